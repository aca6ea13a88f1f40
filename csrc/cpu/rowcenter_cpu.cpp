// OpenMP loops over the inline rowcenter.h functions: rows centered on their offset (and
// scaled), and restored, int64 indices throughout.
//
// A task owns a run of whole rows, a multiple of 8 of them (each row's constant flag is one
// bit of the packed flags, so tasks never share a byte). A row is read in spans of kSpan
// elements (converted from 16 bits where needed): once for its float64 lane sums and
// whether it is constant, once to write the centered values; with scales, the written row
// is read once more for its largest finite magnitude and once to divide. Restoring reads
// the decoded row once for its sums and once to write the output. kSpan is a multiple of
// the 16 lanes, so spans keep every element in its lane. The leaf loops are compiled per
// instruction set (clones.h), on GCC vectors each clone lowers to its own registers.
#include <algorithm>
#include <cstring>

#include "clones.h"
#include "float_spans.h"
#include "row_lanes.h"
#include "simd.h"
#include "torchstash/cpu_kernels.h"
#include "torchstash/groupquant.h"
#include "torchstash/rowcenter.h"

namespace torchstash {
namespace cpu {
namespace {

using groupquant::FloatKind;
using rowcenter::kSumLanes;

constexpr index_t kTaskElems = index_t{1} << 16;

// out[k] <- x[k] - offset.
TS_CPU_CLONES void subtract(const float* x, index_t count, float offset, float* out) {
  for (index_t k = 0; k < count; ++k) out[k] = x[k] - offset;
}

// The largest finite |c[k]| merged into amax, N lanes at a time (simd.h: a 16-lane select
// ran lane by lane on AVX2).
TS_CPU_CLONES float max_finite_abs(const float* c, index_t count, float amax) {
  std::uint32_t m = groupquant::float_bits(amax);
  const index_t done = at_lanes([&](auto n) TS_LANES {
    constexpr int N = decltype(n)::value;
    UintV<N> big = {};
    index_t k = 0;
    for (; k + N <= count; k += N) {
      UintV<N> b;
      std::memcpy(&b, c + k, sizeof(b));
      b &= 0x7FFFFFFFu;
      b = b < 0x7F800000u ? b : 0u;  // finite magnitudes order like their bits
      big = b > big ? b : big;
    }
    for (int l = 0; l < N; ++l) m = big[l] > m ? big[l] : m;
    return k;
  });
  for (index_t k = done; k < count; ++k) {
    const std::uint32_t b = groupquant::float_bits(c[k]) & 0x7FFFFFFFu;
    m = b < 0x7F800000u && b > m ? b : m;
  }
  return groupquant::bits_float(m);
}

TS_CPU_CLONES void divide(float* c, index_t count, float scale) {
  for (index_t k = 0; k < count; ++k) c[k] = c[k] / scale;
}

// v[k] <- d[k] (* scale, when scaled) + delta, each step rounded.
TS_CPU_CLONES void restore_values(const float* d, index_t count, bool scaled, float scale, float delta, float* v) {
  if (scaled) {
    for (index_t k = 0; k < count; ++k) v[k] = d[k] * scale + delta;
  } else {
    for (index_t k = 0; k < count; ++k) v[k] = d[k] + delta;
  }
}

struct CenterArgs {
  const void* x;
  FloatKind kind;
  index_t rows;
  index_t run;
  float* centered;
  float* offsets;
  std::uint8_t* constant;  // packed bits, one per row
  float* scales;           // nullptr: no scaling
};

// Row r's offset and whether it is constant (pass 1).
float center_offset(const CenterArgs& a, index_t r, bool* constant, float* xbuf) {
  const index_t begin = r * a.run;
  double lanes[kSumLanes] = {};
  bool same = true;
  float first = 0.0f;
  for (index_t i = 0; i < a.run; i += kSpan) {
    const index_t m = std::min(kSpan, a.run - i);
    const float* x = load_floats(a.x, a.kind, begin + i, m, xbuf);
    if (i == 0) first = x[0];
    same = add_lanes(x, m, first, lanes) && same;
  }
  *constant = same && groupquant::is_finite(first);
  return rowcenter::offset_of(*constant, first, rowcenter::mean_of(rowcenter::fold_lanes(lanes), a.run));
}

// Row r's offset and constant bit written (the offset returned).
float write_offset(const CenterArgs& a, index_t r, float* xbuf) {
  bool constant = false;
  const float offset = center_offset(a, r, &constant, xbuf);
  a.offsets[r] = offset;
  if (constant) a.constant[r / 8] = static_cast<std::uint8_t>(a.constant[r / 8] | (1u << (r % 8)));
  return offset;
}

void center_row(const CenterArgs& a, index_t r, float* xbuf) {
  const float offset = write_offset(a, r, xbuf);
  float* out = a.centered + r * a.run;
  float amax = 0.0f;
  for (index_t i = 0; i < a.run; i += kSpan) {
    const index_t m = std::min(kSpan, a.run - i);
    subtract(load_floats(a.x, a.kind, r * a.run + i, m, xbuf), m, offset, out + i);
    if (a.scales != nullptr) amax = max_finite_abs(out + i, m, amax);
  }
  if (a.scales == nullptr) return;
  const float scale = rowcenter::scale_of(amax);
  a.scales[r] = scale;
  divide(out, a.run, scale);
}

struct RestoreArgs {
  const float* decoded;
  const float* offsets;
  const std::uint8_t* constant;
  const float* scales;  // nullptr: not scaled
  index_t run;
  FloatKind kind;
  void* out;
};

void restore_row(const RestoreArgs& a, index_t r, float* vbuf) {
  const bool constant = ((a.constant[r / 8] >> (r % 8)) & 1u) != 0;
  const bool scaled = a.scales != nullptr;
  const float scale = scaled ? a.scales[r] : 1.0f;
  const float* d = a.decoded + r * a.run;
  double lanes[kSumLanes] = {};
  for (index_t i = 0; i < a.run && !constant; i += kSpan) {  // a constant row's values are 0
    const index_t m = std::min(kSpan, a.run - i);
    if (scaled) {
      add_scaled_lanes(d + i, m, scale, lanes);
    } else {
      add_lanes(d + i, m, 0.0f, lanes);
    }
  }
  const float drift = rowcenter::drift_of(rowcenter::mean_of(rowcenter::fold_lanes(lanes), a.run));
  const float delta = a.offsets[r] - drift;
  for (index_t i = 0; i < a.run; i += kSpan) {
    const index_t m = std::min(kSpan, a.run - i);
    const index_t first = r * a.run + i;
    float* v = a.kind == FloatKind::kFloat32 ? static_cast<float*>(a.out) + first : vbuf;
    if (constant) {
      std::fill(v, v + m, 0.0f + delta);
    } else {
      restore_values(d + i, m, scaled, scale, delta, v);
    }
    if (a.kind != FloatKind::kFloat32) store_floats(a.out, a.kind, first, m, vbuf);
  }
}

// Rows per task: a multiple of 8 (whole bytes of flags), about kTaskElems elements.
index_t rows_per_task(index_t run) { return ceil_div(std::max<index_t>(1, kTaskElems / run), 8) * 8; }

// Rows [0, rows) through `row` (center_row, or write_offset alone), tasks of whole flag bytes.
template <typename F>
void for_rows(const CenterArgs& a, int num_threads, F row) {
  std::memset(a.constant, 0, static_cast<std::size_t>(ceil_div(a.rows, 8)));
  const index_t per_task = rows_per_task(a.run);
  const index_t tasks = ceil_div(a.rows, per_task);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && tasks > 1)
  for (index_t t = 0; t < tasks; ++t) {
    float xbuf[kSpan];
    const index_t r_hi = std::min(a.rows, (t + 1) * per_task);
    for (index_t r = t * per_task; r < r_hi; ++r) row(a, r, xbuf);
  }
}

}  // namespace

void row_center(const void* x, groupquant::FloatKind kind, index_t rows, index_t run, float* centered,
                float* offsets, std::uint8_t* constant, float* scales, int num_threads) {
  if (rows <= 0) return;
  for_rows(CenterArgs{x, kind, rows, run, centered, offsets, constant, scales}, num_threads, center_row);
}

void row_offsets(const void* x, groupquant::FloatKind kind, index_t rows, index_t run, float* offsets,
                 std::uint8_t* constant, int num_threads) {
  if (rows <= 0) return;
  const auto offset_only = [](const CenterArgs& a, index_t r, float* xbuf) { write_offset(a, r, xbuf); };
  for_rows(CenterArgs{x, kind, rows, run, nullptr, offsets, constant, nullptr}, num_threads, offset_only);
}

void row_uncenter(const float* decoded, const float* offsets, const std::uint8_t* constant, const float* scales,
                  index_t rows, index_t run, groupquant::FloatKind kind, void* out, int num_threads) {
  if (rows <= 0) return;
  const RestoreArgs a{decoded, offsets, constant, scales, run, kind, out};
  const index_t per_task = rows_per_task(run);
  const index_t tasks = ceil_div(rows, per_task);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && tasks > 1)
  for (index_t t = 0; t < tasks; ++t) {
    float vbuf[kSpan];
    const index_t r_hi = std::min(rows, (t + 1) * per_task);
    for (index_t r = t * per_task; r < r_hi; ++r) restore_row(a, r, vbuf);
  }
}

}  // namespace cpu
}  // namespace torchstash
