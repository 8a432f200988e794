// zeal::text::BpeTokenizer against Python `tokenizers` (tests/examples/bpe_peer.py): a GPT-2-style and a
// LLaMA-3-style byte-level BPE trained offline on the repository's text, over 3,200 lines (the
// repository's own and lines mixing scripts, emoji, digits, whitespace runs, contractions, decomposed
// accents and special tokens): the same ids with and without special tokens, the same decoded text
// with and without them, and decode(encode(x)) = x where the tokenizer does not normalize.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "examples/models/bpe.h"
#include "tests/test_helpers.h"

namespace {

namespace fs = std::filesystem;

class BpePeer : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = (fs::temp_directory_path() / fmt::format("zeal_bpe_{}", ::getpid())).string();
    peer_ = zeal_test::run_peer_script("examples/bpe_peer.py", dir_ + " " + ZEAL_SOURCE_DIR);
    if (peer_.skip.empty() && peer_.failure.empty()) {
      std::ifstream in(dir_ + "/cases.json");
      cases_ = nlohmann::json::parse(in);
    }
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }
  void SetUp() override { ZEAL_NEEDS_PEER(peer_); }

  // Every line's ids and decoded text against the peer's; the first few differences shown.
  static void check(const std::string& name) {
    const auto tok = zeal::text::BpeTokenizer::from_file(dir_ + "/" + name + ".json");
    const auto& lines = cases_["lines"];
    ASSERT_GE(lines.size(), 3000u);
    int wrong = 0;
    for (size_t i = 0; i < lines.size(); ++i) {
      const std::string line = lines[i].get<std::string>();
      const auto want = cases_[name][i].get<std::vector<int64_t>>();
      const auto want_plain = cases_[name + "_plain"][i].get<std::vector<int64_t>>();
      const auto got = tok.encode(line), got_plain = tok.encode(line, false);
      const std::string decoded = tok.decode(got), skipped = tok.decode(got, true);
      const bool ok = got == want && got_plain == want_plain && decoded == cases_[name + "_decoded"][i].get<std::string>() &&
                      skipped == cases_[name + "_decoded_skip"][i].get<std::string>();
      if (!ok && ++wrong <= 5) {
        ADD_FAILURE() << name << " line " << i << ": '" << line << "'\n  ids " << fmt::format("{}", fmt::join(got, " "))
                      << "\n  want " << fmt::format("{}", fmt::join(want, " ")) << "\n  decoded '" << decoded << "' want '"
                      << cases_[name + "_decoded"][i].get<std::string>() << "'";
      }
    }
    EXPECT_EQ(wrong, 0) << name << ": " << wrong << " of " << lines.size() << " lines differ";
  }
  static std::string dir_;
  static zeal_test::PeerScript peer_;
  static nlohmann::json cases_;
};
std::string BpePeer::dir_;
zeal_test::PeerScript BpePeer::peer_;
nlohmann::json BpePeer::cases_;

TEST_F(BpePeer, Gpt2StyleGivesTokenizersIdsAndText) {
  check("gpt2");
  // No normalizer: decode(encode(x)) is x itself.
  const auto tok = zeal::text::BpeTokenizer::from_file(dir_ + "/gpt2.json");
  for (const auto& l : cases_["lines"]) EXPECT_EQ(tok.decode(tok.encode(l.get<std::string>())), l.get<std::string>());
}

TEST_F(BpePeer, Llama3StyleGivesTokenizersIdsAndText) { check("llama3"); }

// ignore_merges: a word the vocabulary holds is one token even when no merge makes it.
TEST_F(BpePeer, IgnoreMergesTakesAWordTheVocabularyHoldsWhole) {
  const auto tok = zeal::text::BpeTokenizer::from_file(dir_ + "/crafted.json");
  const auto& lines = cases_["crafted_lines"];
  for (size_t i = 0; i < lines.size(); ++i) {
    EXPECT_EQ(tok.encode(lines[i].get<std::string>()), cases_["crafted"][i].get<std::vector<int64_t>>()) << lines[i];
  }
}

TEST(BpeTokenizer, WhatItDoesNotComputeIsRefusedNamingTheField) {
  const std::string path = (fs::temp_directory_path() / fmt::format("zeal_bpe_bad_{}.json", ::getpid())).string();
  auto refused = [&](const std::string& json, const std::string& says) {
    std::ofstream(path) << json;
    try {
      (void)zeal::text::BpeTokenizer::from_file(path);
      ADD_FAILURE() << json << " was accepted";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  const std::string model = R"("model": {"type": "BPE", "vocab": {"a": 0}, "merges": []})";
  refused(R"({"model": {"type": "WordPiece", "vocab": {}}})", "model.type is 'WordPiece'");
  refused(R"({"model": {"type": "BPE", "vocab": {}, "merges": [], "byte_fallback": true}})", "byte_fallback");
  refused("{" + model + R"(, "pre_tokenizer": {"type": "Metaspace"}})", "pre_tokenizer 'Metaspace'");
  refused("{" + model + R"(, "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "(("}, "behavior": "Isolated"}})",
          "does not compile");
  refused("{" + model + R"(, "pre_tokenizer": null})", "no ByteLevel pre-tokenizer");
  refused("{" + model + R"(, "normalizer": {"type": "Lowercase"}, "pre_tokenizer": {"type": "ByteLevel"}})", "normalizer 'Lowercase'");
  fs::remove(path);
}

}  // namespace
