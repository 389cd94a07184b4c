#!/usr/bin/env bash
# Runs "$@" with cuBLASLt loadable by name (cudarc opens libcublasLt.so / libcublasLt.so.13 with
# dlopen): when the loader cache has no libcublasLt, the CUDA toolkit's lib folder or PyTorch's
# nvidia wheels' is put on LD_LIBRARY_PATH.
if ! ldconfig -p 2>/dev/null | grep -q 'libcublasLt\.so'; then
  dirs=$(ls -d /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-*/lib64 2>/dev/null)
  dirs="$dirs $(python3 - <<'PY' 2>/dev/null
import glob, os
try:
    import nvidia
    for base in nvidia.__path__:
        for f in glob.glob(os.path.join(base, "**", "libcublasLt.so*"), recursive=True):
            print(os.path.dirname(f))
except Exception:
    pass
PY
)"
  for d in $dirs; do
    if ls "$d"/libcublasLt.so* >/dev/null 2>&1; then
      export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      echo "== cuBLASLt: using $d" >&2
      break
    fi
  done
fi
exec "$@"
