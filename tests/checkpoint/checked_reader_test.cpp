// The checkpoint reader (engine/checkpoint/manifest.h) over many spans: its reader threads take the
// spans in turn, so bytes must come out in order and whole, checked against the file's own bytes
// written here, and a corrupted block in any span must be named.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "engine/checkpoint/manifest.h"
#include "engine/error.h"
#include "offload/crc32c.h"

namespace zeal::ckpt {
namespace {

namespace fs = std::filesystem;

// A file of `bytes` random bytes and its manifest entry (a CRC32C per kCrcBlock).
struct File {
  fs::path path;
  std::vector<char> data;
  SavedFile saved;
  File(const std::string& name, int64_t bytes, uint32_t seed) {
    path = fs::temp_directory_path() / ("zeal_reader_" + name + "_" + std::to_string(::getpid()));
    std::mt19937 gen(seed);
    data.resize(static_cast<size_t>(bytes));
    for (auto& c : data) c = static_cast<char>(gen());
    std::ofstream(path, std::ios::binary).write(data.data(), bytes);
    saved.bytes = bytes;
    saved.crc32c = offload::crc32c(data.data(), data.size());
    for (int64_t at = 0; at < bytes; at += kCrcBlock) {
      saved.block_crcs.push_back(offload::crc32c(data.data() + at, static_cast<size_t>(std::min(kCrcBlock, bytes - at))));
    }
  }
  ~File() { fs::remove(path); }
};

// Reads that start and end inside blocks, span many one-block spans, and cross two files.
std::vector<CheckedReader::Read> reads_of(const File& a, const File& b, std::vector<std::vector<char>>& out) {
  const int64_t a_n = static_cast<int64_t>(a.data.size()), b_n = static_cast<int64_t>(b.data.size());
  std::vector<CheckedReader::Read> reads{{a.path, &a.saved, 123, a_n - 123 - 77, nullptr},
                                         {b.path, &b.saved, 0, b_n, nullptr},
                                         {a.path, &a.saved, 5 * kCrcBlock + 9, 2 * kCrcBlock, nullptr}};
  out.clear();
  for (auto& r : reads) {
    out.emplace_back(static_cast<size_t>(r.n));
    r.out = out.back().data();
  }
  return reads;
}

TEST(CheckedReader, ManySpansComeOutWholeAndInOrder) {
  File a("a", 11 * kCrcBlock + 4321, 1), b("b", 7 * kCrcBlock, 2);
  for (bool direct : {true, false}) {
    SCOPED_TRACE(direct ? "O_DIRECT" : "page cache");
    CheckedReader reader(kCrcBlock, direct);  // one block per span: every span is a task of its own
    std::vector<std::vector<char>> out;
    auto reads = reads_of(a, b, out);
    reader.read_many(reads);
    for (size_t i = 0; i < reads.size(); ++i) {
      const auto& src = reads[i].path == a.path ? a.data : b.data;
      ASSERT_EQ(0, std::memcmp(out[i].data(), src.data() + reads[i].offset, out[i].size())) << "read " << i;
    }
    // Through the sink: the same bytes, each read's pieces in order and without gaps.
    for (auto& r : reads) r.out = nullptr;
    std::vector<std::vector<char>> sunk(reads.size());
    reader.read_many(reads, [&](size_t i, int64_t at, const char* p, int64_t n) {
      ASSERT_EQ(at, static_cast<int64_t>(sunk[i].size())) << "read " << i << " out of order";
      sunk[i].insert(sunk[i].end(), p, p + n);
    });
    for (size_t i = 0; i < reads.size(); ++i) EXPECT_EQ(sunk[i], out[i]) << "read " << i;
  }
}

TEST(CheckedReader, ACorruptedBlockInAnySpanIsNamed) {
  File a("c", 11 * kCrcBlock + 4321, 3), b("d", 7 * kCrcBlock, 4);
  for (int64_t block : {0, 1, 6, 10}) {
    SCOPED_TRACE(block);
    {
      std::fstream f(b.path, std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(block * kCrcBlock + 17);
      f.put(static_cast<char>(b.data[static_cast<size_t>(block * kCrcBlock + 17)] ^ 0x5a));
    }
    if (block >= 7) {  // past b's end: corrupt a instead
      std::fstream f(a.path, std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(block * kCrcBlock + 17);
      f.put(static_cast<char>(a.data[static_cast<size_t>(block * kCrcBlock + 17)] ^ 0x5a));
    }
    CheckedReader reader(kCrcBlock, true);
    std::vector<std::vector<char>> out;
    auto reads = reads_of(a, b, out);
    const File& bad = block >= 7 ? a : b;
    const std::string want = bad.path.string() + " is corrupted: bytes " + std::to_string(block * kCrcBlock) + "..";
    try {
      reader.read_many(reads);
      FAIL() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
    std::ofstream(b.path, std::ios::binary).write(b.data.data(), static_cast<std::streamsize>(b.data.size()));
    std::ofstream(a.path, std::ios::binary).write(a.data.data(), static_cast<std::streamsize>(a.data.size()));
  }
}

}  // namespace
}  // namespace zeal::ckpt
