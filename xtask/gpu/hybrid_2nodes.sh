#!/usr/bin/env bash
# Two torchrun "nodes" of 2 GPUs each on one 4-GPU host: node 0 on GPUs 0-1,
# node 1 on GPUs 2-3, one static rendezvous on 127.0.0.1, NCCL forced onto its socket
# transport (no P2P, no shared memory) so the replica groups, which span the nodes, go over
# the network path. Node 0's rank 0 prints the JSON report on stdout.
set -euo pipefail
export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NVLS_ENABLE=0
PORT=${HYBRID_PORT:-29631}
ARGS=(train --device cuda --ranks 4 --outer-dp 2 --sharding optim_grads --steps 60)
NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET NCCL_DEBUG_FILE="${WORK:-/tmp}/hybrid-nccl.%h.%p.log" CUDA_VISIBLE_DEVICES=2,3 torchrun --nnodes 2 --node-rank 1 --nproc-per-node 2 \
  --master-addr 127.0.0.1 --master-port "$PORT" --no-python bin/lowbit "${ARGS[@]}" \
  > /dev/null 2> "${WORK:-/tmp}/hybrid-node1.log" &
node1=$!
CUDA_VISIBLE_DEVICES=0,1 torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 \
  --master-addr 127.0.0.1 --master-port "$PORT" --no-python bin/lowbit "${ARGS[@]}" --json
wait "$node1"
# What NCCL used between the processes (node 1's log): the socket transport.
cat "${WORK:-/tmp}"/hybrid-nccl.*.log 2>/dev/null | grep -o "NET/Socket[^,]*\|Using network [A-Za-z]*\|via NET/[A-Za-z]*" | sort | uniq -c | head -20 >&2 || true
