// OpenMP loop over the inline philox.h functions: one task per range of 4-word blocks.
//
// Within a task, kLanes blocks advance through the rounds together (structure of
// arrays; philox_lanes.h's philox_blocks), so the 32x32->64-bit products are vectorized.
#include <algorithm>

#include "clones.h"
#include "philox_lanes.h"
#include "torchstash/cpu_kernels.h"
#include "torchstash/philox.h"

namespace torchstash {
namespace cpu {
namespace detail {

constexpr index_t kGrainBlocks = index_t{1} << 14;  // 64K floats per task
constexpr int kLanes = kPhiloxLanes;

void store_block(float* out, index_t n, index_t block, const philox::Words& w) {
  const std::uint32_t words[4] = {w.x0, w.x1, w.x2, w.x3};
  const index_t i = block * 4;
  const int count = static_cast<int>(std::min<index_t>(4, n - i));
  for (int k = 0; k < count; ++k) out[i + k] = philox::to_uniform(words[k]);
}

// Blocks [lo, hi) of the stream into out (n elements in all).
TS_CPU_CLONES void philox_range(float* out, index_t n, index_t lo, index_t hi, std::uint64_t seed,
                                std::uint64_t offset) {
  const index_t full_hi = std::min(hi, n / 4);  // blocks whose 4 elements are all wanted
  index_t b0 = lo;
  if (full_hi > lo) {
    const index_t groups = (full_hi - lo) / kLanes;
    philox_blocks(out + b0 * 4, static_cast<std::uint64_t>(b0), groups, seed, offset);
    b0 += groups * kLanes;
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
