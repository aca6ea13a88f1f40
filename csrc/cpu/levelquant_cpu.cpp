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
#include <cstring>

#include "clones.h"
#include "float_spans.h"
#include "simd.h"
#include "torchstash/bitpack.h"
#include "torchstash/cpu_kernels.h"

namespace torchstash {
namespace cpu {
namespace {

constexpr index_t kTaskElems = index_t{1} << 16;  // elements per OpenMP task (whole spans)
static_assert(kTaskElems % kSpan == 0 && kSpan % 8 == 0, "tasks and spans start on bytes");

// codes[i] for one element, from its upper level (the scalar tail and long tables).
inline std::uint8_t level_code(float x, float u, std::int32_t upper, float low, float high, std::uint8_t top) {
  const std::int32_t code = upper - static_cast<std::int32_t>(u * (high - low) >= x - low);
  return x != x ? top : static_cast<std::uint8_t>(code);  // NaN: the top code
}

// codes[0, count) of the span's values v and uniforms u. A short table (a derivative code's 3
// or 15 levels) is walked level by level, N elements at a time in registers (simd.h), each
// step a select (a per-element binary search's data-dependent branches cost 10x; the walk
// over whole-span arrays became masked stores, microcoded on AMD, and scalar byte stores:
// 2.7 ms a MiB at 15 levels on an AVX2 EPYC):
// upper = 1 + #{k in [1, L - 2] : levels[k] < v} is clamp(#levels below v, 1, L - 1) for
// ascending levels. A longer one is searched per element.
TS_CPU_CLONES void level_codes(const float* v, const float* u, index_t count, const float* levels, int nlevels,
                               int bits, std::uint8_t* codes) {
  const auto top = static_cast<std::uint8_t>((1u << bits) - 1u);
  if (nlevels > 16) {
    for (index_t i = 0; i < count; ++i) {
      const auto below = static_cast<int>(std::lower_bound(levels, levels + nlevels, v[i]) - levels);
      const int up = std::min(std::max(below, 1), nlevels - 1);
      codes[i] = level_code(v[i], u[i], up, levels[up - 1], levels[up], top);
    }
    return;
  }
  const index_t done = at_lanes([&](auto n) TS_LANES {
    constexpr int N = decltype(n)::value;
    index_t i = 0;
    for (; i + N <= count; i += N) {
      FloatV<N> x, r;
      std::memcpy(&x, v + i, sizeof(x));
      std::memcpy(&r, u + i, sizeof(r));
      FloatV<N> low = FloatV<N>{} + levels[0];
      FloatV<N> high = FloatV<N>{} + levels[1];
      IntV<N> upper = IntV<N>{} + 1;
      for (int k = 1; k < nlevels - 1; ++k) {
        const IntV<N> above = levels[k] < x;  // -1 where true
        low = above ? FloatV<N>{} + levels[k] : low;
        high = above ? FloatV<N>{} + levels[k + 1] : high;
        upper -= above;
      }
      const IntV<N> down = r * (high - low) >= x - low;  // -1 where true
      const IntV<N> code = x != x ? IntV<N>{} + top : upper + down;
      const ByteV<N> b = low_bytes<N>(code);
      std::memcpy(codes + i, &b, sizeof(b));
    }
    return i;
  });
  for (index_t i = done; i < count; ++i) {
    const float x = v[i];
    std::int32_t up = 1;
    float low = levels[0], high = levels[1];
    for (int k = 1; k < nlevels - 1; ++k) {
      const bool above = levels[k] < x;
      low = above ? levels[k] : low;
      high = above ? levels[k + 1] : high;
      up += static_cast<std::int32_t>(above);
    }
    codes[i] = level_code(x, u[i], up, low, high, top);
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
