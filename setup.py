"""Build hook: generate the gRPC stubs from protos/ with grpcio-tools.

The stubs (``*_pb2.py``, ``*_pb2_grpc.py``, ``*_pb2.pyi``) are written next to the .proto
sources so both regular and editable installs import them as ``pagedserve.v1``. They are
never edited by hand and are ignored by git.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTO_ROOT = ROOT / "protos"


def generate_stubs() -> None:
    """Run protoc (from grpcio-tools) on every .proto under protos/."""
    import grpc_tools
    from grpc_tools import protoc

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    for proto in protos:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={PROTO_ROOT}",
            f"--pyi_out={PROTO_ROOT}",
            f"--grpc_python_out={PROTO_ROOT}",
            proto,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        generate_stubs()
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
