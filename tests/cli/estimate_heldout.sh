#!/usr/bin/env bash
# zeal estimate-memory on rows of benchmarks/estimator/heldout_rows.json, the configurations its terms
# were never fitted to: checkpointed blocks at 512 tokens, an untied head, NVMe offload on 3 ranks
# with max_in_cpu below the per-rank parameters, and the BERT+LoRA of lora_bench when its model is
# installed. Each is run by memory_bench --rows and must be predicted within 5 % of the measured
# train-phase peak (the whole file: docs/memory.md, "How the estimator is judged").
#
# usage: estimate_heldout.sh MEMORY_BENCH
set -euo pipefail
bench=$1
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
home=${HOME:-$(getent passwd "$(id -u)" | cut -d: -f6)}
minilm=${ZEAL_MODELS:-$home/.cache/zeal/models}/all-MiniLM-L6-v2
names="small-s3-512-ckpt small-untied-s3-512-ckpt small-s3-nvme-256-3ranks-maxincpu"
[ -f "$minilm/model.safetensors" ] && names="$names minilm-lora-s3"
python3 - "$root/benchmarks/estimator/heldout_rows.json" "$work/rows.json" $names <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
want = sys.argv[3:]
picked = [r for r in rows if r["name"] in want]
assert len(picked) == len(want), f"rows missing from the file: {set(want) - {r['name'] for r in picked}}"
json.dump({"rows": picked}, open(sys.argv[2], "w"))
PY
"$bench" --rows "$work/rows.json" --nvme_path "$work/nvme" --json "$work/out.json"
python3 - "$work/out.json" <<'PY'
import json, sys
bad = []
for r in json.load(open(sys.argv[1]))["rows"]:
    if not r["ok"]:
        bad.append(f"{r['name']} did not run: {r['why']}")
    elif abs(r["estimator_error"]) > 0.05:
        bad.append(f"{r['name']}: error {100 * r['estimator_error']:+.1f} % (more than 5 %)")
if bad:
    print("\n".join(bad), file=sys.stderr)
    sys.exit(1)
print("every held-out row within 5 %")
PY
