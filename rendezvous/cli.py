"""The ``rendezvous`` command (also ``python -m rendezvous``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from typing import Any

__all__ = ["main"]

EPILOG = """\
examples:
  rendezvous serve --cluster cluster.json --job-name worker --task-index 0
  rendezvous get '/job:worker/replica:0/task:1/device:CPU:0;0000000000000001;/job:worker/replica:0/task:0/device:CPU:0;grad;0:0' \\
      --from 127.0.0.1:50052 --step 3 --text
  rendezvous bench --quick
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rendezvous",
        description="Hand tensors between the ranks of a training job by rendezvous key.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    s = sub.add_parser("serve", help="run one rank server until SIGINT/SIGTERM",
                       description="Run the rank server of one task. Ctrl-C or SIGTERM drains and exits 0. "
                                   "Each flag falls back to an environment variable.")
    s.add_argument("--cluster", default=os.environ.get("RENDEZVOUS_CLUSTER"), metavar="FILE|JSON",
                   help='cluster spec: a JSON file, or inline JSON like \'{"worker": ["127.0.0.1:50051"]}\' '
                        "(env RENDEZVOUS_CLUSTER)")
    s.add_argument("--job-name", default=os.environ.get("RENDEZVOUS_JOB_NAME"), metavar="J",
                   help="this task's job (env RENDEZVOUS_JOB_NAME)")
    s.add_argument("--task-index", type=int, default=_default_task_index(), metavar="N",
                   help="this task's index (env RENDEZVOUS_TASK_INDEX; under mpiexec or srun: the rank; else 0)")
    s.add_argument("--protocol", default="grpc", choices=["grpc", "grpc+mpi"])
    s.add_argument("--grace", type=float, default=5.0, metavar="S",
                   help="seconds replies in flight may take to finish at shutdown (default 5)")

    g = sub.add_parser("get", help="fetch one tensor from a rank server",
                       description="Send one RecvTensor request and print what comes back.")
    g.add_argument("key", metavar="KEY", help="rendezvous key: src_device;incarnation;dst_device;name;frame:iter")
    g.add_argument("--from", dest="address", required=True, metavar="HOST:PORT", help="the producing rank's server")
    g.add_argument("--step", type=int, default=0, metavar="N", help="step id (default 0)")
    g.add_argument("--timeout", type=float, default=30.0, metavar="S", help="deadline in seconds (default 30)")
    g.add_argument("--text", action="store_true", help="print the reply's TensorProto in protobuf text format")
    g.add_argument("--save", metavar="FILE.npy", help="also save the tensor with numpy.save")

    b = sub.add_parser("bench", help="benchmark every path against raw MPI, raw gRPC, gloo and memcpy",
                       description="Run the benchmark suite under mpiexec -n 2 (launched for you): table, "
                                   "JSON and plot. See BENCHMARKS.md.")
    from .bench.cli import add_arguments as bench_arguments  # stdlib only at import

    bench_arguments(b)
    return p


def _default_task_index() -> int:
    raw = os.environ.get("RENDEZVOUS_TASK_INDEX")
    if raw is not None and raw.isdigit():
        return int(raw)
    from .launch import launcher_rank

    found = launcher_rank()
    return found[0] if found else 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "serve" and (not args.cluster or not args.job_name):
        parser.error("serve needs --cluster and --job-name (or RENDEZVOUS_CLUSTER and RENDEZVOUS_JOB_NAME)")
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return _serve(args)
    if args.command == "get":
        return _get(args)
    if args.command == "bench":
        from .bench.cli import run as bench

        return bench(args)
    _parser().print_help()
    return 2


def _cluster_arg(text: str) -> Any:
    return json.loads(text) if text.lstrip().startswith("{") else text


def _serve(args: argparse.Namespace) -> int:
    from .errors import RendezvousError
    from .sync import new_event_loop
    from . import aio

    async def run() -> None:
        server = aio.Server(_cluster_arg(args.cluster), args.job_name, args.task_index, args.protocol)
        await server.start()
        loop = asyncio.get_running_loop()
        stopping = False

        def on_signal() -> None:
            nonlocal stopping
            if stopping:  # a second signal: leave at once
                print("rendezvous: second signal, exiting now", file=sys.stderr, flush=True)
                raise SystemExit(1)
            stopping = True
            loop.create_task(server.stop(args.grace))

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        # Announce only once the handlers are in place: whoever reads this line may signal at once.
        print(f"rendezvous: task {server.task} serving on {server.target} (protocol {server.protocol})",
              flush=True)
        await server.wait_for_termination()

    loop = new_event_loop()
    try:
        loop.run_until_complete(run())
    except RendezvousError as exc:
        print(f"rendezvous serve: {exc.code.name}: {exc.message}", file=sys.stderr)
        return 1
    finally:
        loop.close()
    return 0


def _get(args: argparse.Namespace) -> int:
    import grpc
    import numpy as np
    from google.protobuf import text_format

    from . import frames
    from .errors import RendezvousError, from_status
    from .keys import parse_key
    from .v1 import rendezvous_pb2 as pb

    try:
        parse_key(args.key)
        request = pb.RecvTensorRequest(step_id=args.step, rendezvous_key=args.key)
        with grpc.insecure_channel(args.address, options=[("grpc.max_receive_message_length", -1)]) as ch:
            call = ch.unary_unary("/rendezvous.v1.Rendezvous/RecvTensor")
            try:
                raw = call(request.SerializeToString(), timeout=args.timeout)
            except grpc.RpcError as exc:
                raise from_status(exc.code(), exc.details() or "") from None
    except RendezvousError as exc:
        print(f"rendezvous get: {exc.code.name}: {exc.message}", file=sys.stderr)
        return 1
    if args.text:
        print(text_format.MessageToString(pb.RecvTensorResponse.FromString(raw)), end="")
        return 0
    head = frames.parse_response(raw)
    if head.is_dead:
        print("dead tensor (the producer's branch did not run)")
        return 0
    value = frames.decode_inline(raw, head.tensor) if head.tensor else None
    if not isinstance(value, np.ndarray):
        print("rendezvous get: reply carries no tensor", file=sys.stderr)
        return 1
    print(f"dtype={value.dtype} shape={tuple(value.shape)} nbytes={value.nbytes}")
    print(np.array2string(value, threshold=64))
    if args.save:
        np.save(args.save, value)
    return 0


if __name__ == "__main__":
    sys.exit(main())
