#include "engine/checkpoint/fault_hooks.h"

#include <signal.h>

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

}  // namespace zeal::ckpt
