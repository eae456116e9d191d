"""The daemon's pool of sealed memfd segments (rendezvous/shm.py).

Segments are anonymous memfds: nothing here touches the file system. Checks on
closed segments look for their inodes among this process's
``memfd:rendezvous-segment`` descriptors in /proc/self/fd, or fstat a
descriptor right after the pool closed it (before anything else can be given
its number)."""

from __future__ import annotations

import fcntl
import gc
import os
import tempfile
import threading

import numpy as np
import pytest

from rendezvous.daemon.pool import Pool, Segment
from rendezvous.local import segments as shm
from rendezvous.errors import FailedPrecondition, InvalidArgument

pytestmark = [
    pytest.mark.timeout(30),
    pytest.mark.skipif(not shm.available(), reason="no sealed memfds on this platform"),
]

PAGE = shm._PAGE
MIN = shm.MIN_SEGMENT
KIB = 1 << 10
MIB = 1 << 20


def segment_inodes() -> set[int]:
    """The segments this process has a descriptor on (memfds named as create_segment
    names them), by inode: a segment counts while any descriptor of it is open,
    its pool descriptor or the one its mapping keeps."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:rendezvous-segment"):
                found.add(os.stat(f"/proc/self/fd/{name}").st_ino)
        except OSError:
            continue  # the listing's own descriptor, gone by now
    return found


def inode(seg: Segment) -> int:
    return os.fstat(seg.fd).st_ino


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def collect() -> None:
    gc.collect()


@pytest.fixture
def pool():
    p = Pool(64 * MIB)
    yield p
    p.close()


# -- size classes -------------------------------------------------------------------

SIZES = sorted({0, 1, 100, PAGE - 1, PAGE, PAGE + 1, MIN - 1, MIN, MIN + 1, 70 * KIB, 96 * KIB, 96 * KIB + 1,
                127 * KIB, 128 * KIB, 128 * KIB + 1, 1 * MIB - 1, 1 * MIB, 1 * MIB + 1, 5 * MIB + 12345,
                70 * MIB, (1 << 31) - 1, 1 << 31, (1 << 31) + 1, 3 << 40}
               | {(k * 37_171) % (300 * MIB) for k in range(1, 400)}
               | {(1 << e) + d for e in range(10, 34) for d in (-PAGE - 1, -1, 1, PAGE + 1, (1 << e) // 3)})


def test_size_class_floor_and_pages():
    for n in SIZES:
        c = shm.size_class(n)
        assert c >= MIN, n
        assert c >= n, n
        assert c % PAGE == 0, n


def test_size_class_small_sizes_get_the_minimum():
    for n in (-5, 0, 1, 4096, MIN - 1, MIN):
        assert shm.size_class(n) == MIN


def test_size_class_monotone():
    prev = 0
    for n in SIZES:
        c = shm.size_class(n)
        assert c >= prev, n
        prev = c
    # and densely across one doubling, byte by page
    prev = 0
    for n in range(MIN, 4 * MIN + 2 * PAGE, PAGE // 2):
        c = shm.size_class(n)
        assert c >= prev, n
        prev = c


def test_size_class_waste_bounded():
    for n in SIZES:
        if n <= MIN:
            continue
        c = shm.size_class(n)
        assert c <= n * 1.25 + PAGE, (n, c)


def test_size_class_exact_for_powers_of_two():
    for e in range(16, 42):
        assert shm.size_class(1 << e) == 1 << e


def test_size_class_four_per_doubling():
    # every class between 1 MiB (exclusive) and 2 MiB (inclusive)
    classes = {shm.size_class(n) for n in range(MIB + 1, 2 * MIB + 1, PAGE)}
    assert classes == {MIB + k * (MIB // 4) for k in range(1, 5)}
    assert shm.size_class(70 * MIB) == 80 * MIB


# -- creating and mapping ---------------------------------------------------------------

def test_create_segment_is_sealed():
    fd = shm.create_segment(3 * PAGE)
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        for seal in (fcntl.F_SEAL_SHRINK, fcntl.F_SEAL_GROW, fcntl.F_SEAL_SEAL):
            assert seals & seal, hex(seals)
        assert seals & shm.SEALS == shm.SEALS
        assert os.fstat(fd).st_size == 3 * PAGE
        with pytest.raises(PermissionError):
            os.ftruncate(fd, PAGE)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 10 * PAGE)
        with pytest.raises(PermissionError):
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)  # SEAL_SEAL: no more seals
        assert os.fstat(fd).st_size == 3 * PAGE
        assert os.get_inheritable(fd) is False
    finally:
        os.close(fd)


def test_map_segment_shares_memory_and_keeps_no_descriptor():
    size = 2 * PAGE
    fd = shm.create_segment(size)
    before = shm.live_mappings()
    fds = len(os.listdir("/proc/self/fd"))
    try:
        a = shm.map_segment(fd, size)
        b = shm.map_segment(fd, size)
        # one descriptor per segment: a mapping holds none (Python's mmap keeps a duplicate)
        assert len(os.listdir("/proc/self/fd")) == fds
        assert shm.live_mappings() == before + 2
        assert len(a) == size and len(b) == size
        va, vb = a.view(), b.view()
        va[0:5] = b"hello"
        va[size - 3:size] = b"end"
        assert vb[0:5] == b"hello"
        assert vb[size - 3:size] == b"end"
        vb[100:104] = b"back"
        assert va[100:104] == b"back"
        # a third mapping of a duplicate descriptor sees it too (as a client would)
        dup = os.dup(fd)
        try:
            c = shm.map_segment(dup, size)
            assert c.view()[0:5] == b"hello"
            c.close()
            del c
        finally:
            os.close(dup)
        # closed while an array still uses it: the memory stays until the array goes
        arr = np.frombuffer(a.buffer, np.uint8, size)
        del va, vb
        a.close()
        b.close()
        del a, b
        collect()
        assert shm.live_mappings() == before + 1 and bytes(arr[0:5]) == b"hello"
        del arr
        collect()
        assert shm.live_mappings() == before
    finally:
        os.close(fd)


def test_map_segment_refuses_unsealed_memfd():
    fd = os.memfd_create("rendezvous-test-unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, PAGE)
        with pytest.raises(InvalidArgument):
            shm.map_segment(fd, PAGE)
        # some seals but not all of them is not enough either
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        with pytest.raises(InvalidArgument):
            shm.map_segment(fd, PAGE)
    finally:
        os.close(fd)


def test_map_segment_refuses_memfd_without_sealing():
    # created without MFD_ALLOW_SEALING: it carries only F_SEAL_SEAL, and can still grow or shrink
    fd = os.memfd_create("rendezvous-test-plain", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, PAGE)
        with pytest.raises(InvalidArgument):
            shm.map_segment(fd, PAGE)
    finally:
        os.close(fd)


def test_map_segment_refuses_size_mismatch():
    fd = shm.create_segment(2 * PAGE)
    before = shm.live_mappings()
    try:
        for wrong in (PAGE, 2 * PAGE - 1, 2 * PAGE + 1, 3 * PAGE, 0, -1):
            with pytest.raises(InvalidArgument):
                shm.map_segment(fd, wrong)
        assert shm.live_mappings() == before
    finally:
        os.close(fd)


def test_map_segment_refuses_pipe():
    r, w = os.pipe()
    try:
        for fd in (r, w):
            with pytest.raises(InvalidArgument):
                shm.map_segment(fd, PAGE)
    finally:
        os.close(r)
        os.close(w)


def test_map_segment_refuses_regular_file():
    with tempfile.TemporaryFile() as f:
        f.write(b"\0" * PAGE)
        f.flush()
        with pytest.raises(InvalidArgument):
            shm.map_segment(f.fileno(), PAGE)


def test_map_segment_refuses_closed_descriptor():
    fd = shm.create_segment(PAGE)
    os.close(fd)
    with pytest.raises(InvalidArgument):
        shm.map_segment(fd, PAGE)


# -- lending, producing, reuse --------------------------------------------------------

def test_lend_produce_free_reuse(pool):
    seg = pool.lend(100 * KIB, "a")
    assert seg is not None
    size = shm.size_class(100 * KIB)
    assert seg.size == size and seg.lent_to == "a" and seg.refs == 1
    assert os.fstat(seg.fd).st_size == size
    st = pool.stats()
    assert st["lent"] == 1 and st["free_bytes"] == 0 and st["created"] == 1 and st["reused"] == 0
    assert st["bytes"] == size == pool.total

    # the client writes its tensor through its own mapping of the descriptor
    data = np.arange(25_000, dtype=np.float32)
    client = shm.map_segment(seg.fd, seg.size)
    client[:data.nbytes] = data.tobytes()

    arr = pool.produced(seg.id, "a", data.nbytes, "float32", (250, 100))
    assert arr.shape == (250, 100) and arr.dtype == np.float32
    np.testing.assert_array_equal(arr.ravel(), data)
    assert pool.segment_of(arr) is seg
    assert seg.lent_to is None and seg.tensor
    st = pool.stats()
    assert st["lent"] == 0 and st["in_table"] == 1 and st["free_bytes"] == 0

    # the daemon's array is a view on the segment itself: the client sees a write through it
    arr[0, 0] = 42.0
    assert np.frombuffer(client.buffer, np.float32, 1)[0] == 42.0

    view = arr[10:]  # a view keeps the segment in use
    del arr
    collect()
    assert pool.stats()["free_bytes"] == 0 and not seg.free
    del view
    collect()
    st = pool.stats()
    assert st["free_bytes"] == size and st["in_table"] == 0 and seg.free and not seg.tensor

    again = pool.lend(size - 1, "b")  # the same class: the same segment, pages and all
    assert again is seg and again.lent_to == "b"
    st = pool.stats()
    assert st["reused"] == 1 and st["created"] == 1 and st["free_bytes"] == 0 and st["segments"] == 1
    assert np.frombuffer(client.buffer, np.float32, 1)[0] == 42.0  # no zeroing on reuse
    client.close()


def test_other_class_makes_new_segment(pool):
    a = pool.lend(MIN, "s")
    assert pool.release(a.id, "s")
    b = pool.lend(4 * MIN, "s")
    assert b is not a and b.id != a.id and b.size == 4 * MIN
    st = pool.stats()
    assert st["created"] == 2 and st["reused"] == 0 and st["free_bytes"] == MIN and st["segments"] == 2


def test_release_of_lent_segment(pool):
    seg = pool.lend(MIN, "a")
    assert not pool.release(seg.id, "b")
    assert seg.lent_to == "a" and pool.stats()["free_bytes"] == 0
    assert pool.release(seg.id, "a")
    assert seg.free and seg.lent_to is None and pool.stats()["free_bytes"] == MIN
    assert not pool.release(seg.id, "a")  # twice: no hold left
    assert not pool.release(12345, "a")  # no such segment
    assert seg.refs == 0


def test_produced_rejects_segment_not_lent(pool):
    seg = pool.lend(MIN, "owner")
    with pytest.raises(InvalidArgument):
        pool.produced(seg.id, "thief", 16, "uint8", (16,))
    with pytest.raises(InvalidArgument):
        pool.produced(seg.id + 1000, "owner", 16, "uint8", (16,))
    assert seg.lent_to == "owner" and seg.refs == 1 and not seg.tensor
    st = pool.stats()
    assert st["lent"] == 1 and st["in_table"] == 0 and st["free_bytes"] == 0
    # the real owner still can
    arr = pool.produced(seg.id, "owner", 16, "uint8", (16,))
    assert arr.shape == (16,)
    # and a second produced of the same lend is refused: the lend was used up
    with pytest.raises(InvalidArgument):
        pool.produced(seg.id, "owner", 16, "uint8", (16,))
    del arr
    collect()
    assert seg.free


def test_produced_rejects_free_and_array_segments(pool):
    seg = pool.lend(MIN, "a")
    pool.release(seg.id, "a")
    with pytest.raises(InvalidArgument):  # free: lent to nobody
        pool.produced(seg.id, "a", 16, "uint8", (16,))
    arr = pool.array((4,), "int64")
    other = pool.segment_of(arr)
    with pytest.raises(InvalidArgument):  # a daemon array: lent to nobody
        pool.produced(other.id, "a", 16, "uint8", (16,))
    assert other.tensor and other.refs == 1
    del arr
    collect()
    assert other.free


def test_produced_rejects_oversize(pool):
    seg = pool.lend(MIN, "a")
    for nbytes in (seg.size + 1, seg.size + PAGE, 0, -8):
        with pytest.raises(InvalidArgument):
            pool.produced(seg.id, "a", nbytes, "uint8", (max(nbytes, 0),))
        assert seg.lent_to == "a" and seg.refs == 1 and not seg.tensor
    arr = pool.produced(seg.id, "a", seg.size, "uint8", (seg.size,))  # exactly the segment: fine
    assert arr.nbytes == seg.size and pool.segment_of(arr) is seg
    del arr
    collect()
    assert seg.free


def test_hand_to_holds_until_release(pool):
    seg = pool.lend(MIN, "producer")
    arr = pool.produced(seg.id, "producer", 800, "float64", (100,))
    pool.hand_to(seg, "consumer")
    assert seg.held_by == "consumer" and seg.refs == 2
    assert pool.stats()["held"] == 1
    del arr
    collect()
    assert not seg.free and pool.stats()["free_bytes"] == 0
    assert pool.stats()["in_table"] == 0 and pool.stats()["held"] == 1
    assert not pool.release(seg.id, "producer")  # not its hold any more
    assert not pool.release(seg.id, "someone")
    assert seg.held_by == "consumer" and seg.refs == 1 and pool.stats()["free_bytes"] == 0
    assert pool.release(seg.id, "consumer")
    assert seg.free and seg.held_by is None and pool.stats()["free_bytes"] == MIN
    assert pool.stats()["held"] == 0


def test_hand_to_twice_refused(pool):
    arr = pool.array((10,), "uint8")
    seg = pool.segment_of(arr)
    pool.hand_to(seg, "c1")
    with pytest.raises(FailedPrecondition):
        pool.hand_to(seg, "c2")
    assert seg.held_by == "c1" and seg.refs == 2
    del arr
    collect()
    pool.release(seg.id, "c1")
    assert seg.free


def test_release_before_array_gone(pool):
    arr = pool.array((10,), "uint8")
    seg = pool.segment_of(arr)
    pool.hand_to(seg, "c")
    assert pool.release(seg.id, "c")
    assert not seg.free  # the daemon's array still holds it
    del arr
    collect()
    assert seg.free


def test_session_gone_drops_lent_and_held(pool):
    lent = pool.lend(MIN, "s")
    arr = pool.array((MIN,), "uint8")
    held = pool.segment_of(arr)
    pool.hand_to(held, "s")
    del arr
    collect()
    keep = pool.lend(MIN, "other")
    assert len({lent.id, held.id, keep.id}) == 3
    pool.mark_known(lent, "s")
    assert pool.session_gone("s") == 2
    assert lent.free and held.free and not keep.free
    assert "s" not in lent.known
    assert keep.lent_to == "other"
    assert pool.stats()["free_bytes"] == 2 * MIN
    assert pool.session_gone("s") == 0
    assert pool.session_gone("nobody") == 0


def test_array_is_daemon_held(pool):
    arr = pool.array((3, 5), np.int32)
    assert arr.shape == (3, 5) and arr.dtype == np.int32
    seg = pool.segment_of(arr)
    assert seg is not None and seg.tensor and seg.lent_to is None and seg.held_by is None
    arr[...] = np.arange(15).reshape(3, 5)
    # the bytes are on the segment: a mapping of its descriptor sees them
    m = shm.map_segment(seg.fd, seg.size)
    np.testing.assert_array_equal(np.frombuffer(m.buffer, np.int32, 15), np.arange(15))
    m.close()
    assert pool.stats()["in_table"] == 1
    del arr
    collect()
    assert seg.free and pool.stats()["in_table"] == 0


def test_array_scalar_and_empty(pool):
    s = pool.array((), "float64")
    assert s.shape == () and pool.segment_of(s) is not None
    e = pool.array((0, 4), "float32")
    assert e.shape == (0, 4)
    del s, e
    collect()
    assert pool.stats()["free_bytes"] == pool.total


def test_segment_of(pool):
    arr = pool.array((8, 16), "float32")
    seg = pool.segment_of(arr)
    assert seg is not None
    # full C-contiguous views of it, however made
    assert pool.segment_of(arr.reshape(-1)) is seg
    assert pool.segment_of(arr.view(np.uint8)) is seg
    assert pool.segment_of(arr[:]) is seg
    assert pool.segment_of(arr.reshape(16, 8)[:]) is seg
    assert pool.segment_of(arr[:4]) is seg  # starts at byte 0: a leading part
    # not from byte 0, not contiguous, not a pool array
    assert pool.segment_of(arr[1:]) is None
    assert pool.segment_of(arr.reshape(-1)[3:]) is None
    assert pool.segment_of(arr[:, ::2]) is None
    assert pool.segment_of(arr.T) is None
    assert pool.segment_of(np.zeros((8, 16), np.float32)) is None
    assert pool.segment_of(np.zeros(10)[:5]) is None
    assert pool.segment_of(arr.copy()) is None
    # a foreign array on a mapping of the same descriptor is not the daemon's array
    m = shm.map_segment(seg.fd, seg.size)
    foreign = np.frombuffer(m.buffer, np.float32, 128)
    assert pool.segment_of(foreign) is None
    del foreign
    m.close()


def test_segment_of_produced_views(pool):
    seg = pool.lend(MIN, "a")
    arr = pool.produced(seg.id, "a", 4096, "int64", (16, 32))
    assert pool.segment_of(arr) is seg
    assert pool.segment_of(arr.ravel()) is seg
    assert pool.segment_of(arr[2:]) is None
    assert pool.segment_of(arr[:, 1]) is None


# -- the limit ---------------------------------------------------------------------

def test_limit_refuses_while_held():
    pool = Pool(4 * MIN)
    try:
        held = [pool.lend(MIN, "s") for _ in range(4)]
        assert all(s is not None for s in held)
        assert len({s.id for s in held}) == 4
        assert pool.total == 4 * MIN
        assert pool.lend(MIN, "s") is None
        assert pool.lend(1, "t") is None
        assert pool.array((10,), "uint8") is None
        assert pool.lend(8 * MIN, "s") is None  # above the limit itself
        assert pool.total == 4 * MIN and pool.stats()["created"] == 4
        assert pool.release(held[2].id, "s")
        again = pool.lend(MIN, "t")
        assert again is held[2]
        assert pool.total <= pool.limit
    finally:
        pool.close()


def test_limit_larger_than_pool_never_granted():
    pool = Pool(MIN)
    try:
        assert pool.lend(MIN + 1, "s") is None
        assert pool.total == 0 and pool.stats()["created"] == 0
        assert pool.lend(MIN, "s") is not None
    finally:
        pool.close()


def test_limit_evicts_free_segments_lru_first():
    retired: list[tuple[int, set[str]]] = []
    pool = Pool(8 * MIN, on_retire=lambda sid, sessions: retired.append((sid, set(sessions))))
    try:
        a = pool.lend(MIN, "s")  # class MIN
        b = pool.lend(2 * MIN, "s")  # class 2*MIN
        c = pool.lend(3 * MIN, "s")  # class 3*MIN (192 KiB)
        sizes = a.size + b.size + c.size
        assert pool.total == sizes <= 8 * MIN
        for s in (a, b, c):
            pool.mark_known(s, "s")
        # freed in the order b, a, c: b is the least recently used
        for s in (b, a, c):
            assert pool.release(s.id, "s")
        assert pool.stats()["free_bytes"] == sizes
        inodes = {s.id: inode(s) for s in (a, b, c)}
        # a new class that needs room for just under one free segment's worth
        need = pool.total + 4 * MIN - pool.limit
        assert 0 < need <= b.size
        d = pool.lend(4 * MIN, "t")
        assert d is not None and d.size == 4 * MIN
        assert pool.get(b.id) is None and pool.get(a.id) is a and pool.get(c.id) is c
        assert b.mm.closed and not a.mm.closed and not c.mm.closed
        assert inodes[b.id] not in segment_inodes()
        assert {inodes[a.id], inodes[c.id], inode(d)} <= segment_inodes()
        assert retired == [(b.id, {"s"})]
        assert pool.total <= pool.limit
        assert pool.total == a.size + c.size + d.size
    finally:
        pool.close()


def test_limit_evicts_several_and_keeps_total():
    pool = Pool(6 * MIN)
    try:
        segs = [pool.lend(MIN, str(i)) for i in range(6)]
        for i, s in enumerate(segs):
            pool.release(s.id, str(i))
        assert pool.stats()["free_bytes"] == 6 * MIN
        big = pool.lend(4 * MIN, "x")  # room for it: four of the free ones go, oldest first
        assert big is not None
        assert pool.total == 6 * MIN
        left = [s for s in segs if pool.get(s.id) is not None]
        assert left == segs[4:]
        assert pool.stats()["free_bytes"] == 2 * MIN
        # a total above the limit never happens on the way, whatever is asked for
        for n in (MIN, 2 * MIN, 3 * MIN, 5 * MIN, 6 * MIN, 7 * MIN):
            s = pool.lend(n, "y")
            assert pool.total <= pool.limit
            if s is not None:
                pool.release(s.id, "y")
            assert pool.total <= pool.limit
    finally:
        pool.close()


def test_set_limit_lower_closes_free():
    retired = []
    pool = Pool(8 * MIN, on_retire=lambda sid, sessions: retired.append(sid))
    try:
        segs = [pool.lend(MIN, "s") for _ in range(4)]
        for s in segs:
            pool.mark_known(s, "s")
        for s in segs[:3]:
            pool.release(s.id, "s")
        fds = [s.fd for s in segs]
        inodes = [inode(s) for s in segs]
        pool.set_limit(2 * MIN)
        assert pool.limit == 2 * MIN
        assert pool.total == 2 * MIN  # one free left, with the held one
        assert not is_open(fds[0]) and not is_open(fds[1])
        open_now = segment_inodes()
        assert inodes[0] not in open_now and inodes[1] not in open_now
        assert inodes[2] in open_now and inodes[3] in open_now
        assert sorted(retired) == sorted(s.id for s in segs[:2])  # the two least recently freed
        assert is_open(fds[2]) and is_open(fds[3])
        # lower again: the free one goes; the held one cannot
        pool.set_limit(0)
        assert pool.total == MIN and pool.get(segs[3].id) is segs[3]
        assert not is_open(fds[2])
        # the held one, freed above the limit, is closed rather than kept
        pool.release(segs[3].id, "s")
        assert not is_open(fds[3])
        assert pool.total == 0 and pool.stats()["segments"] == 0
        assert sorted(retired) == sorted(s.id for s in segs)
    finally:
        pool.close()


def test_set_limit_higher_allows_more():
    pool = Pool(MIN)
    try:
        a = pool.lend(MIN, "s")
        assert pool.lend(MIN, "s") is None
        pool.set_limit(2 * MIN)
        b = pool.lend(MIN, "s")
        assert b is not None and b is not a and pool.total == 2 * MIN
    finally:
        pool.close()


# -- retiring and closing ------------------------------------------------------------

def test_close_closes_free_at_once_and_held_when_released():
    retired: list[tuple[int, set[str]]] = []
    pool = Pool(16 * MIN, on_retire=lambda sid, sessions: retired.append((sid, set(sessions))))
    free = pool.lend(MIN, "a")
    unknown = pool.lend(2 * MIN, "a")
    arr = pool.array((MIN,), "uint8")
    held = pool.segment_of(arr)
    pool.hand_to(held, "b")
    pool.mark_known(free, "a")
    assert pool.mark_known(held, "b")
    assert not pool.mark_known(held, "b")  # already known
    pool.mark_known(held, "a")
    pool.release(free.id, "a")
    pool.release(unknown.id, "a")
    ino = {s.id: inode(s) for s in (free, unknown, held)}
    assert set(ino.values()) <= segment_inodes()

    pool.close()
    assert not is_open(free.fd) and not is_open(unknown.fd)
    assert is_open(held.fd)
    assert free.mm.closed and unknown.mm.closed and not held.mm.closed
    open_now = segment_inodes()
    assert ino[free.id] not in open_now and ino[unknown.id] not in open_now and ino[held.id] in open_now
    assert retired == [(free.id, {"a"})]  # nobody knew the other one: no retire for it
    assert pool.stats()["segments"] == 1 and pool.total == held.size

    del arr
    collect()
    assert is_open(held.fd)  # still held by b
    assert len(retired) == 1
    assert pool.release(held.id, "b")
    assert not is_open(held.fd)
    assert held.mm.closed
    assert ino[held.id] not in segment_inodes()
    assert retired[1] == (held.id, {"a", "b"})
    assert pool.total == 0 and pool.stats()["segments"] == 0


def test_close_with_daemon_array_alive():
    retired = []
    pool = Pool(4 * MIN, on_retire=lambda sid, sessions: retired.append((sid, sessions)))
    arr = pool.array((4,), "float32")
    seg = pool.segment_of(arr)
    ino = inode(seg)
    pool.mark_known(seg, "c")
    pool.close()
    assert is_open(seg.fd)
    arr[:] = 7  # still mapped and usable
    assert retired == []
    del arr
    collect()
    assert not is_open(seg.fd)
    assert retired == [(seg.id, {"c"})]
    assert pool.total == 0
    del seg
    collect()
    assert ino not in segment_inodes()  # the memory is gone with the last mapping


def test_session_gone_forgets_known():
    retired = []
    pool = Pool(4 * MIN, on_retire=lambda sid, sessions: retired.append((sid, sessions)))
    a = pool.lend(MIN, "s")
    b = pool.lend(MIN, "t")
    pool.mark_known(a, "s")
    pool.mark_known(a, "t")
    pool.mark_known(b, "s")
    pool.session_gone("s")
    assert pool.release(b.id, "t")
    pool.close()
    # a was known by s and t, s went: t is told; b was known only by s: nobody is told
    assert retired == [(a.id, {"t"})]
    assert pool.total == 0


def test_retire_on_eviction_not_for_unknown():
    retired = []
    pool = Pool(2 * MIN, on_retire=lambda sid, sessions: retired.append((sid, sessions)))
    try:
        a = pool.lend(MIN, "s")
        b = pool.lend(MIN, "s")
        pool.mark_known(b, "s")
        pool.release(a.id, "s")
        pool.release(b.id, "s")
        big = pool.lend(2 * MIN, "s")  # both go
        assert big is not None
        assert retired == [(b.id, {"s"})]
    finally:
        pool.close()


def test_pool_close_releases_every_descriptor():
    pool = Pool(32 * MIN)
    arrays = [pool.array((n,), "uint8") for n in (MIN, 2 * MIN, 5 * MIN)]
    lent = pool.lend(3 * MIN, "x")
    inodes = {inode(pool.segment_of(a)) for a in arrays} | {inode(lent)}
    assert len(inodes) == 4 and inodes <= segment_inodes()
    pool.close()
    assert inodes <= segment_inodes()  # all in use
    del arrays
    collect()
    assert segment_inodes() & inodes == {inode(lent)}
    lent_ino = inode(lent)
    pool.session_gone("x")
    assert not is_open(lent.fd)
    del lent
    collect()
    assert lent_ino not in segment_inodes()
    assert pool.total == 0 and pool.stats()["segments"] == 0


# -- threads ---------------------------------------------------------------------------

def test_owner_array_dropped_on_another_thread(pool):
    box = [pool.array((1000,), "float64")]
    seg = pool.segment_of(box[0])
    assert not seg.free
    done = threading.Event()

    def drop():
        box.clear()  # the last reference goes on this thread
        gc.collect()
        done.set()

    t = threading.Thread(target=drop)
    t.start()
    t.join(10)
    assert done.is_set()
    assert seg.free and pool.stats()["free_bytes"] == seg.size
    assert pool.lend(1000 * 8, "s") is seg


def test_many_threads_lend_produce_drop(pool):
    errors: list[BaseException] = []
    n_threads, rounds = 8, 50

    def work(name: str) -> None:
        try:
            for i in range(rounds):
                seg = pool.lend(MIN - i % 3, name)  # one class: each thread holds one segment at a time
                assert seg is not None and seg.lent_to == name
                arr = pool.produced(seg.id, name, 64, "uint8", (64,))
                arr[:] = i % 256
                assert pool.segment_of(arr) is seg
                if i % 2:
                    pool.hand_to(seg, name)
                    del arr
                    assert pool.release(seg.id, name)
                else:
                    del arr
        except BaseException as exc:  # noqa: BLE001 - reported on the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(f"s{i}",)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors, errors
    collect()
    st = pool.stats()
    assert st["free_bytes"] == st["bytes"] == pool.total
    assert st["lent"] == st["held"] == st["in_table"] == 0
    assert st["created"] <= n_threads
    assert st["created"] + st["reused"] == n_threads * rounds


def test_pool_refuses_without_memfds(monkeypatch):
    monkeypatch.setattr("rendezvous.daemon.pool.available", lambda: False)
    with pytest.raises(FailedPrecondition):
        Pool(MIN)


def test_the_segment_of_an_array_and_of_a_whole_one(pool):
    """A daemon array on a segment, from its first byte, names it; ``whole`` asks
    in addition that the array be all the daemon's array there holds (a group's
    first tensor is not), and an array on other memory names none."""
    owner = pool.array((1024,), np.float32)
    seg = pool.segment_of(owner)
    assert seg is not None and pool.segment_of(owner, whole=True) is seg
    assert pool.segment_of(owner[:10]) is seg and pool.segment_of(owner[:10], whole=True) is None
    assert pool.segment_of(owner[10:]) is None  # not from the first byte
    on_bytes = np.frombuffer(b"\x00" * 64, np.uint8)
    assert pool.segment_of(on_bytes) is None and pool.segment_of(on_bytes, whole=True) is None
    del owner, seg
