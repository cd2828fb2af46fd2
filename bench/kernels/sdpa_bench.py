#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention on the same decode problem kernels_bench times: one query
per sequence over K/V laid out contiguously ([seqs, kv_heads, tokens, head_dim], fp16), grouped-query
attention. Prints "sdpa_layer_us <us> us" and "sdpa_bandwidth <GB/s> GB/s" (K/V bytes read per
second; back-to-back calls timed with CUDA events), and "sdpa_layer_sync_us <us> us" (each call
followed by a synchronize, wall clock: how kernels_bench times the paged kernel), the rows
scripts/gpu-check.sh puts beside the paged kernel's.

usage: sdpa_bench.py --model smollm2|llama8b [--seqs 64] [--tokens 8192] [--iters 20]
"""
import argparse
import sys
import time

MODELS = {"smollm2": (30, 9, 3, 64), "llama8b": (32, 32, 8, 128)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=MODELS, default="smollm2")
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        print(f"no torch: {e}")
        return 3
    if not torch.cuda.is_available():
        print("no device: torch.cuda.is_available() is False")
        return 3
    _, hq, hk, hd = MODELS[a.model]
    dev = torch.device("cuda")
    q = torch.randn(a.seqs, hq, 1, hd, device=dev, dtype=torch.float16)
    k = torch.randn(a.seqs, hk, a.tokens, hd, device=dev, dtype=torch.float16)
    v = torch.randn_like(k)

    def run():
        try:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        except TypeError:  # torch < 2.5: expand the KV heads (extra reads are not counted)
            g = hq // hk
            return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1))

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(a.iters):
        run()
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / a.iters
    # As kernels_bench times the paged kernel (karakv's backend returns once its stream has
    # synchronized): each call followed by a synchronize, wall clock.
    t0 = time.perf_counter()
    for _ in range(a.iters):
        run()
        torch.cuda.synchronize()
    sync_seconds = (time.perf_counter() - t0) / a.iters
    kv_bytes = 2 * k.numel() * k.element_size()
    print(f"# torch {torch.__version__} on {torch.cuda.get_device_name(0)}")
    print(f"sdpa_layer_us {seconds * 1e6:.1f} us")
    print(f"sdpa_bandwidth {kv_bytes / seconds / 1e9:.1f} GB/s")
    print(f"sdpa_layer_sync_us {sync_seconds * 1e6:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
