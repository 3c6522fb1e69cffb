/* Short passes (1-16 rows) over int4 weights with the rows quantized to int8, for CPUs with AVX2 and
 * FMA but no AVX-512 BF16 (viasd_kernels.cpu_int4_q8).
 *
 * The portable products (cpu_packed_mm.c) widen every weight to float32 and spend one float32
 * multiply-add a weight and row: on an AVX2 CPU the widening and the multiply-adds bound a 1-token
 * pass (docs/experiments/avx2-int4-nibble-staging.md). llama.cpp's AVX2 path instead multiplies the
 * weights' 4-bit codes by the activations quantized to int8 (vpmaddubsw: 32 byte products, summed in
 * pairs, an instruction). This file does the same over PyTorch's CPU int4 layout (blocks of B = 32
 * outputs, its AVX2 layout, or 64, its AVX-512 one), with these numbers, for each row and each group
 * of G inputs (G a multiple of 32, the weight's own groups):
 *
 *     a  = max |x[k]| over the group (float32; the rows are bfloat16, so exact)
 *     xq = rint(x[k] * (127 / a)), int8 (-127 .. 127; rounded to nearest, ties to even), 0 where a = 0
 *     d  = a / 127 (0 where a = 0)
 *     I  = sum of xq[k] * q[k] - 8 * sum of xq[k]               (exact, in integers: q the 4-bit code)
 *     X  = the group's sum of x[k] in float32 in a fixed tree: 8 lanes, lane l adding x[l], x[l + 8],
 *          ... in order from 0, then (l + (l + 4)) for l < 4, then ((0 + 2) + (1 + 3))
 *     y  = fma(X, zero, fma((float)I * d, scale, y))            (the groups in order)
 *
 * rounded once to bfloat16 (with the residual, where given, added as the other products add it).
 * The integer sums are exact, so their order is free: any tiling gives the same I. Everything else
 * is per row and per group, so a row's outputs do not depend on the other rows of its pass or on the
 * thread count (threads split the blocks of outputs): `sd` stays exact. The numbers are not the
 * portable products' (the activations keep 8 bits per group of G, as llama.cpp's q8 blocks of 32);
 * cpu_int4_q8.py's `int4_mm_q8_reference` computes them with PyTorch's operators, and
 * tests/kernels/test_kernels_cpu_int4_q8.py compares the two bit for bit.
 *
 * The loop: 4 inputs a step, each input's 16 bytes of a block slice (outputs j: low nibbles; j + B/2:
 * high), inputs k and k + 2 interleaved byte by byte in the low 128 bits and k + 1, k + 3 in the high
 * ones, so that one vpmaddubsw adds an output's two products; an int16 lane adds the products of up
 * to 32 inputs (at most 16 x 2 x 15 x 127 = 60960 in magnitude over both halves, each half under
 * 32767), then they are widened to int32 and the halves added.
 *
 * int8 weights (viasd_int8_mm_q8; [N, K], a bfloat16 scale an output: the int8 format's layers and
 * the int4 format's output head) take the rows quantized the same way, and each output, for each
 * group g in order, adds its 8 lanes' exact integer sums (lane l: inputs 4 l .. 4 l + 3 of the group,
 * vpmaddubsw over |w| and xq signed as w, then vpmaddwd) times d_g into 8 float32 lanes,
 *
 *     acc[l] = fma((float)I[g][l], d_g, acc[l])
 *
 * then y = scale * (((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))),
 * rounded once to bfloat16 (`int8_mm_q8_reference`).
 *
 * Built once per machine by cpu_int4_q8.py; where the compiler does not target AVX2 and FMA these
 * functions return -2 and the engine keeps cpu_packed_mm's products.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"
#include "viasd_kernels.h"
#if defined(__AVX2__) && defined(__FMA__)
#define VIASD_Q8 1
#include <immintrin.h>
#endif

#define Q8_MAX_ROWS 16
#define Q8_MAX_GROUP 256
#define Q8_CHUNK 32     /* inputs an int16 lane sums exactly */
#define Q8_TILE 2       /* rows a tile: 2 x 4 accumulators, 4 weight vectors */
#define Q8_PREFETCH 4096

int viasd_int4_q8_available(void) {
#ifdef VIASD_Q8
    return 1;
#else
    return 0;
#endif
}

#ifdef VIASD_Q8

/* 8 bfloat16 values as float32 */
static inline __m256 q8_load8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* Row r's groups: xq [K] int8 (input order), d [groups], t8 [groups] (8 x the sum of xq), X [groups] */
static void q8_quantize(const uint16_t *x, int64_t K, int64_t G, int8_t *xq, float *d, int32_t *t8, float *X) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t g = 0; g < K / G; g++) {
        const uint16_t *xg = x + g * G;
        __m256 amax = _mm256_setzero_ps(), lanes = _mm256_setzero_ps();
        for (int64_t i = 0; i < G; i += 8) {
            const __m256 v = q8_load8(xg + i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v));
            lanes = _mm256_add_ps(lanes, v);
        }
        float l[8], m[8];
        _mm256_storeu_ps(l, lanes);
        _mm256_storeu_ps(m, amax);
        X[g] = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
        float a = 0.0f;
        for (int i = 0; i < 8; i++)
            a = m[i] > a ? m[i] : a;
        const float id = a > 0.0f ? 127.0f / a : 0.0f;
        d[g] = a > 0.0f ? a / 127.0f : 0.0f;
        __m256i sum = _mm256_setzero_si256();
        const __m256 idv = _mm256_set1_ps(id);
        for (int64_t i = 0; i < G; i += 8) {
            const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(q8_load8(xg + i), idv));  /* MXCSR: nearest, even */
            sum = _mm256_add_epi32(sum, c);
            int32_t ci[8];
            _mm256_storeu_si256((__m256i *)ci, c);
            for (int j = 0; j < 8; j++)
                xq[g * G + i + j] = (int8_t)ci[j];
        }
        int32_t s[8];
        _mm256_storeu_si256((__m256i *)s, sum);
        t8[g] = 8 * (s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7]);
    }
}

/* Every row's groups quantized (q8_quantize): xq [M, K], d, t8, X [M, K / G] */
struct q8_rows {
    int8_t *xq;
    float *d, *X;
    int32_t *t8;
};

static void q8_rows_free(struct q8_rows *rows) {
    free(rows->xq);
    free(rows->d);
    free(rows->X);
    free(rows->t8);
}

/* 0, or -3 out of memory (nothing then held) */
static int q8_rows_quantize(struct q8_rows *rows, const uint16_t *x, int64_t M, int64_t K, int64_t G) {
    const int64_t groups = K / G;
    rows->xq = malloc((size_t)(M * K));
    rows->d = malloc(sizeof(float) * M * groups);
    rows->X = malloc(sizeof(float) * M * groups);
    rows->t8 = malloc(sizeof(int32_t) * M * groups);
    if (!rows->xq || !rows->d || !rows->X || !rows->t8) {
        q8_rows_free(rows);
        return -3;
    }
    for (int64_t r = 0; r < M; r++)
        q8_quantize(x + r * K, K, G, rows->xq + r * K, rows->d + r * groups, rows->t8 + r * groups,
                    rows->X + r * groups);
    return 0;
}

/* The two 16-byte slices of inputs k and k + 1 (`stride` bytes apart) in one vector */
static inline __m256i q8_pair(const uint8_t *at, int64_t stride) {
    if (stride == 16)
        return _mm256_loadu_si256((const __m256i *)at);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)at)),
                                   _mm_loadu_si128((const __m128i *)(at + stride)), 1);
}

/* One group of one 16-byte slice of a block (32 outputs: o_lo .. o_lo + 15 from the low nibbles,
 * o_hi .. o_hi + 15 from the high ones) for R rows (a constant where inlined): adds each output's
 * finished group into tot (rows B apart). at: the group's first input's slice; xq, d, t8, X: the
 * first row's (rows K and `groups` apart); gsz: the block's group's (scale, zero) pairs. */
static inline __attribute__((always_inline)) void q8_tile(const int R, const uint8_t *at, int64_t stride, int64_t G,
                                                          const int8_t *xq, int64_t K, const float *d,
                                                          const int32_t *t8, const float *X, int64_t groups,
                                                          const uint16_t *gsz, int o_lo, int o_hi, int B,
                                                          float *tot, int prefetch) {
    const __m256i low4 = _mm256_set1_epi8(15);
    const __m256i picks = _mm256_setr_epi8(0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2,
                                           1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3);
    __m256i isum[Q8_TILE][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++)
            isum[r][j] = _mm256_setzero_si256();
    for (int64_t c = 0; c < G; c += Q8_CHUNK) {
        __m256i acc[Q8_TILE][4];
        for (int r = 0; r < R; r++)
            for (int j = 0; j < 4; j++)
                acc[r][j] = _mm256_setzero_si256();
        for (int64_t k = c; k < c + Q8_CHUNK; k += 4) {
            const uint8_t *p = at + k * stride;
            if (prefetch)
                _mm_prefetch((const char *)(p + Q8_PREFETCH), _MM_HINT_T0);
            const __m256i v0 = q8_pair(p, stride), v1 = q8_pair(p + 2 * stride, stride);  /* [k | k+1], [k+2 | k+3] */
            const __m256i l0 = _mm256_and_si256(v0, low4), l1 = _mm256_and_si256(v1, low4);
            const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low4);
            const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low4);
            __m256i w[4];
            w[0] = _mm256_unpacklo_epi8(l0, l1);  /* outputs o_lo + 0..7: (k, k+2) low half, (k+1, k+3) high */
            w[1] = _mm256_unpackhi_epi8(l0, l1);  /* o_lo + 8..15 */
            w[2] = _mm256_unpacklo_epi8(h0, h1);  /* o_hi + 0..7 */
            w[3] = _mm256_unpackhi_epi8(h0, h1);  /* o_hi + 8..15 */
            for (int r = 0; r < R; r++) {
                int32_t four;
                memcpy(&four, xq + r * K + k, sizeof four);
                const __m256i xv = _mm256_shuffle_epi8(_mm256_set1_epi32(four), picks);
                for (int j = 0; j < 4; j++)
                    acc[r][j] = _mm256_add_epi16(acc[r][j], _mm256_maddubs_epi16(w[j], xv));
            }
        }
        for (int r = 0; r < R; r++)
            for (int j = 0; j < 4; j++) {
                const __m256i lo = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc[r][j]));
                const __m256i hi = _mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc[r][j], 1));
                isum[r][j] = _mm256_add_epi32(isum[r][j], _mm256_add_epi32(lo, hi));
            }
    }
    const __m256i top = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int j = 0; j < 4; j++) {
        const int o = (j < 2 ? o_lo : o_hi) + (j % 2) * 8;
        const __m256i pairs = _mm256_loadu_si256((const __m256i *)(gsz + 2 * o));  /* 8 (scale, zero) */
        const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
        const __m256 zero = _mm256_castsi256_ps(_mm256_and_si256(pairs, top));
        for (int r = 0; r < R; r++) {
            const __m256i i = _mm256_sub_epi32(isum[r][j], _mm256_set1_epi32(t8[r * groups]));
            const __m256 dd = _mm256_mul_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(d[r * groups]));
            __m256 y = _mm256_loadu_ps(tot + r * B + o);
            y = _mm256_fmadd_ps(dd, scale, y);
            y = _mm256_fmadd_ps(_mm256_set1_ps(X[r * groups]), zero, y);
            _mm256_storeu_ps(tot + r * B + o, y);
        }
    }
}

/* One thread's blocks of B outputs (B a constant where inlined; the enclosing parallel region's
 * static schedule shares them out): out [M, N] = the rows times the weight, plus residual where it
 * is not NULL. */
static inline __attribute__((always_inline)) void q8_thread(const int B, const int8_t *xq, const float *d,
                                                            const int32_t *t8, const float *X, const uint8_t *q,
                                                            const uint16_t *sz, int64_t M, int64_t N, int64_t K,
                                                            int64_t G, uint16_t *out, const uint16_t *residual) {
    const int64_t groups = K / G, blocks = N / B;
    float tot[Q8_MAX_ROWS * 64] __attribute__((aligned(32)));
#ifdef _OPENMP
    #pragma omp for schedule(static)
#endif
    for (int64_t nb = 0; nb < blocks; nb++) {
        memset(tot, 0, sizeof(float) * M * B);
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *bytes = q + (nb * K + g * G) * (B / 2);
            const uint16_t *gsz = sz + (nb * groups + g) * B * 2;
            for (int s = 0; s < B / 32; s++)
                for (int64_t r0 = 0; r0 < M; r0 += Q8_TILE) {
                    const int8_t *xr = xq + r0 * K + g * G;
                    const int64_t at = r0 * groups + g;
                    if (M - r0 >= 2)
                        q8_tile(2, bytes + s * 16, B / 2, G, xr, K, d + at, t8 + at, X + at, groups, gsz, s * 16,
                                B / 2 + s * 16, B, tot + r0 * B, r0 == 0);
                    else
                        q8_tile(1, bytes + s * 16, B / 2, G, xr, K, d + at, t8 + at, X + at, groups, gsz, s * 16,
                                B / 2 + s * 16, B, tot + r0 * B, r0 == 0);
                }
        }
        store_block_bf16(tot, M, B, out, residual, N, nb * B);
    }
}

static int q8_mm(const int B, const uint16_t *x, const uint8_t *q, const uint16_t *sz, int64_t M, int64_t N,
                 int64_t K, int64_t G, uint16_t *out, const uint16_t *residual, int threads) {
    if (M <= 0 || M > Q8_MAX_ROWS || N <= 0 || N % B || K <= 0 || G <= 0 || G > Q8_MAX_GROUP || G % Q8_CHUNK
        || K % G)
        return -1;
    struct q8_rows rows;
    if (q8_rows_quantize(&rows, x, M, K, G))
        return -3;
    const int8_t *xq = rows.xq;
    const float *d = rows.d, *X = rows.X;
    const int32_t *t8 = rows.t8;
    (void)threads;
#ifdef _OPENMP
    #pragma omp parallel num_threads(threads > 0 ? threads : 1)
#endif
    {
        if (B == 64)
            q8_thread(64, xq, d, t8, X, q, sz, M, N, K, G, out, residual);
        else
            q8_thread(32, xq, d, t8, X, q, sz, M, N, K, G, out, residual);
    }
    q8_rows_free(&rows);
    return 0;
}

/* Output n's 8 float32 lanes over every group for one row (xq, d the row's), K a multiple of 32 */
static inline __attribute__((always_inline)) __m256 q8_int8_lanes(const int8_t *w, const int8_t *xq, const float *d,
                                                                  int64_t K) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0, g = 0; k < K; k += 32, g++) {
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + k));
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + k));
        /* |w| * (xq signed as w): each pair at most 2 x 128 x 127, within int16 */
        const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
        const __m256i i = _mm256_madd_epi16(p, ones);  /* lane l: inputs 4 l .. 4 l + 3 */
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(d[g]), acc);
    }
    return acc;
}

static inline float q8_fold8(__m256 v) {
    float a[8];
    _mm256_storeu_ps(a, v);
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

#define Q8_INT8_OUTS 4  /* outputs a tile: their weights stay in L1 for every row */

static int q8_int8_mm(const uint16_t *x, const int8_t *q, const uint16_t *scale, int64_t M, int64_t N, int64_t K,
                      uint16_t *out, const uint16_t *residual, int threads) {
    if (M <= 0 || M > Q8_MAX_ROWS || N <= 0 || K <= 0 || K % Q8_CHUNK)
        return -1;
    const int64_t groups = K / Q8_CHUNK;
    struct q8_rows rows;
    if (q8_rows_quantize(&rows, x, M, K, Q8_CHUNK))
        return -3;
    const int64_t tiles = (N + Q8_INT8_OUTS - 1) / Q8_INT8_OUTS;
    (void)threads;
#ifdef _OPENMP
    #pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
#endif
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * Q8_INT8_OUTS, n_here = N - n0 < Q8_INT8_OUTS ? N - n0 : Q8_INT8_OUTS;
        _mm_prefetch((const char *)(q + (n0 + Q8_INT8_OUTS) * K), _MM_HINT_T0);
        for (int64_t r = 0; r < M; r++)
            for (int64_t j = 0; j < n_here; j++) {
                const int64_t n = n0 + j, at = r * N + n;
                const float sum = q8_fold8(q8_int8_lanes(q + n * K, rows.xq + r * K, rows.d + r * groups, K));
                const uint16_t y = f32_to_bf16(sum * bf16_to_f32(scale[n]));
                out[at] = bf16_add_residual(y, residual ? residual + at : NULL);
            }
    }
    q8_rows_free(&rows);
    return 0;
}

#endif /* VIASD_Q8 */

/* viasd_int4_mm's arguments and results, the weight in PyTorch's blocks of 32 outputs (AVX2's
 * layout) or 64 (AVX-512's), the scales block by block ([N / B, K / G, B, 2]); G a multiple of 32.
 * Returns 0, -1 for arguments it does not take, -2 where it was not built for AVX2 and FMA, -3 out
 * of memory. */
int viasd_int4_mm_q8_32(const uint16_t *x, const uint8_t *q, const uint16_t *sz, int64_t M, int64_t N, int64_t K,
                        int64_t group, uint16_t *out, const uint16_t *residual, int threads) {
#ifdef VIASD_Q8
    return q8_mm(32, x, q, sz, M, N, K, group, out, residual, threads);
#else
    (void)x, (void)q, (void)sz, (void)M, (void)N, (void)K, (void)group, (void)out, (void)residual, (void)threads;
    return -2;
#endif
}

int viasd_int4_mm_q8_64(const uint16_t *x, const uint8_t *q, const uint16_t *sz, int64_t M, int64_t N, int64_t K,
                        int64_t group, uint16_t *out, const uint16_t *residual, int threads) {
#ifdef VIASD_Q8
    return q8_mm(64, x, q, sz, M, N, K, group, out, residual, threads);
#else
    (void)x, (void)q, (void)sz, (void)M, (void)N, (void)K, (void)group, (void)out, (void)residual, (void)threads;
    return -2;
#endif
}

/* viasd_int8_mm's arguments and results (weight [N, K] int8, a bfloat16 scale an output), K a
 * multiple of 32, any N; the rows quantized as the int4 products quantize them. Returns 0, -1 for
 * arguments it does not take, -2 where it was not built for AVX2 and FMA, -3 out of memory. */
int viasd_int8_mm_q8(const uint16_t *x, const int8_t *q, const uint16_t *scale, int64_t M, int64_t N, int64_t K,
                     uint16_t *out, const uint16_t *residual, int threads) {
#ifdef VIASD_Q8
    return q8_int8_mm(x, q, scale, M, N, K, out, residual, threads);
#else
    (void)x, (void)q, (void)scale, (void)M, (void)N, (void)K, (void)out, (void)residual, (void)threads;
    return -2;
#endif
}
