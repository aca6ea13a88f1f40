// CUDA kernels over the inline groupquant.h functions: fused per-group quantization and
// its inverse, 64-bit indices, grid-stride loops with a capped grid.
//
// Quantize: one warp per run of whole groups whose first bit is on a byte boundary
// (byte_aligned_groups, at most 8 groups), so no two warps share an output byte. Per
// group the lanes stride over it for min/max (warp-shuffle reduction) and lane 0 puts the
// parameters in shared memory; then each lane encodes units of whole bytes (a whole
// Philox block when aligned). Dequantize: one thread per unit of whole bytes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "float_io.cuh"
#include "launch_config.cuh"
#include "torchstash/bitpack.h"
#include "torchstash/cuda_launch.h"
#include "torchstash/groupquant.h"

namespace torchstash {
namespace cuda {
namespace {

using groupquant::Params;
using groupquant::Stats;

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = kThreads / kWarp;
constexpr int kMaxRun = 8;  // byte_aligned_groups() never exceeds 8

__device__ __forceinline__ Stats warp_stats(Stats s) {
#pragma unroll
  for (int d = kWarp / 2; d > 0; d /= 2) {
    const Stats other{__shfl_xor_sync(0xFFFFFFFFu, s.mn, d), __shfl_xor_sync(0xFFFFFFFFu, s.mx, d), false};
    s = groupquant::merge(s, other);
  }
  s.nonfinite = __any_sync(0xFFFFFFFFu, s.nonfinite) != 0;
  return s;
}

// Elements per lane step: whole packed bytes, and at least one Philox block (4 elements).
template <int BITS>
__host__ __device__ constexpr int unit_elems() {
  return 8 / BITS >= 4 ? 8 / BITS : 4;
}

template <typename T, int BITS>
__global__ void quantize_kernel(const T* __restrict__ x, index_t n, index_t group_size, index_t run,
                                std::uint64_t seed, const std::int64_t* __restrict__ seed_at, bool stochastic,
                                std::uint8_t* __restrict__ packed, std::uint16_t* __restrict__ lo,
                                std::uint16_t* __restrict__ step) {
  // A traced seed lives in device memory (a compiled graph draws it): read here, no host sync.
  if (seed_at != nullptr) seed = static_cast<std::uint64_t>(*seed_at);
  constexpr int per = 8 / BITS;
  constexpr int unit = unit_elems<BITS>();
  __shared__ Params params[kWarpsPerBlock][kMaxRun];
  Params* mine = params[threadIdx.x / kWarp];
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  const index_t groups = ceil_div(n, group_size);
  const index_t runs = ceil_div(groups, run);
  // The loop bounds are warp-uniform: every lane takes part in every shuffle.
  for (index_t r = grid_start() / kWarp; r < runs; r += grid_stride() / kWarp) {
    const index_t g0 = r * run;
    const int ng = static_cast<int>(groups - g0 < run ? groups - g0 : run);
    const index_t begin = g0 * group_size;  // a byte boundary
    for (int j = 0; j < ng; ++j) {
      const index_t gs = begin + j * group_size;
      const index_t ge = n - gs < group_size ? n : gs + group_size;
      Stats s = groupquant::empty_stats();
      for (index_t i = gs + lane; i < ge; i += kWarp) groupquant::accumulate(&s, load_float(x, i));
      const Params p = groupquant::make_params(warp_stats(s), BITS);
      if (lane == 0) {
        mine[j] = p;
        lo[g0 + j] = groupquant::stored_lo(p);
        step[g0 + j] = groupquant::stored_step(p);
      }
    }
    __syncwarp();
    const index_t last = begin + (ng - 1) * group_size;
    const index_t end = n - last < group_size ? n : last + group_size;
    std::uint8_t* out = packed + begin / per;
    for (index_t k = lane; k * unit < end - begin; k += kWarp) {
      const index_t first = begin + k * unit;
      const int m = static_cast<int>(end - first < unit ? end - first : unit);
      int j = static_cast<int>((first - begin) / group_size);
      index_t left = group_size - (first - begin - j * group_size);  // elements left in group j
      Params p = mine[j];
      philox::Words w{0, 0, 0, 0};
      index_t block = -1;
      std::uint32_t acc = 0;
      for (int e = 0; e < m; ++e) {
        const index_t i = first + e;
        if (left == 0) {
          p = mine[++j];
          left = group_size;
        }
        --left;
        float u = groupquant::kNearest;
        if (stochastic) {
          if ((i >> 2) != block) {
            block = i >> 2;
            w = philox::block_words(seed, 0, static_cast<std::uint64_t>(block));
          }
          const int q = static_cast<int>(i & 3);
          u = philox::to_uniform(q == 0 ? w.x0 : q == 1 ? w.x1 : q == 2 ? w.x2 : w.x3);
        }
        acc |= static_cast<std::uint32_t>(groupquant::code_of(load_float(x, i), p, u, BITS)) << (e * BITS);
      }
      const int nbytes = (m * BITS + 7) / 8;
      for (int b = 0; b < nbytes; ++b) out[k * (unit / per) + b] = static_cast<std::uint8_t>(acc >> (8 * b));
    }
    __syncwarp();  // `mine` is rewritten by the next run
  }
}

template <typename T, int BITS>
__global__ void dequantize_kernel(const std::uint8_t* __restrict__ packed, const std::uint16_t* __restrict__ lo,
                                  const std::uint16_t* __restrict__ step, index_t n, index_t group_size,
                                  T* __restrict__ out) {
  constexpr int per = 8 / BITS;
  constexpr int unit = unit_elems<BITS>();
  constexpr std::uint32_t mask = (1u << BITS) - 1u;
  const index_t units = ceil_div(n, unit);
  for (index_t k = grid_start(); k < units; k += grid_stride()) {
    const index_t first = k * unit;
    const int m = static_cast<int>(n - first < unit ? n - first : unit);
    std::uint32_t acc = 0;
    for (int b = 0; b < (m * BITS + 7) / 8; ++b) acc |= static_cast<std::uint32_t>(packed[first / per + b]) << (8 * b);
    index_t g = first / group_size;
    index_t left = group_size - (first - g * group_size);
    Params p = groupquant::load_params(lo[g], step[g], BITS);
    for (int e = 0; e < m; ++e) {
      if (left == 0) {
        ++g;
        left = group_size;
        p = groupquant::load_params(lo[g], step[g], BITS);
      }
      --left;
      const auto code = static_cast<std::uint8_t>((acc >> (e * BITS)) & mask);
      store_float(out, first + e, groupquant::value_of(code, p, BITS));
    }
  }
}

template <typename T, int BITS>
cudaError_t quantize_as(const void* x, index_t n, index_t group_size, std::uint64_t seed,
                        const std::int64_t* seed_at, bool stochastic, std::uint8_t* packed, std::uint16_t* lo,
                        std::uint16_t* step, cudaStream_t stream) {
  const index_t run = groupquant::byte_aligned_groups(group_size, BITS);
  const index_t runs = ceil_div(ceil_div(n, group_size), run);
  quantize_kernel<T, BITS><<<grid_for(runs * kWarp), kThreads, 0, stream>>>(
      static_cast<const T*>(x), n, group_size, run, seed, seed_at, stochastic, packed, lo, step);
  return cudaGetLastError();
}

template <typename T>
cudaError_t quantize_bits(const void* x, index_t n, int bits, index_t group_size, std::uint64_t seed,
                          const std::int64_t* seed_at, bool stochastic, std::uint8_t* packed, std::uint16_t* lo,
                          std::uint16_t* step, cudaStream_t stream) {
  switch (bits) {
    case 1: return quantize_as<T, 1>(x, n, group_size, seed, seed_at, stochastic, packed, lo, step, stream);
    case 2: return quantize_as<T, 2>(x, n, group_size, seed, seed_at, stochastic, packed, lo, step, stream);
    case 4: return quantize_as<T, 4>(x, n, group_size, seed, seed_at, stochastic, packed, lo, step, stream);
    case 8: return quantize_as<T, 8>(x, n, group_size, seed, seed_at, stochastic, packed, lo, step, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T, int BITS>
cudaError_t dequantize_as(const std::uint8_t* packed, const std::uint16_t* lo, const std::uint16_t* step,
                          index_t group_size, index_t n, void* out, cudaStream_t stream) {
  dequantize_kernel<T, BITS><<<grid_for(ceil_div(n, unit_elems<BITS>())), kThreads, 0, stream>>>(
      packed, lo, step, n, group_size, static_cast<T*>(out));
  return cudaGetLastError();
}

template <typename T>
cudaError_t dequantize_bits(const std::uint8_t* packed, const std::uint16_t* lo, const std::uint16_t* step,
                            int bits, index_t group_size, index_t n, void* out, cudaStream_t stream) {
  switch (bits) {
    case 1: return dequantize_as<T, 1>(packed, lo, step, group_size, n, out, stream);
    case 2: return dequantize_as<T, 2>(packed, lo, step, group_size, n, out, stream);
    case 4: return dequantize_as<T, 4>(packed, lo, step, group_size, n, out, stream);
    case 8: return dequantize_as<T, 8>(packed, lo, step, group_size, n, out, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_group_quantize(const void* x, groupquant::FloatKind kind, index_t n, int bits,
                                  index_t group_size, std::uint64_t seed, bool stochastic, std::uint8_t* packed,
                                  std::uint16_t* lo, std::uint16_t* step, cudaStream_t stream,
                                  const std::int64_t* seed_at) {
  if (n <= 0) return cudaSuccess;
  if (group_size <= 0) return cudaErrorInvalidValue;
  switch (kind) {
    case groupquant::FloatKind::kFloat32:
      return quantize_bits<float>(x, n, bits, group_size, seed, seed_at, stochastic, packed, lo, step, stream);
    case groupquant::FloatKind::kFloat16:
      return quantize_bits<__half>(x, n, bits, group_size, seed, seed_at, stochastic, packed, lo, step, stream);
    case groupquant::FloatKind::kBFloat16:
      return quantize_bits<__nv_bfloat16>(x, n, bits, group_size, seed, seed_at, stochastic, packed, lo, step, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_group_dequantize(const std::uint8_t* packed, const std::uint16_t* lo, const std::uint16_t* step,
                                    int bits, index_t group_size, index_t n, groupquant::FloatKind kind, void* out,
                                    cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (group_size <= 0) return cudaErrorInvalidValue;
  switch (kind) {
    case groupquant::FloatKind::kFloat32:
      return dequantize_bits<float>(packed, lo, step, bits, group_size, n, out, stream);
    case groupquant::FloatKind::kFloat16:
      return dequantize_bits<__half>(packed, lo, step, bits, group_size, n, out, stream);
    case groupquant::FloatKind::kBFloat16:
      return dequantize_bits<__nv_bfloat16>(packed, lo, step, bits, group_size, n, out, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace cuda
}  // namespace torchstash
