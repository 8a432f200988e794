#!/usr/bin/env bash
# Peer failures: 2 ranks of train_gpt (tiny preset) run until both have logged a step; then one
# rank is stopped (SIGSTOP) or killed (SIGKILL) — rank 0, which hosts the rendezvous store, or
# rank 1 — under `zeal launch` or started by hand with torchrun's variables. Every surviving rank
# must exit non-zero within comm_timeout + 10 s naming the culprit, and the launcher within that
# plus its grace. Without ZEAL_PEER_MATRIX=full the ZeRO stage cycles through 0-3 over the eight
# pairings; with it every pairing runs at every stage (32 runs).
#
# usage: peer_failures.sh ZEAL TRAIN_GPT [BASE_PORT]
set -uo pipefail
zeal=$1 train_gpt=$2 port=${3:-29581}
timeout=4 grace=2
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null; done
  rm -rf "$work"
}
trap cleanup EXIT
failures=0 table=""

wait_at_most() {  # wait_at_most PID SECONDS: its exit status, or 255 if it still runs after SECONDS
  local i
  for ((i = 0; i < $2 * 10; i++)); do
    kill -0 "$1" 2>/dev/null || { wait "$1"; return $?; }
    sleep 0.1
  done
  return 255
}

rank_pid() {  # rank_pid LAUNCHER_PID RANK: the pid of the launcher's child with RANK=<rank>
  local c
  for c in $(pgrep -P "$1"); do
    if tr '\0' '\n' < "/proc/$c/environ" 2>/dev/null | grep -qx "RANK=$2"; then echo "$c"; return; fi
  done
}

logged_a_step() {  # logged_a_step FILE...: every file shows a step line
  local f
  for f in "$@"; do grep -q "step [0-9]*/[0-9]*: " "$f" 2>/dev/null || return 1; done
}

run_case() {  # run_case MODE VICTIM SIGNAL STAGE
  local mode=$1 victim=$2 sig=$3 stage=$4 survivor=$((1 - $2))
  port=$((port + 1))
  local args=("$train_gpt" --model tiny --steps 100000 --seq_len 16 --micro_batch 2 --log_every 1
              --zero_stage "$stage" --comm_timeout "$timeout")
  local out="$work/$mode-$victim-$sig-$stage" start end code culprit verdict victim_pid
  pids=()
  if [[ $mode == launch ]]; then
    "$zeal" launch --num_processes 2 --main_process_port "$port" --stop_grace "$grace" --no_bind "${args[@]}" \
      > "$out.out" 2> "$out.err" &
    local launcher=$!
    pids+=("$launcher")
    for _ in $(seq 600); do logged_a_step "$out.out" && break; sleep 0.1; done
    sleep 1  # rank 1 prints nothing; give it a step too
    victim_pid=$(rank_pid "$launcher" "$victim")
    start=$(date +%s.%N)
    kill -"$sig" "$victim_pid"
    wait_at_most "$launcher" 60; code=$?
    end=$(date +%s.%N)
    local limit=$((timeout + 10 + grace))
    # The launcher names the culprit, or passes on the survivor's report that names it.
    if grep -q "rank $victim" "$out.err" "$out.out"; then culprit=yes; else culprit=no; fi
  else
    local r
    for r in 0 1; do
      RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
        "${args[@]}" > "$out.$r.out" 2> "$out.$r.err" &
      pids+=($!)
    done
    for _ in $(seq 600); do logged_a_step "$out.0.out" && break; sleep 0.1; done
    sleep 1  # rank 1 prints nothing; give it a step too
    victim_pid=${pids[$victim]}
    start=$(date +%s.%N)
    kill -"$sig" "$victim_pid"
    wait_at_most "${pids[$survivor]}" 60; code=$?
    end=$(date +%s.%N)
    local limit=$((timeout + 10))
    if grep -q "rank $victim" "$out.$survivor.err"; then culprit=yes; else culprit=no; fi
    out="$out.$survivor"
  fi
  local took
  took=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')
  verdict=ok
  if [[ $code == 0 ]]; then verdict="FAILED: exit 0"; fi
  if [[ $code == 255 ]]; then verdict="FAILED: still running after 60 s"; fi
  if awk -v t="$took" -v l="$limit" 'BEGIN { exit !(t > l) }'; then verdict="FAILED: took ${took} s > ${limit} s"; fi
  if [[ $culprit != yes ]]; then verdict="FAILED: rank $victim not named"; fi
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null; done
  wait 2>/dev/null
  table+=$(printf '\n| %-6s | rank %d | SIG%-4s | %d | %3d | %5s s | %s |' "$mode" "$victim" "$sig" "$stage" "$code" "$took" "$verdict")
  if [[ $verdict != ok ]]; then
    failures=$((failures + 1))
    echo "---- $mode victim $victim SIG$sig stage $stage: $verdict; what the survivor/launcher printed:"
    tail -n 25 "$out.err" 2>/dev/null
  fi
}

i=0
for mode in launch env; do
  for victim in 0 1; do
    for sig in STOP KILL; do
      if [[ ${ZEAL_PEER_MATRIX:-} == full ]]; then
        for stage in 0 1 2 3; do run_case "$mode" "$victim" "$sig" "$stage"; done
      else
        run_case "$mode" "$victim" "$sig" $((i % 4))
      fi
      i=$((i + 1))
    done
  done
done
echo "| mode | stopped | signal | stage | exit | time | verdict |"
echo "|---|---|---|---|---|---|---|${table}"
echo "comm_timeout ${timeout} s, launcher grace ${grace} s"
exit $((failures > 0))
