#!/usr/bin/env bash
# examples/models/train_gpt launched as the README shows: 2 ranks, configs/zero3.yaml with the
# persistence threshold at 0 (every block gathered and released), the tiny preset on README.md's and docs/'s
# bytes. The JSON log must have one line per step and the loss of the last 5 steps must be at least
# 0.5 below the first 5 steps'. An unknown preset must fail naming --model and the known presets.
set -euo pipefail
zeal=$1 train_gpt=$2
log=$(mktemp) config=$(mktemp --suffix=.yaml)
trap 'rm -f "$log" "$config"' EXIT
sed 's/stage3_param_persistence_threshold: .*/stage3_param_persistence_threshold: 0/' configs/zero3.yaml > "$config"
ckpt=$(mktemp -d) resumed=$(mktemp)
trap 'rm -f "$log" "$config" "$resumed"; rm -rf "$ckpt"' EXIT
out=$(mktemp)
trap 'rm -f "$log" "$config" "$resumed" "$out"; rm -rf "$ckpt"' EXIT
"$zeal" launch --num_processes 2 --main_process_port 29533 "$train_gpt" --config_file "$config" --model tiny --steps 40 --seq_len 32 --micro_batch 8 \
  --data README.md docs/*.md --log_every 10 --log_jsonl "$log" --save_dir "$ckpt" --save_every 10 2>&1 | tee "$out"
# Rank 0 says the dtypes gradients accumulate and are reduced in; in bf16 with
# communication_data_type unset, that DeepSpeed would reduce in bf16; set, it is followed.
grep -q '^\[rank 0\] zeal: gradients accumulate in fp32 and are reduced across ranks in fp32$' "$out" ||
  { echo "FAIL: no line naming the gradients' dtypes in an fp32 run" >&2; exit 1; }
said=$("$zeal" launch --num_processes 2 --main_process_port 29539 --mixed_precision bf16 "$train_gpt" --config_file "$config" \
  --model tiny --steps 1 --seq_len 16 --micro_batch 2 --data README.md 2>&1)
grep -q 'reduced across ranks in fp32 (communication_data_type unset; DeepSpeed would reduce in bf16' <<<"$said" ||
  { echo "FAIL: a bf16 run does not say its gradients are reduced in fp32: $said" >&2; exit 1; }
wire=$(mktemp --suffix=.yaml)
{ cat "$config"; echo "communication_data_type: bf16"; echo "steps_per_print: 2"; echo "wall_clock_breakdown: true"; } > "$wire"
breakdown_log=$(mktemp --suffix=.jsonl)
said=$("$zeal" launch --num_processes 2 --main_process_port 29539 --mixed_precision bf16 \
  "$train_gpt" --config_file "$wire" --model tiny --steps 4 --seq_len 16 --micro_batch 2 --data README.md \
  --log_jsonl "$breakdown_log" 2>&1)
rm -f "$wire"
grep -q 'zeal: gradients accumulate in fp32 and are reduced across ranks in bf16$' <<<"$said" ||
  { echo "FAIL: communication_data_type bf16 is not the dtype said: $said" >&2; exit 1; }
# wall_clock_breakdown with steps_per_print 2: after steps 2 and 4, rank 0's mean times of 2 steps.
[ "$(grep -c '^\[rank 0\] zeal: time (ms) per step, mean of 2 | forward: [0-9.]* | backward: [0-9.]*[1-9][0-9.]* | step: [0-9.]* | waiting for reductions: [0-9.]* | gathers: [0-9.]* | reads: [0-9.]* | writes: [0-9.]*$' <<<"$said")" -eq 2 ] ||
  { echo "FAIL: not two wall-clock lines after steps 2 and 4: $said" >&2; exit 1; }
# The waits happen inside the forward, backward and step: never more than their sum (0.02 ms of rounding).
grep 'zeal: time (ms) per step' <<<"$said" | awk -F'|' '{
  split($2, f, ": "); split($3, b, ": "); split($4, s, ": ");
  split($5, r, ": "); split($6, g, ": "); split($7, rd, ": "); split($8, w, ": ");
  if (r[2] + g[2] + rd[2] + w[2] > f[2] + b[2] + s[2] + 0.02) { print "waits exceed the step: " $0; bad = 1 }
} END { exit bad }' || { echo "FAIL: the waits are more than the time they are part of" >&2; exit 1; }
# The JSON log carries the same means, on the steps whose window they close (steps 1 and 3, counted
# from 0), as the printed lines give them.
SAID=$said python3 - "$breakdown_log" <<'PY' || { echo "FAIL: the JSON log's time_ms differs from the printed breakdown" >&2; exit 1; }
import json, os, re, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
printed = [re.findall(r"[0-9.]+", l.split("mean of", 1)[1]) for l in os.environ["SAID"].splitlines()
           if "time (ms) per step" in l]
logged = [(l["step"], l["time_ms"]) for l in lines if "time_ms" in l]
assert [s for s, _ in logged] == [1, 3] and len(printed) == 2, (logged, printed)
for (step, t), p in zip(logged, printed):
    got = [t["steps"], t["forward"], t["backward"], t["step"], t["wait_reductions"], t["wait_gathers"], t["wait_reads"], t["wait_writes"]]
    assert all(abs(float(a) - b) <= 0.006 for a, b in zip(p, got)), (step, p, got)
PY
rm -f "$breakdown_log"
# An FSDP file's fsdp_transformer_layer_cls_to_wrap (unit_names) names the model's block type, which
# the model holds as zeal::Sharded already: accepted, trained, nothing said to be unapplied.
said=$("$zeal" launch --num_processes 2 --main_process_port 29539 "$train_gpt" --config_file configs/fsdp_full_shard.yaml \
  --model tiny --steps 1 --seq_len 16 --micro_batch 2 --data README.md 2>&1)
grep -q '^\[rank 0\] step 1/1: ' <<<"$said" && ! grep -qi 'unit_names.*not applied\|names no module' <<<"$said" ||
  { echo "FAIL: an FSDP file naming the model's block type did not train cleanly: $said" >&2; exit 1; }
# steps_per_print (DeepSpeed's default 10): rank 0's progress line at steps 10, 20, 30 and 40 only.
[ "$(grep -c '^\[rank 0\] zeal: step=[0-9]*, skipped=0, lr=\[[0-9.e, -]*\], grad_norm=[0-9.e+-]*$' "$out")" -eq 4 ] &&
  grep -q '^\[rank 0\] zeal: step=40, ' "$out" && ! grep -q '^\[rank 1\] zeal: step=' "$out" ||
  { echo "FAIL: not four progress lines from rank 0 at steps 10-40:" >&2; grep 'zeal: step=' "$out" >&2; exit 1; }
# The memory report: PEFT's four CPU lines for the train phase, whole MB, total = before + peak.
mb() { sed -n "s/^\[rank 0\] CPU $1 the train $2: \([0-9-]*\)$/\1/p" "$out"; }
before=$(mb "Memory before entering" "") consumed=$(mb "Memory consumed at the end of" "(end-begin)")
peak=$(mb "Peak Memory consumed during" "(max-begin)") total=$(mb "Total Peak Memory consumed during" "(max)")
[ -n "$before" ] && [ -n "$consumed" ] && [ -n "$peak" ] && [ -n "$total" ] && [ "$total" -eq $((before + peak)) ] && [ "$before" -gt 0 ] ||
  { echo "FAIL: the memory report's lines are missing or inconsistent (before '$before', consumed '$consumed', peak '$peak', total '$total')" >&2; exit 1; }
# The JSON log's resident set: the peak never falls and is never below the current.
awk '{ split($0, a, /"rss_bytes": /); split(a[2], r, /[,}]/); split($0, b, /"peak_rss_bytes": /); split(b[2], p, /[,}]/);
  if (r[1] <= 0 || p[1] < r[1] || p[1] < last) { print "FAIL: line " NR ": rss " r[1] ", peak " p[1] ", previous peak " last > "/dev/stderr"; exit 1 } last = p[1] }' "$log"
lines=$(wc -l < "$log")
[ "$lines" -eq 40 ] || { echo "FAIL: $lines JSON lines for 40 steps" >&2; exit 1; }
first=$(head -n 5 "$log" | sed 's/.*"loss": \([0-9.]*\).*/\1/' | awk '{s+=$1} END {print s/NR}')
last=$(tail -n 5 "$log" | sed 's/.*"loss": \([0-9.]*\).*/\1/' | awk '{s+=$1} END {print s/NR}')
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b <= a - 0.5) }' ||
  { echo "FAIL: loss went from $first to $last" >&2; exit 1; }
grep -q '"gathered_peak_bytes": [1-9]' "$log" || { echo "FAIL: no gathered bytes logged" >&2; exit 1; }
# Checkpoints: the run saved after steps 10, 20, 30, 40 (latest: checkpoint-40). Resumed from checkpoint-10 on
# Each save says its peak resident set (MiB or GiB): at least what the process held before training,
# at most the training's total peak (the saves are part of it; its MB line is truncated twice, as
# PEFT's is: before + peak, each rounded down, up to 2 MiB under the resident set).
saves=$(sed -n "s|^\[rank 0\] zeal: saved $ckpt/checkpoint-[0-9]*; the save's peak resident set \([0-9.]*\) \([MG]\)iB (rank 0)\$|\1 \2|p" "$out")
[ "$(wc -l <<<"$saves")" -eq 4 ] &&
  awk -v b="$before" -v t="$total" '{ m = $2 == "G" ? $1 * 1024 : $1; if (m < b || m > t + 3) bad = 1 } END { exit bad }' <<<"$saves" ||
  { echo "FAIL: not four saves each with its peak resident set within ${before}..${total} MiB:" >&2; grep 'zeal: saved' "$out" >&2; exit 1; }
# the same 2 ranks, steps 11-20 give the same losses to the last digit; on 1 rank (twice the micro
# batch: the same samples per step) within 1e-3.
[ "$(cat "$ckpt/latest")" = checkpoint-40 ] || { echo "FAIL: latest is '$(cat "$ckpt/latest")', not checkpoint-40" >&2; exit 1; }
losses() { sed 's/.*"loss": \([0-9.]*\).*/\1/' "$1"; }
"$zeal" launch --num_processes 2 --main_process_port 29536 "$train_gpt" --config_file "$config" --model tiny --steps 20 --seq_len 32 --micro_batch 8 \
  --data README.md docs/*.md --log_every 10 --log_jsonl "$resumed" --resume "$ckpt/checkpoint-10"
[ "$(losses "$resumed")" = "$(losses "$log" | sed -n 11,20p)" ] ||
  { echo "FAIL: resumed at step 10, the losses differ:" >&2; paste <(losses "$log" | sed -n 11,20p) <(losses "$resumed") >&2; exit 1; }
"$zeal" launch --num_processes 1 --main_process_port 29537 "$train_gpt" --config_file "$config" --model tiny --steps 20 --seq_len 32 --micro_batch 16 \
  --data README.md docs/*.md --log_every 10 --log_jsonl "$resumed" --resume "$ckpt/checkpoint-10"
paste <(losses "$log" | sed -n 11,20p) <(losses "$resumed") | awk '{ d = $1 - $2; if (d < 0) d = -d; if (d > 1e-3) bad = 1 } END { exit bad }' ||
  { echo "FAIL: resumed on 1 rank, the losses differ:" >&2; paste <(losses "$log" | sed -n 11,20p) <(losses "$resumed") >&2; exit 1; }
echo "PASS: resumed from step 10 on 2 ranks (same losses) and on 1 rank (within 1e-3)"
# The reference config of ZeRO-3 with the optimizer and parameters offloaded to the CPU, unchanged.
: > "$log"
"$zeal" launch --num_processes 2 --main_process_port 29534 "$train_gpt" --config_file configs/ds_zero3_cpu.yaml --model tiny --steps 40 --seq_len 32 --micro_batch 8 \
  --data README.md docs/*.md --log_every 10 --log_jsonl "$log"
first_off=$(head -n 5 "$log" | sed 's/.*"loss": \([0-9.]*\).*/\1/' | awk '{s+=$1} END {print s/NR}')
last_off=$(tail -n 5 "$log" | sed 's/.*"loss": \([0-9.]*\).*/\1/' | awk '{s+=$1} END {print s/NR}')
awk -v a="$first_off" -v b="$last_off" 'BEGIN { exit !(b <= a - 0.5) }' ||
  { echo "FAIL: with ds_zero3_cpu.yaml the loss went from $first_off to $last_off" >&2; exit 1; }
grep -q '"offload_host_bytes": [1-9]' "$log" || { echo "FAIL: ds_zero3_cpu.yaml offloaded nothing" >&2; exit 1; }
echo "PASS: ds_zero3_cpu.yaml, loss $first_off -> $last_off"
# ZeRO-Infinity's reference config (optimizer state and parameters on NVMe), unchanged but for its
# nvme_path, given on the command line as with accelerate launch; then the same with every block
# sharded (the tiny model's blocks are under the "auto" persistence threshold) and max_in_cpu 0
# (its 1e9 elements would keep them all in host memory), so parameters really go to disk: more
# bytes on disk, the loss falls the same way, nothing left behind.
swap=$(mktemp -d -p "$(dirname "$train_gpt")" zeal-test-swap.XXXXXX)
cfgdir=$(mktemp -d)
trap 'rm -f "$log" "$config" "$resumed"; rm -rf "$swap" "$cfgdir" "$ckpt"' EXIT
nvme_run() {  # config file, log
  : > "$2"
  "$zeal" launch --num_processes 2 --main_process_port 29535 --offload_param_nvme_path "$swap" \
    --offload_optimizer_nvme_path "$swap" "$train_gpt" --config_file "$1" --model tiny --steps 40 --seq_len 32 \
    --micro_batch 8 --data README.md docs/*.md --log_every 10 --log_jsonl "$2"
  local a b
  a=$(head -n 5 "$2" | sed 's/.*"loss": \([0-9.]*\).*/\1/' | awk '{s+=$1} END {print s/NR}')
  b=$(tail -n 5 "$2" | sed 's/.*"loss": \([0-9.]*\).*/\1/' | awk '{s+=$1} END {print s/NR}')
  awk -v a="$a" -v b="$b" 'BEGIN { exit !(b <= a - 0.5) }' || { echo "FAIL: with $1 the loss went from $a to $b" >&2; exit 1; }
  [ -z "$(ls -A "$swap")" ] || { echo "FAIL: $1 left files in $swap: $(ls -A "$swap")" >&2; exit 1; }
  echo "PASS: $1, loss $a -> $b"
}
disk() { tail -n 1 "$1" | sed 's/.*"offload_disk_bytes": \([0-9]*\).*/\1/'; }
nvme_run configs/ds_zero3_nvme.yaml "$log"
disk_shipped=$(disk "$log")
[ "$disk_shipped" -gt 0 ] || { echo "FAIL: ds_zero3_nvme.yaml put nothing on disk" >&2; exit 1; }
cp configs/ds_zero3_nvme.yaml "$cfgdir/"
sed -e 's/"stage3_param_persistence_threshold": "auto"/"stage3_param_persistence_threshold": 0/' \
  -e 's/"max_in_cpu": 1e9/"max_in_cpu": 0/' configs/ds_zero3_nvme.json > "$cfgdir/ds_zero3_nvme.json"
grep -q '"stage3_param_persistence_threshold": 0' "$cfgdir/ds_zero3_nvme.json" && grep -q '"max_in_cpu": 0' "$cfgdir/ds_zero3_nvme.json" ||
  { echo "FAIL: could not edit the threshold and max_in_cpu" >&2; exit 1; }
nvme_run "$cfgdir/ds_zero3_nvme.yaml" "$log"
disk_blocks=$(disk "$log")
[ "$disk_blocks" -gt "$disk_shipped" ] || { echo "FAIL: no parameters on disk ($disk_blocks vs $disk_shipped bytes)" >&2; exit 1; }
echo "PASS: on disk $disk_shipped bytes (optimizer state), $disk_blocks with the blocks' parameters"
# --eval_every: the held-out loss at steps 5 and 10 in the log, and the eval phase's report.
"$zeal" launch --num_processes 2 --main_process_port 29537 "$train_gpt" --config_file "$config" --model tiny --steps 10 --seq_len 32 --micro_batch 8 \
  --data README.md docs/*.md --eval_every 5 --log_jsonl "$resumed" > "$out"
[ "$(grep -c '"eval_loss": [0-9]' "$resumed")" -eq 2 ] && sed -n 5p "$resumed" | grep -q '"eval_loss"' ||
  { echo "FAIL: --eval_every 5 over 10 steps did not log two held-out losses at steps 5 and 10" >&2; cat "$resumed" >&2; exit 1; }
grep -q '^\[rank 0\] CPU Total Peak Memory consumed during the eval (max): [0-9]' "$out" ||
  { echo "FAIL: no memory report for the eval phase" >&2; cat "$out" >&2; exit 1; }
if out=$("$train_gpt" --model gpt5 2>&1); then
  echo "FAIL: an unknown preset was accepted" >&2; exit 1
fi
printf '%s\n' "$out" | grep -q -- "--model: unknown model preset 'gpt5' (known: tiny, gpt2-small, gpt2-medium, gpt2-large, gpt2-1.3b, gpt2-2.7b, gpt2-6.7b)" ||
  { echo "FAIL: unexpected error: $out" >&2; exit 1; }
if out=$("$train_gpt" --stage3_max_live 5 2>&1); then
  echo "FAIL: an unknown flag was accepted" >&2; exit 1
fi
printf '%s\n' "$out" | grep -q -- "unknown flag --stage3_max_live" || { echo "FAIL: unexpected error: $out" >&2; exit 1; }
# fp16 with a loss scale of 2^30: the first steps overflow and are skipped. Resumed after step 3, the
# progress lines go on counting the steps taken and skipped as the uninterrupted run did.
fp16=$(mktemp -d)
printf 'steps_per_print: 1\nfp16:\n  initial_scale_power: 30\n' > "$fp16/c.yaml"
"$train_gpt" --config_file "$fp16/c.yaml" --mixed_precision fp16 --model tiny --steps 6 --seq_len 16 --micro_batch 2 \
  --data README.md --save_dir "$fp16/ck" --save_every 3 > "$fp16/whole" 2>&1
"$train_gpt" --config_file "$fp16/c.yaml" --mixed_precision fp16 --model tiny --steps 6 --seq_len 16 --micro_batch 2 \
  --data README.md --resume "$fp16/ck/checkpoint-3" > "$fp16/resumed" 2>&1
whole=$(grep -o 'step=[0-9]*, skipped=[0-9]*' "$fp16/whole" | tail -n 3)
resumed=$(grep -o 'step=[0-9]*, skipped=[0-9]*' "$fp16/resumed")
rm -rf "$fp16"
grep -q "skipped=[1-9]" <<<"$whole" || { echo "FAIL: no step was skipped to count: $whole" >&2; exit 1; }
[ "$whole" = "$resumed" ] || { echo "FAIL: resumed, the step counts differ: '$whole' vs '$resumed'" >&2; exit 1; }
echo "PASS: loss $first -> $last"
