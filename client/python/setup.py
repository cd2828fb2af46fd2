# Generates karakv/v1/karakv_pb2.py (with its .pyi type stub) and karakv_pb2_grpc.py from the
# repository's proto/ into the build directory while the wheel is built, so the installed stubs
# always match the daemon's proto. The proto is found at $KARAKV_PROTO_DIR, else ./proto (where a
# source distribution carries it: the sdist command below copies it in), else ../../proto (a
# source checkout).
import os
import pathlib
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = pathlib.Path(__file__).resolve().parent
PROTO_FILE = "karakv/v1/karakv.proto"


def proto_dir() -> pathlib.Path:
    candidates = [os.environ.get("KARAKV_PROTO_DIR"), HERE / "proto", HERE.parent.parent / "proto"]
    for c in candidates:
        if c and (pathlib.Path(c) / PROTO_FILE).is_file():
            return pathlib.Path(c)
    raise SystemExit(
        f"cannot find {PROTO_FILE}: looked in $KARAKV_PROTO_DIR, {HERE / 'proto'} (a source distribution) and "
        f"{HERE.parent.parent / 'proto'} (a karakv checkout); build from client/python of a checkout, from a "
        "source distribution made by this setup.py, or set KARAKV_PROTO_DIR to the directory that holds "
        f"{PROTO_FILE}")


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        from grpc_tools import protoc  # a build requirement (pyproject.toml)
        import grpc_tools

        src = proto_dir()
        out = pathlib.Path(self.build_lib)
        (out / "karakv" / "v1").mkdir(parents=True, exist_ok=True)
        well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
        args = ["grpc_tools.protoc", f"-I{src}", f"-I{well_known}", f"--python_out={out}", f"--pyi_out={out}",
                f"--grpc_python_out={out}", str(src / PROTO_FILE)]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {src / PROTO_FILE}")


class SdistWithProto(sdist):
    """The source distribution carries the proto (at proto/karakv/v1/karakv.proto), so a wheel
    builds from it anywhere, away from the checkout."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        dest = pathlib.Path(base_dir) / "proto" / PROTO_FILE
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(proto_dir() / PROTO_FILE, dest)


setup(cmdclass={"build_py": BuildPyWithStubs, "sdist": SdistWithProto})
