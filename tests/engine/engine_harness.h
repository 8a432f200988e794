// Shared by the engine tests: a training run of TinyGpt through zeal::Engine on N ranks
// (zeal::spawn), the same run in one process with plain LibTorch (the reference), and files to
// carry results out of the ranks.
#pragma once

#include <ATen/ATen.h>
#include <ATen/DeviceAccelerator.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <torch/optim/schedulers/step_lr.h>

#include <malloc.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <iterator>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/error.h"
#include "engine/resident.h"
#include "engine/runtime/runtime.h"
#include "engine/optim/optimizer.h"
#include "engine/runtime/spawn.h"
#include "kernels/cpu/adam.h"
#include "tests/engine/rounding.h"
#include "tests/test_device.h"
#include "tests/engine/tiny_gpt.h"

namespace zeal_test {

struct RunSpec {
  int world = 2;
  int stage = 0;
  int accumulation = 1;
  int steps = 10;
  int64_t micro_batch = 2;  // samples per rank per micro-step
  double clip = 0.25;       // 0: off
  double lr = 1e-3, weight_decay = 0.1, eps = 1e-6;
  std::string precision = "no";  // no, bf16, fp16
  int64_t bucket = 1000;         // reduce_bucket_size in elements
  bool overlap = true;
  bool freeze_embeddings = false;
  bool step_lr = false;  // a LibTorch StepLR(step 3, gamma 0.5) on the optimizer
  int64_t layers = TinyGptOptions{}.layers;  // blocks of the model (the stage-3 units)
  // stage 3
  int64_t persistence = 0;      // stage3_param_persistence_threshold
  int64_t prefetch = 50'000'000;  // stage3_prefetch_bucket_size (0: no prefetch)
  int64_t max_live = 1'000'000'000;
  bool init = false;  // build the model with engine.init (zero3_init_flag)
  uint64_t seed = 7;
  std::string isa;  // ZEAL_CPU_ISA in the ranks (empty: unset)
  bool offload = false;  // offload_optimizer.device cpu (and offload_param.device cpu in stage 3)
  bool offload_params = true;  // with offload in stage 3: offload_param.device cpu too
  bool pin_memory = false;     // with offload: offload_optimizer and offload_param pin_memory
  std::string nvme_path;           // offload_optimizer.device nvme there (stage 3)
  int64_t sub_group = 1'000'000'000;  // sub_group_size
  std::string param_nvme_path;     // offload_param.device nvme there (stage 3)
  bool freeze_ln1 = false;         // every block's first LayerNorm frozen (a frozen layer first in a unit)
  bool aio_auto = false;           // aio.block_size and aio.queue_depth "auto" (measured at start-up)
  // offload_param: elements per rank kept in host memory (0 here: every block on disk; the
  // config's default is DeepSpeed's 1e9), read-ahead buffers and their elements.
  int64_t param_max_in_cpu = 0;
  int64_t param_buffer_count = 5, param_buffer_size = 100'000'000;
  int64_t optimizer_buffer_count = 4;  // offload_optimizer.buffer_count
  // fp16 loss scaling
  int64_t initial_scale_power = 16, loss_scale_window = 1000, hysteresis = 2;
  // Where the ranks train: "cpu" or "cuda" (tests/test_device.h); more environment for the ranks
  // (ZEAL_COMM_BACKEND=gloo: ranks share one GPU through the Gloo communicator).
  std::string device = "cpu";
  std::map<std::string, std::string> env;
  // Activation checkpointing (the config's section) of every checkpoint_interval-th block, and the
  // blocks' dropout probability.
  bool checkpointing = false;
  int64_t checkpoint_interval = 1;
  bool cpu_checkpointing = false;  // the checkpoints' inputs in pinned host memory (GPU ranks)
  double dropout = 0;
  // zero_optimization.hybrid_shard, and the ranks of each simulated machine (0: one machine).
  bool hybrid = false;
  int ranks_per_machine = 0;
  std::string comm_dtype;  // communication_data_type (empty: the default, fp32)
};

inline TinyGptOptions model_options() { return {}; }

// Every sample: 9 tokens; the model reads the first 8 and predicts the last 8.
inline at::Tensor make_tokens(int64_t samples) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
  return at::randint(0, model_options().vocab, {samples, model_options().seq + 1}, gen);
}

inline at::Tensor lm_loss(TinyGpt& model, const at::Tensor& tokens) {
  const int64_t T = model_options().seq;
  at::Tensor logits = model->forward(tokens.narrow(1, 0, T));
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}).to(at::kFloat),
                                              tokens.narrow(1, 1, T).reshape({-1}));
}

inline void write_tensor(const std::string& path, const at::Tensor& t) {
  at::Tensor c = t.to(at::kDouble).contiguous();
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.nbytes()));
}

inline at::Tensor read_tensor(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) throw zeal::Error("cannot read " + path);
  const auto n = static_cast<int64_t>(f.tellg()) / 8;
  at::Tensor t = at::empty({n}, at::kDouble);
  f.seekg(0);
  f.read(static_cast<char*>(t.data_ptr()), n * 8);
  return t;
}

inline at::Tensor flat_params(torch::nn::Module& m) {
  std::vector<at::Tensor> parts;
  for (auto& p : m.parameters()) parts.push_back(p.detach().to(at::kCPU, at::kDouble).reshape({-1}));
  return at::cat(parts);
}

inline std::string temp_dir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() / ("zeal_test_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return dir.string();
}

// What `body` throws as zeal::Error on one spawned rank: its message, or "accepted" when it throws
// none. Any other failure of the rank fails the calling test.
inline std::string error_on_one_rank(const std::string& name, const std::function<void(zeal::Runtime&)>& body) {
  const std::string file = temp_dir(name) + "/message";
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        std::string msg = "accepted";
        try {
          body(rt);
        } catch (const zeal::Error& e) {
          msg = e.what();
        }
        std::ofstream(file) << msg;
      },
      1);
  EXPECT_EQ(zeal::describe_failures(results), "");
  std::ifstream f(file);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

inline zeal::Config make_config(const RunSpec& s) {
  zeal::Config c = zeal_test::test_config(s.device);
  c.zero.stage = s.stage;
  c.gradient_accumulation_steps = {s.accumulation, false};
  c.gradient_clipping = {0.0, false};  // clipping is the program's call (clip_grad_norm_)
  c.zero.reduce_bucket_size = {s.bucket, false};
  c.zero.overlap_comm = s.overlap;
  c.mixed_precision = s.precision;
  c.fp16.enabled = {s.precision == "fp16", false};
  c.bf16_enabled = {s.precision == "bf16", false};
  c.fp16.initial_scale_power = s.initial_scale_power;
  c.fp16.loss_scale_window = s.loss_scale_window;
  c.fp16.hysteresis = s.hysteresis;
  c.zero.stage3_param_persistence_threshold = {s.persistence, false};
  c.zero.stage3_prefetch_bucket_size = {s.prefetch, false};
  c.zero.stage3_max_live_parameters = s.max_live;
  c.zero.zero3_init_flag = s.init;
  if (s.offload) {
    c.zero.offload_optimizer.device = zeal::OffloadDevice::kCpu;
    if (s.stage == 3 && s.offload_params) c.zero.offload_param.device = zeal::OffloadDevice::kCpu;
    c.zero.offload_optimizer.pin_memory = c.zero.offload_param.pin_memory = s.pin_memory;
  }
  if (!s.nvme_path.empty()) {
    c.zero.offload_optimizer.device = zeal::OffloadDevice::kNvme;
    c.zero.offload_optimizer.nvme_path = s.nvme_path;
  }
  if (!s.param_nvme_path.empty()) {
    c.zero.offload_param.device = zeal::OffloadDevice::kNvme;
    c.zero.offload_param.nvme_path = s.param_nvme_path;
  }
  c.zero.offload_param.max_in_cpu = s.param_max_in_cpu;
  c.zero.offload_param.buffer_count = s.param_buffer_count;
  c.zero.offload_param.buffer_size = s.param_buffer_size;
  c.zero.offload_optimizer.buffer_count = s.optimizer_buffer_count;
  c.zero.sub_group_size = s.sub_group;
  c.aio.block_size.is_auto = s.aio_auto;
  c.aio.queue_depth.is_auto = s.aio_auto;
  c.activation_checkpointing.enabled = s.checkpointing;
  c.activation_checkpointing.unit_interval = s.checkpoint_interval;
  c.activation_checkpointing.cpu_checkpointing = s.cpu_checkpointing;
  c.zero.hybrid_shard = s.hybrid;
  c.communication_data_type = s.comm_dtype;
  return c;
}

// The model (seeded), its trainable parameters, AdamW over them and a StepLR, as both the ranks
// and the reference build them.
struct Setup {
  TinyGpt model;
  std::vector<at::Tensor> trainable;
  std::unique_ptr<torch::optim::AdamW> opt;
  std::unique_ptr<torch::optim::StepLR> step_lr;
};

inline Setup make_setup(const RunSpec& s, const std::function<TinyGpt()>& build = {}) {
  zeal_test::seed(s.seed);
  // A GPU's default generator starts from a seed of its own, different in every process: seeded
  // here (in the rank or reference process, which uses CUDA anyway), dropout draws the same masks
  // in every run.
  if (s.device == "cuda") at::manual_seed(s.seed);
  TinyGptOptions mo = model_options();
  mo.layers = s.layers;
  mo.dropout = s.dropout;
  Setup u{build ? build() : TinyGpt(mo), {}, nullptr, nullptr};
  if (s.freeze_embeddings) {
    u.model->wte->weight.set_requires_grad(false);
    u.model->wpe->weight.set_requires_grad(false);
  }
  if (s.freeze_ln1) {
    for (auto& item : u.model->named_parameters())
      if (item.key().find(".ln1.") != std::string::npos) item.value().set_requires_grad(false);
  }
  for (auto& p : u.model->parameters()) {
    if (p.requires_grad()) u.trainable.push_back(p);
  }
  u.opt = std::make_unique<torch::optim::AdamW>(
      u.trainable, torch::optim::AdamWOptions(s.lr).eps(s.eps).weight_decay(s.weight_decay));
  u.step_lr = std::make_unique<torch::optim::StepLR>(*u.opt, 3, 0.5);
  return u;
}

// What a run leaves in `dir`: params_<rank> (final parameters), losses (per optimizer step, the
// mean over the global batch), norms (gradient norm before clipping), skipped (0/1 per step).
struct RunResult {
  // per rank; memory: params, grads, master, optimizer states, frozen bytes, trainable count, then
  // stage 3's unit gathers, prefetches and re-traces, offload host and disk bytes, shards read
  // ahead from disk and of those waited for (all as the engine counts them), then measured from
  // outside: the bytes of this rank's swap files on disk (their sizes) and the resident set at the
  // end (freed blocks returned to the system first), then the windows of the optimizer read ahead
  // and, on a GPU, its allocator's allocated bytes at the end and their peak over the run
  std::vector<at::Tensor> params, skipped, scales, memory, trajectory;
  std::vector<int64_t> forwards;  // per rank: forwards of all blocks (recomputations included)
  at::Tensor losses, norms;
};

// Trains on ranks through the engine; `hook(engine, step, micro, loss)` may change the loss.
using LossHook = std::function<at::Tensor(zeal::Engine&, int, int, at::Tensor)>;

// The accelerator allocator's allocated bytes now (or their peak since the process began); 0 on the CPU.
inline double device_allocated(const at::Device& d, bool peak) {
  if (!d.is_cuda()) return 0;
  const auto stats = at::accelerator::getDeviceStats(d.index() < 0 ? 0 : d.index());
  return static_cast<double>(peak ? stats.allocated_bytes[0].peak : stats.allocated_bytes[0].current);
}

inline void train_rank(zeal::Runtime& rt, const RunSpec& s, const std::string& dir, const LossHook& hook) {
  if (!s.isa.empty()) {
    // Ranks are fresh processes: the kernels read ZEAL_CPU_ISA at their first use, here.
    ::setenv("ZEAL_CPU_ISA", s.isa.c_str(), 1);
    if (zeal::cpu::simd_name(zeal::cpu::active_simd()) != s.isa) {
      throw zeal::Error("the kernels did not take ZEAL_CPU_ISA=" + s.isa + " (chosen before the rank started?)");
    }
  }
  zeal::Engine engine(make_config(s), rt);
  TinyGptOptions mo = model_options();
  mo.layers = s.layers;
  mo.dropout = s.dropout;
  Setup u = make_setup(s, [&] { return s.init ? engine.init<TinyGpt>(mo) : TinyGpt(mo); });
  auto [m, o] = engine.prepare(u.model, *u.opt);
  auto sched = engine.prepare(*u.step_lr);
  const int64_t per_step = s.micro_batch * s.world * s.accumulation;
  at::Tensor tokens = make_tokens(per_step * s.steps);
  std::vector<double> losses, norms, skipped, scales;
  auto full_params = [&] {
    auto g = engine.gathered();  // stage 3: the whole parameters, for reading
    return flat_params(*m);
  };
  std::vector<at::Tensor> trajectory{full_params()};  // before the first step, then after each
  for (int step = 0; step < s.steps; ++step) {
    double step_loss = 0;
    for (int micro = 0; micro < s.accumulation; ++micro) {
      auto guard = engine.accumulate(m);
      const int64_t first = step * per_step + (micro * s.world + engine.process_index()) * s.micro_batch;
      at::Tensor batch = tokens.narrow(0, first, s.micro_batch).to(engine.device());
      at::Tensor loss;
      {
        auto ac = engine.autocast();
        loss = lm_loss(m, batch);
      }
      if (hook) loss = hook(engine, step, micro, loss);
      engine.backward(loss);
      step_loss += engine.reduce(loss.detach(), "mean").item<double>() / s.accumulation;
      if (engine.sync_gradients() && s.clip > 0) norms.push_back(engine.clip_grad_norm_(s.clip));
      o.step();
      if (engine.sync_gradients()) {
        skipped.push_back(engine.optimizer_step_was_skipped());
        scales.push_back(engine.loss_scale());
      }
      if (s.step_lr) sched.step();
      o.zero_grad();
    }
    losses.push_back(step_loss);
    trajectory.push_back(full_params());
  }
  const std::string me = std::to_string(engine.process_index());
  write_tensor(dir + "/params_" + me, full_params());
  write_tensor(dir + "/skipped_" + me, at::tensor(skipped, at::kDouble));
  write_tensor(dir + "/scales_" + me, at::tensor(scales, at::kDouble));
  write_tensor(dir + "/trajectory_" + me, at::stack(trajectory));
  int64_t forwards = 0;
  for (auto& b : m->blocks) forwards += b->inner->forwards;
  write_tensor(dir + "/forwards_" + me, at::tensor({static_cast<double>(forwards)}, at::kDouble));
  const zeal::MemoryReport mem = engine.memory();
  // The swap files this rank wrote (<nvme_path>/<run>/rank<r>/*.swp), by their sizes on disk.
  double swap_bytes = 0;
  std::vector<std::string> roots;
  if (!s.nvme_path.empty()) roots.push_back(s.nvme_path);
  if (!s.param_nvme_path.empty() && s.param_nvme_path != s.nvme_path) roots.push_back(s.param_nvme_path);
  // Only this rank's folders are walked: the other ranks may be removing theirs meanwhile, and a
  // walk of the whole tree ends at the first folder that vanishes under it.
  for (const std::string& root : roots) {
    std::error_code ec;
    for (auto run = std::filesystem::directory_iterator(root, ec); !ec && run != std::filesystem::end(run); run.increment(ec)) {
      std::error_code fe;
      for (auto f = std::filesystem::directory_iterator(run->path() / ("rank" + me), fe); !fe && f != std::filesystem::end(f);
           f.increment(fe)) {
        std::error_code se;
        const auto n = f->path().extension() == ".swp" ? std::filesystem::file_size(f->path(), se) : 0;
        if (!se) swap_bytes += static_cast<double>(n);
      }
    }
  }
  ::malloc_trim(0);
  const double resident = static_cast<double>(zeal::detail::resident_bytes());
  const auto fetches = engine.fetch_counts();
  const auto disk_reads = engine.param_disk_reads();
  write_tensor(dir + "/memory_" + me,
               at::tensor(std::vector<double>{double(mem.params), double(mem.grads), double(mem.master),
                                              double(mem.optimizer_states), double(mem.frozen_params),
                                              double(engine.num_trainable_parameters()), double(fetches.gathers),
                                              double(fetches.prefetched), double(fetches.retraced),
                                              double(mem.offload_host), double(mem.offload_disk),
                                              double(disk_reads.ahead), double(disk_reads.waited), swap_bytes,
                                              resident, double(engine.optimizer_windows_read_ahead()),
                                              device_allocated(engine.device(), false),
                                              device_allocated(engine.device(), true)},
                          at::kDouble));
  if (engine.is_main_process()) {
    write_tensor(dir + "/losses", at::tensor(losses, at::kDouble));
    write_tensor(dir + "/norms", at::tensor(norms, at::kDouble));
  }
}

inline RunResult run_engine(const RunSpec& s, const std::string& name, const LossHook& hook = {}) {
  const std::string dir = temp_dir(name);
  zeal::SpawnOptions so;
  so.env = s.env;
  so.ranks_per_machine = s.ranks_per_machine;
  auto results = zeal::spawn([&](zeal::Runtime& rt) { train_rank(rt, s, dir, hook); }, s.world, so);
  EXPECT_EQ(zeal::describe_failures(results), "");
  RunResult r;
  for (int rank = 0; rank < s.world; ++rank) {
    const std::string me = std::to_string(rank);
    r.params.push_back(read_tensor(dir + "/params_" + me));
    r.skipped.push_back(read_tensor(dir + "/skipped_" + me));
    r.scales.push_back(read_tensor(dir + "/scales_" + me));
    r.memory.push_back(read_tensor(dir + "/memory_" + me));
    r.trajectory.push_back(read_tensor(dir + "/trajectory_" + me).view({s.steps + 1, -1}));
    r.forwards.push_back(static_cast<int64_t>(read_tensor(dir + "/forwards_" + me)[0].item<double>()));
  }
  r.losses = read_tensor(dir + "/losses");
  if (s.clip > 0) r.norms = read_tensor(dir + "/norms");
  std::filesystem::remove_all(dir);
  return r;
}

// The same training in one process: each step one forward over the whole global batch,
// torch::nn::utils::clip_grad_norm_ and torch::optim::AdamW, on s.device. On CUDA it runs in a
// child process (the test process never initialises CUDA: tests/test_device.h).
inline RunResult run_reference_here(const RunSpec& s, int split) {
  Setup u = make_setup(s);
  auto& model = u.model;
  auto& opt = *u.opt;
  auto& step_lr = *u.step_lr;
  auto& trainable = u.trainable;
  const at::Device device(s.device == "cuda" ? at::kCUDA : at::kCPU);
  model->to(device);  // the parameters move in place: the optimizer keeps them
  const int64_t per_step = s.micro_batch * s.world * s.accumulation;
  at::Tensor tokens = make_tokens(per_step * s.steps).to(device);
  std::vector<double> losses, norms;
  for (int step = 0; step < s.steps; ++step) {
    opt.zero_grad();
    // `split` micro-batches, or the whole global batch at once.
    double step_loss = 0;
    const int64_t n = per_step / split;
    for (int k = 0; k < split; ++k) {
      at::Tensor loss = lm_loss(model, tokens.narrow(0, step * per_step + k * n, n)) / split;
      loss.backward();
      step_loss += loss.item<double>();
    }
    losses.push_back(step_loss);
    if (s.clip > 0) norms.push_back(torch::nn::utils::clip_grad_norm_(trainable, s.clip));
    opt.step();
    if (s.step_lr) step_lr.step();
  }
  RunResult r;
  r.params.push_back(flat_params(*model));
  r.losses = at::tensor(losses, at::kDouble);
  r.norms = at::tensor(norms, at::kDouble);
  return r;
}

inline RunResult run_reference(const RunSpec& s, int split = 1) {
  if (s.device != "cuda") return run_reference_here(s, split);
  const std::string dir = temp_dir("reference");
  auto results = zeal::spawn(
      [&](zeal::Runtime&) {
        const RunResult r = run_reference_here(s, split);
        write_tensor(dir + "/params", r.params[0]);
        write_tensor(dir + "/losses", r.losses);
        write_tensor(dir + "/norms", r.norms);
      },
      1);
  EXPECT_EQ(zeal::describe_failures(results), "");
  RunResult r;
  r.params.push_back(read_tensor(dir + "/params"));
  r.losses = read_tensor(dir + "/losses");
  r.norms = read_tensor(dir + "/norms");
  std::filesystem::remove_all(dir);
  return r;
}

// Relative difference of two parameter vectors, parameter by parameter: max|a - b| / max|b| of each
// of the model's parameter tensors (each compared at its own scale, so a parameter that stays near 0
// is not judged against the largest one); rel_diff is the largest.
inline std::vector<double> rel_diffs(const at::Tensor& a, const at::Tensor& b) {
  TinyGpt shape(model_options());
  std::vector<double> out;
  int64_t off = 0;
  for (auto& p : shape->parameters()) {
    const int64_t n = p.numel();
    at::Tensor x = a.narrow(0, off, n), y = b.narrow(0, off, n);
    out.push_back((x - y).abs().max().item<double>() / std::max(y.abs().max().item<double>(), 1e-12));
    off += n;
  }
  return out;
}
inline double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  const auto d = rel_diffs(a, b);
  return *std::max_element(d.begin(), d.end());
}

// max |a - b| / max |b| over the whole vector (for models other than TinyGpt).
inline double rel_diff_plain(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / b.abs().max().item<double>();
}

}  // namespace zeal_test

namespace zeal_test {

// --- tolerances (tests/engine/rounding.h) -------------------------------------------------------

// The reference trainer for a spec: TinyGpt seeded like the ranks; rank r's micro-step m on the
// samples train_rank gives it; zeal's clipping rule (the norm in float64, torch's coefficient
// max_norm / (norm + 1e-6), one multiplication); AdamW from torch::optim, or zeal's fused kernel
// with `fused` (the optimizer zeal runs); the StepLR when the spec has one.
// compute_perturbation: the forward and backward run on parameters multiplied by (1 + it) (the
// optimizer still updates the unperturbed ones), a model of computing in a lower precision.
inline ReferenceTrainer reference_trainer(const RunSpec& s, bool fused, double compute_perturbation = 0) {
  auto u = std::make_shared<Setup>(make_setup(s));
  const int64_t per_step = s.micro_batch * s.world * s.accumulation;
  auto tokens = std::make_shared<at::Tensor>(make_tokens(per_step * s.steps));
  std::shared_ptr<zeal::optim::Optimizer> zeal_adamw;
  if (fused) {
    zeal_adamw = zeal::optim::make_fused_adamw({.lr = s.lr, .eps = s.eps, .weight_decay = s.weight_decay});
  }
  ReferenceTrainer t;
  t.params = u->trainable;
  t.backward = [u, tokens, s, per_step, compute_perturbation](int step, int rank, int micro) {
    for (auto& p : u->trainable) p.mutable_grad() = at::Tensor();
    std::vector<at::Tensor> kept;
    if (compute_perturbation != 0) {
      c10::NoGradGuard no_grad;
      for (auto& p : u->model->parameters()) {
        kept.push_back(p.detach().clone());
        p.detach().mul_(1 + compute_perturbation);
      }
    }
    const int64_t first = step * per_step + (micro * s.world + rank) * s.micro_batch;
    at::Tensor loss = lm_loss(u->model, tokens->narrow(0, first, s.micro_batch));
    (s.accumulation == 1 ? loss : loss * (1.0 / s.accumulation)).backward();
    if (!kept.empty()) {
      c10::NoGradGuard no_grad;
      size_t k = 0;
      for (auto& p : u->model->parameters()) p.detach().copy_(kept[k++]);
    }
    return loss.item<double>();
  };
  t.update = [u, s, zeal_adamw]() {
    const double norm = clip_and_step(u->trainable, s.clip, *u->opt, zeal_adamw.get());
    if (s.step_lr) u->step_lr->step();  // also moves the rate zeal_adamw reads
    return norm;
  };
  t.flat = [u] { return flat_params(*u->model); };
  return t;
}

// What two runs of `s` may differ by, computed on this machine (rounding.h):
//   zeal_vs_zeal      two zeal runs that differ in stage, layout or buckets
//   zeal_vs_libtorch  a zeal run against run_reference(s)
struct Tolerances {
  Spread sum_order, optimizer, split;
  Spread zeal_vs_zeal() const { return sum_order; }
  Spread zeal_vs_libtorch() const { return sum_order + optimizer + split; }
};

inline Tolerances tolerances(const RunSpec& s) {
  Tolerances t;
  const auto diff = [](const at::Tensor& a, const at::Tensor& b) { return rel_diff(a, b); };
  t.sum_order = sum_order_spread([&] { return reference_trainer(s, true); }, s.world, s.accumulation, s.steps, diff);
  const ReferenceCurves zeal_optimizer = run_reference_trainer(reference_trainer(s, true), s.world, s.accumulation, s.steps);
  const ReferenceCurves torch_optimizer =
      run_reference_trainer(reference_trainer(s, false), s.world, s.accumulation, s.steps);
  t.optimizer = measured_spread(zeal_optimizer, torch_optimizer, diff);
  const RunResult whole = run_reference(s);
  t.split = measured_spread(torch_optimizer, {whole.params[0], whole.losses, whole.norms}, diff);
  std::printf("[ metric ] tolerances for world %d, accumulation %d: sum order %.3g + optimizer %.3g + split %.3g "
              "(parameters; losses %.3g, norms %.3g against LibTorch)\n",
              s.world, s.accumulation, t.sum_order.params, t.optimizer.params, t.split.params,
              t.zeal_vs_libtorch().losses, t.zeal_vs_libtorch().norms);
  return t;
}

}  // namespace zeal_test

namespace zeal_test {

// bf16 compute with an fp32 master, against the same run in fp32. bf16 keeps 8 significant bits:
// unit roundoff u₁₆ = 2⁻⁸. The bf16 run is the fp32 run with (a) every matmul's inputs and output
// rounded to bf16 — modelled as the forward and backward running on weights off by 2·u₁₆ relatively,
// all in one direction (rounding errors of one sign add up; real ones partly cancel) — and (b) the
// gradient sums formed in bf16 (δ with u₁₆, rounding.h). The reference is run with both, in each
// direction, against the unperturbed fp32 reference; the fp32 side adds its own summation-order
// bound (the zeal fp32 run against that reference).
inline Spread bf16_spread(const RunSpec& s) {
  const auto diff = [](const at::Tensor& a, const at::Tensor& b) { return rel_diff(a, b); };
  const double u16 = std::ldexp(1.0, -8);
  const ReferenceCurves base = run_reference_trainer(reference_trainer(s, true), s.world, s.accumulation, s.steps);
  Spread bf16;
  for (int sign : {1, -1}) {
    const ReferenceCurves r = run_reference_trainer(reference_trainer(s, true, sign * 2 * u16), s.world,
                                                    s.accumulation, s.steps, sign, u16);
    const Spread d = measured_spread(r, base, diff);
    bf16 = {std::max(bf16.params, d.params), std::max(bf16.losses, d.losses), std::max(bf16.norms, d.norms)};
  }
  const Spread fp32 = tolerances(s).zeal_vs_zeal();
  std::printf("[ metric ] bf16 bound for world %d, accumulation %d: parameters %.3g, losses %.3g (+ fp32 %.3g, %.3g)\n",
              s.world, s.accumulation, bf16.params, bf16.losses, fp32.params, fp32.losses);
  return bf16 + fp32;
}

}  // namespace zeal_test
