#!/usr/bin/env python3
"""torch.optim.Muon on the matrices of one Llama-3-8B layer: the baseline of lowbit's
`muon_bench` (crates/lowbit-optim/benches/muon_bench.rs), run by it on the same card.

q, o 4096x4096; k, v 1024x4096; gate, up 14336x4096; down 4096x14336; f32 parameters and
gradients on the GPU; PyTorch's defaults (momentum 0.95, Nesterov, 5 Newton-Schulz steps in bf16,
the original lr adjustment), lr 0.02, weight decay 0.1 (lowbit's MuonConfig default too).
`opt.step()` timed with CUDA events, median of --reps after --warmup steps.

    python3 torch_muon.py [--json PATH] [--reps 10] [--warmup 3]
"""
import argparse
import json
import statistics

import torch

LAYER = [("q", 4096, 4096), ("k", 1024, 4096), ("v", 1024, 4096), ("o", 4096, 4096),
         ("gate", 14336, 4096), ("up", 14336, 4096), ("down", 4096, 14336)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(0)
    params = []
    for _, r, c in LAYER:
        p = torch.nn.Parameter(torch.randn(r, c, device=dev, generator=g) * 0.02)
        p.grad = torch.randn(r, c, device=dev, generator=g)
        params.append(p)
    opt = torch.optim.Muon(params, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    for _ in range(args.warmup):
        opt.step()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        opt.step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    ms = statistics.median(times)
    card = torch.cuda.get_device_name(0)
    print(f"torch.optim.Muon {torch.__version__} on {card}: one Llama-3-8B layer, "
          f"{ms:.2f} ms/step (median of {args.reps}; min {min(times):.2f}, max {max(times):.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"card": card, "torch": torch.__version__, "ms": ms, "times_ms": times,
                       "shapes": LAYER}, f)


if __name__ == "__main__":
    main()
