"""The benchmark suite: ``rendezvous bench`` (``make bench``).

Two ranks under ``mpiexec -n 2`` move the same bytes every way a user might:
raw MPI, a raw gRPC unary call, rendezvous on its default (gRPC inline) and
optimal (MPI) paths, torch.distributed gloo when torch is installed, and a
memcpy as the ceiling; interleaved, in one run. Also the rate with many
recvs outstanding, peak RSS during one large transfer, and the CPU an idle
rank uses. See BENCHMARKS.md for the method and the latest results.

Modules: :mod:`.stats` (numbers), :mod:`.contenders` (the ways to move
bytes), :mod:`.worker` (one rank's schedule), :mod:`.report` (the results
document, targets, table, plot), :mod:`.rss` (peak memory), :mod:`.cli`;
the other commands of ``make bench``: :mod:`.steps` (whole model steps),
:mod:`.daemon` (the daemon's paths), :mod:`.scale` (per-rank cost as the
number of peers grows).
Nothing here is imported by the library itself; matplotlib (the plot) and
torch (gloo) are optional and imported only when used.
"""
