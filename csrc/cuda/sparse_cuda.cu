// CUDA kernels over the inline sparse.h functions: top-k masks by radix select, and
// compaction by prefix counts. Everything stays on the device (no host synchronisation):
// counts the host would need are kept in device workspace that the binding allocates.
// 64-bit element indices, grid-stride loops with a capped grid.
//
// topk_mask (sparse::topk_plan picks the path):
//  * Short segments: a warp (L <= 2048) or a block (L <= 64K) per segment, grid-stride
//    over segments. Per pass the group clears a 256-bin shared histogram, adds the digit of
//    every key with the chosen prefix (shared atomics), and one warp picks the bin (lane l
//    owns bins 8l..8l+7; a suffix scan over lanes finds the lane, the lane its bin).
//  * Long segments: per pass, one block per chunk of 64K elements builds a shared
//    histogram and adds it to its segment's global one (64-bit atomics), then one thread
//    per segment picks the bin. With ties, per-chunk counts of keys == T and their scan
//    tell each chunk where its share of the ties starts.
//  * The mask: the group (or block) walks its bytes, one byte per thread per round: bits
//    of keys > T, bits of keys == T, an exclusive scan of the latter's popcounts ranks the
//    ties in flat order. Bytes inside one segment are stored directly; a segment's partial
//    first and last bytes go to `head` / `tail` (one byte per segment each), and
//    merge_edges_kernel writes each shared byte once, from the segment that holds its first
//    element, or-ing in the following segments' heads (up to 8 segments share a byte).
// mask_compact, mask_scatter, mask_offsets: a block per chunk of mask bytes counts its set
// bits, a single-block kernel scans the counts, and a block per chunk writes its part,
// one mask byte per thread per round, ranks by a block scan. Slots past the mask's count
// are zero-filled (the count is not checked: that would need a host sync).
// offsets_scatter: memset, scan of the block counts, a block per offset block.
#include "launch_config.cuh"
#include "torchstash/cuda_launch.h"
#include "torchstash/sparse.h"

namespace torchstash {
namespace cuda {
namespace {

using sparse::Selection;

constexpr int kWarp = 32;
constexpr unsigned int kFull = 0xFFFFFFFFu;
constexpr int kScanThreads = 1024;  // the single-block scans

template <int TPS>
__device__ __forceinline__ void group_sync() {
  if constexpr (TPS == kWarp) {
    __syncwarp();
  } else {
    __syncthreads();
  }
}

__device__ __forceinline__ index_t warp_inclusive_scan(index_t v) {
  const int lane = static_cast<int>(threadIdx.x % kWarp);
#pragma unroll
  for (int d = 1; d < kWarp; d <<= 1) {
    const index_t y = __shfl_up_sync(kFull, v, d);
    if (lane >= d) v += y;
  }
  return v;
}

// Exclusive scan of v over a group of TPS threads: a warp, or the whole block (TPS ==
// blockDim.x, smem holding TPS / 32 entries). *total <- the group's sum. Every thread of
// the group must call it.
template <int TPS>
__device__ __forceinline__ index_t group_exclusive_scan(index_t v, index_t* total, index_t* smem) {
  const index_t incl = warp_inclusive_scan(v);
  if constexpr (TPS == kWarp) {
    *total = __shfl_sync(kFull, incl, kWarp - 1);
    return incl - v;
  } else {
    constexpr int kWarps = TPS / kWarp;
    const int lane = static_cast<int>(threadIdx.x % kWarp);
    const int warp = static_cast<int>(threadIdx.x / kWarp);
    if (lane == kWarp - 1) smem[warp] = incl;
    __syncthreads();
    if (warp == 0) {
      index_t w = lane < kWarps ? smem[lane] : 0;
      w = warp_inclusive_scan(w);
      if (lane < kWarps) smem[lane] = w;
    }
    __syncthreads();
    const index_t before = warp > 0 ? smem[warp - 1] : 0;
    *total = smem[kWarps - 1];
    __syncthreads();  // smem is reused by the next call
    return before + incl - v;
  }
}

// One radix step by a whole warp (every lane holds the same *sel and ends with the same
// update): lane l owns bins 8l..8l+7; the lane where the suffix sums cross `need` finds the
// bin, as sparse::select_digit would.
template <typename Count>
__device__ __forceinline__ void warp_select(const Count* hist, int shift, Selection* sel) {
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  index_t bins[8];
  index_t sum = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    bins[j] = static_cast<index_t>(hist[8 * lane + j]);
    sum += bins[j];
  }
  index_t incl = sum;  // over lanes >= lane
#pragma unroll
  for (int d = 1; d < kWarp; d <<= 1) {
    const index_t y = __shfl_down_sync(kFull, incl, d);
    if (lane + d < kWarp) incl += y;
  }
  const index_t need = sel->need;
  index_t above = incl - sum;
  const bool mine = above < need && need <= incl;
  const unsigned int ball = __ballot_sync(kFull, mine);
  const int owner = ball != 0 ? __ffs(static_cast<int>(ball)) - 1 : 0;
  int d = 8 * lane;
  index_t count = bins[0];
  if (mine) {
#pragma unroll
    for (int j = 7; j >= 0; --j) {
      if (j == 0 || above + bins[j] >= need) {
        d = 8 * lane + j;
        count = bins[j];
        break;
      }
      above += bins[j];
    }
  }
  d = __shfl_sync(kFull, d, owner);
  above = __shfl_sync(kFull, above, owner);
  count = __shfl_sync(kFull, count, owner);
  sparse::apply_digit(sel, d, above, count, shift);
}

// out[0, m] <- the exclusive scan of in[0, m) and, in out[m], the total; one block of
// kScanThreads threads, each summing a contiguous slice.
template <typename T>
__global__ void __launch_bounds__(kScanThreads)
    exclusive_scan_kernel(const T* __restrict__ in, index_t m, index_t* __restrict__ out) {
  __shared__ index_t smem[kScanThreads / kWarp];
  const index_t per = ceil_div(m, kScanThreads);
  const index_t lo = static_cast<index_t>(threadIdx.x) * per < m ? static_cast<index_t>(threadIdx.x) * per : m;
  const index_t hi = lo + per < m ? lo + per : m;
  index_t sum = 0;
  for (index_t i = lo; i < hi; ++i) sum += static_cast<index_t>(in[i]);
  index_t total;
  index_t run = group_exclusive_scan<kScanThreads>(sum, &total, smem);
  for (index_t i = lo; i < hi; ++i) {
    const auto v = static_cast<index_t>(in[i]);
    out[i] = run;
    run += v;
  }
  if (threadIdx.x == 0) out[m] = total;
}

// Mask bytes of elements [c0, c1) of segment s = [a, e) by a group of TPS threads, a byte
// per thread per round (c0 is a or a multiple of 8, c1 is e or a multiple of 8): keys > t,
// and the keys == t ranked from `rank` on below `ties`. Bytes inside the segment go to
// `out`, its partial first and last bytes to head[s] and tail[s].
template <class K, int TPS>
__device__ void write_bits(const typename K::Word* __restrict__ x, index_t a, index_t e, index_t c0, index_t c1,
                           std::int32_t t, index_t ties, index_t rank, index_t s, std::uint8_t* __restrict__ out,
                           std::uint8_t* __restrict__ head, std::uint8_t* __restrict__ tail, index_t* smem) {
  const int r = static_cast<int>(threadIdx.x % TPS);
  const index_t b0 = c0 >> 3;
  const index_t b1 = (c1 + 7) >> 3;
  const index_t fb = a >> 3;
  for (index_t base = b0; base < b1; base += TPS) {  // group-uniform bounds
    const index_t b = base + r;
    std::uint32_t gt = 0u;
    std::uint32_t eq = 0u;
    if (b < b1) {
      const index_t lo = 8 * b > c0 ? 8 * b : c0;
      const index_t hi = 8 * b + 8 < c1 ? 8 * b + 8 : c1;
      for (index_t i = lo; i < hi; ++i) {
        const auto key = static_cast<std::int32_t>(K::key(x[i]));
        gt |= static_cast<std::uint32_t>(key > t) << (i & 7);
        eq |= static_cast<std::uint32_t>(key == t) << (i & 7);
      }
    }
    if (ties > 0) {  // group-uniform
      index_t total;
      const index_t before = group_exclusive_scan<TPS>(sparse::popcount32(eq), &total, smem);
      gt |= sparse::take_lowest(eq, ties - rank - before);
      rank += total;
    }
    if (b < b1) {
      if (8 * b >= a && 8 * b + 8 <= e) {
        out[b] = static_cast<std::uint8_t>(gt);
      } else if (b == fb) {
        head[s] = static_cast<std::uint8_t>(gt);
      } else {
        tail[s] = static_cast<std::uint8_t>(gt);
      }
    }
  }
}

// ---------------------------------------------------------------- topk: a group per segment

template <class K, int TPS>
__global__ void __launch_bounds__(kThreads)
    topk_segments_kernel(const typename K::Word* __restrict__ x, index_t segments, index_t length, index_t k,
                         std::uint8_t* __restrict__ out, std::uint8_t* __restrict__ head,
                         std::uint8_t* __restrict__ tail) {
  constexpr int kGroups = kThreads / TPS;
  __shared__ unsigned int hist[kGroups][sparse::kBins];
  __shared__ index_t smem[kThreads / kWarp];
  __shared__ Selection chosen;
  const int g = static_cast<int>(threadIdx.x / TPS);
  const int r = static_cast<int>(threadIdx.x % TPS);
  unsigned int* h = hist[g];
  // Group-uniform loop: a warp's lanes (TPS 32), or the whole block (TPS == kThreads).
  for (index_t s = static_cast<index_t>(blockIdx.x) * kGroups + g; s < segments;
       s += static_cast<index_t>(gridDim.x) * kGroups) {
    const index_t a = s * length;
    const index_t e = a + length;
    Selection sel = sparse::start_selection(k, length);
    for (int p = K::kPasses - 1; p >= 0 && !sel.done; --p) {
      const int shift = 8 * p;
      const std::uint32_t himask = sparse::high_mask(shift);
      for (int b = r; b < sparse::kBins; b += TPS) h[b] = 0u;
      group_sync<TPS>();
      for (index_t i = a + r; i < e; i += TPS) {
        const std::uint32_t key = K::key(x[i]);
        if ((key & himask) == sel.prefix) atomicAdd(&h[(key >> shift) & 0xFFu], 1u);
      }
      group_sync<TPS>();
      if constexpr (TPS == kWarp) {
        warp_select(h, shift, &sel);
      } else {
        if (threadIdx.x < kWarp) {
          warp_select(h, shift, &sel);
          if (threadIdx.x == 0) chosen = sel;
        }
        __syncthreads();
        sel = chosen;
      }
    }
    write_bits<K, TPS>(x, a, e, a, e, sparse::threshold32(sel), sel.ties, 0, s, out, head, tail, smem);
    group_sync<TPS>();  // everyone is done with h and `chosen` before the next segment
  }
}

// ---------------------------------------------------------------- topk: long segments

// Chunk j of segment s: from the segment's first byte boundary, kChunk elements each.
__device__ __forceinline__ void chunk_bounds(index_t s, index_t j, index_t length, index_t* c0, index_t* c1) {
  const index_t a = s * length;
  const index_t e = a + length;
  const index_t base = a & ~index_t{7};
  const index_t lo = base + j * sparse::kChunk;
  const index_t hi = lo + sparse::kChunk;
  *c0 = lo > a ? lo : a;
  *c1 = hi < e ? hi : e;
}

__global__ void init_selection_kernel(Selection* __restrict__ sel, index_t segments, index_t length, index_t k) {
  for (index_t s = grid_start(); s < segments; s += grid_stride()) sel[s] = sparse::start_selection(k, length);
}

// hist[s][256] += the chunk histograms of the digit at `shift` (segments not done).
template <class K>
__global__ void __launch_bounds__(kThreads)
    chunk_histogram_kernel(const typename K::Word* __restrict__ x, index_t length, index_t chunks_per_segment,
                           index_t units, const Selection* __restrict__ sel, int shift,
                           unsigned long long* __restrict__ hist) {
  __shared__ unsigned int h[sparse::kBins];
  const std::uint32_t himask = sparse::high_mask(shift);
  for (index_t u = blockIdx.x; u < units; u += gridDim.x) {  // block-uniform
    const index_t s = u / chunks_per_segment;
    const Selection cur = sel[s];
    index_t c0, c1;
    chunk_bounds(s, u - s * chunks_per_segment, length, &c0, &c1);
    if (cur.done || c0 >= c1) continue;  // block-uniform
    for (int b = static_cast<int>(threadIdx.x); b < sparse::kBins; b += blockDim.x) h[b] = 0u;
    __syncthreads();
    for (index_t i = c0 + threadIdx.x; i < c1; i += blockDim.x) {
      const std::uint32_t key = K::key(x[i]);
      if ((key & himask) == cur.prefix) atomicAdd(&h[(key >> shift) & 0xFFu], 1u);
    }
    __syncthreads();
    for (int b = static_cast<int>(threadIdx.x); b < sparse::kBins; b += blockDim.x) {
      if (h[b] != 0u) atomicAdd(hist + s * sparse::kBins + b, static_cast<unsigned long long>(h[b]));
    }
    __syncthreads();
  }
}

__global__ void select_kernel(Selection* __restrict__ sel, index_t segments, const unsigned long long* __restrict__ hist,
                              int shift) {
  for (index_t s = grid_start(); s < segments; s += grid_stride()) {
    Selection cur = sel[s];
    if (cur.done) continue;
    sparse::select_digit(&cur, hist + s * sparse::kBins, shift);
    sel[s] = cur;
  }
}

// eq[u] <- the keys == T of chunk u when its segment splits ties (else 0).
template <class K>
__global__ void __launch_bounds__(kThreads)
    chunk_ties_kernel(const typename K::Word* __restrict__ x, index_t length, index_t chunks_per_segment,
                      index_t units, const Selection* __restrict__ sel, index_t* __restrict__ eq) {
  __shared__ index_t smem[kThreads / kWarp];
  for (index_t u = blockIdx.x; u < units; u += gridDim.x) {  // block-uniform
    const index_t s = u / chunks_per_segment;
    const Selection cur = sel[s];
    index_t count = 0;
    if (cur.ties > 0) {  // block-uniform
      index_t c0, c1;
      chunk_bounds(s, u - s * chunks_per_segment, length, &c0, &c1);
      const std::int32_t t = sparse::threshold32(cur);
      for (index_t i = c0 + threadIdx.x; i < c1; i += blockDim.x) {
        count += static_cast<std::int32_t>(K::key(x[i])) == t ? 1 : 0;
      }
      index_t total;
      group_exclusive_scan<kThreads>(count, &total, smem);
      count = total;
    }
    if (threadIdx.x == 0) eq[u] = count;
  }
}

template <class K>
__global__ void __launch_bounds__(kThreads)
    chunk_mask_kernel(const typename K::Word* __restrict__ x, index_t length, index_t chunks_per_segment,
                      index_t units, const Selection* __restrict__ sel, const index_t* __restrict__ eq_scan,
                      std::uint8_t* __restrict__ out, std::uint8_t* __restrict__ head,
                      std::uint8_t* __restrict__ tail) {
  __shared__ index_t smem[kThreads / kWarp];
  for (index_t u = blockIdx.x; u < units; u += gridDim.x) {  // block-uniform
    const index_t s = u / chunks_per_segment;
    index_t c0, c1;
    chunk_bounds(s, u - s * chunks_per_segment, length, &c0, &c1);
    if (c0 >= c1) continue;
    const Selection cur = sel[s];
    const index_t rank = eq_scan[u] - eq_scan[s * chunks_per_segment];  // ties in earlier chunks
    write_bits<K, kThreads>(x, s * length, (s + 1) * length, c0, c1, sparse::threshold32(cur), cur.ties, rank, s,
                            out, head, tail, smem);
  }
}

// Each byte shared by segments (or the partial last byte) is written once, by the segment
// holding its first element: its own bits (head or tail) or-ed with the heads of the
// segments that start inside the byte.
__global__ void merge_edges_kernel(index_t segments, index_t length, index_t n, const std::uint8_t* __restrict__ head,
                                   const std::uint8_t* __restrict__ tail, std::uint8_t* __restrict__ out) {
  for (index_t s = grid_start(); s < segments; s += grid_stride()) {
    const index_t a = s * length;
    const index_t e = a + length;
    if ((e & 7) == 0) continue;
    const index_t lb = (e - 1) >> 3;
    if (8 * lb < a) continue;  // the byte's first element belongs to an earlier segment
    std::uint32_t v = (a >> 3) == lb ? head[s] : tail[s];
    const index_t byte_end = 8 * lb + 8 < n ? 8 * lb + 8 : n;
    for (index_t t = s + 1; t < segments && t * length < byte_end; ++t) v |= head[t];
    out[lb] = static_cast<std::uint8_t>(v);
  }
}

template <class K>
cudaError_t topk_as(const void* xv, index_t n, index_t segments, index_t k, std::uint8_t* out, void* workspace,
                    cudaStream_t stream) {
  const auto* x = static_cast<const typename K::Word*>(xv);
  const index_t length = n / segments;
  const sparse::TopkPlan plan = sparse::topk_plan(n, segments);
  auto* ws = static_cast<unsigned char*>(workspace);
  std::uint8_t* head = ws + plan.head_off;
  std::uint8_t* tail = ws + plan.tail_off;
  if (plan.path == sparse::TopkPath::kWarpSegments) {
    topk_segments_kernel<K, kWarp>
        <<<grid_for(segments * kWarp), kThreads, 0, stream>>>(x, segments, length, k, out, head, tail);
  } else if (plan.path == sparse::TopkPath::kBlockSegments) {
    const auto grid = static_cast<unsigned int>(segments < kMaxBlocks ? segments : kMaxBlocks);
    topk_segments_kernel<K, kThreads><<<grid, kThreads, 0, stream>>>(x, segments, length, k, out, head, tail);
  } else {
    auto* sel = reinterpret_cast<Selection*>(ws + plan.sel_off);
    auto* hist = reinterpret_cast<unsigned long long*>(ws + plan.hist_off);
    auto* eq = reinterpret_cast<index_t*>(ws + plan.eq_off);
    auto* eq_scan = reinterpret_cast<index_t*>(ws + plan.scan_off);
    const index_t cps = plan.chunks_per_segment;
    const auto grid = static_cast<unsigned int>(plan.units < kMaxBlocks ? plan.units : kMaxBlocks);
    init_selection_kernel<<<grid_for(segments), kThreads, 0, stream>>>(sel, segments, length, k);
    for (int p = K::kPasses - 1; p >= 0; --p) {
      const cudaError_t err = cudaMemsetAsync(
          hist, 0, static_cast<std::size_t>(segments) * sparse::kBins * sizeof(unsigned long long), stream);
      if (err != cudaSuccess) return err;
      chunk_histogram_kernel<K><<<grid, kThreads, 0, stream>>>(x, length, cps, plan.units, sel, 8 * p, hist);
      select_kernel<<<grid_for(segments), kThreads, 0, stream>>>(sel, segments, hist, 8 * p);
    }
    chunk_ties_kernel<K><<<grid, kThreads, 0, stream>>>(x, length, cps, plan.units, sel, eq);
    exclusive_scan_kernel<index_t><<<1, kScanThreads, 0, stream>>>(eq, plan.units, eq_scan);
    chunk_mask_kernel<K><<<grid, kThreads, 0, stream>>>(x, length, cps, plan.units, sel, eq_scan, out, head, tail);
  }
  merge_edges_kernel<<<grid_for(segments), kThreads, 0, stream>>>(segments, length, n, head, tail, out);
  return cudaGetLastError();
}

// ---------------------------------------------------------------- compaction

// counts[c] (and counts32[c] when given) <- the set bits of mask bytes
// [c * chunk_bytes, (c + 1) * chunk_bytes), bits at or past n ignored.
__global__ void __launch_bounds__(kThreads)
    chunk_counts_kernel(const std::uint8_t* __restrict__ mask, index_t n, index_t chunk_bytes, index_t chunks,
                        index_t* __restrict__ counts, std::int32_t* __restrict__ counts32) {
  __shared__ index_t smem[kThreads / kWarp];
  const index_t nbytes = ceil_div(n, 8);
  for (index_t c = blockIdx.x; c < chunks; c += gridDim.x) {  // block-uniform
    const index_t b0 = c * chunk_bytes;
    const index_t b1 = b0 + chunk_bytes < nbytes ? b0 + chunk_bytes : nbytes;
    index_t count = 0;
    for (index_t b = b0 + threadIdx.x; b < b1; b += blockDim.x) count += sparse::popcount32(sparse::mask_byte(mask, b, n));
    index_t total;
    group_exclusive_scan<kThreads>(count, &total, smem);
    if (threadIdx.x == 0) {
      counts[c] = total;
      if (counts32 != nullptr) counts32[c] = static_cast<std::int32_t>(total);
    }
  }
}

// Calls f(i, p) for every set bit i (flat index) of chunk c's mask bytes, p its rank among
// all set bits (from starts[c] on): a byte per thread per round, ranks by a block scan.
template <typename F>
__device__ __forceinline__ void for_each_set(const std::uint8_t* __restrict__ mask, index_t n, index_t chunk_bytes,
                                             index_t c, index_t start, index_t* smem, F f) {
  const index_t nbytes = ceil_div(n, 8);
  const index_t b0 = c * chunk_bytes;
  const index_t b1 = b0 + chunk_bytes < nbytes ? b0 + chunk_bytes : nbytes;
  index_t pos = start;
  for (index_t base = b0; base < b1; base += blockDim.x) {  // block-uniform
    const index_t b = base + threadIdx.x;
    const std::uint32_t v = b < b1 ? sparse::mask_byte(mask, b, n) : 0u;
    index_t total;
    index_t p = pos + group_exclusive_scan<kThreads>(sparse::popcount32(v), &total, smem);
    for (std::uint32_t m = v; m != 0u; m &= m - 1u) f(8 * b + (__ffs(static_cast<int>(m)) - 1), p++);
    pos += total;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    compact_kernel(const T* __restrict__ x, const std::uint8_t* __restrict__ mask, index_t n, index_t chunk_bytes,
                   index_t chunks, const index_t* __restrict__ starts, index_t kept, T* __restrict__ out) {
  __shared__ index_t smem[kThreads / kWarp];
  for (index_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    for_each_set(mask, n, chunk_bytes, c, starts[c], smem, [&](index_t i, index_t p) {
      if (p < kept) out[p] = x[i];
    });
  }
}

// Every element of the chunk is written: values at the set bits (0 past nvalues), 0 elsewhere.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    scatter_kernel(const std::uint8_t* __restrict__ mask, const T* __restrict__ values, index_t nvalues, index_t n,
                   index_t chunk_bytes, index_t chunks, const index_t* __restrict__ starts, T* __restrict__ out) {
  __shared__ index_t smem[kThreads / kWarp];
  const index_t nbytes = ceil_div(n, 8);
  for (index_t c = blockIdx.x; c < chunks; c += gridDim.x) {  // block-uniform
    const index_t b0 = c * chunk_bytes;
    const index_t b1 = b0 + chunk_bytes < nbytes ? b0 + chunk_bytes : nbytes;
    index_t pos = starts[c];
    for (index_t base = b0; base < b1; base += blockDim.x) {
      const index_t b = base + threadIdx.x;
      const std::uint32_t v = b < b1 ? sparse::mask_byte(mask, b, n) : 0u;
      index_t total;
      index_t p = pos + group_exclusive_scan<kThreads>(sparse::popcount32(v), &total, smem);
      if (b < b1) {
        for (int j = 0; j < 8 && 8 * b + j < n; ++j) {
          T w = 0;
          if ((v >> j) & 1u) {
            if (p < nvalues) w = values[p];
            ++p;
          }
          out[8 * b + j] = w;
        }
      }
      pos += total;
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    offsets_kernel(const std::uint8_t* __restrict__ mask, index_t n, index_t chunks, const index_t* __restrict__ starts,
                   index_t kept, std::uint16_t* __restrict__ offsets) {
  __shared__ index_t smem[kThreads / kWarp];
  constexpr index_t kBlockBytes = sparse::kOffsetBlock / 8;
  for (index_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const index_t first = c * sparse::kOffsetBlock;
    for_each_set(mask, n, kBlockBytes, c, starts[c], smem, [&](index_t i, index_t p) {
      if (p < kept) offsets[p] = static_cast<std::uint16_t>(i - first);
    });
  }
}

// out[total, kept) <- 0, total = *total_at (the mask's set bits): slots the mask left empty.
template <typename T>
__global__ void zero_tail_kernel(const index_t* __restrict__ total_at, index_t kept, T* __restrict__ out) {
  const index_t total = *total_at;
  for (index_t i = (total > 0 ? total : 0) + grid_start(); i < kept; i += grid_stride()) out[i] = 0;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    offsets_scatter_kernel(const std::uint16_t* __restrict__ offsets, index_t noffsets,
                           const std::int32_t* __restrict__ counts, const index_t* __restrict__ starts,
                           const T* __restrict__ values, index_t n, index_t blocks, T* __restrict__ out) {
  for (index_t blk = blockIdx.x; blk < blocks; blk += gridDim.x) {
    const index_t first = blk * sparse::kOffsetBlock;
    const index_t j0 = starts[blk] > 0 ? starts[blk] : 0;
    const index_t j1 = starts[blk] + counts[blk] < noffsets ? starts[blk] + counts[blk] : noffsets;
    for (index_t j = j0 + threadIdx.x; j < j1; j += blockDim.x) {
      const index_t i = first + offsets[j];
      if (i < n) out[i] = values[j];
    }
  }
}

unsigned int blocks_for(index_t work) {
  return static_cast<unsigned int>(work < 1 ? 1 : (work < kMaxBlocks ? work : kMaxBlocks));
}

// Per-chunk counts and their scan, in the workspace: returns the scan (chunks + 1 entries).
cudaError_t count_and_scan(const std::uint8_t* mask, index_t n, index_t chunk_bytes, void* workspace,
                           std::int32_t* counts32, index_t** starts_out, cudaStream_t stream) {
  const index_t chunks = sparse::compact_chunks(n, chunk_bytes);
  auto* counts = static_cast<index_t*>(workspace);
  auto* starts = reinterpret_cast<index_t*>(static_cast<unsigned char*>(workspace) +
                                            sparse::align256(chunks * static_cast<index_t>(sizeof(index_t))));
  if (chunks > 0) {
    chunk_counts_kernel<<<blocks_for(chunks), kThreads, 0, stream>>>(mask, n, chunk_bytes, chunks, counts, counts32);
  }
  exclusive_scan_kernel<index_t><<<1, kScanThreads, 0, stream>>>(counts, chunks, starts);
  *starts_out = starts;
  return cudaGetLastError();
}

template <typename T>
cudaError_t compact_as(const void* x, const std::uint8_t* mask, index_t n, index_t kept, void* out, void* workspace,
                       cudaStream_t stream) {
  const index_t chunks = sparse::compact_chunks(n, sparse::kMaskChunkBytes);
  index_t* starts = nullptr;
  const cudaError_t err = count_and_scan(mask, n, sparse::kMaskChunkBytes, workspace, nullptr, &starts, stream);
  if (err != cudaSuccess) return err;
  if (chunks > 0) {
    compact_kernel<T><<<blocks_for(chunks), kThreads, 0, stream>>>(
        static_cast<const T*>(x), mask, n, sparse::kMaskChunkBytes, chunks, starts, kept, static_cast<T*>(out));
  }
  if (kept > 0) zero_tail_kernel<T><<<grid_for(kept), kThreads, 0, stream>>>(starts + chunks, kept, static_cast<T*>(out));
  return cudaGetLastError();
}

template <typename T>
cudaError_t scatter_as(const std::uint8_t* mask, const void* values, index_t nvalues, index_t n, void* out,
                       void* workspace, cudaStream_t stream) {
  const index_t chunks = sparse::compact_chunks(n, sparse::kMaskChunkBytes);
  index_t* starts = nullptr;
  const cudaError_t err = count_and_scan(mask, n, sparse::kMaskChunkBytes, workspace, nullptr, &starts, stream);
  if (err != cudaSuccess) return err;
  if (chunks > 0) {
    scatter_kernel<T><<<blocks_for(chunks), kThreads, 0, stream>>>(mask, static_cast<const T*>(values), nvalues, n,
                                                                   sparse::kMaskChunkBytes, chunks, starts,
                                                                   static_cast<T*>(out));
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t offsets_scatter_as(const std::uint16_t* offsets, index_t noffsets, const std::int32_t* counts,
                               const void* values, index_t n, void* out, void* workspace, cudaStream_t stream) {
  const index_t blocks = ceil_div(n, sparse::kOffsetBlock);
  auto* starts = static_cast<index_t*>(workspace);
  cudaError_t err = cudaMemsetAsync(out, 0, static_cast<std::size_t>(n) * sizeof(T), stream);
  if (err != cudaSuccess) return err;
  exclusive_scan_kernel<std::int32_t><<<1, kScanThreads, 0, stream>>>(counts, blocks, starts);
  if (blocks > 0) {
    offsets_scatter_kernel<T><<<blocks_for(blocks), kThreads, 0, stream>>>(
        offsets, noffsets, counts, starts, static_cast<const T*>(values), n, blocks, static_cast<T*>(out));
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_topk_mask(const void* x, sparse::KeyKind kind, index_t n, index_t segments, index_t k,
                             std::uint8_t* out, void* workspace, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (segments <= 0 || n % segments != 0 || k < 0) return cudaErrorInvalidValue;
  switch (kind) {
    case sparse::KeyKind::kF32: return topk_as<sparse::KeyF32>(x, n, segments, k, out, workspace, stream);
    case sparse::KeyKind::kF32Coarse: return topk_as<sparse::KeyF32Coarse>(x, n, segments, k, out, workspace, stream);
    case sparse::KeyKind::kF16: return topk_as<sparse::KeyF16>(x, n, segments, k, out, workspace, stream);
    case sparse::KeyKind::kBF16: return topk_as<sparse::KeyBF16>(x, n, segments, k, out, workspace, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_mask_compact(const void* x, int word_bytes, const std::uint8_t* mask, index_t n, index_t kept,
                                void* out, void* workspace, cudaStream_t stream) {
  if (word_bytes == 4) return compact_as<std::uint32_t>(x, mask, n, kept, out, workspace, stream);
  if (word_bytes == 2) return compact_as<std::uint16_t>(x, mask, n, kept, out, workspace, stream);
  return cudaErrorInvalidValue;
}

cudaError_t launch_mask_scatter(const std::uint8_t* mask, const void* values, int word_bytes, index_t nvalues,
                                index_t n, void* out, void* workspace, cudaStream_t stream) {
  if (word_bytes == 4) return scatter_as<std::uint32_t>(mask, values, nvalues, n, out, workspace, stream);
  if (word_bytes == 2) return scatter_as<std::uint16_t>(mask, values, nvalues, n, out, workspace, stream);
  return cudaErrorInvalidValue;
}

cudaError_t launch_mask_offsets(const std::uint8_t* mask, index_t n, index_t kept, std::uint16_t* offsets,
                                std::int32_t* counts, void* workspace, cudaStream_t stream) {
  constexpr index_t kBlockBytes = sparse::kOffsetBlock / 8;
  const index_t chunks = sparse::compact_chunks(n, kBlockBytes);
  index_t* starts = nullptr;
  const cudaError_t err = count_and_scan(mask, n, kBlockBytes, workspace, counts, &starts, stream);
  if (err != cudaSuccess) return err;
  if (chunks > 0) {
    offsets_kernel<<<blocks_for(chunks), kThreads, 0, stream>>>(mask, n, chunks, starts, kept, offsets);
  }
  if (kept > 0) zero_tail_kernel<std::uint16_t><<<grid_for(kept), kThreads, 0, stream>>>(starts + chunks, kept, offsets);
  return cudaGetLastError();
}

cudaError_t launch_offsets_scatter(const std::uint16_t* offsets, index_t noffsets, const std::int32_t* counts,
                                   const void* values, int word_bytes, index_t n, void* out, void* workspace,
                                   cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (word_bytes == 4) {
    return offsets_scatter_as<std::uint32_t>(offsets, noffsets, counts, values, n, out, workspace, stream);
  }
  if (word_bytes == 2) {
    return offsets_scatter_as<std::uint16_t>(offsets, noffsets, counts, values, n, out, workspace, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace torchstash
