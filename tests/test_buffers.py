"""The receive-buffer cache: large buffers come back only once nothing refers to them."""

from __future__ import annotations

import numpy as np
import pytest

from rendezvous import buffers
from rendezvous.buffers import RecvBuffers

MiB = 1 << 20
pytestmark = pytest.mark.timeout(30)


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_a_dropped_buffer_is_reused_for_the_same_size():
    cache = RecvBuffers(limit=64 * MiB, min_bytes=MiB)
    a = cache.empty((256, 1024), np.float32)  # 1 MiB
    assert a.shape == (256, 1024) and a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable
    where = _addr(a)
    del a
    b = cache.empty(MiB, np.uint8)  # same bytes, another dtype and shape
    assert _addr(b) == where and cache.reused == 1
    assert b.shape == (MiB,) and b.dtype == np.uint8


@pytest.mark.parametrize("hold", ["array", "view", "memoryview", "reshaped"])
def test_a_buffer_still_referred_to_is_never_handed_out(hold):
    cache = RecvBuffers(limit=64 * MiB, min_bytes=MiB)
    a = cache.empty(MiB, np.uint8)
    a[:] = 7
    if hold == "array":
        keep = a
    elif hold == "view":
        keep = a[10:]
    elif hold == "memoryview":
        keep = memoryview(a)
    else:
        keep = a.view(np.int32).reshape(512, 512)
    where = _addr(a)
    del a
    b = cache.empty(MiB, np.uint8)
    assert _addr(b) != where
    b[:] = 1
    assert np.asarray(keep).view(np.uint8).reshape(-1)[-1] == 7  # what the caller holds is untouched
    assert cache.reused == 0


def test_small_object_and_oversized_requests_bypass_the_cache():
    cache = RecvBuffers(limit=4 * MiB, min_bytes=MiB)
    for shape, dtype in [((100,), np.uint8), ((8 * MiB,), np.uint8)]:
        a = cache.empty(shape, dtype)
        where = _addr(a)
        del a
        assert cache.stats()["tracked_bytes"] == 0, (shape, where)
    assert cache.empty(MiB // 8, object).dtype == object
    assert cache.stats()["tracked_bytes"] == 0


def test_the_limit_bounds_what_is_kept():
    cache = RecvBuffers(limit=3 * MiB, min_bytes=MiB)
    held = [cache.empty(MiB, np.uint8) for _ in range(5)]  # three tracked, two plain
    assert cache.stats()["tracked_bytes"] == 3 * MiB
    del held
    assert cache.stats()["free_bytes"] == 3 * MiB
    # a new size evicts free buffers of another size to stay within the limit
    b = cache.empty(2 * MiB, np.uint8)
    assert cache.stats()["tracked_bytes"] <= 3 * MiB
    del b
    cache.set_limit(0)
    assert cache.stats()["tracked_bytes"] == 0
    a = cache.empty(MiB, np.uint8)
    assert cache.stats()["tracked_bytes"] == 0 and a.nbytes == MiB


def test_clear_keeps_arrays_in_use_valid():
    cache = RecvBuffers(limit=8 * MiB, min_bytes=MiB)
    a = cache.empty(MiB, np.uint8)
    a[:] = 3
    cache.clear()
    assert cache.stats() == {"tracked_bytes": 0, "free_bytes": 0, "reused": 0}
    assert int(a.sum()) == 3 * MiB


def test_each_server_owns_a_cache_that_follows_its_config():
    from rendezvous import aio

    spec = {"w": ["127.0.0.1:0"]}
    off = aio.Server(spec, "w", 0, recv_cache_bytes=0)
    small = aio.Server(spec, "w", 0, recv_cache_bytes=5 * MiB)
    assert off.buffers.limit == 0 and small.buffers.limit == 5 * MiB
    assert off.buffers is not small.buffers  # no process-wide cache: the last server built does not win
    assert off.buffers.limit == 0


def test_sizes_that_differ_a_little_share_buffers():
    cache = RecvBuffers(limit=64 * MiB, min_bytes=256 << 10)
    a = cache.empty((MiB + 100,), np.uint8)
    assert a.nbytes == MiB + 100 and a.flags.c_contiguous and a.flags.writeable
    where = _addr(a)
    del a
    b = cache.empty((MiB + 4000) // 4, np.float32)  # another size of the same class
    assert _addr(b) == where and cache.reused == 1 and b.shape == ((MiB + 4000) // 4,)
    assert cache.stats()["tracked_bytes"] == buffers.size_class(MiB + 100)


def test_size_classes_waste_at_most_an_eighth():
    for n in [1, 7, 255, 256 << 10, (256 << 10) + 1, MiB - 1, MiB, 3 * MiB + 5, (1 << 30) + 1]:
        c = buffers.size_class(n)
        assert n <= c <= n + max(n // 8, 1), n
        assert buffers.size_class(c) == c  # a class is its own class
    assert buffers.size_class(MiB) == MiB
