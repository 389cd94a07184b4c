#!/usr/bin/env python3
"""lowbit's Llama training step on one GPU at the shapes of `torch_llama_train.py`: runs `lowbit
train --device cuda --compute bf16 --metrics FILE` per (shape, precision) and reads its per-step
records (docs/metrics.md).

    python3 lowbit_llama_train.py --lowbit PATH [--shape 125m 1b 8b-layers]
        [--precision bf16 mxfp8 nvfp4] [--recompute off ...] [--microbatches 1 ...]
        [--steps 8] [--warmup 3]
        [--json OUT]

Per run: tokens/s as the timed steps' tokens over their summed wall time (steps after
`--warmup`, whose records carry `tokens_per_s` of that step alone), MFU with the same formula and
peak as the torch script (tokens/s × (6·params + 12·layers·seq·d) / 989e12), the device peak
(lowbit's allocator high-water mark, `device_peak_bytes`) beside the closed form of the model's
activations (`activations_per_rank`), and the final loss; per `--recompute` level given. A run that fails
is reported with its stderr's last line, never skipped.
"""
import argparse
import json
import os
import subprocess
import tempfile

PEAK = 989e12
# name: (lowbit preset, extra flags, batch, seq); shapes as torch_llama_train.py's SHAPES.
SHAPES = {
    "125m": ("llama-125m", [], 32, 1024),
    "1b": ("llama-1b", [], 8, 2048),
    "8b-layers": ("llama-8b-layers", ["--layers", "4"], 2, 4096),
}


def run(lowbit, shape, precision, recompute, micro, steps, warmup, extra, timeout):
    preset, flags, batch, seq = SHAPES[shape]
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        cmd = [lowbit, "train", "--model", preset, *flags, "--seq", str(seq),
               "--batch", str(batch), "--precision", precision, "--device", "cuda",
               "--compute", "bf16", "--steps", str(steps), "--eval-every", "0",
               "--eval-samples", "1", "--metrics", metrics, "--log-every", "0",
               "--recompute", recompute, "--microbatches", str(micro), *extra]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"shape": shape, "precision": precision, "recompute": recompute,
                    "microbatches": micro, "cmd": " ".join(cmd[1:]), "error": f"timed out after {timeout} s"}
        recs = []
        if os.path.exists(metrics):
            recs = [json.loads(line) for line in open(metrics)]
    steps_ = [r for r in recs if r.get("kind") == "step"]
    out = {"shape": shape, "precision": precision, "recompute": recompute,
           "microbatches": micro, "batch": batch, "seq": seq,
           "cmd": " ".join(cmd[1:])}
    if p.returncode != 0 or len(steps_) <= warmup:
        tail = (p.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        out["error"] = f"exit {p.returncode}: {tail}"[:400]
        return out
    head = next(r for r in recs if r.get("kind") == "run")
    m = head["config"]["model"]
    timed = steps_[warmup:]
    tokens = batch * seq * len(timed)
    secs = sum(batch * seq / r["tokens_per_s"] for r in timed)
    tok_s = tokens / secs
    # The model's parameters: the report's FLOPs per token carry them; recompute from the record.
    mfu = timed[-1].get("mfu")
    fpt = None
    if mfu is not None and timed[-1]["tokens_per_s"] > 0:
        fpt = mfu * PEAK / timed[-1]["tokens_per_s"]
    out.update({
        "layers": m["layers"], "dim": m["dim"],
        "step_ms": 1e3 * secs / len(timed),
        "tokens_per_s": tok_s,
        "mfu": tok_s * fpt / PEAK if fpt else None,
        "device_peak_gib": max(r["device_peak_bytes"] or 0 for r in steps_) / 2**30,
        "activations_gib": (head["config"].get("activations_per_rank") or 0) / 2**30,
        "final_loss": steps_[-1]["loss"],
    })
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lowbit", required=True)
    ap.add_argument("--shape", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--precision", nargs="+", default=["bf16", "mxfp8", "nvfp4"])
    ap.add_argument("--recompute", nargs="+", default=["off"],
                    choices=["off", "selective", "mlp", "full"])
    ap.add_argument("--microbatches", nargs="+", type=int, default=[1],
                    help="gradient-accumulation steps per optimizer step (1: the whole batch "
                         "at once, as the torch script runs it)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--extra", nargs="*", default=[], help="more `lowbit train` flags")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per run")
    ap.add_argument("--json")
    a = ap.parse_args()
    res = {"runs": []}
    for s in a.shape:
        for pr in a.precision:
            for rc in a.recompute:
                for mb in a.microbatches:
                    r = run(a.lowbit, s, pr, rc, mb, a.steps, a.warmup, a.extra, a.timeout)
                    print(json.dumps(r), flush=True)
                    res["runs"].append(r)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
