#include "examples/models/wordpiece.h"

#include <utf8proc.h>

#include <algorithm>
#include <fstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "examples/models/hf_config.h"

namespace zeal::text {
namespace {

using json = nlohmann::json;

std::u32string decode(const std::string& s) {
  std::u32string out;
  out.reserve(s.size());
  const auto* p = reinterpret_cast<const utf8proc_uint8_t*>(s.data());
  utf8proc_ssize_t left = static_cast<utf8proc_ssize_t>(s.size());
  while (left > 0) {
    utf8proc_int32_t cp = 0;
    utf8proc_ssize_t n = utf8proc_iterate(p, left, &cp);
    if (n <= 0) {  // not UTF-8: one byte becomes U+FFFD (which clean_text drops)
      out.push_back(0xFFFD);
      n = 1;
    } else {
      out.push_back(static_cast<char32_t>(cp));
    }
    p += n;
    left -= n;
  }
  return out;
}

std::string encode_utf8(const std::u32string& s) {
  std::string out;
  utf8proc_uint8_t buf[4];
  for (char32_t c : s) {
    const auto n = utf8proc_encode_char(static_cast<utf8proc_int32_t>(c), buf);
    out.append(reinterpret_cast<const char*>(buf), static_cast<size_t>(n));
  }
  return out;
}

utf8proc_category_t category(char32_t c) { return utf8proc_category(static_cast<utf8proc_int32_t>(c)); }

// Rust's char::is_whitespace (the White_Space property), which `tokenizers` uses.
bool is_whitespace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) ||
         c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

bool is_control(char32_t c) {
  if (c == '\t' || c == '\n' || c == '\r') return false;
  switch (category(c)) {
    case UTF8PROC_CATEGORY_CC:
    case UTF8PROC_CATEGORY_CF:
    case UTF8PROC_CATEGORY_CN:
    case UTF8PROC_CATEGORY_CO:
    case UTF8PROC_CATEGORY_CS: return true;
    default: return false;
  }
}

bool is_chinese(char32_t c) {
  return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) || (c >= 0x20000 && c <= 0x2A6DF) ||
         (c >= 0x2A700 && c <= 0x2B73F) || (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B820 && c <= 0x2CEAF) ||
         (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

bool is_punctuation(char32_t c) {
  if (c < 128) return (c >= 33 && c <= 47) || (c >= 58 && c <= 64) || (c >= 91 && c <= 96) || (c >= 123 && c <= 126);
  switch (category(c)) {
    case UTF8PROC_CATEGORY_PC:
    case UTF8PROC_CATEGORY_PD:
    case UTF8PROC_CATEGORY_PS:
    case UTF8PROC_CATEGORY_PE:
    case UTF8PROC_CATEGORY_PI:
    case UTF8PROC_CATEGORY_PF:
    case UTF8PROC_CATEGORY_PO: return true;
    default: return false;
  }
}

}  // namespace

WordPieceTokenizer WordPieceTokenizer::from_file(const std::string& path) {
  const json j = models::read_config_json(path);
  WordPieceTokenizer t;
  try {
    const json& m = j.at("model");
    if (m.value("type", "") != "WordPiece") throw std::runtime_error(path + ": model.type is not WordPiece");
    for (auto it = m.at("vocab").begin(); it != m.at("vocab").end(); ++it) t.vocab_[it.key()] = it.value().get<int64_t>();
    t.prefix_ = m.value("continuing_subword_prefix", std::string("##"));
    t.max_chars_ = m.value("max_input_chars_per_word", int64_t{100});
    const std::string unk = m.value("unk_token", std::string("[UNK]"));
    if (!t.vocab_.count(unk)) throw std::runtime_error(path + ": the unk_token '" + unk + "' is not in the vocabulary");
    t.unk_ = t.vocab_.at(unk);
    if (j.contains("normalizer") && !j["normalizer"].is_null()) {
      const json& n = j["normalizer"];
      if (n.value("type", "") != "BertNormalizer") throw std::runtime_error(path + ": normalizer.type is not BertNormalizer");
      t.clean_text_ = n.value("clean_text", true);
      t.chinese_ = n.value("handle_chinese_chars", true);
      t.lowercase_ = n.value("lowercase", true);
      t.strip_accents_ = n.contains("strip_accents") && !n["strip_accents"].is_null() ? n["strip_accents"].get<bool>() : t.lowercase_;
    }
    for (const auto& a : j.value("added_tokens", json::array())) {
      t.added_.push_back({a.at("content").get<std::string>(), a.at("id").get<int64_t>()});
    }
    std::sort(t.added_.begin(), t.added_.end(), [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
    auto id_of = [&](const char* tok) {
      auto it = t.vocab_.find(tok);
      if (it == t.vocab_.end()) throw std::runtime_error(path + ": the vocabulary has no " + std::string(tok));
      return it->second;
    };
    t.cls_ = id_of("[CLS]");
    t.sep_ = id_of("[SEP]");
    t.pad_ = j.contains("padding") && j["padding"].is_object() ? j["padding"].value("pad_id", id_of("[PAD]")) : id_of("[PAD]");
  } catch (const json::exception& e) {
    throw std::runtime_error(path + ": not a WordPiece tokenizer.json: " + e.what());
  }
  return t;
}

int64_t WordPieceTokenizer::token_id(const std::string& token) const {
  auto it = vocab_.find(token);
  return it == vocab_.end() ? -1 : it->second;
}

std::u32string WordPieceTokenizer::normalize(const std::u32string& text) const {
  std::u32string s;
  s.reserve(text.size());
  for (char32_t c : text) {
    if (clean_text_) {
      if (c == 0 || c == 0xFFFD || is_control(c)) continue;
      if (is_whitespace(c)) c = ' ';
    }
    if (chinese_ && is_chinese(c)) {
      s.push_back(' ');
      s.push_back(c);
      s.push_back(' ');
    } else {
      s.push_back(c);
    }
  }
  if (strip_accents_) {
    std::u32string d;
    d.reserve(s.size());
    utf8proc_int32_t buf[32];
    for (char32_t c : s) {
      int last = 0;
      const auto n = utf8proc_decompose_char(static_cast<utf8proc_int32_t>(c), buf, 32, UTF8PROC_DECOMPOSE, &last);
      if (n < 0) {
        d.push_back(c);
        continue;
      }
      for (utf8proc_ssize_t i = 0; i < n; ++i) {
        if (utf8proc_category(buf[i]) != UTF8PROC_CATEGORY_MN) d.push_back(static_cast<char32_t>(buf[i]));
      }
    }
    s.swap(d);
  }
  if (lowercase_) {
    std::u32string l;
    l.reserve(s.size());
    for (char32_t c : s) {
      if (c == 0x130) {  // İ: Unicode's full lowercase mapping is two characters
        l.push_back('i');
        l.push_back(0x307);
      } else {
        l.push_back(static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(c))));
      }
    }
    s.swap(l);
  }
  return s;
}

void WordPieceTokenizer::wordpiece(const std::u32string& word, std::vector<int64_t>* out) const {
  if (static_cast<int64_t>(word.size()) > max_chars_) {
    out->push_back(unk_);
    return;
  }
  std::vector<int64_t> pieces;
  size_t start = 0;
  while (start < word.size()) {
    size_t end = word.size();
    int64_t found = -1;
    while (start < end) {
      std::string sub = encode_utf8(word.substr(start, end - start));
      if (start > 0) sub = prefix_ + sub;
      auto it = vocab_.find(sub);
      if (it != vocab_.end()) {
        found = it->second;
        break;
      }
      --end;
    }
    if (found < 0) {
      out->push_back(unk_);
      return;
    }
    pieces.push_back(found);
    start = end;
  }
  out->insert(out->end(), pieces.begin(), pieces.end());
}

std::vector<int64_t> WordPieceTokenizer::ids_of(const std::string& text) const {
  std::vector<int64_t> ids;
  // Added tokens ([CLS], [MASK] ...) are found in the raw text first, as `tokenizers` does.
  size_t pos = 0;
  auto plain = [&](const std::string& piece) {
    const std::u32string s = normalize(decode(piece));
    std::u32string word;
    auto flush = [&] {
      if (!word.empty()) wordpiece(word, &ids);
      word.clear();
    };
    for (char32_t c : s) {
      if (is_whitespace(c)) {
        flush();
      } else if (is_punctuation(c)) {
        flush();
        wordpiece(std::u32string(1, c), &ids);
      } else {
        word.push_back(c);
      }
    }
    flush();
  };
  while (pos < text.size()) {
    size_t best = std::string::npos;
    const std::pair<std::string, int64_t>* tok = nullptr;
    for (const auto& a : added_) {
      const size_t at = text.find(a.first, pos);
      if (at != std::string::npos && (at < best || (at == best && tok && a.first.size() > tok->first.size()))) {
        best = at;
        tok = &a;
      }
    }
    if (!tok) {
      plain(text.substr(pos));
      break;
    }
    plain(text.substr(pos, best - pos));
    ids.push_back(tok->second);
    pos = best + tok->first.size();
  }
  return ids;
}

std::vector<std::string> WordPieceTokenizer::tokenize(const std::string& text) const {
  std::vector<std::string> by_id(vocab_.size());
  for (const auto& [tok, id] : vocab_)
    if (id >= 0 && id < static_cast<int64_t>(by_id.size())) by_id[id] = tok;
  std::vector<std::string> out;
  for (int64_t id : ids_of(text)) out.push_back(id < static_cast<int64_t>(by_id.size()) ? by_id[id] : "");
  return out;
}

void WordPieceTokenizer::pad(Encoding* e, int64_t pad_to) const {
  while (pad_to > 0 && static_cast<int64_t>(e->ids.size()) < pad_to) {
    e->ids.push_back(pad_);
    e->type_ids.push_back(0);
    e->attention_mask.push_back(0);
  }
}

Encoding WordPieceTokenizer::encode(const std::string& text, int64_t max_length, int64_t pad_to) const {
  std::vector<int64_t> a = ids_of(text);
  if (max_length > 0 && static_cast<int64_t>(a.size()) > max_length - 2) a.resize(std::max<int64_t>(0, max_length - 2));
  Encoding e;
  e.ids.push_back(cls_);
  e.ids.insert(e.ids.end(), a.begin(), a.end());
  e.ids.push_back(sep_);
  e.type_ids.assign(e.ids.size(), 0);
  e.attention_mask.assign(e.ids.size(), 1);
  pad(&e, pad_to);
  return e;
}

Encoding WordPieceTokenizer::encode_pair(const std::string& first, const std::string& second, int64_t max_length,
                                         int64_t pad_to) const {
  std::vector<int64_t> a = ids_of(first), b = ids_of(second);
  if (max_length > 0) {
    while (static_cast<int64_t>(a.size() + b.size()) > std::max<int64_t>(0, max_length - 3) && (!a.empty() || !b.empty())) {
      (a.size() > b.size() ? a : b).pop_back();  // longest first
    }
  }
  Encoding e;
  e.ids.push_back(cls_);
  e.ids.insert(e.ids.end(), a.begin(), a.end());
  e.ids.push_back(sep_);
  e.type_ids.assign(e.ids.size(), 0);
  e.ids.insert(e.ids.end(), b.begin(), b.end());
  e.ids.push_back(sep_);
  e.type_ids.resize(e.ids.size(), 1);
  e.attention_mask.assign(e.ids.size(), 1);
  pad(&e, pad_to);
  return e;
}

}  // namespace zeal::text
