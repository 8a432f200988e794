// The device a test trains on, and CUDA in tests.
//
// Tests run on the CPU unless they ask for CUDA: test_config() is Config::defaults with use_cpu set
// (the engine would otherwise take the GPU wherever one exists). The test process itself never
// initialises CUDA — ranks forked from a process that did cannot use it (zeal::spawn refuses) — so
// seeding goes through seed() (the CPU generator only; at::manual_seed would count the GPUs) and
// whether a GPU exists is asked in a child process (cuda_devices()).
//
// A CUDA test skips on a machine without a GPU, unless ZEAL_TEST_REQUIRE_CUDA=1 (scripts/gpu-check
// sets it): there a missing GPU, or a build without CUDA, fails the test.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "engine/config/config.h"

namespace zeal_test {

// Config::defaults(false) on `device` ("cpu" or "cuda").
inline zeal::Config test_config(const std::string& device = "cpu") {
  zeal::Config c = zeal::Config::defaults(false);
  c.launch.use_cpu = device != "cuda";
  return c;
}

// Seeds LibTorch's CPU generator (what every CPU test draws from) without touching CUDA.
inline void seed(uint64_t s) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_current_seed(s);
}

// The GPUs LibTorch sees, counted in a child process (the count is cached).
inline int cuda_devices() {
  static const int count = [] {
    const pid_t pid = fork();
    if (pid == 0) {
      int n = 0;
      try {
        if (at::detail::getCUDAHooks().hasCUDA()) n = at::detail::getCUDAHooks().deviceCount();
      } catch (...) {
      }
      _exit(std::clamp(n, 0, 100));
    }
    int status = 0;
    if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return 0;
    return WEXITSTATUS(status);
  }();
  return count;
}

inline bool cuda_required() {
  const char* v = std::getenv("ZEAL_TEST_REQUIRE_CUDA");
  return v && *v && std::string(v) != "0";
}

inline bool built_with_cuda() {
#ifdef ZEAL_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace zeal_test

// At the top of a CUDA test: skips it without a GPU (or a CUDA build of zeal); fails instead under
// ZEAL_TEST_REQUIRE_CUDA=1.
#define ZEAL_NEED_CUDA()                                                                                        \
  do {                                                                                                          \
    const char* zeal_no_cuda_ = !zeal_test::built_with_cuda()      ? "built without CUDA (no nvcc, or -DZEAL_CUDA=OFF)" \
                                : zeal_test::cuda_devices() < 1 ? "no CUDA GPU visible to LibTorch on this machine"  \
                                                                  : nullptr;                                    \
    if (zeal_no_cuda_) {                                                                                        \
      if (zeal_test::cuda_required()) FAIL() << zeal_no_cuda_ << " (ZEAL_TEST_REQUIRE_CUDA=1)";                 \
      GTEST_SKIP() << zeal_no_cuda_;                                                                            \
    }                                                                                                           \
  } while (0)
