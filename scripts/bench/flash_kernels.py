#!/usr/bin/env python3
"""Checks and times lowbit's flash attention kernels straight from their PTX or cubin, beside
torch SDPA, in one process on one GPU (no Rust build needed on the GPU machine).

Loads each module through the CUDA driver (ctypes on libcuda) and launches kernels with the
signatures of `crates/lowbit-kernels/flash_attention.cu` (bf16 q, k, v, dout in [b, s, h, d] /
[b, s, kvh, d]; f32 out, dq [b, s, h, d], dk, dv [b, s, kvh, d], lse and D [b, h, s]; seq, heads,
kv_heads as u64; scale as f32; the forward's out_bf16 flag as u32, 0 here):
  fwd (q, k, v, out, lse, ...), dq (q, k, v, lse, dout, D, dq, ...),
  dkv (q, k, v, lse, dout, D, dk, dv, ...).
Checks every output against float64 autograd of the same bf16 inputs on many shapes (outputs
poisoned with NaN first, fresh random inputs per shape; the backward reads the reference's lse
and D = rowsum(bf16(dO)·bf16(O)), as flash_bwd_d computes it), and times the kernels and SDPA
with CUDA events (median of --reps after warm-up). FLOPs as scripts/bench/sdpa_attention.py:
forward 4·b·h·s²·d/2, backward 2.5× that; SDPA's backward time is its forward + backward's
minus its forward's.

    python3 scripts/bench/flash_kernels.py --kernel PATH:NAME:KIND:HEAD_DIM:ROWS:THREADS:SMEM ...

ROWS is the rows of a CTA's own side (query rows for fwd/dq, key rows for dkv).
"""

import argparse
import ctypes
import json
import math

import torch
import torch.nn.functional as F

# The same timing as the SDPA baseline (this script's folder is on the path when it runs).
from sdpa_attention import median_ms

CHECK_SHAPES = [  # (batch, seq, heads, kv_heads)
    (1, 1, 2, 1), (1, 17, 2, 2), (2, 129, 4, 1), (1, 300, 8, 2), (2, 1000, 4, 4),
    (1, 2048, 4, 1), (1, 4100, 2, 2),
]
TIME_SHAPES = [  # (batch, seq, heads, kv_heads, head_dim)
    (8, 2048, 32, 8, 64), (2, 4096, 32, 8, 128), (8, 1024, 12, 12, 64),
]
BOUNDS = {"out": 8e-3, "lse": 1e-2, "dq": 1.2e-2, "dk": 1.2e-2, "dv": 1.2e-2}

cuda = ctypes.CDLL("libcuda.so.1")


def ck(rc, what):
    if rc != 0:
        name = ctypes.c_char_p()
        cuda.cuGetErrorString(rc, ctypes.byref(name))
        raise RuntimeError(f"{what}: CUDA error {rc} {name.value}")


modules = {}


class Kernel:
    def __init__(self, spec):
        path, name, kind, d, rows, threads, smem = spec.split(":")
        if path not in modules:
            data = open(path, "rb").read()
            if path.endswith(".ptx"):
                data += b"\0"
            mod = ctypes.c_void_p()
            ck(cuda.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(data)), f"load {path}")
            modules[path] = mod
        self.fn = ctypes.c_void_p()
        ck(cuda.cuModuleGetFunction(ctypes.byref(self.fn), modules[path], name.encode()), name)
        ck(cuda.cuFuncSetAttribute(self.fn, 8, int(smem)), f"smem {name}")
        self.kind, self.d = kind, int(d)
        # Labelled by file too: two builds of one kernel can run side by side.
        self.name = f"{path.rsplit('/', 1)[-1]}:{name}"
        self.rows, self.threads, self.smem = int(rows), int(threads), int(smem)

    def __call__(self, tensors, b, s, h, kvh, scale):
        args = [ctypes.c_uint64(t.data_ptr()) for t in tensors]
        args += [ctypes.c_uint64(s), ctypes.c_uint64(h), ctypes.c_uint64(kvh), ctypes.c_float(scale)]
        if self.kind == "fwd":
            args.append(ctypes.c_uint32(0))  # out_bf16: f32 out
        ptrs = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        gx = (s + self.rows - 1) // self.rows
        gy = b * (kvh if self.kind == "dkv" else h)
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        ck(cuda.cuLaunchKernel(self.fn, gx, gy, 1, self.threads, 1, 1, self.smem, stream, ptrs, None),
           f"launch {self.name}")


def reference(q, k, v, do, scale):
    """out, lse, dq, dk, dv in float64 of the bf16 inputs (autograd), one batch item at a time."""
    b, s, h, d = q.shape
    g = h // k.shape[2]
    res = {n: [] for n in ("out", "lse", "dq", "dk", "dv")}
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    for bi in range(b):
        qq = q[bi].double().transpose(0, 1).requires_grad_()
        kk = k[bi].double().transpose(0, 1).requires_grad_()
        vv = v[bi].double().transpose(0, 1).requires_grad_()
        sc = (qq @ kk.repeat_interleave(g, 0).transpose(1, 2)) * scale
        sc = sc.masked_fill(~mask, -math.inf)
        lse = torch.logsumexp(sc, dim=2)
        out = torch.softmax(sc, dim=2) @ vv.repeat_interleave(g, 0)
        out.backward(do[bi].double().transpose(0, 1))
        res["out"].append(out.detach().transpose(0, 1))
        res["lse"].append(lse.detach())
        res["dq"].append(qq.grad.transpose(0, 1))
        res["dk"].append(kk.grad.transpose(0, 1))
        res["dv"].append(vv.grad.transpose(0, 1))
    return {n: torch.stack(x) for n, x in res.items()}


def inputs(b, s, h, kvh, d, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda hh: torch.randn(b, s, hh, d, device="cuda", generator=gen).to(torch.bfloat16)
    return mk(h), mk(kvh), mk(kvh), mk(h)


def bwd_inputs(out, do):
    """D[b, h, i] = Σ_d bf16(dO)·bf16(O) in f32."""
    return (out.to(torch.bfloat16).float() * do.float()).sum(-1).transpose(1, 2).contiguous()


def run(kern, q, k, v, do, lse, dd, scale, poison=math.nan):
    b, s, h, d = q.shape
    kvh = k.shape[2]
    dev = q.device
    if kern.kind == "fwd":
        o = {"out": torch.full((b, s, h, d), poison, device=dev), "lse": torch.full((b, h, s), poison, device=dev)}
        ts = (q, k, v, o["out"], o["lse"])
    elif kern.kind == "dq":
        o = {"dq": torch.full((b, s, h, d), poison, device=dev)}
        ts = (q, k, v, lse, do, dd, o["dq"])
    else:
        o = {"dk": torch.full((b, s, kvh, d), poison, device=dev), "dv": torch.full((b, s, kvh, d), poison, device=dev)}
        ts = (q, k, v, lse, do, dd, o["dk"], o["dv"])
    call = lambda: kern(ts, b, s, h, kvh, scale)
    call()
    return o, call


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", action="append", default=[])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.zeros(1, device="cuda")  # the primary context, current on this thread
    kernels = [Kernel(spec) for spec in a.kernel]
    rows = []
    if not a.no_check:
        worst = {kern.name: {} for kern in kernels}
        for d in sorted({kern.d for kern in kernels}):
            for n, (b, s, h, kvh) in enumerate(CHECK_SHAPES):
                q, k, v, do = inputs(b, s, h, kvh, d, 100 + n)
                scale = 1.0 / math.sqrt(d)
                ref = reference(q, k, v, do, scale)
                lse = ref["lse"].float().contiguous()
                dd = bwd_inputs(ref["out"].float(), do)
                for kern in (kk for kk in kernels if kk.d == d):
                    got, _ = run(kern, q, k, v, do, lse, dd, scale)
                    torch.cuda.synchronize()
                    for name, t in got.items():
                        r = ref[name]
                        if name == "lse":
                            e = (t.double() - r).abs().max().item()
                        else:
                            e = ((t.double() - r).abs().max() / r.abs().max().clamp_min(1e-3)).item()
                        if math.isnan(e):
                            e = math.inf
                        if a.verbose:
                            print(f"  {kern.name} b{b} s{s} h{h}/{kvh} {name}: {e:.2e}", flush=True)
                        worst[kern.name][name] = max(worst[kern.name].get(name, 0.0), e)
        for kern in kernels:
            w = worst[kern.name]
            ok = all(e < BOUNDS[n] for n, e in w.items())
            rows.append({"kernel": kern.name, "check": "pass" if ok else "FAIL", "worst": w})
            print(f"CHECK {kern.name}: {'pass' if ok else 'FAIL'} " + " ".join(f"{n} {e:.2e}" for n, e in w.items()), flush=True)
    for (b, s, h, kvh, d) in [] if a.no_time else TIME_SHAPES:
        flop = 4 * b * h * s * s * d / 2
        q, k, v, do = inputs(b, s, h, kvh, d, 7)
        scale = 1.0 / math.sqrt(d)
        qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
        dot = do.transpose(1, 2)
        sdpa = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
        fwd_ms = median_ms(lambda: sdpa(), a.reps)
        fb_ms = median_ms(lambda: torch.autograd.grad(sdpa(), (qt, kt, vt), dot), a.reps)
        line = {"shape": [b, s, h, kvh, d], "sdpa_fwd_tflops": flop / fwd_ms / 1e9,
                "sdpa_bwd_tflops": 2.5 * flop / (fb_ms - fwd_ms) / 1e9, "sdpa_fwd_bwd_tflops": 3.5 * flop / fb_ms / 1e9}
        out = torch.randn(b, s, h, d, device="cuda")
        lse = torch.randn(b, h, s, device="cuda").abs() + 5
        dd = bwd_inputs(out, do)
        for kern in (kk for kk in kernels if kk.d == d):
            got, call = run(kern, q, k, v, do, lse, dd, scale, poison=0.0)
            ms = median_ms(call, a.reps)
            f = flop if kern.kind == "fwd" else 2.5 * flop
            line[kern.name] = {"ms": ms, "tflops_if_alone": f / ms / 1e9}
            del got
        rows.append(line)
        print(json.dumps(line), flush=True)
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
