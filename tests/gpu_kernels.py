"""Kernels that hold a real GPU busy for a while (~200 ms), for the checks a
fake GPU cannot make: a producer still writing when its tensor is sent, a
consumer's kernel still reading a block the pool hands back. cupy only, and
imported only by the GPU checks (tests/test_gpu_cupy.py, gpu_scenarios.py)."""

from __future__ import annotations

from typing import Any

HOLD_NS = 200_000_000  # how long a held kernel spins before it touches memory

_SOURCE = r"""
__device__ void spin(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}

extern "C" __global__ void spin_then_fill(unsigned char* out, unsigned long long n, unsigned char value,
                                          unsigned long long ns) {
    spin(ns);
    for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        out[i] = value;
}

extern "C" __global__ void spin_then_copy(const unsigned char* src, unsigned char* dst, unsigned long long n,
                                          unsigned long long ns) {
    spin(ns);
    for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        dst[i] = src[i];
}
"""

_module: Any = None


def _kernels() -> Any:
    global _module
    import cupy

    if _module is None:
        _module = cupy.RawModule(code=_SOURCE)
    return _module


def as_bytes(array: Any) -> Any:
    """A cupy uint8 view of a cupy array or a CUDA torch tensor (no copy, no sync)."""
    import cupy

    if not isinstance(array, cupy.ndarray):
        array = cupy.asarray(array.detach() if hasattr(array, "detach") else array)
    return array.reshape(-1).view(cupy.uint8)


def fill_late(out: Any, value: int, stream: Any = None, ns: int = HOLD_NS) -> None:
    """Every byte of ``out`` set to ``value`` by a kernel that first spins ``ns``,
    on ``stream`` (a cupy stream; default the current one)."""
    import cupy

    flat = as_bytes(out)
    _kernels().get_function("spin_then_fill")((256,), (256,), (flat, cupy.uint64(flat.size), cupy.uint8(value),
                                                               cupy.uint64(ns)), stream=stream)


def copy_late(src: Any, dst: Any, stream: Any = None, ns: int = HOLD_NS) -> None:
    """``dst[:] = src`` (bytes) by a kernel that first spins ``ns``: a reader still
    queued when ``src`` is freed."""
    import cupy

    s, d = as_bytes(src), as_bytes(dst)
    _kernels().get_function("spin_then_copy")((256,), (256,), (s, d, cupy.uint64(s.size), cupy.uint64(ns)),
                                              stream=stream)
