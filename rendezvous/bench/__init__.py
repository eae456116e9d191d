"""The benchmark suite: ``rendezvous bench``, ``bench-steps``, ``bench-daemon`` and
``bench-scale`` (``make bench``). See BENCHMARKS.md for the method and the
latest results.

``rendezvous bench``: two ranks under ``mpiexec -n 2`` move the same bytes
every way a user might: raw MPI, a raw gRPC unary call, rendezvous on its
default (gRPC inline) and optimal (MPI) paths, torch.distributed gloo when
torch is installed, and a memcpy as the ceiling; interleaved, in one run.
Also the rate with many recvs outstanding, peak RSS during one large
transfer, and the CPU an idle rank uses.

Shared by every command:

* :mod:`.procs`: child processes (``mpiexec`` jobs, daemons, ranks, spawned
  workers) started, watched, timed out and stopped; result lines;
  :mod:`.control`: JSON lines over a Unix socket with children no pipe
  reaches;
* :mod:`.results`: what raw measurements come to (ratios, targets, the
  ``bench.json`` schema); :mod:`.report`: every table, Markdown page, JSON
  file and plot, and the progress bar;
* :mod:`.stats` (numbers), :mod:`.rss` (memory and CPU of a process),
  :mod:`.footprint` (connections, threads, descriptors of a process),
  :mod:`.models` (the parameter shapes of real models).

Per command:

* ``bench``: :mod:`.cli` (the command), :mod:`.worker` (one rank's
  schedule), :mod:`.contenders` and :mod:`.gpu` (the ways to move bytes);
* ``bench-steps``: :mod:`.steps` (whole model steps);
* ``bench-daemon``: :mod:`.daemon` (the command and its document),
  :mod:`.daemon_scenarios` (the scenarios), :mod:`.daemon_fleet` (its
  processes), :mod:`.daemon_workers` (what runs in them);
* ``bench-scale``: :mod:`.scale` (the command, one job per setup and size),
  :mod:`.scale_rank` (one rank).

Each command's module gives ``add_arguments`` (its flags, for the
``rendezvous`` parser), ``run`` (the command) and ``main`` (the same from a
command line); importing it costs nothing beyond the standard library.

Nothing here is imported by the library itself; rich (the progress bar and
the terminal's tables), matplotlib (the plot) and torch (gloo) are optional
and imported only when used.
"""
