// The memory check at prepare (config key memory_check): this rank's predicted peak, from the
// prepared module and the config through engine/estimate.h's model, against the memory it may use
// (engine/memory_budget.h).
#pragma once

#include <cstdint>
#include <string>

#include "engine/memory_budget.h"

namespace torch::nn {
class Module;
}

namespace zeal {
struct Config;
namespace zero {
class InitShards;
}

namespace detail {

struct PrepareMemory {
  int64_t predicted = 0;   // host bytes at the peak, activations left out
  MemoryBudget budget;
  std::string parts;       // the largest parts of the prediction, for the message
  std::string remedies;    // the settings that would lower it, each with its predicted peak
  // Bytes the rank's swap files will take (offload to nvme): the parameters' (offload_param) and
  // the optimizer's (master weights, Adam states, gradients; offload_optimizer).
  int64_t disk_params = 0, disk_optimizer = 0;
  bool fits() const { return budget.bytes < 0 || predicted <= budget.bytes; }
};

// `shards`: the slices engine.init kept (null or empty when the model was built whole).
PrepareMemory predict_prepare_memory(torch::nn::Module& module, zero::InitShards* shards, const Config& config,
                                     int world, int local_world, bool on_gpu);

// The swap files of every rank on this machine against the free space of their file systems,
// before anything is written: "" when they fit, else the message (naming each folder and both sizes).
std::string check_swap_space(const PrepareMemory& pm, const Config& config, int local_world);

}  // namespace detail
}  // namespace zeal
