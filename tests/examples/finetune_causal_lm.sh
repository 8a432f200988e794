#!/usr/bin/env bash
# The causal-LM job end to end, as README.md's job section runs it (scripts/causal-lm-demo): a small
# LLaMA and its tokenizer made offline (tests/examples/causal_lm_peer.py), pretrained briefly with zeal
# (full fine-tuning on "copy: a b c" -> "a b c", merged export), then LoRA instruction-tuned on
# "reverse" under configs/ds_zero3_cpu.yaml on 2 ranks. The held-out exact match must rise by at least 0.5; every epoch
# evaluates, prints PEFT's memory lines and a generation; the adapter loads in Python peft and the merged
# model with transformers' from_pretrained. Skipped (77) without the peers' Python.
set -euo pipefail
zeal=$1 prog=$2
home=${HOME:-$(getent passwd "$(id -u)" | cut -d: -f6)}
python=${ZEAL_PEERS_PYTHON:-$home/.cache/zeal/peers/bin/python}
. tests/peers_skip.sh
[ -x "$python" ] || skip_or_fail "no peers Python at $python (scripts/peers installs it)"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rc=0
# The README's one command (scripts/causal-lm-demo), its output checked below.
ZEAL_BIN_DIR=$(dirname "$zeal") scripts/causal-lm-demo "$work" --port 29573 >"$work/demo.out" 2>&1 || rc=$?
[ "$rc" -eq 77 ] && skip_or_fail "the peers' Python lacks transformers, tokenizers or peft"
if [ "$rc" -ne 0 ]; then tail -20 "$work/demo.out"; echo "FAIL: scripts/causal-lm-demo exited $rc" >&2; exit 1; fi
out=$(cat "$work/lora.log")
echo "$out" | grep -v "zeal: step=" | tail -25
before=$(sed -n 's/^\[rank 0\] exact_match before training: \([0-9.]*\)$/\1/p' <<<"$out")
after=$(printf '%s\n' "$out" | tail -n 1 | sed -n 's/^\[rank 0\] exact_match: \([0-9.]*\)$/\1/p')
[ -n "$before" ] && [ -n "$after" ] || { echo "FAIL: no exact_match lines" >&2; exit 1; }
awk -v a="$before" -v b="$after" 'BEGIN { exit !(b >= a + 0.5) }' || { echo "FAIL: exact match $before -> $after" >&2; exit 1; }
[ "$(grep -c "CPU Total Peak Memory consumed during the train (max)" <<<"$out")" -eq 20 ] || { echo "FAIL: not one memory report per epoch" >&2; exit 1; }
[ "$(grep -c "^\[rank 0\] data: .* on 1 worker thread$" <<<"$out")" -eq 20 ] || { echo "FAIL: not one data line per epoch from the loader's worker" >&2; exit 1; }
[ "$(grep -c "^\[rank 0\] sample: reverse: " <<<"$out")" -eq 20 ] || { echo "FAIL: not one generation per evaluation" >&2; exit 1; }
rc=0
"$python" tests/examples/causal_lm_peer.py check "$work" 2>&1 | grep -v "Warning\|warn\|Loading" || rc=$?
[ "$rc" -eq 0 ] || { echo "FAIL: Python could not load zeal's adapter or merged model" >&2; exit 1; }
# A batch no rank can hold: refused as the Trainer prepares the model, named, before any step.
rc=0
err=$(timeout 120 "$prog" --model_dir "$work/pretrained/merged" --train "$work/train.jsonl" --output_dir "$work/huge" \
  --per_device_train_batch_size 4000000 --max_length 512 --save_strategy no 2>&1 >/dev/null) || rc=$?
if [ "$rc" -eq 0 ] || ! grep -q "memory_check: the batch will not fit: rank 0: 4000000 x 512 tokens per micro-step" <<<"$err"; then
  echo "FAIL: a batch of 4000000 x 512 tokens: exit $rc, said: $(tail -n 3 <<<"$err")" >&2
  exit 1
fi
echo "PASS: exact match $before -> $after; a batch no rank can hold refused"
