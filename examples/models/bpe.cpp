#include "examples/models/bpe.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <stdexcept>
#include <utility>

#include <nlohmann/json.hpp>

#include "examples/models/hf_config.h"

namespace zeal::text {
namespace {

using json = nlohmann::json;

// GPT-2's pre-tokenizer regex (the `tokenizers` ByteLevel pre-tokenizer's with use_regex).
const char* const kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::string utf8(uint32_t cp) {
  std::string out(4, '\0');
  const auto n = utf8proc_encode_char(static_cast<utf8proc_int32_t>(cp), reinterpret_cast<utf8proc_uint8_t*>(out.data()));
  out.resize(static_cast<size_t>(n));
  return out;
}

// GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others for 256 + k.
struct ByteMap {
  std::array<std::string, 256> to_char;
  std::unordered_map<uint32_t, uint8_t> to_byte;
  ByteMap() {
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      const uint32_t cp = printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + extra++);
      to_char[b] = utf8(cp);
      to_byte[cp] = static_cast<uint8_t>(b);
    }
  }
};
const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

// The UTF-8 characters of s (each as its bytes).
std::vector<std::string> characters(const std::string& s) {
  std::vector<std::string> out;
  const auto* p = reinterpret_cast<const utf8proc_uint8_t*>(s.data());
  utf8proc_ssize_t left = static_cast<utf8proc_ssize_t>(s.size()), at = 0;
  while (left > 0) {
    utf8proc_int32_t cp = 0;
    utf8proc_ssize_t n = utf8proc_iterate(p + at, left, &cp);
    if (n <= 0) n = 1;  // a stray byte stands alone
    out.emplace_back(s.substr(static_cast<size_t>(at), static_cast<size_t>(n)));
    at += n;
    left -= n;
  }
  return out;
}

// Bytes as UTF-8 text, each maximal invalid subsequence replaced by U+FFFD (Rust's from_utf8_lossy).
std::string lossy_utf8(const std::string& bytes) {
  std::string out;
  const auto* s = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t n = bytes.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char c = s[i];
    size_t len = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c < 0x80) len = 1;
    else if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c >= 0xE0 && c <= 0xEF) len = 3, lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
    else if (c >= 0xF0 && c <= 0xF4) len = 4, lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
    if (len == 0) {
      out += "\xEF\xBF\xBD";
      ++i;
      continue;
    }
    size_t k = 1;
    for (; k < len && i + k < n; ++k) {
      const unsigned char b = s[i + k];
      if (b < (k == 1 ? lo : 0x80) || b > (k == 1 ? hi : 0xBF)) break;
    }
    if (k == len) {
      out.append(bytes, i, len);
    } else {
      out += "\xEF\xBF\xBD";
    }
    i += k;
  }
  return out;
}

// A compiled PCRE2 pattern (UTF, Unicode properties) splitting text into its matches and the gaps.
class Regex {
 public:
  Regex(const std::string& pattern, const std::string& where) {
    int err = 0;
    PCRE2_SIZE offset = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP, &err,
                          &offset, nullptr);
    if (!code_) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof msg);
      throw std::runtime_error(where + ": the pattern does not compile at offset " + std::to_string(offset) + ": " +
                               reinterpret_cast<const char*>(msg));
    }
  }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  ~Regex() { pcre2_code_free(code_); }

  // [begin, end) of every match, in order (an empty match is skipped).
  std::vector<std::pair<size_t, size_t>> matches(const std::string& s) const {
    std::vector<std::pair<size_t, size_t>> out;
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_, nullptr);
    size_t at = 0;
    while (at <= s.size()) {
      const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), at, 0, md, nullptr);
      if (rc < 0) break;
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      if (ov[1] == ov[0]) {  // empty: step over one character
        if (ov[0] >= s.size()) break;
        at = ov[0] + 1;
        while (at < s.size() && (static_cast<unsigned char>(s[at]) & 0xC0) == 0x80) ++at;
        continue;
      }
      out.emplace_back(ov[0], ov[1]);
      at = ov[1];
    }
    pcre2_match_data_free(md);
    return out;
  }

 private:
  pcre2_code* code_ = nullptr;
};

enum class Behavior { kIsolated, kRemoved };

// One pre-tokenizer step: a regex split, or ByteLevel (prefix space, GPT-2's split, byte map).
struct PreStep {
  bool byte_level = false;
  bool add_prefix_space = false;
  std::shared_ptr<Regex> regex;  // null: no split
  Behavior behavior = Behavior::kIsolated;
};

std::vector<std::string> split(const std::string& s, const Regex& re, Behavior behavior) {
  std::vector<std::string> out;
  size_t last = 0;
  for (const auto& [b, e] : re.matches(s)) {
    if (b > last) out.push_back(s.substr(last, b - last));
    if (behavior == Behavior::kIsolated) out.push_back(s.substr(b, e - b));
    last = e;
  }
  if (last < s.size()) out.push_back(s.substr(last));
  return out;
}

}  // namespace

struct BpeTokenizer::Impl {
  std::string path;
  std::unordered_map<std::string, int64_t> vocab;
  std::unordered_map<int64_t, std::string> tokens;
  std::unordered_map<std::string, int64_t> ranks;  // "a\xffb" → merge rank
  bool ignore_merges = false;
  int64_t unk = -1;
  std::vector<int> normal_forms;  // utf8proc options, applied in order
  std::vector<PreStep> steps;
  struct Added {
    std::string content;
    int64_t id;
    bool special;
  };
  std::vector<Added> added;  // longest content first
  std::unordered_map<int64_t, const Added*> added_by_id;
  std::vector<int64_t> prefix, suffix;  // the template's ids around a single sequence

  std::string normalize(const std::string& s) const {
    std::string t = s;
    for (int options : normal_forms) {
      utf8proc_uint8_t* out = nullptr;
      const auto n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(t.data()), static_cast<utf8proc_ssize_t>(t.size()),
                                  &out, static_cast<utf8proc_option_t>(options));
      if (n < 0) throw std::runtime_error(std::string("cannot normalize the text: ") + utf8proc_errmsg(n));
      t.assign(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
      std::free(out);
    }
    return t;
  }

  void bpe(const std::string& word, std::vector<int64_t>& out) const {
    if (ignore_merges) {
      if (auto it = vocab.find(word); it != vocab.end()) {
        out.push_back(it->second);
        return;
      }
    }
    std::vector<std::string> sym = characters(word);
    while (sym.size() > 1) {
      int64_t best = std::numeric_limits<int64_t>::max();
      for (size_t i = 0; i + 1 < sym.size(); ++i) {
        auto it = ranks.find(sym[i] + '\xff' + sym[i + 1]);
        if (it != ranks.end() && it->second < best) best = it->second;
      }
      if (best == std::numeric_limits<int64_t>::max()) break;
      std::vector<std::string> next;
      for (size_t i = 0; i < sym.size(); ++i) {
        if (i + 1 < sym.size()) {
          auto it = ranks.find(sym[i] + '\xff' + sym[i + 1]);
          if (it != ranks.end() && it->second == best) {
            next.push_back(sym[i] + sym[i + 1]);
            ++i;
            continue;
          }
        }
        next.push_back(sym[i]);
      }
      sym.swap(next);
    }
    for (const auto& s : sym) {
      auto it = vocab.find(s);
      if (it != vocab.end()) {
        out.push_back(it->second);
      } else if (unk >= 0) {
        out.push_back(unk);
      } else {
        throw std::runtime_error(path + ": the symbol '" + s + "' is not in the vocabulary and there is no unk_token");
      }
    }
  }

  // A segment between added tokens: normalized, pre-tokenized, byte-mapped, merged.
  void encode_segment(const std::string& segment, std::vector<int64_t>& out) const {
    std::vector<std::string> pieces{normalize(segment)};
    for (const auto& step : steps) {
      std::vector<std::string> next;
      for (auto& p : pieces) {
        if (step.add_prefix_space && (p.empty() || p[0] != ' ')) p.insert(p.begin(), ' ');
        if (step.regex) {
          for (auto& q : split(p, *step.regex, step.behavior)) next.push_back(std::move(q));
        } else {
          next.push_back(p);
        }
      }
      if (step.byte_level) {
        for (auto& p : next) {
          std::string mapped;
          for (unsigned char c : p) mapped += byte_map().to_char[c];
          p = std::move(mapped);
        }
      }
      pieces.swap(next);
    }
    for (const auto& p : pieces)
      if (!p.empty()) bpe(p, out);
  }
};

BpeTokenizer::BpeTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
BpeTokenizer::BpeTokenizer(BpeTokenizer&&) noexcept = default;
BpeTokenizer& BpeTokenizer::operator=(BpeTokenizer&&) noexcept = default;
BpeTokenizer::~BpeTokenizer() = default;

BpeTokenizer BpeTokenizer::from_file(const std::string& path) {
  const json j = models::read_config_json(path);
  auto impl = std::make_unique<Impl>();
  Impl& t = *impl;
  t.path = path;
  auto refuse = [&](const std::string& what) { throw std::runtime_error(path + ": " + what); };
  try {
    const json& m = j.at("model");
    if (m.value("type", std::string()) != "BPE") refuse("model.type is '" + m.value("type", std::string("?")) + "', not BPE");
    if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"].get<double>() > 0) refuse("model.dropout (random merges) is not computed");
    if (m.value("byte_fallback", false)) refuse("model.byte_fallback (SentencePiece-style BPE) is not this byte-level tokenizer");
    for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      if (m.contains(k) && !m[k].is_null() && !m[k].get<std::string>().empty()) refuse(std::string("model.") + k + " is not computed");
    }
    t.ignore_merges = m.value("ignore_merges", false);
    for (auto it = m.at("vocab").begin(); it != m.at("vocab").end(); ++it) {
      t.vocab[it.key()] = it.value().get<int64_t>();
      t.tokens[it.value().get<int64_t>()] = it.key();
    }
    int64_t rank = 0;
    for (const auto& mg : m.at("merges")) {
      std::string a, b;
      if (mg.is_string()) {
        const std::string s = mg.get<std::string>();
        const size_t sp = s.find(' ');
        if (sp == std::string::npos) refuse("model.merges: '" + s + "' is not two tokens");
        a = s.substr(0, sp), b = s.substr(sp + 1);
      } else {
        a = mg.at(0).get<std::string>(), b = mg.at(1).get<std::string>();
      }
      t.ranks.emplace(a + '\xff' + b, rank++);
    }
    if (m.contains("unk_token") && !m["unk_token"].is_null()) {
      auto it = t.vocab.find(m["unk_token"].get<std::string>());
      if (it != t.vocab.end()) t.unk = it->second;
    }
    // Normalizer.
    std::function<void(const json&)> normalizer = [&](const json& n) {
      if (n.is_null()) return;
      const std::string type = n.value("type", std::string());
      if (type == "Sequence") {
        for (const auto& x : n.at("normalizers")) normalizer(x);
      } else if (type == "NFC") {
        t.normal_forms.push_back(UTF8PROC_STABLE | UTF8PROC_COMPOSE);
      } else if (type == "NFKC") {
        t.normal_forms.push_back(UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT);
      } else if (type == "NFD") {
        t.normal_forms.push_back(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE);
      } else if (type == "NFKD") {
        t.normal_forms.push_back(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT);
      } else {
        refuse("normalizer '" + type + "' is not computed (NFC, NFKC, NFD, NFKD or none)");
      }
    };
    normalizer(j.value("normalizer", json()));
    // Pre-tokenizer.
    std::function<void(const json&)> pre = [&](const json& p) {
      if (p.is_null()) return;
      const std::string type = p.value("type", std::string());
      if (type == "Sequence") {
        for (const auto& x : p.at("pretokenizers")) pre(x);
      } else if (type == "ByteLevel") {
        PreStep s;
        s.byte_level = true;
        s.add_prefix_space = p.value("add_prefix_space", false);
        if (p.value("use_regex", true)) s.regex = std::make_shared<Regex>(kGpt2Pattern, path + ": ByteLevel");
        t.steps.push_back(std::move(s));
      } else if (type == "Split") {
        PreStep s;
        const json& pat = p.at("pattern");
        std::string pattern;
        if (pat.contains("Regex")) {
          pattern = pat["Regex"].get<std::string>();
        } else {
          // A literal string: every character of it escaped.
          for (char c : pat.at("String").get<std::string>()) {
            if (std::string("\\^$.|?*+()[]{}").find(c) != std::string::npos) pattern += '\\';
            pattern += c;
          }
        }
        s.regex = std::make_shared<Regex>(pattern, path + ": pre_tokenizer Split");
        const std::string behavior = p.value("behavior", std::string("Isolated"));
        if (behavior == "Removed") s.behavior = Behavior::kRemoved;
        else if (behavior != "Isolated") refuse("pre_tokenizer Split behavior '" + behavior + "' is not computed (Isolated, Removed)");
        if (p.value("invert", false)) refuse("pre_tokenizer Split with invert is not computed");
        t.steps.push_back(std::move(s));
      } else {
        refuse("pre_tokenizer '" + type + "' is not computed (ByteLevel, Split, Sequence of them)");
      }
    };
    pre(j.value("pre_tokenizer", json()));
    if (std::none_of(t.steps.begin(), t.steps.end(), [](const PreStep& s) { return s.byte_level; })) {
      refuse("no ByteLevel pre-tokenizer: not a byte-level BPE tokenizer");
    }
    // Added tokens.
    for (const auto& a : j.value("added_tokens", json::array())) {
      if (a.value("lstrip", false) || a.value("rstrip", false) || a.value("single_word", false)) {
        refuse("added token '" + a.at("content").get<std::string>() + "' with lstrip, rstrip or single_word is not computed");
      }
      t.added.push_back({a.at("content").get<std::string>(), a.at("id").get<int64_t>(), a.value("special", false)});
      t.tokens[t.added.back().id] = t.added.back().content;
    }
    std::stable_sort(t.added.begin(), t.added.end(), [](const Impl::Added& x, const Impl::Added& y) {
      return x.content.size() > y.content.size();
    });
    for (const auto& a : t.added) t.added_by_id[a.id] = &a;
    // Post-processor: a template's tokens around a single sequence.
    std::function<void(const json&)> post = [&](const json& p) {
      if (p.is_null()) return;
      const std::string type = p.value("type", std::string());
      if (type == "Sequence") {
        for (const auto& x : p.at("processors")) post(x);
      } else if (type == "TemplateProcessing") {
        bool before = true;
        for (const auto& item : p.at("single")) {
          if (item.contains("Sequence")) {
            before = false;
            continue;
          }
          const std::string name = item.at("SpecialToken").at("id").get<std::string>();
          for (const auto& id : p.at("special_tokens").at(name).at("ids")) (before ? t.prefix : t.suffix).push_back(id.get<int64_t>());
        }
      } else if (type != "ByteLevel") {
        refuse("post_processor '" + type + "' is not computed (ByteLevel, TemplateProcessing)");
      }
    };
    post(j.value("post_processor", json()));
  } catch (const json::exception& e) {
    throw std::runtime_error(path + ": " + e.what());
  }
  return BpeTokenizer(std::move(impl));
}

std::vector<int64_t> BpeTokenizer::encode(const std::string& text, bool add_special_tokens) const {
  const Impl& t = *impl_;
  std::vector<int64_t> out;
  if (add_special_tokens) out = t.prefix;
  // The added tokens first: the leftmost match, the longest at a place; the text between them goes
  // through the pipeline.
  size_t at = 0, from = 0;
  while (at < text.size()) {
    const Impl::Added* hit = nullptr;
    for (const auto& a : t.added) {
      if (!a.content.empty() && text.compare(at, a.content.size(), a.content) == 0) {
        hit = &a;
        break;
      }
    }
    if (!hit) {
      ++at;
      continue;
    }
    if (at > from) t.encode_segment(text.substr(from, at - from), out);
    out.push_back(hit->id);
    at += hit->content.size();
    from = at;
  }
  if (from < text.size()) t.encode_segment(text.substr(from), out);
  if (add_special_tokens) out.insert(out.end(), t.suffix.begin(), t.suffix.end());
  return out;
}

std::string BpeTokenizer::decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const {
  const Impl& t = *impl_;
  std::string out, bytes;
  auto flush = [&] {
    out += lossy_utf8(bytes);
    bytes.clear();
  };
  for (int64_t id : ids) {
    if (auto a = t.added_by_id.find(id); a != t.added_by_id.end()) {
      if (skip_special_tokens && a->second->special) continue;
      flush();
      out += a->second->content;
      continue;
    }
    const std::string& tok = token(id);
    const auto* p = reinterpret_cast<const utf8proc_uint8_t*>(tok.data());
    utf8proc_ssize_t left = static_cast<utf8proc_ssize_t>(tok.size()), at = 0;
    while (left > 0) {
      utf8proc_int32_t cp = 0;
      utf8proc_ssize_t n = utf8proc_iterate(p + at, left, &cp);
      if (n <= 0) n = 1, cp = -1;
      auto b = byte_map().to_byte.find(static_cast<uint32_t>(cp));
      if (b != byte_map().to_byte.end()) {
        bytes += static_cast<char>(b->second);
      } else {
        bytes.append(tok, static_cast<size_t>(at), static_cast<size_t>(n));
      }
      at += n;
      left -= n;
    }
  }
  flush();
  return out;
}

int64_t BpeTokenizer::vocab_size() const { return static_cast<int64_t>(impl_->tokens.size()); }

int64_t BpeTokenizer::token_id(const std::string& token) const {
  for (const auto& a : impl_->added)
    if (a.content == token) return a.id;
  auto it = impl_->vocab.find(token);
  return it == impl_->vocab.end() ? -1 : it->second;
}

const std::string& BpeTokenizer::token(int64_t id) const {
  auto it = impl_->tokens.find(id);
  if (it == impl_->tokens.end()) throw std::out_of_range("token id " + std::to_string(id) + " is not in " + impl_->path);
  return it->second;
}

bool BpeTokenizer::is_special(int64_t id) const {
  auto it = impl_->added_by_id.find(id);
  return it != impl_->added_by_id.end() && it->second->special;
}

}  // namespace zeal::text
