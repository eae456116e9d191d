"""Regenerate the protobuf and gRPC modules in rendezvous/v1 from protos/.

Usage: python tools/gen_protos.py [OUTPUT_ROOT]

OUTPUT_ROOT defaults to the repository root; the drift test passes a
temporary folder and compares the result with the committed modules.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

import grpc_tools

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"


def generate(out_root: Path) -> list[Path]:
    """Run protoc on every .proto under protos/ and return the files written."""
    sources = sorted(p.relative_to(PROTOS).as_posix() for p in PROTOS.rglob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    out_root.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTOS}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written = []
    for src in sources:
        stem = Path(src).with_suffix("")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            written.append(out_root / f"{stem}{suffix}")
    return written


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    for path in generate(out):
        print(path)
