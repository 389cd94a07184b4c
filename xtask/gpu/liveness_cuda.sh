#!/usr/bin/env bash
# On two GPUs: a dead rank is noticed in seconds. Runs `lowbit train --device
# cuda` as two processes, kills rank 1 mid-run and checks that rank 0 exits non-zero within
# BOUND seconds with a message naming rank 1. Four cases: SIGKILL and SIGTERM, each with
# torchrun's variables set directly (no agent: nothing but lowbit stops rank 0) and under
# torchrun's agent (if torchrun is installed; the agent may stop rank 0 itself, so there the
# name may come from torchrun's own report). One line per case:
#   liveness-cuda SIGKILL plain: PASS rank 0 exited (rc 1) 1.23 s after the kill, naming rank 1
# then PASS or FAIL overall; the exit status is non-zero on any FAIL.
#
#   gpu/liveness_cuda.sh [LOWBIT_BINARY]     (default bin/lowbit)
set -u
BIN=${1:-bin/lowbit}
BOUND=10
DIR=${WORK:-$(mktemp -d)}
FAILED=0
TRAIN=(train --device cuda --ranks 2 --steps 1000000 --eval-every 20)

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# The pid of the child of $1 whose environment has RANK=$2.
rank_pid() {
  local p
  for p in $(pgrep -P "$1"); do
    tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "RANK=$2" && { echo "$p"; return; }
  done
}

one_case() {
  local sig=$1 mode=$2 port token pid0 pid1 t_kill t_end rc secs
  local log0=$DIR/liveness-$sig-$mode-rank0.log log1=$DIR/liveness-$sig-$mode-rank1.log
  local name="liveness-cuda SIG$sig $mode"
  port=$(free_port)
  token=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
  if [[ $mode == plain ]]; then
    for r in 0 1; do
      RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 \
        MASTER_PORT=$port LOWBIT_RDZV_TOKEN=$token "$BIN" "${TRAIN[@]}" \
        > /dev/null 2> "$([[ $r == 0 ]] && echo "$log0" || echo "$log1")" &
      [[ $r == 0 ]] && pid0=$! || pid1=$!
    done
  else
    # pid0 is the agent: its exit is the job's.
    torchrun --no-python --nproc-per-node 2 --master-port "$port" "$BIN" "${TRAIN[@]}" \
      > /dev/null 2> "$log0" &
    pid0=$!
    : > "$log1"
  fi
  # Mid-run: wait for rank 0's first progress line (an evaluation), then two more seconds.
  for _ in $(seq 1 1200); do
    grep -q '^step' "$log0" 2>/dev/null && break
    kill -0 "$pid0" 2>/dev/null || break
    sleep 0.1
  done
  if ! grep -q '^step' "$log0"; then
    echo "$name: FAIL the run never got going; rank 0's log:"
    tail -n 20 "$log0" | sed 's/^/  | /'
    pkill -KILL -P "$pid0" 2>/dev/null
    kill -KILL "$pid0" ${pid1:-} 2>/dev/null
    wait "$pid0" 2>/dev/null
    FAILED=$((FAILED + 1))
    return
  fi
  sleep 2
  if [[ $mode == agent ]]; then
    pid1=$(rank_pid "$pid0" 1)
    if [[ -z "$pid1" ]]; then
      echo "$name: FAIL no child of torchrun with RANK=1"
      pkill -KILL -P "$pid0" 2>/dev/null
      kill -KILL "$pid0" 2>/dev/null
      wait "$pid0" 2>/dev/null
      FAILED=$((FAILED + 1))
      return
    fi
  fi
  t_kill=$(date +%s.%N)
  kill -"$sig" "$pid1"
  # Rank 0 must be gone within the bound; poll every 50 ms.
  while kill -0 "$pid0" 2>/dev/null; do
    secs=$(awk -v a="$t_kill" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }')
    awk -v s="$secs" -v b="$BOUND" 'BEGIN { exit !(s > b + 20) }' && break
    sleep 0.05
  done
  t_end=$(date +%s.%N)
  secs=$(awk -v a="$t_kill" -v b="$t_end" 'BEGIN { printf "%.2f", b - a }')
  if kill -0 "$pid0" 2>/dev/null; then
    pkill -KILL -P "$pid0" 2>/dev/null
    kill -KILL "$pid0"
    wait "$pid0" 2>/dev/null
    echo "$name: FAIL rank 0 still running ${secs} s after the kill (bound ${BOUND} s)"
    FAILED=$((FAILED + 1))
    return
  fi
  wait "$pid0"
  rc=$?
  local named=no
  grep -Eq 'world rank 1 was lost|local_rank: 1' "$log0" && named=yes
  if [[ $rc -ne 0 && $named == yes ]] && awk -v s="$secs" -v b="$BOUND" 'BEGIN { exit !(s < b) }'; then
    echo "$name: PASS rank 0 exited (rc $rc) $secs s after the kill, naming rank 1"
  else
    echo "$name: FAIL rank 0 exited (rc $rc) $secs s after the kill (bound ${BOUND} s), named rank 1: $named"
    FAILED=$((FAILED + 1))
  fi
  kill -KILL ${pid1:-} 2>/dev/null
  echo "  rank 0's last lines:"
  tail -n 6 "$log0" | sed 's/^/  | /'
}

for mode in plain agent; do
  if [[ $mode == agent ]] && ! command -v torchrun > /dev/null; then
    echo "liveness-cuda agent: skipped (no torchrun)"
    continue
  fi
  one_case KILL "$mode"
  one_case TERM "$mode"
done
if [[ $FAILED -eq 0 ]]; then echo "liveness-cuda: PASS"; else echo "liveness-cuda: FAIL ($FAILED case(s))"; fi
[[ $FAILED -eq 0 ]]
