#!/usr/bin/env python3
"""The Prometheus side of karakv, checked with the real tools:

1. promtool: check config (deploy/prometheus/scrape.yml), check rules and test rules (alerts.yml,
   alerts_test.yml), check metrics on a real scrape of a real karakvd after a small workload whose
   counters are known exactly.
2. A real Prometheus server on loopback scrapes that karakvd every second while a synthetic worker
   decodes with a compressing policy; every PromQL expression of deploy/grafana/karakv-dashboard.json must parse and
   return data (those of a family in MAY_BE_ABSENT only parse, when the daemon has no such series
   here), the alert rules must load and evaluate, and a killed worker's lease expiry must reach
   Prometheus.

Skips (exit 77, reason printed) when promtool or prometheus is missing.
"""
import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from opslib import Daemon, free_port, http_get, skip, wait_for  # noqa: E402

GEOMETRY = ["--layers=4", "--q_heads=4", "--kv_heads=2", "--head_dim=32", "--dtype=fp16", "--block_size=16"]
failures = []

# The metric families karakvd leaves out where they do not apply, and why. Only these may be
# missing from this machine's scrape: the dashboard's queries of them must then parse (not return
# data), and deploy/README.md may document them. Where the scrape has them, every check applies.
MAY_BE_ABSENT = {
    # server/metrics.cc: the container's cgroup memory limit, no series when there is none (cgroup
    # v2 memory.max "max", v1 no limit, no memory cgroup): a bare host, a container without a limit.
    "karakv_memory_limit_bytes": "no cgroup memory limit here",
}
# Exported here but with no observation, so a quantile over them is NaN: the daemon of this test
# runs without --prefix_tier (tests/server/prefix_tier_test.cc and karakv-bench cluster exercise it).
NO_OBSERVATIONS_HERE = {
    "karakv_prefix_tier_lookup_seconds_bucket": "no --prefix_tier in this test",
}


def check(ok, what):
    print(("ok      " if ok else "FAILED  ") + what)
    if not ok:
        failures.append(what)
    return ok


def run(cmd, **kw):
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def metric_value(scrape, series):
    """The value of one exact series line (name{labels} value) in a text exposition, or None."""
    for line in scrape.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return None


def check_deploy_files(promtool, deploy):
    prom = os.path.join(deploy, "prometheus")
    r = run([promtool, "check", "config", os.path.join(prom, "scrape.yml")])
    check(r.returncode == 0, f"promtool check config scrape.yml\n{r.stdout}")
    r = run([promtool, "check", "rules", os.path.join(prom, "alerts.yml")])
    check(r.returncode == 0, f"promtool check rules alerts.yml\n{r.stdout}")
    r = run([promtool, "test", "rules", "alerts_test.yml"], cwd=prom)
    check(r.returncode == 0 and "SUCCESS" in r.stdout, f"promtool test rules alerts_test.yml\n{r.stdout}")


def small_workload_and_scrape(args, promtool, daemon, metrics_port):
    """Known counts: 1 NOT_FOUND, 1 RESOURCE_EXHAUSTED, 3 sequences x 10 decode steps."""
    r = run([args.karakv, f"--target={daemon.target}", "inspect", "424242"])
    check(r.returncode == 1 and "unknown sequence 424242" in r.stdout,
          f"karakv inspect of an unknown sequence fails: {r.stdout.strip()}")
    # The 64 MiB pool is 4096 blocks of 16 tokens: 70000 tokens want 4375.
    r = run([args.worker, f"--target={daemon.target}", "--sequences=1", "--prompt=70000", "--generate=1"])
    check(r.returncode != 0 and "RESOURCE_EXHAUSTED" in r.stdout, f"an oversized prompt is refused: {r.stdout.strip()}")
    r = run([args.worker, f"--target={daemon.target}", "--sequences=3", "--prompt=40", "--generate=10",
             "--check_every=5"])
    check(r.returncode == 0 and "ALL MATCHED" in r.stdout, f"synthetic worker (3 x 10 steps) {r.stdout.strip()}")
    scrape = http_get(f"http://127.0.0.1:{metrics_port}/metrics")
    expected = {
        "karakv_decode_steps_total": 10,
        "karakv_decode_tokens_total": 30,
        "karakv_decode_step_duration_seconds_count": 10,
        "karakv_time_to_first_token_seconds_count": 3,
        'karakv_rpc_errors_total{code="NOT_FOUND",method="Inspect"}': 1,
        'karakv_rpc_errors_total{code="RESOURCE_EXHAUSTED",method="Append"}': 1,
        'karakv_rpc_duration_seconds_count{method="Step"}': 40,  # 10 steps x 4 layers
        "karakv_sequences": 0,
        "karakv_pool_blocks_used": 0,
        "karakv_pool_blocks": 4096,
    }
    for series, want in expected.items():
        got = metric_value(scrape, series)
        check(got == want, f"scrape: {series} = {got}, expected {want}")
    ttft_sum = metric_value(scrape, "karakv_time_to_first_token_seconds_sum")
    step_sum = metric_value(scrape, "karakv_decode_step_duration_seconds_sum")
    # Each TTFT spans the sequence's first decode step, so 3 TTFTs take at least the first step.
    check(ttft_sum is not None and step_sum is not None and 0 < ttft_sum and 0 < step_sum,
          f"scrape: TTFT sum {ttft_sum} s and step sum {step_sum} s are positive")
    check("karakv_compression_factor{" not in scrape,
          "scrape: no compression factor series once every sequence is released (no stale gauges)")
    check("karakv_tenant_blocks_in_use{" not in scrape,
          "scrape: no per-tenant series once every session has detached (bounded by the attached tenants)")
    check(metric_value(scrape, "karakv_kv_cache_usage_perc") == 0, "scrape: karakv_kv_cache_usage_perc is 0 when idle")
    build = re.findall(r'^karakv_build_info\{backend="cpu",revision="([0-9a-f]{7,40}|unknown)",version="(\d+\.\d+\.\d+)"\} 1$',
                       scrape, re.M)
    check(len(build) == 1, f"scrape: one karakv_build_info series, backend cpu, a revision and a version: {build}")
    start = metric_value(scrape, "process_start_time_seconds")
    check(start is not None and time.time() - 600 < start <= time.time(),
          f"scrape: process_start_time_seconds {start} is the daemon's start, in epoch seconds")
    # Label sets exist at zero before their first event; the RPC histogram reaches past a second.
    check(metric_value(scrape, 'karakv_rpc_errors_total{code="INTERNAL",method="Step"}') == 0,
          "scrape: karakv_rpc_errors_total{code=INTERNAL,method=Step} is there at 0")
    check(metric_value(scrape, 'karakv_compactions_total{policy="kara"}') == 0,
          "scrape: karakv_compactions_total{policy=kara} is there at 0")
    check('karakv_rpc_duration_seconds_bucket{method="Step",le="10"}' in scrape,
          "scrape: the RPC latency histogram has buckets past 1 s")
    r = subprocess.run([promtool, "check", "metrics"], input=scrape, text=True, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT)
    check(r.returncode == 0 and r.stdout.strip() == "", f"promtool check metrics on a real scrape: {r.stdout.strip()}")


def dashboard_queries(path):
    """Every PromQL expression of the dashboard, with Grafana's variables replaced."""
    with open(path) as f:
        dash = json.load(f)
    exprs = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                exprs.append((p["title"], t["expr"]))
            walk(p.get("panels", []))

    walk(dash["panels"])
    variables = [v for v in dash["templating"]["list"] if v["type"] == "query"]
    out = []
    for title, e in exprs:
        out.append((title, e, grafana_variables(e)))
    return dash, variables, out


# What the dashboard's variables become here: the scrape job of this test's Prometheus, and All for
# the rest (the daemon is scraped without Kubernetes' namespace and pod labels).
VARIABLES = {"$__rate_interval": "1m", "$namespace": ".*", "$instance": ".*", "$job": "karakv", "$pod": ".*"}


def grafana_variables(e):
    for name, value in VARIABLES.items():
        e = e.replace(name, value)
    return e


def query(prom_url, q):
    body = http_get(f"{prom_url}/api/v1/query?" + urllib.parse.urlencode({"query": q}))
    return json.loads(body)


def has_finite_data(reply):
    if reply.get("status") != "success":
        return False
    data = reply["data"]
    if data["resultType"] == "vector":
        return any(math.isfinite(float(s["value"][1])) for s in data["result"])
    if data["resultType"] == "scalar":
        return math.isfinite(float(data["result"][1]))
    return False


def with_prometheus(args, promtool, prometheus, daemon, metrics_port, workdir):
    prom_port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [os.path.join(os.path.abspath(args.deploy), "prometheus", "alerts.yml")],
        "scrape_configs": [{"job_name": "karakv", "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]}],
    }
    config_path = os.path.join(workdir, "prometheus.yml")
    with open(config_path, "w") as f:
        json.dump(config, f)  # JSON is YAML
    log = open(os.path.join(workdir, "prometheus.log"), "wb")
    proc = subprocess.Popen([prometheus, f"--config.file={config_path}",
                             f"--storage.tsdb.path={os.path.join(workdir, 'data')}",
                             f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
                            stdout=log, stderr=subprocess.STDOUT)
    prom = f"http://127.0.0.1:{prom_port}"
    worker = None
    try:
        wait_for("Prometheus to be ready", lambda: "Ready" in http_get(f"{prom}/-/ready"), timeout=30)
        wait_for("the first scrape of karakvd",
                 lambda: has_finite_data(query(prom, 'up{job="karakv"} == 1')), timeout=20)
        small_workload_and_scrape(args, promtool, daemon, metrics_port)
        # A decode that runs until the test kills it: StreamingLLM keeps each cache between 64 and 128
        # tokens (a compaction every 64 steps per sequence), so the pool never fills however fast
        # the machine is.
        worker = subprocess.Popen([args.worker, f"--target={daemon.target}", "--sequences=4", "--prompt=64",
                                   "--generate=1000000000", "--check_every=0", "--policy=streaming",
                                   "--param=c_max=128,c_target=64"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)

        dash, variables, queries = dashboard_queries(os.path.join(args.deploy, "grafana", "karakv-dashboard.json"))
        check(len(queries) >= 20, f"dashboard has {len(queries)} PromQL expressions")
        for title, original, q in queries:
            check("$" not in q, f"dashboard '{title}': no unknown Grafana variable left in {q}")
        exported = set(re.findall(r"^# TYPE (karakv_\w+) ", http_get(f"http://127.0.0.1:{metrics_port}/metrics"), re.M))
        absent = {name for name in MAY_BE_ABSENT if name not in exported}
        for name in sorted(absent):
            print(f"note: {name} is not exported here ({MAY_BE_ABSENT[name]}): its dashboard queries only have to parse")
        # A query of such a family only has to parse; those of every other family must return data.
        unobserved = absent | set(NO_OBSERVATIONS_HERE)
        no_data_ok = {q for _, _, q in queries if set(re.findall(r"\bkarakv_\w+", q)) & unobserved}
        pending = {q: (title, original) for title, original, q in queries if q not in no_data_ok}
        deadline = time.monotonic() + 40
        while pending and time.monotonic() < deadline:
            for q in list(pending):
                if has_finite_data(query(prom, q)):
                    del pending[q]
            if pending:
                time.sleep(0.5)
        for title, original, q in queries:
            reply = query(prom, q)
            if q in no_data_ok:
                missing = sorted(set(re.findall(r"\bkarakv_\w+", q)) & unobserved)
                why = "; ".join(f"{m}: {MAY_BE_ABSENT.get(m) or NO_OBSERVATIONS_HERE.get(m)}" for m in missing)
                check(reply.get("status") == "success", f"dashboard '{title}': {q} parsed (no data needed: "
                      f"{why})" +
                      ("" if reply.get("status") == "success" else f" (reply: {json.dumps(reply)[:300]})"))
                continue
            check(q not in pending and reply.get("status") == "success",
                  f"dashboard '{title}': {q} parsed and returned data" +
                  ("" if q not in pending else f" (reply: {json.dumps(reply)[:300]})"))
        # What each variable lists: the scrape job, no namespace or pod, this daemon's instance.
        expected_values = {"job": ["karakv"], "namespace": [], "pod": [], "instance": [f"127.0.0.1:{metrics_port}"]}
        for v in variables:
            m = re.fullmatch(r"label_values\((\w+(?:\{[^{}]*\})?), (\w+)\)", v["definition"])
            check(m is not None, f"dashboard variable {v['name']}: {v['definition']} is label_values(metric, label)")
            if m:
                values = json.loads(http_get(f"{prom}/api/v1/label/{m.group(2)}/values?" +
                                             urllib.parse.urlencode({"match[]": grafana_variables(m.group(1))})))["data"]
                check(values == expected_values.get(v["name"]), f"dashboard variable {v['name']} lists {values}")

        # Rates reflect the running decode, not just the presence of series.
        tokens = query(prom, 'rate(karakv_decode_tokens_total[1m])')["data"]["result"]
        check(tokens and float(tokens[0]["value"][1]) > 0, f"decode tokens/s > 0 while the worker runs: {tokens}")
        # The first compaction comes after 64 decode steps per sequence, which a loaded machine may
        # not have reached yet: wait for it (a minute at most), then check the value.
        factor = 'karakv_compression_factor{kind="actual",policy="streaming"}'
        compacted = 'karakv_compactions_total{policy="streaming"} > 0'
        try:
            wait_for("StreamingLLM's first compaction", lambda: has_finite_data(query(prom, compacted)), timeout=60,
                     period=0.5)
            time.sleep(2)  # a scrape after it
        except Exception as e:  # reported by the check below
            print(f"note: {e}")
        ratio = query(prom, factor)["data"]["result"]
        check(ratio and float(ratio[0]["value"][1]) > 1,
              f"StreamingLLM's actual compression factor is above 1 once it has compacted: {ratio}")
        usage = query(prom, "karakv_kv_cache_usage_perc")["data"]["result"]
        check(usage and 0 < float(usage[0]["value"][1]) < 1,
              f"karakv_kv_cache_usage_perc is a fraction between 0 and 1 while the worker decodes: {usage}")
        tenants = query(prom, "karakv_tenant_blocks_in_use")["data"]["result"]
        check([t["metric"].get("tenant") for t in tenants] == ["default"] and float(tenants[0]["value"][1]) > 0,
              f"karakv_tenant_blocks_in_use: one series, the worker's tenant, holding blocks: {tenants}")
        check(worker.poll() is None, "the worker was still decoding when the queries ran")
        # Every family is present now (errors, live sequences, compactions), but those of
        # MAY_BE_ABSENT that do not apply here: the documented list must be exactly what the daemon
        # exports, plus those.
        scraped = set(re.findall(r"^# TYPE (karakv_\w+) (\w+)$", http_get(f"http://127.0.0.1:{metrics_port}/metrics"),
                                 re.M))
        with open(os.path.join(args.deploy, "README.md")) as f:
            documented = set(re.findall(r"^\| `(karakv_\w+)` \| (\w+) \|", f.read(), re.M))
        only_documented = {(name, kind) for name, kind in documented - scraped if name not in absent}
        check(scraped <= documented and not only_documented,
              f"deploy/README.md lists exactly the exported metrics and types (and may list {sorted(absent)}, "
              f"not exported here); only scraped: {sorted(scraped - documented)}, only documented: "
              f"{sorted(only_documented)}")

        # A killed worker stops heartbeating: its lease (2 s) expires and the counter reaches Prometheus.
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        worker = None
        wait_for("the lease expiry in Prometheus",
                 lambda: has_finite_data(query(prom, 'karakv_lease_expiries_total == 1 and karakv_sessions == 0')),
                 timeout=20)
        check(True, "killed worker: karakv_lease_expiries_total == 1 and karakv_sessions == 0 in Prometheus")

        rules = json.loads(http_get(f"{prom}/api/v1/rules"))["data"]["groups"]
        loaded = [r for g in rules for r in g["rules"]]
        with open(os.path.join(args.deploy, "prometheus", "alerts.yml")) as f:
            defined = len(re.findall(r"^\s*- alert:", f.read(), re.M))
        check(defined >= 9 and len(loaded) == defined and all(r["health"] == "ok" for r in loaded),
              f"alerts.yml: {len(loaded)} of its {defined} rules loaded by Prometheus, all evaluating without error: "
              f"{[(r['name'], r['health'], r.get('lastError', '')) for r in loaded if r['health'] != 'ok']}")
        firing = [a["labels"]["alertname"] for a in json.loads(http_get(f"{prom}/api/v1/alerts"))["data"]["alerts"]]
        check("KarakvDown" not in firing and "KarakvInvariantViolation" not in firing,
              f"healthy daemon: neither KarakvDown nor KarakvInvariantViolation is pending or firing ({firing})")
    finally:
        if worker is not None:
            worker.kill()
            worker.wait()
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        if failures:
            with open(os.path.join(workdir, "prometheus.log"), errors="replace") as f:
                print("--- prometheus log ---\n" + f.read()[-3000:])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--karakvd", required=True)
    p.add_argument("--karakv", required=True)
    p.add_argument("--worker", required=True)
    p.add_argument("--deploy", required=True)
    args = p.parse_args()
    promtool, prometheus = shutil.which("promtool"), shutil.which("prometheus")
    if not promtool or not prometheus:
        skip("promtool and prometheus are needed (Debian 12 package 'prometheus'; scripts/setup.sh installs it)")
    started = time.monotonic()
    check_deploy_files(promtool, args.deploy)
    metrics_port = free_port()
    workdir = tempfile.mkdtemp(prefix="karakv-prom-")
    try:
        with Daemon(args.karakvd, *GEOMETRY, "--pool_bytes=64MiB", "--lease_seconds=2", "--log_level=warn",
                    f"--metrics_listen=127.0.0.1:{metrics_port}") as daemon:
            with_prometheus(args, promtool, prometheus, daemon, metrics_port, workdir)
            check(daemon.stop() == 0, "karakvd exits 0 on SIGTERM")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"{len(failures)} failure(s), {time.monotonic() - started:.1f} s")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
