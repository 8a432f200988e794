// Prefaulter: fresh buffers are made resident, in order, on a thread of its own; fault_in covers
// the partial pages at either end; stopping early is safe.
#include <gtest/gtest.h>

#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <cstdint>
#include <thread>
#include <vector>

#include "offload/prefault.h"

namespace {

struct Mapping {
  explicit Mapping(int64_t n) : n(n) {
    p = static_cast<char*>(::mmap(nullptr, static_cast<size_t>(n), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  }
  ~Mapping() { ::munmap(p, static_cast<size_t>(n)); }
  // Pages resident now (mincore), of how many.
  std::pair<int64_t, int64_t> resident() const {
    const int64_t page = ::sysconf(_SC_PAGESIZE);
    std::vector<unsigned char> in(static_cast<size_t>((n + page - 1) / page));
    EXPECT_EQ(::mincore(p, static_cast<size_t>(n), in.data()), 0);
    int64_t r = 0;
    for (unsigned char b : in) r += b & 1;
    return {r, static_cast<int64_t>(in.size())};
  }
  char* p;
  int64_t n;
};

// `count` fresh mappings of `bytes` each, and the (pointer, bytes) list a Prefaulter takes.
void make_mappings(int count, int64_t bytes, std::vector<std::unique_ptr<Mapping>>& maps,
                   std::vector<std::pair<char*, int64_t>>& buffers) {
  for (int i = 0; i < count; ++i) {
    maps.push_back(std::make_unique<Mapping>(bytes));
    ASSERT_NE(maps.back()->p, MAP_FAILED);
    buffers.emplace_back(maps.back()->p, maps.back()->n);
  }
}

TEST(Prefault, FaultInMakesTheWholePagesOfARangeResidentAndStoresNothing) {
  Mapping m(int64_t{8} << 20);
  ASSERT_NE(m.p, MAP_FAILED);
  EXPECT_EQ(m.resident().first, 0);  // fresh: nothing faulted in yet
  zeal::offload::fault_in(m.p + 100, m.n - 200);  // not page-aligned at either end
  const auto [r, pages] = m.resident();
  EXPECT_EQ(r, pages - 2) << "the whole pages inside, not the partial ones at either end (a store would fault them)";
  // Bytes already written stay as they are: a read may be filling the buffer while it is faulted in.
  Mapping w(int64_t{2} << 20);
  ASSERT_NE(w.p, MAP_FAILED);
  for (int64_t i = 0; i < w.n; ++i) w.p[i] = static_cast<char>(i * 31 + 7);
  zeal::offload::fault_in(w.p, w.n);
  zeal::offload::fault_in(w.p + 5, w.n - 9);
  int64_t changed = 0;
  for (int64_t i = 0; i < w.n; ++i) changed += w.p[i] != static_cast<char>(i * 31 + 7);
  EXPECT_EQ(changed, 0);
}

TEST(Prefault, ThePrefaulterMakesItsBuffersResidentInOrder) {
  std::vector<std::unique_ptr<Mapping>> maps;
  std::vector<std::pair<char*, int64_t>> buffers;
  ASSERT_NO_FATAL_FAILURE(make_mappings(5, int64_t{3} << 20, maps, buffers));
  {
    zeal::offload::Prefaulter pf(buffers);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (pf.done() < 5 && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
    ASSERT_EQ(pf.done(), 5);
  }
  for (const auto& m : maps) {
    const auto [r, pages] = m->resident();
    EXPECT_EQ(r, pages);
  }
}

TEST(Prefault, StoppingEarlyJoinsAndLeavesTheRestUntouched) {
  // Many large buffers, destroyed at once: the thread stops at its next step, far from the last.
  std::vector<std::unique_ptr<Mapping>> maps;
  std::vector<std::pair<char*, int64_t>> buffers;
  ASSERT_NO_FATAL_FAILURE(make_mappings(64, int64_t{64} << 20, maps, buffers));
  { zeal::offload::Prefaulter pf(buffers); }
  EXPECT_EQ(maps.back()->resident().first, 0);
}

}  // namespace

namespace {

// The VMA holding `p` in /proc/self/smaps: its "THPeligible:" value (-1 when absent).
int thp_eligible(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  const auto at = reinterpret_cast<uintptr_t>(p);
  while (std::getline(smaps, line)) {
    uintptr_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(':') > line.find('-')) {
      inside = lo <= at && at < hi;
    } else if (inside && line.rfind("THPeligible:", 0) == 0) {
      return std::stoi(line.substr(12));
    }
  }
  return -1;
}

std::string thp_mode() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string s;
  std::getline(f, s);
  const auto a = s.find('['), b = s.find(']');
  return a == std::string::npos || b == std::string::npos ? "" : s.substr(a + 1, b - a - 1);
}

}  // namespace

TEST(Prefault, AFreshBufferIsAlignedWritableAndAsksForHugePages) {
  if (const char* v = std::getenv("ZEAL_HUGE_PAGES"); v && (std::string(v) == "0" || std::string(v) == "off")) {
    GTEST_SKIP() << "ZEAL_HUGE_PAGES=" << v;
  }
  const int64_t n = (int64_t{5} << 20) + 12345;  // not a whole number of pages
  zeal::offload::FreshBuffer b(n);
  EXPECT_EQ(b.size(), n);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % (2 << 20), 0u) << "whole 2 MiB pages start at the buffer";
  for (int64_t i = 0; i < n; i += 4096) EXPECT_EQ(b.data()[i], 0) << i;  // the kernel's pages, cleared
  for (int64_t i = 0; i < n; ++i) b.data()[i] = static_cast<char>(i * 13 + 1);
  int64_t changed = 0;
  for (int64_t i = 0; i < n; ++i) changed += b.data()[i] != static_cast<char>(i * 13 + 1);
  EXPECT_EQ(changed, 0);
  zeal::offload::FreshBuffer small(100);  // under 2 MiB: page-aligned, usable
  EXPECT_EQ(reinterpret_cast<uintptr_t>(small.data()) % 4096, 0u);
  small.data()[99] = 1;
  const std::string mode = thp_mode();
  if (mode != "always" && mode != "madvise") GTEST_SKIP() << "transparent huge pages are '" << mode << "' here";
  const int eligible = thp_eligible(b.data());
  if (eligible < 0) GTEST_SKIP() << "this kernel's smaps has no THPeligible";
  EXPECT_EQ(eligible, 1) << "the buffer's mapping may not use huge pages (THP " << mode << ")";
}
