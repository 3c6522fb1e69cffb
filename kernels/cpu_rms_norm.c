/* RMSNorm for a CPU's passes in one call (viasd_kernels.cpu_rms_norm).
 *
 * transformers' RMSNorm of Llama, Qwen2/3, Mistral and Phi-3 takes eight PyTorch operators a call
 * (to float32, pow, mean, add, rsqrt, mul, back to the input dtype, times the weight): about 16 us
 * on a 2-core CPU, twice a layer, ~1 ms of a 7 ms int4 SmolLM2 pass. This is the same formula in
 * one call, each row on its own:
 *
 *   v   = sum of x^2 over the row / H      float32: 16 partial sums by index % 16, folded pairwise
 *   r   = 1 / sqrt(v + eps)                (PyTorch's rsqrt on a CPU: a division by a square root)
 *   h   = x * r                            float32, rounded to the input dtype
 *   out = weight * h                       in the input dtype (a float32 product, rounded once)
 *
 * in float32 or bfloat16 (x, weight and out alike). Only the order of the sum of squares differs
 * from PyTorch's mean, so a value differs from transformers' by at most a rounding step, rarely.
 * A row's result depends only on the row (the same in a pass of any width). Built once per machine
 * by viasd_kernels/cpu_rms_norm.py with the system C compiler.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16

typedef float vf16 __attribute__((vector_size(64)));
typedef uint16_t vh16 __attribute__((vector_size(32)));
typedef uint32_t vu16 __attribute__((vector_size(64)));

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

/* Round to bfloat16, to nearest even (PyTorch's conversion; NaN stays NaN), widened back. */
static inline vf16 round_bf16(vf16 f) {
    vu16 u;
    memcpy(&u, &f, sizeof u);
    vu16 r = ((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) << 16;
    vu16 nan = (u & 0x7FFFFFFFu) > 0x7F800000u;  /* all ones where NaN */
    r = (r & ~nan) | ((u | 0x00400000u) & 0xFFFF0000u & nan);
    vf16 out;
    memcpy(&out, &r, sizeof out);
    return out;
}

static inline void store16(void *base, int64_t at, vf16 f, int dtype) {
    if (dtype == 0) {
        memcpy((float *)base + at, &f, sizeof f);
    } else {
        vu16 u;
        memcpy(&u, &f, sizeof u);  /* already a bfloat16 value: its top half */
        vh16 h = __builtin_convertvector(u >> 16, vh16);
        memcpy((uint16_t *)base + at, &h, sizeof h);
    }
}

static inline float fold(vf16 v) {
    float a[LANES];
    memcpy(a, &v, sizeof a);
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int i = 0; i < w; i++) a[i] += a[i + w];
    return a[0];
}

static inline __attribute__((always_inline)) void norm_row(const void *x, const void *w, void *out, int64_t r,
                                                           int64_t H, float eps, int dtype) {
    vf16 part = {0};
    for (int64_t i = 0; i < H; i += LANES) {
        vf16 v = load16(x, r * H + i, dtype);
        part += v * v;
    }
    const float inv = 1.0f / sqrtf(fold(part) / (float)H + eps);
    for (int64_t i = 0; i < H; i += LANES) {
        vf16 h = load16(x, r * H + i, dtype) * inv;
        if (dtype == 1)
            h = round_bf16(h);
        vf16 y = load16(w, i, dtype) * h;
        store16(out, r * H + i, dtype == 1 ? round_bf16(y) : y, dtype);
    }
}

/* out [rows, H] = RMSNorm of x [rows, H] with weight [H]; dtype 0 float32, 1 bfloat16. H a multiple
 * of 16. Returns 0, or -1 for arguments it does not take. */
int viasd_rms_norm(const void *x, const void *w, void *out, int64_t rows, int64_t H, float eps, int dtype) {
    if (rows <= 0 || H <= 0 || H % LANES || (dtype != 0 && dtype != 1))
        return -1;
    for (int64_t r = 0; r < rows; r++) {
        if (dtype == 0)
            norm_row(x, w, out, r, H, eps, 0);
        else
            norm_row(x, w, out, r, H, eps, 1);
    }
    return 0;
}
