"""A small LLaMA, its tokenizer and a synthetic instruction task, made offline for finetune_causal_lm.

usage: causal_lm_peer.py OUT. OUT/model: LlamaForCausalLM.save_pretrained (random weights) and a
LLaMA-3-style byte-level BPE tokenizer.json trained with `tokenizers` on the task's text, with the chat
template's tokens (<|bos|>, <|pad|>, <|user|>, <|assistant|>, <|system|>, <|end|>) as special tokens;
OUT/train.jsonl and OUT/eval.jsonl: "reverse: a b c" -> "c b a" over 6 letters; OUT/pretrain.jsonl:
"copy: a b c" -> "a b c". Also, given
`check OUT`, loads OUT/lora/adapter with peft onto its base and OUT/lora/merged with from_pretrained
(no missing or unexpected keys). Exit 77 without transformers, tokenizers or peft (1 under
ZEAL_REQUIRE_PEERS=1).
"""
import json, os, random, sys

try:
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM
    import peft
except Exception as e:  # noqa: BLE001
    print(f"SKIP: {sys.executable} lacks torch, tokenizers, transformers or peft: {e}")
    sys.exit(1 if os.environ.get("ZEAL_REQUIRE_PEERS") == "1" else 77)

if sys.argv[1] == "check":
    out = sys.argv[2]
    pretrained = os.path.join(out, "pretrained", "merged")
    base = LlamaForCausalLM.from_pretrained(pretrained if os.path.isdir(pretrained) else os.path.join(out, "model"))
    pm = peft.PeftModel.from_pretrained(base, os.path.join(out, "lora", "adapter"))
    merged, info = LlamaForCausalLM.from_pretrained(os.path.join(out, "lora", "merged"), output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    print(f"peft loaded zeal's adapter ({sum(p.numel() for n, p in pm.named_parameters() if 'lora_' in n)} adapter "
          f"parameters); merged: {bad or 'every key'}")
    sys.exit(1 if bad else 0)

out = sys.argv[1]
rng = random.Random(7)
letters = "abcdef"
def record(task="reverse"):
    w = [rng.choice(letters) for _ in range(rng.randint(2, 4))]
    answer = reversed(w) if task == "reverse" else w
    return {"prompt": task + ": " + " ".join(w), "response": " ".join(answer)}
train = [record() for _ in range(256)]
held = [record() for _ in range(24)]
pretrain = [record("copy") for _ in range(256)]
os.makedirs(os.path.join(out, "model"), exist_ok=True)
for name, rows in (("train", train), ("eval", held), ("pretrain", pretrain)):
    with open(os.path.join(out, name + ".jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
specials = ["<|bos|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
tok = Tokenizer(models.BPE(ignore_merges=True))
tok.pre_tokenizer = pre_tokenizers.Sequence([
    pre_tokenizers.Split(Regex(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
                         behavior="isolated"),
    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
tok.decoder = decoders.ByteLevel()
text = [r["prompt"] + "\n" + r["response"] for r in train + pretrain]
tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", tok.token_to_id("<|bos|>"))])
tok.save(os.path.join(out, "model", "tokenizer.json"))
torch.manual_seed(0)
config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                     bos_token_id=tok.token_to_id("<|bos|>"), eos_token_id=tok.token_to_id("<|end|>"),
                     pad_token_id=tok.token_to_id("<|pad|>"))
LlamaForCausalLM(config).save_pretrained(os.path.join(out, "model"))
print(f"{len(train)} training and {len(held)} held-out records; vocabulary {tok.get_vocab_size()}")
