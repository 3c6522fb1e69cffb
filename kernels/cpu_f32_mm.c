/* Short passes (1-16 rows) over float32 weights, each output computed the same way whatever the
 * pass holds (viasd_kernels.cpu_f32_mm).
 *
 * Exported (prototypes in viasd_kernels.h): viasd_f32_mm, viasd_f32_mm_ld (the same with the output's and
 * the residual's rows `ld` floats apart: a layer's q, k and v write side by side into one buffer,
 * cpu_layer.c), viasd_f32_mm_vector_bits.
 *
 * `sd` is exact only if a position's logits do not depend on how many rows share its pass. PyTorch's
 * float32 products on a CPU (F.linear, oneDNN, torch.bmm) pick their kernels, and so their summation
 * orders, by the number of rows: on SmolLM2-135M every row of passes of 2-16 rows differed from the
 * 1-row pass (~5e-5 in the logits). Here output (m, n) is one fixed sequence of operations over x[m]
 * and w[n] alone:
 *
 *     acc = 0 (16 float32 lanes);  for k = 0, 16, .., K - 16:  acc = acc + x[m, k:k+16] * w[n, k:k+16]
 *     s   = the 16 lanes added in a fixed tree (lane i + lane i + 8, then + 4, + 2, + 1)
 *     y   = s (+ bias[n]) (+ residual[m, n]),  each add rounded to float32
 *
 * the multiply-add contracted to one fused multiply-add wherever the compiler targets FMA (every
 * instance of the update is the one expression in `rows_outs`, inlined with constant tile sizes, so
 * it is contracted alike everywhere). A pass of R rows runs tiles of rows by outputs that share each
 * loaded weight vector (the weights are read once a pass, however many rows), a 1-row pass runs
 * ROW1_OUTS outputs at once so that enough loads are in flight to stream the weights at the
 * memory's speed; which tile, which thread (threads split the outputs, OpenMP's static schedule,
 * never the inputs) and where the buffers sit change nothing in an output's operations. Vectors are
 * GCC vector extensions: the same lanes with AVX-512 (one register), AVX2 (two) or none.
 *
 * Built once per machine by viasd_kernels/cpu_f32_mm.py with the system C compiler.
 */
#include <stddef.h>
#include <stdint.h>

#define LANES 16
#define MAX_ROWS 16
#define L1_AHEAD 4096  /* floats: leads up to 16 KB are asked into L1, longer ones into L2 */
#define AHEAD 1      /* tiles ahead that a pass of 2-16 rows asks for its weights: over a weight beyond the
                        caches ~10-25% faster, 2 and 4 tiles no better; a 1-row pass asks for nothing
                        (the hardware's prefetcher keeps up: asking cost 3% from L3, 50% from L2) */
/* The 16 lanes of an accumulator are held as PARTS vectors of the widest registers the build
 * targets (one AVX-512 register, two AVX ones, four of 128 bits): GCC keeps a 64-byte vector that is
 * wider than the registers in memory, a load and a store around every update (the AVX2 build ran
 * at ~40% of PyTorch's speed that way). Each lane's sequence of updates is the same however the
 * lanes are split, so the split changes no bit. */
#ifndef PART_BYTES  /* (-DPART_BYTES=16: the tests build NEON's tiles on an x86-64 CPU with FMA) */
#if defined(__AVX512F__)
#define PART_BYTES 64
#elif defined(__AVX__)
#define PART_BYTES 32
#else
#define PART_BYTES 16
#endif
#endif
#if PART_BYTES == 64
#define ROW_TILE 4   /* rows x outputs of accumulators in a tile: 16 of 32 vector registers */
#define OUT_TILE 4
#define ROW1_OUTS 8  /* outputs of a 1-row pass's tile */
#elif PART_BYTES == 32
#define ROW_TILE 2   /* 2 x 2 accumulators of two registers each: 8 of 16, with the rows' and a weight's */
#define OUT_TILE 2
#define ROW1_OUTS 4
#else
#define ROW_TILE 1   /* 2 accumulators of four registers (SSE2 has 16, NEON 32) */
#define OUT_TILE 2
#define ROW1_OUTS 2
#endif
#define PARTS (64 / PART_BYTES)
#define PART_LANES (PART_BYTES / 4)

typedef float vpart __attribute__((vector_size(PART_BYTES)));
typedef float vpartu __attribute__((vector_size(PART_BYTES), aligned(4), may_alias));  /* loads from any float */
typedef float vf16 __attribute__((vector_size(64)));

/* The widest vectors the build targets (512 AVX-512, 256 AVX, 128 SSE2 or NEON, else 0): the same
 * numbers whichever, different tiles (the tests check that a build capped at AVX2 agrees). */
int viasd_f32_mm_vector_bits(void) {
#if defined(__AVX512F__) || defined(__AVX__) || defined(__SSE2__) || defined(__ARM_NEON)
    return PART_BYTES * 8;
#else
    return 0;
#endif
}

/* The lane sums of 16 vectors, s[i] = v[i]'s 16 lanes added in a fixed tree: lane l + lane l + 8
 * (l < 8), then l + l + 4 (l < 4), then (0 + 2) + (1 + 3). Each step adds lanes picked from two
 * vectors, so that one add serves several sums; the picks are vector constructors, which GCC and
 * clang compile to shuffles. (Vectors go by address between functions: passed by value they would
 * change the ABI without AVX-512.) */
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
    for (int i = 0; i < 8; i++)  /* t[i]: lanes 0-7 v[2i]'s lane l + lane l + 8, lanes 8-15 v[2i + 1]'s */
        t[i] = HALVES(v[2 * i], v[2 * i + 1], 0) + HALVES(v[2 * i], v[2 * i + 1], 8);
    for (int i = 0; i < 4; i++)  /* u[i]: lanes 4q .. 4q + 3 v[4i + q]'s four partial sums */
        u[i] = QUARTERS(t[2 * i], t[2 * i + 1], 0) + QUARTERS(t[2 * i], t[2 * i + 1], 4);
    for (int i = 0; i < 2; i++)  /* w[i]: lanes 4q .. 4q + 3 (0 + 2, 1 + 3) of v[8i + q], then of v[8i + 4 + q] */
        w[i] = PAIRS(u[2 * i], u[2 * i + 1], 0) + PAIRS(u[2 * i], u[2 * i + 1], 2);
    const vf16 r = SINGLES(w[0], w[1], 0) + SINGLES(w[0], w[1], 1);  /* lane 4q + e: v[4e + q]'s sum */
    for (int q = 0; q < 4; q++)
        for (int e = 0; e < 4; e++)
            s[4 * e + q] = r[4 * q + e];
}

/* Outputs n0 .. n0 + J - 1 of rows x[0 .. R - 1] (R and J constants where inlined; `w[j]` each
 * output's weights, `x` rows K apart), stored at out + r * ld + j (residual's rows ld apart too). */
static inline __attribute__((always_inline)) void rows_outs(const int R, const int J, const float *x,
                                                            const float *const *w, int64_t K, const float *bias,
                                                            const float *residual, float *out, int64_t ld,
                                                            int64_t n_here, int64_t ahead) {
    vpart acc[ROW_TILE > 1 ? ROW_TILE : 1][ROW1_OUTS > OUT_TILE ? ROW1_OUTS : OUT_TILE][PARTS];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++)
            for (int p = 0; p < PARTS; p++)
                acc[r][j][p] = (vpart){0};
    for (int64_t k = 0; k < K; k += LANES) {
        vpart xv[ROW_TILE][PARTS];
        for (int r = 0; r < R; r++)
            for (int p = 0; p < PARTS; p++)
                xv[r][p] = *(const vpartu *)(x + r * K + k + p * PART_LANES);
        for (int j = 0; j < J; j++) {
            if (ahead > L1_AHEAD)
                __builtin_prefetch(w[j] + k + ahead, 0, 1);  /* to L2 (prefetcht2 on x86) */
            else if (ahead)
                __builtin_prefetch(w[j] + k + ahead, 0, 3);
            for (int p = 0; p < PARTS; p++) {
                const vpart wv = *(const vpartu *)(w[j] + k + p * PART_LANES);
                for (int r = 0; r < R; r++)
                    acc[r][j][p] = acc[r][j][p] + xv[r][p] * wv;  /* the one update of every output */
            }
        }
    }
    vf16 v[16] = {{0}};  /* every tile holds at most 16 sums (R * J <= 16) */
    float sum[16];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++)
            for (int p = 0; p < PARTS; p++)
                for (int l = 0; l < PART_LANES; l++)
                    v[r * J + j][p * PART_LANES + l] = acc[r][j][p][l];
    fold16(v, sum);
    for (int j = 0; j < J && j < n_here; j++)
        for (int r = 0; r < R; r++) {
            float y = sum[r * J + j];
            if (bias)
                y = y + bias[j];
            if (residual)
                y = y + residual[r * ld + j];
            out[r * ld + j] = y;
        }
}

/* One tile of outputs (n_here <= J of them, the rest of `w` pointing at real rows whose results are
 * dropped) for all M rows, ROW_TILE rows at a time; each weight vector is loaded once per row tile
 * from the cache the first row tile brought it into. */
static void tile(const float *x, int64_t M, const float *const *w, int64_t K, const float *bias,
                 const float *residual, float *out, int64_t ld, int64_t n_here) {
    if (M == 1) {
        rows_outs(1, ROW1_OUTS, x, w, K, bias, residual, out, ld, n_here, 0);
        return;
    }
    for (int64_t r0 = 0; r0 < M; r0 += ROW_TILE) {
        const int64_t ahead = r0 == 0 ? OUT_TILE * K * AHEAD : 0;  /* the first row tile streams the weights */
        const float *xr = x + r0 * K, *res = residual ? residual + r0 * ld : NULL;
        float *o = out + r0 * ld;
        switch (M - r0 < ROW_TILE ? M - r0 : ROW_TILE) {  /* a constant row count for each body */
        case 1: rows_outs(1, OUT_TILE, xr, w, K, bias, res, o, ld, n_here, ahead); break;
#if ROW_TILE > 2
        case 2: rows_outs(2, OUT_TILE, xr, w, K, bias, res, o, ld, n_here, ahead); break;
        case 3: rows_outs(3, OUT_TILE, xr, w, K, bias, res, o, ld, n_here, ahead); break;
#endif
        default: rows_outs(ROW_TILE, OUT_TILE, xr, w, K, bias, res, o, ld, n_here, ahead); break;
        }
    }
}

/* out [M, N] = x [M, K] times w [N, K] transposed, plus bias [N] and residual [M, N] where they are
 * not NULL; float32, x and w contiguous, out's and residual's rows `ld` floats apart (ld >= N). K a
 * multiple of 16, 1 <= M <= MAX_ROWS. Returns 0, or -1 for arguments it does not take. */
int viasd_f32_mm_ld(const float *x, const float *w, const float *bias, int64_t M, int64_t N, int64_t K, float *out,
                    const float *residual, int64_t ld, int threads) {
    if (M <= 0 || M > MAX_ROWS || N <= 0 || K <= 0 || K % LANES || ld < N)
        return -1;
    const int64_t outs = M == 1 ? ROW1_OUTS : OUT_TILE;
    const int64_t tiles = (N + outs - 1) / outs;
#ifdef _OPENMP
    #pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static)
#else
    (void)threads;
#endif
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * outs, n_here = N - n0 < outs ? N - n0 : outs;
        const float *wj[ROW1_OUTS > OUT_TILE ? ROW1_OUTS : OUT_TILE];
        for (int64_t j = 0; j < outs; j++)
            wj[j] = w + (n0 + (j < n_here ? j : n_here - 1)) * K;
        tile(x, M, wj, K, bias ? bias + n0 : NULL, residual ? residual + n0 : NULL, out + n0, ld, n_here);
    }
    return 0;
}

/* viasd_f32_mm_ld with out and residual [M, N] contiguous. */
int viasd_f32_mm(const float *x, const float *w, const float *bias, int64_t M, int64_t N, int64_t K, float *out,
                 const float *residual, int threads) {
    return viasd_f32_mm_ld(x, w, bias, M, N, K, out, residual, N, threads);
}
