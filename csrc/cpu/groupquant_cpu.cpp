// OpenMP loops over the inline groupquant.h functions: fused per-group quantization and
// its inverse, int64 indices throughout.
//
// Quantize: a task owns a run of whole groups whose first bit is on a byte boundary
// (byte_aligned_groups), so tasks never share an output byte even when a byte straddles
// two groups. Each group is read twice while it is in cache: min/max, then codes and
// packing. Values and Philox uniforms are prepared a span of up to kSpan elements at a
// time: whole groups when they are small, part of one group when it is large. A span of
// small groups takes one call per leaf loop (stats of all its groups, codes of all its
// ordinary groups, packing), not one per group: per-group calls (each through an ifunc,
// each with its lane merges) took 3.4x the time on 256-element groups.
// Dequantize: a task owns a range of whole packed bytes; groups may start anywhere in it.
//
// Only the hot leaf loops (groups_stats, groups_codes, pack_bytes*, affine_values,
// float_spans.h's fill_uniforms) are compiled per instruction set (clones.h); they do not
// depend on the bit width, so the width-templated glue is compiled once and the unit builds
// in a few seconds. The stats and codes loops are written on GCC vectors of the running CPU's
// lane count (simd.h: 16 floats on AVX-512, 8 on AVX2, where 16 ran lane by lane).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "clones.h"
#include "float_spans.h"
#include "philox_lanes.h"
#include "row_lanes.h"
#include "simd.h"
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

// Min/max of x[0, count) in kLanes independent lanes, each update a compare-and-select
// that excludes NaN and Inf (flagged instead): the careful loop, for groups holding them.
__attribute__((always_inline)) inline Stats lane_stats(const float* x, index_t count) {
  float mn[kLanes], mx[kLanes];
  std::uint32_t bad[kLanes];
  const Stats empty = groupquant::empty_stats();
  for (int l = 0; l < kLanes; ++l) {
    mn[l] = empty.mn;
    mx[l] = empty.mx;
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
  Stats s = empty;
  for (; k < count; ++k) groupquant::accumulate(&s, x[k]);
  for (int l = 0; l < kLanes; ++l) s = groupquant::merge(s, Stats{mn[l], mx[l], bad[l] != 0});
  return s;
}

// Min/max of x[0, count). The fast loop takes min and max of everything (a NaN fails both
// compares and is skipped, an infinity is taken) and the largest magnitude as bits, at least
// 0x7F800000 exactly when something is not finite; only then does lane_stats run. N lanes
// (simd.h): the result is the same at any N.
template <int N>
__attribute__((always_inline)) inline Stats block_stats(const float* x, index_t count) {
  FloatV<N> mn, mx;
  UintV<N> mag = {};
  const Stats empty = groupquant::empty_stats();
  for (int l = 0; l < N; ++l) {
    mn[l] = empty.mn;
    mx[l] = empty.mx;
  }
  index_t k = 0;
  for (; k + N <= count; k += N) {
    FloatV<N> v;
    std::memcpy(&v, x + k, sizeof(v));
    mn = v < mn ? v : mn;
    mx = v > mx ? v : mx;
    const UintV<N> a = (UintV<N>)v & 0x7FFFFFFFu;
    mag = a > mag ? a : mag;
  }
  Stats s = empty;
  std::uint32_t big = 0;
  for (int l = 0; l < N; ++l) {
    s.mn = mn[l] < s.mn ? mn[l] : s.mn;
    s.mx = mx[l] > s.mx ? mx[l] : s.mx;
    big = mag[l] > big ? mag[l] : big;
  }
  for (; k < count; ++k) {
    big = std::max(big, groupquant::float_bits(x[k]) & 0x7FFFFFFFu);
    s.mn = x[k] < s.mn ? x[k] : s.mn;
    s.mx = x[k] > s.mx ? x[k] : s.mx;
  }
  return big >= 0x7F800000u ? lane_stats(x, count) : s;
}

// c[k] <- the code of finite x[k] in a normal group with step > 0 (finite_code, N at a time).
template <int N>
__attribute__((always_inline)) inline void ordinary_codes(const float* x, const float* u, index_t count, float lo,
                                                          float step, float top, std::uint8_t* c) {
  index_t k = 0;
  for (; k + N <= count; k += N) {
    FloatV<N> v, r;
    std::memcpy(&v, x + k, sizeof(v));
    std::memcpy(&r, u + k, sizeof(r));
    FloatV<N> w = (v - lo) / step + r;
    w = w >= 0.0f ? w : 0.0f;  // a NaN fails the compare: 0
    w = w < top ? w : top;
    const ByteV<N> b = low_bytes<N>(__builtin_convertvector(w, IntV<N>));
    std::memcpy(c + k, &b, sizeof(b));
  }
  for (; k < count; ++k) c[k] = groupquant::finite_code(x[k], lo, step, top, u[k]);
}

// Min/max of x[0, count) merged into s (a part of one large group).
TS_CPU_CLONES Stats span_stats(const float* x, index_t count, Stats s) {
  return groupquant::merge(s, at_lanes([&](auto n) TS_LANES { return block_stats<decltype(n)::value>(x, count); }));
}

// stats[j] <- min/max of group j of a span of whole groups of G elements, x[0, count) (the
// last group may be shorter): one call per span, not per group.
TS_CPU_CLONES void groups_stats(const float* x, index_t count, index_t G, Stats* stats) {
  at_lanes([&](auto n) TS_LANES {
    for (index_t off = 0, j = 0; off < count; off += G, ++j) {
      stats[j] = block_stats<decltype(n)::value>(x + off, std::min(G, count - off));
    }
  });
}

TS_CPU_CLONES void finite_codes(const float* x, const float* u, index_t count, float lo, float step, float top,
                                std::uint8_t* c) {
  at_lanes([&](auto n) TS_LANES { ordinary_codes<decltype(n)::value>(x, u, count, lo, step, top, c); });
}

// Whether a group's codes come from ordinary_codes (finite, not tiny, step > 0).
bool is_ordinary(const Params& p) { return !p.special && p.shape == groupquant::kOrdinary && p.step > 0.0f; }

// The codes of the ordinary groups of a span of whole groups of G elements, x[0, count),
// into c; the other groups' codes are left to the caller.
TS_CPU_CLONES void groups_codes(const float* x, const float* u, index_t count, index_t G, const Params* params,
                                std::uint8_t* c) {
  at_lanes([&](auto n) TS_LANES {
    for (index_t off = 0, j = 0; off < count; off += G, ++j) {
      const Params& p = params[j];
      if (is_ordinary(p)) {
        ordinary_codes<decltype(n)::value>(x + off, u + off, std::min(G, count - off), p.lo, p.step, p.top, c + off);
      }
    }
  });
}

// out[j] <- byte j of the packed codes (whole bytes only), one loop per width.
TS_CPU_CLONES void pack_bytes1(const std::uint8_t* codes, index_t bytes, std::uint8_t* out) {
  for (index_t j = 0; j < bytes; ++j) out[j] = bitpack::pack_full<1>(codes + 8 * j);
}
TS_CPU_CLONES void pack_bytes2(const std::uint8_t* codes, index_t bytes, std::uint8_t* out) {
  for (index_t j = 0; j < bytes; ++j) out[j] = bitpack::pack_full<2>(codes + 4 * j);
}
TS_CPU_CLONES void pack_bytes4(const std::uint8_t* codes, index_t bytes, std::uint8_t* out) {
  for (index_t j = 0; j < bytes; ++j) out[j] = bitpack::pack_full<4>(codes + 2 * j);
}

template <int BITS>
void pack_bytes(const std::uint8_t* codes, index_t bytes, std::uint8_t* out) {
  if constexpr (BITS == 1) {
    pack_bytes1(codes, bytes, out);
  } else if constexpr (BITS == 2) {
    pack_bytes2(codes, bytes, out);
  } else if constexpr (BITS == 4) {
    pack_bytes4(codes, bytes, out);
  } else {
    std::memcpy(out, codes, static_cast<std::size_t>(bytes));
  }
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
    pack_bytes<BITS>(codes, full, out);
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
  const float* offsets = nullptr;  // rows centered on these (row_group_quantize)
  index_t run = 0;                 // their length
};

// out[k] <- x[k] - offset (out may be x).
TS_CPU_CLONES void subtract_offset(const float* x, index_t count, float offset, float* out) {
  for (index_t k = 0; k < count; ++k) out[k] = x[k] - offset;
}

// Elements [first, first + count) as float32 (load_floats), each minus its row's offset when
// the rows are centered (then always in xbuf).
const float* load_values(const QuantArgs& a, index_t first, index_t count, float* xbuf) {
  const float* x = load_floats(a.x, a.kind, first, count, xbuf);
  if (a.offsets == nullptr) return x;
  for (index_t k = 0; k < count;) {
    const index_t r = (first + k) / a.run;
    const index_t len = std::min(count - k, (r + 1) * a.run - (first + k));
    subtract_offset(x + k, len, a.offsets[r], xbuf + k);
    k += len;
  }
  return xbuf;
}

// c[0, count) <- the codes of a group that is not ordinary: special or tiny (element by
// element) or constant (all 0).
template <int BITS>
void special_codes(const Params& p, const float* x, const float* u, index_t count, std::uint8_t* c) {
  if (p.special || p.shape != groupquant::kOrdinary) {
    for (index_t k = 0; k < count; ++k) c[k] = groupquant::code_of(x[k], p, u[k], BITS);
  } else {
    std::memset(c, 0, static_cast<std::size_t>(count));
  }
}

// Codes of `count` (<= kSpan) elements of one group (values x, uniforms u) into the packer.
template <int BITS>
void encode(const Params& p, const float* x, const float* u, index_t count, Packer<BITS>* packer) {
  std::uint8_t* c = packer->slot();
  if (is_ordinary(p)) {
    finite_codes(x, u, count, p.lo, p.step, p.top, c);
  } else {
    special_codes<BITS>(p, x, u, count, c);
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
  Stats stats[kSpan];
  Params params[kSpan];
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
      const float* x = load_values(a, first, count, xbuf);
      if (a.stochastic) u = fill_uniforms(ubuf, first, count, a.seed);
      groups_stats(x, count, G, stats);
      for (index_t g = g0; g < g1; ++g) params[g - g0] = group_params(a, g, stats[g - g0], BITS);
      std::uint8_t* c = packer.slot();
      groups_codes(x, u, count, G, params, c);
      for (index_t j = 0; j < g1 - g0; ++j) {  // special, tiny and constant groups
        const index_t off = j * G;
        if (!is_ordinary(params[j])) special_codes<BITS>(params[j], x + off, u + off, std::min(G, count - off), c + off);
      }
      packer.commit(count);
    }
  } else {  // one group, span by span: all of its min/max first, then its codes
    for (index_t g = g_lo; g < g_hi; ++g) {
      const index_t begin = g * G;
      const index_t end = std::min(a.n, begin + G);
      Stats s = groupquant::empty_stats();
      for (index_t i = begin; i < end; i += kSpan) {
        const index_t m = std::min(kSpan, end - i);
        s = span_stats(load_values(a, i, m, xbuf), m, s);
      }
      const Params p = group_params(a, g, s, BITS);
      for (index_t i = begin; i < end; i += kSpan) {
        const index_t m = std::min(kSpan, end - i);
        const float* x = load_values(a, i, m, xbuf);
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
  const float* offsets = nullptr;           // rows restored on these (row_group_dequantize)
  const std::uint8_t* constant = nullptr;  // their constant flags
  index_t run = 0;                          // their length
};

// vals[0, count) <- the float32 values of elements [s, s + count) (count <= kSpan; s anywhere:
// codes before the first byte boundary are read one by one).
template <int BITS>
void decode_values(const DequantArgs& a, index_t s, index_t count, float* vals) {
  constexpr int per = 8 / BITS;
  std::uint8_t codes[kSpan + 8];
  index_t k = 0;
  for (; k < count && (s + k) % per != 0; ++k) codes[k] = bitpack::unpack_code(a.packed, s + k, BITS);
  const index_t full = (count - k) / per;
  const std::uint8_t* src = a.packed + (s + k) / per;
  for (index_t j = 0; j < full; ++j) bitpack::unpack_full<BITS>(src[j], codes + k + j * per);
  for (k += full * per; k < count; ++k) codes[k] = bitpack::unpack_code(a.packed, s + k, BITS);
  for (index_t i = s; i < s + count;) {  // one group segment at a time
    const index_t g = i / a.group_size;
    const index_t seg_end = std::min(s + count, (g + 1) * a.group_size);
    const Params p = groupquant::load_params(a.lo[g], a.step[g], BITS);
    const index_t k0 = i - s;
    if (p.special || p.shape != groupquant::kOrdinary) {
      for (index_t j = k0; j < seg_end - s; ++j) vals[j] = groupquant::value_of(codes[j], p, BITS);
    } else {
      affine_values(codes + k0, seg_end - i, p.lo, p.step, vals + k0);
    }
    i = seg_end;
  }
}

// Elements [e_lo, e_hi), a span at a time (float32 output decoded in place).
template <int BITS>
void dequantize_elems(const DequantArgs& a, index_t e_lo, index_t e_hi) {
  float vbuf[kSpan];
  for (index_t s = e_lo; s < e_hi; s += kSpan) {
    const index_t count = std::min(kSpan, e_hi - s);
    float* vals = a.kind == FloatKind::kFloat32 ? static_cast<float*>(a.out) + s : vbuf;
    decode_values<BITS>(a, s, count, vals);
    if (a.kind != FloatKind::kFloat32) store_floats(a.out, a.kind, s, count, vbuf);
  }
}

// v[k] <- v[k] + delta.
TS_CPU_CLONES void add_delta(float* v, index_t count, float delta) {
  for (index_t k = 0; k < count; ++k) v[k] = v[k] + delta;
}

// Row r restored (row_uncenter of its decoded values): decoded once for its lane sums (into
// the output itself when it is float32), then the output written (decoded once more for a
// 16-bit one).
template <int BITS>
void restore_row(const DequantArgs& a, index_t r, float* vbuf) {
  const bool constant = ((a.constant[r / 8] >> (r % 8)) & 1u) != 0;
  const bool in_place = a.kind == FloatKind::kFloat32;
  const index_t begin = r * a.run;
  double lanes[kSumLanes] = {};
  for (index_t i = 0; i < a.run && !constant; i += kSpan) {  // a constant row's values are 0
    const index_t m = std::min(kSpan, a.run - i);
    float* v = in_place ? static_cast<float*>(a.out) + begin + i : vbuf;
    decode_values<BITS>(a, begin + i, m, v);
    add_lanes(v, m, 0.0f, lanes);
  }
  const float delta = a.offsets[r] - lanes_drift(lanes, a.run);
  for (index_t i = 0; i < a.run; i += kSpan) {
    const index_t m = std::min(kSpan, a.run - i);
    float* v = in_place ? static_cast<float*>(a.out) + begin + i : vbuf;
    if (constant) {
      std::fill(v, v + m, 0.0f + delta);
    } else {
      if (!in_place) decode_values<BITS>(a, begin + i, m, v);
      add_delta(v, m, delta);
    }
    if (!in_place) store_floats(a.out, a.kind, begin + i, m, vbuf);
  }
}

template <int BITS>
void restore_rows(const DequantArgs& a, index_t r_lo, index_t r_hi) {
  float vbuf[kSpan];
  for (index_t r = r_lo; r < r_hi; ++r) restore_row<BITS>(a, r, vbuf);
}

void restore_range(const DequantArgs& a, int bits, index_t r_lo, index_t r_hi) {
  switch (bits) {
    case 1: return restore_rows<1>(a, r_lo, r_hi);
    case 2: return restore_rows<2>(a, r_lo, r_hi);
    case 4: return restore_rows<4>(a, r_lo, r_hi);
    default: return restore_rows<8>(a, r_lo, r_hi);
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

void quantize_tasks(const QuantArgs& a, int bits, int num_threads) {
  const index_t n = a.n, group_size = a.group_size;
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

}  // namespace

void group_quantize(const void* x, groupquant::FloatKind kind, index_t n, int bits, index_t group_size,
                    std::uint64_t seed, bool stochastic, std::uint8_t* packed, std::uint16_t* lo,
                    std::uint16_t* step, int num_threads) {
  if (n <= 0) return;
  quantize_tasks(QuantArgs{x, kind, n, group_size, seed, stochastic, packed, lo, step}, bits, num_threads);
}

void row_group_quantize(const void* x, groupquant::FloatKind kind, index_t n, index_t run, int bits,
                        index_t group_size, std::uint64_t seed, bool stochastic, std::uint8_t* packed,
                        std::uint16_t* lo, std::uint16_t* step, float* offsets, std::uint8_t* constant,
                        int num_threads) {
  if (n <= 0) return;
  row_offsets(x, kind, n / run, run, offsets, constant, num_threads);
  quantize_tasks(QuantArgs{x, kind, n, group_size, seed, stochastic, packed, lo, step, offsets, run}, bits,
                 num_threads);
}

void row_group_dequantize(const std::uint8_t* packed, const std::uint16_t* lo, const std::uint16_t* step, int bits,
                          index_t group_size, index_t n, index_t run, const float* offsets,
                          const std::uint8_t* constant, groupquant::FloatKind kind, void* out, int num_threads) {
  if (n <= 0) return;
  const DequantArgs a{packed, lo, step, n, group_size, kind, out, offsets, constant, run};
  const index_t rows = n / run;
  const index_t per_task = std::max<index_t>(1, kTaskElems / run);
  const index_t tasks = ceil_div(rows, per_task);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && tasks > 1)
  for (index_t t = 0; t < tasks; ++t) restore_range(a, bits, t * per_task, std::min(rows, (t + 1) * per_task));
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
