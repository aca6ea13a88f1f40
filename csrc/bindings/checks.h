// Input validation shared by the CPU (ops.cpp) and CUDA (ops_cuda.cpp) bindings, so
// both devices reject the same inputs with the same messages. Value problems raise
// Python ValueError (TORCH_CHECK_VALUE), dtype problems TypeError (TORCH_CHECK_TYPE).
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "torchstash/bitpack.h"
#include "torchstash/groupquant.h"

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

// `packed` holds numel codes at `bits` bits, as returned by `producer`.
inline void check_packed(const char* op, const char* producer, const at::Tensor& packed, std::int64_t bits,
                         std::int64_t numel) {
  TORCH_CHECK_TYPE(packed.scalar_type() == at::kByte, "torchstash::", op, ": packed must be uint8 (got ",
                   packed.scalar_type(), "); pass the tensor that ", producer, " returned");
  TORCH_CHECK_VALUE(packed.dim() == 1, "torchstash::", op, ": packed must be 1-D (got ", packed.dim(),
                    " dims); pass the tensor that ", producer, " returned, or flatten it");
  TORCH_CHECK_VALUE(numel >= 0, "torchstash::", op, ": numel must be >= 0 (got ", numel, ")");
  const std::int64_t expected = bitpack::packed_size(numel, static_cast<int>(bits));
  TORCH_CHECK_VALUE(packed.numel() == expected, "torchstash::", op, ": ", numel, " codes at ", bits,
                    " bits need exactly ", expected, " packed bytes, got ", packed.numel(),
                    "; pass the numel and bits that were used to pack");
}

inline at::Tensor prepare_packed(const at::Tensor& packed, std::int64_t bits, std::int64_t numel) {
  check_bits("unpack_bits", bits);
  check_packed("unpack_bits", "pack_bits", packed, bits, numel);
  return packed.contiguous();
}

inline void check_group_size(const char* op, std::int64_t group_size) {
  TORCH_CHECK_VALUE(group_size >= 1, "torchstash::", op, ": group_size must be >= 1 (got ", group_size,
                    "); 256 is the usual choice");
}

// The kernels' name for a float dtype; anything but float32, float16 and bfloat16 is a TypeError.
inline groupquant::FloatKind float_kind(const char* op, const char* what, at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return groupquant::FloatKind::kFloat32;
    case at::kHalf: return groupquant::FloatKind::kFloat16;
    case at::kBFloat16: return groupquant::FloatKind::kBFloat16;
    default:
      TORCH_CHECK_TYPE(false, "torchstash::", op, ": ", what, " must be float32, float16 or bfloat16 (got ", dtype,
                       "); convert with .float()");
      return groupquant::FloatKind::kFloat32;  // not reached
  }
}

// A group size the kernels can add to any element index without overflow: every group
// size >= numel means one group, so it is capped there.
inline std::int64_t kernel_group_size(std::int64_t group_size, std::int64_t numel) {
  return group_size < numel ? group_size : (numel > 1 ? numel : 1);
}

inline groupquant::FloatKind check_group_quantize(const at::Tensor& x, std::int64_t bits, std::int64_t group_size) {
  check_bits("group_quantize", bits);
  check_group_size("group_quantize", group_size);
  return float_kind("group_quantize", "x", x.scalar_type());
}

// Shapes and dtypes of what group_quantize returned; the output dtype's kind.
inline groupquant::FloatKind check_group_dequantize(const at::Tensor& packed, const at::Tensor& lo,
                                                    const at::Tensor& step, std::int64_t bits,
                                                    std::int64_t group_size, std::int64_t numel,
                                                    at::ScalarType dtype) {
  constexpr const char* op = "group_dequantize";
  check_bits(op, bits);
  check_group_size(op, group_size);
  check_packed(op, "group_quantize", packed, bits, numel);
  const std::int64_t groups = ceil_div(numel, group_size);
  for (const at::Tensor* t : {&lo, &step}) {
    const char* name = t == &lo ? "lo" : "step";
    TORCH_CHECK_TYPE(t->scalar_type() == at::kBFloat16, "torchstash::", op, ": ", name, " must be bfloat16 (got ",
                     t->scalar_type(), "); pass the tensors that group_quantize returned");
    TORCH_CHECK_VALUE(t->dim() == 1 && t->numel() == groups, "torchstash::", op, ": ", name, " must be 1-D with ",
                      groups, " entries (ceil(", numel, " / ", group_size, ")), got shape ", t->sizes(),
                      "; pass the numel and group_size that were used to quantize");
    TORCH_CHECK_VALUE(t->device() == packed.device(), "torchstash::", op, ": ", name, " is on ", t->device(),
                      " but packed is on ", packed.device(), "; keep the three tensors on one device");
  }
  return float_kind(op, "dtype", dtype);
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
