"""zeal estimate-memory against DeepSpeed and transformers, in the peers' Python.

- DeepSpeed's numbers: for a grid of models (parameter counts, largest layers) and machines (ranks
  per node, nodes), the bytes zeal's JSON gives for every stage-2 and stage-3 option equal what
  deepspeed.runtime.zero's estimate_zero2/zero3_model_states_mem_needs return, exactly; the printed
  tables equal the "all cold" functions' output line for line (the device names aside, which this
  DeepSpeed prints as OffloadDeviceEnum.cpu).
- Model sizes: --hf_config files for GPT-2, BERT and LLaMA shapes give the parameter count of the
  model transformers builds from the same config (on the meta device).
- Errors: no model, --params without --largest_layer_params, an unknown preset: exit status 2,
  naming the flag.
Exit 77 (skip) when deepspeed or transformers cannot be imported; 1 under ZEAL_REQUIRE_PEERS=1.
"""
import contextlib, io, json, os, subprocess, sys, tempfile

zeal = sys.argv[1]
try:
    import torch
    import transformers
    from deepspeed.runtime.zero.stage3 import (estimate_zero3_model_states_mem_needs,
                                               estimate_zero3_model_states_mem_needs_all_cold)
    from deepspeed.runtime.zero.stage_1_and_2 import (estimate_zero2_model_states_mem_needs,
                                                      estimate_zero2_model_states_mem_needs_all_cold)
except Exception as e:  # noqa: BLE001
    print(f"SKIP: the peers' Python lacks deepspeed or transformers: {e}")
    sys.exit(1 if os.environ.get("ZEAL_REQUIRE_PEERS") == "1" else 77)

failures = 0


def check(ok, what):
    global failures
    print(("PASS: " if ok else "FAIL: ") + what)
    failures += 0 if ok else 1


def run(*args):
    return subprocess.run([zeal, "estimate-memory", *args], capture_output=True, text=True)


work = tempfile.mkdtemp()
cases = [(124439808, 38597376, 2, 1), (1_315_575_808, 102_926_336, 8, 1), (6_655_000_001, 205_852_672, 8, 4),
         (7_000_000_000, 262_144_000, 3, 2), (999_999_937, 1, 1, 1), (350_000_000, 50_000_000, 5, 3)]
for total, largest, gpus, nodes in cases:
    out = os.path.join(work, "e.json")
    r = run("--params", str(total), "--largest_layer_params", str(largest), "--num_processes", str(gpus),
            "--num_machines", str(nodes), "--stages", "3", "--offload", "none", "--json", out)
    if r.returncode != 0:
        check(False, f"zeal estimate-memory --params {total}: exit {r.returncode}: {r.stderr.strip()}")
        continue
    ds = json.load(open(out))["deepspeed"]
    bad = []
    for row in ds:
        if row["stage"] == 2:
            cpu, gpu = estimate_zero2_model_states_mem_needs(total, gpus, nodes, row["offload_optimizer"])
        else:
            cpu, gpu, _ = estimate_zero3_model_states_mem_needs(total, largest, gpus, nodes, row["offload_optimizer"],
                                                                row["offload_param"], row["zero_init"])
        if (cpu, gpu) != (row["cpu_bytes"], row["gpu_bytes"]):
            bad.append((row, cpu, gpu))
    check(not bad and len(ds) == 8,
          f"{total} parameters, largest layer {largest}, {gpus} ranks x {nodes} nodes: DeepSpeed's 8 estimates exactly"
          + (f" (first difference: {bad[0]})" if bad else ""))
    # The printed tables against the all-cold functions' output.
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        estimate_zero2_model_states_mem_needs_all_cold(total, gpus, nodes)
        print()
        estimate_zero3_model_states_mem_needs_all_cold(total, largest, gpus, nodes)
    want = buf.getvalue().replace("OffloadDeviceEnum.cpu", "cpu ").splitlines()
    got = r.stdout.splitlines()
    start = next((i for i, l in enumerate(got) if l.startswith("Estimated memory needed")), None)
    got = got[start:start + len(want)] if start is not None else []
    check(got == want, f"{total} parameters: DeepSpeed's tables line for line"
          + ("" if got == want else "\n  zeal:\n    " + "\n    ".join(got) + "\n  DeepSpeed:\n    " + "\n    ".join(want)))

# Parameter counts from config.json against the models transformers builds.
configs = {
    "gpt2": transformers.GPT2Config(n_layer=3, n_embd=96, n_head=4, vocab_size=1000, n_positions=64),
    "gpt2 with n_inner": transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=32, n_inner=200),
    "bert": transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=100,
                                    vocab_size=700, max_position_embeddings=40),
    "llama": transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=176, vocab_size=900, tie_word_embeddings=False),
    "llama tied": transformers.LlamaConfig(num_hidden_layers=3, hidden_size=32, num_attention_heads=4,
                                           intermediate_size=64, vocab_size=300, tie_word_embeddings=True),
}
for name, cfg in configs.items():
    d = os.path.join(work, name.replace(" ", "_"))
    os.makedirs(d)
    cfg.save_pretrained(d)
    with torch.device("meta"):
        if name.startswith("gpt2"):
            model = transformers.GPT2LMHeadModel(cfg)
        elif name == "bert":
            model = transformers.BertModel(cfg)
        else:
            model = transformers.LlamaForCausalLM(cfg)
    want = sum(p.numel() for p in model.parameters())  # shared parameters once
    out = os.path.join(d, "e.json")
    r = run("--hf_config", os.path.join(d, "config.json"), "--stages", "0", "--offload", "none", "--json", out)
    got = json.load(open(out))["model"]["params"] if r.returncode == 0 else f"exit {r.returncode}: {r.stderr.strip()}"
    check(got == want, f"--hf_config {name}: {got} parameters, transformers builds {want}")

for args, flag in [([], "model"), (["--params", "1e9"], "--largest_layer_params"), (["--model", "gpt5"], "--model")]:
    r = run(*args)
    check(r.returncode == 2 and flag in r.stderr, f"zeal estimate-memory {' '.join(args)}: exit 2 naming {flag}"
          + ("" if r.returncode == 2 and flag in r.stderr else f" (exit {r.returncode}: {r.stderr.strip()})"))

sys.exit(1 if failures else 0)
