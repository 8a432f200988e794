// What an export of a model needs from it (engine.save_model, zeal consolidate): the names (zeal::Sharded's
// "block" level left out, LoRA adapter tensors (null) left for the adapter file) and the adapters to
// merge.
#pragma once

#include <nlohmann/json.hpp>
#include <torch/nn/module.h>

namespace zeal::ckpt {

// {model name: export name} where they differ; null for an adapter tensor (the lora_A / lora_B of a
// layer that has both).
nlohmann::json export_names(const torch::nn::Module& model);

// The active LoRA adapters of the model's Linear layers, for an export that merges them:
// {base weight's model name: {"A": lora_A's weight name, "B": lora_B's, "scaling": lora_alpha / r
// (or / sqrt(r))}}. Layers whose adapters were merged or removed are not listed.
nlohmann::json lora_layers(const torch::nn::Module& model);

}  // namespace zeal::ckpt
