#include "offload/mapped_file.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <vector>

#include <fmt/format.h>

#include "engine/error.h"

namespace zeal::offload {

namespace {

// The live mappings the SIGBUS handler knows, in fixed slots it reads without locks: each slot's
// sequence is odd while its range changes (a seqlock), so the handler never sees a torn range.
constexpr int kSlots = 256;
struct Slot {
  std::atomic<uint64_t> seq{0};
  std::atomic<uintptr_t> begin{0}, end{0};
  std::atomic<bool> lost{false};
};
static_assert(std::atomic<uintptr_t>::is_always_lock_free && std::atomic<uint64_t>::is_always_lock_free);
Slot g_slots[kSlots];
struct sigaction g_previous {};  // the disposition before ours (written under g_mu, before ours is in)
std::mutex g_mu;                 // installing, taking and giving back slots (never the handler)
uintptr_t g_page = 4096;

void set_slot(Slot& s, uintptr_t begin, uintptr_t end) {
  s.seq.fetch_add(1, std::memory_order_acq_rel);  // odd: changing
  s.begin.store(begin, std::memory_order_release);
  s.end.store(end, std::memory_order_release);
  s.seq.fetch_add(1, std::memory_order_acq_rel);  // even again
}

void on_sigbus(int sig, siginfo_t* info, void* ctx) {
  const int saved_errno = errno;
  const uintptr_t a = reinterpret_cast<uintptr_t>(info->si_addr);
  for (Slot& s : g_slots) {
    const uint64_t q = s.seq.load(std::memory_order_acquire);
    const uintptr_t b = s.begin.load(std::memory_order_acquire), e = s.end.load(std::memory_order_acquire);
    if ((q & 1) || s.seq.load(std::memory_order_acquire) != q) continue;  // changing: not a live mapping's
    if (b == 0 || a < b || a >= e) continue;
    // A page of zeros in place of the one past the file's end; the access is retried and reads it.
    void* at = reinterpret_cast<void*>(a & ~(g_page - 1));
    if (::mmap(at, g_page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) != MAP_FAILED) {
      s.lost.store(true, std::memory_order_release);
      errno = saved_errno;
      return;
    }
    break;
  }
  // Not ours: the disposition from before comes back, with its own semantics. A faulting access
  // runs again and meets it (an ignored fault ends the process, as the kernel decides); a SIGBUS
  // sent by a process is sent again and delivered to it once this handler returns. The next
  // MappedFile puts this handler back, in front of whatever is there then.
  ::sigaction(SIGBUS, &g_previous, nullptr);
  if (info->si_code <= 0) ::raise(sig);
  (void)ctx;
  errno = saved_errno;
}

// Puts the handler in front of the current disposition, unless it is there already.
void install() {
  std::lock_guard<std::mutex> lock(g_mu);
  struct sigaction cur {};
  ::sigaction(SIGBUS, nullptr, &cur);
  if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_sigbus) return;
  g_page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  g_previous = cur;
  struct sigaction sa {};
  sa.sa_sigaction = on_sigbus;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGBUS, &sa, nullptr);
}

}  // namespace

MappedFile::MappedFile(const std::string& path, int64_t bytes) : size_(bytes) {
  install();
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) throw Error(fmt::format("{} cannot be opened: {}", path, std::strerror(errno)));
  const int64_t page = ::sysconf(_SC_PAGESIZE);
  mapped_ = (std::max<int64_t>(bytes, 1) + page - 1) / page * page;
  void* p = ::mmap(nullptr, static_cast<size_t>(mapped_), PROT_READ, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) {
    const int e = errno;
    ::close(fd_);
    throw Error(fmt::format("{} cannot be mapped: {}", path, std::strerror(e)));
  }
  data_ = static_cast<char*>(p);
  (void)::madvise(p, static_cast<size_t>(mapped_), MADV_SEQUENTIAL);
  std::lock_guard<std::mutex> lock(g_mu);
  for (int k = 0; k < kSlots; ++k) {
    if (g_slots[k].begin.load() != 0) continue;
    slot_ = k;
    g_slots[k].lost.store(false);
    set_slot(g_slots[k], reinterpret_cast<uintptr_t>(data_), reinterpret_cast<uintptr_t>(data_) + mapped_);
    return;
  }
  ::munmap(p, static_cast<size_t>(mapped_));
  ::close(fd_);
  throw Error(fmt::format("{} cannot be mapped: {} files are mapped already", path, kSlots));
}

MappedFile::~MappedFile() {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    set_slot(g_slots[slot_], 0, 0);  // before the unmapping: no fault in it is ours from here on
  }
  ::munmap(data_, static_cast<size_t>(mapped_));
  ::close(fd_);
}

bool MappedFile::lost() const { return g_slots[slot_].lost.load(std::memory_order_acquire); }

int64_t MappedFile::file_size() const {
  struct stat st {};
  return ::fstat(fd_, &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
}

double MappedFile::resident_fraction(int64_t begin, int64_t end) const {
  const int64_t page = static_cast<int64_t>(g_page);
  const int64_t b = std::max<int64_t>(begin, 0) / page * page, e = std::min(end, mapped_);
  if (e <= b) return 1.0;
  std::vector<unsigned char> in(static_cast<size_t>((e - b + page - 1) / page));
  if (::mincore(data_ + b, static_cast<size_t>(e - b), in.data()) != 0) return 0.0;
  int64_t held = 0;
  for (unsigned char c : in) held += c & 1;
  return static_cast<double>(held) / static_cast<double>(in.size());
}

void MappedFile::will_need(int64_t begin, int64_t end) const {
  const int64_t b = std::max<int64_t>(begin, 0) / static_cast<int64_t>(g_page) * static_cast<int64_t>(g_page);
  const int64_t e = std::min(end, mapped_);
  if (e > b) (void)::madvise(data_ + b, static_cast<size_t>(e - b), MADV_WILLNEED);
}

void MappedFile::drop(int64_t begin, int64_t end) const {
  const int64_t b = (std::max<int64_t>(begin, 0) + g_page - 1) / g_page * g_page;
  const int64_t e = end >= size_ ? mapped_ : end / g_page * g_page;
  if (e > b) (void)::madvise(data_ + b, static_cast<size_t>(e - b), MADV_DONTNEED);
}

}  // namespace zeal::offload
