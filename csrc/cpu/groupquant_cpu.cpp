// OpenMP loops over the inline groupquant.h functions: fused per-group quantization and
// its inverse, int64 indices throughout.
//
// Quantize: a task owns a run of whole groups whose first bit is on a byte boundary
// (byte_aligned_groups), so tasks never share an output byte even when a byte straddles
// two groups. Each group is read twice while it is in cache: min/max, then codes and
// packing. Values and Philox uniforms are prepared a span of up to kSpan elements at a
// time: whole groups when they are small, part of one group when it is large.
// Dequantize: a task owns a range of whole packed bytes; groups may start anywhere in it.
//
// Only the hot leaf loops (span_stats, finite_codes, affine_values, float_spans.h's
// fill_uniforms) are compiled per instruction set (clones.h); they do not depend on the bit
// width, so the width-templated glue is compiled once and the unit builds in a few seconds.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "clones.h"
#include "float_spans.h"
#include "philox_lanes.h"
#include "torchstash/bitpack.h"
#include "torchstash/cpu_kernels.h"
#include "torchstash/groupquant.h"
#include "torchstash/philox.h"

namespace torchstash {
namespace cpu {
namespace {

using groupquant::FloatKind;
using groupquant::Params;
using groupquant::Stats;

constexpr index_t kTaskElems = index_t{1} << 16;  // elements per OpenMP task, about
constexpr int kLanes = kPhiloxLanes;               // min/max lanes
static_assert(kSpan % 8 == 0 && kTaskElems % 8 == 0, "spans and tasks must start on bytes");

// Min/max of x[0, count) merged into s, in kLanes independent lanes so that the loop
// vectorizes without -ffast-math (each lane update is a plain compare-and-select).
TS_CPU_CLONES Stats span_stats(const float* x, index_t count, Stats s) {
  float mn[kLanes], mx[kLanes];
  std::uint32_t bad[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    mn[l] = s.mn;
    mx[l] = s.mx;
    bad[l] = 0;
  }
  const float inf = groupquant::bits_float(0x7F800000u);
  const float max_finite = groupquant::bits_float(0x7F7FFFFFu);
  index_t k = 0;
  for (; k + kLanes <= count; k += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float v = x[k + l];
      const bool fin = std::fabs(v) <= max_finite;  // false for NaN and +-inf; a float compare vectorizes
      const float lo_v = fin ? v : inf;
      const float hi_v = fin ? v : -inf;
      mn[l] = lo_v < mn[l] ? lo_v : mn[l];
      mx[l] = hi_v > mx[l] ? hi_v : mx[l];
      bad[l] |= fin ? 0u : 1u;
    }
  }
  for (; k < count; ++k) groupquant::accumulate(&s, x[k]);
  for (int l = 0; l < kLanes; ++l) s = groupquant::merge(s, Stats{mn[l], mx[l], bad[l] != 0});
  return s;
}

// c[k] <- the code of finite x[k] in a normal group with step > 0.
TS_CPU_CLONES void finite_codes(const float* x, const float* u, index_t count, float lo, float step, float top,
                                std::uint8_t* c) {
  for (index_t k = 0; k < count; ++k) c[k] = groupquant::finite_code(x[k], lo, step, top, u[k]);
}

// vals[k] <- lo + codes[k] * step, rounded twice (no FMA: -ffp-contract=off).
TS_CPU_CLONES void affine_values(const std::uint8_t* codes, index_t count, float lo, float step, float* vals) {
  for (index_t k = 0; k < count; ++k) vals[k] = groupquant::add_rn(lo, groupquant::mul_rn(static_cast<float>(codes[k]), step));
}

// Codes appended group by group, written out as whole bytes; a task starts on a byte
// boundary, so only the tensor's last byte can be partial.
template <int BITS>
struct Packer {
  static constexpr int kPer = 8 / BITS;
  std::uint8_t* out;
  std::uint8_t codes[kSpan + 8];
  int pending = 0;  // codes[0, pending) not yet written (fewer than kPer)

  std::uint8_t* slot() { return codes + pending; }

  void commit(index_t count) {
    const index_t total = pending + count;
    const index_t full = total / kPer;
    for (index_t j = 0; j < full; ++j) out[j] = bitpack::pack_full<BITS>(codes + j * kPer);
    out += full;
    pending = static_cast<int>(total - full * kPer);
    for (int k = 0; k < pending; ++k) codes[k] = codes[full * kPer + k];
  }

  void finish() {
    if (pending > 0) *out++ = bitpack::pack_byte(codes, pending, 0, BITS);
    pending = 0;
  }
};

struct QuantArgs {
  const void* x;
  FloatKind kind;
  index_t n;
  index_t group_size;
  std::uint64_t seed;
  bool stochastic;
  std::uint8_t* packed;
  std::uint16_t* lo;
  std::uint16_t* step;
};

// Codes of `count` (<= kSpan) elements of one group (values x, uniforms u) into the packer.
template <int BITS>
void encode(const Params& p, const float* x, const float* u, index_t count, Packer<BITS>* packer) {
  std::uint8_t* c = packer->slot();
  if (p.special || p.shape != groupquant::kOrdinary) {
    for (index_t k = 0; k < count; ++k) c[k] = groupquant::code_of(x[k], p, u[k], BITS);
  } else if (p.step > 0.0f) {
    finite_codes(x, u, count, p.lo, p.step, p.top, c);
  } else {  // a constant group: all codes 0
    std::memset(c, 0, static_cast<std::size_t>(count));
  }
  packer->commit(count);
}

Params group_params(const QuantArgs& a, index_t g, Stats s, int bits) {
  const Params p = groupquant::make_params(s, bits);
  a.lo[g] = groupquant::stored_lo(p);
  a.step[g] = groupquant::stored_step(p);
  return p;
}

// Groups [g_lo, g_hi); g_lo * group_size * BITS is a multiple of 8.
template <int BITS>
void quantize_groups(const QuantArgs& a, index_t g_lo, index_t g_hi) {
  const index_t G = a.group_size;
  float xbuf[kSpan];
  float ubuf[kUniforms];
  if (!a.stochastic) std::fill(ubuf, ubuf + kSpan, groupquant::kNearest);
  const float* u = ubuf;
  Packer<BITS> packer;
  packer.out = a.packed + (g_lo * G) / (8 / BITS);
  if (G <= kSpan) {  // spans of whole groups
    const index_t batch = kSpan / G;
    for (index_t g0 = g_lo; g0 < g_hi; g0 += batch) {
      const index_t g1 = std::min(g_hi, g0 + batch);
      const index_t first = g0 * G;
      const index_t count = std::min(a.n, g1 * G) - first;
      const float* x = load_floats(a.x, a.kind, first, count, xbuf);
      if (a.stochastic) u = fill_uniforms(ubuf, first, count, a.seed);
      for (index_t g = g0; g < g1; ++g) {
        const index_t off = (g - g0) * G;
        const index_t m = std::min(G, count - off);
        const Params p = group_params(a, g, span_stats(x + off, m, groupquant::empty_stats()), BITS);
        encode<BITS>(p, x + off, u + off, m, &packer);
      }
    }
  } else {  // one group, span by span: all of its min/max first, then its codes
    for (index_t g = g_lo; g < g_hi; ++g) {
      const index_t begin = g * G;
      const index_t end = std::min(a.n, begin + G);
      Stats s = groupquant::empty_stats();
      for (index_t i = begin; i < end; i += kSpan) {
        const index_t m = std::min(kSpan, end - i);
        s = span_stats(load_floats(a.x, a.kind, i, m, xbuf), m, s);
      }
      const Params p = group_params(a, g, s, BITS);
      for (index_t i = begin; i < end; i += kSpan) {
        const index_t m = std::min(kSpan, end - i);
        const float* x = load_floats(a.x, a.kind, i, m, xbuf);
        if (a.stochastic) u = fill_uniforms(ubuf, i, m, a.seed);
        encode<BITS>(p, x, u, m, &packer);
      }
    }
  }
  packer.finish();
}

void quantize_range(const QuantArgs& a, int bits, index_t g_lo, index_t g_hi) {
  switch (bits) {
    case 1: return quantize_groups<1>(a, g_lo, g_hi);
    case 2: return quantize_groups<2>(a, g_lo, g_hi);
    case 4: return quantize_groups<4>(a, g_lo, g_hi);
    default: return quantize_groups<8>(a, g_lo, g_hi);
  }
}

struct DequantArgs {
  const std::uint8_t* packed;
  const std::uint16_t* lo;
  const std::uint16_t* step;
  index_t n;
  index_t group_size;
  FloatKind kind;
  void* out;
};

// Elements [e_lo, e_hi); e_lo is a multiple of 8, so the range starts on a byte boundary.
template <int BITS>
void dequantize_elems(const DequantArgs& a, index_t e_lo, index_t e_hi) {
  constexpr int per = 8 / BITS;
  std::uint8_t codes[kSpan + 8];
  float vals[kSpan];
  for (index_t s = e_lo; s < e_hi; s += kSpan) {
    const index_t count = std::min(kSpan, e_hi - s);
    const index_t full = count / per;  // kSpan is a multiple of 8: s is byte-aligned
    const std::uint8_t* src = a.packed + s / per;
    for (index_t j = 0; j < full; ++j) bitpack::unpack_full<BITS>(src[j], codes + j * per);
    for (index_t k = full * per; k < count; ++k) codes[k] = bitpack::unpack_code(src, k, BITS);
    for (index_t i = s; i < s + count;) {  // one group segment at a time
      const index_t g = i / a.group_size;
      const index_t seg_end = std::min(s + count, (g + 1) * a.group_size);
      const Params p = groupquant::load_params(a.lo[g], a.step[g], BITS);
      const index_t k0 = i - s;
      if (p.special || p.shape != groupquant::kOrdinary) {
        for (index_t k = k0; k < seg_end - s; ++k) vals[k] = groupquant::value_of(codes[k], p, BITS);
      } else {
        affine_values(codes + k0, seg_end - i, p.lo, p.step, vals + k0);
      }
      i = seg_end;
    }
    store_floats(a.out, a.kind, s, count, vals);
  }
}

void dequantize_range(const DequantArgs& a, int bits, index_t e_lo, index_t e_hi) {
  switch (bits) {
    case 1: return dequantize_elems<1>(a, e_lo, e_hi);
    case 2: return dequantize_elems<2>(a, e_lo, e_hi);
    case 4: return dequantize_elems<4>(a, e_lo, e_hi);
    default: return dequantize_elems<8>(a, e_lo, e_hi);
  }
}

}  // namespace

void group_quantize(const void* x, groupquant::FloatKind kind, index_t n, int bits, index_t group_size,
                    std::uint64_t seed, bool stochastic, std::uint8_t* packed, std::uint16_t* lo,
                    std::uint16_t* step, int num_threads) {
  if (n <= 0) return;
  const QuantArgs a{x, kind, n, group_size, seed, stochastic, packed, lo, step};
  const index_t groups = ceil_div(n, group_size);
  const index_t align = groupquant::byte_aligned_groups(group_size, bits);
  // Whole byte-aligned runs of groups per task, about kTaskElems elements.
  const index_t per_task = ceil_div(std::max<index_t>(1, kTaskElems / group_size), align) * align;
  const index_t tasks = ceil_div(groups, per_task);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && tasks > 1)
  for (index_t t = 0; t < tasks; ++t) {
    const index_t g_lo = t * per_task;
    quantize_range(a, bits, g_lo, std::min(groups, g_lo + per_task));
  }
}

void group_dequantize(const std::uint8_t* packed, const std::uint16_t* lo, const std::uint16_t* step, int bits,
                      index_t group_size, index_t n, groupquant::FloatKind kind, void* out, int num_threads) {
  if (n <= 0) return;
  const DequantArgs a{packed, lo, step, n, group_size, kind, out};
  const index_t tasks = ceil_div(n, kTaskElems);  // kTaskElems is a multiple of 8
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && tasks > 1)
  for (index_t t = 0; t < tasks; ++t) {
    const index_t e_lo = t * kTaskElems;
    dequantize_range(a, bits, e_lo, std::min(n, e_lo + kTaskElems));
  }
}

}  // namespace cpu
}  // namespace torchstash
