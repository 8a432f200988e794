#!/usr/bin/env bash
# Two "machines" (network namespaces joined by a bridge, each with its own address and its own
# `zeal launch`), two ranks each, training train_gpt's tiny GPT at stage 3:
# 1. 2 machines × 2 ranks end with the same parameters, bit for bit, as 1 machine × 4 ranks;
# 2. every process of machine 1 killed → machine 0's launcher ends non-zero within comm_timeout + 10 s
#    (plus its stop grace), naming machine 1 and its ranks;
# 3. machine 1's link cut → both launchers end so, machine 0 naming machine 1 and machine 1 naming
#    the store's machine;
# 4. machine 1 started with another config (one override) → both refused at the rendezvous, naming
#    the key;
# 5. machine 1 running another zeal build (its library with another source id) → refused the same way;
# 6. (after 1) 2 machines × 2 ranks with hybrid_shard end within rounding of full sharding;
# 7. both launchers with --max_restarts restart together after a rank is killed and end bit-identical.
# Needs root and iproute2; exits 77 (skipped) otherwise.
#
# usage: machines.sh ZEAL TRAIN_GPT [PORT]
set -uo pipefail
zeal=$(realpath "$1") train_gpt=$(realpath "$2") port=${3:-29591}
for tool in bc python3 ldd readelf; do
  command -v $tool >/dev/null || { echo "skipped: needs $tool"; exit 77; }
done
here=$(dirname "$0")
# shellcheck source=netns.sh
source "$here/netns.sh"
work=$(mktemp -d)
cleanup() {
  netns_down
  rm -rf "$work"
}
trap cleanup EXIT
netns_up 2
fail() { echo "FAIL: $*"; for f in "$work"/*.log; do [ -e "$f" ] && { echo "--- $f"; grep -v "step [0-9]*/" "$f" | tail -n 12; }; done; exit 1; }
timeout_s=5 grace=2
common=(--config_file configs/zero3.yaml --num_machines 2 --num_processes 4 --main_process_ip "${MACHINE_IP[0]}"
        --comm_timeout $timeout_s --stop_grace $grace --no_bind)
short=(--model tiny --steps 6 --seq_len 32 --micro_batch 2 --data README.md --seed 3)
long=(--model tiny --steps 100000 --seq_len 32 --micro_batch 2 --data README.md --log_every 1)
now() { date +%s.%N; }
since() { echo "$(now) - $1" | bc; }

# 1. The same parameters as one machine of four ranks.
"$zeal" launch --config_file configs/zero3.yaml --num_processes 4 --main_process_port "$port" --no_bind \
  "$train_gpt" "${short[@]}" --save_dir "$work/one" >"$work/one.log" 2>&1 || fail "1 machine x 4 ranks failed"
# Both machines train the short run into one save folder; fails naming the run otherwise.
train_on_both() {  # what, port, save folder, then the launch flags
  local what=$1 p=$2 save=$3
  shift 3
  on_machine 0 "$zeal" launch "$@" --main_process_port "$p" --machine_rank 0 \
    "$train_gpt" "${short[@]}" --save_dir "$save" >"$work/m0.log" 2>&1 &
  p0=$!
  on_machine 1 "$zeal" launch "$@" --main_process_port "$p" --machine_rank 1 \
    "$train_gpt" "${short[@]}" --save_dir "$save" >"$work/m1.log" 2>&1 &
  p1=$!
  wait $p0 || fail "$what: machine 0 of 2 failed"
  wait $p1 || fail "$what: machine 1 of 2 failed"
}
train_on_both "full sharding" $((port + 1)) "$work/two" "${common[@]}"
grep -q "4 ranks, ZeRO stage 3" "$work/m0.log" || fail "the two machines did not form one 4-rank run"
"$zeal" consolidate "$work/one" "$work/one_out" >/dev/null && "$zeal" consolidate "$work/two" "$work/two_out" >/dev/null ||
  fail "consolidating"
cmp "$work/one_out/model.safetensors" "$work/two_out/model.safetensors" ||
  fail "2 machines x 2 ranks and 1 machine x 4 ranks end with different parameters"
echo "PASS: 2 machines x 2 ranks end bit-identical to 1 machine x 4 ranks"
rm -f "$work"/m?.log

# 2 machines x 2 ranks with hybrid sharding (sharded inside each machine, replicated across):
# as close to full sharding on 4 ranks as one rank over the same global batch is (another legitimate
# summation order: parameters whose gradient is rounding noise, like an attention key's bias, move by
# Adam's whole step either way), each parameter tensor compared at its own scale.
sed 's/^zero_optimization:$/zero_optimization:\n  hybrid_shard: true/' configs/zero3.yaml >"$work/hybrid.yaml"
grep -q "hybrid_shard: true" "$work/hybrid.yaml" || fail "writing the hybrid config"
hybrid=(--config_file "$work/hybrid.yaml" "${common[@]:2}")
train_on_both "hybrid" $((port + 6)) "$work/hyb" "${hybrid[@]}"
grep -q "sharded across the 2 ranks of each machine and replicated across the 2 machines" "$work/m0.log" ||
  fail "hybrid: the run did not say it shards inside each machine"
"$zeal" launch --config_file configs/zero3.yaml --num_processes 1 --main_process_port $((port + 6)) --no_bind \
  "$train_gpt" --model tiny --steps 6 --seq_len 32 --micro_batch 8 --data README.md --seed 3 --save_dir "$work/single" >"$work/single.log" 2>&1 ||
  fail "the one-rank run failed"
for d in hyb single; do "$zeal" consolidate "$work/$d" "$work/${d}_out" >/dev/null || fail "consolidating $d"; done
read -r worst bound < <(python3 - "$work/one_out/model.safetensors" "$work/hyb_out/model.safetensors" \
  "$work/single_out/model.safetensors" <<'PY'
import array, json, struct, sys
def tensors(path):
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    head = json.loads(data[8:8 + n])
    out = {}
    for name, t in head.items():
        if name == "__metadata__":
            continue
        assert t["dtype"] == "F32", t["dtype"]
        a, b = t["data_offsets"]
        out[name] = array.array("f", data[8 + n + a:8 + n + b])
    return out
def worst(x, y):
    assert x.keys() == y.keys(), (sorted(x), sorted(y))
    return max(max(abs(a - b) for a, b in zip(x[k], y[k])) / max(max(abs(a) for a in x[k]), 1e-12) for k in x)
full, hyb, single = (tensors(p) for p in sys.argv[1:4])
print("%.12f %.12f" % (worst(full, hyb), 4 * worst(full, single) + 1e-6))
PY
) || fail "hybrid: comparing the parameters"
(($(echo "$worst <= $bound" | bc -l))) ||
  fail "hybrid: the parameters differ from full sharding by $worst (relative), more than the bound $bound"
echo "PASS: 2 machines x 2 ranks with hybrid_shard end within $worst (relative) of full sharding (bound $bound: 4 x one rank against full sharding)"
rm -f "$work"/m?.log

# 2 machines x 2 ranks with --max_restarts 1 and --resume auto: one rank of machine 1 killed once the
# checkpoint of step 4 appears (often while it is being written); both launchers restart (meeting again on the next port), the run resumes from its last
# checkpoint and ends with the bits of the uninterrupted two-machine run.
long_enough=(--model tiny --steps 12 --seq_len 32 --micro_batch 2 --data README.md --seed 3 --save_every 1)
restart_flags=(--max_restarts 1 "${common[@]}")
on_machine 0 "$zeal" launch "${common[@]}" --main_process_port $((port + 7)) --machine_rank 0 \
  "$train_gpt" "${long_enough[@]}" --save_dir "$work/whole" >"$work/m0.log" 2>&1 &
p0=$!
on_machine 1 "$zeal" launch "${common[@]}" --main_process_port $((port + 7)) --machine_rank 1 \
  "$train_gpt" "${long_enough[@]}" --save_dir "$work/whole" >"$work/m1.log" 2>&1 &
p1=$!
wait $p0 && wait $p1 || fail "restart: the uninterrupted run failed"
on_machine 0 "$zeal" launch "${restart_flags[@]}" --main_process_port $((port + 8)) --machine_rank 0 \
  "$train_gpt" "${long_enough[@]}" --save_dir "$work/again" --resume auto >"$work/m0.log" 2>&1 &
p0=$!
on_machine 1 "$zeal" launch "${restart_flags[@]}" --main_process_port $((port + 8)) --machine_rank 1 \
  "$train_gpt" "${long_enough[@]}" --save_dir "$work/again" --resume auto >"$work/m1.log" 2>&1 &
p1=$!
for ((i = 0; i < 600; i++)); do [ -e "$work/again/checkpoint-4" ] && break; sleep 0.05; done
[ -e "$work/again/checkpoint-4" ] || fail "restart: the run never saved step 4"
victim=$(ps -o pid=,comm= -p "$(ip netns pids "${MACHINE_NS[1]}" | paste -sd,)" | awk '$2 == "train_gpt" {print $1; exit}')
[ -n "$victim" ] || fail "restart: no rank of machine 1 found"
kill -KILL "$victim"
wait $p0
s0=$?
wait $p1
s1=$?
[ $s0 -eq 0 ] && [ $s1 -eq 0 ] || fail "restart: the machines ended with $s0 and $s1 after one rank was killed"
for m in 0 1; do
  grep -q "restarting every rank (restart 1 of 1) after .*; the machines meet again on port $((port + 9))" "$work/m$m.log" ||
    fail "restart: machine $m did not restart onto the next port"
done
grep -q "resumed from" "$work/m0.log" || fail "restart: the program did not resume from its checkpoint"
"$zeal" consolidate "$work/whole/checkpoint-12" "$work/whole_out" >/dev/null &&
  "$zeal" consolidate "$work/again/checkpoint-12" "$work/again_out" >/dev/null || fail "restart: consolidating"
cmp "$work/whole_out/model.safetensors" "$work/again_out/model.safetensors" ||
  fail "restart: the restarted run ends with other parameters than the uninterrupted one"
echo "PASS: two machines restart together after a rank of machine 1 was killed, and end bit-identical"
rm -f "$work"/m?.log

# Starts both machines on a long run; returns once machine 0 has logged step 3.
start_long() {  # port
  on_machine 0 "$zeal" launch "${common[@]}" --main_process_port "$1" --machine_rank 0 "$train_gpt" "${long[@]}" \
    >"$work/m0.log" 2>&1 &
  p0=$!
  on_machine 1 "$zeal" launch "${common[@]}" --main_process_port "$1" --machine_rank 1 "$train_gpt" "${long[@]}" \
    >"$work/m1.log" 2>&1 &
  p1=$!
  for ((i = 0; i < 600; i++)); do grep -q "step 3/" "$work/m0.log" 2>/dev/null && return 0; sleep 0.1; done
  fail "the long run did not reach step 3"
}
limit=$((timeout_s + 10 + grace))

# 2. Every process of machine 1 killed.
start_long $((port + 2))
t0=$(now)
ip netns pids "${MACHINE_NS[1]}" | xargs -r kill -KILL
wait $p0
s0=$?
took=$(since "$t0")
wait $p1 2>/dev/null
[ $s0 -ne 0 ] || fail "machine 0 ended 0 after machine 1 was killed"
(($(echo "$took < $limit" | bc))) || fail "machine 0 took $took s (limit $limit s)"
grep -q "machine 1 (host [^,]*, ranks 2, 3) does not answer" "$work/m0.log" || fail "machine 0 does not name machine 1"
echo "PASS: machine 1 killed: machine 0 ended with $s0 in $took s naming machine 1 and ranks 2, 3"

# 3. Machine 1's link cut.
start_long $((port + 3))
t0=$(now)
cut_link 1
wait $p0
s0=$?
t_0=$(since "$t0")
wait $p1
s1=$?
t_1=$(since "$t0")
[ $s0 -ne 0 ] && [ $s1 -ne 0 ] || fail "a cut link: the machines ended with $s0 and $s1"
(($(echo "$t_0 < $limit && $t_1 < $limit" | bc))) || fail "a cut link: the machines took $t_0 and $t_1 s (limit $limit s)"
grep -q "machine 1 (host [^,]*, ranks 2, 3) does not answer" "$work/m0.log" || fail "a cut link: machine 0 does not name machine 1"
grep -q "the store is on machine 0 (host [^,]*, ranks 0, 1)" "$work/m1.log" || fail "a cut link: machine 1 does not name machine 0"
echo "PASS: link cut: machine 0 ended in $t_0 s naming machine 1, machine 1 in $t_1 s naming machine 0"
ip -n "${MACHINE_NS[1]}" link set eth0 up

# 4 and 5: machine 1 differs; both machines refuse at the rendezvous.
refused() {  # name, port, what both must say, then machine 1's command prefix (env ...) and extra flags
  local name=$1 p=$2 want=$3
  shift 3
  t0=$(now)
  on_machine 0 "$zeal" launch "${common[@]}" --main_process_port "$p" --machine_rank 0 "$train_gpt" "${short[@]}" \
    >"$work/m0.log" 2>&1 &
  p0=$!
  on_machine 1 "$@" --main_process_port "$p" --machine_rank 1 "$train_gpt" "${short[@]}" >"$work/m1.log" 2>&1 &
  p1=$!
  wait $p0
  s0=$?
  wait $p1
  s1=$?
  took=$(since "$t0")
  [ $s0 -ne 0 ] && [ $s1 -ne 0 ] || fail "$name: the machines ended with $s0 and $s1"
  grep -q -- "$want" "$work/m0.log" && grep -q -- "$want" "$work/m1.log" || fail "$name: not named on both machines"
  grep -q "step 1/" "$work/m0.log" && fail "$name: trained before refusing"
  echo "PASS: $name refused at the rendezvous on both machines in $took s: $(grep -m1 -o -- "$want.*" "$work/m0.log" | cut -c1-160)"
}
refused "another config" $((port + 4)) "rank 2 was started with gradient_clipping 0.5 but rank 0 with 1.0" \
  "$zeal" launch "${common[@]}" --gradient_clipping 0.5

# Another build: the same library with another source id, found first through LD_LIBRARY_PATH
# (which a RUNPATH lets win; an old-style RPATH would not).
if readelf -d "$train_gpt" | grep -q "(RPATH)"; then echo "skipped the other-build case: the programs use RPATH"; exit 0; fi
lib=$(ldd "$train_gpt" | awk '/libzeal\.so/ {print $3}')
mkdir -p "$work/otherlib"
python3 - "$lib" "$work/otherlib/$(basename "$lib")" <<'EOF'
import re, sys
data = open(sys.argv[1], "rb").read()
m = re.search(rb"commit ([0-9a-f]{12})", data)
if not m:
    sys.exit(3)  # a build from outside a git checkout has no commit to change
old = m.group(1)
new = b"0" * 12 if old != b"0" * 12 else b"1" * 12
open(sys.argv[2], "wb").write(data[: m.start(1)] + new + data[m.end(1):])
EOF
case $? in
  0) ;;
  3) echo "skipped the other-build case: this build has no source commit"; exit 0 ;;
  *) fail "patching the library's source id" ;;
esac
refused "another zeal build" $((port + 5)) "was started with build zeal" \
  env LD_LIBRARY_PATH="$work/otherlib" "$zeal" launch "${common[@]}"
