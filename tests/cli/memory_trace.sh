#!/usr/bin/env bash
# ZEAL_MEMORY_TRACE=1: train_gpt (tiny, 2 ranks, stage 3, every block gathered and released) prints on
# each rank, for every block, its gather, its gradients complete, its reduce-scatter launched, its
# reduction finishing and its release, each with a resident set and the bytes gathered; the bytes
# gathered after a block's gather exceed those after its release. Without the variable: no trace.
#
# usage: memory_trace.sh ZEAL TRAIN_GPT
set -euo pipefail
zeal=$1 train_gpt=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
sed 's/stage3_param_persistence_threshold: .*/stage3_param_persistence_threshold: 0/' configs/zero3.yaml > "$work/zero3.yaml"
run() {
  "$zeal" launch --num_processes 2 --main_process_port "$1" "$train_gpt" --config_file "$work/zero3.yaml" --model tiny \
    --steps 2 --seq_len 32 --micro_batch 4 --log_every 2
}
# Ports of this process's own (other tests run beside it); a failed run shows its output.
port=$((33000 + ($$ % 1000) * 2))
ZEAL_MEMORY_TRACE=1 run "$port" > "$work/on.txt" 2>&1 || { cat "$work/on.txt" >&2; exit 1; }
run $((port + 1)) > "$work/off.txt" 2>&1 || { cat "$work/off.txt" >&2; exit 1; }
if grep -q "zeal trace:" "$work/off.txt"; then echo "FAIL: trace lines without ZEAL_MEMORY_TRACE" >&2; exit 1; fi
python3 - "$work/on.txt" <<'PY'
import re, sys
pat = re.compile(r"zeal trace: rank (\d+) (gather|release|gradient|gradients complete|reduce-scatter launched|"
                 r"reduction finishing) (\S+|\(root\)): resident ([0-9.]+) MiB, gathered ([0-9.]+) MiB$")
events = {}
bad = []
for line in open(sys.argv[1]):
    if "zeal trace:" not in line:
        continue
    m = pat.search(line.rstrip("\n"))
    if not m:
        bad.append(f"unparsed trace line: {line.strip()}")
        continue
    rank, ev, unit, resident, gathered = int(m[1]), m[2], m[3], float(m[4]), float(m[5])
    if resident <= 0:
        bad.append(f"resident set {resident} MiB in: {line.strip()}")
    events.setdefault((rank, unit), []).append((ev, gathered))
for rank in (0, 1):
    for unit in ("h0", "h1"):
        evs = events.get((rank, unit), [])
        kinds = {e for e, _ in evs}
        want = {"gather", "release", "gradients complete", "reduce-scatter launched", "reduction finishing"}
        if not want <= kinds:
            bad.append(f"rank {rank} {unit}: events {sorted(kinds)} lack {sorted(want - kinds)}")
        gathers = [g for e, g in evs if e == "gather"]
        releases = [g for e, g in evs if e == "release"]
        if gathers and releases and not max(gathers) > min(releases):
            bad.append(f"rank {rank} {unit}: gathered after gather {max(gathers)} MiB, after release {min(releases)} MiB")
if bad:
    print("\n".join(bad), file=sys.stderr)
    sys.exit(1)
print(f"trace: {sum(len(v) for v in events.values())} events on 2 ranks")
PY
