// Raw-pointer CPU loops (csrc/cpu/*.cpp), called by csrc/bindings/ops.cpp.
//
// Torch-free on purpose: the loops compile in about a second, and only the
// bindings translation unit pays for the ATen headers.
#pragma once

#include <cstdint>

#include "torchstash/common.h"

namespace torchstash {
namespace cpu {

// out[0, ceil(n * bits / 8)) <- codes[0, n) packed at `bits` bits (1, 2, 4 or 8).
void pack_bits(const std::uint8_t* codes, index_t n, int bits, std::uint8_t* out, int num_threads);

// out[0, n) <- the first n codes of `packed` at `bits` bits.
void unpack_bits(const std::uint8_t* packed, index_t n, int bits, std::uint8_t* out, int num_threads);

// out[0, n) <- Philox4x32-10 uniforms in [0, 1) for (seed, offset); see philox.h.
void philox_uniform(float* out, index_t n, std::uint64_t seed, std::uint64_t offset, int num_threads);

}  // namespace cpu
}  // namespace torchstash
