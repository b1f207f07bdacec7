"""Regenerate the committed Python stubs from proto/specsplit/v1/*.proto.

    python proto/generate.py            # writes into the repo root (specsplit/v1/)
    python proto/generate.py OUT_DIR    # writes elsewhere (the stub test compares)
"""

import pathlib
import sys

from grpc_tools import protoc
import grpc_tools

PROTO_ROOT = pathlib.Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Run protoc on every .proto; return the generated files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.glob("specsplit/v1/*.proto"))
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted((out_dir / "specsplit" / "v1").glob("*_pb2*.py*"))


if __name__ == "__main__":
    target = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT
    for path in generate(target):
        print(path)
