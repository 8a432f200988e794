// CRC32C (Castagnoli, the iSCSI/ext4 checksum), for checking offloaded state read back from disk
// (aio.verify) and checkpoints. The SSE4.2 instruction where the CPU has it, three independent
// lanes at a time joined by a shift table (about three times one dependent chain), else a table,
// one byte at a time; both give the same value (tested). No LibTorch headers.
#pragma once

#include <cstddef>
#include <cstdint>

namespace zeal::offload {

// The CRC32C of `n` bytes, continuing from `crc` (0 to start): crc32c(b, crc32c(a)) is the CRC of
// a followed by b.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);
// The table version alone (the reference the tests hold the fast one to).
uint32_t crc32c_table(const void* data, size_t n, uint32_t crc = 0);

}  // namespace zeal::offload
