// zeal's one log path (engine/log.h): rank 0 speaks for the group at level info by default, other
// ranks say only what concerns them (with their rank), ZEAL_LOG_LEVEL filters by level,
// ZEAL_LOG_RANKS=all lets every rank speak, and a value neither knows is an error naming it.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>

#include "engine/error.h"
#include "engine/log.h"
#include "engine/runtime/runtime.h"
#include "engine/runtime/spawn.h"

namespace {

namespace fs = std::filesystem;

// What each of 2 ranks wrote to standard error while saying one message of each kind, under `env`.
std::map<int, std::string> said(const std::map<std::string, std::string>& env) {
  const fs::path dir = fs::temp_directory_path() / ("zeal_log_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  zeal::SpawnOptions so;
  so.env = env;
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        const std::string file = (dir / std::to_string(rt.rank())).string();
        const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
        ::dup2(fd, 2);
        ::close(fd);
        zeal::log::debug("a debug line {}", 1);
        zeal::log::info("an info line {}", 2);
        zeal::log::warning("a warning line {}", 3);
        zeal::log::rank_info("my own line {}", 4);
      },
      2, so);
  EXPECT_EQ(zeal::describe_failures(results), "");
  std::map<int, std::string> out;
  for (int r = 0; r < 2; ++r) {
    std::ifstream f(dir / std::to_string(r));
    out[r] = std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  }
  fs::remove_all(dir);
  return out;
}

TEST(Log, RankZeroSpeaksForTheGroupAndEachRankForItself) {
  auto out = said({});
  EXPECT_EQ(out[0],
            "zeal: an info line 2\n"
            "zeal: warning: a warning line 3\n"
            "zeal: rank 0: my own line 4\n");
  EXPECT_EQ(out[1], "zeal: rank 1: my own line 4\n");
}

TEST(Log, TheLevelAndTheRanksFollowTheEnvironment) {
  auto out = said({{"ZEAL_LOG_LEVEL", "warning"}});
  EXPECT_EQ(out[0], "zeal: warning: a warning line 3\n");
  EXPECT_EQ(out[1], "");
  out = said({{"ZEAL_LOG_LEVEL", "DEBUG"}, {"ZEAL_LOG_RANKS", "all"}});
  EXPECT_EQ(out[1],
            "zeal: rank 1: a debug line 1\n"
            "zeal: rank 1: an info line 2\n"
            "zeal: rank 1: warning: a warning line 3\n"
            "zeal: rank 1: my own line 4\n");
  EXPECT_EQ(out[0].rfind("zeal: a debug line 1\n", 0), 0u) << out[0];
}

TEST(Log, AnUnknownValueIsAnErrorNamingTheVariable) {
  for (const auto& [var, value, want] :
       {std::tuple{"ZEAL_LOG_LEVEL", "verbose", "ZEAL_LOG_LEVEL=verbose: expected one of debug, info, warning, error"},
        std::tuple{"ZEAL_LOG_RANKS", "1", "ZEAL_LOG_RANKS=1: expected all or 0"}}) {
    zeal::SpawnOptions so;
    so.env = {{var, value}};
    auto results = zeal::spawn([](zeal::Runtime&) {}, 1, so);
    ASSERT_EQ(results.size(), 1u);
    EXPECT_NE(results[0].failure.find(want), std::string::npos) << results[0].failure;
  }
}

}  // namespace
