#!/usr/bin/env bash
# Fetches FlashInfer's header library (Apache-2.0) for the CUDA backend's paged decode: the PyPI
# wheel flashinfer-python==0.7.2.post1, checked against its pinned SHA-256, of which only the headers
# the decode includes are unpacked (flashinfer/data/include, and CCCL's libcudacxx, which must come
# ahead of the CUDA toolkit's own on the include path: 21 MB) with the wheel's licence files.
# Nothing else is downloaded and nothing from the wheel runs.
#
#   scripts/fetch_flashinfer.sh [DIR]  unpacks into DIR, default
#                                      ${KARAKV_FLASHINFER_DIR:-$HOME/.cache/karakv/flashinfer-0.7.2.post1}
#
# The wheel is kept in ${KARAKV_MODEL_DIR:-$HOME/.cache/karakv} (with the model) for the next run.
# CMake's KARAKV_FLASHINFER=AUTO (the default) builds the FlashInfer route when the default folder
# (or -DKARAKV_FLASHINFER_DIR) holds the headers and the CUDA backend is built; scripts/gpu-check.sh
# --prepare unpacks into a folder of its own under build-gpu/, so it changes no other build.
# Idempotent; exits non-zero, saying why, on any failure.
set -euo pipefail
version=0.7.2.post1
sha256=bfdc18b9e1e4d8d0730fe4343dc0e284cd0c160086de80f99888bc4867922d49
dir="${1:-${KARAKV_FLASHINFER_DIR:-$HOME/.cache/karakv/flashinfer-$version}}"
wheel_dir="${KARAKV_MODEL_DIR:-$HOME/.cache/karakv}"
wheel="$wheel_dir/flashinfer_python-$version-py3-none-any.whl"

if [ -f "$dir/include/flashinfer/attention/decode.cuh" ] && [ -f "$dir/.complete" ]; then
  echo "==> FlashInfer $version headers already in $dir"
  exit 0
fi
mkdir -p "$wheel_dir"
if [ ! -s "$wheel" ] || ! echo "$sha256  $wheel" | sha256sum --check --status; then
  echo "==> downloading flashinfer-python==$version (about 62 MB) into $wheel_dir"
  rm -f "$wheel"
  python3 -m pip download --quiet --no-deps --only-binary=:all: "flashinfer-python==$version" -d "$wheel_dir" ||
    { echo "fetch_flashinfer: cannot download flashinfer-python==$version from the Python package index" >&2; exit 1; }
fi
if ! echo "$sha256  $wheel" | sha256sum --check --status; then
  echo "fetch_flashinfer: $wheel has SHA-256 $(sha256sum "$wheel" | cut -d' ' -f1), expected $sha256" >&2
  exit 1
fi
echo "==> unpacking the headers into $dir"
rm -rf "$dir.tmp"
python3 - "$wheel" "$dir.tmp" <<'PY' || { echo "fetch_flashinfer: cannot unpack $wheel" >&2; rm -rf "$dir.tmp"; exit 1; }
import os, sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
keep = ("flashinfer/data/include/", "flashinfer/data/cccl/libcudacxx/include/")
n = 0
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.endswith("/"):
            continue
        if name.startswith(keep):
            out = os.path.join(dest, name[len("flashinfer/data/"):])
        elif ".dist-info/" in name and "LICENSE" in name.upper():
            out = os.path.join(dest, "licenses", os.path.basename(name))
        else:
            continue
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with z.open(name) as src, open(out, "wb") as dst:
            dst.write(src.read())
        n += 1
if not os.path.isfile(os.path.join(dest, "include/flashinfer/attention/decode.cuh")):
    sys.exit("the wheel has no include/flashinfer/attention/decode.cuh")
print(f"    {n} files")
PY
touch "$dir.tmp/.complete"
rm -rf "$dir"
mv "$dir.tmp" "$dir"
echo "==> FlashInfer $version headers in $dir"
