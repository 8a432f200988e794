// Helpers the test programs share: the Python that runs the peers' cross-checks, and zeal::spawn whose
// ranks fail the test when one of their checks failed.
#pragma once

#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "engine/error.h"
#include "engine/runtime/spawn.h"

namespace zeal_test {

// $ZEAL_PEERS_PYTHON, else the interpreter scripts/peers installs (~/.cache/zeal/peers/bin/python).
inline std::string peers_python() {
  if (const char* p = std::getenv("ZEAL_PEERS_PYTHON")) return p;
  const char* home = std::getenv("HOME");
  return home ? (std::filesystem::path(home) / ".cache/zeal/peers/bin/python").string() : "python3";
}

// zeal::spawn whose ranks turn a failed EXPECT (recorded only in the forked rank) into a failure the
// parent sees in the results.
inline std::vector<zeal::RankResult> spawn_checked(const std::function<void(zeal::Runtime&)>& fn, int world) {
  return zeal::spawn(
      [&](zeal::Runtime& rt) {
        fn(rt);
        if (::testing::Test::HasFailure()) throw zeal::Error("a check failed on this rank (see above)");
      },
      world);
}

// A peer script's outcome: `skip` says why it could not run (no Python, no package), `failure` why it
// failed; both empty when it ran.
struct PeerScript {
  std::string skip, failure;
};
// Runs tests/<script> (from the source tree) with the peers' Python and `args`; its output goes to
// the test's output.
inline PeerScript run_peer_script(const std::string& script, const std::string& args) {
  const std::string python = peers_python();
  if (!std::filesystem::exists(python)) return {"no peers Python at " + python + " (scripts/peers installs it)", ""};
  const int rc = std::system((python + " " + ZEAL_SOURCE_DIR + "/tests/" + script + " " + args).c_str());
  const int code = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  if (code == 77) return {python + " lacks a package " + script + " needs (scripts/peers installs it)", ""};
  if (code != 0) return {"", script + " exited " + std::to_string(code)};
  return {};
}
inline bool peers_required() {
  const char* r = std::getenv("ZEAL_REQUIRE_PEERS");
  return r && std::string(r) == "1";
}

}  // namespace zeal_test

// In a fixture's SetUp: fails when the peer script failed; skips when it could not run (fails under
// ZEAL_REQUIRE_PEERS=1).
#define ZEAL_NEEDS_PEER(peer)                                                             \
  do {                                                                                    \
    ASSERT_EQ((peer).failure, "");                                                        \
    if (!(peer).skip.empty()) {                                                           \
      if (zeal_test::peers_required()) FAIL() << (peer).skip << " (ZEAL_REQUIRE_PEERS=1)"; \
      GTEST_SKIP() << (peer).skip;                                                        \
    }                                                                                     \
  } while (0)
