#!/usr/bin/env bash
# "It will not fit", said before training and after: train_gpt (gpt2-small, stage 0, fp32: about
# 2.1 GiB of model states per rank) under a memory cgroup limited to 1.5 GiB.
# - memory_check: error → every rank refuses at prepare, naming the prediction and the limit, fast.
# - the default (warn) → rank 0 warns with both numbers and the settings that would help, trains,
#   and is killed by the kernel's OOM killer; the launcher says so, with what the rank held.
# - a micro-batch whose activations alone exceed the limit (tiny, 2 ranks, stage 3) → both ranks
#   refuse, whatever memory_check says, and the micro-batch they name trains.
# Needs root and a writable memory cgroup (v1 or v2); exits 77 (skipped) otherwise.
#
# usage: oom.sh ZEAL TRAIN_GPT
set -uo pipefail
zeal=$1 train_gpt=$2
if [ "$(id -u)" != 0 ]; then echo "skipped: needs root to make a memory cgroup"; exit 77; fi
limit=$((1536 * 1024 * 1024))
cg=""
if [ -d /sys/fs/cgroup/memory ] && mkdir "/sys/fs/cgroup/memory/zeal_oom_$$" 2>/dev/null; then
  cg=/sys/fs/cgroup/memory/zeal_oom_$$
  echo "$limit" >"$cg/memory.limit_in_bytes" || { rmdir "$cg"; echo "skipped: cannot limit the cgroup"; exit 77; }
  if ! { [ -e "$cg/memory.memsw.limit_in_bytes" ] && echo "$limit" >"$cg/memory.memsw.limit_in_bytes" 2>/dev/null; } &&
     [ "$(awk '/^SwapTotal:/ {print $2}' /proc/meminfo)" != 0 ]; then
    rmdir "$cg"; echo "skipped: the machine has swap and the cgroup cannot limit it"; exit 77
  fi
elif [ -e /sys/fs/cgroup/cgroup.controllers ] && mkdir "/sys/fs/cgroup/zeal_oom_$$" 2>/dev/null; then
  cg=/sys/fs/cgroup/zeal_oom_$$
  echo "$limit" >"$cg/memory.max" || { rmdir "$cg"; echo "skipped: no memory controller in this cgroup"; exit 77; }
  if ! { [ -e "$cg/memory.swap.max" ] && echo 0 >"$cg/memory.swap.max"; } &&
     [ "$(awk '/^SwapTotal:/ {print $2}' /proc/meminfo)" != 0 ]; then
    rmdir "$cg"; echo "skipped: the machine has swap and the cgroup cannot limit it"; exit 77
  fi
else
  echo "skipped: cannot create a memory cgroup here"
  exit 77
fi
work=$(mktemp -d)
cleanup() {
  for p in $(cat "$cg/cgroup.procs" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
  sleep 0.2
  rmdir "$cg" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; for f in "$work"/*.log; do echo "--- $f"; tail -n 12 "$f"; done; exit 1; }

in_cgroup() {  # in_cgroup CMD...: runs CMD inside the limited cgroup
  (echo $BASHPID >"$cg/cgroup.procs" && exec "$@")
}
run=("$train_gpt" --model gpt2-small --steps 3 --seq_len 64 --micro_batch 1)

start=$(date +%s)
in_cgroup "$zeal" launch --num_processes 1 --config_file configs/single_process.yaml --main_process_port 29568 \
  --memory_check error "${run[@]}" \
  >"$work/strict.log" 2>&1
status=$?
took=$(($(date +%s) - start))
[ $status = 1 ] || fail "memory_check error: expected exit status 1, got $status"
grep -q "memory_check: error: every rank will not fit: rank 0 is predicted to hold [0-9.]* GiB" "$work/strict.log" ||
  fail "memory_check error: the refusal does not name the prediction"
grep -q "the memory cgroup's limit of 1.50 GiB" "$work/strict.log" || fail "memory_check error: the limit is not named"
grep -q "out-of-memory killer" "$work/strict.log" && fail "memory_check error: the rank was killed instead of refusing"
[ "$took" -lt 60 ] || fail "memory_check error took $took s"
echo "PASS: memory_check error refuses in $took s"

in_cgroup "$zeal" launch --num_processes 1 --config_file configs/single_process.yaml --main_process_port 29569 \
  "${run[@]}" >"$work/warn.log" 2>&1
status=$?
[ $status = 137 ] || fail "under the limit: expected the OOM killer's 137, got $status"
grep -q "zeal: warning: every rank may run out of memory: rank 0 is predicted to hold" "$work/warn.log" ||
  fail "no warning at prepare"
grep -q "What would lower the peak: .*offload_optimizer.device nvme ([0-9.]* [MG]iB)" "$work/warn.log" ||
  fail "the warning does not name a remedy with its prediction"
grep -q "failed: rank 0 was killed by the kernel's out-of-memory killer (SIGKILL; .*); it held .* at the last sample, [0-9.]* GiB at most" \
  "$work/warn.log" || fail "the launcher does not report the OOM killer"
echo "PASS: warned at prepare, and the OOM kill reported as such"

# A micro-batch whose activations alone exceed the limit: refused when the model is prepared, even
# with memory_check at its default, on both ranks (they share the limit), naming the largest
# micro-batch predicted to fit with 10 % to spare; that micro-batch trains under the same limit.
tiny=("$train_gpt" --model tiny --steps 1 --seq_len 128)
start=$(date +%s)
in_cgroup "$zeal" launch --num_processes 2 --config_file configs/zero3.yaml --main_process_port 29570 \
  "${tiny[@]}" --micro_batch 65536 >"$work/batch.log" 2>&1
status=$?
took=$(($(date +%s) - start))
[ $status = 1 ] || fail "a batch over the limit: expected exit status 1, got $status"
grep -q "memory_check: the batch will not fit: rank 0: 65536 x 128 tokens per micro-step (tiny) are predicted to add [0-9.]* GiB" \
  "$work/batch.log" || fail "the batch's refusal does not name it and its activations"
grep -q "the memory cgroup's limit of 1.50 GiB, shared by 2 ranks" "$work/batch.log" || fail "the batch's refusal does not name the limit"
grep -q "^\[rank 1\] train_gpt: memory_check: the batch will not fit" "$work/batch.log" ||
  fail "rank 1 did not refuse the batch with rank 0 (the verdict is shared)"
fits=$(grep -o "The largest micro-batch predicted to fit with 10 % to spare is [0-9]*" "$work/batch.log" | head -n 1 | grep -o "[0-9]*$")
[ -n "$fits" ] && [ "$fits" -gt 1 ] || fail "no micro-batch predicted to fit"
[ "$took" -lt 60 ] || fail "the batch's refusal took $took s"
echo "PASS: a batch over the limit refused in $took s; $fits predicted to fit"

in_cgroup "$zeal" launch --num_processes 2 --config_file configs/zero3.yaml --main_process_port 29571 \
  "${tiny[@]}" --micro_batch "$fits" >"$work/fits.log" 2>&1 || fail "micro-batch $fits (the largest predicted to fit) did not train"
echo "PASS: micro-batch $fits trains on 2 ranks under the limit"
