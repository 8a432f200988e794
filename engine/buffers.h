// Non-persistent buffers, as PyTorch's `register_buffer(name, tensor, persistent=False)` makes them
// (LibTorch's register_buffer has no such flag): a causal mask, rotary frequencies, position ids —
// values the model computes itself. Like every buffer they are broadcast from rank 0 (the config's
// broadcast_buffers), but save_state and load_state, save_model and `zeal consolidate` leave them
// out, and a weights load (load_pretrained, load_checkpoint_in_model) does not require them: a file
// that holds one in the model's shape loads it, one in another shape is skipped with a note. A
// persistent buffer (every buffer, unless marked) missing from a checkpoint or a weights file is an
// error naming it, as a missing parameter is.
//
//   inv_freq_ = zeal::register_buffer(*this, "inv_freq", freqs, /*persistent=*/false);
#pragma once

#include <string>
#include <unordered_set>

#include <ATen/Tensor.h>
#include <torch/nn/module.h>

namespace zeal {

// module.register_buffer(name, tensor), marked persistent or not; returns the registered tensor.
at::Tensor register_buffer(torch::nn::Module& module, const std::string& name, at::Tensor tensor, bool persistent);

// Marks `name`, a buffer of `module` itself (not of a submodule), persistent or not; a name the
// module has no buffer under is a zeal::Error naming the module's buffers. The mark belongs to the
// tensor registered under the name, which moves and casts keep (set_data, as the engine and
// Module::to change them); a copy of the module (clone) is unmarked.
void set_buffer_persistent(torch::nn::Module& module, const std::string& name, bool persistent);

// Whether `name`, a buffer of `module` itself, is persistent (the default).
bool buffer_persistent(const torch::nn::Module& module, const std::string& name);

// The names, as model.named_buffers() gives them, of the model's buffers marked non-persistent.
std::unordered_set<std::string> non_persistent_buffers(const torch::nn::Module& model);

}  // namespace zeal
