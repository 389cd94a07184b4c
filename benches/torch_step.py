#!/usr/bin/env python3
"""The best data-parallel step a PyTorch user can assemble for MXFP8 primary weights: the
PyTorch baseline of lowbit's step benchmark (issue 16), run on the same GPUs in the same GPU
matrix call.

From "all gradients ready" to "weights ready for the next forward", per step:

  reduce-scatter  fp32 (or bf16) gradients, one flat buffer, `reduce_scatter_tensor` (avg)
  norm            the global grad norm (local sum of squares + all_reduce) and clipping
  optimizer       `torch.optim.AdamW(fused=True)` on the flat fp32 master shard
  staging         the bf16 cast of the master shard into the all-gather input
  gather          `all_gather_into_tensor` of the bf16 weights
  requantize      torch.compile'd MXFP8 quantization, rowwise and columnwise copies, of every
                  linear weight (embeddings and norms stay bf16, as in lowbit)

Phases are timed with CUDA events in a run with a device synchronization between phases
(`phases`), and the whole step without them (`total`). Bytes on the wire are NCCL's ring bus
bytes ((W-1)/W of the buffer per collective). Peak memory is torch's allocator peak.

    torchrun --nproc-per-node 2 torch_step.py [--model llama-3.2-1b llama-3-8b-layers]
        [--grad-dtype fp32 bf16] [--iters 10] [--json OUT]

Every model x gradient dtype given runs in the one process group (one compiled quantizer);
the JSON is the run's object for one configuration, else {"card", "torch", "world", "runs"}.

The quantizer is a performance baseline in plain PyTorch (MX recipe: 1x32 blocks, E8M0
scales, E4M3 elements), not a bit-exact reference: lowbit's CPU backend is the oracle.
"""
import argparse
import gc
import json
import os
import statistics

import torch
import torch.distributed as dist

E4M3_MAX = 448.0

# name: (vocab, d, layers, kv, ffn); vocab 0 = a layer stack without embeddings.
MODELS = {
    "llama-3.2-1b": (128256, 2048, 16, 512, 8192),
    "llama-3-8b-layers": (0, 4096, 8, 1024, 14336),
}


def parameter_set(vocab, d, layers, kv, ffn):
    """(name, shape, is_linear) for every parameter, in model order (tied embeddings)."""
    params = []
    if vocab:
        params.append(("embed_tokens.weight", (vocab, d), False))
    for i in range(layers):
        p = f"layers.{i}."
        params += [
            (p + "input_layernorm.weight", (d,), False),
            (p + "self_attn.q_proj.weight", (d, d), True),
            (p + "self_attn.k_proj.weight", (kv, d), True),
            (p + "self_attn.v_proj.weight", (kv, d), True),
            (p + "self_attn.o_proj.weight", (d, d), True),
            (p + "post_attention_layernorm.weight", (d,), False),
            (p + "mlp.gate_proj.weight", (ffn, d), True),
            (p + "mlp.up_proj.weight", (ffn, d), True),
            (p + "mlp.down_proj.weight", (d, ffn), True),
        ]
    if vocab:
        params.append(("norm.weight", (d,), False))
    return params


def mxfp8_rowwise(x):
    m, n = x.shape
    xf = x.float().reshape(m, n // 32, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    exp = (torch.floor(torch.log2(amax.clamp(min=2.0**-127))) - 8).clamp(-127, 127)
    q = (xf * torch.exp2(-exp)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(m, n), (exp + 127).to(torch.uint8).reshape(m, n // 32)


def mxfp8_both(x):
    # Columnwise = rowwise of the transpose, as torchao does.
    return mxfp8_rowwise(x), mxfp8_rowwise(x.t())


def timed_ms(f):
    """f's device time (CUDA events), the ranks aligned and the device idle before."""
    dist.barrier()
    torch.cuda.synchronize()
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    start.record()
    f()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def time_phases(phases, step, iters):
    """Each phase's device times, then the whole step's (no synchronization inside), in ms,
    `iters` of each."""
    per_phase = {name: [] for name, _ in phases}
    for _ in range(iters):
        for name, f in phases:
            per_phase[name].append(timed_ms(f))
    totals = [timed_ms(step) for _ in range(iters)]
    return per_phase, totals


def run(model, grad_dtype, iters, quant, rank, world, dev):
    """One configuration: the step per phase and whole, as a JSON-ready dict."""
    params = parameter_set(*MODELS[model])
    numels = [torch.Size(s).numel() for _, s, _ in params]
    total = sum(numels)
    padded = (total + world - 1) // world * world
    shard = padded // world
    gdt = torch.float32 if grad_dtype == "fp32" else torch.bfloat16

    gen = torch.Generator(device=dev).manual_seed(1234 + rank)
    # Gradients "ready": one flat buffer filled once by a kernel (the step reads it).
    grads = torch.randn(padded, device=dev, dtype=gdt, generator=gen).mul_(1e-3)
    grad_shard = torch.empty(shard, device=dev, dtype=gdt)
    master = torch.nn.Parameter(torch.randn(shard, device=dev, generator=gen).mul_(0.02))
    opt = torch.optim.AdamW(
        [master], lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True
    )
    gather_in = torch.empty(shard, device=dev, dtype=torch.bfloat16)
    weights = torch.empty(padded, device=dev, dtype=torch.bfloat16)
    views, off = [], 0
    for (_, shape, linear), n in zip(params, numels):
        if linear:
            views.append(weights[off : off + n].view(shape))
        off += n
    clip = 1.0

    def reduce_scatter():
        dist.reduce_scatter_tensor(grad_shard, grads, op=dist.ReduceOp.AVG)

    def norm():
        sq = grad_shard.float().pow(2).sum()
        dist.all_reduce(sq)
        coef = (clip / (sq.sqrt() + 1e-6)).clamp(max=1.0)
        g = grad_shard if gdt == torch.float32 else grad_shard.float()
        master.grad = g.mul_(coef)

    def optimizer():
        opt.step()

    def staging():
        gather_in.copy_(master.detach())

    def gather():
        dist.all_gather_into_tensor(weights, gather_in)

    def requantize():
        return [quant(v) for v in views]

    phases = [
        ("reduce_scatter", reduce_scatter),
        ("norm", norm),
        ("optimizer", optimizer),
        ("staging", staging),
        ("gather", gather),
        ("requantize", requantize),
    ]

    def step():
        for _, f in phases:
            f()

    for _ in range(3):  # compile, NCCL warm-up, optimizer state allocation
        step()
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.reset_peak_memory_stats(dev)

    per_phase, totals = time_phases(phases, step, iters)

    ring = (world - 1) / world
    wire = {
        "reduce_scatter": int(padded * grads.element_size() * ring),
        "norm": int(4 * 2 * ring),
        "gather": int(padded * 2 * ring),
    }
    return {
        "card": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "world": world,
        "model": model,
        "params": total,
        "linear_params": sum(v.numel() for v in views),
        "grad_dtype": grad_dtype,
        "phases_ms": {k: round(statistics.median(v), 3) for k, v in per_phase.items()},
        "total_ms": round(statistics.median(totals), 3),
        "wire_bytes": wire,
        "peak_bytes": torch.cuda.max_memory_allocated(dev),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS), nargs="+", default=["llama-3.2-1b"])
    ap.add_argument("--grad-dtype", choices=["fp32", "bf16"], nargs="+", default=["fp32"])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    # One compiled quantizer for every configuration (its compiled shapes carry over).
    quant = torch.compile(mxfp8_both)

    results = []
    for model in args.model:
        for grad_dtype in args.grad_dtype:
            result = run(model, grad_dtype, args.iters, quant, rank, world, dev)
            gc.collect()  # the configuration's tensors, before the next one allocates
            torch.cuda.empty_cache()
            results.append(result)
            if rank == 0:
                print(
                    f"torch step {model} ({result['params'] / 1e9:.3f}B params) on {world}x "
                    f"{result['card']}, {grad_dtype} grads: total {result['total_ms']:.2f} ms"
                )
                for k, v in result["phases_ms"].items():
                    print(f"  {k:<16} {v:9.3f} ms")
                print(f"  peak memory      {result['peak_bytes'] / 2**30:9.2f} GiB per rank")
    if rank == 0 and args.json:
        # One configuration: its object; several: {"card", "torch", "world", "runs": [...]}.
        out = results[0] if len(results) == 1 else {
            "card": results[0]["card"],
            "torch": torch.__version__,
            "world": world,
            "runs": results,
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
