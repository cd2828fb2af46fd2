#!/usr/bin/env python3
"""Draws the charts of a karakv-bench run from the CSVs it wrote into --out_dir.

  ratios.png  the ratio of every row of p1/p2/p3/p5/serve.csv (karakv / its baseline), one panel per
              mode, bars green (target met), red (missed) or grey (context), targets dashed
  memory.png  memory_series.csv: resident K/V MiB per sequence over decode steps, one line per policy
  quant_ratio.png  quant_ratio.csv: actual compression ratio vs context length, one line per storage
              format; the nominal ratios (16 / bits) dashed, labelled with their formats
  serve.png   serve_runs.csv and serve_series.csv (the Kara paper's Figure 1): (a) output throughput vs
              max batch, one line per policy; (b) sequences decoding vs decode step and (c) K/V bytes
              held per decoding sequence vs decode step, both at the largest max batch (closed-loop
              runs)
  serve_open.png  the open-loop runs of serve_runs.csv (--serve_rates): (a) TTFT p50 and p99 vs
              arrival rate and (b) output throughput vs arrival rate, one line per policy, at the
              largest max batch

Usage: bench/plot.py RESULTS_DIR [OUTPUT_DIR]   (default OUTPUT_DIR: RESULTS_DIR)
A chart whose CSVs are absent is skipped. Needs matplotlib; without it, says so and exits 0 so
that scripts/bench.sh carries on.
"""
import csv
import os
import re
import sys
import textwrap

RATIO_MODES = ("p1", "p2", "p3", "p5", "serve")
COLORS = {"PASS": "tab:green", "MISS": "tab:red", "info": "tab:gray"}
POLICY_STYLE = {  # color, line style: distinguishable in greyscale too
    "none": ("black", "-"),
    "kara": ("tab:blue", "-"),
    "snapkv": ("tab:orange", "--"),
    "streaming": ("tab:green", ":"),
    "kara+kivi4": ("tab:purple", "-."),
}


def read_csv(path):
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def target_value(text):
    """'>= 3x' -> 3.0, '>= 60%' -> 0.6, '-' -> None."""
    m = re.match(r"\s*[<>]=\s*([0-9.]+)\s*(x|%)", text)
    if not m:
        return None
    v = float(m.group(1))
    return v / 100 if m.group(2) == "%" else v


def is_percent(row):
    """Whether karakv-bench prints this row's ratio as a percentage (its ratio_text column; older
    CSVs lack it, then the target decides)."""
    if row.get("ratio_text"):
        return row["ratio_text"].endswith("%")
    return "%" in row["target"]


def ratio_label(row):
    if row.get("ratio_text"):
        return row["ratio_text"]
    r = float(row["ratio"])
    return f"{100 * r:.1f}%" if is_percent(row) else f"{r:.2f}x"


def plot_ratios(results_dir, output, plt):
    panels = []
    for mode in RATIO_MODES:
        rows = read_csv(os.path.join(results_dir, mode + ".csv"))
        if rows:
            panels.append((mode.upper(), rows))
    if not panels:
        return False
    heights = [1.2 + 0.5 * len(rows) for _, rows in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, sum(heights)), squeeze=False, layout="constrained",
                             gridspec_kw={"height_ratios": heights})
    for ax, (mode, rows) in zip(axes[:, 0], panels):
        ratios = [float(r["ratio"]) for r in rows]
        percent = all(is_percent(r) for r in rows)  # the axis in %, when every row reads so
        y = list(range(len(rows)))[::-1]  # first row on top
        ax.barh(y, ratios, color=[COLORS.get(r["result"], "tab:gray") for r in rows], height=0.6)
        labels = [textwrap.fill(r["metric"], 44) + "\nvs " + textwrap.fill(r["baseline_name"], 45) for r in rows]
        ax.set_yticks(y)
        ax.set_yticklabels(labels, fontsize=7)
        positive = [v for v in ratios if v > 0]
        log = bool(positive) and max(positive) / min(positive) > 30
        top = max(ratios + [t for t in (target_value(r["target"]) for r in rows) if t is not None])
        if log:
            ax.set_xscale("log")
            lo, hi = min(positive), top
            ticks = [t for t in (0.05, 0.1, 0.2, 0.5, 1, 2, 3, 5, 10, 20, 50, 100, 200) if lo / 2 <= t <= hi * 3]
            ax.set_xticks(ticks)
            ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}x"))
            ax.xaxis.set_minor_formatter(plt.NullFormatter())
        for yy, r, v in zip(y, rows, ratios):
            ax.text(v * (1.05 if log else 1) + (0 if log else top * 0.01), yy, ratio_label(r),
                    va="center", fontsize=7)
        for r in rows:
            t = target_value(r["target"])
            if t is not None:
                ax.axvline(t, color="black", linestyle="--", linewidth=1)
                ax.text(t, len(rows) - 0.5, f" target {r['target']}", fontsize=7, va="bottom")
        ax.set_xlim(right=top * (3 if log else 1.2))
        if not log:
            ax.set_xlim(left=0)
        if percent:
            ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{100 * v:.0f}%"))
        ax.set_ylim(-0.6, len(rows) - 0.05)
        ax.set_title(f"{mode}: karakv / baseline" + (" (log scale)" if log else ""), fontsize=9, loc="left")
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle("karakv-bench ratios (green: target met, red: missed, grey: context)", fontsize=10)
    fig.savefig(output, dpi=90)
    return True


def plot_memory(results_dir, output, plt):
    rows = read_csv(os.path.join(results_dir, "memory_series.csv"))
    if not rows:
        return False
    policies = []
    for r in rows:
        if r["policy"] not in policies:
            policies.append(r["policy"])
    series = {}
    for p in policies:
        mine = [r for r in rows if r["policy"] == p]
        series[p] = ([int(r["step"]) for r in mine], [float(r["kv_mib"]) for r in mine])
    # Policies whose curves are identical (snapkv and streaming share trigger and budget) share a line.
    drawn = []
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for p in policies:
        if any(series[p] == series[q] for q in drawn):
            continue
        same = [q for q in policies if q != p and series[q] == series[p]]
        drawn.append(p)
        color, style = POLICY_STYLE.get(p, (None, "-"))
        label = p if not same else " = ".join([p] + same) + " (identical)"
        ax.plot(*series[p], label=label, color=color, linestyle=style, linewidth=1.8)
    seqs = rows[0]["sequences"]
    ax.set_xlabel("decode step")
    ax.set_ylabel("resident K/V per sequence (MiB)")
    ax.set_title(f"Resident KV cache per sequence (mean of {seqs}), SmolLM2-135M geometry, fp16", fontsize=10)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(title="policy", fontsize=8)
    fig.tight_layout()
    fig.savefig(output, dpi=90)
    return True


FORMAT_STYLE = {  # color, marker
    "fp16": ("black", "o"),
    "kivi2": ("tab:blue", "s"),
    "kivi4": ("tab:cyan", "s"),
    "tq2": ("tab:red", "^"),
    "tq3": ("tab:orange", "^"),
    "tq4": ("tab:olive", "^"),
    "kara+kivi4": ("tab:purple", "D"),
    "kara": ("tab:gray", "D"),
}


def plot_quant_ratio(results_dir, output, plt):
    rows = read_csv(os.path.join(results_dir, "quant_ratio.csv"))
    if not rows:
        return False
    formats = []
    for r in rows:
        if r["format"] not in formats:
            formats.append(r["format"])
    contexts = sorted({int(r["context"]) for r in rows})
    fig, ax = plt.subplots(figsize=(8, 4.8))
    series = {}
    for f in formats:
        mine = sorted((r for r in rows if r["format"] == f), key=lambda r: int(r["context"]))
        series[f] = ([int(r["context"]) for r in mine], [round(float(r["actual_ratio"]), 3) for r in mine], mine)
    drawn = []
    for f in formats:
        x, y, mine = series[f]
        if any(series[g][:2] == (x, y) for g in drawn):
            continue  # drawn with the format it equals
        same = [g for g in formats if g != f and series[g][:2] == (x, y)]
        drawn.append(f)
        color, marker = FORMAT_STYLE.get(f, (None, "o"))
        label = f"{f} ({mine[0]['policy']})" + "".join(f" = {g}" for g in same) + (" (identical)" if same else "")
        ax.plot(x, y, marker=marker, color=color, linewidth=1.8, label=label,
                linestyle=":" if f == "kara" else "-")
    # Nominal ratios: one dashed line per distinct value, labelled with the formats that have it.
    nominal = {}
    for f in formats:
        v = float(next(r for r in rows if r["format"] == f)["nominal_ratio"])
        if v > 1:
            nominal.setdefault(round(v, 2), []).append(f)
    for v, names in sorted(nominal.items()):
        ax.axhline(v, linestyle="--", linewidth=1, color="dimgray", alpha=0.8)
        ax.text(contexts[0], v, f" nominal {v:g}x: {', '.join(names)}", fontsize=7, va="bottom", color="dimgray")
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts)
    ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v / 1024:g}k" if v >= 1024 else f"{v:g}"))
    ax.xaxis.set_minor_formatter(plt.NullFormatter())
    ax.set_xlabel("context length (logical tokens)")
    ax.set_ylabel("fp16 bytes / bytes held")
    ax.set_ylim(0, max([9] + [float(r["actual_ratio"]) * 1.1 for r in rows]))
    ax.set_title("Actual compression ratio (solid) vs the format's nominal 16/bits (dashed),\n"
                 "SmolLM2-135M geometry, residual 128", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(output, dpi=90)
    return True


def serve_rate(row):
    """The run's arrival rate (requests/s); 0 for a closed-loop run (and CSVs from before the column)."""
    return float(row.get("rate_req_s") or 0)


def policies_of(runs):
    policies = []
    for r in runs:
        if r["policy"] not in policies:
            policies.append(r["policy"])
    return policies


def plot_serve(results_dir, output, plt):
    runs = [r for r in read_csv(os.path.join(results_dir, "serve_runs.csv")) if serve_rate(r) == 0]
    if not runs:
        return False
    series = [r for r in read_csv(os.path.join(results_dir, "serve_series.csv")) if serve_rate(r) == 0]
    policies = []
    for r in runs:
        if r["policy"] not in policies:
            policies.append(r["policy"])
    batches = sorted({int(r["max_batch"]) for r in runs})
    largest = batches[-1]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.3))
    ax = axes[0]
    for p in policies:
        mine = sorted((r for r in runs if r["policy"] == p), key=lambda r: int(r["max_batch"]))
        color, style = POLICY_STYLE.get(p, (None, "-"))
        ax.plot([int(r["max_batch"]) for r in mine], [float(r["throughput_tok_s"]) for r in mine], marker="o",
                color=color, linestyle=style, linewidth=1.8, label=p)
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches)
    ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(plt.NullFormatter())
    ax.set_xlabel("max batch (decoding sequences allowed)")
    ax.set_ylabel("output throughput (tokens/s)")
    ax.set_ylim(bottom=0)
    ax.set_title("(a) output throughput vs max batch", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, title="policy")
    def decoding(r):
        return float(r["decoding"])

    def kv_per_sequence(r):
        return float(r["kv_mib"]) / max(1.0, float(r["decoding"]))

    for ax, value, label, title in ((axes[1], decoding, "sequences decoding",
                                     f"(b) sequences decoding, max batch {largest}"),
                                    (axes[2], kv_per_sequence, "K/V held per decoding sequence (MiB)",
                                     f"(c) K/V held per sequence, max batch {largest}")):
        for p in policies:
            mine = [r for r in series if r["policy"] == p and int(r["max_batch"]) == largest]
            if not mine:
                continue
            color, style = POLICY_STYLE.get(p, (None, "-"))
            ax.plot([int(r["step"]) for r in mine], [value(r) for r in mine], color=color, linestyle=style,
                    linewidth=1.4, label=p)
        ax.set_xlabel("engine decode step")
        ax.set_ylabel(label)
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle("karakv-bench serve: continuous batching through karakvd, one fixed pool", fontsize=10)
    fig.tight_layout()
    fig.savefig(output, dpi=90)
    return True


def plot_serve_open(results_dir, output, plt):
    runs = [r for r in read_csv(os.path.join(results_dir, "serve_runs.csv")) if serve_rate(r) > 0]
    if not runs:
        return False
    largest = max(int(r["max_batch"]) for r in runs)
    runs = [r for r in runs if int(r["max_batch"]) == largest]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.3))
    for p in policies_of(runs):
        mine = sorted((r for r in runs if r["policy"] == p), key=serve_rate)
        color, style = POLICY_STYLE.get(p, (None, "-"))
        rates = [serve_rate(r) for r in mine]
        axes[0].plot(rates, [float(r["ttft_p99_ms"]) for r in mine], marker="o", color=color, linestyle=style,
                     linewidth=1.8, label=f"{p} p99")
        axes[0].plot(rates, [float(r["ttft_p50_ms"]) for r in mine], marker=".", color=color, linestyle=style,
                     linewidth=0.8, alpha=0.6, label=f"{p} p50")
        axes[1].plot(rates, [float(r["throughput_tok_s"]) for r in mine], marker="o", color=color, linestyle=style,
                     linewidth=1.8, label=p)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("TTFT from arrival (ms, log scale)")
    axes[0].set_title(f"(a) time to first token vs arrival rate, max batch {largest}", fontsize=10)
    axes[1].set_ylabel("output throughput (tokens/s)")
    axes[1].set_ylim(bottom=0)
    axes[1].set_title(f"(b) output throughput vs arrival rate, max batch {largest}", fontsize=10)
    for ax in axes:
        ax.set_xlabel("arrival rate (requests/s, Poisson)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("karakv-bench serve --serve_rates: open loop through karakvd, one fixed pool", fontsize=10)
    fig.tight_layout()
    fig.savefig(output, dpi=90)
    return True


def main():
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    results_dir = sys.argv[1]
    out_dir = sys.argv[2] if len(sys.argv) > 2 else results_dir
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot.py: matplotlib is not installed; skipping the charts", file=sys.stderr)
        return 0
    os.makedirs(out_dir, exist_ok=True)
    drawn = 0
    for name, draw in (("ratios.png", plot_ratios), ("memory.png", plot_memory),
                       ("quant_ratio.png", plot_quant_ratio), ("serve.png", plot_serve),
                       ("serve_open.png", plot_serve_open)):
        path = os.path.join(out_dir, name)
        if draw(results_dir, path, plt):
            print(f"plot.py: wrote {path}")
            drawn += 1
    if drawn == 0:
        print(f"plot.py: no karakv-bench CSV in {results_dir}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
