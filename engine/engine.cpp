#include "engine/engine.h"

#include "engine/linear.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <exception>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>
#include <unordered_map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "engine/comm/hybrid.h"
#include "engine/comm/monitor.h"
#include "engine/checkpoint/state_stream.h"
#include "engine/engine_state.h"
#include "engine/log.h"
#include "engine/wait_clock.h"
#include "engine/peft/slots.h"
#include "engine/error.h"
#include "engine/estimate.h"
#include "engine/prepare_check.h"
#include "engine/optim/loss_scale.h"
#include "engine/optim/optimizer.h"
#include "engine/runtime/device_choice.h"
#include "engine/runtime/runtime.h"
#include "engine/host_cache.h"
#include "engine/zero/host_memory.h"
#include "engine/memory_tracker.h"
#include "engine/zero/init.h"
#include "engine/zero/offload_state.h"
#include "engine/zero/stage3.h"
#include "engine/zero/unit_checkpointing.h"
#include "engine/zero/zero_optimizer.h"
#include "offload/host_arena.h"
#include "offload/swap_dir.h"
#include "offload/tune.h"
#include "kernels/cpu/adam.h"

namespace zeal {


namespace {

at::ScalarType dtype_of(Precision p) {
  switch (p) {
    case Precision::kFp16: return at::kHalf;
    case Precision::kBf16: return at::kBFloat16;
    default: return at::kFloat;
  }
}

// The dtype gradients are summed or reduced in: the config's ("fp32", "fp16", "bf16"), fp32 when unset.
at::ScalarType grad_dtype(const std::string& name) {
  if (name == "fp16") return at::kHalf;
  if (name == "bf16") return at::kBFloat16;
  return at::kFloat;
}

const char* dtype_name(at::ScalarType t) {
  return t == at::kHalf ? "fp16" : t == at::kBFloat16 ? "bf16" : "fp32";
}

// Adam's and AdamW's options have the same fields.
template <class Options>
optim::Hyper adam_hyper(const Options& o, const char* name, size_t group) {
  if (o.amsgrad()) throw Error(fmt::format("parameter group {}: {} with amsgrad is not supported", group, name));
  optim::Hyper h;
  h.lr = o.lr();
  h.beta1 = std::get<0>(o.betas());
  h.beta2 = std::get<1>(o.betas());
  h.eps = o.eps();
  h.weight_decay = o.weight_decay();
  return h;
}

// Whether the fused optimizer kernels exist for partitions on `device`.
bool fused_kernels(const c10::Device& device) {
#ifdef ZEAL_HAVE_CUDA
  if (device.is_cuda()) return true;
#endif
  return device.is_cpu();
}

// The zeal optimizer for a LibTorch optimizer's parameter group, with its hyperparameters.
// Adam and AdamW run the fused kernels where the partition lives on a device that has them.
std::unique_ptr<optim::Optimizer> optimizer_for(torch::optim::OptimizerOptions& options, size_t group, bool fused) {
  if (auto* o = dynamic_cast<torch::optim::AdamWOptions*>(&options)) {
    const auto h = adam_hyper(*o, "AdamW", group);
    return fused ? optim::make_fused_adamw(h) : optim::make_adamw(h);
  }
  if (auto* o = dynamic_cast<torch::optim::AdamOptions*>(&options)) {
    const auto h = adam_hyper(*o, "Adam", group);
    return fused ? optim::make_fused_adam(h) : optim::make_adam(h);
  }
  if (auto* o = dynamic_cast<torch::optim::SGDOptions*>(&options)) {
    if (o->dampening() != 0) throw Error(fmt::format("parameter group {}: SGD with dampening is not supported", group));
    optim::Hyper h;
    h.lr = o->lr();
    h.momentum = o->momentum();
    h.weight_decay = o->weight_decay();
    h.nesterov = o->nesterov();
    return optim::make_sgd(h);
  }
  throw Error("zeal shards torch::optim::Adam, AdamW and SGD; this optimizer is none of them (or set optimizer.type "
              "in the config)");
}

}  // namespace

// --- construction ------------------------------------------------------------------------------

Engine::Engine(Config config)
    : config_(std::move(config)), owned_runtime_(std::make_unique<Runtime>(config_)), runtime_(owned_runtime_.get()),
      compute_dtype_(dtype_of(config_.precision())), state_(std::make_unique<State>()) {
  init();
}

Engine::Engine(Config config, Runtime& runtime)
    : config_(std::move(config)), runtime_(&runtime), compute_dtype_(dtype_of(config_.precision())),
      state_(std::make_unique<State>()) {
  init();
}

Engine::~Engine() {
  finish_background_save();
  if (state_) {
    try {
      end_training();
    } catch (const std::exception& e) {
      log::rank_warning("closing the trackers: {}", e.what());
    }
  }
  // Stage 3 leaves the model gathered (usable) when the engine goes, unless the engine held its
  // last handle: then the model goes too, and gathering it whole would only cost memory.
  if (state_ && state_->module && state_->module.use_count() == 1) {
    if (auto* s3 = dynamic_cast<zero::Stage3*>(state_->zero.get())) s3->skip_gather_at_shutdown();
  }
  if (state_ && state_->module) remember_prepared(state_->module.get(), nullptr);
  if (state_ && state_->init_module) remember_prepared(state_->init_module, nullptr);
  host_cache_trim();
}

void Engine::init() {
  detail::note_runtime_baseline();  // the first engine's start: what every memory report calls the runtime
  try {
    (void)cpu::active_simd();  // a bad ZEAL_CPU_ISA is named now, not at the first step
  } catch (const std::invalid_argument& e) {
    throw Error(e.what());
  }

  zero::keep_large_allocations_mapped();
  install_host_cache();  // LibTorch's large CPU blocks reused (engine/host_cache.h)

  // The world comes from the runtime; "auto" sizes that depend on the model's hidden size take
  // DeepSpeed's defaults here (the engine does not know the hidden size).
  config_.launch.num_processes = runtime_->world_size();
  auto fill = [&](auto& a, auto value, const char* key) {
    if (!a.is_auto) return;
    a = {value, false};
    log::debug("{}: \"auto\" is {} (DeepSpeed's default; Config::resolve_auto with the hidden size gives Accelerate's)",
               key, value);
  };
  fill(config_.zero.reduce_bucket_size, int64_t{500'000'000}, "zero_optimization.reduce_bucket_size");
  fill(config_.zero.stage3_prefetch_bucket_size, int64_t{50'000'000}, "zero_optimization.stage3_prefetch_bucket_size");
  fill(config_.zero.stage3_param_persistence_threshold, int64_t{100'000},
       "zero_optimization.stage3_param_persistence_threshold");
  // Accelerate builds a ZeRO-3 model partitioned unless told otherwise: its DeepSpeed plugin takes an
  // unset zero3_init_flag from ACCELERATE_DEEPSPEED_ZERO3_INIT, else from whether the config is stage 3.
  if (config_.launch.distributed_type == "DEEPSPEED" && config_.zero.stage == 3) {
    const auto it = config_.origins.find("zero_optimization.zero3_init_flag");
    if (it == config_.origins.end() || it->second.kind == Origin::Kind::kDefault) {
      const char* env = std::getenv("ACCELERATE_DEEPSPEED_ZERO3_INIT");
      std::string e = env ? env : "";
      for (auto& ch : e) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
      config_.zero.zero3_init_flag = !(e == "0" || e == "false" || e == "no" || e == "n" || e == "f" || e == "off");
      config_.origins["zero_optimization.zero3_init_flag"] =
          Origin{Origin::Kind::kProgram, env && *env ? "ACCELERATE_DEEPSPEED_ZERO3_INIT"
                                                     : "Accelerate's default for a ZeRO-3 DeepSpeed config"};
    }
  }
  accumulation_steps_ = config_.gradient_accumulation_steps.is_auto ? 1 : config_.gradient_accumulation_steps.value;
  if (accumulation_steps_ < 1) {
    throw Error(fmt::format("gradient_accumulation_steps must be at least 1, got {}", accumulation_steps_));
  }
  const bool use_cuda = !config_.launch.use_cpu && at::detail::getCUDAHooks().hasCUDA() &&
                        at::detail::getCUDAHooks().deviceCount() > 0;
  if (use_cuda) {
    // gpu_ids and the local rank pick the GPU; the NCCL communicator is made on the same one.
#ifdef ZEAL_HAVE_NCCL
    constexpr bool have_nccl = true;
#else
    constexpr bool have_nccl = false;
#endif
    const DeviceChoice choice = choose_cuda_device(runtime_->local_rank(), runtime_->local_world_size(),
                                                   at::detail::getCUDAHooks().deviceCount(), have_nccl,
                                                   config_.launch.gpu_ids);
    device_ = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(choice.device));
    state_->cuda_backend = choice.backend;
    // The current device of this thread: LibTorch's allocations without a device and zeal's kernel
    // launches go to this rank's GPU, not GPU 0.
    c10::impl::VirtualGuardImpl(at::kCUDA).setDevice(device_);
  }
  if (config_.precision() == Precision::kFp16) state_->scaler = std::make_unique<LossScaler>(config_.fp16);
  // bf16/fp16 compute on a CPU without instructions for it: LibTorch converts or emulates its matrix
  // products (one core of an AVX2 EPYC, 64x2048 by 2048x8192: fp32 30 GFLOP/s; bf16 6.7 through
  // linear, 0.2 through matmul); zeal::linear, which every torch::nn::Linear runs, multiplies in fp32.
  const c10::ScalarType lowp = config_.precision() == Precision::kBf16   ? at::kBFloat16
                               : config_.precision() == Precision::kFp16 ? at::kHalf
                                                                         : at::kFloat;
  if (device_.is_cpu() && lowp != at::kFloat) {
    const char* name = lowp == at::kBFloat16 ? "bf16" : "fp16";
    if (cpu_widens_products(lowp)) {
      log::info("mixed_precision {} on a CPU without {}: torch::nn::Linear layers and zeal::linear multiply in fp32 "
                "(LibTorch's own {} products run 5 to 150 times slower here); other {} matrix products of the model "
                "(at::matmul, attention) stay slow; fp32 throughout: --mixed_precision no",
                name, lowp == at::kBFloat16 ? "AVX512-BF16" : "AVX512-FP16", name, name);
    } else if (!cpu_has_instructions(lowp)) {  // ZEAL_CPU_LOWP_MATMUL=native
      log::warning("mixed_precision {} on a CPU without {} and ZEAL_CPU_LOWP_MATMUL=native: LibTorch's {} matrix "
                   "products run 5 (linear layers) to 150 (matmul) times slower than fp32 here; fp32 throughout: "
                   "--mixed_precision no",
                   name, lowp == at::kBFloat16 ? "AVX512-BF16" : "AVX512-FP16", name);
    }
  }
  // A comm_timeout the config sets explicitly applies to a runtime made elsewhere (zeal::spawn) too.
  auto origin = config_.origins.find("comm_timeout");
  if (origin != config_.origins.end() && origin->second.kind != Origin::Kind::kDefault) {
    runtime_->comm().set_timeout(config_.launch.comm_timeout);
    if (device_.is_cuda()) comm().set_timeout(config_.launch.comm_timeout);  // NCCL's too
  }
  make_hybrid_comm();
  if (state_->hybrid && origin != config_.origins.end() && origin->second.kind != Origin::Kind::kDefault)
    state_->hybrid->set_timeout(config_.launch.comm_timeout);
}

// hybrid_shard: every rank's machine (node rank) and local rank, exchanged; groups of the ranks of
// one machine (they shard) and of the ranks with one local rank (they hold the same shard).
void Engine::make_hybrid_comm() {
  const auto& z = config_.zero;
  if (!z.hybrid_shard || z.stage < 2 || runtime_->world_size() == 1) return;
  Communicator& every = comm();
  const int world = runtime_->world_size(), rank = runtime_->rank();
  at::Tensor mine = at::tensor({int64_t{runtime_->env().node_rank}, int64_t{runtime_->local_rank()}}, at::kLong);
  at::Tensor all = at::empty({2 * world}, at::kLong);
  if (device_.is_cuda()) {
    mine = mine.to(device_);
    all = all.to(device_);
  }
  every.all_gather(mine, all).wait();
  all = all.cpu();
  std::vector<int> machine_of(world), local_of(world);
  for (int r = 0; r < world; ++r) {
    machine_of[r] = static_cast<int>(all[2 * r].item<int64_t>());
    local_of[r] = static_cast<int>(all[2 * r + 1].item<int64_t>());
  }
  // The machines the rendezvous found (under Open MPI the node rank counts ranks within a machine,
  // so there the hosts' order decides); the node ranks where it did not note them.
  if (const std::vector<int> noted = detail::rank_machine_indices();
      static_cast<int>(noted.size()) == world && std::find(noted.begin(), noted.end(), -1) == noted.end()) {
    machine_of = noted;
  }
  const HybridLayout l = hybrid_layout(rank, machine_of, local_of);
  if (l.replica.size() == 1) {
    log::info("hybrid_shard on one machine is full sharding");
    return;
  }
  if (l.machine.size() == 1) {
    throw Error(fmt::format("zero_optimization.hybrid_shard: each of the {} machines runs one rank, so there is "
                            "nothing to shard inside a machine: that is replicating everything, ZeRO stage 0; use "
                            "stage 0, or full sharding across machines (hybrid_shard false)",
                            l.replica.size()));
  }
  const int dev = device_.is_cuda() && state_->cuda_backend == CudaBackend::kNccl ? device_.index() : -1;
  // Named by their members' first rank: unique, and the same name on every member.
  Communicator& machine = runtime_->group_comm(fmt::format("machine-of-{}", l.machine.front()), l.machine, dev);
  Communicator& replica = runtime_->group_comm(fmt::format("replica-of-{}", l.replica.front()), l.replica, dev);
  state_->replica_index = l.replica_index;
  state_->hybrid = make_hybrid_communicator(every, machine, replica, l);
  log::info("hybrid_shard: the ZeRO state is sharded across the {} ranks of each machine and replicated across the "
            "{} machines",
            l.machine.size(), l.replica.size());
}

Communicator& Engine::shard_comm() { return state_->hybrid ? *state_->hybrid : comm(); }

Communicator& Engine::comm() {
  // Gloo takes CUDA tensors too (staged through pinned host memory), for ranks that share a GPU.
  return device_.is_cuda() && state_->cuda_backend == CudaBackend::kNccl ? runtime_->cuda_comm(device_.index())
                                                                          : runtime_->comm();
}

Engine::InitScope::InitScope(Engine* e) : e_(e) {
  const auto& z = e->config_.zero;
  e->state_->init_done = false;
  ctx_ = std::make_unique<zero::InitContext>(e->shard_comm(), z.stage == 3 && z.zero3_init_flag, e->device_);
}

Engine::InitScope::~InitScope() = default;

void Engine::InitScope::finish(torch::nn::Module& model) {
  auto shards = ctx_->finish(model, &e_->state_->init_report);
  ctx_.reset();
  if (!shards->empty()) {
    if (e_->state_->init_shards && !e_->state_->init_shards->empty()) {
      throw Error("engine.init: one engine trains one model, and a partitioned one was built already");
    }
    e_->state_->init_shards = std::move(shards);
  }
  e_->state_->init_done = true;
  // load_pretrained / load_checkpoint_in_model find this engine (and the slices) from the model.
  if (e_->state_->init_module && e_->state_->init_module != &model) remember_prepared(e_->state_->init_module, nullptr);
  e_->state_->init_module = &model;
  remember_prepared(&model, e_);
}

void Engine::prepare_module(std::shared_ptr<torch::nn::Module> module) {
  if (!module) throw Error("engine.prepare: the model is empty");
  if (state_->module && state_->module != module) throw Error("engine.prepare: one engine trains one model");
  if (state_->zero) throw Error("engine.prepare: the model was already prepared with its optimizer");
  remember_prepared(module.get(), this);
  zero::apply_activation_checkpointing(*module, config_.activation_checkpointing, device_, runtime_->rank() == 0);
  const auto& shards = state_->init_shards;
  if (shards && !shards->empty()) {
    // Built partitioned: the slices reach the device when stage 3 takes them.
    c10::NoGradGuard no_grad;
    for (auto& p : module->parameters(true))
      if (!shards->contains(p)) p.set_data(p.to(device_));
    for (auto& b : module->buffers(true)) b.set_data(b.to(device_));
  } else if (config_.zero.stage == 3 && !device_.is_cpu()) {
    // Stage 3 moves the parameters unit by unit as it partitions them (Unit::build): the whole
    // model never sits on one GPU. Buffers are not partitioned; they go now.
    c10::NoGradGuard no_grad;
    for (auto& b : module->buffers(true)) b.set_data(b.to(device_));
  } else {
    module->to(device_);
  }
  state_->module = std::move(module);
}

void Engine::prepare_optimizer(torch::optim::Optimizer* optimizer) {
  if (!config_.optimizer.type.empty()) {
    throw Error(fmt::format("the config names an optimizer (optimizer.type: {}) and the program prepares one too; "
                            "remove one of them",
                            config_.optimizer.type));
  }
  if (state_->torch_optimizer && state_->torch_optimizer != optimizer) {
    throw Error("engine.prepare: one engine takes one optimizer (use parameter groups for different settings)");
  }
  if (state_->zero) throw Error("engine.prepare: the optimizer was already prepared");
  state_->torch_optimizer = optimizer;
}

int Engine::add_scheduler(torch::optim::LRScheduler* torch_scheduler, std::shared_ptr<optim::LrSchedule> schedule) {
  if (!config_.scheduler.type.empty()) {
    throw Error(fmt::format("the config names a scheduler (scheduler.type: {}) and the program prepares one too; "
                            "remove one of them",
                            config_.scheduler.type));
  }
  state_->schedulers.push_back({torch_scheduler, std::move(schedule), optimizer_steps_});
  return static_cast<int>(state_->schedulers.size()) - 1;
}

data::Binding Engine::binding() {
  data::Binding b;
  b.rank = runtime_->rank();
  b.world_size = runtime_->world_size();
  b.device = device_;
  b.progress = state_->progress;
  b.cursor = std::make_shared<data::Cursor>();
  state_->cursors.push_back(b.cursor);
  return b;
}

void Engine::finish_prepare() {
  if (state_->zero || !state_->module) return;
  if (!state_->torch_optimizer && config_.optimizer.type.empty()) return;
  build_zero();
  if (state_->batch_check) {
    const auto [model, batch] = std::move(*state_->batch_check);
    state_->batch_check.reset();
    check_batch_memory(model, batch);
  }
}

// One line on rank 0 at start: the dtypes gradients are accumulated and reduced in. Unset, both are
// fp32 even when training in 16 bits, where DeepSpeed reduces in the training dtype: said, so that
// neither the bytes on the wire nor the rounding surprise anyone.
void Engine::say_gradient_dtypes(int world) const {
  if (!log::enabled(log::Level::kInfo)) return;
  const at::ScalarType accum = grad_dtype(config_.grad_accum_dtype), wire = grad_dtype(config_.communication_data_type);
  std::string line = fmt::format("gradients accumulate in {}", dtype_name(accum));
  if (world > 1) {
    line += fmt::format(" and are reduced across ranks in {}", dtype_name(wire));
    if (config_.communication_data_type.empty() && compute_dtype_ != at::kFloat) {
      line += fmt::format(" (communication_data_type unset; DeepSpeed would reduce in {}: set it to {} for half the bytes)",
                          dtype_name(compute_dtype_), dtype_name(compute_dtype_));
    }
  }
  log::info("{}", line);
}

// memory_check: every rank's predicted peak against what it may use, and with offload to nvme the
// swap files against the free disk, before anything is allocated or written. Collective (the
// verdicts are shared, so that every rank refuses together).
void Engine::check_memory_at_prepare() {
  const bool nvme = config_.zero.offload_optimizer.device == OffloadDevice::kNvme ||
                    (config_.zero.stage == 3 && config_.zero.offload_param.device == OffloadDevice::kNvme);
  if (config_.memory_check == "off" && !nvme) return;
  const detail::PrepareMemory pm =
      detail::predict_prepare_memory(*state_->module, state_->init_shards.get(), config_, shard_comm().world_size(),
                                     runtime_->local_world_size(), device_.is_cuda());
  if (nvme) {
    // A restarted attempt (zeal launch --max_restarts) first removes the swap files its killed
    // predecessor left: they would otherwise take the space this one needs.
    if (const char* prev = std::getenv("ZEAL_PREVIOUS_ATTEMPT_PIDS"); prev && *prev) {
      std::vector<long> pids;
      std::istringstream list(prev);
      for (std::string p; std::getline(list, p, ',');) pids.push_back(std::atol(p.c_str()));
      std::set<std::string> paths;
      if (config_.zero.offload_optimizer.device == OffloadDevice::kNvme) paths.insert(config_.zero.offload_optimizer.nvme_path);
      if (config_.zero.offload_param.device == OffloadDevice::kNvme) paths.insert(config_.zero.offload_param.nvme_path);
      for (const auto& path : paths) {
        for (const auto& d : offload::remove_earlier_attempt(path, pids)) {
          log::rank_info("offload: removed {}, the swap files of the attempt before this one", d);
        }
      }
    }
    // The free space for the swap files, before anything is written (every rank, in agreement).
    const auto verdicts = ckpt::all_strings(*this, detail::check_swap_space(pm, config_, runtime_->local_world_size()));
    std::vector<std::pair<std::string, std::vector<int>>> said;  // each message once, with its ranks
    for (size_t r = 0; r < verdicts.size(); ++r) {
      if (verdicts[r].empty()) continue;
      auto it = std::find_if(said.begin(), said.end(), [&](const auto& x) { return x.first == verdicts[r]; });
      if (it == said.end()) it = said.insert(said.end(), {verdicts[r], {}});
      it->second.push_back(static_cast<int>(r));
    }
    if (!said.empty()) {
      std::string text;
      for (const auto& [msg, ranks] : said) {
        text += fmt::format("{}{} {}: {}", text.empty() ? "" : "\n", ranks.size() == 1 ? "rank" : "ranks",
                            fmt::join(ranks, ", "), msg);
      }
      throw Error(text);
    }
  }
  if (config_.memory_check == "off") return;
  state_->predicted_peak = pm.predicted;
  state_->memory_budget = pm.budget.bytes;
  state_->memory_budget_source = pm.budget.source;
  std::string mine;
  if (!pm.fits()) {
    mine = fmt::format(
        "rank {} is predicted to hold {} of host memory at its peak before any activations ({}), but may use {}, "
        "{}.{}",
        runtime_->rank(), format_bytes(static_cast<double>(pm.predicted)), pm.parts,
        format_bytes(static_cast<double>(pm.budget.bytes)), pm.budget.source,
        pm.remedies.empty() ? "" : " What would lower the peak: " + pm.remedies + ".");
  }
  const std::vector<std::string> all = ckpt::all_strings(*this, mine);
  std::string first;
  std::vector<int> over;
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty()) continue;
    over.push_back(static_cast<int>(r));
    if (first.empty()) first = all[r];
  }
  if (over.empty()) return;
  const std::string ranks = over.size() == all.size() ? "every rank" : fmt::format("rank(s) {}", fmt::join(over, ", "));
  if (config_.memory_check == "error") {
    throw Error(fmt::format("memory_check: error: {} will not fit: {} (memory_check: warn trains anyway)", ranks, first));
  }
  log::warning("{} may run out of memory: {} A smaller micro-batch and activation checkpointing lower the activations "
               "on top. (memory_check: error refuses to train, off silences this.)",
               ranks, first);
}

void Engine::check_batch_memory(const estimate::ModelShape& model, const estimate::RunShape& batch) {
  if (!state_->zero) {  // checked once the model and optimizer are prepared
    state_->batch_check.emplace(model, batch);
    return;
  }
  // memory_check is the same on every rank (compared at the rendezvous); below, every rank takes
  // part in the verdict, even one with nothing to check (a GPU rank, a budget that could not be read).
  if (config_.memory_check == "off") return;
  const int64_t budget = state_->memory_budget;
  const bool checked = !device_.is_cuda() && state_->predicted_peak >= 0 && budget >= 0;
  const detail::BatchMemory bm =
      checked ? detail::predict_batch_memory(model, batch, config_, shard_comm().world_size(), num_trainable_parameters(),
                                             state_->predicted_peak, budget)
              : detail::BatchMemory{};
  const int64_t peak = state_->predicted_peak + bm.activations;
  // 'x': the batch alone needs more than the rank may use (no setting of memory_check runs it); 'w': the whole
  // peak does.
  std::string mine;
  if (checked && peak > budget) {
    std::string lower;
    if (bm.largest_micro_batch > 0) lower = fmt::format("The largest micro-batch predicted to fit with 10 % to spare is {}", bm.largest_micro_batch);
    if (bm.with_checkpointing >= 0) {
      lower += fmt::format("{}ctivation checkpointing (every unit) predicts {} in all", lower.empty() ? "A" : "; a",
                           format_bytes(static_cast<double>(bm.with_checkpointing)));
    }
    mine = fmt::format("{}rank {}: {} x {} tokens per micro-step ({}) are predicted to add {} of activations to the "
                       "{} the rank holds before them, {} in all, but it may use {}, {}.{}",
                       bm.activations > budget ? 'x' : 'w', runtime_->rank(), batch.micro_batch, batch.seq_len,
                       model.name, format_bytes(static_cast<double>(bm.activations)),
                       format_bytes(static_cast<double>(state_->predicted_peak)), format_bytes(static_cast<double>(peak)),
                       format_bytes(static_cast<double>(budget)), state_->memory_budget_source,
                       lower.empty() ? "" : " " + lower + ".");
  }
  const std::vector<std::string> all = ckpt::all_strings(*this, mine);
  std::string first;
  bool certain = false;
  for (const auto& s : all) {
    if (s.empty()) continue;
    if (first.empty() || (s[0] == 'x' && !certain)) first = s.substr(1);
    certain = certain || s[0] == 'x';
  }
  if (first.empty()) return;
  if (certain) {
    throw Error(fmt::format("memory_check: the batch will not fit: {} (the activations alone are more than the rank "
                            "may use; memory_check: off runs it anyway)", first));
  }
  if (config_.memory_check == "error") {
    throw Error(fmt::format("memory_check: error: the batch will not fit: {} (memory_check: warn trains anyway)", first));
  }
  log::warning("the batch may run out of memory: {} (memory_check: error refuses to train, off silences this.)", first);
}

void Engine::build_zero() {
  auto& module = *state_->module;
  // Resolve what the program now knows.
  ProgramValues pv;
  pv.world_size = runtime_->world_size();
  if (state_->torch_optimizer) {
    pv.lr = state_->torch_optimizer->param_groups().at(0).options().get_lr();
  }
  if (config_.train_micro_batch_size_per_gpu.is_auto && !pv.micro_batch_size) {
    config_.train_micro_batch_size_per_gpu = {0, false};
  }
  config_.resolve_auto(pv);
  accumulation_steps_ = config_.gradient_accumulation_steps.value;

  // Parameters in registration order; which are trainable.
  std::unordered_map<const void*, int> index;
  std::vector<at::Tensor> all;
  std::vector<std::string> names;
  for (auto& item : module.named_parameters(true)) {
    // A parameter registered under two names (tied weights) counts once, under its first name.
    if (!index.emplace(item.value().unsafeGetTensorImpl(), static_cast<int>(all.size())).second) continue;
    all.push_back(item.value());
    names.push_back(item.key());
  }
  check_memory_at_prepare();
  std::vector<int> group_of(all.size(), -1);
  std::vector<zero::ZeroOptimizer::Group> groups;
  if (state_->torch_optimizer) {
    auto& pgs = state_->torch_optimizer->param_groups();
    for (size_t g = 0; g < pgs.size(); ++g) {
      for (size_t k = 0; k < pgs[g].params().size(); ++k) {
        auto it = index.find(pgs[g].params()[k].unsafeGetTensorImpl());
        if (it == index.end()) {
          throw Error(fmt::format("parameter {} of the optimizer's group {} is not a parameter of the prepared model", k, g));
        }
        if (group_of[it->second] >= 0) {
          throw Error(fmt::format("parameter '{}' is in the optimizer's groups {} and {}", names[it->second],
                                  group_of[it->second], g));
        }
        group_of[it->second] = static_cast<int>(g);
      }
      groups.push_back({{}, {}, optimizer_for(pgs[g].options(), g, fused_kernels(device_))});
      state_->base_lrs.push_back(pgs[g].options().get_lr());
    }
  } else {
    groups.push_back({{}, {}, optim::make_optimizer(config_.optimizer, fused_kernels(device_))});
    state_->base_lrs.push_back(config_.optimizer.lr.value);
    for (size_t i = 0; i < all.size(); ++i) group_of[i] = 0;
  }
  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> frozen;
  for (size_t i = 0; i < all.size(); ++i) {
    if (!all[i].requires_grad()) {
      frozen.push_back(all[i]);
      continue;
    }
    if (group_of[i] < 0) {
      throw Error(fmt::format("parameter '{}' requires grad but is in none of the optimizer's groups; freeze it "
                              "(requires_grad(false)) or give it to the optimizer",
                              names[i]));
    }
    groups[group_of[i]].params.push_back(all[i]);
    groups[group_of[i]].names.push_back(names[i]);
    state_->trained_names.insert(names[i]);
  }
  // Frozen parameters and buffers: rank 0's values everywhere (as DDP does); frozen parameters
  // compute in the compute dtype too.
  Communicator& c = comm();
  const bool stage3 = config_.zero.stage == 3;  // stage 3 broadcasts and casts every parameter itself
  std::vector<at::Tensor> to_sync = stage3 ? std::vector<at::Tensor>{} : frozen;
  for (auto& b : module.buffers(true)) to_sync.push_back(b);
  if (c.world_size() > 1) {
    std::vector<Work> works;
    std::vector<std::pair<at::Tensor, at::Tensor>> back;  // a non-contiguous one through a copy
    for (auto& t : to_sync) {
      if (t.numel() == 0) continue;
      if (t.is_contiguous()) {
        works.push_back(c.broadcast(t, 0));
      } else {
        back.push_back({t, t.contiguous()});
        works.push_back(c.broadcast(back.back().second, 0));
      }
    }
    for (auto& w : works) w.wait();
    c10::NoGradGuard no_grad;
    for (auto& [t, copy] : back) t.copy_(copy);
  }
  for (auto& p : frozen) {
    if (stage3) break;
    if (at::isFloatingType(p.scalar_type()) && p.scalar_type() != compute_dtype_) p.set_data(p.to(compute_dtype_));
  }
  // With bf16 or fp16 the floating-point buffers compute in that dtype too, as DeepSpeed's
  // module.bfloat16()/half() casts them: a BatchNorm's weight (trained in the compute dtype) and its
  // running statistics must agree, or LibTorch's batch_norm refuses the mix. Integer buffers stay.
  if (compute_dtype_ != at::kFloat) {
    c10::NoGradGuard no_grad;
    for (auto& b : module.buffers(true)) {
      if (at::isFloatingType(b.scalar_type()) && b.scalar_type() != compute_dtype_) b.set_data(b.to(compute_dtype_));
    }
  }
  // offload_optimizer.device cpu: master weights and optimizer state in one host arena (pinned for
  // a GPU when pin_memory asks), the step on the CPU.
  const OffloadDevice off = config_.zero.offload_optimizer.device;
  if (off != OffloadDevice::kNone && !state_->offload) {
    state_->offload = std::make_shared<offload::HostArena>(device_.is_cuda() && config_.zero.offload_optimizer.pin_memory);
  }
  const bool param_nvme = stage3 && config_.zero.offload_param.device == OffloadDevice::kNvme;
  if ((off == OffloadDevice::kNvme || param_nvme) && !state_->io) {
    // One run directory for every rank: rank 0 names it.
    if (runtime_->rank() == 0) {
      state_->run_id = offload::new_run_id();
      if (runtime_->world_size() > 1) runtime_->store_set("offload/run_id", state_->run_id);
    } else {
      state_->run_id = runtime_->store_get("offload/run_id");
    }
    offload::IoOptions io;
    io.block_size = config_.aio.block_size.value;
    io.queue_depth = static_cast<int>(config_.aio.queue_depth.value);
    if (config_.aio.block_size.is_auto || config_.aio.queue_depth.is_auto) {
      // "auto": rank 0 measures the disk under the swap path (a few seconds) and every rank takes its
      // choice, so the whole run uses one setting.
      const std::string& where = off == OffloadDevice::kNvme ? config_.zero.offload_optimizer.nvme_path
                                                             : config_.zero.offload_param.nvme_path;
      std::string chosen;
      if (runtime_->rank() == 0) {
        const offload::TuneResult t = offload::tune_io(where, int64_t{64} << 20, 4.0);
        chosen = fmt::format("{} {}", t.best.block_size, t.best.queue_depth);
        log::info("offload: aio auto: measured {} in {} settings: block_size {}, queue_depth {} (write {:.2f} GB/s, "
                  "read {:.2f} GB/s)",
                  where, t.trials.size(), t.best.block_size, t.best.queue_depth, t.best.write_bytes_per_s / 1e9,
                  t.best.read_bytes_per_s / 1e9);
        if (runtime_->world_size() > 1) runtime_->store_set("offload/aio", chosen);
      } else {
        chosen = runtime_->store_get("offload/aio");
      }
      const auto space = chosen.find(' ');
      if (config_.aio.block_size.is_auto) io.block_size = std::stoll(chosen.substr(0, space));
      if (config_.aio.queue_depth.is_auto) io.queue_depth = std::stoi(chosen.substr(space + 1));
    }
    io.thread_count = static_cast<int>(config_.aio.thread_count);
    io.single_submit = config_.aio.single_submit;
    io.overlap_events = config_.aio.overlap_events;
    io.verify = config_.aio.verify;
    std::string why;
    state_->io = offload::make_io_engine(io, std::getenv("ZEAL_OFFLOAD_IO") && std::string(std::getenv("ZEAL_OFFLOAD_IO")) == "threads", &why);
    if (!why.empty() && runtime_->local_rank() == 0) {  // once per machine
      log::rank_info("offload: {}; reading and writing through {} threads instead", why, io.thread_count);
    }
  }
  // The rank's swap directory under an nvme_path: one per path (the optimizer's and the
  // parameters' may be the same directory or two).
  auto swap_dir = [&](const std::string& nvme_path) {
    std::error_code ec;
    const std::string key = std::filesystem::weakly_canonical(nvme_path, ec).string();
    auto& dir = state_->swap_dirs[ec ? nvme_path : key];
    if (!dir) {
      dir = std::make_shared<offload::SwapDir>(nvme_path, state_->run_id, runtime_->rank());
      if (runtime_->local_rank() == 0) {
        for (const auto& d : dir->stale()) {
          log::rank_warning("offload: {} was left by a run that did not finish; remove it", d);
        }
      }
    }
    return dir;
  };
  if (off == OffloadDevice::kNvme && !state_->nvme) {
    auto nv = std::make_shared<zero::NvmeOffload>();
    nv->dir = swap_dir(config_.zero.offload_optimizer.nvme_path);
    nv->io = state_->io;
    // sub_group_size sets a window, up to kMaxNvmeSubGroup (DeepSpeed's default of 1e9 would ask for
    // 64 GB per rank).
    nv->sub_group_elems = nvme_window_elems(config_.zero.sub_group_size);
    if (config_.zero.sub_group_size > kMaxNvmeSubGroup) {
      log::info("offload: the optimizer's nvme windows hold {} elements (sub_group_size {} would keep about {} of "
                "window buffers in host memory per rank; a sub_group_size of at most {} is taken as it is)",
                kDefaultNvmeWindowElems, config_.zero.sub_group_size,
                format_bytes(static_cast<double>(nvme_window_bytes_per_elem(static_cast<int>(
                                 std::min<int64_t>(config_.zero.offload_optimizer.buffer_count, 3)))) *
                             static_cast<double>(config_.zero.sub_group_size)), kMaxNvmeSubGroup);
    }
    nv->buffer_sets = static_cast<int>(std::min<int64_t>(config_.zero.offload_optimizer.buffer_count, 3));
    state_->nvme = nv;
  }
  // On a GPU, parameter shards offloaded to the CPU (offload_param cpu; nvme's max_in_cpu) live in
  // host memory of their own, copied back for their gathers; on CPU ranks they are there already.
  std::shared_ptr<offload::HostArena> param_host;
  if (stage3 && !device_.is_cpu() && config_.zero.offload_param.device != OffloadDevice::kNone) {
    param_host = std::make_shared<offload::HostArena>(device_.is_cuda() && config_.zero.offload_param.pin_memory);
  }
  if (param_host && config_.zero.offload_param.device == OffloadDevice::kCpu && !state_->param_swap) {
    state_->param_swap = std::make_shared<zero::ParamSwap>(param_host);
  }
  if (param_nvme && !state_->param_swap) {
    zero::ParamSwapOptions po;
    po.buffer_count = config_.zero.offload_param.buffer_count;
    po.buffer_elems = config_.zero.offload_param.buffer_size;
    po.max_in_cpu = config_.zero.offload_param.max_in_cpu;
    state_->param_swap = std::make_shared<zero::ParamSwap>(swap_dir(config_.zero.offload_param.nvme_path), state_->io,
                                                           po, param_host);
  }
  Communicator& sc = shard_comm();
  say_gradient_dtypes(sc.reduction_world());
  if (!config_.zero.unit_names.empty() && !stage3) {
    log::info("zero_optimization.unit_names (fsdp_transformer_layer_cls_to_wrap) [{}] names stage 3's units: at stage "
              "{} nothing is gathered, so it changes nothing",
              fmt::join(config_.zero.unit_names, ", "), config_.zero.stage);
  }
  if (stage3) {
    zero::Stage3Options o3;
    o3.compute_dtype = compute_dtype_;
    o3.grad_accum_dtype = grad_dtype(config_.grad_accum_dtype);
    o3.comm_dtype = grad_dtype(config_.communication_data_type);
    o3.prefetch_elems = config_.zero.stage3_prefetch_bucket_size.value;
    o3.persistence_threshold = config_.zero.stage3_param_persistence_threshold.value;
    o3.max_live_elems = config_.zero.stage3_max_live_parameters;
    o3.prefetch = o3.prefetch_elems > 0;
    o3.max_reuse_elems = config_.zero.stage3_max_reuse_distance;
    o3.device = device_;
    o3.offload = state_->offload;
    o3.nvme = state_->nvme;
    o3.param_swap = state_->param_swap;
    o3.unit_names = config_.zero.unit_names;
    std::vector<zero::Stage3::Group> g3;
    for (auto& g : groups) g3.push_back({std::move(g.params), std::move(g.names), std::move(g.optimizer)});
    state_->zero = std::make_unique<zero::Stage3>(sc, module, std::move(g3), o3, state_->init_shards);
    state_->init_shards.reset();
    make_config_schedules();
    return;
  }
  zero::GroupOptions o;
  o.stage = static_cast<int>(config_.zero.stage);
  o.compute_dtype = compute_dtype_;
  o.grad_accum_dtype = grad_dtype(config_.grad_accum_dtype);
  o.comm_dtype = grad_dtype(config_.communication_data_type);
  o.bucket_elems = config_.zero.reduce_bucket_size.value;
  o.overlap_comm = config_.zero.overlap_comm;
  o.offload = state_->offload;
  state_->zero = std::make_unique<zero::ZeroOptimizer>(sc, std::move(groups), o);
  make_config_schedules();
}

// DeepSpeed's rule for its schedulers: WarmupLR and WarmupDecayLR give every group the configured
// rates (a scalar warmup_max_lr is copied to each); WarmupCosineLR scales each group's own rate.
void Engine::make_config_schedules() {
  // wall_clock_breakdown's first mark: the end of prepare (the first forward is timed from here).
  state_->wall.mark = std::chrono::steady_clock::now();
  state_->wall.marked = true;
  (void)detail::take_waits();  // the waits of training start here too
  state_->config_schedules.clear();
  const auto& sc = config_.scheduler;
  if (sc.type.empty()) return;
  // DeepSpeed's rule for a list (its _format_param): exactly one rate per parameter group.
  const size_t groups = state_->base_lrs.size();
  const bool reads_rates = sc.type == "WarmupLR" || sc.type == "WarmupDecayLR";  // WarmupCosineLR scales instead
  for (const auto& [key, list] : {std::pair{"warmup_min_lr", &sc.warmup_min_lrs}, std::pair{"warmup_max_lr", &sc.warmup_max_lrs}}) {
    if (reads_rates && !list->empty() && list->size() != groups) {
      const std::string full = std::string("scheduler.params.") + key;
      const auto origin = config_.origins.find(full);
      throw Error(fmt::format("{} (from {}): expected {} values (one per parameter group of the optimizer), got {}",
                              full, origin == config_.origins.end() ? Origin{}.describe() : origin->second.describe(),
                              groups, list->size()));
    }
  }
  for (size_t g = 0; g < groups; ++g) {
    state_->config_schedules.push_back(optim::make_schedule(sc, state_->base_lrs[g], g));
  }
}

// --- the step ----------------------------------------------------------------------------------

Engine::AccumulateGuard Engine::accumulate() {
  begin_micro_step();
  guard_open_ = true;
  return AccumulateGuard(this);
}

Engine::AccumulateGuard::~AccumulateGuard() {
  if (e_) e_->guard_open_ = false;
}

void Engine::begin_micro_step() {
  // Accelerate's rule: sync every accumulation_steps-th micro-step and at the end of the data.
  if (state_->progress->active && state_->progress->end_of_dataloader) {
    micro_steps_ = 0;
    sync_ = true;
  } else {
    ++micro_steps_;
    sync_ = micro_steps_ % accumulation_steps_ == 0;
  }
  state_->backward_in_micro_step = false;
  ++state_->micro_steps_begun;
  shard_comm().set_progress(optimizer_steps_, state_->micro_steps_begun);  // the hybrid one tells all three
  if (state_->zero) state_->zero->begin_micro_step(sync_);
}

void Engine::backward(const at::Tensor& loss) {
  if (!state_->zero) throw Error("engine.backward: prepare the model and an optimizer first");
  if (!guard_open_) begin_micro_step();
  // Stages 0 and 1 reduce the gradient buffer in place on the sync micro-step: a second backward
  // would add local gradients to reduced ones. Stages 2 and 3 reduce each pass's own gradients.
  if (state_->backward_in_micro_step && sync_ && state_->zero->stage() < 2) {
    throw Error("engine.backward was called twice in the micro-step that synchronizes gradients (stages 0 and 1 "
                "reduce them in place); add the losses and call it once");
  }
  state_->backward_in_micro_step = true;
  if (config_.wall_clock_breakdown) {
    synchronize();
    auto& w = state_->wall;
    w.backward_start = std::chrono::steady_clock::now();
    if (w.marked) w.forward += std::chrono::duration<double, std::milli>(w.backward_start - w.mark).count();
  }
  // The backward that completes the gradients: the NVMe-offloaded step's first windows of master,
  // m and v start coming in now, behind the backward (they do not depend on the gradients).
  if (sync_) {
    try {
      state_->zero->prefetch_step_state();
    } catch (const std::exception&) {
      // (no thread to read with: the step reads them itself)
    }
  }
  double factor = 1.0 / static_cast<double>(accumulation_steps_);
  if (state_->scaler) factor *= state_->scaler->scale();
  try {
    (factor == 1.0 ? loss : loss * factor).backward();
  } catch (...) {
    // The pass ended with an error (a hook that threw, a failed collective): what it reduced is
    // finished and dropped, and the next step is skipped; the engine stays usable.
    state_->zero->notice_abandoned();
    state_->grads_pending = true;
    throw;
  }
  state_->zero->end_backward();
  state_->grads_pending = true;
  if (config_.wall_clock_breakdown) {
    synchronize();
    auto& w = state_->wall;
    w.mark = std::chrono::steady_clock::now();
    w.marked = true;
    w.backward += std::chrono::duration<double, std::milli>(w.mark - w.backward_start).count();
  }
}

at::Tensor Engine::full_grad(const at::Tensor& param) {
  if (!state_->zero) throw Error("engine.full_grad: prepare the model and an optimizer first");
  return state_->zero->full_grad(param, inv_scale());
}

double Engine::inv_scale() const { return state_->scaler ? 1.0 / state_->scaler->scale() : 1.0; }

double Engine::loss_scale() const { return state_->scaler ? state_->scaler->scale() : 1.0; }

void Engine::configure(const std::vector<Config::Setting>& settings) {
  if (state_->zero) throw Error("engine.configure: the model is prepared already; set the config before prepare");
  config_.set_all(settings);
  accumulation_steps_ = config_.gradient_accumulation_steps.is_auto ? 1 : config_.gradient_accumulation_steps.value;
}

void Engine::keep_alive(std::shared_ptr<void> object) { state_->kept.push_back(std::move(object)); }

std::vector<double> Engine::get_lr() const {
  if (!state_->zero) throw Error("engine.get_lr: prepare the model and an optimizer first");
  return learning_rates();
}

std::vector<double> Engine::learning_rates() const {
  const size_t n = state_->zero->num_groups();
  std::shared_ptr<optim::LrSchedule> prepared;
  for (auto& s : state_->schedulers) {
    if (s.zeal) prepared = s.zeal;
  }
  if (prepared) {
    // PyTorch's and Hugging Face's rule: a schedule scales each group's own rate. The program's
    // schedule gives group 0's rate; every other group keeps its ratio to group 0's base rate.
    if (const auto f = prepared->factor(optimizer_steps_)) {
      std::vector<double> out;
      for (size_t g = 0; g < n; ++g) out.push_back(state_->base_lrs.at(g) * *f);
      return out;
    }
    const double lr = prepared->lr_at(optimizer_steps_), base0 = state_->base_lrs.at(0);
    std::vector<double> out(n, lr);
    for (size_t g = 1; g < n && base0 > 0; ++g) out[g] = lr * state_->base_lrs.at(g) / base0;
    return out;
  }
  if (!state_->config_schedules.empty()) {
    std::vector<double> out;
    for (size_t g = 0; g < n; ++g) out.push_back(state_->config_schedules.at(g)->lr_at(optimizer_steps_));
    return out;
  }
  if (state_->torch_optimizer) {
    std::vector<double> out;
    for (auto& g : state_->torch_optimizer->param_groups()) out.push_back(g.options().get_lr());
    return out;
  }
  return state_->base_lrs;
}

void Engine::step() {
  if (!state_->zero) throw Error("engine.step: prepare the model and an optimizer first");
  // A backward the program ran itself (loss.backward()) leaves gradients too.
  if (const int64_t passes = state_->zero->backward_passes(); passes != state_->passes_seen) {
    state_->passes_seen = passes;
    state_->grads_pending = true;
  }
  if (!sync_ || !state_->grads_pending) return;
  std::chrono::steady_clock::time_point step_start{};
  if (config_.wall_clock_breakdown) {
    synchronize();
    step_start = std::chrono::steady_clock::now();
  }
  if (optimizer_steps_ + skipped_steps_ == 0) check_adapters_ran();
  const double clip = config_.gradient_clipping.value;
  const std::vector<double> lrs = learning_rates();
  const auto r = state_->zero->step(inv_scale(), clip, lrs);
  state_->grads_pending = false;
  last_grad_norm_ = r.grad_norm;
  last_step_skipped_ = !r.stepped;
  if (!r.abandoned.empty()) {
    log::warning("optimizer step {} skipped: {}", optimizer_steps_ + 1, r.abandoned);
    ++skipped_steps_;
    sync_buffers();
    report_progress(lrs);
    return;
  }
  if (state_->scaler) {
    state_->scaler->update(!r.stepped);
  } else if (!r.stepped) {
    log::warning("optimizer step {} skipped: the gradients hold inf or nan (norm {})", optimizer_steps_ + 1,
                 r.grad_norm);
  }
  if (r.stepped) {
    ++optimizer_steps_;
  } else {
    ++skipped_steps_;
  }
  sync_buffers();  // after the counters: a failure here leaves them in step with the optimizer
  if (config_.wall_clock_breakdown) {
    synchronize();
    auto& w = state_->wall;
    w.mark = std::chrono::steady_clock::now();
    w.marked = true;
    w.step += std::chrono::duration<double, std::milli>(w.mark - step_start).count();
    ++w.steps;
  }
  report_progress(lrs);
}

void Engine::sync_buffers() {
  Communicator& c = comm();
  if (!config_.broadcast_buffers || c.world_size() == 1 || !state_->module) return;
  // One broadcast per dtype and device: the buffers flattened into one tensor and back.
  std::map<std::pair<int, std::string>, std::vector<at::Tensor>> by;
  for (auto& b : state_->module->buffers(true)) {
    if (b.numel() > 0) by[{static_cast<int>(b.scalar_type()), b.device().str()}].push_back(b);
  }
  CollectiveLabel label(c, "buffers after step");
  c10::NoGradGuard no_grad;
  for (auto& [key, list] : by) {
    std::vector<at::Tensor> flat;
    for (auto& b : list) flat.push_back(b.reshape({-1}));
    at::Tensor all = at::cat(flat);
    c.broadcast(all, 0).wait();
    int64_t at = 0;
    for (auto& b : list) {
      b.copy_(all.narrow(0, at, b.numel()).view(b.sizes()));
      at += b.numel();
    }
  }
}

// Before the first optimizer step: LoRA adapters that no forward of this step ran on any rank (their
// Linear's weight used directly by its owner, never through Linear::forward) would train nothing,
// silently. Every rank takes part (the same collectives whether or not it has adapters): the ranks
// agree on how many adapted layers the model has, then on which ran anywhere.
void Engine::check_adapters_ran() {
  const auto layers = state_->module ? peft::detail::adapter_runs(*state_->module)
                                     : std::vector<std::pair<std::string, bool>>{};
  Communicator& c = comm();
  const auto opts = at::TensorOptions().dtype(at::kLong).device(device_);
  const int64_t n = static_cast<int64_t>(layers.size());
  at::Tensor count = at::tensor({n, -n}, at::kLong).to(device_);
  if (c.world_size() > 1) c.all_reduce(count, ReduceOp::kMax).wait();
  count = count.cpu();
  if (count[0].item<int64_t>() != -count[1].item<int64_t>()) {
    throw Error(fmt::format("the ranks' models have different numbers of LoRA-adapted layers ({} to {}; this rank {}): "
                            "adapt the same layers on every rank",
                            -count[1].item<int64_t>(), count[0].item<int64_t>(), n));
  }
  if (n == 0) return;
  at::Tensor ran = at::zeros({n}, opts);
  for (int64_t i = 0; i < n; ++i)
    if (layers[i].second) ran[i] = 1;
  if (c.world_size() > 1) c.all_reduce(ran, ReduceOp::kMax).wait();
  ran = ran.cpu();
  std::vector<std::string> idle;
  for (int64_t i = 0; i < n; ++i)
    if (ran[i].item<int64_t>() == 0) idle.push_back(layers[i].first);
  if (idle.empty()) return;
  throw Error(fmt::format("the LoRA adapters of {} adapted layer{} did not run in the first step's forward passes on "
                          "any rank: {}{}. Their module multiplies by the Linear's weight itself instead of calling it "
                          "(as torch::nn::MultiheadAttention does with out_proj), or the layer is not used by the "
                          "loss, so the adapters would never train; leave these layers out of target_modules",
                          idle.size(), idle.size() == 1 ? "" : "s",
                          fmt::join(idle.begin(), idle.begin() + std::min<size_t>(idle.size(), 8), ", "),
                          idle.size() > 8 ? ", ..." : ""));
}

// DeepSpeed's steps_per_print: every that many steps (taken or skipped), rank 0 prints the step, the
// steps skipped, each group's learning rate of that step, the gradient norm and, in fp16, the loss scale.
void Engine::report_progress(const std::vector<double>& lrs) {
  const int64_t steps = optimizer_steps_ + skipped_steps_;
  if (steps % config_.steps_per_print != 0) return;
  if (log::enabled(log::Level::kInfo)) {
    std::string rates;
    for (size_t g = 0; g < lrs.size(); ++g) rates += fmt::format("{}{:.6g}", g ? ", " : "", lrs[g]);
    std::string line = fmt::format("step={}, skipped={}, lr=[{}], grad_norm={:.6g}", steps, skipped_steps_, rates,
                                   last_grad_norm_);
    if (state_->scaler) line += fmt::format(", loss_scale={:g}", state_->scaler->scale());
    log::info("{}", line);
  }
  // wall_clock_breakdown: the mean per optimizer step since the last line. "forward" is everything
  // from the end of the previous backward or step to the next backward (the forward, and the data);
  // inside those, what the training thread spent blocked on collectives and on offloaded state.
  auto& w = state_->wall;
  const auto waited = detail::take_waits();  // a window's waits stay in it
  if (config_.wall_clock_breakdown && w.steps > 0) {
    const double n = static_cast<double>(w.steps);
    w.last = {steps,           w.steps,         w.forward / n,   w.backward / n,  w.step / n,
              waited[0] * 1e3 / n, waited[1] * 1e3 / n, waited[2] * 1e3 / n, waited[3] * 1e3 / n};
    const StepBreakdown& b = w.last;
    log::info("time (ms) per step, mean of {} | forward: {:.2f} | backward: {:.2f} | step: {:.2f} | waiting for "
              "reductions: {:.2f} | gathers: {:.2f} | reads: {:.2f} | writes: {:.2f}",
              b.steps, b.forward_ms, b.backward_ms, b.step_ms, b.reduction_wait_ms, b.gather_wait_ms, b.read_wait_ms,
              b.write_wait_ms);
  }
  w.forward = w.backward = w.step = 0;
  w.steps = 0;
}

const Engine::StepBreakdown& Engine::wall_clock() const { return state_->wall.last; }

void Engine::zero_grad() {
  // Inside an accumulation the gradients are the sum so far: only the sync micro-step clears.
  if (!sync_) return;
  if (state_->zero) state_->zero->zero_grad();
  state_->grads_pending = false;
}

double Engine::clip_grad_norm_(double max_norm, double norm_type) {
  if (!state_->zero) throw Error("engine.clip_grad_norm_: prepare the model and an optimizer first");
  if (!sync_) {
    throw Error("engine.clip_grad_norm_ on a micro-step that does not sync gradients: clip only when "
                "engine.sync_gradients() is true");
  }
  return state_->zero->clip_grad_norm(max_norm, norm_type, inv_scale());
}

void Engine::clip_grad_value_(double clip_value) {
  if (!state_->zero) throw Error("engine.clip_grad_value_: prepare the model and an optimizer first");
  if (!sync_) {
    throw Error("engine.clip_grad_value_ on a micro-step that does not sync gradients: clip only when "
                "engine.sync_gradients() is true");
  }
  state_->zero->clip_grad_value(clip_value, inv_scale());
}

void PreparedOptimizer::step() { engine_->step(); }
void PreparedOptimizer::zero_grad() { engine_->zero_grad(); }
bool PreparedOptimizer::step_was_skipped() const { return engine_->optimizer_step_was_skipped(); }

void PreparedScheduler::step() { engine_->scheduler_step(index_); }
double PreparedScheduler::last_lr() const { return engine_->scheduler_last_lr(index_); }

// A LibTorch scheduler steps once per optimizer step that ran; zeal schedules follow the
// engine's step count by themselves.
void Engine::scheduler_step(int index) {
  auto& s = state_->schedulers.at(index);
  if (s.seen_steps == optimizer_steps_) return;
  s.seen_steps = optimizer_steps_;
  if (s.torch) s.torch->step();
}

double Engine::scheduler_last_lr(int index) const {
  auto& s = state_->schedulers.at(index);
  if (s.zeal) return s.zeal->lr_at(std::max<int64_t>(optimizer_steps_ - 1, 0));
  if (state_->torch_optimizer) return state_->torch_optimizer->param_groups().at(0).options().get_lr();
  return state_->base_lrs.empty() ? 0.0 : state_->base_lrs[0];
}

// --- autocast ----------------------------------------------------------------------------------

Engine::AutocastGuard::AutocastGuard(at::DeviceType device, at::ScalarType dtype, bool enable) : device_(device) {
  if (!enable) return;
  active_ = true;
  prev_enabled_ = at::autocast::is_autocast_enabled(device);
  prev_dtype_ = at::autocast::get_autocast_dtype(device);
  at::autocast::set_autocast_enabled(device, true);
  at::autocast::set_autocast_dtype(device, dtype);
  at::autocast::increment_nesting();
}

Engine::AutocastGuard::AutocastGuard(AutocastGuard&& o) noexcept
    : device_(o.device_), active_(std::exchange(o.active_, false)), prev_enabled_(o.prev_enabled_),
      prev_dtype_(o.prev_dtype_) {}

Engine::AutocastGuard::~AutocastGuard() {
  if (!active_) return;
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(device_, prev_enabled_);
  at::autocast::set_autocast_dtype(device_, prev_dtype_);
}

Engine::AutocastGuard Engine::autocast() const {
  return AutocastGuard(device_.type(), compute_dtype_, compute_dtype_ != at::kFloat);
}

// --- collectives on results --------------------------------------------------------------------

namespace {

std::vector<int64_t> all_sizes(Communicator& c, int64_t mine, at::Device device) {
  at::Tensor out = at::empty({c.world_size()}, at::TensorOptions().dtype(at::kLong).device(device));
  at::Tensor in = at::full({1}, mine, out.options());
  c.all_gather(in, out).wait();
  out = out.cpu();
  return std::vector<int64_t>(out.data_ptr<int64_t>(), out.data_ptr<int64_t>() + out.numel());
}

}  // namespace

at::Tensor Engine::gather(const at::Tensor& t) {
  c10::NoGradGuard no_grad;
  at::Tensor x = (t.dim() == 0 ? t.reshape({1}) : t).to(device_).contiguous();
  const bool is_bool = x.scalar_type() == at::kBool;
  if (is_bool) x = x.to(at::kByte);
  Communicator& c = comm();
  const int world = c.world_size();
  at::Tensor out;
  if (world == 1) {
    out = x.clone();
  } else {
    const auto sizes = all_sizes(c, x.size(0), device_);
    const int64_t most = *std::max_element(sizes.begin(), sizes.end());
    auto shape = x.sizes().vec();
    shape[0] = most;
    at::Tensor mine = x;
    if (x.size(0) != most) {
      mine = at::zeros(shape, x.options());
      mine.narrow(0, 0, x.size(0)).copy_(x);
    }
    shape[0] = most * world;
    at::Tensor all = at::empty(shape, x.options());
    if (all.numel() > 0) c.all_gather(mine.view({-1}), all.view({-1})).wait();
    std::vector<at::Tensor> parts;
    for (int r = 0; r < world; ++r) parts.push_back(all.narrow(0, r * most, sizes[r]));
    out = std::all_of(sizes.begin(), sizes.end(), [&](int64_t s) { return s == most; }) ? all : at::cat(parts);
  }
  return is_bool ? out.to(at::kBool) : out;
}

at::Tensor Engine::gather_for_metrics(const at::Tensor& t) {
  at::Tensor all = gather(t);
  const auto& p = *state_->progress;
  if (p.active && p.end_of_dataloader && p.real_in_global_batch < p.global_batch_size &&
      all.size(0) == p.global_batch_size) {
    return all.narrow(0, 0, p.real_in_global_batch);
  }
  return all;
}

std::vector<at::Tensor> Engine::gather_for_metrics(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (auto& t : ts) out.push_back(gather_for_metrics(t));
  return out;
}

at::Tensor Engine::reduce(const at::Tensor& t, const std::string& op) {
  if (op != "sum" && op != "mean") throw Error(fmt::format("engine.reduce: op '{}' (sum or mean)", op));
  if (op == "mean" && !at::isFloatingType(t.scalar_type())) {
    throw Error(fmt::format("engine.reduce: the mean of a {} tensor; convert it to floating point first",
                            c10::toString(t.scalar_type())));
  }
  c10::NoGradGuard no_grad;
  at::Tensor x = t.to(device_).contiguous().clone();
  comm().all_reduce(x, op == "sum" ? ReduceOp::kSum : ReduceOp::kAvg).wait();
  return x;
}

at::Tensor Engine::pad_across_processes(const at::Tensor& t, int64_t dim, double pad_value, bool pad_first) {
  if (t.dim() == 0) return t;
  if (dim < 0) dim += t.dim();
  if (dim < 0 || dim >= t.dim()) throw Error(fmt::format("pad_across_processes: dim {} of a {}-d tensor", dim, t.dim()));
  const auto sizes = all_sizes(comm(), t.size(dim), device_);
  const int64_t most = *std::max_element(sizes.begin(), sizes.end());
  if (t.size(dim) == most) return t;
  auto shape = t.sizes().vec();
  shape[dim] = most;
  at::Tensor out = at::full(shape, pad_value, t.options());
  out.narrow(dim, pad_first ? most - t.size(dim) : 0, t.size(dim)).copy_(t);
  return out;
}

// --- processes ---------------------------------------------------------------------------------

bool Engine::is_main_process() const { return runtime_->is_main_process(); }
bool Engine::is_local_main_process() const { return runtime_->is_local_main_process(); }
int Engine::num_processes() const { return runtime_->world_size(); }
int Engine::process_index() const { return runtime_->rank(); }
int Engine::local_process_index() const { return runtime_->local_rank(); }
void Engine::wait_for_everyone() { comm().barrier().wait(); }

void Engine::synchronize() const {
  if (device_.is_cuda()) c10::impl::VirtualGuardImpl(device_.type()).synchronizeDevice(device_.index());
}

Engine::MainProcessFirst::MainProcessFirst(Engine* e) : e_(e) {
  if (!e_->is_main_process()) e_->wait_for_everyone();
}

Engine::MainProcessFirst::~MainProcessFirst() noexcept(false) {
  // While an exception unwinds, the barrier is left out: the other ranks then fail with a
  // collective timeout that names this rank instead of this rank hanging here.
  if (e_ && e_->is_main_process() && std::uncaught_exceptions() == 0) e_->wait_for_everyone();
}

Engine::Gathered Engine::gathered(std::vector<at::Tensor> params, int modifier_rank) {
  if (modifier_rank >= num_processes()) {
    throw Error(fmt::format("engine.gathered: modifier_rank {} is not a rank of this {}-process run", modifier_rank,
                            num_processes()));
  }
  std::vector<int> units;
  if (auto* s3 = dynamic_cast<zero::Stage3*>(state_->zero.get())) units = s3->gather_units(params);
  return Gathered(this, std::move(units), std::move(params), modifier_rank);
}

Engine::Gathered::~Gathered() noexcept(false) {
  if (!e_ || std::uncaught_exceptions() > 0) return;
  if (auto* s3 = dynamic_cast<zero::Stage3*>(e_->state_->zero.get())) {
    s3->release_units(units_, modifier_rank_);
    return;
  }
  if (modifier_rank_ < 0 || e_->num_processes() == 1) return;
  // Stages 0-2: parameters are whole everywhere; a modification is broadcast. (Trainable ones
  // would also need their master weights refreshed: not supported there.)
  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> ps = params_;
  if (ps.empty() && e_->state_->module) ps = e_->state_->module->parameters(true);
  for (auto& p : ps) {
    if (p.requires_grad() && e_->state_->zero) {
      throw Error("engine.gathered with a modifier_rank changes trainable parameters only in stage 3");
    }
    e_->comm().broadcast(p.detach(), modifier_rank_).wait();
  }
}

void Engine::reset_peak_memory() {
  if (auto* s3 = dynamic_cast<zero::Stage3*>(state_->zero.get())) s3->fetch().reset_peak();
}

Engine::FetchCounts Engine::fetch_counts() const {
  if (auto* s3 = dynamic_cast<zero::Stage3*>(state_->zero.get())) {
    return {s3->fetch().gathers(), s3->fetch().prefetched(), s3->fetch().retraced()};
  }
  return {};
}

int64_t Engine::optimizer_windows_read_ahead() const {
  return state_->zero ? state_->zero->optimizer_windows_read_ahead() : 0;
}

Engine::DiskReads Engine::param_disk_reads() const {
  if (!state_->param_swap) return {};
  return {state_->param_swap->read_ahead_count(), state_->param_swap->waited_reads()};
}

int Engine::zero_stage() const { return static_cast<int>(config_.zero.stage); }

MemoryReport Engine::memory() const {
  MemoryReport m;
  if (state_->zero) {
    const auto b = state_->zero->bytes();
    m.params = b.params;
    m.grads = b.grads;
    m.master = b.master;
    m.optimizer_states = b.optimizer;
    m.workspace = b.workspace;
  }
  if (state_->offload) {
    m.offload_host = state_->offload->bytes();
    m.offload_host_peak = state_->offload->peak();
  }
  if (state_->param_swap) {  // offload_param cpu on a GPU: the shards' host memory
    m.offload_host += state_->param_swap->host_bytes();
    m.offload_host_peak += state_->param_swap->host_peak();
  }
  if (state_->zero) {
    m.offload_disk = state_->zero->offload_disk_bytes();
  }
  if (state_->init_done) {
    m.construction_peak = state_->init_report.peak;
    m.construction_bound = state_->init_report.partitioned ? state_->init_report.bound()
                                                           : state_->init_report.model_bytes;
  }
  if (auto* s3 = dynamic_cast<zero::Stage3*>(state_->zero.get())) {
    m.frozen_params = s3->frozen_bytes();
    m.gathered = s3->fetch().gathered();
    m.gathered_peak = s3->fetch().peak();
    m.gathered_bound = s3->fetch().bound();
  }
  if (state_->module) {
    for (auto& p : state_->module->parameters(true)) {
      if (state_->zero && state_->zero->stage() == 3) break;  // every parameter lives in a unit's shards
      if (!state_->zero || !p.requires_grad()) {
        (state_->zero ? m.frozen_params : m.params) += p.nbytes();
      }
    }
    for (auto& b : state_->module->buffers(true)) m.buffers += b.nbytes();
  }
  if (runtime_) m.comm_buffers = runtime_->comm().buffer_bytes();
  const HostCacheStats hc = host_cache_stats();
  m.host_cache = hc.cached_bytes;
  m.host_cache_peak = hc.peak_cached_bytes;
  return m;
}

int64_t Engine::num_trainable_parameters() const { return state_->zero ? state_->zero->num_elements() : 0; }

}  // namespace zeal
