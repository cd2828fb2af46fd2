#!/usr/bin/env bash
# The main job: build karakv, start karakvd on its CPU default, drive a synthetic decode workload
# through it with the example worker (attention outputs checked against a dense float64
# reference), show the daemon's own view, and stop it with SIGTERM.
# It runs the workload twice, without compression and with Kara, so the KV memory saved shows.
# Then, when SmolLM2-135M-Instruct can be fetched (scripts/fetch_smollm2.sh), it answers a question
# with the real model through the same daemon, again without compression and with Kara.
# Tunables: SEQUENCES, PROMPT, GENERATE, POOL.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
smollm2=""
if bash scripts/fetch_smollm2.sh; then
  smollm2="${KARAKV_MODEL_DIR:-$HOME/.cache/karakv}/smollm2-135m-instruct.karakv"
else
  echo "WARNING: scripts/fetch_smollm2.sh failed; skipping the SmolLM2 part of the demo" >&2
fi

sock=$(mktemp -u /tmp/karakv-demo-XXXXXX.sock)
log=$(mktemp /tmp/karakvd-demo-XXXXXX.log)
echo "==> starting karakvd on unix:$sock (log: $log)"
./build/server/karakvd --socket="$sock" --pool_bytes="${POOL:-1GiB}" > "$log" 2>&1 &
daemon=$!
trap 'kill $daemon 2>/dev/null || true' EXIT
for _ in $(seq 100); do
  ./build/client/karakv --target="unix:$sock" --timeout=0.2 health > /dev/null 2>&1 && break
  sleep 0.1
done
./build/client/karakv --target="unix:$sock" health

SEQUENCES="${SEQUENCES:-16}" PROMPT="${PROMPT:-512}" GENERATE="${GENERATE:-256}" \
  bash scripts/demo_workload.sh build "unix:$sock"

if [ -n "$smollm2" ]; then
  # A few hundred generated tokens, so that Kara (a budget of 192 tokens, a turn every 8 steps)
  # compresses many times and the KV memory it saves shows in the worker's last line.
  prompt="Write a story of about 200 words about a lighthouse keeper who finds a message in a bottle."
  for policy in none kara; do
    echo
    echo "==> SmolLM2-135M-Instruct answering through karakvd, --policy=$policy"
    params=()
    # budget=192, recent=64: with the defaults (768, 256) a 320-token answer would never reach the budget.
    [ "$policy" = kara ] && params=(--param=budget=192 --param=period=8 --param=recent=64)
    ./build/examples/llama/llama_worker --model="$smollm2" --target="unix:$sock" --chat --tokens=320 \
      --policy="$policy" "${params[@]}" --prompt="$prompt"
  done
fi

echo "==> the daemon's view after the worker detached: every block back in the pool, invariant checked"
./build/client/karakv --target="unix:$sock" --check_invariants stats

echo "==> SIGTERM: drain and stop"
kill -TERM $daemon
wait $daemon
code=$?
trap - EXIT
tail -n 3 "$log"
echo "karakvd exited with status $code"
exit $code
