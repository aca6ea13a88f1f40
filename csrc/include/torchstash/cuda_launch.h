// Launchers for the CUDA kernels in csrc/cuda/*.cu, called by csrc/bindings/ops_cuda.cpp.
//
// Raw pointers and a stream only, no torch headers: `nvcc -c` compiles the .cu
// files on machines without a CUDA build of torch. Each launcher returns the
// launch status (cudaGetLastError) for the caller to check; n == 0 launches nothing.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "torchstash/channelquant.h"
#include "torchstash/common.h"
#include "torchstash/groupquant.h"
#include "torchstash/signs.h"
#include "torchstash/sparse.h"

namespace torchstash {
namespace cuda {

// out[0, ceil(n * bits / 8)) <- codes[0, n) packed at `bits` bits (1, 2, 4 or 8).
cudaError_t launch_pack_bits(const std::uint8_t* codes, index_t n, int bits, std::uint8_t* out,
                             cudaStream_t stream);

// out[0, n) <- the first n codes of `packed` at `bits` bits.
cudaError_t launch_unpack_bits(const std::uint8_t* packed, index_t n, int bits, std::uint8_t* out,
                               cudaStream_t stream);

// out[0, n) <- Philox4x32-10 uniforms in [0, 1) for (seed, offset); see philox.h.
cudaError_t launch_philox_uniform(float* out, index_t n, std::uint64_t seed, std::uint64_t offset,
                                  cudaStream_t stream);

// Fused per-group quantization of x[0, n) (float32, __half or __nv_bfloat16, per `kind`):
// packed[0, ceil(n * bits / 8)) <- the codes, lo/step[0, ceil(n / group_size)) <- the
// bfloat16 bit patterns of each group's lo and signed step; see groupquant.h. `seed_at`, when
// given, is a device int64 the kernel reads the seed's 64 bits from (a compiled graph's seed).
cudaError_t launch_group_quantize(const void* x, groupquant::FloatKind kind, index_t n, int bits,
                                  index_t group_size, std::uint64_t seed, bool stochastic, std::uint8_t* packed,
                                  std::uint16_t* lo, std::uint16_t* step, cudaStream_t stream,
                                  const std::int64_t* seed_at = nullptr);

// out[0, n) (float32, __half or __nv_bfloat16 per `kind`) <- the values group_quantize encoded.
cudaError_t launch_group_dequantize(const std::uint8_t* packed, const std::uint16_t* lo, const std::uint16_t* step,
                                    int bits, index_t group_size, index_t n, groupquant::FloatKind kind, void* out,
                                    cudaStream_t stream);

// Rows of `run` elements centered on their offset (rowcenter.h): centered[0, rows * run)
// (float32), offsets[0, rows), constant[0, ceil(rows / 8)) (packed bits) and, unless nullptr,
// scales[0, rows) of x (float32, __half or __nv_bfloat16 per `kind`).
cudaError_t launch_row_center(const void* x, groupquant::FloatKind kind, index_t rows, index_t run, float* centered,
                              float* offsets, std::uint8_t* constant, float* scales, cudaStream_t stream);

// out[0, rows * run) (per `kind`) <- the rows row_center centered, from their decoded values.
cudaError_t launch_row_uncenter(const float* decoded, const float* offsets, const std::uint8_t* constant,
                                const float* scales, index_t rows, index_t run, groupquant::FloatKind kind, void* out,
                                cudaStream_t stream);

// e4m3 codes with a per-group scale (fp8.h): codes[0, ceil(n / group_size) * group_size) and
// scale[0, ceil(n / group_size)) (bfloat16 bits) of x[0, n).
cudaError_t launch_fp8_quantize(const void* x, groupquant::FloatKind kind, index_t n, index_t group_size,
                                std::uint8_t* codes, std::uint16_t* scale, cudaStream_t stream);

// out[0, n) (per `kind`) <- the values of codes[0, n).
cudaError_t launch_fp8_dequantize(const std::uint8_t* codes, const std::uint16_t* scale, index_t n,
                                  index_t group_size, groupquant::FloatKind kind, void* out, cudaStream_t stream);

// out[0, ceil(n * bits / 8)) <- the packed codes of x[0, n) rounded stochastically to
// levels[0, nlevels) (ascending) with Philox uniforms of (seed, 0); NaN gets the top code
// (level_quantize_ref is the definition).
cudaError_t launch_level_quantize(const void* x, groupquant::FloatKind kind, index_t n, const float* levels,
                                  int nlevels, int bits, std::uint64_t seed, std::uint8_t* out, cudaStream_t stream);

// out[0, ceil(n / 8)) <- 1 bits where x[k] is above zero or NaN (signs.h).
cudaError_t launch_sign_pack(const void* x, SignKind kind, index_t n, std::uint8_t* out, cudaStream_t stream);

// out[0, n) (of `kind`) <- 1.0 where the bit is set, else 0.0.
cudaError_t launch_sign_unpack(const std::uint8_t* packed, index_t n, SignKind kind, void* out,
                               cudaStream_t stream);

// Channel-wise 8-bit layout (channelquant.h): element i of x[0, n) belongs to channel
// (i / inner) % channels; n is a multiple of inner * channels.
// mn, mx[0, channels) <- min and max over each channel's finite elements (+inf, -inf when it
// has none; -0.0 as +0.0). Writes them for n == 0 too.
cudaError_t launch_channel_minmax(const void* x, groupquant::FloatKind kind, index_t n, index_t inner,
                                  index_t channels, float* mn, float* mx, cudaStream_t stream);

// codes[0, n) <- the 8-bit codes of x[0, n) with each channel's float32 lo and step.
cudaError_t launch_channel_quantize(const void* x, groupquant::FloatKind kind, index_t n, index_t inner,
                                    index_t channels, const float* lo, const float* step, std::uint64_t seed,
                                    bool stochastic, std::uint8_t* codes, cudaStream_t stream);

// out[0, n) (float32, __half or __nv_bfloat16 per `kind`) <- the values of codes[0, n).
cudaError_t launch_channel_dequantize(const std::uint8_t* codes, index_t n, index_t inner, index_t channels,
                                      const float* lo, const float* step, groupquant::FloatKind kind, void* out,
                                      cudaStream_t stream);

// Top-k by magnitude and sparse storage (sparse.h). `workspace` is device memory the caller
// allocates (its size below); nothing is synchronised with the host, so the set-bit counts
// are not checked: slots the mask leaves empty are zero, set bits past them are dropped.
// out[0, ceil(n / 8)) <- the packed mask of the k greatest keys of each of `segments`
// equal segments of x[0, n); workspace: sparse::topk_plan(n, segments).bytes.
cudaError_t launch_topk_mask(const void* x, sparse::KeyKind kind, index_t n, index_t segments, index_t k,
                             std::uint8_t* out, void* workspace, cudaStream_t stream);

// out[0, kept) <- the elements (word_bytes each) of x[0, n) at the mask's set bits, flat order;
// workspace: sparse::compact_workspace(n, sparse::kMaskChunkBytes).
cudaError_t launch_mask_compact(const void* x, int word_bytes, const std::uint8_t* mask, index_t n, index_t kept,
                                void* out, void* workspace, cudaStream_t stream);

// out[0, n) <- values[0, nvalues) at the mask's set bits (flat order), zero elsewhere;
// workspace: sparse::compact_workspace(n, sparse::kMaskChunkBytes).
cudaError_t launch_mask_scatter(const std::uint8_t* mask, const void* values, int word_bytes, index_t nvalues,
                                index_t n, void* out, void* workspace, cudaStream_t stream);

// counts[0, ceil(n / kOffsetBlock)) <- set bits per block, offsets[0, kept) <- their positions
// inside their blocks; workspace: sparse::compact_workspace(n, sparse::kOffsetBlock / 8).
cudaError_t launch_mask_offsets(const std::uint8_t* mask, index_t n, index_t kept, std::uint16_t* offsets,
                                std::int32_t* counts, void* workspace, cudaStream_t stream);

// out[0, n) <- values at the positions the offsets and block counts give, zero elsewhere
// (positions past n and offsets past noffsets ignored); workspace:
// sparse::offsets_scatter_workspace(n).
cudaError_t launch_offsets_scatter(const std::uint16_t* offsets, index_t noffsets, const std::int32_t* counts,
                                   const void* values, int word_bytes, index_t n, void* out, void* workspace,
                                   cudaStream_t stream);

}  // namespace cuda
}  // namespace torchstash
