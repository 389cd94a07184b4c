#!/usr/bin/env python3
"""torch.distributed.checkpoint saving and loading the tensors lowbit's ckpt_bench saves.

The same fp32 tensors as `crates/lowbit-ckpt/benches/ckpt_bench.rs`: for --params parameters
in matrices of 4096 columns (4096 rows each, the last one shorter), a master, `exp_avg` and
`exp_avg_sq` each (12 bytes a parameter), on --device (the host by default; `cuda` as for
ckpt_bench --device cuda, so both saves include the copy to the host). One process, no process group
(`no_dist=True`), `FileSystemWriter` with fsync on (its default) and --threads writer threads
(DCP's default is 1). Before every load the checkpoint's pages are dropped from the page cache
(`posix_fadvise(DONTNEED)`), as ckpt_bench does. Times are medians of --reps; GB/s are
bytes / s (10^9). With --lowbit-json (ckpt_bench's --json of the same size and directory) the
table also shows lowbit's save and load over DCP's (>1: lowbit is faster).

    python3 torch_dcp.py [--params 256M] [--reps 3] [--threads 1] [--device cpu|cuda] [--dir DIR]
                         [--json OUT.json] [--lowbit-json ckpt_bench.json]
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

SIDE = 4096


def count(text):
    mul = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    unit = text[-1:].upper()
    n = int(text[:-1]) * mul[unit] if unit in mul else int(text)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive count")
    return n


def model(params):
    rows = -(-params // SIDE)
    out = []
    for i in range(-(-rows // SIDE)):
        r = min(rows - i * SIDE, SIDE)
        out.append((f"layers.{i}.weight", (r, SIDE)))
    return out


def state(params, seed, device):
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, shape in model(params):
        for st in ("master", "exp_avg", "exp_avg_sq"):
            t = torch.randn(shape, generator=g, dtype=torch.float32)
            sd[f"{name}/{st}"] = t.to(device)
    return sd


def drop_cached(path):
    dropped = True
    for dirpath, _, names in os.walk(path):
        for n in names:
            fd = os.open(os.path.join(dirpath, n), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                dropped = False
            finally:
                os.close(fd)
    return dropped


def data_bytes(path):
    return sum(
        os.path.getsize(os.path.join(d, n))
        for d, _, names in os.walk(path)
        for n in names
        if n.endswith(".distcp")
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=count, default=256 << 20)
    ap.add_argument("--reps", type=count, default=3)
    ap.add_argument("--threads", type=count, default=1)
    ap.add_argument("--device", default="cpu", help="where the tensors live (cpu, cuda)")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--json")
    ap.add_argument("--lowbit-json")
    a = ap.parse_args()

    work = os.path.join(a.dir, f"torch-dcp-bench-{os.getpid()}")
    os.makedirs(work, exist_ok=True)
    sd = state(a.params, 0, a.device)
    target = state(a.params, 1, a.device)
    tensor_bytes = sum(t.numel() * 4 for t in sd.values())
    saves, loads = [], []
    files = 0
    cache_dropped = True
    try:
        for rep in range(a.reps):
            path = os.path.join(work, f"step-{rep}")
            writer = FileSystemWriter(path, sync_files=True, thread_count=a.threads)
            t = time.perf_counter()
            dcp.save(sd, storage_writer=writer, no_dist=True)
            saves.append(time.perf_counter() - t)
            files = data_bytes(path)
            cache_dropped &= drop_cached(path)
            t = time.perf_counter()
            dcp.load(target, storage_reader=FileSystemReader(path), no_dist=True)
            if a.device != "cpu":
                torch.cuda.synchronize()
            loads.append(time.perf_counter() - t)
            for k in sd:
                if not torch.equal(sd[k], target[k]):
                    sys.exit(f"torch_dcp: {k} differs after the load")
            shutil.rmtree(path)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    rows = [("dcp_save", statistics.median(saves)), ("dcp_load", statistics.median(loads))]
    ours = {}
    if a.lowbit_json:
        lb = json.load(open(a.lowbit_json))
        ours = {r["name"]: r for r in lb["results"]}
        if lb.get("bytes") and abs(lb["bytes"] - files) > 0.01 * files:
            print(f"note: lowbit's data files are {lb['bytes']} bytes, DCP's {files}")
    print(
        f"torch.distributed.checkpoint {torch.__version__}: {tensor_bytes} bytes of fp32 tensors "
        f"({tensor_bytes / 2**30:.2f} GiB), {files} bytes of .distcp data, {a.reps} reps "
        f"(medians), {a.threads} writer thread(s), tensors on {a.device}, directory {a.dir}"
    )
    print(f"{'case':<12} {'ms':>10} {'GB/s':>9} {'lowbit GB/s':>12} {'lowbit/DCP':>11}")
    results = []
    for (name, secs), lowbit in zip(rows, ("save_1rank", "load_1rank")):
        rate = tensor_bytes / secs / 1e9
        mine = ours.get(lowbit, {}).get("gb_per_s")
        speedup = mine / rate if mine else None
        print(
            f"{name:<12} {secs * 1e3:>10.1f} {rate:>9.3f} "
            f"{(f'{mine:.3f}' if mine else '-'):>12} {(f'{speedup:.2f}' if speedup else '-'):>11}"
        )
        results.append(
            {
                "name": name,
                "seconds": secs,
                "bytes": tensor_bytes,
                "gb_per_s": rate,
                "lowbit": lowbit,
                "lowbit_gb_per_s": mine,
                "lowbit_over_dcp": speedup,
            }
        )
    if not cache_dropped:
        print("note: posix_fadvise(DONTNEED) was refused: loads may come from the page cache")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "bench": "torch-dcp",
                    "torch": torch.__version__,
                    "params": sum(t.numel() for t in sd.values()) // 3,
                    "bytes": tensor_bytes,
                    "reps": a.reps,
                    "threads": a.threads,
                    "device": a.device,
                    "cache_dropped": cache_dropped,
                    "results": results,
                },
                f,
            )


if __name__ == "__main__":
    main()
