#!/usr/bin/env bash
# zeal estimate-memory against DeepSpeed's estimators and transformers' parameter counts
# (tests/cli/estimate_check.py). Skipped (77) without the peers' Python (scripts/peers).
set -euo pipefail
zeal=$1
home=${HOME:-$(getent passwd "$(id -u)" | cut -d: -f6)}
python=${ZEAL_PEERS_PYTHON:-$home/.cache/zeal/peers/bin/python}
. tests/peers_skip.sh
[ -x "$python" ] || skip_or_fail "no peers Python at $python (scripts/peers installs it)"
OMP_NUM_THREADS=1 "$python" tests/cli/estimate_check.py "$zeal"
