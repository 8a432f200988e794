#include "engine/checkpoint/manifest.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>

#include <fmt/format.h>

#include "engine/error.h"
#include "offload/crc32c.h"
#include "offload/io.h"

namespace zeal::ckpt {


struct CheckedReader::Impl {
  struct Fds {
    int direct = -1, buffered = -1;
  };
  std::map<std::string, Fds> files;
  std::unique_ptr<offload::IoEngine> io;
  std::unique_ptr<offload::AlignedBuffer> buf;
  int64_t span = 0;
  ~Impl() {
    for (auto& [p, f] : files) {
      if (f.direct >= 0) ::close(f.direct);
      if (f.buffered >= 0) ::close(f.buffered);
    }
  }
  Fds& open(const std::filesystem::path& path) {
    auto it = files.find(path.string());
    if (it != files.end()) return it->second;
    Fds f;
    f.buffered = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (f.buffered < 0) throw Error(fmt::format("checkpoint: {} is missing ({})", path.string(), std::strerror(errno)));
    f.direct = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);  // -1 where the file system has none
    return files[path.string()] = f;
  }
};

CheckedReader::CheckedReader(int64_t span) : impl_(std::make_unique<Impl>()) {
  offload::IoOptions o;
  o.queue_depth = 32;
  impl_->io = offload::make_io_engine(o);
  impl_->span = std::max<int64_t>(span, kCrcBlock);
  impl_->buf = std::make_unique<offload::AlignedBuffer>(impl_->span);
  impl_->io->register_buffer(impl_->buf->data(), impl_->buf->size());
}

CheckedReader::~CheckedReader() = default;

void CheckedReader::read(const std::filesystem::path& path, const SavedFile& f, int64_t offset, int64_t n, char* out) {
  if (n <= 0) return;
  Impl::Fds& fds = impl_->open(path);
  char* block = impl_->buf->data();
  if (f.crc_block > impl_->span) throw Error(fmt::format("checkpoint: {}: CRC blocks of {} bytes", path.string(), f.crc_block));
  const int64_t per_span = std::max<int64_t>(1, impl_->span / f.crc_block);
  const int64_t first = offset / f.crc_block, last = (offset + n - 1) / f.crc_block;
  for (int64_t b0 = first; b0 <= last; b0 += per_span) {
    const int64_t b1 = std::min(last + 1, b0 + per_span);  // blocks [b0, b1)
    const int64_t at = b0 * f.crc_block, len = std::min(b1 * f.crc_block, f.bytes) - at;
    if (len <= 0) {
      throw Error(fmt::format("checkpoint: {} is truncated: byte {} is past its end", path.string(), at));
    }
    // Whole aligned blocks through O_DIRECT, the rest (a file's short tail) with pread.
    int64_t direct = fds.direct >= 0 && f.crc_block % offload::kIoAlign == 0 ? len / offload::kIoAlign * offload::kIoAlign : 0;
    if (direct > 0) {
      try {
        impl_->io->read(fds.direct, path.string(), block, direct, at);
      } catch (const offload::IoError& e) {
        throw Error(fmt::format("checkpoint: {} is truncated or unreadable: {}", path.string(), e.what()));
      }
    }
    for (int64_t got = direct; got < len;) {
      const ssize_t r = ::pread(fds.buffered, block + got, static_cast<size_t>(len - got), at + got);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        throw Error(fmt::format("checkpoint: {} is truncated: bytes {}..{} cannot be read", path.string(), at + got,
                                at + len));
      }
      got += r;
    }
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t bat = b * f.crc_block, blen = std::min(f.crc_block, f.bytes - bat);
      const char* p = block + (bat - at);
      if (static_cast<size_t>(b) >= f.block_crcs.size() || offload::crc32c(p, static_cast<size_t>(blen)) != f.block_crcs[b]) {
        throw Error(fmt::format("checkpoint: {} is corrupted: bytes {}..{} do not match their CRC32C", path.string(),
                                bat, bat + blen));
      }
      const int64_t lo = std::max(bat, offset), hi = std::min(bat + blen, offset + n);
      if (lo < hi) std::memcpy(out + (lo - offset), p + (lo - bat), static_cast<size_t>(hi - lo));
    }
  }
}

void read_checked(const std::filesystem::path& path, const SavedFile& f, int64_t offset, int64_t n, char* out) {
  CheckedReader r;
  r.read(path, f, offset, n, out);
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
