// OpenMP loop over the inline philox.h functions: one task per range of 4-word blocks.
//
// Within a task, kLanes blocks advance through the rounds together (structure of
// arrays), so the compiler vectorizes the 32x32->64-bit products across blocks.
#include <algorithm>

#include "clones.h"
#include "torchstash/cpu_kernels.h"
#include "torchstash/philox.h"

namespace torchstash {
namespace cpu {
namespace detail {

constexpr index_t kGrainBlocks = index_t{1} << 14;  // 64K floats per task
constexpr int kLanes = 8;

void store_block(float* out, index_t n, index_t block, const philox::Words& w) {
  const std::uint32_t words[4] = {w.x0, w.x1, w.x2, w.x3};
  const index_t i = block * 4;
  const int count = static_cast<int>(std::min<index_t>(4, n - i));
  for (int k = 0; k < count; ++k) out[i + k] = philox::to_uniform(words[k]);
}

// Blocks [lo, hi) of the stream into out (n elements in all).
TS_CPU_CLONES void philox_range(float* out, index_t n, index_t lo, index_t hi, std::uint64_t seed,
                                std::uint64_t offset) {
  const auto off_lo = static_cast<std::uint32_t>(offset);
  const auto off_hi = static_cast<std::uint32_t>(offset >> 32);
  const index_t full_hi = std::min(hi, n / 4);  // blocks whose 4 elements are all wanted
  index_t b0 = lo;
  for (; b0 + kLanes <= full_hi; b0 += kLanes) {
    std::uint32_t c0[kLanes], c1[kLanes], c2[kLanes], c3[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      const auto b = static_cast<std::uint64_t>(b0 + l);
      c0[l] = static_cast<std::uint32_t>(b);
      c1[l] = static_cast<std::uint32_t>(b >> 32);
      c2[l] = off_lo;
      c3[l] = off_hi;
    }
    auto k0 = static_cast<std::uint32_t>(seed);
    auto k1 = static_cast<std::uint32_t>(seed >> 32);
    for (int r = 0; r < philox::kRounds; ++r) {
      if (r > 0) {
        k0 += philox::kW0;
        k1 += philox::kW1;
      }
      for (int l = 0; l < kLanes; ++l) {
        const philox::Words w = philox::round(philox::Words{c0[l], c1[l], c2[l], c3[l]}, k0, k1);
        c0[l] = w.x0;
        c1[l] = w.x1;
        c2[l] = w.x2;
        c3[l] = w.x3;
      }
    }
    for (int l = 0; l < kLanes; ++l) {
      float* o = out + (b0 + l) * 4;
      o[0] = philox::to_uniform(c0[l]);
      o[1] = philox::to_uniform(c1[l]);
      o[2] = philox::to_uniform(c2[l]);
      o[3] = philox::to_uniform(c3[l]);
    }
  }
  for (; b0 < hi; ++b0) store_block(out, n, b0, philox::block_words(seed, offset, static_cast<std::uint64_t>(b0)));
}

}  // namespace detail

void philox_uniform(float* out, index_t n, std::uint64_t seed, std::uint64_t offset, int num_threads) {
  const index_t blocks = ceil_div(n, 4);
  const index_t tasks = ceil_div(blocks, detail::kGrainBlocks);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && tasks > 1)
  for (index_t t = 0; t < tasks; ++t) {
    const index_t lo = t * detail::kGrainBlocks;
    detail::philox_range(out, n, lo, std::min(blocks, lo + detail::kGrainBlocks), seed, offset);
  }
}

}  // namespace cpu
}  // namespace torchstash
