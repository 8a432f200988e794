// GPT-2's Hugging Face files into the GPT example through load_pretrained's transforms
// (examples/models/gpt2_weights.h): float64 logits against transformers' GPT2LMHeadModel on a
// checkpoint it writes in the test (tests/examples/gpt2_peer.py); a square Conv1D weight loaded as it
// is refused, naming it; stage 3 on 2 ranks (engine.init, each rank its slices) against one process.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <torch/optim/adamw.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "engine/checkpoint/safetensors.h"
#include "engine/config/config.h"
#include "engine/engine.h"
#include "engine/runtime/runtime.h"
#include "examples/models/gpt.h"
#include "examples/models/gpt2_weights.h"
#include "tests/test_helpers.h"

namespace {

namespace fs = std::filesystem;
using zeal::models::Gpt;

class Gpt2Peer : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = (fs::temp_directory_path() / fmt::format("zeal_gpt2_{}", ::getpid())).string();
    peer_ = zeal_test::run_peer_script("examples/gpt2_peer.py", dir_ + " > /dev/null 2>&1");
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }
  void SetUp() override { ZEAL_NEEDS_PEER(peer_); }
  static at::Tensor expected(const std::string& key) {
    return zeal::detail::read_tensor(dir_ + "/expected.safetensors", key);
  }
  static std::string dir_;
  static zeal_test::PeerScript peer_;
};
std::string Gpt2Peer::dir_;
zeal_test::PeerScript Gpt2Peer::peer_;

TEST_F(Gpt2Peer, ItsFilesLoadIntoTheGptExampleAndGiveTransformersLogits) {
  const auto cfg = zeal::models::gpt2_config(dir_ + "/config.json");
  Gpt model(cfg);
  auto options = zeal::models::gpt2_pretrained_options(cfg, dir_);
  options.strict = true;
  options.quiet = true;
  const auto report = zeal::load_pretrained(model, dir_, options);
  EXPECT_TRUE(report.missing.empty());
  EXPECT_TRUE(report.unused.empty()) << report.unused.front();  // the transforms' sources count as used
  model->to(at::kDouble);
  model->eval();
  c10::NoGradGuard no_grad;
  const at::Tensor got = model->forward(expected("ids")), want = expected("logits");
  const double scale = std::max(1.0, want.abs().max().item<double>());
  EXPECT_LE((got - want).abs().max().item<double>(), 1e-9 * scale);  // float64 on both sides
}

TEST_F(Gpt2Peer, ASquareConv1DWeightLoadedAsItIsIsRefused) {
  const auto cfg = zeal::models::gpt2_config(dir_ + "/config.json");
  Gpt model(cfg);
  zeal::PretrainedOptions o;
  o.rename = {{"h0.attn_proj.weight", "transformer.h.0.attn.c_proj.weight"}};  // [32, 32]: fits either way
  o.quiet = true;
  try {
    zeal::load_pretrained(model, dir_, o);
    ADD_FAILURE() << "a Conv1D weight was loaded without its transpose";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("'transformer.h.0.attn.c_proj.weight' in " + dir_ + " is a GPT-2 Conv1D weight"),
              std::string::npos)
        << e.what();
  }
  // A transform naming something the model does not have is named too.
  o.rename.clear();
  o.transforms["h7.attn.weight"] = zeal::transposed("transformer.h.0.attn.c_attn.weight");
  try {
    zeal::load_pretrained(model, dir_, o);
    ADD_FAILURE() << "a transform of a missing name was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("transforms name 'h7.attn.weight'"), std::string::npos) << e.what();
  }
}

TEST_F(Gpt2Peer, Stage3RanksReadTheirSlicesOfTheTransformedWeights) {
  const std::string out = dir_ + "/stage3_logits.bin", dir = dir_;
  const auto results = zeal_test::spawn_checked(
      [&](zeal::Runtime& rt) {
        zeal::Config c = zeal::Config::parse(
            R"({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "zero3_init_flag": true}})", "ds.json");
        c.launch.use_cpu = true;
        zeal::Engine engine(c, rt);
        const auto cfg = zeal::models::gpt2_config(dir + "/config.json");
        auto model = engine.init<Gpt>(cfg);
        auto o = zeal::models::gpt2_pretrained_options(cfg, dir);
        o.strict = true;
        o.quiet = true;
        zeal::load_pretrained(model, dir, o);
        torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
        auto [m, po] = engine.prepare(model, opt);
        (void)po;
        m->eval();
        c10::NoGradGuard no_grad;
        const at::Tensor logits = m->forward(expected("ids")).contiguous();
        if (engine.is_main_process()) {
          std::ofstream f(out, std::ios::binary);
          f.write(static_cast<const char*>(logits.data_ptr()), static_cast<std::streamsize>(logits.nbytes()));
        }
      },
      2);
  ASSERT_EQ(zeal::describe_failures(results), "");
  const int threads = at::get_num_threads();
  at::set_num_threads(1);  // as the ranks: the same order of sums
  const auto cfg = zeal::models::gpt2_config(dir_ + "/config.json");
  Gpt one(cfg);
  auto o = zeal::models::gpt2_pretrained_options(cfg, dir_);
  o.quiet = true;
  zeal::load_pretrained(one, dir_, o);
  one->eval();
  c10::NoGradGuard no_grad;
  const at::Tensor want = one->forward(expected("ids"));
  at::set_num_threads(threads);
  at::Tensor got = at::empty_like(want);
  std::ifstream f(out, std::ios::binary);
  f.read(static_cast<char*>(got.data_ptr()), static_cast<std::streamsize>(got.nbytes()));
  EXPECT_TRUE(got.equal(want)) << "largest difference " << (got - want).abs().max().item<double>();
}

// The way back: after two optimizer steps under stage 3 on 2 ranks, engine.save_model with
// gpt2_export_options writes GPT-2's names and Conv1D layout, and transformers' GPT2LMHeadModel
// loads the export (nothing missing or unexpected) and gives the trained model's logits
// (tests/examples/gpt2_export_check.py).
TEST_F(Gpt2Peer, AnExportLoadsInTransformersAsGpt2) {
  const std::string dir = dir_, export_dir = dir_ + "/export", logits_file = dir_ + "/export_logits.safetensors";
  const auto results = zeal_test::spawn_checked(
      [&](zeal::Runtime& rt) {
        zeal::Config c = zeal::Config::parse(
            R"({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})", "ds.json");
        c.launch.use_cpu = true;
        zeal::Engine engine(c, rt);
        const auto cfg = zeal::models::gpt2_config(dir + "/config.json");
        Gpt model(cfg);
        auto o = zeal::models::gpt2_pretrained_options(cfg, dir);
        o.quiet = true;
        zeal::load_pretrained(model, dir, o);
        torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
        auto [m, po] = engine.prepare(model, opt);
        const at::Tensor ids = expected("ids");
        for (int step = 0; step < 2; ++step) {
          const at::Tensor logits = m->forward(ids);
          engine.backward(at::cross_entropy_loss(logits.narrow(1, 0, 8).reshape({-1, logits.size(2)}),
                                            ids.narrow(1, 1, 8).reshape({-1})));
          po.step();
          po.zero_grad();
        }
        engine.save_model(export_dir, zeal::models::gpt2_export_options(cfg));
        // A name the model lacks (a typo, another depth) is an error on every rank, not a silent skip.
        auto wrong = zeal::models::gpt2_export_options(cfg);
        wrong.names["h9.attn.weight"] = {"transformer.h.9.attn.c_attn.weight", true};
        try {
          engine.save_model(dir + "/export_wrong", wrong);
          ADD_FAILURE() << "an export name the model lacks was accepted";
        } catch (const zeal::Error& e) {
          EXPECT_NE(std::string(e.what()).find("'h9.attn.weight'"), std::string::npos) << e.what();
        }
        m->eval();
        c10::NoGradGuard no_grad;
        const at::Tensor logits = m->forward(ids).contiguous();
        const at::Tensor before = expected("logits").to(at::kFloat);
        EXPECT_GT((logits - before).abs().max().item<double>(), 1e-2) << "training did not move the logits";
        if (engine.is_main_process()) {
          zeal::ckpt::SafetensorsWriter w(logits_file,
                                          {{"ids", "I64", ids.sizes().vec(), static_cast<int64_t>(ids.nbytes())},
                                           {"logits", "F32", logits.sizes().vec(), static_cast<int64_t>(logits.nbytes())}},
                                          {});
          w.append(ids.contiguous().data_ptr(), static_cast<int64_t>(ids.nbytes()));
          w.append(logits.data_ptr(), static_cast<int64_t>(logits.nbytes()));
          w.finish();
        }
        engine.wait_for_everyone();
      },
      2);
  ASSERT_EQ(zeal::describe_failures(results), "");
  const auto check = zeal_test::run_peer_script("examples/gpt2_export_check.py",
                                                dir_ + " " + export_dir + " " + logits_file);
  EXPECT_EQ(check.failure, "");
  EXPECT_EQ(check.skip, "");
}

// Fused and split projections: a file's q, k, v into one fused weight (concatenated), and a fused
// file's weight into three (split_part), value for value.
struct SplitImpl : torch::nn::Module {
  SplitImpl()
      : q(register_module("q", torch::nn::Linear(4, 4))), k(register_module("k", torch::nn::Linear(4, 4))),
        v(register_module("v", torch::nn::Linear(4, 4))) {}
  torch::nn::Linear q, k, v;
};
TORCH_MODULE(Split);
struct FusedImpl : torch::nn::Module {
  FusedImpl() : qkv(register_module("qkv", torch::nn::Linear(4, 12))) {}
  torch::nn::Linear qkv;
};
TORCH_MODULE(Fused);

TEST(PretrainedTransforms, FusedAndSplitProjectionsLoadValueForValue) {
  const std::string dir = (fs::temp_directory_path() / fmt::format("zeal_fused_{}", ::getpid())).string();
  fs::create_directories(dir + "/split");
  fs::create_directories(dir + "/fused");
  at::manual_seed(3);
  Split split;
  Fused fused;
  // The files: split's tensors as they are, and fused's.
  auto write = [](const std::string& file, const torch::nn::Module& m) {
    std::vector<zeal::ckpt::TensorEntry> entries;
    std::vector<at::Tensor> ts;
    for (const auto& p : m.named_parameters()) {
      ts.push_back(p.value().detach().contiguous());
      entries.push_back({p.key(), "F32", ts.back().sizes().vec(), static_cast<int64_t>(ts.back().nbytes()), 0});
    }
    zeal::ckpt::SafetensorsWriter w(file, entries, {{"format", "pt"}});
    for (const auto& t : ts) w.append(t.data_ptr(), static_cast<int64_t>(t.nbytes()));
    w.finish();
  };
  write(dir + "/split/model.safetensors", *split);
  write(dir + "/fused/model.safetensors", *fused);
  // Split's file into a fused model.
  Fused f2;
  zeal::PretrainedOptions o;
  o.quiet = true;
  o.transforms["qkv.weight"] = zeal::concatenated({"q.weight", "k.weight", "v.weight"}, 0);
  o.transforms["qkv.bias"] = zeal::concatenated({"q.bias", "k.bias", "v.bias"}, 0);
  zeal::load_pretrained(f2, dir + "/split", o);
  EXPECT_TRUE(f2->qkv->weight.equal(at::cat({split->q->weight, split->k->weight, split->v->weight}, 0)));
  EXPECT_TRUE(f2->qkv->bias.equal(at::cat({split->q->bias, split->k->bias, split->v->bias}, 0)));
  // Fused's file into a split model.
  Split s2;
  zeal::PretrainedOptions o2;
  o2.quiet = true;
  const char* names[] = {"q", "k", "v"};
  for (int i = 0; i < 3; ++i) {
    o2.transforms[std::string(names[i]) + ".weight"] = zeal::split_part("qkv.weight", 0, i, 3);
    o2.transforms[std::string(names[i]) + ".bias"] = zeal::split_part("qkv.bias", 0, i, 3);
  }
  zeal::load_pretrained(s2, dir + "/fused", o2);
  EXPECT_TRUE(s2->k->weight.equal(fused->qkv->weight.narrow(0, 4, 4)));
  EXPECT_TRUE(s2->v->bias.equal(fused->qkv->bias.narrow(0, 8, 4)));
  // A split that does not divide is named.
  o2.transforms["q.weight"] = zeal::split_part("qkv.weight", 0, 0, 5);
  try {
    zeal::load_pretrained(s2, dir + "/fused", o2);
    ADD_FAILURE() << "an uneven split was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("the transform of 'q.weight': split_part('qkv.weight', dim 0, part 0 of 5)"),
              std::string::npos)
        << e.what();
  }
  fs::remove_all(dir);
}

}  // namespace
