/* RoPE on a pass's queries and keys, and the keys and values written into the layer's cache, in one
 * call on a CPU (viasd_kernels.cpu_rope_write).
 *
 * A layer's pass otherwise splits its projections, views and transposes them, rotates q and k
 * (`rope.apply_rope`: x * cos + roll(x, D / 2) * sin_signed, four operators each) and writes k and v
 * into the cache (two indexed writes): about twenty PyTorch operators a layer. Here, for every row t
 * and head h, each element is computed with PyTorch's own roundings, so the result is bit for bit
 * `apply_rope` followed by `LayerCache.update`:
 *
 *   a = x[i] * cos[i]                      rounded to the dtype
 *   b = x[(i + D/2) % D] * sin_signed[i]   rounded to the dtype
 *   y[i] = a + b                           rounded to the dtype (bfloat16: float32 sum, then rounded)
 *
 * in float32 (no fused multiply-add: the function is compiled without contraction) or bfloat16.
 * Built once per machine by viasd_kernels/cpu_rope_write.py with the system C compiler.
 */
#include <stdint.h>
#include <string.h>

#include "cpu_bf16.h"
#include "viasd_kernels.h"

/* y = x * c + roll(x, D / 2) * s over the first half (partner i + D / 2) and the second (i - D / 2) */
VIASD_NO_CONTRACT
static void rotate_f32(const float *restrict x, const float *restrict c, const float *restrict s, float *restrict y,
                       int D) {
    VIASD_NO_CONTRACT_BODY
    const int half = D / 2;
    for (int i = 0; i < half; i++) {
        float a = x[i] * c[i];
        float b = x[i + half] * s[i];
        y[i] = a + b;
    }
    for (int i = half; i < D; i++) {
        float a = x[i] * c[i];
        float b = x[i - half] * s[i];
        y[i] = a + b;
    }
}

VIASD_NO_CONTRACT
static void rotate_bf16(const uint16_t *restrict x, const uint16_t *restrict c, const uint16_t *restrict s,
                        uint16_t *restrict y, int D) {
    VIASD_NO_CONTRACT_BODY
    const int half = D / 2;
    for (int i = 0; i < half; i++) {
        float a = bf16_to_f32(f32_to_bf16(bf16_to_f32(x[i]) * bf16_to_f32(c[i])));
        float b = bf16_to_f32(f32_to_bf16(bf16_to_f32(x[i + half]) * bf16_to_f32(s[i])));
        y[i] = f32_to_bf16(a + b);
    }
    for (int i = half; i < D; i++) {
        float a = bf16_to_f32(f32_to_bf16(bf16_to_f32(x[i]) * bf16_to_f32(c[i])));
        float b = bf16_to_f32(f32_to_bf16(bf16_to_f32(x[i - half]) * bf16_to_f32(s[i])));
        y[i] = f32_to_bf16(a + b);
    }
}

/* q [T, Hq * D] (row stride q_st), k and v [T, Hkv * D] (row strides k_st, v_st), cos and sin [T, D]
 * (contiguous), pos [T] int64 slots; q_out [Hq, T, D] contiguous; kc, vc [Hkv, S, D] (one layer's
 * cache). dtype 0 float32, 1 bfloat16 (every tensor alike). Returns 0, or -1 for arguments it does
 * not take (a slot outside the cache, an odd head width). */
int viasd_rope_write(const void *q, int64_t q_st, const void *k, int64_t k_st, const void *v, int64_t v_st,
                     const void *cos, const void *sin, const int64_t *pos, void *q_out, void *kc, void *vc, int T,
                     int Hq, int Hkv, int D, int64_t S, int dtype) {
    if (T <= 0 || Hq <= 0 || Hkv <= 0 || D <= 0 || D % 2 || (dtype != 0 && dtype != 1))
        return -1;
    for (int t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= S)
            return -1;
    const size_t e = dtype == 0 ? 4 : 2;
    const char *qb = q, *kb = k, *vb = v, *cb = cos, *sb = sin;
    char *qo = q_out, *kcb = kc, *vcb = vc;
    for (int t = 0; t < T; t++) {
        const char *ct = cb + (size_t)t * D * e, *st = sb + (size_t)t * D * e;
        for (int h = 0; h < Hq + Hkv; h++) {
            const int is_q = h < Hq, hh = is_q ? h : h - Hq;
            const char *x = is_q ? qb + ((size_t)t * q_st + (size_t)hh * D) * e : kb + ((size_t)t * k_st + (size_t)hh * D) * e;
            char *y = is_q ? qo + (((size_t)hh * T + t) * D) * e : kcb + (((size_t)hh * S + pos[t]) * D) * e;
            if (dtype == 0)
                rotate_f32((const float *)x, (const float *)ct, (const float *)st, (float *)y, D);
            else
                rotate_bf16((const uint16_t *)x, (const uint16_t *)ct, (const uint16_t *)st, (uint16_t *)y, D);
        }
        for (int h = 0; h < Hkv; h++)
            memcpy(vcb + (((size_t)h * S + pos[t]) * D) * e, vb + ((size_t)t * v_st + (size_t)h * D) * e, (size_t)D * e);
    }
    return 0;
}
