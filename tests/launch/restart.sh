#!/usr/bin/env bash
# zeal launch --max_restarts: 2 ranks of train_gpt (tiny preset, stage 3, a checkpoint every step,
# --resume auto). One run goes through uninterrupted; in the other a rank chosen at random is
# killed with SIGKILL at two random steps. The interrupted run must finish after exactly two
# restarts, with final parameters bit-identical to the uninterrupted run's. A failure that repeats
# at once (a flag the program refuses) must end the launch after one restart, saying why.
#
# usage: restart.sh ZEAL TRAIN_GPT [PORT]
set -uo pipefail
zeal=$1 train_gpt=$2 port=${3:-29561}
work=$(mktemp -d)
launcher=""
cleanup() {
  [ -n "$launcher" ] && kill -KILL "$launcher" 2>/dev/null
  [ -n "${KEEP:-}" ] && echo "kept $work" || rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; for f in "$work"/*.log; do echo "--- $f"; tail -n 15 "$f"; done; exit 1; }

steps=24
run=(--model tiny --steps "$steps" --seq_len 32 --micro_batch 2 --data README.md --save_every 1 --seed 11 --log_every 1)
launch=("$zeal" launch --config_file configs/zero3.yaml --num_processes 2 --no_bind)

"${launch[@]}" --main_process_port "$port" "$train_gpt" "${run[@]}" --save_dir "$work/plain" >"$work/plain.log" 2>&1 ||
  fail "the uninterrupted run failed"

# The kills: after the checkpoints of two random steps exist (the second at least 5 steps later).
k1=$((2 + RANDOM % 6))
k2=$((k1 + 5 + RANDOM % 8))
echo "killing a rank after the checkpoints of steps $k1 and $k2"
"${launch[@]}" --main_process_port "$((port + 1))" --max_restarts 3 "$train_gpt" "${run[@]}" --save_dir "$work/killed" \
  --resume auto >"$work/killed.log" 2>&1 &
launcher=$!
kills=0
for k in $k1 $k2; do
  # The second kill waits for the restarted attempt to be running.
  for ((i = 0; i < 1200 && kills > 0; i++)); do
    [ "$(grep -c "restarting every rank" "$work/killed.log")" -ge $kills ] && [ -n "$(pgrep -P "$launcher")" ] && break
    sleep 0.05
  done
  for ((i = 0; i < 1200; i++)); do [ -e "$work/killed/checkpoint-$k" ] && break; sleep 0.05; done
  [ -e "$work/killed/checkpoint-$k" ] || fail "the run never saved step $k"
  victims=($(pgrep -P "$launcher"))
  [ ${#victims[@]} -gt 0 ] || fail "no rank runs after step $k"
  victim=${victims[$((RANDOM % ${#victims[@]}))]}
  kill -KILL "$victim"
  kills=$((kills + 1))
  echo "killed pid $victim after step $k"
done
wait "$launcher"
status=$?
launcher=""
[ $status = 0 ] || fail "the restarted run ended with status $status"
restarts=$(grep -c "zeal launch: restarting every rank" "$work/killed.log")
[ "$restarts" = 2 ] || fail "expected 2 restarts, the launcher made $restarts"
grep -q "restart 2 of 3) after rank [01] was killed by signal 9" "$work/killed.log" || fail "the restart does not name the killed rank"
grep -q "resumed from" "$work/killed.log" || fail "the program did not resume from its checkpoint"

"$zeal" consolidate "$work/plain/checkpoint-$steps" "$work/plain_out" >/dev/null || fail "consolidating the plain run"
"$zeal" consolidate "$work/killed/checkpoint-$steps" "$work/killed_out" >/dev/null || fail "consolidating the killed run"
cmp "$work/plain_out/model.safetensors" "$work/killed_out/model.safetensors" ||
  fail "the restarted run's parameters differ from the uninterrupted run's"
echo "PASS: killed twice (after steps $k1 and $k2), restarted twice, bit-identical parameters after step $steps"

# A failure that repeats: retried once, then the launcher gives up with the reason.
start=$(date +%s)
"${launch[@]}" --main_process_port "$((port + 2))" --max_restarts 5 "$train_gpt" --model no_such_preset >"$work/bad.log" 2>&1
status=$?
took=$(($(date +%s) - start))
[ $status = 2 ] || fail "a repeating failure: expected the program's status 2, got $status"
grep -q "giving up after 1 restart: the attempt failed as the one before it did" "$work/bad.log" ||
  fail "a repeating failure was not recognised"
[ "$(grep -c "restarting every rank" "$work/bad.log")" = 1 ] || fail "a repeating failure was restarted more than once"
[ "$took" -lt 60 ] || fail "giving up took $took s"
echo "PASS: a repeating failure ends after one restart in $took s"

# With offload to NVMe the killed attempt's swap files stay on disk (nothing ran its cleanup): the
# restarted attempt removes them before it checks the free space, and the finished run leaves none.
mkdir -p "$work/nvme"
"${launch[@]/configs\/zero3.yaml/configs/ds_zero3_nvme.yaml}" --main_process_port "$((port + 3))" --max_restarts 2 \
  --offload_optimizer_nvme_path "$work/nvme" --offload_param_nvme_path "$work/nvme" "$train_gpt" --model tiny --steps 10 \
  --seq_len 32 --micro_batch 2 --data README.md --save_every 1 --save_dir "$work/nvme_ckpt" --resume auto \
  >"$work/nvme.log" 2>&1 &
launcher=$!
for ((i = 0; i < 1200; i++)); do [ -e "$work/nvme_ckpt/checkpoint-3" ] && break; sleep 0.05; done
[ -e "$work/nvme_ckpt/checkpoint-3" ] || fail "the NVMe run never saved step 3"
victim=$(pgrep -P "$launcher" | head -1)
[ -n "$victim" ] || fail "no rank of the NVMe run"
kill -KILL "$victim"
wait "$launcher"
status=$?
launcher=""
[ $status = 0 ] || fail "the restarted NVMe run ended with status $status"
grep -q "removed $work/nvme/zeal-[0-9-]* (.*), the swap files of the attempt before this one" "$work/nvme.log" ||
  fail "the restarted attempt did not remove the killed attempt's swap files"
[ -z "$(ls -A "$work/nvme")" ] || fail "swap files left behind: $(ls -A "$work/nvme")"
echo "PASS: the killed attempt's swap files were removed by the restart; none left at the end"
