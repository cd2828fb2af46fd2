# Generates karakv/v1/karakv_pb2.py and karakv_pb2_grpc.py from the repository's proto/ into the
# build directory while the wheel is built, so the installed stubs always match the daemon's proto.
# The proto directory is found at $KARAKV_PROTO_DIR, else ../../proto (a source checkout).
import os
import pathlib

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = pathlib.Path(__file__).resolve().parent
PROTO_FILE = "karakv/v1/karakv.proto"


def proto_dir() -> pathlib.Path:
    candidates = [os.environ.get("KARAKV_PROTO_DIR"), HERE.parent.parent / "proto"]
    for c in candidates:
        if c and (pathlib.Path(c) / PROTO_FILE).is_file():
            return pathlib.Path(c)
    raise SystemExit(
        f"cannot find {PROTO_FILE}: build from a karakv checkout (client/python) or set "
        "KARAKV_PROTO_DIR to the directory that holds karakv/v1/karakv.proto")


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        from grpc_tools import protoc  # a build requirement (pyproject.toml)
        import grpc_tools

        src = proto_dir()
        out = pathlib.Path(self.build_lib)
        (out / "karakv" / "v1").mkdir(parents=True, exist_ok=True)
        well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
        args = ["grpc_tools.protoc", f"-I{src}", f"-I{well_known}", f"--python_out={out}",
                f"--grpc_python_out={out}", str(src / PROTO_FILE)]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {src / PROTO_FILE}")


setup(cmdclass={"build_py": BuildPyWithStubs})
