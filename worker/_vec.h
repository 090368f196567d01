/* worker/_vec.h: what the CPU kernels (_paged_attention.c, _cpu_ops.c) share: the 8-float vector type, its
 * loads, stores and lane select, the CLONES attribute for hot loops, and Cephes' expf polynomial. */
#ifndef KVGATE_VEC_H
#define KVGATE_VEC_H

#include <stdint.h>
#include <string.h>

/* 8 floats in a vector register (GCC/Clang vector extension: one ymm with AVX2, half a zmm with AVX-512,
 * two xmm otherwise); loads and stores through memcpy, which compile to unaligned vector moves. */
typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi" /* f8 values never cross a call: every helper is inlined */
#endif

/* Hot loops are compiled three times, for AVX-512, AVX2 with FMA ("x86-64-v3": a plain "avx2" clone has no
 * FMA and splits every multiply-add) and baseline x86-64, and the best is picked at load. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

static inline __attribute__((always_inline)) f8 load8(const float *p) {
    f8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void store8(float *p, f8 v) { memcpy(p, &v, sizeof v); }

/* lanes of a where mask is all ones, of b elsewhere (C has no ?: on vectors) */
static inline __attribute__((always_inline)) f8 select8(i8 mask, f8 a, f8 b) {
    i8 a_bits, b_bits;
    memcpy(&a_bits, &a, sizeof a_bits);
    memcpy(&b_bits, &b, sizeof b_bits);
    const i8 bits = (a_bits & mask) | (b_bits & ~mask);
    f8 v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* e^x = e^r * 2^n for x = n ln2 + r, |r| <= ln2 / 2 (the caller rounds n and keeps 2^n a normal float): e^r by
 * the minimax polynomial of Cephes' expf (about 1 ulp), 2^n added in the exponent bits. */
static inline __attribute__((always_inline)) f8 exp_reduced8(f8 x, i8 n_int) {
    const f8 n = __builtin_convertvector(n_int, f8);
    f8 r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    f8 p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    i8 bits;
    memcpy(&bits, &p, sizeof bits);
    bits += n_int << 23;
    memcpy(&p, &bits, sizeof p);
    return p;
}

#endif
