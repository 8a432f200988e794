// Instruction data for a causal LM: JSON-lines records ({"prompt", "response"}, or {"messages": [{"role",
// "content"}, …]} through a chat template), tokenized with the loss on the responses only (labels -100
// elsewhere), then padded per batch or packed into rows of a fixed length.
//
//   auto tok = zeal::text::BpeTokenizer::from_file(dir + "/tokenizer.json");
//   zeal::models::ChatTemplate chat;                       // or from the program's config
//   auto examples = zeal::models::read_instructions("train.jsonl", tok, chat);
//   zeal::DataLoader loader(zeal::models::InstructionSet(examples), {.batch_size = 8},
//                           zeal::models::PadCollate{tok.token_id("<|pad|>")});
//   // batch.data: ids [B, T], batch.labels, batch.attention_mask
//
// InstructionStream reads the same files without holding them: it keeps each record's place in the
// file and tokenizes a record when a loader asks for it (on the loader's worker threads when
// num_workers > 0), so tokenization runs beside the training step.
#pragma once

#include <ATen/ATen.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/data/loader.h"
#include "examples/models/bpe.h"

namespace zeal::models {

// How records become text: a role's message is prefix + content + suffix; a prompt/response record
// is the user's message then the assistant's. Only the assistant's content and suffix are learned.
struct ChatTemplate {
  std::string system_prefix = "<|system|>\n", system_suffix = "\n";
  std::string user_prefix = "<|user|>\n", user_suffix = "\n";
  std::string assistant_prefix = "<|assistant|>\n", assistant_suffix = "<|end|>\n";
  bool add_bos = true;  // the tokenizer's template (a BOS) before each record

  // From a JSON object with any of these keys; std::runtime_error naming an unknown key.
  static ChatTemplate from_json(const nlohmann::json& j, const std::string& where) {
    ChatTemplate t;
    for (auto it = j.begin(); it != j.end(); ++it) {
      const std::string& k = it.key();
      std::string* field = k == "system_prefix" ? &t.system_prefix : k == "system_suffix" ? &t.system_suffix
                           : k == "user_prefix" ? &t.user_prefix : k == "user_suffix" ? &t.user_suffix
                           : k == "assistant_prefix" ? &t.assistant_prefix : k == "assistant_suffix" ? &t.assistant_suffix
                           : nullptr;
      if (k == "add_bos") t.add_bos = it.value().get<bool>();
      else if (field) *field = it.value().get<std::string>();
      else throw std::runtime_error(where + ": unknown chat template key '" + k + "'");
    }
    return t;
  }
};

// One tokenized record: ids and labels of the same length (-100 where no loss is taken).
struct InstructionExample {
  std::vector<int64_t> ids, labels;
};

namespace detail {
inline void append(InstructionExample& e, const std::vector<int64_t>& ids, bool learn) {
  e.ids.insert(e.ids.end(), ids.begin(), ids.end());
  for (int64_t id : ids) e.labels.push_back(learn ? id : -100);
}
}  // namespace detail

// A record (one JSON object) tokenized; `where` names it in errors (file:line).
inline InstructionExample tokenize_instruction(const nlohmann::json& r, const zeal::text::BpeTokenizer& tok,
                                               const ChatTemplate& t, const std::string& where) {
  InstructionExample e;
  if (t.add_bos) detail::append(e, tok.encode("", true), false);
  auto message = [&](const std::string& role, const std::string& content) {
    const bool assistant = role == "assistant";
    const std::string& prefix = role == "system" ? t.system_prefix : role == "user" ? t.user_prefix : t.assistant_prefix;
    const std::string& suffix = role == "system" ? t.system_suffix : role == "user" ? t.user_suffix : t.assistant_suffix;
    if (role != "system" && role != "user" && role != "assistant") {
      throw std::runtime_error(where + ": unknown role '" + role + "' (system, user, assistant)");
    }
    detail::append(e, tok.encode(prefix, false), false);
    detail::append(e, tok.encode(content + suffix, false), assistant);
  };
  try {
    if (r.contains("messages")) {
      for (const auto& m : r.at("messages")) message(m.at("role").get<std::string>(), m.at("content").get<std::string>());
    } else {
      message("user", r.at("prompt").get<std::string>());
      message("assistant", r.at("response").get<std::string>());
    }
  } catch (const nlohmann::json::exception& x) {
    throw std::runtime_error(where + ": a record needs prompt and response, or messages with role and content (" +
                             x.what() + ")");
  }
  if (std::none_of(e.labels.begin(), e.labels.end(), [](int64_t l) { return l != -100; })) {
    throw std::runtime_error(where + ": the record has no assistant response to learn");
  }
  return e;
}

// Every record of a JSON-lines file (blank lines skipped); `max_length` > 0 truncates each.
inline std::vector<InstructionExample> read_instructions(const std::string& path, const zeal::text::BpeTokenizer& tok,
                                                         const ChatTemplate& t, int64_t max_length = 0) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::vector<InstructionExample> out;
  int64_t line_no = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(line_no);
    nlohmann::json r;
    try {
      r = nlohmann::json::parse(line);
    } catch (const std::exception& x) {
      throw std::runtime_error(where + ": not JSON: " + x.what());
    }
    auto e = tokenize_instruction(r, tok, t, where);
    if (max_length > 0 && static_cast<int64_t>(e.ids.size()) > max_length) {
      e.ids.resize(static_cast<size_t>(max_length));
      e.labels.resize(static_cast<size_t>(max_length));
    }
    out.push_back(std::move(e));
  }
  if (out.empty()) throw std::runtime_error(path + " holds no record");
  return out;
}

// A JSON-lines file read record by record: the constructor reads the file once, checks that every
// record is JSON of one of the two shapes (naming file:line) and keeps where each starts; get(i)
// reads record i again and tokenizes it (truncated to max_length when > 0). get() may run on several
// threads at once.
class InstructionStream {
 public:
  InstructionStream(const std::string& path, std::shared_ptr<const zeal::text::BpeTokenizer> tok, ChatTemplate t,
                    int64_t max_length = 0)
      : path_(path), tok_(std::move(tok)), t_(std::move(t)), max_length_(max_length) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error("cannot read " + path);
    int64_t line_no = 0, offset = 0;
    for (std::string line; std::getline(in, line);) {
      ++line_no;
      const int64_t start = offset;
      offset += static_cast<int64_t>(line.size()) + 1;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      const std::string where = path + ":" + std::to_string(line_no);
      check(line, where);
      records_.push_back({start, static_cast<int64_t>(line.size()), line_no});
    }
    if (records_.empty()) throw std::runtime_error(path + " holds no record");
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw std::runtime_error("cannot open " + path + ": " + std::strerror(errno));
    fd_ = std::shared_ptr<int>(new int(fd), [](int* f) { ::close(*f), delete f; });
  }

  InstructionExample get(size_t i) const {
    const Record& r = records_.at(i);
    std::string line(static_cast<size_t>(r.length), '\0');
    size_t got = 0;
    while (got < line.size()) {
      const ssize_t n = ::pread(*fd_, line.data() + got, line.size() - got, r.offset + static_cast<int64_t>(got));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) throw std::runtime_error(where(r) + ": cannot read the record again (the file changed?)");
      got += static_cast<size_t>(n);
    }
    auto e = tokenize_instruction(parse(line, where(r)), *tok_, t_, where(r));
    if (max_length_ > 0 && static_cast<int64_t>(e.ids.size()) > max_length_) {
      e.ids.resize(static_cast<size_t>(max_length_));
      e.labels.resize(static_cast<size_t>(max_length_));
    }
    return e;
  }
  size_t size() const { return records_.size(); }

 private:
  struct Record {
    int64_t offset, length, line;
  };
  std::string where(const Record& r) const { return path_ + ":" + std::to_string(r.line); }
  static nlohmann::json parse(const std::string& line, const std::string& where) {
    try {
      return nlohmann::json::parse(line);
    } catch (const std::exception& x) {
      throw std::runtime_error(where + ": not JSON: " + x.what());
    }
  }
  // The record's shape, without tokenizing it.
  static void check(const std::string& line, const std::string& where) {
    const auto r = parse(line, where);
    auto is_string = [&](const char* k) { return r.is_object() && r.contains(k) && r.at(k).is_string(); };
    bool ok = is_string("prompt") && is_string("response");
    if (!ok && r.is_object() && r.contains("messages") && r.at("messages").is_array()) {
      bool assistant = false;
      ok = true;
      for (const auto& m : r.at("messages")) {
        ok = ok && m.is_object() && m.contains("role") && m.at("role").is_string() && m.contains("content") &&
             m.at("content").is_string();
        if (!ok) break;
        const auto role = m.at("role").get<std::string>();
        if (role != "system" && role != "user" && role != "assistant") {
          throw std::runtime_error(where + ": unknown role '" + role + "' (system, user, assistant)");
        }
        assistant = assistant || role == "assistant";
      }
      if (ok && !assistant) throw std::runtime_error(where + ": the record has no assistant response to learn");
    }
    if (!ok) {
      throw std::runtime_error(where + ": a record needs prompt and response strings, or messages with role and content");
    }
  }
  std::string path_;
  std::shared_ptr<const zeal::text::BpeTokenizer> tok_;
  ChatTemplate t_;
  int64_t max_length_;
  std::vector<Record> records_;
  std::shared_ptr<int> fd_;
};

// Examples concatenated and cut into rows of `length` (the last partial row dropped): no padding;
// a row's tokens may see the previous record's.
inline std::vector<InstructionExample> pack(const std::vector<InstructionExample>& examples, int64_t length) {
  std::vector<InstructionExample> rows;
  InstructionExample cur;
  for (const auto& e : examples) {
    for (size_t i = 0; i < e.ids.size(); ++i) {
      cur.ids.push_back(e.ids[i]);
      cur.labels.push_back(e.labels[i]);
      if (static_cast<int64_t>(cur.ids.size()) == length) rows.push_back(std::move(cur)), cur = {};
    }
  }
  return rows;
}

// A batch: ids (`data`, for the Trainer's counts), labels and the attention mask, [B, T].
struct InstructionBatch {
  at::Tensor data, labels, attention_mask;
};

class InstructionSet {
 public:
  explicit InstructionSet(std::vector<InstructionExample> examples) : examples_(std::move(examples)) {}
  const InstructionExample& get(size_t i) const { return examples_.at(i); }
  size_t size() const { return examples_.size(); }

 private:
  std::vector<InstructionExample> examples_;
};

// Pads a batch on the right to its longest example: `pad_id` in ids, -100 in labels, 0 in the mask.
struct PadCollate {
  int64_t pad_id = 0;
  InstructionBatch operator()(std::vector<InstructionExample> items) const {
    size_t T = 0;
    for (const auto& e : items) T = std::max(T, e.ids.size());
    const auto B = static_cast<int64_t>(items.size());
    at::Tensor ids = at::full({B, static_cast<int64_t>(T)}, pad_id, at::kLong);
    at::Tensor labels = at::full({B, static_cast<int64_t>(T)}, -100, at::kLong);
    at::Tensor mask = at::zeros({B, static_cast<int64_t>(T)}, at::kLong);
    for (int64_t b = 0; b < B; ++b) {
      const auto& e = items[static_cast<size_t>(b)];
      const auto n = static_cast<int64_t>(e.ids.size());
      ids[b].narrow(0, 0, n).copy_(at::tensor(e.ids, at::kLong));
      labels[b].narrow(0, 0, n).copy_(at::tensor(e.labels, at::kLong));
      mask[b].narrow(0, 0, n).fill_(1);
    }
    return {ids, labels, mask};
  }
};

// Moved to the engine's device by a prepared loader (found by argument-dependent lookup).
inline InstructionBatch to_device(InstructionBatch b, at::Device d) {
  return {data::to_device(std::move(b.data), d), data::to_device(std::move(b.labels), d),
          data::to_device(std::move(b.attention_mask), d)};
}

}  // namespace zeal::models
