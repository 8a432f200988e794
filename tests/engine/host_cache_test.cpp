// The host allocator cache (engine/host_cache.h), each case in a child process of its own (the cache
// is installed once per process and reads ZEAL_HOST_CACHE then): freed large blocks come back already
// resident; a step-like pattern of allocations keeps its peak resident set (read from /proc) while its
// page faults fall; the bound and trim give memory back; the user's settings win; a bad setting is
// named; many threads at once leave it consistent.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/CPUAllocator.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "engine/error.h"
#include "engine/host_cache.h"
#include "engine/zero/host_memory.h"
#include "engine/memory_tracker.h"

namespace {

// Runs `body` in a child with ZEAL_HOST_CACHE=`setting` (nullptr: unset); returns what the body wrote
// to `out` (numbers), or fails the test with the child's message.
std::vector<double> in_child(const char* setting, const std::function<void(std::vector<double>&)>& body) {
  int fd[2];
  EXPECT_EQ(pipe(fd), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    close(fd[0]);
    if (setting) setenv("ZEAL_HOST_CACHE", setting, 1); else unsetenv("ZEAL_HOST_CACHE");
    at::set_num_threads(1);
    std::string msg;
    std::vector<double> out;
    int rc = 0;
    try {
      body(out);
      for (double v : out) msg += std::to_string(v) + " ";
    } catch (const std::exception& e) {
      msg = std::string("ERROR ") + e.what();
      rc = 3;
    }
    if (write(fd[1], msg.data(), msg.size()) < 0) rc = 4;
    _exit(rc);
  }
  close(fd[1]);
  std::string got;
  char buf[4096];
  for (ssize_t n; (n = read(fd[0], buf, sizeof buf)) > 0;) got.append(buf, static_cast<size_t>(n));
  close(fd[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    ADD_FAILURE() << "child: " << got << " (status " << status << ")";
    return {};
  }
  std::vector<double> out;
  for (const char* p = got.c_str(); *p;) {
    char* end;
    const double v = std::strtod(p, &end);
    if (end == p) break;
    out.push_back(v);
    p = end;
  }
  return out;
}

at::Tensor touched(int64_t bytes) {
  at::Tensor t = at::empty({bytes}, at::kByte);
  std::memset(t.data_ptr(), 1, static_cast<size_t>(bytes));
  return t;
}

double minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_minflt);
}

constexpr int64_t MiB = 1 << 20;

TEST(HostCache, AFreedLargeBlockComesBackAndAMissGivesTheCacheBack) {
  const auto r = in_child(nullptr, [](std::vector<double>& out) {
    if (!zeal::install_host_cache()) throw std::runtime_error("not installed");
    void* first;
    {
      at::Tensor a = touched(8 * MiB);
      first = a.data_ptr();
    }
    const auto s1 = zeal::host_cache_stats();
    at::Tensor b = touched(8 * MiB - 1000);  // the same size class
    const auto s2 = zeal::host_cache_stats();
    out = {double(b.data_ptr() == first), double(s1.cached_bytes), double(s2.cached_bytes), double(s2.hits - s1.hits)};
    b.reset();
    at::Tensor c = touched(16 * MiB);  // a miss: the cached 8 MiB goes back first
    const auto s3 = zeal::host_cache_stats();
    out.push_back(double(s3.cached_bytes));
    out.push_back(double(s3.released_bytes));
    at::Tensor small = at::empty({100}, at::kFloat);  // LibTorch's own allocator
    // LibTorch's raw interface (its kernels' scratch): both sizes through raw_deallocate.
    for (size_t n : {size_t{256}, size_t{4 * MiB}}) {
      c10::Allocator* a = c10::GetCPUAllocator();
      void* q = a->raw_allocate(n);
      std::memset(q, 2, n);
      a->raw_deallocate(q);
    }
    out.push_back(double(zeal::host_cache_stats().in_use_bytes));
  });
  ASSERT_EQ(r.size(), 7u);
  EXPECT_EQ(r[0], 1.0) << "the freed block was not handed out again";
  EXPECT_EQ(r[1], 8.0 * MiB);
  EXPECT_EQ(r[2], 0.0);
  EXPECT_EQ(r[3], 1.0);
  EXPECT_EQ(r[4], 0.0) << "a miss kept cached blocks beside its new mapping";
  EXPECT_EQ(r[5], 8.0 * MiB);
  EXPECT_EQ(r[6], 16.0 * MiB) << "only the 16 MiB block is the cache's";
}

// A training step's shape: activations of several sizes made in the forward, freed in reverse in the
// backward while gradients of other sizes come and go, five steps. The cache keeps the peak resident
// set of LibTorch's own allocation (+2 %) and takes away most page faults.
TEST(HostCache, AStepPatternKeepsItsPeakAndLosesItsPageFaults) {
  auto pattern = [](std::vector<double>& out) {
    zeal::zero::keep_large_allocations_mapped();  // glibc's thresholds as the engine sets them
    const bool installed = zeal::install_host_cache();
    zeal::detail::reset_resident_peak();
    const double base = double(zeal::detail::resident_bytes());
    const double f0 = minor_faults();
    for (int step = 0; step < 5; ++step) {
      std::vector<at::Tensor> acts;
      for (int k = 0; k < 12; ++k) acts.push_back(touched((3 + k % 5) * MiB + k * 4096));
      while (!acts.empty()) {
        at::Tensor grad = touched((2 + acts.size() % 3) * MiB);
        acts.pop_back();
      }
      at::Tensor update = touched(20 * MiB);  // the optimizer's temporary, larger than any one cached block
    }
    out = {double(installed), double(zeal::detail::resident_peak_bytes()) - base, minor_faults() - f0};
  };
  const auto with = in_child(nullptr, pattern), without = in_child("off", pattern);
  ASSERT_EQ(with.size(), 3u);
  ASSERT_EQ(without.size(), 3u);
  std::printf("peak resident set above the start: %.1f MiB with the cache, %.1f without; minor faults %.0f and %.0f\n",
              with[1] / MiB, without[1] / MiB, with[2], without[2]);
  EXPECT_EQ(with[0], 1.0);
  EXPECT_EQ(without[0], 0.0);
  EXPECT_LE(with[1], without[1] * 1.02 + 2.0 * MiB) << "the cache raised the peak resident set";
  EXPECT_LT(with[2], 0.6 * without[2]) << "page faults with the cache " << with[2] << ", without " << without[2];
}

TEST(HostCache, TheBoundAndTrimGiveMemoryBack) {
  const auto r = in_child("4M", [](std::vector<double>& out) {
    zeal::install_host_cache();
    touched(8 * MiB);  // over the bound: unmapped when freed
    const auto s1 = zeal::host_cache_stats();
    touched(2 * MiB);
    const auto s2 = zeal::host_cache_stats();
    const double rss = double(zeal::detail::resident_bytes());
    zeal::host_cache_trim();
    const auto s3 = zeal::host_cache_stats();
    out = {double(s1.cached_bytes), double(s2.cached_bytes), double(s3.cached_bytes), double(s1.limit_bytes),
           rss - double(zeal::detail::resident_bytes())};
  });
  ASSERT_EQ(r.size(), 5u);
  EXPECT_EQ(r[0], 0.0);
  EXPECT_EQ(r[1], 2.0 * MiB);
  EXPECT_EQ(r[2], 0.0);
  EXPECT_EQ(r[3], 4.0 * MiB);
  EXPECT_GE(r[4], 1.5 * MiB) << "trim did not lower the resident set";
}

TEST(HostCache, TheUsersSettingsWinAndABadOneIsNamed) {
  EXPECT_EQ(in_child("off", [](std::vector<double>& out) { out = {double(zeal::install_host_cache())}; }),
            std::vector<double>{0.0});
  for (const char* var : {"MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES", "LD_PRELOAD"}) {
    EXPECT_EQ(in_child(nullptr,
                       [var](std::vector<double>& out) {
                         setenv(var, std::string(var) == "GLIBC_TUNABLES" ? "glibc.malloc.mmap_threshold=65536"
                                     : std::string(var) == "LD_PRELOAD"   ? "/usr/lib/libjemalloc.so.2"
                                                                          : "65536",
                                1);
                         out = {double(zeal::install_host_cache())};
                       }),
              std::vector<double>{0.0})
        << var;
  }
  EXPECT_EQ(in_child(nullptr,
                     [](std::vector<double>& out) {
                       static struct Mine final : c10::Allocator {
                         c10::DataPtr allocate(size_t n) override { return c10::GetDefaultCPUAllocator()->allocate(n); }
                         void copy_data(void* d, const void* s, size_t n) const override { default_copy_data(d, s, n); }
                       } mine;
                       c10::SetCPUAllocator(&mine, 0);
                       out = {double(zeal::install_host_cache()), double(c10::GetCPUAllocator() == &mine)};
                     }),
            (std::vector<double>{0.0, 1.0}));
  const auto r = in_child("lots", [](std::vector<double>& out) {
    try {
      zeal::install_host_cache();
    } catch (const zeal::Error& e) {
      out = {double(std::string(e.what()).find("ZEAL_HOST_CACHE='lots'") != std::string::npos)};
    }
  });
  EXPECT_EQ(r, std::vector<double>{1.0});
}

TEST(HostCache, ManyThreadsAtOnceLeaveItConsistent) {
  const auto r = in_child(nullptr, [](std::vector<double>& out) {
    zeal::install_host_cache();
    std::vector<std::thread> ts;
    for (int t = 0; t < 4; ++t) {
      ts.emplace_back([t] {
        for (int i = 0; i < 200; ++i) {
          at::Tensor a = touched((1 + (i + t) % 4) * MiB / 2);
          at::Tensor b = touched(MiB / 4 + 4096 * (i % 3));
          if (a.data_ptr<uint8_t>()[0] != 1 || b.data_ptr<uint8_t>()[0] != 1) std::abort();
        }
      });
    }
    for (auto& t : ts) t.join();
    const auto s = zeal::host_cache_stats();
    out = {double(s.in_use_bytes), double(s.hits > 0)};
  });
  EXPECT_EQ(r, (std::vector<double>{0.0, 1.0}));
}

}  // namespace
