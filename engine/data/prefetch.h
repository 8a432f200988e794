// Background preparation of a loader's batches (zeal::DataLoader's num_workers and prefetch_factor).
//
// Worker threads build batches [first, end) with make(b), in index order of starting, at most `ahead`
// batches beyond the one last taken; take(b) hands batch b over in order, waiting only if it is not
// ready yet. An exception thrown while building batch b is rethrown by take(b), unchanged. The
// destructor stops the workers (a batch being built is finished, then dropped).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

namespace zeal::data {

template <class Batch>
class Prefetcher {
 public:
  Prefetcher(int64_t first, int64_t end, int workers, int64_t ahead, std::function<Batch(int64_t)> make)
      : next_(first), taken_(first), end_(end), ahead_(ahead < 1 ? 1 : ahead), make_(std::move(make)) {
    threads_.reserve(static_cast<size_t>(workers));
    for (int w = 0; w < workers; ++w) threads_.emplace_back([this] { run(); });
  }
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;
  ~Prefetcher() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  // Whether take(b) can hand batch b over: not taken (or skipped) yet, and in range. Only the thread
  // that takes asks, so the answer holds until it takes.
  bool has(int64_t b) {
    std::lock_guard lock(mu_);
    return b >= taken_ && b < end_;
  }

  // Batch b (has(b)); batches skipped over are dropped. Adds the seconds spent waiting to *waited.
  Batch take(int64_t b, double* waited = nullptr) {
    const auto t0 = std::chrono::steady_clock::now();
    std::unique_lock lock(mu_);
    taken_ = b;
    for (auto it = ready_.begin(); it != ready_.end() && it->first < b;) it = ready_.erase(it);
    cv_.notify_all();  // the window moved
    cv_.wait(lock, [&] { return ready_.count(b) != 0; });
    auto slot = std::move(ready_.at(b));
    ready_.erase(b);
    taken_ = b + 1;
    lock.unlock();
    cv_.notify_all();
    if (waited) *waited += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (auto* e = std::get_if<std::exception_ptr>(&slot)) std::rethrow_exception(*e);
    return std::move(std::get<Batch>(slot));
  }

 private:
  using Slot = std::variant<Batch, std::exception_ptr>;
  void run() {
    for (;;) {
      int64_t b;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stop_ || (next_ < end_ && next_ < taken_ + ahead_); });
        if (stop_) return;
        b = next_++;
      }
      Slot slot = [&]() -> Slot {
        try {
          return Slot(std::in_place_index<0>, make_(b));
        } catch (...) {
          return Slot(std::in_place_index<1>, std::current_exception());
        }
      }();
      {
        std::lock_guard lock(mu_);
        if (b >= taken_) ready_.emplace(b, std::move(slot));
      }
      cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  int64_t next_, taken_, end_, ahead_;
  bool stop_ = false;
  std::map<int64_t, Slot> ready_;
  std::function<Batch(int64_t)> make_;
  std::vector<std::thread> threads_;
};

}  // namespace zeal::data
