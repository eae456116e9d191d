"""GPU tensors over MPI with a host-memory stand-in for the GPU (runs everywhere)."""

from __future__ import annotations

import pytest

from test_mpi import HERE, launch

pytestmark = pytest.mark.mpi
SCRIPT = str(HERE / "gpu_scenarios.py")


# With requests over MPI, the smallest host tensor received onto the GPU (c2g,
# below one frame) comes inside its reply, then goes to the device in one copy:
# one staged receive fewer, one copy to the device more, and that inline reply
# counted as an MPI transfer too.
REQUESTS = ["0", "1"]
IDS = ["grpc-requests", "mpi-requests"]


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("requests", REQUESTS, ids=IDS)
def test_staged_gpu_transfers_over_mpi(requests):
    _, results, out = launch(2, "transfers", env={"MPI_OPTIMAL_PATH": "1", "RENDEZVOUS_MPI_REQUESTS": requests},
                             timeout=140, script=SCRIPT)
    assert "CUDA-aware MPI: no (MPIX_" in out  # probed from the MPI library at start-up
    inline = requests == "1"
    for r in results:
        gpu = r["stats"]["gpu"]
        assert gpu["cuda_aware"] == 0
        # produced on the fake GPU: g2g, g2c (3 sizes each), 6 re-sends, the late one, the OOM one
        assert gpu["staged_sends"] == 3 + 3 + 6 + 1 + 1, gpu
        # received onto the fake GPU: g2g, c2g, re-sends, the late one
        assert gpu["staged_recvs"] == 3 + 3 + 6 + 1 - inline, gpu
        assert gpu["to_device"] == 1 + inline, gpu
        assert gpu["direct_sends"] == gpu["direct_recvs"] == 0
        assert r["stats"]["mpi"]["transfers"] == 9 + 6 + 1 + inline
        # pinned buffers come back to the pool: far fewer allocations than chunks moved
        assert r["pinned_allocs"] <= 16, r["pinned_allocs"]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("requests", REQUESTS, ids=IDS)
def test_cuda_aware_mpi_takes_device_buffers_directly(requests):
    _, results, out = launch(2, "transfers", env={"MPI_OPTIMAL_PATH": "1", "RENDEZVOUS_CUDA_AWARE": "1",
                                                  "RENDEZVOUS_MPI_REQUESTS": requests}, timeout=140, script=SCRIPT)
    assert "CUDA-aware MPI: yes (RENDEZVOUS_CUDA_AWARE)" in out
    inline = requests == "1"
    for r in results:
        gpu = r["stats"]["gpu"]
        assert gpu["cuda_aware"] == 1
        assert gpu["staged_sends"] == gpu["staged_recvs"] == 0, gpu
        assert gpu["direct_sends"] == 14 and gpu["direct_recvs"] == 13 - inline, gpu
        # no staging copies; only the tensor kept on the host after the full-device
        # recv goes to the device afterwards (3 MiB in 1 MiB chunks), and with
        # requests over MPI the small inline one (one copy)
        assert r["copies"] == {"d2h": 0, "h2d": 3 + inline}
        assert gpu["to_device"] == 1 + inline


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["event", "refused"])
@pytest.mark.parametrize("dst_kind", ["GPU", "CPU"])
def test_a_staged_send_that_fails_partway_fails_its_recv_at_once(dst_kind, how):
    # the copy of chunk 3 of 6 fails on its stream (its event reports the error),
    # or cannot be queued; the consumer (onto its GPU, or its host) has a 40 s deadline
    _, results, out = launch(2, "aborted", dst_kind, how, env={"MPI_OPTIMAL_PATH": "1"}, timeout=110,
                             script=SCRIPT)
    for r in results:
        gpu = r["stats"]["gpu"]
        # both went staged over MPI; a receive is counted once it is whole
        # the given-up tensor went back and was sent again: 3 sends, 2 whole receives
        assert gpu["staged_sends"] == 3 and gpu["staged_recvs"] == 2 * (dst_kind == "GPU"), gpu
        assert r["left"] == [], r["left"]
        assert r["took"] < 10, r["took"]
        assert not r["violations"], r["violations"]
        assert r["pinned_held"] == 0 and r["pinned_out"] == 0, r


@pytest.mark.timeout(150)
@pytest.mark.parametrize("requests", REQUESTS, ids=IDS)
def test_ranks_of_one_node_move_gpu_tensors_by_ipc_and_host_ones_by_mpi(requests):
    _, results, out = launch(2, "ipc", env={"MPI_OPTIMAL_PATH": "1", "RENDEZVOUS_MPI_REQUESTS": requests},
                             timeout=140, script=SCRIPT)
    for r in results:
        stats, gpu = r["stats"], r["stats"]["gpu"]
        assert stats["ipc"]["transfers"] == 1 and gpu["ipc_sends"] == gpu["ipc_recvs"] == 1, stats
        assert stats["mpi"]["transfers"] >= 1 and gpu["staged_recvs"] == 1, stats  # the host tensor, by MPI
        assert gpu["staged_sends"] == 0 and not r["violations"]
