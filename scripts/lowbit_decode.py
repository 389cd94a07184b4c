#!/usr/bin/env python3
"""Decode a file written by `lowbit quantize` from its specification alone (docs/format.md).

Needs numpy only (safetensors' own loader cannot read the fp8 dtypes into numpy, so the
safetensors container — an 8-byte little-endian header length, a JSON header, the data — is
parsed here by hand). Every recipe (mxfp8, mxfp8-e5m2, nvfp4), both scale layouts (compact,
swizzled), 1D and 2D scaling, and either copy.

Library use:
    tensors = decode("w.mxfp8.safetensors")             # {name: float32 ndarray}, original shapes
    tensors = decode(path, copy="columnwise")           # from the other copy
Command line:
    lowbit_decode.py IN OUT [--dtype f32|bf16|f16|orig] [--copy auto|rowwise|columnwise]
writes a safetensors file as `lowbit dequantize IN OUT` does: quantized tensors dequantized
(to their original dtype unless --dtype says otherwise), every other tensor copied.
"""

import argparse
import json
import struct
import sys

import numpy as np

BLOCK_MX = 32
BLOCK_NV = 16
SUFFIXES = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv", "amax")
RAW_DTYPES = {
    "F32": np.float32, "F16": np.float16, "F64": np.float64, "U8": np.uint8, "I8": np.int8,
    "U16": np.uint16, "I16": np.int16, "U32": np.uint32, "I32": np.int32, "U64": np.uint64,
    "I64": np.int64, "BOOL": np.uint8, "BF16": np.uint16, "F8_E4M3": np.uint8,
    "F8_E5M2": np.uint8, "F8_E8M0": np.uint8,
}


def read_safetensors(path):
    """(header without __metadata__, metadata dict, the file's bytes, data start)."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {}) or {}
    return header, meta, raw, 8 + n


def small_float_table(mbits, bias):
    """fp32 value of every byte of a float with `mbits` mantissa bits and exponent `bias`."""
    b = np.arange(256, dtype=np.uint32)
    exp = (b & 0x7F) >> mbits
    mant = (b & ((1 << mbits) - 1)).astype(np.float64)
    sub = mant * 2.0 ** (1 - bias - mbits)
    norm = (1.0 + mant / 2 ** mbits) * 2.0 ** (exp.astype(np.float64) - bias)
    mag = np.where(exp == 0, sub, norm)
    return np.where(b & 0x80, -mag, mag).astype(np.float32)


E4M3 = small_float_table(3, 7)
E4M3[[0x7F, 0xFF]] = np.nan  # e4m3fn: no infinity, S.1111.111 is NaN
E5M2 = small_float_table(2, 15)
E5M2[0x7C], E5M2[0xFC] = np.inf, -np.inf
E5M2[[0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF]] = np.nan
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
# E8M0: 2^(b - 127); 0x00 is 2^-127 (an fp32 subnormal), 0xFF is NaN.
E8M0 = (np.arange(256, dtype=np.uint32) << 23).view(np.float32).copy()
E8M0[0x00] = np.uint32(0x00400000).view(np.float32)
E8M0[0xFF] = np.nan


def swizzle_offsets(rows, cols):
    """Offset in the swizzled buffer of compact scale (r, c), as a rows x cols index array:
    ((r/128)*ceil(cols/4) + c/4)*512 + (r%32)*16 + ((r%128)/32)*4 + c%4."""
    r = np.arange(rows, dtype=np.int64)[:, None]
    c = np.arange(cols, dtype=np.int64)[None, :]
    return ((r // 128) * ((cols + 3) // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def unswizzle(stored, rows, cols):
    padded = ((rows + 127) // 128 * 128) * ((cols + 3) // 4 * 4)
    assert stored.size == padded, (stored.size, padded)
    return stored[swizzle_offsets(rows, cols)] if rows and cols else np.zeros((rows, cols), np.uint8)


def matrix_dims(shape):
    """[d0, ..., N] -> (d0*..., N); 1-D is one row; a 0-D scalar is 1 x 1."""
    if not shape:
        return 1, 1
    return int(np.prod(shape[:-1], dtype=np.int64)), shape[-1]


class File:
    def __init__(self, path):
        self.header, self.meta, self.raw, self.start = read_safetensors(path)

    def bytes_of(self, name):
        e = self.header[name]
        a, b = e["data_offsets"]
        return e, np.frombuffer(self.raw, np.uint8, b - a, self.start + a)

    def u8(self, name, dtype, shape):
        """The bytes of component `name`, checked to be `dtype` of `shape` (a 4-byte F32 amax
        is asked for as shape (4,) and checked as its stored shape [1])."""
        e, b = self.bytes_of(name)
        stored = [1] if dtype == "F32" else list(shape)
        assert e["dtype"] == dtype and e["shape"] == stored, (name, e, dtype, shape)
        return b.reshape(shape)


def decode_tensor(f, name, copy="auto"):
    """The float32 values of quantized tensor `name`, in its original shape."""
    m = f.meta
    assert m.get("lowbit.format_version") == "1", "not a lowbit quantize file (version 1)"
    recipe, copies, layout = m["lowbit.recipe"], m["lowbit.copies"], m["lowbit.scale_layout"]
    orig = json.loads(m["lowbit.tensor." + name])
    rows, cols = matrix_dims(orig["shape"])
    if copy == "auto":
        copy = "rowwise" if copies in ("rowwise", "both") else "columnwise"
    swz = layout == "swizzled"
    if recipe in ("mxfp8", "mxfp8-e5m2"):
        table, dt = (E4M3, "F8_E4M3") if recipe == "mxfp8" else (E5M2, "F8_E5M2")
        q = f.u8(f"{name}.{copy}_data", dt, (rows, cols))
        rb = (rows + BLOCK_MX - 1) // BLOCK_MX
        cb = (cols + BLOCK_MX - 1) // BLOCK_MX
        if copy == "rowwise":
            shape = ((rows + 127) // 128 * 128, (cb + 3) // 4 * 4) if swz else (rows, cb)
            s = f.u8(f"{name}.rowwise_scale_inv", "F8_E8M0", shape).reshape(-1)
            s = unswizzle(s, rows, cb) if swz else s.reshape(rows, cb)
            scale = E8M0[s][:, np.arange(cols) // BLOCK_MX] if rows and cols else None
        else:
            # Swizzled columnwise scales are the swizzle of the transpose [cols, row blocks],
            # stored under TE's shape [roundup(row blocks, 4), roundup(cols, 128)].
            shape = ((rb + 3) // 4 * 4, (cols + 127) // 128 * 128) if swz else (rb, cols)
            s = f.u8(f"{name}.columnwise_scale_inv", "F8_E8M0", shape).reshape(-1)
            s = unswizzle(s, cols, rb).T if swz else s.reshape(rb, cols)
            scale = E8M0[s][np.arange(rows) // BLOCK_MX, :] if rows and cols else None
        out = np.zeros((rows, cols), np.float32) if scale is None else table[q] * scale
    elif recipe == "nvfp4":
        (amax,) = np.frombuffer(f.u8(f"{name}.amax", "F32", (4,)).tobytes(), np.float32)
        # The plane: rowwise [rows, cols]; columnwise the transpose [cols, rows].
        pr, pc = (rows, cols) if copy == "rowwise" else (cols, rows)
        nb = (pc + BLOCK_NV - 1) // BLOCK_NV
        data = f.u8(f"{name}.{copy}_data", "U8", (pr, (pc + 1) // 2))
        shape = ((pr + 127) // 128 * 128, (nb + 3) // 4 * 4) if swz else (pr, nb)
        s = f.u8(f"{name}.{copy}_scale_inv", "F8_E4M3", shape).reshape(-1)
        s = unswizzle(s, pr, nb) if swz else s.reshape(pr, nb)
        if pr and pc:
            col = np.arange(pc)
            # Element 2i is the low nibble of byte i, element 2i+1 the high one.
            nib = np.where(col % 2 == 0, data[:, col // 2] & 0xF, data[:, col // 2] >> 4)
            # TE's dequantize order, each step rounded to fp32: (sf * amax) * fl32(1/2688).
            factor = np.float32(1.0 / (6.0 * 448.0))
            final = (E4M3[s] * np.float32(amax)) * factor
            plane = E2M1[nib] * final[:, col // BLOCK_NV]
        else:
            plane = np.zeros((pr, pc), np.float32)
        out = plane if copy == "rowwise" else plane.T
    else:
        raise ValueError(f"unknown recipe {recipe!r}")
    return np.ascontiguousarray(out, np.float32).reshape(orig["shape"])


def quantized_names(f):
    return sorted(k[len("lowbit.tensor."):] for k in f.meta if k.startswith("lowbit.tensor."))


def decode(path, copy="auto"):
    """{name: float32 array} of every quantized tensor of a `lowbit quantize` file."""
    f = File(path)
    return {n: decode_tensor(f, n, copy) for n in quantized_names(f)}


def to_bf16_bits(x):
    """fp32 -> bf16 bits, round to nearest even; NaN kept quiet with its sign (Rust's `half`)."""
    b = x.astype(np.float32).view(np.uint32)
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    rounded = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(nan, ((b >> 16) | 0x40).astype(np.uint16), rounded)


def to_f16_bits(x):
    """fp32 -> f16 bits, round to nearest even, finite values saturated to +-65504 (as lowbit
    dequantize does); NaN as Rust's `half` (sign, 0x7E00 | top mantissa bits)."""
    x = x.astype(np.float32)
    b = x.view(np.uint32)
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    fin = np.where(np.isfinite(x), np.clip(x, -65504.0, 65504.0), x)
    with np.errstate(over="ignore", invalid="ignore"):
        h = fin.astype(np.float16).view(np.uint16)
    nan_bits = ((b >> 16) & 0x8000) | 0x7E00 | ((b & 0x7FFFFF) >> 13)
    return np.where(nan, nan_bits.astype(np.uint16), h)


def write_safetensors(path, tensors, metadata):
    """tensors: {name: (dtype string, shape, bytes)}; names sorted, data aligned to 8 bytes."""
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        dt, shape, data = tensors[name]
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def main(argv):
    # Overflow to +-Inf is part of the format (a block holding Inf decodes to Inf), as in fp32.
    np.seterr(over="ignore", invalid="ignore")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("input")
    ap.add_argument("output")
    ap.add_argument("--dtype", choices=["orig", "f32", "bf16", "f16"], default="orig")
    ap.add_argument("--copy", choices=["auto", "rowwise", "columnwise"], default="auto")
    a = ap.parse_args(argv)
    f = File(a.input)
    names = quantized_names(f)
    consumed = {f"{n}.{s}" for n in names for s in SUFFIXES}
    out = {}
    for n in names:
        v = decode_tensor(f, n, a.copy)
        dt = json.loads(f.meta["lowbit.tensor." + n])["dtype"] if a.dtype == "orig" else a.dtype.upper()
        bits = {"F32": lambda v: v.astype("<f4"), "BF16": to_bf16_bits, "F16": to_f16_bits}[dt](v)
        out[n] = (dt, v.shape, bits.astype(bits.dtype.newbyteorder("<")).tobytes())
    for n, e in f.header.items():
        if n not in consumed:
            _, b = f.bytes_of(n)
            out[n] = (e["dtype"], e["shape"], b.tobytes())
    meta = {k: v for k, v in f.meta.items() if not k.startswith("lowbit.")}
    write_safetensors(a.output, out, meta)


if __name__ == "__main__":
    main(sys.argv[1:])
