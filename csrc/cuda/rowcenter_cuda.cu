// CUDA kernels over the inline rowcenter.h functions: rows centered on their offset (and
// scaled), and restored, 64-bit indices, grid-stride loops with a capped grid.
//
// One warp per 8 consecutive rows (one byte of constant flags, written by lane 0 alone).
// Per row, lanes 0-15 each add their float64 lane of the sum in order (lane l: elements l,
// l + 16, ...), folded by shuffles in rowcenter.h's order (s[l] + s[l + w], w = 8, 4, 2, 1),
// so the sum is the CPU's and the reference's bit for bit; equality with the first element,
// the largest finite magnitude and the writes stride over the row with all 32 lanes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "float_io.cuh"
#include "launch_config.cuh"
#include "torchstash/cuda_launch.h"
#include "torchstash/groupquant.h"
#include "torchstash/rowcenter.h"

namespace torchstash {
namespace cuda {
namespace {

constexpr int kWarp = 32;
constexpr unsigned kAll = 0xFFFFFFFFu;
constexpr int kRowsPerWarp = 8;

// The folded float64 sum of lane sums held by lanes 0-15 (others hold 0 and are ignored).
__device__ __forceinline__ double fold(double s) {
#pragma unroll
  for (int w = rowcenter::kSumLanes / 2; w >= 1; w /= 2) {
    const double other = __shfl_down_sync(kAll, s, w);
    s = __dadd_rn(s, other);  // lane l < w: s[l] + s[l + w]
  }
  return __shfl_sync(kAll, s, 0);
}

template <typename T>
__device__ double lane_sum(const T* x, index_t run, int lane) {
  double s = 0.0;
  if (lane < rowcenter::kSumLanes) {
    for (index_t i = lane; i < run; i += rowcenter::kSumLanes) s = __dadd_rn(s, static_cast<double>(load_float(x, i)));
  }
  return s;
}

__device__ __forceinline__ std::uint32_t warp_max(std::uint32_t v) {
#pragma unroll
  for (int d = kWarp / 2; d > 0; d /= 2) {
    const std::uint32_t o = __shfl_xor_sync(kAll, v, d);
    v = o > v ? o : v;
  }
  return v;
}

// Row r of x centered into centered[r * run, ...); returns whether it is constant.
template <typename T>
__device__ bool center_row(const T* x, index_t r, index_t run, int lane, float* centered, float* offsets,
                           float* scales) {
  const T* row = x + r * run;
  const float first = load_float(row, 0);
  bool same = true;
  for (index_t i = lane; i < run; i += kWarp) same = same && load_float(row, i) == first;
  const bool constant = __all_sync(kAll, same) != 0 && groupquant::is_finite(first);
  const double sum = fold(lane_sum(row, run, lane));
  const float offset = rowcenter::offset_of(constant, first, rowcenter::mean_of(sum, run));
  if (lane == 0) offsets[r] = offset;
  float* out = centered + r * run;
  std::uint32_t big = 0;
  for (index_t i = lane; i < run; i += kWarp) {
    const float c = __fsub_rn(load_float(row, i), offset);
    out[i] = c;
    const std::uint32_t b = groupquant::float_bits(c) & 0x7FFFFFFFu;
    big = b < 0x7F800000u && b > big ? b : big;
  }
  if (scales != nullptr) {
    const float scale = rowcenter::scale_of(groupquant::bits_float(warp_max(big)));
    if (lane == 0) scales[r] = scale;
    __syncwarp();
    for (index_t i = lane; i < run; i += kWarp) out[i] = __fdiv_rn(out[i], scale);
  }
  return constant;
}

template <typename T>
__global__ void center_kernel(const T* __restrict__ x, index_t rows, index_t run, float* __restrict__ centered,
                              float* __restrict__ offsets, std::uint8_t* __restrict__ constant,
                              float* __restrict__ scales) {
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  const index_t bytes = ceil_div(rows, kRowsPerWarp);
  for (index_t j = grid_start() / kWarp; j < bytes; j += grid_stride() / kWarp) {  // warp-uniform
    unsigned flags = 0;
    for (int k = 0; k < kRowsPerWarp && j * kRowsPerWarp + k < rows; ++k) {
      if (center_row(x, j * kRowsPerWarp + k, run, lane, centered, offsets, scales)) flags |= 1u << k;
    }
    if (lane == 0) constant[j] = static_cast<std::uint8_t>(flags);
  }
}

// v of element i of a row: decoded (times its scale), 0 on a constant row.
__device__ __forceinline__ float restored(const float* d, index_t i, bool constant, const float* scales, index_t r) {
  if (constant) return 0.0f;
  return scales != nullptr ? __fmul_rn(d[i], scales[r]) : d[i];
}

template <typename T>
__global__ void uncenter_kernel(const float* __restrict__ decoded, const float* __restrict__ offsets,
                                const std::uint8_t* __restrict__ constant, const float* __restrict__ scales,
                                index_t rows, index_t run, T* __restrict__ out) {
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  for (index_t r = grid_start() / kWarp; r < rows; r += grid_stride() / kWarp) {  // warp-uniform
    const bool flat = ((constant[r / 8] >> (r % 8)) & 1u) != 0;
    const float* d = decoded + r * run;
    double s = 0.0;
    if (lane < rowcenter::kSumLanes) {
      for (index_t i = lane; i < run; i += rowcenter::kSumLanes) {
        s = __dadd_rn(s, static_cast<double>(restored(d, i, flat, scales, r)));
      }
    }
    const float drift = rowcenter::drift_of(rowcenter::mean_of(fold(s), run));
    const float delta = __fsub_rn(offsets[r], drift);
    for (index_t i = lane; i < run; i += kWarp) {
      store_float(out, r * run + i, __fadd_rn(restored(d, i, flat, scales, r), delta));
    }
  }
}

template <typename T>
cudaError_t center(const void* x, index_t rows, index_t run, float* centered, float* offsets,
                   std::uint8_t* constant, float* scales, cudaStream_t stream) {
  const index_t warps = ceil_div(rows, kRowsPerWarp);
  center_kernel<T><<<grid_for(warps * kWarp), kThreads, 0, stream>>>(static_cast<const T*>(x), rows, run, centered,
                                                                      offsets, constant, scales);
  return cudaGetLastError();
}

template <typename T>
cudaError_t uncenter(const float* decoded, const float* offsets, const std::uint8_t* constant, const float* scales,
                     index_t rows, index_t run, void* out, cudaStream_t stream) {
  uncenter_kernel<T><<<grid_for(rows * kWarp), kThreads, 0, stream>>>(decoded, offsets, constant, scales, rows, run,
                                                                       static_cast<T*>(out));
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_row_center(const void* x, groupquant::FloatKind kind, index_t rows, index_t run, float* centered,
                              float* offsets, std::uint8_t* constant, float* scales, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (run <= 0) return cudaErrorInvalidValue;
  switch (kind) {
    case groupquant::FloatKind::kFloat32:
      return center<float>(x, rows, run, centered, offsets, constant, scales, stream);
    case groupquant::FloatKind::kFloat16:
      return center<__half>(x, rows, run, centered, offsets, constant, scales, stream);
    case groupquant::FloatKind::kBFloat16:
      return center<__nv_bfloat16>(x, rows, run, centered, offsets, constant, scales, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_row_uncenter(const float* decoded, const float* offsets, const std::uint8_t* constant,
                                const float* scales, index_t rows, index_t run, groupquant::FloatKind kind, void* out,
                                cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (run <= 0) return cudaErrorInvalidValue;
  switch (kind) {
    case groupquant::FloatKind::kFloat32:
      return uncenter<float>(decoded, offsets, constant, scales, rows, run, out, stream);
    case groupquant::FloatKind::kFloat16:
      return uncenter<__half>(decoded, offsets, constant, scales, rows, run, out, stream);
    case groupquant::FloatKind::kBFloat16:
      return uncenter<__nv_bfloat16>(decoded, offsets, constant, scales, rows, run, out, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace cuda
}  // namespace torchstash
