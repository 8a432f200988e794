// Engine::State: what an Engine holds beyond its header (shared by engine.cpp and the checkpoint
// code). Internal: not installed for programs.
#pragma once

#include <chrono>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <utility>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include "engine/checkpoint/staging.h"
#include "engine/engine.h"
#include "engine/estimate.h"
#include "engine/optim/loss_scale.h"
#include "engine/runtime/device_choice.h"
#include "engine/zero/init.h"
#include "engine/zero/offload_state.h"
#include "engine/zero/zero_optimizer.h"
#include "offload/host_arena.h"
#include "offload/swap_dir.h"

namespace zeal {

// load_checkpoint_in_model's way from a module to the engine that prepared it (null: forget it).
void remember_prepared(const torch::nn::Module* module, Engine* engine);

struct Engine::State {
  // Objects a helper prepared and handed over (engine.keep_alive): first, so they go last.
  std::vector<std::shared_ptr<void>> kept;
  // hybrid_shard across machines: the sharding's communicator (declared before the sharding, so it
  // outlives it) and this rank's machine among the replicas of its shard (only machine 0's ranks
  // write the state to checkpoints).
  std::unique_ptr<Communicator> hybrid;
  int replica_index = 0;
  std::shared_ptr<torch::nn::Module> module;
  torch::optim::Optimizer* torch_optimizer = nullptr;
  std::unique_ptr<zero::Sharding> zero;
  // Schedules: LibTorch ones step the LibTorch optimizer's rates; zeal ones give the rate of
  // optimizer step t directly (the config's, or one the program prepared).
  struct Scheduler {
    torch::optim::LRScheduler* torch = nullptr;
    std::shared_ptr<optim::LrSchedule> zeal;
    int64_t seen_steps = 0;  // optimizer steps this scheduler has been stepped for
  };
  std::vector<Scheduler> schedulers;
  // The config's scheduler, one per parameter group (WarmupCosineLR scales each group's own rate).
  std::vector<std::shared_ptr<optim::LrSchedule>> config_schedules;
  std::vector<double> base_lrs;  // per group, when no LibTorch optimizer gives them
  std::unique_ptr<LossScaler> scaler;
  std::shared_ptr<data::Progress> progress = std::make_shared<data::Progress>();
  std::vector<std::shared_ptr<data::Cursor>> cursors;  // one per prepared loader, in prepare order
  std::vector<std::shared_ptr<Checkpointable>> custom;  // register_for_checkpointing, in order
  std::vector<std::unique_ptr<Tracker>> trackers;        // init_trackers, on the main process
  int64_t loader_batch_size = 0;
  bool backward_in_micro_step = false, grads_pending = false;
  int64_t micro_steps_begun = 0;  // every micro-step so far (collectives' descriptions, agreement points)
  // memory_check at prepare: this rank's predicted peak before activations and the memory it may
  // use (-1: not checked), for Engine::check_batch_memory.
  int64_t predicted_peak = -1, memory_budget = -1;
  std::string memory_budget_source;
  // The parameters the optimizer holds (by name), as prepare found them: saved from the optimizer
  // whatever their requires_grad is at the save (disable_adapter freezes the modules to save).
  std::set<std::string> trained_names;
  // check_batch_memory called before prepare: run when the model is prepared.
  std::optional<std::pair<estimate::ModelShape, estimate::RunShape>> batch_check;
  int64_t passes_seen = 0;        // backward passes the sharding had ended at the last step
  // engine.init: slices of partitioned parameters (until Stage3 takes them), what it measured.
  std::shared_ptr<zero::InitShards> init_shards;
  zero::InitReport init_report;
  bool init_done = false;
  const torch::nn::Module* init_module = nullptr;  // the model engine.init built (load_pretrained finds us by it)
  CudaBackend cuda_backend = CudaBackend::kNccl;  // which communicator carries CUDA tensors
  std::shared_ptr<offload::HostArena> offload;     // offload_optimizer.device cpu or nvme
  std::shared_ptr<zero::NvmeOffload> nvme;         // offload_optimizer.device nvme
  std::shared_ptr<zero::ParamSwap> param_swap;     // offload_param.device nvme
  std::shared_ptr<offload::IoEngine> io;           // either on nvme
  std::map<std::string, std::shared_ptr<offload::SwapDir>> swap_dirs;  // by nvme_path
  std::string run_id;
  // An asynchronous save_state's background work (its error on this rank, or empty), and the
  // removal of checkpoints that were replaced or fell beyond total_limit.
  std::future<std::string> saving;
  std::string saving_dir;
  // SaveStateOptions::keep_staging: the staging chunks kept for the next asynchronous save.
  std::shared_ptr<ckpt::StagingPool> staging_pool = std::make_shared<ckpt::StagingPool>();
  std::future<void> cleanup;
  // wall_clock_breakdown: milliseconds since the last report, the device synchronised at each edge.
  struct WallClock {
    std::chrono::steady_clock::time_point mark{}, backward_start{};
    bool marked = false;
    double forward = 0, backward = 0, step = 0;
    int64_t steps = 0;
    Engine::StepBreakdown last;  // the last window's means
  } wall;
};

}  // namespace zeal
