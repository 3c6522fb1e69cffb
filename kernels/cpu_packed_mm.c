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
 * (docs/benchmarks.md section 33).
 *
 * A row's arithmetic depends only on the row and the weights: the same instructions in the same
 * order whether the pass holds 1 or 16 rows and whichever thread runs its outputs (threads split the
 * outputs, never the inputs). So a position's logits do not depend on its pass, and `sd` stays exact
 * (tests/test_kernels_cpu_packed_mm.py checks rows bit for bit across pass widths and thread counts).
 * The numbers differ from PyTorch's kernels by float32 and bfloat16 rounding (the products are exact
 * here; PyTorch rounds nothing to bfloat16 but multiplies in float32).
 *
 * Built once per machine by viasd_kernels/cpu_packed_mm.py; where the compiler does not target
 * AVX-512 BF16 and VBMI (int4_pair's byte picks; Cooper Lake has BF16 without VBMI) the functions
 * return -2 and the engine keeps PyTorch's kernels.
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
 * kept in `buf` when `keep`) or read from `buf` */
static inline __attribute__((always_inline)) void int8_rows(int R, const uint16_t *x, int64_t K, int64_t n_here,
                                                            const int8_t *src, int keep, __m512i (*buf)[OUTS],
                                                            __m512 acc[][OUTS]) {
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
    case 1: int8_rows(1, x, K, n_here, src, keep, buf, acc); break;
    case 2: int8_rows(2, x, K, n_here, src, keep, buf, acc); break;
    case 3: int8_rows(3, x, K, n_here, src, keep, buf, acc); break;
    default: int8_rows(4, x, K, n_here, src, keep, buf, acc); break;
    }
}

/* the 16 lanes summed in a fixed tree (halves, then quarters, ...), times the scale, in bfloat16 */
static inline uint16_t int8_out(__m512 v, float scale) {
    __m256 h8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
    __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
    __m128 h1 = _mm_add_ss(h2, _mm_movehdup_ps(h2));
    __m128bh yb = _mm_cvtneps_pbh(_mm_set_ss(_mm_cvtss_f32(h1) * scale));
    uint16_t bits;
    memcpy(&bits, &yb, sizeof bits);
    return bits;
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
                int8_chunk(R, x + r0 * K, K, n_here, r0 == 0 ? q + n0 * K : NULL, M > CHUNK, buf, acc);
                for (int64_t j = 0; j < n_here; j++) {
                    uint32_t su = (uint32_t)scale[n0 + j] << 16;
                    float sc;
                    memcpy(&sc, &su, sizeof sc);
                    for (int r = 0; r < R; r++) {
                        const int64_t at = (r0 + r) * N + n0 + j;
                        const uint16_t y = int8_out(acc[r][j], sc);
                        out[at] = residual ? f32_to_bf16(bf16_to_f32(y) + bf16_to_f32(residual[at])) : y;
                    }
                }
            }
        }
        _mm_free(buf);
    }
    return failed ? -3 : 0;
#endif
}
