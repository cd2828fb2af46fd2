#!/usr/bin/env bash
# The Python SDK as a user installs it, in a fresh virtual environment (no system site packages):
#   1. `pip install client/python` from a checkout;
#   2. a source distribution built with `python -m build --sdist`, then installed from the tarball
#      with the checkout gone (so the proto must travel inside the sdist).
# After each install the package must import from the venv, be typed (py.typed and the generated
# messages' .pyi; mypy checks the first install) and talk to a real karakvd (install_smoke.py:
# blocking, fast-path and asyncio clients).
# Usage: install_test.sh SOURCE_DIR KARAKVD
# PyPI provides the SDK's dependencies and build requirements: when it cannot be reached (or there
# is no venv support) the test exits 77 (ctest: skipped), saying so.
set -euo pipefail
src=$1
karakvd=$2
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/karakv-pyinstall-XXXXXX")
daemon=
cleanup() {
  if [ -n "$daemon" ]; then kill "$daemon" 2>/dev/null || true; wait "$daemon" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
unset KARAKV_PROTO_DIR PYTHONPATH

python3 -m venv "$work/venv" > "$work/venv.log" 2>&1 ||
  { echo "SKIP: python3 -m venv failed (install python3-venv): $(tail -1 "$work/venv.log")"; exit 77; }
py=$work/venv/bin/python
pip=("$py" -m pip install --disable-pip-version-check -q)
index=${PIP_INDEX_URL:-https://pypi.org/simple}
"$py" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1].rstrip('/') + '/pip/', timeout=15)" "$index" \
  2> "$work/probe.log" ||
  { echo "SKIP: the package index $index cannot be reached, and pip needs it for the SDK's dependencies: $(tail -1 "$work/probe.log")"; exit 77; }

"$karakvd" --socket="$work/karakvd.sock" --log_level=warn --threads=2 --layers=2 --q_heads=4 --kv_heads=2 \
  --head_dim=16 --dtype=fp16 --block_size=4 --pool_bytes=4MiB &
daemon=$!

# A checkout of the parts the package needs (the build writes build/ and *.egg-info into it).
mkdir -p "$work/checkout/client"
cp -r "$src/client/python" "$work/checkout/client/python"
cp -r "$src/proto" "$work/checkout/proto"
rm -rf "$work/checkout/client/python/build" "$work/checkout/client/python"/*.egg-info

echo "== pip install client/python (from a checkout)"
"${pip[@]}" "$work/checkout/client/python"
(cd "$work" && "$py" "$here/install_smoke.py" "unix:$work/karakvd.sock")
# Typed: mypy checks the installed package (it refuses one without py.typed).
"${pip[@]}" mypy==2.4.1
(cd "$work" && "$py" -m mypy -p karakv --check-untyped-defs --ignore-missing-imports --no-incremental)

echo "== python -m build --sdist, then pip install of the tarball without the checkout"
"${pip[@]}" build==1.3.0
"$py" -m build --sdist --outdir "$work/dist" "$work/checkout/client/python" > "$work/build.log" 2>&1 ||
  { cat "$work/build.log"; echo "FAILED: python -m build --sdist client/python"; exit 1; }
sdist=$(ls "$work"/dist/karakv-*.tar.gz)
tar tzf "$sdist" > "$work/sdist.txt"
grep -q '/proto/karakv/v1/karakv.proto$' "$work/sdist.txt" ||
  { echo "FAILED: $(basename "$sdist") does not carry proto/karakv/v1/karakv.proto"; exit 1; }
rm -rf "$work/checkout"
"$py" -m pip uninstall -q -y karakv
"${pip[@]}" "$sdist"
(cd "$work" && "$py" "$here/install_smoke.py" "unix:$work/karakvd.sock")
echo "PASSED: the checkout and the sdist install into a clean venv and talk to karakvd"
