// Segments that carry their own Adam state (the NVMe windows, the offloaded state) must step exactly
// as the optimizer's own state at their offsets: one check, run on the CPU (optimizer_test) and on a
// GPU (cuda_engine_test).
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <vector>

#include "engine/optim/optimizer.h"

namespace zeal_test {

inline void expect_segment_state_matches_own_state(const at::Device& device) {
  const int64_t n = 1003, cut = 517;
  const zeal::optim::Hyper h{.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
  auto own = zeal::optim::make_fused_adamw(h);
  auto carried = zeal::optim::make_fused_adamw(h);
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  at::Tensor p_own = at::randn({n}, gen).to(device), p_carried = p_own.clone();
  const at::Tensor start = p_own.cpu().clone();
  at::Tensor m = at::zeros({n}, f32), v = at::zeros({n}, f32);
  for (int step = 0; step < 4; ++step) {
    const at::Tensor g = (at::randn({n}, gen) * (step + 1)).to(device).contiguous();
    std::vector<zeal::optim::FusedSegment> a(2), b(2);
    for (int k = 0; k < 2; ++k) {
      const int64_t off = k == 0 ? 0 : cut, len = k == 0 ? cut : n - cut;
      for (auto* s : {&a[k], &b[k]}) {
        s->offset = off;
        s->n = len;
        s->grad = g.data_ptr<float>() + off;
        s->grad_type = zeal::cpu::DType::kFp32;
      }
      a[k].master = p_own.data_ptr<float>() + off;
      b[k].master = p_carried.data_ptr<float>() + off;
      b[k].m = m.data_ptr<float>() + off;
      b[k].v = v.data_ptr<float>() + off;
    }
    own->fused_update(n, device, a, 1.0);
    carried->fused_update(n, device, b, 1.0);
  }
  EXPECT_TRUE(at::equal(p_own.cpu(), p_carried.cpu())) << device;
  EXPECT_GT(v.abs().min().item<double>(), 0.0) << "the carried second moments were not written";
  EXPECT_FALSE(at::equal(p_own.cpu(), start)) << "the parameters did not move";
}

}  // namespace zeal_test
