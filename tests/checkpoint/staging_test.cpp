// An asynchronous save's staging: the bytes come out as they went in, in order, whatever the
// budget; with the writes held back, the chunks are allocated and faulted in ahead of the copy.
#include <gtest/gtest.h>

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <thread>
#include <vector>

#include "engine/checkpoint/staging.h"

namespace {

using zeal::ckpt::Staging;

std::vector<char> pattern(int64_t n) {
  std::vector<char> v(static_cast<size_t>(n));
  uint32_t x = 12345;
  for (auto& c : v) {
    x = x * 1664525u + 1013904223u;
    c = static_cast<char>(x >> 24);
  }
  return v;
}

// Pages of [p, p + n) resident now (mincore), whole pages inside only.
int64_t resident_pages(const char* p, int64_t n, int64_t* pages) {
  const int64_t page = ::sysconf(_SC_PAGESIZE);
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + page - 1) & ~static_cast<uintptr_t>(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(n)) & ~static_cast<uintptr_t>(page - 1);
  std::vector<unsigned char> in((end - begin) / page);
  EXPECT_EQ(::mincore(reinterpret_cast<void*>(begin), end - begin, in.data()), 0);
  *pages = static_cast<int64_t>(in.size());
  int64_t r = 0;
  for (unsigned char b : in) r += b & 1;
  return r;
}

// Drains `st` on a thread of its own, as the save's background thread does.
std::vector<char> drain(Staging& st, bool ahead) {
  std::vector<char> out;
  if (ahead) st.fault_in_ahead();
  while (Staging::Chunk* c = st.next()) {
    out.insert(out.end(), c->bytes.get(), c->bytes.get() + c->fill);
    st.done(c);
  }
  return out;
}

TEST(Staging, FaultInMakesEveryPageResident) {
  const int64_t n = int64_t{24} << 20;
  auto* p = static_cast<char*>(::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(p, MAP_FAILED);
  int64_t pages = 0;
  EXPECT_EQ(resident_pages(p, n, &pages), 0);  // fresh: nothing faulted in yet
  Staging::fault_in(p + 100, n - 200);         // not page-aligned at either end
  EXPECT_EQ(resident_pages(p, n, &pages), pages);
  ::munmap(p, n);
}

TEST(Staging, BytesComeOutInOrderWithTheWritesHeldOrNot) {
  const std::vector<char> data = pattern((int64_t{40} << 20) + 12345);
  for (const bool hold : {true, false}) {
    for (const int64_t budget : {static_cast<int64_t>(data.size()) + (1 << 20), int64_t{3} << 20}) {
      if (hold && budget < static_cast<int64_t>(data.size())) continue;  // hold: the budget holds the whole state
      SCOPED_TRACE(testing::Message() << "hold " << hold << ", budget " << budget);
      Staging st(budget, nullptr, hold);
      std::vector<char> out;
      std::thread writer([&] { out = drain(st, hold); });
      // Pieces of every size, as a state's tensors come.
      int64_t at = 0, k = 1;
      while (at < static_cast<int64_t>(data.size())) {
        const int64_t n = std::min<int64_t>(k, static_cast<int64_t>(data.size()) - at);
        st.append(data.data() + at, n);
        at += n;
        k = k * 7 % 9'999'991 + 1;
      }
      st.close();
      writer.join();
      EXPECT_TRUE(out == data);
    }
  }
}

TEST(Staging, TheCopyUsesTheChunksFaultedInAhead) {
  const std::vector<char> data = pattern(int64_t{20} << 20);
  Staging st(static_cast<int64_t>(data.size()) + (1 << 20), nullptr, /*hold=*/true);
  st.fault_in_ahead();  // to its end before the copy starts: every chunk the copy needs is there
  st.append(data.data(), static_cast<int64_t>(data.size()));
  st.close();
  EXPECT_EQ(st.copy_allocations(), 0);
  EXPECT_TRUE(drain(st, false) == data);
  // Without it the copy allocates every chunk itself.
  Staging plain(static_cast<int64_t>(data.size()) + (1 << 20), nullptr, /*hold=*/true);
  plain.append(data.data(), static_cast<int64_t>(data.size()));
  plain.close();
  EXPECT_GT(plain.copy_allocations(), 0);
  EXPECT_TRUE(drain(plain, false) == data);
}

}  // namespace
