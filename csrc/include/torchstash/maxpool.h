// A 2-d max pool whose argmax is kept as its position in the window (memsave's MaxPool):
// the geometry and the arithmetic shared by the CPU loops (csrc/cpu/maxpool_cpu.cpp) and
// the bindings' shape checks.
//
// The bit-exact definition is torchstash.kernels.maxpool_reference (csrc/README.md repeats
// it). Output sizes are ATen's pooling_output_shape; each output scans its window row-major
// over the rows and columns inside the plane, taking a value when it is above the current
// maximum (from -inf) or NaN, so the first largest value wins and the last NaN: ATen's CPU
// kernel for contiguous planes. The argmax's offset from the window's (unclipped) first
// element, i * dilation_h * W + j * dilation_w, is coded through the caller's table (offset ->
// position, as torchstash.windows builds it) and packed at `bits` bits in the outputs' flat
// order.
#pragma once

#include <cstdint>

#include "torchstash/common.h"

namespace torchstash {
namespace maxpool {

struct Geometry {
  index_t H, W;    // input plane
  index_t OH, OW;  // output plane
  index_t kH, kW, sH, sW, pH, pW, dH, dW;
};

// floor(a / b) for b > 0.
TS_HD index_t floor_div(index_t a, index_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// ATen's pooling_output_shape: the number of windows along one dimension.
TS_HD index_t output_size(index_t in, index_t k, index_t pad, index_t stride, index_t dilation, bool ceil_mode) {
  const index_t num = in + 2 * pad - dilation * (k - 1) - 1 + (ceil_mode ? stride - 1 : 0);
  index_t out = floor_div(num, stride) + 1;
  if (ceil_mode && (out - 1) * stride >= in + pad) --out;
  return out;
}

// The first index at or after `start` on the lattice start + m * step that is >= 0.
TS_HD index_t first_inside(index_t start, index_t step) {
  return start >= 0 ? start : start + ((-start + step - 1) / step) * step;
}

}  // namespace maxpool
}  // namespace torchstash
