#!/usr/bin/env bash
# zeal against Python transformers, tokenizers and peft on all-MiniLM-L6-v2 (tests/peft/minilm_check.py).
# Skipped (77) without the model (scripts/setup installs it) or without the peers' Python.
set -euo pipefail
zeal=$1 tool=$2
home=${HOME:-$(getent passwd "$(id -u)" | cut -d: -f6)}
model=${ZEAL_MINILM:-${ZEAL_MODELS:-$home/.cache/zeal/models}/all-MiniLM-L6-v2}
python=${ZEAL_PEERS_PYTHON:-$home/.cache/zeal/peers/bin/python}
. tests/peers_skip.sh
[ -f "$model/model.safetensors" ] || skip_or_fail "no all-MiniLM-L6-v2 in $model (scripts/setup installs it)"
[ -x "$python" ] || skip_or_fail "no peers Python at $python (scripts/peers installs it)"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
OMP_NUM_THREADS=1 "$python" tests/peft/minilm_check.py "$model" "$zeal" "$tool" "$work"
