#!/usr/bin/env bash
# Test fixture: makes <build>/pyvenv with the pinned tools of requirements.txt and installs the
# Python SDK (client/python) into it. Usage: make_venv.sh BUILD_DIR SOURCE_DIR [NAME REQUIREMENTS]
# With NAME and REQUIREMENTS (a file under tests/tools): <build>/NAME with those pins only, no SDK
# (checkov's venv: its pins must not meet the SDK's).
# When the venv or the download of the pinned packages fails (no python3-venv, no network), it writes
# the reason to <build>/pyvenv.skip and exits 0: the tests that need the venv then SKIP with that
# reason. A failure to build the SDK itself is a real failure (exit 1).
set -uo pipefail
build=$1
src=$2
name=${3:-pyvenv}
venv=$build/$name
skip=$build/$name.skip
reqs=$src/tests/tools/${4:-requirements.txt}
rm -f "$skip"

skip_with() {
  echo "SKIP: $1" | tee "$skip"
  exit 0
}

stamp=$(sha256sum "$reqs" | cut -d' ' -f1)
if [ "$(cat "$venv/.requirements" 2>/dev/null)" != "$stamp" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv" > "$build/$name.log" 2>&1 ||
    skip_with "python3 -m venv failed (install python3-venv): $(tail -1 "$build/$name.log")"
  "$venv/bin/pip" install --disable-pip-version-check -q -r "$reqs" >> "$build/$name.log" 2>&1 ||
    skip_with "pip could not install the pinned test tools of ${reqs#"$src/"}: $(tail -1 "$build/$name.log")"
  echo "$stamp" > "$venv/.requirements"
fi
if [ "$name" != pyvenv ]; then
  echo "$name: $(wc -l < "$reqs") pinned lines of ${reqs#"$src/"} installed"
  exit 0
fi

# Build from a copy so the source tree gets no build/ or egg-info; the stubs are generated from
# proto/ by the package's own build step (client/python/setup.py), as any user's install does.
copy=$build/python-sdk-src
rm -rf "$copy"
mkdir -p "$copy/client"
cp -r "$src/client/python" "$copy/client/python"
cp -r "$src/proto" "$copy/proto"
rm -rf "$copy/client/python/build" "$copy/client/python"/*.egg-info  # from a manual install
"$venv/bin/pip" install --disable-pip-version-check -q --no-build-isolation --no-deps --force-reinstall \
  "$copy/client/python" || { echo "FAILED: pip install of the karakv Python SDK (client/python)"; exit 1; }
"$venv/bin/python" -c "import karakv.v1.karakv_pb2_grpc, karakv; print('karakv SDK', karakv.__version__, 'installed in', '$venv'.split('/')[-1])"
