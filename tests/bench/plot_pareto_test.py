"""bench/plot_pareto.py names each quality row's policy family from its params: the rows of the
2026-12-06 suite (params as given, no `budget` on the `kara` defaults) stay "kara (v2 defaults)",
and rows written since llama_quality records the parameters as the daemon resolved them are named by
what ran (the version 3 defaults: budget 768, fit 1, prompt auto)."""
import os
import sys

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import plot_pareto  # noqa: E402


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def main():
    cases = [
        ("kara", "norm=0 observers=1 period=16 recent=256 rho=0.25 window=128", "kara (v2 defaults)"),
        ("kara", "agg=0 budget=768 fit=1 norm=0 observers=1 period=16 prompt=2 recent=256 rho=0.25 window=128",
         "kara v3 fit, prompt auto"),
        ("k70", "budget=1104 prompt=1 recent=256", "kara v3, prompt windowed"),
        ("k54", "budget=800 fit=2", "kara v3 fit 2, prompt kept"),
        ("kara", "budget=0 prompt=0 rho=0.25", "kara v2, prompt kept"),
        ("ks", "budget=0 share=0.5", "kara v3 share, prompt kept"),
        ("k2", "rho2=0.25 prompt=1", "kara, two levels, prompt windowed"),
        ("snapkv@k70", "c_max=1100", "snapkv"),
        ("none", "-", "none"),
    ]
    for policy, params, want in cases:
        got = plot_pareto.family({"policy": policy, "params": params})
        if got != want:
            fail(f"{policy} [{params}]: {got!r}, expected {want!r}")
    print(f"PASS: {len(cases)} rows named")


if __name__ == "__main__":
    main()
