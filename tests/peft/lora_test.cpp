// zeal::peft and zeal::load_pretrained: the adapted forward against a float64 computation, PEFT's
// matching rules and bias modes, training with adapters in every ZeRO stage on 1–3 ranks against
// one process at stage 0, base weights untouched, the adapter file (read back byte by byte), the
// merged weights against base + scaling·B·A, and Hugging Face names in and out.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/transformerlayer.h>
#include <torch/optim/adamw.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "engine/error.h"
#include "engine/checkpoint/consolidate.h"
#include "engine/peft/lora.h"
#include "engine/runtime/runtime.h"
#include "engine/runtime/spawn.h"
#include "examples/models/bert.h"
#include "tests/test_device.h"

namespace fs = std::filesystem;
using zeal::models::BertConfig;
using zeal::models::BertForSequenceClassification;

namespace {

BertConfig tiny_bert() {
  BertConfig c;
  c.vocab_size = 50;
  c.hidden_size = 16;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.intermediate_size = 24;
  c.max_position_embeddings = 12;
  c.hidden_dropout_prob = 0;
  c.attention_probs_dropout_prob = 0;
  return c;
}

std::string temp_dir(const std::string& name) {
  auto d = fs::temp_directory_path() / ("zeal_lora_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d.string();
}

// A safetensors file read independently of zeal's reader: name → float64 tensor, and the sizes.
struct StFile {
  std::map<std::string, at::Tensor> tensors;
  int64_t header_bytes = 0, data_bytes = 0, file_bytes = 0;
};
StFile read_st(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(f.good()) << path;
  uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);
  std::string header(n, '\0');
  f.read(header.data(), static_cast<std::streamsize>(n));
  std::vector<char> data((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  StFile out;
  out.header_bytes = static_cast<int64_t>(8 + n);
  out.data_bytes = static_cast<int64_t>(data.size());
  out.file_bytes = out.header_bytes + out.data_bytes;
  const auto j = nlohmann::json::parse(header);
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const auto off = it.value()["data_offsets"].get<std::vector<int64_t>>();
    const auto shape = it.value()["shape"].get<std::vector<int64_t>>();
    const std::string dt = it.value()["dtype"];
    EXPECT_EQ(dt, "F32") << it.key();
    at::Tensor t = at::empty(shape, at::kFloat);
    EXPECT_EQ(off[1] - off[0], t.nbytes()) << it.key();
    std::memcpy(t.data_ptr(), data.data() + off[0], t.nbytes());
    out.tensors[it.key()] = t.to(at::kDouble);
  }
  return out;
}

// Inside a spawned rank a gtest assertion stays in the child process: a failed check throws
// instead, which spawn reports as the rank's failure.
void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("check failed: " + what);
}

// offload: "" (none), "cpu", or an nvme_path (optimizer state and parameters on nvme, stage 3).
zeal::Config config_for(int stage, bool init = false, bool checkpointing = false, const std::string& offload = "") {
  zeal::Config c = zeal_test::test_config();
  if (offload == "cpu") {
    c.zero.offload_optimizer.device = zeal::OffloadDevice::kCpu;
  } else if (!offload.empty()) {
    c.zero.offload_optimizer.device = zeal::OffloadDevice::kNvme;
    c.zero.offload_optimizer.nvme_path = offload;
    c.zero.offload_param.device = zeal::OffloadDevice::kNvme;
    c.zero.offload_param.nvme_path = offload;
    c.zero.offload_param.max_in_cpu = 0;
  }
  c.activation_checkpointing.enabled = checkpointing;
  c.zero.stage = stage;
  c.gradient_clipping = {0.0, false};
  c.zero.reduce_bucket_size = {300, false};  // several buckets even for these tiny adapters
  c.zero.stage3_param_persistence_threshold = {0, false};
  c.zero.zero3_init_flag = init;
  return c;
}

// The same batches for every world size: sample i of step s is row s·global + i.
struct Data {
  at::Tensor ids, labels;
};
Data make_data(int64_t samples, int64_t seq, int64_t vocab, int64_t labels) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(99);
  return {at::randint(1, vocab, {samples, seq}, g), at::randint(0, labels, {samples}, g)};
}

zeal::peft::LoraConfig lora_config() {
  zeal::peft::LoraConfig lc;
  lc.r = 4;
  lc.lora_alpha = 8;
  lc.target_modules = {"query", "value"};
  lc.modules_to_save = {"classifier"};
  lc.init_lora_weights = "none";  // B random too: the adapters change the output from the first step
  return lc;
}

// Trains the adapted tiny BERT on `world` ranks at `stage`; leaves adapter/, merged/ and the
// initial base weights (init.safetensors, through save_merged before training) in `dir`.
// With `save_checkpoints`, also ckpt/ (save_state) and ckpt_nofrozen/ (without frozen weights),
// before the merge.
void train_lora(int stage, int world, const std::string& dir, bool init, int steps = 4, bool checkpointing = false,
                const std::string& offload = "", bool save_checkpoints = false) {
  const int64_t global = 6, seq = 8, labels = 3;
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Engine engine(config_for(stage, init, checkpointing, offload), rt);
        zeal_test::seed(5);
        auto model = init ? engine.init<BertForSequenceClassification>(tiny_bert(), labels)
                          : BertForSequenceClassification(tiny_bert(), labels);
        auto peft = zeal::peft::get_peft_model(model, lora_config());
        torch::optim::AdamW opt(peft.trainable_parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
        auto [m, o] = engine.prepare(model, opt);
        peft.save_merged(dir + "/init", &engine);
        const Data d = make_data(global * steps, seq, tiny_bert().vocab_size, labels);
        const int64_t per = global / world, r = engine.process_index();
        for (int s = 0; s < steps; ++s) {
          const int64_t begin = s * global + r * per;
          at::Tensor logits = m->forward(d.ids.narrow(0, begin, per));
          at::Tensor loss = at::cross_entropy_loss(logits, d.labels.narrow(0, begin, per));
          engine.backward(loss);
          o.step();
          o.zero_grad();
        }
        peft.save_pretrained(dir + "/adapter", &engine);
        engine.save_model(dir + "/export_merged", {.merged = true});  // merged in the export, not in the model
        if (save_checkpoints) {
          engine.save_state(dir + "/ckpt");
          engine.save_state(dir + "/ckpt_nofrozen", {.include_frozen = false});
          auto off = peft.disable_adapter();  // saved while evaluating the base model, say
          engine.save_state(dir + "/ckpt_disabled");
        }
        peft.merge_and_unload(&engine);
        peft.save_merged(dir + "/merged", &engine);
        try {  // merged into the model now: nothing is left to merge, and the export says so
          engine.save_model(dir + "/export_again", {.merged = true});
          throw std::runtime_error("save_model({.merged = true}) after merge_and_unload: no error");
        } catch (const zeal::Error& e) {
          if (std::string(e.what()).find("holds no active LoRA adapters to merge") == std::string::npos) throw;
        }
      },
      world);
  for (const auto& res : results) ASSERT_TRUE(res.ok()) << "rank " << res.rank << ": " << res.failure;
}

}  // namespace

TEST(Lora, ForwardInterpositionIsInEffect) { EXPECT_TRUE(zeal::peft::forward_interposed()); }

TEST(Lora, AdaptedForwardEqualsFloat64BasePlusScaledBA) {
  zeal_test::seed(1);
  auto root = std::make_shared<torch::nn::Module>();
  torch::nn::Linear lin(torch::nn::LinearOptions(5, 7));
  torch::nn::Linear other(torch::nn::LinearOptions(5, 7));
  root->register_module("proj", lin);
  root->register_module("other", other);
  const at::Tensor x = at::randn({3, 4, 5});
  const at::Tensor before = lin(x).detach().clone();
  zeal::peft::LoraConfig lc;
  lc.r = 2;
  lc.lora_alpha = 6;
  lc.target_modules = {"proj"};
  auto peft = zeal::peft::get_peft_model(root, lc);
  ASSERT_EQ(peft.adapted_modules(), std::vector<std::string>{"proj"});
  EXPECT_TRUE(at::equal(lin(x), before)) << "B starts at zero: the adapted layer's output is the base's";
  auto A = std::dynamic_pointer_cast<torch::nn::LinearImpl>(lin->named_children()["lora_A"]);
  auto B = std::dynamic_pointer_cast<torch::nn::LinearImpl>(lin->named_children()["lora_B"]);
  ASSERT_TRUE(A && B);
  {
    c10::NoGradGuard ng;
    B->weight.normal_();
  }
  const at::Tensor xd = x.to(at::kDouble);
  const at::Tensor want = at::matmul(xd, lin->weight.to(at::kDouble).t()) + lin->bias.to(at::kDouble) +
                          at::matmul(at::matmul(xd, A->weight.to(at::kDouble).t()), B->weight.to(at::kDouble).t()) * 3.0;
  EXPECT_LT((lin(x).to(at::kDouble) - want).abs().max().item<double>(), 1e-5);
  // Called as a member function, through the holder, or by LibTorch's own callers: one forward.
  EXPECT_TRUE(at::equal(lin->forward(x), lin(x)));
  // A Linear without adapters is LibTorch's own computation, bit for bit.
  EXPECT_TRUE(at::equal(other(x), torch::nn::functional::linear(x, other->weight, other->bias)));
  {
    auto off = peft.disable_adapter();
    EXPECT_TRUE(at::equal(lin(x), before));
  }
  EXPECT_FALSE(at::equal(lin(x), before));
  // Gradients reach A and B and not the frozen base.
  lin(x).sum().backward();
  EXPECT_TRUE(A->weight.grad().defined() && B->weight.grad().defined());
  EXPECT_FALSE(lin->weight.grad().defined());
  // Merged: W + scaling·B·A, the adapters gone, the same output.
  const at::Tensor adapted = lin(x).detach().clone();
  const at::Tensor merged_w = lin->weight.to(at::kDouble) + at::matmul(B->weight.to(at::kDouble), A->weight.to(at::kDouble)) * 3.0;
  peft.merge_and_unload();
  EXPECT_FALSE(lin->named_children().contains("lora_A"));
  EXPECT_LT((lin->weight.to(at::kDouble) - merged_w).abs().max().item<double>(), 1e-6);
  EXPECT_LT((lin(x) - adapted).abs().max().item<double>(), 1e-5);
}

// LibTorch's own modules: TransformerEncoderLayer calls its Linear layers through Linear::forward,
// so their adapters act and train; MultiheadAttention multiplies by its out_proj's weight directly,
// so adapting out_proj is refused and all-linear leaves it out.
TEST(Lora, TransformerEncoderLayerAdaptersRunAndAttentionsOutProjIsRefused) {
  zeal_test::seed(3);
  auto build = [] {
    auto root = std::make_shared<torch::nn::Module>();
    root->register_module("layer", torch::nn::TransformerEncoderLayer(
                                       torch::nn::TransformerEncoderLayerOptions(16, 4).dim_feedforward(32).dropout(0.0)));
    return root;
  };
  auto root = build();
  auto layer = root->named_children()["layer"];
  auto run = [&](const at::Tensor& x) { return layer->as<torch::nn::TransformerEncoderLayerImpl>()->forward(x); };
  const at::Tensor x = at::randn({5, 2, 16});
  const at::Tensor before = run(x).detach().clone();
  zeal::peft::LoraConfig lc;
  lc.r = 2;
  lc.target_modules = {"linear1", "linear2"};
  auto peft = zeal::peft::get_peft_model(root, lc);
  EXPECT_EQ(peft.adapted_modules(), (std::vector<std::string>{"layer.linear1", "layer.linear2"}));
  EXPECT_TRUE(at::equal(run(x), before)) << "B starts at zero";
  std::vector<at::Tensor> adapters;
  for (const auto& item : root->named_parameters()) {
    if (item.key().find("lora_") != std::string::npos) adapters.push_back(item.value());
  }
  ASSERT_EQ(adapters.size(), 4u);
  {
    c10::NoGradGuard ng;
    for (auto& p : adapters) p.normal_();
  }
  EXPECT_GT((run(x) - before).abs().max().item<double>(), 1e-3) << "the adapters change the layer's output";
  run(x).pow(2).sum().backward();
  for (auto& p : adapters) {
    ASSERT_TRUE(p.grad().defined());
    EXPECT_GT(p.grad().abs().max().item<double>(), 0.0);
  }

  zeal::peft::LoraConfig out_proj = lc;
  out_proj.target_modules = {"out_proj"};
  try {
    (void)zeal::peft::get_peft_model(build(), out_proj);
    ADD_FAILURE() << "adapting MultiheadAttention's out_proj was accepted";
  } catch (const zeal::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'layer.self_attn.out_proj' is the out_proj of a torch::nn::MultiheadAttention"),
              std::string::npos)
        << e.what();
  }
  zeal::peft::LoraConfig all = lc;
  all.target_modules = {"all-linear"};
  EXPECT_EQ(zeal::peft::get_peft_model(build(), all).adapted_modules(),
            (std::vector<std::string>{"layer.linear1", "layer.linear2"}));
}

// A module that multiplies by an adapted Linear's weight itself never runs the adapters: the
// engine's first optimizer step refuses, on every rank, naming the layer (not a silent no-op).
struct BypassImpl : torch::nn::Module {
  BypassImpl() {
    used = register_module("used", torch::nn::Linear(6, 6));
    direct = register_module("direct", torch::nn::Linear(6, 6));
  }
  at::Tensor forward(const at::Tensor& x) {
    return used(torch::nn::functional::linear(x, direct->weight, direct->bias));  // `direct` bypassed
  }
  torch::nn::Linear used{nullptr}, direct{nullptr};
};
TORCH_MODULE(Bypass);

TEST(Lora, AdaptersThatNeverRunAreRefusedAtTheFirstStepOnEveryRank) {
  for (const auto& [targets, want] :
       {std::pair{std::vector<std::string>{"used", "direct"}, std::string("the LoRA adapters of 1 adapted layer did not "
                                                                           "run in the first step's forward passes on any "
                                                                           "rank: direct.")},
        std::pair{std::vector<std::string>{"used"}, std::string("accepted")}}) {
    const std::string dir =
        (std::filesystem::temp_directory_path() / ("zeal_bypass_" + std::to_string(::getpid()))).string();
    std::filesystem::create_directories(dir);
    auto results = zeal::spawn(
        [&](zeal::Runtime& rt) {
          zeal::Engine engine(config_for(3, false), rt);
          Bypass model;
          zeal::peft::LoraConfig lc;
          lc.r = 2;
          lc.target_modules = targets;
          auto peft = zeal::peft::get_peft_model(model.ptr(), lc);
          torch::optim::AdamW opt(peft.trainable_parameters(), torch::optim::AdamWOptions(1e-2));
          auto [m, o] = engine.prepare(model, opt);
          std::string msg = "accepted";
          try {
            engine.backward(m->forward(at::randn({4, 6})).pow(2).sum());
            o.step();
          } catch (const zeal::Error& e) {
            msg = e.what();
          }
          std::ofstream(dir + "/" + std::to_string(rt.rank())) << msg;
        },
        2);
    ASSERT_EQ(zeal::describe_failures(results), "");
    for (int r = 0; r < 2; ++r) {
      std::ifstream f(dir + "/" + std::to_string(r));
      const std::string msg((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      EXPECT_EQ(msg.rfind(want, 0), 0u) << "rank " << r << ": " << msg;
    }
    std::filesystem::remove_all(dir);
  }
}

// clone() of an adapted model is refused (LibTorch's Cloneable finds the adapter modules that
// reset() does not make), so no copy runs without its adapters; the original runs as before.
TEST(Lora, ACloneOfAnAdaptedModelIsRefused) {
  zeal_test::seed(4);
  torch::nn::Sequential seq(torch::nn::Linear(4, 4), torch::nn::Linear(4, 2));
  zeal::peft::LoraConfig lc;
  lc.r = 2;
  lc.target_modules = {"0"};
  auto peft = zeal::peft::get_peft_model(seq.ptr(), lc);
  const at::Tensor x = at::randn({3, 4});
  const at::Tensor y = seq->forward(x);
  try {
    (void)seq->clone();
    ADD_FAILURE() << "the adapted model was cloned";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not have the same number of child modules"), std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(at::equal(seq->forward(x), y)) << "the original is unaffected";
}

TEST(Lora, DropoutActsOnTheAdapterPathOnlyInTraining) {
  zeal_test::seed(2);
  auto root = std::make_shared<torch::nn::Module>();
  torch::nn::Linear lin(torch::nn::LinearOptions(8, 8));
  root->register_module("q", lin);
  zeal::peft::LoraConfig lc;
  lc.r = 4;
  lc.lora_dropout = 0.5;
  lc.target_modules = {"q"};
  lc.init_lora_weights = "none";
  auto peft = zeal::peft::get_peft_model(root, lc);
  const at::Tensor x = at::randn({16, 8});
  root->eval();
  const at::Tensor a = lin(x), b = lin(x);
  EXPECT_TRUE(at::equal(a, b)) << "no dropout in eval";
  root->train();
  EXPECT_FALSE(at::equal(lin(x), a)) << "dropout on the adapter's input in training";
}

TEST(Lora, MatchingFollowsPeftRules) {
  auto model = BertForSequenceClassification(tiny_bert(), 3);
  auto count = [&](zeal::peft::LoraConfig lc) {
    auto m = BertForSequenceClassification(tiny_bert(), 3);
    return zeal::peft::get_peft_model(m, lc).adapted_modules();
  };
  zeal::peft::LoraConfig lc;
  lc.target_modules = {"query", "value"};
  auto qv = count(lc);
  ASSERT_EQ(qv.size(), 4u);
  EXPECT_EQ(qv[0], "bert.encoder.layer.0.attention.self.query");  // Sharded's "block" left out
  lc.target_modules = {};
  lc.target_modules_regex = R"(.*\.layer\.1\.attention\.self\.(query|key))";
  EXPECT_EQ(count(lc), (std::vector<std::string>{"bert.encoder.layer.1.attention.self.query",
                                                 "bert.encoder.layer.1.attention.self.key"}));
  lc.target_modules_regex = "";
  lc.target_modules = {"all-linear"};
  EXPECT_EQ(count(lc).size(), 2u * 6u + 1u) << "every Linear of the layers and the pooler, not the classifier";
  lc.target_modules = {"dense"};
  lc.exclude_modules = {"bert.encoder.layer.0.attention.output.dense", "pooler.dense"};
  EXPECT_EQ(count(lc).size(), 2u * 3u + 1u - 2u);
  lc.exclude_modules = {};
  lc.target_modules = {"nonexistent"};
  try {
    count(lc);
    FAIL() << "no match must be an error";
  } catch (const zeal::Error& e) {
    EXPECT_NE(std::string(e.what()).find("bert.encoder.layer.0.attention.self.query"), std::string::npos) << e.what();
  }
  lc.target_modules = {"self"};
  try {
    count(lc);
    FAIL() << "a non-Linear target must be an error";
  } catch (const zeal::Error& e) {
    EXPECT_NE(std::string(e.what()).find("Linear modules only"), std::string::npos) << e.what();
  }
  lc.target_modules = {"query"};
  lc.r = 0;
  EXPECT_THROW(count(lc), zeal::Error);
}

TEST(Lora, BiasModesAndModulesToSaveChooseWhatTrainsAndWhatIsSaved) {
  const BertConfig c = tiny_bert();
  const int64_t H = c.hidden_size, L = c.num_hidden_layers, r = 4;
  const int64_t lora = L * 2 * (r * H + H * r);
  struct Case {
    std::string bias;
    bool save_classifier;
    int64_t trainable;
    size_t saved;
  };
  // Per layer: query, key, value, attention output, its LayerNorm, intermediate, output, its LayerNorm.
  const int64_t all_biases = L * (4 * H + H + c.intermediate_size + H + H) + H /*embeddings' LayerNorm*/ + H /*pooler*/ + 3 /*classifier*/;
  // LayerNorm biases are biases too in PEFT's "all" ("bias" in the name).
  for (const Case& k : {Case{"none", false, lora, size_t(L * 4)}, Case{"lora_only", false, lora + L * 2 * H, size_t(L * 6)},
                        Case{"all", false, lora + all_biases, 0}, Case{"none", true, lora + H * 3 + 3, size_t(L * 4 + 2)}}) {
    auto m = BertForSequenceClassification(c, 3);
    zeal::peft::LoraConfig lc;
    lc.r = r;
    lc.target_modules = {"query", "value"};
    lc.bias = k.bias;
    if (k.save_classifier) lc.modules_to_save = {"classifier"};
    auto peft = zeal::peft::get_peft_model(m, lc);
    EXPECT_EQ(peft.num_trainable_parameters(), k.trainable) << k.bias;
    const auto state = peft.adapter_state_dict();
    if (k.saved) EXPECT_EQ(state.size(), k.saved) << k.bias;
    if (k.bias == "lora_only") EXPECT_TRUE(state.count("base_model.model.bert.encoder.layer.0.attention.self.query.base_layer.bias"));
    if (k.save_classifier) EXPECT_TRUE(state.count("base_model.model.classifier.weight"));
    EXPECT_TRUE(state.count("base_model.model.bert.encoder.layer.1.attention.self.value.lora_B.weight"));
    // PEFT's line, computed here from the counts (a module to save counts twice, as in PEFT).
    const int64_t all = peft.num_parameters() + (k.save_classifier ? H * 3 + 3 : 0);
    char pct[32];
    std::snprintf(pct, sizeof pct, "%.4f", 100.0 * static_cast<double>(k.trainable) / static_cast<double>(all));
    EXPECT_NE(peft.trainable_parameters_line().find(std::string("trainable%: ") + pct), std::string::npos)
        << peft.trainable_parameters_line();
  }
}

// The adapters after training equal one process's at stage 0 in every stage and world size;
// frozen weights never change; the file is the adapters' bytes; merged = base + scaling·B·A.
// Activation checkpointing of the encoder layers (the first one's input asks for no gradient: the
// embeddings are frozen) trains the same adapters bit for bit, at stages 0 and 3 on 2 ranks.
TEST(Lora, CheckpointedLayersTrainTheSameAdaptersBitForBit) {
  const std::string root = temp_dir("lora_ckpt");
  for (int stage : {0, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    const std::string plain = root + "/plain" + std::to_string(stage), ckpt = root + "/ckpt" + std::to_string(stage);
    train_lora(stage, 2, plain, false, 3, false);
    train_lora(stage, 2, ckpt, false, 3, true);
    const StFile a = read_st(plain + "/adapter/adapter_model.safetensors");
    const StFile b = read_st(ckpt + "/adapter/adapter_model.safetensors");
    const StFile start = read_st(plain + "/init/model.safetensors");
    ASSERT_EQ(a.tensors.size(), b.tensors.size());
    for (const auto& [k, t] : a.tensors) {
      ASSERT_TRUE(b.tensors.count(k)) << k;
      EXPECT_TRUE(at::equal(t, b.tensors.at(k))) << k;
    }
    // The merged models agree too, and training changed them.
    const StFile ma = read_st(plain + "/merged/model.safetensors"), mb = read_st(ckpt + "/merged/model.safetensors");
    bool moved = false;
    for (const auto& [k, t] : ma.tensors) {
      EXPECT_TRUE(at::equal(t, mb.tensors.at(k))) << k;
      moved = moved || !at::equal(t, start.tensors.at(k));
    }
    EXPECT_TRUE(moved);
  }
}

// zeal consolidate --merged --no_frozen: the adapted weights are the fine-tuned layers, written merged
// (the same bits as save_model's merged export) beside the trainable ones; the other frozen weights
// are left out. A checkpoint saved without frozen weights cannot be merged: the error names the
// weight, and nothing is written.
TEST(Lora, MergedExportWithoutFrozenWeightsKeepsTheAdaptedOnes) {
  const std::string dir = temp_dir("merged_nofrozen");
  train_lora(3, 2, dir, false, 2, false, "", /*save_checkpoints=*/true);
  const StFile full = read_st(dir + "/export_merged/model.safetensors");
  zeal::ckpt::ConsolidateOptions o;
  o.merged = true;
  o.include_frozen = false;
  zeal::ckpt::consolidate(dir + "/ckpt", dir + "/out", o);
  const StFile got = read_st(dir + "/out/model.safetensors");
  int adapted = 0;
  for (const auto& [k, t] : full.tensors) {
    const std::string layer = k.substr(0, k.rfind('.'));
    const bool is_adapted = k.size() > 7 && k.rfind(".weight") == k.size() - 7 &&
                            (layer.find(".query") != std::string::npos || layer.find(".value") != std::string::npos);
    const bool trainable = k.rfind("classifier.", 0) == 0;
    if (is_adapted || trainable) {
      ASSERT_TRUE(got.tensors.count(k)) << k << " left out";
      EXPECT_TRUE(at::equal(got.tensors.at(k), t)) << k;
      adapted += is_adapted;
    } else {
      EXPECT_FALSE(got.tensors.count(k)) << k << " is frozen and not adapted: --no_frozen leaves it out";
    }
  }
  EXPECT_EQ(adapted, 2 * 2) << "query and value of both layers";
  try {
    zeal::ckpt::consolidate(dir + "/ckpt_nofrozen", dir + "/out2", {.merged = true});
    ADD_FAILURE() << "merging a checkpoint without the adapted weights: no error";
  } catch (const zeal::Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not hold the weight"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(dir + "/out2/model.safetensors"));
}

// A checkpoint saved inside disable_adapter() (while evaluating the base model, say) holds the
// adapters and the trained modules to save, not their originals: its merged export is the one saved
// with the adapters on, at stage 3 (units) and stage 1 (frozen weights written from rank 0).
TEST(Lora, ACheckpointSavedInsideDisableAdapterMergesAsOneSavedOutside) {
  for (const int stage : {3, 1}) {
    SCOPED_TRACE(testing::Message() << "stage " << stage);
    const std::string dir = temp_dir("disabled" + std::to_string(stage));
    train_lora(stage, 2, dir, false, 2, false, "", /*save_checkpoints=*/true);
    const StFile full = read_st(dir + "/export_merged/model.safetensors");
    zeal::ckpt::consolidate(dir + "/ckpt_disabled", dir + "/out", {.merged = true});
    const StFile off = read_st(dir + "/out/model.safetensors");
    EXPECT_EQ(off.tensors.size(), full.tensors.size());
    for (const auto& [k, t] : full.tensors) {
      ASSERT_TRUE(off.tensors.count(k)) << k;
      EXPECT_TRUE(at::equal(off.tensors.at(k), t)) << k << ": saved inside disable_adapter(), merged differently";
    }
    fs::remove_all(dir);
  }
}

TEST(Lora, EveryStageAndWorldSizeTrainsTheSameAdapters) {
  const std::string root = temp_dir("stages");
  train_lora(0, 1, root + "/ref", false);
  const StFile ref = read_st(root + "/ref/adapter/adapter_model.safetensors");
  ASSERT_EQ(ref.tensors.size(), 2u * 2u * 2u + 2u);
  const StFile init_ref = read_st(root + "/ref/init/model.safetensors");
  const double scaling = lora_config().scaling();
  struct Run {
    int stage, world;
    bool init;
    std::string offload = "";  // "cpu" or "nvme"
  };
  // Every stage on 1, 2 and 3 ranks (stage 0 on 1 rank is the reference), stage 3 also built
  // partitioned by engine.init, and merged with the optimizer state offloaded to the CPU and with it
  // and the parameters on nvme.
  for (const Run& run : {Run{0, 2, false}, Run{0, 3, false}, Run{1, 1, false}, Run{1, 2, false}, Run{1, 3, false},
                         Run{2, 1, false}, Run{2, 2, false}, Run{2, 3, false}, Run{3, 1, false}, Run{3, 2, false},
                         Run{3, 3, false}, Run{3, 3, true}, Run{2, 2, false, "cpu"}, Run{3, 2, false, "cpu"},
                         Run{3, 2, false, "nvme"}, Run{3, 3, false, "nvme"}}) {
    SCOPED_TRACE("stage " + std::to_string(run.stage) + ", " + std::to_string(run.world) + " ranks" +
                 (run.init ? ", engine.init" : "") + (run.offload.empty() ? "" : ", offload " + run.offload));
    const std::string dir = root + "/s" + std::to_string(run.stage) + "w" + std::to_string(run.world) +
                            (run.init ? "i" : "") + run.offload;
    fs::create_directories(dir + "/swap");
    train_lora(run.stage, run.world, dir, run.init, 4, false, run.offload == "nvme" ? dir + "/swap" : run.offload);
    const StFile got = read_st(dir + "/adapter/adapter_model.safetensors");
    int64_t bytes = 0;
    for (const auto& [k, t] : got.tensors) bytes += t.numel() * 4;
    EXPECT_EQ(got.data_bytes, bytes) << "the file holds the adapters' bytes and nothing else";
    ASSERT_EQ(got.tensors.size(), ref.tensors.size());
    for (const auto& [k, t] : ref.tensors) {
      ASSERT_TRUE(got.tensors.count(k)) << k;
      EXPECT_GT(got.tensors.at(k).numel(), 0) << k;
      EXPECT_LT((got.tensors.at(k) - t).abs().max().item<double>(), 2e-5) << k;
    }
    // Frozen weights: bit-identical to the initial ones; adapted ones: initial + scaling·B·A.
    const StFile init = read_st(dir + "/init/model.safetensors");
    const StFile merged = read_st(dir + "/merged/model.safetensors");
    ASSERT_EQ(merged.tensors.size(), init_ref.tensors.size());
    for (const auto& [k, w0] : init.tensors) {
      EXPECT_TRUE(at::equal(w0, init_ref.tensors.at(k))) << k << ": every world size starts from the same base";
      const std::string layer = k.substr(0, k.rfind('.'));
      const std::string a = "base_model.model." + layer + ".lora_A.weight", b = "base_model.model." + layer + ".lora_B.weight";
      if (k.rfind(".weight") == k.size() - 7 && got.tensors.count(a)) {
        const at::Tensor want = w0 + at::matmul(got.tensors.at(b), got.tensors.at(a)) * scaling;
        EXPECT_LT((merged.tensors.at(k) - want).abs().max().item<double>(), 1e-6) << k;
        EXPECT_GT((merged.tensors.at(k) - w0).abs().max().item<double>(), 1e-4) << k << " was merged";
      } else if (k.rfind("classifier.", 0) == 0) {
        EXPECT_TRUE(at::equal(merged.tensors.at(k), got.tensors.at("base_model.model." + k))) << k;
      } else {
        EXPECT_TRUE(at::equal(merged.tensors.at(k), w0)) << k << " is frozen and must not change";
      }
    }
    // engine.save_model with `merged`, before the merge: the same weights within the rounding of its
    // float64 sum against merge_and_unload's float32 one, and no adapter tensors.
    const StFile exported = read_st(dir + "/export_merged/model.safetensors");
    EXPECT_EQ(exported.tensors.size(), merged.tensors.size());
    for (const auto& [k, t] : merged.tensors) {
      ASSERT_TRUE(exported.tensors.count(k)) << k;
      EXPECT_LT((exported.tensors.at(k) - t).abs().max().item<double>(), 1e-6) << k;
    }
  }
  fs::remove_all(root);
}

// A block whose adapted Linear outputs meet in either operand order, in one expression or two
// statements, and an adapted Linear at the root (outside every stage-3 unit).
struct PairBlockImpl : torch::nn::Module {
  explicit PairBlockImpl(bool swap) : swap(swap) {
    a = register_module("a", torch::nn::Linear(6, 6));
    b = register_module("b", torch::nn::Linear(6, 6));
    norm = register_module("norm", torch::nn::Linear(6, 6));
  }
  at::Tensor forward(const at::Tensor& x) {
    if (swap) {
      at::Tensor first = b(x);
      at::Tensor second = a(at::tanh(first));
      return norm(second) + first;
    }
    return a(x) + norm(b(x));
  }
  bool swap;
  torch::nn::Linear a{nullptr}, b{nullptr}, norm{nullptr};
};
TORCH_MODULE(PairBlock);
struct PairNetImpl : torch::nn::Module {
  PairNetImpl() {
    head = register_module("head", torch::nn::Linear(6, 6));
    for (int i = 0; i < 3; ++i) blocks.push_back(register_module("h" + std::to_string(i), zeal::Sharded<PairBlock>(i % 2 == 1)));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& bl : blocks) x = bl->forward(x);
    return head(x);
  }
  torch::nn::Linear head{nullptr};
  std::vector<zeal::Sharded<PairBlock>> blocks;
};
TORCH_MODULE(PairNet);

TEST(Lora, OperandOrderAndRootLayersDoNotMatterUnderStage3) {
  const std::string root = temp_dir("pairs");
  auto run = [&](int stage, int world) {
    const std::string out = root + "/" + std::to_string(stage) + "_" + std::to_string(world);
    auto results = zeal::spawn(
        [&](zeal::Runtime& rt) {
          zeal::Engine engine(config_for(stage), rt);
          zeal_test::seed(3);
          PairNet net;
          zeal::peft::LoraConfig lc;
          lc.r = 2;
          lc.target_modules = {"a", "b", "head"};
          lc.init_lora_weights = "none";
          auto peft = zeal::peft::get_peft_model(net, lc);
          require(peft.adapted_modules().size() == 7u, "7 adapted Linear modules");
          torch::optim::AdamW opt(peft.trainable_parameters(), torch::optim::AdamWOptions(1e-2));
          auto [m, o] = engine.prepare(net, opt);
          auto g = at::make_generator<at::CPUGeneratorImpl>(4);
          const at::Tensor x = at::randn({6, 6}, g), y = at::randn({6, 6}, g);
          const int64_t per = 6 / world, r = engine.process_index();
          for (int s = 0; s < 3; ++s) {
            engine.backward(at::mse_loss(m->forward(x.narrow(0, r * per, per)), y.narrow(0, r * per, per)));
            o.step();
            o.zero_grad();
          }
          peft.save_pretrained(out, &engine);
          // Merging under stage 3: on 4 ranks a block's 48 adapter elements leave the last rank a
          // shard of padding only, which must still take part in every collective of the merge.
          peft.merge_and_unload(&engine);
        },
        world);
    for (const auto& res : results) EXPECT_TRUE(res.ok()) << "rank " << res.rank << ": " << res.failure;
    return read_st(out + "/adapter_model.safetensors");
  };
  (void)run(3, 4);
  const StFile ref = run(0, 1), got = run(3, 2);
  ASSERT_EQ(ref.tensors.size(), 14u);
  for (const auto& [k, t] : ref.tensors) EXPECT_LT((got.tensors.at(k) - t).abs().max().item<double>(), 2e-5) << k;
  fs::remove_all(root);
}

TEST(Lora, SavedAdapterLoadsBackIntoAFreshModel) {
  const std::string dir = temp_dir("reload");
  zeal_test::seed(8);
  auto m = BertForSequenceClassification(tiny_bert(), 3);
  auto peft = zeal::peft::get_peft_model(m, lora_config());
  const at::Tensor ids = at::randint(1, 50, {2, 7});
  const at::Tensor out = m->forward(ids).detach();
  peft.save_pretrained(dir);
  const auto cfg = zeal::peft::LoraConfig::from_pretrained(dir);
  EXPECT_EQ(cfg.r, 4);
  EXPECT_EQ(cfg.modules_to_save, std::vector<std::string>{"classifier"});
  // Another model with the same base (seed) but other adapters: loading gives the same output.
  zeal_test::seed(8);
  auto m2 = BertForSequenceClassification(tiny_bert(), 3);
  zeal_test::seed(100);
  auto peft2 = zeal::peft::from_pretrained(m2.ptr(), dir);
  EXPECT_TRUE(at::allclose(m2->forward(ids), out, 0, 1e-6));
  // A mismatching adapter (other targets) is refused and changes nothing.
  zeal_test::seed(8);
  auto m3 = BertForSequenceClassification(tiny_bert(), 3);
  auto lc = lora_config();
  lc.target_modules = {"query"};
  auto peft3 = zeal::peft::get_peft_model(m3, lc);
  const at::Tensor before = m3->forward(ids).detach();
  EXPECT_THROW(peft3.load_adapter(dir), zeal::Error);
  EXPECT_TRUE(at::equal(m3->forward(ids), before));
  fs::remove_all(dir);
}

// Bytes this process has read through read(2)/pread(2) and friends, as the kernel counts them.
int64_t bytes_read_by_process() {
  std::ifstream io("/proc/self/io");
  std::string key;
  int64_t value = 0;
  while (io >> key >> value) {
    if (key == "rchar:") return value;
  }
  throw std::runtime_error("/proc/self/io has no rchar");
}

// save_merged into a folder holding an earlier sharded export replaces that export as a set: the
// old index and shards go, the folder's other files stay, nothing partial is left.
TEST(SaveMerged, ReplacesAnEarlierShardedExportAsASet) {
  namespace fs = std::filesystem;
  const std::string dir = temp_dir("merged_set");
  fs::create_directories(dir);
  for (const char* name : {"model.safetensors.index.json", "model-00001-of-00002.safetensors",
                           "model-00002-of-00002.safetensors", "config.json", "tokenizer.json"}) {
    std::ofstream(dir + "/" + name) << "earlier";
  }
  zeal_test::seed(5);
  zeal::models::BertModel base(tiny_bert());
  zeal::peft::LoraConfig lc;
  lc.target_modules = {"query"};
  auto p = zeal::peft::get_peft_model(base.ptr(), lc);
  p.save_merged(dir);
  std::set<std::string> left;
  for (const auto& e : fs::directory_iterator(dir)) left.insert(e.path().filename().string());
  EXPECT_EQ(left, (std::set<std::string>{"config.json", "model.safetensors", "tokenizer.json"}));
  EXPECT_FALSE(read_st(dir + "/model.safetensors").tensors.empty());
}

// Under stage 3 with engine.init each rank reads its slices of the units' weights, not the file:
// the kernel's count of bytes read during load_pretrained equals the root's tensors whole plus a
// 1/world share of every unit tensor, on 2 and 3 ranks.
TEST(Pretrained, Stage3InitReadsOnlyEachRanksShareOfTheFile) {
  const std::string dir = temp_dir("slices");
  BertConfig c = tiny_bert();
  c.hidden_size = 64;
  c.intermediate_size = 256;
  c.num_hidden_layers = 4;
  zeal_test::seed(21);
  zeal::models::BertModel base(c);
  {
    auto root = base.ptr();
    zeal::peft::LoraConfig lc;
    lc.target_modules = {"query"};
    auto p = zeal::peft::get_peft_model(root, lc);
    p.merge_and_unload();
    p.save_merged(dir);
  }
  const std::string file = dir + "/model.safetensors";
  const StFile st = read_st(file);
  int64_t root_bytes = 0, unit_bytes = 0;
  for (const auto& [k, t] : st.tensors) (k.rfind("encoder.layer.", 0) == 0 ? unit_bytes : root_bytes) += t.numel() * 4;
  ASSERT_GT(unit_bytes, 8 * root_bytes) << "the units must hold most of the file for the count to tell";
  for (int world : {2, 3}) {
    SCOPED_TRACE(std::to_string(world) + " ranks");
    auto results = zeal::spawn(
        [&](zeal::Runtime& rt) {
          zeal::Engine engine(config_for(3, true), rt);
          auto model = engine.init<zeal::models::BertModel>(c);
          const int64_t before = bytes_read_by_process();
          zeal::load_pretrained(model, dir, {.quiet = true});
          const int64_t got = bytes_read_by_process() - before;
          // The header (read once per file) and the ranks' agreement messages come on top.
          const double want = static_cast<double>(root_bytes) + static_cast<double>(unit_bytes) / world;
          require(std::abs(static_cast<double>(got) - want) <= 0.02 * want + static_cast<double>(st.header_bytes) + 16384,
                  "rank " + std::to_string(engine.process_index()) + " read " + std::to_string(got) + " bytes of a " +
                      std::to_string(st.file_bytes) + "-byte file; its share is about " + std::to_string(int64_t(want)));
          // And they are the right values: gathered, every weight equals the file's.
          torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
          auto [m, o] = engine.prepare(model, opt);
          auto g = engine.gathered();
          for (const auto& item : m->named_parameters()) {
            std::string k = item.key();
            const auto at_block = k.find(".block.");
            if (at_block != std::string::npos) k.erase(at_block, 6);
            require(st.tensors.count(k) == 1 && at::equal(item.value().detach().to(at::kDouble), st.tensors.at(k)),
                    k + " equals the file's values");
          }
        },
        world);
    for (const auto& res : results) EXPECT_TRUE(res.ok()) << "rank " << res.rank << ": " << res.failure;
  }
  fs::remove_all(dir);
}

TEST(Pretrained, HuggingFaceNamesAPrefixAndStage3SlicesLoad) {
  const std::string dir = temp_dir("pretrained");
  // A BertModel's weights under its own names (no "bert." prefix, as a BertModel checkpoint is).
  zeal_test::seed(11);
  zeal::models::BertModel base(tiny_bert());
  {
    zeal::peft::PeftModel none;  // save_merged of the plain model: its Hugging Face names
    auto root = base.ptr();
    zeal::peft::LoraConfig lc;
    lc.target_modules = {"query"};
    auto p = zeal::peft::get_peft_model(root, lc);
    p.merge_and_unload();  // B is zero: the weights stay the base's
    p.save_merged(dir + "/base");
  }
  const StFile file = read_st(dir + "/base/model.safetensors");
  ASSERT_TRUE(file.tensors.count("encoder.layer.1.attention.self.query.weight"));
  auto check = [&](int world, int stage, bool init, bool after_prepare) {
    auto results = zeal::spawn(
        [&](zeal::Runtime& rt) {
          zeal::Engine engine(config_for(stage, init), rt);
          zeal_test::seed(12);
          auto clf = init ? engine.init<BertForSequenceClassification>(tiny_bert(), 3) : BertForSequenceClassification(tiny_bert(), 3);
          auto load = [&] {
            const auto report = zeal::load_pretrained(clf, dir + "/base", {.quiet = true});
            require(report.model_prefix == "bert.", "model prefix 'bert.', got '" + report.model_prefix + "'");
            require(report.missing == std::vector<std::string>{"classifier.weight", "classifier.bias"},
                    "only the classifier missing");
            require(report.unused.empty(), "every file tensor used");
          };
          if (!after_prepare) load();
          torch::optim::AdamW opt(clf->parameters(), torch::optim::AdamWOptions(1e-3));
          auto [m, o] = engine.prepare(clf, opt);
          if (after_prepare) load();
          auto g = engine.gathered();
          for (const auto& item : m->named_parameters()) {
            std::string k = item.key();
            if (k.rfind("bert.", 0) != 0) continue;
            k = k.substr(5);
            const auto at_block = k.find(".block.");
            if (at_block != std::string::npos) k.erase(at_block, 6);
            require(file.tensors.count(k) == 1, k + " in the file");
            require(at::equal(item.value().detach().to(at::kDouble), file.tensors.at(k)), k + " equals the file's values");
          }
        },
        world);
    for (const auto& res : results) EXPECT_TRUE(res.ok()) << "rank " << res.rank << ": " << res.failure;
  };
  check(1, 0, false, false);
  check(2, 3, true, false);  // partitioned by engine.init: each rank reads its slices
  check(2, 3, false, true);  // prepared: each rank reads its shards (and master weights)
  check(3, 2, false, true);
  // Strict: the classifier is missing.
  BertForSequenceClassification clf(tiny_bert(), 3);
  EXPECT_THROW(zeal::load_pretrained(clf, dir + "/base", {.strict = true}), zeal::Error);
  // A shape mismatch names the tensor and changes nothing.
  BertConfig wide = tiny_bert();
  wide.intermediate_size = 20;
  zeal::models::BertModel other(wide);
  const at::Tensor before = other->embeddings->word_embeddings->weight.clone();
  try {
    zeal::load_pretrained(other, dir + "/base", {.quiet = true});
    FAIL() << "a shape mismatch must throw";
  } catch (const zeal::Error& e) {
    EXPECT_NE(std::string(e.what()).find("intermediate.dense"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(at::equal(other->embeddings->word_embeddings->weight, before));
  fs::remove_all(dir);
}
