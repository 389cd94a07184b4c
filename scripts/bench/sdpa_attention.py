#!/usr/bin/env python3
"""torch SDPA causal GQA attention in bf16, the baseline of lowbit's flash attention.

Times `F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)` forward and
forward + backward at the shapes of `crates/lowbit-device/tests/cuda_flash.rs`'s `flash_timing`
and prints one JSON object per shape. FLOPs as there (FlashAttention-2's convention): forward
4 * b * h * s^2 * d / 2 (causal), backward 2.5x the forward, so forward + backward counts 3.5x.
Median of `--reps` CUDA-event-timed runs after 3 warm-ups.

    python3 scripts/bench/sdpa_attention.py [--reps 20] [--json out.json]
"""

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

SHAPES = [  # (batch, seq, heads, kv_heads, head_dim)
    (8, 2048, 32, 8, 64),
    (2, 4096, 32, 8, 128),
    (8, 1024, 12, 12, 64),
]


def median_ms(fn, reps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        z.record()
        z.synchronize()
        times.append(a.elapsed_time(z))
    return statistics.median(times)


def bench(b, s, h, kvh, d, reps):
    dev = torch.device("cuda")
    # SDPA's layout: [batch, heads, seq, dim].
    q = torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, kvh, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, kvh, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16)

    def fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def fwd_bwd():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(dout)

    flops = 4.0 * b * h * s * s * d / 2
    tf, tb = median_ms(fwd, reps), median_ms(fwd_bwd, reps)
    return {
        "op": "torch_sdpa",
        "batch": b,
        "seq": s,
        "heads": h,
        "kv_heads": kvh,
        "head_dim": d,
        "fwd_ms": round(tf, 4),
        "fwd_tflops": round(flops / tf / 1e9, 1),
        "fwd_bwd_ms": round(tb, 4),
        "fwd_bwd_tflops": round(3.5 * flops / tb / 1e9, 1),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", help="also write the list of results here")
    args = ap.parse_args()
    results = []
    for shape in SHAPES:
        r = bench(*shape, args.reps)
        print(json.dumps(r), flush=True)
        results.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
