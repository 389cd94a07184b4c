#!/usr/bin/env bash
# Checks scripts/lowbit_decode.py (the Python decoder written from docs/format.md) against
# `lowbit dequantize`, bit for bit: a generated file with odd sizes, 1-D, 0-D and empty tensors,
# NaN and ±Inf, in BF16/F16/F32, quantized with every recipe, both scale layouts, 1D and 2D
# scales and both copies, then dequantized by both (original dtypes and f32) and compared tensor
# by tensor. The columnwise copy of a `--copies both` file, decoded by Python, must equal what
# lowbit makes of the `--copies columnwise` file. Exits non-zero on any mismatch.
#
# Needs python3 with numpy (`python3 -m pip install numpy safetensors`); builds the debug binary.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --locked --quiet -p lowbit --bin lowbit
BIN="${CARGO_TARGET_DIR:-target}/debug/lowbit"
DIR="$(mktemp -d)"
trap 'rm -rf "$DIR"' EXIT

python3 - "$DIR/in.safetensors" <<'EOF'
import sys
import numpy as np
sys.path.insert(0, "scripts")
from lowbit_decode import to_bf16_bits, to_f16_bits, write_safetensors

rng = np.random.default_rng(38)
def values(shape, scale=1.0):
    n = int(np.prod(shape)) if shape else 1
    x = (rng.standard_normal(n) * scale * 10.0 ** rng.integers(-3, 3, n)).astype(np.float32)
    if n > 20:
        x[7], x[n // 2], x[n - 2] = np.nan, np.inf, -np.inf
    return x
def t(dtype, shape, scale=1.0):
    x = values(shape, scale)
    b = {"F32": lambda v: v.astype("<f4"), "BF16": to_bf16_bits, "F16": to_f16_bits}[dtype](x)
    return (dtype, shape, b.astype(b.dtype.newbyteorder("<")).tobytes())
tensors = {
    "odd3d": t("BF16", [3, 37, 45]),
    "tall": t("F32", [130, 300]),
    "big": t("BF16", [2, 130, 513], 1e3),
    "one_d": t("F16", [1000]),
    "row": t("F32", [1, 777]),
    "scalar": t("F32", []),
    "empty": t("F32", [0, 4]),
    "small": t("F16", [33, 17]),
    "tiny": t("F32", [5], 1e-30),
    "ids": ("I64", [3], np.arange(3, dtype="<i8").tobytes()),
}
write_safetensors(sys.argv[1], tensors, {"source": "check_decoder"})
EOF

compare() { # compare A B WHAT: same tensor names, dtypes, shapes and bytes
  python3 - "$1" "$2" "$3" <<'EOF'
import sys
sys.path.insert(0, "scripts")
from lowbit_decode import File
a, b, what = File(sys.argv[1]), File(sys.argv[2]), sys.argv[3]
bad = []
if sorted(a.header) != sorted(b.header):
    bad.append(f"names {sorted(a.header)} != {sorted(b.header)}")
for n in sorted(set(a.header) & set(b.header)):
    (ea, ba), (eb, bb) = a.bytes_of(n), b.bytes_of(n)
    if (ea["dtype"], ea["shape"]) != (eb["dtype"], eb["shape"]):
        bad.append(f"{n}: {ea['dtype']} {ea['shape']} != {eb['dtype']} {eb['shape']}")
    elif ba.tobytes() != bb.tobytes():
        i = next(i for i in range(len(ba)) if ba[i] != bb[i])
        bad.append(f"{n}: bytes differ from byte {i} ({ba[i]:#04x} vs {bb[i]:#04x})")
if bad:
    print(f"MISMATCH ({what}):\n  " + "\n  ".join(bad))
    sys.exit(1)
EOF
}

checked=0
for recipe in mxfp8 mxfp8-e5m2 nvfp4; do
  for layout in compact swizzled; do
    for twod in "" "--2d"; do
      what="--recipe $recipe --scale-layout $layout $twod"
      for copies in both columnwise; do
        "$BIN" quantize "$DIR/in.safetensors" "$DIR/q-$copies.safetensors" --all --force \
          --recipe "$recipe" --scale-layout "$layout" $twod --copies "$copies" >/dev/null
        for dtype in orig f32; do
          flag=(); [ "$dtype" = f32 ] && flag=(--dtype f32)
          "$BIN" dequantize "$DIR/q-$copies.safetensors" "$DIR/l-$copies-$dtype.safetensors" \
            --force "${flag[@]}" >/dev/null
          python3 scripts/lowbit_decode.py "$DIR/q-$copies.safetensors" \
            "$DIR/p-$copies-$dtype.safetensors" --dtype "$dtype"
          compare "$DIR/l-$copies-$dtype.safetensors" "$DIR/p-$copies-$dtype.safetensors" \
            "$what --copies $copies, dtype $dtype"
          checked=$((checked + 1))
        done
      done
      # The other copy of a `both` file, decoded by Python, is lowbit's columnwise-only result.
      python3 scripts/lowbit_decode.py "$DIR/q-both.safetensors" "$DIR/p-col.safetensors" \
        --dtype f32 --copy columnwise
      compare "$DIR/l-columnwise-f32.safetensors" "$DIR/p-col.safetensors" \
        "$what, columnwise copy of a both file"
      checked=$((checked + 1))
    done
  done
done
echo "check_decoder: $checked comparisons, every tensor bit-identical to lowbit dequantize"
