// Fused per-group stochastic quantization, host and device: the per-element and per-group
// arithmetic shared by the CPU loops (csrc/cpu/groupquant_cpu.cpp) and the CUDA kernels
// (csrc/cuda/groupquant_cuda.cu).
//
// The bit-exact definition is torchstash.kernels.groupquant_reference (csrc/README.md
// repeats it). Everything here works on float32 values and bit patterns:
//   group stats  mn, mx over the finite elements (0, 0 when none), -0.0 read as +0.0
//   levels L     2^bits - 1; a special group (NaN/Inf inside) reserves codes: L = 2^bits - 4
//                (bits >= 2), L = 0 (bits == 1)
//   lo           bf16_down(mn);  step = bf16_up((mx - lo) / L), 0 when L == 0
//   code         clamp(floor((x - lo) / step + u), 0, L), 0 when step == 0 or on NaN
//   value        lo + code * step (multiply, then add)
//   tiny group   finite values all subnormal, not all zero: coded scaled by 2^126 (exact), lo
//                from its shape (tiny_params), stored as the NaN pattern 0x7F80 | shape;
//                value (lo + code * step) * 2^-126
// The arithmetic must not be contracted into FMAs: on the device it uses the explicitly
// rounded intrinsics (__fsub_rn, __fdiv_rn, __fadd_rn, __fmul_rn), on the host the
// translation units are built with -ffp-contract=off (torchstash.kernels.loader._flags).
#pragma once

#include <cstdint>
#include <cstring>

#include "torchstash/common.h"
#include "torchstash/philox.h"

namespace torchstash {
namespace groupquant {

// The floating-point types the ops read and write (torch float32, float16, bfloat16).
enum class FloatKind : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// The uniform used without stochastic rounding: floor(v + 0.5) rounds to nearest.
constexpr float kNearest = 0.5f;

TS_HD std::uint32_t float_bits(float v) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(v);
#else
  std::uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  return b;
#endif
}

TS_HD float bits_float(std::uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float v;
  std::memcpy(&v, &b, sizeof(v));
  return v;
#endif
}

// Correctly rounded (round-to-nearest-even) fp32 operations that are never fused.
TS_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

TS_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

TS_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

TS_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

TS_HD bool is_finite_bits(std::uint32_t b) { return (b & 0x7F800000u) != 0x7F800000u; }
TS_HD bool is_finite(float v) { return is_finite_bits(float_bits(v)); }

// The largest bfloat16 <= v, for finite v; below the lowest bfloat16 it is -inf.
TS_HD float bf16_down(float v) {
  const std::uint32_t b = float_bits(v);
  const std::uint32_t trunc = b & 0xFFFF0000u;  // toward zero: down for v >= 0, up for v < 0
  const bool inexact = (b & 0xFFFFu) != 0;
  return bits_float(inexact && (b >> 31) != 0 ? trunc + 0x10000u : trunc);
}

// The smallest bfloat16 >= v, for finite v or +inf; above the largest bfloat16 it is +inf.
TS_HD float bf16_up(float v) {
  const std::uint32_t b = float_bits(v);
  const std::uint32_t trunc = b & 0xFFFF0000u;
  const bool inexact = (b & 0xFFFFu) != 0;
  return bits_float(inexact && (b >> 31) == 0 ? trunc + 0x10000u : trunc);
}

// ---------------------------------------------------------------- storage conversions

TS_HD float bf16_bits_to_float(std::uint16_t h) { return bits_float(static_cast<std::uint32_t>(h) << 16); }

// Exact. Subnormals: m * 2^-24 is a product of exact values (no rounding, nothing to fuse).
TS_HD float half_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t e = (h >> 10) & 0x1Fu;
  const std::uint32_t m = h & 0x3FFu;
  if (e == 0) return bits_float(sign | float_bits(static_cast<float>(m) * 5.9604644775390625e-08f));
  if (e == 31) return bits_float(sign | 0x7F800000u | (m << 13));
  return bits_float(sign | ((e + 112u) << 23) | (m << 13));
}

// Round to nearest even, as torch's fp32 -> bf16 cast; every NaN becomes 0x7FC0 (torch's
// scalar cast; its vectorized CPU cast writes 0xFFFF, so NaN payloads are not compared).
TS_HD std::uint16_t float_to_bf16_bits(float v) {
  const std::uint32_t b = float_bits(v);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
  return static_cast<std::uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

// Round to nearest even, as torch's fp32 -> fp16 cast (overflow to inf, subnormals kept);
// a NaN becomes sign | 0x7E00, as in torch.
TS_HD std::uint16_t float_to_half_bits(float v) {
  const std::uint32_t b = float_bits(v);
  const auto sign = static_cast<std::uint16_t>((b >> 16) & 0x8000u);
  const std::uint32_t a = b & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<std::uint16_t>(sign | 0x7E00u);
  if (a >= 0x477FF000u) return static_cast<std::uint16_t>(sign | 0x7C00u);  // >= 65520: inf
  if (a >= 0x38800000u) {  // a normal half: rebias the exponent, round the 13 dropped bits
    return static_cast<std::uint16_t>(sign | ((a - 0x38000000u + 0xFFFu + ((a >> 13) & 1u)) >> 13));
  }
  const std::uint32_t e = a >> 23;
  if (e < 102) return sign;  // below 2^-25: rounds to zero
  const std::uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  const std::uint32_t shift = 126u - e;  // value * 2^24 = m * 2^(e - 126), shift in [14, 24]
  std::uint32_t q = m >> shift;
  const std::uint32_t rem = m & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u) != 0)) ++q;
  return static_cast<std::uint16_t>(sign | q);
}

// ---------------------------------------------------------------- per group

// Highest code a finite value may take.
TS_HD int levels(int bits, bool special) {
  if (!special) return (1 << bits) - 1;
  return bits >= 2 ? (1 << bits) - 4 : 0;
}

// Running min/max over the finite elements; `nonfinite` marks a special group.
struct Stats {
  float mn;
  float mx;
  bool nonfinite;
};

TS_HD Stats empty_stats() { return Stats{bits_float(0x7F800000u), bits_float(0xFF800000u), false}; }

TS_HD void accumulate(Stats* s, float x) {
  if (is_finite(x)) {
    s->mn = x < s->mn ? x : s->mn;
    s->mx = x > s->mx ? x : s->mx;
  } else {
    s->nonfinite = true;
  }
}

TS_HD Stats merge(Stats a, Stats b) {
  return Stats{b.mn < a.mn ? b.mn : a.mn, b.mx > a.mx ? b.mx : a.mx, a.nonfinite || b.nonfinite};
}

// A tiny group (its finite values all subnormal, not all zero) would get bfloat16 subnormals
// for lo and step, multiples of 2^-133: about two significant bits for randn * 1e-40. It is
// coded scaled by 2^126, exact for a subnormal, with a lo made from its shape (tiny_params)
// and stored as the bfloat16 NaN pattern kTinyLo | shape, which no other group stores.
constexpr std::uint32_t kSmallestNormal = 0x00800000u;  // 2^-126 (also the decoding factor)
constexpr std::uint32_t kTinyScale = 0x7E800000u;       // 2^126
constexpr std::uint16_t kTinyLo = 0x7F80u;
enum Shape : int { kOrdinary = 0, kPositive = 1, kNegative = 2, kBoth = 3 };

// What quantizing and dequantizing a group needs. `step` is the magnitude (>= 0); the
// stored form carries `special` in its sign bit. `scale` multiplies a value before coding,
// `unit` a decoded one: 1 for an ordinary group, 2^126 and 2^-126 for a tiny one.
struct Params {
  float lo;
  float step;
  float top;  // levels(bits, special), as a float for the clamp
  bool special;
  int shape;
  float scale;
  float unit;
};

// A tiny group's scaled lo from its shape and scaled step: 0 (positive: zero is level 0),
// -top * step (negative: zero is the top level) or -top * step / 2 (both); all exact.
TS_HD float tiny_lo(int shape, float top, float step) {
  const float span = mul_rn(top, step);
  if (shape == kPositive) return 0.0f;
  return sub_rn(0.0f, shape == kNegative ? span : mul_rn(span, 0.5f));
}

TS_HD Params ordinary_params(float lo, float step, float top, bool special) {
  return Params{lo, step, top, special, kOrdinary, 1.0f, 1.0f};
}

TS_HD Params tiny_group(int shape, float step, float top, bool special) {
  return Params{tiny_lo(shape, top, step), step, top, special, shape, bits_float(kTinyScale),
                bits_float(kSmallestNormal)};
}

// A tiny group's parameters from its finite range [mn, mx] (not scaled yet).
TS_HD Params tiny_params(float mn, float mx, float top, bool special) {
  const float smn = mul_rn(mn, bits_float(kTinyScale));
  const float smx = mul_rn(mx, bits_float(kTinyScale));
  const int shape = mn >= 0.0f ? kPositive : mx <= 0.0f ? kNegative : kBoth;
  const float big = smx > -smn ? smx : -smn;
  const float width = shape == kPositive ? smx : shape == kNegative ? -smn : add_rn(big, big);
  return tiny_group(shape, top > 0.0f ? bf16_up(div_rn(width, top)) : 0.0f, top, special);
}

TS_HD Params make_params(Stats s, int bits) {
  const bool any_finite = s.mn <= s.mx;  // mn stays +inf without a finite element
  // + 0.0f turns -0.0 into +0.0: the group's zeros may have come in either sign.
  const float mn = add_rn(any_finite ? s.mn : 0.0f, 0.0f);
  const float mx = add_rn(any_finite ? s.mx : 0.0f, 0.0f);
  const float top = static_cast<float>(levels(bits, s.nonfinite));
  const float big = mx > -mn ? mx : -mn;
  if (big > 0.0f && big < bits_float(kSmallestNormal)) return tiny_params(mn, mx, top, s.nonfinite);
  const float lo = bf16_down(mn);
  const float step = top > 0.0f ? bf16_up(div_rn(sub_rn(mx, lo), top)) : 0.0f;
  return ordinary_params(lo, step, top, s.nonfinite);
}

// The bfloat16 bit patterns stored for a group (both values are bfloat16 already).
TS_HD std::uint16_t stored_lo(const Params& p) {
  if (p.shape != kOrdinary) return static_cast<std::uint16_t>(kTinyLo | p.shape);
  return static_cast<std::uint16_t>(float_bits(p.lo) >> 16);
}
TS_HD std::uint16_t stored_step(const Params& p) {
  return static_cast<std::uint16_t>((float_bits(p.step) >> 16) | (p.special ? 0x8000u : 0u));
}

// A group's parameters back from its stored bfloat16 lo and signed step.
TS_HD Params load_params(std::uint16_t lo_bits, std::uint16_t step_bits, int bits) {
  const bool special = (step_bits & 0x8000u) != 0;
  const float step = bf16_bits_to_float(static_cast<std::uint16_t>(step_bits & 0x7FFFu));
  const float top = static_cast<float>(levels(bits, special));
  if ((lo_bits & 0x7FFFu) > kTinyLo) return tiny_group(lo_bits & 0x7F, step, top, special);  // a NaN lo
  return ordinary_params(bf16_bits_to_float(lo_bits), step, top, special);
}

// ---------------------------------------------------------------- per element

// clamp(floor(w), 0, top) for w = (x - lo) / step + u, with a NaN w giving 0. For w >= 0
// truncation is floor, and clamping before flooring is the same as after (top is an integer).
// Written as two selects (a NaN fails `w >= 0` first) so that CPU loops vectorize.
TS_HD std::uint8_t clamp_code(float w, float top) {
  const float c = w >= 0.0f ? w : 0.0f;
  return static_cast<std::uint8_t>(static_cast<int>(c < top ? c : top));
}

// Code of a finite x in a group with step > 0.
TS_HD std::uint8_t finite_code(float x, float lo, float step, float top, float u) {
  return clamp_code(add_rn(div_rn(sub_rn(x, lo), step), u), top);
}

// Reserved code of a non-finite x: NaN, +Inf, -Inf = 2^bits - 1, - 2, - 3 (bits >= 2); 1 at 1 bit.
TS_HD std::uint8_t nonfinite_code(float x, int bits) {
  if (bits == 1) return 1;
  const std::uint32_t b = float_bits(x);
  const int hi = (1 << bits) - 1;
  if ((b & 0x7FFFFFFFu) != 0x7F800000u) return static_cast<std::uint8_t>(hi);  // NaN
  return static_cast<std::uint8_t>((b >> 31) != 0 ? hi - 2 : hi - 1);
}

// Code of any element of a group (a tiny group's scaled first: exact).
TS_HD std::uint8_t code_of(float x, const Params& p, float u, int bits) {
  if (!is_finite(x)) return nonfinite_code(x, bits);
  return p.step > 0.0f ? finite_code(mul_rn(x, p.scale), p.lo, p.step, p.top, u) : 0;
}

// Value of a code: (lo + code * step) * unit, or the non-finite value a reserved code stands for.
TS_HD float value_of(std::uint8_t code, const Params& p, int bits) {
  if (p.special) {
    const int hi = (1 << bits) - 1;
    if (bits == 1) {
      if (code == 1) return bits_float(0x7FC00000u);
    } else if (code == hi) {
      return bits_float(0x7FC00000u);
    } else if (code == hi - 1) {
      return bits_float(0x7F800000u);
    } else if (code == hi - 2) {
      return bits_float(0xFF800000u);
    }
  }
  return mul_rn(add_rn(p.lo, mul_rn(static_cast<float>(code), p.step)), p.unit);
}

// philox_uniform(n, seed, 0)[i]: word i % 4 of Philox block i / 4 at offset 0.
TS_HD float uniform_at(std::uint64_t seed, index_t i) {
  const philox::Words w = philox::block_words(seed, 0, static_cast<std::uint64_t>(i) >> 2);
  const int k = static_cast<int>(i & 3);
  return philox::to_uniform(k == 0 ? w.x0 : k == 1 ? w.x1 : k == 2 ? w.x2 : w.x3);
}

// Groups per run whose bit length is a whole number of bytes: a run of that many groups
// starts on a byte boundary, so parallel tasks made of whole runs never share a byte.
TS_HD index_t byte_aligned_groups(index_t group_size, int bits) {
  index_t k = 1;
  while (((group_size % 8) * bits * k) % 8 != 0) k *= 2;
  return k;
}

}  // namespace groupquant
}  // namespace torchstash
