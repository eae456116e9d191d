"""ARCHITECTURE.md and BENCHMARKS.md checked against the code and the tree.

ARCHITECTURE.md is a map of the code (docs/architecture-notes.md its longer
notes), so every name they write in backticks that looks like code must be
in the code:

- a dotted name (``Class.member``, ``module.name``, ``module.Class.member``,
  with or without the ``rendezvous.`` prefix and call arguments) must resolve:
  a class is any class defined in ``rendezvous/`` (its stubs included, for
  the generated messages), a member is a method, a name assigned in the class
  body, an attribute assigned as ``self.X`` in a method, or a nested class,
  its bases' included; a module may be named by its last part (``kept`` is
  ``rendezvous/rank/kept.py``), and a name a module imports counts as its own;
- a bare class name (``PeerClient``) must be a class in ``rendezvous/``, a name
  in the ``.proto`` files, or one of the few foreign names listed below;
- a path (``rank/kept.py``, ``rendezvous/mpi/``, ``tests/racing.py``,
  ``test_mpi.py::test_x``) must exist, relative to the repository or to the
  package, and a bare file name must name a file somewhere in the product;
- every module of ``rendezvous/`` is named by its path.

ARCHITECTURE.md states no measured figure (those are BENCHMARKS.md's), and
ARCHITECTURE.md and BENCHMARKS.md stay within their size and link only to
files that exist. Each check is a function that returns what it found
wrong, so the tests below also show it failing on a made-up text.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "rendezvous"
ARCHITECTURE = ROOT / "ARCHITECTURE.md"
BENCHMARKS = ROOT / "BENCHMARKS.md"
NOTES = ROOT / "docs" / "architecture-notes.md"
#: the most lines each document may have
SIZE_LIMITS = {ARCHITECTURE: 520, BENCHMARKS: 420}
#: the folders whose files a bare file name may mean
PRODUCT_DIRS = ("rendezvous", "tests", "tools", "protos", "deploy", "examples", "server", "client", "benchmarks")
#: first parts of dotted names that belong to other libraries
FOREIGN_ROOTS = {"asyncio", "grpc", "numpy", "os", "threading", "weakref", "MPI", "torch", "cupy", "socket", "signal"}
#: bare CamelCase names that belong to other libraries (MPI's calls, protobuf's Any)
FOREIGN_NAMES = {"Any", "Testsome", "Isend", "Irecv", "Iprobe", "Improbe", "Imrecv", "Dup", "Send", "Recv"}
#: file name endings that make a backticked span a path
PATH_SUFFIXES = (".py", ".md", ".proto", ".json", ".service", ".toml", ".png", ".yaml", ".sh")

DOTTED = re.compile(r"(?:[A-Za-z_]\w*\.)+[A-Za-z_]\w*")
CAMEL = re.compile(r"_?[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*")


# ---------------------------------------------------------------- the code

class ClassInfo:
    def __init__(self, node: ast.ClassDef, module: str):
        self.name, self.module = node.name, module
        self.bases = [ast.unparse(b).split(".")[-1] for b in node.bases]
        self.nested = {n.name: ClassInfo(n, module) for n in node.body if isinstance(n, ast.ClassDef)}
        self.own: set[str] = set(self.nested)
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.own.add(item.name)
            elif isinstance(item, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                self.own.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        for sub in ast.walk(node):  # self.X = ... in any method
            if (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
                    and isinstance(sub.value, ast.Name) and sub.value.id == "self"):
                self.own.add(sub.attr)


class ModuleInfo:
    def __init__(self, name: str, tree: ast.Module):
        self.name = name
        self.classes: dict[str, ClassInfo] = {}
        self.names: set[str] = set()
        self.imports: dict[str, tuple[str, str]] = {}  # local name -> (absolute module, name there)
        package = name.split(".") if name.endswith("__init__") else name.split(".")[:-1]
        package = [p for p in package if p != "__init__"]
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                self.classes[node.name] = ClassInfo(node, name)
                self.names.add(node.name)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                self.names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[:len(package) - node.level + 1]
                    source = ".".join(["rendezvous", *base, *([node.module] if node.module else [])])
                else:
                    source = node.module or ""
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = (source, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    self.imports[alias.asname or alias.name.split(".")[0]] = (alias.name, "")


class Code:
    """Every module and class of the package, read with ast (nothing imported)."""

    def __init__(self, package: Path = PACKAGE):
        self.modules: dict[str, ModuleInfo] = {}  # dotted, without "rendezvous.", packages as "x.__init__"
        for path in sorted(package.rglob("*.py*")):
            if path.suffix not in (".py", ".pyi") or "__pycache__" in path.parts:
                continue
            name = ".".join(path.relative_to(package).with_suffix("").parts)
            info = ModuleInfo(name, ast.parse(path.read_text(), str(path)))
            if name in self.modules:  # a stub beside its module: one module with both's names
                self.modules[name].classes.update(info.classes)
                self.modules[name].names |= info.names
            else:
                self.modules[name] = info
        self.classes: dict[str, list[ClassInfo]] = {}
        for module in self.modules.values():
            for cls in module.classes.values():
                self.classes.setdefault(cls.name, []).append(cls)

    def modules_named(self, dotted: str) -> list[ModuleInfo]:
        """The modules ``dotted`` may mean: the exact name, a package, or the last parts of a longer name."""
        found = []
        for name, module in self.modules.items():
            bare = name.removesuffix(".__init__")
            if bare == dotted or bare.endswith("." + dotted) or (dotted == "rendezvous" and name == "__init__"):
                found.append(module)
        return found

    def members(self, cls: ClassInfo, seen: frozenset[int] = frozenset()) -> set[str]:
        out = set(cls.own)
        for base in cls.bases:
            for parent in self.classes.get(base, []):
                if id(parent) not in seen:
                    out |= self.members(parent, seen | {id(cls)})
        return out

    def in_class(self, cls: ClassInfo, rest: list[str]) -> bool:
        if not rest:
            return True
        if rest[0] in cls.nested:
            return self.in_class(cls.nested[rest[0]], rest[1:])
        return len(rest) == 1 and rest[0] in self.members(cls)

    def in_module(self, module: ModuleInfo, rest: list[str], depth: int = 0) -> bool:
        if not rest:
            return True
        head, tail = rest[0], rest[1:]
        if head in module.classes:
            return self.in_class(module.classes[head], tail)
        if head in module.names:
            return not tail
        if head in module.imports and depth < 5:
            source, original = module.imports[head]
            if not source.startswith("rendezvous"):
                return not tail  # another library's name: only the name itself is checked
            target = source.removeprefix("rendezvous").lstrip(".")
            parts = [original, *tail] if original else tail
            return any(self.in_module(m, parts, depth + 1) for m in self.modules_named(target or "rendezvous"))
        sub = module.name.removesuffix(".__init__") + "." + head
        return any(self.in_module(m, tail, depth + 1) for m in self.modules_named(sub) if m.name.startswith(sub))

    def resolves(self, dotted: str) -> bool:
        parts = dotted.split(".")
        if parts[0] == "rendezvous":
            parts = parts[1:] or ["rendezvous"]
        for n in range(len(parts), 0, -1):
            for module in self.modules_named(".".join(parts[:n])):
                if self.in_module(module, parts[n:]):
                    return True
        return any(self.in_class(cls, parts[1:]) for cls in self.classes.get(parts[0], []))


@cache
def code() -> Code:
    return Code()


@cache
def proto_names() -> frozenset[str]:
    text = "\n".join(p.read_text() for p in (ROOT / "protos").rglob("*.proto"))
    return frozenset(re.findall(r"\b(?:message|service|rpc|enum)\s+(\w+)", text))


@cache
def product_files() -> frozenset[str]:
    """Every file of the product's folders, as a path relative to the repository."""
    return frozenset(p.relative_to(ROOT).as_posix() for d in PRODUCT_DIRS for p in (ROOT / d).rglob("*")
                     if p.is_file() and "__pycache__" not in p.parts)


# ---------------------------------------------------------------- the checks

def code_spans(text: str) -> list[str]:
    """Every inline code span of a Markdown text, fenced blocks left out, line breaks as spaces."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", text)]


def path_exists(span: str) -> bool:
    """A path relative to the repository or the package (a folder ends in /),
    or a bare file name found in the product; ``file::function`` also needs the
    function defined there."""
    path, _, test = span.partition("::")
    if "/" in path:
        found = [f"{prefix}{path}" for prefix in ("", "rendezvous/") if (ROOT / prefix / path).exists()]
    else:
        found = [p for p in product_files() if p.rsplit("/", 1)[-1] == path]
    if not found:
        return False
    if test:  # file::function: the function is defined in one of them
        return any(re.search(rf"^\s*(?:async )?def {re.escape(test)}\(", (ROOT / p).read_text(), re.M)
                   for p in found if p.endswith(".py"))
    return True


def is_path(span: str) -> bool:
    """``x/y``, ``x/``, ``x.py``, ``x.py::test``: what the text names as a file or folder."""
    path = span.split("::")[0]
    return re.fullmatch(r"[\w.-]+(/[\w.-]+)*/?", path) is not None and ("/" in path or path.endswith(PATH_SUFFIXES))


def missing_names(text: str) -> list[str]:
    """The code names and paths a document writes in backticks that do not exist."""
    missing = []
    for span in code_spans(text):
        if is_path(span):
            if not path_exists(span):
                missing.append(span)
            continue
        dotted = DOTTED.match(span)
        if dotted and (dotted.end() == len(span) or span[dotted.end()] == "("):
            name = dotted.group()
            if name.split(".")[0] not in FOREIGN_ROOTS and not code().resolves(name):
                missing.append(span)
        elif CAMEL.fullmatch(name := span.split("(")[0]) and name not in ("None", "True", "False"):
            if name not in code().classes and name not in proto_names() and name not in FOREIGN_NAMES:
                missing.append(span)
    return sorted(set(missing))


def modules_not_named(text: str) -> list[str]:
    """The modules of the package (``__init__`` and the generated ``v1/`` left out) no path in the text names."""
    named = set()
    paths = product_files()
    for span in code_spans(text):
        span = span.split("::")[0]
        if is_path(span) and span.endswith(".py"):
            if "/" in span:
                named.update(p for p in (span, f"rendezvous/{span}") if p in paths)
            else:
                named.update(p for p in paths if p.rsplit("/", 1)[-1] == span)
    wanted = {p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.py")
              if p.name != "__init__.py" and "v1" not in p.relative_to(PACKAGE).parts[:1]
              and "__pycache__" not in p.parts}
    return sorted(wanted - named)


def broken_links(text: str, where: Path) -> list[str]:
    """Relative links of a Markdown text (``[x](target)``) whose file does not exist."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (where.parent / target.split("#")[0]).exists():
            broken.append(target)
    return broken


#: what a measured figure looks like: a rate, a time, a ratio, a share
#: (a product, ``2 × 124``, is arithmetic, not a ratio)
FIGURE = re.compile(r"\d\s*(?:[GMK]B/s|[GMK]iB/s|µs|us\b|ms\b|(?:x\b|×)(?!\s*\d)|%)|\b(?:faster|slower)\b")


def measured_figures(text: str) -> list[str]:
    """The lines of a text that state a measured figure."""
    return [line.strip() for line in text.splitlines() if FIGURE.search(line)]


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


# ---------------------------------------------------------------- the tests

@pytest.mark.parametrize("doc", [ARCHITECTURE, NOTES], ids=lambda p: p.name)
def test_every_code_name_in_the_architecture_exists(doc):
    assert missing_names(doc.read_text()) == []


def test_every_module_is_on_the_map():
    assert modules_not_named(ARCHITECTURE.read_text()) == []


def test_architecture_states_no_measured_figure():
    assert measured_figures(ARCHITECTURE.read_text()) == []


@pytest.mark.parametrize("doc", sorted(SIZE_LIMITS), ids=lambda p: p.name)
def test_documents_stay_within_their_size(doc):
    assert lines(doc) <= SIZE_LIMITS[doc], f"{doc.name} has {lines(doc)} lines, at most {SIZE_LIMITS[doc]}"


@pytest.mark.parametrize("doc", sorted(SIZE_LIMITS), ids=lambda p: p.name)
def test_documents_link_only_to_files_that_exist(doc):
    assert broken_links(doc.read_text(), doc) == []


def test_the_name_check_finds_names_that_do_not_exist():
    """Names that resolve pass; a member, class, module or path that is not
    there is reported, each on its own."""
    good = ("`Kept.hand_over`, `kept.to_table`, `rendezvous.aio.Server`, `aio.Server.recv_item`, "
            "`RetryCache.take_resend`, `local.segments.Mapping`, `LocalRecvManyResponse.failures`, "
            "`PeerClient`, `RecvTensorStream`, `asyncio.timeout`, `rank/kept.py`, `rendezvous/mpi/`, "
            "`tests/racing.py`, `procs.py`, `PinnedPool.give(buf, after=event)`, "
            "`test_mpi.py::test_connections_cut_mid_race_deliver_every_tensor_exactly_once`")
    assert missing_names(good) == []
    bad = ["`aio.Server._place`", "`SessionServer._accept`", "`Kept.no_such_member`", "`kept.no_such_function`",
           "`NoSuchClass`", "`rank/no_such.py`", "`no_such_module.py`", "`test_mpi.py::test_no_such_test`"]
    assert missing_names(" and ".join(bad)) == sorted(b.strip("`") for b in bad)


def test_the_map_check_finds_a_module_left_out():
    text = ARCHITECTURE.read_text()
    assert "`rank/kept.py`" in text
    assert "rendezvous/rank/kept.py" in modules_not_named(text.replace("`rank/kept.py`", "`rank/`"))


def test_the_figure_check_finds_figures():
    made_up = ["the loop polls, which measured 0.7 x the time", "a wake-up costs 100-200 µs",
               "5.4 GB/s on one node", "near 2 % of a core", "3 ms after the last message", "1.5 × raw MPI",
               "it made the step faster"]
    assert measured_figures("\n".join(made_up)) == made_up
    assert measured_figures("a 13-byte header; 1 MiB frames; `keepalive_time`; 1/8 of the pool; 2 × 124") == []


def test_the_size_and_link_checks_can_fail(tmp_path):
    doc = tmp_path / "DOC.md"
    links = "[there](BENCHMARKS.md) [gone](NO_SUCH.md#x) [web](https://example.com) [here](#top)"
    doc.write_text("line\n" * 521 + links + "\n")
    assert lines(doc) > SIZE_LIMITS[ARCHITECTURE]
    (tmp_path / "BENCHMARKS.md").write_text("")
    assert broken_links(doc.read_text(), doc) == ["NO_SUCH.md#x"]
