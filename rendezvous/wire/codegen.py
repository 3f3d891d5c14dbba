"""Generate the Python gRPC stubs in rendezvous/wire/_proto/ from protos/rendezvous.proto.

Run `python -m rendezvous.wire.codegen` after editing the .proto; tests/rendezvous/test_proto_stubs.py
fails when the committed stubs drift from what this produces.
"""
from __future__ import annotations

import pathlib
import re
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
PROTO_DIR = REPO_ROOT / "protos"
PROTO_FILE = "rendezvous.proto"
STUB_DIR = pathlib.Path(__file__).resolve().parent / "_proto"
STUB_FILES = ("rendezvous_pb2.py", "rendezvous_pb2.pyi", "rendezvous_pb2_grpc.py")


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Write the stubs into out_dir and return their paths; raises RuntimeError if protoc fails."""
    from grpc_tools import protoc  # a test/dev dependency only
    import importlib.resources

    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    rc = protoc.main([
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PROTO_DIR / PROTO_FILE),
    ])
    if rc != 0:
        raise RuntimeError(f"protoc failed (exit {rc}) on {PROTO_DIR / PROTO_FILE}")
    # grpc_python_out emits a top-level `import rendezvous_pb2`; the stubs live in a package.
    grpc_file = out_dir / "rendezvous_pb2_grpc.py"
    text = grpc_file.read_text()
    text = re.sub(r"^import rendezvous_pb2 as", "from . import rendezvous_pb2 as", text, flags=re.M)
    grpc_file.write_text(text)
    return [out_dir / name for name in STUB_FILES]


if __name__ == "__main__":
    for path in generate(STUB_DIR):
        print(path)
    sys.exit(0)
