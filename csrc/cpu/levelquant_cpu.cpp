// Stochastic rounding to a sorted table of levels, bit-packed, in one pass: the derivative
// codes of GELU and SiLU (torchstash-quant's derivs.py rounds f'(x) to the levels of f').
//
// For element i of x (float32, float16 or bfloat16, widened to float32):
//   NaN             -> code 2**bits - 1 (a non-finite input's code);
//   otherwise       upper = clamp(#levels below v, 1, L - 1), low/high = levels[upper - 1 / upper],
//                   code = upper - (u * (high - low) >= v - low), u = Philox uniform i of (seed, 0).
// Codes are packed as bitpack.h lays them out. Reference: level_quantize_ref (bit-exact; the
// float32 operations are the reference's, one rounding each: -ffp-contract=off).
#include <algorithm>

#include "clones.h"
#include "float_spans.h"
#include "torchstash/bitpack.h"
#include "torchstash/cpu_kernels.h"

namespace torchstash {
namespace cpu {
namespace {

constexpr index_t kTaskElems = index_t{1} << 16;  // elements per OpenMP task (whole spans)
static_assert(kTaskElems % kSpan == 0 && kSpan % 8 == 0, "tasks and spans start on bytes");

// codes[0, count) of the span's values v and uniforms u. A short table (a derivative code's 3
// or 15 levels) is walked level by level over the whole span, each step a select on every
// element (vectorized; a per-element binary search's data-dependent branches cost 10x):
// upper = 1 + #{k in [1, L - 2] : levels[k] < v} is clamp(#levels below v, 1, L - 1) for
// ascending levels. A longer one is searched per element.
TS_CPU_CLONES void level_codes(const float* v, const float* u, index_t count, const float* levels, int nlevels,
                               int bits, std::uint8_t* codes) {
  const auto top = static_cast<std::uint8_t>((1u << bits) - 1u);
  alignas(64) float low[kSpan];
  alignas(64) float high[kSpan];
  alignas(64) std::int32_t upper[kSpan];
  if (nlevels <= 16) {
    for (index_t i = 0; i < count; ++i) {
      low[i] = levels[0];
      high[i] = levels[1];
      upper[i] = 1;
    }
    for (int k = 1; k < nlevels - 1; ++k) {
      const float lk = levels[k];
      const float next = levels[k + 1];
      for (index_t i = 0; i < count; ++i) {
        const bool above = lk < v[i];
        low[i] = above ? lk : low[i];
        high[i] = above ? next : high[i];
        upper[i] += static_cast<std::int32_t>(above);
      }
    }
  } else {
    for (index_t i = 0; i < count; ++i) {
      const auto below = static_cast<int>(std::lower_bound(levels, levels + nlevels, v[i]) - levels);
      const int up = std::min(std::max(below, 1), nlevels - 1);
      low[i] = levels[up - 1];
      high[i] = levels[up];
      upper[i] = up;
    }
  }
  for (index_t i = 0; i < count; ++i) {
    const float x = v[i];
    const std::int32_t code = upper[i] - static_cast<std::int32_t>(u[i] * (high[i] - low[i]) >= x - low[i]);
    codes[i] = x != x ? top : static_cast<std::uint8_t>(code);  // NaN: the top code
  }
}

void level_range(const void* x, groupquant::FloatKind kind, index_t n, index_t lo, index_t hi, const float* levels,
                 int nlevels, int bits, std::uint64_t seed, std::uint8_t* out) {
  alignas(64) float values[kSpan];
  alignas(64) float uniforms[kUniforms];
  alignas(64) std::uint8_t codes[kSpan];
  for (index_t first = lo; first < hi; first += kSpan) {
    const index_t count = std::min(kSpan, hi - first);
    const float* v = load_floats(x, kind, first, count, values);
    const float* u = fill_uniforms(uniforms, first, count, seed);
    level_codes(v, u, count, levels, nlevels, bits, codes);
    pack_bits(codes, count, bits, out + first / bitpack::codes_per_byte(bits), 1);
  }
  (void)n;
}

}  // namespace

void level_quantize(const void* x, groupquant::FloatKind kind, index_t n, const float* levels, int nlevels, int bits,
                    std::uint64_t seed, std::uint8_t* out, int num_threads) {
  const index_t tasks = ceil_div(n, kTaskElems);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && tasks > 1)
  for (index_t t = 0; t < tasks; ++t) {
    const index_t lo = t * kTaskElems;
    level_range(x, kind, n, lo, std::min(n, lo + kTaskElems), levels, nlevels, bits, seed, out);
  }
}

}  // namespace cpu
}  // namespace torchstash
