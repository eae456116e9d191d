"""The size budget of ``rendezvous/``, as tools/budget.toml writes it.

A module may have at most 450 lines, a class 300 and a function 60 (the
limits are in the file). What is over budget today is listed there with its
size as its cap and why; anything else over budget fails, a listed entry may
not grow past its cap, and an entry that is gone or back within budget must
be taken off, so the list only shrinks as code is split.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "rendezvous"
BUDGET = ROOT / "tools" / "budget.toml"
GENERATED = "v1"  # rendezvous/v1/: generated from protos/
KINDS = ("module", "class", "function")

#: (path under the package, kind, name) -> lines; the name of a module is ""
Sizes = dict[tuple[str, str, str], int]
#: the same key -> (cap, why)
Listed = dict[tuple[str, str, str], tuple[int, str]]


def _definitions(node: ast.AST, prefix: str = "") -> Iterator[tuple[str, str, int]]:
    """(kind, dotted name, lines from its def/class line to its last) of every class
    and function under ``node``; methods as ``Class.method``, nested as ``outer.inner``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}{child.name}"
            kind = "class" if isinstance(child, ast.ClassDef) else "function"
            yield kind, name, child.end_lineno - child.lineno + 1
            yield from _definitions(child, f"{name}.")
        else:
            yield from _definitions(child, prefix)


def measure(package: Path = PACKAGE) -> Sizes:
    """The size of every module, class and function of ``package``, the generated code left out."""
    sizes: Sizes = {}
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package)
        if where.parts[0] == GENERATED:
            continue
        text = path.read_text()
        sizes[(where.as_posix(), "module", "")] = len(text.splitlines())
        for kind, name, lines in _definitions(ast.parse(text, str(path))):
            key = (where.as_posix(), kind, name)
            sizes[key] = max(lines, sizes.get(key, 0))  # a property's getter and setter share a name
    return sizes


def _entry(value: object, what: str) -> tuple[int, str]:
    if not (isinstance(value, dict) and set(value) == {"lines", "why"} and isinstance(value["lines"], int)
            and isinstance(value["why"], str) and value["why"].strip()):
        raise ValueError(f"{what}: want {{ lines = <its size today>, why = \"<why it is that large>\" }}, "
                         f"got {value!r}")
    return value["lines"], value["why"]


def load(text: str) -> tuple[dict[str, int], Listed]:
    """(limits by kind, listed entries) from the budget file's text; ValueError
    naming what is malformed (an unknown kind, an entry without its reason)."""
    doc = tomllib.loads(text)
    limits = doc.pop("limits", None)
    if not (isinstance(limits, dict) and set(limits) == set(KINDS)
            and all(isinstance(v, int) for v in limits.values())):
        raise ValueError(f"[limits] must give {', '.join(KINDS)} as numbers, got {limits!r}")
    listed: Listed = {}
    for module, table in doc.items():
        unknown = set(table) - set(KINDS)
        if unknown or not module.endswith(".py"):
            raise ValueError(f"[{module!r}]: a module's path ends in .py and holds only {KINDS}; "
                             f"got {sorted(unknown) or module}")
        if "module" in table:
            listed[(module, "module", "")] = _entry(table["module"], f"{module} module")
        for kind in ("class", "function"):
            for name, value in table.get(kind, {}).items():
                listed[(module, kind, name)] = _entry(value, f"{module} {kind} {name}")
    return limits, listed


def _name(key: tuple[str, str, str]) -> str:
    module, kind, name = key
    return f"rendezvous/{module}" if kind == "module" else f"rendezvous/{module}: {kind} {name}"


def problems(sizes: Sizes, limits: dict[str, int], listed: Listed) -> list[str]:
    """What breaks the budget: sizes over it and not listed, listed entries grown
    past their caps, and listed entries that are gone or within budget now."""
    found = []
    for key, lines in sorted(sizes.items()):
        limit = limits[key[1]]
        if lines <= limit:
            continue
        if key not in listed:
            found.append(f"{_name(key)}: {lines} lines, over the {limit} allowed and not listed")
        elif lines > listed[key][0]:
            found.append(f"{_name(key)}: {lines} lines, grown past its cap of {listed[key][0]}")
    for key in sorted(listed):
        if key not in sizes:
            found.append(f"{_name(key)}: listed, but there is no such {key[1]} any more: remove its entry")
        elif sizes[key] <= limits[key[1]]:
            found.append(f"{_name(key)}: {sizes[key]} lines, within budget now: remove its entry")
    return found


def test_the_package_keeps_its_size_budget():
    found = problems(measure(), *load(BUDGET.read_text()))
    assert not found, f"{BUDGET.relative_to(ROOT)}:\n  " + "\n  ".join(found)


def test_the_budget_check_fails_on_what_breaks_the_budget(tmp_path):
    """The check can fail: on a module, a class and a method over budget and not
    listed, on a listed one grown past its cap, and on entries for code that is
    gone or small again; the same code listed at its size passes."""
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "generated.py").write_text("x = 1\n" * 50)  # generated: never counted
    body = "\n".join(f"        x{i} = {i}" for i in range(5))
    (tmp_path / "big.py").write_text(f'"""A module."""\n\n\nclass Big:\n    def long(self):\n{body}\n\n'
                                     f"    def short(self):\n        pass\n\n\ndef small():\n    pass\n")
    sizes = measure(tmp_path)
    assert sizes[("big.py", "module", "")] == 17 and sizes[("big.py", "class", "Big")] == 10
    assert sizes[("big.py", "function", "Big.long")] == 6 and ("v1/generated.py", "module", "") not in sizes
    limits = {"module": 10, "class": 5, "function": 3}

    def listing(module: int = 17, cls: int = 10, method: int = 6, extra: str = "") -> Listed:
        text = (f'[limits]\nmodule = 10\nclass = 5\nfunction = 3\n\n["big.py"]\n'
                f'module = {{ lines = {module}, why = "a test" }}\nclass.Big = {{ lines = {cls}, why = "a test" }}\n'
                f'function."Big.long" = {{ lines = {method}, why = "a test" }}\n{extra}')
        loaded_limits, listed = load(text)
        assert loaded_limits == limits
        return listed

    assert problems(sizes, limits, listing()) == []
    unlisted = problems(sizes, limits, {})
    assert len(unlisted) == 3 and all("not listed" in p for p in unlisted), unlisted
    assert problems(sizes, limits, listing(method=5)) == [
        "rendezvous/big.py: function Big.long: 6 lines, grown past its cap of 5"]
    assert problems(sizes, limits, listing(extra='function.gone = { lines = 70, why = "a test" }\n')) == [
        "rendezvous/big.py: function gone: listed, but there is no such function any more: remove its entry"]
    assert problems(sizes, limits, listing(extra='function.small = { lines = 70, why = "a test" }\n')) == [
        "rendezvous/big.py: function small: 2 lines, within budget now: remove its entry"]
    assert problems(sizes, limits, listing(module=20)) == []  # shrunk, still over: its cap stays


def test_a_malformed_budget_file_is_refused():
    good = '[limits]\nmodule = 450\nclass = 300\nfunction = 60\n\n'
    for bad in ('["a.py"]\nclas.X = { lines = 400, why = "x" }\n',  # a misspelt kind
                '["a.py"]\nclass.X = { lines = 400 }\n',  # no reason
                '["a.py"]\nclass.X = { lines = 400, why = " " }\n',  # an empty one
                '["a"]\nmodule = { lines = 500, why = "x" }\n'):  # not a module's path
        with pytest.raises(ValueError):
            load(good + bad)
    with pytest.raises(ValueError):
        load('["a.py"]\nmodule = { lines = 500, why = "x" }\n')  # no limits
    assert load(BUDGET.read_text())[0] == {"module": 450, "class": 300, "function": 60}
