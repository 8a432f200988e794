#!/usr/bin/env bash
# build/bin/finetune_lora as the README runs it, made small: 2 ranks, configs/ds_zero3_cpu.yaml
# unchanged; it must train (evaluating every epoch, loading the best checkpoint), save the adapter (Python-loadable names checked by the PEFT cross-check),
# reload it, merge it, save the merged model, and end with "accuracy: <fraction>" above chance.
# Skipped (77) without all-MiniLM-L6-v2 (scripts/setup installs it) or without apt-cache.
set -euo pipefail
zeal=$1 finetune=$2
home=${HOME:-$(getent passwd "$(id -u)" | cut -d: -f6)}
model=${ZEAL_MINILM:-${ZEAL_MODELS:-$home/.cache/zeal/models}/all-MiniLM-L6-v2}
. tests/peers_skip.sh
[ -f "$model/model.safetensors" ] || skip_or_fail "no all-MiniLM-L6-v2 in $model (scripts/setup installs it)"
command -v apt-cache >/dev/null || { echo "SKIP: no apt-cache to list package descriptions"; exit 77; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
apt-cache dumpavail > "$work/packages.txt"
out=$("$zeal" launch --num_processes 2 --main_process_port 29543 "$finetune" --config_file configs/ds_zero3_cpu.yaml --model_dir "$model" \
      --data "$work/packages.txt" --out "$work/out" --sections games,science,net --train_per_section 40 \
      --eval_per_section 20 --epochs 2 --seq_len 32 --batch_size 8 --lr 5e-3 2>&1)
echo "$out"
for f in adapter/adapter_model.safetensors adapter/adapter_config.json merged/model.safetensors; do
  [ -s "$work/out/$f" ] || { echo "FAIL: $f was not written" >&2; exit 1; }
done
grep -q "trainable params: .* || all params: .* || trainable%: " <<<"$out" || { echo "FAIL: no PEFT line" >&2; exit 1; }
# PEFT's memory lines: the four CPU lines for each of the 2 training epochs and for every evaluation.
for phase in train eval; do
  n=$(grep -c "^\[rank 0\] CPU Total Peak Memory consumed during the $phase (max): [0-9]*$" <<<"$out" || true)
  [ "$n" -ge 2 ] || { echo "FAIL: $n memory reports for the $phase phase" >&2; exit 1; }
done
# The Trainer: an evaluation every epoch, the best checkpoint loaded at the end.
[ "$(grep -c "'epoch': [12], 'eval_accuracy'" <<<"$out")" -ge 2 ] || { echo "FAIL: not one evaluation per epoch" >&2; exit 1; }
grep -q "loading the best model from $work/out/checkpoints/checkpoint-" <<<"$out" || { echo "FAIL: no best model loaded" >&2; exit 1; }
acc=$(printf '%s\n' "$out" | tail -n 1 | sed -n 's/^\[rank 0\] accuracy: \([0-9.]*\)$/\1/p')
[ -n "$acc" ] || { echo "FAIL: the last line is not 'accuracy: <fraction>'" >&2; exit 1; }
awk -v a="$acc" 'BEGIN { exit !(a > 0.5) }' || { echo "FAIL: accuracy $acc is not above 0.5 (chance: 0.33)" >&2; exit 1; }
echo "PASS: accuracy $acc"
