#!/bin/sh
# The convergence study of docs/convergence.md: llama-125m on one GPU, the same data, schedule and
# token budget for each (precision, optimizer) pair, one JSON report per run.
#
#   scripts/convergence.sh LOWBIT DATA OUT STEPS RUN...
#
# LOWBIT is a lowbit binary built with --features cuda, DATA a directory of `lowbit data prepare`
# (GPT-2 tokens), OUT where the reports go, STEPS the steps of every run (0: measure the speed
# with a 20-step probe and take the steps that fit SECONDS, default 170, per run), and each RUN
# `precision:optimizer` (bf16|mxfp8|nvfp4 : adamw|muon). Every run: batch 32 x 256 tokens, the
# bf16 tensor-core GEMMs (--compute bf16), AdamW lr 1e-3 (warmup 5%, cosine to a tenth), Muon at
# its default rate on the matrices, eval on 256 validation windows every EVAL (default 25) steps.
# The eval lines stream to OUT/RUN.log as the run goes, so a run cut short still leaves its curve.
set -eu
lowbit=$1 data=$2 out=$3 steps=$4
shift 4
seconds=${SECONDS_PER_RUN:-170}
every=${EVAL:-25}
mkdir -p "$out"
common="--model llama-125m --seq 256 --batch 32 --microbatches 1 --ranks 1 --device cuda \
  --compute bf16 --lr 1e-3 --eval-samples 256 --data $data"
if [ "$steps" = 0 ]; then
    # Tokens per second of a short bf16 run (the slowest of the three precisions' GEMMs are the
    # same bf16 GEMMs: quantization only changes the weights' storage).
    "$lowbit" train $common --precision bf16 --steps 20 --eval-every 0 --json \
        >"$out/probe.json" 2>/dev/null
    wall=$(sed -n 's/.*"wall_s":\([0-9.]*\).*/\1/p' "$out/probe.json")
    steps=$(awk -v w="$wall" -v s="$seconds" 'BEGIN { n = int(s / (w / 20) * 0.85); print (n < 20 ? 20 : n) }')
fi
echo "steps $steps" >"$out/steps.txt"
for run in "$@"; do
    precision=${run%%:*} optimizer=${run##*:}
    name="$precision-$optimizer"
    timeout $((seconds + 60)) "$lowbit" train $common --precision "$precision" \
        --optimizer "$optimizer" $([ "$optimizer" = muon ] && echo --muon-ns-dtype bf16) \
        --steps "$steps" --eval-every "$every" --json \
        >"$out/$name.json" 2>"$out/$name.log" || echo "$name: exit $?" >>"$out/failed.txt"
done
