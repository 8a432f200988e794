#!/usr/bin/env bash
# Every number a shipped program (the examples and zeal's subcommands) takes is checked where it enters: zero, negative, not a
# number, out of range or nan ends the program at once with exit code 2 and the flag named on
# stderr (never a crash, a silent run or CLI11's own exit codes); --help exits 0; a JSON log that
# cannot be written ends the run with its path.
set -uo pipefail
train_gpt=$1 classify=$2 finetune_lora=$3
fail=0
check() {  # program, flag named, arguments...
  local prog=$1 flag=$2
  shift 2
  local err rc
  err=$(timeout 20 "$prog" "$@" 2>&1 >/dev/null)
  rc=$?
  if [ "$rc" -ne 2 ] || ! grep -q -- "$flag" <<<"$err"; then
    echo "FAIL: $(basename "$prog") $*: exit $rc (want 2), said: $err" >&2
    fail=1
  else
    echo "ok: $(basename "$prog") $* -> 2: $err"
  fi
}
for args in "--log_every 0" "--micro_batch 0" "--micro_batch -3" "--steps -1" "--steps 0" "--steps abc" \
            "--seq_len 0" "--seq_len 100000" "--lr nan" "--lr 0" "--lr -1e-3" "--lr inf" "--weight_decay -1" \
            "--weight_decay nan" "--save_every -2" "--model nope" "--steps 010" "--steps 0x3" \
            "--steps 99999999999999999999" "--seed -1" "--micro_batch 4611686018427387904" "--eval_every 1.5" \
            "--zero_stage 7" "--gradient_accumulation_steps 0" "--comm_timeout 1e16"; do
  read -r flag _ <<<"$args"
  # shellcheck disable=SC2086
  check "$train_gpt" "$flag" $args
done
for args in "--batch_size 0" "--epochs -1" "--lr nan" "--dim 0" "--layers 0" "--log_every 0" "--train_size 0" \
            "--valid_size x" "--dim 3" "--train_size 99999999999999999999" "--seed -1" "--zero_stage 9"; do
  read -r flag _ <<<"$args"
  # shellcheck disable=SC2086
  check "$classify" "$flag" $args
done
for args in "--epochs 0" "--batch_size -1" "--lr nan" "--r 0" "--seq_len 2" "--lora_dropout 1" "--log_every 0" \
            "--train_per_section x" "--lora_dropout nan" "--lora_alpha inf" "--sections games" "--seed -1" \
            "--mixed_precision fp8"; do
  read -r flag _ <<<"$args"
  # shellcheck disable=SC2086
  check "$finetune_lora" "$flag" $args
done
check "$train_gpt" "/nonexistent.yaml: no such config file" --config_file /nonexistent.yaml
# zeal's own subcommands, the same way.
zeal=$(dirname "$train_gpt")/zeal
check "$zeal" "--nproc_per_node" launch --nproc_per_node 0 /bin/true
check "$zeal" "--nnodes" launch --nnodes -1 /bin/true
check "$zeal" "--master_port" launch --master_port 70000 /bin/true
check "$zeal" "--node_rank" launch --node_rank -7 /bin/true
check "$zeal" "--params" estimate-memory --params 1e30 --largest_layer_params 1e6
check "$zeal" "--micro_batch" estimate-memory --model tiny --micro_batch 9223372036854775807
check "$zeal" "--largest_layer_params" estimate-memory --params 1e6 --largest_layer_params 1e7
# Estimator flags that would change nothing are refused, not ignored.
check "$zeal" "--activation_checkpointing" estimate-memory --params 1e6 --largest_layer_params 1e5 --activation_checkpointing true
check "$zeal" "--chunked_loss" estimate-memory --params 1e6 --largest_layer_params 1e5 --chunked_loss true
check "$zeal" "--checkpoint_interval" estimate-memory --model tiny --checkpoint_interval 2
check "$zeal" "--loss_chunk" estimate-memory --model tiny --loss_chunk 64
check "$zeal" "--frozen_head" estimate-memory --model tiny --frozen_head false
check "$zeal" "--max_shard_size" consolidate /nonexistent /tmp/zeal-flags-out --max_shard_size .
check "$zeal" "--max_shard_size" consolidate /nonexistent /tmp/zeal-flags-out --max_shard_size 1.2.3GB
check "$zeal" "--mib" offload tune --nvme_path /tmp --mib 17592186044416
tmpd=$(mktemp -d)
# Each config.json value estimate-memory reads is checked, naming the key (never a flag the user did
# not give, never an overflow to a negative size).
hfd=$(mktemp -d)
gpt() { printf '{"model_type": "gpt2", "n_embd": %s, "n_layer": %s, "n_head": 12, "vocab_size": %s, "n_positions": 1024}' "$@"; }
gpt -768 12 50257 > "$hfd/neg.json"
gpt 768 99999999999 50257 > "$hfd/layers.json"
gpt 768 12 5e12 > "$hfd/vocab.json"
gpt 768 12 18446744073709551615 > "$hfd/huge.json"
printf '{"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 5, "vocab_size": 32000, "intermediate_size": 11008}' > "$hfd/kv.json"
check "$zeal" "'n_embd' is -768" estimate-memory --hf_config "$hfd/neg.json"
check "$zeal" "'n_layer' is 99999999999" estimate-memory --hf_config "$hfd/layers.json"
check "$zeal" "'vocab_size' is 5000000000000.0" estimate-memory --hf_config "$hfd/vocab.json"
check "$zeal" "'vocab_size' is 18446744073709551615" estimate-memory --hf_config "$hfd/huge.json"
check "$zeal" "'num_key_value_heads' 5" estimate-memory --hf_config "$hfd/kv.json"
rm -rf "$hfd"
check "$zeal" "--zero_stage" config --config_file "$tmpd/a.yaml" --zero_stage abc
check "$zeal" "--num_processes" config --config_file "$tmpd/a.yaml" --num_processes 0
check "$zeal" "--distributed_type" config --config_file "$tmpd/a.yaml" --distributed_type BOGUS
# A device, pipe or socket is never replaced by the config file.
mkfifo "$tmpd/fifo"
check "$zeal" "not a regular file" config --config_file "$tmpd/fifo"
[ -p "$tmpd/fifo" ] || { echo "FAIL: zeal config replaced a FIFO" >&2; fail=1; }
[ "$(ls "$tmpd" | wc -l)" -eq 1 ] || { echo "FAIL: zeal config left files behind: $(ls "$tmpd")" >&2; fail=1; }
# Many problems: the first 20 and a count, in zeal's CLI as in the programs.
for i in $(seq 1 27); do echo "bogus_key_$i: 1"; done > "$tmpd/many.yaml"
err=$(timeout 20 "$zeal" config validate "$tmpd/many.yaml" 2>&1 >/dev/null)
rc=$?
if [ "$rc" -ne 2 ] || [ "$(grep -c "unknown key" <<<"$err")" -ne 20 ] || ! grep -q "and 7 more problems" <<<"$err"; then
  echo "FAIL: zeal config validate with 27 problems: exit $rc, said: $err" >&2
  fail=1
else
  echo "ok: zeal config validate with 27 problems -> 2, 20 shown and a count"
fi
# A tracker zeal does not know is refused, naming the key and the value.
printf 'log_with: [tensorboard, tensorbored]\n' > "$tmpd/trackers.yaml"
check "$zeal" "log_with.*tensorbored" config validate "$tmpd/trackers.yaml"
rm -rf "$tmpd"
# A flag the program does not know, and a stray argument, are errors too (not taken as the engine's).
check "$train_gpt" "--rank" --rank 0
check "$classify" "--rank" --rank 0
check "$finetune_lora" "--rank" --rank 0
check "$train_gpt" "stray" --steps 2 stray
for prog in "$train_gpt" "$classify" "$finetune_lora"; do
  timeout 20 "$prog" --help >/dev/null 2>&1 || { echo "FAIL: $(basename "$prog") --help exited $?" >&2; fail=1; }
done
# Standard output on a full disk: the program ends with exit 1 and says so.
check_full_stdout() {  # program, arguments...
  local err rc
  err=$(timeout 120 "$@" 2>&1 >/dev/full)
  rc=$?
  if [ "$rc" -ne 1 ] || ! grep -q "cannot write standard output" <<<"$err"; then
    echo "FAIL: $(basename "$1") ${*:2} >/dev/full: exit $rc (want 1), said: $err" >&2
    fail=1
  else
    echo "ok: $(basename "$1") ${*:2} >/dev/full -> 1: $err"
  fi
}
check_full_stdout "$train_gpt" --steps 1 --seq_len 16 --micro_batch 2
check_full_stdout "$zeal" config keys
# A JSON log on a full disk: the run ends non-zero naming the file.
err=$(timeout 120 "$train_gpt" --steps 2 --seq_len 16 --micro_batch 2 --log_jsonl /dev/full 2>&1 >/dev/null)
rc=$?
if [ "$rc" -eq 0 ] || ! grep -q "/dev/full" <<<"$err"; then
  echo "FAIL: --log_jsonl /dev/full: exit $rc, said: $err" >&2
  fail=1
else
  echo "ok: --log_jsonl /dev/full -> $rc"
fi
# Inputs that are wrong in content, not form: the run ends non-zero naming the file or flag, in one
# message without the standard library's or LibTorch's own text or a C++ backtrace.
run_prefix=()  # a command train_gpt runs under (prlimit)
check_run() {  # what to find, arguments...
  local want=$1
  shift
  local err rc
  err=$(timeout 120 "${run_prefix[@]}" "$train_gpt" "$@" 2>&1 >/dev/null)
  rc=$?
  if [ "$rc" -eq 0 ] || ! grep -qF -- "$want" <<<"$err" ||
     grep -qE "frame #|Exception raised from|enforce fail|basic_filebuf|_M_default_append|negative dimension" <<<"$err"; then
    echo "FAIL: train_gpt $*: exit $rc, want '$want', said: $err" >&2
    fail=1
  else
    echo "ok: train_gpt $* -> $rc: $err"
  fi
}
dir=$(mktemp -d)
check_run "--data: $dir is a directory" --steps 1 --data "$dir"
# llm.c's magic (20240520), version 1 and a negative token count.
python3 -c "import struct,sys; sys.stdout.buffer.write(struct.pack('<3i', 20240520, 1, -5) + bytes(1012) + bytes(64))" > "$dir/neg.bin"
check_run "$dir/neg.bin has llm.c's magic but an impossible header" --steps 1 --data "$dir/neg.bin"
python3 -c "import struct,sys; sys.stdout.buffer.write(struct.pack('<3i', 20240520, 1, 1 << 30) + bytes(1012) + bytes(64))" > "$dir/big.bin"
check_run "$dir/big.bin has llm.c's magic but an impossible header" --steps 1 --data "$dir/big.bin"
python3 -c "import struct,sys; sys.stdout.buffer.write(struct.pack('<3i', 20240520, 1, 100) + bytes(500))" > "$dir/short.bin"
check_run "$dir/short.bin has llm.c's magic but is shorter than its 1024-byte header" --steps 1 --data "$dir/short.bin"
# Output places that cannot be written are found before any training (100000 steps would outlast
# the timeout).
check_run "--save_dir: cannot create the folder /dev/null/ck/x" --steps 100000 --seq_len 16 --micro_batch 2 --save_dir /dev/null/ck/x
check_run "--save_dir: cannot create the folder /proc/zeal_ckpt" --steps 100000 --seq_len 16 --micro_batch 2 --save_dir /proc/zeal_ckpt
check_run "--log_jsonl: cannot create the folder /proc/zeal_logs" --steps 100000 --seq_len 16 --micro_batch 2 --log_jsonl /proc/zeal_logs/train.jsonl
check_run "--log_jsonl: $dir is a folder, not a file" --steps 100000 --seq_len 16 --micro_batch 2 --log_jsonl "$dir"
check_fails() {  # exit code wanted, what to find, program, arguments...
  local want_rc=$1 want=$2 prog=$3
  shift 3
  local err rc
  err=$(timeout 60 "$prog" "$@" 2>&1 >/dev/null)
  rc=$?
  if [ "$rc" -ne "$want_rc" ] || ! grep -qF -- "$want" <<<"$err"; then
    echo "FAIL: $(basename "$prog") $*: exit $rc (want $want_rc), said: $err" >&2
    fail=1
  else
    echo "ok: $(basename "$prog") $* -> $rc: $err"
  fi
}
check_fails 1 "--out: cannot create the folder /proc/zeal_lora_out" "$finetune_lora" --out /proc/zeal_lora_out
check_fails 2 "--json: cannot create the folder /proc/zeal_est" "$zeal" estimate-memory --model tiny --json /proc/zeal_est/est.json
# A micro-batch no rank can hold: refused when the model is prepared, named with the largest that
# fits (never left to the kernel's OOM killer on a machine that overcommits).
check_run "memory_check: the batch will not fit: rank 0: 1048576 x 128 tokens per micro-step (tiny)" \
  --steps 1 --seq_len 128 --micro_batch 1048576
check_run "The largest micro-batch predicted to fit with 10 % to spare is" --steps 1 --seq_len 128 --micro_batch 1048576
# With the check off and the address space bounded, the allocation fails: LibTorch's enforce
# failure, in one line.
printf 'memory_check: "off"\n' >"$dir/check_off.yaml"
run_prefix=(prlimit --as=17179869184 --)
check_run "you tried to allocate" --steps 1 --seq_len 128 --micro_batch 1048576 --config_file "$dir/check_off.yaml"
run_prefix=()
rm -rf "$dir"
exit $fail
