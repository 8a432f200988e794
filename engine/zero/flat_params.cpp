#include "engine/zero/flat_params.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "engine/comm/communicator.h"
#include "engine/error.h"

namespace zeal::zero {

at::Tensor initial_flat_values(const std::vector<at::Tensor>& params, const std::vector<int64_t>& offsets,
                               int64_t padded, Communicator& comm, bool same_everywhere,
                               std::optional<at::Device> target) {
  ZEAL_CHECK(params.size() == offsets.size()) << params.size() << " parameters, " << offsets.size() << " offsets";
  c10::NoGradGuard no_grad;
  const auto device = target ? *target : params.empty() ? at::Device(at::kCPU) : params[0].device();
  at::Tensor init = at::zeros({padded}, at::TensorOptions().dtype(at::kFloat).device(device));
  for (size_t i = 0; i < params.size(); ++i) {
    init.narrow(0, offsets[i], params[i].numel()).copy_(params[i].detach().reshape({-1}));
  }
  if (comm.world_size() > 1 && !same_everywhere && padded > 0) comm.broadcast(init, 0).wait();
  return init;
}

void view_params_into(std::vector<at::Tensor>& params, const at::Tensor& flat, const std::vector<int64_t>& offsets) {
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor& p = params[i];
    p.set_data(flat.narrow(0, offsets[i], p.numel()).view(p.sizes()));
    p.mutable_grad() = at::Tensor();
  }
}

}  // namespace zeal::zero
