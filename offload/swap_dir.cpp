#include "offload/swap_dir.h"

#include "offload/crc32c.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <system_error>

#include <fmt/format.h>

#include "engine/error.h"

namespace zeal::offload {
namespace fs = std::filesystem;

namespace {

std::string hostname() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof buf - 1) != 0) return "?";
  return buf;
}

std::string human(int64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{} B", b) : fmt::format("{:.1f} {}", v, units[u]);
}

int64_t tree_bytes(const fs::path& p) {
  int64_t n = 0;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(p, ec); !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (it->is_regular_file(ec)) n += static_cast<int64_t>(it->file_size(ec));
  }
  return n;
}

// A rank directory's owner ("<host> <pid>") is gone: same machine, no such process.
bool owner_gone(const fs::path& rank_dir) {
  std::ifstream f(rank_dir / "owner");
  std::string host;
  long pid = 0;
  if (!(f >> host >> pid)) return false;  // not ours to judge
  if (host != hostname()) return false;
  return ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

// The owner ("<host> <pid>") of a rank directory, when it is this machine's.
long owner_pid_here(const fs::path& rank_dir) {
  std::ifstream f(rank_dir / "owner");
  std::string host;
  long pid = 0;
  if (!(f >> host >> pid) || host != hostname()) return -1;
  return pid;
}

}  // namespace

std::vector<std::string> remove_earlier_attempt(const std::string& nvme_path, const std::vector<long>& pids) {
  std::vector<std::string> removed;
  if (pids.empty()) return removed;
  std::error_code ec;
  for (auto it = fs::directory_iterator(nvme_path, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const fs::path d = it->path();
    if (d.filename().string().rfind("zeal-", 0) != 0 || !it->is_directory(ec)) continue;
    bool any = false, theirs = true;
    std::error_code ec2;
    for (auto r = fs::directory_iterator(d, ec2); !ec2 && r != fs::directory_iterator(); r.increment(ec2)) {
      any = true;
      const long pid = owner_pid_here(r->path());
      theirs = theirs && std::find(pids.begin(), pids.end(), pid) != pids.end() && owner_gone(r->path());
    }
    if (!any || !theirs) continue;
    const std::string what = fmt::format("{} ({})", d.string(), human(tree_bytes(d)));
    fs::remove_all(d, ec2);
    if (!ec2) removed.push_back(what);
  }
  return removed;
}

std::string new_run_id() {
  const auto secs = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch());
  return fmt::format("{}-{}", secs.count(), ::getpid());
}

SwapDir::SwapDir(const std::string& nvme_path, const std::string& run_id, int rank) : root_(nvme_path) {
  std::error_code ec;
  if (nvme_path.empty() || !fs::is_directory(nvme_path, ec)) {
    throw Error(fmt::format("offload: nvme_path '{}' is not a directory", nvme_path));
  }
  if (::access(nvme_path.c_str(), W_OK | X_OK) != 0) {
    throw Error(fmt::format("offload: nvme_path '{}' is not writable: {}", nvme_path, std::strerror(errno)));
  }
  run_dir_ = (fs::path(nvme_path) / ("zeal-" + run_id)).string();
  path_ = (fs::path(run_dir_) / ("rank" + std::to_string(rank))).string();
  // Earlier runs' directories whose every rank on this machine is gone.
  for (auto it = fs::directory_iterator(nvme_path, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const fs::path d = it->path();
    if (d.string() == run_dir_ || d.filename().string().rfind("zeal-", 0) != 0 || !it->is_directory(ec)) continue;
    bool any = false, all_gone = true;
    for (auto r = fs::directory_iterator(d, ec); !ec && r != fs::directory_iterator(); r.increment(ec)) {
      any = true;
      all_gone = all_gone && owner_gone(r->path());
    }
    if (any && all_gone) stale_.push_back(fmt::format("{} ({})", d.string(), human(tree_bytes(d))));
  }
  fs::create_directories(path_, ec);
  if (ec) throw Error(fmt::format("offload: cannot create {}: {}", path_, ec.message()));
  std::ofstream(fs::path(path_) / "owner") << hostname() << ' ' << ::getpid() << '\n';
}

SwapDir::~SwapDir() {
  std::error_code ec;
  fs::remove_all(path_, ec);
  if (fs::is_empty(run_dir_, ec) && !ec) fs::remove(run_dir_, ec);
}

int64_t SwapDir::free_bytes() const {
  struct statvfs s {};
  if (::statvfs(root_.c_str(), &s) != 0) return -1;
  return static_cast<int64_t>(s.f_bavail) * static_cast<int64_t>(s.f_frsize);
}

void SwapDir::require(int64_t bytes, const std::string& what) const {
  const int64_t free = free_bytes();
  if (free >= 0 && bytes > free) {
    throw Error(fmt::format("offload: {} needs {} in {}, but its file system has {} free", what, human(bytes), root_,
                            human(free)));
  }
}

int SwapDir::open_file(const std::string& name) const {
  const std::string p = (fs::path(path_) / name).string();
  const int fd = ::open(p.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0600);
  if (fd >= 0) return fd;
  if (errno == EINVAL) {
    throw Error(fmt::format("offload: {} cannot be opened for direct I/O (O_DIRECT): its file system (tmpfs?) does "
                            "not support it; choose an nvme_path on a disk",
                            p));
  }
  throw Error(fmt::format("offload: cannot create {}: {}", p, std::strerror(errno)));
}

SwapFile::SwapFile(std::shared_ptr<SwapDir> dir, std::shared_ptr<IoEngine> io, const std::string& name)
    : dir_(std::move(dir)), io_(std::move(io)), path_((fs::path(dir_->path()) / name).string()) {
  fd_ = dir_->open_file(name);
  verify_ = io_->options().verify;
}

void SwapFile::write(IoEngine& io, const void* buf, int64_t bytes, int64_t offset) {
  io.write(fd_, path_, buf, bytes, offset);
  if (!verify_) return;
  const int64_t block = io_->options().block_size;
  std::lock_guard<std::mutex> lock(crc_mu_);
  for (int64_t at = 0; at < bytes; at += block) {
    const int64_t n = std::min(block, bytes - at);
    crc_[offset + at] = {n, crc32c(static_cast<const char*>(buf) + at, static_cast<size_t>(n))};
  }
}

void SwapFile::read(IoEngine& io, void* buf, int64_t bytes, int64_t offset) {
  io.read(fd_, path_, buf, bytes, offset);
  if (!verify_) return;
  const int64_t block = io_->options().block_size;
  std::lock_guard<std::mutex> lock(crc_mu_);
  for (int64_t at = 0; at < bytes; at += block) {
    const int64_t n = std::min(block, bytes - at);
    auto it = crc_.find(offset + at);
    if (it == crc_.end() || it->second.first != n) continue;  // not written as this piece
    const uint32_t got = crc32c(static_cast<const char*>(buf) + at, static_cast<size_t>(n));
    if (got != it->second.second) {
      throw IoError(fmt::format("offload: {} at offset {} ({} bytes) does not hold what was written there (CRC32C "
                                "{:08x}, written {:08x}): the disk or the file changed it",
                                path_, offset + at, n, got, it->second.second),
                    path_, offset + at, n, EBADMSG);
    }
  }
}

SwapFile::~SwapFile() {
  if (fd_ >= 0) ::close(fd_);
  std::error_code ec;
  fs::remove(path_, ec);
}

}  // namespace zeal::offload
