"""torch.distributed (NCCL) all-gather and reduce-scatter, measured exactly as
benches/nccl_bench.rs measures lowbit's NcclComm, for a same-run baseline.

    torchrun --nproc-per-node 2 torch_collectives.py [--json PATH] [--min-mib N] [--max-mib N]

Size is the large buffer (all-gather output, reduce-scatter input). Each size: 5 warm-up calls,
then 3 trials of clamp(4 GiB / size, 10, 400) back-to-back calls timed with CUDA events on the
current stream; the median trial counts, the slowest rank's time is reported.
busbw = size / time * (n - 1) / n.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist

MIB = 1 << 20


def iters(nbytes):
    return max(10, min(400, (4 << 30) // nbytes))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--min-mib", type=int, default=1)
    p.add_argument("--max-mib", type=int, default=1024)
    a = p.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, n = dist.get_rank(), dist.get_world_size()
    sizes = []
    mib = max(1, a.min_mib)
    while mib <= a.max_mib:
        sizes.append(mib * MIB)
        mib *= 2
    biggest = sizes[-1]
    big = torch.full((biggest // 4,), 0.3 + rank, dtype=torch.float32, device="cuda")
    small = torch.full((biggest // 4 // n,), 1.7 + rank, dtype=torch.float32, device="cuda")
    cases = [("all_gather", torch.bfloat16), ("all_gather", torch.uint8),
             ("reduce_scatter", torch.bfloat16), ("reduce_scatter", torch.float32)]
    names = {torch.bfloat16: "bf16", torch.uint8: "u8", torch.float32: "f32"}
    rows = []
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    for op, dtype in cases:
        for nbytes in sizes:
            es = torch.tensor([], dtype=dtype).element_size()
            large = big.view(dtype)[: nbytes // es]
            part = small.view(dtype)[: nbytes // n // es]
            if op == "all_gather":
                call = lambda: dist.all_gather_into_tensor(large, part)
            else:
                call = lambda: dist.reduce_scatter_tensor(part, large, op=dist.ReduceOp.SUM)
            for _ in range(5):
                call()
            torch.cuda.synchronize()
            k = iters(nbytes)
            trials = []
            for _ in range(3):
                start.record()
                for _ in range(k):
                    call()
                end.record()
                end.synchronize()
                trials.append(start.elapsed_time(end) / 1e3 / k)
            secs = sorted(trials)[1]
            t = torch.tensor([secs], dtype=torch.float64, device="cuda")
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            secs = t.item()
            algbw = nbytes / secs / 1e9
            rows.append({"op": op, "dtype": names[dtype], "bytes": nbytes,
                         "time_us": secs * 1e6, "algbw_gbs": algbw,
                         "busbw_gbs": algbw * (n - 1) / n})
            dist.barrier()
    if rank == 0:
        print(f"{'op':<15} {'dtype':>5} {'size MiB':>10} {'time us':>12} {'busbw GB/s':>12}")
        for r in rows:
            print(f"{r['op']:<15} {r['dtype']:>5} {r['bytes'] // MIB:>10} "
                  f"{r['time_us']:>12.1f} {r['busbw_gbs']:>12.1f}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"impl": f"torch.distributed {torch.__version__} "
                                   f"(NCCL {'.'.join(map(str, torch.cuda.nccl.version()))})",
                           "card": torch.cuda.get_device_name(local), "gpus": n,
                           "results": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
