"""README's examples, run as written, and the user pages kept short and linked.

Every python block in README.md is either a program (its first line names it:
``# ring.py: ...``) that a test runs exactly as written, or a fragment, marked
``<!-- fragment -->`` on the line before it (it needs a real cluster, a GPU, or
names the reader supplies). README.md stays a page to start and to look up
(a bound on its length), and every relative link of README.md,
server/README.md, client/README.md and docs/*.md reaches a file and, for an
#anchor into a markdown page, one of its headings."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from rendezvous import make_key
from rendezvous.client import Client

from conftest import free_ports

pytestmark = pytest.mark.timeout(90)
ROOT = Path(__file__).resolve().parent.parent
RENDEZVOUSD = str(Path(sys.executable).parent / "rendezvousd")
#: the programs in README, by their first line, and the test that runs each
PROGRAMS = {"# ring.py": "tests/test_bootstrap.py::test_readme_torchrun_example_runs_as_written",
            "# node0_train.py": "tests/test_readme.py::test_readme_local_client_example_runs_as_written"}


def python_blocks() -> list[tuple[str, str]]:
    """(the line before, the block) for every python block in README.md."""
    text = (ROOT / "README.md").read_text()
    return [(before, block) for before, block in re.findall(r"([^\n]*)\n```python\n(.*?)```", text, re.S)]


def test_every_python_block_is_a_program_run_here_or_a_marked_fragment():
    blocks = python_blocks()
    assert len(blocks) >= 4
    seen = set()
    for before, block in blocks:
        first = block.split(":", 1)[0]
        if first in PROGRAMS:
            seen.add(first)
        else:
            assert before.strip() == "<!-- fragment -->", f"README block neither a program nor a fragment:\n{block}"
    assert seen == set(PROGRAMS), f"README lost a program: {set(PROGRAMS) - seen}"


def readme_program(first: str) -> str:
    for _, block in python_blocks():
        if block.startswith(first):
            return block
    raise AssertionError(f"no README block starts with {first!r}")


def test_readme_local_client_example_runs_as_written():
    """Two daemons (nodes 0 and 1); README's node-0 program runs against node
    0's daemon, and this test plays node 1's training process."""
    ports = free_ports(2)
    cluster = '{"node": ["127.0.0.1:%d", "127.0.0.1:%d"]}' % tuple(ports)
    with tempfile.TemporaryDirectory(prefix="rdvreadme", dir="/tmp") as folder:
        env = {**os.environ, "GRPC_VERBOSITY": "ERROR"}
        daemons = [subprocess.Popen([RENDEZVOUSD, "--cluster", cluster, "--job-name", "node", "--task-index",
                                     str(i), "--local", f"unix:{folder}/node{i}.sock"], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
        try:
            for d in daemons:
                assert d.stdout.readline().startswith("rendezvousd: "), d.stderr.read()  # type: ignore[union-attr]
            script = Path(folder, "node0_train.py")
            script.write_text(readme_program("# node0_train.py"))
            program = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True,
                                       env={**env, "RENDEZVOUS_LOCAL_ADDRESS": f"unix:{folder}/node0.sock"})
            node0, node1 = "/job:node/replica:0/task:0/device:CPU:0", "/job:node/replica:0/task:1/device:CPU:0"
            with Client(f"unix:{folder}/node1.sock") as me:
                got = me.recv(make_key(node0, node1, "grad"), step_id=3, timeout=60)
                assert got.shape == (1 << 20,) and float(got.sum()) == float(1 << 20)
                del got
                me.send(make_key(node1, node0, "grad"), np.full(1 << 20, 2.0), step_id=3)
            out, err = program.communicate(timeout=60)
            assert program.returncode == 0, err[-3000:]
            assert "got (1048576,) float64 from node 1" in out
        finally:
            for d in daemons:
                d.terminate()
            for d in daemons:
                d.wait(30)


# --- the pages stay short and linked -----------------------------------------------------------

#: README.md is the page to start and to look up; what is longer is linked from it
README_MAX_LINES = 480
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def user_pages() -> list[Path]:
    """The pages whose links are checked: the README, the daemon's and the
    client's pages, and every page under docs/."""
    return [ROOT / "README.md", ROOT / "server" / "README.md", ROOT / "client" / "README.md",
            *sorted((ROOT / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """``text`` without its fenced code blocks and inline code, where a
    ``# comment`` is no heading and ``[x](y)`` no link."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(page: Path) -> set[str]:
    """The #anchors GitHub makes for a markdown page's headings: lower case,
    punctuation dropped (inline code and link text kept as text), spaces as
    hyphens, a repeated one numbered -1, -2, ..."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", page.read_text(), flags=re.S | re.M)
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", text, re.M):
        heading = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    """Every relative link of ``page`` whose file does not exist, or whose
    #anchor names no heading of the markdown page it points into."""
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not a file of this repository
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    return broken


def test_readme_stays_a_page_to_start_and_to_look_up():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines (at most {README_MAX_LINES}): move reference "
                                       f"material to server/README.md, client/README.md or docs/ and link it")


def test_every_relative_link_of_the_user_pages_reaches_a_file_and_a_heading():
    pages = user_pages()
    assert len(pages) >= 8 and all(p.exists() for p in pages)
    links = sum(len(LINK.findall(prose(p.read_text()))) for p in pages)
    assert links >= 50  # the pages link one another: a parser that finds none would pass anything
    broken = {p.relative_to(ROOT).as_posix(): b for p in pages if (b := broken_links(p))}
    assert not broken, broken


def test_the_anchors_are_githubs():
    """The slugs the link check compares with, on headings of this repository's kind."""
    with tempfile.TemporaryDirectory() as folder:
        page = Path(folder, "p.md")
        page.write_text('# The MPI fast path: `protocol="grpc+mpi"`\n## Deploying: `deploy/`\n'
                        "```sh\n# not a heading\n```\n## Deploying: `deploy/`\n### What `make bench` runs\n"
                        "## See [mpi.md](mpi.md), gRPC's keepalive\n")
        assert anchors(page) == {"the-mpi-fast-path-protocolgrpcmpi", "deploying-deploy", "deploying-deploy-1",
                                 "what-make-bench-runs", "see-mpimd-grpcs-keepalive"}
