// OpenMP loops over the inline sparse.h functions: top-k masks by radix select, and
// compaction by prefix counts. No sort, no index temporaries; int64 indices throughout.
//
// topk_mask. Per segment, 2 or 4 passes build a 256-bin histogram of one key digit among
// the elements whose higher digits match the digits chosen so far; the bin holding the
// k-th greatest key is chosen from the top (over sums of 16 bins first). Keys are read
// straight from the float's bits. The mask is then written a byte at a time for key > T,
// and the first `ties` keys == T are set by a scan that stops after the last of them.
//  * Many or short segments: an OpenMP task owns a run of whole segments whose first
//    element is on a byte boundary (1, 2, 4 or 8 segments: 8 / gcd(L, 8)), so tasks
//    never share an output byte; inside a task segments run one after the other and
//    their partial boundary bytes are or-ed into the task's zeroed bytes.
//  * Few long segments (fewer than 2 per thread, L >= 64K): segment after segment, each
//    pass splits the segment into one chunk per thread (chunk bounds on byte boundaries),
//    chunk histograms summed; the last pass's chunk counts of the final bin are the
//    chunks' counts of keys == T, so the mask pass knows where each chunk's ties start.
// Histograms use 4 interleaved sub-histograms (16-bit below 2048 elements; equal digits in
// a row would otherwise serialize on one counter); a key off the prefix adds 0 to its digit's bin
// rather than branching or counting into an overflow bin (one more hot counter).
//
// mask_compact, mask_scatter, mask_offsets, offsets_scatter: tasks of 64K elements (8 KiB
// of mask: one offset block), set bits counted per task, an exclusive scan, then each task
// writes its part walking the set bits of 64-bit mask words.
#include <algorithm>
#include <cstring>
#include <vector>

#include "torchstash/cpu_kernels.h"
#include "torchstash/sparse.h"

namespace torchstash {
namespace cpu {
namespace {

using sparse::Selection;

constexpr index_t kTaskElems = sparse::kOffsetBlock;  // compaction tasks: one offset block
constexpr index_t kSegmentTask = index_t{1} << 16;    // topk: elements per task of whole segments, at least
constexpr index_t kLongSegment = index_t{1} << 16;    // topk: split a segment across threads from here
constexpr index_t kSubHistMin = 2048;                 // 32-bit sub-histograms from here (16-bit below)
constexpr index_t kFoldElems = index_t{1} << 28;      // u32 sub-histograms folded before they could overflow
constexpr int kHistBins = sparse::kBins;

// ---------------------------------------------------------------- topk: histograms

// Adds the key of w to a histogram h of the digit at `shift`: 1 to its digit's bin when
// its digits above are `prefix`, else 0 (an add rather than a branch or an overflow bin,
// which would be a single hot counter when most keys miss the prefix).
template <class K, typename Count>
inline void count_key(typename K::Word w, std::uint32_t himask, std::uint32_t prefix, int shift, Count* h) {
  const std::uint32_t key = K::key(w);
  h[(key >> shift) & 0xFFu] += static_cast<Count>((key & himask) == prefix);
}

// h[0, 256) <- the histogram of elements [lo, hi), fewer than 2^16 of them, counted in 4
// interleaved 16-bit sub-histograms (2 KiB to clear).
template <class K>
void short_histogram(const typename K::Word* x, index_t lo, index_t hi, std::uint32_t prefix, int shift,
                     std::uint16_t* h) {
  const std::uint32_t himask = sparse::high_mask(shift);
  std::uint16_t sub[4][sparse::kBins];
  std::memset(sub, 0, sizeof(sub));
  index_t i = lo;
  for (; i + 4 <= hi; i += 4) {
    count_key<K>(x[i], himask, prefix, shift, sub[0]);
    count_key<K>(x[i + 1], himask, prefix, shift, sub[1]);
    count_key<K>(x[i + 2], himask, prefix, shift, sub[2]);
    count_key<K>(x[i + 3], himask, prefix, shift, sub[3]);
  }
  for (; i < hi; ++i) count_key<K>(x[i], himask, prefix, shift, sub[0]);
  for (int b = 0; b < sparse::kBins; ++b) {
    h[b] = static_cast<std::uint16_t>(sub[0][b] + sub[1][b] + sub[2][b] + sub[3][b]);
  }
}

// hist[0, 256) <- the histogram of elements [lo, hi), in 4 interleaved sub-histograms.
template <class K>
void long_histogram(const typename K::Word* x, index_t lo, index_t hi, std::uint32_t prefix, int shift,
                    index_t* hist) {
  const std::uint32_t himask = sparse::high_mask(shift);
  for (int b = 0; b < sparse::kBins; ++b) hist[b] = 0;
  std::uint32_t h[4][sparse::kBins];
  for (index_t start = lo; start < hi; start += kFoldElems) {
    const index_t end = std::min(hi, start + kFoldElems);
    std::memset(h, 0, sizeof(h));
    index_t i = start;
    for (; i + 4 <= end; i += 4) {
      count_key<K>(x[i], himask, prefix, shift, h[0]);
      count_key<K>(x[i + 1], himask, prefix, shift, h[1]);
      count_key<K>(x[i + 2], himask, prefix, shift, h[2]);
      count_key<K>(x[i + 3], himask, prefix, shift, h[3]);
    }
    for (; i < end; ++i) count_key<K>(x[i], himask, prefix, shift, h[0]);
    for (int b = 0; b < sparse::kBins; ++b) hist[b] += index_t{h[0][b]} + h[1][b] + h[2][b] + h[3][b];
  }
}

// sparse::select_digit with the scan from the top done over sums of 16 bins first, then
// inside the group of 16 that holds the bin: the same bin, in about 32 steps, not 256.
template <typename Count>
void select_digit_fast(Selection* s, const Count* hist, int shift) {
  Count coarse[16];
  for (int g = 0; g < 16; ++g) {
    Count c = 0;  // a short histogram's sums fit its counts' type
    for (int j = 0; j < 16; ++j) c += hist[16 * g + j];
    coarse[g] = c;
  }
  index_t above = 0;
  int g = 15;
  for (; g > 0; --g) {
    const auto c = static_cast<index_t>(coarse[g]);
    if (above + c >= s->need) break;
    above += c;
  }
  int d = 16 * g + 15;
  for (; d > 16 * g; --d) {
    const auto c = static_cast<index_t>(hist[d]);
    if (above + c >= s->need) break;
    above += c;
  }
  sparse::apply_digit(s, d, above, static_cast<index_t>(hist[d]), shift);
}

// ---------------------------------------------------------------- topk: mask bits

// Bits of keys > t among elements [lo, hi) (inside one output byte, at bit lo & 7 on).
template <class K>
inline std::uint32_t above_bits(const typename K::Word* x, index_t lo, index_t hi, std::int32_t t) {
  std::uint32_t g = 0;
  for (index_t i = lo; i < hi; ++i) g |= static_cast<std::uint32_t>(static_cast<std::int32_t>(K::key(x[i])) > t) << (i & 7);
  return g;
}

// Mask bits of elements [lo, hi) of one segment for keys > t: whole bytes are stored,
// partial ones or-ed in (the bytes start zeroed).
template <class K>
void write_above(const typename K::Word* x, index_t lo, index_t hi, std::int32_t t, std::uint8_t* out) {
  if (lo >= hi || t == INT32_MAX) return;  // no key is above INT32_MAX
  index_t i = lo;
  const index_t head_end = std::min(hi, (lo + 7) & ~index_t{7});
  if (i < head_end) {
    out[i >> 3] |= static_cast<std::uint8_t>(above_bits<K>(x, i, head_end, t));
    i = head_end;
  }
  const index_t full_end = std::max(i, hi & ~index_t{7});
  if (t < 0) {  // every key
    std::memset(out + (i >> 3), 0xFF, static_cast<std::size_t>((full_end - i) >> 3));
  } else {
    for (; i < full_end; i += 8) {
      std::uint32_t g = 0;
      for (int j = 0; j < 8; ++j) g |= static_cast<std::uint32_t>(static_cast<std::int32_t>(K::key(x[i + j])) > t) << j;
      out[i >> 3] = static_cast<std::uint8_t>(g);
    }
  }
  i = full_end;
  if (i < hi) out[i >> 3] |= static_cast<std::uint8_t>(above_bits<K>(x, i, hi, t));
}

// Sets the bits of the first *left keys == t among elements [lo, hi) (*left counts down).
template <class K>
void write_ties(const typename K::Word* x, index_t lo, index_t hi, std::int32_t t, index_t* left, std::uint8_t* out) {
  for (index_t i = lo; i < hi && *left > 0; ++i) {
    if (static_cast<std::int32_t>(K::key(x[i])) == t) {
      out[i >> 3] |= static_cast<std::uint8_t>(1u << (i & 7));
      --*left;
    }
  }
}

// ---------------------------------------------------------------- topk: one segment per thread

template <class K>
void topk_segment(const typename K::Word* x, index_t a, index_t e, index_t k, std::uint8_t* out) {
  Selection sel = sparse::start_selection(k, e - a);
  if (e - a < kSubHistMin) {
    std::uint16_t hist[kHistBins];
    for (int p = K::kPasses - 1; p >= 0 && !sel.done; --p) {
      short_histogram<K>(x, a, e, sel.prefix, 8 * p, hist);
      select_digit_fast(&sel, hist, 8 * p);
    }
  } else {
    index_t hist[kHistBins];
    for (int p = K::kPasses - 1; p >= 0 && !sel.done; --p) {
      long_histogram<K>(x, a, e, sel.prefix, 8 * p, hist);
      select_digit_fast(&sel, hist, 8 * p);
    }
  }
  const std::int32_t t = sparse::threshold32(sel);
  write_above<K>(x, a, e, t, out);
  index_t left = sel.ties;
  write_ties<K>(x, a, e, t, &left, out);
}

// Segments in runs of `run` whose first element is on a byte boundary; tasks of whole runs.
template <class K>
void topk_by_segments(const typename K::Word* x, index_t segments, index_t length, index_t k, std::uint8_t* out,
                      int num_threads) {
  const index_t run = (length % 8 == 0) ? 1 : (length % 4 == 0) ? 2 : (length % 2 == 0) ? 4 : 8;
  const index_t runs_per_task = std::max<index_t>(1, kSegmentTask / (run * length));
  const index_t per_task = run * runs_per_task;  // segments
  const index_t tasks = ceil_div(segments, per_task);
  const index_t n = segments * length;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1 && tasks > 1)
  for (index_t t = 0; t < tasks; ++t) {
    const index_t s0 = t * per_task;
    const index_t s1 = std::min(segments, s0 + per_task);
    const index_t b0 = s0 * length / 8;  // a byte boundary
    const index_t b1 = ceil_div(std::min(n, s1 * length), 8);
    std::memset(out + b0, 0, static_cast<std::size_t>(b1 - b0));
    for (index_t s = s0; s < s1; ++s) topk_segment<K>(x, s * length, (s + 1) * length, k, out);
  }
}

// Few long segments: each split into one chunk per thread.
template <class K>
void topk_by_chunks(const typename K::Word* x, index_t segments, index_t length, index_t k, std::uint8_t* out,
                    int num_threads) {
  const index_t n = segments * length;
  std::memset(out, 0, static_cast<std::size_t>(ceil_div(n, 8)));
  const index_t tasks = std::min<index_t>(num_threads, ceil_div(length, kLongSegment));
  std::vector<index_t> hists(static_cast<std::size_t>(tasks * kHistBins));
  std::vector<index_t> bounds(static_cast<std::size_t>(tasks + 1));
  std::vector<index_t> starts(static_cast<std::size_t>(tasks));
  for (index_t s = 0; s < segments; ++s) {
    const index_t a = s * length;
    const index_t e = a + length;
    const index_t chunk = ceil_div(length, tasks);
    bounds[0] = a;
    for (index_t t = 1; t < tasks; ++t) bounds[t] = std::min(e, ((a + t * chunk) + 7) & ~index_t{7});
    bounds[tasks] = e;
    Selection sel = sparse::start_selection(k, length);
    int last_shift = -1;
    for (int p = K::kPasses - 1; p >= 0 && !sel.done; --p) {
      const int shift = 8 * p;
      const std::uint32_t prefix = sel.prefix;
#pragma omp parallel for schedule(static, 1) num_threads(num_threads) if (num_threads > 1 && tasks > 1)
      for (index_t t = 0; t < tasks; ++t) {
        long_histogram<K>(x, bounds[t], bounds[t + 1], prefix, shift, hists.data() + t * kHistBins);
      }
      index_t hist[kHistBins] = {};
      for (index_t t = 0; t < tasks; ++t) {
        for (int b = 0; b < kHistBins; ++b) hist[b] += hists[t * kHistBins + b];
      }
      select_digit_fast(&sel, hist, shift);
      last_shift = shift;
    }
    // With ties, the last pass was the final digit: its bin in each chunk's histogram is
    // the chunk's count of keys == T.
    index_t taken = 0;
    for (index_t t = 0; t < tasks; ++t) {
      starts[t] = taken;
      if (sel.ties > 0 && last_shift == 0) taken += hists[t * kHistBins + (sel.prefix & 0xFFu)];
    }
    const std::int32_t thr = sparse::threshold32(sel);
    const index_t ties = sel.ties;
#pragma omp parallel for schedule(static, 1) num_threads(num_threads) if (num_threads > 1 && tasks > 1)
    for (index_t t = 0; t < tasks; ++t) {
      write_above<K>(x, bounds[t], bounds[t + 1], thr, out);
      index_t left = std::max<index_t>(0, ties - starts[static_cast<std::size_t>(t)]);
      write_ties<K>(x, bounds[t], bounds[t + 1], thr, &left, out);
    }
  }
}

template <class K>
void topk_as(const void* x, index_t n, index_t segments, index_t k, std::uint8_t* out, int num_threads) {
  const auto* w = static_cast<const typename K::Word*>(x);
  const index_t length = n / segments;
  if (num_threads > 1 && length >= kLongSegment && segments < 2 * static_cast<index_t>(num_threads)) {
    topk_by_chunks<K>(w, segments, length, k, out, num_threads);
  } else {
    topk_by_segments<K>(w, segments, length, k, out, num_threads);
  }
}

// ---------------------------------------------------------------- compaction

// Mask bits of elements [64 * w, 64 * w + 64), bits at or past n cleared.
inline std::uint64_t mask_word(const std::uint8_t* mask, index_t n, index_t w) {
  const index_t first = 64 * w;
  std::uint64_t v = 0;
  if (first + 64 <= n) {
    std::memcpy(&v, mask + 8 * w, sizeof(v));  // little-endian: byte j holds bits 8j..8j+7
    return v;
  }
  const index_t nbytes = ceil_div(n, 8);
  for (index_t b = 8 * w; b < nbytes; ++b) v |= static_cast<std::uint64_t>(sparse::mask_byte(mask, b, n)) << (8 * (b - 8 * w));
  return v;
}

// Set bits of the mask per task of kTaskElems elements.
std::vector<index_t> task_counts(const std::uint8_t* mask, index_t n, int num_threads) {
  const index_t tasks = ceil_div(n, kTaskElems);
  std::vector<index_t> counts(static_cast<std::size_t>(tasks));
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && tasks > 1)
  for (index_t t = 0; t < tasks; ++t) {
    const index_t w1 = ceil_div(std::min(n, (t + 1) * kTaskElems), 64);
    index_t c = 0;
    for (index_t w = t * (kTaskElems / 64); w < w1; ++w) c += sparse::popcount64(mask_word(mask, n, w));
    counts[static_cast<std::size_t>(t)] = c;
  }
  return counts;
}

// counts -> their exclusive scan; returns the total.
index_t exclusive_scan(std::vector<index_t>* counts) {
  index_t total = 0;
  for (auto& c : *counts) {
    const index_t v = c;
    c = total;
    total += v;
  }
  return total;
}

// Calls f(i, j) for the set bits i (flat index) of task t's elements, j counting from 0.
template <typename F>
inline void for_each_set(const std::uint8_t* mask, index_t n, index_t t, F f) {
  const index_t w1 = ceil_div(std::min(n, (t + 1) * kTaskElems), 64);
  index_t j = 0;
  for (index_t w = t * (kTaskElems / 64); w < w1; ++w) {
    std::uint64_t v = mask_word(mask, n, w);
    while (v != 0) {
      f(64 * w + __builtin_ctzll(v), j++);
      v &= v - 1;
    }
  }
}

template <typename T>
void compact_as(const T* x, const std::uint8_t* mask, index_t n, const std::vector<index_t>& starts, T* out,
                int num_threads) {
  const auto tasks = static_cast<index_t>(starts.size());
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && tasks > 1)
  for (index_t t = 0; t < tasks; ++t) {
    T* dst = out + starts[static_cast<std::size_t>(t)];
    for_each_set(mask, n, t, [&](index_t i, index_t j) { dst[j] = x[i]; });
  }
}

template <typename T>
void scatter_as(const std::uint8_t* mask, const T* values, index_t n, const std::vector<index_t>& starts, T* out,
                int num_threads) {
  const auto tasks = static_cast<index_t>(starts.size());
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && tasks > 1)
  for (index_t t = 0; t < tasks; ++t) {
    const index_t lo = t * kTaskElems;
    std::memset(out + lo, 0, static_cast<std::size_t>(std::min(n, lo + kTaskElems) - lo) * sizeof(T));
    const T* src = values + starts[static_cast<std::size_t>(t)];
    for_each_set(mask, n, t, [&](index_t i, index_t j) { out[i] = src[j]; });
  }
}

template <typename T>
void offsets_scatter_as(const std::uint16_t* offsets, const std::vector<index_t>& starts, const T* values,
                        index_t n, T* out, int num_threads) {
  const index_t blocks = static_cast<index_t>(starts.size()) - 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && blocks > 1)
  for (index_t b = 0; b < blocks; ++b) {
    const index_t lo = b * sparse::kOffsetBlock;
    std::memset(out + lo, 0, static_cast<std::size_t>(std::min(n, lo + sparse::kOffsetBlock) - lo) * sizeof(T));
    for (index_t j = starts[static_cast<std::size_t>(b)]; j < starts[static_cast<std::size_t>(b + 1)]; ++j) {
      out[lo + offsets[j]] = values[j];
    }
  }
}

}  // namespace

void topk_mask(const void* x, sparse::KeyKind kind, index_t n, index_t segments, index_t k, std::uint8_t* out,
               int num_threads) {
  if (n <= 0 || segments <= 0) return;
  switch (kind) {
    case sparse::KeyKind::kF32: return topk_as<sparse::KeyF32>(x, n, segments, k, out, num_threads);
    case sparse::KeyKind::kF32Coarse: return topk_as<sparse::KeyF32Coarse>(x, n, segments, k, out, num_threads);
    case sparse::KeyKind::kF16: return topk_as<sparse::KeyF16>(x, n, segments, k, out, num_threads);
    default: return topk_as<sparse::KeyBF16>(x, n, segments, k, out, num_threads);
  }
}

index_t mask_compact(const void* x, int word_bytes, const std::uint8_t* mask, index_t n, index_t kept, void* out,
                     int num_threads) {
  std::vector<index_t> starts = task_counts(mask, n, num_threads);
  const index_t total = exclusive_scan(&starts);
  if (total != kept) return total;
  if (word_bytes == 4) {
    compact_as(static_cast<const std::uint32_t*>(x), mask, n, starts, static_cast<std::uint32_t*>(out), num_threads);
  } else {
    compact_as(static_cast<const std::uint16_t*>(x), mask, n, starts, static_cast<std::uint16_t*>(out), num_threads);
  }
  return total;
}

index_t mask_scatter(const std::uint8_t* mask, const void* values, int word_bytes, index_t nvalues, index_t n,
                     void* out, int num_threads) {
  std::vector<index_t> starts = task_counts(mask, n, num_threads);
  const index_t total = exclusive_scan(&starts);
  if (total != nvalues) return total;
  if (word_bytes == 4) {
    scatter_as(mask, static_cast<const std::uint32_t*>(values), n, starts, static_cast<std::uint32_t*>(out),
               num_threads);
  } else {
    scatter_as(mask, static_cast<const std::uint16_t*>(values), n, starts, static_cast<std::uint16_t*>(out),
               num_threads);
  }
  return total;
}

index_t mask_offsets(const std::uint8_t* mask, index_t n, index_t kept, std::uint16_t* offsets, std::int32_t* counts,
                     int num_threads) {
  std::vector<index_t> starts = task_counts(mask, n, num_threads);  // tasks are the offset blocks
  for (std::size_t b = 0; b < starts.size(); ++b) counts[b] = static_cast<std::int32_t>(starts[b]);
  const index_t total = exclusive_scan(&starts);
  if (total != kept) return total;
  const auto tasks = static_cast<index_t>(starts.size());
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && tasks > 1)
  for (index_t t = 0; t < tasks; ++t) {
    std::uint16_t* dst = offsets + starts[static_cast<std::size_t>(t)];
    const index_t base = t * kTaskElems;
    for_each_set(mask, n, t, [&](index_t i, index_t j) { dst[j] = static_cast<std::uint16_t>(i - base); });
  }
  return total;
}

index_t offsets_scatter(const std::uint16_t* offsets, index_t noffsets, const std::int32_t* counts,
                        const void* values, int word_bytes, index_t n, void* out, int num_threads) {
  const index_t blocks = ceil_div(n, sparse::kOffsetBlock);
  std::vector<index_t> starts(static_cast<std::size_t>(blocks + 1));
  index_t total = 0;
  for (index_t b = 0; b < blocks; ++b) {
    if (counts[b] < 0) return -1;
    starts[static_cast<std::size_t>(b)] = total;
    total += counts[b];
  }
  starts[static_cast<std::size_t>(blocks)] = total;
  if (total != noffsets) return -1;
  // Only the last block can reach past n.
  if (blocks > 0) {
    const index_t room = n - (blocks - 1) * sparse::kOffsetBlock;
    for (index_t j = starts[static_cast<std::size_t>(blocks - 1)]; j < total; ++j) {
      if (offsets[j] >= room) return -2;
    }
  }
  if (word_bytes == 4) {
    offsets_scatter_as(offsets, starts, static_cast<const std::uint32_t*>(values), n,
                       static_cast<std::uint32_t*>(out), num_threads);
  } else {
    offsets_scatter_as(offsets, starts, static_cast<const std::uint16_t*>(values), n,
                       static_cast<std::uint16_t*>(out), num_threads);
  }
  return 0;
}

}  // namespace cpu
}  // namespace torchstash
