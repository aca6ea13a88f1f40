// TS_CPU_CLONES: compile a hot function for AVX-512, AVX2 and baseline x86-64 and pick
// one at load time (GCC/Clang target_clones + ifunc), so the JIT-built library stays
// portable (no -march=native) yet vectorizes 32x32->64-bit products well where it can.
// GCC clones for the x86-64-v4 and -v3 levels: "avx512f" alone lacks AVX512VL/BW/DQ,
// which the 32-bit-lane products and narrowing stores need (Philox took 156 us per 256K
// uniforms on the avx512f clone, 88 us on x86-64-v4, one thread, Zen 4).
#pragma once

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__CUDACC__)
#if !defined(__clang__) && __GNUC__ >= 12
#define TS_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TS_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#else
#define TS_CPU_CLONES
#endif
