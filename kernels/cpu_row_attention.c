/* Row-invariant attention for short passes on a CPU (viasd_kernels.cpu_row_attention).
 *
 * Every query row attends over its own keys, and its numbers are a function of that row's query
 * and keys alone: the same whether the row is decoded alone (a 1-token pass) or inside a verify
 * block or a token tree's pass. Nothing in a row's arithmetic depends on how many rows the call
 * holds, which thread runs it, or where its buffers sit in memory:
 *
 *   s_i   = scale * dot(q, k_i)        over d in 16 fixed partial sums, then added in a fixed tree
 *   m     = max_i s_i
 *   p_i   = exp(s_i - m)               one polynomial (below), the same at every call
 *   den   = sum_i p_i                  in 16 fixed partial sums by i % 16, folded pairwise
 *   out_d = (sum_i p_i * v_i,d) / den  accumulated over i in order, each d on its own
 *
 * in float32 from float32 or bfloat16 inputs, keys visited in cache order. The row's keys are taken
 * 16 at a time from its first: the 16 dot products' partial sums are added together in one
 * transposing tree (each key's sum in the same lane-position order whichever keys sit beside it, the
 * last group padded with zeros), and the polynomial runs on 16 scores at a time, on vectors. A task
 * attends one row's query heads of one KV head, up to 4 heads of width 64 (2 of 128) at once, with
 * the head width, head count and dtype compiled in, so that their sums stay in registers.
 * Built once per machine by viasd_kernels/cpu_row_attention.py with the system C compiler.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"
#include "viasd_kernels.h"

#define LANES 16
#define MAX_HEAD_DIM 512
#define MAX_BLOCKS (MAX_HEAD_DIM / LANES)
#define MAX_GROUP 16

typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));

/* A vector's 16 lanes added pairwise, halves folded in a fixed order. */
static inline float fold(vf16 v) {
    union { vf16 v; vf8 h[2]; } a = {v};
    union { vf8 v; vf4 h[2]; } b = {a.h[0] + a.h[1]};
    vf4 c = b.h[0] + b.h[1];
    return (c[0] + c[2]) + (c[1] + c[3]);
}

/* exp(x) for x <= 0 (a score minus its row's max), 16 lanes at a time: Cephes' expf polynomial,
 * about 1 ulp. */
static inline vf16 exp16(vf16 x) {
    const vf16 lowest = {0};
    vi16 below = x < (lowest - 87.0f);
    union { vf16 f; vi16 i; } a = {x}, b = {lowest - 87.0f};
    a.i = (a.i & ~below) | (b.i & below);
    x = a.f;
    vf16 n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504088896341f - 0.5f, vi16), vf16);
    vf16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf16 p = lowest + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { vi16 i; vf16 f; } scale = {(__builtin_convertvector(n, vi16) + 127) << 23};
    return p * scale.f;
}

/* Each lane's larger value (a where neither is larger). */
static inline vf16 vmax(vf16 a, vf16 b) {
    vi16 gt = b > a;
    union { vf16 f; vi16 i; } x = {a}, y = {b};
    x.i = (x.i & ~gt) | (y.i & gt);
    return x.f;
}

/* The lanes of a and b that the 16 constant indices name (0-15 a's, 16-31 b's): a permutation, no
 * arithmetic. __builtin_shufflevector is clang's and GCC's (12 and later); older GCCs have only
 * __builtin_shuffle, which clang lacks. */
#ifndef __has_builtin
#define __has_builtin(x) 0
#endif
#if __has_builtin(__builtin_shufflevector)
#define PICK(a, b, ...) ((vf16)__builtin_shufflevector(a, b, __VA_ARGS__))
#else
#define PICK(a, b, ...) __builtin_shuffle(a, b, (vi16){__VA_ARGS__})
#endif
#define LO8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define HI8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define LO4 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27
#define HI4 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31
#define LO2 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29
#define HI2 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31
#define LO1 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define HI1 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31

/* The lane sums of 16 vectors: out[i] = sum of v[i]'s 16 lanes, in a fixed tree (halves, quarters,
 * pairs, lanes), each sum's order set by i alone. */
static inline vf16 sum16(vf16 v[16]) {
    vf16 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)  /* keys 2i, 2i + 1: 8 partial sums each */
        a[i] = PICK(v[2 * i], v[2 * i + 1], LO8) + PICK(v[2 * i], v[2 * i + 1], HI8);
    for (int i = 0; i < 4; i++)  /* keys 4i .. 4i + 3: 4 each */
        b[i] = PICK(a[2 * i], a[2 * i + 1], LO4) + PICK(a[2 * i], a[2 * i + 1], HI4);
    for (int i = 0; i < 2; i++)  /* keys 8i .. 8i + 7: 2 each */
        c[i] = PICK(b[2 * i], b[2 * i + 1], LO2) + PICK(b[2 * i], b[2 * i + 1], HI2);
    /* keys 0-15, one sum each, in the order 0 1 | 2 3 | ... of the lanes (a, b, c kept keys in order) */
    return PICK(c[0], c[1], LO1) + PICK(c[0], c[1], HI1);
}

/* Each of R heads' scores (row r at scores + r * padded, nk of them) to exp(s - m[r]), m[r] the
 * largest (its max is the same in any order), in place, and their sum into den[r]: 16 at a time, in 16 partial sums by i % 16, folded. The
 * padding after the last key is set to 0 (it adds nothing). */
static inline __attribute__((always_inline)) void softmax(const int R, int nk, int padded, float *scores,
                                                          const float *m, float *den) {
    const vf16 zero = {0};
    for (int r = 0; r < R; r++) {
        float *sr = scores + (int64_t)r * padded;
        vf16 part = zero;
        for (int i0 = 0; i0 < nk; i0 += LANES) {
            const int n = nk - i0 < LANES ? nk - i0 : LANES;
            vf16 x;
            memcpy(&x, sr + i0, sizeof x);
            x = exp16(x - m[r]);
            if (n < LANES)
                for (int i = n; i < LANES; i++) x[i] = 0.0f;  /* the padding adds nothing */
            memcpy(sr + i0, &x, sizeof x);
            part += x;
        }
        den[r] = fold(part);
    }
}

/* The keys of row t, in cache order, into `keys`; returns how many. */
static int row_keys(int t, int T, int end, int window, const uint8_t *mask, int64_t mask_stride, int32_t *keys) {
    int n = 0;
    if (mask) {
        const uint8_t *m = mask + (int64_t)t * mask_stride;
        for (int l = 0; l < end; l++)
            if (m[l]) keys[n++] = l;
        return n;
    }
    int hi = end - T + t + 1;
    int lo = (window > 0 && hi - window > 0) ? hi - window : 0;
    for (int l = lo; l < hi; l++) keys[n++] = l;
    return n;
}

/* Query heads h0 .. h0 + R - 1 of row t, which read KV head g (at `head` in k and v), B blocks of 16
 * a head: each key and value row is widened once for the R heads. Inlined with constant B, R and
 * dtype for the common shapes (dispatch below), so the heads' sums stay in registers; each head's
 * arithmetic is the one at the top of this file, whatever R is. */
static inline __attribute__((always_inline)) void heads(const int B, const int R, const int dtype, const void *q,
                                                        int64_t q_sh, int64_t q_st, const void *k, const void *v,
                                                        int t, int h0, int Hq, int D, int64_t head,
                                                        const int32_t *keys, int nk, float scale, float *scores,
                                                        void *out) {
    vf16 qv[MAX_GROUP][MAX_BLOCKS], acc[MAX_GROUP][MAX_BLOCKS], row[MAX_BLOCKS], mv[MAX_GROUP];
    float m[MAX_GROUP], den[MAX_GROUP];
    const vf16 zero = {0};
    const int padded = (nk + LANES - 1) / LANES * LANES;
    for (int r = 0; r < R; r++) {
        for (int j = 0; j < B; j++) qv[r][j] = load16(q, (int64_t)(h0 + r) * q_sh + (int64_t)t * q_st + j * LANES, dtype);
        m[r] = -3.0e38f;
        for (int i = 0; i < LANES; i++) mv[r][i] = -3.0e38f;
    }
    vf16 keyrows[LANES][MAX_BLOCKS];  /* 16 keys, widened */
    for (int i0 = 0; i0 < nk; i0 += LANES) {
        const int n = nk - i0 < LANES ? nk - i0 : LANES;
        for (int i = 0; i < LANES; i++)
            for (int j = 0; j < B; j++)
                keyrows[i][j] = i < n ? load16(k, head + (int64_t)keys[i0 + i] * D + j * LANES, dtype) : zero;
        for (int r = 0; r < R; r++) {
            vf16 parts[LANES];
            for (int i = 0; i < LANES; i++) {
                vf16 part = zero;
                for (int j = 0; j < B; j++) part += qv[r][j] * keyrows[i][j];
                parts[i] = part;
            }
            vf16 s = sum16(parts) * scale;
            /* the head's scores, padded to whole groups of 16 (the padding is never read as a key) */
            memcpy(scores + (int64_t)r * padded + i0, &s, sizeof s);
            if (n == LANES) {
                mv[r] = vmax(mv[r], s);
            } else {
                for (int i = 0; i < n; i++)
                    if (s[i] > m[r]) m[r] = s[i];
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < LANES; i++)
            if (mv[r][i] > m[r]) m[r] = mv[r][i];
    softmax(R, nk, padded, scores, m, den);
    for (int r = 0; r < R; r++)
        for (int j = 0; j < B; j++) acc[r][j] = zero;
    for (int i = 0; i < nk; i++) {
        for (int j = 0; j < B; j++) row[j] = load16(v, head + (int64_t)keys[i] * D + j * LANES, dtype);
        for (int r = 0; r < R; r++) {
            float p = scores[(int64_t)r * padded + i];
            for (int j = 0; j < B; j++) acc[r][j] += p * row[j];
        }
    }
    for (int r = 0; r < R; r++) {
        int64_t at = ((int64_t)t * Hq + h0 + r) * D;
        for (int j = 0; j < B; j++) {
            store16(out, at + j * LANES, acc[r][j] / den[r], dtype);
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* The AVX2 class's heads: the arithmetic above, every lane's operations the same and in the same
 * order (the bit-for-bit test builds both: viasd_row_attention_plain is `heads` alone), laid out for
 * 16 registers of 8 floats. The plain code's 16-lane vectors spill on AVX2 (a head of 64 is 8
 * registers, its keys' partial sums 32 more) and GCC moves them through general registers: a row over
 * 700 keys took ~10x its arithmetic. Here a key's 16 partial sums are two registers (lanes 0-7 and
 * 8-15), added into one at once (sum16's first step), 8 keys' sums folded together in sum16's tree
 * (fold8), and the values are summed 16 dimensions and at most 4 heads at a time over every key. */
#include <immintrin.h>
#define ROW_AVX2 1

static inline __m256 load8(const void *base, int64_t at, int dtype) {
    if (dtype == 0)
        return _mm256_loadu_ps((const float *)base + at);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + at));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* The dot products of 8 keys in key order, w[i] holding key i's 8 sums of lanes m and m + 8: each
 * added as fold() adds a vector's halves (m with m + 4, then m with m + 2, then the two left). */
static inline __m256 fold8(const __m256 w[8]) {
    __m256 u[4], y[2];
    for (int i = 0; i < 4; i++)  /* [key 2i's 4 sums | key 2i + 1's] */
        u[i] = _mm256_add_ps(_mm256_permute2f128_ps(w[2 * i], w[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(w[2 * i], w[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++)  /* [keys 4i, 4i + 2: 2 sums each | keys 4i + 1, 4i + 3] */
        y[i] = _mm256_add_ps(_mm256_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                             _mm256_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
    /* [keys 0 2 4 6 | 1 3 5 7], put in key order */
    const __m256 z = _mm256_add_ps(_mm256_shuffle_ps(y[0], y[1], 0x88), _mm256_shuffle_ps(y[0], y[1], 0xDD));
    return _mm256_permutevar8x32_ps(z, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static inline __attribute__((always_inline)) void heads8(const int B, const int R, const int dtype, const void *q,
                                                         int64_t q_sh, int64_t q_st, const void *k, const void *v,
                                                         int t, int h0, int Hq, int D, int64_t head,
                                                         const int32_t *keys, int nk, float scale, float *scores,
                                                         void *out) {
    float m[MAX_GROUP], den[MAX_GROUP];
    __m256 mv[MAX_GROUP];
    float keyrows[8][MAX_HEAD_DIM] __attribute__((aligned(32)));  /* 8 keys, widened */
    const __m256 zero = _mm256_setzero_ps();
    const int padded = (nk + LANES - 1) / LANES * LANES;
    for (int r = 0; r < R; r++) {
        m[r] = -3.0e38f;
        mv[r] = _mm256_set1_ps(-3.0e38f);
    }
    for (int i0 = 0; i0 < nk; i0 += 8) {
        const int n = nk - i0 < 8 ? nk - i0 : 8;
        for (int i = 0; i < 8; i++)
            for (int j = 0; j < 2 * B; j++)
                _mm256_store_ps(keyrows[i] + 8 * j,
                                i < n ? load8(k, head + (int64_t)keys[i0 + i] * D + 8 * j, dtype) : zero);
        for (int r = 0; r < R; r++) {
            __m256 qr[2 * MAX_BLOCKS], w[8];
            for (int j = 0; j < 2 * B; j++) qr[j] = load8(q, (int64_t)(h0 + r) * q_sh + (int64_t)t * q_st + 8 * j, dtype);
            for (int i = 0; i < 8; i++) {
                __m256 lo = zero, hi = zero;  /* lanes 0-7 and 8-15 of each block of 16 */
                for (int j = 0; j < B; j++) {
                    lo = _mm256_fmadd_ps(qr[2 * j], _mm256_load_ps(keyrows[i] + 16 * j), lo);
                    hi = _mm256_fmadd_ps(qr[2 * j + 1], _mm256_load_ps(keyrows[i] + 16 * j + 8), hi);
                }
                w[i] = _mm256_add_ps(lo, hi);
            }
            const __m256 s = _mm256_mul_ps(fold8(w), _mm256_set1_ps(scale));
            _mm256_storeu_ps(scores + (int64_t)r * padded + i0, s);
            if (n == 8) {
                mv[r] = _mm256_max_ps(mv[r], s);
            } else {
                for (int i = 0; i < n; i++)
                    if (scores[(int64_t)r * padded + i0 + i] > m[r]) m[r] = scores[(int64_t)r * padded + i0 + i];
            }
        }
    }
    for (int r = 0; r < R; r++) {
        float lanes[8];
        _mm256_storeu_ps(lanes, mv[r]);
        for (int i = 0; i < 8; i++)
            if (lanes[i] > m[r]) m[r] = lanes[i];
    }
    softmax(R, nk, padded, scores, m, den);
    for (int r0 = 0; r0 < R; r0 += 4) {
        const int nr = R - r0 < 4 ? R - r0 : 4;
        for (int j = 0; j < B; j++) {  /* dimensions 16 j .. 16 j + 15 of nr heads, over every key */
            __m256 acc[4][2] = {{zero, zero}, {zero, zero}, {zero, zero}, {zero, zero}};
            for (int i = 0; i < nk; i++) {
                const int64_t at = head + (int64_t)keys[i] * D + 16 * j;
                const __m256 v0 = load8(v, at, dtype), v1 = load8(v, at + 8, dtype);
                for (int r = 0; r < nr; r++) {
                    const __m256 p = _mm256_broadcast_ss(scores + (int64_t)(r0 + r) * padded + i);
                    acc[r][0] = _mm256_fmadd_ps(p, v0, acc[r][0]);
                    acc[r][1] = _mm256_fmadd_ps(p, v1, acc[r][1]);
                }
            }
            for (int r = 0; r < nr; r++) {
                float o[LANES] __attribute__((aligned(32)));
                const __m256 d = _mm256_set1_ps(den[r0 + r]);
                _mm256_store_ps(o, _mm256_div_ps(acc[r][0], d));
                _mm256_store_ps(o + 8, _mm256_div_ps(acc[r][1], d));
                vf16 ov;
                memcpy(&ov, o, sizeof ov);
                store16(out, ((int64_t)t * Hq + h0 + r0 + r) * D + 16 * j, ov, dtype);
            }
        }
    }
}
#endif

#ifdef ROW_AVX2
#define HEADS(B, R, DT) heads8(B, R, DT, q, q_sh, q_st, k, v, t, h0, Hq, D, head, keys, nk, scale, scores, out)
#else
#define HEADS(B, R, DT) heads(B, R, DT, q, q_sh, q_st, k, v, t, h0, Hq, D, head, keys, nk, scale, scores, out)
#endif

/* Row t's query heads h0 .. h0 + R - 1 (R at most heads_per_task), which read KV head g. */
static void some_heads(const void *q, int64_t q_sh, int64_t q_st, const void *k, const void *v, int dtype, int t,
                       int g, int h0, int R, int Hq, int D, int64_t S, const int32_t *keys, int nk, float scale,
                       float *scores, void *out, int plain) {
    const int B = D / LANES;
    const int64_t head = (int64_t)g * S * D;
#ifdef ROW_AVX2
    if (plain) {  /* the plain code, its shapes not compiled in (the same operations, lane by lane) */
        heads(B, R, dtype, q, q_sh, q_st, k, v, t, h0, Hq, D, head, keys, nk, scale, scores, out);
        return;
    }
#else
    (void)plain;
#endif
    switch (B * 64 + R * 2 + dtype) {  /* constant shapes for the common head widths */
    case 4 * 64 + 2: HEADS(4, 1, 0); break;
    case 4 * 64 + 3: HEADS(4, 1, 1); break;
    case 4 * 64 + 4: HEADS(4, 2, 0); break;
    case 4 * 64 + 5: HEADS(4, 2, 1); break;
    case 4 * 64 + 6: HEADS(4, 3, 0); break;
    case 4 * 64 + 7: HEADS(4, 3, 1); break;
    case 4 * 64 + 8: HEADS(4, 4, 0); break;
    case 4 * 64 + 9: HEADS(4, 4, 1); break;
    case 8 * 64 + 2: HEADS(8, 1, 0); break;
    case 8 * 64 + 3: HEADS(8, 1, 1); break;
    case 8 * 64 + 4: HEADS(8, 2, 0); break;
    case 8 * 64 + 5: HEADS(8, 2, 1); break;
    default: HEADS(B, R, dtype); break;
    }
}

/* How many of a KV head's nh query heads one task attends: as many as keep their sums in registers
 * (4 heads of 64, 2 of 128, else 1). Each head's arithmetic is the same whichever task holds it.
 * (Splitting a KV head's query heads further where a pass has fewer tasks than twice the threads
 * was slower: each task widens the keys again.) */
static int heads_per_task(int D, int nh) {
    const int B = D / LANES, most = B == 4 ? 4 : B == 8 ? 2 : 1;
    return most < nh ? most : nh;
}

/* q [Hq, T, D] at head stride q_sh and row stride q_st (elements; its last dimension contiguous);
 * k, v [Hkv, S, D] (one layer's cache, S slots); out [T, Hq, D]. dtype: 0 float32, 1 bfloat16
 * (q, k, v and out alike). Row t's keys: with `mask` ([T, mask_stride]
 * bytes) the slots l < end it marks; without, the causal range ending at slot end - T + t
 * (within `window` slots when window > 0). Returns 0, or -1 for arguments it cannot take. */
static int attend(const void *q, int64_t q_sh, int64_t q_st, const void *k, const void *v, int dtype, int T, int Hq,
                  int Hkv, int D, int64_t S, int end, int window, const uint8_t *mask, int64_t mask_stride,
                  float scale, void *out, int threads, int plain) {
    if (D <= 0 || D % LANES || D > MAX_HEAD_DIM || Hkv <= 0 || Hq % Hkv || Hq / Hkv > MAX_GROUP || T <= 0 || end <= 0 || end > S || (dtype != 0 && dtype != 1))
        return -1;
    if (!mask && end - T < 0)
        return -1;
    if (threads <= 0)
        threads = 1;
    const int nh = Hq / Hkv, per = heads_per_task(D, nh), chunks = (nh + per - 1) / per;
    int failed = 0;
    #pragma omp parallel num_threads(threads) reduction(|| : failed)
    {
        float *scores = (float *)malloc((size_t)(end + LANES) * (size_t)(Hq / Hkv) * sizeof(float));
        int32_t *keys = (int32_t *)malloc((size_t)end * sizeof(int32_t));
        int ok = scores && keys;
        failed = !ok;
        #pragma omp for schedule(static)
        for (int task = 0; task < T * Hkv * chunks; task++) {
            if (!ok) continue;  /* this thread's rows stay unwritten: the call returns -2 */
            int t = task / (Hkv * chunks), g = task / chunks % Hkv, c = task % chunks * per;
            int nk = row_keys(t, T, end, window, mask, mask_stride, keys);
            some_heads(q, q_sh, q_st, k, v, dtype, t, g, g * nh + c, nh - c < per ? nh - c : per, Hq, D, S, keys, nk,
                       scale, scores, out, plain);
        }
        free(scores);
        free(keys);
    }
    return failed ? -2 : 0;
}

int viasd_row_attention(const void *q, int64_t q_sh, int64_t q_st, const void *k, const void *v, int dtype, int T,
                        int Hq, int Hkv, int D, int64_t S, int end, int window, const uint8_t *mask,
                        int64_t mask_stride, float scale, void *out, int threads) {
    return attend(q, q_sh, q_st, k, v, dtype, T, Hq, Hkv, D, S, end, window, mask, mask_stride, scale, out, threads, 0);
}

/* viasd_row_attention through the plain code alone (`heads`), on every class: the reference that the
 * AVX2 class's heads8 is compared with, bit for bit (tests/kernels/test_kernels_cpu_row_attention.py). */
int viasd_row_attention_plain(const void *q, int64_t q_sh, int64_t q_st, const void *k, const void *v, int dtype,
                              int T, int Hq, int Hkv, int D, int64_t S, int end, int window, const uint8_t *mask,
                              int64_t mask_stride, float scale, void *out, int threads) {
    return attend(q, q_sh, q_st, k, v, dtype, T, Hq, Hkv, D, S, end, window, mask, mask_stride, scale, out, threads, 1);
}

/* The lanes a head's partial sums are laid out in: 8 where this build runs the AVX2 class's heads8,
 * 16 where it runs the plain code alone. */
int viasd_row_attention_lanes(void) {
#ifdef ROW_AVX2
    return 8;
#else
    return LANES;
#endif
}
