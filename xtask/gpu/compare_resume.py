#!/usr/bin/env python3
"""Compares a straight `lowbit train --json` run with runs resumed from its checkpoints: every
resumed run's steps (losses, grad norms), evals and final-master checksum must equal the
straight run's from the resumed step on, bit for bit. Exits 1 on any difference.

    compare_resume.py STRAIGHT.json RESUMED.json [RESUMED.json ...]
"""
import json
import sys


def load(path):
    with open(path) as f:
        return json.load(f)


def by_step(entries, keys):
    return {e["step"]: tuple(e[k] for k in keys) for e in entries}


def main():
    straight_path, *resumed = sys.argv[1:]
    straight = load(straight_path)
    steps = by_step(straight["steps"], ["loss_bits", "grad_norm_bits"])
    evals = by_step(straight["evals"], ["loss_bits"])
    ok = True
    for path in resumed:
        d = load(path)
        mine = by_step(d["steps"], ["loss_bits", "grad_norm_bits"])
        my_evals = by_step(d["evals"], ["loss_bits"])
        first = min(mine) if mine else None
        problems = []
        if not mine:
            problems.append("ran no step")
        problems += [f"step {s}" for s, v in mine.items() if steps.get(s) != v]
        problems += [f"eval at step {s}" for s, v in my_evals.items() if evals.get(s) != v]
        if d["master_checksum"] != straight["master_checksum"]:
            problems.append("final master checksum")
        name = path.split("/")[-1]
        if problems:
            ok = False
            print(f"{name}: DIFFERS from the straight run: {', '.join(problems)}")
        else:
            print(
                f"{name}: steps {first}-{max(mine)} and {len(my_evals)} evals identical to "
                f"the straight run bit for bit; checksum {d['master_checksum']}"
            )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
