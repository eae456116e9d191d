"""The dependency direction ARCHITECTURE.md writes down ("Layers"), checked
on the source: no module imports a layer above its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

PACKAGE = Path(__file__).resolve().parent.parent / "rendezvous"

# module (dotted, without the "rendezvous." prefix) -> layer rank; a longer
# prefix wins. The same order as ARCHITECTURE.md's table.
LAYERS = {
    "v1": 0, "fields": 0,
    "errors": 1, "keys": 1, "table": 1, "tensors": 1, "wire": 1, "frames": 1, "buffers": 1,
    "config": 1, "cluster": 1, "devices": 1, "fakegpu": 1, "stats": 1, "shm": 1, "localwire": 1, "auth": 1,
    "lifecycle": 1,
    "transport": 2, "mpi": 2,
    "rpc": 3, "rpc.options": 1,  # names and options: below everything that opens a channel
    "aio": 4, "sync": 4, "launch": 4,
    "daemon": 5,
    "client": 5,
    "cli": 6, "__main__": 6, "bench": 6, "__init__": 6,
}
# Imports made inside a function on purpose (optional or heavy parts, loaded
# only when used) are still imports: they are checked too.


def _layer(module: str) -> int:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        rank = LAYERS.get(".".join(parts[:n]))
        if rank is not None:
            return rank
    raise AssertionError(f"rendezvous.{module} is in no layer: add it to LAYERS and ARCHITECTURE.md")


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out.append((".".join(parts), path))
    return out


def _imports(module: str, path: Path) -> set[str]:
    """The rendezvous modules ``module`` imports (without the prefix)."""
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
            if any((PACKAGE / Path(*target.split("."))).with_suffix(s).exists() or
                   (PACKAGE / Path(*target.split("."))).is_dir() for s in (".py",)):
                found.add(target)
    return found


@pytest.mark.parametrize("module,path", _modules(), ids=[m for m, _ in _modules()])
def test_no_module_imports_a_layer_above_its_own(module, path):
    if module == "__init__":
        return  # the package's front door re-exports the public API
    mine = _layer(module)
    above = sorted(t for t in _imports(module, path) if _layer(t) > mine)
    assert not above, f"rendezvous.{module} (layer {mine}) imports {above}, which sit above it"


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    """The check can fail: a core module importing the rank server is caught."""
    fake = tmp_path / "keys.py"
    fake.write_text("from .aio import Server\nfrom rendezvous.rpc import peer\n")
    assert _imports("keys", fake) == {"aio", "rpc", "rpc.peer"}
    assert _layer("aio") > _layer("keys") and _layer("rpc.peer") > _layer("keys")


def test_the_local_client_never_imports_mpi():
    for module, path in _modules():
        if module.startswith("client"):
            assert not any(t.startswith("mpi") for t in _imports(module, path)), module
            assert "mpi4py" not in path.read_text(), module
