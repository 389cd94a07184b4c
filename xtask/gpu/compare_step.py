"""Puts lowbit's data-parallel step (step_bench) beside the PyTorch pipeline (torch_step.py),
both JSON files of one run.

    compare_step.py OURS.json TORCH.json [MORE_OURS.json ...] [--fsdp2 FSDP2.json]

One table per lowbit configuration (model, precision, gradient dtype): each phase's time in
lowbit and torch (the same model, gradient dtype and world size), torch / lowbit (> 1: lowbit
is faster), and lowbit's ratio to the bound measured in the same run (NCCL bus bandwidth for
the collectives, device copy bandwidth for the kernels; target >= 0.85). Then the step's
targets: >= 1.4x faster than torch for 2 GPUs, MXFP8 staged, fp32 gradients; exposed
communication <= 10% of the step with compute. Prints (and writes to $STEP_SUMMARY, if set);
exits 1 if OURS or TORCH is missing or unreadable (further lowbit files are optional).

With --fsdp2 (torch_fsdp2_step.py's JSON: FSDP2 with torchao's float8 all-gather, the same
parameter set), a last section puts, per model, gradient dtype and world size, its whole step
(with reshard_after_forward and without) beside lowbit's totals (runs without compute overlap)
and the torch pipeline's; FSDP2's step also holds the forward and backward of a tiny batch and
its collectives. The file is optional: missing, unreadable or skipped, that is only noted.
"""

import json
import os
import sys

PHASES = ["reduce_scatter", "norm", "optimizer", "staging", "gather", "requantize"]


def runs(path):
    """The runs of a file: a single run object, or an object with a "runs" list."""
    with open(path) as f:
        data = json.load(f)
    return data["runs"] if "runs" in data else [data]


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def speedup(theirs, ours):
    # A phase lowbit does not have (bf16 weights: no re-quantization) has no speedup.
    return theirs / ours if theirs is not None and ours >= 1e-3 else None


def fsdp2_section(path, ours, torch):
    """Lines putting torch_fsdp2_step.py's runs beside lowbit's and the torch pipeline's totals."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        return [f"(left out FSDP2 {path}: {e})"]
    if "skipped" in data:
        return [f"FSDP2 + torchao float8 all-gather: not run ({data['skipped']})"]
    groups = {}
    for r in data.get("runs", [data]):
        groups.setdefault((r["model"], r["grad_dtype"], r["world"]), []).append(r)
    lines = []
    for (model, grad_dtype, world), rs in groups.items():
        r0 = rs[0]
        lines += ["", f"{model}, {grad_dtype} grads, {world}x {r0['card']}: FSDP2 + torchao "
                      f"{r0.get('torchao', '?')} float8 all-gather (torch {r0.get('torch', '?')}, "
                      f"1x{r0.get('tokens', '?')} tokens, {r0.get('optimizer', '?')} AdamW)"]
        for r in sorted(rs, key=lambda r: not r["reshard_after_forward"]):
            lines.append(f"  reshard_after_forward={str(r['reshard_after_forward']):<5} "
                         f"step {r['total_ms']:9.3f} ms (fwd+bwd {r['fwd_bwd_ms']:.3f}, clip "
                         f"{r['clip_ms']:.3f}, optimizer {r['optimizer_ms']:.3f}, scales "
                         f"{r['precompute_scale_ms']:.3f}), peak {r['peak_bytes'] / 2**30:.2f} GiB")
        best = min(r["total_ms"] for r in rs)
        for o in ours:
            if (o["model"], o["grad_dtype"], o["world"]) != (model, grad_dtype, world):
                continue
            if o.get("overlap"):
                continue  # its step holds compute; FSDP2's the tiny batch's
            up = speedup(best, o["total_ms"])
            lines.append(f"  lowbit {o['precision']:<12} step {o['total_ms']:9.3f} ms "
                         f"(FSDP2's best / lowbit: {fmt(up, '.2f')}x)")
        for t in torch:
            if (t["model"], t["grad_dtype"], t["world"]) == (model, grad_dtype, world):
                lines.append(f"  torch pipeline      step {t['total_ms']:9.3f} ms "
                             f"(FSDP2's best / torch pipeline: "
                             f"{fmt(speedup(best, t['total_ms']), '.2f')}x)")
    return lines


def main():
    argv = sys.argv[1:]
    fsdp2 = None
    if "--fsdp2" in argv:
        i = argv.index("--fsdp2")
        if i + 1 >= len(argv):
            sys.exit(__doc__)
        fsdp2 = argv[i + 1]
        del argv[i:i + 2]
    if len(argv) < 2:
        sys.exit(__doc__)
    try:
        ours, torch = runs(argv[0]), runs(argv[1])
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"compare_step: {e}")
    lines = []
    for more in argv[2:]:  # optional (the overlap run): a missing one is only noted
        try:
            ours += runs(more)
        except (OSError, ValueError, KeyError) as e:
            lines.append(f"(left out {more}: {e})")
    theirs = {(r["model"], r["grad_dtype"], r["world"]): r for r in torch}
    targets = []
    for r in ours:
        t = theirs.get((r["model"], r["grad_dtype"], r["world"]))
        head = (f"{r['model']}, {r['precision']} weights, {r['grad_dtype']} grads, "
                f"{r['world']}x {r['card']}")
        if t:
            head += f" vs torch {t.get('torch', '?')}"
        lines += ["", head,
                  f"{'phase':<16} {'lowbit ms':>10} {'torch ms':>10} {'speedup':>8} "
                  f"{'vs bound':>9}"]
        for p in PHASES:
            ms = r["phases_ms"][p]
            tms = t["phases_ms"].get(p) if t else None
            ratio = r.get("ratios", {}).get(p)
            lines.append(f"{p:<16} {ms:>10.3f} {fmt(tms, '10.3f'):>10} "
                         f"{fmt(speedup(tms, ms), '7.2f') + 'x' if speedup(tms, ms) else '-':>8} "
                         f"{fmt(ratio, '9.2f'):>9}")
        tt = t["total_ms"] if t else None
        total_speedup = speedup(tt, r["total_ms"])
        lines.append(f"{'total':<16} {r['total_ms']:>10.3f} {fmt(tt, '10.3f'):>10} "
                     f"{fmt(total_speedup, '7.2f') + 'x' if total_speedup else '-':>8}")
        tpeak = t["peak_bytes"] / 2**30 if t else None
        lines.append(f"peak memory per rank: lowbit {r['peak_bytes'] / 2**30:.2f} GiB "
                     f"(closed form {r['memory']['closed_form_bytes'] / 2**30:.2f} GiB), "
                     f"torch {fmt(tpeak, '.2f')} GiB")
        if r.get("norm_stepped_ms") is not None:
            nr = r.get("norm_stepped_ratio")
            lines.append(f"norm as the one-call step runs it (beside the reductions): "
                         f"{r['norm_stepped_ms']:.3f} ms ({fmt(nr, '.2f')}x of its bound)")
        low = [p for p in PHASES if r["ratios"].get(p) is not None and r["ratios"][p] < 0.85]
        if low:
            lines.append("phases below 0.85x of their bound: " + ", ".join(
                f"{p} {r['ratios'][p]:.2f}x" for p in low))
        ov = r.get("overlap")
        if ov:
            lines.append(f"overlap: exposed {ov['exposed_ms']:.2f} ms of a "
                         f"{ov['step_with_compute_ms']:.2f} ms step "
                         f"({100 * ov['exposed_fraction']:.1f}%)")
            if "exposed_comm_ms" in ov:
                lines.append(f"overlap: exposed communication (less the iteration's local kernels: norm, optimizer, staging, re-quantization, zeroing the gradients) "
                             f"{ov['exposed_comm_ms']:.2f} ms "
                             f"({100 * ov['exposed_comm_fraction']:.1f}%, target <= 10%)")
        if (r["world"] == 2 and r["precision"] == "mxfp8" and r["grad_dtype"] == "fp32"
                and total_speedup is not None):
            met = "met" if total_speedup >= 1.4 else "NOT met"
            targets.append(f"target >= 1.4x torch ({r['model']}, 2 GPUs, mxfp8 staged, fp32 "
                           f"grads): {total_speedup:.2f}x, {met}")
    lines += [""] + (targets or ["no 2-GPU mxfp8/fp32 run with a torch baseline to compare"])
    if fsdp2:
        lines += fsdp2_section(fsdp2, ours, torch)
    text = "\n".join(lines)
    print(text)
    if os.environ.get("STEP_SUMMARY"):
        with open(os.environ["STEP_SUMMARY"], "w") as f:
            f.write("data-parallel step, lowbit vs torch\n" + text + "\n")


if __name__ == "__main__":
    main()
