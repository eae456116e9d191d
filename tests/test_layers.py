"""The layers ARCHITECTURE.md writes down, checked on the source as written there.

The table under "Layers" in ARCHITECTURE.md says which modules form each
layer and which layers each may import; this test parses that very table,
so the document and the code cannot drift apart: every module must belong
to a layer, and every import of a ``rendezvous`` module must go to a layer
its row allows. Within and across layers the modules have an order: no
module imports, even inside a function, one that imports it back.

Below the table's rules, this file holds the rules the table does not
state: which third-party packages each layer may import, and that no module
takes names from the package root (``rendezvous/__init__.py`` is the public
face, built from the modules, not a place the modules reach back into).

``python tests/test_layers.py`` prints the modules of each layer in their order.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from graphlib import TopologicalSorter
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "rendezvous"
DOC = ROOT / "ARCHITECTURE.md"
MARKER = "<!-- layers: read by tests/test_layers.py -->"


def parse_layers(text: str) -> tuple[dict[str, str], dict[str, set[str] | None]]:
    """(module prefix -> layer, layer -> the layers it may import, None: anything)
    from the table after MARKER."""
    lines = text[text.index(MARKER):].splitlines()[1:]
    owners: dict[str, str] = {}
    allowed: dict[str, set[str] | None] = {}
    for line in lines[2:]:  # after the header and its rule
        if not line.startswith("|"):
            break
        layer, where, may = (cell.strip() for cell in line.strip("|").split("|"))
        for module in re.findall(r"`([^`]+)`", where):
            assert module not in owners, f"{module} is in two layers"
            owners[module] = layer
        allowed[layer] = None if may == "anything" else {m.strip() for m in may.split(",")}
    for layer, may in allowed.items():
        unknown = (may or set()) - set(allowed)
        assert not unknown, f"layer {layer!r} may import {unknown}, which are not layers"
    return owners, allowed


OWNERS, ALLOWED = parse_layers(DOC.read_text())
PROGRAMS = "programs"


def layer_of(module: str, owners: dict[str, str] = OWNERS) -> str:
    """The layer of ``module`` (dotted, without ``rendezvous.``): its longest listed prefix."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        layer = owners.get(".".join(parts[:n]))
        if layer is not None:
            return layer
    raise AssertionError(f"rendezvous.{module} is in no layer: add it to ARCHITECTURE.md's table")


# ---------------------------------------------------------------- reading the source

def _modules(package: Path = PACKAGE) -> list[tuple[str, Path]]:
    """(dotted name without ``rendezvous.``, file) of every module; a subpackage's
    ``__init__.py`` is the module named by the subpackage."""
    out = []
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out.append((".".join(parts), path))
    return out


def _is_module(target: str, package: Path = PACKAGE) -> bool:
    """Whether ``rendezvous.<target>`` is a module or a package (a folder) of the source."""
    where = package / Path(*target.split("."))
    return where.with_suffix(".py").exists() or where.is_dir()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
           (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(node: ast.AST, in_function: bool = False,
                  for_typing: bool = False) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
    """Every import statement under ``node`` with (inside a function, only for type checking)."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node, in_function, for_typing
    elif isinstance(node, ast.If) and _is_type_checking(node.test):
        for child in node.body:
            yield from _import_nodes(child, in_function, True)
        for child in node.orelse:
            yield from _import_nodes(child, in_function, for_typing)
    else:
        inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for child in ast.iter_child_nodes(node):
            yield from _import_nodes(child, inside, for_typing)


def _package_of(module: str, path: Path) -> list[str]:
    return module.split(".") if path.name == "__init__.py" and module != "__init__" else module.split(".")[:-1]


def _absolute(node: ast.ImportFrom, package: list[str]) -> str:
    """The module a ``from ... import`` reads from, dotted and absolute."""
    if not node.level:
        return node.module or ""
    base = package[:len(package) - node.level + 1] if node.level > 1 else package
    return ".".join(["rendezvous", *base, *([node.module] if node.module else [])])


def import_sites(module: str, path: Path, package: Path = PACKAGE,
                 typing: bool = True) -> list[tuple[str, int, bool]]:
    """(rendezvous module imported, without the prefix; line; inside a function) for each
    import of a ``rendezvous`` module in ``path``, functions' imports included: an
    import made late on purpose is still an import. ``from P import a`` names ``P``
    only where ``a`` is a name of P's rather than its submodule. With ``typing``
    False, imports made only for type checking are left out."""
    tree = ast.parse(path.read_text(), str(path))
    mine = _package_of(module, path)
    found = []
    for node, in_function, for_typing in _import_nodes(tree):
        if for_typing and not typing:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            prefix = _absolute(node, mine)
            subs = [f"{prefix}.{a.name}" for a in node.names]
            takes_names = any(not _is_module(sub[len("rendezvous."):], package) for sub in subs)
            names = subs + [prefix] if takes_names else subs
        for name in names:
            if name == "rendezvous" or not name.startswith("rendezvous."):
                continue
            target = name[len("rendezvous."):]
            if _is_module(target, package):
                found.append((target, node.lineno, in_function))
    return found


def _imports(module: str, path: Path, package: Path = PACKAGE, typing: bool = True) -> set[str]:
    """The rendezvous modules ``module`` imports (without the prefix)."""
    return {target for target, _, _ in import_sites(module, path, package, typing)}


# ---------------------------------------------------------------- the table's rules

def violations(module: str, path: Path, owners=OWNERS, allowed=ALLOWED) -> list[str]:
    mine = layer_of(module, owners)
    may = allowed[mine]
    if may is None:
        return []
    return sorted(f"{t} ({layer_of(t, owners)})" for t in _imports(module, path) if layer_of(t, owners) not in may)


@pytest.mark.parametrize("module,path", _modules(), ids=[m for m, _ in _modules()])
def test_each_module_imports_only_what_its_layer_may(module, path):
    found = violations(module, path)
    assert not found, f"rendezvous.{module} ({layer_of(module)}) imports {found}, which its layer may not"


def test_the_check_fails_when_a_rule_is_broken(tmp_path):
    """The check can fail: a core module importing the rank server, the daemon
    importing the client, and the client importing MPI are each caught, by the
    rules as the document states them."""
    for module, source in (("keys", "from .aio import Server\nfrom rendezvous.rpc import peer\n"),
                           ("daemon.daemon", "from rendezvous.client.blocking import Client\n"),
                           ("client.core", "from rendezvous.mpi import world\n"),
                           ("rpc.peer", "from rendezvous.mpi.plane import MpiPlane\n")):
        fake = tmp_path / f"{module.replace('.', '_')}.py"
        fake.write_text(source)
        assert violations(module, fake), f"{module} importing {source!r} went unnoticed"


def test_a_row_changed_in_the_document_changes_the_rule(tmp_path):
    """The rules come from the document: with the daemon allowed to import the
    local client, the daemon importing it passes; as written, it does not."""
    text = DOC.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| node daemon |"))
    loosened = text.replace(row, row.rstrip(" |") + ", local client |")
    owners, allowed = parse_layers(loosened)
    fake = tmp_path / "daemon.py"
    fake.write_text("from rendezvous.client.blocking import Client\n")
    assert violations("daemon.daemon", fake) and not violations("daemon.daemon", fake, owners, allowed)


def test_the_local_client_never_imports_mpi():
    for module, path in _modules():
        if module.startswith("client"):
            assert not any(t.startswith("mpi") for t in _imports(module, path)), module
            assert "mpi4py" not in path.read_text(), module


# ---------------------------------------------------------------- an order, no cycles

def import_graph(package: Path = PACKAGE) -> dict[str, dict[str, tuple[int, bool]]]:
    """module -> {module it imports: (line, inside a function)}, for the imports that
    run (at the top or in a function; those made only for type checking left out:
    they load nothing). A namespace folder without ``__init__.py`` is no module."""
    modules = dict(_modules(package))
    graph: dict[str, dict[str, tuple[int, bool]]] = {}
    for module, path in modules.items():
        edges: dict[str, tuple[int, bool]] = {}
        for target, line, in_function in import_sites(module, path, package, typing=False):
            if target in modules and target != module:
                edges.setdefault(target, (line, in_function))
        graph[module] = edges
    return graph


def strongly_connected(graph: dict[str, dict[str, tuple[int, bool]]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or not (Tarjan's
    algorithm, without recursion); a module in no cycle is a group of one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    groups.append(sorted(group))
    return groups


def _shortest_cycle(graph: dict[str, dict[str, tuple[int, bool]]], group: list[str]) -> list[str]:
    """The fewest imports that lead from the group's first module back to it."""
    members, start = set(group), group[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node]):
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if target in members and target not in came_from:
                    came_from[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"{group} holds no cycle")


def cycles(graph: dict[str, dict[str, tuple[int, bool]]]) -> list[list[str]]:
    """One cycle (``a, b, ..., a``) through each group of modules that import each other."""
    return [_shortest_cycle(graph, group) for group in strongly_connected(graph) if len(group) > 1]


def import_order(graph: dict[str, dict[str, tuple[int, bool]]]) -> list[list[str]]:
    """The modules in an order where each comes after every module it imports; the
    modules of a cycle, which have no such order, stand together as one entry."""
    groups = strongly_connected(graph)
    group_of = {member: i for i, group in enumerate(groups) for member in group}
    sorter = TopologicalSorter({i: {group_of[t] for m in group for t in graph[m]} - {i}
                                for i, group in enumerate(groups)})
    return [groups[i] for i in sorter.static_order()]


def describe_order(graph: dict[str, dict[str, tuple[int, bool]]], owners: dict[str, str] = OWNERS) -> str:
    """The order, one line per layer; a cycle's modules in brackets."""
    by_layer: dict[str, list[str]] = {layer: [] for layer in owners.values()}  # the table's order
    for group in import_order(graph):
        name = group[0] if len(group) == 1 else f"[{' '.join(group)}]"
        by_layer.setdefault(layer_of(group[0], owners), []).append(name)
    return "\n".join(f"  {layer}: {', '.join(names)}" for layer, names in by_layer.items() if names)


def cycle_report(graph: dict[str, dict[str, tuple[int, bool]]], owners: dict[str, str] = OWNERS) -> str:
    """What a reader needs to break each cycle (every import on it, where it is),
    then the order of the modules as they stand; empty when there is no cycle."""
    found = cycles(graph)
    if not found:
        return ""
    lines = ["modules that import each other (imports made only for type checking left out):"]
    for cycle in found:
        lines.append("  " + " -> ".join(cycle))
        for a, b in zip(cycle, cycle[1:]):
            line, in_function = graph[a][b]
            lines.append(f"    rendezvous.{a}, line {line}: imports rendezvous.{b}"
                         f"{' (inside a function)' if in_function else ''}")
    lines.append("the order, each module after those it imports, by layer (a cycle in brackets):")
    lines.append(describe_order(graph, owners))
    return "\n".join(lines)


def test_no_module_imports_one_that_imports_it_back():
    """Within a layer and across layers the modules have an order: follow the
    imports that run (in functions too) and nothing leads back."""
    report = cycle_report(import_graph())
    assert not report, report


def test_the_cycle_check_finds_a_cycle_made_in_a_function(tmp_path):
    """The check can fail: two modules importing each other, one of them only
    inside a function, are reported with both lines and the order of the rest;
    an import made only for type checking closes no cycle."""
    for name, source in {
        "__init__.py": "",
        "first.py": "def late():\n    from . import second\n",
        "second.py": "from rendezvous.first import late\nfrom rendezvous import third\n",
        "third.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rendezvous.second import x\n",
    }.items():
        (tmp_path / name).write_text(source)
    owners = {"__init__": "public API", "first": "core", "second": "core", "third": "core"}
    graph = import_graph(tmp_path)
    assert graph["first"] == {"second": (2, True)} and graph["third"] == {}
    assert cycles(graph) == [["first", "second", "first"]]
    report = cycle_report(graph, owners)
    assert "first -> second -> first" in report and "line 2: imports rendezvous.second (inside a function)" in report
    assert "core: third, [first second]" in report

    (tmp_path / "first.py").write_text("def late():\n    from . import third\n")
    graph = import_graph(tmp_path)
    assert cycles(graph) == [] and cycle_report(graph, owners) == ""
    order = [group[0] for group in import_order(graph)]
    assert order.index("third") < order.index("first") and order.index("first") < order.index("second")


# ---------------------------------------------------------------- third-party packages

AT_IMPORT = "at import"  # anywhere in the module
IN_FUNCTIONS = "in functions"  # only inside a function (or for type checking): importing the module loads nothing

#: The third-party packages (top-level import names; ``google`` is protobuf) each
#: layer may import, and where. The standard library is always allowed. This is
#: today's use, kept as the rule: a new dependency of a layer is a decision made here.
THIRD_PARTY: dict[str, dict[str, str]] = {
    "wire contract": {"google": AT_IMPORT, "grpc": AT_IMPORT},  # generated messages and service stubs
    "core": {"numpy": AT_IMPORT, "google": AT_IMPORT,
             "ml_dtypes": IN_FUNCTIONS,  # bfloat16, an optional extra
             "uvloop": IN_FUNCTIONS},  # the event loop, where installed
    "local protocol": {"numpy": AT_IMPORT, "google": AT_IMPORT},
    "data-plane contract": {},
    "MPI": {"numpy": AT_IMPORT, "google": AT_IMPORT,
            "mpi4py": IN_FUNCTIONS},  # loaded when the MPI half starts, never with MPI_DISABLED=1
    "CUDA IPC": {"google": AT_IMPORT},
    "control plane": {"numpy": AT_IMPORT, "google": AT_IMPORT, "grpc": AT_IMPORT, "grpc_health": AT_IMPORT},
    "rank server": {"numpy": AT_IMPORT, "grpc": AT_IMPORT},
    "node daemon": {"numpy": AT_IMPORT, "google": AT_IMPORT, "grpc": AT_IMPORT,
                    # the daemon extra: health, reflection, metrics, JSON logs
                    "grpc_health": IN_FUNCTIONS, "grpc_reflection": IN_FUNCTIONS,
                    "prometheus_client": IN_FUNCTIONS, "pythonjsonlogger": IN_FUNCTIONS},
    "local client": {"numpy": AT_IMPORT, "grpc": AT_IMPORT},
    "public API": {},
    PROGRAMS: {"numpy": AT_IMPORT,
               **{name: IN_FUNCTIONS for name in ("google", "grpc", "grpc_health", "mpi4py", "cupy", "torch",
                                                  "matplotlib", "rich")}},
}

#: What one module (or package) of a layer may import beyond its layer's row:
#: the GPU library where the GPU code lives, a framework where tensors are handed to it.
THIRD_PARTY_MODULES: dict[str, dict[str, str]] = {
    "devices.cupy_backend": {"cupy": IN_FUNCTIONS},
    "interop": {"torch": IN_FUNCTIONS},
}

#: Where today's code imports what its layer's words rule out ("the core knows no
#: transport"), each with why; an entry that is no longer true must go.
THIRD_PARTY_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("errors", "grpc"): "each error carries its grpc.StatusCode, and the code <-> error mapping lives here",
    ("auth", "grpc"): "builds gRPC's TLS credentials and the token interceptor for every server and channel",
    ("local.messages", "grpc"): "error_from turns a failed gRPC call to the daemon into the package's error",
    ("rank.bootstrap", "torch"): "under torchrun the addresses go through torch's TCPStore (imported only there)",
}


def third_party_imports(path: Path) -> list[tuple[str, int, bool]]:
    """(top-level package, line, inside a function or for type checking only) of each
    import in ``path`` of something neither standard library nor this package."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node, in_function, for_typing in _import_nodes(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            continue
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        for name in names:
            top = name.split(".")[0]
            if top and top != "rendezvous" and top not in sys.stdlib_module_names:
                found.append((top, node.lineno, in_function or for_typing))
    return found


def third_party_violations(module: str, path: Path, owners: dict[str, str] = OWNERS,
                           layers: dict[str, dict[str, str]] = THIRD_PARTY,
                           modules: dict[str, dict[str, str]] = THIRD_PARTY_MODULES,
                           exceptions: dict[tuple[str, str], str] = THIRD_PARTY_EXCEPTIONS) -> list[str]:
    """The imports of ``path`` its layer's row, its own entry and the exceptions do not allow."""
    may = dict(layers[layer_of(module, owners)])
    parts = module.split(".")
    for n in range(1, len(parts) + 1):
        may.update(modules.get(".".join(parts[:n]), {}))
    wrong = []
    for package, line, lazy in third_party_imports(path):
        if (module, package) in exceptions:
            continue
        where = may.get(package)
        if where is None:
            wrong.append(f"line {line}: {package}, which {layer_of(module, owners)} may not import")
        elif where == IN_FUNCTIONS and not lazy:
            wrong.append(f"line {line}: {package} at import, where it may only be imported inside a function")
    return wrong


def test_every_layer_has_a_row_of_third_party_packages():
    assert set(THIRD_PARTY) == set(ALLOWED), (set(THIRD_PARTY) ^ set(ALLOWED))
    for module in THIRD_PARTY_MODULES:
        layer_of(module)  # a module the table knows


def test_each_layer_imports_only_its_third_party_packages():
    found = {f"rendezvous.{m} ({layer_of(m)})": wrong for m, path in _modules()
             if (wrong := third_party_violations(m, path))}
    assert not found, "\n".join(f"{m}: {'; '.join(w)}" for m, w in found.items())


def test_each_third_party_exception_is_still_needed():
    """The exceptions only shrink: one whose import is gone is taken off the list."""
    modules = dict(_modules())
    stale = [f"{module}: {package}" for module, package in THIRD_PARTY_EXCEPTIONS
             if module not in modules or package not in {p for p, _, _ in third_party_imports(modules[module])}]
    assert not stale, f"no longer imported, remove from THIRD_PARTY_EXCEPTIONS: {stale}"


def test_the_third_party_check_fails_when_a_rule_is_broken(tmp_path):
    """The check can fail: mpi4py outside the MPI layer, torch at import even where
    it may be imported, cupy in a module that is not GPU code, matplotlib at import
    in a program; grpc in the core passes only as its listed exception."""
    for module, source in (("keys", "import mpi4py\n"),
                           ("client.core", "def f():\n    from mpi4py import MPI\n"),
                           ("interop", "import torch\n"),
                           ("codec.tensors", "def f():\n    import cupy\n"),
                           ("rank.server", "def f():\n    import torch\n"),
                           ("bench.report", "import matplotlib.pyplot as plt\n"),
                           ("transport", "import numpy\n")):
        fake = tmp_path / f"{module.replace('.', '_')}.py"
        fake.write_text(source)
        assert third_party_violations(module, fake), f"{module} with {source!r} went unnoticed"
    fake = tmp_path / "fine.py"
    fake.write_text("import os\nimport numpy as np\ndef f():\n    import torch\n")
    assert not third_party_violations("interop", fake) and third_party_violations("codec.dtypes", fake)
    fake.write_text("import grpc\n")
    assert not third_party_violations("errors", fake) and third_party_violations("errors", fake, exceptions={})


# ---------------------------------------------------------------- the package root

def root_names(module: str, path: Path, package: Path = PACKAGE) -> list[str]:
    """Where ``path`` takes a name from the package root (``from rendezvous import
    Server``, ``from .. import Server`` reaching it, ``rendezvous.Server`` after
    ``import rendezvous``) rather than from the module that defines it. Submodules
    (``from rendezvous import codec``) are modules, not the root's names."""
    tree = ast.parse(path.read_text(), str(path))
    mine = _package_of(module, path)
    bound: set[str] = set()  # local names for the root package
    found = []
    for node, _, _ in _import_nodes(tree):
        if isinstance(node, ast.ImportFrom):
            if _absolute(node, mine) == "rendezvous":
                found += [f"line {node.lineno}: {a.name}" for a in node.names if not _is_module(a.name, package)]
        else:
            for a in node.names:
                if a.name == "rendezvous" or (a.name.startswith("rendezvous.") and a.asname is None):
                    bound.add(a.asname or "rendezvous")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                and not _is_module(node.attr, package)):
            found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_module_takes_names_from_the_package_root():
    """Inside the package a name comes from its own module; only the root itself
    and the programs (which use the package as its users do) may use the root's."""
    found = {f"rendezvous.{m}": names for m, path in _modules()
             if m != "__init__" and layer_of(m) != PROGRAMS and (names := root_names(m, path))}
    assert not found, f"names taken from the package root: {found}"


def test_the_root_check_fails_when_a_name_is_taken_from_the_root(tmp_path):
    for module, source in (("keys", "from rendezvous import Server\n"),
                           ("keys", "def f():\n    from rendezvous import codec, Received\n"),
                           ("rank.receiver", "from .. import Server\n"),
                           ("keys", "import rendezvous\nserver = rendezvous.Server\n"),
                           ("keys", "import rendezvous.rank.launch\nx = rendezvous.ClusterSpec\n"),
                           ("keys", "import rendezvous as rv\nx = rv.Config\n"),
                           ("keys", "from rendezvous import *\n")):
        fake = tmp_path / "fake.py"
        fake.write_text(source)
        assert root_names(module, fake), f"{module} with {source!r} went unnoticed"
    fake = tmp_path / "fake.py"
    fake.write_text("from rendezvous import codec, items\nfrom .. import keys\nimport rendezvous.rank.launch\n"
                    "run = rendezvous.rank.launch.run_local\n")
    assert root_names("rank.receiver", fake) == []


if __name__ == "__main__":
    print(cycle_report(import_graph()) or "the modules of each layer, each after those it imports:\n"
          + describe_order(import_graph()))


# ---------------------------------------------------------------- class names

#: names two classes of the package share on purpose: the blocking and the
#: asyncio form of one public class (as grpc and grpc.aio do)
SHARED_CLASS_NAMES = {"Client", "Server"}
#: duplicates still to be renamed; the list only shrinks
DUPLICATE_CLASS_NAMES_LEFT: set[str] = set()


def duplicate_class_names(paths) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(str(path.relative_to(PACKAGE)))
    return {name: where for name, where in found.items() if len(where) > 1}


def test_class_names_are_unique_but_for_those_listed():
    paths = [p for _, p in _modules() if "v1" not in p.relative_to(PACKAGE).parts]
    dupes = duplicate_class_names(paths)
    unlisted = set(dupes) - SHARED_CLASS_NAMES - DUPLICATE_CLASS_NAMES_LEFT
    assert not unlisted, {n: dupes[n] for n in unlisted}
    fixed = DUPLICATE_CLASS_NAMES_LEFT - set(dupes)
    assert not fixed, f"no longer duplicated, remove from DUPLICATE_CLASS_NAMES_LEFT: {sorted(fixed)}"


def test_the_class_name_check_finds_a_duplicate(tmp_path):
    (tmp_path / "a.py").write_text("class Thing:\n    pass\n")
    (tmp_path / "b.py").write_text("class Thing:\n    pass\nclass Other:\n    pass\n")
    global PACKAGE
    real, PACKAGE = PACKAGE, tmp_path
    try:
        assert duplicate_class_names(sorted(tmp_path.glob("*.py"))) == {"Thing": ["a.py", "b.py"]}
    finally:
        PACKAGE = real
