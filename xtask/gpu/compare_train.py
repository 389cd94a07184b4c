#!/usr/bin/env python3
"""Compares `lowbit train --json` runs: the first is the reference (the CPU backend), every
other must have the same losses, grad norms, eval losses and final-master checksum, bit for bit.
Prints a summary (final loss beside the floor, wall time, memory) for each run; exits 1 on any
difference."""
import json
import sys


def load(path):
    with open(path) as f:
        return json.load(f)


def trajectory(d):
    return (
        [s["loss_bits"] for s in d["steps"]],
        [s["grad_norm_bits"] for s in d["steps"]],
        [e["loss_bits"] for e in d["evals"]],
        d["master_checksum"],
    )


def main():
    paths = sys.argv[1:]
    runs = [(p, load(p)) for p in paths]
    ok = True
    ref_path, ref = runs[0]
    for path, d in runs:
        final = d["evals"][-1]["loss"] if d["evals"] else float("nan")
        floor = d["floor"]
        mem = d["memory"]["per_rank"]["total"]
        base = d["memory"]["bf16_unsharded"]["total"]
        print(
            f"{path.split('/')[-1]:<28} {d['config']}\n"
            f"    final eval {final:.4f}  floor {floor if floor is None else round(floor, 4)}  "
            f"wall {d.get('timing', d).get('wall_s', float('nan')):.1f} s  memory/rank {mem / 1024:.1f} KiB (bf16 unsharded "
            f"{base / 1024:.1f} KiB)  checksum {d['master_checksum']}"
        )
        if path != ref_path:
            names = ["losses", "grad norms", "eval losses", "master checksum"]
            for name, a, b in zip(names, trajectory(ref), trajectory(d)):
                if a != b:
                    ok = False
                    print(f"    DIFFERS from {ref_path.split('/')[-1]}: {name}")
            if ok:
                print(f"    identical to {ref_path.split('/')[-1]} bit for bit")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
