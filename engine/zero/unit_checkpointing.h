// The config's activation_checkpointing applied to a model's zeal::Sharded units (internal; the
// engine calls it at prepare, at every stage).
#pragma once

#include <c10/core/Device.h>

namespace torch::nn {
class Module;
}

namespace zeal {
struct ActivationCheckpointingConfig;

namespace zero {

// Every unit_interval-th Sharded unit (in the model's order) checkpoints when the config enables it;
// a unit the program set itself keeps its setting. A unit that holds other Sharded units cannot
// checkpoint (zeal::Error naming it). On the main process, says once what cannot take effect: no
// unit to checkpoint, or cpu_checkpointing on CPU ranks. Returns how many units checkpoint.
int apply_activation_checkpointing(torch::nn::Module& model, const ActivationCheckpointingConfig& config,
                                   const c10::Device& device, bool main_process);

}  // namespace zero
}  // namespace zeal
