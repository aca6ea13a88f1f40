// Input validation shared by the CPU (ops.cpp) and CUDA (ops_cuda.cpp) bindings, so
// both devices reject the same inputs with the same messages. Value problems raise
// Python ValueError (TORCH_CHECK_VALUE), dtype problems TypeError (TORCH_CHECK_TYPE).
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "torchstash/bitpack.h"

namespace torchstash {
namespace bindings {

inline void check_bits(const char* op, std::int64_t bits) {
  TORCH_CHECK_VALUE(bits == 1 || bits == 2 || bits == 4 || bits == 8, "torchstash::", op,
                    ": bits must be one of 1, 2, 4, 8 (got ", bits, "); pick one of those widths");
}

// The codes as a contiguous uint8/bool tensor; bool is read as bytes (0 or 1).
inline at::Tensor prepare_codes(const at::Tensor& codes, std::int64_t bits) {
  check_bits("pack_bits", bits);
  const auto dtype = codes.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kByte || dtype == at::kBool,
                   "torchstash::pack_bits: codes must be uint8 or bool (got ", dtype,
                   "); convert them with codes.to(torch.uint8)");
  TORCH_CHECK_VALUE(dtype != at::kBool || bits == 1,
                    "torchstash::pack_bits: bool codes are packed at bits=1 (got bits=", bits,
                    "); pass bits=1 or convert the codes with codes.to(torch.uint8)");
  return codes.contiguous();
}

inline at::Tensor prepare_packed(const at::Tensor& packed, std::int64_t bits, std::int64_t numel) {
  check_bits("unpack_bits", bits);
  TORCH_CHECK_TYPE(packed.scalar_type() == at::kByte,
                   "torchstash::unpack_bits: packed must be uint8 (got ", packed.scalar_type(),
                   "); pass the tensor that pack_bits returned");
  TORCH_CHECK_VALUE(packed.dim() == 1, "torchstash::unpack_bits: packed must be 1-D (got ",
                    packed.dim(), " dims); pass the tensor that pack_bits returned, or flatten it");
  TORCH_CHECK_VALUE(numel >= 0, "torchstash::unpack_bits: numel must be >= 0 (got ", numel, ")");
  const std::int64_t expected = bitpack::packed_size(numel, static_cast<int>(bits));
  TORCH_CHECK_VALUE(packed.numel() == expected, "torchstash::unpack_bits: ", numel, " codes at ",
                    bits, " bits need exactly ", expected, " packed bytes, got ", packed.numel(),
                    "; pass the numel and bits that were used to pack");
  return packed.contiguous();
}

inline void check_philox_out(const at::Tensor& out) {
  TORCH_CHECK_TYPE(out.scalar_type() == at::kFloat,
                   "torchstash::philox_uniform: out must be float32 (got ", out.scalar_type(),
                   "); allocate it with torch.empty(numel, dtype=torch.float32)");
  TORCH_CHECK_VALUE(out.is_contiguous(),
                    "torchstash::philox_uniform: out must be contiguous; allocate it with "
                    "torch.empty(numel, dtype=torch.float32)");
}

}  // namespace bindings
}  // namespace torchstash
