// Sequence numbers, check-ins and the hang report shared by the communicators (internal).
//
// Each rank publishes the sequence number of the collective it last entered to the store from a
// background thread (the collective itself only bumps a counter and copies its description under
// a mutex; no store traffic, no formatting). When a collective fails or times out, the rank
// reads every rank's progress and names the ranks that never reached it. With
// ZEAL_DEBUG_COLLECTIVES=1, ranks exchange (operation, sequence, size, dtype) through the store
// before every collective and fail with both sides of any difference.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <stdexcept>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/comm/communicator.h"

namespace zeal::detail {

struct OpInfo {
  std::string name;   // "all_reduce(sum)", "all_gather[blocks.3, pre_forward]"
  uint64_t seq = 0;
  int64_t numel = 0;
  std::string dtype;  // "float32"
  int64_t step = -1, micro_step = -1;  // -1: not set by an engine
  // What every rank must agree on: "all_gather[blocks.3, pre_forward] of 1000 float32 at step 4,
  // micro-step 2" (no sequence number).
  std::string signature() const;
  std::string describe() const;  // "collective #7 " + signature()
};

class Monitor {
 public:
  Monitor(c10::intrusive_ptr<c10d::Store> store, std::string prefix, int rank, int world,
          std::chrono::milliseconds timeout, bool debug);
  ~Monitor();
  Monitor(const Monitor&) = delete;
  Monitor& operator=(const Monitor&) = delete;

  // Enters the next collective (`name` gets the communicator's label); in debug mode checks it
  // against every rank (throws CommError).
  OpInfo begin(std::string name, const std::string& label, int64_t numel, std::string dtype);
  void set_progress(int64_t step, int64_t micro_step);
  // Communicator::check_agreement.
  void check_agreement(const std::string& where);
  // Throws the CommError for `op`, which failed with `cause` (an exception's text).
  [[noreturn]] void fail(const OpInfo& op, const std::string& cause);

  std::chrono::milliseconds timeout() const { return std::chrono::milliseconds(timeout_ms_.load()); }
  void set_timeout(std::chrono::milliseconds t) { timeout_ms_.store(t.count()); }
  uint64_t sequence() const { return seq_.load(); }
  int rank() const { return rank_; }

 private:
  void heartbeat();
  void compare(const OpInfo& op);
  // What each other rank posted as its progress, read twice a few heartbeats apart: a rank whose
  // beat did not move is no longer running.
  struct Peer {
    bool known = false, alive = false;
    uint64_t seq = 0;
    std::string what;  // its describe()
  };
  std::vector<Peer> read_peers();
  // One line per other machine none of whose ranks answers (see note_rank_machines); *lost: any.
  std::vector<std::string> silent_machines(const std::vector<Peer>& peers, bool* lost) const;
  bool store_silent_ = false;  // a store call of the reports went unanswered: do not wait on it again

  c10::intrusive_ptr<c10d::Store> store_;
  std::string prefix_;
  int rank_, world_;
  std::atomic<int64_t> timeout_ms_;
  bool debug_;
  std::atomic<uint64_t> seq_{0};
  std::mutex mu_;
  OpInfo current_;  // the collective last entered (seq 0: none yet), guarded by mu_
  std::atomic<int64_t> step_{-1}, micro_{-1};
  // Since the last agreement point: how many collectives, a hash of their signatures, and the last
  // few of them (to name the first difference). Touched only by the thread issuing collectives.
  uint64_t agreement_count_ = 0, agreement_hash_ = 1469598103934665603ull, agreements_ = 0;
  std::vector<std::string> recent_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::atomic<bool> stopping_{false};  // the heartbeat's store call gives up at once (destructor)
  std::thread thread_;
};

// Store calls that cannot block forever. A TCPStore client waits on its socket without a deadline
// for check, get and set: when the store's host is stopped (SIGSTOP, a debugger, swapped out)
// every other rank would hang inside the call, whatever comm_timeout says. The call runs on a
// worker thread instead; the caller waits at most `deadline` and otherwise gets StoreSilent naming
// the store's host. An abandoned worker keeps its own reference to the store and ends with it.
// A call whose socket fails (the host died: reset, closed) throws StoreSilent naming the host too.
struct StoreSilent : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// `give_up`, when given, ends the wait early once it turns true (a rank on its way out does not wait
// for a silent store).
void run_bounded(const std::function<void()>& op, std::chrono::milliseconds deadline, const std::string& what,
                 const std::atomic<bool>* give_up = nullptr);
template <class T>
T bounded(const std::function<T()>& op, std::chrono::milliseconds deadline, const std::string& what) {
  auto result = std::make_shared<T>();
  run_bounded([op, result] { *result = op(); }, deadline, what);
  return std::move(*result);
}
// Who hosts the store, as the reports name it: "rank 0, which hosts the rendezvous store" by
// default; zeal::spawn's children name their parent.
void set_store_host(const std::string& who);
const std::string& store_host();

// The machine (launcher's node rank) and host name of every rank, as the rendezvous learned them:
// a report then says when every rank of another machine stopped answering. Empty: unknown.
void note_rank_machines(std::vector<int> node_of_rank, std::vector<std::string> host_of_rank);
// The machine of every rank as noted (empty when not known: one rank, or before the rendezvous).
std::vector<int> rank_machine_indices();

// "float32", "bfloat16", … for a c10 scalar type name.
std::string dtype_name(const std::string& c10_name);

}  // namespace zeal::detail
