// A BERT WordPiece tokenizer reading Hugging Face's tokenizer.json (the `tokenizers` library's
// format) and giving the same ids: its added tokens matched first, then BertNormalizer (clean
// text, space around CJK characters, accents stripped and lowercased when configured),
// BertPreTokenizer (split on whitespace and punctuation), WordPiece (greedy longest match,
// "##" continuations, [UNK] for a word it cannot cover or longer than max_input_chars_per_word),
// and the template "[CLS] A [SEP]" (pairs: "[CLS] A [SEP] B [SEP]"). Unicode tables from utf8proc.
// No LibTorch headers.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace zeal::text {

struct Encoding {
  std::vector<int64_t> ids;
  std::vector<int64_t> type_ids;
  std::vector<int64_t> attention_mask;
};

class WordPieceTokenizer {
 public:
  // std::runtime_error naming the file or the field when it is not a BERT WordPiece tokenizer.
  static WordPieceTokenizer from_file(const std::string& tokenizer_json);

  // max_length > 0 truncates (longest first for a pair) to that many ids, special tokens included;
  // pad_to > 0 pads with [PAD] (attention_mask 0) up to that length.
  Encoding encode(const std::string& text, int64_t max_length = 0, int64_t pad_to = 0) const;
  Encoding encode_pair(const std::string& a, const std::string& b, int64_t max_length = 0, int64_t pad_to = 0) const;
  // The WordPiece tokens of `text` (no special tokens), as strings.
  std::vector<std::string> tokenize(const std::string& text) const;

  int64_t vocab_size() const { return static_cast<int64_t>(vocab_.size()); }
  int64_t token_id(const std::string& token) const;  // -1 when absent
  int64_t pad_id() const { return pad_; }

 private:
  std::vector<int64_t> ids_of(const std::string& text) const;
  void wordpiece(const std::u32string& word, std::vector<int64_t>* out) const;
  std::u32string normalize(const std::u32string& text) const;
  void pad(Encoding* e, int64_t pad_to) const;

  std::unordered_map<std::string, int64_t> vocab_;
  std::vector<std::pair<std::string, int64_t>> added_;  // content, id (longest first)
  bool clean_text_ = true, chinese_ = true, strip_accents_ = true, lowercase_ = true;
  std::string prefix_ = "##";
  int64_t max_chars_ = 100;
  int64_t unk_ = 100, cls_ = 101, sep_ = 102, pad_ = 0;
};

}  // namespace zeal::text
