// The torchstash operator library: schemas and the CPU kernels.
//
// Uses <torch/library.h> and <ATen/core/Tensor.h> instead of <torch/extension.h>
// (no pybind11), and allocates with Tensor::new_empty rather than at::empty, to keep
// this, the slowest translation unit, near 4 s. The library is loaded with
// torch.ops.load_library and the ops are called as torch.ops.torchstash.*.
#include <cstdlib>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "checks.h"
#include "torchstash/bitpack.h"
#include "torchstash/cpu_kernels.h"

namespace torchstash {
namespace {

// Below this many bytes of work a single thread is faster than waking the team.
constexpr std::int64_t kParallelThreshold = std::int64_t{1} << 18;

int threads_for(std::int64_t work) { return work < kParallelThreshold ? 1 : at::get_num_threads(); }

void advise_huge(void* p, std::int64_t nbytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (std::getenv("TS_NOHUGE")) return;
  constexpr std::uintptr_t kHuge = std::uintptr_t{1} << 21;
  const std::uintptr_t lo = (reinterpret_cast<std::uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const std::uintptr_t hi = (reinterpret_cast<std::uintptr_t>(p) + static_cast<std::uintptr_t>(nbytes)) & ~(kHuge - 1);
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
#endif
}

at::Tensor pack_bits_cpu(const at::Tensor& codes, std::int64_t bits) {
  const at::Tensor c = bindings::prepare_codes(codes, bits);
  const std::int64_t n = c.numel();
  at::Tensor out = c.new_empty({bitpack::packed_size(n, static_cast<int>(bits))}, c.options().dtype(at::kByte));
  if (n > 0) {
    cpu::pack_bits(static_cast<const std::uint8_t*>(c.const_data_ptr()), n, static_cast<int>(bits),
                   out.mutable_data_ptr<std::uint8_t>(), threads_for(n));
  }
  return out;
}

at::Tensor unpack_bits_cpu(const at::Tensor& packed, std::int64_t bits, std::int64_t numel) {
  const at::Tensor p = bindings::prepare_packed(packed, bits, numel);
  at::Tensor out = p.new_empty({numel});
  advise_huge(out.mutable_data_ptr(), numel);
  if (numel > 0) {
    cpu::unpack_bits(p.const_data_ptr<std::uint8_t>(), numel, static_cast<int>(bits),
                     out.mutable_data_ptr<std::uint8_t>(), threads_for(numel));
  }
  return out;
}

void philox_uniform_cpu(const at::Tensor& out, std::int64_t seed, std::int64_t offset) {
  bindings::check_philox_out(out);
  const std::int64_t n = out.numel();
  if (n > 0) {
    // seed and offset are 64-bit patterns: a Python value in [2^63, 2^64) arrives negative.
    cpu::philox_uniform(out.mutable_data_ptr<float>(), n, static_cast<std::uint64_t>(seed),
                        static_cast<std::uint64_t>(offset), threads_for(n * 16));
  }
}

}  // namespace
}  // namespace torchstash

TORCH_LIBRARY(torchstash, m) {
  // Fake (meta) kernels for torch.compile live in this Python module.
  m.set_python_module("torchstash.kernels._meta");
  m.def("pack_bits(Tensor codes, int bits) -> Tensor");
  m.def("unpack_bits(Tensor packed, int bits, int numel) -> Tensor");
  m.def("philox_uniform(Tensor(a!) out, int seed, int offset) -> ()");
}

TORCH_LIBRARY_IMPL(torchstash, CPU, m) {
  m.impl("pack_bits", &torchstash::pack_bits_cpu);
  m.impl("unpack_bits", &torchstash::unpack_bits_cpu);
  m.impl("philox_uniform", &torchstash::philox_uniform_cpu);
}
