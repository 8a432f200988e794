// WriteBehind (offload/write_behind.h) on a real swap file: writes submitted through a few slots
// land in the file in submission order, a slot's buffer is the caller's again only once its write
// is done, and a failed write is an IoError naming the file, from then on at every call.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "offload/io.h"
#include "offload/swap_dir.h"
#include "offload/write_behind.h"

namespace zeal::offload {
namespace {

namespace fs = std::filesystem;

std::vector<char> file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<char>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

struct Dir {
  fs::path root = fs::temp_directory_path() / ("zeal_write_behind_" + std::to_string(::getpid()));
  Dir() { fs::create_directories(root); }
  ~Dir() { fs::remove_all(root); }
};

// Each slot's buffer is refilled as soon as wait_slot hands it back: if a write were still reading
// it, the file would hold the next fill's bytes (with one slot, every wait comes right after its
// submit, while the write is surely in flight). Overlapping offsets check the order.
TEST(WriteBehind, EveryWriteLandsInOrderAndSlotsComeBackOnlyWhenWritten) {
  Dir d;
  for (const bool threads : {false, true})
    for (const int kSlots : {1, 3}) {
      SCOPED_TRACE(fmt::format("{}, {} slots", threads ? "thread pool" : "io_uring", kSlots));
      IoOptions o;
      o.block_size = 256 << 10;
      auto dir = std::make_shared<SwapDir>(d.root.string(), fmt::format("{}{}", threads ? "threads" : "uring", kSlots), 0);
      auto file = std::make_shared<SwapFile>(dir, make_io_engine(o, threads), "grads.swp");
      constexpr int64_t kChunk = 4 << 20, kChunks = 24;
      std::vector<std::unique_ptr<AlignedBuffer>> slot;
      for (int s = 0; s < kSlots; ++s) slot.push_back(std::make_unique<AlignedBuffer>(kChunk));
      // Chunk i goes to offset (i % 16) * kChunk: the last 8 overwrite the first 8.
      std::vector<char> want(16 * kChunk);
      std::mt19937 gen(7);
      {
        WriteBehind w(file, make_io_engine(o, threads), kSlots);
        for (int64_t i = 0; i < kChunks; ++i) {
          const int s = static_cast<int>(i % kSlots);
          w.wait_slot(s);
          char* b = slot[static_cast<size_t>(s)]->data();
          for (int64_t j = 0; j < kChunk; j += 8) {
            const uint64_t x = gen();
            std::memcpy(b + j, &x, 8);
          }
          const int64_t off = (i % 16) * kChunk;
          std::memcpy(want.data() + off, b, kChunk);
          w.submit(s, b, kChunk, off);
        }
        w.drain();
        EXPECT_EQ(w.writes(), kChunks);
        // Refilled after drain: the file must not change.
        for (auto& b : slot) std::memset(b->data(), 0x5a, kChunk);
      }
      const std::vector<char> disk = file_bytes(file->path());
      ASSERT_EQ(disk.size(), want.size());
      EXPECT_EQ(std::memcmp(disk.data(), want.data(), want.size()), 0);
    }
}

TEST(WriteBehind, AFailedWriteIsNamedAtEveryCallAfter) {
  Dir d;
  IoOptions o;
  o.block_size = 1 << 20;
  auto dir = std::make_shared<SwapDir>(d.root.string(), "fail", 0);
  auto file = std::make_shared<SwapFile>(dir, make_io_engine(o), "grads.swp");
  std::unique_ptr<IoEngine> io = make_io_engine(o);
  FaultInjection fault;
  fault.at_request = 5;  // the second write's second request
  fault.error = ENOSPC;
  io->inject(fault);
  AlignedBuffer a(4 << 20), b(4 << 20);
  WriteBehind w(file, std::move(io), 2);
  w.submit(0, a.data(), a.size(), 0);
  w.submit(1, b.data(), b.size(), a.size());
  std::string first;
  try {
    w.drain();
    ADD_FAILURE() << "the injected ENOSPC was not reported";
  } catch (const IoError& e) {
    first = e.what();
    EXPECT_EQ(e.path(), file->path());
    EXPECT_EQ(e.error(), ENOSPC);
  }
  EXPECT_NE(first.find(file->path()), std::string::npos) << first;
  EXPECT_THROW(w.wait_slot(0), IoError);
  EXPECT_THROW(w.submit(0, a.data(), a.size(), 0), IoError);
  EXPECT_THROW(w.drain(), IoError);
  EXPECT_EQ(w.writes(), 1);
}

}  // namespace
}  // namespace zeal::offload
