"""Cross-checks zeal against Python transformers, tokenizers and peft on all-MiniLM-L6-v2.

    minilm_check.py MODEL_DIR ZEAL_CLI MINILM_CHECK WORK_DIR

1. tokenizers' ids equal zeal's on every line of SENTENCES (a few thousand, built from the Debian
   package descriptions on this machine when they are there); transformers' BertModel hidden states
   and mean-pooled embeddings equal zeal's (<= 1e-5).
2. LoRA (query, value; the classifier saved whole), 20 AdamW steps: zeal under stage 0 on one rank
   and stage 3 on two ranks, Python peft starting from zeal's initial adapter: losses within 1e-4
   relative; peft loads zeal's final adapter and gives zeal's logits (<= 1e-5); zeal loads the
   adapter Python saved and gives Python's logits.
Exit 77 (skipped) when this Python lacks torch, transformers, tokenizers or peft.
"""
import json
import os
import subprocess
import sys

try:
    import torch
    import transformers
    import tokenizers
    import peft
except ImportError as e:  # pragma: no cover
    print(f"SKIP: {sys.executable} lacks {e.name} (scripts/peers installs it)")
    sys.exit(1 if os.environ.get("ZEAL_REQUIRE_PEERS") == "1" else 77)

model_dir, zeal_cli, tool, work = sys.argv[1:5]
os.makedirs(work, exist_ok=True)
torch.manual_seed(0)
torch.set_num_threads(1)
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


# --- sentences ---------------------------------------------------------------------------------
sentences = []
try:
    out = subprocess.run(["apt-cache", "dumpavail"], capture_output=True, text=True, timeout=120).stdout
    for line in out.splitlines():
        if line.startswith("Description: "):
            sentences.append(line[len("Description: "):])
        if len(sentences) >= 3000:
            break
except (OSError, subprocess.SubprocessError):
    pass
sentences += [
    "The quick brown fox jumps over the lazy dog.",
    "Crème brûlée, naïve café — déjà vu!",
    "Zürich's Straße has 3.5 km of ünïcödé",
    "中文字符 and English mixed",
    "tabs\tand\nnewlines and  double  spaces",
    "[CLS] literal special tokens [SEP] inside [MASK] text",
    "supercalifragilisticexpialidocious" * 5,
    "emoji 😀 and symbols ©®™ ±×÷",
]
sent_file = os.path.join(work, "sentences.txt")
with open(sent_file, "w") as f:
    f.write("\n".join(s.replace("\n", " ") for s in sentences) + "\n")
sentences = [s for s in open(sent_file).read().split("\n") if s]

# --- tokenizer and encoder -----------------------------------------------------------------------
embed_json = os.path.join(work, "embed.json")
subprocess.run([tool, "embed", model_dir, sent_file, embed_json], check=True)
z = json.load(open(embed_json))
tok = tokenizers.Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
tok.no_padding()
tok.enable_truncation(128)
bad = [i for i, s in enumerate(sentences) if tok.encode(s).ids != z["ids"][i]]
check(not bad, f"tokenizer ids equal tokenizers' on {len(sentences)} sentences"
      + (f" (first difference at line {bad[0] + 1}: {sentences[bad[0]]!r})" if bad else ""))

model = transformers.BertModel.from_pretrained(model_dir, attn_implementation="eager").eval()
tok.enable_padding(length=24, pad_id=0, pad_token="[PAD]")
tok.enable_truncation(24)
n = min(len(sentences), 32)
enc = tok.encode_batch(sentences[:n])
ids = torch.tensor([e.ids for e in enc])
mask = torch.tensor([e.attention_mask for e in enc])
with torch.no_grad():
    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
m = mask.unsqueeze(-1).float()
emb = (hidden * m).sum(1) / m.sum(1).clamp_min(1e-9)
emb = torch.nn.functional.normalize(emb, dim=1)


def tensor(j):
    return torch.tensor(j["values"], dtype=torch.float64).view(j["shape"])


real = mask.bool()
dh = (tensor(z["hidden"])[real] - hidden.double()[real]).abs().max().item()
de = (tensor(z["embeddings"]) - emb.double()).abs().max().item()
check(dh <= 1e-5, f"hidden states of the real tokens equal transformers' (max |difference| {dh:.2e})")
check(de <= 1e-5, f"sentence embeddings equal sentence-transformers' mean pooling (max |difference| {de:.2e})")

# --- LoRA against peft ---------------------------------------------------------------------------
STEPS, BATCH, LABELS = 20, 8, 3


def batch(begin, count):
    rows = [sentences[(begin + i) % len(sentences)] for i in range(count)]
    e = tok.encode_batch(rows)
    labels = [((i * 7 + i // 3) % LABELS) for i in range(begin, begin + count)]
    return torch.tensor([x.ids for x in e]), torch.tensor([x.attention_mask for x in e]), torch.tensor(labels)


def run_zeal(name, nproc, config, port, mode="train"):
    out = os.path.join(work, name)
    os.makedirs(out, exist_ok=True)
    # Its own port: other tests launch ranks at the same time.
    cmd = [zeal_cli, "launch", "--num_processes", str(nproc), "--main_process_port", str(port), tool, mode,
           model_dir, sent_file, out,
           "--config_file", config]
    subprocess.run(cmd, check=True)
    return out, json.load(open(os.path.join(out, "result.json")))


def python_model():
    base = transformers.BertForSequenceClassification.from_pretrained(
        model_dir, num_labels=LABELS, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation="eager")
    return base


z0_dir, z0 = run_zeal("stage0", 1, "configs/single_process.yaml", 29541)
z3_dir, z3 = run_zeal("stage3", 2, "configs/zero3.yaml", 29542)

pm = peft.PeftModel.from_pretrained(python_model(), os.path.join(z0_dir, "initial"), is_trainable=True)
# The classifier's original (peft's ModulesToSaveWrapper.original_module) is zeal's as it was before
# training: the trained copy's initial values, which the initial adapter file holds.
with torch.no_grad():
    wrapper = pm.base_model.model.classifier
    for name, p in wrapper.original_module.named_parameters():
        p.copy_(dict(wrapper.modules_to_save["default"].named_parameters())[name])
pm.train()
opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)
py_losses = []
for s in range(STEPS):
    i, msk, y = batch((s % 2) * BATCH, BATCH)
    loss = torch.nn.functional.cross_entropy(pm(input_ids=i, attention_mask=msk).logits, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    py_losses.append(loss.item())
print("peft losses  :", " ".join(f"{x:.5f}" for x in py_losses))
for name, r in (("stage 0, 1 rank", z0), ("stage 3, 2 ranks", z3)):
    print(f"zeal {name}:", " ".join(f"{x:.5f}" for x in r["losses"]))
    rel = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], py_losses))
    check(rel <= 1e-4, f"zeal {name}: the 20 losses equal peft's (max relative difference {rel:.2e})")
check(py_losses[-1] < py_losses[0], f"the loss falls ({py_losses[0]:.4f} -> {py_losses[-1]:.4f})")

i, msk, _ = batch(0, BATCH)
pm.eval()
with torch.no_grad():
    py_logits = pm(input_ids=i, attention_mask=msk).logits.double()
    loaded = peft.PeftModel.from_pretrained(python_model(), os.path.join(z0_dir, "final")).eval()
    zeal_in_py = loaded(input_ids=i, attention_mask=msk).logits.double()
d = (zeal_in_py - tensor(z0["logits"])).abs().max().item()
check(d <= 1e-5, f"peft loads zeal's adapter and gives zeal's logits (max |difference| {d:.2e})")
d3 = (tensor(z3["logits"]) - tensor(z0["logits"])).abs().max().item()
check(d3 <= 1e-4, f"stage 3 on 2 ranks gives stage 0's logits (max |difference| {d3:.2e})")
# disable_adapter(): no adapters and the classifier's original values, as peft's context gives.
with torch.no_grad(), pm.disable_adapter():
    py_disabled = pm(input_ids=i, attention_mask=msk).logits.double()
moved = (py_disabled - py_logits).abs().max().item()
check(moved > 1e-2, f"training moved the logits away from the disabled model's ({moved:.2e}), so the next checks can fail")
for name, r in (("stage 0", z0), ("stage 3", z3)):
    dd = (tensor(r["disabled_logits"]) - py_disabled).abs().max().item()
    check(dd <= 1e-4, f"zeal {name}: disable_adapter() gives peft's disable_adapter() logits (max |difference| {dd:.2e})")

# --- exports (engine.save_model) in transformers ---------------------------------------------------
# A model whose encoder layers are zeal::Sharded units, exported after training: transformers loads
# it with no missing or unexpected names, and gives zeal's logits; with LoRA the export is the base
# model (no adapter tensors) and peft adds the adapter file to it.
import safetensors.torch


def load_export(path):
    names = list(safetensors.torch.load_file(os.path.join(path, "model.safetensors")).keys())
    bad = [n for n in names if ".block." in n or "lora_" in n]
    check(not bad, f"{path}: {len(names)} tensors, none with Sharded's block level or an adapter's name {bad[:3]}")
    # The model's own config.json beside the weights (save_model writes the weights only).
    cfg = transformers.AutoConfig.from_pretrained(model_dir, num_labels=LABELS, hidden_dropout_prob=0.0,
                                                  attention_probs_dropout_prob=0.0)
    model, info = transformers.BertForSequenceClassification.from_pretrained(
        path, config=cfg, attn_implementation="eager", output_loading_info=True)
    missing, unexpected = sorted(info["missing_keys"]), sorted(info["unexpected_keys"])
    check(not missing and not unexpected, f"{path}: transformers finds every weight (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return model.eval()


for name, nproc, config, port in (("export_stage0", 1, "configs/single_process.yaml", 29551),
                                  ("export_stage3", 2, "configs/zero3.yaml", 29552)):
    e_dir, e = run_zeal(name, nproc, config, port, mode="export")
    with torch.no_grad():
        got = load_export(os.path.join(e_dir, "export"))(input_ids=i, attention_mask=msk).logits.double()
    d = (got - tensor(e["logits"])).abs().max().item()
    check(d <= 1e-5, f"{name}: transformers loads the fine-tuned export and gives zeal's logits (max |difference| {d:.2e})")
for name, d_dir, r in (("stage 0", z0_dir, z0), ("stage 3", z3_dir, z3)):
    with torch.no_grad():
        lm = peft.PeftModel.from_pretrained(load_export(os.path.join(d_dir, "export")), os.path.join(d_dir, "final")).eval()
        got = lm(input_ids=i, attention_mask=msk).logits.double()
    d = (got - tensor(r["logits"])).abs().max().item()
    check(d <= 1e-5, f"LoRA {name}: the export plus peft's adapter gives zeal's logits (max |difference| {d:.2e})")

# save_model with `merged`: transformers alone (no peft) gives zeal's logits, and every weight is
# peft's merge_and_unload of the plain export and zeal's adapter.
for name, d_dir, r in (("stage 0", z0_dir, z0), ("stage 3", z3_dir, z3)):
    with torch.no_grad():
        merged = load_export(os.path.join(d_dir, "export_merged"))
        got = merged(input_ids=i, attention_mask=msk).logits.double()
        ref = peft.PeftModel.from_pretrained(load_export(os.path.join(d_dir, "export")), os.path.join(d_dir, "final")).merge_and_unload()
        want = dict(ref.state_dict())
        wd = max((v.double() - want[k].double()).abs().max().item() for k, v in merged.state_dict().items())
        changed = max((merged.state_dict()[k].double() - v.double()).abs().max().item()
                      for k, v in load_export(os.path.join(d_dir, "export")).state_dict().items())
    d = (got - tensor(r["logits"])).abs().max().item()
    check(d <= 1e-5, f"LoRA {name}: the merged export alone in transformers gives zeal's logits (max |difference| {d:.2e})")
    check(changed > 1e-4 and wd <= 1e-6,
          f"LoRA {name}: the merged export's weights are peft's merge_and_unload's (max |difference| {wd:.2e}; merging moved them by {changed:.2e})")

# save_merged before merging: the base model, the classifier's original values (transformers loads
# it and gives the disabled model's logits).
for name, d_dir in (("stage 0", z0_dir), ("stage 3", z3_dir)):
    with torch.no_grad():
        got = load_export(os.path.join(d_dir, "base"))(input_ids=i, attention_mask=msk).logits.double()
    d = (got - py_disabled).abs().max().item()
    check(d <= 1e-4, f"{name}: save_merged's base model in transformers gives the disabled model's logits (max |difference| {d:.2e})")

py_dir = os.path.join(work, "python_adapter")
pm.save_pretrained(py_dir)
ev = os.path.join(work, "eval.json")
subprocess.run([tool, "eval", model_dir, sent_file, py_dir, ev], check=True)
d = (tensor(json.load(open(ev))["logits"]) - py_logits).abs().max().item()
check(d <= 1e-5, f"zeal loads the adapter peft saved and gives peft's logits (max |difference| {d:.2e})")

print(f"transformers {transformers.__version__}, tokenizers {tokenizers.__version__}, peft {peft.__version__}, torch {torch.__version__}")
sys.exit(1 if failures else 0)
