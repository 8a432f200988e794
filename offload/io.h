// Reads and writes of offloaded state on a file system (NVMe offload): io_uring (liburing) on files
// opened O_DIRECT, each transfer cut into `block_size` requests with up to `queue_depth` in flight;
// where io_uring is unavailable (old kernel, seccomp, kernel.io_uring_disabled) a pool of
// `thread_count` threads doing pread/pwrite takes over, with a one-line warning. Every failure names
// the file, the offset and the size of the request and the system's reason; a short transfer is a
// failure too. No LibTorch headers.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "engine/error.h"

namespace zeal::offload {

// O_DIRECT needs buffers, offsets and sizes aligned to the device's logical block; 4 KiB covers
// every disk in use.
constexpr int64_t kIoAlign = 4096;

struct IoOptions {
  int64_t block_size = 1 << 20;  // bytes per request (aio.block_size)
  int queue_depth = 16;          // requests in flight (aio.queue_depth)
  int thread_count = 1;          // threads of the fallback (aio.thread_count)
  bool single_submit = false;    // submit requests one at a time (aio.single_submit)
  bool overlap_events = true;    // submit new requests while completions arrive (aio.overlap_events)
  bool verify = false;           // swap files check a CRC32C per block on every read (aio.verify)
};

// An I/O request that failed: the file, where, how much and why.
class IoError : public Error {
 public:
  IoError(const std::string& what, std::string path, int64_t offset, int64_t bytes, int error)
      : Error(what), path_(std::move(path)), offset_(offset), bytes_(bytes), error_(error) {}
  const std::string& path() const { return path_; }
  int64_t offset() const { return offset_; }
  int64_t bytes() const { return bytes_; }
  int error() const { return error_; }  // errno; 0 for a short transfer

 private:
  std::string path_;
  int64_t offset_, bytes_;
  int error_;
};

// A fault for tests: request number `at_request` (counted over the engine's life from 0) fails with
// `error` (ENOSPC, EIO, ...) or, with short_transfer, moves half its bytes.
struct FaultInjection {
  int64_t at_request = -1;
  int error = 0;
  bool short_transfer = false;
};

class IoEngine {
 public:
  virtual ~IoEngine() = default;
  // Writes `bytes` from `buf` to `fd` at `offset` (or reads them into `buf`), blocking until every
  // request is done; throws IoError naming `path`. buf, bytes and offset must be multiples of
  // kIoAlign (zeal::Error otherwise).
  void write(int fd, const std::string& path, const void* buf, int64_t bytes, int64_t offset);
  void read(int fd, const std::string& path, void* buf, int64_t bytes, int64_t offset);
  virtual const char* kind() const = 0;  // "io_uring" or "threads"
  // io_uring's registered (fixed) buffers: the kernel pins and maps `bytes` at `buf` once, and every
  // later request lying inside it skips the per-request page mapping. Adds to the buffers already
  // registered; returns false, leaving them as they were, where the kernel refuses (a locked-memory
  // limit, a buffer over 1 GiB) or the engine is the thread pool. Call it while no transfer runs.
  virtual bool register_buffer(void* buf, int64_t bytes) {
    (void)buf;
    (void)bytes;
    return false;
  }
  // Requests issued over the engine's life, and those of them that used a registered buffer.
  int64_t requests() const { return requests_; }
  int64_t fixed_requests() const { return fixed_requests_; }
  const IoOptions& options() const { return options_; }
  void inject(const FaultInjection& f) { fault_ = f; }

 protected:
  explicit IoEngine(const IoOptions& o) : options_(o) {}
  enum class Op { kRead, kWrite };
  virtual void transfer(Op op, int fd, const std::string& path, char* buf, int64_t bytes, int64_t offset) = 0;
  // The result to use for request number `request` (in issue order) moving `len` bytes: `res`
  // unless a fault is injected there.
  int64_t maybe_fault(int64_t request, int64_t res, int64_t len) const;
  [[noreturn]] void fail(Op op, const std::string& path, int64_t offset, int64_t len, int64_t res) const;

  IoOptions options_;
  FaultInjection fault_;
  int64_t requests_ = 0;  // issued over the engine's life
  int64_t fixed_requests_ = 0;
};

// io_uring unless it cannot be used here or `force_threads`; `why_not_uring` receives the reason
// the fallback was taken (empty when io_uring is used).
std::unique_ptr<IoEngine> make_io_engine(const IoOptions& o, bool force_threads = false,
                                         std::string* why_not_uring = nullptr);

// Memory for O_DIRECT transfers: `bytes` rounded up to kIoAlign, aligned to it, zero-filled unless
// `zeroed` is false (for memory whose every byte is written before it is read: its pages are then
// faulted in where they are first written instead of all here).
struct AlignedBuffer {
  explicit AlignedBuffer(int64_t bytes, bool zeroed = true);
  ~AlignedBuffer();
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  char* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  char* data_ = nullptr;
  int64_t size_ = 0;
};

}  // namespace zeal::offload
