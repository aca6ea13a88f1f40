// Span helpers shared by the fused quantization loops (groupquant_cpu.cpp,
// channelquant_cpu.cpp): float32/float16/bfloat16 in and out of a float32 buffer, and the
// Philox uniforms of a span of elements. Internal linkage: each unit gets its own copy,
// fill_uniforms compiled per instruction set (clones.h).
#pragma once

#include <cstdint>
#include <cstring>

#include "clones.h"
#include "philox_lanes.h"
#include "torchstash/common.h"
#include "torchstash/groupquant.h"

namespace torchstash {
namespace cpu {
namespace {

constexpr index_t kSpan = 2048;  // elements prepared at once (8 KiB of fp32)
// A span's Philox blocks (kSpan / 4, one more when unaligned) rounded up to kPhiloxLanes.
constexpr index_t kUniforms = kSpan + 4 * kPhiloxLanes;
static_assert(kSpan % (4 * kPhiloxLanes) == 0, "spans must start on Philox lane groups");

// x[first, first + count) as float32: a pointer into x itself, or `buf` after conversion.
inline const float* load_floats(const void* x, groupquant::FloatKind kind, index_t first, index_t count,
                                float* buf) {
  const std::uint16_t* src = static_cast<const std::uint16_t*>(x) + first;
  switch (kind) {
    case groupquant::FloatKind::kFloat32: return static_cast<const float*>(x) + first;
    case groupquant::FloatKind::kBFloat16:
      for (index_t k = 0; k < count; ++k) buf[k] = groupquant::bf16_bits_to_float(src[k]);
      return buf;
    default:
      for (index_t k = 0; k < count; ++k) buf[k] = groupquant::half_bits_to_float(src[k]);
      return buf;
  }
}

// vals[0, count) stored as elements [first, first + count) of `out`, rounded per `kind`.
inline void store_floats(void* out, groupquant::FloatKind kind, index_t first, index_t count, const float* vals) {
  std::uint16_t* dst = static_cast<std::uint16_t*>(out) + first;
  switch (kind) {
    case groupquant::FloatKind::kFloat32:
      std::memcpy(static_cast<float*>(out) + first, vals, static_cast<std::size_t>(count) * sizeof(float));
      return;
    case groupquant::FloatKind::kBFloat16:
      for (index_t k = 0; k < count; ++k) dst[k] = groupquant::float_to_bf16_bits(vals[k]);
      return;
    default:
      for (index_t k = 0; k < count; ++k) dst[k] = groupquant::float_to_half_bits(vals[k]);
      return;
  }
}

// Uniforms of elements [first, first + count) (count <= kSpan; buf holds kUniforms): returns
// p with p[k] the uniform of element first + k (philox_uniform(n, seed, 0)). Philox blocks
// advance kPhiloxLanes at a time (philox_lanes.h's philox_blocks); the few blocks
// computed past the end are ignored. GCC vectorizes across 16 such steps, so it pays off from
// about 128 blocks: hence spans.
[[maybe_unused]] TS_CPU_CLONES const float* fill_uniforms(float* buf, index_t first, index_t count, std::uint64_t seed) {
  const index_t b_lo = first >> 2;
  const index_t b_hi = (first + count + 3) >> 2;
  philox_blocks(buf, static_cast<std::uint64_t>(b_lo), ceil_div(b_hi - b_lo, kPhiloxLanes), seed, 0);  // offset 0
  return buf + (first & 3);
}

}  // namespace
}  // namespace cpu
}  // namespace torchstash
