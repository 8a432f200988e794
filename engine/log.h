// What zeal says to the user, one way out (standard error): "zeal: " and the message.
//
// By default rank 0 speaks for the group (messages about the run, the same on every rank) and other
// ranks only say what concerns them alone (rank_info, rank_warning: "zeal: rank 3: ..."), at level
// info and above. ZEAL_LOG_LEVEL=debug|info|warning|error sets the level (error: errors only);
// ZEAL_LOG_RANKS=all makes every rank print the group's messages too, each with its rank.
#pragma once

#include <string>
#include <string_view>
#include <utility>

#include <fmt/format.h>

namespace zeal::log {

enum class Level { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// This process's place (the runtime sets it when it joins the group; before that: rank 0 of 1).
void set_rank(int rank, int world);
// Reads ZEAL_LOG_LEVEL and ZEAL_LOG_RANKS now; throws zeal::Error naming the variable and its
// choices for a value it does not know (the runtime calls it first thing).
void read_environment();
// Whether a message at `level` is printed by this rank; `own`: it concerns this rank alone.
bool enabled(Level level, bool own = false);
// Prints "zeal: [rank R: ][warning: |error: ]message" as one write, if enabled.
void write(Level level, bool own, std::string_view message);

template <class... A>
void debug(fmt::format_string<A...> f, A&&... a) {
  if (enabled(Level::kDebug)) write(Level::kDebug, false, fmt::format(f, std::forward<A>(a)...));
}
template <class... A>
void info(fmt::format_string<A...> f, A&&... a) {
  if (enabled(Level::kInfo)) write(Level::kInfo, false, fmt::format(f, std::forward<A>(a)...));
}
template <class... A>
void warning(fmt::format_string<A...> f, A&&... a) {
  if (enabled(Level::kWarning)) write(Level::kWarning, false, fmt::format(f, std::forward<A>(a)...));
}
// What concerns this rank alone: every rank prints its own, with its rank.
template <class... A>
void rank_info(fmt::format_string<A...> f, A&&... a) {
  if (enabled(Level::kInfo, true)) write(Level::kInfo, true, fmt::format(f, std::forward<A>(a)...));
}
template <class... A>
void rank_warning(fmt::format_string<A...> f, A&&... a) {
  if (enabled(Level::kWarning, true)) write(Level::kWarning, true, fmt::format(f, std::forward<A>(a)...));
}
template <class... A>
void rank_error(fmt::format_string<A...> f, A&&... a) {
  if (enabled(Level::kError, true)) write(Level::kError, true, fmt::format(f, std::forward<A>(a)...));
}

}  // namespace zeal::log
