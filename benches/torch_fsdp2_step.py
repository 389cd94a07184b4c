#!/usr/bin/env python3
"""What PyTorch's own sharded data parallelism does with float8 weights: FSDP2
(`torch.distributed.fsdp.fully_shard`) with torchao's float8 training and its float8 all-gather,
on the parameter set of lowbit's step benchmark (torch_step.py's MODELS, the same names and
shapes), run on the same GPUs in the same GPU matrix call (issue 16).

Per rank: an nn.Embedding (bf16 compute, tied LM head, not float8), per layer RMSNorm weights and
the bias-free q, k, v, o, gate, up and down linears, a final norm; fp32 parameters. Every layer
linear becomes a torchao `Float8Linear` (dynamic tensorwise scaling) whose weight all-gathers in
float8 (`Float8LinearConfig(enable_fsdp_float8_all_gather=True)`): the fp32 shard is cast to
e4m3 with a scale precomputed after the optimizer (`precompute_float8_dynamic_scale_for_fsdp`,
one all-reduce of every weight's amax) and gathered at 1 byte per element; the embedding and the
norms gather in bf16. `fully_shard` per layer, then on the root, with
`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32 or bf16 per --grad-dtype)`.

One step, a tiny batch (1 x --tokens tokens, so compute is negligible next to the data-parallel
work), each phase timed with CUDA events in a run with a device synchronization between phases,
the whole step without them (`total_ms`):

  fwd_bwd           forward + backward: FSDP2's all-gathers (twice per layer with
                    reshard_after_forward, the default: ZeRO-3; once without), the float8
                    casts and GEMMs, the gradient reduce-scatter
  clip              `clip_grad_norm_(..., 1.0)` (the global norm: one all-reduce)
  optimizer         `torch.optim.AdamW(fused=True)` on the fp32 shards (foreach=True if fused
                    refuses these DTensor parameters; the JSON says which), `zero_grad(None)`
  precompute_scale  `precompute_float8_dynamic_scale_for_fsdp(model)`

Each configuration runs with reshard_after_forward True and False. Peak memory is torch's
allocator peak over the timed steps.

    torchrun --nproc-per-node 2 torch_fsdp2_step.py [--model llama-3.2-1b llama-3-8b-layers]
        [--grad-dtype fp32 bf16] [--reshard true false] [--iters 10] [--warmup 3]
        [--tokens 16] [--compile] [--json OUT]

The JSON is {"card", "torch", "torchao", "world", "runs": [...]}, one run per model x gradient
dtype x reshard flag. Where torchao cannot be imported (or the card has no float8 GEMMs) it says
so on stdout and writes {"card", "torch", "world", "skipped": REASON} instead, exit status 0:
no run happened and none is reported.

--compile compiles each layer (`torch.compile`), torchao's recommendation for fused
scaling/casting kernels; off by default: at 16 tokens the activation casts it fuses are a few
microseconds, and the weight casts before the all-gather run in FSDP2's hooks, outside the
compiled region, either way.
"""
import argparse
import gc
import json
import os
import statistics
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from torch_step import MODELS, parameter_set, time_phases


class Norm(nn.Module):
    """RMSNorm: the weight vector of parameter_set, used as Llama uses it."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)
        return xf.to(x.dtype) * self.weight


class Attention(nn.Module):
    """q, k, v, o of a GQA attention, mixed without the attention itself: every weight gets a
    gradient, and compute stays negligible."""

    def __init__(self, d, kv):
        super().__init__()
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, kv, bias=False)
        self.v_proj = nn.Linear(d, kv, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.groups = d // kv

    def forward(self, x):
        kv = self.k_proj(x) + self.v_proj(x)
        return self.o_proj(self.q_proj(x) + kv.repeat(1, 1, self.groups))


class Mlp(nn.Module):
    def __init__(self, d, ffn):
        super().__init__()
        self.gate_proj = nn.Linear(d, ffn, bias=False)
        self.up_proj = nn.Linear(d, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, d, kv, ffn):
        super().__init__()
        self.input_layernorm = Norm(d)
        self.self_attn = Attention(d, kv)
        self.post_attention_layernorm = Norm(d)
        self.mlp = Mlp(d, ffn)

    def forward(self, x):
        h = x + self.self_attn(self.input_layernorm(x))
        return h + self.mlp(self.post_attention_layernorm(h))


class Model(nn.Module):
    """parameter_set's parameters, in its order and under its names (checked in build)."""

    def __init__(self, vocab, d, layers, kv, ffn):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d) if vocab else None
        self.layers = nn.ModuleList(Layer(d, kv, ffn) for _ in range(layers))
        self.norm = Norm(d) if vocab else None

    def forward(self, x):
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        for layer in self.layers:
            h = layer(h)
        if self.embed_tokens is not None:
            h = F.linear(self.norm(h), self.embed_tokens.weight)  # the tied LM head, bf16
        return h.float().pow(2).mean()


def build(model_name, grad_dtype, reshard, compile_layers, mesh, dev, ao):
    """The FSDP2 + float8 model, its optimizer's parameters and the float8 linears' count."""
    shape = MODELS[model_name]
    torch.manual_seed(1234)  # the same initial weights on every rank
    with torch.device(dev):
        model = Model(*shape)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
    expect = [(n, tuple(s)) for n, s, _ in parameter_set(*shape)]
    got = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert got == expect, "the model's parameters differ from torch_step.parameter_set"

    # Only the layers' linears become float8 (every Llama dim is a multiple of 16, as
    # torch._scaled_mm needs); the embedding (and tied head) and the norms stay bf16.
    config = ao.Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    ao.convert_to_float8_training(
        model,
        config=config,
        module_filter_fn=lambda m, fqn: fqn.startswith("layers.") and isinstance(m, nn.Linear),
    )
    float8 = [m for m in model.modules() if type(m).__name__ == "Float8Linear"]
    assert float8, "convert_to_float8_training converted no linear"

    mp = ao.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32 if grad_dtype == "fp32" else torch.bfloat16,
    )
    for i, layer in enumerate(model.layers):
        if compile_layers:
            # As torchtitan and torchao's FSDP2 tests do: FSDP2's hooks on the compiled wrapper,
            # outside the compiled region.
            layer = torch.compile(layer)
            model.layers[i] = layer
        ao.fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    ao.fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    return model, len(float8)


def make_optimizer(params, fused):
    kind = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, **kind)


def run(model_name, grad_dtype, reshard, args, mesh, rank, world, dev, ao):
    """One configuration: the step per phase and whole, as a JSON-ready dict."""
    vocab, d, _, _, _ = MODELS[model_name]
    params_set = parameter_set(*MODELS[model_name])
    model, n_float8 = build(model_name, grad_dtype, reshard, args.compile, mesh, dev, ao)
    params = list(model.parameters())
    gen = torch.Generator(device=dev).manual_seed(99 + rank)  # each rank its own batch
    if vocab:
        inp = torch.randint(vocab, (1, args.tokens), device=dev, generator=gen)
    else:
        inp = torch.randn(1, args.tokens, d, device=dev, dtype=torch.bfloat16, generator=gen)

    optimizer = {"kind": "fused", "fallback_reason": None}
    try:
        opt = make_optimizer(params, fused=True)
    except (RuntimeError, ValueError, TypeError) as e:
        optimizer.update(kind="foreach", fallback_reason=f"{type(e).__name__}: {e}")
        opt = make_optimizer(params, fused=False)
    # Scales for the first all-gather (else it reduces each weight's amax on its own).
    ao.precompute_float8_dynamic_scale_for_fsdp(model)

    def fwd_bwd():
        model(inp).backward()

    def clip():
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)

    def optimizer_step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    def precompute_scale():
        ao.precompute_float8_dynamic_scale_for_fsdp(model)

    phases = [
        ("fwd_bwd", fwd_bwd),
        ("clip", clip),
        ("optimizer", optimizer_step),
        ("precompute_scale", precompute_scale),
    ]

    def step():
        for _, f in phases:
            f()

    # The first step: every parameter must get a gradient; fused AdamW may refuse DTensors.
    fwd_bwd()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"parameters without a gradient: {missing[:4]}"
    clip()
    try:
        opt.step()
    except (RuntimeError, NotImplementedError, AssertionError, TypeError) as e:
        if optimizer["kind"] != "fused":
            raise
        optimizer.update(kind="foreach", fallback_reason=f"{type(e).__name__}: {e}")
        if rank == 0:
            print(f"fused AdamW refused ({optimizer['fallback_reason']}); foreach=True")
        opt = make_optimizer(params, fused=False)
        opt.step()
    opt.zero_grad(set_to_none=True)
    precompute_scale()
    for _ in range(args.warmup):  # NCCL warm-up, optimizer state, compilation
        step()
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.reset_peak_memory_stats(dev)

    per_phase, totals = time_phases(phases, step, args.iters)

    # What FSDP2 should put on the wire per step (NCCL ring bus bytes, (W-1)/W of each
    # collective's buffer): float8 layer weights at 1 byte, the rest at 2 (bf16); layers
    # gather twice with reshard_after_forward (forward, backward), the root's parameters once
    # (FSDP2 keeps the root unsharded between forward and backward); every gradient once.
    ring = (world - 1) / world
    total = sum(torch.Size(s).numel() for _, s, _ in params_set)
    linear = sum(torch.Size(s).numel() for _, s, lin in params_set if lin)
    layer_other = sum(
        torch.Size(s).numel() for n, s, lin in params_set if not lin and n.startswith("layers.")
    )
    root = total - linear - layer_other
    gathers = 2 if reshard else 1
    wire = {
        "all_gather": int(ring * (gathers * (linear + 2 * layer_other) + 2 * root)),
        "reduce_scatter": int(ring * total * (4 if grad_dtype == "fp32" else 2)),
    }
    ms = {k: round(statistics.median(v), 3) for k, v in per_phase.items()}
    result = {
        "card": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "torchao": ao.version,
        "world": world,
        "model": model_name,
        "params": total,
        "linear_params": linear,
        "float8_linears": n_float8,
        "grad_dtype": grad_dtype,
        "reshard_after_forward": reshard,
        "tokens": args.tokens,
        "compile": args.compile,
        "optimizer": optimizer["kind"],
        "total_ms": round(statistics.median(totals), 3),
        "fwd_bwd_ms": ms["fwd_bwd"],
        "clip_ms": ms["clip"],
        "optimizer_ms": ms["optimizer"],
        "precompute_scale_ms": ms["precompute_scale"],
        "wire_bytes_model": wire,
        "peak_bytes": torch.cuda.max_memory_allocated(dev),
    }
    if optimizer["fallback_reason"]:
        result["optimizer_fallback_reason"] = optimizer["fallback_reason"][:500]
    return result


def load_ao():
    """torchao's float8 API and FSDP2's as one namespace, or None and why they cannot load."""
    try:
        import torchao
        from torchao.float8 import (
            Float8LinearConfig,
            convert_to_float8_training,
            precompute_float8_dynamic_scale_for_fsdp,
        )
    except Exception as e:  # ImportError, or a torchao that fails on this torch
        return None, f"torchao cannot be imported: {type(e).__name__}: {e}"
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
        except ImportError as e:
            return None, f"FSDP2 (fully_shard) not in torch {torch.__version__}: {e}"
    if not torch.cuda.is_available():
        return None, "no CUDA device"
    if torch.cuda.get_device_capability() < (8, 9):
        return None, f"{torch.cuda.get_device_name()} has no float8 GEMMs (sm_89+)"
    try:
        from importlib.metadata import version

        ao_version = version("torchao")
    except Exception:
        ao_version = getattr(torchao, "__version__", "?")
    return SimpleNamespace(
        version=ao_version,
        Float8LinearConfig=Float8LinearConfig,
        convert_to_float8_training=convert_to_float8_training,
        precompute_float8_dynamic_scale_for_fsdp=precompute_float8_dynamic_scale_for_fsdp,
        MixedPrecisionPolicy=MixedPrecisionPolicy,
        fully_shard=fully_shard,
    ), None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS), nargs="+", default=["llama-3.2-1b"])
    ap.add_argument("--grad-dtype", choices=["fp32", "bf16"], nargs="+", default=["fp32"])
    ap.add_argument("--reshard", choices=["true", "false"], nargs="+", default=["true", "false"],
                    help="FSDP2 reshard_after_forward (true: the default, ZeRO-3)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16,
                    help="tokens per rank (a multiple of 16, as float8 GEMMs need)")
    ap.add_argument("--compile", action="store_true", help="torch.compile each layer")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.tokens % 16:
        ap.error("--tokens must be a multiple of 16 (torch._scaled_mm)")

    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", rank))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
    ao, reason = load_ao()
    if ao is None:
        # Not run: said on stdout and in the JSON, and nothing is timed or reported.
        card = torch.cuda.get_device_name(local) if torch.cuda.is_available() else None
        if rank == 0:
            print(f"torch FSDP2 float8 step: SKIPPED, {reason}")
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"card": card, "torch": torch.__version__, "world": world,
                               "skipped": reason}, f, indent=1)
        return

    dev = torch.device("cuda", local)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (world,))
    results = []
    for model in args.model:
        for grad_dtype in args.grad_dtype:
            for reshard in args.reshard:
                result = run(model, grad_dtype, reshard == "true", args, mesh, rank, world,
                             dev, ao)
                gc.collect()  # the configuration's tensors, before the next one allocates
                torch.cuda.empty_cache()
                results.append(result)
                if rank == 0:
                    print(
                        f"torch FSDP2 + torchao {ao.version} float8 step {model} "
                        f"({result['params'] / 1e9:.3f}B params) on {world}x {result['card']}, "
                        f"{grad_dtype} grads, reshard_after_forward={reshard}, "
                        f"{result['optimizer']} AdamW: total {result['total_ms']:.2f} ms"
                    )
                    for k in ["fwd_bwd", "clip", "optimizer", "precompute_scale"]:
                        print(f"  {k:<16} {result[k + '_ms']:9.3f} ms")
                    print(f"  peak memory      {result['peak_bytes'] / 2**30:9.2f} GiB per rank")
                    sys.stdout.flush()
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({
                "card": results[0]["card"],
                "torch": torch.__version__,
                "torchao": ao.version,
                "world": world,
                "runs": results,
            }, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
