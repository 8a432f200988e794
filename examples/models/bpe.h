// A byte-level BPE tokenizer reading Hugging Face's tokenizer.json (GPT-2, LLaMA-3 and Qwen style)
// and giving the `tokenizers` library's ids: added tokens matched first, the normalizer (none, NFC,
// NFKC), the pre-tokenizer (ByteLevel with GPT-2's regex, or a Split by the file's regex followed by
// ByteLevel), GPT-2's byte-to-unicode map, the merges by rank (ignore_merges: a word in the
// vocabulary is one token), the post-processor's template (a BOS token, say) and the ByteLevel
// decoder. The pre-tokenizer's regex runs on PCRE2 with Unicode properties. No LibTorch headers.
//
//   auto tok = zeal::text::BpeTokenizer::from_file(dir + "/tokenizer.json");
//   std::vector<int64_t> ids = tok.encode("Hello, world!");
//   std::string text = tok.decode(ids, /*skip_special_tokens=*/true);
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace zeal::text {

class BpeTokenizer {
 public:
  // std::runtime_error naming the file and the field for what is not a byte-level BPE tokenizer
  // this class computes (another model or pre-tokenizer, byte_fallback, dropout, a bad regex).
  static BpeTokenizer from_file(const std::string& tokenizer_json);
  BpeTokenizer(BpeTokenizer&&) noexcept;
  BpeTokenizer& operator=(BpeTokenizer&&) noexcept;
  ~BpeTokenizer();

  // The ids of `text`; with add_special_tokens, the post-processor's template around them.
  std::vector<int64_t> encode(const std::string& text, bool add_special_tokens = true) const;
  // The text of `ids` (bytes that are not valid UTF-8 become U+FFFD, as `tokenizers` does).
  std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens = false) const;

  int64_t vocab_size() const;
  int64_t token_id(const std::string& token) const;  // -1 when absent
  const std::string& token(int64_t id) const;         // zeal::Error-free: std::out_of_range when absent
  bool is_special(int64_t id) const;

 private:
  struct Impl;
  explicit BpeTokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zeal::text
