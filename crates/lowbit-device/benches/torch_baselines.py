#!/usr/bin/env python3
"""PyTorch baselines for lowbit's CUDA kernels, run in the same GPU matrix call as
`benches/cuda_bench.rs` (the bundle runs both): a device copy, reference MXFP8 and NVFP4
quantizers written in PyTorch (eager and torch.compile), and torch.optim.AdamW(fused=True)
followed by the bf16 copy of the weights.

The quantizers follow the recipes (1x32 blocks with E8M0 scales and E4M3 elements; NVFP4 with
a per-tensor amax, 1x16 blocks with E4M3 scales and E2M1 elements packed two per byte) in plain
PyTorch; they are performance baselines, not bit-exact references (lowbit's CPU backend is the
oracle). Bytes counted as cuda_bench counts them.

    python3 torch_baselines.py [--json OUT.json] [--size 16384] [--params 268435456]
"""
import argparse
import json
import statistics

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0


def timeit(fn, iters=20, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)  # us
    return statistics.median(times)


def mxfp8_rowwise(x):
    m, n = x.shape
    xf = x.float().reshape(m, n // 32, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    # E8M0 scale as in the MX spec: 2^(floor(log2 amax) - emax(E4M3) = 8), clamped.
    exp = torch.floor(torch.log2(amax.clamp(min=2.0**-127))) - 8
    exp = exp.clamp(-127, 127)
    q = (xf * torch.exp2(-exp)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(m, n), (exp + 127).to(torch.uint8).reshape(m, n // 32)


def mxfp8_both(x):
    r = mxfp8_rowwise(x)
    c = mxfp8_rowwise(x.t())  # columnwise = rowwise of the transpose, as torchao does
    return r, c


E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_MIDS = (E2M1_GRID[1:] + E2M1_GRID[:-1]) / 2


def nvfp4_rowwise(x, mids):
    m, n = x.shape
    xf = x.float()
    gamax = xf.abs().amax()
    enc = (E4M3_MAX * E2M1_MAX) / gamax.clamp(min=1e-30)
    blocks = xf.reshape(m, n // 16, 16)
    bamax = blocks.abs().amax(-1, keepdim=True)
    scale = (bamax / E2M1_MAX * enc).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    dec = scale.float() / enc
    y = blocks / dec.clamp(min=1e-30)
    code = torch.bucketize(y.abs().clamp(max=E2M1_MAX), mids).to(torch.uint8)
    code = code | ((y < 0).to(torch.uint8) << 3)
    code = code.reshape(m, n // 2, 2)
    packed = code[..., 0] | (code[..., 1] << 4)
    return packed, scale.reshape(m, n // 16), gamax


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--size", type=int, default=16384)
    ap.add_argument("--params", type=int, default=256 * 1024 * 1024)
    args = ap.parse_args()
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(0)
    n = args.size
    x = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    elems = n * n
    rows = []

    def add(label, us, nbytes, baseline_us=None):
        gbps = nbytes / us / 1e3
        row = {"name": label, "us": round(us, 1), "gbps": round(gbps, 1)}
        if baseline_us is not None:
            row["x_copy"] = round(gbps / copy_gbps, 3)
        rows.append(row)
        extra = f" = {row['x_copy']:.2f}x copy" if "x_copy" in row else ""
        print(f"{label:<48} {us:10.1f} us {gbps:8.0f} GB/s{extra}", flush=True)

    copy_us = timeit(lambda: y.copy_(x))
    copy_gbps = 4 * elems / copy_us / 1e3
    add(f"torch copy bf16 {n}x{n}", copy_us, 4 * elems)

    mids = E2M1_MIDS.to(dev)
    cases = [
        ("mxfp8 rowwise", lambda f: f(x), mxfp8_rowwise, elems * (2 + 1 + 1 / 32)),
        ("mxfp8 rowwise+columnwise", lambda f: f(x), mxfp8_both, elems * (2 + 2 + 2 / 32)),
        (
            "nvfp4 rowwise with amax",
            lambda f: f(x, mids),
            nvfp4_rowwise,
            elems * (2 + 2 + 1 / 2 + 1 / 16),
        ),
    ]
    for label, call, fn, nbytes in cases:
        add(f"torch eager {label}", timeit(lambda: call(fn)), nbytes, copy_us)
        compiled = torch.compile(fn)
        add(f"torch.compile {label}", timeit(lambda: call(compiled)), nbytes, copy_us)

    # AdamW: fp32 params, grads, moments; bf16 copy of the result. 30 bytes per parameter.
    del x, y
    torch.cuda.empty_cache()
    p = torch.nn.Parameter(torch.randn(args.params, device=dev) * 0.02)
    p.grad = torch.randn_like(p) * 1e-3
    out = torch.empty(args.params, device=dev, dtype=torch.bfloat16)
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    buf = torch.empty_like(p)
    f32_copy_us = timeit(lambda: buf.copy_(p))
    copy_gbps = 8 * args.params / f32_copy_us / 1e3
    add(f"torch copy f32 {args.params >> 20}M", f32_copy_us, 8 * args.params)

    def adamw_step():
        opt.step()
        out.copy_(p)

    add(
        f"torch AdamW(fused=True) + bf16 copy {args.params >> 20}M",
        timeit(adamw_step, iters=10),
        30 * args.params,
        f32_copy_us,
    )
    result = {"card": name, "torch": torch.__version__, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
