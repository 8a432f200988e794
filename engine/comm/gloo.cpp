// The Gloo backend. ProcessGroupGloo does the transport; zeal adds uneven sizes, averaging,
// deadlines with a hang report, and its own ring reduce-scatter: c10d's Gloo reduce_scatter is
// an all-reduce of the whole buffer followed by a copy (twice the bytes of a ring, and it
// ignores the reduce op).
#define USE_C10D_GLOO 1
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <ATen/ATen.h>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <future>

#include <fmt/format.h>

#include "engine/comm/backends.h"
#include "engine/comm/monitor.h"

namespace zeal {

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
  }
  return "?";
}

namespace detail {
namespace {

// The address the other ranks reach this one at: the interface GLOO_SOCKET_IFNAME names, or
// the local address of the route to the master (a UDP connect sends nothing).
std::shared_ptr<::gloo::transport::Device> make_device(const std::string& master_addr) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  std::string local = "127.0.0.1";
  if (getaddrinfo(master_addr.c_str(), "9", &hints, &res) == 0 && res) {
    const int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
      sockaddr_in me{};
      socklen_t len = sizeof me;
      char buf[INET_ADDRSTRLEN] = {0};
      if (getsockname(fd, reinterpret_cast<sockaddr*>(&me), &len) == 0 &&
          inet_ntop(AF_INET, &me.sin_addr, buf, sizeof buf)) {
        local = buf;
      }
    }
    if (fd >= 0) close(fd);
    freeaddrinfo(res);
  }
  return c10d::ProcessGroupGloo::createDeviceForHostname(local);
}

constexpr int64_t kSegmentBytes = 4 << 20;
constexpr int64_t kWindowSegments = 2;  // segments through the ring at once in a reduce-scatter

std::string dtype_of(const at::Tensor& t) { return dtype_name(c10::toString(t.scalar_type())); }

bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  const auto* a0 = static_cast<const char*>(a.data_ptr());
  const auto* b0 = static_cast<const char*>(b.data_ptr());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

void divide(const at::Tensor& t, int world) {
  if (at::isIntegralType(t.scalar_type(), /*includeBool=*/false)) {
    t.div_(world, "trunc");
  } else {
    t.div_(world);
  }
}

std::string explain(const std::string& what, std::chrono::milliseconds timeout) {
  const std::string first = what.substr(0, what.find('\n'));
  if (what.find("imed out") != std::string::npos) {
    return fmt::format("timed out after {:g} s (comm_timeout) [{}]", timeout.count() / 1000.0, first);
  }
  if (what.find("losed by peer") != std::string::npos || what.find("reset by peer") != std::string::npos ||
      what.find("Broken pipe") != std::string::npos) {
    return fmt::format("a peer closed its connection: it exited or crashed [{}]", first);
  }
  return first;
}

// A collective in flight: c10d works to wait for, then a step that finishes it on this thread.
class GlooWork final : public Work::Impl {
 public:
  GlooWork(Monitor* monitor, OpInfo info) : monitor_(monitor), info_(std::move(info)) {}

  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::function<void()> finish;
  std::shared_future<void> future;  // for work run on the communicator's ring thread

  void wait() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) {
      if (error_) std::rethrow_exception(error_);
      return;
    }
    try {
      for (auto& w : works) {
        if (!w->wait(monitor_->timeout())) throw std::runtime_error("Timed out");
      }
      if (future.valid()) {
        if (future.wait_for(monitor_->timeout() + std::chrono::seconds(5)) != std::future_status::ready) {
          throw std::runtime_error("Timed out waiting for the ring");
        }
        future.get();
      }
      if (finish) finish();
      done_ = true;
    } catch (const CommError&) {
      done_ = true;
      error_ = std::current_exception();
      throw;
    } catch (const std::exception& e) {
      done_ = true;
      try {
        monitor_->fail(info_, explain(e.what(), monitor_->timeout()));
      } catch (...) {
        error_ = std::current_exception();
      }
      std::rethrow_exception(error_);
    }
  }

  bool done() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return true;
    for (auto& w : works) {
      if (!w->isCompleted()) return false;
    }
    return !future.valid() || future.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }

 private:
  Monitor* monitor_;
  OpInfo info_;
  std::mutex mu_;
  bool done_ = false;
  std::exception_ptr error_;
};

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world, std::chrono::milliseconds timeout,
                   bool debug, const std::string& master_addr)
      : rank_(rank), world_(world), monitor_(store, "zeal/comm/", rank, world, timeout, debug) {
    auto options = c10d::ProcessGroupGloo::Options::create_default(timeout);
    options->threads = 2;
    options->devices = {make_device(master_addr)};
    pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(c10::make_intrusive<c10d::PrefixStore>("zeal/gloo", store), rank,
                                                      world, options);
    if (world > 1) {
      // No rank goes on before every rank's mesh is up: a rank that ends at once (an error right
      // after start-up) would otherwise close sockets a slower peer is still handshaking on, and
      // that peer would report a Gloo connection error instead of the rank that failed.
      auto connected = c10::make_intrusive<c10d::PrefixStore>("zeal/gloo/connected", store);
      connected->set(std::to_string(rank), std::vector<uint8_t>{1});
      std::vector<std::string> everyone;
      for (int r = 0; r < world; ++r) everyone.push_back(std::to_string(r));
      connected->wait(everyone, timeout);
    }
    ring_thread_ = std::thread([this] { ring_loop(); });
  }

  ~GlooCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(ring_mu_);
      ring_stop_ = true;
    }
    ring_cv_.notify_all();
    ring_thread_.join();
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string backend() const override { return "gloo"; }
  uint64_t sequence() const override { return monitor_.sequence(); }
  void set_progress(int64_t step, int64_t micro_step) override { monitor_.set_progress(step, micro_step); }
  int64_t buffer_bytes() const override { return scratch_bytes_.load(); }
  void check_agreement(const std::string& where) override { monitor_.check_agreement(where); }
  void set_timeout(double seconds) override {
    monitor_.set_timeout(std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0)));
  }

  Work all_gather(const at::Tensor& shard, const at::Tensor& output) override {
    const int64_t s = check_shard("all_gather", shard, output, "output");
    auto work = start("all_gather", output.numel(), dtype_of(output));
    at::Tensor out = output.view({-1});
    at::Tensor in = shard.view({-1});
    at::Tensor target = s * world_ == output.numel() ? out : at::empty({s * world_}, output.options());
    // In place (the shard is this rank's slice of the output, as ZeRO's flat buffers do it): Gloo
    // copies the input into the output first, so give it a copy rather than the same memory.
    if (overlaps(in, target)) in = in.clone();
    work->works.push_back(pg_->_allgather_base(target, in));
    if (!target.is_same(out)) work->finish = [target, out] { out.copy_(target.narrow(0, 0, out.numel())); };
    return Work(work);
  }

  Work reduce_scatter(const at::Tensor& input, const at::Tensor& shard, ReduceOp op) override {
    const int64_t s = check_shard("reduce_scatter", shard, input, "input");
    auto work = start(fmt::format("reduce_scatter({})", to_string(op)), input.numel(), dtype_of(input));
    const uint64_t seq = monitor_.sequence();
    at::Tensor in = input.view({-1});
    at::Tensor out = shard.view({-1});
    auto done = std::make_shared<std::promise<void>>();
    work->future = done->get_future().share();
    {
      std::lock_guard<std::mutex> lock(ring_mu_);
      ring_queue_.push_back({[this, in, out, s, seq, op] {
                               ring_reduce_scatter(in, out, s, seq, op);
                               if (op == ReduceOp::kAvg) divide(out, world_);
                             },
                             std::move(done)});
    }
    ring_cv_.notify_one();
    return Work(work);
  }

  Work all_reduce(const at::Tensor& tensor, ReduceOp op) override {
    check(tensor, "all_reduce", "tensor");
    auto work = start(fmt::format("all_reduce({})", to_string(op)), tensor.numel(), dtype_of(tensor));
    c10d::AllreduceOptions opts;
    opts.reduceOp = op == ReduceOp::kMax ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
    opts.timeout = monitor_.timeout();
    std::vector<at::Tensor> ts{tensor};
    work->works.push_back(pg_->allreduce(ts, opts));
    if (op == ReduceOp::kAvg) work->finish = [tensor, w = world_] { divide(tensor, w); };
    return Work(work);
  }

  Work broadcast(const at::Tensor& tensor, int root) override {
    check(tensor, "broadcast", "tensor");
    if (root < 0 || root >= world_) throw Error(fmt::format("broadcast: root {} is not a rank of {}", root, world_));
    auto work = start(fmt::format("broadcast(root {})", root), tensor.numel(), dtype_of(tensor));
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    opts.timeout = monitor_.timeout();
    std::vector<at::Tensor> ts{tensor};
    work->works.push_back(pg_->broadcast(ts, opts));
    return Work(work);
  }

  Work barrier() override {
    auto work = start("barrier", 0, "none");
    c10d::BarrierOptions opts;
    opts.timeout = monitor_.timeout();
    work->works.push_back(pg_->barrier(opts));
    return Work(work);
  }

 private:
  std::shared_ptr<GlooWork> start(std::string name, int64_t numel, std::string dtype) {
    return std::make_shared<GlooWork>(&monitor_, monitor_.begin(std::move(name), label(), numel, std::move(dtype)));
  }

  // Both tensors usable, and the shard the size and dtype that `flat` over world_ ranks needs;
  // returns that size.
  int64_t check_shard(const char* op, const at::Tensor& shard, const at::Tensor& flat, const char* flat_name) const {
    check(shard, op, "shard");
    check(flat, op, flat_name);
    const int64_t s = shard_size(flat.numel());
    if (shard.numel() != s || shard.scalar_type() != flat.scalar_type()) {
      throw Error(fmt::format("{}: the shard has {} {} elements; an {} of {} elements over {} ranks needs shards of {} {}",
                              op, shard.numel(), dtype_of(shard), flat_name, flat.numel(), world_, s, dtype_of(flat)));
    }
    return s;
  }

  void check(const at::Tensor& t, const char* op, const char* what) const {
    if (!t.defined()) throw Error(fmt::format("{}: the {} tensor is undefined", op, what));
    if (!t.device().is_cpu()) {
      throw Error(fmt::format("{}: the {} tensor is on {}; the gloo communicator takes CPU tensors (use the NCCL "
                              "communicator for CUDA tensors)",
                              op, what, t.device().str()));
    }
    if (!t.is_contiguous()) throw Error(fmt::format("{}: the {} tensor must be contiguous", op, what));
  }

  // Ring reduce-scatter of `in` (world_ chunks of s elements, the tail zero-padded) into `out`:
  // in step k rank r sends its running sum of chunk r-k-1 to r+1 and receives r-1's running sum of
  // chunk r-k-2, adding its own part. After world-1 steps it holds chunk r summed over all ranks.
  // Each rank sends and receives (world-1)·s elements. The chunk goes in windows of a few segments,
  // each window through the whole ring, so the scratch is three windows (what arrives, and two
  // running sums: the one being sent and the next): 3 × min(2 segments of 4 MiB, a chunk), whatever
  // the buffer's size; the input is read, never written.
  void ring_reduce_scatter(const at::Tensor& in, const at::Tensor& out, int64_t s, uint64_t seq, ReduceOp op) {
    const int64_t n = in.numel();
    // [off, off + len) of chunk c of the input, padded with zeros where it runs past the end.
    auto piece = [&](int64_t c, int64_t off, int64_t len) -> at::Tensor {
      const int64_t begin = c * s + off;
      if (begin + len <= n) return in.narrow(0, begin, len);
      at::Tensor padded = at::zeros({len}, in.options());
      if (begin < n) padded.narrow(0, 0, n - begin).copy_(in.narrow(0, begin, n - begin));
      return padded;
    };
    if (world_ == 1 || s == 0) {
      if (s > 0) out.copy_(piece(rank_, 0, s));
      return;
    }
    const int next = (rank_ + 1) % world_, prev = (rank_ + world_ - 1) % world_;
    // Segments of a chunk travel as separate messages; their count stays within the tag's 10 bits.
    const int64_t seg = std::max<int64_t>((s + 1023) / 1024, kSegmentBytes / static_cast<int64_t>(in.element_size()));
    const int64_t nseg = (s + seg - 1) / seg;
    const int64_t window = std::min(kWindowSegments * seg, s);
    // Kept between calls and only grown (c10d's send and receive works may hold a buffer a moment
    // after they complete, so a buffer made per call would linger unpredictably).
    if (!scratch_[0].defined() || scratch_[0].scalar_type() != in.scalar_type() || scratch_[0].numel() < window) {
      for (auto& t : scratch_) t = at::empty({window}, in.options());
      scratch_bytes_ = 3 * window * static_cast<int64_t>(in.element_size());
    }
    at::Tensor* scratch = scratch_;
    auto mod = [&](int64_t x) { return ((x % world_) + world_) % world_; };
    for (int64_t first = 0; first < nseg; first += kWindowSegments) {
      const int64_t begin = first * seg, len = std::min(window, s - begin);
      at::Tensor sending = piece(mod(rank_ - 1), begin, len);
      for (int k = 0; k + 1 < world_; ++k) {
        const int64_t recv_chunk = mod(rank_ - k - 2);
        at::Tensor incoming = scratch[0].narrow(0, 0, len);
        std::vector<c10::intrusive_ptr<c10d::Work>> works;
        for (int64_t off = 0, g = first; off < len; off += seg, ++g) {
          const int64_t m = std::min(seg, len - off);
          const int tag = static_cast<int>(((seq & 0x3FF) << 20) | (static_cast<uint64_t>(k & 0x3FF) << 10) |
                                           static_cast<uint64_t>(g));
          std::vector<at::Tensor> rx{incoming.narrow(0, off, m)};
          std::vector<at::Tensor> tx{sending.narrow(0, off, m)};
          works.push_back(pg_->recv(rx, prev, tag));
          works.push_back(pg_->send(tx, next, tag));
        }
        for (auto& w : works) {
          if (!w->wait(monitor_.timeout())) throw std::runtime_error("Timed out");
        }
        // The running sum goes to the buffer not being sent; the last one is the result.
        at::Tensor sum = k + 2 == world_ ? out.narrow(0, begin, len) : scratch[1 + (k % 2)].narrow(0, 0, len);
        if (op == ReduceOp::kMax) {
          at::maximum_out(sum, incoming, piece(recv_chunk, begin, len));
        } else {
          at::add_out(sum, incoming, piece(recv_chunk, begin, len));
        }
        sending = sum;
      }
    }
  }

  // Runs the queued reduce-scatters in order. A job's tensors are released before its completion is
  // signalled, so a caller that sees the collective done holds the only references left.
  void ring_loop() {
    for (;;) {
      RingJob job;
      {
        std::unique_lock<std::mutex> lock(ring_mu_);
        ring_cv_.wait(lock, [this] { return ring_stop_ || !ring_queue_.empty(); });
        if (ring_queue_.empty()) return;
        job = std::move(ring_queue_.front());
        ring_queue_.pop_front();
      }
      std::exception_ptr error;
      try {
        job.run();
      } catch (...) {
        error = std::current_exception();
      }
      job.run = nullptr;
      if (error) job.done->set_exception(error);
      else job.done->set_value();
    }
  }

  int rank_, world_;
  Monitor monitor_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
  std::mutex ring_mu_;
  std::condition_variable ring_cv_;
  std::atomic<int64_t> scratch_bytes_{0};  // what scratch_ holds, for buffer_bytes() from other threads
  at::Tensor scratch_[3];  // three windows of the largest reduce-scatter so far; the ring thread's
  struct RingJob {
    std::function<void()> run;
    std::shared_ptr<std::promise<void>> done;
  };
  std::deque<RingJob> ring_queue_;
  bool ring_stop_ = false;
  std::thread ring_thread_;
};

}  // namespace

std::unique_ptr<Communicator> make_gloo_communicator(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world,
                                                     std::chrono::milliseconds timeout, bool debug,
                                                     const std::string& master_addr) {
  return std::make_unique<GlooCommunicator>(store, rank, world, timeout, debug, master_addr);
}

}  // namespace detail
}  // namespace zeal
