"""A tensor larger than one gRPC message (2 GiB) moves over the chunked stream."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import cluster, key, run


@pytest.mark.huge
@pytest.mark.timeout(300)
def test_over_two_gib_over_grpc_stream():
    n = (2 << 30) + 4096 + 3  # just past 2 GiB, odd length

    async def main():
        async with cluster(2, chunk_bytes=4 << 20) as (a, b):
            value = np.empty(n, dtype=np.uint8)
            value[: 1 << 20] = np.arange(1 << 20, dtype=np.uint32).astype(np.uint8)
            value[-(1 << 20):] = 7
            value[1 << 20: -(1 << 20)] = 1
            b.send(key(1, 0, "huge"), value)
            got = await a.recv(key(1, 0, "huge"), timeout=280)
            assert got.nbytes == n
            # spot-check both ends and a stride through the middle
            assert np.array_equal(got[: 1 << 20], value[: 1 << 20])
            assert np.array_equal(got[-(1 << 20):], value[-(1 << 20):])
            assert np.array_equal(got[::4099], value[::4099])
    run(main(), timeout=290)
