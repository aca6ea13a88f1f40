// Sign bits, host and device: where a float tensor is above zero (NaN counts as above), one
// bit per element in the bitpack layout, and those bits back as 1.0 / 0.0 in the tensor's
// dtype. Shared by csrc/cpu/signs_cpu.cpp and csrc/cuda/signs_cuda.cu; the definition is
// torchstash.kernels.reference.sign_pack_ref / sign_unpack_ref.
#pragma once

#include <cstdint>

#include "torchstash/common.h"

namespace torchstash {

// The element types sign bits read and write (torch float32, float64, float16, bfloat16).
enum class SignKind : int { kFloat32 = 0, kFloat64 = 1, kFloat16 = 2, kBFloat16 = 3 };

namespace signs {

// !(x <= 0) for a 16-bit float's bits: NaN (magnitude above the infinity's `inf_bits`), or
// the sign bit clear and the value not zero.
TS_HD bool above_bits16(std::uint16_t h, std::uint16_t inf_bits) {
  const std::uint16_t mag = static_cast<std::uint16_t>(h & 0x7FFFu);
  return mag > inf_bits || (h < 0x8000u && mag != 0);
}

// The bits of +infinity (16-bit kinds) and of 1.0 (every kind).
TS_HD std::uint16_t inf_bits16(SignKind kind) { return kind == SignKind::kFloat16 ? 0x7C00u : 0x7F80u; }
TS_HD std::uint16_t one_bits16(SignKind kind) { return kind == SignKind::kFloat16 ? 0x3C00u : 0x3F80u; }
constexpr std::uint32_t kOne32 = 0x3F800000u;
constexpr std::uint64_t kOne64 = 0x3FF0000000000000ull;

}  // namespace signs
}  // namespace torchstash
