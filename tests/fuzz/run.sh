#!/usr/bin/env bash
# Runs the config loader's fuzz target for SECONDS over the committed corpus (read only; what it
# finds goes to a temporary folder). Exit 0 when nothing crashed, hung or tripped a sanitizer.
#
# usage: tests/fuzz/run.sh build/fuzz/config_fuzz [SECONDS]
set -euo pipefail
fuzz=$(realpath "$1") seconds=${2:-20}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
new=$(mktemp -d) crashes=$(mktemp -d)
trap 'rm -rf "$new" "$crashes"' EXIT
cd "$crashes"
# -timeout: one input taking 5 s is a hang; -rss_limit_mb: one using 2 GiB is a memory bomb.
"$fuzz" -max_total_time="$seconds" -timeout=5 -rss_limit_mb=2048 -max_len=8192 -print_final_stats=1 \
  -dict="$root/tests/fuzz/config.dict" "$new" "$root/tests/fuzz/corpus" 2>&1 | tail -n 25
