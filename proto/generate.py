"""Regenerates the committed gRPC stubs from proto/batchd.proto.

    python -m batchd.proto.generate          # rewrite proto/batchd_pb2*.py
    python -m batchd.proto.generate --check  # exit 1 if the committed stubs are stale

The proto is compiled under the virtual path batchd/proto/ so the generated modules import each other
as `batchd.proto.batchd_pb2`, the package they live in.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUTPUTS = ("batchd_pb2.py", "batchd_pb2.pyi", "batchd_pb2_grpc.py")


def generate(out_dir: Path) -> dict[str, str]:
    """Compiles the proto into `out_dir`; returns {file name: text}."""
    from grpc_tools import protoc

    args = [
        "grpc_tools.protoc",
        f"-Ibatchd/proto={HERE}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        "batchd/proto/batchd.proto",
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on proto/batchd.proto")
    gen = out_dir / "batchd" / "proto"
    return {name: (gen / name).read_text() for name in OUTPUTS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed stubs are stale")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        files = generate(Path(tmp))
    stale = [n for n, text in files.items() if not (HERE / n).exists() or (HERE / n).read_text() != text]
    if args.check:
        if stale:
            print(f"stale gRPC stubs: {stale}; run python -m batchd.proto.generate", file=sys.stderr)
            return 1
        return 0
    for name, text in files.items():
        (HERE / name).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
