"""Byte-level BPE tokenizers made offline with `tokenizers`, and the ids zeal's BpeTokenizer must give.

usage: bpe_peer.py OUT SOURCE_DIR. Trains on the repository's own text (README.md, docs/*.md):
  OUT/gpt2.json    GPT-2 style: ByteLevel pre-tokenizer with GPT-2's regex, <|endoftext|>;
  OUT/llama3.json  LLaMA-3 style: NFC, Split by LLaMA-3's regex then ByteLevel without a regex,
                   ignore_merges, special tokens, a template adding <|begin_of_text|>;
and writes OUT/cases.json: >= 3,000 lines (the repository's text, and lines drawn with a fixed seed
mixing scripts, emoji, digits, whitespace runs, contractions, decomposed accents, special tokens) with
each tokenizer's ids (with and without special tokens) and decode of them. Exit 77 without tokenizers
(1 under ZEAL_REQUIRE_PEERS=1).
"""
import glob, json, os, random, sys

try:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
except Exception as e:  # noqa: BLE001
    print(f"SKIP: {sys.executable} lacks tokenizers: {e}")
    sys.exit(1 if os.environ.get("ZEAL_REQUIRE_PEERS") == "1" else 77)

out, src = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
files = [os.path.join(src, "README.md")] + sorted(glob.glob(os.path.join(src, "docs", "*.md")))

LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")

gpt2 = Tokenizer(models.BPE())
gpt2.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
gpt2.decoder = decoders.ByteLevel()
gpt2.train(files, trainers.BpeTrainer(vocab_size=900, special_tokens=["<|endoftext|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
gpt2.save(os.path.join(out, "gpt2.json"))

specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
llama = Tokenizer(models.BPE(ignore_merges=True))
llama.normalizer = normalizers.NFC()
llama.pre_tokenizer = pre_tokenizers.Sequence([
    pre_tokenizers.Split(Regex(LLAMA3), behavior="isolated", invert=False),
    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
llama.decoder = decoders.ByteLevel()
llama.train(files, trainers.BpeTrainer(vocab_size=1000, special_tokens=specials,
                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
bos = llama.token_to_id("<|begin_of_text|>")
llama.post_processor = processors.Sequence([
    processors.ByteLevel(trim_offsets=False),
    processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                  special_tokens=[("<|begin_of_text|>", bos)])])
llama.save(os.path.join(out, "llama3.json"))

lines = []
for f in files:
    for line in open(f, encoding="utf-8"):
        line = line.rstrip("\n")
        if line.strip():
            lines.append(line)
rng = random.Random(1234)
words = [w for l in lines for w in l.split()][:5000]
pieces = [
    lambda: rng.choice(words),
    lambda: str(rng.randint(0, 10 ** rng.randint(1, 12))),
    lambda: " " * rng.randint(2, 7),
    lambda: rng.choice(["\t", "\t\t", "\n", "\r\n", "\n\n", " \n ", "\u00a0", "\u3000", "\u2003", "\u200b"]),
    lambda: rng.choice(["😀", "👍🏽", "👨‍👩‍👧", "🇫🇷", "❤️", "🧪🚀", "✨"]),
    lambda: "".join(chr(rng.randint(0x4E00, 0x9FA5)) for _ in range(rng.randint(1, 6))),
    lambda: rng.choice(["Привет", "мир", "مرحبا", "नमस्ते", "こんにちは", "안녕하세요", "Γειά", "שלום", "ñandú", "Ærø"]),
    lambda: rng.choice(["it's", "I'LL", "we've", "they'd", "She'S", "you're", "can't", "'m", "o'clock"]),
    lambda: rng.choice(["e\u0301", "A\u030a", "n\u0303o", "\u00e9", "ﬁ", "①", "ｱ", "Ⅻ"]),
    lambda: rng.choice(["...", "!!", "?!", "--", "==>", "(x)", "[1]", "{}", "#include", "<|", "|>", "$$", "@@"]),
    lambda: rng.choice(specials + ["<|endoftext|>"]),
]
while len(lines) < 3200:
    lines.append("".join(rng.choice(pieces)() for _ in range(rng.randint(1, 14))))

cases = {"lines": lines}
for name, tok in (("gpt2", gpt2), ("llama3", llama)):
    with_special = tok.encode_batch(lines)
    without = tok.encode_batch(lines, add_special_tokens=False)
    cases[name] = [e.ids for e in with_special]
    cases[name + "_plain"] = [e.ids for e in without]
    cases[name + "_decoded"] = tok.decode_batch([e.ids for e in with_special], skip_special_tokens=False)
    cases[name + "_decoded_skip"] = tok.decode_batch([e.ids for e in with_special], skip_special_tokens=True)
# ignore_merges where it matters: "abc" is in the vocabulary but no merge makes it.
crafted = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
           "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
           "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                                                "use_regex": True},
           "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                     "vocab": {"a": 0, "b": 1, "c": 2, "\u0120": 3, "ab": 4, "abc": 5, "\u0120a": 6},
                     "merges": [["a", "b"], ["\u0120", "a"]]}}
json.dump(crafted, open(os.path.join(out, "crafted.json"), "w"))
tok = Tokenizer.from_file(os.path.join(out, "crafted.json"))
cases["crafted_lines"] = ["abc", "abcabc", " abc", "ab c", "cab", "abc abc"]
cases["crafted"] = [tok.encode(l).ids for l in cases["crafted_lines"]]
assert cases["crafted"][0] == [5], cases["crafted"]
json.dump(cases, open(os.path.join(out, "cases.json"), "w"), ensure_ascii=False)
print(f"{len(lines)} lines, {sum(len(x) for x in cases['gpt2'])} GPT-2-style ids, {sum(len(x) for x in cases['llama3'])} LLaMA-3-style ids")
