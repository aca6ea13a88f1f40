// Channel-wise ("head-wise") 8-bit quantization, host and device: the per-element arithmetic
// shared by the CPU loops (csrc/cpu/channelquant_cpu.cpp) and the CUDA kernels
// (csrc/cuda/channelquant_cuda.cu). It is the layout of the Mesa codec (quant.mesa).
//
// The bit-exact definition is torchstash.kernels.channelquant_reference (csrc/README.md
// repeats it). A flat tensor of n elements is read as (n / (inner * C), C, inner): element i
// belongs to channel (i / inner) % C. Per channel, float32 lo and step (chosen by the caller):
//   stats   min, max over the channel's finite elements (+inf, -inf when none), -0.0 as +0.0
//   code    finite x: clamp(floor(s + u), 0, 252) with s = (x - lo) / step when step > 0,
//           else s = 0; a NaN quotient gives 0. NaN = 255, +Inf = 254, -Inf = 253.
//   value   lo + code * step (multiply, then add); the reserved codes give NaN, +Inf, -Inf
// No FMA: the device uses the explicitly rounded intrinsics (groupquant.h's sub_rn, div_rn,
// add_rn, mul_rn), the host units are built with -ffp-contract=off.
#pragma once

#include <cstdint>

#include "torchstash/common.h"
#include "torchstash/groupquant.h"

namespace torchstash {
namespace channelquant {

// Highest code of a finite value, and the codes reserved for the non-finite ones.
constexpr int kLevels = 252;
constexpr float kTop = 252.0f;
constexpr std::uint8_t kNegInf = 253;
constexpr std::uint8_t kPosInf = 254;
constexpr std::uint8_t kNaN = 255;

// Channel of flat element i.
TS_HD index_t channel_of(index_t i, index_t inner, index_t channels) { return (i / inner) % channels; }

// Reserved code of a non-finite x (x != x is NaN; otherwise its sign picks the infinity).
TS_HD std::uint8_t nonfinite_code(float x) {
  return x != x ? kNaN : (x > 0.0f ? kPosInf : kNegInf);
}

// Code of a finite x. `step > 0` is false for 0, negative and NaN steps: then s = 0 and,
// u being below 1, the code is 0. Written as selects so that CPU loops vectorize.
TS_HD std::uint8_t finite_code(float x, float lo, float step, float u) {
  const bool positive = step > 0.0f;
  const float s = groupquant::div_rn(groupquant::sub_rn(x, lo), positive ? step : 1.0f);
  return groupquant::clamp_code(groupquant::add_rn(positive ? s : 0.0f, u), kTop);
}

// Code of any element.
TS_HD std::uint8_t code_of(float x, float lo, float step, float u) {
  return groupquant::is_finite(x) ? finite_code(x, lo, step, u) : nonfinite_code(x);
}

// Value of a code: lo + code * step, rounded twice, or the non-finite value it stands for.
TS_HD float value_of(std::uint8_t code, float lo, float step) {
  const float v = groupquant::add_rn(lo, groupquant::mul_rn(static_cast<float>(code), step));
  if (code < kNegInf) return v;
  return groupquant::bits_float(code == kNaN ? 0x7FC00000u : code == kPosInf ? 0x7F800000u : 0xFF800000u);
}

// A channel's min (max) as the op returns it: -0.0 becomes +0.0, infinities stay.
TS_HD float canonical(float v) { return groupquant::add_rn(v, 0.0f); }

}  // namespace channelquant
}  // namespace torchstash
