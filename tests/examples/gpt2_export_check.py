"""transformers loads the GPT example's export (engine.save_model with gpt2_export_options).

usage: gpt2_export_check.py CONFIG_DIR EXPORT_DIR ZEAL_LOGITS. CONFIG_DIR holds GPT-2's config.json
(tests/examples/gpt2_peer.py's), EXPORT_DIR model.safetensors, ZEAL_LOGITS a safetensors file with
"ids" and zeal's float32 "logits" for them. GPT2LMHeadModel.from_pretrained must find every weight
(no missing, no unexpected) and give zeal's logits. Exit 77 without transformers (1 under
ZEAL_REQUIRE_PEERS=1).
"""
import os, shutil, sys

try:
    import torch
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel
except Exception as e:  # noqa: BLE001
    print(f"SKIP: {sys.executable} lacks torch, safetensors or transformers: {e}")
    sys.exit(1 if os.environ.get("ZEAL_REQUIRE_PEERS") == "1" else 77)

config_dir, export_dir, logits_file = sys.argv[1:4]
names = sorted(load_file(os.path.join(export_dir, "model.safetensors")).keys())
# The export holds the weights; the model's own config files go beside them, as a user puts them.
for f in ("config.json", "generation_config.json"):
    if os.path.exists(os.path.join(config_dir, f)):
        shutil.copy(os.path.join(config_dir, f), os.path.join(export_dir, f))
model, info = GPT2LMHeadModel.from_pretrained(export_dir, output_loading_info=True)
missing, unexpected = sorted(info["missing_keys"]), sorted(info["unexpected_keys"])
failures = 0
if missing or unexpected or info.get("mismatched_keys"):
    print(f"FAIL: transformers: missing {missing[:4]}, unexpected {unexpected[:4]}, mismatched {info.get('mismatched_keys')}")
    failures += 1
z = load_file(logits_file)
with torch.no_grad():
    got = model.eval()(z["ids"]).logits
d = (got - z["logits"]).abs().max().item()
scale = max(1.0, z["logits"].abs().max().item())
print(f"gpt2 export: {len(names)} tensors, transformers' logits against zeal's: max |difference| {d:.2e}")
if d > 1e-4 * scale:
    print("FAIL: the logits differ")
    failures += 1
sys.exit(1 if failures else 0)
