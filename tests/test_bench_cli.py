"""The bench subcommands' flags: `bench-steps`, `bench-daemon`, `bench-scale`.

Each module gives ``add_arguments`` (its flags, for the ``rendezvous``
parser) and ``run`` (the command), and ``main(argv)`` (the same from a command
line: how the ranks of ``bench-steps`` start). Nothing here runs a benchmark:
only the flags, their checks, ``--help``, what importing the modules costs,
and the refusal to start without rich.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from rendezvous.bench import cli as bench_cli
from rendezvous.bench import daemon, scale, steps

COMMANDS = {"bench-steps": steps, "bench-daemon": daemon, "bench-scale": scale}

#: every flag each command documents, with a value it accepts (None: a switch)
FLAGS = {
    "bench-steps": {"--steps": "3", "--models": "resnet50,many-small", "--contenders": "mpi,optimal",
                    "--out": "o", "--timeout": "60"},
    "bench-daemon": {"--quick": None, "--sizes": "1K,1M", "--aio-sizes": "1K", "--cross-sizes": "1K",
                     "--scenarios": "local,small", "--samples": "2", "--budget": "1M", "--rounds": "1",
                     "--small-ops": "20", "--outstanding": "50", "--rate-rounds": "1", "--pool-bytes": "64M",
                     "--daemon-env": "RENDEZVOUS_RETRY_CACHE_BYTES=0", "--out": "o", "--timeout": "60"},
    "bench-scale": {"--ranks": "2,4", "--setups": "grpc", "--big": "4K", "--out": "o", "--timeout": "60"},
}


def _parser(module) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="t")
    module.add_arguments(p)
    return p


def _flags(name: str) -> list[str]:
    out = []
    for flag, value in FLAGS[name].items():
        out += [flag] if value is None else [flag, value]
    return out


def _run(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_documented_flag_is_accepted(name):
    module = COMMANDS[name]
    p = _parser(module)
    documented = {o for a in p._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    assert documented == set(FLAGS[name])  # the table above lists them all
    args = p.parse_args(_flags(name))
    assert args.out == "o" and args.timeout == 60.0
    module.options(args)  # and they pass the command's own checks


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_an_unknown_flag_is_refused(name, capsys):
    with pytest.raises(SystemExit) as exc:
        _parser(COMMANDS[name]).parse_args(["--no-such-flag"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        COMMANDS[name].main(["--no-such-flag"])  # main: the same parser, before anything runs
    assert exc.value.code == 2


@pytest.mark.timeout(10)
def test_the_subcommands_fit_under_one_parser():
    """As ``rendezvous`` registers them: no flag's dest collides with the top
    level's (``verbose``, ``command``), and each parses under its name."""
    top = argparse.ArgumentParser(prog="rendezvous")
    top.add_argument("-v", "--verbose", action="count", default=0)
    sub = top.add_subparsers(dest="command")
    bench_cli.add_arguments(sub.add_parser("bench"))
    for name, module in COMMANDS.items():
        p = sub.add_parser(name)
        module.add_arguments(p)
        assert not {a.dest for a in p._actions} & {"verbose", "command"}, name
    args = top.parse_args(["-vv", "bench-steps", "--steps", "3", "--models", "bert-base"])
    assert (args.verbose, args.command, args.steps, args.models) == (2, "bench-steps", 3, "bert-base")
    args = top.parse_args(["bench-daemon", "--quick", "--daemon-env", "A=1", "--daemon-env", "B=2"])
    assert args.command == "bench-daemon" and args.quick and args.daemon_env == ["A=1", "B=2"]
    args = top.parse_args(["bench-scale", "--ranks", "2,8"])
    assert args.command == "bench-scale" and args.ranks == "2,8" and args.verbose == 0
    opts = scale.options(args)  # run() takes the namespace as the top level parsed it
    assert opts.ranks == [2, 8] and opts.setups == list(scale.SETUPS) and args.ranks == "2,8"


@pytest.mark.timeout(10)
def test_steps_hands_its_ranks_the_same_flags():
    p = steps.parser()
    args = p.parse_args(["--steps", "2", "--models", "resnet50", "--contenders", "mpi,grpc", "--timeout", "90"])
    assert p.parse_args(steps._argv(args)) == args
    opts = steps.options(args)
    assert opts.models == ["resnet50"] and opts.contenders == ["mpi", "grpc"] and args.models == "resnet50"


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name,flags,message", [
    ("bench-steps", ["--models", "vgg"], "unknown vgg"),
    ("bench-steps", ["--contenders", "mpi,pigeon"], "unknown pigeon"),
    ("bench-steps", ["--steps", "0"], "--steps must be >= 1"),
    ("bench-steps", ["--models", ","], "at least one"),
    ("bench-daemon", ["--sizes", "1X"], "--sizes"),
    ("bench-daemon", ["--rounds", "0"], "--rounds must be >= 1"),
    ("bench-daemon", ["--daemon-env", "NOVALUE"], "NAME=VALUE"),
    ("bench-scale", ["--ranks", "2,x"], "not a list of numbers"),
    ("bench-scale", ["--big", "6"], "multiple of 4"),
    ("bench-scale", ["--timeout", "0"], "must be positive"),
])
def test_bad_values_are_refused_by_run_before_anything_starts(name, flags, message, tmp_path):
    module = COMMANDS[name]
    args = module.parser().parse_args([*flags, "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match=message):
        module.run(args)
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_lists_every_flag(name):
    module = COMMANDS[name].__name__
    for argv in (["-m", module, "--help"], ["-m", "rendezvous", name, "--help"]):
        done = _run(*argv)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"usage: rendezvous {name} "), done.stdout[:200]
        for flag in FLAGS[name]:
            assert flag in done.stdout, (argv, flag)


@pytest.mark.timeout(60)
def test_importing_the_commands_costs_nothing_beyond_the_package():
    """``rendezvous``'s parser imports all of them to learn their flags."""
    code = ("import sys, rendezvous\n"
            "before = set(sys.modules)\n"
            "import rendezvous.bench.steps, rendezvous.bench.daemon, rendezvous.bench.scale, rendezvous.bench.cli\n"
            "new = set(sys.modules) - before\n"
            "print(sorted(m for m in new if not m.startswith('rendezvous.bench')\n"
            "             and m.split('.')[0] not in sys.stdlib_module_names))\n"
            "print(sorted(m for m in ('rich', 'matplotlib', 'mpi4py', 'torch') if m in sys.modules))\n")
    done = _run("-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[]", "[]"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv", [["bench", "--sizes", "1K"], ["bench-daemon", "--scenarios", "local"],
                                  ["bench-scale", "--setups", "grpc"]])
def test_without_rich_a_drawing_command_refuses_to_start(argv, tmp_path):
    code = ("import sys\n"
            "sys.modules['rich'] = None  # as if not installed: importing it fails\n"
            "from rendezvous.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    done = _run("-c", code, *argv, "--out", str(tmp_path / "out"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"rendezvous {argv[0]}: rich" in done.stderr
    assert "pip install 'rendezvous[bench]'" in done.stderr
    assert not (tmp_path / "out").exists()  # refused before anything ran or was written
