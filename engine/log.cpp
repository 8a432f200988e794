#include "engine/log.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <string>

#include "engine/error.h"

namespace zeal::log {
namespace {

std::atomic<int> g_rank{0}, g_world{1};
std::atomic<int> g_level{-1};  // -1: not read yet
std::atomic<bool> g_all_ranks{false};

std::string lower(const char* s) {
  std::string out = s ? s : "";
  for (auto& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// Before the runtime read the environment (a message from a program without one): read it here,
// never throwing from a log call (an unknown value is the runtime's error to raise).
int level() {
  if (g_level.load() < 0) {
    try {
      read_environment();
    } catch (...) {
    }
  }
  return g_level.load();
}

}  // namespace

void set_rank(int rank, int world) {
  g_rank = rank;
  g_world = world;
}

void read_environment() {
  const std::string l = lower(std::getenv("ZEAL_LOG_LEVEL"));
  int v = static_cast<int>(Level::kInfo);
  if (l == "debug") v = 0;
  else if (l.empty() || l == "info") v = 1;
  else if (l == "warning" || l == "warn") v = 2;
  else if (l == "error") v = 3;
  else {
    g_level = 1;
    throw Error(fmt::format("ZEAL_LOG_LEVEL={}: expected one of debug, info, warning, error", std::getenv("ZEAL_LOG_LEVEL")));
  }
  const std::string r = lower(std::getenv("ZEAL_LOG_RANKS"));
  if (!(r.empty() || r == "0" || r == "all")) {
    g_level = v;
    throw Error(fmt::format("ZEAL_LOG_RANKS={}: expected all or 0 (rank 0 speaks for the group, the default)",
                            std::getenv("ZEAL_LOG_RANKS")));
  }
  g_all_ranks = r == "all";
  g_level = v;
}

bool enabled(Level l, bool own) {
  if (static_cast<int>(l) < level()) return false;
  return own || g_rank.load() == 0 || g_all_ranks.load();
}

void write(Level l, bool own, std::string_view message) {
  if (!enabled(l, own)) return;
  std::string line = "zeal: ";
  if (g_world.load() > 1 && (own || g_rank.load() != 0)) line += fmt::format("rank {}: ", g_rank.load());
  if (l == Level::kWarning && message.rfind("warning", 0) != 0) line += "warning: ";
  if (l == Level::kError) line += "error: ";
  line += message;
  if (line.back() != '\n') line += '\n';
  // One write: lines of ranks sharing a terminal or pipe do not interleave mid-line.
  [[maybe_unused]] const ssize_t n = ::write(STDERR_FILENO, line.data(), line.size());
}

}  // namespace zeal::log
