#!/usr/bin/env python3
"""karakvd --log_format=json: every stderr line is one JSON object with time, level, logger and msg,
including lines whose message carries a caller's quotes, backslashes, newlines and invalid UTF-8;
--log_format=text stays text, and an unknown format is refused naming the choices."""
import argparse
import datetime
import json
import os
import subprocess
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from opslib import Daemon  # noqa: E402

GEOMETRY = ["--layers=2", "--q_heads=4", "--kv_heads=2", "--head_dim=16", "--pool_bytes=4MiB"]
failures = []


def check(ok, what):
    print(("ok      " if ok else "FAILED  ") + what)
    if not ok:
        failures.append(what)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--karakvd", required=True)
    p.add_argument("--worker", required=True)
    args = p.parse_args()

    # A policy name a careless caller might send: it comes back in the refusal, which is logged.
    hostile = 'we"ird\\name\nsecond line\tand {braces} %s'
    with Daemon(args.karakvd, *GEOMETRY, "--log_format=json", "--log_level=debug") as d:
        for policy in (hostile.encode(), b"invalid \xff utf-8"):
            # The second never reaches the handler: protobuf refuses the string and logs why.
            r = subprocess.run([args.worker.encode(), f"--target={d.target}".encode(), b"--sequences=1",
                                b"--prompt=20", b"--generate=2", b"--policy=" + policy], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)
            check(r.returncode != 0, f"the worker's CreateSequence with policy {policy!r} is refused")
        r = subprocess.run([args.worker, f"--target={d.target}", "--sequences=2", "--prompt=20", "--generate=3"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        check(r.returncode == 0, f"a normal workload runs: {r.stdout.strip()[-200:]}")
        check(d.stop() == 0, "karakvd exits 0 on SIGTERM")
        raw = d.stderr()

    try:
        text = raw.decode("utf-8")  # strict: an invalid byte copied through would fail here
        check(True, "stderr is valid UTF-8")
    except UnicodeDecodeError as e:
        check(False, f"stderr is valid UTF-8: {e}")
        text = raw.decode("utf-8", "replace")
    lines = text.splitlines()
    check(len(lines) >= 6, f"{len(lines)} log lines (start, serving, attach/detach, refusal, drain, stop)")
    records = []
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            check(False, f"line parses as JSON ({e}): {line!r}")
            continue
        ok = (isinstance(rec, dict) and set(rec) == {"time", "level", "logger", "msg"} and
              rec["level"] in {"trace", "debug", "info", "warning", "error", "critical"} and rec["logger"] == "karakvd")
        try:
            datetime.datetime.fromisoformat(rec["time"])
        except (ValueError, KeyError, TypeError):
            ok = False
        check(ok, f"line has time (ISO 8601), level, logger, msg: {line[:120]}")
        records.append(rec)
    msgs = [r["msg"] for r in records]
    check(any(f"unknown policy '{hostile}'" in m and r["level"] == "debug" for r, m in zip(records, msgs)),
          "the refusal is logged at debug with the caller's policy name intact")
    check(any(m.startswith("protobuf ") and "invalid UTF-8" in m for m in msgs),
          "protobuf's own complaint about invalid UTF-8 is a JSON line too")
    check(sum("attached: worker 'synthetic_worker'" in m for m in msgs) >= 2, "attach lines name the worker")
    check(any(m == "stopped" for m in msgs), "the last line says stopped")

    with Daemon(args.karakvd, *GEOMETRY, "--log_format=text") as d:
        check(d.stop() == 0, "text format: karakvd exits 0")
        text_lines = d.stderr().decode().splitlines()
    check(text_lines and all(not l.startswith("{") and " karakvd: " in l for l in text_lines),
          f"--log_format=text writes text lines: {text_lines[:1]}")

    r = subprocess.run([args.karakvd, "--log_format=xml", "--socket=/nonexistent/karakv.sock"], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    check(r.returncode == 2 and "--log_format=xml, expected text or json" in r.stdout,
          f"--log_format=xml is refused naming the choices: {r.stdout.strip()}")
    print(f"{len(failures)} failure(s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
