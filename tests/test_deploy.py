"""deploy/: every manifest parses, and every command in it is a real console
script whose flags the real argument parser accepts."""

from __future__ import annotations

import configparser
import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from rendezvous.cli import daemon_parser
from rendezvous.cluster import ClusterSpec
from rendezvous.config import ENV_VARS, Config

pytestmark = pytest.mark.timeout(30)
ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"


def scripts() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def check_daemon_command(argv: list[str]) -> tuple[object, list[str]]:
    """Find `rendezvousd` in ``argv`` and parse what follows with its real parser."""
    names = [a for a in argv if Path(a).name == "rendezvousd"]
    assert names, f"no rendezvousd in {argv}"
    rest = argv[argv.index(names[0]) + 1:]
    parser = daemon_parser()

    def fail(message: str) -> None:
        raise AssertionError(f"rendezvousd refuses {rest}: {message}")

    parser.error = fail  # type: ignore[method-assign]
    return parser.parse_args(rest), rest


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
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # systemd keys are case-sensitive
    unit.read_string((DEPLOY / "systemd" / "rendezvousd.service").read_text())
    service = unit["Service"]
    args, _ = check_daemon_command(shlex.split(service["ExecStart"]))
    assert args.protocol == "grpc" and args.local.startswith("unix:/run/rendezvous/")
    assert service["RuntimeDirectory"] == "rendezvous"
    assert service["KillSignal"] == "SIGTERM"
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    env = {}
    for line in (DEPLOY / "systemd" / "rendezvousd.env").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, value = line.split("=", 1)
            env[name] = value
    unknown = set(env) - set(ENV_VARS)
    assert not unknown, f"variables rendezvous does not read: {unknown}"
    assert service["EnvironmentFile"].endswith("rendezvousd.env")
    Config.load(env=env)  # every value reads


def test_slurm_script_runs_the_daemons_then_the_training_step():
    text = (DEPLOY / "slurm" / "rendezvous.sbatch").read_text()
    assert text.startswith("#!/bin/bash\n") and "#SBATCH --nodes=" in text
    joined = re.sub(r"\\\n\s*", " ", text)  # continuation lines
    steps = [line.strip() for line in joined.splitlines() if line.strip().startswith("srun ")]
    assert len(steps) == 2, steps
    daemons, training = steps
    assert "--ntasks-per-node=1" in daemons and daemons.endswith("&")
    args, _ = check_daemon_command(shlex.split(daemons.rstrip("&")))
    assert args.protocol == "grpc+mpi" and args.job_name == "node"
    assert "kill -TERM" in text and "RENDEZVOUS_LOCAL_ADDRESS" in text
    assert "train.py" in training


def test_kubernetes_mpijob_with_cluster_configmap():
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "mpijob.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"ConfigMap", "MPIJob"}
    job = kinds["MPIJob"]
    assert job["apiVersion"] == "kubeflow.org/v2beta1"
    config_map = kinds["ConfigMap"]
    spec = ClusterSpec.from_any(json.loads(config_map["data"]["cluster.json"]))
    workers = job["spec"]["mpiReplicaSpecs"]["Worker"]
    assert len(spec.jobs["node"]) == workers["replicas"]
    launcher = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    args, _ = check_daemon_command(launcher["command"])
    n = launcher["command"][launcher["command"].index("-n") + 1]
    assert int(n) == workers["replicas"]
    # the cluster flag points at the ConfigMap, mounted in the worker pods
    pod = workers["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v.get("configMap", {}).get("name") == config_map["metadata"]["name"])
    daemon = next(c for c in pod["containers"] if c["name"] == "worker")
    mount = next(m for m in daemon["volumeMounts"] if m["name"] == volume["name"])
    assert args.cluster == f"{mount['mountPath']}/cluster.json"
    # the trainer shares the daemon's socket folder (both sockets; shared memory
    # travels over the session socket as descriptors), and is told where the socket is
    trainer = next(c for c in pod["containers"] if c["name"] == "trainer")
    socket_dir = args.local[len("unix:"):].rsplit("/", 1)[0]
    mounts = [{m["mountPath"]: m["name"] for m in c["volumeMounts"]} for c in (daemon, trainer)]
    assert socket_dir in mounts[0] and mounts[0][socket_dir] == mounts[1].get(socket_dir)
    env = {e["name"]: e["value"] for e in trainer["env"]}
    assert env["RENDEZVOUS_LOCAL_ADDRESS"] == args.local


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


def test_readme_lists_every_deploy_file():
    readme = (ROOT / "README.md").read_text()
    files = [p.relative_to(ROOT).as_posix() for p in DEPLOY.rglob("*") if p.is_file()]
    missing = [f for f in files if f"`{f}`" not in readme]
    assert not missing, f"README's deploy table lacks {missing}"
