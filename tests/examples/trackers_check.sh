#!/usr/bin/env bash
# The trackers of a real run: train_gpt on 2 ranks with log_with jsonl and DeepSpeed's tensorboard
# and csv_monitor sections; Python's tensorboard, csv and json read what they wrote
# (tests/examples/trackers_check.py). Skipped (77) without the peers' Python (scripts/peers).
set -uo pipefail
zeal=$1 train_gpt=$2
home=${HOME:-$(getent passwd "$(id -u)" | cut -d: -f6)}
python=${ZEAL_PEERS_PYTHON:-$home/.cache/zeal/peers/bin/python}
. tests/peers_skip.sh
[ -x "$python" ] && "$python" -c "import tensorboard" 2>/dev/null ||
  skip_or_fail "no peers Python with tensorboard at $python (scripts/peers installs it)"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
steps=8
cat >"$work/ds.json" <<JSON
{
  "zero_optimization": {"stage": 3},
  "log_with": ["jsonl"],
  "logging_dir": "$work/runs",
  "tensorboard": {"enabled": true, "output_path": "$work/ds", "job_name": "job"},
  "csv_monitor": {"enabled": true, "output_path": "$work/ds", "job_name": "job"}
}
JSON
"$zeal" launch --num_processes 2 --config_file "$work/ds.json" --main_process_port 29567 "$train_gpt" --model tiny \
  --steps $steps --seq_len 32 --micro_batch 2 --data README.md --lr 1e-3 --eval_every 4 --log_every 1 --log_jsonl "$work/train.jsonl" \
  >"$work/run.log" 2>&1 || { tail -20 "$work/run.log"; echo "FAIL: the run failed"; exit 1; }
grep -q "zeal: trackers: tensorboard in $work/ds/job, csv in $work/ds/job, jsonl in $work/runs/train_gpt" "$work/run.log" ||
  { grep trackers "$work/run.log"; echo "FAIL: the trackers were not announced"; exit 1; }
"$python" tests/examples/trackers_check.py "$work" $steps
