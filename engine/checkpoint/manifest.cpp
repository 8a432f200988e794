#include "engine/checkpoint/manifest.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include <fmt/format.h>

#include "engine/error.h"
#include "offload/crc32c.h"

namespace zeal::ckpt {

// Reads bytes [offset, offset + n) of a checkpoint file into `out`, checking the CRC32C of every
// block it touches; errors name the file and the block.
void read_checked(const std::filesystem::path& path, const SavedFile& f, int64_t offset, int64_t n, char* out) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(fmt::format("checkpoint: {} is missing ({})", path.string(), std::strerror(errno)));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  const int64_t first = offset / f.crc_block, last = (offset + n - 1) / f.crc_block;
  std::vector<char> block(static_cast<size_t>(f.crc_block));
  for (int64_t b = first; b <= last; ++b) {
    const int64_t at = b * f.crc_block, len = std::min(f.crc_block, f.bytes - at);
    int64_t got = 0;
    while (got < len) {
      const ssize_t r = ::pread(fd, block.data() + got, static_cast<size_t>(len - got), at + got);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        throw Error(fmt::format("checkpoint: {} is truncated: bytes {}..{} cannot be read", path.string(), at + got,
                                at + len));
      }
      got += r;
    }
    if (static_cast<size_t>(b) >= f.block_crcs.size() || offload::crc32c(block.data(), static_cast<size_t>(len)) != f.block_crcs[b]) {
      throw Error(fmt::format("checkpoint: {} is corrupted: bytes {}..{} do not match their CRC32C", path.string(), at,
                              at + len));
    }
    const int64_t lo = std::max(at, offset), hi = std::min(at + len, offset + n);
    std::memcpy(out + (lo - offset), block.data() + (lo - at), static_cast<size_t>(hi - lo));
  }
}


std::filesystem::path resolve_checkpoint(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  if (!fs::exists(dir / "manifest.json") && fs::exists(dir / "latest")) {
    std::ifstream f(dir / "latest");
    std::string name;
    std::getline(f, name);
    return dir / name;
  }
  return dir;
}

}  // namespace zeal::ckpt
