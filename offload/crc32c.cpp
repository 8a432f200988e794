#include "offload/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace zeal::offload {
namespace {

constexpr uint32_t kPoly = 0x82F63B78;  // 0x1EDC6F41 bit-reversed

constexpr std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = c & 1 ? (c >> 1) ^ kPoly : c >> 1;
    t[i] = c;
  }
  return t;
}
constexpr std::array<uint32_t, 256> kTable = make_table();

#if defined(__x86_64__)
// Three lanes of kLane bytes each are summed at once (the instruction's latency is three times its
// throughput, so one dependent chain leaves two thirds of the unit idle), then joined: for the raw
// register update f, f(x, B) = Z(x) ^ f(0, B) where Z(x) = f(x, kLane zero bytes) is linear in x, so
// the three lanes' registers a, b, c make Z(Z(a) ^ b) ^ c. Z is a table per byte of x.
constexpr size_t kLane = 4096;

struct ShiftTable {
  uint32_t t[4][256];
};

__attribute__((target("sse4.2"))) uint32_t zeros_update(uint32_t x) {
  uint64_t c = x;
  for (size_t i = 0; i < kLane; i += 8) c = _mm_crc32_u64(c, 0);
  return static_cast<uint32_t>(c);
}

__attribute__((target("sse4.2"))) const ShiftTable& shift_table() {
  static const ShiftTable table = [] {
    ShiftTable s{};
    for (int k = 0; k < 4; ++k)
      for (uint32_t b = 0; b < 256; ++b) s.t[k][b] = zeros_update(b << (8 * k));
    return s;
  }();
  return table;
}

inline uint32_t shift(const ShiftTable& s, uint32_t x) {
  return s.t[0][x & 0xFF] ^ s.t[1][(x >> 8) & 0xFF] ^ s.t[2][(x >> 16) & 0xFF] ^ s.t[3][x >> 24];
}

__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(const void* data, size_t n, uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t c = ~crc;
  if (n >= 3 * kLane) {
    const ShiftTable& s = shift_table();
    for (; n >= 3 * kLane; n -= 3 * kLane, p += 3 * kLane) {
      uint64_t c1 = 0, c2 = 0;
      for (size_t i = 0; i < kLane; i += 8) {
        uint64_t v0, v1, v2;
        std::memcpy(&v0, p + i, 8);
        std::memcpy(&v1, p + kLane + i, 8);
        std::memcpy(&v2, p + 2 * kLane + i, 8);
        c = _mm_crc32_u64(c, v0);
        c1 = _mm_crc32_u64(c1, v1);
        c2 = _mm_crc32_u64(c2, v2);
      }
      c = shift(s, shift(s, static_cast<uint32_t>(c)) ^ static_cast<uint32_t>(c1)) ^ static_cast<uint32_t>(c2);
    }
  }
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; n > 0; --n, ++p) c32 = _mm_crc32_u8(c32, *p);
  return ~c32;
}
#endif

}  // namespace

uint32_t crc32c_table(const void* data, size_t n, uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
  for (size_t i = 0; i < n; ++i) c = kTable[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return ~c;
}

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
#if defined(__x86_64__)
  static const bool sse42 = __builtin_cpu_supports("sse4.2");
  if (sse42) return crc32c_sse42(data, n, crc);
#endif
  return crc32c_table(data, n, crc);
}

}  // namespace zeal::offload
