// Buffers marked non-persistent (zeal::register_buffer(..., false), PyTorch's persistent=False): left
// out of save_state and save_model, not required by load_state, load_checkpoint_in_model or
// load_pretrained (read where a file holds them in the model's shape, else skipped), while a
// persistent buffer a file lacks is an error naming it, as a parameter is. And buffers and frozen
// weights whose elements are not in storage order, broadcast, saved and loaded whole.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>

#include <fmt/format.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include "engine/buffers.h"
#include "engine/checkpoint/safetensors.h"
#include "engine/checkpoint/tensor_dtype.h"
#include "engine/error.h"
#include "engine/zero/sharded.h"
#include "tests/engine/engine_harness.h"

namespace zeal_test {
namespace {

namespace fs = std::filesystem;

// A block with a table sized by `len`, computed from nothing the training changes (non-persistent).
struct TabledImpl : torch::nn::Module {
  explicit TabledImpl(int64_t len) : fc(register_module("fc", torch::nn::Linear(8, 8))) {
    table = zeal::register_buffer(*this, "table", at::arange(len, at::kFloat), /*persistent=*/false);
  }
  at::Tensor forward(const at::Tensor& x) { return at::tanh(fc(x)) + table.sum() * 1e-3; }
  torch::nn::Linear fc;
  at::Tensor table;
};
TORCH_MODULE(Tabled);

// A Sharded block (its table inside the unit), an EMA (persistent) and a mask of `len` (not).
struct ModelImpl : torch::nn::Module {
  explicit ModelImpl(int64_t len, bool mask_persistent = false)
      : b0(register_module("b0", zeal::Sharded<Tabled>(len))), head(register_module("head", torch::nn::Linear(8, 2))) {
    ema = register_buffer("ema", at::zeros({8}));
    mask = zeal::register_buffer(*this, "mask", at::full({len}, static_cast<double>(len)), mask_persistent);
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = b0->forward(x);
    if (is_training()) {
      c10::NoGradGuard no_grad;
      ema.mul_(0.5).add_(h.mean(0), 0.5);
    }
    return head(h) * mask.mean() / static_cast<double>(mask.numel());
  }
  zeal::Sharded<Tabled> b0;
  torch::nn::Linear head;
  at::Tensor ema, mask;
};
TORCH_MODULE(Model);

// A safetensors file of these tensors, in order.
void write_file(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  std::vector<zeal::ckpt::TensorEntry> entries;
  for (const auto& [name, t] : tensors) {
    entries.push_back({name, zeal::ckpt::safetensors_dtype(t.scalar_type()), t.sizes().vec(),
                       static_cast<int64_t>(t.nbytes()), 0});
  }
  zeal::ckpt::SafetensorsWriter w(path, entries, {{"format", "pt"}});
  for (const auto& [name, t] : tensors) w.append(t.contiguous().data_ptr(), static_cast<int64_t>(t.nbytes()));
  w.finish();
}

// The model's parameters and persistent buffers under the names an export gives them.
std::vector<std::pair<std::string, at::Tensor>> state_of(Model& m, bool with_ema = true) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : m->named_parameters(true)) {
    std::string n = item.key();
    if (n.rfind("b0.block.", 0) == 0) n = "b0." + n.substr(9);
    out.push_back({n, item.value().detach().clone()});
  }
  if (with_ema) out.push_back({"ema", m->ema.clone()});
  return out;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const zeal::Error& e) {
    return e.what();
  }
  return "";
}

TEST(NonPersistentBuffers, AreNamedAsTheModelNamesThemAndUnknownNamesAreRefused) {
  Model m(4);
  const auto names = zeal::non_persistent_buffers(*m);
  EXPECT_EQ(names, (std::unordered_set<std::string>{"mask", "b0.block.table"}));
  EXPECT_FALSE(zeal::buffer_persistent(*m, "mask"));
  EXPECT_TRUE(zeal::buffer_persistent(*m, "ema"));
  zeal::set_buffer_persistent(*m, "mask", true);
  EXPECT_EQ(zeal::non_persistent_buffers(*m), (std::unordered_set<std::string>{"b0.block.table"}));
  const std::string e = error_of([&] { zeal::set_buffer_persistent(*m, "nope", false); });
  EXPECT_NE(e.find("'nope'"), std::string::npos) << e;
  EXPECT_NE(e.find("ema"), std::string::npos) << e;  // the buffers it has
  Model other(4);  // marks belong to the buffer marked, not to its module's type
  zeal::set_buffer_persistent(*other, "ema", false);
  EXPECT_EQ(zeal::non_persistent_buffers(*m), (std::unordered_set<std::string>{"b0.block.table"}));
  EXPECT_EQ(zeal::non_persistent_buffers(*other), (std::unordered_set<std::string>{"ema", "mask", "b0.block.table"}));
  // A cast keeps the mark (the tensor stays, as the engine's casts and moves keep it).
  other->mask.set_data(other->mask.to(at::kBFloat16));
  EXPECT_FALSE(zeal::buffer_persistent(*other, "mask"));
  // Many models made and dropped, one at a time: none inherits another's marks.
  for (int i = 0; i < 50; ++i) {
    auto plain = std::make_shared<torch::nn::Module>();
    plain->register_buffer("mask", at::zeros({2}));
    plain->register_buffer("ema", at::zeros({2}));
    ASSERT_TRUE(zeal::non_persistent_buffers(*plain).empty()) << "iteration " << i;
    Model marked(3);
    (void)marked;
  }
}

TEST(NonPersistentBuffers, LoadWhereTheFileHoldsThemInTheModelsShapeElseAreSkipped) {
  const std::string dir = temp_dir("buffers_np_load");
  at::manual_seed(3);
  Model src(4);
  src->ema.normal_();
  auto state = state_of(src);
  // No mask, no table: loads, and they keep the model's own values.
  write_file(dir + "/plain.safetensors", state);
  Model a(6);
  EXPECT_EQ(zeal::load_checkpoint_in_model(*a, dir + "/plain.safetensors"), static_cast<int64_t>(state.size()));
  EXPECT_TRUE(at::equal(a->ema, src->ema));
  EXPECT_TRUE(at::equal(a->mask, at::full({6}, 6.0)));
  // A mask in the model's shape is read; in another shape it is skipped.
  auto with_mask = state;
  with_mask.push_back({"mask", at::full({6}, -1.0)});
  write_file(dir + "/mask.safetensors", with_mask);
  Model b(6);
  zeal::load_checkpoint_in_model(*b, dir + "/mask.safetensors");
  EXPECT_TRUE(at::equal(b->mask, at::full({6}, -1.0)));
  Model c(5);
  zeal::load_checkpoint_in_model(*c, dir + "/mask.safetensors");
  EXPECT_TRUE(at::equal(c->mask, at::full({5}, 5.0)));
  // Persistent, the mask of another shape is an error naming it, and nothing changes.
  Model d(5, /*mask_persistent=*/true);
  const at::Tensor w_before = d->head->weight.detach().clone();
  std::string e = error_of([&] { zeal::load_checkpoint_in_model(*d, dir + "/mask.safetensors"); });
  EXPECT_NE(e.find("mask"), std::string::npos) << e;
  EXPECT_TRUE(at::equal(d->head->weight, w_before));
  // A persistent buffer the file lacks is an error naming it, as a parameter is.
  write_file(dir + "/no_ema.safetensors", state_of(src, /*with_ema=*/false));
  Model f(4);
  e = error_of([&] { zeal::load_checkpoint_in_model(*f, dir + "/no_ema.safetensors"); });
  EXPECT_NE(e.find("'ema'"), std::string::npos) << e;
  // load_pretrained lists it as missing; strict refuses.
  Model g(4);
  const auto report = zeal::load_pretrained(*g, dir + "/no_ema.safetensors", {.quiet = true});
  EXPECT_NE(std::find(report.missing.begin(), report.missing.end(), "ema"), report.missing.end());
  EXPECT_EQ(std::find(report.missing.begin(), report.missing.end(), "mask"), report.missing.end());
  e = error_of([&] { zeal::load_pretrained(*g, dir + "/no_ema.safetensors", {.strict = true, .quiet = true}); });
  EXPECT_NE(e.find("ema"), std::string::npos) << e;
  fs::remove_all(dir);
}

// Stage 3 on 2 ranks: the checkpoint and the export hold the EMA and leave out the mask and the
// table; a model whose mask and table have other lengths resumes from them and loads the export.
TEST(NonPersistentBuffers, CheckpointsAndExportsLeaveThemOutAndResumeAtOtherShapes) {
  const std::string dir = temp_dir("buffers_np_ckpt");
  RunSpec s;
  s.world = 2, s.stage = 3;
  auto phase = [&](int64_t len, bool save) {
    auto results = zeal::spawn(
        [&](zeal::Runtime& rt) {
          zeal::Engine engine(make_config(s), rt);
          at::manual_seed(11);
          Model net(len);
          torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
          auto [m, o] = engine.prepare(net, opt);
          if (!save) engine.load_state(dir + "/ckpt");
          for (int step = 0; step < 2 && save; ++step) {
            engine.backward(m->forward(at::randn({4, 8})).pow(2).mean());
            o.step();
            o.zero_grad();
          }
          if (save) {
            engine.save_state(dir + "/ckpt");
            engine.save_model(dir + "/export");
          }
          if (rt.rank() == 0) {
            write_tensor(fmt::format("{}/ema_{}", dir, len), m->ema);
            write_tensor(fmt::format("{}/mask_{}", dir, len), m->mask);
          }
        },
        s.world);
    ASSERT_EQ(zeal::describe_failures(results), "");
  };
  phase(4, true);
  const auto rank0 = zeal::ckpt::read_safetensors_header(dir + "/ckpt/rank0.safetensors");
  EXPECT_TRUE(rank0.tensors.count("buffer/ema/0"));
  for (const auto& [name, e] : rank0.tensors) {
    EXPECT_EQ(name.find("mask"), std::string::npos) << name;
    EXPECT_EQ(name.find("table"), std::string::npos) << name;
  }
  const auto exported = zeal::ckpt::read_safetensors_header(dir + "/export/model.safetensors");
  EXPECT_TRUE(exported.tensors.count("ema"));
  EXPECT_FALSE(exported.tensors.count("mask"));
  EXPECT_FALSE(exported.tensors.count("b0.table"));
  phase(7, false);
  EXPECT_TRUE(at::equal(read_tensor(dir + "/ema_7"), read_tensor(dir + "/ema_4")));
  EXPECT_TRUE(at::equal(read_tensor(dir + "/mask_7"), at::full({7}, 7.0, at::kDouble)));
  Model fresh(9);
  zeal::load_checkpoint_in_model(*fresh, dir + "/export");
  EXPECT_TRUE(at::equal(fresh->ema.to(at::kDouble), read_tensor(dir + "/ema_4")));
  // The mask made persistent: the checkpoint lacks it, and load_state names it on every rank; so it
  // does the EMA saved as [8] for a model whose EMA is another shape.
  auto refused = [&](const std::function<Model()>& make) {
    std::vector<std::string> said(2);
    auto results = zeal::spawn(
        [&](zeal::Runtime& rt) {
          zeal::Engine engine(make_config(s), rt);
          Model net = make();
          torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
          auto [m, o] = engine.prepare(net, opt);
          std::string msg = "accepted";
          try {
            engine.load_state(dir + "/ckpt");
          } catch (const zeal::Error& e) {
            msg = e.what();
          }
          std::ofstream(fmt::format("{}/said_{}", dir, rt.rank())) << msg;
        },
        s.world);
    EXPECT_EQ(zeal::describe_failures(results), "");
    for (int r = 0; r < 2; ++r) {
      std::ifstream f(fmt::format("{}/said_{}", dir, r));
      said[r].assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    }
    return said;
  };
  for (const auto& msg : refused([] { return Model(4, /*mask_persistent=*/true); })) {
    EXPECT_NE(msg.find("the checkpoint has no buffer 'mask'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("nothing was changed"), std::string::npos) << msg;
  }
  for (const auto& msg : refused([] {
         Model m(4);
         m->ema.set_data(at::zeros({2, 4}));
         return m;
       })) {
    EXPECT_NE(msg.find("buffer 'ema' is [8] in the checkpoint and [2,4] in the model"), std::string::npos) << msg;
  }
  fs::remove_all(dir);
}

// A buffer and a frozen weight whose elements are not in storage order (transposed views): prepare
// gives every rank rank 0's values, and load_state, load_checkpoint_in_model and the export carry
// them whole (a load that wrote into a contiguous copy and dropped it would leave them unchanged).
struct OddImpl : torch::nn::Module {
  explicit OddImpl(uint64_t seed) : fc(register_module("fc", torch::nn::Linear(4, 4))) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
    fw = register_parameter("fw", at::randn({4, 4}, g).t(), /*requires_grad=*/false);
    nc = register_buffer("nc", at::randn({3, 4}, g).t());
  }
  at::Tensor forward(const at::Tensor& x) { return fc(x).matmul(fw).matmul(nc); }
  torch::nn::Linear fc;
  at::Tensor fw, nc;
};
TORCH_MODULE(Odd);

TEST(NonContiguous, BuffersAndFrozenWeightsAreBroadcastSavedAndLoadedWhole) {
  const std::string dir = temp_dir("buffers_nc");
  RunSpec s;
  s.world = 2, s.stage = 1;
  ASSERT_FALSE(Odd(1)->nc.is_contiguous());
  ASSERT_FALSE(Odd(1)->fw.is_contiguous());
  auto phase = [&](bool save) {
    auto results = zeal::spawn(
        [&](zeal::Runtime& rt) {
          zeal::Engine engine(make_config(s), rt);
          at::manual_seed(5);
          Odd net(save ? 100 + rt.rank() : 200 + rt.rank());  // each rank its own values, and other ones to load into
          torch::optim::AdamW opt(net->fc->parameters(), torch::optim::AdamWOptions(1e-2));
          auto [m, o] = engine.prepare(net, opt);
          const std::string tag = fmt::format("{}/{}_{}", dir, save ? "saved" : "loaded", rt.rank());
          if (save) {
            write_tensor(tag + "_prepared", at::cat({m->nc.reshape({-1}), m->fw.reshape({-1})}));
            engine.backward(m->forward(at::ones({2, 4})).sum());
            o.step();
            o.zero_grad();
            engine.save_state(dir + "/ckpt");
            engine.save_model(dir + "/export");
          } else {
            engine.load_state(dir + "/ckpt");
          }
          write_tensor(tag, at::cat({m->nc.reshape({-1}), m->fw.reshape({-1})}));
        },
        s.world);
    ASSERT_EQ(zeal::describe_failures(results), "");
  };
  phase(true);
  phase(false);
  const at::Tensor rank0 = at::cat({Odd(100)->nc.reshape({-1}), Odd(100)->fw.reshape({-1})}).to(at::kDouble);
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(at::equal(read_tensor(fmt::format("{}/saved_{}_prepared", dir, r)), rank0)) << "rank " << r;
    EXPECT_TRUE(at::equal(read_tensor(fmt::format("{}/loaded_{}", dir, r)), rank0)) << "rank " << r;
  }
  Odd fresh(300);
  zeal::load_checkpoint_in_model(*fresh, dir + "/export");
  EXPECT_TRUE(at::equal(at::cat({fresh->nc.reshape({-1}), fresh->fw.reshape({-1})}).to(at::kDouble), rank0));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace zeal_test
