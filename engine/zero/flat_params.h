// Parameters laid end to end in one flat buffer: what every ZeRO stage does to its parameters
// (FlatGroup's buckets for stages 0-2, each stage-3 unit's trainable and frozen parts).
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace zeal {
class Communicator;
}

namespace zeal::zero {

// The parameters' current values in one float32 buffer of `padded` elements on `device` (parameter i
// at offsets[i], zeros elsewhere), with rank 0's values on every rank unless `same_everywhere`
// (they are known to be equal already: gathered from engine.init's slices). `device` defaults to
// the first parameter's; stage 3 passes the engine's, so a model still on the CPU reaches the GPU
// one unit at a time.
at::Tensor initial_flat_values(const std::vector<at::Tensor>& params, const std::vector<int64_t>& offsets,
                               int64_t padded, Communicator& comm, bool same_everywhere,
                               std::optional<at::Device> device = std::nullopt);

// Makes every params[i] a view of `flat` at offsets[i] with its own shape (set_data: the same
// tensor object, so autograd, optimizers and modules keep pointing at it) and clears its .grad.
void view_params_into(std::vector<at::Tensor>& params, const at::Tensor& flat, const std::vector<int64_t>& offsets);

}  // namespace zeal::zero
