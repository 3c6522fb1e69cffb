/* Short passes (1-16 rows) over int4 and int8 weights, each weight read once a pass
 * (viasd_kernels.cpu_packed_mm).
 *
 * PyTorch's CPU kernels for these formats widen the weight to float32 and multiply-add in float32
 * for every 4 rows of a pass: a 6-row verify pass streams and widens the weight twice and costs
 * about twice a 1-row pass. Here each weight is widened once a pass to bfloat16, exactly, and every
 * row takes it through AVX-512 BF16's pair dot product (vdpbf16ps: two bfloat16 products summed into
 * a float32 lane), which does twice the float32 multiply-adds an instruction.
 *
 * int4 (PyTorch's CPU layout, blocks of 64 outputs; the scales and zeros block by block, [N / 64,
 * K / group, 64, 2] bfloat16: cpu_packed_mm.py lays PyTorch's [K / group, N, 2] out so at bind time):
 * the weight is (q - 8) * scale + zero per group of `group` inputs. q - 8 is a small integer, exact in
 * bfloat16, so a row's output is computed group by group as
 *
 *     D = sum over the group's inputs of x[k] * (q[k] - 8)     (vdpbf16ps, pairs of inputs in order,
 *                                                               even and odd pairs in two lanes, then added)
 *     X = sum over the group's inputs of x[k]                  (float32, in input order)
 *     y = fma(X, zero, fma(D, scale, y))                       (groups in order)
 *
 * and rounded once to bfloat16. int8 (weight [N, K] int8, one bfloat16 scale an output): each output
 * is the dot product of the row with the output's weights, 32 inputs a step into 16 float32 lanes
 * (vdpbf16ps), the lanes summed in a fixed tree, times the scale, rounded once.
 *
 * A 1-token pass is bound by memory, not arithmetic: the weights stream once and nothing else should
 * stall them. In PyTorch's layout a block's scales sit one group every N * 4 bytes apart (a page
 * apart for N >= 1024), a demand miss and a page walk for every group of every block; laid out block
 * by block they are a second sequential stream. Passes of more rows do enough arithmetic a line for
 * the hardware's prefetcher to fall behind, so the int4 products ask for their weights 4 KB ahead
 * (a 6-row pass's products ~12% faster, a 1-row pass's unchanged) and the int8 ones 4 tiles ahead
 * (docs/experiments/int4-scales-blockwise-prefetch.md).
 *
 * A row's arithmetic depends only on the row and the weights: the same instructions in the same
 * order whether the pass holds 1 or 16 rows and whichever thread runs its outputs (threads split the
 * outputs, never the inputs). So a position's logits do not depend on its pass, and `sd` stays exact
 * (tests/kernels/test_kernels_cpu_packed_mm.py checks rows bit for bit across pass widths and thread
 * counts, and the portable products against cpu_packed_mm.py's int4_mm_portable_reference).
 * The numbers differ from PyTorch's kernels by float32 and bfloat16 rounding (the products are exact
 * here; PyTorch rounds nothing to bfloat16 but multiplies in float32).
 *
 * Built once per machine by viasd_kernels/cpu_packed_mm.py; where the compiler does not target
 * AVX-512 BF16 and VBMI (int4_pair's byte picks; Cooper Lake has BF16 without VBMI) these functions
 * return -2 and the engine takes the portable products at the end of this file instead.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"
#include "viasd_kernels.h"
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VBMI__)
#define VIASD_PACKED 1
#include <immintrin.h>
#endif

#define MAX_ROWS 16
#define BLOCK 64          /* outputs a block of PyTorch's AVX-512 int4 layout */
#define MAX_GROUP 256
#define PREFETCH 4096   /* bytes ahead that the int4 products ask for their weights */

int viasd_packed_mm_available(void) {
#ifdef VIASD_PACKED
    return 1;
#else
    return 0;
#endif
}

#ifdef VIASD_PACKED

static inline __m512 bf16x16_to_f32(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The byte picks of `int4_pair`: word 2 j + h of the result takes byte j (first) or 16 + j (second)
 * of input k + h's 32 bytes, which sit at 32 h in the pair's 64 */
static inline __m512i pair_picks(int second) {
    uint8_t idx[64];
    for (int i = 0; i < 32; i++) {
        int j = i / 2, h = i % 2;
        idx[2 * i] = idx[2 * i + 1] = (uint8_t)(h * 32 + second * 16 + j);
    }
    return _mm512_loadu_si512((const void *)idx);
}

/* The 4 weight vectors of input pair (k, k + 1) of a 64-output block: vector s holds outputs
 * 16 s .. 16 s + 15, each as (q[k] - 8, q[k + 1] - 8) in bfloat16. `pair` points at the pair's 64
 * bytes (input k's 32, then input k + 1's). The lookup (vpermw) reads only the low 5 bits of each
 * index word and its table holds the 16 values twice, so each word's bits above its 4-bit code
 * need no clearing. */
static inline void int4_pair(const uint8_t *pair, __m512i lut, __m512i first_picks, __m512i second_picks,
                             __m512i w[4]) {
    __m512i bytes = _mm512_loadu_si512((const void *)pair);
    __m512i first = _mm512_permutexvar_epi8(first_picks, bytes);    /* bytes 0-15: outputs 0-15, 32-47 */
    __m512i second = _mm512_permutexvar_epi8(second_picks, bytes);  /* bytes 16-31: outputs 16-31, 48-63 */
    w[0] = _mm512_permutexvar_epi16(first, lut);
    w[1] = _mm512_permutexvar_epi16(second, lut);
    w[2] = _mm512_permutexvar_epi16(_mm512_srli_epi16(first, 4), lut);
    w[3] = _mm512_permutexvar_epi16(_mm512_srli_epi16(second, 4), lut);
}

/* acc[r][s] += x[r] pair p . w[s] for R rows (R a constant where inlined) */
static inline __attribute__((always_inline)) void pair_dot(int R, const int32_t *const *xs, int64_t p, const __m512i *w,
                                                           __m512 acc[][4]) {
    for (int r = 0; r < R; r++) {
        __m512bh xp = (__m512bh)_mm512_set1_epi32(xs[r][p]);
        for (int s = 0; s < 4; s++)
            acc[r][s] = _mm512_dpbf16_ps(acc[r][s], xp, (__m512bh)w[s]);
    }
}

/* y[r][.] = fma(X, zero, fma(D, scale, y)) for one group */
static inline void int4_finish(int R, __m512 acc[][4], const float *xsum, const uint16_t *sz, float *tot) {
    for (int s = 0; s < 4; s++) {
        __m512i pairs = _mm512_loadu_si512((const void *)(sz + s * 32));  /* 16 (scale, zero) */
        __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
        __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xFFFF0000u)));
        for (int r = 0; r < R; r++) {
            __m512 y = _mm512_loadu_ps(tot + r * BLOCK + s * 16);
            y = _mm512_fmadd_ps(acc[r][s], scale, y);
            y = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r]), zero, y);
            _mm512_storeu_ps(tot + r * BLOCK + s * 16, y);
        }
    }
}

/* One group of a 64-output block for rows r0 .. r0 + R - 1, the weights widened now (`rows` set:
 * kept in `buf` when `keep`) or read from `buf` */
static inline __attribute__((always_inline)) void int4_rows(int R, const int32_t *const *xg, int64_t pairs,
                                                            const uint8_t *rows, const __m512i *consts, int keep,
                                                            __m512i (*buf)[4], const float *xsg, const uint16_t *gsz,
                                                            float *tot) {
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int s = 0; s < 4; s++)
            acc[r][s] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        if (rows) {
            __m512i w[4];
            _mm_prefetch((const char *)(rows + p * 64 + PREFETCH), _MM_HINT_T0);
            int4_pair(rows + p * 64, consts[0], consts[1], consts[2], w);
            if (keep)
                for (int s = 0; s < 4; s++)
                    buf[p][s] = w[s];
            pair_dot(R, xg, p, w, acc);
        } else {
            pair_dot(R, xg, p, buf[p], acc);
        }
    }
    int4_finish(R, acc, xsg, gsz, tot);
}

#define CHUNK 4  /* rows that share one read of the widened weights */

static void int4_chunk(int R, const int32_t *const *xg, int64_t pairs, const uint8_t *rows, const __m512i *consts,
                       int keep,
                       __m512i (*buf)[4], const float *xsg, const uint16_t *gsz, float *tot) {
    switch (R) {  /* a constant row count for each body */
    case 1: int4_rows(1, xg, pairs, rows, consts, keep, buf, xsg, gsz, tot); break;
    case 2: int4_rows(2, xg, pairs, rows, consts, keep, buf, xsg, gsz, tot); break;
    case 3: int4_rows(3, xg, pairs, rows, consts, keep, buf, xsg, gsz, tot); break;
    default: int4_rows(4, xg, pairs, rows, consts, keep, buf, xsg, gsz, tot); break;
    }
}

/* A block's outputs rounded once to bfloat16; with `residual` (the same shape as out), each then
 * added to its residual in float32 and rounded again: PyTorch's `residual + y` of two bfloat16
 * tensors, bit for bit */
static inline void store_bf16(const float *tot, int64_t M, uint16_t *out, const uint16_t *residual, int64_t N,
                              int64_t n0) {
    for (int64_t r = 0; r < M; r++)
        for (int s = 0; s < 4; s++) {
            __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(tot + r * BLOCK + s * 16));
            if (residual) {
                __m256i res = _mm256_loadu_si256((const __m256i *)(residual + r * N + n0 + s * 16));
                h = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(bf16x16_to_f32(h), bf16x16_to_f32(res)));
            }
            _mm256_storeu_si256((__m256i *)(out + r * N + n0 + s * 16), h);
        }
}
#endif

/* out [M, N] bfloat16 = x [M, K] bfloat16 times the int4 weight (q [N, K / 2] uint8 in blocks of 64
 * outputs, sz [N / 64, K / group, 64, 2] bfloat16), plus `residual` [M, N] bfloat16 where it is not
 * NULL (see store_bf16). Returns 0; -1 for arguments it does not take; -2 where
 * the build has no AVX-512 BF16; -3 out of memory. */
int viasd_int4_mm(const uint16_t *x, const uint8_t *q, const uint16_t *sz, int64_t M, int64_t N, int64_t K,
                  int64_t group, uint16_t *out, const uint16_t *residual, int threads) {
#ifndef VIASD_PACKED
    (void)x; (void)q; (void)sz; (void)M; (void)N; (void)K; (void)group; (void)out; (void)residual; (void)threads;
    return -2;
#else
    if (M <= 0 || M > MAX_ROWS || N <= 0 || N % BLOCK || K <= 0 || group <= 0 || group > MAX_GROUP
        || group % 2 || K % group)
        return -1;
    const int64_t groups = K / group, pairs = group / 2;
    /* each row's sum over each group (float32, in input order) */
    float *xsums = malloc(sizeof(float) * M * groups);
    if (!xsums)
        return -3;
    for (int64_t r = 0; r < M; r++)
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int64_t k = 0; k < group; k++) {
                uint32_t u = (uint32_t)x[r * K + g * group + k] << 16;
                float f;
                memcpy(&f, &u, sizeof f);
                s += f;
            }
            xsums[r * groups + g] = s;
        }
    /* the bfloat16 of q - 8 for q = 0..15, repeated for both halves of the lookup */
    static const uint16_t lut_bits[32] = {
        0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
        0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
        0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
        0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0};
    const __m512i consts[3] = {_mm512_loadu_si512((const void *)lut_bits), pair_picks(0), pair_picks(1)};
    const int64_t blocks = N / BLOCK;
    #pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static)
    for (int64_t nb = 0; nb < blocks; nb++) {
        float tot[MAX_ROWS * BLOCK];
        __m512i buf[MAX_GROUP / 2][4];
        memset(tot, 0, sizeof(float) * M * BLOCK);
        for (int64_t g = 0; g < groups; g++) {
            const int32_t *xg[MAX_ROWS];
            for (int64_t r = 0; r < M; r++)
                xg[r] = (const int32_t *)(x + r * K + g * group);
            const uint8_t *rows = q + (nb * K + g * group) * (BLOCK / 2);
            const uint16_t *gsz = sz + (nb * groups + g) * BLOCK * 2;
            float xsg[MAX_ROWS];
            for (int64_t r = 0; r < M; r++)
                xsg[r] = xsums[r * groups + g];
            /* the first rows as each pair is widened; the widened pairs kept for the other rows */
            for (int64_t r0 = 0; r0 < M; r0 += CHUNK) {
                const int R = M - r0 < CHUNK ? (int)(M - r0) : CHUNK;
                int4_chunk(R, xg + r0, pairs, r0 == 0 ? rows : NULL, consts, M > CHUNK, buf, xsg + r0, gsz,
                           tot + r0 * BLOCK);
            }
        }
        store_bf16(tot, M, out, residual, N, nb * BLOCK);
    }
    free(xsums);
    return 0;
#endif
}

#ifdef VIASD_PACKED
#define OUTS 4            /* int8 outputs widened together */
#define MAX_K8 8192       /* int8 inputs held widened for the other rows */

/* The 16-lane sums of OUTS outputs for rows r0 .. r0 + R - 1, the weights widened now (`src` set:
 * kept in `buf` when `keep`) or read from `buf`. `gs` (NULL: one scale an output, applied later) the
 * first output's scales of its groups of 32 inputs, the next output's K / 32 on: each group's pair
 * dot products summed into zero lanes, then added to the lanes times the group's scale (fma) */
static inline __attribute__((always_inline)) void int8_rows(int R, const uint16_t *x, int64_t K, int64_t n_here,
                                                            const int8_t *src, int keep, __m512i (*buf)[OUTS],
                                                            __m512 acc[][OUTS], const float *gs) {
    for (int r = 0; r < R; r++)
        for (int j = 0; j < OUTS; j++)
            acc[r][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512i w[OUTS];
        for (int j = 0; j < OUTS; j++) {
            if (j >= n_here) {
                w[j] = _mm512_setzero_si512();
            } else if (src) {
                const int8_t *at = src + j * K + k;
                _mm_prefetch((const char *)(at + 4 * OUTS * K), _MM_HINT_T0);  /* 4 tiles ahead (measured) */
                __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)at)));
                __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(at + 16))));
                w[j] = (__m512i)_mm512_cvtne2ps_pbh(b, a);  /* inputs k .. k + 31 in order, exact */
                if (keep)
                    buf[k / 32][j] = w[j];
            } else {
                w[j] = buf[k / 32][j];
            }
        }
        if (gs) {
            __m512 sc[OUTS];
            for (int j = 0; j < OUTS; j++)
                sc[j] = _mm512_set1_ps(gs[(j < n_here ? j : 0) * (K / 32) + k / 32]);
            for (int r = 0; r < R; r++) {
                __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + r * K + k));
                for (int j = 0; j < OUTS; j++)
                    acc[r][j] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), xv, (__m512bh)w[j]), sc[j],
                                                acc[r][j]);
            }
            continue;
        }
        for (int r = 0; r < R; r++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + r * K + k));
            for (int j = 0; j < OUTS; j++)
                acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, (__m512bh)w[j]);
        }
    }
}

static void int8_chunk(int R, const uint16_t *x, int64_t K, int64_t n_here, const int8_t *src, int keep,
                       __m512i (*buf)[OUTS], __m512 acc[][OUTS]) {
    switch (R) {  /* a constant row count for each body */
    case 1: int8_rows(1, x, K, n_here, src, keep, buf, acc, NULL); break;
    case 2: int8_rows(2, x, K, n_here, src, keep, buf, acc, NULL); break;
    case 3: int8_rows(3, x, K, n_here, src, keep, buf, acc, NULL); break;
    default: int8_rows(4, x, K, n_here, src, keep, buf, acc, NULL); break;
    }
}

/* int8_chunk over scales by groups of 32 (`gs`: int8_rows) */
static void int8g_chunk(int R, const uint16_t *x, int64_t K, int64_t n_here, const int8_t *src, int keep,
                        __m512i (*buf)[OUTS], __m512 acc[][OUTS], const float *gs) {
    switch (R) {
    case 1: int8_rows(1, x, K, n_here, src, keep, buf, acc, gs); break;
    case 2: int8_rows(2, x, K, n_here, src, keep, buf, acc, gs); break;
    case 3: int8_rows(3, x, K, n_here, src, keep, buf, acc, gs); break;
    default: int8_rows(4, x, K, n_here, src, keep, buf, acc, gs); break;
    }
}

/* the 16 lanes summed in a fixed tree (halves, then quarters, ...) */
static inline float int8_sum(__m512 v) {
    __m256 h8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
    __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
    return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
}

/* int8_sum times the scale, in bfloat16 */
static inline uint16_t int8_out(__m512 v, float scale) {
    __m128bh yb = _mm_cvtneps_pbh(_mm_set_ss(int8_sum(v) * scale));
    uint16_t bits;
    memcpy(&bits, &yb, sizeof bits);
    return bits;
}
#endif

#ifdef VIASD_PACKED
/* The AVX-512 BF16 int8 products: viasd_int8_mm (`scale` one bfloat16 an output, `out` and `residual`
 * bfloat16) and viasd_int8g_mm (`gs` float32 scales by groups of 32, `out32` and `residual32` float32,
 * not rounded). */
static int b8_mm(const uint16_t *x, const int8_t *q, const uint16_t *scale, const float *gs, int64_t M, int64_t N,
                 int64_t K, uint16_t *out, float *out32, const uint16_t *residual, const float *residual32,
                 int threads) {
    if (M <= 0 || M > MAX_ROWS || N <= 0 || K <= 0 || K % 32 || K > MAX_K8)
        return -1;
    const int64_t tiles = (N + OUTS - 1) / OUTS;
    int failed = 0;
    #pragma omp parallel num_threads(threads > 0 ? threads : 1) reduction(|| : failed)
    {
        __m512i (*buf)[OUTS] = M > CHUNK ? _mm_malloc(sizeof(__m512i) * OUTS * (K / 32), 64) : NULL;
        failed = M > CHUNK && !buf;
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (failed)
                continue;  /* this thread's outputs stay unwritten: the call returns -3 */
            const int64_t n0 = t * OUTS, n_here = N - n0 < OUTS ? N - n0 : OUTS;
            for (int64_t r0 = 0; r0 < M; r0 += CHUNK) {
                const int R = M - r0 < CHUNK ? (int)(M - r0) : CHUNK;
                __m512 acc[CHUNK][OUTS];
                const int8_t *src = r0 == 0 ? q + n0 * K : NULL;
                if (gs) {
                    int8g_chunk(R, x + r0 * K, K, n_here, src, M > CHUNK, buf, acc, gs + n0 * (K / 32));
                    for (int64_t j = 0; j < n_here; j++)
                        for (int r = 0; r < R; r++) {
                            const int64_t at = (r0 + r) * N + n0 + j;
                            out32[at] = residual32 ? residual32[at] + int8_sum(acc[r][j]) : int8_sum(acc[r][j]);
                        }
                    continue;
                }
                int8_chunk(R, x + r0 * K, K, n_here, src, M > CHUNK, buf, acc);
                for (int64_t j = 0; j < n_here; j++) {
                    uint32_t su = (uint32_t)scale[n0 + j] << 16;
                    float sc;
                    memcpy(&sc, &su, sizeof sc);
                    for (int r = 0; r < R; r++) {
                        const int64_t at = (r0 + r) * N + n0 + j;
                        const uint16_t y = int8_out(acc[r][j], sc);
                        out[at] = bf16_add_residual(y, residual ? residual + at : NULL);
                    }
                }
            }
        }
        _mm_free(buf);
    }
    return failed ? -3 : 0;
}
#endif

/* out [M, N] bfloat16 = (x [M, K] bfloat16 times q [N, K] int8, transposed) times scale [N] bfloat16,
 * plus `residual` [M, N] bfloat16 where it is not NULL (as store_bf16).
 * K a multiple of 32, at most MAX_K8. Returns 0, -1, -2 or -3 as viasd_int4_mm. */
int viasd_int8_mm(const uint16_t *x, const int8_t *q, const uint16_t *scale, int64_t M, int64_t N, int64_t K,
                  uint16_t *out, const uint16_t *residual, int threads) {
#ifndef VIASD_PACKED
    (void)x; (void)q; (void)scale; (void)M; (void)N; (void)K; (void)out; (void)residual; (void)threads;
    return -2;
#else
    return b8_mm(x, q, scale, NULL, M, N, K, out, NULL, residual, NULL, threads);
#endif
}

/* out [M, N] float32 = x [M, K] bfloat16 times q [N, K] int8, transposed, each output's groups of 32
 * inputs times their float32 scale gs [N, K / 32] (a GGUF file's Q8_0 blocks, exactly): per group the
 * pair dot products (vdpbf16ps) into zero lanes, added to the output's lanes times the scale (fma,
 * groups in order), the lanes summed in int8_sum's tree; not rounded to bfloat16 (logits), plus
 * `residual` [M, N] float32 where it is not NULL. K a multiple of 32, at most MAX_K8. Returns 0, -1,
 * -2 or -3 as viasd_int4_mm. */
int viasd_int8g_mm(const uint16_t *x, const int8_t *q, const float *gs, int64_t M, int64_t N, int64_t K, float *out,
                   const float *residual, int threads) {
#ifndef VIASD_PACKED
    (void)x; (void)q; (void)gs; (void)M; (void)N; (void)K; (void)out; (void)residual; (void)threads;
    return -2;
#else
    return b8_mm(x, q, NULL, gs, M, N, K, NULL, out, NULL, residual, threads);
#endif
}

/* ------------------------------------------------------------------------------------------------
 * The portable products: CPUs without AVX-512 BF16 (AVX2 + FMA, AVX-512F Xeons before Sapphire
 * Rapids, NEON, anything GCC's and clang's vector extensions compile for). Each weight is read once
 * a pass and widened exactly to float32 (int4: q - 8; int8: the code), and every row multiplies it
 * in float32, one multiply-add a weight (fused wherever the build targets FMA: each update is the
 * one expression `a + b * c`, inlined alike everywhere). Vectors are 16 float32 lanes (one AVX-512
 * register, two AVX2 ones, four NEON ones), so the arithmetic is the same whichever of them.
 *
 * int4 (PyTorch's CPU layout in blocks of B = 64 outputs, AVX-512's, or B = 32, AVX2's: for each
 * input, B / 2 bytes whose low nibbles are outputs 0 .. B / 2 - 1 and high nibbles B / 2 .. B - 1;
 * the scales block by block, [N / B, K / group, B, 2] bfloat16): the lanes are outputs, so each
 * output is its own sequence over its inputs, in order
 *
 *     D = fma(x[k], q[k] - 8, D)                               (k over the group)
 *     y = fma(X, zero, fma(D, scale, y))                       (groups in order; X = the group's sum of x,
 *                                                               float32 in input order, as the BF16 path)
 *
 * and rounded once to bfloat16. int8 (weight [N, K], a bfloat16 scale an output): the lanes are
 * inputs, 16 at a time, acc = fma(x[k .. k + 15], q[k .. k + 15], acc), the 16 lanes summed in a
 * fixed tree (lane l + lane l + 8, then + 4, + 2, + 1), times the scale, rounded once.
 *
 * Rows go in tiles that share each widened weight vector in registers (P_ROWS rows; a 1-row int8
 * pass takes more outputs at once, so that enough loads are in flight to stream the weights at the
 * memory's speed); where a pass holds more rows than a tile, the first tile keeps what it widened in
 * a small buffer (a group's, or a tile of outputs') that the others read, so every weight is widened
 * once a pass. A 1-row pass on AVX2 runs two groups of a block side by side (each output's D of each
 * group its own sequence, the groups finished in order), so that 8 accumulators, not 4, hide the
 * multiply-add's latency; there each group's nibbles are first split into signed bytes q - 8 for the
 * whole group (stage_nibbles), then widened 8 at a time from memory (the widening bounds that pass:
 * the mask or shift and the subtraction now take 5 byte operations for 64 weights, not 2 for every 8
 * in 32-bit lanes). The tiling changes which registers hold a lane, never the lane's operations: a
 * row's outputs are the same in a pass of 1 or 16 rows and on any thread count (threads split the
 * outputs).
 * The numbers differ from the BF16 path's (float32 products of float32 weights here) by rounding. */

typedef int8_t vs16 __attribute__((vector_size(16)));
typedef uint8_t vb16 __attribute__((vector_size(16)));
typedef int16_t vw16 __attribute__((vector_size(32)));


#if defined(__AVX512F__)
#define VL 16           /* float32 lanes of the int4 product's vectors (its lanes are outputs: any width
                           gives the same numbers) */
#define P_ROWS 4        /* rows of a tile: 4 x 4 accumulators of an int4 block of 64 */
#define P_SLICES 2      /* 16-byte slices of an input's B / 2 bytes a tile widens: the whole block */
#define P8_OUTS 4       /* int8 outputs of a tile of several rows */
#define P8_ROW1_OUTS 8  /* int8 outputs of a 1-row tile */
#include <immintrin.h>
#elif defined(__AVX2__)
#define VL 8
#define P_ROWS 2        /* 16 registers: 2 rows x 4 accumulators, 4 weight vectors */
#define P_SLICES 1
#define P8_OUTS 2
#define P8_ROW1_OUTS 4
#include <immintrin.h>
#else
#define VL 4            /* SSE2, NEON, ... */
#define P_ROWS 2
#define P_SLICES 1
#define P8_OUTS 2
#define P8_ROW1_OUTS 4
#endif
#define P_PAIR_GROUPS (VL == 8)  /* whether a 1-row pass runs two groups at once (p4_tile) */
#define P8_AHEAD 1      /* int8 tiles ahead that a tile asks for its weights */
#define NV (16 / VL)    /* vectors of 16 outputs */

typedef float vfn __attribute__((vector_size(VL * 4)));
typedef uint32_t vun __attribute__((vector_size(VL * 4)));

#if VL == 4  /* the widening in vector extensions (x86-64 has intrinsics above) */
/* 16 signed bytes as float32, exactly (through 16 and 32 bits: GCC 12 compiles the direct
 * conversion one lane at a time) */
static inline __attribute__((always_inline)) void bytes_to_f32(vs16 b, vf16 *out) {
    *out = __builtin_convertvector(__builtin_convertvector(__builtin_convertvector(b, vw16), vi16), vf16);
}
#endif

/* Whether the build fuses the portable products' multiply-adds (FMA targeted), for the Python side's
 * description of the path. */
int viasd_packed_mm_fma(void) {
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA) || defined(__aarch64__)
    return 1;
#else
    return 0;
#endif
}

#if VL != 8
/* An input's 16 bytes of a block, widened exactly: w[0 .. NV) the low nibbles - 8 (outputs j),
 * w[NV .. 2 NV) the high nibbles - 8 (outputs j + B / 2), float32 (AVX2: stage_nibbles below) */
static inline __attribute__((always_inline)) void widen_nibbles(const uint8_t *p, vfn *w) {
#if defined(__AVX512F__)
    const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));  /* the lookup reads 4 bits */
    w[0] = (vfn)_mm512_permutexvar_ps(d, table);
    w[1] = (vfn)_mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), table);
#else
    vb16 b;
    memcpy(&b, p, sizeof b);
    vf16 lo, hi;
    bytes_to_f32((vs16)(b & 15) - 8, &lo);
    bytes_to_f32((vs16)(b >> 4) - 8, &hi);
    memcpy(w, &lo, sizeof lo);
    memcpy(w + NV, &hi, sizeof hi);
#endif
}
#endif

#if VL == 8
/* AVX2: a group's nibbles of one 16-byte slice (an input's bytes `stride` apart) as signed bytes
 * q - 8, two inputs a step in 32-byte vectors: lo[k] the low nibbles (outputs j), hi[k] the high
 * ones (outputs j + B / 2). p4_tile widens them 8 at a time from memory (vpmovsxbd, then
 * vcvtdq2ps). Exact: q - 8 is -8 .. 7. */
static inline __attribute__((always_inline)) void stage_nibbles(const uint8_t *at, const int64_t stride, int64_t G,
                                                                int8_t (*lo)[16], int8_t (*hi)[16]) {
    const __m256i low4 = _mm256_set1_epi8(15), eight = _mm256_set1_epi8(8);
    for (int64_t k = 0; k < G; k += 2) {  /* G is even */
        __m256i b;
        if (stride == 16) {
            b = _mm256_loadu_si256((const __m256i *)(at + k * 16));
            __builtin_prefetch(at + k * 16 + PREFETCH, 0, 3);
        } else {
            b = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(at + k * stride))),
                                        _mm_loadu_si128((const __m128i *)(at + (k + 1) * stride)), 1);
            __builtin_prefetch(at + k * stride + PREFETCH, 0, 3);
            __builtin_prefetch(at + (k + 1) * stride + PREFETCH, 0, 3);
        }
        _mm256_store_si256((__m256i *)lo[k], _mm256_sub_epi8(_mm256_and_si256(b, low4), eight));
        _mm256_store_si256((__m256i *)hi[k], _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(b, 4), low4), eight));
    }
}

/* the 8 staged weights at p as float32 */
static inline __attribute__((always_inline)) vfn staged8(const int8_t *p) {
    return (vfn)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#endif

/* NG groups (1, or 2 for a 1-row tile) of a block of B outputs, slices slice0 .. slice0 + S - 1, for
 * R rows (R, NG, S, B and MODE constants where inlined): xf the rows' float32 inputs of the first
 * group (K apart), `bytes` its weights (the next group's G * B / 2 on), xs the rows' sums of the
 * first group (`groups` apart), gsz its B (scale, zero) pairs (the next group's B * 2 on), tot the
 * rows' running outputs (B apart). MODE 0: widen; 1: widen and keep in buf; 2: read buf. Two groups
 * run their inputs side by side, each output's D of each group its own sequence, and are finished in
 * order: a 1-row tile's 4 accumulators (AVX2) would otherwise wait on the multiply-add's latency. */
static inline __attribute__((always_inline)) void p4_tile(const int R, const int NG, const int S, const int B,
                                                          const int MODE, const float *xf, int64_t K,
                                                          const uint8_t *bytes, int64_t G, int slice0, vfn *buf,
                                                          const float *xs, int64_t groups, const uint16_t *gsz,
                                                          float *tot) {
    vfn acc[2][P_ROWS][2 * NV * P_SLICES];
    for (int g = 0; g < 2; g++)  /* all of them: the ones past NG, R and S are dropped when inlined */
        for (int r = 0; r < P_ROWS; r++)
            for (int j = 0; j < 2 * NV * P_SLICES; j++)
                acc[g][r][j] = (vfn){0};
#if VL == 8
    int8_t lo[MODE == 2 ? 1 : NG][MODE == 2 ? 1 : MAX_GROUP][16] __attribute__((aligned(32)));
    int8_t hi[MODE == 2 ? 1 : NG][MODE == 2 ? 1 : MAX_GROUP][16] __attribute__((aligned(32)));
    if (MODE != 2)
        for (int g = 0; g < NG; g++)
            stage_nibbles(bytes + g * G * (B / 2) + slice0 * 16, B / 2, G, lo[g], hi[g]);
#endif
    for (int64_t k = 0; k < G; k++)
        for (int g = 0; g < NG; g++) {
            vfn w[2 * NV * P_SLICES];
            if (MODE == 2) {
                for (int j = 0; j < 2 * NV * S; j++)
                    w[j] = buf[k * 2 * NV * S + j];
            } else {
#if VL == 8
                w[0] = staged8(lo[g][k]);
                w[1] = staged8(lo[g][k] + 8);
                w[2] = staged8(hi[g][k]);
                w[3] = staged8(hi[g][k] + 8);
#else
                const uint8_t *at = bytes + (g * G + k) * (B / 2) + slice0 * 16;
                __builtin_prefetch(at + PREFETCH, 0, 3);
                for (int s = 0; s < S; s++)
                    widen_nibbles(at + 16 * s, w + 2 * NV * s);
#endif
                if (MODE == 1)
                    for (int j = 0; j < 2 * NV * S; j++)
                        buf[k * 2 * NV * S + j] = w[j];
            }
            for (int r = 0; r < R; r++) {
                const float xv = xf[r * K + g * G + k];
                for (int j = 0; j < 2 * NV * S; j++)
                    acc[g][r][j] = acc[g][r][j] + xv * w[j];  /* the one update of every output's D */
            }
        }
    for (int g = 0; g < NG; g++)
        for (int j = 0; j < 2 * NV * S; j++) {
            const int s = j / (2 * NV), h = j % (2 * NV) / NV, v = j % NV;
            const int o = h * (B / 2) + (slice0 + s) * 16 + v * VL;  /* the VL outputs of acc[.][.][j] */
            vun pairs, sb, zb;
            memcpy(&pairs, gsz + g * B * 2 + 2 * o, sizeof pairs);  /* VL (scale, zero): scale the low half */
            sb = pairs << 16;
            zb = pairs & 0xFFFF0000u;
            vfn scale, zero;
            memcpy(&scale, &sb, sizeof scale);
            memcpy(&zero, &zb, sizeof zero);
            for (int r = 0; r < R; r++) {
                vfn y;
                memcpy(&y, tot + r * B + o, sizeof y);
                y = y + acc[g][r][j] * scale;
                y = y + xs[r * groups + g] * zero;
                memcpy(tot + r * B + o, &y, sizeof y);
            }
        }
}

/* The rows' float32 inputs xf [M, K] and group sums xsums [M, K / G] (float32, in input order); 0, -1
 * for arguments the int4 products do not take (blocks of B), -3 out of memory */
static int p4_setup(int64_t B, const uint16_t *x, int64_t M, int64_t N, int64_t K, int64_t G, float **xf,
                    float **xsums) {
    *xf = *xsums = NULL;
    if (M <= 0 || M > MAX_ROWS || N <= 0 || N % B || K <= 0 || G <= 0 || G > MAX_GROUP || G % 2 || K % G)
        return -1;
    const int64_t groups = K / G;
    *xf = malloc(sizeof(float) * M * K);
    *xsums = malloc(sizeof(float) * M * groups);
    if (!*xf || !*xsums) {
        free(*xf);
        free(*xsums);
        return -3;
    }
    for (int64_t r = 0; r < M; r++)
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int64_t k = g * G; k < (g + 1) * G; k++) {
                (*xf)[r * K + k] = bf16_to_f32(x[r * K + k]);
                s += (*xf)[r * K + k];
            }
            (*xsums)[r * groups + g] = s;
        }
    return 0;
}

/* a row tile of p4_thread, with a constant row count and mode for each body */
#if P_ROWS > 2
#define P4_TILES(MODE)                                                                                          \
    switch (M - r0 < P_ROWS ? M - r0 : P_ROWS) {                                                                \
    case 1: p4_tile(1, 1, S, B, MODE, xr, K, bytes, G, s0, buf, xs, groups, gsz, t); break;                        \
    case 2: p4_tile(2, 1, S, B, MODE, xr, K, bytes, G, s0, buf, xs, groups, gsz, t); break;                        \
    case 3: p4_tile(3, 1, S, B, MODE, xr, K, bytes, G, s0, buf, xs, groups, gsz, t); break;                        \
    default: p4_tile(P_ROWS, 1, S, B, MODE, xr, K, bytes, G, s0, buf, xs, groups, gsz, t); break;                  \
    }
#else
#define P4_TILES(MODE)                                                                                          \
    switch (M - r0 < P_ROWS ? M - r0 : P_ROWS) {                                                                \
    case 1: p4_tile(1, 1, S, B, MODE, xr, K, bytes, G, s0, buf, xs, groups, gsz, t); break;                        \
    default: p4_tile(P_ROWS, 1, S, B, MODE, xr, K, bytes, G, s0, buf, xs, groups, gsz, t); break;                  \
    }
#endif

/* One thread's blocks of B outputs (B a constant where inlined; the blocks shared out by the
 * enclosing parallel region's static schedule): out [M, N] bfloat16 = x [M, K] times the int4 weight,
 * plus residual where it is not NULL (rounded first, then added in float32 and rounded again).
 * Returns whether this thread ran out of memory (its outputs then stay unwritten). The parallel
 * region is the exported function's own, so that B is a constant in the code it outlines. */
static inline __attribute__((always_inline)) int p4_thread(const int B, const float *xf, const float *xsums,
                                                           const uint8_t *q, const uint16_t *sz, int64_t M,
                                                           int64_t N, int64_t K, int64_t G, uint16_t *out,
                                                           const uint16_t *residual) {
    const int64_t groups = K / G, blocks = N / B;
    const int S = P_SLICES < B / 32 ? P_SLICES : B / 32;
    vfn *buf = M > P_ROWS ? aligned_alloc(64, sizeof(vfn) * 2 * NV * S * G) : NULL;
    float tot[MAX_ROWS * 64] __attribute__((aligned(64)));
    const int failed = M > P_ROWS && !buf;
#ifdef _OPENMP
    #pragma omp for schedule(static)
#endif
    for (int64_t nb = 0; nb < blocks; nb++) {
        if (failed)
            continue;
        memset(tot, 0, sizeof(float) * M * B);
        for (int64_t g = 0, ng; g < groups; g += ng) {
            const uint8_t *bytes = q + (nb * K + g * G) * (B / 2);
            const uint16_t *gsz = sz + (nb * groups + g) * B * 2;
            ng = P_PAIR_GROUPS && M == 1 && g + 1 < groups ? 2 : 1;
            for (int s0 = 0; s0 < B / 32; s0 += S)
                for (int64_t r0 = 0; r0 < M; r0 += P_ROWS) {
                    const float *xr = xf + r0 * K + g * G, *xs = xsums + r0 * groups + g;
                    float *t = tot + r0 * B;
                    if (ng == 2) {
                        p4_tile(1, 2, S, B, 0, xr, K, bytes, G, s0, buf, xs, groups, gsz, t);
                    } else if (r0 > 0) {
                        P4_TILES(2)
                    } else if (M > P_ROWS) {
                        P4_TILES(1)
                    } else {
                        P4_TILES(0)
                    }
                }
        }
        store_block_bf16(tot, M, B, out, residual, N, nb * B);
    }
    free(buf);
    return failed;
}

#ifdef _OPENMP
#define P_PARALLEL _Pragma("omp parallel num_threads(threads > 0 ? threads : 1) reduction(|| : failed)")
#else
#define P_PARALLEL
#endif

/* viasd_int4_mm's arguments and results, the weight in PyTorch's blocks of 64 outputs (AVX-512's
 * layout) or 32 (AVX2's); the portable arithmetic above. Returns 0, -1 for arguments it does not
 * take, -3 out of memory. */
int viasd_int4_mm_portable64(const uint16_t *x, const uint8_t *q, const uint16_t *sz, int64_t M, int64_t N,
                             int64_t K, int64_t group, uint16_t *out, const uint16_t *residual, int threads) {
    float *xf, *xsums;
    int failed = p4_setup(64, x, M, N, K, group, &xf, &xsums);
    if (failed)
        return failed;
    (void)threads;
    P_PARALLEL
    failed = p4_thread(64, xf, xsums, q, sz, M, N, K, group, out, residual);
    free(xf);
    free(xsums);
    return failed ? -3 : 0;
}

int viasd_int4_mm_portable32(const uint16_t *x, const uint8_t *q, const uint16_t *sz, int64_t M, int64_t N,
                             int64_t K, int64_t group, uint16_t *out, const uint16_t *residual, int threads) {
    float *xf, *xsums;
    int failed = p4_setup(32, x, M, N, K, group, &xf, &xsums);
    if (failed)
        return failed;
    (void)threads;
    P_PARALLEL
    failed = p4_thread(32, xf, xsums, q, sz, M, N, K, group, out, residual);
    free(xf);
    free(xsums);
    return failed ? -3 : 0;
}

/* 16 int8 weights as NV float32 vectors, exactly */
static inline __attribute__((always_inline)) void widen_bytes(const int8_t *p, vfn *w) {
#if defined(__AVX512F__)
    w[0] = (vfn)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    w[0] = (vfn)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    w[1] = (vfn)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))));
#else
    vs16 b;
    vf16 f;
    memcpy(&b, p, sizeof b);
    bytes_to_f32(b, &f);
    memcpy(w, &f, sizeof f);
#endif
}

#if VL == 16
/* The lane sums of 16 vectors, s[i] = v[i]'s 16 lanes added in a fixed tree: lane l + lane l + 8
 * (l < 8), then l + l + 4 (l < 4), then (0 + 2) + (1 + 3); each add serves several sums (the picks
 * are vector constructors, compiled to shuffles). cpu_f32_mm.c's tree. */
#define HALVES(a, b, o) (vf16){a[o], a[o + 1], a[o + 2], a[o + 3], a[o + 4], a[o + 5], a[o + 6], a[o + 7], \
                               b[o], b[o + 1], b[o + 2], b[o + 3], b[o + 4], b[o + 5], b[o + 6], b[o + 7]}
#define QUARTERS(a, b, o) (vf16){a[o], a[o + 1], a[o + 2], a[o + 3], a[o + 8], a[o + 9], a[o + 10], a[o + 11], \
                                 b[o], b[o + 1], b[o + 2], b[o + 3], b[o + 8], b[o + 9], b[o + 10], b[o + 11]}
#define PAIRS(a, b, o) (vf16){a[o], a[o + 1], b[o], b[o + 1], a[o + 4], a[o + 5], b[o + 4], b[o + 5], \
                              a[o + 8], a[o + 9], b[o + 8], b[o + 9], a[o + 12], a[o + 13], b[o + 12], b[o + 13]}
#define SINGLES(a, b, o) (vf16){a[o], a[o + 2], b[o], b[o + 2], a[o + 4], a[o + 6], b[o + 4], b[o + 6], \
                                a[o + 8], a[o + 10], b[o + 8], b[o + 10], a[o + 12], a[o + 14], b[o + 12], b[o + 14]}

static inline __attribute__((always_inline)) void fold16(const vf16 *v, float *s) {
    vf16 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)
        t[i] = HALVES(v[2 * i], v[2 * i + 1], 0) + HALVES(v[2 * i], v[2 * i + 1], 8);
    for (int i = 0; i < 4; i++)
        u[i] = QUARTERS(t[2 * i], t[2 * i + 1], 0) + QUARTERS(t[2 * i], t[2 * i + 1], 4);
    for (int i = 0; i < 2; i++)
        w[i] = PAIRS(u[2 * i], u[2 * i + 1], 0) + PAIRS(u[2 * i], u[2 * i + 1], 2);
    const vf16 r = SINGLES(w[0], w[1], 0) + SINGLES(w[0], w[1], 1);  /* lane 4q + e: v[4e + q]'s sum */
    for (int q = 0; q < 4; q++)
        for (int e = 0; e < 4; e++)
            s[4 * e + q] = r[4 * q + e];
}
#endif

/* s[i] = the 16 lanes (NV vectors) of sums v[0 .. n) added in that tree, whatever the vectors' width:
 * t[l] = lane l + lane l + 8, u[l] = t[l] + t[l + 4], then (u[0] + u[2]) + (u[1] + u[3]) */
static inline __attribute__((always_inline)) void fold_sums(int n, vfn (*v)[NV], float *s) {
#if VL == 16
    vf16 w[16] = {{0}};
    for (int i = 0; i < n; i++)
        w[i] = v[i][0];
    fold16(w, s);
#else
    for (int i = 0; i < n; i++) {
        float u[4];
#if VL == 8
        float t[8];
        const vfn tv = v[i][0] + v[i][1];
        memcpy(t, &tv, sizeof t);
        for (int l = 0; l < 4; l++)
            u[l] = t[l] + t[l + 4];
#else
        const vfn uv = (v[i][0] + v[i][2]) + (v[i][1] + v[i][3]);
        memcpy(u, &uv, sizeof u);
#endif
        s[i] = (u[0] + u[2]) + (u[1] + u[3]);
    }
#endif
}

/* The sums of outputs n0 .. n0 + J - 1 (`w0` the first's weights; those past n_here read the first's
 * and are dropped) for R rows (R, J, MODE constants where inlined): sums[r * J + j]. MODE as p4_tile,
 * buf [K / 16][J][NV]. `gs` (NULL: one scale an output, applied later) the first output's scales of
 * its groups of 32 inputs, the next output's K / 32 on: each group summed into zero lanes, then added
 * to the output's lanes times the group's scale (one multiply-add a lane). */
static inline __attribute__((always_inline)) void p8_tile(const int R, const int J, const int MODE, const float *xf,
                                                          int64_t K, const int8_t *w0, int64_t n_here, vfn *buf,
                                                          float *sums, const float *gs) {
    vfn acc[P_ROWS * (P8_ROW1_OUTS > P8_OUTS ? P8_ROW1_OUTS : P8_OUTS)][NV];
    vfn grp[P_ROWS * (P8_ROW1_OUTS > P8_OUTS ? P8_ROW1_OUTS : P8_OUTS)][NV];
    for (int i = 0; i < R * J; i++)
        for (int v = 0; v < NV; v++)
            acc[i][v] = grp[i][v] = (vfn){0};
    for (int64_t k = 0; k < K; k += 16) {
        vfn w[P8_ROW1_OUTS > P8_OUTS ? P8_ROW1_OUTS : P8_OUTS][NV];
        for (int j = 0; j < J; j++) {
            if (MODE == 2) {
                for (int v = 0; v < NV; v++)
                    w[j][v] = buf[((k / 16) * J + j) * NV + v];
            } else {
                const int8_t *at = w0 + (j < n_here ? j : 0) * K + k;
                __builtin_prefetch(at + P8_AHEAD * J * K, 0, 3);
                widen_bytes(at, w[j]);
                if (MODE == 1)
                    for (int v = 0; v < NV; v++)
                        buf[((k / 16) * J + j) * NV + v] = w[j][v];
            }
        }
        if (gs) {
            for (int r = 0; r < R; r++)
                for (int v = 0; v < NV; v++) {
                    vfn xv;
                    memcpy(&xv, xf + r * K + k + v * VL, sizeof xv);
                    for (int j = 0; j < J; j++)
                        grp[r * J + j][v] = grp[r * J + j][v] + xv * w[j][v];
                }
            if (k % 32 == 16)  /* the group's end */
                for (int j = 0; j < J; j++) {
                    const float g = gs[(j < n_here ? j : 0) * (K / 32) + k / 32];
                    for (int r = 0; r < R; r++)
                        for (int v = 0; v < NV; v++) {
                            acc[r * J + j][v] = acc[r * J + j][v] + grp[r * J + j][v] * g;
                            grp[r * J + j][v] = (vfn){0};
                        }
                }
            continue;
        }
        for (int r = 0; r < R; r++)
            for (int v = 0; v < NV; v++) {
                vfn xv;
                memcpy(&xv, xf + r * K + k + v * VL, sizeof xv);
                for (int j = 0; j < J; j++)
                    acc[r * J + j][v] = acc[r * J + j][v] + xv * w[j][v];  /* the one update of every output */
            }
    }
    fold_sums(R * J, acc, sums);
}

#if P_ROWS > 2
#define P8_TILES(MODE, GS)                                                                                         \
    switch (R) {                                                                                                \
    case 1: p8_tile(1, P8_OUTS, MODE, xr, K, w0, n_here, buf, sums, GS); break;                                    \
    case 2: p8_tile(2, P8_OUTS, MODE, xr, K, w0, n_here, buf, sums, GS); break;                                    \
    case 3: p8_tile(3, P8_OUTS, MODE, xr, K, w0, n_here, buf, sums, GS); break;                                    \
    default: p8_tile(P_ROWS, P8_OUTS, MODE, xr, K, w0, n_here, buf, sums, GS); break;                              \
    }
#else
#define P8_TILES(MODE, GS)                                                                                         \
    switch (R) {                                                                                                \
    case 1: p8_tile(1, P8_OUTS, MODE, xr, K, w0, n_here, buf, sums, GS); break;                                    \
    default: p8_tile(P_ROWS, P8_OUTS, MODE, xr, K, w0, n_here, buf, sums, GS); break;                              \
    }
#endif

/* The portable int8 products: viasd_int8_mm_portable (`scale` one bfloat16 an output, `out` and
 * `residual` bfloat16) and viasd_int8g_mm_portable (`gs` float32 scales by groups of 32, `out32` and
 * `residual32` float32, not rounded). */
static int p8_mm(const uint16_t *x, const int8_t *q, const uint16_t *scale, const float *gs, int64_t M, int64_t N,
                 int64_t K, uint16_t *out, float *out32, const uint16_t *residual, const float *residual32,
                 int threads) {
    if (M <= 0 || M > MAX_ROWS || N <= 0 || K <= 0 || K % (gs ? 32 : 16))
        return -1;
    float *xf = malloc(sizeof(float) * M * K);
    if (!xf)
        return -3;
    for (int64_t i = 0; i < M * K; i++)
        xf[i] = bf16_to_f32(x[i]);
    const int J = M == 1 ? P8_ROW1_OUTS : P8_OUTS;
    const int64_t tiles = (N + J - 1) / J;
    int failed = 0;
    (void)threads;
    P_PARALLEL
    {
        vfn *buf = M > P_ROWS ? aligned_alloc(64, sizeof(vfn) * NV * J * (K / 16)) : NULL;
        failed = M > P_ROWS && !buf;
#ifdef _OPENMP
        #pragma omp for schedule(static)
#endif
        for (int64_t t = 0; t < tiles; t++) {
            if (failed)
                continue;  /* this thread's outputs stay unwritten: the call returns -3 */
            const int64_t n0 = t * J, n_here = N - n0 < J ? N - n0 : J;
            const int8_t *w0 = q + n0 * K;
            const float *g0 = gs ? gs + n0 * (K / 32) : NULL;
            for (int64_t r0 = 0; r0 < M; r0 += P_ROWS) {
                const float *xr = xf + r0 * K;
                float sums[16];
                const int R = M - r0 < P_ROWS ? (int)(M - r0) : P_ROWS;
                if (gs) {  /* logits: once a pass, the tiles' modes not specialised */
                    if (M == 1) {
                        p8_tile(1, P8_ROW1_OUTS, 0, xr, K, w0, n_here, NULL, sums, g0);
                    } else if (r0 > 0) {
                        P8_TILES(2, g0)
                    } else if (M > P_ROWS) {
                        P8_TILES(1, g0)
                    } else {
                        P8_TILES(0, g0)
                    }
                    for (int64_t j = 0; j < n_here; j++)
                        for (int r = 0; r < R; r++) {
                            const int64_t at = (r0 + r) * N + n0 + j;
                            out32[at] = residual32 ? residual32[at] + sums[r * J + j] : sums[r * J + j];
                        }
                    continue;
                }
                if (M == 1) {
                    p8_tile(1, P8_ROW1_OUTS, 0, xr, K, w0, n_here, NULL, sums, NULL);
                } else if (r0 > 0) {
                    P8_TILES(2, NULL)
                } else if (M > P_ROWS) {
                    P8_TILES(1, NULL)
                } else {
                    P8_TILES(0, NULL)
                }
                for (int64_t j = 0; j < n_here; j++) {
                    const float sc = bf16_to_f32(scale[n0 + j]);
                    for (int r = 0; r < R; r++) {
                        const int64_t at = (r0 + r) * N + n0 + j;
                        const uint16_t y = f32_to_bf16(sums[r * J + j] * sc);
                        out[at] = bf16_add_residual(y, residual ? residual + at : NULL);
                    }
                }
            }
        }
        free(buf);
    }
    free(xf);
    return failed ? -3 : 0;
}

/* viasd_int8_mm's arguments and results (K a multiple of 16, any width); the portable arithmetic
 * above. Returns 0, -1 for arguments it does not take, -3 out of memory. */
int viasd_int8_mm_portable(const uint16_t *x, const int8_t *q, const uint16_t *scale, int64_t M, int64_t N,
                           int64_t K, uint16_t *out, const uint16_t *residual, int threads) {
    return p8_mm(x, q, scale, NULL, M, N, K, out, NULL, residual, NULL, threads);
}

/* viasd_int8g_mm's arguments and results (K a multiple of 32, any width), the portable arithmetic. */
int viasd_int8g_mm_portable(const uint16_t *x, const int8_t *q, const float *gs, int64_t M, int64_t N, int64_t K,
                            float *out, const float *residual, int threads) {
    return p8_mm(x, q, NULL, gs, M, N, K, NULL, out, NULL, residual, threads);
}
