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
  rendezvous get '/job:worker/replica:0/task:1/device:CPU:0;0000000000000000;/job:worker/replica:0/task:0/device:CPU:0;grad;0:0' \\
      --from 127.0.0.1:50052 --step 3 --text
  rendezvous health --from 127.0.0.1:50052      # exit 0 only when SERVING
  rendezvous pending                            # this node's rendezvousd, on its local socket
  rendezvous stats --from 10.0.0.1:50051 --json
  rendezvous bench --quick
  rendezvous doctor                             # before blaming the network
"""


def _version(prog: str) -> str:
    from importlib import metadata

    try:
        return f"{prog} {metadata.version('rendezvous')}"
    except metadata.PackageNotFoundError:
        return f"{prog} (version unknown: not installed)"


def _verbosity() -> argparse.ArgumentParser:
    """-v/--verbose for every subcommand, so it may follow the subcommand too;
    its count adds to one given before it (``-v serve -v`` is ``-vv``)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", dest="verbose_after", action="count", default=0,
                        help="more logging (-v info, -vv debug); before or after the subcommand, counts add")
    return common


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rendezvous",
        description="Hand tensors between the ranks of a training job by rendezvous key.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="more logging (-v info, -vv debug); before or after the subcommand, counts add")
    p.add_argument("--version", action="version", version=_version("rendezvous"))
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    common = _verbosity()

    def command(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], **kwargs)

    s = command("serve", help="run one rank server (or, with --daemon, rendezvousd) until SIGINT/SIGTERM",
                description="Run the rank server of one task; with --daemon, the node's rendezvousd. "
                            "Ctrl-C or SIGTERM drains and exits 0. Settings: flags, then environment, "
                            "then the --config file, then defaults.")
    add_serve_arguments(s, daemon_flag=True)

    g = command("get", help="fetch one tensor from a rank server",
                description="Send one RecvTensor request and print what comes back.")
    g.add_argument("key", metavar="KEY", help="rendezvous key: src_device;incarnation;dst_device;name;frame:iter")
    g.add_argument("--from", dest="address", required=True, metavar="HOST:PORT", help="the producing rank's server")
    g.add_argument("--step", type=int, default=0, metavar="N", help="step id (default 0)")
    g.add_argument("--timeout", type=float, default=30.0, metavar="S", help="deadline in seconds (default 30)")
    g.add_argument("--text", action="store_true", help="print the reply's TensorProto in protobuf text format")
    g.add_argument("--save", metavar="FILE.npy", help="also save the tensor with numpy.save")
    _add_security(g)

    for name, what, description in (
            ("stats", "a running server's counters per path and its table's sizes",
             "Print a rank server's or rendezvousd's counters per path (local, grpc, mpi, gpu), the sizes of "
             "its waiting table and, for a daemon, its local clients and shared-memory pool."),
            ("pending", "what waits in a running server: tensors not consumed, recvs waiting",
             "List what waits in a rank server or rendezvousd, the oldest first: tensors produced and not "
             "consumed (tensor), recvs waiting for a producer (waiter), a daemon's local recvs waiting on "
             "another task (remote)."),
            ("health", "whether a running server serves (exit 0 SERVING, 1 not, 2 unreachable)",
             "Ask the standard gRPC health service. Prints SERVING, NOT_SERVING or unreachable; exits 0 only "
             "when SERVING, 1 when not, 2 when the server cannot be reached or answers with an error.")):
        a = command(name, help=what, description=description)
        _add_admin_arguments(a)
        if name == "health":
            a.add_argument("--service", default="", metavar="NAME",
                           help="one service's status (e.g. rendezvous.v1.LocalRendezvous; default: the server's)")

    b = command("bench", help="benchmark every path against raw MPI, raw gRPC, gloo and memcpy",
                description="Run the benchmark suite under mpiexec -n 2 (launched for you): table, "
                            "JSON and plot. See BENCHMARKS.md.")
    from .bench.cli import add_arguments as bench_arguments  # stdlib only at import

    bench_arguments(b)
    from .bench import daemon as bench_daemon, scale as bench_scale, steps as bench_steps  # stdlib only at import

    for name, module in (("bench-steps", bench_steps), ("bench-daemon", bench_daemon), ("bench-scale", bench_scale)):
        module.add_arguments(command(name, help=module.HELP, description=module.DESCRIPTION,
                                     epilog=module.EPILOG))
    from . import doctor  # stdlib only at import

    doctor.add_arguments(command("doctor", help=doctor.HELP, description=doctor.DESCRIPTION))
    return p


def _add_security(p: argparse.ArgumentParser) -> None:
    """The flags that reach a server with a token or TLS (get, stats, pending, health)."""
    sec = p.add_argument_group("security (for servers with a token or TLS; a unix: socket needs neither)")
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


def _add_admin_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from", dest="address", metavar="ADDRESS",
                   help="HOST:PORT of a rank server or daemon, or unix:PATH of a daemon's local socket "
                        "(default: this node's daemon, where rendezvousd would listen: RENDEZVOUS_LOCAL_ADDRESS, "
                        "else the default socket)")
    p.add_argument("--timeout", type=float, default=5.0, metavar="S", help="deadline in seconds (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON object (for scripts)")
    _add_security(p)


#: serve/rendezvousd flag (argparse dest) -> Config field
_FLAG_FIELDS = {
    "cluster": "cluster", "job_name": "job_name", "task_index": "task_index", "protocol": "protocol",
    "grace": "grace", "local": "local_address", "metrics_port": "metrics_port", "metrics_host": "metrics_host",
    "stall_warning": "stall_warning", "log_format": "log_format", "mpi_requests": "mpi_requests",
}
#: flags that act only in the daemon: `rendezvous serve` refuses them without --daemon
_DAEMON_ONLY = ("local", "metrics_port", "metrics_host")


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
    p.add_argument("--log-format", choices=["text", "json"],
                   help="log lines as text (default) or JSON objects (env RENDEZVOUS_LOG_FORMAT)")
    p.add_argument("--stall-warning", type=float, metavar="S",
                   help="log a recv waiting longer than this (default 60; 0: never)")
    p.add_argument("--config", metavar="FILE", help="TOML file of config fields (env RENDEZVOUS_CONFIG)")
    p.add_argument("--print-config", action="store_true",
                   help="print the effective config and where each value came from, then exit")
    if daemon_flag:
        p.add_argument("--daemon", action="store_true",
                       help="run rendezvousd: local clients, metrics (the same as the rendezvousd command)")
    d = p.add_argument_group("daemon only (with --daemon)" if daemon_flag else "daemon")
    d.add_argument("--local", metavar="ADDRESS",
                   help="where local clients connect: unix:PATH or HOST:PORT; {job_name} and {task_index} are "
                        "replaced (default unix:$XDG_RUNTIME_DIR/rendezvous/rendezvousd.sock or "
                        "/run/rendezvous/rendezvousd.sock)")
    d.add_argument("--metrics-port", type=int, metavar="PORT", help="Prometheus /metrics port; 0: any; -1: off")
    d.add_argument("--metrics-host", metavar="HOST", help="metrics bind address (default: this task's host)")



def daemon_parser() -> argparse.ArgumentParser:
    """The `rendezvousd` command's parser."""
    p = argparse.ArgumentParser(
        prog="rendezvousd",
        description="The rendezvous daemon of one node: a rank that holds the node's waiting table, serves "
                    "other nodes, and lets local processes send and recv through it. SIGTERM drains, exits 0.",
        epilog="examples:\n"
               "  mpiexec -n 2 -ppn 1 rendezvousd --cluster cluster.json --job-name node --protocol grpc+mpi\n"
               "  rendezvousd --config /etc/rendezvous/rendezvousd.toml --print-config\n"
               "  mpiexec -n 2 -ppn 1 rendezvousd --cluster cluster.json --job-name node -- python train.py\n"
               "      (each daemon runs train.py with RENDEZVOUS_LOCAL_ADDRESS set, and exits with its status\n"
               "       once it ends: the job ends when training does)\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    p.add_argument("--version", action="version", version=_version("rendezvousd"))
    add_serve_arguments(p, daemon_flag=False)
    return p


def _quiet_grpc() -> None:
    # A program, unlike a library, owns its environment: keep gRPC's C core
    # (connection events at INFO) off stderr unless the user chose a verbosity.
    # Read when gRPC initializes, so set before any channel or server exists.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


def _split_command(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """``[flags] -- COMMAND [ARGS...]``: (the flags, the program a daemon runs,
    None without ``--``)."""
    if "--" not in argv:
        return argv, None
    at = argv.index("--")
    return argv[:at], argv[at + 1:]


def daemon_main(argv: list[str] | None = None) -> int:
    """Entry point of `rendezvousd`."""
    _quiet_grpc()
    argv = sys.argv[1:] if argv is None else list(argv)
    argv, command = _split_command(argv)
    parser = daemon_parser()
    args = parser.parse_args(argv)
    if command == []:
        parser.error("-- needs a COMMAND after it")
    args.daemon = True
    args.run = command or []
    return _serve(args, parser)


def _load_config(args: argparse.Namespace):
    import dataclasses

    overrides = {field: getattr(args, dest) for dest, field in _FLAG_FIELDS.items()
                 if getattr(args, dest, None) is not None}
    file = args.config or os.environ.get("RENDEZVOUS_CONFIG") or None
    cfg = Config.load(overrides, file=file)
    flags = {field: "flag --" + dest.replace("_", "-") for dest, field in _FLAG_FIELDS.items()
             if field in overrides}
    return dataclasses.replace(cfg, sources={**cfg.sources, **flags})


def parse(argv: list[str], parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The ``rendezvous`` command's arguments; ``verbose`` counts every -v, before
    the subcommand and after it."""
    args = (parser or _parser()).parse_args(argv)
    args.verbose += getattr(args, "verbose_after", 0)
    return args


def main(argv: list[str] | None = None) -> int:
    _quiet_grpc()
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    head, command = _split_command(argv)
    if command is not None and "serve" not in head:
        head, command = argv, None  # a "--" that is not serve's
    args = parse(head, parser)
    if args.command == "serve":
        args.run = command or []
        if command == []:
            parser.error("-- needs a COMMAND after it")
        if command and not args.daemon:
            print("rendezvous serve: error: -- COMMAND runs a program beside the daemon: add --daemon",
                  file=sys.stderr)
            return 2
        given = [dest for dest in _DAEMON_ONLY if getattr(args, dest) is not None]
        if given and not args.daemon:
            flag = "--" + given[0].replace("_", "-")
            print(f"rendezvous serve: error: {flag} acts only in the daemon: add --daemon (or run rendezvousd)",
                  file=sys.stderr)
            return 2
        return _serve(args, parser)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "get":
        return _get(args, argv)
    if args.command in ("stats", "pending", "health"):
        return _admin(args, argv)
    if args.command == "bench":
        from .bench.cli import run as bench

        return bench(args)
    if args.command in ("bench-steps", "bench-daemon", "bench-scale"):
        from importlib import import_module

        return import_module(f".bench.{args.command[6:]}", __package__).run(args)
    if args.command == "doctor":
        from .doctor import run as doctor

        return doctor(args)
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
        prog = "rendezvousd" if args.daemon else "rendezvous serve"
        sys.stdout.write(setup.render_config(cfg, identity, prog))
        return 0
    if identity is None:
        parser.error("serve needs --cluster and --job-name (or RENDEZVOUS_CLUSTER and RENDEZVOUS_JOB_NAME, "
                     "or the config file)")
    verbose = getattr(args, "verbose", 0)
    level = [None, logging.INFO, logging.DEBUG][min(verbose, 2)]
    try:
        setup.setup_logging(cfg, level)
        if args.daemon:
            return daemon.run(cfg, command=getattr(args, "run", []))
        grpc_setup, token = setup.grpc_security(cfg)
    except RendezvousError as exc:
        print(f"{command}: {exc.code.name}: {exc.message}", file=sys.stderr)
        return 1
    cluster, job_name, task_index, _ = identity
    secured = "".join((", TLS" if cfg.tls_cert else "", ", mutual TLS" if cfg.tls_client_auth else "",
                       ", token" if token else ""))

    async def start() -> aio.Server:
        server = aio.Server(cluster, job_name, task_index, cfg.protocol, config=cfg, grpc_setup=grpc_setup)
        await server.start()
        return server

    return run_until_signalled(
        start, prog="rendezvous serve", uvloop=cfg.uvloop, stop=lambda s: s.stop(cfg.grace),
        announce=lambda s: f"rendezvous: task {s.task} serving on {s.target} (protocol {s.protocol}{secured})")


# -- talking to a running server ------------------------------------------------------------


def _warn_token_flag(prog: str, argv: list[str]) -> None:
    if "--token" in argv or any(a.startswith("--token=") for a in argv):
        print(f"{prog}: warning: --token is deprecated and will be removed: a token on the command "
              "line shows in the process list to every user; use --token-file FILE or RENDEZVOUS_TOKEN",
              file=sys.stderr)


def _channel(args: argparse.Namespace, address: str) -> tuple[Any, tuple[tuple[str, str], ...]]:
    """A channel to ``address`` with the security flags applied, and the metadata
    every call carries (the token). A ``unix:`` socket is a daemon's local
    socket: plaintext, guarded by its file mode, no token."""
    import grpc

    from . import auth
    from .rpc.options import local_channel_options

    options = local_channel_options()
    if address.startswith("unix:"):
        return grpc.insecure_channel(address, options=options), ()
    token = auth.read_token(args.token, args.token_file, "--token-file")
    credentials = auth.tls_channel_credentials(args.tls_ca, args.tls_cert, args.tls_key,
                                               ("--tls-ca", "--tls-cert", "--tls-key"))
    channel = (grpc.secure_channel(address, credentials, options=options) if credentials
               else grpc.insecure_channel(address, options=options))
    return channel, auth.token_metadata(token)


def _get(args: argparse.Namespace, argv: list[str]) -> int:
    import grpc
    import numpy as np
    from google.protobuf import text_format

    from .codec.parsing import decode_inline, parse_response
    from .errors import RendezvousError, from_status
    from .keys import parse_key
    from .rpc.options import UNARY_METHOD
    from .v1 import rendezvous_pb2 as pb

    what = f"{args.key} (step {args.step}) from {args.address}"
    try:
        parse_key(args.key)
    except RendezvousError as exc:
        print(f"rendezvous get: {args.key!r} is not a rendezvous key: {exc.code.name}: {exc.message}",
              file=sys.stderr)
        return 1
    try:
        request = pb.RecvTensorRequest(step_id=args.step, rendezvous_key=args.key)
        _warn_token_flag("rendezvous get", argv)
        channel, metadata = _channel(args, args.address)
        with channel as ch:
            call = ch.unary_unary(UNARY_METHOD)
            try:
                raw = call(request.SerializeToString(), timeout=args.timeout, metadata=metadata or None)
            except grpc.RpcError as exc:
                raise from_status(exc.code(), exc.details() or "") from None
    except RendezvousError as exc:
        if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
            print(f"rendezvous get: no tensor for {args.key} (step {args.step}) from {args.address} within "
                  f"{args.timeout:g} s: DEADLINE_EXCEEDED: {exc.message}", file=sys.stderr)
        else:
            print(f"rendezvous get: {what}: {exc.code.name}: {exc.message}", file=sys.stderr)
        return 1
    if args.text:
        print(text_format.MessageToString(pb.RecvTensorResponse.FromString(raw)), end="")
        return 0
    try:
        head = parse_response(raw)
        if head.is_dead:
            print("dead tensor (the producer's branch did not run)")
            return 0
        limit = Config.load().max_tensor_bytes  # what the server announces is checked first
        value = decode_inline(raw, head.tensor, max_bytes=limit) if head.tensor else None
    except RendezvousError as exc:
        print(f"rendezvous get: {what}: malformed reply: {exc.code.name}: {exc.message}", file=sys.stderr)
        return 1
    if not isinstance(value, np.ndarray):
        print(f"rendezvous get: {what}: the reply carries no tensor", file=sys.stderr)
        return 1
    print(f"dtype={value.dtype} shape={tuple(value.shape)} nbytes={value.nbytes}")
    print(np.array2string(value, threshold=64))
    if args.save:
        np.save(args.save, value)
    return 0


def _default_address() -> str:
    """Where this node's daemon listens, as rendezvousd itself would resolve it."""
    from .daemon.setup import local_address
    from .errors import InvalidArgument

    cfg = Config.load(file=os.environ.get("RENDEZVOUS_CONFIG") or None)
    address, source = local_address(cfg, cfg.job_name, cfg.task_index)
    if "{job_name}" in address or "{task_index}" in address:
        raise InvalidArgument(f"the daemon's address {address!r} ({source}) names this task: set "
                              "RENDEZVOUS_JOB_NAME and RENDEZVOUS_TASK_INDEX, or give --from")
    return address


def _admin(args: argparse.Namespace, argv: list[str]) -> int:
    """`rendezvous stats`, `pending` and `health`: one call to a running server."""
    import grpc

    from .errors import RendezvousError
    from .local.address import parse_local_address

    prog = f"rendezvous {args.command}"
    failed = 2 if args.command == "health" else 1
    try:
        address = args.address or _default_address()
        if address.startswith("unix:"):
            path = parse_local_address(address).where
            if not os.path.exists(path):
                return _unreachable(args, prog, address, f"no socket at {path}: is rendezvousd running on this "
                                                         "node? (start it, or give --from HOST:PORT or unix:PATH)")
        _warn_token_flag(prog, argv)
        channel, metadata = _channel(args, address)
    except RendezvousError as exc:
        print(f"{prog}: {exc.code.name}: {exc.message}", file=sys.stderr)
        return failed
    with channel:
        try:
            if args.command == "health":
                return _health(args, channel, address)
            if args.command == "stats":
                return _stats(args, channel, metadata, address)
            return _pending(args, channel, metadata, address)
        except grpc.RpcError as exc:
            return _rpc_failed(args, prog, address, exc)


def _unreachable(args: argparse.Namespace, prog: str, address: str, why: str) -> int:
    if args.command == "health":
        _say(args, "unreachable", {"address": address, "status": "UNREACHABLE", "error": why})
    print(f"{prog}: cannot reach {address}: {why}", file=sys.stderr)
    return 2 if args.command == "health" else 1


def _rpc_failed(args: argparse.Namespace, prog: str, address: str, exc: Any) -> int:
    import grpc

    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE:
        return _unreachable(args, prog, address, details)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return _unreachable(args, prog, address, f"no answer within {args.timeout:g} s")
    if code == grpc.StatusCode.UNIMPLEMENTED:
        service = "grpc.health.v1.Health" if args.command == "health" else "rendezvous.v1.Admin"
        why = f"{address} does not serve {service} (not a rendezvous server, or one older than this command)"
    elif code == grpc.StatusCode.UNAUTHENTICATED:
        why = (f"{address} refused the call: UNAUTHENTICATED: {details} "
               "(give --token-file FILE or RENDEZVOUS_TOKEN)")
    elif code == grpc.StatusCode.NOT_FOUND and args.command == "health":
        why = f"{address} knows no service {args.service!r}"
    else:
        why = f"{address}: {code.name}: {details}"
    if args.command == "health":
        _say(args, "error", {"address": address, "status": "ERROR", "error": why})
    print(f"{prog}: {why}", file=sys.stderr)
    return 2 if args.command == "health" else 1


def _say(args: argparse.Namespace, text: str, data: dict[str, Any]) -> None:
    """``text`` on stdout, or ``data`` as one JSON object with --json."""
    import json

    print(json.dumps(data) if args.json else text)


def _plain(value: Any) -> Any:
    """A Struct's numbers as ints where they are whole (counters are)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _health(args: argparse.Namespace, channel: Any, address: str) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=args.service),
                                                      timeout=args.timeout)
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    _say(args, status, {"address": address, "service": args.service, "status": status})
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


#: the counters of a path, in the order `rendezvous stats` shows them
_COUNTERS = ("transfers", "bytes", "errors", "fallbacks", "served", "served_bytes", "served_fused", "in_flight")


def _stats(args: argparse.Namespace, channel: Any, metadata: Any, address: str) -> int:
    from google.protobuf.json_format import MessageToDict

    from .v1 import admin_pb2, admin_pb2_grpc

    reply = admin_pb2_grpc.AdminStub(channel).Stats(admin_pb2.StatsRequest(), timeout=args.timeout,
                                                     metadata=metadata or None)
    paths = _plain(MessageToDict(reply.paths))
    table = _plain(MessageToDict(reply.table))
    daemon = _plain(MessageToDict(reply.daemon))
    if args.json:
        _say(args, "", {"address": address, "task": reply.task, "protocol": reply.protocol, "paths": paths,
                        "table": table, "daemon": daemon})
        return 0
    lines = [f"{reply.task} at {address} (protocol {reply.protocol})"]
    rows = [name for name in ("local", "grpc", "mpi", "ipc") if name in paths]
    columns = [c for c in _COUNTERS if any(c in paths[r] for r in rows)]
    columns += sorted({c for r in rows for c in paths[r]} - set(columns))
    grid = [["path", *columns]] + [[r, *(str(paths[r].get(c, "-")) for c in columns)] for r in rows]
    widths = [max(len(line[i]) for line in grid) for i in range(len(grid[0]))]
    for line in grid:
        lines.append("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(line, widths))).rstrip())

    def section(name: str, values: dict[str, Any]) -> None:
        flat = {k: v for k, v in sorted(values.items()) if not isinstance(v, dict)}
        if flat:
            lines.append(f"{name}: " + ", ".join(f"{k} {_shown(v)}" for k, v in flat.items()))
        for k, v in sorted(values.items()):
            if isinstance(v, dict) and v:
                section(k, v)

    for name in sorted(set(paths) - set(rows)):
        section(name, paths[name])
    section("table", table)
    section("daemon", daemon)
    print("\n".join(lines))
    return 0


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def _pending(args: argparse.Namespace, channel: Any, metadata: Any, address: str) -> int:
    from .v1 import admin_pb2_grpc
    from .v1 import local_pb2 as lpb

    reply = admin_pb2_grpc.AdminStub(channel).Pending(lpb.PendingRequest(), timeout=args.timeout,
                                                       metadata=metadata or None)
    if args.json:
        entries = [{"kind": e.kind, "step_id": e.step_id, "key": e.rendezvous_key, "count": e.count,
                    "oldest_age_seconds": round(e.oldest_age_seconds, 6), "producer": e.producer}
                   for e in reply.entries]
        _say(args, "", {"address": address, "entries": entries, "omitted": reply.omitted})
        return 0
    if not reply.entries and not reply.omitted:
        print(f"nothing pending at {address}")
        return 0
    for e in reply.entries:
        print(f"{e.kind:<6}  step {e.step_id}  count {e.count}  age {e.oldest_age_seconds:.1f}s  "
              f"{e.rendezvous_key}  (producer {e.producer})")
    if reply.omitted:
        print(f"{reply.omitted} more not shown")
    return 0


if __name__ == "__main__":
    sys.exit(main())
