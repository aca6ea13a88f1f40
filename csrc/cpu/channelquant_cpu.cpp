// OpenMP loops over the inline channelquant.h functions: per-channel min/max, 8-bit
// channel-wise quantization and its inverse, int64 indices throughout.
//
// The flat tensor is (outer, C, inner): element i belongs to channel (i / inner) % C.
// Quantize and dequantize: tasks of kTaskElems elements (codes are whole bytes, so tasks
// never share an output byte), walked a span of kSpan elements at a time (values converted
// from 16 bits, Philox uniforms). Within a span, when inner >= kRunInner, each run of one
// channel is encoded with that channel's lo and step as scalars; for smaller inner (a
// (B, N, C) tensor per channel has inner = 1) lo and step are first expanded into
// per-element arrays for the span, so the leaf loop stays one vectorized pass.
// Min/max: one task per thread, each with its own partial min/max, folded per channel at
// the end (min and max are exact, so the result does not depend on the split). Runs of a
// channel reduce in lanes; for small inner the partials are per column of the
// (outer, C * inner) matrix instead, reduced with a vectorized loop across columns.
//
// Only the leaf loops are compiled per instruction set (clones.h).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "clones.h"
#include "float_spans.h"
#include "simd.h"
#include "torchstash/channelquant.h"
#include "torchstash/cpu_kernels.h"
#include "torchstash/groupquant.h"

namespace torchstash {
namespace cpu {
namespace {

using groupquant::FloatKind;

constexpr index_t kTaskElems = index_t{1} << 16;   // elements per OpenMP task (quantize, dequantize)
constexpr index_t kRunInner = 64;                  // from here on a channel's runs take scalar lo/step
constexpr index_t kMaxColumns = index_t{1} << 16;  // per-column min/max partials per task, at most
constexpr int kLanes = 32;                         // min/max lanes: independent chains for the SIMD units

// Channel c of flat element i, and r, its position in the run of `inner` elements.
struct Cursor {
  index_t c;
  index_t r;
};

Cursor cursor_at(index_t i, index_t inner, index_t channels) {
  const index_t q = i / inner;
  return Cursor{q % channels, i - q * inner};
}

// ---------------------------------------------------------------- leaf loops

// *mn, *mx <- min/max of themselves and the finite x[0, count), in kLanes independent lanes so
// that the loop vectorizes without -ffast-math.
TS_CPU_CLONES void run_minmax(const float* x, index_t count, float* mn_io, float* mx_io) {
  float mn[kLanes], mx[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    mn[l] = *mn_io;
    mx[l] = *mx_io;
  }
  const float inf = groupquant::bits_float(0x7F800000u);
  const float max_finite = groupquant::bits_float(0x7F7FFFFFu);
  index_t k = 0;
  for (; k + kLanes <= count; k += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float v = x[k + l];
      const bool fin = std::fabs(v) <= max_finite;  // false for NaN and +-inf
      const float lo_v = fin ? v : inf;
      const float hi_v = fin ? v : -inf;
      mn[l] = lo_v < mn[l] ? lo_v : mn[l];
      mx[l] = hi_v > mx[l] ? hi_v : mx[l];
    }
  }
  for (; k < count; ++k) {
    const float v = x[k];
    if (std::fabs(v) <= max_finite) {
      mn[0] = v < mn[0] ? v : mn[0];
      mx[0] = v > mx[0] ? v : mx[0];
    }
  }
  for (int l = 1; l < kLanes; ++l) {
    mn[0] = mn[l] < mn[0] ? mn[l] : mn[0];
    mx[0] = mx[l] > mx[0] ? mx[l] : mx[0];
  }
  *mn_io = mn[0];
  *mx_io = mx[0];
}

// mn[k], mx[k] <- min/max of themselves and x[k] where finite (consecutive columns).
TS_CPU_CLONES void column_minmax(const float* __restrict__ x, index_t count, float* __restrict__ mn,
                                 float* __restrict__ mx) {
  const float inf = groupquant::bits_float(0x7F800000u);
  const float max_finite = groupquant::bits_float(0x7F7FFFFFu);
  for (index_t k = 0; k < count; ++k) {
    const float v = x[k];
    const bool fin = std::fabs(v) <= max_finite;
    const float lo_v = fin ? v : inf;
    const float hi_v = fin ? v : -inf;
    mn[k] = lo_v < mn[k] ? lo_v : mn[k];
    mx[k] = hi_v > mx[k] ? hi_v : mx[k];
  }
}

// channelquant::code_of spelled out for GCC's vectorizer, which (with the default
// -ftrapping-math) gives up on a float select that guards a division. Every float operation
// runs unconditionally and the selects are integer masks: without step > 0 the quotient is
// (lo - lo) / 1, which is 0 (or NaN for an infinite lo), and either gives code 0, as s = 0 does.
__attribute__((always_inline)) inline std::uint8_t select_code(float v, float lo, float step, float u) {
  using groupquant::bits_float;
  using groupquant::float_bits;
  const std::uint32_t sb = float_bits(step);
  const std::uint32_t pos = 0u - static_cast<std::uint32_t>(sb - 1u < 0x7F800000u);  // step in (0, inf]
  const float num = groupquant::sub_rn(bits_float((float_bits(v) & pos) | (float_bits(lo) & ~pos)), lo);
  const float s = groupquant::div_rn(num, bits_float((sb & pos) | (0x3F800000u & ~pos)));
  const std::uint32_t code = groupquant::clamp_code(groupquant::add_rn(s, u), channelquant::kTop);
  const std::uint32_t xb = float_bits(v);
  const std::uint32_t special = (xb & 0x7FFFFFu) != 0 ? channelquant::kNaN
                                : (xb >> 31) != 0     ? channelquant::kNegInf
                                                      : channelquant::kPosInf;
  return static_cast<std::uint8_t>(groupquant::is_finite_bits(xb) ? code : special);
}

// select_code for N elements (simd.h): w = s + u with s from a positive step (0 otherwise, as
// channelquant::finite_code), clamped and truncated; the non-finite x replaced by their codes.
template <int N>
__attribute__((always_inline)) inline ByteV<N> select_codes(const FloatV<N>& v, const FloatV<N>& lo, const FloatV<N>& step,
                                                         const FloatV<N>& u) {
  const IntV<N> pos = step > 0.0f;
  const FloatV<N> num = v - lo;
  const FloatV<N> den = pos ? step : FloatV<N>{} + 1.0f;
  FloatV<N> w = num / den;
  w = (pos ? w : FloatV<N>{}) + u;
  w = w >= 0.0f ? w : 0.0f;  // a NaN fails the compare: 0
  w = w < channelquant::kTop ? w : channelquant::kTop;
  const UintV<N> code = __builtin_convertvector(__builtin_convertvector(w, IntV<N>), UintV<N>) & 0xFFu;
  const UintV<N> xb = (UintV<N>)v;
  const UintV<N> special = (xb & 0x7FFFFFu) != 0u ? UintV<N>{} + channelquant::kNaN
                           : (xb >> 31) != 0u     ? UintV<N>{} + channelquant::kNegInf
                                                  : UintV<N>{} + channelquant::kPosInf;
  const UintV<N> out = (xb & 0x7F800000u) != 0x7F800000u ? code : special;
  return low_bytes<N>(out);
}

// c[k] <- the code of x[k] in one channel (scalar lo, step).
TS_CPU_CLONES void run_codes(const float* __restrict__ x, const float* __restrict__ u, index_t count, float lo,
                             float step, std::uint8_t* __restrict__ c) {
  const index_t done = at_lanes([&](auto n) TS_LANES {
    constexpr int N = decltype(n)::value;
    index_t k = 0;
    for (; k + N <= count; k += N) {
      FloatV<N> v, r;
      std::memcpy(&v, x + k, sizeof(v));
      std::memcpy(&r, u + k, sizeof(r));
      const ByteV<N> b = select_codes<N>(v, FloatV<N>{} + lo, FloatV<N>{} + step, r);
      std::memcpy(c + k, &b, sizeof(b));
    }
    return k;
  });
  for (index_t k = done; k < count; ++k) c[k] = select_code(x[k], lo, step, u[k]);
}

// c[k] <- the code of x[k] with per-element lo_e[k], step_e[k].
TS_CPU_CLONES void expanded_codes(const float* __restrict__ x, const float* __restrict__ u,
                                  const float* __restrict__ lo_e, const float* __restrict__ step_e, index_t count,
                                  std::uint8_t* __restrict__ c) {
  const index_t done = at_lanes([&](auto n) TS_LANES {
    constexpr int N = decltype(n)::value;
    index_t k = 0;
    for (; k + N <= count; k += N) {
      FloatV<N> v, r, lo, step;
      std::memcpy(&v, x + k, sizeof(v));
      std::memcpy(&r, u + k, sizeof(r));
      std::memcpy(&lo, lo_e + k, sizeof(lo));
      std::memcpy(&step, step_e + k, sizeof(step));
      const ByteV<N> b = select_codes<N>(v, lo, step, r);
      std::memcpy(c + k, &b, sizeof(b));
    }
    return k;
  });
  for (index_t k = done; k < count; ++k) c[k] = select_code(x[k], lo_e[k], step_e[k], u[k]);
}

// channelquant::value_of spelled out for the vectorizer: the affine value is computed for
// every code and replaced, through an integer mask, by the reserved codes' values.
__attribute__((always_inline)) inline float select_value(std::uint8_t code, float lo, float step) {
  using groupquant::bits_float;
  using groupquant::float_bits;
  const std::uint32_t c = code;
  const float v = groupquant::add_rn(lo, groupquant::mul_rn(static_cast<float>(code), step));
  const std::uint32_t keep = 0u - static_cast<std::uint32_t>(c < channelquant::kNegInf);
  const std::uint32_t special = c == channelquant::kNaN ? 0x7FC00000u : c == channelquant::kPosInf ? 0x7F800000u : 0xFF800000u;
  return bits_float((float_bits(v) & keep) | (special & ~keep));
}

// vals[k] <- the value of codes[k] in one channel (scalar lo, step).
TS_CPU_CLONES void run_values(const std::uint8_t* __restrict__ codes, index_t count, float lo, float step,
                              float* __restrict__ vals) {
  for (index_t k = 0; k < count; ++k) vals[k] = select_value(codes[k], lo, step);
}

// vals[k] <- the value of codes[k] with per-element lo_e[k], step_e[k].
TS_CPU_CLONES void expanded_values(const std::uint8_t* __restrict__ codes, const float* __restrict__ lo_e,
                                   const float* __restrict__ step_e, index_t count, float* __restrict__ vals) {
  for (index_t k = 0; k < count; ++k) vals[k] = select_value(codes[k], lo_e[k], step_e[k]);
}

// ---------------------------------------------------------------- per span

struct Channels {
  const float* lo;
  const float* step;
  index_t inner;
  index_t channels;
};

// lo_e, step_e[0, count) <- lo, step of the channels of elements [first, first + count).
void expand_params(const Channels& ch, index_t first, index_t count, float* lo_e, float* step_e) {
  Cursor cur = cursor_at(first, ch.inner, ch.channels);
  index_t k = 0;
  if (ch.inner == 1) {  // consecutive elements, consecutive channels: copy runs of lo and step
    while (k < count) {
      const index_t len = std::min(ch.channels - cur.c, count - k);
      std::memcpy(lo_e + k, ch.lo + cur.c, static_cast<std::size_t>(len) * sizeof(float));
      std::memcpy(step_e + k, ch.step + cur.c, static_cast<std::size_t>(len) * sizeof(float));
      k += len;
      cur.c = 0;
    }
    return;
  }
  while (k < count) {
    const index_t len = std::min(ch.inner - cur.r, count - k);
    std::fill(lo_e + k, lo_e + k + len, ch.lo[cur.c]);
    std::fill(step_e + k, step_e + k + len, ch.step[cur.c]);
    k += len;
    cur.r = 0;
    cur.c = cur.c + 1 == ch.channels ? 0 : cur.c + 1;
  }
}

// Calls f(k, len, c) for the runs of one channel among elements [first, first + count).
template <typename F>
void for_each_run(const Channels& ch, index_t first, index_t count, F f) {
  Cursor cur = cursor_at(first, ch.inner, ch.channels);
  for (index_t k = 0; k < count;) {
    const index_t len = std::min(ch.inner - cur.r, count - k);
    f(k, len, cur.c);
    k += len;
    cur.r = 0;
    cur.c = cur.c + 1 == ch.channels ? 0 : cur.c + 1;
  }
}

struct QuantArgs {
  const void* x;
  FloatKind kind;
  Channels ch;
  std::uint64_t seed;
  bool stochastic;
  std::uint8_t* codes;
};

void quantize_range(const QuantArgs& a, index_t e_lo, index_t e_hi) {
  float xbuf[kSpan];
  float ubuf[kUniforms];
  float lo_e[kSpan];
  float step_e[kSpan];
  if (!a.stochastic) std::fill(ubuf, ubuf + kSpan, groupquant::kNearest);
  const float* u = ubuf;
  for (index_t s = e_lo; s < e_hi; s += kSpan) {
    const index_t count = std::min(kSpan, e_hi - s);
    const float* x = load_floats(a.x, a.kind, s, count, xbuf);
    if (a.stochastic) u = fill_uniforms(ubuf, s, count, a.seed);
    std::uint8_t* out = a.codes + s;
    if (a.ch.inner >= kRunInner) {
      for_each_run(a.ch, s, count, [&](index_t k, index_t len, index_t c) {
        run_codes(x + k, u + k, len, a.ch.lo[c], a.ch.step[c], out + k);
      });
    } else {
      expand_params(a.ch, s, count, lo_e, step_e);
      expanded_codes(x, u, lo_e, step_e, count, out);
    }
  }
}

struct DequantArgs {
  const std::uint8_t* codes;
  Channels ch;
  FloatKind kind;
  void* out;
};

void dequantize_range(const DequantArgs& a, index_t e_lo, index_t e_hi) {
  float vbuf[kSpan];
  float lo_e[kSpan];
  float step_e[kSpan];
  for (index_t s = e_lo; s < e_hi; s += kSpan) {
    const index_t count = std::min(kSpan, e_hi - s);
    const std::uint8_t* codes = a.codes + s;
    // float32 output is written in place; 16-bit output goes through vbuf.
    float* vals = a.kind == FloatKind::kFloat32 ? static_cast<float*>(a.out) + s : vbuf;
    if (a.ch.inner >= kRunInner) {
      for_each_run(a.ch, s, count, [&](index_t k, index_t len, index_t c) {
        run_values(codes + k, len, a.ch.lo[c], a.ch.step[c], vals + k);
      });
    } else {
      expand_params(a.ch, s, count, lo_e, step_e);
      expanded_values(codes, lo_e, step_e, count, vals);
    }
    if (a.kind != FloatKind::kFloat32) store_floats(a.out, a.kind, s, count, vbuf);
  }
}

// Partial min/max of elements [e_lo, e_hi) into pmn, pmx: per channel, or per column of the
// (outer, C * inner) matrix when `columns` > 0.
void minmax_range(const void* x, FloatKind kind, const Channels& ch, index_t columns, index_t e_lo, index_t e_hi,
                  float* pmn, float* pmx) {
  float xbuf[kSpan];
  for (index_t s = e_lo; s < e_hi; s += kSpan) {
    const index_t count = std::min(kSpan, e_hi - s);
    const float* v = load_floats(x, kind, s, count, xbuf);
    if (columns > 0) {
      index_t j = s % columns;
      for (index_t k = 0; k < count;) {
        const index_t len = std::min(columns - j, count - k);
        column_minmax(v + k, len, pmn + j, pmx + j);
        k += len;
        j = 0;
      }
    } else {
      for_each_run(ch, s, count, [&](index_t k, index_t len, index_t c) { run_minmax(v + k, len, pmn + c, pmx + c); });
    }
  }
}

}  // namespace

void channel_minmax(const void* x, groupquant::FloatKind kind, index_t n, index_t inner, index_t channels, float* mn,
                    float* mx, int num_threads) {
  const float inf = groupquant::bits_float(0x7F800000u);
  // Per column for small inner (a vectorized pass across the columns), per channel otherwise.
  const index_t columns = inner < kRunInner && channels <= kMaxColumns / inner ? inner * channels : 0;
  const index_t width = columns > 0 ? columns : channels;
  const index_t tasks = n <= 0 ? 0 : std::min<index_t>(std::max(1, num_threads), ceil_div(n, kTaskElems));
  std::vector<float> pmn(static_cast<std::size_t>(tasks * width), inf);
  std::vector<float> pmx(static_cast<std::size_t>(tasks * width), -inf);
  const Channels ch{nullptr, nullptr, inner, channels};
  if (tasks > 0) {
    const index_t chunk = ceil_div(n, tasks);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && tasks > 1)
    for (index_t t = 0; t < tasks; ++t) {
      const index_t e_lo = std::min(n, t * chunk);
      minmax_range(x, kind, ch, columns, e_lo, std::min(n, e_lo + chunk), pmn.data() + t * width,
                   pmx.data() + t * width);
    }
  }
  const index_t per = columns > 0 ? inner : 1;  // partials per channel in each task
  for (index_t c = 0; c < channels; ++c) {
    float lo = inf;
    float hi = -inf;
    for (index_t t = 0; t < tasks; ++t) {
      const float* tmn = pmn.data() + t * width + c * per;
      const float* tmx = pmx.data() + t * width + c * per;
      for (index_t j = 0; j < per; ++j) {
        lo = tmn[j] < lo ? tmn[j] : lo;
        hi = tmx[j] > hi ? tmx[j] : hi;
      }
    }
    mn[c] = channelquant::canonical(lo);
    mx[c] = channelquant::canonical(hi);
  }
}

void channel_quantize(const void* x, groupquant::FloatKind kind, index_t n, index_t inner, index_t channels,
                      const float* lo, const float* step, std::uint64_t seed, bool stochastic, std::uint8_t* codes,
                      int num_threads) {
  if (n <= 0) return;
  const QuantArgs a{x, kind, Channels{lo, step, inner, channels}, seed, stochastic, codes};
  const index_t tasks = ceil_div(n, kTaskElems);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && tasks > 1)
  for (index_t t = 0; t < tasks; ++t) {
    const index_t e_lo = t * kTaskElems;
    quantize_range(a, e_lo, std::min(n, e_lo + kTaskElems));
  }
}

void channel_dequantize(const std::uint8_t* codes, index_t n, index_t inner, index_t channels, const float* lo,
                        const float* step, groupquant::FloatKind kind, void* out, int num_threads) {
  if (n <= 0) return;
  const DequantArgs a{codes, Channels{lo, step, inner, channels}, kind, out};
  const index_t tasks = ceil_div(n, kTaskElems);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && tasks > 1)
  for (index_t t = 0; t < tasks; ++t) {
    const index_t e_lo = t * kTaskElems;
    dequantize_range(a, e_lo, std::min(n, e_lo + kTaskElems));
  }
}

namespace {

// torch.minimum / torch.maximum of two floats: NaN if either is NaN.
float minimum_nan(float a, float b) {
  if (a != a || b != b) return groupquant::bits_float(0x7FC00000u);
  return b < a ? b : a;
}

float maximum_nan(float a, float b) {
  if (a != a || b != b) return groupquant::bits_float(0x7FC00000u);
  return b > a ? b : a;
}

}  // namespace

void mesa_range(const float* mn, const float* mx, index_t channels, index_t groups, const float* prev, float decay,
                float rest, float* lo, float* step, float* run) {
  const float inf = groupquant::bits_float(0x7F800000u);
  std::vector<float> gmin(static_cast<std::size_t>(groups), inf);
  std::vector<float> gmax(static_cast<std::size_t>(groups), -inf);
  for (index_t c = 0; c < channels; ++c) {
    const index_t g = c * groups / channels;
    gmin[g] = mn[c] < gmin[g] ? mn[c] : gmin[g];
    gmax[g] = mx[c] > gmax[g] ? mx[c] : gmax[g];
  }
  for (index_t g = 0; g < groups; ++g) {
    const bool seen = gmin[g] <= gmax[g];
    float run_lo = 0.0f;
    float run_hi = 0.0f;
    if (prev != nullptr) {
      // two products, then their sum (no FMA: -ffp-contract=off), as torch's three ops
      const float blend_lo = decay * prev[g] + rest * gmin[g];
      const float blend_hi = decay * prev[groups + g] + rest * gmax[g];
      run_lo = seen ? blend_lo : prev[g];
      run_hi = seen ? blend_hi : prev[groups + g];
    } else if (seen) {
      run_lo = gmin[g];
      run_hi = gmax[g];
    }
    run[g] = run_lo;
    run[groups + g] = run_hi;
    const float l = minimum_nan(run_lo, gmin[g]);
    float width = maximum_nan(run_hi, gmax[g]) - l;
    width = width != width || width >= 0.0f ? width : 0.0f;  // clamp_min(0), NaN kept
    lo[g] = l;
    step[g] = width / channelquant::kTop;
  }
}

}  // namespace cpu
}  // namespace torchstash
