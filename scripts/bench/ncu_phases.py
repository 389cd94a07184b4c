#!/usr/bin/env python3
"""The step time per phase from Nsight Compute: reads the CSV of
`ncu --csv --metrics gpu__time_duration.sum <program>` (one row per kernel launch), sorts each
kernel into a phase by its name and prints the time per phase and the heaviest kernels.

    python3 ncu_phases.py NCU.csv [--steps N] [--json OUT]

--steps divides every total by the number of steps the program ran (the per-step figure).
Phases: attention (flash_*, attention_*), GEMMs (cuBLAS/cuBLASLt kernels: nvjet, xmma, gemm,
cutlass; matmul), loss (xent), optimizer (adamw, sgd, non-finite checks, clip norms),
quantization (mxfp8, nvfp4, stage2d, tile_amax, dequantize) and elementwise (the rest: RMSNorm,
RoPE, SwiGLU, embedding, casts, fills, copies). The kernel durations are ncu's
gpu__time_duration with the kernels serialised, so their sum bounds the step's device time from
above when kernels would overlap, and launch gaps are not in it.
"""
import argparse
import csv
import json
import re
import sys
from collections import defaultdict

RULES = [
    ("attention", r"flash|attention|fmha|sdpa"),
    ("loss", r"xent|cross_entropy|softmax_row"),
    ("quantization", r"mxfp8|nvfp4|stage2d|tile_amax|dequant|quantize|e4m3|u32_max"),
    ("optimizer", r"adamw|sgd|non_finite|clip|max_abs|muon|norm_sq"),
    ("GEMMs", r"nvjet|xmma|gemm|cutlass|matmul|cublas|splitk|sm90_"),
]


def phase(name):
    for p, rx in RULES:
        if re.search(rx, name, re.I):
            return p
    return "elementwise"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--steps", type=float, default=1.0)
    ap.add_argument("--json")
    a = ap.parse_args()
    lines = open(a.csv, errors="replace").read().splitlines()
    # ncu prints its own log lines (==PROF== ...) and the program's output before the CSV.
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        sys.exit(f"{a.csv}: no ncu CSV header (\"ID\",...) found")
    rows = csv.DictReader(lines[start:])
    per_kernel = defaultdict(lambda: [0, 0.0])
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = r.get("Metric Unit", "ns")
        v = float(r["Metric Value"].replace(",", ""))
        ns = v * {"ns": 1, "nsecond": 1, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6}.get(unit, 1)
        k = per_kernel[r["Kernel Name"]]
        k[0] += 1
        k[1] += ns
    phases = defaultdict(float)
    for name, (_, ns) in per_kernel.items():
        phases[phase(name)] += ns
    total = sum(phases.values())
    print(f"device time per step over {a.steps:g} step(s): {total / a.steps / 1e6:.2f} ms")
    print("| phase | ms/step | share |\n|---|---|---|")
    for p, ns in sorted(phases.items(), key=lambda x: -x[1]):
        print(f"| {p} | {ns / a.steps / 1e6:.2f} | {100 * ns / total:.1f}% |")
    print("\n| kernel | phase | launches/step | ms/step |\n|---|---|---|---|")
    top = sorted(per_kernel.items(), key=lambda x: -x[1][1])[:25]
    for name, (n, ns) in top:
        print(f"| {name[:70]} | {phase(name)} | {n / a.steps:g} | {ns / a.steps / 1e6:.3f} |")
    if a.json:
        json.dump({"steps": a.steps, "phases_ms": {p: ns / a.steps / 1e6 for p, ns in phases.items()},
                   "kernels": {n: {"launches": c, "ms": ns / 1e6} for n, (c, ns) in per_kernel.items()}},
                  open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
