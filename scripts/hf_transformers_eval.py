#!/usr/bin/env python3
"""Validation loss of a `lowbit ckpt export --format hf` directory through transformers.

    HF_HUB_OFFLINE=1 scripts/hf_transformers_eval.py EXPORT_DIR DATA_DIR --ckpt CKPT \
        [--lowbit-eval FILE] [--device cuda] [--dtype float32|bfloat16] [--ranks R]

Loads EXPORT_DIR with AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained
(local files only, both the fast and the slow tokenizer), checks that the tokenizer encodes a
sample of DATA_DIR's text to the very ids `lowbit data prepare` wrote, and computes the mean
token loss over exactly the windows `lowbit eval CKPT` uses:

- the validation split of DATA_DIR (manifest.json; raw little-endian u16/u32 shards in order)
  cut into non-overlapping windows of seq + 1 tokens (`Split::windows`, `Split::window`);
- `lowbit eval` runs on R ranks (default 1) with one microbatch, so a rank's batch is
  ceil(batch / R) and the eval set is ceil(eval_samples / batch') * batch' items, batch' =
  R * ceil(batch / R); item i is window i % windows (`LlamaJob::build` in src/train/llama.rs);
- every window weighs the same, so the loss is the mean over all predicted tokens.

seq, batch and eval_samples are the checkpoint's (its manifest.json: model.seq, batch,
eval_samples), or --seq/--batch/--eval-samples. With --lowbit-eval FILE (the output of
`lowbit eval CKPT --json`) it also reports the relative difference and fails above --tolerance
(0.5%). Prints one JSON object; exit status 1 on a failed check.
"""
import argparse
import json
import math
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402


def manifest_config(ckpt):
    """The `config` map of a checkpoint root (its `latest`) or of a step-N directory."""
    path = os.path.join(ckpt, "manifest.json")
    if not os.path.exists(path):
        with open(os.path.join(ckpt, "latest")) as f:
            path = os.path.join(ckpt, f.read().strip(), "manifest.json")
    with open(path) as f:
        return json.load(f)["config"]


def validation_tokens(data_dir):
    with open(os.path.join(data_dir, "manifest.json")) as f:
        m = json.load(f)
    dt = np.dtype({"u16": "<u2", "u32": "<u4"}[m["dtype"]])
    parts = [np.fromfile(os.path.join(data_dir, s["file"]), dtype=dt)
             for s in m["splits"]["validation"]["shards"]]
    toks = np.concatenate(parts).astype(np.int64)
    if len(toks) != m["splits"]["validation"]["tokens"]:
        sys.exit(f"{data_dir}: the validation shards hold {len(toks)} tokens, the manifest says "
                 f"{m['splits']['validation']['tokens']}")
    return toks, m


def safe_cut(text):
    """The last ` ` between two ASCII letters: lowbit's `Tokenizer::safe_cut`, where GPT-2's
    pre-tokenizer always ends one piece and starts the next, so encode(text[:p]) is a prefix of
    encode(text)."""
    for p in range(len(text) - 2, 0, -1):
        if text[p] == " " and text[p - 1].isascii() and text[p - 1].isalpha() \
                and text[p + 1].isascii() and text[p + 1].isalpha():
            return p
    return None


def check_tokenizer(tok, toks, eot, limit=4096):
    """Encodes a prefix of the first validation document with `tok` and compares it with the
    ids lowbit wrote for it (documents are preceded by end-of-text)."""
    start = 1 if len(toks) and toks[0] == eot else 0
    rest = np.nonzero(toks[start:] == eot)[0]
    end = start + (int(rest[0]) if len(rest) else len(toks) - start)
    ids = [int(t) for t in toks[start:min(end, start + limit)]]
    text = tok.decode(ids)
    p = safe_cut(text)
    if p is None:
        return {"ok": False, "why": "no cut point in the sample"}
    enc = tok(text[:p], add_special_tokens=False)["input_ids"]
    ok = enc == ids[:len(enc)] and len(enc) > 0
    first = next((i for i, (a, b) in enumerate(zip(enc, ids)) if a != b), None)
    return {"ok": ok, "tokens_compared": len(enc), "first_difference": first,
            "class": type(tok).__name__}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("export_dir")
    ap.add_argument("data_dir")
    ap.add_argument("--ckpt", help="the checkpoint exported (its seq, batch, eval_samples)")
    ap.add_argument("--seq", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--eval-samples", type=int)
    ap.add_argument("--ranks", type=int, default=1, help="--ranks of the lowbit eval compared")
    ap.add_argument("--device", default="cuda" if _cuda() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", type=int, default=8, help="windows per forward")
    ap.add_argument("--lowbit-eval", help="`lowbit eval CKPT --json` output to compare with")
    ap.add_argument("--tolerance", type=float, default=0.005)
    a = ap.parse_args()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = manifest_config(a.ckpt) if a.ckpt else {}
    seq = a.seq or int(cfg.get("model.seq", 0))
    batch = a.batch or int(cfg.get("batch", 0))
    eval_samples = a.eval_samples or int(cfg.get("eval_samples", 0))
    if not (seq and batch and eval_samples):
        sys.exit("need --ckpt, or --seq, --batch and --eval-samples")
    rows = -(-batch // a.ranks)
    split = a.ranks * rows
    items = max(1, -(-eval_samples // split)) * split

    toks, m = validation_tokens(a.data_dir)
    windows = len(toks) // (seq + 1)
    if windows == 0:
        sys.exit(f"{a.data_dir}: no validation window of {seq + 1} tokens")
    result = {"export": a.export_dir, "data": a.data_dir, "tokenizer": m["tokenizer"],
              "seq": seq, "items": items, "windows": windows, "device": a.device,
              "dtype": a.dtype}
    checks = {}
    for fast in (True, False):
        tok = AutoTokenizer.from_pretrained(a.export_dir, use_fast=fast, local_files_only=True)
        checks["fast" if fast else "slow"] = check_tokenizer(tok, toks, m["eot"])
    result["tokenizer_check"] = checks

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    # transformers 5 names the argument `dtype`, 4.x `torch_dtype` (4.x would take `dtype` as a
    # config attribute and load f32 silently).
    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(a.export_dir, local_files_only=True,
                                                 **{key: dtype})
    model = model.to(a.device).eval()
    if next(model.parameters()).dtype != dtype:
        sys.exit(f"loaded as {next(model.parameters()).dtype}, asked for {dtype}")
    result["transformers"] = transformers.__version__
    result["torch"] = torch.__version__
    picks = [i % windows for i in range(items)]
    total, count = 0.0, 0
    with torch.no_grad():
        for b in range(0, items, a.rows):
            w = np.stack([toks[j * (seq + 1):(j + 1) * (seq + 1)] for j in picks[b:b + a.rows]])
            x = torch.from_numpy(w).to(a.device)
            logits = model(input_ids=x[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
            total += float(loss.double())
            count += x[:, 1:].numel()
    result["loss"] = total / count
    ok = all(c["ok"] for c in checks.values()) and math.isfinite(result["loss"])
    if a.lowbit_eval:
        with open(a.lowbit_eval) as f:
            lb = json.load(f)
        if lb.get("eval_items") not in (None, items):
            result["warning"] = f"lowbit eval used {lb['eval_items']} items, this {items}"
            ok = False
        result["lowbit_eval_loss"] = lb["eval_loss"]
        rel = abs(result["loss"] - lb["eval_loss"]) / abs(lb["eval_loss"])
        result["relative_difference"] = rel
        result["within_tolerance"] = rel <= a.tolerance
        ok = ok and rel <= a.tolerance
    result["ok"] = ok
    print(json.dumps(result))
    sys.exit(0 if ok else 1)


def _cuda():
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


if __name__ == "__main__":
    main()
