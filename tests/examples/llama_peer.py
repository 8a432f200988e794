"""Makes small LLaMA checkpoints with transformers and the logits zeal's decoder must reproduce.

usage: llama_peer.py OUT. Writes OUT/untied and OUT/tied (LlamaForCausalLM.save_pretrained: grouped-query
attention, 4 heads over 2 key-value heads; an untied and a tied head) and OUT/<name>/expected.safetensors:
ids [3, 11], attention_mask (row 1 left-padded, row 2 right-padded), right_mask (row 2 right-padded),
labels (-100 on right_mask's padding and the first two tokens), and in float64 the logits without a
mask, with attention_mask, and the loss of the labels with right_mask; OUT/<name>/generation.json:
transformers' greedy generate of 3 left-padded prompts, without an EOS and with one a row reaches
early. The attention is torch's SDPA
(transformers' eager attention takes its softmax in float32 even in a float64 model).
Exit 77 without transformers (1 under ZEAL_REQUIRE_PEERS=1).
"""
import json, os, sys

try:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM
except Exception as e:  # noqa: BLE001
    print(f"SKIP: {sys.executable} lacks torch, safetensors or transformers: {e}")
    sys.exit(1 if os.environ.get("ZEAL_REQUIRE_PEERS") == "1" else 77)

out = sys.argv[1]
for name, tied in (("untied", False), ("tied", True)):
    torch.manual_seed(0 if tied else 1)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rms_norm_eps=1e-5, rope_theta=500.0, initializer_range=0.2,
                         tie_word_embeddings=tied, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    d = os.path.join(out, name)
    model.save_pretrained(d)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 97, (3, 11), generator=g)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, -2:] = 0
    # The loss with right padding only (a left-padded row's first positions see no key: transformers
    # gives them NaN logits, and NaN times an ignored label is still NaN).
    right = torch.ones(3, 11, dtype=torch.long)
    right[2, -2:] = 0
    labels = ids.clone()
    labels[right == 0] = -100
    labels[:, :2] = -100
    model = model.double()
    with torch.no_grad():
        plain = model(ids).logits
        masked = model(ids, attention_mask=mask).logits
        result = model(ids, attention_mask=right, labels=labels)
        # transformers' causal-LM loss (position t predicts label t + 1, -100 ignored, the mean), in
        # float64: its own casts the logits to float32 first.
        loss = torch.nn.functional.cross_entropy(result.logits[:, :-1].reshape(-1, config.vocab_size),
                                                 labels[:, 1:].reshape(-1), ignore_index=-100)
        assert abs(loss.item() - result.loss.item()) < 1e-5 * abs(loss.item()), (loss.item(), result.loss.item())
    save_file({"ids": ids, "attention_mask": mask, "right_mask": right, "labels": labels, "logits": plain.contiguous(),
               "logits_masked": masked.contiguous(), "loss": loss.reshape(1)},
              os.path.join(d, "expected.safetensors"))
    # Greedy generation of 3 prompts of different lengths, left-padded, with an EOS that one row
    # reaches early (the token it generates third without one).
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5], [9, 8]]
    width = max(len(p) for p in prompts)
    batch = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        free = model.generate(batch, attention_mask=attn, max_new_tokens=8, do_sample=False, pad_token_id=0,
                              eos_token_id=None)
        eos = int(free[0, width + 2])
        stopped = model.generate(batch, attention_mask=attn, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                 eos_token_id=eos)
    def new_tokens(out):
        rows = []
        for r in out[:, width:].tolist():
            rows.append(r[: r.index(eos) + 1] if eos in r else r)
        return rows
    # A LoRA adapter made by Python peft (B random, so it is not a no-op) and its float64 logits.
    try:
        import peft
        lc = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False,
                             task_type="CAUSAL_LM")
        torch.manual_seed(3)
        pm = peft.get_peft_model(LlamaForCausalLM.from_pretrained(d).double().eval(), lc).eval()
        pm.save_pretrained(os.path.join(d, "py_adapter"))
        with torch.no_grad():
            save_file({"logits": pm(ids, attention_mask=mask).logits.contiguous()}, os.path.join(d, "py_adapter_logits.safetensors"))
    except ImportError as e:
        print(f"SKIP: no peft: {e}")
        sys.exit(1 if os.environ.get("ZEAL_REQUIRE_PEERS") == "1" else 77)
    json.dump({"prompts": prompts, "free": [r for r in free[:, width:].tolist()], "eos": eos,
               "stopped": new_tokens(stopped)}, open(os.path.join(d, "generation.json"), "w"))
    print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters, logits {tuple(plain.shape)}, loss {loss.item():.6f}")
