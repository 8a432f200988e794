// The adapters of adapted Linear modules, by module: what zeal's LinearImpl::forward looks up.
#pragma once

#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>

#include <atomic>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace zeal::peft::detail {

struct Slot {
  std::weak_ptr<torch::nn::Module> owner;  // the adapted Linear (checked, so a reused address never matches)
  std::shared_ptr<torch::nn::LinearImpl> A, B;
  std::shared_ptr<torch::nn::DropoutImpl> dropout;  // null when lora_dropout is 0
  double scaling = 1;
  bool active = true;
  // Forwards with gradients enabled that ran the adapters (shared by the slot's copies).
  std::shared_ptr<std::atomic<int64_t>> runs = std::make_shared<std::atomic<int64_t>>(0);
};

// How many active slots exist (0: every Linear takes LibTorch's path without a lookup).
int live_slots();
// The active slot of `linear`, copied into *out; false when it has none.
bool find_slot(const torch::nn::Module* linear, Slot* out);
// The slot of `linear` whether active or turned off for a disable_adapter() scope (a checkpoint
// saved inside one still records the adapters); false when it has none.
bool find_any_slot(const torch::nn::Module* linear, Slot* out);
void add_slot(const torch::nn::Module* linear, Slot slot);
void set_active(const torch::nn::Module* linear, bool active);
void remove_slot(const torch::nn::Module* linear);
bool has_slot(const torch::nn::Module* linear);
// The adapted Linear modules under `root` with active adapters, in the module tree's order: each
// path and whether its adapters ran in a forward with gradients enabled (a module that multiplies by
// the Linear's weight itself bypasses them).
std::vector<std::pair<std::string, bool>> adapter_runs(const torch::nn::Module& root);

}  // namespace zeal::peft::detail
