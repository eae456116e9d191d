"""The ``rendezvous`` command (also ``python -m rendezvous``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from .config import Config, Protocol

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

    s = sub.add_parser("serve", help="run one rank server (or, with --daemon, rendezvousd) until SIGINT/SIGTERM",
                       description="Run the rank server of one task; with --daemon, the node's rendezvousd. "
                                   "Ctrl-C or SIGTERM drains and exits 0. Settings: flags, then environment, "
                                   "then the --config file, then defaults.")
    add_serve_arguments(s, daemon_flag=True)

    g = sub.add_parser("get", help="fetch one tensor from a rank server",
                       description="Send one RecvTensor request and print what comes back.")
    g.add_argument("key", metavar="KEY", help="rendezvous key: src_device;incarnation;dst_device;name;frame:iter")
    g.add_argument("--from", dest="address", required=True, metavar="HOST:PORT", help="the producing rank's server")
    g.add_argument("--step", type=int, default=0, metavar="N", help="step id (default 0)")
    g.add_argument("--timeout", type=float, default=30.0, metavar="S", help="deadline in seconds (default 30)")
    g.add_argument("--text", action="store_true", help="print the reply's TensorProto in protobuf text format")
    g.add_argument("--save", metavar="FILE.npy", help="also save the tensor with numpy.save")
    sec = g.add_argument_group("security (for servers with a token or TLS)")
    sec.add_argument("--token", default=os.environ.get("RENDEZVOUS_TOKEN", ""), metavar="TOKEN",
                     help="deprecated (a command line is visible to every user in the process list): use "
                          "--token-file or RENDEZVOUS_TOKEN. The shared token, sent as 'authorization: Bearer TOKEN'")
    sec.add_argument("--token-file", default=os.environ.get("RENDEZVOUS_TOKEN_FILE", ""), metavar="FILE",
                     help="read the token from FILE (env RENDEZVOUS_TOKEN_FILE)")
    sec.add_argument("--tls-ca", default=os.environ.get("RENDEZVOUS_TLS_CA", ""), metavar="PEM",
                     help="connect over TLS, trusting this CA (env RENDEZVOUS_TLS_CA)")
    sec.add_argument("--tls-cert", default=os.environ.get("RENDEZVOUS_TLS_CERT", ""), metavar="PEM",
                     help="client certificate, for servers that demand one (env RENDEZVOUS_TLS_CERT)")
    sec.add_argument("--tls-key", default=os.environ.get("RENDEZVOUS_TLS_KEY", ""), metavar="PEM",
                     help="the client certificate's key (env RENDEZVOUS_TLS_KEY)")

    b = sub.add_parser("bench", help="benchmark every path against raw MPI, raw gRPC, gloo and memcpy",
                       description="Run the benchmark suite under mpiexec -n 2 (launched for you): table, "
                                   "JSON and plot. See BENCHMARKS.md.")
    from .bench.cli import add_arguments as bench_arguments  # stdlib only at import

    bench_arguments(b)
    from .bench import daemon as bench_daemon, scale as bench_scale, steps as bench_steps  # stdlib only at import

    for name, module in (("bench-steps", bench_steps), ("bench-daemon", bench_daemon), ("bench-scale", bench_scale)):
        module.add_arguments(sub.add_parser(name, help=module.HELP, description=module.DESCRIPTION,
                                            epilog=module.EPILOG))
    return p


#: serve/rendezvousd flag (argparse dest) -> Config field
_FLAG_FIELDS = {
    "cluster": "cluster", "job_name": "job_name", "task_index": "task_index", "protocol": "protocol",
    "grace": "grace", "local": "local_address", "metrics_port": "metrics_port", "metrics_host": "metrics_host",
    "stall_warning": "stall_warning", "log_format": "log_format", "mpi_requests": "mpi_requests",
}


def add_serve_arguments(p: argparse.ArgumentParser, daemon_flag: bool) -> None:
    """The flags of `rendezvous serve` and `rendezvousd`. Each overrides a config
    field (environment RENDEZVOUS_<FIELD>, the --config file, then the default)."""
    p.add_argument("--cluster", metavar="FILE|JSON",
                   help='cluster spec: a JSON file, or inline JSON like \'{"worker": ["127.0.0.1:50051"]}\' '
                        "(env RENDEZVOUS_CLUSTER)")
    p.add_argument("--job-name", metavar="J", help="this task's job (env RENDEZVOUS_JOB_NAME)")
    p.add_argument("--task-index", type=int, metavar="N",
                   help="this task's index (env RENDEZVOUS_TASK_INDEX; under mpiexec or srun: the rank; else 0)")
    p.add_argument("--protocol", choices=[p.value for p in Protocol], help="default grpc (env RENDEZVOUS_PROTOCOL)")
    p.add_argument("--mpi-requests", action="store_const", const=True, default=None,
                   help="under grpc+mpi, ask the ranks of the MPI job for tensors with MPI messages "
                        "(env RENDEZVOUS_MPI_REQUESTS=1)")
    p.add_argument("--grace", type=float, metavar="S",
                   help="seconds a drain keeps serving what was produced here, until all is consumed (default 10)")
    p.add_argument("--config", metavar="FILE", help="TOML file of config fields (env RENDEZVOUS_CONFIG)")
    p.add_argument("--print-config", action="store_true",
                   help="print the effective config and where each value came from, then exit")
    if daemon_flag:
        p.add_argument("--daemon", action="store_true",
                       help="run rendezvousd: local clients, metrics, health (the same as the rendezvousd command)")
    d = p.add_argument_group("daemon")
    d.add_argument("--local", metavar="ADDRESS",
                   help="where local clients connect: unix:PATH or HOST:PORT; {job_name} and {task_index} are "
                        "replaced (default unix:$XDG_RUNTIME_DIR/rendezvous/rendezvousd.sock or "
                        "/run/rendezvous/rendezvousd.sock)")
    d.add_argument("--metrics-port", type=int, metavar="PORT", help="Prometheus /metrics port; 0: any; -1: off")
    d.add_argument("--metrics-host", metavar="HOST", help="metrics bind address (default: this task's host)")
    d.add_argument("--stall-warning", type=float, metavar="S",
                   help="log a recv waiting longer than this (default 60; 0: never)")
    d.add_argument("--log-format", choices=["text", "json"], help="log lines as text (default) or JSON")


def daemon_parser() -> argparse.ArgumentParser:
    """The `rendezvousd` command's parser."""
    p = argparse.ArgumentParser(
        prog="rendezvousd",
        description="The rendezvous daemon of one node: a rank that holds the node's waiting table, serves "
                    "other nodes, and lets local processes send and recv through it. SIGTERM drains, exits 0.",
        epilog="examples:\n"
               "  mpiexec -n 2 -ppn 1 rendezvousd --cluster cluster.json --job-name node --protocol grpc+mpi\n"
               "  rendezvousd --config /etc/rendezvous/rendezvousd.toml --print-config\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    add_serve_arguments(p, daemon_flag=False)
    return p


def _quiet_grpc() -> None:
    # A program, unlike a library, owns its environment: keep gRPC's C core
    # (connection events at INFO) off stderr unless the user chose a verbosity.
    # Read when gRPC initializes, so set before any channel or server exists.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


def daemon_main(argv: list[str] | None = None) -> int:
    """Entry point of `rendezvousd`."""
    _quiet_grpc()
    args = daemon_parser().parse_args(argv)
    args.daemon = True
    return _serve(args, daemon_parser())


def _load_config(args: argparse.Namespace):
    import dataclasses

    overrides = {field: getattr(args, dest) for dest, field in _FLAG_FIELDS.items()
                 if getattr(args, dest, None) is not None}
    file = args.config or os.environ.get("RENDEZVOUS_CONFIG") or None
    cfg = Config.load(overrides, file=file)
    flags = {field: "flag --" + dest.replace("_", "-") for dest, field in _FLAG_FIELDS.items()
             if field in overrides}
    return dataclasses.replace(cfg, sources={**cfg.sources, **flags})


def main(argv: list[str] | None = None) -> int:
    _quiet_grpc()
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args, parser)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "get":
        return _get(args, argv)
    if args.command == "bench":
        from .bench.cli import run as bench

        return bench(args)
    if args.command in ("bench-steps", "bench-daemon", "bench-scale"):
        from importlib import import_module

        return import_module(f".bench.{args.command[6:]}", __package__).run(args)
    _parser().print_help()
    return 2


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .errors import RendezvousError
    from .lifecycle import run_until_signalled
    from . import aio
    from .daemon import daemon, setup

    command = "rendezvousd" if parser.prog == "rendezvousd" else "rendezvous serve"
    try:
        cfg = _load_config(args)
        identity = setup.resolve_identity(cfg) if cfg.cluster and cfg.job_name else None
    except RendezvousError as exc:
        print(f"{command}: {exc.code.name}: {exc.message}", file=sys.stderr)
        return 2
    except ValueError as exc:  # inline cluster JSON
        print(f"{command}: INVALID_ARGUMENT: cluster is not JSON: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        sys.stdout.write(setup.render_config(cfg, identity))
        return 0
    if identity is None:
        parser.error("serve needs --cluster and --job-name (or RENDEZVOUS_CLUSTER and RENDEZVOUS_JOB_NAME, "
                     "or the config file)")
    verbose = getattr(args, "verbose", 0)
    level = [None, logging.INFO, logging.DEBUG][min(verbose, 2)]
    if args.daemon:
        setup.setup_logging(cfg, level)
        return daemon.run(cfg)
    logging.basicConfig(level=level or logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cluster, job_name, task_index, _ = identity

    async def start() -> aio.Server:
        server = aio.Server(cluster, job_name, task_index, cfg.protocol, config=cfg)
        await server.start()
        return server

    return run_until_signalled(
        start, prog="rendezvous serve", uvloop=cfg.uvloop, stop=lambda s: s.stop(cfg.grace),
        announce=lambda s: f"rendezvous: task {s.task} serving on {s.target} (protocol {s.protocol})")


def _get_security(args: argparse.Namespace) -> tuple[Any, tuple[tuple[str, str], ...]]:
    """(TLS channel credentials or None, token metadata) from ``get``'s flags."""
    from . import auth

    token = auth.read_token(args.token, args.token_file, "--token-file")
    credentials = auth.tls_channel_credentials(args.tls_ca, args.tls_cert, args.tls_key,
                                               ("--tls-ca", "--tls-cert", "--tls-key"))
    return credentials, auth.token_metadata(token)


def _get(args: argparse.Namespace, argv: list[str]) -> int:
    import grpc
    import numpy as np
    from google.protobuf import text_format

    from . import frames
    from .errors import RendezvousError, from_status
    from .keys import parse_key
    from .rpc.options import UNARY_METHOD, local_channel_options
    from .v1 import rendezvous_pb2 as pb

    try:
        parse_key(args.key)
        request = pb.RecvTensorRequest(step_id=args.step, rendezvous_key=args.key)
        if "--token" in argv or any(a.startswith("--token=") for a in argv):
            print("rendezvous get: warning: --token is deprecated and will be removed: a token on the command "
                  "line shows in the process list to every user; use --token-file FILE or RENDEZVOUS_TOKEN",
                  file=sys.stderr)
        credentials, metadata = _get_security(args)
        options = local_channel_options()
        channel = (grpc.secure_channel(args.address, credentials, options=options) if credentials
                   else grpc.insecure_channel(args.address, options=options))
        with channel as ch:
            call = ch.unary_unary(UNARY_METHOD)
            try:
                raw = call(request.SerializeToString(), timeout=args.timeout, metadata=metadata or None)
            except grpc.RpcError as exc:
                raise from_status(exc.code(), exc.details() or "") from None
    except RendezvousError as exc:
        print(f"rendezvous get: {exc.code.name}: {exc.message}", file=sys.stderr)
        return 1
    if args.text:
        print(text_format.MessageToString(pb.RecvTensorResponse.FromString(raw)), end="")
        return 0
    try:
        head = frames.parse_response(raw)
        if head.is_dead:
            print("dead tensor (the producer's branch did not run)")
            return 0
        limit = Config.load().max_tensor_bytes  # what the server announces is checked first
        value = frames.decode_inline(raw, head.tensor, max_bytes=limit) if head.tensor else None
    except RendezvousError as exc:
        print(f"rendezvous get: malformed reply: {exc.code.name}: {exc.message}", file=sys.stderr)
        return 1
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
