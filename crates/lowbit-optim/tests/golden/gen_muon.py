#!/usr/bin/env python3
"""Golden vectors for lowbit-optim's `Muon` from PyTorch's own `torch.optim.Muon` (PyTorch >= 2.9,
on the CPU). Writes `muon.json` beside this script; `crates/lowbit-optim/tests/optim/muon.rs` reads it.

Run (any PyTorch >= 2.9; the committed file was made with the version recorded in it):

    python3 -m venv /tmp/tv && /tmp/tv/bin/pip install torch
    /tmp/tv/bin/python crates/lowbit-optim/tests/golden/gen_muon.py

What it does, per configuration (hyper-parameters chosen exactly representable in f32, so that
PyTorch's Python-float scalars and lowbit's f32 hyper-parameters are the same numbers):

- parameters of shapes 8x16 (wide), 16x8 (tall: Newton-Schulz runs on the transpose), 32x32 and
  a grouped expert tensor [2, 8, 16], whose experts PyTorch sees as two separate 8x16 parameters
  (Muon is per parameter, so this is exactly "orthogonalize each expert");
- initial values and one gradient per step from `torch.Generator` seeds, stored as f32 bits;
- `STEPS` steps of `torch.optim.Muon`, recording every parameter after every step, twice:
  * "bf16": `torch.optim.Muon` as is (its Newton-Schulz iterate is bfloat16);
  * "f32": the same optimizer with `torch.optim._muon._zeropower_via_newtonschulz` replaced by
    `ns_copy(..., torch.float32)`, a line-for-line copy of that function whose only change is
    `grad.to(torch.float32, copy=True)` for `grad.bfloat16()` (a copy, as `bfloat16()` makes:
    without it the in-place normalization would scale the momentum buffer). The copy is checked against the original: with
    `torch.bfloat16` it reproduces `_zeropower_via_newtonschulz` bit for bit on every input the
    optimizer passes it (asserted below), so the f32 goldens differ from PyTorch only in that
    one cast.

Computation runs single-threaded (`torch.set_num_threads(1)`) so the file does not depend on the
thread count. Every f32 array is stored as one string of 8 hex digits per value (the IEEE bit
pattern, most significant digit first), so values round-trip exactly.
"""

import json
import os
import platform

import torch
import torch.optim._muon as muon_mod

STEPS = 3
SHAPES = [("w_wide", [8, 16]), ("w_tall", [16, 8]), ("w_square", [32, 32]), ("experts", [2, 8, 16])]

# Hyper-parameters: each value is an f32 value written as the Python float it converts to.
def f32(x):
    return float(torch.tensor(x, dtype=torch.float32).item())

CONFIGS = [
    {
        "name": "nesterov_original",
        "lr": f32(0.02),
        "momentum": f32(0.95),
        "nesterov": True,
        "weight_decay": f32(0.1),
        "adjust_lr_fn": "original",
        "seed": 1,
    },
    {
        "name": "plain_match_rms_adamw",
        "lr": f32(0.05),
        "momentum": f32(0.9),
        "nesterov": False,
        "weight_decay": f32(0.01),
        "adjust_lr_fn": "match_rms_adamw",
        "seed": 2,
    },
]

ORIGINAL_NS = muon_mod._zeropower_via_newtonschulz


def ns_copy(grad, ns_coefficients, ns_steps, eps, dtype):
    """`torch.optim._muon._zeropower_via_newtonschulz` (PyTorch 2.9+), with the iterate cast to
    `dtype` instead of always to bfloat16."""
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if len(grad.shape) != 2:
        raise ValueError("Input tensor gradient must be a 2D matrix")
    if len(ns_coefficients) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")
    a, b, c = ns_coefficients
    # `copy=True`: `grad.bfloat16()` of an f32 tensor is always a new tensor, while
    # `grad.to(torch.float32)` would return `grad` itself, and the in-place `div_` below would
    # then scale the caller's tensor (without Nesterov, the momentum buffer).
    ortho_grad = grad.to(dtype, copy=True)
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    ortho_grad.div_(ortho_grad.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram_matrix = ortho_grad @ ortho_grad.T
        gram_update = torch.addmm(gram_matrix, gram_matrix, gram_matrix, beta=b, alpha=c)
        ortho_grad = torch.addmm(ortho_grad, gram_update, ortho_grad, beta=a)
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    return ortho_grad


CHECKED = [0]


def ns_f32(grad, ns_coefficients, ns_steps, eps):
    # The copy must be faithful: with bfloat16 it is the original, bit for bit.
    want = ORIGINAL_NS(grad, ns_coefficients, ns_steps, eps)
    got = ns_copy(grad, ns_coefficients, ns_steps, eps, torch.bfloat16)
    assert torch.equal(want.view(torch.int16), got.view(torch.int16)), "ns_copy is not faithful"
    CHECKED[0] += 1
    return ns_copy(grad, ns_coefficients, ns_steps, eps, torch.float32)


def hexs(t):
    bits = t.detach().contiguous().view(-1).view(torch.int32).tolist()
    return "".join(f"{b & 0xFFFFFFFF:08x}" for b in bits)


def run(cfg, inits, grads, ns_dtype):
    """Masters after every step: per parameter (in SHAPES order), a list of STEPS tensors."""
    muon_mod._zeropower_via_newtonschulz = ORIGINAL_NS if ns_dtype == "bf16" else ns_f32
    try:
        # Torch parameters: one matrix per 2D shape, one per expert of a 3D shape.
        tparams = []
        for init, (_, shape) in zip(inits, SHAPES):
            mats = init.reshape(-1, shape[-2], shape[-1])
            tparams.append([torch.nn.Parameter(m.clone()) for m in mats])
        flat = [p for ps in tparams for p in ps]
        opt = torch.optim.Muon(
            flat,
            lr=cfg["lr"],
            weight_decay=cfg["weight_decay"],
            momentum=cfg["momentum"],
            nesterov=cfg["nesterov"],
            adjust_lr_fn=cfg["adjust_lr_fn"],
        )
        out = [[] for _ in SHAPES]
        for step in range(STEPS):
            for i, ((_, shape), ps) in enumerate(zip(SHAPES, tparams)):
                g = grads[i][step]
                gs = g.reshape(-1, shape[-2], shape[-1])
                for p, gm in zip(ps, gs):
                    p.grad = gm.clone()
            opt.step()
            for i, ps in enumerate(tparams):
                out[i].append(torch.stack([p.detach() for p in ps]).reshape(-1).clone())
        return out
    finally:
        muon_mod._zeropower_via_newtonschulz = ORIGINAL_NS


def main():
    torch.set_num_threads(1)
    doc = {
        "generator": "crates/lowbit-optim/tests/golden/gen_muon.py",
        "torch": torch.__version__,
        "device": "cpu",
        "machine": platform.machine(),
        "threads": 1,
        "ns_coefficients": [3.4445, -4.7750, 2.0315],
        "ns_steps": 5,
        "eps": 1e-7,
        "steps": STEPS,
        "configs": [],
    }
    for cfg in CONFIGS:
        gen = torch.Generator().manual_seed(1000 + cfg["seed"])
        inits, grads = [], []
        for _, shape in SHAPES:
            n = 1
            for d in shape:
                n *= d
            inits.append(torch.randn(n, generator=gen, dtype=torch.float32) * 0.5)
            grads.append([torch.randn(n, generator=gen, dtype=torch.float32) * 0.1 for _ in range(STEPS)])
        results = {d: run(cfg, inits, grads, d) for d in ("bf16", "f32")}
        params = []
        for i, (name, shape) in enumerate(SHAPES):
            params.append(
                {
                    "name": name,
                    "shape": shape,
                    "init": hexs(inits[i]),
                    "grads": [hexs(g) for g in grads[i]],
                    "masters": {d: [hexs(m) for m in results[d][i]] for d in results},
                }
            )
        doc["configs"].append(
            {
                "name": cfg["name"],
                "lr": cfg["lr"],
                "momentum": cfg["momentum"],
                "nesterov": cfg["nesterov"],
                "weight_decay": cfg["weight_decay"],
                "adjust_lr_fn": cfg["adjust_lr_fn"],
                "params": params,
            }
        )
    assert CHECKED[0] > 0
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "muon.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {path} ({os.path.getsize(path)} bytes; ns_copy checked on {CHECKED[0]} inputs)")


if __name__ == "__main__":
    main()
