"""The TOML config file: its place among the sources, refusals that name the
key, and `--print-config`."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib

import pytest

from rendezvous.config import Config
from rendezvous.errors import InvalidArgument

pytestmark = pytest.mark.timeout(60)


def write(tmp_path, text: str):
    path = tmp_path / "rendezvousd.toml"
    path.write_text(text)
    return path


def test_file_sits_between_environment_and_defaults(tmp_path):
    path = write(tmp_path, "chunk_bytes = 65536\nshm_threshold = 4096\nstall_warning = 3\nmpi_optimal_path = false\n")
    cfg = Config.load(env={}, file=path)
    assert (cfg.chunk_bytes, cfg.shm_threshold, cfg.stall_warning, cfg.mpi_optimal_path) == (65536, 4096, 3.0, False)
    assert cfg.sources["chunk_bytes"] == f"file {path}" and cfg.sources["grace"] == "default"
    assert isinstance(cfg.stall_warning, float)
    cfg = Config.load({"chunk_bytes": 8192}, env={"RENDEZVOUS_SHM_THRESHOLD": "100", "MPI_OPTIMAL_PATH": "1"},
                      file=path)
    assert cfg.chunk_bytes == 8192 and cfg.sources["chunk_bytes"] == "argument"
    assert cfg.shm_threshold == 100 and cfg.sources["shm_threshold"] == "env RENDEZVOUS_SHM_THRESHOLD"
    assert cfg.mpi_optimal_path is True
    assert cfg.stall_warning == 3.0  # only the file set it


def test_strings_in_the_file_read_as_the_environment_reads_them(tmp_path):
    cfg = Config.load(env={}, file=write(tmp_path, 'mpi_disabled = "1"\nchunk_bytes = "4096"\nlog_format = "json"\n'))
    assert cfg.mpi_disabled is True and cfg.chunk_bytes == 4096 and cfg.log_format == "json"


@pytest.mark.parametrize("text,match", [
    ("chunk_size = 1\n", "unknown config key 'chunk_size'"),
    ("[daemon]\nprotocol = 'grpc'\n", "unknown config key 'daemon'"),
    ("chunk_bytes = true\n", "chunk_bytes: expected int, got bool"),
    ("chunk_bytes = 1.5\n", "chunk_bytes: expected int, got float"),
    ("tls_client_auth = 1\n", "tls_client_auth: expected bool, got int"),
    ("protocol = 'grpc+tcp'\n", "protocol must be grpc or grpc\\+mpi"),
    ("chunk_bytes = \n", "is not TOML"),
])
def test_bad_files_are_refused_naming_the_key(tmp_path, text, match):
    path = write(tmp_path, text)
    with pytest.raises(InvalidArgument, match=match) as info:
        Config.load(env={}, file=path)
    assert str(path) in info.value.message or "must be" in info.value.message


def test_missing_file(tmp_path):
    with pytest.raises(InvalidArgument, match="cannot read config file"):
        Config.load(env={}, file=tmp_path / "nope.toml")


def test_daemon_settings_are_validated():
    for bad in ({"log_format": "xml"}, {"metrics_port": 70000}, {"tls_cert": "a.pem"},
                {"tls_client_auth": True}, {"task_index": -2}, {"max_tensor_bytes": 0}):
        with pytest.raises(InvalidArgument):
            Config.load(bad, env={})


def _rendezvousd(*args, env=None):
    full = {k: v for k, v in os.environ.items() if not k.startswith("RENDEZVOUS_")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-c", "import sys; from rendezvous.cli import daemon_main; "
                           "sys.exit(daemon_main())", *args], capture_output=True, text=True, timeout=30, env=full)


def test_print_config_shows_values_and_their_sources(tmp_path):
    path = write(tmp_path, 'job_name = "node"\nshm_threshold = 4096\ngrace = 7.5\ntoken = "hunter2"\n')
    out = _rendezvousd("--config", str(path), "--print-config", "--grace", "2", "--cluster", '{"node": ["127.0.0.1:0"]}',
                       env={"RENDEZVOUS_SHM_THRESHOLD": "8192", "PMI_RANK": "1", "PMI_SIZE": "2"})
    assert out.returncode == 0, out.stderr
    assert "hunter2" not in out.stdout
    lines = {line.split(" = ")[0]: line for line in out.stdout.splitlines() if " = " in line}
    assert lines["grace"] == "grace = 2.0  # flag --grace"
    assert lines["shm_threshold"] == "shm_threshold = 8192  # env RENDEZVOUS_SHM_THRESHOLD"
    assert lines["job_name"] == f'job_name = "node"  # file {path}'
    assert lines["task_index"] == "task_index = 1  # launcher PMI_RANK"
    assert lines["chunk_bytes"] == "chunk_bytes = 1048576  # default"
    assert lines["token"].startswith('token = "***"')
    parsed = tomllib.loads(out.stdout)  # the output is itself a config file
    assert parsed["grace"] == 2.0 and parsed["job_name"] == "node"
    # the same through `rendezvous serve --daemon`
    serve = subprocess.run([sys.executable, "-m", "rendezvous", "serve", "--daemon", "--config", str(path),
                            "--print-config"], capture_output=True, text=True, timeout=30)
    assert serve.returncode == 0 and "file " + str(path) in serve.stdout


def test_bad_config_file_stops_the_daemon_naming_the_key(tmp_path):
    out = _rendezvousd("--config", str(write(tmp_path, "bogus = 1\n")))
    assert out.returncode == 2 and "unknown config key 'bogus'" in out.stderr
    out = _rendezvousd(env={"RENDEZVOUS_CONFIG": str(write(tmp_path, "grace = 'soon'\n"))})
    assert out.returncode == 2 and "grace" in out.stderr
    out = _rendezvousd("--job-name", "node")
    assert out.returncode == 2 and "--cluster and --job-name" in out.stderr


def test_print_config_shows_the_local_address_the_daemon_will_use(tmp_path):
    """Not an empty string: the default socket as resolved (and why), or the
    setting with {job_name} and {task_index} replaced."""
    out = _rendezvousd("--print-config", env={"XDG_RUNTIME_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    lines = {line.split(" = ")[0]: line for line in out.stdout.splitlines() if " = " in line}
    assert lines["local_address"] == (f'local_address = "unix:{tmp_path}/rendezvous/rendezvousd.sock"  '
                                      "# default, under $XDG_RUNTIME_DIR")
    out = _rendezvousd("--print-config", env={"XDG_RUNTIME_DIR": ""})
    assert 'local_address = "unix:/run/rendezvous/rendezvousd.sock"  # default; XDG_RUNTIME_DIR is unset' in \
        out.stdout
    out = _rendezvousd("--print-config", "--cluster", '{"node": ["127.0.0.1:0", "127.0.0.1:0"]}', "--job-name",
                       "node", "--task-index", "1", "--local", "unix:/tmp/{job_name}-{task_index}.sock")
    assert ('local_address = "unix:/tmp/node-1.sock"  # flag --local: unix:/tmp/{job_name}-{task_index}.sock'
            in out.stdout), out.stdout
    assert tomllib.loads(out.stdout)["local_address"] == "unix:/tmp/node-1.sock"
