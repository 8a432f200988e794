// ShardStep: the optimizer step over what one rank owns, shared by every ZeRO stage.
//
// A rank owns an fp32 master partition and, laid against it in pieces, its reduced gradients (in
// the compute dtype, wherever the stage keeps them: a bucket's owned region, a gradient partition,
// a stage-3 unit's shard) and the compute-precision parameters the step must write (a bucket's
// owned region of the parameter buffer, a unit's shard). ShardStep computes the gradient
// statistics where the gradients lie, defers clipping into one multiplier, and runs the update:
// with a fused optimizer one pass per piece reads the gradient, updates master and state and
// writes the compute copy; otherwise the gradients are made into one fp32 tensor first.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "engine/optim/optimizer.h"
#include "offload/host_arena.h"
#include "offload/swap_dir.h"
#include "offload/write_behind.h"
#include "kernels/cpu/adam.h"

namespace zeal::zero {

// The kernels' name for a tensor dtype (fp32, bf16, fp16); throws zeal::Error for others.
cpu::DType kernel_dtype(at::ScalarType t);
// Sum of squares and largest magnitude of one tensor: the SIMD kernel for contiguous CPU tensors,
// tensor ops elsewhere.
cpu::GradStats stats_of(const at::Tensor& t);
// The same folded onto `acc`: stats_from(b, stats_from(a, {})) == stats_of(a ++ b) bit for bit when
// a's size is a multiple of kStatsBlock (the gradient swap takes pieces a window at a time).
cpu::GradStats stats_from(const at::Tensor& t, cpu::GradStats acc);
inline constexpr int64_t kStatsBlock = 1024;

class ShardStep;

// Checkpoints: a piece of a named parameter a rank holds (Sharding::state_ranges).
struct StateRange {
  std::string name;              // the parameter's name in the model
  std::vector<int64_t> shape;    // the whole parameter's
  int64_t begin = 0, count = 0;  // elements of the flattened parameter
  at::Tensor values;             // this rank's compute-dtype (frozen: own dtype) values of them, a view
  ShardStep* step = nullptr;     // trainable: where its master and optimizer state live
  int64_t index = 0;             // ... at this index of that step's partition
  int group = -1;                // its values are present only while this group is open (stage 3:
                                 // the unit's index), or always (-1); see Sharding::open_group
};

class ShardStep {
 public:
  struct Piece {
    int64_t offset = 0;  // in the master partition
    at::Tensor grad;     // reduced gradients, compute dtype, contiguous
    at::Tensor out;      // where the updated values go in compute precision (same numel)
  };

  ShardStep() = default;
  // `master`: the fp32 master partition, or undefined when the pieces' `out` are fp32 and the
  // optimizer is fused (can_alias): the parameters are then their own master weights, updated in
  // place, and no copy is kept (4 bytes per owned element less). `grad32_alias`: a tensor laid out
  // like the partition that already holds the gradients in fp32 (so no copy is needed to make them
  // fp32), or undefined.
  ShardStep(at::Tensor master, std::unique_ptr<optim::Optimizer> optimizer, std::vector<Piece> pieces,
            at::Tensor grad32_alias = {});
  // Waits for a write-back still in flight (offload_to_nvme).
  ~ShardStep();
  // With the state on NVMe, apply() returns while the last window is still being written (it
  // overlaps what comes next); this waits for it. If that write failed, this and every later call
  // throw zeal::Error naming the failure (the state on disk is a step behind). The next apply and
  // every access to the state call it first.
  void finish_writes();
  ShardStep(ShardStep&&) = default;
  ShardStep& operator=(ShardStep&&) = default;
  // Whether parameters computing in `compute` on `device` can be their own master weights.
  static bool can_alias(const optim::Optimizer& optimizer, at::ScalarType compute, at::Device device);

  // Statistics of the unscaled gradients (× inv_scale and any deferred clip factor).
  cpu::GradStats stats(double inv_scale);
  // The same two numbers as one-element double tensors on `where` (the gradients' device),
  // computed where the gradients are without the host waiting (CUDA: the multi-tensor
  // sum-of-squares kernel on the current stream), so a step on a GPU synchronises once, for the
  // global norm, whatever the number of pieces. An empty partition gives zeros on `where`.
  at::Tensor sumsq_on_device(double inv_scale, at::Device where);
  at::Tensor amax_on_device(double inv_scale, at::Device where);
  // ZeRO-Offload: the master (which must be a separate tensor), the optimizer state and two step
  // buffers (fp32 gradients, compute-precision results) move into the arena's host memory. From then
  // on apply() streams the gradients into the host buffer, updates on the CPU and streams the results
  // back into every piece's `out`. A partition that computes on the CPU is in host memory already:
  // only its optimizer state (and a separate master, if any: fp32 parameters with a fused optimizer
  // stay their own) moves into the arena, no step buffers are made, and the step is the one without
  // offload. Bit-identical to the step without offload. Call once, before the first step.
  void offload_to(std::shared_ptr<offload::HostArena> arena);
  bool offloaded() const { return arena_ != nullptr; }
  // NVMe offload (instead of offload_to): the master (a separate tensor) and the optimizer state
  // (fused Adam) move into `file`, [master | m | v], and the step runs window by window of
  // `window` elements (sub_group_size) through `buffer_sets` sets of master, m and v windows
  // (offload_optimizer.buffer_count; more than 3 add nothing): with 3, while window i is updated,
  // window i−1 is written back and window i+1 read, each on its own thread and I/O engine; with 2,
  // the read of i+1 overlaps the update of i and the write-back follows it; with 1, read, update
  // and write take turns. The sets are io_uring registered buffers where the kernel allows. Host
  // memory: the sets plus the gradient and result windows, in the arena. Bit-identical to the
  // step without offload.
  void offload_to_nvme(std::shared_ptr<offload::HostArena> arena, std::shared_ptr<offload::SwapFile> file,
                       int64_t window, int buffer_sets = 3);
  // A `master` that is a meta tensor (sizes only) says the master weights are already in `file`'s
  // first region, written there as they were made (never whole in host memory): only m and v are
  // initialised.
  int buffer_sets() const { return sets_; }
  bool on_nvme() const { return swap_ != nullptr; }
  // apply() calls enter(k) before it touches piece k's `out` and leave(k) once the last of its
  // results is there, so the owner can bring the pieces' `out` in from disk and send them back a
  // few at a time (stage 3 with offload_param nvme: one unit's shards): with the state on NVMe as
  // its windows reach and pass the piece, otherwise piece after piece (a fused step then updates
  // one piece at a time). Without hooks every `out` must be present for the whole step.
  struct PieceHooks {
    std::function<void(size_t)> enter, leave;
  };
  void set_piece_hooks(PieceHooks hooks) { hooks_ = std::move(hooks); }
  // NVMe offload: starts reading the master, m and v of the step's first windows (as many as there
  // are buffer sets) into their sets on a thread of its own, so that the next apply finds them there
  // instead of waiting for the disk after the backward (they do not depend on the gradients; the
  // engine calls it as the backward that completes the gradients begins). Costs no memory: the sets
  // are there either way. Nothing is started while the previous step's last write-back is still in
  // flight, or with the state elsewhere. Every access to the state waits for the reads first; one that
  // writes the state (a load, a changed master) drops what they brought. Bit-identical steps either way.
  void prefetch_state();
  // Leading windows whose master, m and v the next apply takes from the sets (the reads finished).
  int prefetched_windows();
  // Windows the steps so far took from the sets instead of the disk (prefetch_state).
  int64_t windows_read_ahead() const { return windows_read_ahead_; }
  // The I/O engine of the write-back and of prefetch_state's reads (after offload_to_nvme; a failed
  // prefetch replaces it). Tests inject faults into it.
  offload::IoEngine& write_engine() { return *writer_; }
  // Gradient swap (after offload_to_nvme; DeepSpeed's ZeRO-Infinity swaps gradients out with the
  // optimizer state): the reduced gradients leave host memory for `file`, each piece in a region of
  // its own (aligned for O_DIRECT), in the accumulation dtype. The pieces' `grad` become meta tensors
  // (sizes and dtype, no storage). accumulate_grad adds one micro-step's reduced gradients of a piece
  // into the file (the first since clear_grads writes them) a window at a time and keeps their
  // statistics; the step reads them back window by window beside master, m and v. The writes leave
  // the caller's thread (the backward goes on while they run, on a thread and I/O engine of their
  // own, through the buffer sets' gradient bounce buffers); everything that reads the gradients
  // (statistics, the step, read_grad, clear_grads) waits for them first, and a failed write fails
  // that call and every later one, naming the file. Bit-identical updates; clip_grad_value (which
  // needs the fp32 gradients whole) is refused.
  void swap_gradients(std::shared_ptr<offload::SwapFile> file);
  bool gradients_swapped() const { return gswap_ != nullptr; }
  void accumulate_grad(size_t k, const at::Tensor& g);
  // Swapped: every piece's gradient is zero again (nothing is written until the next accumulate_grad).
  void clear_grads();
  // Piece k's gradients as a host tensor in the accumulation dtype (zeros if none came).
  at::Tensor read_grad(size_t k);
  // Bytes of this partition's state on disk (NVMe offload), else 0; the swapped gradients included.
  int64_t disk_bytes() const { return (swap_ ? 3 * region_bytes_ : 0) + gswap_bytes_; }
  // Multiplies the gradients by c: deferred into the update's multiplier when possible.
  void scale(double c);
  // The unscaled gradients as one fp32 tensor laid out like the master, to modify in place; made
  // on first use, valid until reset().
  const at::Tensor& fp32_grads(double inv_scale);
  // One optimizer step at lr; writes every piece's `out`.
  void apply(double lr, double inv_scale);
  // Forgets the fp32 gradients and the deferred factor (the gradients were cleared or are new).
  void reset();
  // Piece k's master weights take its compute-precision values (they were changed from outside:
  // engine.gathered with a modifier).
  void refresh_master(size_t k);
  size_t num_pieces() const { return pieces_.size(); }
  const Piece& piece(size_t k) const { return pieces_[k]; }
  int64_t total() const { return total_; }

  // Checkpoints, between steps: the optimizer state's names ("exp_avg" and "exp_avg_sq" for Adam,
  // "momentum_buffer" for SGD with momentum, none for plain SGD), and copies of elements
  // [index, index + n) of the master weights ("master") or of a state tensor out of (read) or into
  // (write) `buf`, fp32 host memory, wherever they live: the device, the host arena, the parameters
  // themselves (aliased), or the swap file (window by window, as the step reads and writes them).
  std::vector<std::string> state_names() const;
  // Where elements [index, index + n) of "master" or a state tensor lie as contiguous fp32 in host
  // memory, when they do (a save then copies them once, straight from there); else null (on a
  // device, on NVMe, or across pieces of aliased parameters).
  const float* host_state(const std::string& what, int64_t index, int64_t n) const;
  // Whether the optimizer state (not the master) still holds the zeros it was made with: no step and
  // no write_state of it since it was made (or since zero_state). A load may then write it in place
  // while it checks the checkpoint, and zero it again if the load fails.
  bool state_zero() const { return !state_touched_; }
  // The optimizer state back to its zeros (a failed load that wrote it in place, see state_zero).
  void zero_state();
  void read_state(const std::string& what, int64_t index, int64_t n, float* buf) { state_io(what, index, n, buf, false); }
  void write_state(const std::string& what, int64_t index, int64_t n, const float* buf) {
    state_io(what, index, n, const_cast<float*>(buf), true);
  }

  // The separate master partition (undefined when the parameters are their own master) and its bytes.
  const at::Tensor& master() const { return master_; }
  int64_t master_bytes() const { return master_.defined() ? master_.nbytes() : 0; }
  bool aliased() const { return !master_.defined() && !swap_; }
  optim::Optimizer& optimizer() { return *optimizer_; }
  const optim::Optimizer& optimizer() const { return *optimizer_; }
  bool fused() const { return fused_; }
  // Bytes of the fp32 gradient copy when one was made (not an alias).
  int64_t workspace_bytes() const;

 private:
  // The gradients the statistics read now and the factor still to apply to them.
  std::vector<at::Tensor> current_grads(double inv_scale, double* scale) const;

  void state_io(const std::string& what, int64_t index, int64_t n, float* buf, bool write);
  // f(piece) for every piece with elements, between the hooks' enter and leave.
  void each_out(const std::function<void(const Piece&)>& f);
  void apply_offloaded(double lr, double inv_scale);
  void apply_nvme(double inv_scale);

  // Gradient swap: piece k at byte gswap_off_[k] of gswap_; whether it holds this step's gradients and
  // their statistics; one bounce buffer per buffer set (a window of fp32 plus alignment on each side)
  // and one fp32 gradient window per set.
  void read_grad_window(int64_t a, int64_t len, int k);
  // Waits for the gradient writes in flight; a failed one is rethrown (also every time after).
  void finish_grad_writes();
  // The gradient swap's writes, through gbounce_: declared before it, so that a move assignment
  // replaces (and so drains) the writer before the buffers it writes from; ~ShardStep resets it first.
  std::unique_ptr<offload::WriteBehind> gwriter_;
  std::shared_ptr<offload::SwapFile> gswap_;
  std::vector<int64_t> gswap_off_;
  std::vector<char> gswap_written_;
  std::vector<cpu::GradStats> gswap_stats_;
  int64_t gswap_bytes_ = 0;
  at::Tensor gbounce_[3], win_grad_[3];
  int next_gslot_ = 0;  // the bounce buffer the next gradient chunk takes

  // The last window's write-back, left in flight when apply returns so that it overlaps the next
  // forward and backward; waited for (its error rethrown) before anything touches the swap again.
  // Declared before the engine and buffers it uses: a move assignment replaces it (and so waits for
  // the old write) before it replaces them.
  std::future<void> pending_write_;
  std::string write_error_;  // set when that write failed: the state on disk is stale from then on
  // prefetch_state's reads (through writer_, which nothing else uses meanwhile): the number of
  // leading windows brought in, -1 when a read failed (apply then reads them itself and says why; the writes get a new engine).
  std::future<int> prefetch_;
  int prefetched_ = 0;       // leading windows valid in their sets for the next apply
  int64_t windows_read_ahead_ = 0;
  void finish_prefetch();
  // The write-back's own engine, with the buffer sets registered.
  void make_writer();
  PieceHooks hooks_;
  std::shared_ptr<offload::SwapFile> swap_;  // NVMe offload
  int64_t window_ = 0, region_bytes_ = 0;
  // Up to three sets: one updated while the previous is written back and the next read.
  int sets_ = 3;
  at::Tensor win_master_[3], win_m_[3], win_v_[3];
  std::unique_ptr<offload::IoEngine> writer_;  // the write-back's own engine (the file's reads)

  std::shared_ptr<offload::HostArena> arena_;
  bool local_ = false;  // offloaded to the host memory it computes in (a CPU partition): no step buffers
  at::Tensor host_grad_, host_out_;  // offload: the step's buffers in the arena
  at::Tensor master_;
  int64_t total_ = 0;                // elements of the partition (the optimizer state's size)
  at::TensorOptions state_options_;  // fp32 on the partition's device
  std::unique_ptr<optim::Optimizer> optimizer_;
  std::vector<Piece> pieces_;
  at::Tensor grad32_, alias_;
  bool grad32_ready_ = false;
  bool state_touched_ = false;  // see state_zero
  double pending_scale_ = 1.0;
  bool fused_ = false;
};

}  // namespace zeal::zero
