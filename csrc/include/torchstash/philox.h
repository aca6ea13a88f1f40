// Counter-based Philox4x32-10 (Salmon et al., SC'11; Random123), host and device.
//
// Layout shared by the CPU loop, the CUDA kernel and the Python reference
// (torchstash.kernels.reference.philox_uniform_ref):
//   key     = (seed_lo32, seed_hi32)
//   counter = (block_lo32, block_hi32, offset_lo32, offset_hi32), block = i / 4
//   element i takes output word i % 4 of its block
//   uniform = (word >> 8) * 2^-24, a float in [0, 1) exact in float32.
#pragma once

#include "torchstash/common.h"

namespace torchstash {
namespace philox {

constexpr std::uint32_t kM0 = 0xD2511F53u;
constexpr std::uint32_t kM1 = 0xCD9E8D57u;
constexpr std::uint32_t kW0 = 0x9E3779B9u;  // golden ratio
constexpr std::uint32_t kW1 = 0xBB67AE85u;  // sqrt(3) - 1
constexpr int kRounds = 10;

struct Words {
  std::uint32_t x0, x1, x2, x3;
};

// High and low 32 bits of the 64-bit product a * b.
TS_HD void mulhilo(std::uint32_t a, std::uint32_t b, std::uint32_t* hi, std::uint32_t* lo) {
#if defined(__CUDA_ARCH__)
  *hi = __umulhi(a, b);
  *lo = a * b;
#else
  const std::uint64_t p = static_cast<std::uint64_t>(a) * static_cast<std::uint64_t>(b);
  *hi = static_cast<std::uint32_t>(p >> 32);
  *lo = static_cast<std::uint32_t>(p);
#endif
}

TS_HD Words round(Words c, std::uint32_t k0, std::uint32_t k1) {
  std::uint32_t hi0, lo0, hi1, lo1;
  mulhilo(kM0, c.x0, &hi0, &lo0);
  mulhilo(kM1, c.x2, &hi1, &lo1);
  return Words{hi1 ^ c.x1 ^ k0, lo1, hi0 ^ c.x3 ^ k1, lo0};
}

// Philox4x32 with kRounds rounds; the key is bumped between rounds (kRounds - 1 times).
TS_HD Words philox4x32_10(Words ctr, std::uint32_t k0, std::uint32_t k1) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int r = 0; r < kRounds; ++r) {
    if (r > 0) {
      k0 += kW0;
      k1 += kW1;
    }
    ctr = round(ctr, k0, k1);
  }
  return ctr;
}

// The four words of block `block` for (seed, offset), in the layout above.
TS_HD Words block_words(std::uint64_t seed, std::uint64_t offset, std::uint64_t block) {
  const Words ctr{static_cast<std::uint32_t>(block), static_cast<std::uint32_t>(block >> 32),
                  static_cast<std::uint32_t>(offset), static_cast<std::uint32_t>(offset >> 32)};
  return philox4x32_10(ctr, static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32));
}

// Top 24 bits of a word as a float in [0, 1); exact (a 24-bit integer times a power of two).
TS_HD float to_uniform(std::uint32_t w) {
  return static_cast<float>(w >> 8) * 5.9604644775390625e-08f;  // 2^-24
}

}  // namespace philox
}  // namespace torchstash
