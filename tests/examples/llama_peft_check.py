"""Python peft and transformers reading what zeal wrote for the small LLaMA (tests/examples/llama_test.cpp).

usage: llama_peft_check.py DIR. DIR/untied is the base checkpoint; DIR/zeal_adapter zeal's adapter
(PeftModel.save_pretrained's format) with DIR/zeal_logits.safetensors zeal's float64 logits of
expected.safetensors' ids and attention_mask under it; DIR/zeal_merged zeal's merged export. Checks
PeftModel.from_pretrained(LlamaForCausalLM) on zeal's adapter gives zeal's logits (1e-9 of their
scale, float64) and the merged export, loaded with from_pretrained, the PeftModel's (1e-5: its
weights pass through float32). Exit 77 without peft (1 under ZEAL_REQUIRE_PEERS=1).
"""
import os, shutil, sys

try:
    import peft
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM
except Exception as e:  # noqa: BLE001
    print(f"SKIP: {sys.executable} lacks peft, torch or transformers: {e}")
    sys.exit(1 if os.environ.get("ZEAL_REQUIRE_PEERS") == "1" else 77)

d = sys.argv[1]
base = os.path.join(d, "untied")
e = load_file(os.path.join(base, "expected.safetensors"))
ids, mask = e["ids"], e["attention_mask"]
keep = mask.bool()
zeal = load_file(os.path.join(d, "zeal_logits.safetensors"))["logits"]
failures = 0

def close(a, b, rel, what):
    global failures
    scale = max(1.0, b[keep].abs().max().item())
    diff = (a[keep] - b[keep]).abs().max().item()
    ok = diff <= rel * scale
    failures += not ok
    print(f"{'ok' if ok else 'FAIL'}: {what}: largest difference {diff:.3g} at a scale of {scale:.3g}")

with torch.no_grad():
    model = LlamaForCausalLM.from_pretrained(base, attn_implementation="sdpa").double().eval()
    pm = peft.PeftModel.from_pretrained(model, os.path.join(d, "zeal_adapter")).eval()
    with_adapter = pm(ids, attention_mask=mask).logits
    close(with_adapter, zeal, 1e-9, "PeftModel.from_pretrained on zeal's adapter vs zeal")
    shutil.copy(os.path.join(base, "config.json"), os.path.join(d, "zeal_merged", "config.json"))
    merged = LlamaForCausalLM.from_pretrained(os.path.join(d, "zeal_merged"), attn_implementation="sdpa").double().eval()
    close(merged(ids, attention_mask=mask).logits, with_adapter, 1e-5, "zeal's merged export vs the PeftModel")
sys.exit(1 if failures else 0)
