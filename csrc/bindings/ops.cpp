// The torchstash operator library: schemas and the CPU kernels.
//
// Uses <torch/library.h> and <ATen/core/Tensor.h> instead of <torch/extension.h>
// (no pybind11), and allocates with Tensor::new_empty rather than at::empty, to keep
// this, the slowest translation unit, near 4 s. The library is loaded with
// torch.ops.load_library and the ops are called as torch.ops.torchstash.*.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <tuple>
#include <vector>

#include "checks.h"
#include "torchstash/bitpack.h"
#include "torchstash/cpu_kernels.h"

namespace torchstash {
namespace {

// Below this many bytes of work a single thread is faster than waking the team.
constexpr std::int64_t kParallelThreshold = std::int64_t{1} << 18;

int threads_for(std::int64_t work) { return work < kParallelThreshold ? 1 : at::get_num_threads(); }

// Large outputs are advised to use transparent huge pages (Linux; a no-op where THP is
// off): first-touch page faults, not the loops, otherwise dominate a 64 MiB output
// (16K faults of 4 KiB against 32 of 2 MiB). PyTorch's THP_MEM_ALLOC_ENABLE does the
// same for all allocations. Only buffers of 32 MiB or more, which glibc always maps
// privately (its mmap threshold tops out at 32 MiB), and only their 2 MiB-aligned
// interior are advised, so the advice never reaches memory shared with other tensors.
// The huge pages are then faulted in by this thread, one store each, before the
// OpenMP team writes the buffer: concurrent huge-page faults from several threads were
// measured to stall for tens of milliseconds.
constexpr std::int64_t kHugeAdviceBytes = std::int64_t{32} << 20;

// `data` is about to be overwritten entirely by the caller.
void prepare_huge_pages(void* data, std::int64_t nbytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (nbytes < kHugeAdviceBytes) return;
  constexpr std::uintptr_t kHuge = std::uintptr_t{1} << 21;
  const auto begin = reinterpret_cast<std::uintptr_t>(data);
  const std::uintptr_t lo = (begin + kHuge - 1) & ~(kHuge - 1);
  const std::uintptr_t hi = (begin + static_cast<std::uintptr_t>(nbytes)) & ~(kHuge - 1);
  if (hi <= lo || madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE) != 0) return;
  for (std::uintptr_t page = lo; page < hi; page += kHuge) *reinterpret_cast<volatile std::uint8_t*>(page) = 0;
#else
  (void)data;
  (void)nbytes;
#endif
}

at::Tensor pack_bits_cpu(const at::Tensor& codes, std::int64_t bits) {
  const at::Tensor c = bindings::prepare_codes(codes, bits);
  const std::int64_t n = c.numel();
  const std::int64_t nbytes = bitpack::packed_size(n, static_cast<int>(bits));
  at::Tensor out = c.new_empty({nbytes}, c.options().dtype(at::kByte));
  prepare_huge_pages(out.mutable_data_ptr(), nbytes);
  if (n > 0) {
    cpu::pack_bits(static_cast<const std::uint8_t*>(c.const_data_ptr()), n, static_cast<int>(bits),
                   out.mutable_data_ptr<std::uint8_t>(), threads_for(n));
  }
  return out;
}

at::Tensor unpack_bits_cpu(const at::Tensor& packed, std::int64_t bits, std::int64_t numel) {
  const at::Tensor p = bindings::prepare_packed(packed, bits, numel);
  at::Tensor out = p.new_empty({numel});
  prepare_huge_pages(out.mutable_data_ptr(), numel);
  if (numel > 0) {
    cpu::unpack_bits(p.const_data_ptr<std::uint8_t>(), numel, static_cast<int>(bits),
                     out.mutable_data_ptr<std::uint8_t>(), threads_for(numel));
  }
  return out;
}

void philox_uniform_cpu(const at::Tensor& out, std::int64_t seed, std::int64_t offset) {
  bindings::check_philox_out(out);
  const std::int64_t n = out.numel();
  prepare_huge_pages(out.mutable_data_ptr(), n * 4);
  if (n > 0) {
    // seed and offset are 64-bit patterns: a Python value in [2^63, 2^64) arrives negative.
    cpu::philox_uniform(out.mutable_data_ptr<float>(), n, static_cast<std::uint64_t>(seed),
                        static_cast<std::uint64_t>(offset), threads_for(n * 16));
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> group_quantize_cpu(const at::Tensor& x, std::int64_t bits,
                                                                  std::int64_t group_size, std::int64_t seed,
                                                                  bool stochastic) {
  const groupquant::FloatKind kind = bindings::check_group_quantize(x, bits, group_size);
  const at::Tensor c = x.contiguous();
  const std::int64_t n = c.numel();
  const std::int64_t groups = ceil_div(n, group_size);
  const std::int64_t nbytes = bitpack::packed_size(n, static_cast<int>(bits));
  at::Tensor packed = c.new_empty({nbytes}, c.options().dtype(at::kByte));
  at::Tensor lo = c.new_empty({groups}, c.options().dtype(at::kBFloat16));
  at::Tensor step = c.new_empty({groups}, c.options().dtype(at::kBFloat16));
  prepare_huge_pages(packed.mutable_data_ptr(), nbytes);
  if (n > 0) {
    // seed is a 64-bit pattern: a Python value in [2^63, 2^64) arrives negative.
    cpu::group_quantize(c.const_data_ptr(), kind, n, static_cast<int>(bits),
                        bindings::kernel_group_size(group_size, n), static_cast<std::uint64_t>(seed), stochastic,
                        packed.mutable_data_ptr<std::uint8_t>(), static_cast<std::uint16_t*>(lo.mutable_data_ptr()),
                        static_cast<std::uint16_t*>(step.mutable_data_ptr()), threads_for(n * 16));
  }
  return {packed, lo, step};
}

// The overload a compiled graph calls: its seed is a tensor (a graph input or drawn in the
// graph), read here on the host.
std::tuple<at::Tensor, at::Tensor, at::Tensor> group_quantize_seeded_cpu(const at::Tensor& x, std::int64_t bits,
                                                                         std::int64_t group_size,
                                                                         const at::Tensor& seed, bool stochastic) {
  bindings::check_seed_tensor("group_quantize", seed, x.device());
  return group_quantize_cpu(x, bits, group_size, seed.item<std::int64_t>(), stochastic);
}

at::Tensor group_dequantize_cpu(const at::Tensor& packed, const at::Tensor& lo, const at::Tensor& step,
                                std::int64_t bits, std::int64_t group_size, std::int64_t numel,
                                at::ScalarType dtype) {
  const groupquant::FloatKind kind =
      bindings::check_group_dequantize(packed, lo, step, bits, group_size, numel, dtype);
  const at::Tensor p = packed.contiguous();
  const at::Tensor l = lo.contiguous();
  const at::Tensor s = step.contiguous();
  at::Tensor out = p.new_empty({numel}, p.options().dtype(dtype));
  prepare_huge_pages(out.mutable_data_ptr(), static_cast<std::int64_t>(out.nbytes()));
  if (numel > 0) {
    cpu::group_dequantize(p.const_data_ptr<std::uint8_t>(), static_cast<const std::uint16_t*>(l.const_data_ptr()),
                          static_cast<const std::uint16_t*>(s.const_data_ptr()), static_cast<int>(bits),
                          bindings::kernel_group_size(group_size, numel), numel, kind, out.mutable_data_ptr(),
                          threads_for(numel * 4));
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> channel_minmax_cpu(const at::Tensor& x, std::int64_t inner, std::int64_t channels) {
  const groupquant::FloatKind kind = bindings::check_channel_minmax(x, inner, channels);
  const at::Tensor c = x.contiguous();
  const std::int64_t n = c.numel();
  at::Tensor mn = c.new_empty({channels}, c.options().dtype(at::kFloat));
  at::Tensor mx = c.new_empty({channels}, c.options().dtype(at::kFloat));
  cpu::channel_minmax(c.const_data_ptr(), kind, n, inner, channels, mn.mutable_data_ptr<float>(),
                      mx.mutable_data_ptr<float>(), threads_for(n * 4));
  return {mn, mx};
}

// quant.mesa's pack in one call: the channels' range, the running range and the codes.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mesa_quantize_cpu(
    const at::Tensor& x, std::int64_t inner, std::int64_t channels, std::int64_t groups,
    const std::optional<at::Tensor>& running, double decay, std::int64_t seed, bool stochastic) {
  const groupquant::FloatKind kind = bindings::check_mesa_quantize(x, inner, channels, groups, running);
  const at::Tensor c = x.contiguous();
  const std::int64_t n = c.numel();
  std::vector<float> mn(static_cast<std::size_t>(channels));
  std::vector<float> mx(static_cast<std::size_t>(channels));
  cpu::channel_minmax(c.const_data_ptr(), kind, n, inner, channels, mn.data(), mx.data(), threads_for(n * 4));
  const at::TensorOptions floats = c.options().dtype(at::kFloat);
  at::Tensor lo = c.new_empty({groups}, floats);
  at::Tensor step = c.new_empty({groups}, floats);
  at::Tensor run = c.new_empty({2, groups}, floats);
  const at::Tensor prev = running.has_value() ? running->contiguous() : at::Tensor();
  // the scalars as torch rounds them: d * prev + (1 - d) * observed in float32
  cpu::mesa_range(mn.data(), mx.data(), channels, groups, prev.defined() ? prev.const_data_ptr<float>() : nullptr,
                  static_cast<float>(decay), static_cast<float>(1.0 - decay), lo.mutable_data_ptr<float>(),
                  step.mutable_data_ptr<float>(), run.mutable_data_ptr<float>());
  // each channel's lo and step (its group's)
  std::vector<float> clo(static_cast<std::size_t>(channels));
  std::vector<float> cstep(static_cast<std::size_t>(channels));
  for (std::int64_t ch = 0; ch < channels; ++ch) {
    clo[ch] = lo.const_data_ptr<float>()[ch * groups / channels];
    cstep[ch] = step.const_data_ptr<float>()[ch * groups / channels];
  }
  at::Tensor codes = c.new_empty({n}, c.options().dtype(at::kByte));
  prepare_huge_pages(codes.mutable_data_ptr(), n);
  if (n > 0) {
    cpu::channel_quantize(c.const_data_ptr(), kind, n, inner, channels, clo.data(), cstep.data(),
                          static_cast<std::uint64_t>(seed), stochastic, codes.mutable_data_ptr<std::uint8_t>(),
                          threads_for(n * (stochastic ? 16 : 4)));
  }
  return {codes, lo, step, run};
}

at::Tensor channel_quantize_cpu(const at::Tensor& x, const at::Tensor& lo, const at::Tensor& step, std::int64_t inner,
                                std::int64_t seed, bool stochastic) {
  const groupquant::FloatKind kind = bindings::check_channel_quantize(x, lo, step, inner);
  const at::Tensor c = x.contiguous();
  const at::Tensor l = lo.contiguous();
  const at::Tensor s = step.contiguous();
  const std::int64_t n = c.numel();
  at::Tensor codes = c.new_empty({n}, c.options().dtype(at::kByte));
  prepare_huge_pages(codes.mutable_data_ptr(), n);
  if (n > 0) {
    // seed is a 64-bit pattern: a Python value in [2^63, 2^64) arrives negative.
    cpu::channel_quantize(c.const_data_ptr(), kind, n, inner, l.numel(), l.const_data_ptr<float>(),
                          s.const_data_ptr<float>(), static_cast<std::uint64_t>(seed), stochastic,
                          codes.mutable_data_ptr<std::uint8_t>(), threads_for(n * (stochastic ? 16 : 4)));
  }
  return codes;
}

at::Tensor channel_dequantize_cpu(const at::Tensor& codes, const at::Tensor& lo, const at::Tensor& step,
                                  std::int64_t inner, at::ScalarType dtype) {
  const groupquant::FloatKind kind = bindings::check_channel_dequantize(codes, lo, step, inner, dtype);
  const at::Tensor c = codes.contiguous();
  const at::Tensor l = lo.contiguous();
  const at::Tensor s = step.contiguous();
  const std::int64_t n = c.numel();
  at::Tensor out = c.new_empty({n}, c.options().dtype(dtype));
  prepare_huge_pages(out.mutable_data_ptr(), static_cast<std::int64_t>(out.nbytes()));
  if (n > 0) {
    cpu::channel_dequantize(c.const_data_ptr<std::uint8_t>(), n, inner, l.numel(), l.const_data_ptr<float>(),
                            s.const_data_ptr<float>(), kind, out.mutable_data_ptr(), threads_for(n * 4));
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> row_center_cpu(const at::Tensor& x, std::int64_t run,
                                                                          bool scale) {
  const groupquant::FloatKind kind = bindings::check_row_center(x, run);
  const at::Tensor c = x.contiguous();
  const std::int64_t rows = c.numel() / run;
  at::Tensor centered = c.new_empty({c.numel()}, c.options().dtype(at::kFloat));
  at::Tensor offsets = c.new_empty({rows}, c.options().dtype(at::kFloat));
  at::Tensor constant = c.new_empty({ceil_div(rows, 8)}, c.options().dtype(at::kByte));
  at::Tensor scales = c.new_empty({scale ? rows : 0}, c.options().dtype(at::kFloat));
  prepare_huge_pages(centered.mutable_data_ptr(), static_cast<std::int64_t>(centered.nbytes()));
  cpu::row_center(c.const_data_ptr(), kind, rows, run, centered.mutable_data_ptr<float>(),
                  offsets.mutable_data_ptr<float>(), constant.mutable_data_ptr<std::uint8_t>(),
                  scale ? scales.mutable_data_ptr<float>() : nullptr, threads_for(c.numel() * 4));
  return {centered, offsets, constant, scales};
}

at::Tensor row_uncenter_cpu(const at::Tensor& decoded, const at::Tensor& offsets, const at::Tensor& constant,
                            const at::Tensor& scales, std::int64_t run, at::ScalarType dtype) {
  const groupquant::FloatKind kind = bindings::check_row_uncenter(decoded, offsets, constant, scales, run, dtype);
  const at::Tensor d = decoded.contiguous();
  const at::Tensor o = offsets.contiguous();
  const at::Tensor k = constant.contiguous();
  const at::Tensor s = scales.contiguous();
  at::Tensor out = d.new_empty({d.numel()}, d.options().dtype(dtype));
  prepare_huge_pages(out.mutable_data_ptr(), static_cast<std::int64_t>(out.nbytes()));
  cpu::row_uncenter(d.const_data_ptr<float>(), o.const_data_ptr<float>(), k.const_data_ptr<std::uint8_t>(),
                    s.numel() > 0 ? s.const_data_ptr<float>() : nullptr, d.numel() / run, run, kind,
                    out.mutable_data_ptr(), threads_for(d.numel() * 4));
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> row_group_quantize_cpu(
    const at::Tensor& x, std::int64_t run, std::int64_t bits, std::int64_t group_size, std::int64_t seed,
    bool stochastic) {
  const groupquant::FloatKind kind = bindings::check_row_group_quantize(x, run, bits, group_size);
  const at::Tensor c = x.contiguous();
  const std::int64_t n = c.numel();
  const std::int64_t rows = n / run;
  const std::int64_t nbytes = bitpack::packed_size(n, static_cast<int>(bits));
  at::Tensor packed = c.new_empty({nbytes}, c.options().dtype(at::kByte));
  at::Tensor lo = c.new_empty({ceil_div(n, group_size)}, c.options().dtype(at::kBFloat16));
  at::Tensor step = c.new_empty({ceil_div(n, group_size)}, c.options().dtype(at::kBFloat16));
  at::Tensor offsets = c.new_empty({rows}, c.options().dtype(at::kFloat));
  at::Tensor constant = c.new_empty({ceil_div(rows, 8)}, c.options().dtype(at::kByte));
  prepare_huge_pages(packed.mutable_data_ptr(), nbytes);
  if (n > 0) {
    cpu::row_group_quantize(c.const_data_ptr(), kind, n, run, static_cast<int>(bits),
                            bindings::kernel_group_size(group_size, n), static_cast<std::uint64_t>(seed), stochastic,
                            packed.mutable_data_ptr<std::uint8_t>(), static_cast<std::uint16_t*>(lo.mutable_data_ptr()),
                            static_cast<std::uint16_t*>(step.mutable_data_ptr()), offsets.mutable_data_ptr<float>(),
                            constant.mutable_data_ptr<std::uint8_t>(), threads_for(n * 16));
  }
  return {packed, lo, step, offsets, constant};
}

// The overload a compiled graph calls (as group_quantize.seeded).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> row_group_quantize_seeded_cpu(
    const at::Tensor& x, std::int64_t run, std::int64_t bits, std::int64_t group_size, const at::Tensor& seed,
    bool stochastic) {
  bindings::check_seed_tensor("row_group_quantize", seed, x.device());
  return row_group_quantize_cpu(x, run, bits, group_size, seed.item<std::int64_t>(), stochastic);
}

at::Tensor row_group_dequantize_cpu(const at::Tensor& packed, const at::Tensor& lo, const at::Tensor& step,
                                    const at::Tensor& offsets, const at::Tensor& constant, std::int64_t bits,
                                    std::int64_t group_size, std::int64_t run, std::int64_t numel,
                                    at::ScalarType dtype) {
  const groupquant::FloatKind kind = bindings::check_row_group_dequantize(packed, lo, step, offsets, constant, bits,
                                                                          group_size, run, numel, dtype);
  const at::Tensor p = packed.contiguous();
  const at::Tensor l = lo.contiguous();
  const at::Tensor s = step.contiguous();
  const at::Tensor o = offsets.contiguous();
  const at::Tensor k = constant.contiguous();
  at::Tensor out = p.new_empty({numel}, p.options().dtype(dtype));
  prepare_huge_pages(out.mutable_data_ptr(), static_cast<std::int64_t>(out.nbytes()));
  if (numel > 0) {
    cpu::row_group_dequantize(p.const_data_ptr<std::uint8_t>(), static_cast<const std::uint16_t*>(l.const_data_ptr()),
                              static_cast<const std::uint16_t*>(s.const_data_ptr()), static_cast<int>(bits),
                              bindings::kernel_group_size(group_size, numel), numel, run, o.const_data_ptr<float>(),
                              k.const_data_ptr<std::uint8_t>(), kind, out.mutable_data_ptr(), threads_for(numel * 8));
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> fp8_quantize_cpu(const at::Tensor& x, std::int64_t group_size) {
  const groupquant::FloatKind kind = bindings::check_fp8_quantize(x, group_size);
  const at::Tensor c = x.contiguous();
  const std::int64_t n = c.numel();
  const std::int64_t groups = ceil_div(n, group_size);
  at::Tensor codes = c.new_empty({groups * group_size}, c.options().dtype(at::kByte));
  at::Tensor scale = c.new_empty({groups}, c.options().dtype(at::kBFloat16));
  prepare_huge_pages(codes.mutable_data_ptr(), static_cast<std::int64_t>(codes.nbytes()));
  cpu::fp8_quantize(c.const_data_ptr(), kind, n, group_size, codes.mutable_data_ptr<std::uint8_t>(),
                    static_cast<std::uint16_t*>(scale.mutable_data_ptr()), threads_for(n * 4));
  return {codes, scale};
}

at::Tensor fp8_dequantize_cpu(const at::Tensor& codes, const at::Tensor& scale, std::int64_t group_size,
                              std::int64_t numel, at::ScalarType dtype) {
  const groupquant::FloatKind kind = bindings::check_fp8_dequantize(codes, scale, group_size, numel, dtype);
  const at::Tensor c = codes.contiguous();
  const at::Tensor s = scale.contiguous();
  at::Tensor out = c.new_empty({numel}, c.options().dtype(dtype));
  prepare_huge_pages(out.mutable_data_ptr(), static_cast<std::int64_t>(out.nbytes()));
  cpu::fp8_dequantize(c.const_data_ptr<std::uint8_t>(), static_cast<const std::uint16_t*>(s.const_data_ptr()), numel,
                      group_size, kind, out.mutable_data_ptr(), threads_for(numel * 4));
  return out;
}

at::Tensor level_quantize_cpu(const at::Tensor& x, const at::Tensor& levels, std::int64_t bits, std::int64_t seed) {
  const groupquant::FloatKind kind = bindings::check_level_quantize(x, levels, bits);
  const at::Tensor c = x.contiguous();
  const at::Tensor l = levels.contiguous();
  const std::int64_t n = c.numel();
  at::Tensor out = c.new_empty({bitpack::packed_size(n, static_cast<int>(bits))}, c.options().dtype(at::kByte));
  if (n > 0) {
    // seed is a 64-bit pattern: a Python value in [2^63, 2^64) arrives negative.
    cpu::level_quantize(c.const_data_ptr(), kind, n, l.const_data_ptr<float>(), static_cast<int>(l.numel()),
                        static_cast<int>(bits), static_cast<std::uint64_t>(seed), out.mutable_data_ptr<std::uint8_t>(),
                        threads_for(n * 16));
  }
  return out;
}

at::Tensor sign_pack_cpu(const at::Tensor& x) {
  const SignKind kind = bindings::sign_kind("sign_pack", "x", x.scalar_type());
  const at::Tensor c = x.contiguous();
  const std::int64_t n = c.numel();
  at::Tensor out = c.new_empty({ceil_div(n, 8)}, c.options().dtype(at::kByte));
  cpu::sign_pack(c.const_data_ptr(), kind, n, out.mutable_data_ptr<std::uint8_t>(), threads_for(n));
  return out;
}

at::Tensor sign_unpack_cpu(const at::Tensor& packed, std::int64_t numel, at::ScalarType dtype) {
  const SignKind kind = bindings::check_sign_unpack(packed, numel, dtype);
  const at::Tensor p = packed.contiguous();
  at::Tensor out = p.new_empty({numel}, p.options().dtype(dtype));
  prepare_huge_pages(out.mutable_data_ptr(), static_cast<std::int64_t>(out.nbytes()));
  cpu::sign_unpack(p.const_data_ptr<std::uint8_t>(), numel, kind, out.mutable_data_ptr(), threads_for(numel));
  return out;
}

at::Tensor sign_select_cpu(const at::Tensor& grad, const at::Tensor& packed) {
  const SignKind kind = bindings::check_sign_select(grad, packed);
  const at::Tensor g = grad.contiguous();
  const at::Tensor p = packed.contiguous();
  const std::int64_t n = g.numel();
  at::Tensor out = g.new_empty({n});
  prepare_huge_pages(out.mutable_data_ptr(), static_cast<std::int64_t>(out.nbytes()));
  cpu::sign_select(p.const_data_ptr<std::uint8_t>(), g.const_data_ptr(), n, kind, out.mutable_data_ptr(),
                   threads_for(n));
  return out;
}

std::tuple<at::Tensor, at::Tensor> max_pool2d_code_cpu(const at::Tensor& x, at::IntArrayRef kernel,
                                                       at::IntArrayRef stride, at::IntArrayRef padding,
                                                       at::IntArrayRef dilation, bool ceil_mode,
                                                       const at::Tensor& table, std::int64_t bits) {
  const maxpool::Geometry g =
      bindings::check_max_pool2d_code(x, kernel, stride, padding, dilation, ceil_mode, table, bits);
  const at::Tensor c = x.contiguous();
  const at::Tensor t = table.contiguous();
  const std::int64_t planes = c.numel() / (g.H * g.W);
  std::vector<std::int64_t> sizes(c.sizes().begin(), c.sizes().end());
  sizes[sizes.size() - 2] = g.OH;
  sizes[sizes.size() - 1] = g.OW;
  at::Tensor out = c.new_empty(sizes);
  at::Tensor packed =
      c.new_empty({bitpack::packed_size(planes * g.OH * g.OW, static_cast<int>(bits))}, c.options().dtype(at::kByte));
  cpu::max_pool2d_code(c.const_data_ptr<float>(), planes, g, t.const_data_ptr<std::uint8_t>(), t.numel(),
                       static_cast<int>(bits), out.mutable_data_ptr<float>(), packed.mutable_data_ptr<std::uint8_t>(),
                       threads_for(c.numel() * g.kH * g.kW));
  return {out, packed};
}

at::Tensor max_pool2d_code_backward_cpu(const at::Tensor& grad, const at::Tensor& packed, at::IntArrayRef input_size,
                                        at::IntArrayRef kernel, at::IntArrayRef stride, at::IntArrayRef padding,
                                        at::IntArrayRef dilation, bool ceil_mode, std::int64_t bits) {
  const maxpool::Geometry g = bindings::check_max_pool2d_code_backward(grad, packed, input_size, kernel, stride,
                                                                       padding, dilation, ceil_mode, bits);
  const at::Tensor gr = grad.contiguous();
  const at::Tensor p = packed.contiguous();
  at::Tensor gx = gr.new_empty(input_size);
  const std::int64_t planes = gx.numel() / (g.H * g.W);
  const bool ok = cpu::max_pool2d_code_backward(gr.const_data_ptr<float>(), p.const_data_ptr<std::uint8_t>(), planes,
                                                g, static_cast<int>(bits), gx.mutable_data_ptr<float>(),
                                                threads_for(gx.numel() * 2));
  TORCH_CHECK_VALUE(ok, "torchstash::max_pool2d_code_backward: a code is not a position of its window inside the ",
                    "plane; pass the codes max_pool2d_code made with these arguments");
  return gx;
}

std::tuple<at::Tensor, at::Tensor> window_code_cpu(const at::Tensor& indices, const at::Tensor& table,
                                                   at::IntArrayRef plane, at::IntArrayRef kernel,
                                                   at::IntArrayRef stride, at::IntArrayRef padding,
                                                   at::IntArrayRef dilation, std::int64_t bits) {
  const maxpool::Geometry g =
      bindings::check_window_code(indices, table, plane, kernel, stride, padding, dilation, bits);
  const at::Tensor c = indices.contiguous();
  const at::Tensor t = table.contiguous();
  const std::int64_t n = c.numel();
  at::Tensor packed = c.new_empty({bitpack::packed_size(n, static_cast<int>(bits))}, c.options().dtype(at::kByte));
  const std::int64_t planes = g.OH * g.OW > 0 ? n / (g.OH * g.OW) : 0;
  const bool exact = planes == 0 || cpu::window_code(c.const_data_ptr<std::int64_t>(), planes, g,
                                                     t.const_data_ptr<std::uint8_t>(), t.numel(),
                                                     static_cast<int>(bits), packed.mutable_data_ptr<std::uint8_t>(),
                                                     threads_for(n * 8));
  return {packed, c.new_full({}, exact, c.options().dtype(at::kBool))};
}

at::Tensor window_indices_cpu(const at::Tensor& packed, at::IntArrayRef size, at::IntArrayRef plane,
                              at::IntArrayRef kernel, at::IntArrayRef stride, at::IntArrayRef padding,
                              at::IntArrayRef dilation, std::int64_t bits) {
  const maxpool::Geometry g =
      bindings::window_geometry("window_indices", size, plane, kernel, stride, padding, dilation, bits);
  const at::Tensor p = packed.contiguous();
  at::Tensor out = p.new_empty(size, p.options().dtype(at::kLong));
  bindings::check_packed("window_indices", "window_code", packed, bits, out.numel());
  const std::int64_t planes = g.OH * g.OW > 0 ? out.numel() / (g.OH * g.OW) : 0;
  const bool ok = planes == 0 || cpu::window_indices(p.const_data_ptr<std::uint8_t>(), planes, g, static_cast<int>(bits),
                                                     out.mutable_data_ptr<std::int64_t>(), threads_for(out.numel() * 8));
  TORCH_CHECK_VALUE(ok, "torchstash::window_indices: a code is past its window's positions; pass the codes ",
                    "window_code made with these arguments");
  return out;
}

at::Tensor topk_mask_cpu(const at::Tensor& x, std::int64_t segments, std::int64_t k, bool exact) {
  const sparse::KeyKind kind = bindings::check_topk_mask(x, segments, k, exact);
  const at::Tensor c = x.contiguous();
  const std::int64_t n = c.numel();
  const std::int64_t nbytes = ceil_div(n, 8);
  at::Tensor out = c.new_empty({nbytes}, c.options().dtype(at::kByte));
  prepare_huge_pages(out.mutable_data_ptr(), nbytes);
  if (n > 0) {
    cpu::topk_mask(c.const_data_ptr(), kind, n, segments, k, out.mutable_data_ptr<std::uint8_t>(),
                   threads_for(n * sparse::key_passes(kind) * 2));
  }
  return out;
}

at::Tensor mask_compact_cpu(const at::Tensor& x, const at::Tensor& mask, std::int64_t kept) {
  const groupquant::FloatKind kind = bindings::check_mask_compact(x, mask, kept);
  const at::Tensor c = x.contiguous();
  const at::Tensor m = mask.contiguous();
  at::Tensor out = c.new_empty({kept});
  const std::int64_t found = cpu::mask_compact(c.const_data_ptr(), sparse::word_bytes(kind),
                                               m.const_data_ptr<std::uint8_t>(), c.numel(), kept,
                                               out.mutable_data_ptr(), threads_for(c.numel() / 4));
  TORCH_CHECK_VALUE(found == kept, "mask_compact: the mask has ", found, " set bits, not ", kept);
  return out;
}

at::Tensor mask_scatter_cpu(const at::Tensor& mask, const at::Tensor& values, std::int64_t numel) {
  const groupquant::FloatKind kind = bindings::check_mask_scatter(mask, values, numel);
  const at::Tensor m = mask.contiguous();
  const at::Tensor v = values.contiguous();
  at::Tensor out = v.new_empty({numel});
  prepare_huge_pages(out.mutable_data_ptr(), static_cast<std::int64_t>(out.nbytes()));
  const std::int64_t found =
      cpu::mask_scatter(m.const_data_ptr<std::uint8_t>(), v.const_data_ptr(), sparse::word_bytes(kind), v.numel(),
                        numel, out.mutable_data_ptr(), threads_for(static_cast<std::int64_t>(out.nbytes())));
  TORCH_CHECK_VALUE(found == v.numel(), "mask_scatter: the mask has ", found, " set bits, but ", v.numel(),
                    " values were given");
  return out;
}

std::tuple<at::Tensor, at::Tensor> mask_offsets_cpu(const at::Tensor& mask, std::int64_t numel, std::int64_t kept) {
  bindings::check_mask_offsets(mask, numel, kept);
  const at::Tensor m = mask.contiguous();
  at::Tensor offsets = m.new_empty({kept}, m.options().dtype(at::kUInt16));
  at::Tensor counts = m.new_empty({ceil_div(numel, sparse::kOffsetBlock)}, m.options().dtype(at::kInt));
  const std::int64_t found = cpu::mask_offsets(
      m.const_data_ptr<std::uint8_t>(), numel, kept, static_cast<std::uint16_t*>(offsets.mutable_data_ptr()),
      counts.mutable_data_ptr<std::int32_t>(), threads_for(numel / 4));
  TORCH_CHECK_VALUE(found == kept, "mask_offsets: the mask has ", found, " set bits, not ", kept);
  return {offsets, counts};
}

at::Tensor offsets_scatter_cpu(const at::Tensor& offsets, const at::Tensor& counts, const at::Tensor& values,
                               std::int64_t numel) {
  const groupquant::FloatKind kind = bindings::check_offsets_scatter(offsets, counts, values, numel);
  const at::Tensor o = offsets.contiguous();
  const at::Tensor c = counts.contiguous();
  const at::Tensor v = values.contiguous();
  at::Tensor out = v.new_empty({numel});
  prepare_huge_pages(out.mutable_data_ptr(), static_cast<std::int64_t>(out.nbytes()));
  const std::int64_t status = cpu::offsets_scatter(
      static_cast<const std::uint16_t*>(o.const_data_ptr()), o.numel(), c.const_data_ptr<std::int32_t>(),
      v.const_data_ptr(), sparse::word_bytes(kind), numel, out.mutable_data_ptr(),
      threads_for(static_cast<std::int64_t>(out.nbytes())));
  TORCH_CHECK_VALUE(status != -1, "offsets_scatter: counts must be >= 0 and sum to the ", o.numel(),
                    " offsets; pass the counts that mask_offsets returned");
  TORCH_CHECK_VALUE(status != -2, "offsets_scatter: an offset of the last block reaches past ", numel,
                    " elements; pass the numel that mask_offsets was given");
  return out;
}

}  // namespace
}  // namespace torchstash

TORCH_LIBRARY(torchstash, m) {
  // Fake (meta) kernels for torch.compile live in this Python module.
  m.set_python_module("torchstash.kernels._meta");
  m.def("pack_bits(Tensor codes, int bits) -> Tensor");
  m.def("unpack_bits(Tensor packed, int bits, SymInt numel) -> Tensor");
  m.def("philox_uniform(Tensor(a!) out, int seed, int offset) -> ()");
  m.def("group_quantize(Tensor x, int bits, int group_size, int seed, bool stochastic) -> (Tensor, Tensor, Tensor)");
  m.def(
      "group_quantize.seeded(Tensor x, int bits, int group_size, Tensor seed, bool stochastic) -> "
      "(Tensor, Tensor, Tensor)");
  m.def(
      "group_dequantize(Tensor packed, Tensor lo, Tensor step, int bits, int group_size, SymInt numel, "
      "ScalarType dtype) -> Tensor");
  m.def("channel_minmax(Tensor x, SymInt inner, int channels) -> (Tensor, Tensor)");
  m.def("channel_quantize(Tensor x, Tensor lo, Tensor step, SymInt inner, int seed, bool stochastic) -> Tensor");
  m.def(
      "mesa_quantize(Tensor x, SymInt inner, int channels, int groups, Tensor? running, float decay, int seed, "
      "bool stochastic) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("channel_dequantize(Tensor codes, Tensor lo, Tensor step, SymInt inner, ScalarType dtype) -> Tensor");
  m.def("row_center(Tensor x, SymInt run, bool scale) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "row_uncenter(Tensor decoded, Tensor offsets, Tensor constant, Tensor scales, SymInt run, ScalarType dtype) -> "
      "Tensor");
  m.def(
      "row_group_quantize(Tensor x, SymInt run, int bits, int group_size, int seed, bool stochastic) -> "
      "(Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "row_group_quantize.seeded(Tensor x, SymInt run, int bits, int group_size, Tensor seed, bool stochastic) -> "
      "(Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "row_group_dequantize(Tensor packed, Tensor lo, Tensor step, Tensor offsets, Tensor constant, int bits, "
      "int group_size, SymInt run, SymInt numel, ScalarType dtype) -> Tensor");
  m.def("fp8_quantize(Tensor x, int group_size) -> (Tensor, Tensor)");
  m.def("fp8_dequantize(Tensor codes, Tensor scale, int group_size, SymInt numel, ScalarType dtype) -> Tensor");
  m.def("level_quantize(Tensor x, Tensor levels, int bits, int seed) -> Tensor");
  m.def("sign_pack(Tensor x) -> Tensor");
  m.def("sign_unpack(Tensor packed, SymInt numel, ScalarType dtype) -> Tensor");
  m.def("sign_select(Tensor grad, Tensor packed) -> Tensor");
  m.def(
      "max_pool2d_code(Tensor x, int[] kernel, int[] stride, int[] padding, int[] dilation, bool ceil_mode, "
      "Tensor table, int bits) -> (Tensor, Tensor)");
  m.def(
      "max_pool2d_code_backward(Tensor grad, Tensor packed, SymInt[] input_size, int[] kernel, int[] stride, "
      "int[] padding, int[] dilation, bool ceil_mode, int bits) -> Tensor");
  m.def(
      "window_code(Tensor indices, Tensor table, int[] plane, int[] kernel, int[] stride, int[] padding, "
      "int[] dilation, int bits) -> (Tensor, Tensor)");
  m.def(
      "window_indices(Tensor packed, SymInt[] size, int[] plane, int[] kernel, int[] stride, int[] padding, "
      "int[] dilation, int bits) -> Tensor");
  m.def("topk_mask(Tensor x, int segments, int k, bool exact) -> Tensor");
  m.def("mask_compact(Tensor x, Tensor mask, int kept) -> Tensor");
  m.def("mask_scatter(Tensor mask, Tensor values, SymInt numel) -> Tensor");
  m.def("mask_offsets(Tensor mask, SymInt numel, int kept) -> (Tensor, Tensor)");
  m.def("offsets_scatter(Tensor offsets, Tensor counts, Tensor values, SymInt numel) -> Tensor");
}

TORCH_LIBRARY_IMPL(torchstash, CPU, m) {
  m.impl("pack_bits", &torchstash::pack_bits_cpu);
  m.impl("unpack_bits", &torchstash::unpack_bits_cpu);
  m.impl("philox_uniform", &torchstash::philox_uniform_cpu);
  m.impl("group_quantize", &torchstash::group_quantize_cpu);
  m.impl("group_quantize.seeded", &torchstash::group_quantize_seeded_cpu);
  m.impl("group_dequantize", &torchstash::group_dequantize_cpu);
  m.impl("channel_minmax", &torchstash::channel_minmax_cpu);
  m.impl("channel_quantize", &torchstash::channel_quantize_cpu);
  m.impl("mesa_quantize", &torchstash::mesa_quantize_cpu);
  m.impl("channel_dequantize", &torchstash::channel_dequantize_cpu);
  m.impl("row_center", &torchstash::row_center_cpu);
  m.impl("row_uncenter", &torchstash::row_uncenter_cpu);
  m.impl("row_group_quantize", &torchstash::row_group_quantize_cpu);
  m.impl("row_group_quantize.seeded", &torchstash::row_group_quantize_seeded_cpu);
  m.impl("row_group_dequantize", &torchstash::row_group_dequantize_cpu);
  m.impl("fp8_quantize", &torchstash::fp8_quantize_cpu);
  m.impl("fp8_dequantize", &torchstash::fp8_dequantize_cpu);
  m.impl("level_quantize", &torchstash::level_quantize_cpu);
  m.impl("sign_pack", &torchstash::sign_pack_cpu);
  m.impl("sign_unpack", &torchstash::sign_unpack_cpu);
  m.impl("sign_select", &torchstash::sign_select_cpu);
  m.impl("max_pool2d_code", &torchstash::max_pool2d_code_cpu);
  m.impl("max_pool2d_code_backward", &torchstash::max_pool2d_code_backward_cpu);
  m.impl("window_code", &torchstash::window_code_cpu);
  m.impl("window_indices", &torchstash::window_indices_cpu);
  m.impl("topk_mask", &torchstash::topk_mask_cpu);
  m.impl("mask_compact", &torchstash::mask_compact_cpu);
  m.impl("mask_scatter", &torchstash::mask_scatter_cpu);
  m.impl("mask_offsets", &torchstash::mask_offsets_cpu);
  m.impl("offsets_scatter", &torchstash::offsets_scatter_cpu);
}
