// The offload I/O layer (offload/io.h) on a real file: bytes round-trip through io_uring and the
// thread-pool fallback at several block sizes and queue depths, the file holds exactly the bytes
// written (read back independently), and every failure (ENOSPC, EIO, a short transfer, a file too
// short to read) is an IoError naming the file, the offset and the size.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "offload/crc32c.h"
#include "offload/io.h"
#include "offload/swap_dir.h"

namespace zeal::offload {
namespace {

struct TempFile {
  std::string path;
  int fd = -1;
  explicit TempFile(const std::string& name) {
    path = (std::filesystem::temp_directory_path() / ("zeal_io_" + name + "_" + std::to_string(::getpid()))).string();
    fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT, 0600);
    if (fd < 0) fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);  // a file system without O_DIRECT
  }
  ~TempFile() {
    if (fd >= 0) ::close(fd);
    std::filesystem::remove(path);
  }
};

void fill_random(AlignedBuffer& b, uint32_t seed) {
  std::mt19937 gen(seed);
  for (int64_t i = 0; i < b.size(); ++i) b.data()[i] = static_cast<char>(gen());
}

std::vector<char> file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<char>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

struct Shape {
  bool threads;
  int64_t block;
  int depth;
  bool single_submit, overlap;
};

class IoRoundTrip : public ::testing::TestWithParam<Shape> {};

TEST_P(IoRoundTrip, BytesComeBackAndTheFileHoldsThem) {
  const Shape s = GetParam();
  IoOptions o;
  o.block_size = s.block;
  o.queue_depth = s.depth;
  o.thread_count = 3;
  o.single_submit = s.single_submit;
  o.overlap_events = s.overlap;
  std::string why;
  auto io = make_io_engine(o, s.threads, &why);
  EXPECT_STREQ(io->kind(), s.threads ? "threads" : "io_uring") << why;
  TempFile f("roundtrip");
  ASSERT_GE(f.fd, 0) << std::strerror(errno);
  // Not a multiple of the block size: the last request is shorter.
  const int64_t bytes = 3 * s.block + 5 * kIoAlign;
  AlignedBuffer out(bytes), in(bytes), more(2 * kIoAlign);
  fill_random(out, 11);
  fill_random(more, 12);
  io->write(f.fd, f.path, out.data(), bytes, 0);
  io->write(f.fd, f.path, more.data(), more.size(), bytes);  // appended after
  io->read(f.fd, f.path, in.data(), bytes, 0);
  EXPECT_EQ(std::memcmp(out.data(), in.data(), static_cast<size_t>(bytes)), 0);
  const std::vector<char> disk = file_bytes(f.path);
  ASSERT_EQ(static_cast<int64_t>(disk.size()), bytes + more.size());
  EXPECT_EQ(std::memcmp(disk.data(), out.data(), static_cast<size_t>(bytes)), 0);
  EXPECT_EQ(std::memcmp(disk.data() + bytes, more.data(), static_cast<size_t>(more.size())), 0);
  // A read at an offset inside the file.
  AlignedBuffer part(kIoAlign * 3);
  io->read(f.fd, f.path, part.data(), part.size(), 2 * kIoAlign);
  EXPECT_EQ(std::memcmp(part.data(), out.data() + 2 * kIoAlign, static_cast<size_t>(part.size())), 0);
}

INSTANTIATE_TEST_SUITE_P(Shapes, IoRoundTrip,
                         ::testing::Values(Shape{false, 1 << 20, 16, false, true}, Shape{false, 128 << 10, 4, false, false},
                                           Shape{false, 4096, 1, true, true}, Shape{false, 64 << 10, 32, true, false},
                                           Shape{true, 1 << 20, 16, false, true}, Shape{true, 4096, 1, false, true},
                                           Shape{true, 128 << 10, 8, false, false}));

// io_uring's registered buffers: transfers inside a registered buffer go as fixed-buffer requests
// (counted), others as plain ones, and the bytes are the same either way, part of a buffer too;
// the thread pool registers nothing.
TEST(IoRegisteredBuffers, FixedRequestsMoveTheSameBytes) {
  IoOptions o;
  o.block_size = 64 << 10;
  o.queue_depth = 8;
  std::string why;
  auto io = make_io_engine(o, false, &why);
  if (std::string(io->kind()) != "io_uring") GTEST_SKIP() << why;
  TempFile f("fixed");
  ASSERT_GE(f.fd, 0) << std::strerror(errno);
  const int64_t bytes = 5 * o.block_size + 3 * kIoAlign;
  AlignedBuffer a(bytes), b(bytes), plain(bytes), back(bytes);
  fill_random(a, 21);
  fill_random(plain, 22);
  ASSERT_TRUE(io->register_buffer(a.data(), a.size()));
  ASSERT_TRUE(io->register_buffer(b.data(), b.size()));  // a second one, added to the first
  io->write(f.fd, f.path, a.data(), bytes, 0);
  const int64_t after_write = io->fixed_requests();
  EXPECT_EQ(after_write, 6) << "a write from a registered buffer: 6 requests of at most 64 KiB";
  io->write(f.fd, f.path, plain.data(), bytes, bytes);  // not registered
  EXPECT_EQ(io->fixed_requests(), after_write);
  io->read(f.fd, f.path, b.data(), bytes, bytes);  // the plain buffer's bytes into a registered one
  EXPECT_EQ(io->fixed_requests(), 2 * after_write);
  EXPECT_EQ(std::memcmp(b.data(), plain.data(), static_cast<size_t>(bytes)), 0);
  io->read(f.fd, f.path, b.data() + kIoAlign, 2 * kIoAlign, kIoAlign);  // inside b, at an offset
  EXPECT_EQ(std::memcmp(b.data() + kIoAlign, a.data() + kIoAlign, 2 * kIoAlign), 0);
  io->read(f.fd, f.path, back.data(), bytes, 0);
  EXPECT_EQ(std::memcmp(back.data(), a.data(), static_cast<size_t>(bytes)), 0);
  const std::vector<char> disk = file_bytes(f.path);
  ASSERT_EQ(static_cast<int64_t>(disk.size()), 2 * bytes);
  EXPECT_EQ(std::memcmp(disk.data(), a.data(), static_cast<size_t>(bytes)), 0);
  EXPECT_EQ(io->requests() - io->fixed_requests(), 6 + 6) << "the unregistered write and read";
  auto threads = make_io_engine(o, true);
  EXPECT_FALSE(threads->register_buffer(a.data(), a.size()));
}

std::string failure_of(IoEngine& io, bool write, const FaultInjection& fault, int64_t bytes, int64_t offset,
                       const std::string& name, IoError* caught = nullptr) {
  TempFile f(name);
  AlignedBuffer b(bytes);
  io.inject(fault);
  try {
    if (write) io.write(f.fd, f.path, b.data(), bytes, offset);
    else io.read(f.fd, f.path, b.data(), bytes, offset);
  } catch (const IoError& e) {
    if (caught) *caught = e;
    return std::string(e.what()) + "|" + f.path;
  }
  return "no error";
}

TEST(IoFailures, EachNamesFileOffsetAndSize) {
  for (bool threads : {false, true}) {
    IoOptions o;
    o.block_size = 64 << 10;
    o.queue_depth = 4;
    o.thread_count = 1;
    auto io = make_io_engine(o, threads);
    SCOPED_TRACE(io->kind());
    // The third request of a 256 KiB write fails: it starts at 128 KiB past the offset.
    IoError e("", "", 0, 0, 0);
    std::string msg = failure_of(*io, true, {2, ENOSPC, false}, 256 << 10, 8192, "enospc", &e);
    const std::string path = msg.substr(msg.find('|') + 1);
    EXPECT_NE(msg.find("writing " + path + " at offset " + std::to_string(8192 + (128 << 10)) + " (65536 bytes)"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find(std::strerror(ENOSPC)), std::string::npos) << msg;
    EXPECT_EQ(e.error(), ENOSPC);
    EXPECT_EQ(e.offset(), 8192 + (128 << 10));
    EXPECT_EQ(e.bytes(), 65536);
    // EIO on the first request of a read.
    io = make_io_engine(o, threads);
    msg = failure_of(*io, false, {0, EIO, false}, 64 << 10, 0, "eio");
    EXPECT_NE(msg.find("reading"), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::strerror(EIO)), std::string::npos) << msg;
    // A short write.
    io = make_io_engine(o, threads);
    msg = failure_of(*io, true, {1, 0, true}, 128 << 10, 0, "short");
    EXPECT_NE(msg.find("short transfer, 32768 of 65536 bytes"), std::string::npos) << msg;
    EXPECT_NE(msg.find("at offset 65536"), std::string::npos) << msg;
    // Reading past the end of a real (empty) file: no fault injected, the file is just short.
    io = make_io_engine(o, threads);
    msg = failure_of(*io, false, {}, 64 << 10, 0, "past_end");
    EXPECT_NE(msg.find("short transfer, 0 of 65536 bytes (the file is shorter than expected)"), std::string::npos)
        << msg;
  }
}

TEST(IoFailures, MisalignedRequestsAndBadOptionsAreNamed) {
  auto io = make_io_engine({});
  TempFile f("align");
  AlignedBuffer b(2 * kIoAlign);
  try {
    io->write(f.fd, f.path, b.data() + 1, kIoAlign, 0);
    ADD_FAILURE() << "a misaligned buffer was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("must be multiples of 4096 bytes (O_DIRECT)"), std::string::npos) << e.what();
  }
  IoOptions o;
  o.block_size = 1000;
  try {
    (void)make_io_engine(o);
    ADD_FAILURE() << "a block size of 1000 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("aio.block_size: 1000"), std::string::npos) << e.what();
  }
}


std::string my_hostname() {
  char buf[256] = {0};
  gethostname(buf, sizeof buf - 1);
  return buf;
}

TEST(SwapDirectory, MadeAtStartRemovedAtTheEndStaleRunsNamed) {
  namespace fs = std::filesystem;
  const fs::path root = fs::temp_directory_path() / ("zeal_swap_" + std::to_string(::getpid()));
  fs::remove_all(root);
  fs::create_directories(root);
  // A run that crashed: its owner process is gone (a child that has exited and been reaped).
  const pid_t child = fork();
  if (child == 0) _exit(0);
  waitpid(child, nullptr, 0);
  fs::create_directories(root / "zeal-crashed" / "rank0");
  std::ofstream(root / "zeal-crashed" / "rank0" / "owner") << my_hostname() << ' ' << child << '\n';
  std::ofstream(root / "zeal-crashed" / "rank0" / "state.swp") << std::string(5000, 'x');
  // A run still going (this process owns it): not stale.
  fs::create_directories(root / "zeal-running" / "rank0");
  std::ofstream(root / "zeal-running" / "rank0" / "owner") << my_hostname() << ' ' << ::getpid() << '\n';
  {
    SwapDir d(root.string(), "test-run", 2);
    EXPECT_EQ(d.path(), (root / "zeal-test-run" / "rank2").string());
    EXPECT_TRUE(fs::is_directory(d.path()));
    ASSERT_EQ(d.stale().size(), 1u);
    EXPECT_NE(d.stale()[0].find("zeal-crashed"), std::string::npos) << d.stale()[0];
    EXPECT_NE(d.stale()[0].find("(4.9 KiB)"), std::string::npos) << d.stale()[0];
    EXPECT_GT(d.free_bytes(), 0);
    try {
      d.require(int64_t{1} << 50, "optimizer state");
      ADD_FAILURE() << "1 PiB fit";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("optimizer state needs 1024.0 TiB in " + root.string()), std::string::npos)
          << e.what();
    }
    const int fd = d.open_file("state.swp");
    ASSERT_GE(fd, 0);
    ::close(fd);
    EXPECT_TRUE(fs::exists(fs::path(d.path()) / "state.swp"));
  }
  EXPECT_FALSE(fs::exists(root / "zeal-test-run")) << "the run's directory outlived the run";
  EXPECT_TRUE(fs::exists(root / "zeal-crashed")) << "a stale directory is named, never deleted";
  fs::remove_all(root);
}

TEST(SwapDirectory, AFileSystemWithoutDirectIoIsNamed) {
  namespace fs = std::filesystem;
  const fs::path shm = "/dev/shm";
  if (!fs::is_directory(shm)) GTEST_SKIP() << "no /dev/shm";
  const fs::path root = shm / ("zeal_swap_" + std::to_string(::getpid()));
  fs::create_directories(root);
  const std::string probe = (root / "probe").string();
  const int pfd = ::open(probe.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0600);
  if (pfd >= 0) {
    ::close(pfd);
    fs::remove_all(root);
    GTEST_SKIP() << "/dev/shm accepts O_DIRECT here";
  }
  SwapDir d(root.string(), "tmpfs", 0);
  try {
    (void)d.open_file("state.swp");
    ADD_FAILURE() << "O_DIRECT on tmpfs was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot be opened for direct I/O (O_DIRECT)"), std::string::npos) << e.what();
  }
  fs::remove_all(root);
}

// CRC32C against the published check values (RFC 3720 B.4; "123456789" → e3069283) and the
// hardware path against the table path on every length and alignment up to 64 bytes, around its
// three-lane rounds, and on 1 MiB.
TEST(Crc32c, MatchesPublishedValuesAndTheTable) {
  const std::string digits = "123456789";
  EXPECT_EQ(crc32c(digits.data(), digits.size()), 0xE3069283u);
  EXPECT_EQ(crc32c_table(digits.data(), digits.size()), 0xE3069283u);
  std::vector<unsigned char> zeros(32, 0), ones(32, 0xFF), inc(32), dec(32);
  for (int i = 0; i < 32; ++i) {
    inc[i] = static_cast<unsigned char>(i);
    dec[i] = static_cast<unsigned char>(31 - i);
  }
  EXPECT_EQ(crc32c(zeros.data(), 32), 0x8A9136AAu);
  EXPECT_EQ(crc32c(ones.data(), 32), 0x62A8AB43u);
  EXPECT_EQ(crc32c(inc.data(), 32), 0x46DD794Eu);
  EXPECT_EQ(crc32c(dec.data(), 32), 0x113FDB5Cu);
  AlignedBuffer b(1 << 20);
  fill_random(b, 9);
  for (size_t off = 0; off < 8; ++off)
    for (size_t n = 0; n <= 64; ++n) ASSERT_EQ(crc32c(b.data() + off, n), crc32c_table(b.data() + off, n)) << off << " " << n;
  EXPECT_EQ(crc32c(b.data(), 1 << 20), crc32c_table(b.data(), 1 << 20));
  // Continuing a CRC over two pieces is the CRC of the whole.
  EXPECT_EQ(crc32c(b.data() + 1000, (1 << 20) - 1000, crc32c(b.data(), 1000)), crc32c(b.data(), 1 << 20));
  // Around the three-lane rounds (12 KiB each): lengths just under, at and over one and two rounds,
  // at odd offsets, and a continuation that starts mid-round.
  for (const size_t n : {12287u, 12288u, 12289u, 24575u, 24576u, 24583u, 100000u})
    for (const size_t off : {0u, 3u})
      ASSERT_EQ(crc32c(b.data() + off, n), crc32c_table(b.data() + off, n)) << off << " " << n;
  EXPECT_EQ(crc32c(b.data() + 5000, 30000, crc32c(b.data(), 5000)), crc32c_table(b.data(), 35000));
}

// aio.verify: a byte changed on disk behind the swap file's back is found when its block is read
// back, naming the file, the block's offset and size; without verify the same read passes.
TEST(SwapVerify, AChangedByteIsNamedWithItsBlock) {
  namespace fs = std::filesystem;
  const fs::path root = fs::temp_directory_path() / ("zeal_verify_" + std::to_string(::getpid()));
  fs::create_directories(root);
  for (const bool verify : {true, false}) {
    IoOptions o;
    o.block_size = 256 << 10;
    o.verify = verify;
    std::shared_ptr<IoEngine> io = make_io_engine(o);
    auto dir = std::make_shared<SwapDir>(root.string(), verify ? "verify" : "plain", 0);
    SwapFile f(dir, io, "state.swp");
    AlignedBuffer out(1 << 20), in(1 << 20);
    fill_random(out, 4);
    f.write(out.data(), out.size(), 0);
    f.read(in.data(), in.size(), 0);  // unchanged: passes
    EXPECT_EQ(std::memcmp(in.data(), out.data(), out.size()), 0);
    {
      const int fd = ::open(f.path().c_str(), O_WRONLY);
      ASSERT_GE(fd, 0);
      const char x = static_cast<char>(out.data()[600000] ^ 0x01);
      ASSERT_EQ(::pwrite(fd, &x, 1, 600000), 1);
      ::fsync(fd);
      ::close(fd);
    }
    try {
      f.read(in.data(), in.size(), 0);
      EXPECT_FALSE(verify) << "the changed byte was not noticed";
      EXPECT_EQ(in.data()[600000], static_cast<char>(out.data()[600000] ^ 0x01)) << "the read did not see the change";
    } catch (const IoError& e) {
      EXPECT_TRUE(verify) << e.what();
      EXPECT_EQ(e.path(), f.path());
      EXPECT_EQ(e.offset(), 524288);  // the 256 KiB block holding byte 600000
      EXPECT_EQ(e.bytes(), 262144);
      EXPECT_NE(std::string(e.what()).find("does not hold what was written there"), std::string::npos) << e.what();
    }
  }
  fs::remove_all(root);
}

// A real file system that fills up (a 1 MiB tmpfs mounted for the test; skipped where mounting is
// not permitted): the write that does not fit is an IoError with ENOSPC naming the file, an offset
// inside it and the request's size, and the swap file is gone once it is dropped.
TEST(IoFailures, AFullFileSystemIsNamed) {
  namespace fs = std::filesystem;
  const fs::path root = fs::temp_directory_path() / ("zeal_full_" + std::to_string(::getpid()));
  fs::create_directories(root);
  if (::mount("tmpfs", root.c_str(), "tmpfs", 0, "size=1m") != 0) {
    const std::string why = std::strerror(errno);
    fs::remove_all(root);
    GTEST_SKIP() << "cannot mount a small tmpfs here (" << why << ")";
  }
  struct Unmount {
    fs::path p;
    ~Unmount() {
      ::umount(p.c_str());
      fs::remove_all(p);
    }
  } unmount{root};
  IoOptions o;
  o.block_size = 256 << 10;
  std::shared_ptr<IoEngine> io = make_io_engine(o);
  auto dir = std::make_shared<SwapDir>(root.string(), "full", 0);
  std::string path;
  {
    SwapFile f(dir, io, "state.swp");
    path = f.path();
    AlignedBuffer b(4 << 20);
    try {
      f.write(b.data(), b.size(), 0);
      ADD_FAILURE() << "4 MiB fit in a 1 MiB file system";
    } catch (const IoError& e) {
      EXPECT_EQ(e.error(), ENOSPC) << e.what();
      EXPECT_EQ(e.path(), path);
      EXPECT_GE(e.offset(), 0);
      EXPECT_LT(e.offset(), 4 << 20);
      EXPECT_EQ(e.bytes(), 256 << 10);
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(std::strerror(ENOSPC)), std::string::npos) << e.what();
    }
  }
  EXPECT_FALSE(fs::exists(path)) << "the swap file outlived its failure";
}

}  // namespace
}  // namespace zeal::offload
