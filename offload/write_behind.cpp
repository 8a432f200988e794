#include "offload/write_behind.h"

namespace zeal::offload {

WriteBehind::WriteBehind(std::shared_ptr<SwapFile> file, std::unique_ptr<IoEngine> io, int slots)
    : file_(std::move(file)), io_(std::move(io)), busy_(static_cast<size_t>(slots), 0) {
  ZEAL_CHECK(file_ && io_ && slots >= 1) << "WriteBehind needs a file, an engine and at least one slot";
  thread_ = std::thread([this] { run(); });
}

WriteBehind::~WriteBehind() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [&] { return in_flight_ == 0; });
    stop_ = true;
  }
  work_.notify_all();
  thread_.join();
}

void WriteBehind::run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_, nothing left
    const Job job = queue_.front();
    queue_.pop_front();
    const bool failed = error_ != nullptr;
    lock.unlock();
    std::unique_ptr<IoError> error;
    if (!failed) {  // after a failure the rest are not written: the file is not trusted any more
      try {
        file_->write(*io_, job.buf, job.bytes, job.offset);
      } catch (const IoError& e) {
        error = std::make_unique<IoError>(e);
      } catch (const std::exception& e) {
        error = std::make_unique<IoError>(e.what(), file_->path(), job.offset, job.bytes, 0);
      } catch (...) {
        error = std::make_unique<IoError>("an unknown failure", file_->path(), job.offset, job.bytes, 0);
      }
    }
    lock.lock();
    if (!failed && !error) ++writes_;
    if (error && !error_) error_ = std::move(error);
    busy_[static_cast<size_t>(job.slot)] = 0;
    --in_flight_;
    done_.notify_all();
  }
}

void WriteBehind::rethrow_locked() const {
  if (error_) throw IoError(*error_);
}

void WriteBehind::wait_slot(int s) {
  ZEAL_CHECK(s >= 0 && s < slots()) << "WriteBehind: no slot " << s;
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [&] { return !busy_[static_cast<size_t>(s)]; });
  rethrow_locked();
}

void WriteBehind::submit(int s, const void* buf, int64_t bytes, int64_t offset) {
  ZEAL_CHECK(s >= 0 && s < slots()) << "WriteBehind: no slot " << s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ZEAL_CHECK(!busy_[static_cast<size_t>(s)]) << "WriteBehind: slot " << s << " submitted before its last write was done";
    rethrow_locked();
    busy_[static_cast<size_t>(s)] = 1;
    ++in_flight_;
    queue_.push_back({s, buf, bytes, offset});
  }
  work_.notify_one();
}

void WriteBehind::drain() {
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [&] { return in_flight_ == 0; });
  rethrow_locked();
}

int64_t WriteBehind::writes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return writes_;
}

}  // namespace zeal::offload
