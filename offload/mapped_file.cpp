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

#include <fmt/format.h>

#include "engine/error.h"

namespace zeal::offload {

namespace {

// The live mappings the SIGBUS handler knows, in fixed slots it reads without locks.
constexpr int kSlots = 256;
struct Slot {
  std::atomic<uintptr_t> begin{0}, end{0};
  std::atomic<bool> lost{false};
};
Slot g_slots[kSlots];
struct sigaction g_previous {};
std::once_flag g_installed;
std::mutex g_slots_mu;  // taking and giving back slots (not the handler)
uintptr_t g_page = 4096;

void on_sigbus(int sig, siginfo_t* info, void* ctx) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(info->si_addr);
  for (Slot& s : g_slots) {
    const uintptr_t b = s.begin.load(std::memory_order_acquire), e = s.end.load(std::memory_order_acquire);
    if (b == 0 || a < b || a >= e) continue;
    // A page of zeros in place of the one past the file's end; the access is retried and reads it.
    void* at = reinterpret_cast<void*>(a & ~(g_page - 1));
    if (::mmap(at, g_page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) != MAP_FAILED) {
      s.lost.store(true, std::memory_order_release);
      return;
    }
    break;
  }
  // Not ours (or no page could be put there): what was there before.
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction) return g_previous.sa_sigaction(sig, info, ctx);
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    return g_previous.sa_handler(sig);
  }
  // The default action: a faulting access runs again and ends the process as it would have; a
  // SIGBUS sent by a process (no access to run again) is sent again.
  ::signal(SIGBUS, SIG_DFL);
  if (info->si_code <= 0) ::raise(sig);
}

void install() {
  std::call_once(g_installed, [] {
    g_page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
    struct sigaction sa {};
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGBUS, &sa, &g_previous);
  });
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
  std::lock_guard<std::mutex> lock(g_slots_mu);
  for (int k = 0; k < kSlots; ++k) {
    if (g_slots[k].begin.load() != 0) continue;
    slot_ = k;
    g_slots[k].lost.store(false);
    g_slots[k].end.store(reinterpret_cast<uintptr_t>(data_) + mapped_);
    g_slots[k].begin.store(reinterpret_cast<uintptr_t>(data_), std::memory_order_release);
    return;
  }
  ::munmap(p, static_cast<size_t>(mapped_));
  ::close(fd_);
  throw Error(fmt::format("{} cannot be mapped: {} files are mapped already", path, kSlots));
}

MappedFile::~MappedFile() {
  {
    std::lock_guard<std::mutex> lock(g_slots_mu);
    g_slots[slot_].begin.store(0, std::memory_order_release);
    g_slots[slot_].end.store(0);
  }
  ::munmap(data_, static_cast<size_t>(mapped_));
  ::close(fd_);
}

bool MappedFile::lost() const { return g_slots[slot_].lost.load(std::memory_order_acquire); }

int64_t MappedFile::file_size() const {
  struct stat st {};
  return ::fstat(fd_, &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
}

void MappedFile::drop(int64_t begin, int64_t end) const {
  const int64_t b = (std::max<int64_t>(begin, 0) + g_page - 1) / g_page * g_page;
  const int64_t e = end >= size_ ? mapped_ : end / g_page * g_page;
  if (e > b) (void)::madvise(data_ + b, static_cast<size_t>(e - b), MADV_DONTNEED);
}

}  // namespace zeal::offload
