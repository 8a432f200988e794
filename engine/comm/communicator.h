// One interface for the collectives ZeRO needs, with a Gloo backend (CPU tensors, through
// LibTorch's c10d) and an NCCL backend (CUDA tensors, through NCCL's C API).
//
// Every call is asynchronous and returns a Work; wait() blocks until it is done. Until then the
// call's tensors must stay as they are (inputs unchanged, outputs unread). Ranks must issue the
// same collectives in the same order. Each collective has a deadline (comm_timeout):
// when it passes, or a peer dies, wait() throws CommError naming the operation, its sequence
// number, its size and dtype, and the ranks that had not reached it.
//
// Uneven sizes: all_gather and reduce_scatter work on a flat buffer of `total` elements split
// into world_size shards of shard_size(total) elements; the last shards may be partly or
// entirely beyond `total` (those elements are padding: gathered from nowhere, reduced as 0).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/error.h"

namespace at {
class Tensor;
}

namespace zeal {

enum class ReduceOp { kSum, kAvg, kMax };
const char* to_string(ReduceOp op);

// A collective that failed: timed out, lost a peer, or disagreed with another rank's call.
class CommError : public Error {
 public:
  CommError(const std::string& what, std::string op, uint64_t seq, std::vector<int> missing)
      : Error(what), op_(std::move(op)), seq_(seq), missing_(std::move(missing)) {}
  const std::string& op() const { return op_; }
  uint64_t seq() const { return seq_; }
  const std::vector<int>& missing_ranks() const { return missing_; }

 private:
  std::string op_;
  uint64_t seq_;
  std::vector<int> missing_;
};

// The handle of an issued collective.
class Work {
 public:
  struct Impl {
    virtual ~Impl() = default;
    virtual void wait() = 0;
    virtual bool done() = 0;
  };
  Work() = default;
  explicit Work(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  // Blocks until the collective is complete; throws CommError on timeout or failure. Waiting
  // twice is allowed; a default-constructed Work is complete.
  void wait() {
    if (impl_) impl_->wait();
  }
  bool done() const { return !impl_ || impl_->done(); }

 private:
  std::shared_ptr<Impl> impl_;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual std::string backend() const = 0;  // "gloo" or "nccl"

  // shard: shard_size(output.numel()) elements; output: the flat buffer, every rank's shard in
  // rank order. Both contiguous, same dtype and device. The shard may be this rank's own slice
  // of the output (in place).
  virtual Work all_gather(const at::Tensor& shard, const at::Tensor& output) = 0;
  // input: the flat buffer; shard receives this rank's shard_size(input.numel()) elements of
  // the element-wise reduction over ranks (kSum or kAvg). The shard may be this rank's own slice
  // of the input (in place) when the input's size is a multiple of the world size.
  virtual Work reduce_scatter(const at::Tensor& input, const at::Tensor& shard, ReduceOp op) = 0;
  // In place: every rank ends with the reduction (kSum, kAvg or kMax).
  virtual Work all_reduce(const at::Tensor& tensor, ReduceOp op) = 0;
  // In place: every rank ends with root's values.
  virtual Work broadcast(const at::Tensor& tensor, int root) = 0;
  virtual Work barrier() = 0;

  // Number of collectives this communicator has issued (the sequence number of the last one).
  virtual uint64_t sequence() const = 0;

  // The optimizer step and micro-step this rank is in: part of every collective's description, so
  // hang reports and ZEAL_DEBUG_COLLECTIVES name them, and a rank one micro-step ahead is caught.
  virtual void set_progress(int64_t step, int64_t micro_step) = 0;
  // An agreement point: every rank calls it at the same point of its program (`where`, e.g. "end of
  // backward"). Through the rendezvous store (not a collective, so it cannot pair with another
  // one), it checks that every rank reached the same point having issued the same collectives since
  // the last agreement point; throws CommError naming both sides of the first difference, or the
  // ranks that did not arrive within the timeout with what each was doing.
  virtual void check_agreement(const std::string& where) = 0;
  // The deadline of every collective and agreement point from now on, in seconds.
  virtual void set_timeout(double seconds) = 0;
  // How many ranks a reduce_scatter reduces over: the world size, or more when the shards are
  // replicated across machines (hybrid sharding). A sum of parts divided first divides by this.
  virtual int reduction_world() const { return world_size(); }
  // Host memory this communicator keeps between collectives (Gloo's ring scratch), in bytes.
  virtual int64_t buffer_bytes() const { return 0; }

  // The label of the collectives this communicator issues now (see CollectiveLabel).
  const std::string& label() const { return label_; }
  void set_label(std::string label) { label_ = std::move(label); }

  int64_t shard_size(int64_t total) const { return (total + world_size() - 1) / world_size(); }

 private:
  std::string label_;
};

// While it lives, the collectives `comm` issues are described as `op[label]` — for stage 3
// `all_gather[blocks.3, pre_backward]` — in hang reports, ZEAL_DEBUG_COLLECTIVES and agreement
// checks. Labels nest; the previous one comes back.
class CollectiveLabel {
 public:
  CollectiveLabel(Communicator& comm, std::string label) : comm_(comm), prev_(comm.label()) {
    comm_.set_label(std::move(label));
  }
  ~CollectiveLabel() { comm_.set_label(std::move(prev_)); }
  CollectiveLabel(const CollectiveLabel&) = delete;
  CollectiveLabel& operator=(const CollectiveLabel&) = delete;

 private:
  Communicator& comm_;
  std::string prev_;
};

}  // namespace zeal
