#!/usr/bin/env python3
"""The PyTorch peer of lowbit's Llama training step on one GPU: Hugging Face `LlamaForCausalLM`
with the shapes of lowbit's presets, fp32 parameters (the masters), bf16 autocast, SDPA attention,
fused AdamW, gradient clipping at 1.0, random tokens. Modes: `eager`, `compile`
(`torch.compile(model)`), and `float8` (torchao float8 training, tensorwise scaling, compiled) when
torchao can be imported.

    python3 torch_llama_train.py [--shape 125m 1b 8b-layers] [--mode eager compile float8]
        [--steps 10] [--warmup 3] [--json OUT]

Per (shape, mode): tokens/s over `--steps` timed steps after `--warmup` (a device sync at both
ends, wall clock), MFU = tokens/s × (6·params + 12·layers·seq·d) / 989e12 (H100/H200 dense bf16
peak; the FLOP count of the PaLM paper's appendix B, attention counted without the causal halving,
as torchtitan and nanoGPT count it), and peak memory (`torch.cuda.max_memory_allocated`, the
caching allocator's high-water mark over the timed run). A shape or mode that fails (out of
memory, missing torchao) is reported with its error, not skipped silently.
"""
import argparse
import gc
import json
import time

import torch

PEAK = 989e12

# name: (vocab, d, layers, heads, kv_heads, ffn, tied, theta, batch, seq) as lowbit's presets
# (crates/lowbit-llama/src/config.rs) and the batch x seq.
SHAPES = {
    "125m": (50304, 768, 12, 12, 12, 2048, True, 10000.0, 32, 1024),
    "1b": (128256, 2048, 16, 32, 8, 8192, True, 500000.0, 8, 2048),
    "8b-layers": (128256, 4096, 4, 32, 8, 14336, False, 500000.0, 2, 4096),
}


def build(shape):
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab, d, layers, heads, kv, ffn, tied, theta, _, seq = SHAPES[shape]
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=d,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=ffn,
        tie_word_embeddings=tied,
        rope_theta=theta,
        max_position_embeddings=max(seq, 8192),
        rms_norm_eps=1e-5,
        attn_implementation="sdpa",
    )
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    return model, cfg


def flops_per_token(cfg, params, seq):
    return 6 * params + 12 * cfg.num_hidden_layers * seq * cfg.hidden_size


def run(shape, mode, steps, warmup):
    vocab, d, layers, heads, kv, ffn, tied, theta, batch, seq = SHAPES[shape]
    torch.manual_seed(0)
    model, cfg = build(shape)
    params = sum(p.numel() for p in model.parameters())
    if mode == "float8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(
            model,
            config=Float8LinearConfig(),  # tensorwise scaling, the default recipe
            module_filter_fn=lambda m, name: "lm_head" not in name,
        )
    fwd = torch.compile(model) if mode in ("compile", "float8") else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(1)

    def step():
        ids = torch.randint(0, vocab, (batch, seq + 1), device="cuda", generator=gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = fwd(input_ids=ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().view(-1, vocab), ids[:, 1:].reshape(-1)
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(steps):
        loss = step()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    tok_s = steps * batch * seq / dt
    out = {
        "shape": shape,
        "mode": mode,
        "batch": batch,
        "seq": seq,
        "params": params,
        "step_ms": 1e3 * dt / steps,
        "tokens_per_s": tok_s,
        "mfu": tok_s * flops_per_token(cfg, params, seq) / PEAK,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "final_loss": float(loss),
    }
    del model, fwd, opt
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--mode", nargs="+", default=["eager", "compile"],
                    choices=["eager", "compile", "float8"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    res = {"card": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": []}
    for s in a.shape:
        for m in a.mode:
            try:
                r = run(s, m, a.steps, a.warmup)
            except Exception as e:  # reported, never skipped silently
                r = {"shape": s, "mode": m, "error": f"{type(e).__name__}: {e}"[:400]}
                gc.collect()
                torch.cuda.empty_cache()
            print(json.dumps(r), flush=True)
            res["runs"].append(r)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
