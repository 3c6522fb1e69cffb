/* bfloat16 <-> float32 for viasd_kernels' C files, as PyTorch converts them (c10::BFloat16: a
 * bfloat16 is the top half of a float32; rounding to nearest, ties to even; a NaN becomes 0x7FC0),
 * one value or 16 lanes at a time. cpu_build.py hashes this header with every C file that
 * includes it, so a change here rebuilds them. */
#ifndef VIASD_CPU_BF16_H
#define VIASD_CPU_BF16_H

#include <stdint.h>
#include <string.h>

/* No fused multiply-add in a function: each product rounded on its own, as PyTorch's operators do.
 * GCC takes an attribute on the function (VIASD_NO_CONTRACT before it); clang ignores that attribute
 * and takes a pragma as the first line of the function's body (VIASD_NO_CONTRACT_BODY). Write both. */
#if defined(__clang__)
#define VIASD_NO_CONTRACT
#define VIASD_NO_CONTRACT_BODY _Pragma("clang fp contract(off)")
#else
#define VIASD_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#define VIASD_NO_CONTRACT_BODY
#endif

typedef float vf16 __attribute__((vector_size(64)));
typedef uint16_t vh16 __attribute__((vector_size(32)));
typedef uint32_t vu16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Branch-free, so that loops over it vectorize. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint16_t r = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)0x7FC0u : r;
}

/* The bfloat16 bits of 16 floats, each rounded as f32_to_bf16. */
static inline vh16 f32_to_bf16_16(vf16 f) {
    vu16 u;
    memcpy(&u, &f, sizeof u);
    vu16 r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    vu16 nan = (vu16)((u & 0x7FFFFFFFu) > 0x7F800000u);  /* all ones where NaN */
    r = (r & ~nan) | (0x7FC0u & nan);
    return __builtin_convertvector(r, vh16);
}

/* A product's bfloat16 output y, plus its residual where `residual` is not NULL: added in float32 and
 * rounded again, PyTorch's `residual + y` of two bfloat16 tensors, bit for bit. */
static inline uint16_t bf16_add_residual(uint16_t y, const uint16_t *residual) {
    return residual ? f32_to_bf16(bf16_to_f32(y) + bf16_to_f32(*residual)) : y;
}

/* A block of B outputs for M rows (tot [M, B] float32) rounded once to bfloat16 into out [M, N] from
 * column n0, each plus its residual ([M, N]) where `residual` is not NULL (bf16_add_residual). */
static inline void store_block_bf16(const float *tot, int64_t M, int B, uint16_t *out, const uint16_t *residual,
                                    int64_t N, int64_t n0) {
    for (int64_t r = 0; r < M; r++)
        for (int j = 0; j < B; j++)
            out[r * N + n0 + j] = bf16_add_residual(f32_to_bf16(tot[r * B + j]),
                                                    residual ? residual + r * N + n0 + j : NULL);
}

/* 16 floats rounded to bfloat16 values (kept as float32). */
static inline vf16 round_bf16_16(vf16 f) {
    vu16 u = __builtin_convertvector(f32_to_bf16_16(f), vu16) << 16;
    vf16 out;
    memcpy(&out, &u, sizeof out);
    return out;
}

/* 16 values from `base` + `at` elements: float32 (dtype 0) or bfloat16 widened exactly (dtype 1). */
static inline vf16 load16(const void *base, int64_t at, int dtype) {
    vf16 out;
    if (dtype == 0) {
        memcpy(&out, (const float *)base + at, sizeof out);
    } else {
        vh16 h;
        memcpy(&h, (const uint16_t *)base + at, sizeof h);
        vu16 u = __builtin_convertvector(h, vu16) << 16;
        memcpy(&out, &u, sizeof out);
    }
    return out;
}

/* 16 floats to `base` + `at` elements: as float32 (dtype 0) or rounded to bfloat16 (dtype 1). */
static inline void store16(void *base, int64_t at, vf16 f, int dtype) {
    if (dtype == 0) {
        memcpy((float *)base + at, &f, sizeof f);
    } else {
        vh16 h = f32_to_bf16_16(f);
        memcpy((uint16_t *)base + at, &h, sizeof h);
    }
}

#endif
