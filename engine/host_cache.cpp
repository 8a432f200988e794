#include "engine/host_cache.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/error.h"
#include "engine/memory_budget.h"

namespace zeal {
namespace {

constexpr size_t kLarge = 128 << 10;  // glibc's mmap threshold as the engine sets it
constexpr size_t kPage = 4096;

// The size class of a large request: rounded up to a page, then to 1/8 of its power of two.
size_t size_class(size_t n) {
  size_t p2 = 1;
  while (p2 <= n / 2) p2 <<= 1;
  const size_t g = std::max(kPage, p2 / 8);
  return (n + g - 1) / g * g;
}

class HostCache;
HostCache* g_cache = nullptr;  // lives as long as the process: tensors may outlive everything

class HostCache final : public c10::Allocator {
 public:
  HostCache(c10::Allocator* small, size_t limit) : small_(small), limit_(limit) {}

  c10::DataPtr allocate(size_t n) override {
    if (n < kLarge) return small_->allocate(n);
    const size_t cls = size_class(n), need = (n + kPage - 1) / kPage * kPage;
    std::vector<std::pair<void*, size_t>> release;
    void* p = nullptr;
    size_t got = cls, tail = 0;  // tail: resident bytes past `need` to drop from a reused block
    {
      std::lock_guard lock(mu_);
      // The smallest cached block that holds n, if it is at most twice the class.
      auto it = free_.lower_bound(cls);
      if (it != free_.end() && it->first <= 2 * cls) {
        got = it->first;
        const Cached c = it->second.back();
        it->second.pop_back();
        if (it->second.empty()) free_.erase(it);
        lru_.erase(c.seq);
        p = c.p;
        cached_ -= c.extent;
        tail = c.extent > need ? c.extent - need : 0;
        ++hits_;
      } else {
        ++misses_;
        evict(need, release);
      }
      in_use_ += need;
    }
    for (auto [q, bytes] : release) ::munmap(q, bytes);
    // A block reused for less than it held before: what lies past the request leaves the resident set,
    // so that every block in use holds at most its request's pages, as a fresh mapping would.
    if (tail > 0) ::madvise(static_cast<char*>(p) + need, tail, MADV_DONTNEED);
    if (!p) p = map(cls, need);
    {
      std::lock_guard lock(mu_);
      live_.emplace(p, std::make_pair(got, need));
    }
    // data == context and one deleter for every block, as LibTorch's raw_allocate/raw_deallocate need.
    return {p, p, &HostCache::free_block, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &HostCache::free_block; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  void make_room(size_t bytes) {
    std::vector<std::pair<void*, size_t>> release;
    {
      std::lock_guard lock(mu_);
      evict(bytes, release);
    }
    for (auto [q, b] : release) ::munmap(q, b);
  }

  void trim() {
    std::vector<std::pair<void*, size_t>> release;
    {
      std::lock_guard lock(mu_);
      for (auto& [cls, blocks] : free_) {
        for (const Cached& c : blocks) release.emplace_back(c.p, cls);
      }
      free_.clear();
      lru_.clear();
      released_ += cached_;
      cached_ = 0;
    }
    for (auto [q, bytes] : release) ::munmap(q, bytes);
  }

  HostCacheStats stats() {
    std::lock_guard lock(mu_);
    HostCacheStats s;
    s.installed = true;
    s.cached_bytes = static_cast<int64_t>(cached_);
    s.peak_cached_bytes = static_cast<int64_t>(peak_cached_);
    s.in_use_bytes = static_cast<int64_t>(in_use_);
    s.limit_bytes = static_cast<int64_t>(limit_);
    s.hits = hits_;
    s.misses = misses_;
    s.released_bytes = static_cast<int64_t>(released_);
    return s;
  }

  // fork() while another thread holds the lock would leave the child's copy locked forever.
  void lock_for_fork() { mu_.lock(); }
  void unlock_after_fork() { mu_.unlock(); }

 private:
  // Never grow the resident set beside cached blocks: takes out, least recently freed first, blocks
  // holding `bytes` (or all there are), to be unmapped by the caller outside the lock.
  void evict(size_t bytes, std::vector<std::pair<void*, size_t>>& release) {
    size_t freed = 0;
    while (!lru_.empty() && freed < bytes) {
      const auto [cls, q] = lru_.begin()->second;
      lru_.erase(lru_.begin());
      auto f = free_.find(cls);
      auto b = std::find_if(f->second.begin(), f->second.end(), [q = q](const Cached& c) { return c.p == q; });
      freed += b->extent;
      f->second.erase(b);
      if (f->second.empty()) free_.erase(f);
      release.emplace_back(q, cls);
    }
    cached_ -= freed;
    released_ += freed;
  }

  void* map(size_t bytes, size_t need) {
    for (int attempt = 0; attempt < 2; ++attempt) {
      void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p != MAP_FAILED) return p;
      trim();  // memory is short: what the cache keeps goes first
    }
    {
      std::lock_guard lock(mu_);
      in_use_ -= need;
    }
    TORCH_CHECK_WITH(OutOfMemoryError, false, "zeal's host allocator: not enough memory: you tried to allocate ", bytes,
                     " bytes (", std::strerror(errno), ")");
  }

  // Frees a block of either kind: a large one (the cache's) or a small one (LibTorch's, reaching here
  // through raw_deallocate).
  static void free_block(void* p) {
    HostCache* c = g_cache;
    bool keep = false;
    size_t cls = 0;
    {
      std::unique_lock lock(c->mu_);
      auto it = c->live_.find(p);
      if (it == c->live_.end()) {
        lock.unlock();
        c->small_->raw_deallocate(p);
        return;
      }
      cls = it->second.first;
      const size_t extent = it->second.second;
      c->live_.erase(it);
      c->in_use_ -= extent;
      if (c->cached_ + extent <= c->limit_) {
        const uint64_t seq = c->next_seq_++;
        c->free_[cls].push_back({seq, p, extent});
        c->lru_.emplace(seq, std::make_pair(cls, p));
        c->cached_ += extent;
        c->peak_cached_ = std::max(c->peak_cached_, c->cached_);
        keep = true;
      } else {
        c->released_ += extent;
      }
    }
    if (!keep) ::munmap(p, cls);
  }

  c10::Allocator* small_;
  std::unordered_map<void*, std::pair<size_t, size_t>> live_;  // large blocks handed out: size, bytes asked (pages)
  size_t limit_;
  std::mutex mu_;
  // Cached blocks by size, the most recently freed last, with the bytes their last use could have made
  // resident; and all of them by when they were freed, for giving back the oldest first.
  struct Cached {
    uint64_t seq;
    void* p;
    size_t extent;
  };
  std::map<size_t, std::vector<Cached>> free_;
  std::map<uint64_t, std::pair<size_t, void*>> lru_;
  uint64_t next_seq_ = 0;
  size_t cached_ = 0, peak_cached_ = 0, in_use_ = 0, released_ = 0;
  int64_t hits_ = 0, misses_ = 0;
};


// ZEAL_HOST_CACHE: unset or on (a quarter of the machine's memory), 0/off/false, or bytes (K, M, G).
std::optional<size_t> configured_limit() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  size_t quarter = pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page) / 4 : size_t{1} << 30;
  if (const int64_t cg = cgroup_memory_limit(); cg > 0) quarter = std::min(quarter, static_cast<size_t>(cg) / 4);
  const char* env = std::getenv("ZEAL_HOST_CACHE");
  if (!env || !*env) return quarter;
  std::string v(env);
  for (auto& ch : v) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (v == "0" || v == "off" || v == "false" || v == "no") return std::nullopt;
  if (v == "on" || v == "true" || v == "yes" || v == "1") return quarter;
  size_t digits = 0;
  while (digits < v.size() && std::isdigit(static_cast<unsigned char>(v[digits]))) ++digits;
  const std::string unit = v.substr(digits);
  const size_t scale = unit.empty() || unit == "b" ? 1
                       : unit == "k" || unit == "kib" ? size_t{1} << 10
                       : unit == "m" || unit == "mib" ? size_t{1} << 20
                       : unit == "g" || unit == "gib" ? size_t{1} << 30
                                                      : 0;
  if (digits == 0 || digits > 15 || scale == 0 || std::stoull(v.substr(0, digits)) > (size_t{1} << 50) / scale) {
    throw Error("ZEAL_HOST_CACHE='" + std::string(env) +
                "': expected on, off, 0, or the most bytes the host allocator may cache (e.g. 2G)");
  }
  return static_cast<size_t>(std::stoull(v.substr(0, digits))) * scale;
}

// The user's own malloc settings: glibc's thresholds (MALLOC_MMAP_THRESHOLD_, MALLOC_TOP_PAD_,
// GLIBC_TUNABLES glibc.malloc.*) or another malloc preloaded (jemalloc, tcmalloc, mimalloc).
bool user_chose_malloc() {
  for (const char* v : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_"}) {
    if (std::getenv(v)) return true;
  }
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (tunables && std::strstr(tunables, "glibc.malloc.")) return true;
  const char* preload = std::getenv("LD_PRELOAD");
  return preload && (std::strstr(preload, "jemalloc") || std::strstr(preload, "tcmalloc") || std::strstr(preload, "mimalloc"));
}

}  // namespace

bool install_host_cache() {
  static const bool installed = [] {
    const auto limit = configured_limit();
    if (!limit || user_chose_malloc()) return false;
    c10::Allocator* current = c10::GetCPUAllocator();
    if (current != c10::GetDefaultCPUAllocator()) return false;  // the program chose its own
    auto* cache = new HostCache(current, *limit);
    // The highest priority: LibTorch ignores a lower one once anything (zeal's memory counter, say)
    // set its allocator at 255. Only LibTorch's default is ever replaced (checked above).
    c10::SetCPUAllocator(cache, /*priority=*/255);
    if (c10::GetCPUAllocator() != cache) {
      delete cache;
      return false;
    }
    g_cache = cache;
    ::pthread_atfork([] { g_cache->lock_for_fork(); }, [] { g_cache->unlock_after_fork(); },
                     [] { g_cache->unlock_after_fork(); });
    return true;
  }();
  return installed;
}

HostCacheStats host_cache_stats() { return g_cache ? g_cache->stats() : HostCacheStats{}; }

void host_cache_trim() {
  if (g_cache) g_cache->trim();
}

c10::Allocator* host_cache_allocator() { return g_cache; }

void host_cache_make_room(size_t bytes) {
  if (g_cache) g_cache->make_room(bytes);
}

}  // namespace zeal
