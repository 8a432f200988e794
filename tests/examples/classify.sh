#!/usr/bin/env bash
# examples/classify launched as the README shows, on 2 ranks with configs/zero2.yaml: it must end
# with "accuracy: <fraction>" clearly above chance (0.5) on the held-out reviews, after the
# Trainer's evaluation every epoch (PEFT's memory lines for each), the best checkpoint loaded at
# the end and no more than save_total_limit (2) checkpoints kept.
set -euo pipefail
zeal=$1 classify=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
out=$("$zeal" launch --num_processes 2 "$classify" --config_file configs/zero2.yaml --output_dir "$dir" 2>&1)
echo "$out"
last=$(printf '%s\n' "$out" | tail -n 1)
acc=$(printf '%s\n' "$last" | sed -n 's/^\[rank 0\] accuracy: \([0-9.]*\)$/\1/p')
if [ -z "$acc" ]; then
  echo "FAIL: the last line is not 'accuracy: <fraction>': $last" >&2
  exit 1
fi
awk -v a="$acc" 'BEGIN { exit !(a >= 0.8) }' || { echo "FAIL: accuracy $acc is below 0.8" >&2; exit 1; }
evals=$(grep -c "'eval_accuracy'" <<<"$out" || true)
[ "$evals" -ge 3 ] || { echo "FAIL: $evals evaluations, want one per epoch (3) and the last" >&2; exit 1; }
mem=$(grep -c "CPU Memory before entering the train" <<<"$out" || true)
[ "$mem" -eq 3 ] || { echo "FAIL: $mem epochs' memory reports, want 3" >&2; exit 1; }
grep -q "loading the best model from $dir/checkpoint-" <<<"$out" || { echo "FAIL: no best model loaded" >&2; exit 1; }
kept=$(find "$dir" -maxdepth 1 -name 'checkpoint-*' | wc -l)
[ "$kept" -ge 1 ] && [ "$kept" -le 2 ] || { echo "FAIL: $kept checkpoints kept, save_total_limit is 2" >&2; exit 1; }
echo "PASS: accuracy $acc, $evals evaluations, $kept checkpoints kept"
