// OpenMP loops over the inline bitpack.h functions: one task per block of output
// (pack) or input (unpack) bytes, int64 indices throughout.
#include <algorithm>
#include <cstring>

#include "torchstash/bitpack.h"
#include "torchstash/cpu_kernels.h"

namespace torchstash {
namespace cpu {
namespace {

// Bytes per OpenMP task: large enough to amortise scheduling, small enough to balance.
constexpr index_t kGrain = index_t{1} << 16;

template <int BITS>
void pack_impl(const std::uint8_t* codes, index_t n, std::uint8_t* out, int num_threads) {
  constexpr int per = 8 / BITS;
  const index_t full = n / per;  // output bytes whose codes are all present
  const index_t tasks = ceil_div(full, kGrain);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && tasks > 1)
  for (index_t t = 0; t < tasks; ++t) {
    const index_t lo = t * kGrain;
    const index_t hi = std::min(full, lo + kGrain);
    if constexpr (BITS == 8) {
      std::memcpy(out + lo, codes + lo, static_cast<std::size_t>(hi - lo));
    } else {
      for (index_t j = lo; j < hi; ++j) out[j] = bitpack::pack_full<BITS>(codes + j * per);
    }
  }
  if (full * per < n) out[full] = bitpack::pack_byte(codes, n, full, BITS);
}

template <int BITS>
void unpack_impl(const std::uint8_t* packed, index_t n, std::uint8_t* out, int num_threads) {
  constexpr int per = 8 / BITS;
  const index_t full = n / per;  // input bytes whose codes are all wanted
  const index_t tasks = ceil_div(full, kGrain);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && tasks > 1)
  for (index_t t = 0; t < tasks; ++t) {
    const index_t lo = t * kGrain;
    const index_t hi = std::min(full, lo + kGrain);
    if constexpr (BITS == 8) {
      std::memcpy(out + lo, packed + lo, static_cast<std::size_t>(hi - lo));
    } else {
      for (index_t j = lo; j < hi; ++j) bitpack::unpack_full<BITS>(packed[j], out + j * per);
    }
  }
  for (index_t i = full * per; i < n; ++i) out[i] = bitpack::unpack_code(packed, i, BITS);
}

}  // namespace

void pack_bits(const std::uint8_t* codes, index_t n, int bits, std::uint8_t* out, int num_threads) {
  switch (bits) {
    case 1: return pack_impl<1>(codes, n, out, num_threads);
    case 2: return pack_impl<2>(codes, n, out, num_threads);
    case 4: return pack_impl<4>(codes, n, out, num_threads);
    default: return pack_impl<8>(codes, n, out, num_threads);
  }
}

void unpack_bits(const std::uint8_t* packed, index_t n, int bits, std::uint8_t* out, int num_threads) {
  switch (bits) {
    case 1: return unpack_impl<1>(packed, n, out, num_threads);
    case 2: return unpack_impl<2>(packed, n, out, num_threads);
    case 4: return unpack_impl<4>(packed, n, out, num_threads);
    default: return unpack_impl<8>(packed, n, out, num_threads);
  }
}

}  // namespace cpu
}  // namespace torchstash
