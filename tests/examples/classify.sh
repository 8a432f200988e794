#!/usr/bin/env bash
# examples/classify launched as the README shows, on 2 ranks with configs/zero2.yaml: it must end
# with "accuracy: <fraction>" clearly above chance (0.5) on the held-out reviews.
set -euo pipefail
zeal=$1 classify=$2
out=$("$zeal" launch --num_processes 2 "$classify" --config_file configs/zero2.yaml 2>&1)
echo "$out"
last=$(printf '%s\n' "$out" | tail -n 1)
acc=$(printf '%s\n' "$last" | sed -n 's/^\[rank 0\] accuracy: \([0-9.]*\)$/\1/p')
if [ -z "$acc" ]; then
  echo "FAIL: the last line is not 'accuracy: <fraction>': $last" >&2
  exit 1
fi
awk -v a="$acc" 'BEGIN { exit !(a >= 0.8) }' || { echo "FAIL: accuracy $acc is below 0.8" >&2; exit 1; }
echo "PASS: accuracy $acc"
