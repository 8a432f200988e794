#include "engine/checkpoint/fault_hooks.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>

#include <fmt/format.h>

namespace zeal::ckpt {

void maybe_die(const std::string& point, int rank) {
  const char* e = std::getenv("ZEAL_CHECKPOINT_KILL");
  if (!e) return;
  const std::string want(e);
  if (want == point || want == point + ":" + std::to_string(rank)) ::raise(SIGKILL);
}

int injected_write_error(int rank) {
  const char* f = std::getenv("ZEAL_CHECKPOINT_FAULT");
  return f && std::string(f) == fmt::format("enospc:{}", rank) ? ENOSPC : 0;
}

void maybe_change_between_passes(const std::string& path, int64_t offset, int rank) {
  const char* f = std::getenv("ZEAL_CHECKPOINT_FAULT");
  if (f && (std::string(f) == fmt::format("grow:{}", rank) || std::string(f) == "grow:all")) {
    const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
    if (fd >= 0) (void)!::write(fd, "", 1), ::close(fd);
    return;
  }
  if (!f || std::string(f) != fmt::format("change:{}", rank)) return;
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  char c = 0;
  if (fd >= 0 && ::pread(fd, &c, 1, offset) == 1) {
    c ^= 0x40;
    (void)!::pwrite(fd, &c, 1, offset);
  }
  if (fd >= 0) ::close(fd);
}

void maybe_evict_between_passes(const std::vector<std::string>& paths, int rank) {
  const char* f = std::getenv("ZEAL_CHECKPOINT_FAULT");
  if (!f || (std::string(f) != fmt::format("evict:{}", rank) && std::string(f) != "evict:all")) return;
  for (const auto& path : paths) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);  // clean pages leave the cache
    ::close(fd);
  }
}

}  // namespace zeal::ckpt
