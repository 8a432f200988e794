// What a rank holds for the model states, and what DESIGN.md's stage table says it should hold.
#pragma once

#include <cstdint>
#include <string>

namespace zeal {

// Bytes held by this rank. model_states() is what the stage table counts.
struct MemoryReport {
  int64_t params = 0;            // trainable parameters in the compute dtype (with shard padding)
  int64_t grads = 0;             // gradients kept between micro-steps
  int64_t master = 0;            // fp32 master weights
  int64_t optimizer_states = 0;  // e.g. Adam's m and v
  int64_t frozen_params = 0;     // parameters with requires_grad = false
  int64_t buffers = 0;           // the model's buffers
  int64_t workspace = 0;         // step scratch and gradient staging (peak); stage 3: gathered units too
  int64_t comm_buffers = 0;      // host memory the communicator keeps between collectives (Gloo's ring scratch)
  // Freed large CPU blocks the host allocator keeps for reuse (engine/host_cache.h), now and at most.
  // None of it is part of a peak: the resident set grows only while the cache is empty.
  int64_t host_cache = 0, host_cache_peak = 0;
  // Stage 3: bytes of unit parameters gathered now (persistent units included), the most since
  // the last engine.reset_peak_memory(), and the bound the fetch coordinator keeps to:
  // stage3_max_live_parameters + the largest unit + the persistent units.
  int64_t gathered = 0, gathered_peak = 0, gathered_bound = 0;
  // engine.init: the most CPU memory construction held at once, and what it may hold (stage 3
  // partitioned: the largest Sharded member + the root's parameters and buffers + the slices kept).
  int64_t construction_peak = 0, construction_bound = 0;
  // Offload (offload_optimizer.device cpu): host memory the offload manager holds now (master
  // weights, optimizer state and the step's two buffers, already counted above where they are
  // model states) and the most it held.
  int64_t offload_host = 0, offload_host_peak = 0;
  // NVMe offload: bytes in the swap files (master, m, v and the gradients; offload_param's shards).
  int64_t offload_disk = 0;
  int64_t model_states() const { return params + grads + master + optimizer_states; }
  int64_t total() const { return model_states() + frozen_params + buffers + workspace; }
  // "params 1.2 MiB, grads …" on one line.
  std::string summary() const;
};

// The stage table for `psi` trainable parameters over `world` ranks, per rank:
//   stage 0: (P + G + M + O)·Ψ        stage 1: (P + G)·Ψ + (M + O)·Ψ/N
//   stage 2: P·Ψ + (G + M + O)·Ψ/N    stage 3: (P + G + M + O)·Ψ/N
// with P, G the bytes per parameter and gradient element (2 in bf16/fp16, 4 in fp32), M = 4 for
// the fp32 master and O the optimizer's state bytes (8 for Adam): K = M + O = 12 as in DESIGN.md.
// Parameters that compute in fp32 with a fused optimizer (Adam, AdamW) are their own master
// weights: M = 0.
struct StageModel {
  int stage = 0;
  int64_t psi = 0;
  int world = 1;
  int64_t param_bytes = 2, grad_bytes = 2, master_bytes = 4, optimizer_bytes = 8;
};
double expected_model_state_bytes(const StageModel& m);

// offload_optimizer.device nvme: the elements one optimizer window holds. sub_group_size sets it, as
// in DeepSpeed, up to kMaxNvmeSubGroup (67 M elements: about 4.3 GB of window buffers per rank with
// three sets); a larger one — DeepSpeed's default of 1e9 would ask for 64 GB per rank — gets
// kDefaultNvmeWindowElems (8 MiB per tensor). Larger windows cost host memory and make the disk's
// runs of requests longer (docs/offload.md has a measurement).
constexpr int64_t kDefaultNvmeWindowElems = int64_t{1} << 21;
constexpr int64_t kMaxNvmeSubGroup = int64_t{1} << 26;
constexpr int64_t nvme_window_elems(int64_t sub_group_size) {
  return sub_group_size > kMaxNvmeSubGroup ? kDefaultNvmeWindowElems : (sub_group_size < 1 ? 1 : sub_group_size);
}
// Host bytes per window element: per buffer set master, m, v, gradients (fp32) and the gradients'
// read buffer, times the sets, plus the result window (at most fp32).
constexpr int64_t nvme_window_bytes_per_elem(int buffer_sets) { return 20 * buffer_sets + 4; }

// 1536 → "1.5 KiB".
std::string format_bytes(double bytes);

}  // namespace zeal
