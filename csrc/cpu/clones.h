// TS_CPU_CLONES: compile a hot function for AVX-512, AVX2 and baseline x86-64 and pick
// one at load time (GCC/Clang target_clones + ifunc), so the JIT-built library stays
// portable (no -march=native) yet vectorizes 32x32->64-bit products well where it can.
#pragma once

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__CUDACC__)
#define TS_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define TS_CPU_CLONES
#endif
