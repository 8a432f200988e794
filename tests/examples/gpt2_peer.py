"""A small GPT-2 checkpoint made with transformers and the logits the GPT example must reproduce.

usage: gpt2_peer.py OUT. Writes OUT/config.json and model.safetensors (GPT2LMHeadModel.save_pretrained:
Conv1D weights stored [in, out]) and OUT/expected.safetensors: ids [2, 9] and the float64 logits.
Exit 77 without transformers (1 under ZEAL_REQUIRE_PEERS=1).
"""
import os, sys

try:
    import torch
    from safetensors.torch import save_file
    from transformers import GPT2Config, GPT2LMHeadModel
except Exception as e:  # noqa: BLE001
    print(f"SKIP: {sys.executable} lacks torch, safetensors or transformers: {e}")
    sys.exit(1 if os.environ.get("ZEAL_REQUIRE_PEERS") == "1" else 77)

out = sys.argv[1]
torch.manual_seed(0)
config = GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=4, initializer_range=0.2, bos_token_id=0, eos_token_id=0,
                    attn_implementation="sdpa")
model = GPT2LMHeadModel(config).eval()
model.save_pretrained(out)
ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(5))
with torch.no_grad():
    logits = model.double()(ids).logits
save_file({"ids": ids, "logits": logits.contiguous()}, os.path.join(out, "expected.safetensors"))
print(f"gpt2: {sum(p.numel() for p in model.parameters())} parameters, logits {tuple(logits.shape)}")
