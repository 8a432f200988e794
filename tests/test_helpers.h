// Helpers the test programs share: the Python that runs the peers' cross-checks, and zeal::spawn whose
// ranks fail the test when one of their checks failed.
#pragma once

#include <gtest/gtest.h>

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

}  // namespace zeal_test
