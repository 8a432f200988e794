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
  bool fits() const { return budget.bytes < 0 || predicted <= budget.bytes; }
};

// `shards`: the slices engine.init kept (null or empty when the model was built whole).
PrepareMemory predict_prepare_memory(torch::nn::Module& module, zero::InitShards* shards, const Config& config,
                                     int world, int local_world, bool on_gpu);

}  // namespace detail
}  // namespace zeal
