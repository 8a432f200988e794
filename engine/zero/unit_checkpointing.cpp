#include "engine/zero/unit_checkpointing.h"
#include "engine/log.h"

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "engine/config/config.h"
#include "engine/error.h"
#include "engine/zero/sharded.h"

namespace zeal::zero {

int apply_activation_checkpointing(torch::nn::Module& model, const ActivationCheckpointingConfig& config,
                                   const c10::Device& device, bool main_process) {
  std::vector<std::pair<std::string, std::shared_ptr<ShardedBase>>> units;
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    if (auto s = std::dynamic_pointer_cast<ShardedBase>(item.value())) units.emplace_back(item.key(), s);
  }
  CheckpointOptions options;
  options.offload_inputs = config.cpu_checkpointing && device.is_cuda();
  options.synchronize = config.synchronize_checkpoint_boundary;
  auto holds_units = [](const ShardedBase& unit) {
    for (const auto& m : unit.modules(/*include_self=*/false))
      if (dynamic_cast<const ShardedBase*>(m.get())) return true;
    return false;
  };
  int on = 0;
  for (size_t i = 0; i < units.size(); ++i) {
    auto& [name, unit] = units[i];
    if (config.enabled && !unit->activation_checkpointing() && !holds_units(*unit) &&
        static_cast<int64_t>(i) % config.unit_interval == 0) {
      unit->set_activation_checkpointing(true, options);
    }
    if (!unit->activation_checkpointing()) continue;
    if (holds_units(*unit)) {
      throw Error(fmt::format("activation checkpointing of the Sharded unit '{}': it holds other Sharded units, "
                              "whose gathers would run inside its recomputation; checkpoint the inner units instead",
                              name.empty() ? "(the model)" : name));
    }
    ++on;
  }
  if (main_process && config.enabled) {
    if (!units.empty()) {
      log::info("activation checkpointing: {} of {} Sharded units recompute their forward in the backward{}", on,
                units.size(), config.unit_interval > 1 ? fmt::format(" (unit_interval {})", config.unit_interval) : "");
    }
    if (units.empty()) {
      log::warning("activation_checkpointing is on, but the model has no zeal::Sharded member to checkpoint (units named "
                   "by unit_names are not checkpointed): hold its blocks as zeal::Sharded<Block>, or call "
                   "zeal::checkpoint in its forward");
    }
    if (config.cpu_checkpointing && !device.is_cuda()) {
      log::info("activation_checkpointing.cpu_checkpointing: these ranks compute on the CPU, so the checkpoints "
                "already live in host memory; nothing moves");
    }
  }
  return on;
}

}  // namespace zeal::zero
