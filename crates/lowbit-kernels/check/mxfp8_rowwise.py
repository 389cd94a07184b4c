"""GPU check of crates/lowbit-kernels/mxfp8.cu: bit-exactness against the CPU library and a timing.

Runs on the device machine (PyTorch for memory and events, libcuda through ctypes for the PTX).
Inputs and the CPU reference are safetensors files written by `lowbit quantize` on the CPU:
  python3 crates/lowbit-kernels/check/mxfp8_rowwise.py IN.safetensors ROWWISE.safetensors BOTH.safetensors
Prints one line per tensor (bytes equal or not) and a timing line for a 16384x16384 bf16 tensor
against a device-to-device copy of the same bytes measured in the same run.
"""

import ctypes
import json
import struct
import sys

import torch

PTX = "crates/lowbit-kernels/ptx/mxfp8.sm_90.ptx"
KERNEL = b"mxfp8_rowwise_e4m3_bf16"


def check(code, what):
    if code != 0:
        raise RuntimeError(f"{what} failed with CUresult {code}")


def read_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    data = blob[8 + n :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        out[name] = (info["dtype"], info["shape"], data[a:b])
    return out


class Kernel:
    def __init__(self):
        torch.zeros(1, device="cuda")  # creates the primary context
        self.cuda = ctypes.CDLL("libcuda.so.1")
        ptx = open(PTX, "rb").read() + b"\0"
        self.mod = ctypes.c_void_p()
        check(self.cuda.cuModuleLoadData(ctypes.byref(self.mod), ctypes.c_char_p(ptx)), "cuModuleLoadData")
        self.fn = ctypes.c_void_p()
        check(self.cuda.cuModuleGetFunction(ctypes.byref(self.fn), self.mod, KERNEL), "cuModuleGetFunction")
        self.fn8 = ctypes.c_void_p()
        check(self.cuda.cuModuleGetFunction(ctypes.byref(self.fn8), self.mod, KERNEL + b"_x8"), "cuModuleGetFunction")
        self.fn16 = ctypes.c_void_p()
        check(self.cuda.cuModuleGetFunction(ctypes.byref(self.fn16), self.mod, KERNEL + b"_x16"), "cuModuleGetFunction")
        self.per_thread = 8
        self.fnb = ctypes.c_void_p()
        check(self.cuda.cuModuleGetFunction(ctypes.byref(self.fnb), self.mod, b"mxfp8_both_e4m3_bf16"), "cuModuleGetFunction")

    def both(self, x, rd, rs, cd, cs, rows, cols):
        args = [ctypes.c_void_p(t.data_ptr()) for t in (x, rd, rs, cd, cs)] + [
            ctypes.c_ulonglong(rows),
            ctypes.c_ulonglong(cols),
        ]
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        gx, gy = (cols + 255) // 256, (rows + 31) // 32
        check(self.cuda.cuLaunchKernel(self.fnb, gx, gy, 1, 256, 1, 1, 0, stream, params, None), "cuLaunchKernel")

    def __call__(self, x, data, scales, rows, cols):
        args = [
            ctypes.c_void_p(x.data_ptr()),
            ctypes.c_void_p(data.data_ptr()),
            ctypes.c_void_p(scales.data_ptr()),
            ctypes.c_ulonglong(rows),
            ctypes.c_ulonglong(cols),
        ]
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        if cols % 32 == 0:
            threads = 128
            per = self.per_thread
            gx = (cols // per + threads - 1) // threads
            gy = min(rows, 65535)
            fn = self.fn8 if per == 8 else self.fn16
            check(self.cuda.cuLaunchKernel(fn, gx, gy, 1, threads, 1, 1, 0, stream, params, None), "cuLaunchKernel")
            return
        blocks = rows * ((cols + 31) // 32)
        threads = 256  # 8 warps, one 1x32 block each
        grid = (blocks * 32 + threads - 1) // threads
        check(self.cuda.cuLaunchKernel(self.fn, grid, 1, 1, threads, 1, 1, 0, stream, params, None), "cuLaunchKernel")


def main():
    k = Kernel()
    inputs = read_safetensors(sys.argv[1])
    expected = read_safetensors(sys.argv[2])
    failures = 0
    for per in (8, 16):
        k.per_thread = per
        for name, (dtype, shape, raw) in sorted(inputs.items()):
            if dtype != "BF16":
                continue
            cols = shape[-1] if shape else 1
            rows = 1
            for d in shape[:-1]:
                rows *= d
            x = torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).cuda()
            data = torch.full((rows * cols,), 0xA5, dtype=torch.uint8, device="cuda")  # poisoned
            scales = torch.full((rows * ((cols + 31) // 32),), 0xA5, dtype=torch.uint8, device="cuda")
            k(x, data, scales, rows, cols)
            torch.cuda.synchronize()
            want_d = expected[name + ".rowwise_data"][2]
            want_s = expected[name + ".rowwise_scale_inv"][2]
            ok_d = bytes(data.cpu().numpy().tobytes()) == want_d
            ok_s = bytes(scales.cpu().numpy().tobytes()) == want_s
            failures += (not ok_d) + (not ok_s)
            print(f"x{per} {name:28s} {rows}x{cols}: data {'EQUAL' if ok_d else 'DIFFER'}, scales {'EQUAL' if ok_s else 'DIFFER'}")
    # Both copies in one pass, against `lowbit quantize --copies both` (argv[3]).
    expected_both = read_safetensors(sys.argv[3])
    for name, (dtype, shape, raw) in sorted(inputs.items()):
        if dtype != "BF16":
            continue
        cols = shape[-1] if shape else 1
        rows = 1
        for d in shape[:-1]:
            rows *= d
        x = torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).cuda()
        poison = lambda n: torch.full((n,), 0xA5, dtype=torch.uint8, device="cuda")
        rd, cd = poison(rows * cols), poison(rows * cols)
        rs, cs = poison(rows * ((cols + 31) // 32)), poison(((rows + 31) // 32) * cols)
        k.both(x, rd, rs, cd, cs, rows, cols)
        torch.cuda.synchronize()
        oks = []
        for t, key in ((rd, "rowwise_data"), (rs, "rowwise_scale_inv"), (cd, "columnwise_data"), (cs, "columnwise_scale_inv")):
            oks.append(bytes(t.cpu().numpy().tobytes()) == expected_both[name + "." + key][2])
        failures += oks.count(False)
        print(f"both {name:27s} {rows}x{cols}: " + ", ".join("EQUAL" if o else "DIFFER" for o in oks))
    # Timing: 16384x16384 bf16 against a device-to-device copy of the same input bytes.
    n = 16384
    x = torch.randn(n, n, device="cuda").to(torch.bfloat16)
    data = torch.empty(n * n, dtype=torch.uint8, device="cuda")
    scales = torch.empty(n * n // 32, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(x)

    def timed(f, reps=50):
        for _ in range(5):
            f()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            f()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        times.sort()
        return times[len(times) // 2] * 1e-3

    t_copy = timed(lambda: dst.copy_(x))
    copy_bw = 2 * x.numel() * 2 / t_copy
    q_bytes = x.numel() * (2 + 1 + 1 / 32)
    print(f"device {torch.cuda.get_device_name()}")
    print(f"copy bf16 {n}x{n}: {t_copy * 1e6:.1f} us, {copy_bw / 1e9:.0f} GB/s (read + write)")
    for per in (8, 16):
        k.per_thread = per
        t_q = timed(lambda: k(x, data, scales, n, n))
        print(f"mxfp8 rowwise x{per}: {t_q * 1e6:.1f} us, {q_bytes / t_q / 1e9:.0f} GB/s = {q_bytes / t_q / copy_bw:.2f}x copy")
    rd, cd = torch.empty(n * n, dtype=torch.uint8, device="cuda"), torch.empty(n * n, dtype=torch.uint8, device="cuda")
    rs, cs = torch.empty(n * n // 32, dtype=torch.uint8, device="cuda"), torch.empty(n * n // 32, dtype=torch.uint8, device="cuda")
    t_b = timed(lambda: k.both(x, rd, rs, cd, cs, n, n))
    b_bytes = x.numel() * (2 + 2 + 2 / 32)
    print(f"mxfp8 rowwise+columnwise one pass: {t_b * 1e6:.1f} us, {b_bytes / t_b / 1e9:.0f} GB/s = {b_bytes / t_b / copy_bw:.2f}x copy")
    print("RESULT", "PASS" if failures == 0 else f"FAIL ({failures})")


if __name__ == "__main__":
    main()
