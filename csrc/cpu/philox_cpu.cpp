// OpenMP loop over the inline philox.h functions: one task per range of 4-word blocks.
#include <algorithm>

#include "torchstash/cpu_kernels.h"
#include "torchstash/philox.h"

namespace torchstash {
namespace cpu {
namespace {

constexpr index_t kGrainBlocks = index_t{1} << 14;  // 64K floats per task

}  // namespace

void philox_uniform(float* out, index_t n, std::uint64_t seed, std::uint64_t offset, int num_threads) {
  const index_t blocks = ceil_div(n, 4);
  const index_t tasks = ceil_div(blocks, kGrainBlocks);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && tasks > 1)
  for (index_t t = 0; t < tasks; ++t) {
    const index_t lo = t * kGrainBlocks;
    const index_t hi = std::min(blocks, lo + kGrainBlocks);
    for (index_t b = lo; b < hi; ++b) {
      const philox::Words w = philox::block_words(seed, offset, static_cast<std::uint64_t>(b));
      const std::uint32_t words[4] = {w.x0, w.x1, w.x2, w.x3};
      const index_t i = b * 4;
      const int count = static_cast<int>(std::min<index_t>(4, n - i));
      for (int k = 0; k < count; ++k) out[i + k] = philox::to_uniform(words[k]);
    }
  }
}

}  // namespace cpu
}  // namespace torchstash
