#!/usr/bin/env python3
"""An independent Llama forward over a Hugging Face directory (numpy only).

Written from the Hugging Face definition (transformers' modeling_llama.py: LlamaRMSNorm,
LlamaRotaryEmbedding with _compute_llama3_parameters, rotate_half, repeat_kv, eager attention,
LlamaMLP), not from lowbit's code, and computed in float64 so that its own rounding does not
matter. It prints JSON: the mean token loss of each window, their mean, and optionally the
logits of the last position of the first window.

    hf_reference.py MODEL_DIR DATA_DIR --seq S --items N [--logits]

The windows are those `lowbit eval` uses: the validation split of DATA_DIR (a `lowbit data
prepare` directory: manifest.json and raw little-endian shards) cut into non-overlapping windows
of S + 1 tokens, window i % (number of windows) for item i < N; inputs are a window's first S
tokens, targets its last S.
"""
import argparse
import json
import os
import sys

import struct

import numpy as np

DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8"}


def load_file(path):
    """The tensors of a safetensors file, read from its specification (8-byte little-endian
    header length, JSON header, data): numpy has no bfloat16 (so neither has
    safetensors.numpy), and BF16 is the top half of an f32."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        x = np.frombuffer(data[a:b], dtype=DTYPES[t["dtype"]])
        if t["dtype"] == "BF16":
            x = (x.astype(np.uint32) << 16).view(np.float32)
        out[name] = x.reshape(t["shape"])
    return out


def load_weights(d):
    index = os.path.join(d, "model.safetensors.index.json")
    single = os.path.join(d, "model.safetensors")
    files = [single] if os.path.exists(single) else sorted(
        {os.path.join(d, f) for f in json.load(open(index))["weight_map"].values()})
    w = {}
    for f in files:
        for k, v in load_file(f).items():
            w[k] = v.astype(np.float64)
    return w


def rope_inv_freq(cfg, head_dim):
    # LlamaRotaryEmbedding: inv_freq = 1 / theta^(2i/d); llama3 scaling as
    # _compute_llama3_parameters (transformers/modeling_rope_utils.py).
    inv = 1.0 / (cfg["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    s = cfg.get("rope_scaling")
    if s:
        kind = s.get("rope_type", s.get("type"))
        assert kind == "llama3", kind
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        low_wl, high_wl = old / lo, old / hi
        wavelen = 2 * np.pi / inv
        scaled = np.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        inv = np.where(medium, smoothed, scaled)
    return inv


def rms_norm(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def forward(cfg, w, ids):
    """Logits [T, vocab] of one sequence of token ids."""
    T = len(ids)
    H, KV = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    D = cfg.get("head_dim") or cfg["hidden_size"] // H
    eps = cfg["rms_norm_eps"]
    inv = rope_inv_freq(cfg, D)
    freqs = np.outer(np.arange(T, dtype=np.float64), inv)
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb), np.sin(emb)
    x = w["model.embed_tokens.weight"][ids]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(T, H, D).transpose(1, 0, 2)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(T, KV, D).transpose(1, 0, 2)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(T, KV, D).transpose(1, 0, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = np.repeat(k, H // KV, axis=0)  # repeat_kv
        v = np.repeat(v, H // KV, axis=0)
        s = q @ k.transpose(0, 2, 1) / np.sqrt(D) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        a = (s / s.sum(-1, keepdims=True)) @ v
        x = x + a.transpose(1, 0, 2).reshape(T, H * D) @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        g = h @ w[p + "mlp.gate_proj.weight"].T
        u = h @ w[p + "mlp.up_proj.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * u) @ w[p + "mlp.down_proj.weight"].T
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else w["lm_head.weight"]
    return x @ head.T


def validation_tokens(data_dir):
    m = json.load(open(os.path.join(data_dir, "manifest.json")))
    dt = {"u16": np.uint16, "u32": np.uint32}[m["dtype"]]
    parts = [np.fromfile(os.path.join(data_dir, s["file"]), dtype=np.dtype(dt).newbyteorder("<"))
             for s in m["splits"]["validation"]["shards"]]
    return np.concatenate(parts).astype(np.int64), m


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("data_dir")
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--items", type=int, required=True)
    ap.add_argument("--logits", action="store_true")
    a = ap.parse_args()
    cfg = json.load(open(os.path.join(a.model_dir, "config.json")))
    if cfg.get("architectures") != ["LlamaForCausalLM"]:
        sys.exit(f"not a LlamaForCausalLM: {cfg.get('architectures')}")
    w = load_weights(a.model_dir)
    toks, _ = validation_tokens(a.data_dir)
    n = len(toks) // (a.seq + 1)
    losses, first_logits = [], None
    for i in range(a.items):
        win = toks[(i % n) * (a.seq + 1):(i % n + 1) * (a.seq + 1)]
        z = forward(cfg, w, win[:-1])
        if first_logits is None:
            first_logits = z[-1]
        z = z - z.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        losses.append(float(-logp[np.arange(a.seq), win[1:]].mean()))
    out = {"windows": n, "items": a.items, "seq": a.seq,
           "mean_loss": float(np.mean(losses)), "losses": losses}
    if a.logits:
        out["last_logits_of_first_window"] = [float(v) for v in first_logits]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
