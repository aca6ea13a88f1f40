// memsave's 2-d max pool on contiguous float32 planes (maxpool.h): the pool and its
// positions' codes in one pass, where ATen writes int64 indices that are then coded in
// several more; its backward scatters the gradient from the codes. One OpenMP task per
// run of planes; the codes are written a byte per output and packed at the end (a plane's
// codes need not start on a byte). window_code and window_indices code a stock pool's
// int64 indices so, with the check that each position gives its index back, and back.
#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "clones.h"
#include "torchstash/bitpack.h"
#include "torchstash/cpu_kernels.h"
#include "torchstash/maxpool.h"

namespace torchstash {
namespace cpu {
namespace {

using maxpool::Geometry;

// The code of a window's argmax at `offset` from its first element (clamped into the table,
// as the reference clamps it).
inline std::uint8_t code_at(const std::uint8_t* table, index_t table_size, index_t offset) {
  return table[std::min(std::max<index_t>(offset, 0), table_size - 1)];
}

// A task's scratch: the input plane inside a border of -inf (a window's element outside the
// plane is never taken, as ATen never visits it), one window element's samples for every
// output of the plane, the running maxima and their offsets, and each output's first offset.
struct PlaneScratch {
  index_t rows, cols;  // the padded plane
  std::vector<float> padded, samples, top;
  std::vector<std::int32_t> best, first;

  explicit PlaneScratch(const Geometry& g)
      : rows(std::max(g.pH + g.H, (g.OH - 1) * g.sH + (g.kH - 1) * g.dH + 1)),
        cols(std::max(g.pW + g.W, (g.OW - 1) * g.sW + (g.kW - 1) * g.dW + 1)),
        padded(static_cast<std::size_t>(rows * cols), -std::numeric_limits<float>::infinity()),
        samples(static_cast<std::size_t>(g.OH * g.OW)),
        top(static_cast<std::size_t>(g.OH * g.OW)),
        best(static_cast<std::size_t>(g.OH * g.OW)),
        first(static_cast<std::size_t>(g.OH * g.OW)) {
    for (index_t oh = 0; oh < g.OH; ++oh) {  // ATen's first index: the first row and column inside
      const index_t h0 = oh * g.sH - g.pH;
      for (index_t ow = 0; ow < g.OW; ++ow) {
        const index_t w0 = ow * g.sW - g.pW;
        first[oh * g.OW + ow] = static_cast<std::int32_t>((maxpool::first_inside(h0, g.dH) - h0) * g.W +
                                                          maxpool::first_inside(w0, g.dW) - w0);
      }
    }
  }
};

// top[k], best[k] <- s[k], offset where s[k] is above top[k] or NaN, for k < n: one window
// element of n outputs side by side (an output scanned element by element waits on each
// compare: ATen's loop, 29 ns an output of a 3x3 window).
TS_CPU_CLONES void take_larger(const float* __restrict s, index_t n, std::int32_t offset, float* __restrict top,
                               std::int32_t* __restrict best) {
  for (index_t k = 0; k < n; ++k) {
    const bool take = (s[k] > top[k]) | (s[k] != s[k]);
    top[k] = take ? s[k] : top[k];
    best[k] = take ? offset : best[k];
  }
}

// Plane p's outputs and their codes (one byte each): for each element of the window in ATen's
// order (its rows, then its columns), every output's sample of it taken where larger.
void pool_plane(const float* in, const Geometry& g, const std::uint8_t* table, index_t table_size, float* out,
                std::uint8_t* codes, PlaneScratch& r) {
  const index_t n = g.OH * g.OW;
  for (index_t ih = 0; ih < g.H; ++ih) {
    std::memcpy(r.padded.data() + (g.pH + ih) * r.cols + g.pW, in + ih * g.W,
                static_cast<std::size_t>(g.W) * sizeof(float));
  }
  std::fill(r.top.begin(), r.top.end(), -std::numeric_limits<float>::infinity());
  std::copy(r.first.begin(), r.first.end(), r.best.begin());
  float* samples = r.samples.data();
  for (index_t i = 0; i < g.kH; ++i) {
    for (index_t j = 0; j < g.kW; ++j) {
      const float* from = r.padded.data() + i * g.dH * r.cols + j * g.dW;
      for (index_t oh = 0; oh < g.OH; ++oh) {
        const float* row = from + oh * g.sH * r.cols;
        float* to = samples + oh * g.OW;
        for (index_t ow = 0; ow < g.OW; ++ow) to[ow] = row[ow * g.sW];
      }
      take_larger(samples, n, static_cast<std::int32_t>(i * g.dH * g.W + j * g.dW), r.top.data(), r.best.data());
    }
  }
  std::memcpy(out, r.top.data(), static_cast<std::size_t>(n) * sizeof(float));
  for (index_t k = 0; k < n; ++k) codes[k] = code_at(table, table_size, r.best[k]);
}

// Each code's offset from its window's first element, (code / kW) * dH * W + (code % kW) * dW;
// a code past the window's positions gets one that points outside every plane.
std::vector<index_t> code_offsets(const Geometry& g) {
  std::vector<index_t> offsets(256, -(index_t{1} << 62));
  for (index_t code = 0; code < std::min<index_t>(256, g.kH * g.kW); ++code) {
    offsets[static_cast<std::size_t>(code)] = (code / g.kW) * g.dH * g.W + (code % g.kW) * g.dW;
  }
  return offsets;
}

// Plane p's input gradient from its outputs' gradient and codes, added in output order from
// zero; false when a code's index falls outside the plane (where a window is wider than the
// plane two positions share an offset, and the one the table coded may step past its row's
// end: the flat index is what counts).
bool scatter_plane(const float* grad, const std::uint8_t* codes, const Geometry& g, const index_t* offsets,
                   float* gx) {
  std::memset(gx, 0, static_cast<std::size_t>(g.H * g.W) * sizeof(float));
  bool ok = true;
  const index_t plane = g.H * g.W;
  for (index_t oh = 0; oh < g.OH; ++oh) {
    const index_t h0 = oh * g.sH - g.pH;
    for (index_t ow = 0; ow < g.OW; ++ow) {
      const index_t o = oh * g.OW + ow;
      const index_t index = h0 * g.W + ow * g.sW - g.pW + offsets[codes[o]];
      if (index < 0 || index >= plane) {
        ok = false;
        continue;
      }
      gx[index] += grad[o];
    }
  }
  return ok;
}

// An index `first + offset` as the reference computes it: in int32 arithmetic (wrapping, as
// torch's int32 ops do) where the plane has fewer than 2^31 elements, else in int64.
inline index_t index_at(index_t first, index_t offset, bool narrow) {
  if (!narrow) return first + offset;
  return static_cast<std::int32_t>(static_cast<std::uint32_t>(first) + static_cast<std::uint32_t>(offset));
}

// An index's offset from its window's first element, as the reference computes it (see index_at).
inline index_t offset_of(std::int64_t index, index_t first, bool narrow) {
  if (!narrow) return index - first;
  return static_cast<std::int32_t>(static_cast<std::uint32_t>(index) - static_cast<std::uint32_t>(first));
}

}  // namespace

void max_pool2d_code(const float* x, index_t planes, const Geometry& g, const std::uint8_t* table,
                     index_t table_size, int bits, float* out, std::uint8_t* packed, int num_threads) {
  const index_t per = g.OH * g.OW;
  std::vector<std::uint8_t> codes(static_cast<std::size_t>(planes * per));
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && planes > 1)
  {
    PlaneScratch scratch(g);
#pragma omp for schedule(static)
    for (index_t p = 0; p < planes; ++p) {
      pool_plane(x + p * g.H * g.W, g, table, table_size, out + p * per, codes.data() + p * per, scratch);
    }
  }
  pack_bits(codes.data(), planes * per, bits, packed, num_threads);
}

bool max_pool2d_code_backward(const float* grad, const std::uint8_t* packed, index_t planes, const Geometry& g,
                              int bits, float* gx, int num_threads) {
  const index_t per = g.OH * g.OW;
  std::vector<std::uint8_t> codes(static_cast<std::size_t>(planes * per));
  unpack_bits(packed, planes * per, bits, codes.data(), num_threads);
  const std::vector<index_t> offsets = code_offsets(g);
  bool ok = true;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && planes > 1) reduction(&& : ok)
  for (index_t p = 0; p < planes; ++p) {
    ok = scatter_plane(grad + p * per, codes.data() + p * per, g, offsets.data(), gx + p * g.H * g.W) && ok;
  }
  return ok;
}

bool window_code(const std::int64_t* indices, index_t planes, const Geometry& g, const std::uint8_t* table,
                 index_t table_size, int bits, std::uint8_t* packed, int num_threads) {
  const index_t per = g.OH * g.OW;
  const bool narrow = g.H * g.W < (index_t{1} << 31);
  const std::vector<index_t> offsets = code_offsets(g);
  std::vector<std::uint8_t> codes(static_cast<std::size_t>(planes * per));
  bool exact = true;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && planes > 1) reduction(&& : exact)
  for (index_t p = 0; p < planes; ++p) {
    unsigned misses = 0;  // counted without branches: which index misreads is data
    for (index_t oh = 0; oh < g.OH; ++oh) {
      const index_t row_first = (oh * g.sH - g.pH) * g.W - g.pW;
      const std::int64_t* in = indices + p * per + oh * g.OW;
      std::uint8_t* out = codes.data() + p * per + oh * g.OW;
      for (index_t ow = 0; ow < g.OW; ++ow) {
        const index_t first = row_first + ow * g.sW;
        const std::uint8_t code = code_at(table, table_size, offset_of(in[ow], first, narrow));
        out[ow] = code;  // a table's code is always one of the window's positions
        misses |= static_cast<unsigned>(index_at(first, offsets[code], narrow) != in[ow]);
      }
    }
    exact = exact && misses == 0;
  }
  pack_bits(codes.data(), planes * per, bits, packed, num_threads);
  return exact;
}

bool window_indices(const std::uint8_t* packed, index_t planes, const Geometry& g, int bits, std::int64_t* indices,
                    int num_threads) {
  const index_t per = g.OH * g.OW;
  const bool narrow = g.H * g.W < (index_t{1} << 31);
  const std::vector<index_t> offsets = code_offsets(g);
  std::vector<std::uint8_t> codes(static_cast<std::size_t>(planes * per));
  unpack_bits(packed, planes * per, bits, codes.data(), num_threads);
  bool ok = true;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && planes > 1) reduction(&& : ok)
  for (index_t p = 0; p < planes; ++p) {
    bool plane_ok = true;
    for (index_t oh = 0; oh < g.OH; ++oh) {
      for (index_t ow = 0; ow < g.OW; ++ow) {
        const index_t o = p * per + oh * g.OW + ow;
        const index_t first = (oh * g.sH - g.pH) * g.W + ow * g.sW - g.pW;
        const std::uint8_t code = codes[static_cast<std::size_t>(o)];
        plane_ok = plane_ok && code < g.kH * g.kW;
        indices[o] = index_at(first, code < g.kH * g.kW ? offsets[code] : 0, narrow);
      }
    }
    ok = ok && plane_ok;
  }
  return ok;
}

}  // namespace cpu
}  // namespace torchstash
