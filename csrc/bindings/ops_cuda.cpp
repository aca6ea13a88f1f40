// CUDA kernels of the torchstash operator library (only compiled in CUDA builds).
//
// Validates with the same checks as the CPU bindings, then calls the raw-pointer
// launchers of csrc/cuda/*.cu on the current stream of the tensor's device.
#include <ATen/ATen.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <limits>
#include <tuple>

#include "checks.h"
#include "torchstash/bitpack.h"
#include "torchstash/cuda_launch.h"

namespace torchstash {
namespace {

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

at::Tensor pack_bits_cuda(const at::Tensor& codes, std::int64_t bits) {
  const c10::cuda::CUDAGuard guard(codes.device());
  const at::Tensor c = bindings::prepare_codes(codes, bits);
  const std::int64_t n = c.numel();
  at::Tensor out = c.new_empty({bitpack::packed_size(n, static_cast<int>(bits))}, c.options().dtype(at::kByte));
  C10_CUDA_CHECK(cuda::launch_pack_bits(static_cast<const std::uint8_t*>(c.const_data_ptr()), n,
                                        static_cast<int>(bits), out.mutable_data_ptr<std::uint8_t>(),
                                        current_stream()));
  return out;
}

at::Tensor unpack_bits_cuda(const at::Tensor& packed, std::int64_t bits, std::int64_t numel) {
  const c10::cuda::CUDAGuard guard(packed.device());
  const at::Tensor p = bindings::prepare_packed(packed, bits, numel);
  at::Tensor out = p.new_empty({numel});
  C10_CUDA_CHECK(cuda::launch_unpack_bits(p.const_data_ptr<std::uint8_t>(), numel, static_cast<int>(bits),
                                          out.mutable_data_ptr<std::uint8_t>(), current_stream()));
  return out;
}

void philox_uniform_cuda(const at::Tensor& out, std::int64_t seed, std::int64_t offset) {
  const c10::cuda::CUDAGuard guard(out.device());
  bindings::check_philox_out(out);
  C10_CUDA_CHECK(cuda::launch_philox_uniform(out.mutable_data_ptr<float>(), out.numel(),
                                             static_cast<std::uint64_t>(seed),
                                             static_cast<std::uint64_t>(offset), current_stream()));
}

namespace {
// `seed_at`: a device int64 holding the seed (a compiled graph's), read by the kernel.
std::tuple<at::Tensor, at::Tensor, at::Tensor> group_quantize_at(const at::Tensor& x, std::int64_t bits,
                                                                 std::int64_t group_size, std::int64_t seed,
                                                                 const std::int64_t* seed_at, bool stochastic) {
  const c10::cuda::CUDAGuard guard(x.device());
  const groupquant::FloatKind kind = bindings::check_group_quantize(x, bits, group_size);
  const at::Tensor c = x.contiguous();
  const std::int64_t n = c.numel();
  const std::int64_t groups = ceil_div(n, group_size);
  at::Tensor packed = c.new_empty({bitpack::packed_size(n, static_cast<int>(bits))}, c.options().dtype(at::kByte));
  at::Tensor lo = c.new_empty({groups}, c.options().dtype(at::kBFloat16));
  at::Tensor step = c.new_empty({groups}, c.options().dtype(at::kBFloat16));
  C10_CUDA_CHECK(cuda::launch_group_quantize(
      c.const_data_ptr(), kind, n, static_cast<int>(bits), bindings::kernel_group_size(group_size, n),
      static_cast<std::uint64_t>(seed), stochastic, packed.mutable_data_ptr<std::uint8_t>(),
      static_cast<std::uint16_t*>(lo.mutable_data_ptr()), static_cast<std::uint16_t*>(step.mutable_data_ptr()),
      current_stream(), seed_at));
  return {packed, lo, step};
}
}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> group_quantize_cuda(const at::Tensor& x, std::int64_t bits,
                                                                   std::int64_t group_size, std::int64_t seed,
                                                                   bool stochastic) {
  return group_quantize_at(x, bits, group_size, seed, nullptr, stochastic);
}

// A seed tensor on the CPU is read on the host; one on x's device by the kernel (no sync).
std::tuple<at::Tensor, at::Tensor, at::Tensor> group_quantize_seeded_cuda(const at::Tensor& x, std::int64_t bits,
                                                                          std::int64_t group_size,
                                                                          const at::Tensor& seed, bool stochastic) {
  bindings::check_seed_tensor("group_quantize", seed, x.device());
  if (seed.device().is_cpu()) return group_quantize_at(x, bits, group_size, seed.item<std::int64_t>(), nullptr,
                                                       stochastic);
  return group_quantize_at(x, bits, group_size, 0, seed.const_data_ptr<std::int64_t>(), stochastic);
}

at::Tensor group_dequantize_cuda(const at::Tensor& packed, const at::Tensor& lo, const at::Tensor& step,
                                 std::int64_t bits, std::int64_t group_size, std::int64_t numel,
                                 at::ScalarType dtype) {
  const c10::cuda::CUDAGuard guard(packed.device());
  const groupquant::FloatKind kind =
      bindings::check_group_dequantize(packed, lo, step, bits, group_size, numel, dtype);
  const at::Tensor p = packed.contiguous();
  const at::Tensor l = lo.contiguous();
  const at::Tensor s = step.contiguous();
  at::Tensor out = p.new_empty({numel}, p.options().dtype(dtype));
  C10_CUDA_CHECK(cuda::launch_group_dequantize(
      p.const_data_ptr<std::uint8_t>(), static_cast<const std::uint16_t*>(l.const_data_ptr()),
      static_cast<const std::uint16_t*>(s.const_data_ptr()), static_cast<int>(bits),
      bindings::kernel_group_size(group_size, numel), numel, kind, out.mutable_data_ptr(), current_stream()));
  return out;
}

std::tuple<at::Tensor, at::Tensor> channel_minmax_cuda(const at::Tensor& x, std::int64_t inner,
                                                       std::int64_t channels) {
  const c10::cuda::CUDAGuard guard(x.device());
  const groupquant::FloatKind kind = bindings::check_channel_minmax(x, inner, channels);
  const at::Tensor c = x.contiguous();
  at::Tensor mn = c.new_empty({channels}, c.options().dtype(at::kFloat));
  at::Tensor mx = c.new_empty({channels}, c.options().dtype(at::kFloat));
  C10_CUDA_CHECK(cuda::launch_channel_minmax(c.const_data_ptr(), kind, c.numel(), inner, channels,
                                             mn.mutable_data_ptr<float>(), mx.mutable_data_ptr<float>(),
                                             current_stream()));
  return {mn, mx};
}

at::Tensor channel_quantize_cuda(const at::Tensor& x, const at::Tensor& lo, const at::Tensor& step,
                                 std::int64_t inner, std::int64_t seed, bool stochastic) {
  const c10::cuda::CUDAGuard guard(x.device());
  const groupquant::FloatKind kind = bindings::check_channel_quantize(x, lo, step, inner);
  const at::Tensor c = x.contiguous();
  const at::Tensor l = lo.contiguous();
  const at::Tensor s = step.contiguous();
  at::Tensor codes = c.new_empty({c.numel()}, c.options().dtype(at::kByte));
  C10_CUDA_CHECK(cuda::launch_channel_quantize(c.const_data_ptr(), kind, c.numel(), inner, l.numel(),
                                               l.const_data_ptr<float>(), s.const_data_ptr<float>(),
                                               static_cast<std::uint64_t>(seed), stochastic,
                                               codes.mutable_data_ptr<std::uint8_t>(), current_stream()));
  return codes;
}

// quant.mesa's pack in one call: the channels' range (kernel), the running range (the
// reference's ATen ops on one entry per group, so the CPU's bits), the codes (kernel).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mesa_quantize_cuda(
    const at::Tensor& x, std::int64_t inner, std::int64_t channels, std::int64_t groups,
    const std::optional<at::Tensor>& running, double decay, std::int64_t seed, bool stochastic) {
  const c10::cuda::CUDAGuard guard(x.device());
  bindings::check_mesa_quantize(x, inner, channels, groups, running);
  auto [gmin, gmax] = channel_minmax_cuda(x, inner, channels);
  at::Tensor gid;
  if (groups != channels) {
    gid = at::div(at::arange(channels, x.options().dtype(at::kLong)) * groups, channels, "floor");
    const at::TensorOptions floats = x.options().dtype(at::kFloat);
    gmin = at::full({groups}, std::numeric_limits<float>::infinity(), floats).scatter_reduce(0, gid, gmin, "amin");
    gmax = at::full({groups}, -std::numeric_limits<float>::infinity(), floats).scatter_reduce(0, gid, gmax, "amax");
  }
  const at::Tensor seen = gmin <= gmax;
  const at::Tensor observed = at::stack({gmin, gmax});
  const at::Tensor run = running.has_value()
                             ? at::where(seen, *running * decay + observed * (1.0 - decay), *running)
                             : at::where(seen, observed, at::Scalar(0.0));
  at::Tensor lo = at::minimum(run[0], gmin);
  // divided by a tensor: a host scalar would make CUDA multiply by its reciprocal, not divide
  at::Tensor step = (at::maximum(run[1], gmax) - lo).clamp_min_(0.0).div_(at::full({}, 252.0f, lo.options()));
  const at::Tensor clo = gid.defined() ? lo.index_select(0, gid) : lo;
  const at::Tensor cstep = gid.defined() ? step.index_select(0, gid) : step;
  at::Tensor codes = channel_quantize_cuda(x, clo, cstep, inner, seed, stochastic);
  return {codes, lo, step, run};
}

at::Tensor channel_dequantize_cuda(const at::Tensor& codes, const at::Tensor& lo, const at::Tensor& step,
                                   std::int64_t inner, at::ScalarType dtype) {
  const c10::cuda::CUDAGuard guard(codes.device());
  const groupquant::FloatKind kind = bindings::check_channel_dequantize(codes, lo, step, inner, dtype);
  const at::Tensor c = codes.contiguous();
  const at::Tensor l = lo.contiguous();
  const at::Tensor s = step.contiguous();
  at::Tensor out = c.new_empty({c.numel()}, c.options().dtype(dtype));
  C10_CUDA_CHECK(cuda::launch_channel_dequantize(c.const_data_ptr<std::uint8_t>(), c.numel(), inner, l.numel(),
                                                 l.const_data_ptr<float>(), s.const_data_ptr<float>(), kind,
                                                 out.mutable_data_ptr(), current_stream()));
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> row_center_cuda(const at::Tensor& x, std::int64_t run,
                                                                           bool scale) {
  const c10::cuda::CUDAGuard guard(x.device());
  const groupquant::FloatKind kind = bindings::check_row_center(x, run);
  const at::Tensor c = x.contiguous();
  const std::int64_t rows = c.numel() / run;
  at::Tensor centered = c.new_empty({c.numel()}, c.options().dtype(at::kFloat));
  at::Tensor offsets = c.new_empty({rows}, c.options().dtype(at::kFloat));
  at::Tensor constant = c.new_empty({ceil_div(rows, 8)}, c.options().dtype(at::kByte));
  at::Tensor scales = c.new_empty({scale ? rows : 0}, c.options().dtype(at::kFloat));
  C10_CUDA_CHECK(cuda::launch_row_center(c.const_data_ptr(), kind, rows, run, centered.mutable_data_ptr<float>(),
                                         offsets.mutable_data_ptr<float>(), constant.mutable_data_ptr<std::uint8_t>(),
                                         scale ? scales.mutable_data_ptr<float>() : nullptr, current_stream()));
  return {centered, offsets, constant, scales};
}

at::Tensor row_uncenter_cuda(const at::Tensor& decoded, const at::Tensor& offsets, const at::Tensor& constant,
                             const at::Tensor& scales, std::int64_t run, at::ScalarType dtype) {
  const c10::cuda::CUDAGuard guard(decoded.device());
  const groupquant::FloatKind kind = bindings::check_row_uncenter(decoded, offsets, constant, scales, run, dtype);
  const at::Tensor d = decoded.contiguous();
  const at::Tensor o = offsets.contiguous();
  const at::Tensor k = constant.contiguous();
  const at::Tensor s = scales.contiguous();
  at::Tensor out = d.new_empty({d.numel()}, d.options().dtype(dtype));
  C10_CUDA_CHECK(cuda::launch_row_uncenter(d.const_data_ptr<float>(), o.const_data_ptr<float>(),
                                           k.const_data_ptr<std::uint8_t>(),
                                           s.numel() > 0 ? s.const_data_ptr<float>() : nullptr, d.numel() / run, run,
                                           kind, out.mutable_data_ptr(), current_stream()));
  return out;
}

// CUDA composes the two kernels (row_center, then group_quantize of its float32 output, a
// scratch tensor on the same stream); the CPU fuses them.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> row_group_quantize_cuda(
    const at::Tensor& x, std::int64_t run, std::int64_t bits, std::int64_t group_size, std::int64_t seed,
    bool stochastic) {
  const c10::cuda::CUDAGuard guard(x.device());
  bindings::check_row_group_quantize(x, run, bits, group_size);
  auto [centered, offsets, constant, scales] = row_center_cuda(x, run, false);
  auto [packed, lo, step] = group_quantize_cuda(centered, bits, group_size, seed, stochastic);
  return {packed, lo, step, offsets, constant};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> row_group_quantize_seeded_cuda(
    const at::Tensor& x, std::int64_t run, std::int64_t bits, std::int64_t group_size, const at::Tensor& seed,
    bool stochastic) {
  const c10::cuda::CUDAGuard guard(x.device());
  bindings::check_row_group_quantize(x, run, bits, group_size);
  bindings::check_seed_tensor("row_group_quantize", seed, x.device());
  auto [centered, offsets, constant, scales] = row_center_cuda(x, run, false);
  const bool on_host = seed.device().is_cpu();
  auto [packed, lo, step] =
      group_quantize_at(centered, bits, group_size, on_host ? seed.item<std::int64_t>() : 0,
                        on_host ? nullptr : seed.const_data_ptr<std::int64_t>(), stochastic);
  return {packed, lo, step, offsets, constant};
}

at::Tensor row_group_dequantize_cuda(const at::Tensor& packed, const at::Tensor& lo, const at::Tensor& step,
                                     const at::Tensor& offsets, const at::Tensor& constant, std::int64_t bits,
                                     std::int64_t group_size, std::int64_t run, std::int64_t numel,
                                     at::ScalarType dtype) {
  const c10::cuda::CUDAGuard guard(packed.device());
  bindings::check_row_group_dequantize(packed, lo, step, offsets, constant, bits, group_size, run, numel, dtype);
  const at::Tensor decoded = group_dequantize_cuda(packed, lo, step, bits, group_size, numel, at::kFloat);
  return row_uncenter_cuda(decoded, offsets, constant, offsets.new_empty({0}), run, dtype);
}

std::tuple<at::Tensor, at::Tensor> fp8_quantize_cuda(const at::Tensor& x, std::int64_t group_size) {
  const c10::cuda::CUDAGuard guard(x.device());
  const groupquant::FloatKind kind = bindings::check_fp8_quantize(x, group_size);
  const at::Tensor c = x.contiguous();
  const std::int64_t groups = ceil_div(c.numel(), group_size);
  at::Tensor codes = c.new_empty({groups * group_size}, c.options().dtype(at::kByte));
  at::Tensor scale = c.new_empty({groups}, c.options().dtype(at::kBFloat16));
  C10_CUDA_CHECK(cuda::launch_fp8_quantize(c.const_data_ptr(), kind, c.numel(), group_size,
                                           codes.mutable_data_ptr<std::uint8_t>(),
                                           static_cast<std::uint16_t*>(scale.mutable_data_ptr()), current_stream()));
  return {codes, scale};
}

at::Tensor fp8_dequantize_cuda(const at::Tensor& codes, const at::Tensor& scale, std::int64_t group_size,
                               std::int64_t numel, at::ScalarType dtype) {
  const c10::cuda::CUDAGuard guard(codes.device());
  const groupquant::FloatKind kind = bindings::check_fp8_dequantize(codes, scale, group_size, numel, dtype);
  const at::Tensor c = codes.contiguous();
  const at::Tensor s = scale.contiguous();
  at::Tensor out = c.new_empty({numel}, c.options().dtype(dtype));
  C10_CUDA_CHECK(cuda::launch_fp8_dequantize(c.const_data_ptr<std::uint8_t>(),
                                             static_cast<const std::uint16_t*>(s.const_data_ptr()), numel, group_size,
                                             kind, out.mutable_data_ptr(), current_stream()));
  return out;
}

at::Tensor level_quantize_cuda(const at::Tensor& x, const at::Tensor& levels, std::int64_t bits,
                               std::int64_t seed) {
  const c10::cuda::CUDAGuard guard(x.device());
  const groupquant::FloatKind kind = bindings::check_level_quantize(x, levels, bits);
  const at::Tensor c = x.contiguous();
  const at::Tensor l = levels.contiguous();
  const std::int64_t n = c.numel();
  at::Tensor out = c.new_empty({bitpack::packed_size(n, static_cast<int>(bits))}, c.options().dtype(at::kByte));
  // seed is a 64-bit pattern: a Python value in [2^63, 2^64) arrives negative.
  C10_CUDA_CHECK(cuda::launch_level_quantize(c.const_data_ptr(), kind, n, l.const_data_ptr<float>(),
                                             static_cast<int>(l.numel()), static_cast<int>(bits),
                                             static_cast<std::uint64_t>(seed), out.mutable_data_ptr<std::uint8_t>(),
                                             current_stream()));
  return out;
}

at::Tensor sign_pack_cuda(const at::Tensor& x) {
  const c10::cuda::CUDAGuard guard(x.device());
  const SignKind kind = bindings::sign_kind("sign_pack", "x", x.scalar_type());
  const at::Tensor c = x.contiguous();
  at::Tensor out = c.new_empty({ceil_div(c.numel(), 8)}, c.options().dtype(at::kByte));
  C10_CUDA_CHECK(cuda::launch_sign_pack(c.const_data_ptr(), kind, c.numel(), out.mutable_data_ptr<std::uint8_t>(),
                                        current_stream()));
  return out;
}

at::Tensor sign_unpack_cuda(const at::Tensor& packed, std::int64_t numel, at::ScalarType dtype) {
  const c10::cuda::CUDAGuard guard(packed.device());
  const SignKind kind = bindings::check_sign_unpack(packed, numel, dtype);
  const at::Tensor p = packed.contiguous();
  at::Tensor out = p.new_empty({numel}, p.options().dtype(dtype));
  C10_CUDA_CHECK(cuda::launch_sign_unpack(p.const_data_ptr<std::uint8_t>(), numel, kind, out.mutable_data_ptr(),
                                          current_stream()));
  return out;
}

// Device scratch memory from torch's caching allocator, on t's device and stream.
at::Tensor workspace_like(const at::Tensor& t, std::int64_t bytes) {
  return t.new_empty({bytes > 0 ? bytes : 1}, t.options().dtype(at::kByte));
}

at::Tensor topk_mask_cuda(const at::Tensor& x, std::int64_t segments, std::int64_t k, bool exact) {
  const c10::cuda::CUDAGuard guard(x.device());
  const sparse::KeyKind kind = bindings::check_topk_mask(x, segments, k, exact);
  const at::Tensor c = x.contiguous();
  const std::int64_t n = c.numel();
  at::Tensor out = c.new_empty({ceil_div(n, 8)}, c.options().dtype(at::kByte));
  if (n > 0) {
    at::Tensor ws = workspace_like(c, sparse::topk_plan(n, segments).bytes);
    C10_CUDA_CHECK(cuda::launch_topk_mask(c.const_data_ptr(), kind, n, segments, k,
                                          out.mutable_data_ptr<std::uint8_t>(), ws.mutable_data_ptr(),
                                          current_stream()));
  }
  return out;
}

at::Tensor mask_compact_cuda(const at::Tensor& x, const at::Tensor& mask, std::int64_t kept) {
  const c10::cuda::CUDAGuard guard(x.device());
  const groupquant::FloatKind kind = bindings::check_mask_compact(x, mask, kept);
  const at::Tensor c = x.contiguous();
  const at::Tensor m = mask.contiguous();
  at::Tensor out = c.new_empty({kept});
  at::Tensor ws = workspace_like(c, sparse::compact_workspace(c.numel(), sparse::kMaskChunkBytes));
  C10_CUDA_CHECK(cuda::launch_mask_compact(c.const_data_ptr(), sparse::word_bytes(kind),
                                           m.const_data_ptr<std::uint8_t>(), c.numel(), kept,
                                           out.mutable_data_ptr(), ws.mutable_data_ptr(), current_stream()));
  return out;
}

at::Tensor mask_scatter_cuda(const at::Tensor& mask, const at::Tensor& values, std::int64_t numel) {
  const c10::cuda::CUDAGuard guard(mask.device());
  const groupquant::FloatKind kind = bindings::check_mask_scatter(mask, values, numel);
  const at::Tensor m = mask.contiguous();
  const at::Tensor v = values.contiguous();
  at::Tensor out = v.new_empty({numel});
  at::Tensor ws = workspace_like(m, sparse::compact_workspace(numel, sparse::kMaskChunkBytes));
  C10_CUDA_CHECK(cuda::launch_mask_scatter(m.const_data_ptr<std::uint8_t>(), v.const_data_ptr(),
                                           sparse::word_bytes(kind), v.numel(), numel, out.mutable_data_ptr(),
                                           ws.mutable_data_ptr(), current_stream()));
  return out;
}

std::tuple<at::Tensor, at::Tensor> mask_offsets_cuda(const at::Tensor& mask, std::int64_t numel,
                                                     std::int64_t kept) {
  const c10::cuda::CUDAGuard guard(mask.device());
  bindings::check_mask_offsets(mask, numel, kept);
  const at::Tensor m = mask.contiguous();
  at::Tensor offsets = m.new_empty({kept}, m.options().dtype(at::kUInt16));
  at::Tensor counts = m.new_empty({ceil_div(numel, sparse::kOffsetBlock)}, m.options().dtype(at::kInt));
  at::Tensor ws = workspace_like(m, sparse::compact_workspace(numel, sparse::kOffsetBlock / 8));
  C10_CUDA_CHECK(cuda::launch_mask_offsets(m.const_data_ptr<std::uint8_t>(), numel, kept,
                                           static_cast<std::uint16_t*>(offsets.mutable_data_ptr()),
                                           counts.mutable_data_ptr<std::int32_t>(), ws.mutable_data_ptr(),
                                           current_stream()));
  return {offsets, counts};
}

at::Tensor offsets_scatter_cuda(const at::Tensor& offsets, const at::Tensor& counts, const at::Tensor& values,
                                std::int64_t numel) {
  const c10::cuda::CUDAGuard guard(values.device());
  const groupquant::FloatKind kind = bindings::check_offsets_scatter(offsets, counts, values, numel);
  const at::Tensor o = offsets.contiguous();
  const at::Tensor c = counts.contiguous();
  const at::Tensor v = values.contiguous();
  at::Tensor out = v.new_empty({numel});
  at::Tensor ws = workspace_like(v, sparse::offsets_scatter_workspace(numel));
  C10_CUDA_CHECK(cuda::launch_offsets_scatter(static_cast<const std::uint16_t*>(o.const_data_ptr()), o.numel(),
                                              c.const_data_ptr<std::int32_t>(), v.const_data_ptr(),
                                              sparse::word_bytes(kind), numel, out.mutable_data_ptr(),
                                              ws.mutable_data_ptr(), current_stream()));
  return out;
}

}  // namespace
}  // namespace torchstash

TORCH_LIBRARY_IMPL(torchstash, CUDA, m) {
  m.impl("pack_bits", &torchstash::pack_bits_cuda);
  m.impl("unpack_bits", &torchstash::unpack_bits_cuda);
  m.impl("philox_uniform", &torchstash::philox_uniform_cuda);
  m.impl("group_quantize", &torchstash::group_quantize_cuda);
  m.impl("group_quantize.seeded", &torchstash::group_quantize_seeded_cuda);
  m.impl("group_dequantize", &torchstash::group_dequantize_cuda);
  m.impl("channel_minmax", &torchstash::channel_minmax_cuda);
  m.impl("channel_quantize", &torchstash::channel_quantize_cuda);
  m.impl("mesa_quantize", &torchstash::mesa_quantize_cuda);
  m.impl("channel_dequantize", &torchstash::channel_dequantize_cuda);
  m.impl("row_center", &torchstash::row_center_cuda);
  m.impl("row_uncenter", &torchstash::row_uncenter_cuda);
  m.impl("row_group_quantize", &torchstash::row_group_quantize_cuda);
  m.impl("row_group_quantize.seeded", &torchstash::row_group_quantize_seeded_cuda);
  m.impl("row_group_dequantize", &torchstash::row_group_dequantize_cuda);
  m.impl("fp8_quantize", &torchstash::fp8_quantize_cuda);
  m.impl("fp8_dequantize", &torchstash::fp8_dequantize_cuda);
  m.impl("level_quantize", &torchstash::level_quantize_cuda);
  m.impl("sign_pack", &torchstash::sign_pack_cuda);
  m.impl("sign_unpack", &torchstash::sign_unpack_cuda);
  m.impl("topk_mask", &torchstash::topk_mask_cuda);
  m.impl("mask_compact", &torchstash::mask_compact_cuda);
  m.impl("mask_scatter", &torchstash::mask_scatter_cuda);
  m.impl("mask_offsets", &torchstash::mask_offsets_cuda);
  m.impl("offsets_scatter", &torchstash::offsets_scatter_cuda);
}
