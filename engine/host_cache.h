// A caching allocator for LibTorch's large CPU blocks: the host analogue of the CUDA caching allocator.
//
// Every CPU tensor of 128 KiB and more is a mapping of its own (glibc's threshold as the engine sets
// it), so each step's activations and gradients are fresh pages: a page fault and a page cleared for
// every 4 KiB, every step. The cache keeps freed large blocks by size class (a block's size rounded
// up by at most 1/8) and hands them out again, already resident. It does not make the resident set
// larger than it would be without it: a request takes the smallest cached block that holds it (at most
// twice its size class; the pages past the request are dropped), and one the cache cannot serve, or a
// large mapping zeal makes elsewhere (host_cache_make_room), first returns cached blocks to the system,
// the least recently freed first, as many bytes as it is about to use (or all of them), so the resident
// set grows only when the cache is empty, and then to what is live. (Memory that passes neither way,
// such as glibc's heap of small blocks, pinned or communicator buffers, can still grow beside cached
// blocks.) Cached bytes are also bounded (ZEAL_HOST_CACHE=BYTES; by default a quarter of the machine's
// memory or of the memory cgroup's limit) and given back at phase ends (a MemoryTracker phase's start
// and end, engine.save_state and load_state, the engine's end) and when a mapping fails. Small blocks
// go to LibTorch's allocator.
//
// The engine installs it once per process, before the model is built. The user's choices win: it is
// not installed when ZEAL_HOST_CACHE is 0 or off, when glibc's malloc was tuned (MALLOC_MMAP_THRESHOLD_,
// MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_, MALLOC_MMAP_MAX_, GLIBC_TUNABLES glibc.malloc.*) or another
// malloc preloaded (jemalloc, tcmalloc, mimalloc), or when the program set its own CPU allocator. No
// LibTorch headers here.
#pragma once

#include <cstddef>
#include <cstdint>

namespace c10 {
struct Allocator;
}

namespace zeal {

struct HostCacheStats {
  bool installed = false;
  int64_t cached_bytes = 0;   // freed blocks kept, resident, for reuse
  int64_t peak_cached_bytes = 0;
  int64_t in_use_bytes = 0;   // large blocks handed out and not yet freed
  int64_t limit_bytes = 0;    // the bound on cached_bytes
  int64_t hits = 0, misses = 0;  // large requests served from the cache / mapped afresh
  int64_t released_bytes = 0;    // freed bytes given back to the system (evicted, trimmed, or over the bound)
};

// Installs the cache as LibTorch's CPU allocator (once per process; later calls return the first
// answer). False when the user's settings keep LibTorch's (above). zeal::Error for a ZEAL_HOST_CACHE that is not a byte count, 0 or off.
bool install_host_cache();
HostCacheStats host_cache_stats();
// Gives every cached block back to the system (blocks in use are untouched).
void host_cache_trim();
// The cache as an allocator, for zeal's own large host buffers (gathered units, gradient staging);
// nullptr when it is not installed.
c10::Allocator* host_cache_allocator();
// Before a large mapping the cache does not make (one that must start zeroed, say): gives back cached
// blocks worth `bytes`, so that the mapping does not grow the resident set beside them.
void host_cache_make_room(size_t bytes);

}  // namespace zeal
