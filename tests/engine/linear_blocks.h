// A stack of kBlocks zeal::Sharded blocks, each tanh(Linear(kDim, kDim)): 1 Mi weights and 4 MiB of
// fp32 gradients per block, large enough for resident-set measurements to see one block. `reversed`
// runs them in reverse of their registration order.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <string>
#include <vector>

#include "engine/zero/sharded.h"

namespace zeal_test {

constexpr int64_t kBlockDim = 1024;
constexpr int kBlocks = 12;

struct LinearBlockImpl : torch::nn::Module {
  LinearBlockImpl() { fc = register_module("fc", torch::nn::Linear(kBlockDim, kBlockDim)); }
  at::Tensor forward(const at::Tensor& x) { return at::tanh(fc(x)); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(LinearBlock);

struct LinearStackImpl : torch::nn::Module {
  explicit LinearStackImpl(bool reversed = false) : reversed(reversed) {
    for (int i = 0; i < kBlocks; ++i) {
      blocks.push_back(register_module("b" + std::to_string(i), zeal::Sharded<LinearBlock>()));
    }
  }
  at::Tensor forward(at::Tensor x) {
    for (int i = 0; i < kBlocks; ++i) x = blocks[reversed ? kBlocks - 1 - i : i]->forward(x);
    return x;
  }
  bool reversed;
  std::vector<zeal::Sharded<LinearBlock>> blocks;
};
TORCH_MODULE(LinearStack);

}  // namespace zeal_test
