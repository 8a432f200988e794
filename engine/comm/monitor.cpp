#include "engine/comm/monitor.h"

#include <map>
#include <sstream>

#include <fmt/format.h>

namespace zeal::detail {
namespace {

constexpr auto kHeartbeat = std::chrono::milliseconds(100);
constexpr auto kAliveEvery = std::chrono::milliseconds(250);

std::string to_text(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
std::vector<uint8_t> to_bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

}  // namespace

std::string OpInfo::describe() const {
  return fmt::format("collective #{} {} of {} {}", seq, name, numel, dtype);
}

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
    : store_(std::move(store)), prefix_(std::move(prefix)), rank_(rank), world_(world), timeout_(timeout),
      debug_(debug) {
  store_->set(fmt::format("{}progress/{}", prefix_, rank_), to_bytes("0 0 none"));
  thread_ = std::thread([this] { heartbeat(); });
}

Monitor::~Monitor() {
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
      store_->set(fmt::format("{}progress/{}", prefix_, rank_), to_bytes(value));
    } catch (const std::exception&) {
      // The store is gone (rank 0 exited): the collective itself will report the failure.
    }
    lock.lock();
  }
}

OpInfo Monitor::begin(std::string name, int64_t numel, std::string dtype) {
  OpInfo op{std::move(name), seq_.load() + 1, numel, std::move(dtype)};
  seq_.store(op.seq);
  {
    std::lock_guard<std::mutex> lock(mu_);
    current_ = op;
  }
  if (debug_) compare(op);
  return op;
}

void Monitor::compare(const OpInfo& op) {
  const std::string mine = fmt::format("{} of {} {}", op.name, op.numel, op.dtype);
  store_->set(fmt::format("{}debug/{}/{}", prefix_, op.seq, rank_), to_bytes(mine));
  std::vector<std::string> keys;
  for (int r = 0; r < world_; ++r) keys.push_back(fmt::format("{}debug/{}/{}", prefix_, op.seq, r));
  try {
    store_->wait(keys, timeout_);
  } catch (const std::exception& e) {
    fail(op, std::string("ZEAL_DEBUG_COLLECTIVES check-in timed out: ") + e.what());
  }
  std::vector<std::string> lines;
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    const std::string theirs = to_text(store_->get(keys[r]));
    if (theirs != mine) {
      lines.push_back(fmt::format("rank {} called {}, rank {} called {}", rank_, mine, r, theirs));
    }
  }
  if (op.seq > 2) {
    // Every rank has posted op.seq - 1, so all have finished comparing op.seq - 2.
    try {
      store_->deleteKey(fmt::format("{}debug/{}/{}", prefix_, op.seq - 2, rank_));
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

void Monitor::fail(const OpInfo& op, const std::string& cause) {
  // Read every rank's progress twice, a few heartbeats apart: a rank whose beat did not move is
  // no longer running (it exited, crashed or is stopped).
  auto read_all = [&] {
    std::vector<std::string> states(world_);
    for (int r = 0; r < world_; ++r) {
      if (r == rank_) continue;
      const std::string key = fmt::format("{}progress/{}", prefix_, r);
      try {
        if (store_->check({key})) states[r] = to_text(store_->get(key));
      } catch (const std::exception&) {
      }
    }
    return states;
  };
  const auto first = read_all();
  std::this_thread::sleep_for(kAliveEvery * 3);
  const auto second = read_all();
  std::vector<int> missing;
  std::vector<std::string> where;
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    const std::string& state = second[r];
    if (state.empty()) {
      missing.push_back(r);
      where.push_back(fmt::format("rank {}: unknown (the store is unreachable)", r));
      continue;
    }
    std::istringstream in(state);
    uint64_t their = 0, beat = 0;
    in >> their >> beat;
    std::string what;
    std::getline(in >> std::ws, what);
    const bool alive = first[r] != second[r];
    const std::string life = alive ? "" : " and is not responding (exited, crashed or stopped?)";
    if (their < op.seq) {
      missing.push_back(r);
      where.push_back(their == 0 ? fmt::format("rank {} has not entered any collective{}", r, life)
                                 : fmt::format("rank {} is at {}{}", r, what, life));
    } else if (their > op.seq) {
      where.push_back(fmt::format("rank {} is already at {}{}", r, what, life));
    } else if (!alive) {
      where.push_back(fmt::format("rank {} reached it{}", r, life));
    }
  }
  std::string msg = fmt::format("rank {}: {} failed: {}", rank_, op.describe(), cause);
  if (!missing.empty()) {
    msg += fmt::format("\n  missing: rank{} {} {} not reached it", missing.size() == 1 ? "" : "s", rank_list(missing),
                       missing.size() == 1 ? "has" : "have");
  } else {
    msg += "\n  every rank reached it";
  }
  for (const auto& w : where) msg += "\n  " + w;
  msg += "\n  Every rank must issue the same collectives in the same order; run with ZEAL_DEBUG_COLLECTIVES=1 to check.";
  throw CommError(msg, op.name, op.seq, missing);
}

}  // namespace zeal::detail
