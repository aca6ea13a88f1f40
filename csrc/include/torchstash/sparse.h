// Top-k selection by magnitude and sparse storage, host and device: the keys, the radix-select
// step and the bit helpers shared by the CPU loops (csrc/cpu/sparse_cpu.cpp) and the CUDA
// kernels (csrc/cuda/sparse_cuda.cu).
//
// The bit-exact definition is torchstash.kernels.sparse_reference (csrc/README.md repeats it):
//   key      float32 bits & 0x7FFFFFFF, float16/bfloat16 bits & 0x7FFF, NaN -> the greatest key
//            (0x7FFFFFFF / 0x7FFF); exact=False cuts a float32 key to key >> 16
//   segment  s holds flat elements [s * L, (s + 1) * L), L = n / segments
//   select   the k greatest keys of a segment, equal keys by lower index first
// A segment's selection is a radix select with 8-bit digits (4 passes for exact float32
// keys, 2 for the 16-bit ones), ending in a threshold T and a tie count: the mask keeps
// key > T and the first `ties` elements (flat order) with key == T.
#pragma once

#include <cstdint>

#include "torchstash/common.h"
#include "torchstash/groupquant.h"

namespace torchstash {
namespace sparse {

// Elements per block of 16-bit offsets (mask_offsets, offsets_scatter).
constexpr index_t kOffsetBlock = index_t{1} << 16;
constexpr int kBins = 256;

// ---------------------------------------------------------------- keys

// The storage word of each float kind, read as an unsigned integer, and its magnitude key.
struct KeyF32 {
  using Word = std::uint32_t;
  static constexpr int kPasses = 4;
  static TS_HD std::uint32_t key(Word b) {
    const std::uint32_t m = b & 0x7FFFFFFFu;
    return m > 0x7F800000u ? 0x7FFFFFFFu : m;
  }
};

// exact=False: the float32 key at bfloat16 precision.
struct KeyF32Coarse {
  using Word = std::uint32_t;
  static constexpr int kPasses = 2;
  static TS_HD std::uint32_t key(Word b) { return KeyF32::key(b) >> 16; }
};

struct KeyF16 {
  using Word = std::uint16_t;
  static constexpr int kPasses = 2;
  static TS_HD std::uint32_t key(Word b) {
    const std::uint32_t m = b & 0x7FFFu;
    return m > 0x7C00u ? 0x7FFFu : m;
  }
};

struct KeyBF16 {
  using Word = std::uint16_t;
  static constexpr int kPasses = 2;
  static TS_HD std::uint32_t key(Word b) {
    const std::uint32_t m = b & 0x7FFFu;
    return m > 0x7F80u ? 0x7FFFu : m;
  }
};

enum class KeyKind : int { kF32 = 0, kF32Coarse = 1, kF16 = 2, kBF16 = 3 };

TS_HD KeyKind key_kind(groupquant::FloatKind kind, bool exact) {
  switch (kind) {
    case groupquant::FloatKind::kFloat16: return KeyKind::kF16;
    case groupquant::FloatKind::kBFloat16: return KeyKind::kBF16;
    default: return exact ? KeyKind::kF32 : KeyKind::kF32Coarse;
  }
}

TS_HD int key_passes(KeyKind kind) { return kind == KeyKind::kF32 ? 4 : 2; }

// Bytes per element of a float kind (the storage word).
TS_HD int word_bytes(groupquant::FloatKind kind) { return kind == groupquant::FloatKind::kFloat32 ? 4 : 2; }

// The key bits above the digit at `shift` (those a pass must match): 0 for the top digit.
TS_HD std::uint32_t high_mask(int shift) { return shift + 8 >= 32 ? 0u : ~((std::uint32_t{1} << (shift + 8)) - 1u); }

// ---------------------------------------------------------------- radix select

// One segment's selection. While !done: the digits chosen so far (`prefix`, zero below
// them) and how many elements with that prefix are still to be taken (`need`). Once done:
// the mask keeps key > threshold and the first `ties` elements with key == threshold.
struct Selection {
  std::int64_t threshold;
  index_t need;
  index_t ties;
  std::uint32_t prefix;
  int done;
};

// k of a segment of `length` elements: nothing (k == 0) and everything (k == length) are
// decided without reading the data.
TS_HD Selection start_selection(index_t k, index_t length) {
  Selection s{0, k, 0, 0u, 0};
  if (k <= 0) {
    s.done = 1;
    s.threshold = INT64_MAX;
  } else if (k >= length) {
    s.done = 1;
    s.threshold = -1;
  }
  return s;
}

// The digit d at `shift` was chosen: `above` elements with the prefix have a greater digit
// and `count` have digit d. When all of the `count` are taken the selection ends here
// (keys >= prefix: threshold prefix - 1, no ties); after the last digit it ends with ties.
TS_HD void apply_digit(Selection* s, int d, index_t above, index_t count, int shift) {
  s->need -= above;
  s->prefix |= static_cast<std::uint32_t>(d) << shift;
  if (s->need == count) {
    s->done = 1;
    s->threshold = static_cast<std::int64_t>(s->prefix) - 1;
    s->ties = 0;
  } else if (shift == 0) {
    s->done = 1;
    s->threshold = static_cast<std::int64_t>(s->prefix);
    s->ties = s->need;
  }
}

// One pass's choice from the 256-bin histogram of the digit at `shift` among the elements
// with the prefix: the bin holding the need-th greatest, scanning from the top.
template <typename Count>
TS_HD void select_digit(Selection* s, const Count* hist, int shift) {
  index_t above = 0;
  int d = kBins - 1;
  for (; d > 0; --d) {
    const auto c = static_cast<index_t>(hist[d]);
    if (above + c >= s->need) break;
    above += c;
  }
  apply_digit(s, d, above, static_cast<index_t>(hist[d]), shift);
}

// The threshold as an int32 for comparisons with keys (all <= 0x7FFFFFFF): -1 keeps every
// key, INT32_MAX none.
TS_HD std::int32_t threshold32(const Selection& s) {
  return s.threshold > INT32_MAX ? INT32_MAX : static_cast<std::int32_t>(s.threshold);
}

// ---------------------------------------------------------------- bits

TS_HD int popcount32(std::uint32_t v) {
#if defined(__CUDA_ARCH__)
  return __popc(v);
#else
  return __builtin_popcount(v);
#endif
}

TS_HD int popcount64(std::uint64_t v) {
#if defined(__CUDA_ARCH__)
  return __popcll(v);
#else
  return __builtin_popcountll(v);
#endif
}

// The lowest `left` set bits of `eq` (all of them when it has no more).
TS_HD std::uint32_t take_lowest(std::uint32_t eq, index_t left) {
  if (left <= 0) return 0u;
  if (popcount32(eq) <= left) return eq;
  std::uint32_t out = 0u;
  for (; left > 0; --left) {
    const std::uint32_t low = eq & (0u - eq);
    out |= low;
    eq ^= low;
  }
  return out;
}

// Byte b of a packed 1-bit mask of n elements, bits at or past n cleared.
TS_HD std::uint32_t mask_byte(const std::uint8_t* mask, index_t b, index_t n) {
  const std::uint32_t v = mask[b];
  const index_t valid = n - 8 * b;
  return valid >= 8 ? v : v & ((1u << valid) - 1u);
}

// ---------------------------------------------------------------- CUDA plan of topk_mask

// How the CUDA topk_mask runs, and its device workspace (byte offsets, 256-aligned).
// Short segments: a warp (kWarpSegments) or a block (kBlockSegments) per segment, the
// histograms in shared memory. Long segments (kGlobalPasses): per pass a histogram kernel
// over chunks of kChunk elements merging into per-segment global histograms, then a
// select kernel; the mask kernel ranks ties across chunks by a scan of per-chunk counts.
// Every path writes the bytes that lie inside one segment directly, and a segment's
// partial first and last bytes into `head` and `tail`, merged by a final kernel.
enum class TopkPath : int { kWarpSegments = 0, kBlockSegments = 1, kGlobalPasses = 2 };

struct TopkPlan {
  TopkPath path;
  index_t chunks_per_segment;  // kGlobalPasses
  index_t units;               // segments * chunks_per_segment
  index_t head_off, tail_off, sel_off, hist_off, eq_off, scan_off;
  index_t bytes;
};

constexpr index_t kWarpSegmentMax = 2048;    // warp per segment up to this length
constexpr index_t kBlockSegmentMax = 65536;  // block per segment up to this length (with enough segments)
constexpr index_t kBlockSegmentFew = 8192;   // ... and always up to this one
constexpr index_t kManySegments = 128;
constexpr index_t kChunk = index_t{1} << 16;  // elements per chunk of a long segment (a multiple of 8)

inline index_t align256(index_t v) { return (v + 255) / 256 * 256; }

inline TopkPlan topk_plan(index_t n, index_t segments) {
  TopkPlan p{TopkPath::kWarpSegments, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  const index_t length = segments > 0 ? n / segments : 0;
  if (length > kWarpSegmentMax) p.path = TopkPath::kBlockSegments;
  if (length > kBlockSegmentMax || (length > kBlockSegmentFew && segments < kManySegments)) {
    p.path = TopkPath::kGlobalPasses;
  }
  index_t at = 0;
  p.head_off = at;
  at = align256(at + segments);
  p.tail_off = at;
  at = align256(at + segments);
  if (p.path == TopkPath::kGlobalPasses) {
    // Chunks start at multiples of kChunk from the segment's first byte boundary.
    p.chunks_per_segment = ceil_div(length + 7, kChunk);
    p.units = segments * p.chunks_per_segment;
    p.sel_off = at;
    at = align256(at + segments * static_cast<index_t>(sizeof(Selection)));
    p.hist_off = at;
    at = align256(at + segments * kBins * static_cast<index_t>(sizeof(unsigned long long)));
    p.eq_off = at;
    at = align256(at + p.units * static_cast<index_t>(sizeof(index_t)));
    p.scan_off = at;
    at = align256(at + (p.units + 1) * static_cast<index_t>(sizeof(index_t)));
  }
  p.bytes = at;
  return p;
}

// Chunks of the mask and offset ops on CUDA: mask bytes per block of work.
constexpr index_t kMaskChunkBytes = 4096;

// Device workspace of the CUDA compaction ops (mask_compact, mask_scatter, mask_offsets):
// per-chunk counts and their exclusive scan (chunks + 1 entries).
inline index_t compact_chunks(index_t n, index_t chunk_bytes) { return ceil_div(ceil_div(n, 8), chunk_bytes); }
inline index_t compact_workspace(index_t n, index_t chunk_bytes) {
  const index_t chunks = compact_chunks(n, chunk_bytes);
  return align256(chunks * static_cast<index_t>(sizeof(index_t))) +
         align256((chunks + 1) * static_cast<index_t>(sizeof(index_t)));
}

// offsets_scatter: the exclusive scan of the block counts (blocks + 1 entries).
inline index_t offsets_scatter_workspace(index_t n) {
  return align256((ceil_div(n, kOffsetBlock) + 1) * static_cast<index_t>(sizeof(index_t)));
}

}  // namespace sparse
}  // namespace torchstash
