#!/usr/bin/env bash
# Runs a command with PyTorch's bundled NCCL loaded as libnccl.so, so a benchmark of lowbit's
# NCCL communicator and torch.distributed's can be compared on the same NCCL build.
set -euo pipefail
lib=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))')
dir=$(mktemp -d "${TMPDIR:-/tmp}/torch-nccl.XXXXXX")
ln -s "$lib/libnccl.so.2" "$dir/libnccl.so"
echo "NCCL from $lib" >&2
LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$@"
