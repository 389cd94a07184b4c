#!/usr/bin/env bash
# FSDP runs of `lowbit train` on 2 ranks: every sharding strategy, MXFP8 weights
# gathered as such where the strategy holds them (optim, optim_grads, optim_grads_params with
# both copies and fine-grained), bf16 weights quantized on the fly otherwise; NVFP4 units of
# optim_grads_params; bf16 gradient communication.
# `train_fsdp.sh cpu|cuda` writes $WORK/train-<device>-fsdp-<variant>.json; `--list` the variants.
set -euo pipefail
declare -A FLAGS=(
  [no_shard]="--sharding no_shard --param-gather off"
  [optim]="--sharding optim"
  [optim_grads]="--sharding optim_grads"
  [optim_grads_params]="--sharding optim_grads_params --param-gather off"
  [optim_grads_params-mxfp8]="--sharding optim_grads_params"
  [optim_grads_params-mxfp8-fine]="--sharding optim_grads_params --fine-grained-param-gather on --recompute on"
  [optim_grads_params-nvfp4]="--sharding optim_grads_params --precision nvfp4"
  [optim_grads-bf16comm]="--sharding optim_grads --grad-comm-dtype bf16"
)
ORDER="no_shard optim optim_grads optim_grads_params optim_grads_params-mxfp8 optim_grads_params-mxfp8-fine optim_grads_params-nvfp4 optim_grads-bf16comm"
if [[ "${1:-}" == "--list" ]]; then echo $ORDER; exit 0; fi
device=$1
for v in $ORDER; do
  echo "== $v: ${FLAGS[$v]}"
  # shellcheck disable=SC2086
  bin/lowbit train --device "$device" --ranks 2 --steps 60 ${FLAGS[$v]} --json > "$WORK/train-$device-fsdp-$v.json"
done
