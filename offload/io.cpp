#include "offload/io.h"

#include "engine/host_cache.h"

#include <liburing.h>
#include <sys/statvfs.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/format.h>

namespace zeal::offload {
namespace {

const char* verb(bool write) { return write ? "writing" : "reading"; }

bool aligned(int64_t v) { return v % kIoAlign == 0; }

// io_uring: one ring per engine, requests of block_size, queue_depth in flight.
class UringEngine final : public IoEngine {
 public:
  UringEngine(const IoOptions& o, io_uring ring) : IoEngine(o), ring_(ring) {}
  ~UringEngine() override { io_uring_queue_exit(&ring_); }
  const char* kind() const override { return "io_uring"; }

  bool register_buffer(void* buf, int64_t bytes) override {
    if (bytes <= 0 || bytes > (int64_t{1} << 30)) return false;  // the kernel's limit per buffer
    if (!regs_.empty()) io_uring_unregister_buffers(&ring_);
    regs_.push_back({buf, static_cast<size_t>(bytes)});
    if (io_uring_register_buffers(&ring_, regs_.data(), static_cast<unsigned>(regs_.size())) == 0) return true;
    regs_.pop_back();
    if (!regs_.empty() && io_uring_register_buffers(&ring_, regs_.data(), static_cast<unsigned>(regs_.size())) != 0) {
      regs_.clear();  // not even the earlier set again: plain requests from now on
    }
    return false;
  }

 protected:
  void transfer(Op op, int fd, const std::string& path, char* buf, int64_t bytes, int64_t offset) override {
    struct Req {
      int64_t off, len;
    };
    std::vector<Req> reqs;
    for (int64_t at = 0; at < bytes; at += options_.block_size) reqs.push_back({at, std::min(options_.block_size, bytes - at)});
    const int64_t base = requests_;  // requests are numbered in the order they are issued
    requests_ += static_cast<int64_t>(reqs.size());
    // The registered buffer holding the whole transfer, if any.
    int fixed = -1;
    for (size_t i = 0; i < regs_.size(); ++i) {
      char* b = static_cast<char*>(regs_[i].iov_base);
      if (buf >= b && buf + bytes <= b + regs_[i].iov_len) fixed = static_cast<int>(i);
    }
    if (fixed >= 0) fixed_requests_ += static_cast<int64_t>(reqs.size());
    size_t next = 0, done = 0;
    int in_flight = 0;
    // The first failure is reported after the requests in flight have completed (their buffers
    // are the caller's).
    int64_t bad_off = -1, bad_len = 0, bad_res = 0;
    while (done < reqs.size()) {
      int queued = 0;
      while (next < reqs.size() && in_flight < options_.queue_depth && bad_off < 0) {
        io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
        if (!sqe) break;
        const Req& r = reqs[next];
        if (fixed >= 0) {
          if (op == Op::kWrite) {
            io_uring_prep_write_fixed(sqe, fd, buf + r.off, static_cast<unsigned>(r.len),
                                      static_cast<uint64_t>(offset + r.off), fixed);
          } else {
            io_uring_prep_read_fixed(sqe, fd, buf + r.off, static_cast<unsigned>(r.len),
                                     static_cast<uint64_t>(offset + r.off), fixed);
          }
        } else if (op == Op::kWrite) {
          io_uring_prep_write(sqe, fd, buf + r.off, static_cast<unsigned>(r.len), static_cast<uint64_t>(offset + r.off));
        } else {
          io_uring_prep_read(sqe, fd, buf + r.off, static_cast<unsigned>(r.len), static_cast<uint64_t>(offset + r.off));
        }
        io_uring_sqe_set_data64(sqe, next);
        ++next;
        ++in_flight;
        ++queued;
        if (options_.single_submit) {
          submit(op, path, offset + r.off, r.len);
          queued = 0;
        }
      }
      if (queued > 0) submit(op, path, offset + reqs[next - 1].off, reqs[next - 1].len);
      if (in_flight == 0) break;  // a failure stopped new requests and nothing is left in flight
      // Wait for one completion; with overlap_events, take every completion already there and go
      // back to submitting, else wait until the whole batch is in.
      const int want = options_.overlap_events ? 1 : in_flight;
      for (int k = 0; k < want; ++k) {
        io_uring_cqe* cqe = nullptr;
        int rc;
        do {
          rc = io_uring_wait_cqe(&ring_, &cqe);
        } while (rc == -EINTR);
        if (rc < 0) fail(op, path, offset, bytes, rc);
        const uint64_t index = io_uring_cqe_get_data64(cqe);
        const Req& r = reqs[index];
        const int64_t res = maybe_fault(base + static_cast<int64_t>(index), cqe->res, r.len);
        io_uring_cqe_seen(&ring_, cqe);
        --in_flight;
        ++done;
        if (res != r.len && bad_off < 0) {
          bad_off = offset + r.off;
          bad_len = r.len;
          bad_res = res;
        }
      }
      if (bad_off >= 0 && in_flight == 0) break;
    }
    if (bad_off >= 0) fail(op, path, bad_off, bad_len, bad_res);
  }

 private:
  void submit(Op op, const std::string& path, int64_t off, int64_t len) {
    int rc;
    do {
      rc = io_uring_submit(&ring_);
    } while (rc == -EINTR || rc == -EAGAIN);
    if (rc < 0) fail(op, path, off, len, rc);
  }

  io_uring ring_;
  std::vector<iovec> regs_;  // registered buffers, by index
};

// pread/pwrite on thread_count threads, each taking the next block.
class ThreadEngine final : public IoEngine {
 public:
  explicit ThreadEngine(const IoOptions& o) : IoEngine(o) {}
  const char* kind() const override { return "threads"; }

 protected:
  void transfer(Op op, int fd, const std::string& path, char* buf, int64_t bytes, int64_t offset) override {
    const int64_t blocks = (bytes + options_.block_size - 1) / options_.block_size;
    const int64_t base = requests_;
    requests_ += blocks;
    std::atomic<int64_t> next{0};
    std::mutex mu;
    int64_t bad_off = -1, bad_len = 0, bad_res = 0;
    auto work = [&] {
      for (int64_t b; (b = next.fetch_add(1)) < blocks;) {
        const int64_t off = b * options_.block_size, len = std::min(options_.block_size, bytes - off);
        int64_t moved = 0, res = 0;
        while (moved < len) {  // pread/pwrite may move less than asked; a 0 or an error ends it
          res = op == Op::kWrite ? ::pwrite(fd, buf + off + moved, len - moved, offset + off + moved)
                                 : ::pread(fd, buf + off + moved, len - moved, offset + off + moved);
          if (res < 0 && errno == EINTR) continue;
          if (res <= 0) {
            res = res < 0 ? -errno : moved;
            break;
          }
          moved += res;
          res = moved;
        }
        std::lock_guard<std::mutex> lock(mu);
        res = maybe_fault(base + b, res, len);
        if (res != len && bad_off < 0) {
          bad_off = offset + off;
          bad_len = len;
          bad_res = res;
        }
        if (bad_off >= 0) return;
      }
    };
    const int n = static_cast<int>(std::min<int64_t>(std::max(1, options_.thread_count), blocks));
    std::vector<std::thread> threads;
    for (int t = 1; t < n; ++t) threads.emplace_back(work);
    work();
    for (auto& t : threads) t.join();
    if (bad_off >= 0) fail(op, path, bad_off, bad_len, bad_res);
  }
};

}  // namespace

void IoEngine::write(int fd, const std::string& path, const void* buf, int64_t bytes, int64_t offset) {
  if (!aligned(reinterpret_cast<uintptr_t>(buf)) || !aligned(bytes) || !aligned(offset)) {
    throw Error(fmt::format("offload: writing {}: buffer, size ({}) and offset ({}) must be multiples of {} bytes "
                            "(O_DIRECT)",
                            path, bytes, offset, kIoAlign));
  }
  if (bytes > 0) transfer(Op::kWrite, fd, path, static_cast<char*>(const_cast<void*>(buf)), bytes, offset);
}

void IoEngine::read(int fd, const std::string& path, void* buf, int64_t bytes, int64_t offset) {
  if (!aligned(reinterpret_cast<uintptr_t>(buf)) || !aligned(bytes) || !aligned(offset)) {
    throw Error(fmt::format("offload: reading {}: buffer, size ({}) and offset ({}) must be multiples of {} bytes "
                            "(O_DIRECT)",
                            path, bytes, offset, kIoAlign));
  }
  if (bytes > 0) transfer(Op::kRead, fd, path, static_cast<char*>(buf), bytes, offset);
}

int64_t IoEngine::maybe_fault(int64_t request, int64_t res, int64_t len) const {
  if (request != fault_.at_request) return res;
  if (fault_.short_transfer) return len / 2;
  return -fault_.error;
}

void IoEngine::fail(Op op, const std::string& path, int64_t offset, int64_t len, int64_t res) const {
  const bool w = op == Op::kWrite;
  if (res >= 0 && w) {
    // A write cut short by a full file system: say so, with ENOSPC, as the next write would.
    struct statvfs s {};
    const std::string dir = path.substr(0, path.find_last_of('/') + 1);
    if (::statvfs(dir.empty() ? "." : dir.c_str(), &s) == 0 &&
        static_cast<int64_t>(s.f_bavail) * static_cast<int64_t>(s.f_frsize) < len - res) {
      throw IoError(fmt::format("offload: writing {} at offset {} ({} bytes) failed: {} ({} of {} bytes written)", path,
                                offset, len, std::strerror(ENOSPC), res, len),
                    path, offset, len, ENOSPC);
    }
  }
  if (res >= 0) {
    throw IoError(fmt::format("offload: {} {} at offset {} ({} bytes): short transfer, {} of {} bytes{}", verb(w), path,
                              offset, len, res, len, w ? " (is the disk full?)" : " (the file is shorter than expected)"),
                  path, offset, len, 0);
  }
  const int e = static_cast<int>(-res);
  throw IoError(fmt::format("offload: {} {} at offset {} ({} bytes) failed: {}", verb(w), path, offset, len,
                            std::strerror(e)),
                path, offset, len, e);
}

std::unique_ptr<IoEngine> make_io_engine(const IoOptions& o, bool force_threads, std::string* why_not_uring) {
  if (o.block_size <= 0 || o.block_size % kIoAlign != 0) {
    throw Error(fmt::format("aio.block_size: {} is not a positive multiple of {} bytes", o.block_size, kIoAlign));
  }
  if (o.queue_depth < 1) throw Error(fmt::format("aio.queue_depth: {} is below 1", o.queue_depth));
  if (o.thread_count < 1) throw Error(fmt::format("aio.thread_count: {} is below 1", o.thread_count));
  std::string why = force_threads ? "the thread pool was asked for" : "";
  if (!force_threads) {
    io_uring ring;
    const int rc = io_uring_queue_init(static_cast<unsigned>(o.queue_depth), &ring, 0);
    if (rc == 0) {
      if (why_not_uring) why_not_uring->clear();
      return std::make_unique<UringEngine>(o, ring);
    }
    why = fmt::format("io_uring is not available here ({})", std::strerror(-rc));
  }
  if (why_not_uring) *why_not_uring = why;
  return std::make_unique<ThreadEngine>(o);
}

AlignedBuffer::AlignedBuffer(int64_t bytes, bool zeroed) {
  size_ = (std::max<int64_t>(bytes, 0) + kIoAlign - 1) / kIoAlign * kIoAlign;
  if (size_ == 0) size_ = kIoAlign;
  host_cache_make_room(static_cast<size_t>(size_));  // not beside cached blocks
  data_ = static_cast<char*>(std::aligned_alloc(kIoAlign, static_cast<size_t>(size_)));
  if (!data_) throw Error(fmt::format("offload: cannot allocate a {}-byte I/O buffer", size_));
  if (zeroed) std::memset(data_, 0, static_cast<size_t>(size_));
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

}  // namespace zeal::offload
