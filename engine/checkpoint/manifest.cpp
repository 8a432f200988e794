#include "engine/checkpoint/manifest.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <map>

#include <fmt/format.h>

#include "engine/error.h"
#include "offload/crc32c.h"
#include "offload/io.h"
#include "offload/mapped_file.h"

namespace zeal::ckpt {


struct CheckedReader::Impl {
  struct Fds {
    int direct = -1, buffered = -1;
  };
  std::map<std::string, Fds> files;
  std::vector<std::unique_ptr<offload::IoEngine>> io;          // one per reader thread
  // The readers' ring: `slots` spans in one buffer (registered once with each engine, for O_DIRECT).
  std::unique_ptr<offload::AlignedBuffer> ring;
  size_t slots = 0;
  char* slot(size_t k) const { return ring->data() + static_cast<int64_t>(k) * span; }
  int64_t span = 0;
  bool direct = true;
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
    (void)::posix_fadvise(f.buffered, 0, 0, POSIX_FADV_SEQUENTIAL);  // a larger read-ahead window
    if (direct) f.direct = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);  // -1 where the file system has none
    return files[path.string()] = f;
  }
};

CheckedReader::CheckedReader(int64_t span, bool direct, int readers) : impl_(std::make_unique<Impl>()) {
  impl_->direct = direct;
  offload::IoOptions o;
  o.queue_depth = 32;
  impl_->span = std::max<int64_t>(span, kCrcBlock);
  for (int r = 0; r < std::max(1, readers); ++r) impl_->io.push_back(offload::make_io_engine(o));
  // Not zeroed: every byte is read into before it is checked. Registered (pinned) only for O_DIRECT,
  // which uses it: a buffered read's pages are faulted in by the reads themselves, on the reader
  // threads, instead of all before the first read (0.08-0.18 s for 128 MiB here).
  impl_->slots = impl_->io.size() + 2;
  impl_->ring = std::make_unique<offload::AlignedBuffer>(impl_->span * static_cast<int64_t>(impl_->slots),
                                                         /*zeroed=*/false);
  if (direct)
    for (auto& io : impl_->io) io->register_buffer(impl_->ring->data(), impl_->ring->size());
}

CheckedReader::~CheckedReader() = default;

void CheckedReader::read(const std::filesystem::path& path, const SavedFile& f, int64_t offset, int64_t n, char* out) {
  read_many({{path, &f, offset, n, out}});
}

int64_t CheckedReader::buffer_bytes() const { return impl_->span * static_cast<int64_t>(impl_->slots); }

void CheckedReader::read_many(const std::vector<Read>& reads, const Sink& sink) {
  // The spans to read, in order: whole CRC blocks [b0, b1) of one request's file.
  struct Task {
    size_t read;
    int64_t b0, b1;
  };
  std::vector<Task> tasks;
  std::vector<Impl::Fds*> fds;
  for (size_t i = 0; i < reads.size(); ++i) {
    const Read& r = reads[i];
    fds.push_back(&impl_->open(r.path));  // here: the producer below only reads
    if (r.n <= 0) continue;
    const SavedFile& f = *r.file;
    if (f.crc_block > impl_->span || f.crc_block <= 0) {
      throw Error(fmt::format("checkpoint: {}: CRC blocks of {} bytes", r.path.string(), f.crc_block));
    }
    if (r.offset < 0 || r.offset + r.n > f.bytes) {  // else a block past the end would be checked
      throw Error(fmt::format("checkpoint: {}: bytes {}..{} lie outside its {} bytes (the manifest does not match "
                              "the file)",
                              r.path.string(), r.offset, r.offset + r.n, f.bytes));
    }
    const int64_t per_span = std::max<int64_t>(1, impl_->span / f.crc_block);
    const int64_t first = r.offset / f.crc_block, last = (r.offset + r.n - 1) / f.crc_block;
    for (int64_t b0 = first; b0 <= last; b0 += per_span) tasks.push_back({i, b0, std::min(last + 1, b0 + per_span)});
  }
  if (tasks.empty()) return;
  // Reads task t's blocks into `block`: whole aligned blocks through O_DIRECT, the rest (a file's
  // short tail) with pread.
  auto fetch = [&](offload::IoEngine& io, const Task& t, char* block) {
    const Read& r = reads[t.read];
    const SavedFile& f = *r.file;
    const Impl::Fds& fd = *fds[t.read];
    const int64_t at = t.b0 * f.crc_block, len = std::min(t.b1 * f.crc_block, f.bytes) - at;
    if (len <= 0) throw Error(fmt::format("checkpoint: {} is truncated: byte {} is past its end", r.path.string(), at));
    int64_t direct = fd.direct >= 0 && !r.cached && !r.drop && f.crc_block % offload::kIoAlign == 0 ? len / offload::kIoAlign * offload::kIoAlign : 0;
    if (direct > 0) {
      try {
        io.read(fd.direct, r.path.string(), block, direct, at);
      } catch (const offload::IoError& e) {
        throw Error(fmt::format("checkpoint: {} is truncated or unreadable: {}", r.path.string(), e.what()));
      }
    }
    for (int64_t got = direct; got < len;) {
      const ssize_t k = ::pread(fd.buffered, block + got, static_cast<size_t>(len - got), at + got);
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) {
        throw Error(fmt::format("checkpoint: {} is truncated: bytes {}..{} cannot be read", r.path.string(), at + got,
                                at + len));
      }
      got += k;
    }
    // Clean pages leave the cache at once: what stays there is what a second read will want. Only
    // whole blocks within the read's own bytes: a block it shares with the read beside it is
    // checked whole again when that one is read again.
    if (r.drop) {
      const int64_t cb = f.crc_block, end = std::min(at + len, r.offset + r.n);
      const int64_t lo = (std::max(at, r.offset) + cb - 1) / cb * cb, hi = end == f.bytes ? end : end / cb * cb;
      if (hi > lo) (void)::posix_fadvise(fd.buffered, lo, hi - lo, POSIX_FADV_DONTNEED);
    }
  };
  // Reader threads keep the disk busy a few spans ahead (a ring of buffers) while this thread checks
  // the CRCs and copies the bytes out. Reader r of R fetches spans r, r + R, …: while one waits
  // for its span's last requests, the other's are already in flight, so the device sees one
  // unbroken run of requests (a virtual disk's host reads ahead of such runs, and a drained queue
  // costs a disk its depth at every span's end).
  const size_t slots = impl_->slots;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<bool> ready(tasks.size(), false);
  size_t consumed = 0;
  bool stop = false;
  std::exception_ptr failure;
  const size_t n_readers = impl_->io.size();
  auto read_loop = [&](size_t first) {
    for (size_t t = first; t < tasks.size(); t += n_readers) {
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stop || t - consumed < slots; });
        if (stop) return;
      }
      try {
        fetch(*impl_->io[first], tasks[t], impl_->slot(t % slots));
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!failure) failure = std::current_exception();
        cv.notify_all();
        return;
      }
      std::lock_guard<std::mutex> lock(mu);
      ready[t] = true;
      cv.notify_all();
    }
  };
  std::vector<std::thread> readers;
  readers.reserve(n_readers);
  struct Join {  // an error below (or a reader that cannot start) stops and joins the readers
    std::vector<std::thread>& th;
    std::mutex& mu;
    std::condition_variable& cv;
    bool& stop;
    ~Join() {
      {
        std::lock_guard<std::mutex> lock(mu);
        stop = true;
      }
      cv.notify_all();
      for (auto& t : th) t.join();
    }
  } join{readers, mu, cv, stop};
  for (size_t r = 0; r < n_readers && r < tasks.size(); ++r) readers.emplace_back(read_loop, r);
  for (size_t t = 0; t < tasks.size(); ++t) {
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return ready[t] || failure; });
      if (!ready[t]) std::rethrow_exception(failure);
    }
    const Read& r = reads[tasks[t].read];
    const SavedFile& f = *r.file;
    const int64_t at = tasks[t].b0 * f.crc_block;
    const char* block = impl_->slot(t % slots);
    for (int64_t b = tasks[t].b0; b < tasks[t].b1; ++b) {
      const int64_t bat = b * f.crc_block, blen = std::min(f.crc_block, f.bytes - bat);
      const char* p = block + (bat - at);
      if (static_cast<size_t>(b) >= f.block_crcs.size() || offload::crc32c(p, static_cast<size_t>(blen)) != f.block_crcs[b]) {
        throw Error(fmt::format("checkpoint: {} is corrupted: bytes {}..{} do not match their CRC32C", r.path.string(),
                                bat, bat + blen));
      }
      const int64_t lo = std::max(bat, r.offset), hi = std::min(bat + blen, r.offset + r.n);
      if (lo >= hi) continue;
      if (r.out) {
        std::memcpy(r.out + (lo - r.offset), p + (lo - bat), static_cast<size_t>(hi - lo));
      } else if (sink) {
        sink(tasks[t].read, lo - r.offset, p + (lo - bat), hi - lo);
      }
    }
    std::lock_guard<std::mutex> lock(mu);
    consumed = t + 1;
    cv.notify_all();
  }
}

void read_checked(const std::filesystem::path& path, const SavedFile& f, int64_t offset, int64_t n, char* out) {
  // One reader thread and spans sized to the read (a few blocks, as a rank's random number
  // generators are), not the 128 MiB ring of a whole state's reads.
  const int64_t block = std::max<int64_t>(f.crc_block, 1);
  CheckedReader r(std::max(block, std::min<int64_t>(32 << 20, (n / block + 2) * block)), /*direct=*/true, /*readers=*/1);
  r.read(path, f, offset, n, out);
}

bool read_mapped(const std::vector<CheckedReader::Read>& reads, const CheckedReader::Sink& sink, int64_t piece) {
  // Every file mapped before any byte goes out: one that cannot be leaves the reads to the caller.
  std::map<std::string, std::unique_ptr<offload::MappedFile>> maps;
  for (const auto& r : reads) {
    auto& m = maps[r.path.string()];
    if (m || r.n <= 0) continue;
    try {
      m = std::make_unique<offload::MappedFile>(r.path.string(), r.file->bytes);
    } catch (const Error&) {
      return false;
    }
    if (m->file_size() != r.file->bytes) {
      throw Error(fmt::format("checkpoint: {} changed after it was checked: {} bytes, the manifest says {}",
                              r.path.string(), m->file_size(), r.file->bytes));
    }
  }
  // Mappings fault the bytes in one window at a time on this thread: from the disk that is about
  // half what the caller's reader threads get (a cold 3 GB file here: 0.70 GB/s against 1.5). So
  // where the page cache no longer holds most of the bytes (a state beyond it), the caller reads.
  int64_t want = 0;
  double held = 0;
  for (const auto& r : reads) {
    if (r.n <= 0) continue;
    want += r.n;
    held += maps.at(r.path.string())->resident_fraction(r.offset, r.offset + r.n) * static_cast<double>(r.n);
  }
  if (want > 0 && held < 0.9 * static_cast<double>(want)) return false;
  // Windows of 32 MiB mapped at a time (the next one read ahead, in case the page cache let the
  // bytes go), unmapped once used: the resident set holds about one window. Pieces of `piece`
  // bytes (whole blocks, at least one) go out at once, then their CRC32Cs are checked.
  constexpr int64_t kWindow = 32 << 20;
  for (size_t i = 0; i < reads.size(); ++i) {
    const CheckedReader::Read& r = reads[i];
    if (r.n <= 0) continue;
    const SavedFile& f = *r.file;
    const std::string path = r.path.string();
    const offload::MappedFile& m = *maps.at(path);
    const int64_t cb = f.crc_block;
    if (cb <= 0 || kWindow % cb != 0) throw Error(fmt::format("checkpoint: {}: CRC blocks of {} bytes", path, cb));
    const int64_t first = r.offset / cb, last = (r.offset + r.n - 1) / cb;
    // Blocks [b0, b1) against the manifest's CRC32Cs, after their bytes went out.
    auto verify = [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t bat = b * cb, blen = std::min(cb, f.bytes - bat);
        const uint32_t crc = offload::crc32c(m.data() + bat, static_cast<size_t>(blen));
        if (m.lost()) {
          throw Error(fmt::format("checkpoint: {} was truncated (or could not be read) while it was read again "
                                  "(bytes {}..{})",
                                  path, bat, bat + blen));
        }
        if (crc != f.block_crcs[b]) {
          throw Error(fmt::format("checkpoint: {} changed after it was checked: bytes {}..{} no longer match their "
                                  "CRC32C",
                                  path, bat, bat + blen));
        }
      }
    };
    int64_t win_lo = 0, win_hi = 0;
    for (int64_t b0 = first; b0 <= last;) {
      const int64_t at0 = b0 * cb;
      if (at0 >= f.bytes || last >= static_cast<int64_t>(f.block_crcs.size())) {
        throw Error(fmt::format("checkpoint: {} is truncated: byte {} is past its end", path, at0));
      }
      if (at0 >= win_hi) {
        if (win_hi > 0) m.drop(win_lo, at0);
        win_lo = at0;
        win_hi = std::min(f.bytes, at0 + kWindow);
        m.will_need(win_hi, std::min(f.bytes, win_hi + kWindow));
      }
      const int64_t b1 = std::min({last + 1, b0 + std::max<int64_t>(1, piece / cb), (win_hi + cb - 1) / cb});
      const int64_t lo = std::max(at0, r.offset), hi = std::min({b1 * cb, f.bytes, r.offset + r.n});
      const char* p = m.data() + lo;
      try {
        if (r.out) {
          std::memcpy(r.out + (lo - r.offset), p, static_cast<size_t>(hi - lo));
        } else if (sink) {
          sink(i, lo - r.offset, p, hi - lo);
        }
      } catch (...) {
        verify(b0, b1);  // a truncated or changed file is the cause to name, when it is one
        throw;
      }
      // Checked after they went out: a block changed since the first pass is found (unless it was
      // changed back meanwhile), and what a failure leaves, partly applied state, is what a failure
      // before the block would have left too.
      verify(b0, b1);
      b0 = b1;
    }
    // The pages used go, but for a last block the next read shares.
    const CheckedReader::Read* next = i + 1 < reads.size() ? &reads[i + 1] : nullptr;
    const bool shared = next && next->path == r.path && next->n > 0 && next->offset / cb == last;
    m.drop(win_lo, shared ? last * cb : std::min(f.bytes, (last + 1) * cb));
  }
  return true;
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
