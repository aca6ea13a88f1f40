// OpenMP loops for sign bits: where a float tensor is above zero (NaN counts as above),
// one bit per element in the bitpack layout, those bits back as 1.0 / 0.0, and a gradient
// kept where they are set (a ReLU's backward from its bits).
//
// Pack: tasks of kGrain output bytes; each span of elements is tested into a byte per element
// (a vectorized compare), then packed 8 to a byte. Unpack: tasks of kGrain input bytes, each
// byte spread into 8 elements. Leaf loops compiled per instruction set (clones.h).
#include <algorithm>
#include <cstring>

#include "clones.h"
#include "simd.h"
#include "torchstash/bitpack.h"
#include "torchstash/cpu_kernels.h"
#include "torchstash/signs.h"

namespace torchstash {
namespace cpu {
namespace {

constexpr index_t kGrain = index_t{1} << 13;  // bytes per task: 64K elements
constexpr index_t kSpanBytes = 256;           // bytes packed per span (2048 elements)

// above[k] <- 1 where !(x[k] <= 0), per element type.
TS_CPU_CLONES void above_f32(const float* x, index_t count, std::uint8_t* above) {
  for (index_t k = 0; k < count; ++k) above[k] = !(x[k] <= 0.0f) ? 1 : 0;
}

TS_CPU_CLONES void above_f64(const double* x, index_t count, std::uint8_t* above) {
  for (index_t k = 0; k < count; ++k) above[k] = !(x[k] <= 0.0) ? 1 : 0;
}

TS_CPU_CLONES void above_f16(const std::uint16_t* x, index_t count, std::uint16_t inf_bits, std::uint8_t* above) {
  for (index_t k = 0; k < count; ++k) above[k] = signs::above_bits16(x[k], inf_bits) ? 1 : 0;
}

TS_CPU_CLONES void pack_ones(const std::uint8_t* above, index_t bytes, std::uint8_t* out) {
  for (index_t j = 0; j < bytes; ++j) out[j] = bitpack::pack_full<1>(above + 8 * j);
}

void above(const void* x, SignKind kind, index_t first, index_t count, std::uint8_t* flags) {
  switch (kind) {
    case SignKind::kFloat32: return above_f32(static_cast<const float*>(x) + first, count, flags);
    case SignKind::kFloat64: return above_f64(static_cast<const double*>(x) + first, count, flags);
    default:
      return above_f16(static_cast<const std::uint16_t*>(x) + first, count, signs::inf_bits16(kind), flags);
  }
}

// Output bytes [j_lo, j_hi) of n elements.
void pack_range(const void* x, SignKind kind, index_t n, index_t j_lo, index_t j_hi, std::uint8_t* out) {
  std::uint8_t flags[8 * kSpanBytes];
  for (index_t j = j_lo; j < j_hi; j += kSpanBytes) {
    const index_t bytes = std::min(kSpanBytes, j_hi - j);
    const index_t count = std::min(8 * bytes, n - 8 * j);
    above(x, kind, 8 * j, count, flags);
    std::memset(flags + count, 0, static_cast<std::size_t>(8 * bytes - count));  // the last byte's unused bits
    pack_ones(flags, bytes, out + j);
  }
}

typedef std::uint32_t U16 __attribute__((vector_size(64)));
typedef std::uint32_t U8 __attribute__((vector_size(32)));
typedef std::uint16_t H32 __attribute__((vector_size(64)));
typedef std::uint64_t Q8 __attribute__((vector_size(64)));

// out[k] <- `one` where bit k of packed[0, bytes) is set, else 0: a byte (or two) broadcast to
// every lane, and-ed with the lane's bit (vectorizes in every clone).
TS_CPU_CLONES void spread32(const std::uint8_t* p, index_t bytes, std::uint32_t* out) {
  index_t j = 0;
  if (lanes() == 16) {
    const U16 bit = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768};
    for (; j + 2 <= bytes; j += 2) {
      const U16 w = U16{} + (static_cast<std::uint32_t>(p[j]) | (static_cast<std::uint32_t>(p[j + 1]) << 8));
      const U16 v = (w & bit) != 0u ? U16{} + signs::kOne32 : U16{};
      std::memcpy(out + 8 * j, &v, sizeof(v));
    }
  } else {  // a byte a step: 8 lanes, one AVX2 register (simd.h)
    const U8 bit = {1, 2, 4, 8, 16, 32, 64, 128};
    for (; j < bytes; ++j) {
      const U8 v = ((U8{} + p[j]) & bit) != 0u ? U8{} + signs::kOne32 : U8{};
      std::memcpy(out + 8 * j, &v, sizeof(v));
    }
  }
  for (; j < bytes; ++j) {
    for (int k = 0; k < 8; ++k) out[8 * j + k] = ((p[j] >> k) & 1u) != 0 ? signs::kOne32 : 0u;
  }
}

TS_CPU_CLONES void spread16(const std::uint8_t* p, index_t bytes, std::uint16_t one, std::uint16_t* out) {
  const H32 bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128,
                   1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
  index_t j = 0;
  for (; j + 4 <= bytes; j += 4) {
    H32 w;
    for (int l = 0; l < 32; ++l) w[l] = p[j + l / 8];
    const H32 v = (w & bit) != 0 ? H32{} + one : H32{};
    std::memcpy(out + 8 * j, &v, sizeof(v));
  }
  for (; j < bytes; ++j) {
    for (int k = 0; k < 8; ++k) out[8 * j + k] = ((p[j] >> k) & 1u) != 0 ? one : 0u;
  }
}

TS_CPU_CLONES void spread64(const std::uint8_t* p, index_t bytes, std::uint64_t* out) {
  const Q8 bit = {1, 2, 4, 8, 16, 32, 64, 128};
  for (index_t j = 0; j < bytes; ++j) {
    const Q8 v = ((Q8{} + p[j]) & bit) != 0u ? Q8{} + signs::kOne64 : Q8{};
    std::memcpy(out + 8 * j, &v, sizeof(v));
  }
}

// Elements [8 * j_lo, min(n, 8 * j_hi)).
void unpack_range(const std::uint8_t* packed, index_t n, SignKind kind, index_t j_lo, index_t j_hi, void* out) {
  const index_t full = std::min(j_hi, n / 8);  // bytes whose 8 elements are all wanted
  const index_t bytes = std::max<index_t>(0, full - j_lo);
  switch (kind) {
    case SignKind::kFloat32: spread32(packed + j_lo, bytes, static_cast<std::uint32_t*>(out) + 8 * j_lo); break;
    case SignKind::kFloat64: spread64(packed + j_lo, bytes, static_cast<std::uint64_t*>(out) + 8 * j_lo); break;
    default: spread16(packed + j_lo, bytes, signs::one_bits16(kind), static_cast<std::uint16_t*>(out) + 8 * j_lo);
  }
  for (index_t i = 8 * (j_lo + bytes); i < std::min(n, 8 * j_hi); ++i) {
    const bool on = bitpack::unpack_code(packed, i, 1) != 0;
    switch (kind) {
      case SignKind::kFloat32: static_cast<std::uint32_t*>(out)[i] = on ? signs::kOne32 : 0u; break;
      case SignKind::kFloat64: static_cast<std::uint64_t*>(out)[i] = on ? signs::kOne64 : 0u; break;
      default: static_cast<std::uint16_t*>(out)[i] = on ? signs::one_bits16(kind) : 0u; break;
    }
  }
}

// out[k] <- g[k] where bit k of packed[0, bytes) is set, else 0 (all bits clear: +0.0), per
// element width: the bit spread into a lane mask, as in spread*, and-ed with the gradient.
TS_CPU_CLONES void select32(const std::uint8_t* p, index_t bytes, const std::uint32_t* g, std::uint32_t* out) {
  index_t j = 0;
  if (lanes() == 16) {
    const U16 bit = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768};
    for (; j + 2 <= bytes; j += 2) {
      const U16 w = U16{} + (static_cast<std::uint32_t>(p[j]) | (static_cast<std::uint32_t>(p[j + 1]) << 8));
      U16 v;
      std::memcpy(&v, g + 8 * j, sizeof(v));
      v = (w & bit) != 0u ? v : U16{};
      std::memcpy(out + 8 * j, &v, sizeof(v));
    }
  } else {  // a byte a step: 8 lanes, one AVX2 register (simd.h)
    const U8 bit = {1, 2, 4, 8, 16, 32, 64, 128};
    for (; j < bytes; ++j) {
      U8 v;
      std::memcpy(&v, g + 8 * j, sizeof(v));
      v = ((U8{} + p[j]) & bit) != 0u ? v : U8{};
      std::memcpy(out + 8 * j, &v, sizeof(v));
    }
  }
  for (; j < bytes; ++j) {
    for (int k = 0; k < 8; ++k) out[8 * j + k] = ((p[j] >> k) & 1u) != 0 ? g[8 * j + k] : 0u;
  }
}

TS_CPU_CLONES void select16(const std::uint8_t* p, index_t bytes, const std::uint16_t* g, std::uint16_t* out) {
  const H32 bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128,
                   1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
  index_t j = 0;
  for (; j + 4 <= bytes; j += 4) {
    H32 w;
    for (int l = 0; l < 32; ++l) w[l] = p[j + l / 8];
    H32 v;
    std::memcpy(&v, g + 8 * j, sizeof(v));
    v = (w & bit) != 0 ? v : H32{};
    std::memcpy(out + 8 * j, &v, sizeof(v));
  }
  for (; j < bytes; ++j) {
    for (int k = 0; k < 8; ++k) out[8 * j + k] = ((p[j] >> k) & 1u) != 0 ? g[8 * j + k] : std::uint16_t{0};
  }
}

TS_CPU_CLONES void select64(const std::uint8_t* p, index_t bytes, const std::uint64_t* g, std::uint64_t* out) {
  const Q8 bit = {1, 2, 4, 8, 16, 32, 64, 128};
  for (index_t j = 0; j < bytes; ++j) {
    Q8 v;
    std::memcpy(&v, g + 8 * j, sizeof(v));
    v = ((Q8{} + p[j]) & bit) != 0u ? v : Q8{};
    std::memcpy(out + 8 * j, &v, sizeof(v));
  }
}

// Elements [8 * j_lo, min(n, 8 * j_hi)) of sign_select.
void select_range(const std::uint8_t* packed, const void* grad, index_t n, SignKind kind, index_t j_lo, index_t j_hi,
                  void* out) {
  const index_t full = std::min(j_hi, n / 8);
  const index_t bytes = std::max<index_t>(0, full - j_lo);
  const index_t first = 8 * j_lo;
  switch (kind) {
    case SignKind::kFloat32:
      select32(packed + j_lo, bytes, static_cast<const std::uint32_t*>(grad) + first,
               static_cast<std::uint32_t*>(out) + first);
      break;
    case SignKind::kFloat64:
      select64(packed + j_lo, bytes, static_cast<const std::uint64_t*>(grad) + first,
               static_cast<std::uint64_t*>(out) + first);
      break;
    default:
      select16(packed + j_lo, bytes, static_cast<const std::uint16_t*>(grad) + first,
               static_cast<std::uint16_t*>(out) + first);
  }
  for (index_t i = 8 * (j_lo + bytes); i < std::min(n, 8 * j_hi); ++i) {
    const bool on = bitpack::unpack_code(packed, i, 1) != 0;
    switch (kind) {
      case SignKind::kFloat32:
        static_cast<std::uint32_t*>(out)[i] = on ? static_cast<const std::uint32_t*>(grad)[i] : 0u;
        break;
      case SignKind::kFloat64:
        static_cast<std::uint64_t*>(out)[i] = on ? static_cast<const std::uint64_t*>(grad)[i] : 0u;
        break;
      default:
        static_cast<std::uint16_t*>(out)[i] = on ? static_cast<const std::uint16_t*>(grad)[i] : std::uint16_t{0};
    }
  }
}

}  // namespace

void sign_pack(const void* x, SignKind kind, index_t n, std::uint8_t* out, int num_threads) {
  const index_t bytes = ceil_div(n, 8);
  const index_t tasks = ceil_div(bytes, kGrain);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && tasks > 1)
  for (index_t t = 0; t < tasks; ++t) {
    pack_range(x, kind, n, t * kGrain, std::min(bytes, (t + 1) * kGrain), out);
  }
}

void sign_unpack(const std::uint8_t* packed, index_t n, SignKind kind, void* out, int num_threads) {
  const index_t bytes = ceil_div(n, 8);
  const index_t tasks = ceil_div(bytes, kGrain);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && tasks > 1)
  for (index_t t = 0; t < tasks; ++t) {
    unpack_range(packed, n, kind, t * kGrain, std::min(bytes, (t + 1) * kGrain), out);
  }
}

void sign_select(const std::uint8_t* packed, const void* grad, index_t n, SignKind kind, void* out, int num_threads) {
  const index_t bytes = ceil_div(n, 8);
  const index_t tasks = ceil_div(bytes, kGrain);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && tasks > 1)
  for (index_t t = 0; t < tasks; ++t) {
    select_range(packed, grad, n, kind, t * kGrain, std::min(bytes, (t + 1) * kGrain), out);
  }
}

}  // namespace cpu
}  // namespace torchstash
