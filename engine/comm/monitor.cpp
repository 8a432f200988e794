#include "engine/comm/monitor.h"

#include <algorithm>
#include <map>
#include <type_traits>
#include <sstream>

#include <c10/util/Exception.h>
#include <fmt/format.h>

namespace zeal::detail {
namespace {

constexpr auto kHeartbeat = std::chrono::milliseconds(100);
constexpr auto kAliveEvery = std::chrono::milliseconds(250);
constexpr size_t kAgreementLog = 512;  // signatures kept between agreement points to name a difference

std::string to_text(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
std::vector<uint8_t> to_bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

std::string& store_host_name() {
  static std::string who = "rank 0, which hosts the rendezvous store,";
  return who;
}

// The deadline for one store call of the reports and the heartbeat: a live store answers in
// milliseconds, so a few seconds without an answer mean its host is not running.
constexpr auto kStoreCall = std::chrono::milliseconds(5000);

// `f(store)` under `deadline` (see run_bounded); `f` must own what it uses (it may outlive the caller).
template <class F>
auto on_store(const c10::intrusive_ptr<c10d::Store>& store, std::chrono::milliseconds deadline, const char* what, F f) {
  using R = decltype(f(*store));
  if constexpr (std::is_void_v<R>) {
    run_bounded([store, f] { f(*store); }, deadline, what);
  } else {
    return bounded<R>([store, f] { return f(*store); }, deadline, what);
  }
}

}  // namespace

void set_store_host(const std::string& who) { store_host_name() = who; }

namespace {
struct RankMachines {
  std::mutex mu;
  std::vector<int> node;
  std::vector<std::string> host;
};
RankMachines& rank_machines() {
  static RankMachines m;
  return m;
}
}  // namespace

void note_rank_machines(std::vector<int> node_of_rank, std::vector<std::string> host_of_rank) {
  auto& m = rank_machines();
  std::lock_guard<std::mutex> lock(m.mu);
  m.node = std::move(node_of_rank);
  m.host = std::move(host_of_rank);
}
std::vector<int> rank_machine_indices() {
  auto& m = rank_machines();
  std::lock_guard<std::mutex> lock(m.mu);
  return m.node;
}
const std::string& store_host() { return store_host_name(); }

namespace {
// With several machines: which one hosts the store (rank 0's), as the reports of silent machines
// name it; empty with one machine or before the rendezvous noted them.
std::string store_machine_note() {
  auto& m = rank_machines();
  std::lock_guard<std::mutex> lock(m.mu);
  if (m.node.empty() || m.node[0] < 0 || m.host.size() != m.node.size()) return "";
  std::vector<int> ranks;
  bool several = false;
  for (size_t r = 0; r < m.node.size(); ++r) {
    if (m.node[r] == m.node[0]) ranks.push_back(static_cast<int>(r));
    several = several || m.node[r] != m.node[0];
  }
  if (!several) return "";
  return fmt::format("; the store is on machine {} (host {}, rank{} {}): if that machine or the network to it is "
                     "down, none of its ranks can be reached either",
                     m.node[0], m.host[0], ranks.size() == 1 ? "" : "s", rank_list(ranks));
}
}  // namespace

void run_bounded(const std::function<void()>& op, std::chrono::milliseconds deadline, const std::string& what,
                 const std::atomic<bool>* give_up) {
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::exception_ptr error;
  };
  auto state = std::make_shared<State>();
  std::thread([op, state] {
    std::exception_ptr error;
    try {
      op();
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(state->mu);
    state->done = true;
    state->error = error;
    state->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(state->mu);
  bool answered = false;
  if (give_up == nullptr) {
    answered = state->cv.wait_for(lock, deadline, [&] { return state->done; });
  } else {  // nothing signals give_up on the cv: look every 20 ms
    const auto end = std::chrono::steady_clock::now() + deadline;
    while (!(answered = state->done) && !give_up->load() && std::chrono::steady_clock::now() < end) {
      state->cv.wait_for(lock, std::chrono::milliseconds(20), [&] { return state->done; });
    }
  }
  if (!answered) {
    throw StoreSilent(fmt::format("{} no answer from the store within {:g} s: {} is not responding (stopped, hung or "
                                  "gone){}", what, deadline.count() / 1000.0, store_host(), store_machine_note()));
  }
  if (!state->error) return;
  try {
    std::rethrow_exception(state->error);
  } catch (const c10::DistNetworkError& e) {
    // The store's socket failed (reset, closed): its host is gone. A socket timeout is only slow.
    const std::string why = e.what();
    if (why.find("Timeout") != std::string::npos) throw;
    throw StoreSilent(fmt::format("{} lost the store: {} exited or closed it? ({}){}", what, store_host(),
                                  why.substr(0, why.find('\n')), store_machine_note()));
  }
}

std::string OpInfo::signature() const {
  std::string s = fmt::format("{} of {} {}", name, numel, dtype);
  if (step >= 0) s += fmt::format(" at step {}, micro-step {}", step, micro_step);
  return s;
}

std::string OpInfo::describe() const { return fmt::format("collective #{} {}", seq, signature()); }

std::string dtype_name(const std::string& n) {
  static const std::map<std::string, std::string> names = {
      {"Float", "float32"}, {"Double", "float64"}, {"Half", "float16"}, {"BFloat16", "bfloat16"},
      {"Long", "int64"},    {"Int", "int32"},     {"Char", "int8"},     {"Byte", "uint8"},
      {"Bool", "bool"}};
  auto it = names.find(n);
  return it == names.end() ? n : it->second;
}

Monitor::Monitor(c10::intrusive_ptr<c10d::Store> store, std::string prefix, int rank, int world,
                 std::chrono::milliseconds timeout, bool debug)
    : store_(std::move(store)), prefix_(std::move(prefix)), rank_(rank), world_(world), timeout_ms_(timeout.count()),
      debug_(debug) {
  auto s = store_;
  const std::string key = fmt::format("{}progress/{}", prefix_, rank_);
  run_bounded([s, key] { s->set(key, to_bytes("0 0 none")); }, std::max(timeout, std::chrono::milliseconds(kStoreCall)),
              "posting progress:");
  thread_ = std::thread([this] { heartbeat(); });
}

Monitor::~Monitor() {
  stopping_ = true;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Monitor::heartbeat() {
  // Posts "<seq> <beat> <collective>" when the collective changes and at least every
  // kAliveEvery, so others can tell a live rank that is elsewhere from one that is gone.
  // The text is built here, off the collectives' path.
  uint64_t beat = 0, posted = 0;
  auto last = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, kHeartbeat);
    if (stop_) break;
    const auto now = std::chrono::steady_clock::now();
    if (current_.seq == posted && now - last < kAliveEvery) continue;
    posted = current_.seq;
    last = now;
    const std::string value = fmt::format("{} {} {}", current_.seq, ++beat, current_.describe());
    lock.unlock();
    try {
      auto store = store_;
      const std::string key = fmt::format("{}progress/{}", prefix_, rank_);
      run_bounded([store, key, value] { store->set(key, to_bytes(value)); }, kStoreCall, "posting progress:", &stopping_);
    } catch (const std::exception&) {
      // The store is gone (rank 0 exited): the collective itself will report the failure.
    }
    lock.lock();
  }
}

OpInfo Monitor::begin(std::string name, const std::string& label, int64_t numel, std::string dtype) {
  if (!label.empty()) name += "[" + label + "]";
  OpInfo op{std::move(name), seq_.load() + 1, numel, std::move(dtype), step_.load(), micro_.load()};
  seq_.store(op.seq);
  {
    std::lock_guard<std::mutex> lock(mu_);
    current_ = op;
  }
  // The record the next agreement point compares (FNV-1a over the signatures).
  const std::string sig = op.signature();
  ++agreement_count_;
  for (unsigned char c : sig) agreement_hash_ = (agreement_hash_ ^ c) * 1099511628211ull;
  agreement_hash_ = (agreement_hash_ ^ 0xff) * 1099511628211ull;
  if (recent_.size() < kAgreementLog) recent_.push_back(sig);
  if (debug_) compare(op);
  return op;
}

void Monitor::set_progress(int64_t step, int64_t micro_step) {
  step_.store(step);
  micro_.store(micro_step);
}

void Monitor::compare(const OpInfo& op) {
  const std::string mine = op.signature();
  const std::string mine_key = fmt::format("{}debug/{}/{}", prefix_, op.seq, rank_);
  try {
    on_store(store_, kStoreCall, "ZEAL_DEBUG_COLLECTIVES check-in:",
             [mine_key, mine](c10d::Store& s) { s.set(mine_key, to_bytes(mine)); });
  } catch (const StoreSilent& e) {
    throw CommError(fmt::format("rank {}: {}", rank_, e.what()), op.name, op.seq, {});
  }
  std::vector<std::string> keys;
  for (int r = 0; r < world_; ++r) keys.push_back(fmt::format("{}debug/{}/{}", prefix_, op.seq, r));
  const auto t = timeout();
  try {
    on_store(store_, t + kStoreCall, "ZEAL_DEBUG_COLLECTIVES check-in:", [keys, t](c10d::Store& s) { s.wait(keys, t); });
  } catch (const StoreSilent& e) {
    store_silent_ = true;
    fail(op, e.what());
  } catch (const std::exception& e) {
    const std::string what = e.what();
    fail(op, "ZEAL_DEBUG_COLLECTIVES check-in timed out: " + what.substr(0, what.find('\n')));
  }
  std::vector<std::string> lines;
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    std::string theirs;
    try {
      theirs = on_store(store_, kStoreCall, "ZEAL_DEBUG_COLLECTIVES check-in:",
                        [key = keys[r]](c10d::Store& s) { return to_text(s.get(key)); });
    } catch (const StoreSilent& e) {
      store_silent_ = true;
      fail(op, e.what());
    }
    if (theirs != mine) {
      lines.push_back(fmt::format("rank {} called {}, rank {} called {}", rank_, mine, r, theirs));
    }
  }
  if (op.seq > 2) {
    // Every rank has posted op.seq - 1, so all have finished comparing op.seq - 2.
    try {
      on_store(store_, kStoreCall, "", [key = fmt::format("{}debug/{}/{}", prefix_, op.seq - 2, rank_)](
                                           c10d::Store& s) { s.deleteKey(key); });
    } catch (const std::exception&) {
    }
  }
  if (!lines.empty()) {
    std::string msg = fmt::format("rank {}: collective #{} differs between ranks (ZEAL_DEBUG_COLLECTIVES):", rank_, op.seq);
    for (const auto& l : lines) msg += "\n  " + l;
    msg += "\nEvery rank must issue the same collectives, with the same sizes and dtypes, in the same order.";
    throw CommError(msg, op.name, op.seq, {});
  }
}

std::vector<Monitor::Peer> Monitor::read_peers() {
  auto read_all = [&] {
    std::vector<std::string> states(world_);
    for (int r = 0; r < world_; ++r) {
      if (r == rank_) continue;
      const std::string key = fmt::format("{}progress/{}", prefix_, r);
      if (store_silent_) continue;
      try {
        auto store = store_;
        states[r] = bounded<std::string>(
            [store, key] { return store->check({key}) ? to_text(store->get(key)) : std::string(); }, kStoreCall,
            "reading rank progress:");
      } catch (const StoreSilent&) {
        store_silent_ = true;
      } catch (const std::exception&) {
      }
    }
    return states;
  };
  const auto first = read_all();
  if (!store_silent_) std::this_thread::sleep_for(kAliveEvery * 3);
  const auto second = read_all();
  std::vector<Peer> peers(world_);
  for (int r = 0; r < world_; ++r) {
    if (r == rank_ || second[r].empty()) continue;
    std::istringstream in(second[r]);
    uint64_t beat = 0;
    Peer& p = peers[r];
    p.known = true;
    p.alive = first[r] != second[r];
    in >> p.seq >> beat;
    std::getline(in >> std::ws, p.what);
  }
  return peers;
}

// Machines none of whose ranks answers: lost, cut off, or their launcher stopped. When the store
// itself is silent nothing is known of the others; the store's machine is named instead.
std::vector<std::string> Monitor::silent_machines(const std::vector<Peer>& peers, bool* lost) const {
  std::vector<std::string> machines;
  bool machine_lost = false;
  {
    auto& rm = rank_machines();
    std::lock_guard<std::mutex> lock(rm.mu);
    if (static_cast<int>(rm.node.size()) == world_ && rm.node[rank_] >= 0) {
      std::map<int, std::vector<int>> by_node;
      for (int r = 0; r < world_; ++r) by_node[rm.node[r]].push_back(r);
      for (const auto& [node, ranks] : by_node) {
        if (node == rm.node[rank_]) continue;
        const std::string label = fmt::format("machine {} (host {}, rank{} {})", node, rm.host[ranks.front()],
                                              ranks.size() == 1 ? "" : "s", rank_list(ranks));
        if (store_silent_) {
          if (std::find(ranks.begin(), ranks.end(), 0) != ranks.end()) {
            machines.push_back(fmt::format("the store is on {}: if that machine or the network to it is down, none "
                                           "of its ranks can be reached either", label));
          }
          continue;
        }
        const bool silent = std::all_of(ranks.begin(), ranks.end(), [&](int r) { return !peers[r].known || !peers[r].alive; });
        if (!silent) continue;
        machine_lost = true;
        machines.push_back(fmt::format("{} does not answer: none of its ranks responds (the machine, the network to "
                                       "it or its launcher is down)", label));
      }
    }
  }
  if (lost) *lost = machine_lost;
  return machines;
}

void Monitor::fail(const OpInfo& op, const std::string& cause) {
  const std::vector<Peer> peers = read_peers();
  std::vector<int> missing;
  std::vector<std::string> where;
  bool all_same = true;
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    const Peer& p = peers[r];
    if (!p.known) {
      missing.push_back(r);
      all_same = false;
      if (!store_silent_) where.push_back(fmt::format("rank {}: unknown (the store is unreachable)", r));
      continue;
    }
    const std::string life = p.alive ? "" : " and is not responding (exited, crashed or stopped?)";
    if (p.seq < op.seq) {
      missing.push_back(r);
      all_same = false;
      where.push_back(p.seq == 0 ? fmt::format("rank {} has not entered any collective{}", r, life)
                                 : fmt::format("rank {} is at {}{}", r, p.what, life));
    } else if (p.seq > op.seq) {
      all_same = false;
      where.push_back(fmt::format("rank {} is already at {}{}", r, p.what, life));
    } else if (p.what != op.describe()) {
      // The same sequence number in another operation: the ranks' programs went different ways.
      all_same = false;
      where.push_back(fmt::format("rank {} is at {}, a different operation{}", r, p.what, life));
    } else if (!p.alive) {
      where.push_back(fmt::format("rank {} reached it{}", r, life));
    }
  }
  bool machine_lost = false;
  const std::vector<std::string> machines = silent_machines(peers, &machine_lost);
  std::string msg = fmt::format("rank {}: {} failed: {}", rank_, op.describe(), cause);
  for (const auto& m : machines) msg += "\n  " + m;
  if (!missing.empty()) {
    msg += fmt::format("\n  missing: rank{} {} {} not reached it", missing.size() == 1 ? "" : "s", rank_list(missing),
                       missing.size() == 1 ? "has" : "have");
  } else if (all_same) {
    msg += "\n  every rank reached it";
  }
  if (store_silent_) {
    msg += fmt::format("\n  {} is not responding: the store did not answer within {:g} s (stopped, hung or gone)",
                       store_host(), kStoreCall.count() / 1000.0);
  }
  for (const auto& w : where) msg += "\n  " + w;
  if (!store_silent_ && !machine_lost)
    msg += "\n  Every rank must issue the same collectives in the same order; run with ZEAL_DEBUG_COLLECTIVES=1 to check.";
  throw CommError(msg, op.name, op.seq, missing);
}

void Monitor::check_agreement(const std::string& where) {
  const uint64_t k = ++agreements_;
  const std::string head = fmt::format("{}|{}|{:016x}|{}|{}", where, agreement_count_, agreement_hash_, step_.load(),
                                       micro_.load());
  std::string record = head;
  for (const auto& sig : recent_) record += "\n" + sig;
  const uint64_t base = seq_.load() - agreement_count_;  // the sequence number before the first of them
  agreement_count_ = 0;
  agreement_hash_ = 1469598103934665603ull;
  recent_.clear();
  if (world_ == 1) return;
  std::vector<std::string> keys;
  for (int r = 0; r < world_; ++r) keys.push_back(fmt::format("{}agree/{}/{}", prefix_, k, r));
  const std::string agreement = fmt::format("agreement point #{} ({}):", k, where);
  const auto t = timeout();
  try {
    on_store(store_, kStoreCall, agreement.c_str(),
             [key = keys[rank_], record](c10d::Store& s) { s.set(key, to_bytes(record)); });
    on_store(store_, t + kStoreCall, agreement.c_str(), [keys, t](c10d::Store& s) { s.wait(keys, t); });
  } catch (const StoreSilent& e) {
    throw CommError(fmt::format("rank {}: {}", rank_, e.what()), "agreement(" + where + ")", seq_.load(), {});
  } catch (const std::exception&) {
    std::vector<int> missing;
    std::string msg = fmt::format("rank {}: agreement point #{} ({}) was not reached by every rank within {:g} s", rank_,
                                  k, where, timeout().count() / 1000.0);
    const std::vector<Peer> peers = read_peers();
    for (int r = 0; r < world_; ++r) {
      if (r == rank_) continue;
      bool arrived = false;
      if (!store_silent_) {
        try {
          arrived = on_store(store_, kStoreCall, "", [key = keys[r]](c10d::Store& s) { return s.check({key}); });
        } catch (const StoreSilent&) {
          store_silent_ = true;
        } catch (const std::exception&) {
        }
      }
      if (arrived) continue;
      missing.push_back(r);
      const Peer& p = peers[r];
      msg += p.known ? fmt::format("\n  rank {} did not arrive: it is at {}{}", r, p.what,
                                   p.alive ? "" : " and is not responding (exited, crashed or stopped?)")
                     : fmt::format("\n  rank {} did not arrive (its progress is unknown)", r);
    }
    bool machine_lost = false;
    for (const auto& m : silent_machines(peers, &machine_lost)) msg += "\n  " + m;
    if (!machine_lost) {
      msg += "\n  Every rank must run the same engine calls in the same order (see docs/concepts.md, \"Collective calls\").";
    }
    throw CommError(msg, "agreement(" + where + ")", seq_.load(), missing);
  }
  std::vector<std::string> lines;
  auto split = [](const std::string& text) {
    std::vector<std::string> out;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);) out.push_back(line);
    return out;
  };
  const std::vector<std::string> mine = split(record);
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    std::vector<std::string> theirs;
    try {
      theirs = split(on_store(store_, kStoreCall, agreement.c_str(),
                              [key = keys[r]](c10d::Store& s) { return to_text(s.get(key)); }));
    } catch (const StoreSilent& e) {
      throw CommError(fmt::format("rank {}: {}", rank_, e.what()), "agreement(" + where + ")", seq_.load(), {});
    }
    if (!theirs.empty() && theirs[0] == head) continue;
    // Name the first collective where the two records part, else the point each rank reached.
    std::string first;
    const size_t n = std::min(mine.size(), theirs.size());
    for (size_t i = 1; i < n && first.empty(); ++i) {
      if (mine[i] != theirs[i]) {
        first = fmt::format("collective #{}: rank {} issued {}, rank {} issued {}", base + i, rank_, mine[i], r, theirs[i]);
      }
    }
    auto count_of = [](const std::vector<std::string>& rec) {
      std::istringstream in(rec.empty() ? "" : rec[0]);
      std::string where_part, count;
      std::getline(in, where_part, '|');
      std::getline(in, count, '|');
      return std::make_pair(where_part, count);
    };
    const auto [their_where, their_count] = count_of(theirs);
    if (first.empty() && mine.size() != theirs.size() && n < kAgreementLog) {
      const auto& longer = mine.size() > theirs.size() ? mine : theirs;
      const int who = mine.size() > theirs.size() ? rank_ : r;
      first = fmt::format("collective #{}: rank {} issued {}, rank {} none", base + n, who, longer[n],
                          who == rank_ ? r : rank_);
    }
    lines.push_back(fmt::format("rank {} reached '{}' after {} collectives, rank {} reached '{}' after {}{}", rank_,
                                where, count_of(mine).second, r, their_where, their_count,
                                first.empty() ? "" : "; first difference at " + first));
  }
  if (k > 2) {
    try {
      on_store(store_, kStoreCall, "", [key = fmt::format("{}agree/{}/{}", prefix_, k - 2, rank_)](
                                           c10d::Store& s) { s.deleteKey(key); });
    } catch (const std::exception&) {
    }
  }
  if (!lines.empty()) {
    std::string msg = fmt::format("rank {}: the ranks went different ways before agreement point #{} ({}):", rank_, k, where);
    for (const auto& l : lines) msg += "\n  " + l;
    msg += "\n  Every rank must run the same engine calls in the same order; a stage-3 unit's forward, backward and "
           "engine.gathered() are collective.";
    throw CommError(msg, "agreement(" + where + ")", seq_.load(), {});
  }
}

}  // namespace zeal::detail
