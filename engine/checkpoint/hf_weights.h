// The names an export of a model uses (engine.save_model, zeal consolidate): zeal::Sharded's "block"
// level left out, LoRA adapter tensors (null) left for the adapter file.
#pragma once

#include <nlohmann/json.hpp>
#include <torch/nn/module.h>

namespace zeal::ckpt {

// {model name: export name} where they differ; null for an adapter tensor (the lora_A / lora_B of a
// layer that has both).
nlohmann::json export_names(const torch::nn::Module& model);

}  // namespace zeal::ckpt
