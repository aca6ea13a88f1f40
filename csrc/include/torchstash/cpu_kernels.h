// Raw-pointer CPU loops (csrc/cpu/*.cpp), called by csrc/bindings/ops.cpp.
//
// Torch-free on purpose: the loops compile in about a second, and only the
// bindings translation unit pays for the ATen headers.
#pragma once

#include <cstdint>

#include "torchstash/channelquant.h"
#include "torchstash/common.h"
#include "torchstash/groupquant.h"
#include "torchstash/maxpool.h"
#include "torchstash/signs.h"
#include "torchstash/sparse.h"

namespace torchstash {
namespace cpu {

// out[0, ceil(n * bits / 8)) <- codes[0, n) packed at `bits` bits (1, 2, 4 or 8).
void pack_bits(const std::uint8_t* codes, index_t n, int bits, std::uint8_t* out, int num_threads);

// out[0, n) <- the first n codes of `packed` at `bits` bits.
void unpack_bits(const std::uint8_t* packed, index_t n, int bits, std::uint8_t* out, int num_threads);

// out[0, n) <- Philox4x32-10 uniforms in [0, 1) for (seed, offset); see philox.h.
void philox_uniform(float* out, index_t n, std::uint64_t seed, std::uint64_t offset, int num_threads);

// Fused per-group quantization of x[0, n) (float32, float16 or bfloat16 bits, per `kind`):
// packed[0, ceil(n * bits / 8)) <- the codes, lo/step[0, ceil(n / group_size)) <- the
// bfloat16 bit patterns of each group's lo and signed step; see groupquant.h.
void group_quantize(const void* x, groupquant::FloatKind kind, index_t n, int bits, index_t group_size,
                    std::uint64_t seed, bool stochastic, std::uint8_t* packed, std::uint16_t* lo,
                    std::uint16_t* step, int num_threads);

// out[0, ceil(n * bits / 8)) <- x[0, n) (float32, float16 or bfloat16 bits, per `kind`)
// rounded stochastically to levels[0, nlevels) (float32, ascending, 2 <= nlevels < 2**bits) and
// packed at `bits` bits, NaN as code 2**bits - 1; see levelquant_cpu.cpp.
void level_quantize(const void* x, groupquant::FloatKind kind, index_t n, const float* levels, int nlevels, int bits,
                    std::uint64_t seed, std::uint8_t* out, int num_threads);

// out[0, n) (float32, float16 or bfloat16 per `kind`) <- the values group_quantize encoded.
void group_dequantize(const std::uint8_t* packed, const std::uint16_t* lo, const std::uint16_t* step, int bits,
                      index_t group_size, index_t n, groupquant::FloatKind kind, void* out, int num_threads);

// Rows of `run` elements centered on their offset (rowcenter.h): x[0, rows * run) (float32,
// float16 or bfloat16 bits, per `kind`) -> centered[0, rows * run) (float32), offsets[0, rows),
// constant[0, ceil(rows / 8)) (packed bits) and, unless `scales` is nullptr, scales[0, rows)
// (the centered rows divided by them).
void row_center(const void* x, groupquant::FloatKind kind, index_t rows, index_t run, float* centered,
                float* offsets, std::uint8_t* constant, float* scales, int num_threads);

// row_center's offsets and constant flags alone (no centered values written).
void row_offsets(const void* x, groupquant::FloatKind kind, index_t rows, index_t run, float* offsets,
                 std::uint8_t* constant, int num_threads);

// group_quantize of row_center's centered values (no scales), without writing them: the rows'
// offsets and constant flags first, then the codes of x minus its row's offset.
void row_group_quantize(const void* x, groupquant::FloatKind kind, index_t n, index_t run, int bits,
                        index_t group_size, std::uint64_t seed, bool stochastic, std::uint8_t* packed,
                        std::uint16_t* lo, std::uint16_t* step, float* offsets, std::uint8_t* constant,
                        int num_threads);

// row_uncenter of group_dequantize's float32 values, without writing them: each row decoded
// twice (its lane sums, then the output).
void row_group_dequantize(const std::uint8_t* packed, const std::uint16_t* lo, const std::uint16_t* step, int bits,
                          index_t group_size, index_t n, index_t run, const float* offsets,
                          const std::uint8_t* constant, groupquant::FloatKind kind, void* out, int num_threads);

// out[0, rows * run) (float32, float16 or bfloat16 per `kind`) <- the rows row_center centered,
// from their decoded values (float32) and what it returned (scales nullptr: not scaled).
void row_uncenter(const float* decoded, const float* offsets, const std::uint8_t* constant, const float* scales,
                  index_t rows, index_t run, groupquant::FloatKind kind, void* out, int num_threads);

// e4m3 codes with a per-group scale (fp8.h): codes[0, ceil(n / group_size) * group_size) (the
// last group's padding coded as 0) and scale[0, ceil(n / group_size)) (bfloat16 bits) of
// x[0, n) (float32, float16 or bfloat16 bits per `kind`).
void fp8_quantize(const void* x, groupquant::FloatKind kind, index_t n, index_t group_size, std::uint8_t* codes,
                  std::uint16_t* scale, int num_threads);

// out[0, n) (float32, float16 or bfloat16 per `kind`) <- the values of codes[0, n).
void fp8_dequantize(const std::uint8_t* codes, const std::uint16_t* scale, index_t n, index_t group_size,
                    groupquant::FloatKind kind, void* out, int num_threads);

// out[0, ceil(n / 8)) <- 1 bits where x[k] is above zero or NaN (signs.h), for x[0, n) of `kind`.
void sign_pack(const void* x, SignKind kind, index_t n, std::uint8_t* out, int num_threads);

// out[0, n) (of `kind`) <- 1.0 where the bit of packed is set, else 0.0.
void sign_unpack(const std::uint8_t* packed, index_t n, SignKind kind, void* out, int num_threads);

// out[0, n) (of `kind`) <- grad[k] where bit k of packed is set, else 0 (+0.0): a ReLU's
// threshold_backward from its sign bits, in one pass.
void sign_select(const std::uint8_t* packed, const void* grad, index_t n, SignKind kind, void* out, int num_threads);

// memsave's 2-d max pool (maxpool.h) over `planes` contiguous float32 planes of g.H x g.W:
// out[0, planes * g.OH * g.OW) <- the maxima, packed[0, ceil(that * bits / 8)) <- each
// argmax's position, table[offset from the window's first element] (table_size entries).
void max_pool2d_code(const float* x, index_t planes, const maxpool::Geometry& g, const std::uint8_t* table,
                     index_t table_size, int bits, float* out, std::uint8_t* packed, int num_threads);

// Its backward: gx[0, planes * g.H * g.W) <- the gradient of each output added at its code's
// position (in output order, from zero), as ATen's max_pool2d_with_indices_backward adds it
// at the index. Returns false when a code is not a position inside the plane.
bool max_pool2d_code_backward(const float* grad, const std::uint8_t* packed, index_t planes,
                              const maxpool::Geometry& g, int bits, float* gx, int num_threads);

// A stock pool's int64 indices[0, planes * g.OH * g.OW) (flat in planes of g.H x g.W) as their
// positions in their windows, table[offset from the window's first element], packed at
// `bits`: torchstash.windows.encode_positions and pack_bits, in its int32 arithmetic where a
// plane has fewer than 2^31 elements. Returns whether every position gives its index back.
bool window_code(const std::int64_t* indices, index_t planes, const maxpool::Geometry& g, const std::uint8_t* table,
                 index_t table_size, int bits, std::uint8_t* packed, int num_threads);

// The indices back from window_code's positions (decode_positions); false when a code is past
// the window's positions.
bool window_indices(const std::uint8_t* packed, index_t planes, const maxpool::Geometry& g, int bits,
                    std::int64_t* indices, int num_threads);

// Channel-wise 8-bit layout (channelquant.h): element i of x[0, n) belongs to channel
// (i / inner) % channels; n is a multiple of inner * channels.
// mn, mx[0, channels) <- min and max over each channel's finite elements (+inf, -inf when it
// has none; -0.0 as +0.0). Writes them for n == 0 too.
void channel_minmax(const void* x, groupquant::FloatKind kind, index_t n, index_t inner, index_t channels, float* mn,
                    float* mx, int num_threads);

// codes[0, n) <- the 8-bit codes of x[0, n) with each channel's float32 lo and step.
void channel_quantize(const void* x, groupquant::FloatKind kind, index_t n, index_t inner, index_t channels,
                      const float* lo, const float* step, std::uint64_t seed, bool stochastic, std::uint8_t* codes,
                      int num_threads);

// quant.mesa's running range, on the channels' mn, mx[0, channels) from channel_minmax: channel c
// is in group c * groups / channels, whose observed min and max are its channels' (+inf, -inf
// when none is finite), seen when min <= max. run[0, 2 * groups) <- (lo row, hi row): decay *
// prev + rest * observed where seen, else prev (prev null: observed where seen, else 0);
// lo[g] <- minimum(run lo, observed min), step[g] <- max(maximum(run hi, observed max) - lo, 0)
// / 252, NaN propagating, as torch.minimum, maximum and clamp_min compute them.
void mesa_range(const float* mn, const float* mx, index_t channels, index_t groups, const float* prev, float decay,
                float rest, float* lo, float* step, float* run);

// out[0, n) (float32, float16 or bfloat16 per `kind`) <- the values of codes[0, n).
void channel_dequantize(const std::uint8_t* codes, index_t n, index_t inner, index_t channels, const float* lo,
                        const float* step, groupquant::FloatKind kind, void* out, int num_threads);

// Top-k by magnitude and sparse storage (sparse.h); x is float32, float16 or bfloat16 bits.
// out[0, ceil(n / 8)) <- the packed mask of the k greatest keys of each of `segments` equal
// segments of x[0, n) (n a multiple of segments, k <= n / segments).
void topk_mask(const void* x, sparse::KeyKind kind, index_t n, index_t segments, index_t k, std::uint8_t* out,
               int num_threads);

// The mask's set bits among n elements, counted; when they are `kept`, out[0, kept) <- the
// elements (of word_bytes bytes each) of x at the set bits, in flat order. Returns the count.
index_t mask_compact(const void* x, int word_bytes, const std::uint8_t* mask, index_t n, index_t kept, void* out,
                     int num_threads);

// The mask's set bits counted; when they are `nvalues`, out[0, n) <- values at the set bits
// (flat order), zero elsewhere. Returns the count.
index_t mask_scatter(const std::uint8_t* mask, const void* values, int word_bytes, index_t nvalues, index_t n,
                     void* out, int num_threads);

// counts[0, ceil(n / kOffsetBlock)) <- set bits per block; when they sum to `kept`,
// offsets[0, kept) <- their positions inside their blocks (flat order). Returns the sum.
index_t mask_offsets(const std::uint8_t* mask, index_t n, index_t kept, std::uint16_t* offsets, std::int32_t* counts,
                     int num_threads);

// out[0, n) <- values at the positions the offsets and block counts give, zero elsewhere.
// Returns 0, or without writing: -1 when the counts are negative or do not sum to
// noffsets, -2 when an offset of the last block reaches past n.
index_t offsets_scatter(const std::uint16_t* offsets, index_t noffsets, const std::int32_t* counts,
                        const void* values, int word_bytes, index_t n, void* out, int num_threads);

}  // namespace cpu
}  // namespace torchstash
