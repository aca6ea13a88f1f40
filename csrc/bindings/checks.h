// Input validation shared by the CPU (ops.cpp) and CUDA (ops_cuda.cpp) bindings, so
// both devices reject the same inputs with the same messages. Value problems raise
// Python ValueError (TORCH_CHECK_VALUE), dtype problems TypeError (TORCH_CHECK_TYPE).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "torchstash/bitpack.h"
#include "torchstash/groupquant.h"
#include "torchstash/maxpool.h"
#include "torchstash/signs.h"
#include "torchstash/sparse.h"

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

// A traced seed: a 0-dim int64 tensor holding the seed's 64 bits, on the CPU or on `device`.
inline void check_seed_tensor(const char* op, const at::Tensor& seed, const c10::Device& device) {
  TORCH_CHECK_VALUE(seed.scalar_type() == at::kLong && seed.dim() == 0, "torchstash::", op,
                    ": a seed tensor must be a 0-dim int64 tensor, got ", seed.scalar_type(), " of ", seed.dim(),
                    " dimension(s); make it with torch.tensor(as_int64(seed))");
  TORCH_CHECK_VALUE(seed.device().is_cpu() || seed.device() == device, "torchstash::", op,
                    ": the seed tensor is on ", seed.device(), " but x is on ", device,
                    "; keep it on the CPU or on x's device");
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

// ---------------------------------------------------------------- channel-wise layout

inline void check_inner(const char* op, std::int64_t inner) {
  TORCH_CHECK_VALUE(inner >= 1, "torchstash::", op, ": inner must be >= 1 (got ", inner,
                    "); it is the number of consecutive elements of one channel: N * D for the heads of a "
                    "contiguous (B, H, N, D) tensor, 1 for the last dim");
}

// n elements read as (n / (inner * channels), channels, inner), without forming inner * channels.
inline void check_channel_layout(const char* op, const char* what, std::int64_t n, std::int64_t inner,
                                 std::int64_t channels) {
  TORCH_CHECK_VALUE(n % inner == 0 && (n / inner) % channels == 0, "torchstash::", op, ": ", what, " has ", n,
                    " elements, not a multiple of inner * channels (", inner, " * ", channels,
                    "); pass the inner and channel count of its layout");
}

// lo and step: float32, 1-D, one entry per channel (>= 1), on `device`. Returns the channel count.
inline std::int64_t check_channel_params(const char* op, const at::Tensor& lo, const at::Tensor& step,
                                         const char* owner, const at::Device& device) {
  for (const at::Tensor* t : {&lo, &step}) {
    const char* name = t == &lo ? "lo" : "step";
    TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, "torchstash::", op, ": ", name, " must be float32 (got ",
                     t->scalar_type(), "); convert it with .float()");
    TORCH_CHECK_VALUE(t->dim() == 1 && t->numel() >= 1, "torchstash::", op, ": ", name,
                      " must be 1-D with one entry per channel, got shape ", t->sizes());
    TORCH_CHECK_VALUE(t->device() == device, "torchstash::", op, ": ", name, " is on ", t->device(), " but ", owner,
                      " is on ", device, "; keep the three tensors on one device");
  }
  TORCH_CHECK_VALUE(lo.numel() == step.numel(), "torchstash::", op,
                    ": lo and step must have one entry per channel each, got ", lo.numel(), " and ", step.numel());
  return lo.numel();
}

inline groupquant::FloatKind check_channel_minmax(const at::Tensor& x, std::int64_t inner, std::int64_t channels) {
  constexpr const char* op = "channel_minmax";
  const groupquant::FloatKind kind = float_kind(op, "x", x.scalar_type());
  check_inner(op, inner);
  TORCH_CHECK_VALUE(channels >= 1, "torchstash::", op, ": channels must be >= 1 (got ", channels, ")");
  check_channel_layout(op, "x", x.numel(), inner, channels);
  return kind;
}

// quant.mesa's fused pack: x as for channel_minmax, 1 <= groups <= channels, and the running
// range (if any) float32 (2, groups) on x's device.
inline groupquant::FloatKind check_mesa_quantize(const at::Tensor& x, std::int64_t inner, std::int64_t channels,
                                                 std::int64_t groups, const std::optional<at::Tensor>& running) {
  constexpr const char* op = "mesa_quantize";
  const groupquant::FloatKind kind = float_kind(op, "x", x.scalar_type());
  check_inner(op, inner);
  TORCH_CHECK_VALUE(channels >= 1, "torchstash::", op, ": channels must be >= 1 (got ", channels, ")");
  TORCH_CHECK_VALUE(groups >= 1 && groups <= channels, "torchstash::", op, ": groups must be in [1, channels = ",
                    channels, "] (got ", groups, ")");
  check_channel_layout(op, "x", x.numel(), inner, channels);
  if (running.has_value()) {
    const at::Tensor& r = *running;
    TORCH_CHECK_TYPE(r.scalar_type() == at::kFloat, "torchstash::", op, ": running must be float32 (got ",
                     r.scalar_type(), "); pass the range the previous call returned");
    TORCH_CHECK_VALUE(r.dim() == 2 && r.size(0) == 2 && r.size(1) == groups, "torchstash::", op,
                      ": running must have shape (2, groups = ", groups, "), got ", r.sizes(),
                      "; pass None to start a new range");
    TORCH_CHECK_VALUE(r.device() == x.device(), "torchstash::", op, ": running is on ", r.device(), " but x is on ",
                      x.device(), "; keep both on one device");
  }
  return kind;
}

inline groupquant::FloatKind check_channel_quantize(const at::Tensor& x, const at::Tensor& lo,
                                                    const at::Tensor& step, std::int64_t inner) {
  constexpr const char* op = "channel_quantize";
  const groupquant::FloatKind kind = float_kind(op, "x", x.scalar_type());
  check_inner(op, inner);
  const std::int64_t channels = check_channel_params(op, lo, step, "x", x.device());
  check_channel_layout(op, "x", x.numel(), inner, channels);
  return kind;
}

// The output dtype's kind.
inline groupquant::FloatKind check_channel_dequantize(const at::Tensor& codes, const at::Tensor& lo,
                                                      const at::Tensor& step, std::int64_t inner,
                                                      at::ScalarType dtype) {
  constexpr const char* op = "channel_dequantize";
  TORCH_CHECK_TYPE(codes.scalar_type() == at::kByte, "torchstash::", op, ": codes must be uint8 (got ",
                   codes.scalar_type(), "); pass the tensor that channel_quantize returned");
  TORCH_CHECK_VALUE(codes.dim() == 1, "torchstash::", op, ": codes must be 1-D (got ", codes.dim(),
                    " dims); pass the tensor that channel_quantize returned, or flatten it");
  check_inner(op, inner);
  const std::int64_t channels = check_channel_params(op, lo, step, "codes", codes.device());
  check_channel_layout(op, "codes", codes.numel(), inner, channels);
  return float_kind(op, "dtype", dtype);
}

// ---------------------------------------------------------------- top-k and sparse storage

inline void check_same_device(const char* op, const at::Tensor& a, const char* a_name, const at::Tensor& b,
                              const char* b_name) {
  TORCH_CHECK_VALUE(a.device() == b.device(), "torchstash::", op, ": ", a_name, " is on ", a.device(), " but ",
                    b_name, " is on ", b.device(), "; keep them on one device");
}

inline void check_kept(const char* op, std::int64_t kept) {
  TORCH_CHECK_VALUE(kept >= 0, "torchstash::", op, ": kept must be >= 0 (got ", kept,
                    "); it is the number of set bits of the mask (segments * k for topk_mask's)");
}

// 1-D float values, on the mask's device.
inline groupquant::FloatKind check_values(const char* op, const at::Tensor& values, const at::Tensor& other,
                                          const char* other_name) {
  const groupquant::FloatKind kind = float_kind(op, "values", values.scalar_type());
  TORCH_CHECK_VALUE(values.dim() == 1, "torchstash::", op, ": values must be 1-D (got shape ", values.sizes(),
                    "); pass the tensor that mask_compact returned");
  check_same_device(op, values, "values", other, other_name);
  return kind;
}

// The key kind of x's dtype.
inline sparse::KeyKind check_topk_mask(const at::Tensor& x, std::int64_t segments, std::int64_t k, bool exact) {
  constexpr const char* op = "topk_mask";
  const groupquant::FloatKind kind = float_kind(op, "x", x.scalar_type());
  TORCH_CHECK_VALUE(segments >= 1, "torchstash::", op, ": segments must be >= 1 (got ", segments,
                    "); 1 selects over the whole tensor");
  TORCH_CHECK_VALUE(k >= 0, "torchstash::", op, ": k must be >= 0 (got ", k, ")");
  const std::int64_t n = x.numel();
  TORCH_CHECK_VALUE(n % segments == 0, "torchstash::", op, ": ", n, " elements do not split into ", segments,
                    " equal segments; pass a segment count that divides the number of elements");
  TORCH_CHECK_VALUE(n == 0 || k <= n / segments, "torchstash::", op, ": k=", k, " is more than a segment's ",
                    n / segments, " elements");
  return sparse::key_kind(kind, exact);
}

inline groupquant::FloatKind check_mask_compact(const at::Tensor& x, const at::Tensor& mask, std::int64_t kept) {
  constexpr const char* op = "mask_compact";
  const groupquant::FloatKind kind = float_kind(op, "x", x.scalar_type());
  check_packed(op, "topk_mask", mask, 1, x.numel());
  check_same_device(op, x, "x", mask, "the mask");
  check_kept(op, kept);
  return kind;
}

inline groupquant::FloatKind check_mask_scatter(const at::Tensor& mask, const at::Tensor& values,
                                                std::int64_t numel) {
  constexpr const char* op = "mask_scatter";
  check_packed(op, "topk_mask", mask, 1, numel);
  return check_values(op, values, mask, "the mask");
}

inline void check_mask_offsets(const at::Tensor& mask, std::int64_t numel, std::int64_t kept) {
  constexpr const char* op = "mask_offsets";
  check_packed(op, "topk_mask", mask, 1, numel);
  check_kept(op, kept);
}

inline groupquant::FloatKind check_offsets_scatter(const at::Tensor& offsets, const at::Tensor& counts,
                                                   const at::Tensor& values, std::int64_t numel) {
  constexpr const char* op = "offsets_scatter";
  TORCH_CHECK_VALUE(numel >= 0, "torchstash::", op, ": numel must be >= 0 (got ", numel, ")");
  const groupquant::FloatKind kind = check_values(op, values, offsets, "offsets");
  TORCH_CHECK_TYPE(offsets.scalar_type() == at::kUInt16 && offsets.dim() == 1, "torchstash::", op,
                   ": offsets must be 1-D uint16 (got ", offsets.scalar_type(), " of shape ", offsets.sizes(),
                   "); pass the offsets that mask_offsets returned");
  const std::int64_t blocks = ceil_div(numel, sparse::kOffsetBlock);
  TORCH_CHECK_TYPE(counts.scalar_type() == at::kInt && counts.dim() == 1 && counts.numel() == blocks,
                   "torchstash::", op, ": counts must be int32 of shape (", blocks, ",) for ", numel,
                   " elements (got ", counts.scalar_type(), " of shape ", counts.sizes(),
                   "); pass the counts that mask_offsets returned");
  TORCH_CHECK_VALUE(offsets.numel() == values.numel(), "torchstash::", op, ": ", offsets.numel(),
                    " offsets need as many values, got ", values.numel());
  check_same_device(op, counts, "counts", values, "values");
  return kind;
}

// ---------------------------------------------------------------- rows centered on an offset

inline void check_run(const char* op, std::int64_t numel, std::int64_t run) {
  TORCH_CHECK_VALUE(run >= 1, "torchstash::", op, ": run must be >= 1 (got ", run,
                    "); it is the number of elements of a row sharing one offset");
  TORCH_CHECK_VALUE(numel % run == 0, "torchstash::", op, ": ", numel, " elements do not split into rows of ", run,
                    "; pass the row length of the tensor's layout");
}

inline groupquant::FloatKind check_row_center(const at::Tensor& x, std::int64_t run) {
  const groupquant::FloatKind kind = float_kind("row_center", "x", x.scalar_type());
  check_run("row_center", x.numel(), run);
  return kind;
}

// offsets and constant as row_center returned them for rows of `run` out of numel elements.
inline void check_row_params(const char* op, std::int64_t numel, std::int64_t run, const at::Tensor& offsets,
                             const at::Tensor& constant, const at::Device& device) {
  check_run(op, numel, run);
  const std::int64_t rows = numel / run;
  TORCH_CHECK_TYPE(offsets.scalar_type() == at::kFloat && offsets.dim() == 1 && offsets.numel() == rows,
                   "torchstash::", op, ": offsets must be float32 of shape (", rows, ",), got ",
                   offsets.scalar_type(), " of shape ", offsets.sizes(), "; pass what row_center returned");
  TORCH_CHECK_TYPE(constant.scalar_type() == at::kByte && constant.dim() == 1 && constant.numel() == ceil_div(rows, 8),
                   "torchstash::", op, ": constant must be uint8 of shape (", ceil_div(rows, 8), ",), got ",
                   constant.scalar_type(), " of shape ", constant.sizes(), "; pass what row_center returned");
  for (const at::Tensor* t : {&offsets, &constant}) {
    TORCH_CHECK_VALUE(t->device() == device, "torchstash::", op, ": every tensor must be on ", device,
                      ", got one on ", t->device());
  }
}

// What row_center returned for the decoded values' rows of `run`; the output dtype's kind.
inline groupquant::FloatKind check_row_uncenter(const at::Tensor& decoded, const at::Tensor& offsets,
                                                const at::Tensor& constant, const at::Tensor& scales,
                                                std::int64_t run, at::ScalarType dtype) {
  constexpr const char* op = "row_uncenter";
  TORCH_CHECK_TYPE(decoded.scalar_type() == at::kFloat, "torchstash::", op, ": decoded must be float32 (got ",
                   decoded.scalar_type(), "); decode the centered values as float32");
  check_row_params(op, decoded.numel(), run, offsets, constant, decoded.device());
  const std::int64_t rows = decoded.numel() / run;
  TORCH_CHECK_TYPE(scales.scalar_type() == at::kFloat && scales.dim() == 1 &&
                       (scales.numel() == rows || scales.numel() == 0),
                   "torchstash::", op, ": scales must be float32 of shape (", rows, ",) or (0,), got ",
                   scales.scalar_type(), " of shape ", scales.sizes(), "; pass what row_center returned");
  TORCH_CHECK_VALUE(scales.device() == decoded.device(), "torchstash::", op, ": every tensor must be on ",
                    decoded.device(), ", got one on ", scales.device());
  return float_kind(op, "dtype", dtype);
}

inline groupquant::FloatKind check_row_group_quantize(const at::Tensor& x, std::int64_t run, std::int64_t bits,
                                                      std::int64_t group_size) {
  const groupquant::FloatKind kind = check_group_quantize(x, bits, group_size);
  check_run("row_group_quantize", x.numel(), run);
  return kind;
}

inline groupquant::FloatKind check_row_group_dequantize(const at::Tensor& packed, const at::Tensor& lo,
                                                        const at::Tensor& step, const at::Tensor& offsets,
                                                        const at::Tensor& constant, std::int64_t bits,
                                                        std::int64_t group_size, std::int64_t run,
                                                        std::int64_t numel, at::ScalarType dtype) {
  const groupquant::FloatKind kind = check_group_dequantize(packed, lo, step, bits, group_size, numel, dtype);
  check_row_params("row_group_dequantize", numel, run, offsets, constant, packed.device());
  return kind;
}

// ---------------------------------------------------------------- fp8 codes

inline groupquant::FloatKind check_fp8_quantize(const at::Tensor& x, std::int64_t group_size) {
  check_group_size("fp8_quantize", group_size);
  return float_kind("fp8_quantize", "x", x.scalar_type());
}

inline groupquant::FloatKind check_fp8_dequantize(const at::Tensor& codes, const at::Tensor& scale,
                                                  std::int64_t group_size, std::int64_t numel,
                                                  at::ScalarType dtype) {
  constexpr const char* op = "fp8_dequantize";
  check_group_size(op, group_size);
  TORCH_CHECK_VALUE(numel >= 0, "torchstash::", op, ": numel must be >= 0 (got ", numel, ")");
  TORCH_CHECK_TYPE(codes.scalar_type() == at::kByte && codes.dim() == 1 && codes.numel() == numel, "torchstash::", op,
                   ": codes must be 1-D uint8 of ", numel, " codes, got ", codes.scalar_type(), " of shape ",
                   codes.sizes(), "; pass the first numel codes fp8_quantize returned");
  const std::int64_t groups = ceil_div(numel, group_size);
  TORCH_CHECK_TYPE(scale.scalar_type() == at::kBFloat16 && scale.dim() == 1 && scale.numel() == groups,
                   "torchstash::", op, ": scale must be bfloat16 of shape (", groups, ",), got ", scale.scalar_type(),
                   " of shape ", scale.sizes(), "; pass the numel and group_size that were used to quantize");
  TORCH_CHECK_VALUE(scale.device() == codes.device(), "torchstash::", op, ": scale is on ", scale.device(),
                    " but codes are on ", codes.device(), "; keep them on one device");
  return float_kind(op, "dtype", dtype);
}

// ---------------------------------------------------------------- codes of a table of levels

inline groupquant::FloatKind check_level_quantize(const at::Tensor& x, const at::Tensor& levels, std::int64_t bits) {
  constexpr const char* op = "level_quantize";
  check_bits(op, bits);
  TORCH_CHECK_VALUE(bits >= 2, "torchstash::", op, ": bits must be 2, 4 or 8 (one code is NaN's), got ", bits);
  TORCH_CHECK_TYPE(levels.scalar_type() == at::kFloat && levels.dim() == 1, "torchstash::", op,
                   ": levels must be 1-D float32, got ", levels.scalar_type(), " of shape ", levels.sizes());
  const std::int64_t count = levels.numel();
  TORCH_CHECK_VALUE(count >= 2 && count < (std::int64_t{1} << bits), "torchstash::", op, ": levels must hold 2 to ",
                    (std::int64_t{1} << bits) - 1, " values at ", bits, " bits (one code is NaN's), got ", count);
  TORCH_CHECK_VALUE(levels.device() == x.device(), "torchstash::", op, ": levels are on ", levels.device(),
                    " but x is on ", x.device(), "; keep them on one device");
  return float_kind(op, "x", x.scalar_type());
}

// ---------------------------------------------------------------- sign bits

inline SignKind sign_kind(const char* op, const char* what, at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return SignKind::kFloat32;
    case at::kDouble: return SignKind::kFloat64;
    case at::kHalf: return SignKind::kFloat16;
    case at::kBFloat16: return SignKind::kBFloat16;
    default:
      TORCH_CHECK_TYPE(false, "torchstash::", op, ": ", what,
                       " must be float32, float64, float16 or bfloat16 (got ", dtype, ")");
      return SignKind::kFloat32;  // not reached
  }
}

inline SignKind check_sign_unpack(const at::Tensor& packed, std::int64_t numel, at::ScalarType dtype) {
  check_packed("sign_unpack", "sign_pack", packed, 1, numel);
  return sign_kind("sign_unpack", "dtype", dtype);
}

inline SignKind check_sign_select(const at::Tensor& grad, const at::Tensor& packed) {
  check_packed("sign_select", "sign_pack", packed, 1, grad.numel());
  TORCH_CHECK(grad.device() == packed.device(), "torchstash::sign_select: grad is on ", grad.device(),
              " but packed is on ", packed.device(), "; keep them on one device");
  return sign_kind("sign_select", "grad", grad.scalar_type());
}

// A 2-d pool's int[] argument: two values, each at least `low`.
inline void check_pool_pair(const char* op, const char* name, at::IntArrayRef v, std::int64_t low) {
  TORCH_CHECK_VALUE(v.size() == 2, "torchstash::", op, ": ", name, " must hold 2 values, one per spatial dim (got ",
                    v.size(), ")");
  TORCH_CHECK_VALUE(v[0] >= low && v[1] >= low, "torchstash::", op, ": ", name, " must be >= ", low, " (got ", v,
                    ")");
}

// The pool's geometry for an input of `sizes` (3-D or 4-D), checked as ATen checks it: a
// padding of at most half the kernel, and at least one window along each dim.
inline maxpool::Geometry pool_geometry(const char* op, at::IntArrayRef sizes, at::IntArrayRef kernel,
                                       at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                                       bool ceil_mode) {
  TORCH_CHECK_VALUE(sizes.size() == 3 || sizes.size() == 4, "torchstash::", op,
                    ": the input must be 3-D or 4-D (got ", sizes.size(), " dims)");
  check_pool_pair(op, "kernel", kernel, 1);
  check_pool_pair(op, "stride", stride, 1);
  check_pool_pair(op, "padding", padding, 0);
  check_pool_pair(op, "dilation", dilation, 1);
  for (int i = 0; i < 2; ++i) {
    TORCH_CHECK_VALUE(padding[i] <= kernel[i] / 2, "torchstash::", op,
                      ": padding must be at most half of the kernel (got padding ", padding, ", kernel ", kernel,
                      ")");
  }
  maxpool::Geometry g{};
  g.H = sizes[sizes.size() - 2];
  g.W = sizes[sizes.size() - 1];
  g.kH = kernel[0];
  g.kW = kernel[1];
  g.sH = stride[0];
  g.sW = stride[1];
  g.pH = padding[0];
  g.pW = padding[1];
  g.dH = dilation[0];
  g.dW = dilation[1];
  g.OH = maxpool::output_size(g.H, g.kH, g.pH, g.sH, g.dH, ceil_mode);
  g.OW = maxpool::output_size(g.W, g.kW, g.pW, g.sW, g.dW, ceil_mode);
  TORCH_CHECK_VALUE(g.H >= 1 && g.W >= 1 && g.OH >= 1 && g.OW >= 1, "torchstash::", op, ": an input plane of ", g.H,
                    "x", g.W, " gives ", g.OH, "x", g.OW, " windows; the pool needs at least one");
  return g;
}

inline maxpool::Geometry check_max_pool2d_code(const at::Tensor& x, at::IntArrayRef kernel, at::IntArrayRef stride,
                                               at::IntArrayRef padding, at::IntArrayRef dilation, bool ceil_mode,
                                               const at::Tensor& table, std::int64_t bits) {
  const char* op = "max_pool2d_code";
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat, "torchstash::", op, ": x must be float32 (got ", x.scalar_type(),
                   "); other dtypes take ATen's pool");
  check_bits(op, bits);
  const maxpool::Geometry g = pool_geometry(op, x.sizes(), kernel, stride, padding, dilation, ceil_mode);
  TORCH_CHECK_VALUE(g.kH * g.kW <= (std::int64_t{1} << bits), "torchstash::", op, ": bits=", bits,
                    " cannot hold the ", g.kH * g.kW, " positions of a ", kernel, " window; pass wider bits");
  TORCH_CHECK_VALUE(g.H * g.W < (std::int64_t{1} << 30), "torchstash::", op, ": an input plane of ", g.H, "x", g.W,
                    " elements is over the kernel's 2^30; pool it with ATen");
  TORCH_CHECK_TYPE(table.scalar_type() == at::kByte, "torchstash::", op, ": table must be uint8 (got ",
                   table.scalar_type(), "); pass the offset -> position table torchstash.windows builds");
  TORCH_CHECK_VALUE(table.dim() == 1 && table.numel() >= 1, "torchstash::", op,
                    ": table must be a non-empty 1-D tensor (got shape ", table.sizes(), ")");
  TORCH_CHECK(table.device() == x.device(), "torchstash::", op, ": table is on ", table.device(), " but x is on ",
              x.device(), "; keep them on one device");
  return g;
}

inline maxpool::Geometry check_max_pool2d_code_backward(const at::Tensor& grad, const at::Tensor& packed,
                                                        at::IntArrayRef input_size, at::IntArrayRef kernel,
                                                        at::IntArrayRef stride, at::IntArrayRef padding,
                                                        at::IntArrayRef dilation, bool ceil_mode, std::int64_t bits) {
  const char* op = "max_pool2d_code_backward";
  TORCH_CHECK_TYPE(grad.scalar_type() == at::kFloat, "torchstash::", op, ": grad must be float32 (got ",
                   grad.scalar_type(), ")");
  check_bits(op, bits);
  const maxpool::Geometry g = pool_geometry(op, input_size, kernel, stride, padding, dilation, ceil_mode);
  std::vector<std::int64_t> expected(input_size.begin(), input_size.end());
  expected[expected.size() - 2] = g.OH;
  expected[expected.size() - 1] = g.OW;
  TORCH_CHECK_VALUE(grad.sizes() == at::IntArrayRef(expected), "torchstash::", op, ": grad has shape ", grad.sizes(),
                    " but the pool of an input of ", input_size, " gives ", at::IntArrayRef(expected),
                    "; pass the input's size and the pool's arguments");
  check_packed(op, "max_pool2d_code", packed, bits, grad.numel());
  TORCH_CHECK(grad.device() == packed.device(), "torchstash::", op, ": grad is on ", grad.device(),
              " but packed is on ", packed.device(), "; keep them on one device");
  return g;
}

// The geometry of a stock pool's indices of `sizes` (..., OH, OW) over input planes of `plane`.
inline maxpool::Geometry window_geometry(const char* op, at::IntArrayRef sizes, at::IntArrayRef plane,
                                         at::IntArrayRef kernel, at::IntArrayRef stride, at::IntArrayRef padding,
                                         at::IntArrayRef dilation, std::int64_t bits) {
  check_bits(op, bits);
  TORCH_CHECK_VALUE(sizes.size() >= 2, "torchstash::", op, ": the indices must have at least 2 dims (got ",
                    sizes.size(), ")");
  check_pool_pair(op, "plane", plane, 1);
  check_pool_pair(op, "kernel", kernel, 1);
  check_pool_pair(op, "stride", stride, 1);
  check_pool_pair(op, "padding", padding, 0);
  check_pool_pair(op, "dilation", dilation, 1);
  maxpool::Geometry g{plane[0], plane[1], sizes[sizes.size() - 2], sizes[sizes.size() - 1],
                      kernel[0], kernel[1], stride[0], stride[1], padding[0], padding[1], dilation[0], dilation[1]};
  TORCH_CHECK_VALUE(g.kH * g.kW <= (std::int64_t{1} << bits), "torchstash::", op, ": bits=", bits,
                    " cannot hold the ", g.kH * g.kW, " positions of a ", kernel, " window; pass wider bits");
  return g;
}

inline maxpool::Geometry check_window_code(const at::Tensor& indices, const at::Tensor& table, at::IntArrayRef plane,
                                           at::IntArrayRef kernel, at::IntArrayRef stride, at::IntArrayRef padding,
                                           at::IntArrayRef dilation, std::int64_t bits) {
  const char* op = "window_code";
  TORCH_CHECK_TYPE(indices.scalar_type() == at::kLong, "torchstash::", op, ": indices must be int64 (got ",
                   indices.scalar_type(), "); pass a max pool's indices");
  TORCH_CHECK_TYPE(table.scalar_type() == at::kByte, "torchstash::", op, ": table must be uint8 (got ",
                   table.scalar_type(), "); pass the offset -> position table torchstash.windows builds");
  TORCH_CHECK_VALUE(table.dim() == 1 && table.numel() >= 1, "torchstash::", op,
                    ": table must be a non-empty 1-D tensor (got shape ", table.sizes(), ")");
  TORCH_CHECK(table.device() == indices.device(), "torchstash::", op, ": table is on ", table.device(),
              " but indices is on ", indices.device(), "; keep them on one device");
  return window_geometry(op, indices.sizes(), plane, kernel, stride, padding, dilation, bits);
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
