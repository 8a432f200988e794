// Instruction data (examples/models/instruction_data.h): labels only on the responses, the padded
// batch, packing, errors naming the line; and the causal-LM loss of a 3-record batch through the LLaMA
// decoder against a hand computation (float64). A byte-level tokenizer made in the test (every byte
// its own token, a BOS template) keeps the expected ids readable: a text's ids are its bytes.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <utf8proc.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "examples/models/bpe.h"
#include "examples/models/instruction_data.h"
#include "examples/models/llama.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
constexpr int64_t kBos = 256;

// GPT-2's byte-to-unicode map, for the vocabulary's names.
std::string byte_char(int b) {
  static std::vector<std::string> m = [] {
    std::vector<std::string> out(256);
    int extra = 0;
    for (int x = 0; x < 256; ++x) {
      const bool printable = (x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255);
      const int cp = printable ? x : 256 + extra++;
      char buf[4];
      const auto n = utf8proc_encode_char(cp, reinterpret_cast<utf8proc_uint8_t*>(buf));
      out[x] = std::string(buf, static_cast<size_t>(n));
    }
    return out;
  }();
  return m[b];
}

std::string byte_tokenizer() {
  const std::string path = (fs::temp_directory_path() / fmt::format("zeal_bytes_{}.json", ::getpid())).string();
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
  json j = {{"added_tokens", {{{"id", kBos}, {"content", "<|bos|>"}, {"special", true}}}},
            {"normalizer", nullptr},
            {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
            {"post_processor",
             {{"type", "TemplateProcessing"},
              {"single", {{{"SpecialToken", {{"id", "<|bos|>"}}}}, {{"Sequence", {{"id", "A"}}}}}},
              {"special_tokens", {{"<|bos|>", {{"id", "<|bos|>"}, {"ids", {kBos}}}}}}}},
            {"decoder", {{"type", "ByteLevel"}}},
            {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}}}};
  std::ofstream(path) << j.dump();
  return path;
}

std::vector<int64_t> bytes(const std::string& s) { return std::vector<int64_t>(s.begin(), s.end()); }
std::vector<int64_t> masked(size_t n) { return std::vector<int64_t>(n, -100); }
template <class... V>
std::vector<int64_t> cat(const V&... parts) {
  std::vector<int64_t> out;
  (out.insert(out.end(), parts.begin(), parts.end()), ...);
  return out;
}

const std::vector<std::string> kRecords = {
    R"({"prompt": "2+2?", "response": "4"})",
    R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"},
                     {"role": "assistant", "content": "hi"}]})",
    R"({"prompt": "x", "response": "yz"})"};

class Instructions : public ::testing::Test {
 protected:
  void SetUp() override { path_ = byte_tokenizer(); }
  void TearDown() override { fs::remove(path_); }
  std::vector<zeal::models::InstructionExample> examples(const zeal::text::BpeTokenizer& tok) {
    std::vector<zeal::models::InstructionExample> out;
    for (size_t i = 0; i < kRecords.size(); ++i) {
      out.push_back(zeal::models::tokenize_instruction(json::parse(kRecords[i]), tok, chat_, "r" + std::to_string(i)));
    }
    return out;
  }
  std::string path_;
  zeal::models::ChatTemplate chat_;
};

TEST_F(Instructions, OnlyTheResponsesCarryLabels) {
  const auto tok = zeal::text::BpeTokenizer::from_file(path_);
  const auto ex = examples(tok);
  const std::string user0 = "<|user|>\n2+2?\n", asst = "<|assistant|>\n";
  EXPECT_EQ(ex[0].ids, cat(std::vector<int64_t>{kBos}, bytes(user0), bytes(asst), bytes("4<|end|>\n")));
  EXPECT_EQ(ex[0].labels, cat(masked(1 + user0.size() + asst.size()), bytes("4<|end|>\n")));
  // Two assistant turns: both learned, the system and user turns not.
  const std::string sys = "<|system|>\nBe brief.\n", u1 = "<|user|>\nhi\n", u2 = "<|user|>\nagain\n";
  EXPECT_EQ(ex[1].labels, cat(masked(1 + sys.size() + u1.size() + asst.size()), bytes("hello<|end|>\n"),
                              masked(u2.size() + asst.size()), bytes("hi<|end|>\n")));
  // The batch: right-padded to the longest, -100 and mask 0 there.
  const auto b = zeal::models::PadCollate{0}(ex);
  EXPECT_EQ(b.data.size(1), static_cast<int64_t>(ex[1].ids.size()));
  EXPECT_EQ(b.attention_mask[0].sum().item<int64_t>(), static_cast<int64_t>(ex[0].ids.size()));
  EXPECT_EQ(b.labels[2].narrow(0, static_cast<int64_t>(ex[2].ids.size()), 3).eq(-100).all().item<bool>(), true);
  // Packing: rows of 16, the concatenation cut, nothing padded.
  const auto rows = zeal::models::pack(ex, 16);
  size_t total = 0;
  for (const auto& e : ex) total += e.ids.size();
  ASSERT_EQ(rows.size(), total / 16);
  EXPECT_EQ(std::vector<int64_t>(rows[1].ids.begin(), rows[1].ids.begin() + 4),
            std::vector<int64_t>(ex[0].ids.begin() + 16, ex[0].ids.begin() + 20));
}

TEST_F(Instructions, AFileIsReadAndItsBadLinesAreNamed) {
  const auto tok = zeal::text::BpeTokenizer::from_file(path_);
  const std::string file = (fs::temp_directory_path() / fmt::format("zeal_instr_{}.jsonl", ::getpid())).string();
  {
    std::ofstream f(file);
    for (const auto& r : kRecords) f << json::parse(r).dump() << "\n\n";
  }
  EXPECT_EQ(zeal::models::read_instructions(file, tok, chat_).size(), 3u);
  EXPECT_EQ(zeal::models::read_instructions(file, tok, chat_, 10)[1].ids.size(), 10u);
  std::ofstream(file, std::ios::app) << R"({"prompt": "no answer"})" << "\n";
  try {
    zeal::models::read_instructions(file, tok, chat_);
    ADD_FAILURE() << "a record without a response was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(file + ":7: a record needs prompt and response"), std::string::npos) << e.what();
  }
  fs::remove(file);
}

// The streaming dataset: the same examples as read_instructions, built in worker threads, in the
// same batches; bad records named at construction with their line.
TEST_F(Instructions, AStreamGivesTheFilesExamplesThroughWorkers) {
  auto tok = std::make_shared<const zeal::text::BpeTokenizer>(zeal::text::BpeTokenizer::from_file(path_));
  const std::string file = (fs::temp_directory_path() / fmt::format("zeal_stream_{}.jsonl", ::getpid())).string();
  {
    std::ofstream f(file);
    for (int k = 0; k < 9; ++k) f << json::parse(kRecords[static_cast<size_t>(k) % kRecords.size()]).dump() << (k % 4 ? "\n" : "\n \n");
  }
  for (int64_t max_length : {0, 12}) {
    const auto expected = zeal::models::read_instructions(file, *tok, chat_, max_length);
    zeal::models::InstructionStream stream(file, tok, chat_, max_length);
    ASSERT_EQ(stream.size(), expected.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      EXPECT_EQ(stream.get(i).ids, expected[i].ids) << i;
      EXPECT_EQ(stream.get(i).labels, expected[i].labels) << i;
    }
    zeal::DataLoader plain(zeal::models::InstructionSet(expected), {.batch_size = 2, .shuffle = true},
                           zeal::models::PadCollate{0});
    zeal::DataLoader loader(std::move(stream), {.batch_size = 2, .shuffle = true, .num_workers = 2},
                            zeal::models::PadCollate{0});
    auto p = plain.begin();
    int64_t batches = 0;
    for (const auto& b : loader) {
      EXPECT_TRUE(at::equal(b.data, (*p).data));
      EXPECT_TRUE(at::equal(b.labels, (*p).labels));
      ++p, ++batches;
    }
    EXPECT_EQ(batches, plain.size());
  }
  const std::vector<std::pair<std::string, std::string>> bad = {
      {R"({"prompt": "no answer"})", ":2: a record needs prompt and response"},
      {R"({"prompt": "a", "response": "b")", ":2: not JSON"},
      {R"({"messages": [{"role": "user", "content": "hi"}]})", ":2: the record has no assistant response"},
      {R"({"messages": [{"role": "bot", "content": "hi"}]})", ":2: unknown role 'bot'"}};
  for (const auto& [line, message] : bad) {
    std::ofstream(file) << kRecords[0] << "\n" << line << "\n";
    try {
      zeal::models::InstructionStream s(file, tok, chat_);
      ADD_FAILURE() << "accepted: " << line;
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(file + message), std::string::npos) << e.what();
    }
  }
  fs::remove(file);
}

// The model's loss: the mean over the response tokens of -log p(token | everything before it).
TEST_F(Instructions, TheLossOfABatchIsTheResponsesAloneComputedByHand) {
  const auto tok = zeal::text::BpeTokenizer::from_file(path_);
  const auto b = zeal::models::PadCollate{0}(examples(tok));
  zeal::models::LlamaConfig c;
  c.vocab_size = 257;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 128;
  c.initializer_range = 0.2;
  at::manual_seed(4);
  zeal::models::LlamaForCausalLM model(c);
  model->to(at::kDouble);
  c10::NoGradGuard no_grad;
  const at::Tensor logits = model->forward(b.data, b.attention_mask);
  double sum = 0;
  int64_t n = 0;
  for (int64_t r = 0; r < b.data.size(0); ++r) {
    for (int64_t t = 0; t + 1 < b.data.size(1); ++t) {
      const int64_t target = b.labels[r][t + 1].item<int64_t>();
      if (target == -100) continue;
      const at::Tensor row = logits[r][t];
      const double mx = row.max().item<double>();
      const double lse = mx + std::log((row - mx).exp().sum().item<double>());
      sum += lse - row[target].item<double>();
      ++n;
    }
  }
  ASSERT_GT(n, 10);
  for (bool chunked : {false, true}) {
    model->config.chunked_loss = chunked;
    const double got = model->loss(b.data, b.labels, b.attention_mask).item<double>();
    EXPECT_NEAR(got, sum / static_cast<double>(n), 1e-12 * std::abs(sum / static_cast<double>(n)))
        << (chunked ? "chunked head" : "whole logits");
  }
}

}  // namespace
