// CUDA kernels over the inline channelquant.h functions: per-channel min/max, 8-bit
// channel-wise quantization and its inverse, 64-bit indices, grid-stride loops with a
// capped grid.
//
// Min/max: the outputs are set to +inf / -inf, then partial results are merged with
// integer atomics on the float bit patterns (exact, so the order does not matter; -0.0 is
// made +0.0 first). For inner >= kRowInner one warp reduces a chunk of up to kChunk
// elements of one channel run (warp shuffles, one atomic pair per chunk); for smaller inner
// each thread reduces one column of the (outer, C * inner) matrix over a grid-stride loop
// whose stride is a multiple of the column count, so loads stay coalesced.
// Quantize and dequantize: one thread per 4 elements (one Philox block), the channel found
// with one division per block and stepped from element to element.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "float_io.cuh"
#include "launch_config.cuh"
#include "torchstash/channelquant.h"
#include "torchstash/cuda_launch.h"
#include "torchstash/groupquant.h"
#include "torchstash/philox.h"

namespace torchstash {
namespace cuda {
namespace {

using groupquant::Stats;

constexpr int kWarp = 32;
constexpr index_t kRowInner = 32;  // from here on min/max reduces channel runs, a warp each
constexpr index_t kChunk = 2048;   // elements of a run per warp
constexpr index_t kPerThread = 16;  // min/max by columns: elements per thread, at least

// *addr <- min(*addr, v) / max(*addr, v) for v not -0.0 and not NaN: non-negative floats order
// like their bits as int32, negative ones in reverse as uint32 (and below every non-negative).
__device__ __forceinline__ void atomic_min_float(float* addr, float v) {
  if (v >= 0.0f) {
    atomicMin(reinterpret_cast<int*>(addr), __float_as_int(v));
  } else {
    atomicMax(reinterpret_cast<unsigned int*>(addr), __float_as_uint(v));
  }
}

__device__ __forceinline__ void atomic_max_float(float* addr, float v) {
  if (v >= 0.0f) {
    atomicMax(reinterpret_cast<int*>(addr), __float_as_int(v));
  } else {
    atomicMin(reinterpret_cast<unsigned int*>(addr), __float_as_uint(v));
  }
}

// Merges a partial result into channel c (nothing when it saw no finite element).
__device__ __forceinline__ void publish(float* mn, float* mx, index_t c, Stats s) {
  if (s.mn <= s.mx) {
    atomic_min_float(mn + c, channelquant::canonical(s.mn));
    atomic_max_float(mx + c, channelquant::canonical(s.mx));
  }
}

__device__ __forceinline__ void accumulate_finite(Stats* s, float v) {
  if (groupquant::is_finite(v)) {
    s->mn = v < s->mn ? v : s->mn;
    s->mx = v > s->mx ? v : s->mx;
  }
}

// Min and max over lanes l, l ^ d, ... for d from `from` down to `to` (powers of two).
__device__ __forceinline__ Stats warp_minmax(Stats s, int from, int to) {
  for (int d = from; d >= to; d /= 2) {
    const Stats other{__shfl_xor_sync(0xFFFFFFFFu, s.mn, d), __shfl_xor_sync(0xFFFFFFFFu, s.mx, d), false};
    s = groupquant::merge(s, other);
  }
  return s;
}

__global__ void init_minmax_kernel(float* __restrict__ mn, float* __restrict__ mx, index_t channels) {
  for (index_t c = grid_start(); c < channels; c += grid_stride()) {
    mn[c] = groupquant::bits_float(0x7F800000u);
    mx[c] = groupquant::bits_float(0xFF800000u);
  }
}

// inner >= kRowInner: a warp per chunk of one channel run.
template <typename T>
__global__ void minmax_runs_kernel(const T* __restrict__ x, index_t n, index_t inner, index_t channels,
                                   float* __restrict__ mn, float* __restrict__ mx) {
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  const index_t runs = n / inner;
  const index_t per_run = ceil_div(inner, kChunk);
  const index_t units = runs * per_run;
  // The loop bounds are warp-uniform: every lane takes part in every shuffle.
  for (index_t w = grid_start() / kWarp; w < units; w += grid_stride() / kWarp) {
    const index_t run = w / per_run;
    const index_t run_end = (run + 1) * inner;
    const index_t begin = run * inner + (w - run * per_run) * kChunk;
    const index_t end = run_end - begin < kChunk ? run_end : begin + kChunk;
    Stats s = groupquant::empty_stats();
    for (index_t i = begin + lane; i < end; i += kWarp) accumulate_finite(&s, load_float(x, i));
    s = warp_minmax(s, kWarp / 2, 1);
    if (lane == 0) publish(mn, mx, run % channels, s);
  }
}

// inner < kRowInner: columns j of the (n / columns, columns) matrix, columns = inner * C;
// column j belongs to channel j / inner.
template <typename T>
__global__ void minmax_columns_kernel(const T* __restrict__ x, index_t n, index_t inner, index_t columns,
                                      float* __restrict__ mn, float* __restrict__ mx) {
  const index_t t = grid_start();
  const index_t total = grid_stride();
  if (columns <= total) {
    // A stride that is a multiple of `columns`: thread t always reads column t % columns.
    const index_t stride = total / columns * columns;
    Stats s = groupquant::empty_stats();
    if (t < stride) {
      for (index_t i = t; i < n; i += stride) accumulate_finite(&s, load_float(x, i));
    }
    // Few columns: lanes l and l + columns of a warp share a column (columns divides 32 and
    // the stride), so the warp reduces them before the atomics.
    if (columns < kWarp && kWarp % columns == 0) {
      s = warp_minmax(s, kWarp / 2, static_cast<int>(columns));
      if (static_cast<index_t>(threadIdx.x % kWarp) >= columns) return;
    }
    if (t < stride) publish(mn, mx, (t % columns) / inner, s);
    return;
  }
  for (index_t j = t; j < columns; j += total) {
    Stats s = groupquant::empty_stats();
    for (index_t i = j; i < n; i += columns) accumulate_finite(&s, load_float(x, i));
    publish(mn, mx, j / inner, s);
  }
}

template <typename T>
__global__ void quantize_kernel(const T* __restrict__ x, index_t n, index_t inner, index_t channels,
                                const float* __restrict__ lo, const float* __restrict__ step, std::uint64_t seed,
                                bool stochastic, std::uint8_t* __restrict__ codes) {
  const index_t blocks = ceil_div(n, 4);
  const bool aligned = (reinterpret_cast<std::uintptr_t>(codes) % sizeof(std::uint32_t)) == 0;
  for (index_t b = grid_start(); b < blocks; b += grid_stride()) {
    const index_t first = b * 4;
    const int m = static_cast<int>(n - first < 4 ? n - first : 4);
    float u[4] = {groupquant::kNearest, groupquant::kNearest, groupquant::kNearest, groupquant::kNearest};
    if (stochastic) {
      const philox::Words w = philox::block_words(seed, 0, static_cast<std::uint64_t>(b));
      u[0] = philox::to_uniform(w.x0);
      u[1] = philox::to_uniform(w.x1);
      u[2] = philox::to_uniform(w.x2);
      u[3] = philox::to_uniform(w.x3);
    }
    const index_t q = first / inner;
    index_t r = first - q * inner;
    index_t c = q % channels;
    std::uint32_t acc = 0;
    for (int e = 0; e < m; ++e) {
      const std::uint8_t code = channelquant::code_of(load_float(x, first + e), lo[c], step[c], u[e]);
      acc |= static_cast<std::uint32_t>(code) << (8 * e);
      if (++r == inner) {
        r = 0;
        c = c + 1 == channels ? 0 : c + 1;
      }
    }
    if (aligned && m == 4) {
      reinterpret_cast<std::uint32_t*>(codes)[b] = acc;
    } else {
      for (int e = 0; e < m; ++e) codes[first + e] = static_cast<std::uint8_t>(acc >> (8 * e));
    }
  }
}

template <typename T>
__global__ void dequantize_kernel(const std::uint8_t* __restrict__ codes, index_t n, index_t inner,
                                  index_t channels, const float* __restrict__ lo, const float* __restrict__ step,
                                  T* __restrict__ out) {
  const index_t blocks = ceil_div(n, 4);
  // `codes` may be a view with an offset: whole-word loads only when aligned.
  const bool aligned = (reinterpret_cast<std::uintptr_t>(codes) % sizeof(std::uint32_t)) == 0;
  for (index_t b = grid_start(); b < blocks; b += grid_stride()) {
    const index_t first = b * 4;
    const int m = static_cast<int>(n - first < 4 ? n - first : 4);
    std::uint32_t acc = 0;
    if (aligned && m == 4) {
      acc = reinterpret_cast<const std::uint32_t*>(codes)[b];
    } else {
      for (int e = 0; e < m; ++e) acc |= static_cast<std::uint32_t>(codes[first + e]) << (8 * e);
    }
    const index_t q = first / inner;
    index_t r = first - q * inner;
    index_t c = q % channels;
    for (int e = 0; e < m; ++e) {
      const auto code = static_cast<std::uint8_t>(acc >> (8 * e));
      store_float(out, first + e, channelquant::value_of(code, lo[c], step[c]));
      if (++r == inner) {
        r = 0;
        c = c + 1 == channels ? 0 : c + 1;
      }
    }
  }
}

template <typename T>
cudaError_t minmax_as(const void* x, index_t n, index_t inner, index_t channels, float* mn, float* mx,
                      cudaStream_t stream) {
  init_minmax_kernel<<<grid_for(channels), kThreads, 0, stream>>>(mn, mx, channels);
  if (n <= 0) return cudaGetLastError();
  const T* xt = static_cast<const T*>(x);
  if (inner >= kRowInner) {
    const index_t units = (n / inner) * ceil_div(inner, kChunk);
    minmax_runs_kernel<T><<<grid_for(units * kWarp), kThreads, 0, stream>>>(xt, n, inner, channels, mn, mx);
  } else {
    const index_t columns = inner * channels;  // <= n: n is a multiple of it
    const index_t threads = ceil_div(n, kPerThread) > columns ? ceil_div(n, kPerThread) : columns;
    minmax_columns_kernel<T><<<grid_for(threads), kThreads, 0, stream>>>(xt, n, inner, columns, mn, mx);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_channel_minmax(const void* x, groupquant::FloatKind kind, index_t n, index_t inner,
                                  index_t channels, float* mn, float* mx, cudaStream_t stream) {
  if (channels <= 0) return cudaSuccess;
  if (inner <= 0) return cudaErrorInvalidValue;
  switch (kind) {
    case groupquant::FloatKind::kFloat32: return minmax_as<float>(x, n, inner, channels, mn, mx, stream);
    case groupquant::FloatKind::kFloat16: return minmax_as<__half>(x, n, inner, channels, mn, mx, stream);
    case groupquant::FloatKind::kBFloat16: return minmax_as<__nv_bfloat16>(x, n, inner, channels, mn, mx, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_channel_quantize(const void* x, groupquant::FloatKind kind, index_t n, index_t inner,
                                    index_t channels, const float* lo, const float* step, std::uint64_t seed,
                                    bool stochastic, std::uint8_t* codes, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (inner <= 0 || channels <= 0) return cudaErrorInvalidValue;
  const unsigned int grid = grid_for(ceil_div(n, 4));
  switch (kind) {
    case groupquant::FloatKind::kFloat32:
      quantize_kernel<float><<<grid, kThreads, 0, stream>>>(static_cast<const float*>(x), n, inner, channels, lo,
                                                            step, seed, stochastic, codes);
      break;
    case groupquant::FloatKind::kFloat16:
      quantize_kernel<__half><<<grid, kThreads, 0, stream>>>(static_cast<const __half*>(x), n, inner, channels, lo,
                                                             step, seed, stochastic, codes);
      break;
    case groupquant::FloatKind::kBFloat16:
      quantize_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(
          static_cast<const __nv_bfloat16*>(x), n, inner, channels, lo, step, seed, stochastic, codes);
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t launch_channel_dequantize(const std::uint8_t* codes, index_t n, index_t inner, index_t channels,
                                      const float* lo, const float* step, groupquant::FloatKind kind, void* out,
                                      cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (inner <= 0 || channels <= 0) return cudaErrorInvalidValue;
  const unsigned int grid = grid_for(ceil_div(n, 4));
  switch (kind) {
    case groupquant::FloatKind::kFloat32:
      dequantize_kernel<float><<<grid, kThreads, 0, stream>>>(codes, n, inner, channels, lo, step,
                                                              static_cast<float*>(out));
      break;
    case groupquant::FloatKind::kFloat16:
      dequantize_kernel<__half><<<grid, kThreads, 0, stream>>>(codes, n, inner, channels, lo, step,
                                                               static_cast<__half*>(out));
      break;
    case groupquant::FloatKind::kBFloat16:
      dequantize_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(codes, n, inner, channels, lo, step,
                                                                      static_cast<__nv_bfloat16*>(out));
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace torchstash
