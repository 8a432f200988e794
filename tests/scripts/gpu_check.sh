#!/usr/bin/env bash
# scripts/gpu-check on a machine without a GPU: argument errors, the dry run (the carried Debian
# packages fetched, unpacked under the build folder and configured against), the summary and the
# files it writes, resuming (steps that passed are not run again), the deadline (stops cleanly,
# "run the same command again", then resumes), a tampered package named, and the real run refused
# without a GPU. Usage: gpu_check.sh WORK_DIR
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
work=${1:?work dir}
rm -rf "$work" && mkdir -p "$work"
check=$root/scripts/gpu-check
fail() { echo "FAIL: $*"; exit 1; }
expect() {  # expect CODE TEXT -- command...
  local code=$1 text=$2; shift 3
  local got
  out=$("$@" 2>&1); got=$?
  [ "$got" = "$code" ] || { echo "$out" | tail -20; fail "$* exited $got, expected $code"; }
  [ -z "$text" ] || grep -qF -- "$text" <<<"$out" || { echo "$out" | tail -20; fail "$* did not say: $text"; }
}

# Usage errors exit 2 naming the problem; --help exits 0.
expect 0 "--fetch-deps" -- "$check" --help
expect 2 "unknown argument '--bogus'" -- "$check" --bogus
expect 2 "--deadline takes whole seconds" -- "$check" --deadline 5m
expect 2 "--only: no step 'lint'" -- "$check" --only lint
expect 2 "--out needs a value" -- "$check" --out

# The dry run: every step it can run passes, the GPU steps say what they would run.
b=$work/build o1=$work/out1
expect 0 "Dry run passed" -- "$check" --dry-run --build-dir "$b" --out "$o1"
last=$(tail -1 <<<"$out")
[[ "$last" == "| cpu | dry |"* ]] || fail "the output does not end with the summary table (last line: $last)"
for f in summary.md results.json environment.txt logs.tar.gz; do [ -s "$o1/$f" ] || fail "$o1/$f missing"; done
[ "$(ls "$o1" | wc -l)" -le 8 ] || fail "more than 8 files in the output folder"
python3 - "$o1/results.json" <<'PY' || fail "results.json"
import json, sys
r = json.load(open(sys.argv[1]))
st = {s["step"]: s["status"] for s in r["steps"]}
assert r["dry_run"] is True, r
assert [st[s] for s in ("probe", "deps", "configure")] == ["passed"] * 3, st
assert all(st[s] == "dry" for s in ("build", "kernels", "nccl", "engine", "bench_adam", "bench_step", "cpu")), st
PY
# The packages were found under the build folder, not in this machine's /usr.
grep -q "^ZEAL_URING_LIBRARY:FILEPATH=$b/deps-root/" "$b/tree/CMakeCache.txt" || fail "liburing not from the carried packages"
listing=$(tar -tzf "$o1/logs.tar.gz")
grep -q 'logs/configure.log' <<<"$listing" || fail "the configure log is not in logs.tar.gz"

# Again: the steps that passed are not run again; the probe is (it describes this call's machine).
expect 0 "configure: passed before" -- "$check" --dry-run --build-dir "$b" --out "$work/out2"
grep -q "deps: passed before" <<<"$out" || fail "deps ran again"
grep -q "probe: the machine" <<<"$out" || fail "the probe did not run again"
[ -s "$work/out2/environment.txt" ] || fail "the second call's output has no environment.txt"

# A deadline too short for the next step: a clean stop, exit 3, then the same command finishes.
expect 3 "run the same command again" -- "$check" --dry-run --restart --deadline 20 --build-dir "$b" --out "$work/out3"
grep -q "Stopped before the deadline" "$work/out3/summary.md" || fail "summary.md does not say it stopped"
# Which steps fitted before the deadline depends on the machine (the probe imports torch): each one
# that passed there is not run again.
passed3=$(python3 -c 'import json,sys; print(" ".join(s["step"] for s in json.load(open(sys.argv[1]))["steps"] if s["status"] == "passed" and s["step"] != "probe"))' "$work/out3/results.json")
expect 0 "Dry run passed" -- "$check" --dry-run --build-dir "$b" --out "$work/out4"
for s in $passed3; do
  grep -q "$s: passed before" <<<"$out" || fail "the resumed run repeated $s"
done

# A carried package that does not match its digest is named, and nothing is configured after it.
cp -r "$root/.gpu-deps" "$work/deps"
deb=$(ls "$work"/deps/debs/libfmt-dev_*.deb)
printf 'x' >>"$deb"
expect 1 "does not match MANIFEST" -- env ZEAL_GPU_DEPS="$work/deps" "$check" --dry-run --restart --build-dir "$work/b2" --out "$work/out5"
grep -q '^| configure | blocked |' <<<"$out" || fail "configure ran after the deps failed"

# Without --dry-run on a machine without a GPU: the probe says so, exit 1.
if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  expect 1 "no GPU" -- "$check" --build-dir "$work/b3" --out "$work/out6"
fi
rm -rf "$work"
echo "gpu-check: all checks passed"
