"""deploy/: every manifest parses, every command in it is a real console script
whose flags the real argument parser accepts, and what they run works: the
systemd unit verifies and its install script creates what it names (the
service then serves and stops on its kill signal), the image holds every
file the manifests run, and the MPIJob's and the Slurm script's jobs, run
here under mpiexec, end when their trainers do, with their status."""

from __future__ import annotations

import configparser
import datetime
import ipaddress
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest

from proc_wait import wait_gone
import yaml

from rendezvous.cli import daemon_parser
from rendezvous.cluster import ClusterSpec
from rendezvous.config import ENV_VARS, Config

from test_daemon_cli import RENDEZVOUSD, Proc
from test_mpi import mpiexec

pytestmark = pytest.mark.timeout(30)
ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "rendezvousd.service"
SYSUSERS = DEPLOY / "systemd" / "rendezvous.sysusers"
INSTALL = DEPLOY / "systemd" / "install.sh"
TRAINED = re.compile(r"mpijob_train: node (\d+) of (\d+): (\d+) steps, "
                     r"loss ([\d.]+) -> ([\d.]+), params ([0-9a-f]{16})")
READY = re.compile(r"rendezvousd: (\S+) serving on (\S+) .*; local (\S+);")


def scripts() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def check_daemon_command(argv: list[str]) -> tuple[object, list[str], list[str]]:
    """Find `rendezvousd` in ``argv`` and parse its flags (what comes before a
    ``--``) with its real parser; also return the command after ``--`` (the
    daemon's child), if any."""
    names = [a for a in argv if Path(a).name == "rendezvousd"]
    assert names, f"no rendezvousd in {argv}"
    rest = argv[argv.index(names[0]) + 1:]
    flags, child = (rest[:rest.index("--")], rest[rest.index("--") + 1:]) if "--" in rest else (rest, [])
    parser = daemon_parser()

    def fail(message: str) -> None:
        raise AssertionError(f"rendezvousd refuses {flags}: {message}")

    parser.error = fail  # type: ignore[method-assign]
    return parser.parse_args(flags), rest, child


def unit() -> configparser.ConfigParser:
    parsed = configparser.ConfigParser(strict=False, interpolation=None)
    parsed.optionxform = str  # systemd keys are case-sensitive
    parsed.read_string(UNIT.read_text())
    return parsed


def env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, value = line.split("=", 1)
            env[name] = value
    return env


def mpijob() -> dict[str, dict]:
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "mpijob.yaml").read_text()))
    return {d["kind"]: d for d in docs}


def launcher_command() -> list[str]:
    job = mpijob()["MPIJob"]
    return job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["command"]


# --- the image --------------------------------------------------------------------------------

def dockerfile() -> list[str]:
    """deploy/Dockerfile's instructions, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def image_files() -> dict[str, Path]:
    """Path in the image -> the checkout's file that COPY puts there (the build
    context is the checkout's root: `docker build -f deploy/Dockerfile .`)."""
    files: dict[str, Path] = {}
    workdir = "/"
    for line in dockerfile():
        op, _, rest = line.partition(" ")
        if op == "WORKDIR":
            workdir = os.path.normpath(os.path.join(workdir, rest.strip()))
        elif op in ("COPY", "ADD"):
            words = json.loads(rest) if rest.lstrip().startswith("[") else shlex.split(rest)
            words = [w for w in words if not w.startswith("--")]
            *sources, dest = words
            dest_dir = dest.endswith("/") or len(sources) > 1
            dest = os.path.normpath(os.path.join(workdir, dest))
            for source in sources:
                src = ROOT / source
                assert src.exists(), f"COPY {source}: no such file in the checkout"
                if src.is_dir():
                    for f in src.rglob("*"):
                        if f.is_file():
                            files[os.path.join(dest, f.relative_to(src).as_posix())] = f
                else:
                    files[os.path.join(dest, src.name) if dest_dir else dest] = src
    return files


def image_provides(command: str) -> str | None:
    """How the image provides ``command`` (None: it does not)."""
    lines = dockerfile()
    pip = " ".join(line for line in lines if line.startswith("RUN ") and "pip install" in line)
    extras = set(re.findall(r"\.\[([a-z,]+)\]", pip)[0].split(",")) if re.search(r"\.\[", pip) else set()
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    apt = " ".join(line for line in lines if line.startswith("RUN ") and "apt-get install" in line)
    if command in image_files():
        return "COPY"
    if command in ("python", "python3") and lines[0].startswith("FROM python:"):
        return "the python base image"
    if command in scripts() and pip:
        return "pip install: console script"
    if command == "mpiexec" and "mpi" in extras and any(d.startswith("mpich") for d in optional["mpi"]):
        return "pip install: the mpich wheel"
    if command == "/usr/sbin/sshd" and "openssh-server" in apt.split():
        return "apt-get install openssh-server"
    return None


def run_job(argv: list[str], timeout: float, env: dict | None = None) -> tuple[int, str, str]:
    """Run ``argv`` in a session of its own; kill the whole session if it
    outlives ``timeout`` (then fail)."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                         text=True, start_new_session=True, env={**os.environ, **(env or {})})
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(f"{argv[:3]}... still running after {timeout}s\nstdout:\n{out[-3000:]}\n"
                             f"stderr:\n{err[-3000:]}") from None
    return p.returncode, out, err


def processes_mentioning(text: str) -> dict[int, str]:
    """pid -> command line of every process whose command line names ``text``
    (an exited one, a zombie, has none)."""
    found = {}
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if any(text.encode() in a for a in args):
            found[int(cmdline.parent.name)] = b" ".join(args).decode(errors="replace")
    return found


def assert_nothing_left(folder: Path, timeout: float = 10) -> None:
    """No process of the job is left (each one's command line names ``folder``),
    and no socket."""
    wait_gone(processes_mentioning(str(folder)), timeout)  # on their exits, at most the timeout
    left = processes_mentioning(str(folder))
    assert not left, f"processes outlived the job: {left}"
    assert not list(folder.glob("*.sock*")), list(folder.iterdir())


def local_daemon_command(argv: list[str], folder: Path, script: Path | None, steps: int = 20) -> list[str]:
    """A manifest's daemon command (from `rendezvousd` on) made to run its nodes
    on this machine: the cluster file ``folder``/cluster.json (see
    write_port0_cluster: grpc+mpi publishes the ports the OS chose), a socket
    per node in ``folder``, metrics on any port, this interpreter, the
    checkout's trainer (``script``), and ``steps`` training steps."""
    _, rest, child = check_daemon_command(argv)
    cluster = folder / "cluster.json"
    out, i = [RENDEZVOUSD], 0
    flags = rest[:rest.index("--")] if child else rest
    while i < len(flags):
        flag = flags[i]
        if flag in ("--cluster", "--local", "--metrics-port"):
            out += [flag, {"--cluster": str(cluster), "--local": f"unix:{folder}/node-{{task_index}}.sock",
                           "--metrics-port": "0"}[flag]]
            i += 2
        else:
            out.append(flag)
            i += 1
    if child:
        assert child[0] in ("python", "python3"), child
        args = child[2:]
        for j, a in enumerate(args[:-1]):
            if a == "--cluster":
                args[j + 1] = str(cluster)
        out += ["--", sys.executable, str(script or child[1]), *args, "--steps", str(steps)]
    return out


def write_port0_cluster(folder: Path, spec: ClusterSpec) -> None:
    (folder / "cluster.json").write_text(json.dumps(
        {job: ["127.0.0.1:0"] * len(tasks) for job, tasks in spec.jobs.items()}))


def assert_trained(out: str, nodes: int, steps: int) -> None:
    lines = TRAINED.findall(out)
    assert sorted(int(m[0]) for m in lines) == list(range(nodes)), out
    for node, of, done, first, last, _ in lines:
        assert (int(of), int(done)) == (nodes, steps)
        assert float(last) < float(first) / 10, f"node {node}: the loss did not fall: {first} -> {last}"
    assert len({m[5] for m in lines}) == 1, f"the nodes' parameters differ: {lines}"


@pytest.fixture
def jobdir():
    with tempfile.TemporaryDirectory(prefix="rdv", dir="/tmp") as d:  # short: socket paths
        yield Path(d)


# --- manifests --------------------------------------------------------------------------------

def test_console_scripts_exist():
    import importlib

    found = scripts()
    assert {"rendezvous", "rendezvousd"} <= set(found)
    for target in found.values():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func)), target


def test_cluster_file_and_hostfile_agree():
    spec = ClusterSpec.from_any(str(DEPLOY / "cluster.json"))
    hosts = [line.split(":")[0] for line in (DEPLOY / "hostfile").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert hosts == [spec.jobs["node"][i].rsplit(":", 1)[0] for i in sorted(spec.jobs["node"])]


def test_example_config_file_loads():
    cfg = Config.load(env={}, file=DEPLOY / "rendezvousd.toml")
    assert cfg.protocol == "grpc+mpi" and cfg.tls_client_auth is True
    assert cfg.sources["job_name"].startswith("file ")


def test_systemd_unit_and_environment_file():
    parsed = unit()
    service = parsed["Service"]
    args, _, child = check_daemon_command(shlex.split(service["ExecStart"]))
    assert args.protocol == "grpc" and args.local.startswith("unix:/run/rendezvous/") and not child
    assert service["RuntimeDirectory"] == "rendezvous"
    assert service["KillSignal"] == "SIGTERM"
    assert parsed["Install"]["WantedBy"] == "multi-user.target"
    env = env_file(DEPLOY / "systemd" / "rendezvousd.env")
    unknown = set(env) - set(ENV_VARS)
    assert not unknown, f"variables rendezvous does not read: {unknown}"
    assert service["EnvironmentFile"].endswith("rendezvousd.env")
    Config.load(env=env)  # every value reads


def test_slurm_script_runs_each_trainer_as_its_daemons_child():
    text = (DEPLOY / "slurm" / "rendezvous.sbatch").read_text()
    assert text.startswith("#!/bin/bash\n") and "#SBATCH --nodes=" in text
    joined = re.sub(r"\\\n\s*", " ", text)  # continuation lines
    steps = [line.strip() for line in joined.splitlines() if line.strip().startswith("srun ")]
    assert len(steps) == 1, steps
    assert "--ntasks-per-node=1" in steps[0] and not steps[0].endswith("&")
    args, _, child = check_daemon_command(shlex.split(steps[0]))
    assert args.protocol == "grpc+mpi" and args.job_name == "node"
    assert child[0] == "python" and "examples/mpijob_train.py" in child[1], child


def test_kubernetes_mpijob_runs_each_trainer_as_its_daemons_child():
    kinds = mpijob()
    assert set(kinds) == {"ConfigMap", "MPIJob"}
    job = kinds["MPIJob"]
    assert job["apiVersion"] == "kubeflow.org/v2beta1"
    config_map = kinds["ConfigMap"]
    spec = ClusterSpec.from_any(json.loads(config_map["data"]["cluster.json"]))
    workers = job["spec"]["mpiReplicaSpecs"]["Worker"]
    assert len(spec.jobs["node"]) == workers["replicas"]
    command = launcher_command()
    args, _, child = check_daemon_command(command)
    n = command[command.index("-n") + 1]
    assert int(n) == workers["replicas"] and command[command.index("-ppn") + 1] == "1"
    # the cluster flag points at the ConfigMap, mounted where mpiexec starts the daemons
    pod = workers["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["worker"], "the trainer is the daemon's child, not a container"
    volume = next(v for v in pod["volumes"] if v.get("configMap", {}).get("name") == config_map["metadata"]["name"])
    worker = pod["containers"][0]
    mount = next(m for m in worker["volumeMounts"] if m["name"] == volume["name"])
    assert args.cluster == f"{mount['mountPath']}/cluster.json"
    # the daemon starts the trainer, which reads the same cluster file
    assert child[:2] == ["python", "/app/train.py"], child
    assert child[child.index("--cluster") + 1] == args.cluster
    # the worker is ready when the launcher can reach it (sshd), not only once a daemon runs
    assert worker["command"][0] == "/usr/sbin/sshd"
    assert worker["readinessProbe"]["tcpSocket"]["port"] == 22


def test_dockerfile_installs_with_the_readmes_command():
    readme = (ROOT / "README.md").read_text()
    docker = (DEPLOY / "Dockerfile").read_text()
    install = re.search(r"^(pip install '\.\[[a-z,]+\]')", readme, re.M)
    assert install, "README has no install command for a checkout"
    runs = [line for line in docker.splitlines() if line.startswith("RUN ")]
    assert any(install.group(1) in line for line in runs), (install.group(1), runs)
    assert "daemon" in install.group(1)
    entry = next(line for line in docker.splitlines() if line.startswith("ENTRYPOINT"))
    assert json.loads(entry.split(None, 1)[1]) == ["rendezvousd"]
    cmd = next(line for line in docker.splitlines() if line.startswith("CMD"))
    check_daemon_command(["rendezvousd", *json.loads(cmd.split(None, 1)[1])])


def test_the_image_holds_every_command_and_file_the_mpijob_runs():
    files = image_files()
    job = mpijob()["MPIJob"]
    commands = []
    for replica in job["spec"]["mpiReplicaSpecs"].values():
        for container in replica["template"]["spec"]["containers"]:
            commands.append(container["command"])
            assert container["image"].split(":")[0] == "rendezvous", "the image of deploy/Dockerfile"
    _, _, child = check_daemon_command(launcher_command())
    commands += [["rendezvousd"], child]
    for command in commands:
        assert image_provides(command[0]), f"the image has no {command[0]!r}"
        for arg in command[1:]:
            if arg.startswith("/") and Path(arg).suffix in (".py", ".sh"):
                assert arg in files, f"{command[0]} runs {arg}, which no COPY in deploy/Dockerfile puts there"
                assert files[arg].is_file()
    # and the checks above can fail
    assert image_provides("/usr/bin/nothing") is None and "/app/nothing.py" not in files


def test_the_operators_page_lists_every_deploy_file():
    page = (ROOT / "server" / "README.md").read_text()  # the deploy table lives on rendezvousd's operator page
    files = [p.relative_to(ROOT).as_posix() for p in DEPLOY.rglob("*") if p.is_file()]
    missing = [f for f in files if f"`{f}`" not in page]
    assert not missing, f"server/README.md's deploy table lacks {missing}"


# --- systemd ----------------------------------------------------------------------------------

def systemd_tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"no {name} on this machine")
    return found


def verify(root: Path) -> subprocess.CompletedProcess:
    """`systemd-analyze verify` of the installed unit in the file system at ``root``."""
    return subprocess.run([systemd_tool("systemd-analyze"), "verify", "--man=no", "--generators=no",
                           f"--root={root}", "rendezvousd.service"], capture_output=True, text=True, timeout=60)


def add_system_units(root: Path) -> None:
    """The units every service depends on (sysinit.target, ...), from this machine."""
    units = Path("/usr/lib/systemd/system")
    if not (units / "sysinit.target").exists():
        pytest.skip("no systemd units on this machine")
    shutil.copytree(units, root / "usr/lib/systemd/system", symlinks=True)


def test_sysusers_file_creates_the_units_user_and_group(tmp_path):
    (tmp_path / "etc").mkdir()
    subprocess.run([systemd_tool("systemd-sysusers"), f"--root={tmp_path}", str(SYSUSERS)],
                   check=True, capture_output=True, timeout=30)
    service = unit()["Service"]
    users = {line.split(":")[0]: line.split(":") for line in (tmp_path / "etc/passwd").read_text().splitlines()}
    groups = {line.split(":")[0]: line.split(":") for line in (tmp_path / "etc/group").read_text().splitlines()}
    user = users[service["User"]]
    assert groups[service["Group"]][2] == user[3], "User='s primary group is Group="
    assert int(user[2]) < 1000, "a system user"


def test_systemd_analyze_verify_accepts_the_unit_with_its_command_in_place(jobdir):
    systemd_dir = jobdir / "etc/systemd/system"
    systemd_dir.mkdir(parents=True)
    shutil.copy(UNIT, systemd_dir / UNIT.name)
    add_system_units(jobdir)
    command = shlex.split(unit()["Service"]["ExecStart"])[0]
    # without the command the unit names, verify fails, naming it ...
    refused = verify(jobdir)
    assert refused.returncode != 0 and command in refused.stderr, refused
    # ... with it (a stand-in here: install.sh's virtualenv is tested below), it passes with nothing to say
    stub = jobdir / command.lstrip("/")
    stub.parent.mkdir(parents=True)
    stub.write_text("#!/bin/sh\n")
    stub.chmod(0o755)
    result = verify(jobdir)
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), result
    # a key systemd does not know is reported (verify still exits 0: the output is what tells)
    (systemd_dir / UNIT.name).write_text(UNIT.read_text().replace("KillMode=", "KilMode="))
    assert "Unknown key" in verify(jobdir).stderr


def make_pki(folder: Path, host: str = "127.0.0.1") -> None:
    """ca.pem, and node.pem/node.key signed by it for ``host`` (server and client use)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rendezvous test CA")])

    def cert(subject, public_key, extensions):
        b = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_name).public_key(public_key)
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
             .not_valid_after(now + datetime.timedelta(days=1)))
        for ext, critical in extensions:
            b = b.add_extension(ext, critical=critical)
        return b.sign(ca_key, hashes.SHA256())

    ca = cert(ca_name, ca_key.public_key(), [(x509.BasicConstraints(ca=True, path_length=None), True)])
    node = cert(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "node")]), key.public_key(), [
        (x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]), False),
        (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), False)])
    (folder / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (folder / "node.pem").write_bytes(node.public_bytes(serialization.Encoding.PEM))
    (folder / "node.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


@pytest.fixture(scope="module")
def installed():
    """deploy/systemd/install.sh run into a fresh root (DESTDIR), from this
    checkout, with this interpreter; the cluster file placed there first."""
    systemd_tool("systemd-sysusers")
    root = Path(tempfile.mkdtemp(prefix="rdv", dir="/tmp"))
    try:
        (root / "etc/rendezvous").mkdir(parents=True)
        cluster = json.dumps({"node": ["127.0.0.1:0"]})
        (root / "etc/rendezvous/cluster.json").write_text(cluster)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RENDEZVOUS_")}
        result = subprocess.run([str(INSTALL)], env={**env, "DESTDIR": str(root), "PYTHON": sys.executable},
                                capture_output=True, text=True, timeout=240)
        assert result.returncode == 0, result.stderr[-4000:]
        yield root, cluster, result.stdout
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_install_script_creates_what_the_unit_names(installed):
    root, cluster, output = installed
    service = unit()["Service"]
    # the user and group
    passwd = (root / "etc/passwd").read_text()
    assert re.search(rf"^{service['User']}:", passwd, re.M)
    assert re.search(rf"^{service['Group']}:", (root / "etc/group").read_text(), re.M)
    # ExecStart's command, a virtualenv's console script that runs
    command = root / shlex.split(service["ExecStart"])[0].lstrip("/")
    assert command.is_file() and os.access(command, os.X_OK)
    usage = subprocess.run([str(command), "--help"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 0 and usage.stdout.startswith("usage: rendezvousd"), usage
    # the environment file, where the unit reads it; a cluster file already there is kept
    assert (root / service["EnvironmentFile"].lstrip("/")).read_text() == \
        (DEPLOY / "systemd/rendezvousd.env").read_text()
    assert (root / "etc/rendezvous/cluster.json").read_text() == cluster
    assert (root / "etc/systemd/system/rendezvousd.service").read_text() == UNIT.read_text()
    # every file the environment file names, that nothing installs, is in the list of what to provide
    named = [Path(v).name for v in env_file(DEPLOY / "systemd/rendezvousd.env").values()
             if v.startswith("/etc/rendezvous/")]
    assert named and all(name in output for name in named), (named, output)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_systemd_analyze_verify_accepts_the_installed_unit(installed):
    root, _, _ = installed
    if not (root / "usr/lib/systemd/system").exists():
        add_system_units(root)
    result = verify(root)
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), result


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_installed_service_serves_over_tls_and_stops_on_its_kill_signal(installed):
    """ExecStart with the EnvironmentFile, in the installed root (its absolute
    paths under that root, metrics on any port), with the TLS files and token
    the list asks for: it serves local clients, its remote port takes only TLS
    with a client certificate, and KillSignal drains it to exit 0."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from rendezvous.client import Client

    root, _, _ = installed
    service = unit()["Service"]
    folder = root / "etc/rendezvous"
    make_pki(folder)
    (folder / "token").write_text(secrets.token_hex(16))
    run_dir = root / "run" / service["RuntimeDirectory"]
    run_dir.mkdir(parents=True, exist_ok=True)
    run_dir.chmod(int(service["RuntimeDirectoryMode"], 8))

    def here(value: str) -> str:
        return re.sub(r"(^|unix:)(/(etc|opt|run)/rendezvous)", lambda m: f"{m.group(1)}{root}{m.group(2)}", value)

    argv = [here(a) for a in shlex.split(service["ExecStart"])]
    argv[argv.index("--metrics-port") + 1] = "0"
    env = {k: here(v) for k, v in env_file(root / service["EnvironmentFile"].lstrip("/")).items()}
    daemon = Proc(argv, env=env)
    try:
        match = READY.match(daemon.line("rendezvousd: "))
        assert match, "ready line"
        target, local = match.group(2), match.group(3)
        assert local == argv[argv.index("--local") + 1]
        key = ("/job:node/replica:0/task:0/device:CPU:0;0000000000000000;"
               "/job:node/replica:0/task:0/device:CPU:1;t;0:0")
        with Client(local) as c:
            c.send(key, np.arange(1 << 17, dtype=np.int32), step_id=1)
            assert int(c.recv(key, step_id=1, timeout=10).sum()) == sum(range(1 << 17))
        request = health_pb2.HealthCheckRequest()
        tls = grpc.ssl_channel_credentials((folder / "ca.pem").read_bytes(), (folder / "node.key").read_bytes(),
                                           (folder / "node.pem").read_bytes())
        with grpc.secure_channel(target, tls) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(request, timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(target) as ch, pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(ch).Check(request, timeout=5)
        daemon.p.send_signal(getattr(signal, service["KillSignal"]))
        assert daemon.p.wait(int(service["TimeoutStopSec"])) == 0, "".join(daemon.err)[-3000:]
        assert not (run_dir / "rendezvousd.sock").exists()
    finally:
        daemon.kill()


# --- the trainer and the jobs -----------------------------------------------------------------

@pytest.mark.timeout(60)
def test_the_images_trainer_trains_through_a_daemon(jobdir):
    """/app/train.py of the image (the checkout's file COPY puts there) against
    a real daemon: it connects through RENDEZVOUS_LOCAL_ADDRESS, trains, and exits 0."""
    trainer = image_files()["/app/train.py"]
    (jobdir / "cluster.json").write_text(json.dumps({"node": ["127.0.0.1:0"]}))
    daemon = Proc([RENDEZVOUSD, "--cluster", str(jobdir / "cluster.json"), "--job-name", "node",
                   "--local", f"unix:{jobdir}/d.sock"])
    try:
        local = READY.match(daemon.line("rendezvousd: ")).group(3)
        rc, out, err = run_job([sys.executable, str(trainer), "--cluster", str(jobdir / "cluster.json"),
                                "--steps", "15"], timeout=45, env={"RENDEZVOUS_LOCAL_ADDRESS": local})
        assert rc == 0, err[-3000:]
        assert_trained(out, nodes=1, steps=15)
        daemon.p.send_signal(signal.SIGTERM)
        assert daemon.p.wait(30) == 0
    finally:
        daemon.kill()


@pytest.mark.mpi
@pytest.mark.timeout(150)
def test_the_mpijob_completes_when_its_trainers_do(jobdir):
    """The launcher's command, its nodes on this machine: every trainer trains,
    each daemon exits with its trainer, and mpiexec returns 0 with nothing left."""
    command = launcher_command()
    write_port0_cluster(jobdir, ClusterSpec.from_any(json.loads(mpijob()["ConfigMap"]["data"]["cluster.json"])))
    start = command.index("rendezvousd")
    argv = [*mpiexec(), *command[1:start],
            *local_daemon_command(command[start:], jobdir, image_files()["/app/train.py"])]
    rc, out, err = run_job(argv, timeout=120)
    assert rc == 0, err[-4000:]
    assert_trained(out, nodes=int(command[command.index("-n") + 1]), steps=20)
    assert_nothing_left(jobdir)


@pytest.mark.mpi
@pytest.mark.timeout(150)
def test_the_mpijob_fails_when_its_trainers_fail(jobdir):
    """Trainers that exit 3: the daemons exit 3 and so does mpiexec (the
    launcher fails, and so does the MPIJob)."""
    command = launcher_command()
    write_port0_cluster(jobdir, ClusterSpec.from_any(json.loads(mpijob()["ConfigMap"]["data"]["cluster.json"])))
    start = command.index("rendezvousd")
    daemons = local_daemon_command(command[start:], jobdir, image_files()["/app/train.py"])
    failing = [*daemons[:daemons.index("--") + 1], sys.executable, "-c", "import sys; sys.exit(3)", str(jobdir)]
    rc, _, err = run_job([*mpiexec(), *command[1:start], *failing], timeout=120)
    assert rc == 3, err[-4000:]
    assert_nothing_left(jobdir)


@pytest.mark.mpi
@pytest.mark.timeout(150)
def test_the_mpijob_ends_when_one_trainer_fails(jobdir):
    """Node 1's trainer exits 3 at once while node 0's trains, waiting for node
    1's gradients: the job still ends, non-zero, long before the trainer's recv
    timeout, and leaves no process behind. (Node 0's daemon gives up on node 1
    after RENDEZVOUS_CONNECT_TIMEOUT, then drains for RENDEZVOUS_GRACE: both
    shortened here through the job's environment.)"""
    command = launcher_command()
    write_port0_cluster(jobdir, ClusterSpec.from_any(json.loads(mpijob()["ConfigMap"]["data"]["cluster.json"])))
    start = command.index("rendezvousd")
    training = local_daemon_command(command[start:], jobdir, image_files()["/app/train.py"], steps=10_000)
    training += ["--timeout", "300"]
    failing = [*training[:training.index("--") + 1], sys.executable, "-c", "import sys; sys.exit(3)", str(jobdir)]
    n = command.index("-n")
    launcher = command[1:n] + command[n + 2:start]  # -n per command below
    began = time.monotonic()
    rc, out, err = run_job([*mpiexec(), *launcher, "-n", "1", *training, ":", "-n", "1", *failing], timeout=120,
                           env={"RENDEZVOUS_CONNECT_TIMEOUT": "5", "RENDEZVOUS_GRACE": "1"})
    assert "mpijob_train: node 0 of 2: training" in out, err[-4000:]
    assert not TRAINED.search(out) and rc != 0, (rc, out, err[-4000:])
    assert time.monotonic() - began < 60, "the job waited for the trainer's recv timeout"
    assert_nothing_left(jobdir)


@pytest.mark.mpi
@pytest.mark.timeout(150)
def test_the_slurm_script_runs_a_step_that_completes_when_its_trainers_do(jobdir):
    """The batch script under bash with stand-ins for srun and scontrol: it
    writes the cluster file from the allocation's hosts and hands srun one
    command; that command, its nodes on this machine under mpiexec, trains and
    returns 0."""
    bin_dir, submit = jobdir / "bin", jobdir / "submit"
    bin_dir.mkdir()
    submit.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'n1\\nn2\\n'\n")
    (bin_dir / "srun").write_text(f"#!{sys.executable}\nimport json, sys\n"
                                  f"json.dump(sys.argv[1:], open({str(jobdir / 'srun.json')!r}, 'w'))\n")
    for stub in bin_dir.iterdir():
        stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(submit), "SLURM_JOB_ID": "77",
           "SLURM_JOB_NUM_NODES": "2", "TRAIN": ""}
    rc, _, err = run_job(["bash", str(DEPLOY / "slurm/rendezvous.sbatch")], timeout=30, env=env)
    assert rc == 0, err
    run_dir = submit / "rendezvous-77"
    assert json.loads((run_dir / "cluster.json").read_text()) == {"node": ["n1:50051", "n2:50051"]}
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    srun = json.loads((jobdir / "srun.json").read_text())
    start = srun.index("rendezvousd")
    launch = srun[:start]
    assert {"--nodes=2", "--ntasks-per-node=1", "--mpi=pmi2", "--kill-on-bad-exit=1"} <= set(launch), launch
    args, _, child = check_daemon_command(srun)
    assert args.cluster == str(run_dir / "cluster.json") and args.local == "unix:/tmp/rendezvous-77.sock"
    trainer = Path(child[1])
    assert trainer == submit / "examples/mpijob_train.py", child
    # run in the checkout: the trainer is the checkout's
    write_port0_cluster(jobdir, ClusterSpec.from_any(str(run_dir / "cluster.json")))
    daemons = local_daemon_command(srun[start:], jobdir, ROOT / trainer.relative_to(submit))
    rc, out, err = run_job([*mpiexec(), "-n", "2", *daemons], timeout=120)
    assert rc == 0, err[-4000:]
    assert_trained(out, nodes=2, steps=20)
    assert_nothing_left(jobdir)
