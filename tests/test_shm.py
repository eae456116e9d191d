"""POSIX shared-memory segments for the local hop (rendezvous/shm.py).

Other processes on this machine may have segments in /dev/shm: every test
works under fresh prefixes of its own and asserts only about those names."""

from __future__ import annotations

import gc
import os
import secrets
import subprocess
import sys

import numpy as np
import pytest

from rendezvous import shm
from rendezvous.errors import InvalidArgument, NotFound

pytestmark = [
    pytest.mark.timeout(30),
    pytest.mark.skipif(not shm.available() or not os.path.isdir(shm.SHM_DIR),
                       reason="no POSIX shared memory in /dev/shm"),
]


@pytest.fixture
def prefixes():
    """Fresh prefixes made by ``make(pid=...)``; whatever is left under them is unlinked at the end."""
    made: list[str] = []

    def make(pid: int | None = None) -> str:
        p = shm.new_prefix() if pid is None else f"rdv-{pid}-{secrets.token_hex(6)}-"
        made.append(p)
        return p

    yield make
    for p in made:
        for name in shm.listed(p):
            shm.discard(name)
    for p in made:
        assert shm.listed(p) == [], f"left behind under {p}"


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(20)
    return proc.pid


def test_new_prefix_shape():
    a, b = shm.new_prefix(), shm.new_prefix()
    assert a != b
    for p in (a, b):
        assert p.startswith(f"rdv-{os.getpid()}-") and p.endswith("-")
        assert shm.NAME_RE.match(p + "1")


@pytest.mark.parametrize("dtype", ["float32", "int64", "uint8", "bool", "complex128"])
def test_write_then_take_round_trip(prefixes, dtype):
    prefix = prefixes()
    arr = (np.arange(60) % 5).astype(dtype).reshape(3, 4, 5)
    name, nbytes = shm.write(prefix, arr)
    assert name.startswith(prefix) and shm.NAME_RE.match(name)
    assert nbytes == arr.nbytes
    assert shm.listed(prefix) == [name]
    assert os.stat(os.path.join(shm.SHM_DIR, name)).st_size == arr.nbytes
    assert os.stat(os.path.join(shm.SHM_DIR, name)).st_mode & 0o777 == 0o600

    got = shm.take(name, nbytes, arr.dtype, arr.shape)
    assert shm.listed(prefix) == []  # the name is gone as soon as it is taken
    assert not os.path.exists(os.path.join(shm.SHM_DIR, name))
    assert got.dtype == arr.dtype and got.shape == arr.shape
    np.testing.assert_array_equal(got, arr)
    assert got.flags.writeable
    got.reshape(-1)[0] = arr.reshape(-1)[1]  # writable in place: the caller owns it
    del got


def test_write_is_a_copy_and_names_are_unique(prefixes):
    prefix = prefixes()
    arr = np.arange(10, dtype=np.int32)
    n1, _ = shm.write(prefix, arr)
    arr[:] = -1
    n2, _ = shm.write(prefix, arr)
    assert n1 != n2 and shm.listed(prefix) == sorted([n1, n2])
    np.testing.assert_array_equal(shm.take(n1, 40, np.int32, (10,)), np.arange(10))
    np.testing.assert_array_equal(shm.take(n2, 40, np.int32, (10,)), np.full(10, -1))


def test_write_non_contiguous_and_scalar(prefixes):
    prefix = prefixes()
    base = np.arange(100, dtype=np.float64).reshape(10, 10)
    view = base[1::3, ::-2]
    assert not view.flags.c_contiguous
    name, nbytes = shm.write(prefix, view)
    assert nbytes == view.size * 8
    np.testing.assert_array_equal(shm.take(name, nbytes, view.dtype, view.shape), view)

    scalar = np.array(7, np.int16)
    name, nbytes = shm.write(prefix, scalar)
    got = shm.take(name, nbytes, np.int16, ())
    assert got.shape == () and got == 7


def test_write_empty_is_refused(prefixes):
    prefix = prefixes()
    with pytest.raises(InvalidArgument, match="empty tensor"):
        shm.write(prefix, np.zeros((0, 3), np.float32))
    assert shm.listed(prefix) == []


def test_take_unknown_name_is_not_found(prefixes):
    name = prefixes() + "1"
    with pytest.raises(NotFound, match=name):
        shm.take(name, 8, np.float64, (1,))


def test_take_twice_is_not_found(prefixes):
    name, nbytes = shm.write(prefixes(), np.ones(4, np.float32))
    first = shm.take(name, nbytes, np.float32, (4,))
    with pytest.raises(NotFound):
        shm.take(name, nbytes, np.float32, (4,))
    np.testing.assert_array_equal(first, np.ones(4))


@pytest.mark.parametrize("name", [
    "rdv-1-0123456789ab",                # no counter
    "rdv-1-0123456789ab-",               # empty counter
    "rdv-x-0123456789ab-1",              # pid not a number
    "rdv-1-0123456789a-1",               # session too short
    "rdv-1-0123456789abc-1",             # session too long
    "rdv-1-0123456789AB-1",              # upper-case hex
    "rdv-1-0123456789ab-1\n",            # a trailing newline ($ would allow it, \\Z does not)
    "rdv-1-0123456789ab-1/../x",         # a path
    "/rdv-1-0123456789ab-1",             # a leading slash
    "xrdv-1-0123456789ab-1",
    "",
])
def test_names_not_ours_are_refused(name):
    assert not shm.NAME_RE.match(name)
    with pytest.raises(InvalidArgument, match="not a rendezvous shared-memory segment name"):
        shm.take(name, 8, np.float64, (1,))
    assert shm.discard(name) is False


def test_take_refuses_mismatched_sizes_without_consuming(prefixes):
    prefix = prefixes()
    name, nbytes = shm.write(prefix, np.arange(8, dtype=np.int32))  # 32 bytes
    with pytest.raises(InvalidArgument, match="32 bytes announced"):
        shm.take(name, nbytes, np.int64, (8,))  # needs 64
    with pytest.raises(InvalidArgument, match="need 32"):
        shm.take(name, 16, np.int32, (8,))
    with pytest.raises(InvalidArgument):
        shm.take(name, 0, np.int32, (0,))
    assert shm.listed(prefix) == [name]  # nothing was consumed
    np.testing.assert_array_equal(shm.take(name, nbytes, np.int32, (8,)), np.arange(8))


def test_take_refuses_a_segment_smaller_than_announced(prefixes):
    prefix = prefixes()
    name, nbytes = shm.write(prefix, np.arange(4, dtype=np.int32))  # 16 bytes
    with pytest.raises(InvalidArgument, match="holds 16 bytes, 32 announced"):
        shm.take(name, 32, np.int32, (8,))
    # the name was unlinked before the size was checked: it cannot leak
    assert shm.listed(prefix) == []


def test_discard(prefixes):
    prefix = prefixes()
    name, _ = shm.write(prefix, np.ones(3))
    other, _ = shm.write(prefix, np.ones(3))
    assert shm.discard(name) is True
    assert shm.listed(prefix) == [other]
    assert shm.discard(name) is False  # already gone
    with pytest.raises(NotFound):
        shm.take(name, 24, np.float64, (3,))


def test_sweep_removes_only_its_prefix(prefixes):
    mine, theirs = prefixes(), prefixes()
    for i in range(3):
        shm.write(mine, np.full(4, i, np.int8))
    kept, _ = shm.write(theirs, np.arange(4, dtype=np.int8))
    taken, _ = shm.write(mine, np.ones(2))
    held = shm.take(taken, 16, np.float64, (2,))  # already taken: not counted by the sweep
    assert len(shm.listed(mine)) == 3

    assert shm.sweep(mine) == 3
    assert shm.listed(mine) == []
    assert shm.listed(theirs) == [kept]
    assert shm.sweep(mine) == 0
    np.testing.assert_array_equal(held, [1.0, 1.0])  # a taken segment's memory is not affected
    np.testing.assert_array_equal(shm.take(kept, 4, np.int8, (4,)), np.arange(4))


def test_sweep_refuses_prefixes_not_ours(prefixes):
    prefix = prefixes()
    name, _ = shm.write(prefix, np.ones(1))
    assert shm.sweep(prefix[len("rdv-"):]) == 0  # no "rdv-": never a sweep of foreign names
    assert shm.sweep("") == 0
    assert shm.listed(prefix) == [name]


def test_sweep_dead_removes_dead_pids_and_keeps_live_ones(prefixes):
    dead = prefixes(pid=_dead_pid())
    live = prefixes()
    parent = prefixes(pid=os.getppid())
    for prefix in (dead, dead, live, parent):
        shm.write(prefix, np.ones(2))
    l1, p1 = shm.listed(live), shm.listed(parent)
    assert len(shm.listed(dead)) == 2

    shm.sweep_dead(dead)
    # (the count is checked in the next test: a daemon started by someone else on
    # this machine may sweep these dead names too)
    assert shm.listed(dead) == []
    assert shm.sweep_dead(live) == 0
    assert shm.sweep_dead(parent) == 0
    assert shm.listed(live) == l1 and shm.listed(parent) == p1


@pytest.fixture
def fake_shm_dir(tmp_path, monkeypatch):
    """/dev/shm replaced by a folder of plain files, so that sweep_dead("rdv-")
    can be tried on chosen names without touching anyone's real segments:
    returns (add(name), unlinked names)."""
    unlinked: list[str] = []

    def fake_unlink(name: str) -> bool:
        path = tmp_path / name
        if not path.exists():
            return False
        path.unlink()
        unlinked.append(name)
        return True

    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    monkeypatch.setattr(shm, "_unlink", fake_unlink)
    return (lambda name: (tmp_path / name).write_bytes(b"x")), unlinked


def test_sweep_dead_chooses_names_of_dead_pids(fake_shm_dir):
    add, unlinked = fake_shm_dir
    dead = _dead_pid()
    names = {
        "dead": [f"rdv-{dead}-0123456789ab-1", f"rdv-{dead}-0123456789ab-2", f"rdv-{dead}-aaaaaaaaaaaa-7"],
        "alive": [f"rdv-{os.getpid()}-0123456789ab-1", f"rdv-{os.getppid()}-bbbbbbbbbbbb-3",
                  "rdv-1-cccccccccccc-1"],  # pid 1 always exists
        "not ours": [f"rdv-{dead}-0123456789ab-x", f"rdv-{dead}-0123456789ab", "other-file"],
    }
    for group in names.values():
        for n in group:
            add(n)
    assert shm.sweep_dead() == 3
    assert sorted(unlinked) == sorted(names["dead"])
    assert shm.listed("") == sorted(names["alive"] + names["not ours"])
    assert shm.sweep_dead() == 0
    # a prefix limits the sweep
    add(names["dead"][0])
    assert shm.sweep_dead(f"rdv-{dead}-aaaaaaaaaaaa-") == 0
    assert shm.sweep_dead(f"rdv-{dead}-0123456789ab-") == 1
    # sweep, too, leaves alone what NAME_RE does not match
    assert shm.sweep(f"rdv-{dead}-0123456789ab") == 0
    assert shm.listed(f"rdv-{dead}-") == sorted(names["not ours"][:2])


def test_sweep_dead_name_with_impossible_pid(fake_shm_dir):
    """A pid outside the C int range once raised OverflowError from os.kill and
    aborted the whole sweep (and so the daemon's start)."""
    add, unlinked = fake_shm_dir
    dead = _dead_pid()
    impossible = f"rdv-{2**31}-0123456789ab-1"  # pids are C ints: no process can have this one
    assert shm.NAME_RE.match(impossible)
    add(impossible)
    add(f"rdv-{dead}-0123456789ab-1")
    assert shm.sweep_dead() == 2
    assert sorted(unlinked) == sorted([impossible, f"rdv-{dead}-0123456789ab-1"])


def test_live_mappings_counts_taken_segments(prefixes):
    prefix = prefixes()
    gc.collect()
    before = shm.live_mappings()
    n1, b1 = shm.write(prefix, np.arange(6, dtype=np.int32))
    n2, b2 = shm.write(prefix, np.arange(3, dtype=np.float64))
    assert shm.live_mappings() == before  # the writer keeps no mapping
    a = shm.take(n1, b1, np.int32, (6,))
    assert shm.live_mappings() == before + 1
    b = shm.take(n2, b2, np.float64, (3,))
    assert shm.live_mappings() == before + 2
    view = a[2:4]  # a view keeps the mapping alive
    del a
    gc.collect()
    assert shm.live_mappings() == before + 2
    np.testing.assert_array_equal(view, [2, 3])
    del view
    gc.collect()
    assert shm.live_mappings() == before + 1
    del b
    gc.collect()
    assert shm.live_mappings() == before


def test_failed_take_leaves_no_mapping(prefixes):
    gc.collect()
    before = shm.live_mappings()
    with pytest.raises(NotFound):
        shm.take(prefixes() + "9", 8, np.uint8, (8,))
    name, _ = shm.write(prefixes(), np.ones(2, np.int8))
    with pytest.raises(InvalidArgument):
        shm.take(name, 4, np.int8, (4,))
    assert shm.live_mappings() == before


def test_listed_filters_by_prefix(prefixes):
    a, b = prefixes(), prefixes()
    na, _ = shm.write(a, np.ones(1))
    nb, _ = shm.write(b, np.ones(1))
    assert shm.listed(a) == [na] and shm.listed(b) == [nb]
    assert set(shm.listed("rdv-")) >= {na, nb}
