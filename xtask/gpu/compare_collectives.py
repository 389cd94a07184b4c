"""Compares lowbit's NCCL benchmark with torch.distributed's, both JSON files of one run.

    compare_collectives.py OURS.json TORCH.json

Prints (and writes to $STEP_SUMMARY, if set) one row per op, dtype and size: bus bandwidth of
each and their ratio. Exits 1 if either file is missing.
"""

import json
import os
import sys


def load(path):
    with open(path) as f:
        return json.load(f)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    try:
        ours, torch = load(sys.argv[1]), load(sys.argv[2])
    except OSError as e:
        sys.exit(f"compare_collectives: {e}")
    theirs = {(r["op"], r["dtype"], r["bytes"]): r for r in torch["results"]}
    lines = [f"collectives on {ours.get('card', '?')} x{ours.get('gpus', '?')}: "
             f"{ours.get('impl', 'lowbit')} vs {torch.get('impl', 'torch')} (bus bandwidth, GB/s)",
             f"{'op':<15} {'dtype':>5} {'MiB':>6} {'lowbit':>9} {'torch':>9} {'ratio':>7}"]
    ratios = []
    for r in ours["results"]:
        t = theirs.get((r["op"], r["dtype"], r["bytes"]))
        tb = t["busbw_gbs"] if t else float("nan")
        ratio = r["busbw_gbs"] / tb if t and tb > 0 else float("nan")
        if r["bytes"] >= 16 << 20 and ratio == ratio:
            ratios.append(ratio)
        lines.append(f"{r['op']:<15} {r['dtype']:>5} {r['bytes'] >> 20:>6} "
                     f"{r['busbw_gbs']:>9.1f} {tb:>9.1f} {ratio:>7.3f}")
    if ratios:
        lines.append(f"sizes >= 16 MiB: ratio min {min(ratios):.3f}, "
                     f"{sum(x >= 0.95 for x in ratios)}/{len(ratios)} within 5% or faster")
    text = "\n".join(lines)
    print(text)
    if os.environ.get("STEP_SUMMARY"):
        with open(os.environ["STEP_SUMMARY"], "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
