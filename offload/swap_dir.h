// Where a rank's offloaded state lives on disk: <nvme_path>/zeal-<run id>/rank<k>/, made at start,
// removed on a normal exit (the run directory too once no rank's is left). A directory of a run
// that did not end normally (its owner process is gone) is named at the next start, with its size,
// so it can be removed; nothing is deleted behind the user's back. No LibTorch headers.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <string>
#include <vector>

#include "offload/io.h"

namespace zeal::offload {

// The run directories under nvme_path whose every rank directory belongs to one of `pids` on this
// machine, all of them gone: what the attempt before this one of the same `zeal launch
// --max_restarts` left when its ranks were killed. Removed; returns them as "dir (size)".
std::vector<std::string> remove_earlier_attempt(const std::string& nvme_path, const std::vector<long>& pids);

class SwapDir {
 public:
  // nvme_path must exist and be writable; run_id is the same on every rank of the run.
  SwapDir(const std::string& nvme_path, const std::string& run_id, int rank);
  ~SwapDir();
  SwapDir(const SwapDir&) = delete;
  SwapDir& operator=(const SwapDir&) = delete;

  const std::string& path() const { return path_; }
  // Directories of earlier runs under nvme_path whose owner on this machine is gone, with their
  // sizes: "/nvme/zeal-123-456 (1.5 GiB)".
  const std::vector<std::string>& stale() const { return stale_; }
  // Bytes free to this process on nvme_path's file system.
  int64_t free_bytes() const;
  // Throws zeal::Error naming the directory, the bytes needed and the bytes free when `bytes` do
  // not fit.
  void require(int64_t bytes, const std::string& what) const;
  // Creates (truncates) `name` in the rank's directory for O_DIRECT I/O and returns its descriptor
  // (closed by the caller). A file system without O_DIRECT (tmpfs) is named.
  int open_file(const std::string& name) const;

 private:
  std::string root_, run_dir_, path_;
  std::vector<std::string> stale_;
};

// One swap file in a rank's directory, read and written through an I/O engine; closed and removed
// when it goes.
class SwapFile {
 public:
  SwapFile(std::shared_ptr<SwapDir> dir, std::shared_ptr<IoEngine> io, const std::string& name);
  ~SwapFile();
  SwapFile(const SwapFile&) = delete;
  SwapFile& operator=(const SwapFile&) = delete;
  void write(const void* buf, int64_t bytes, int64_t offset) { write(*io_, buf, bytes, offset); }
  void read(void* buf, int64_t bytes, int64_t offset) { read(*io_, buf, bytes, offset); }
  // The same through another engine (an engine is used by one thread at a time: a second thread
  // writing while the first reads needs its own).
  // With aio.verify (the engine's options), every block_size piece of every write gets a CRC32C,
  // checked when the same piece is read back: a mismatch is an IoError naming the file, the
  // piece's offset and size, and both checksums.
  void write(IoEngine& io, const void* buf, int64_t bytes, int64_t offset);
  void read(IoEngine& io, void* buf, int64_t bytes, int64_t offset);
  IoEngine& io() { return *io_; }
  const std::string& path() const { return path_; }
  SwapDir& dir() { return *dir_; }

 private:
  std::shared_ptr<SwapDir> dir_;
  std::shared_ptr<IoEngine> io_;
  std::string path_;
  int fd_ = -1;
  bool verify_ = false;
  std::mutex crc_mu_;  // the reader and the writer run on two threads
  std::unordered_map<int64_t, std::pair<int64_t, uint32_t>> crc_;  // piece offset: (bytes, CRC32C)
};

// "<seconds since the epoch>-<pid>": unique enough for the run directories of one machine.
std::string new_run_id();

}  // namespace zeal::offload
