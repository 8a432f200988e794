// The checkpoint reader (engine/checkpoint/manifest.h) over many spans: its reader threads take the
// spans in turn, so bytes must come out in order and whole, checked against the file's own bytes
// written here, and a corrupted block in any span must be named. read_mapped, the load's second
// pass: the same bytes through mappings, a window resident at a time, a block changed or a file
// truncated under it named (the process lives), a SIGBUS not its own still fatal.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <fcntl.h>
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
#include "offload/mapped_file.h"

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

// Reads marked `drop` (bytes a load reads once) go through the page cache, even where the reader
// reads with O_DIRECT, and leave it as they are checked, but for the blocks they share with the
// reads beside them.
TEST(CheckedReader, ReadsMarkedDropLeaveThePageCacheAndTheirNeighboursStay) {
  File a("drop", 16 * kCrcBlock + 5000, 13);
  const int64_t n = static_cast<int64_t>(a.data.size()), cut1 = 5 * kCrcBlock + 1000, cut2 = 12 * kCrcBlock + 7;
  for (bool direct : {true, false}) {
    SCOPED_TRACE(direct ? "O_DIRECT" : "page cache");
    const int fd = ::open(a.path.c_str(), O_RDONLY);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::fdatasync(fd), 0);
    ASSERT_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
    ::close(fd);
    offload::MappedFile m(a.path.string(), n);
    if (m.resident_fraction(0, n) > 0.01) GTEST_SKIP() << "this file system keeps clean pages (tmpfs?)";
    std::vector<std::vector<char>> out(3);
    std::vector<CheckedReader::Read> reads{{a.path, &a.saved, 0, cut1, nullptr, /*cached=*/true},
                                           {a.path, &a.saved, cut1, cut2 - cut1, nullptr},
                                           {a.path, &a.saved, cut2, n - cut2, nullptr, /*cached=*/true}};
    reads[1].drop = true;
    for (size_t i = 0; i < reads.size(); ++i) {
      out[i].resize(static_cast<size_t>(reads[i].n));
      reads[i].out = out[i].data();
    }
    CheckedReader(kCrcBlock, direct, /*readers=*/1).read_many(reads);
    for (size_t i = 0; i < reads.size(); ++i)
      ASSERT_EQ(0, std::memcmp(out[i].data(), a.data.data() + reads[i].offset, out[i].size())) << "read " << i;
    // Blocks 6..11 are the dropped read's alone; block 5 it shares with the read before, 12 with
    // the read after: those are read (and checked) whole again with them, and stay.
    EXPECT_LT(m.resident_fraction(6 * kCrcBlock, 12 * kCrcBlock), 0.01) << "the dropped read's pages are still cached";
    EXPECT_EQ(m.resident_fraction(0, 6 * kCrcBlock), 1.0) << "the read before it lost pages";
    EXPECT_EQ(m.resident_fraction(12 * kCrcBlock, n), 1.0) << "the read after it lost pages";
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

// A manifest whose CRC list runs past its file's bytes, and a read past them (a hostile or
// damaged manifest): an error naming the file, not a check of bytes that are not there.
TEST(CheckedReader, AReadPastTheFilesEndIsNamed) {
  File a("e", 3 * kCrcBlock + 10, 5);
  SavedFile longer = a.saved;
  longer.block_crcs.push_back(0);
  longer.block_crcs.push_back(0);
  for (bool direct : {true, false}) {
    CheckedReader reader(32 << 20, direct);
    std::vector<char> out(3 * kCrcBlock);
    try {
      reader.read_many({{a.path, &longer, 2 * kCrcBlock, 3 * kCrcBlock, out.data()}});
      FAIL() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(a.path.string() + ": bytes 2097152..5242880 lie outside its 3145738 bytes"),
                std::string::npos)
          << e.what();
    }
  }
}

// Resident set now, bytes (/proc/self/statm).
int64_t resident() {
  std::ifstream f("/proc/self/statm");
  int64_t size = 0, res = 0;
  f >> size >> res;
  return res * ::sysconf(_SC_PAGESIZE);
}

TEST(ReadMapped, GivesTheSameBytesInOrderWithOneWindowResident) {
  File a("ma", 11 * kCrcBlock + 4321, 5), b("mb", 7 * kCrcBlock, 6);
  std::vector<std::vector<char>> out;
  auto reads = reads_of(a, b, out);
  ASSERT_TRUE(read_mapped(reads, {}));
  for (size_t i = 0; i < reads.size(); ++i) {
    const auto& src = reads[i].path == a.path ? a.data : b.data;
    ASSERT_EQ(0, std::memcmp(out[i].data(), src.data() + reads[i].offset, out[i].size())) << "read " << i;
  }
  for (auto& r : reads) r.out = nullptr;
  std::vector<std::vector<char>> sunk(reads.size());
  ASSERT_TRUE(read_mapped(reads, [&](size_t i, int64_t at, const char* p, int64_t n) {
    ASSERT_EQ(at, static_cast<int64_t>(sunk[i].size())) << "read " << i << " out of order";
    sunk[i].insert(sunk[i].end(), p, p + n);
  }));
  for (size_t i = 0; i < reads.size(); ++i) EXPECT_EQ(sunk[i], out[i]) << "read " << i;
  // A file of 256 MiB (in the page cache: just written) read whole: the pages it maps go again as it
  // moves on, so the resident set grows by about one 32 MiB window, not by the file.
  File big("mbig", 256 * kCrcBlock, 7);
  const int64_t before = resident();
  int64_t most = 0;
  ASSERT_TRUE(read_mapped({{big.path, &big.saved, 0, 256 * kCrcBlock, nullptr}},
                          [&](size_t, int64_t, const char*, int64_t) { most = std::max(most, resident() - before); }));
  EXPECT_LT(most, int64_t{80} << 20) << "the mapped pages stayed resident";
  EXPECT_GT(most, int64_t{8} << 20) << "nothing was mapped?";
}

TEST(ReadMapped, ABlockChangedOrAFileTruncatedMeanwhileIsNamedAndTheProcessLives) {
  File a("mc", 9 * kCrcBlock + 100, 8);
  const std::vector<CheckedReader::Read> reads{{a.path, &a.saved, 10, 9 * kCrcBlock, nullptr}};
  int64_t piece = kCrcBlock;
  auto expect_error = [&](const std::string& want, const CheckedReader::Sink& sink) {
    try {
      read_mapped(reads, sink, piece);
      ADD_FAILURE() << "no error; wanted " << want;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  const CheckedReader::Sink none = [](size_t, int64_t, const char*, int64_t) {};
  // A byte of block 4 changed (as by a writer while the bytes went out): named after them.
  {
    std::fstream f(a.path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(4 * kCrcBlock + 5);
    f.put(static_cast<char>(a.data[4 * kCrcBlock + 5] ^ 1));
  }
  int64_t went = 0;
  expect_error(a.path.string() + " changed after it was checked: bytes " + std::to_string(4 * kCrcBlock) + "..",
               [&](size_t, int64_t, const char*, int64_t n) { went += n; });
  EXPECT_EQ(went, 5 * kCrcBlock - 10) << "blocks 0-4 went out before the change was found";
  piece = 8 * kCrcBlock;  // as to a device: the first piece (blocks 0-7) goes out whole
  went = 0;
  expect_error(a.path.string() + " changed after it was checked: bytes " + std::to_string(4 * kCrcBlock) + "..",
               [&](size_t, int64_t, const char*, int64_t n) { went += n; });
  EXPECT_EQ(went, 8 * kCrcBlock - 10);
  piece = kCrcBlock;
  std::ofstream(a.path, std::ios::binary).write(a.data.data(), static_cast<std::streamsize>(a.data.size()));
  // Another size than the manifest's, before anything goes out.
  ::truncate(a.path.c_str(), 3 * kCrcBlock);
  went = 0;
  expect_error(a.path.string() + " changed after it was checked: " + std::to_string(3 * kCrcBlock) + " bytes",
               [&](size_t, int64_t, const char*, int64_t n) { went += n; });
  EXPECT_EQ(went, 0);
  std::ofstream(a.path, std::ios::binary).write(a.data.data(), static_cast<std::streamsize>(a.data.size()));
  // Truncated while the bytes go out: the pages past the new end would raise SIGBUS.
  bool cut = false;
  expect_error(a.path.string() + " was truncated (or could not be read) while it was read again",
               [&](size_t, int64_t, const char*, int64_t) {
    if (!cut) ::truncate(a.path.c_str(), 2 * kCrcBlock);
    cut = true;
  });
  std::ofstream(a.path, std::ios::binary).write(a.data.data(), static_cast<std::streamsize>(a.data.size()));
  EXPECT_TRUE(read_mapped(reads, none));  // whole again
}

// Bytes the page cache let go (a state beyond it) are left to the reader's threads, which read the
// disk faster than faults through a mapping: read_mapped says so and hands out nothing.
TEST(ReadMapped, BytesThePageCacheLetGoAreLeftToTheReader) {
  File a("mf", 16 * kCrcBlock, 11);
  const std::vector<CheckedReader::Read> reads{{a.path, &a.saved, 0, 16 * kCrcBlock, nullptr}};
  const int fd = ::open(a.path.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::fdatasync(fd), 0);
  ASSERT_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);  // clean pages leave the cache
  int64_t went = 0;
  const CheckedReader::Sink count = [&](size_t, int64_t, const char*, int64_t n) { went += n; };
  EXPECT_FALSE(read_mapped(reads, count));
  EXPECT_EQ(went, 0);
  CheckedReader(kCrcBlock, /*direct=*/false).read_many(reads, {});  // back in the page cache
  EXPECT_TRUE(read_mapped(reads, count));
  EXPECT_EQ(went, 16 * kCrcBlock);
  ::close(fd);
}

// A SIGBUS at an address no MappedFile holds ends the process as before (the handler steps aside).
TEST(ReadMappedDeathTest, ASigbusNotItsOwnStillEndsTheProcess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  File a("md", 4 * kCrcBlock, 9);
  EXPECT_EXIT(
      {
        offload::MappedFile held(a.path.string(), 4 * kCrcBlock);  // the handler is installed
        const int fd = ::open(a.path.c_str(), O_RDONLY);
        auto* p = static_cast<volatile char*>(::mmap(nullptr, 4 * kCrcBlock, PROT_READ, MAP_SHARED, fd, 0));
        ::truncate(a.path.c_str(), 0);
        std::printf("%d", p[3 * kCrcBlock]);  // past the end of a mapping of its own
        std::exit(0);
      },
      ::testing::KilledBySignal(SIGBUS), "");
  EXPECT_EXIT(
      {
        offload::MappedFile held(a.path.string(), 4 * kCrcBlock);
        ::raise(SIGBUS);
        std::exit(0);
      },
      ::testing::KilledBySignal(SIGBUS), "");
}

// A handler the program had before gets the SIGBUS that is not a mapping's, with its own semantics:
// a plain handler sees the fault, an ignored SIGBUS sent by a process stays ignored, an SA_SIGINFO
// handler gets one sent by a process; and a MappedFile made afterwards still turns a truncation
// into an error.
void exit_three(int) { std::_Exit(3); }
void exit_four(int, siginfo_t*, void*) { std::_Exit(4); }

// SIGBUS ignored, one sent by the process itself, then a truncation under read_mapped: exits with 5
// when that was named.
void ignored_then_truncated(const File& a) {
  ::signal(SIGBUS, SIG_IGN);
  { offload::MappedFile held(a.path.string(), 4 * kCrcBlock); }
  ::raise(SIGBUS);  // ignored, as before
  const std::vector<CheckedReader::Read> reads{{a.path, &a.saved, 0, 4 * kCrcBlock, nullptr}};
  try {
    read_mapped(reads, [&](size_t, int64_t, const char*, int64_t) { ::truncate(a.path.c_str(), kCrcBlock); });
  } catch (const Error& e) {
    std::_Exit(std::string(e.what()).find("was truncated") != std::string::npos ? 5 : 6);
  }
  std::_Exit(0);
}

TEST(ReadMappedDeathTest, TheDispositionFromBeforeGetsWhatIsNotAMappings) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  File a("me", 4 * kCrcBlock, 10);
  EXPECT_EXIT(
      {
        ::signal(SIGBUS, exit_three);
        offload::MappedFile held(a.path.string(), 4 * kCrcBlock);
        const int fd = ::open(a.path.c_str(), O_RDONLY);
        auto* p = static_cast<volatile char*>(::mmap(nullptr, 4 * kCrcBlock, PROT_READ, MAP_SHARED, fd, 0));
        ::truncate(a.path.c_str(), 0);
        std::printf("%d", p[3 * kCrcBlock]);
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(3), "");
  std::ofstream(a.path, std::ios::binary).write(a.data.data(), static_cast<std::streamsize>(a.data.size()));
  EXPECT_EXIT(ignored_then_truncated(a), ::testing::ExitedWithCode(5), "");
  std::ofstream(a.path, std::ios::binary).write(a.data.data(), static_cast<std::streamsize>(a.data.size()));
  EXPECT_EXIT(
      {
        struct sigaction sa {};
        sa.sa_sigaction = exit_four;
        sa.sa_flags = SA_SIGINFO;
        ::sigaction(SIGBUS, &sa, nullptr);
        offload::MappedFile held(a.path.string(), 4 * kCrcBlock);
        ::raise(SIGBUS);
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(4), "");
}

}  // namespace
}  // namespace zeal::ckpt
