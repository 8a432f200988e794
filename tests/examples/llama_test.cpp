// examples/models/llama.h against transformers' LlamaForCausalLM on checkpoints transformers writes
// in the test (tests/examples/llama_peer.py: grouped-query attention, an untied and a tied head):
// logits without and with padding masks and the loss of labels with -100, in float64; the KV cache
// against recomputation; and stage 3 on 2 ranks (engine.init, load_pretrained) against one process.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/optim/adamw.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <fstream>
#include <string>
#include <vector>

#include "engine/checkpoint/safetensors.h"
#include "engine/peft/lora.h"
#include "engine/config/config.h"
#include "engine/engine.h"
#include "engine/error.h"
#include "engine/runtime/runtime.h"
#include "engine/runtime/spawn.h"
#include "tests/test_helpers.h"
#include "examples/models/generate.h"
#include "examples/models/llama.h"

namespace {

namespace fs = std::filesystem;
using zeal_test::peers_python;
using zeal_test::spawn_checked;

using zeal::models::LlamaCache;
using zeal::models::LlamaConfig;
using zeal::models::LlamaForCausalLM;

// transformers' weights into the model, every parameter from the file.
zeal::PretrainedReport strict_load(LlamaForCausalLM& model, const std::string& dir) {
  zeal::PretrainedOptions o;
  o.strict = true;
  o.quiet = true;
  return zeal::load_pretrained(model, dir, o);
}

// The checkpoints, made once per test program.
class LlamaPeer : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = (fs::temp_directory_path() / fmt::format("zeal_llama_{}", ::getpid())).string();
    peer_ = zeal_test::run_peer_script("examples/llama_peer.py", dir_ + " > /dev/null 2>&1");
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }
  void SetUp() override { ZEAL_NEEDS_PEER(peer_); }
  static std::string dir(const std::string& name) { return dir_ + "/" + name; }
  // A tensor of expected.safetensors.
  static at::Tensor expected(const std::string& name, const std::string& key) {
    return zeal::detail::read_tensor(dir(name) + "/expected.safetensors", key);
  }
  static LlamaForCausalLM load(const std::string& name) {
    const auto cfg = LlamaConfig::from_file(dir(name) + "/config.json");
    LlamaForCausalLM model(cfg);
    const auto report = strict_load(model, dir(name));
    EXPECT_TRUE(report.unused.empty()) << report.unused.front();
    model->to(at::kDouble);
    model->eval();
    return model;
  }
  static std::string dir_;
  static zeal_test::PeerScript peer_;
};
std::string LlamaPeer::dir_;
zeal_test::PeerScript LlamaPeer::peer_;

// float64 on both sides: the sums differ only in order, ~1e-15 of the logits' scale per operation;
// 1e-9 leaves room for that and catches any real difference (fp32 rotary tables alone are 1e-7).
void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double scale = std::max(1.0, want.abs().max().item<double>());
  const double diff = (got - want).abs().max().item<double>();
  EXPECT_LE(diff, 1e-9 * scale) << what << ": largest difference " << diff << " at a scale of " << scale;
}

TEST_F(LlamaPeer, LogitsMatchTransformersWithAndWithoutPadding) {
  for (const std::string name : {"untied", "tied"}) {
    auto model = load(name);
    c10::NoGradGuard no_grad;
    const at::Tensor ids = expected(name, "ids"), mask = expected(name, "attention_mask");
    expect_close(model->forward(ids), expected(name, "logits"), name + " without a mask");
    // Padding query positions hold nothing to compare (transformers leaves them NaN).
    const at::Tensor got = model->forward(ids, mask), want = expected(name, "logits_masked");
    const at::Tensor keep = mask.to(at::kBool);
    expect_close(got.index({keep}), want.index({keep}), name + " with left and right padding");
    model->config.chunked_loss = false;
    const at::Tensor labels = expected(name, "labels"), right = expected(name, "right_mask");
    expect_close(model->loss(ids, labels, right).reshape({1}), expected(name, "loss"), name + " loss (whole logits)");
    model->config.chunked_loss = true;
    expect_close(model->loss(ids, labels, right).reshape({1}), expected(name, "loss"), name + " loss (chunked head)");
  }
}

TEST_F(LlamaPeer, TheKvCacheGivesTheLogitsOfTheWholeSequence) {
  auto model = load("untied");
  c10::NoGradGuard no_grad;
  const at::Tensor ids = expected("untied", "ids");
  const at::Tensor full = model->forward(ids);
  // A prefix of 5 tokens, then 2, then one at a time.
  LlamaCache cache;
  std::vector<at::Tensor> parts{model->forward(ids.narrow(1, 0, 5), {}, {}, &cache),
                                model->forward(ids.narrow(1, 5, 2), {}, {}, &cache)};
  for (int64_t t = 7; t < ids.size(1); ++t) parts.push_back(model->forward(ids.narrow(1, t, 1), {}, {}, &cache));
  EXPECT_EQ(cache.length(), ids.size(1));
  expect_close(at::cat(parts, 1), full, "cached");
  // With a padding mask too (row 1 left-padded): the positions with tokens agree.
  const at::Tensor mask = expected("untied", "attention_mask");
  const at::Tensor whole = model->forward(ids, mask);
  LlamaCache c2;
  std::vector<at::Tensor> p2{model->forward(ids.narrow(1, 0, 6), mask.narrow(1, 0, 6), {}, &c2)};
  for (int64_t t = 6; t < ids.size(1); ++t) p2.push_back(model->forward(ids.narrow(1, t, 1), mask.narrow(1, 0, t + 1), {}, &c2));
  const at::Tensor keep = mask.to(at::kBool);
  expect_close(at::cat(p2, 1).index({keep}), whole.index({keep}), "cached with padding");
}

TEST_F(LlamaPeer, Stage3OnTwoRanksGivesOneProcesssLogits) {
  const std::string out = (fs::temp_directory_path() / fmt::format("zeal_llama_s3_{}", ::getpid())).string();
  const std::string model_dir = dir("untied");
  const auto results = spawn_checked(
      [&](zeal::Runtime& rt) {
        zeal::Config c = zeal::Config::parse(
            R"({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "zero3_init_flag": true}})",
            "ds.json");
        c.launch.use_cpu = true;
        zeal::Engine engine(c, rt);
        const auto cfg = LlamaConfig::from_file(model_dir + "/config.json");
        auto model = engine.init<LlamaForCausalLM>(cfg);
        strict_load(model, model_dir);
        torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
        auto [m, po] = engine.prepare(model, opt);
        (void)po;
        m->eval();
        c10::NoGradGuard no_grad;
        const at::Tensor logits = m->forward(expected("untied", "ids"), expected("untied", "attention_mask"));
        if (engine.is_main_process()) {
          std::ofstream f(out, std::ios::binary);
          f.write(static_cast<const char*>(logits.contiguous().data_ptr()), static_cast<std::streamsize>(logits.nbytes()));
        }
      },
      2);
  ASSERT_EQ(zeal::describe_failures(results), "");
  // One process, fp32 too, with one thread as the ranks have (the sums' order is then the same).
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const auto cfg = LlamaConfig::from_file(model_dir + "/config.json");
  LlamaForCausalLM one(cfg);
  strict_load(one, model_dir);
  one->eval();
  c10::NoGradGuard no_grad;
  const at::Tensor mask = expected("untied", "attention_mask");
  const at::Tensor want = one->forward(expected("untied", "ids"), mask);
  at::set_num_threads(threads);
  at::Tensor got = at::empty_like(want);
  std::ifstream f(out, std::ios::binary);
  f.read(static_cast<char*>(got.data_ptr()), static_cast<std::streamsize>(got.nbytes()));
  fs::remove(out);
  EXPECT_TRUE(got.equal(want)) << "largest difference " << (got - want).abs().max().item<double>();
  // And fp32 against transformers' float64, on the positions with tokens: fp32's rounding over two
  // layers of 32 wide (2^-24 per operation, a few hundred operations deep) stays under 1e-4.
  const at::Tensor keep = mask.to(at::kBool);
  const at::Tensor ref = expected("untied", "logits_masked").index({keep});
  const double scale = std::max(1.0, ref.abs().max().item<double>());
  EXPECT_LE((got.index({keep}).to(at::kDouble) - ref).abs().max().item<double>(), 1e-4 * scale);
}

// transformers' greedy generate: left-padded prompts of different lengths, without an EOS and with one
// a row reaches early (the others go on).
TEST_F(LlamaPeer, GreedyGenerationEqualsTransformers) {
  auto model = load("untied");
  std::ifstream in(dir("untied") + "/generation.json");
  const auto j = nlohmann::json::parse(in);
  const auto prompts = j["prompts"].get<std::vector<std::vector<int64_t>>>();
  zeal::models::GenerationConfig g;
  g.max_new_tokens = 8;
  EXPECT_EQ(zeal::models::generate(model, prompts, g), j["free"].get<std::vector<std::vector<int64_t>>>());
  g.eos_token_id = j["eos"].get<int64_t>();
  EXPECT_EQ(zeal::models::generate(model, prompts, g), j["stopped"].get<std::vector<std::vector<int64_t>>>());
  // Sampling with top_k 1 is greedy; a seed repeats a sample.
  g.do_sample = true;
  g.top_k = 1;
  g.temperature = 0.7;
  EXPECT_EQ(zeal::models::generate(model, prompts, g), j["stopped"].get<std::vector<std::vector<int64_t>>>());
  g.top_k = 0;
  g.top_p = 0.9;
  g.seed = 3;
  EXPECT_EQ(zeal::models::generate(model, prompts, g), zeal::models::generate(model, prompts, g));
}

// Stage 3 on 2 ranks, each with its own prompts, one rank's rows ending early (EOS) and a rank with
// none: every rank steps until all are done, and each gets one process's tokens.
TEST_F(LlamaPeer, Stage3RanksGenerateDifferentLengthsWithoutAMismatch) {
  const std::string model_dir = dir("untied"), out = dir("untied") + "/stage3_generation.json";
  std::ifstream in(model_dir + "/generation.json");
  const auto j = nlohmann::json::parse(in);
  const auto prompts = j["prompts"].get<std::vector<std::vector<int64_t>>>();
  zeal::models::GenerationConfig g;
  g.max_new_tokens = 8;
  g.eos_token_id = j["eos"].get<int64_t>();
  for (const bool empty_rank : {false, true}) {
    const auto results = spawn_checked(
        [&](zeal::Runtime& rt) {
          zeal::Config c = zeal::Config::parse(R"({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})", "ds.json");
          c.launch.use_cpu = true;
          zeal::Engine engine(c, rt);
          LlamaForCausalLM model(LlamaConfig::from_file(model_dir + "/config.json"));
          strict_load(model, model_dir);
          torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
          auto [m, po] = engine.prepare(model, opt);
          (void)po;
          m->eval();
          // Rank 0: the prompt whose row stops after 3 tokens; rank 1: the other two (or none).
          std::vector<std::vector<int64_t>> mine;
          if (rt.rank() == 0) mine = {prompts[0]};
          else if (!empty_rank) mine = {prompts[1], prompts[2]};
          const auto got = zeal::models::generate(m, mine, g, &engine);
          std::vector<std::vector<int64_t>> want;
          const auto stopped = j["stopped"].get<std::vector<std::vector<int64_t>>>();
          if (rt.rank() == 0) want = {stopped[0]};
          else if (!empty_rank) want = {stopped[1], stopped[2]};
          EXPECT_EQ(got, want) << "rank " << rt.rank();
        },
        2);
    EXPECT_EQ(zeal::describe_failures(results), "") << (empty_rank ? "with a rank without prompts" : "");
  }
}

// LoRA on the decoder both ways with Python peft: zeal's adapter and merged export read by peft and
// transformers (tests/examples/llama_peft_check.py), and an adapter peft made read by zeal.
TEST_F(LlamaPeer, LoraAdaptersAndMergesAgreeWithPeftBothWays) {
  const at::Tensor ids = expected("untied", "ids"), mask = expected("untied", "attention_mask");
  const at::Tensor keep = mask.to(at::kBool);
  {
    // Python's adapter in zeal.
    auto model = load("untied");
    auto pm = zeal::peft::from_pretrained(model.ptr(), dir("untied") + "/py_adapter");
    c10::NoGradGuard no_grad;
    const at::Tensor got = model->forward(ids, mask);
    const at::Tensor want = zeal::detail::read_tensor(dir("untied") + "/py_adapter_logits.safetensors", "logits");
    expect_close(got.index({keep}), want.index({keep}), "peft's adapter in zeal");
  }
  // zeal's adapter (B random as well), its logits, and its merged export, for Python.
  auto model = load("untied");
  zeal::peft::LoraConfig lc;
  lc.r = 4;
  lc.lora_alpha = 8;
  lc.target_modules = {"q_proj", "v_proj", "down_proj"};
  lc.init_lora_weights = "none";
  lc.task_type = "CAUSAL_LM";
  lc.base_model_name_or_path = dir("untied");
  at::manual_seed(9);
  auto pm = zeal::peft::get_peft_model(model.ptr(), lc);
  model->to(at::kDouble);
  c10::NoGradGuard no_grad;
  const at::Tensor logits = model->forward(ids, mask).contiguous();
  {
    zeal::ckpt::SafetensorsWriter w(dir_ + "/zeal_logits.safetensors",
                                    {{"logits", "F64", logits.sizes().vec(), static_cast<int64_t>(logits.nbytes()), 0}},
                                    {{"format", "pt"}});
    w.append(logits.data_ptr(), static_cast<int64_t>(logits.nbytes()));
    w.finish();
  }
  pm.save_pretrained(dir_ + "/zeal_adapter");
  pm.merge_and_unload();
  expect_close(model->forward(ids, mask).index({keep}), logits.index({keep}), "zeal merged vs zeal with the adapter");
  pm.save_merged(dir_ + "/zeal_merged");
  const auto check = zeal_test::run_peer_script("examples/llama_peft_check.py", dir_);
  EXPECT_EQ(check.failure, "") << "Python peft or transformers disagree with zeal (see above)";
  EXPECT_EQ(check.skip, "");
}

// A model engine.init partitioned holds only slices until prepared: using it before is an error naming
// the unit, not a read of freed memory; prepared, it runs.
TEST(LlamaInit, APartitionedModelUsedBeforePrepareIsRefused) {
  const auto results = spawn_checked(
      [&](zeal::Runtime& rt) {
        zeal::Config c = zeal::Config::parse(
            R"({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "zero3_init_flag": true}})", "ds.json");
        c.launch.use_cpu = true;
        zeal::Engine engine(c, rt);
        LlamaConfig cfg;
        cfg.vocab_size = 50;
        cfg.hidden_size = 16;
        cfg.intermediate_size = 32;
        cfg.num_hidden_layers = 2;
        cfg.num_attention_heads = 2;
        cfg.num_key_value_heads = 1;
        auto model = engine.init<LlamaForCausalLM>(cfg);
        const at::Tensor ids = at::randint(0, 50, {2, 5}, at::kLong);
        try {
          (void)model->forward(ids);
          ADD_FAILURE() << "a partitioned model ran before prepare";
        } catch (const zeal::Error& e) {
          EXPECT_NE(std::string(e.what()).find("ran before engine.prepare"), std::string::npos) << e.what();
        }
        torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
        auto [m, po] = engine.prepare(model, opt);
        (void)po;
        EXPECT_EQ(m->forward(ids).sizes(), (std::vector<int64_t>{2, 5, 50}));
      },
      2);
  EXPECT_EQ(zeal::describe_failures(results), "");
}

TEST(LlamaConfig, WhatTheModelDoesNotComputeIsRefusedNamingTheKey) {
  const std::string path = (fs::temp_directory_path() / fmt::format("zeal_llama_cfg_{}.json", ::getpid())).string();
  auto refused = [&](const std::string& json, const std::string& says) {
    std::ofstream(path) << json;
    try {
      (void)LlamaConfig::from_file(path);
      ADD_FAILURE() << json << " was accepted";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  refused(R"({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4}})", "rope_scaling of type 'yarn'");
  refused(R"({"model_type": "llama", "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}})", "rope_parameters of type 'llama3'");
  refused(R"({"model_type": "llama", "hidden_act": "gelu"})", "hidden_act 'gelu'");
  refused(R"({"model_type": "llama", "num_attention_heads": 6, "num_key_value_heads": 4})", "multiple of num_key_value_heads");
  refused(R"({"model_type": "gpt2"})", "model_type 'gpt2'");
  fs::remove(path);
}

}  // namespace
