"""The layers ARCHITECTURE.md writes down, checked on the source as written there.

The table under "Layers" in ARCHITECTURE.md says which modules form each
layer and which layers each may import; this test parses that very table,
so the document and the code cannot drift apart: every module must belong
to a layer, and every import of a ``rendezvous`` module must go to a layer
its row allows.
"""

from __future__ import annotations

import ast
import re
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


def layer_of(module: str, owners: dict[str, str] = OWNERS) -> str:
    """The layer of ``module`` (dotted, without ``rendezvous.``): its longest listed prefix."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        layer = owners.get(".".join(parts[:n]))
        if layer is not None:
            return layer
    raise AssertionError(f"rendezvous.{module} is in no layer: add it to ARCHITECTURE.md's table")


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out.append((".".join(parts), path))
    return out


def _imports(module: str, path: Path) -> set[str]:
    """The rendezvous modules ``module`` imports (without the prefix), functions'
    imports included: an import made late on purpose is still an import."""
    tree = ast.parse(path.read_text(), str(path))
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1] if node.level > 1 else package
                prefix = ".".join(["rendezvous", *base, *([node.module] if node.module else [])])
            else:
                prefix = node.module or ""
            names = [prefix] + [f"{prefix}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name == "rendezvous" or not name.startswith("rendezvous."):
                continue
            target = name[len("rendezvous."):]
            where = PACKAGE / Path(*target.split("."))
            if where.with_suffix(".py").exists() or where.is_dir():
                found.add(target)
    return found


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
