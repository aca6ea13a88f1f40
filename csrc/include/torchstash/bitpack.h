// Packing of unsigned codes at 1, 2, 4 or 8 bits per element, host and device.
//
// Layout shared by the CPU loop, the CUDA kernel and the Python reference
// (torchstash.kernels.reference.pack_bits_ref / unpack_bits_ref):
//   element i lives in byte (i * bits) / 8 at bit shift (i * bits) % 8, i.e. the
//   first element of a byte takes its lowest bits (little-endian within a byte);
//   the packed length is ceil(n * bits / 8) and unused trailing bits are zero.
// Only the low `bits` bits of a code are stored (a bitfield store): checking the
// range would cost a device synchronisation on CUDA.
#pragma once

#include <cstring>

#include "torchstash/common.h"

#if !defined(__CUDA_ARCH__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "torchstash's bitpack fast paths assume a little-endian host"
#endif

namespace torchstash {
namespace bitpack {

TS_HD bool valid_bits(int bits) { return bits == 1 || bits == 2 || bits == 4 || bits == 8; }
TS_HD int codes_per_byte(int bits) { return 8 / bits; }
TS_HD std::uint8_t code_mask(int bits) { return static_cast<std::uint8_t>((1u << bits) - 1u); }

// ceil(n * bits / 8), written so that n * bits cannot overflow.
TS_HD index_t packed_size(index_t n, int bits) { return ceil_div(n, codes_per_byte(bits)); }

// Byte j of the packed form of codes[0, n): the generic, bounds-checked definition.
TS_HD std::uint8_t pack_byte(const std::uint8_t* codes, index_t n, index_t j, int bits) {
  const int per = codes_per_byte(bits);
  const std::uint8_t mask = code_mask(bits);
  const index_t first = j * per;
  unsigned out = 0;
  for (int k = 0; k < per && first + k < n; ++k) {
    out |= static_cast<unsigned>(codes[first + k] & mask) << (k * bits);
  }
  return static_cast<std::uint8_t>(out);
}

// Code i of a packed buffer: the generic definition.
TS_HD std::uint8_t unpack_code(const std::uint8_t* packed, index_t i, int bits) {
  const int per = codes_per_byte(bits);
  const int shift = static_cast<int>(i % per) * bits;
  return static_cast<std::uint8_t>((packed[i / per] >> shift) & code_mask(bits));
}

// Little-endian load/store of a T at any byte address: a single (unaligned) move on
// the host, byte by byte on the device, where unaligned wide accesses fault.
template <typename T>
TS_HD T load_le(const std::uint8_t* p) {
#if defined(__CUDA_ARCH__)
  T v = 0;
  for (unsigned k = 0; k < sizeof(T); ++k) v = static_cast<T>(v | (static_cast<T>(p[k]) << (8 * k)));
  return v;
#else
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
#endif
}

template <typename T>
TS_HD void store_le(std::uint8_t* p, T v) {
#if defined(__CUDA_ARCH__)
  for (unsigned k = 0; k < sizeof(T); ++k) p[k] = static_cast<std::uint8_t>(v >> (8 * k));
#else
  std::memcpy(p, &v, sizeof(T));
#endif
}

// Fast paths for a full byte (all 8 / BITS codes present), SWAR on one word; they
// agree with pack_byte / unpack_code (tests/test_kernels_headers.py checks every byte).
template <int BITS>
TS_HD std::uint8_t pack_full(const std::uint8_t* c);

template <>
TS_HD std::uint8_t pack_full<1>(const std::uint8_t* c) {
  // Byte k's low bit moves to bit 56 + k; the partial products never overlap.
  const std::uint64_t x = load_le<std::uint64_t>(c) & 0x0101010101010101ull;
  return static_cast<std::uint8_t>((x * 0x0102040810204080ull) >> 56);
}

template <>
TS_HD std::uint8_t pack_full<2>(const std::uint8_t* c) {
  // Byte k's two low bits move to bits 24 + 2k; the partial products never overlap.
  const std::uint32_t x = load_le<std::uint32_t>(c) & 0x03030303u;
  return static_cast<std::uint8_t>((x * 0x01041040u) >> 24);
}

template <>
TS_HD std::uint8_t pack_full<4>(const std::uint8_t* c) {
  return static_cast<std::uint8_t>((c[0] & 0x0Fu) | ((c[1] & 0x0Fu) << 4));
}

template <>
TS_HD std::uint8_t pack_full<8>(const std::uint8_t* c) {
  return c[0];
}

// Writes the 8 / BITS codes held by byte b to out[0, 8 / BITS).
template <int BITS>
TS_HD void unpack_full(std::uint8_t b, std::uint8_t* out);

template <>
TS_HD void unpack_full<1>(std::uint8_t b, std::uint8_t* out) {
  // Replicate b into every byte, keep bit k in byte k, then turn "non-zero" into 1.
  const std::uint64_t x = (static_cast<std::uint64_t>(b) * 0x0101010101010101ull) & 0x8040201008040201ull;
  store_le<std::uint64_t>(out, ((x + 0x7F7F7F7F7F7F7F7Full) >> 7) & 0x0101010101010101ull);
}

template <>
TS_HD void unpack_full<2>(std::uint8_t b, std::uint8_t* out) {
  const std::uint32_t v = b;
  store_le<std::uint32_t>(out, (v | (v << 6) | (v << 12) | (v << 18)) & 0x03030303u);
}

template <>
TS_HD void unpack_full<4>(std::uint8_t b, std::uint8_t* out) {
  store_le<std::uint16_t>(out, static_cast<std::uint16_t>((b & 0x0Fu) | ((b & 0xF0u) << 4)));
}

template <>
TS_HD void unpack_full<8>(std::uint8_t b, std::uint8_t* out) {
  out[0] = b;
}

}  // namespace bitpack
}  // namespace torchstash
