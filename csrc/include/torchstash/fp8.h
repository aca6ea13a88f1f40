// e4m3 codes with a per-group scale (quant.fp8), host and device: the per-element and
// per-group arithmetic shared by the CPU loops (csrc/cpu/fp8_cpu.cpp) and the CUDA kernels
// (csrc/cuda/fp8_cuda.cu).
//
// The bit-exact definition is torchstash.kernels.fp8_reference (csrc/README.md repeats it):
//   amax    the group's largest finite |x| (0 when none); special: the group holds NaN/Inf
//   scale   bf16_up(amax / top) with top = 240 (special) or 448, 1 when amax is 0; stored as
//           bfloat16, negated for a special group
//   code    finite x: e4m3(clamp(x / scale, -448, 448)), torch's float32 -> float8_e4m3fn cast
//           (round to nearest even; the clamp only acts where the scale underflowed, and makes
//           the code the same whether a torch saturates or gives NaN past 448); +Inf 0x78,
//           -Inf 0xF8, NaN 0x7F
//   value   e4m3 value * |scale| (float32), +-Inf for 0x78 / 0xF8 in a special group
// The conversions are c10's fp8e4m3fn_from_fp32_value (the saturating one of torch 2.10 on,
// which is the clamped cast) and fp8e4m3fn_to_fp32_value, bit for bit.
#pragma once

#include <cstdint>

#include "torchstash/common.h"
#include "torchstash/groupquant.h"

namespace torchstash {
namespace fp8 {

constexpr std::uint8_t kPosInf = 0x78;
constexpr std::uint8_t kNegInf = 0xF8;
constexpr std::uint8_t kNaN = 0x7F;

// float32 -> e4m3fn bits of clamp(f, -448, 448): 0x7E past 448 (Inf included), NaN 0x7F.
TS_HD std::uint8_t e4m3_from_float(float f) {
  constexpr std::uint32_t kMax = UINT32_C(1087) << 20;       // 480.0f: past the last rounding to 448
  constexpr std::uint32_t kDenormMask = UINT32_C(141) << 23;  // 2^14: aligns subnormals
  std::uint32_t b = groupquant::float_bits(f);
  const std::uint32_t sign = b & 0x80000000u;
  b ^= sign;
  std::uint8_t result;
  if (b >= kMax) {
    result = b > 0x7F800000u ? 0x7F : 0x7E;  // NaN stays NaN; the rest saturates
  } else if (b < (UINT32_C(121) << 23)) {  // below 2^-6, the smallest normal e4m3
    const float aligned = groupquant::add_rn(groupquant::bits_float(b), groupquant::bits_float(kDenormMask));
    result = static_cast<std::uint8_t>(groupquant::float_bits(aligned) - kDenormMask);
  } else {
    const std::uint32_t odd = (b >> 20) & 1u;  // round half to even
    b += ((std::uint32_t)(7 - 127) << 23) + 0x7FFFFu;
    b += odd;
    result = static_cast<std::uint8_t>(b >> 20);
    if (result == 0x7F) result = 0x7E;  // rounded up past 448: saturates
  }
  return static_cast<std::uint8_t>(result | (sign >> 24));
}

TS_HD int clz32(std::uint32_t v) {
#if defined(__CUDA_ARCH__)
  return __clz(static_cast<int>(v));
#else
  return v == 0 ? 32 : __builtin_clz(v);
#endif
}

// e4m3fn bits -> float32, as c10's fp8e4m3fn_to_fp32_value (exact; 0x7F / 0xFF are NaN).
TS_HD float e4m3_to_float(std::uint8_t code) {
  const std::uint32_t w = static_cast<std::uint32_t>(code) << 24;
  const std::uint32_t sign = w & 0x80000000u;
  const std::uint32_t nonsign = w & 0x7FFFFFFFu;
  int shift = clz32(nonsign);
  shift = shift > 4 ? shift - 4 : 0;
  const std::int32_t inf_nan = (static_cast<std::int32_t>(nonsign + 0x01000000u) >> 8) & INT32_C(0x7F800000);
  const std::int32_t zero = static_cast<std::int32_t>(nonsign - 1u) >> 31;
  const std::uint32_t mag = ((nonsign << shift >> 4) + (static_cast<std::uint32_t>(0x78 - shift) << 23)) |
                            static_cast<std::uint32_t>(inf_nan);
  return groupquant::bits_float(sign | (mag & ~static_cast<std::uint32_t>(zero)));
}

// A group's scale (a bfloat16 value) from its largest finite magnitude.
TS_HD float group_scale(float amax, bool special) {
  const float top = special ? 240.0f : 448.0f;
  return groupquant::bf16_up(amax > 0.0f ? groupquant::div_rn(amax, top) : 1.0f);
}

// The stored bfloat16 bits: the scale, its sign bit set for a special group.
TS_HD std::uint16_t stored_scale(float scale, bool special) {
  return static_cast<std::uint16_t>((groupquant::float_bits(scale) >> 16) | (special ? 0x8000u : 0u));
}

TS_HD std::uint8_t code_of(float x, float scale) {
  const std::uint32_t b = groupquant::float_bits(x);
  if (!groupquant::is_finite_bits(b)) {
    if ((b & 0x7FFFFFFFu) != 0x7F800000u) return kNaN;
    return (b >> 31) != 0 ? kNegInf : kPosInf;
  }
  return e4m3_from_float(groupquant::div_rn(x, scale));
}

// The value of a code with the stored scale's magnitude and sign (special).
TS_HD float value_of(std::uint8_t code, float magnitude, bool special) {
  if (special && code == kPosInf) return groupquant::bits_float(0x7F800000u);
  if (special && code == kNegInf) return groupquant::bits_float(0xFF800000u);
  return groupquant::mul_rn(e4m3_to_float(code), magnitude);
}

}  // namespace fp8
}  // namespace torchstash
