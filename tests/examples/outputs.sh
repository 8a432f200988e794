#!/usr/bin/env bash
# Outputs whole or absent:
# - an export into a folder replaces the previous export's files as a set (single file ↔ shards with
#   their index), leaving the folder's other files alone;
# - an export that fails (a corrupted checkpoint) leaves the previous export byte for byte and no
#   partial file;
# - --names renames and transposes what it names, leaves the rest byte for byte, and refuses a name
#   the checkpoint lacks or a malformed file;
# - offload to nvme on a file system too small for the swap files ends at prepare, naming the folder
#   and both sizes, with nothing written there (root: a 16 MiB tmpfs; skipped otherwise).
#
# usage: outputs.sh ZEAL TRAIN_GPT
set -uo pipefail
zeal=$1 train_gpt=$2
work=$(mktemp -d)
mounted=""
cleanup() {
  [ -n "$mounted" ] && umount "$mounted"
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }
listing() { (cd "$1" && find . -type f -print0 | sort -z | xargs -0 sha256sum); }

"$train_gpt" --model tiny --steps 2 --seq_len 16 --micro_batch 2 --save_dir "$work/ck" >"$work/train.log" 2>&1 ||
  fail "training the checkpoint: $(tail -3 "$work/train.log")"
out=$work/out
mkdir -p "$out"
echo '{"model_type": "gpt2"}' >"$out/config.json"

# Shards, then one file, then shards again: each time exactly the new set.
"$zeal" consolidate "$work/ck" "$out" --max_shard_size 100KB >/dev/null || fail "the sharded export"
shards=$(ls "$out" | grep -c '^model-[0-9]\{5\}-of-[0-9]\{5\}\.safetensors$')
[ "$shards" -gt 1 ] && [ -f "$out/model.safetensors.index.json" ] || fail "expected shards and an index, got: $(ls "$out")"
"$zeal" consolidate "$work/ck" "$out" >/dev/null || fail "the single-file export"
[ "$(ls -A "$out" | sort | tr '\n' ' ')" = "config.json model.safetensors " ] ||
  fail "after a single-file export over shards the folder holds: $(ls -A "$out")"
"$zeal" consolidate "$work/ck" "$out" --max_shard_size 150KB >/dev/null || fail "the second sharded export"
[ -f "$out/model.safetensors" ] && fail "the single file stayed beside the new shards"
python3 - "$out" <<'EOF' || fail "the index and the shard files disagree"
import json, os, sys
d = sys.argv[1]
index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
named = set(index["weight_map"].values())
present = {f for f in os.listdir(d) if f.startswith("model-")}
assert named == present, (named, present)
EOF
echo "PASS: each export replaced the previous one as a set ($(ls "$out" | tr '\n' ' '))"

# A failing export: the previous one stays whole.
before=$(listing "$out")
bad=$work/bad
cp -r "$work/ck/$(cat "$work/ck/latest")" "$bad"
rankfile=$(ls "$bad" | grep -m1 'safetensors$')
size=$(stat -c %s "$bad/$rankfile")
printf '\xff\xfe' | dd of="$bad/$rankfile" bs=1 seek=$((size - 40)) conv=notrunc status=none
err=$("$zeal" consolidate "$bad" "$out" 2>&1 >/dev/null)
[ $? -ne 0 ] || fail "the export of a corrupted checkpoint succeeded"
grep -qi "crc\|checksum" <<<"$err" || fail "the failure does not name the checksum: $err"
[ "$(listing "$out")" = "$before" ] || fail "the failed export changed the folder: $(ls -A "$out")"
[ -z "$(ls -A "$out" | grep -v '^config.json$\|^model')" ] || fail "the failed export left: $(ls -A "$out")"
echo "PASS: a failed export left the previous one byte for byte ($err)"

# --names: a tensor renamed, a 2-D one written transposed (its bytes checked against the plain
# export's, transposed here), the rest as they were; a name the checkpoint lacks is refused.
plain=$work/plain named=$work/named
"$zeal" consolidate "$work/ck" "$plain" >/dev/null || fail "the plain export"
python3 - "$plain/model.safetensors" "$work/names.json" <<'EOF' || fail "choosing the names"
import json, struct, sys
b = open(sys.argv[1], "rb").read()
h = json.loads(b[8:8 + struct.unpack("<Q", b[:8])[0]])
two = sorted(n for n, e in h.items() if n != "__metadata__" and len(e["shape"]) == 2 and e["shape"][0] != e["shape"][1])
one = sorted(n for n, e in h.items() if n != "__metadata__" and len(e["shape"]) == 1)
json.dump({two[0]: {"name": "renamed.t", "transpose": True}, one[0]: "renamed.v"}, open(sys.argv[2], "w"))
EOF
"$zeal" consolidate "$work/ck" "$named" --names "$work/names.json" >/dev/null || fail "the export with --names"
python3 - "$plain/model.safetensors" "$named/model.safetensors" "$work/names.json" <<'EOF' || fail "the renamed export"
import array, json, struct, sys
def load(p):
    b = open(p, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n])
    h.pop("__metadata__", None)
    return h, b[8 + n:]
(ph, pb), (nh, nb) = load(sys.argv[1]), load(sys.argv[2])
names = json.load(open(sys.argv[3]))
t_from = next(k for k, v in names.items() if isinstance(v, dict))
v_from = next(k for k, v in names.items() if isinstance(v, str))
t_to, v_to = names[t_from]["name"], names[v_from]
assert set(nh) == (set(ph) - {t_from, v_from}) | {t_to, v_to}, sorted(set(nh) ^ set(ph))
def data(h, b, n):
    e = h[n]
    return b[e["data_offsets"][0]:e["data_offsets"][1]]
for n in set(ph) - {t_from, v_from}:
    assert data(ph, pb, n) == data(nh, nb, n), n
assert data(ph, pb, v_from) == data(nh, nb, v_to)
r, c = ph[t_from]["shape"]
assert nh[t_to]["shape"] == [c, r] and ph[t_from]["dtype"] == "F32", (nh[t_to], ph[t_from])
src, dst = array.array("f", data(ph, pb, t_from)), array.array("f", data(nh, nb, t_to))
assert all(dst[j * r + i] == src[i * c + j] for i in range(r) for j in range(c)), "not the transpose"
print(f"renamed {t_from} -> {t_to} (transposed {r}x{c}), {v_from} -> {v_to}")
EOF
echo '{"no.such.tensor": "x"}' >"$work/bad_names.json"
err=$("$zeal" consolidate "$work/ck" "$work/never" --names "$work/bad_names.json" 2>&1 >/dev/null) &&
  fail "a name the checkpoint lacks was accepted"
grep -q "no.such.tensor" <<<"$err" || fail "the refusal does not name the tensor: $err"
[ ! -e "$work/never/model.safetensors" ] || fail "the refused export wrote a file"
echo '{"x": 3}' >"$work/bad_names.json"
err=$("$zeal" consolidate "$work/ck" "$work/never" --names "$work/bad_names.json" 2>&1 >/dev/null) &&
  fail "a names file of numbers was accepted"
grep -q "'x' maps to 3" <<<"$err" || fail "the malformed names file is not named: $err"
echo "PASS: --names renamed and transposed as asked, and refused what it could not do"

# Free space for the swap files, at prepare.
if [ "$(id -u)" != 0 ]; then echo "skipped the free-space case: needs root to mount a tmpfs"; exit 0; fi
mkdir -p "$work/tiny"
mount -t tmpfs -o size=16m tmpfs "$work/tiny" 2>/dev/null || { echo "skipped the free-space case: cannot mount"; exit 0; }
mounted=$work/tiny
start=$(date +%s)
err=$("$train_gpt" --model gpt2-small --steps 100000 --seq_len 16 --micro_batch 1 --config_file configs/ds_zero3_nvme.yaml \
  --offload_optimizer_nvme_path "$work/tiny" --offload_param_nvme_path "$work/tiny" 2>&1 >/dev/null)
rc=$?
took=$(($(date +%s) - start))
[ $rc = 1 ] || fail "a disk too small: exit $rc, said: $err"
# (max_in_cpu 1e9 keeps every parameter shard in host memory: the optimizer's files alone.)
grep -q "offload: the swap files need about 1\.[0-9]* GiB in $work/tiny (the optimizer's 1\.[0-9]* GiB per rank), but its file system has 16.00 MiB free" <<<"$err" ||
  fail "the free-space refusal does not name the folder and both sizes: $err"
[ -z "$(ls -A "$work/tiny")" ] || fail "something was written before the check: $(ls -AR "$work/tiny")"
echo "PASS: a disk too small for the swap files refused at prepare in $took s, nothing written"
# Both kinds of swap file on one file system (max_in_cpu 0: every block's parameter shard on disk;
# the root, with the embeddings, stays in memory): their sum. gpt2-small's 12 blocks hold 85 M
# parameters, 162 MiB in bf16.
python3 - "$work/tiny" >"$work/ds.json" <<'PY'
import json, sys
c = json.load(open("configs/ds_zero3_nvme.json"))
z = c["zero_optimization"]
z["offload_optimizer"]["nvme_path"] = z["offload_param"]["nvme_path"] = sys.argv[1]
z["offload_param"]["max_in_cpu"] = 0
print(json.dumps(c))
PY
err=$("$train_gpt" --model gpt2-small --steps 100000 --seq_len 16 --micro_batch 1 --config_file "$work/ds.json" 2>&1 >/dev/null)
rc=$?
[ $rc = 1 ] || fail "a disk too small, both swaps: exit $rc, said: $err"
grep -q "need about 2\\.[0-9]* GiB in $work/tiny (the optimizer's 1\\.[0-9]* GiB + the parameters' 16[0-9]\\.[0-9]* MiB per rank)" <<<"$err" ||
  fail "the parameters' swap is not counted with the optimizer's: $err"
[ -z "$(ls -A "$work/tiny")" ] || fail "something was written before the check: $(ls -AR "$work/tiny")"
echo "PASS: both swaps on one file system counted together"
