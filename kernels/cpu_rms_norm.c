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

#include "cpu_bf16.h"
#include "viasd_kernels.h"

#define LANES 16

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
            h = round_bf16_16(h);
        store16(out, r * H + i, load16(w, i, dtype) * h, dtype);
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
