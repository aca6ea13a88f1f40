// OpenMP loops over the inline fp8.h functions: e4m3 codes with a per-group scale and their
// inverse, int64 indices throughout.
//
// Quantize: a task owns whole groups; each group is read twice while in cache (largest
// finite magnitude, then codes), in spans of kSpan elements (values converted from 16 bits).
// The codes cover whole groups: the last group's padding is coded as zeros (code 0), as the
// reference pads the tensor. Dequantize: tasks of kTaskElems elements, a group segment at a
// time. The leaf loops are compiled per instruction set (clones.h).
#include <algorithm>
#include <cstring>

#include "clones.h"
#include "float_spans.h"
#include "simd.h"
#include "torchstash/cpu_kernels.h"
#include "torchstash/fp8.h"
#include "torchstash/groupquant.h"

namespace torchstash {
namespace cpu {
namespace {

using groupquant::FloatKind;

constexpr index_t kTaskElems = index_t{1} << 16;

// The leaf loops run at the CPU's lane count (simd.h); N never changes a result.

// Largest finite |x[k]| (0 when none) and whether some x[k] is not finite, merged into
// *amax and *special. Finite magnitudes order like their bits.
TS_CPU_CLONES void span_amax(const float* x, index_t count, float* amax, bool* special) {
  std::uint32_t m = groupquant::float_bits(*amax), any_bad = 0;
  const index_t done = at_lanes([&](auto n) TS_LANES {
    constexpr int N = decltype(n)::value;
    UintV<N> big = {}, bad = {};
    index_t k = 0;
    for (; k + N <= count; k += N) {
      UintV<N> b;
      std::memcpy(&b, x + k, sizeof(b));
      b &= 0x7FFFFFFFu;
      const IntV<N> fin = b < 0x7F800000u;
      bad |= (UintV<N>)fin ^ 0xFFFFFFFFu;
      b &= (UintV<N>)fin;
      big = b > big ? b : big;
    }
    for (int l = 0; l < N; ++l) {
      m = big[l] > m ? big[l] : m;
      any_bad |= bad[l];
    }
    return k;
  });
  for (index_t k = done; k < count; ++k) {
    const std::uint32_t b = groupquant::float_bits(x[k]) & 0x7FFFFFFFu;
    if (b < 0x7F800000u) {
      m = b > m ? b : m;
    } else {
      any_bad = 1;
    }
  }
  *amax = groupquant::bits_float(m);
  *special = *special || any_bad != 0;
}

// e4m3 codes of finite x[k] / scale, N at a time: fp8::e4m3_from_float with its branches
// as selects.
TS_CPU_CLONES void finite_codes(const float* x, index_t count, float scale, std::uint8_t* c) {
  const index_t done = at_lanes([&](auto n) TS_LANES {
    constexpr int N = decltype(n)::value;
    using F = FloatV<N>;
    using U = UintV<N>;
    const U max_bits = U{} + (UINT32_C(1087) << 20);
    const U denorm = U{} + (UINT32_C(141) << 23);
    const F denorm_f = F{} + groupquant::bits_float(UINT32_C(141) << 23);
    index_t k = 0;
    for (; k + N <= count; k += N) {
      F v;
      std::memcpy(&v, x + k, sizeof(v));
      const F q = v / scale;
      const U qb = (U)q;
      const U sign = qb & 0x80000000u;
      const U a = qb ^ sign;
      const F af = (F)a + denorm_f;
      const U small = (U)af - denorm;
      U normal = (a + ((static_cast<std::uint32_t>(7 - 127) << 23) + 0x7FFFFu) + ((a >> 20) & 1u)) >> 20;
      normal = normal == 0x7Fu ? U{} + 0x7Eu : normal;
      const U big = a > 0x7F800000u ? U{} + 0x7Fu : U{} + 0x7Eu;
      U r = a >= max_bits ? big : (a < (UINT32_C(121) << 23) ? small : normal);
      r = (r & 0xFFu) | (sign >> 24);
      const ByteV<N> b = low_bytes<N>(r);
      std::memcpy(c + k, &b, sizeof(b));
    }
    return k;
  });
  for (index_t k = done; k < count; ++k) c[k] = fp8::e4m3_from_float(groupquant::div_rn(x[k], scale));
}

TS_CPU_CLONES void special_codes(const float* x, index_t count, float scale, std::uint8_t* c) {
  for (index_t k = 0; k < count; ++k) c[k] = fp8::code_of(x[k], scale);
}

// v[k] <- the value of code c[k] times `magnitude` (a group that is not special), N at a
// time: fp8::e4m3_to_float as selects (a normal code's bits rebiased, a subnormal's mantissa
// times 2^-9, exact; 0x7F / 0xFF the NaN c10 gives).
TS_CPU_CLONES void finite_values(const std::uint8_t* c, index_t count, float magnitude, float* v) {
  const index_t done = at_lanes([&](auto n) TS_LANES {
    constexpr int N = decltype(n)::value;
    using U = UintV<N>;
    index_t k = 0;
    for (; k + N <= count; k += N) {
      const U w = widen_bytes<N>(c + k);
      const U e = (w >> 3) & 0xFu;
      const U m = w & 7u;
      const FloatV<N> sub_f = __builtin_convertvector((IntV<N>)m, FloatV<N>) * 0.001953125f;
      U bits = e == 0u ? (U)sub_f : ((e + 120u) << 23) | (m << 20);
      bits = (w & 0x7Fu) == 0x7Fu ? U{} + 0x7FF00000u : bits;
      bits |= (w & 0x80u) << 24;
      const FloatV<N> val = (FloatV<N>)bits * magnitude;
      std::memcpy(v + k, &val, sizeof(val));
    }
    return k;
  });
  for (index_t k = done; k < count; ++k) v[k] = fp8::value_of(c[k], magnitude, false);
}

TS_CPU_CLONES void special_values(const std::uint8_t* c, index_t count, float magnitude, float* v) {
  for (index_t k = 0; k < count; ++k) v[k] = fp8::value_of(c[k], magnitude, true);
}

struct QuantArgs {
  const void* x;
  FloatKind kind;
  index_t n;
  index_t group_size;
  std::uint8_t* codes;
  std::uint16_t* scale;
};

void quantize_group(const QuantArgs& a, index_t g, float* xbuf) {
  const index_t begin = g * a.group_size;
  const index_t end = std::min(a.n, begin + a.group_size);
  float amax = 0.0f;
  bool special = false;
  for (index_t i = begin; i < end; i += kSpan) {
    const index_t m = std::min(kSpan, end - i);
    span_amax(load_floats(a.x, a.kind, i, m, xbuf), m, &amax, &special);
  }
  const float scale = fp8::group_scale(amax, special);
  a.scale[g] = fp8::stored_scale(scale, special);
  for (index_t i = begin; i < end; i += kSpan) {
    const index_t m = std::min(kSpan, end - i);
    const float* x = load_floats(a.x, a.kind, i, m, xbuf);
    if (special) {
      special_codes(x, m, scale, a.codes + i);
    } else {
      finite_codes(x, m, scale, a.codes + i);
    }
  }
  const index_t padded = begin + a.group_size;  // the reference's zero padding codes as 0
  if (end < padded) std::memset(a.codes + end, 0, static_cast<std::size_t>(padded - end));
}

struct DequantArgs {
  const std::uint8_t* codes;
  const std::uint16_t* scale;
  index_t n;
  index_t group_size;
  FloatKind kind;
  void* out;
};

void dequantize_range(const DequantArgs& a, index_t e_lo, index_t e_hi) {
  float vbuf[kSpan];
  for (index_t s = e_lo; s < e_hi; s += kSpan) {
    const index_t count = std::min(kSpan, e_hi - s);
    float* vals = a.kind == FloatKind::kFloat32 ? static_cast<float*>(a.out) + s : vbuf;
    for (index_t i = s; i < s + count;) {  // one group segment at a time
      const index_t g = i / a.group_size;
      const index_t seg_end = std::min(s + count, (g + 1) * a.group_size);
      const std::uint16_t stored = a.scale[g];
      const float magnitude = groupquant::bf16_bits_to_float(static_cast<std::uint16_t>(stored & 0x7FFFu));
      if ((stored & 0x8000u) != 0) {
        special_values(a.codes + i, seg_end - i, magnitude, vals + (i - s));
      } else {
        finite_values(a.codes + i, seg_end - i, magnitude, vals + (i - s));
      }
      i = seg_end;
    }
    if (a.kind != FloatKind::kFloat32) store_floats(a.out, a.kind, s, count, vbuf);
  }
}

}  // namespace

void fp8_quantize(const void* x, groupquant::FloatKind kind, index_t n, index_t group_size, std::uint8_t* codes,
                  std::uint16_t* scale, int num_threads) {
  if (n <= 0) return;
  const QuantArgs a{x, kind, n, group_size, codes, scale};
  const index_t groups = ceil_div(n, group_size);
  const index_t per_task = std::max<index_t>(1, kTaskElems / group_size);
  const index_t tasks = ceil_div(groups, per_task);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && tasks > 1)
  for (index_t t = 0; t < tasks; ++t) {
    float xbuf[kSpan];
    const index_t g_hi = std::min(groups, (t + 1) * per_task);
    for (index_t g = t * per_task; g < g_hi; ++g) quantize_group(a, g, xbuf);
  }
}

void fp8_dequantize(const std::uint8_t* codes, const std::uint16_t* scale, index_t n, index_t group_size,
                    groupquant::FloatKind kind, void* out, int num_threads) {
  if (n <= 0) return;
  const DequantArgs a{codes, scale, n, group_size, kind, out};
  const index_t tasks = ceil_div(n, kTaskElems);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && tasks > 1)
  for (index_t t = 0; t < tasks; ++t) {
    const index_t e_lo = t * kTaskElems;
    dequantize_range(a, e_lo, std::min(n, e_lo + kTaskElems));
  }
}

}  // namespace cpu
}  // namespace torchstash
