/* A decoder layer's calls up to its MLP activation in one call, for a CPU's short passes
 * (viasd_kernels.cpu_layer).
 *
 * A 1-token int4 pass of a 30-layer model paid about 49 us a layer in calls alone (Python, ctypes,
 * the operators between the kernels), a third of the pass. This function runs, in order, the very
 * kernels the pass calls one by one, handed to it as function pointers (no second copy of any
 * arithmetic: every number is the one the separate calls compute):
 *
 *   h    = rms_norm(x)                        (cpu_rms_norm)
 *   qkv  = h W_qkv^T                          (int4: cpu_packed_mm, one fused product; float32:
 *                                              cpu_f32_mm, q, k and v side by side in each row)
 *   q    = rope(q); the cache takes rope(k), v (cpu_rope_write)
 *   a    = row attention of q over the cache  (cpu_row_attention)
 *   x2   = x + a W_o^T                        (the residual added as the product stores)
 *   h2   = rms_norm(x2)
 *   gu   = h2 W_gate_up^T                     (float32: gate and up side by side in each row)
 *
 * The caller then runs silu(gate) * up and the down product (with x2 as its residual) as before.
 * L->dtype picks the layer's kind: 1, bfloat16 activations over int4 weights (int4_mm); 0, float32
 * activations and weights (f32_mm, which the float32 pass's row-invariant products call one by one).
 * Returns 0, or the step that refused its arguments (1-7). The structs and the prototypes are
 * viasd_kernels.h's.
 */
#include <stddef.h>
#include <stdint.h>

#include "viasd_kernels.h"

/* out [T, n] (rows ld apart) = x [T, K] times the product's weights: int4's fused ones (q, sz), or
 * float32's one or more weights `w` of `parts` rows each, side by side in out's rows. */
static int product(const struct viasd_layer_kernels *k, const struct viasd_layer *L, int T, const void *x, int64_t K,
                   const void *q, const void *sz, int64_t n, const void *const *w, const int64_t *parts, int count,
                   void *out, const void *residual, int threads) {
    if (L->dtype == 1)
        return k->int4_mm(x, q, sz, T, n, K, L->group, out, residual, threads);
    int64_t at = 0;
    for (int i = 0; i < count; i++) {
        if (!w[i] || k->f32_mm(x, w[i], NULL, T, parts[i], K, (float *)out + at, residual, n, threads))
            return -1;
        at += parts[i];
    }
    return at == n ? 0 : -1;
}

/* x [T, hidden]; scratch h, h2 [T, hidden], qkv [T, qkv_n], q [heads, T, head_dim], a [T, heads *
 * head_dim]; out x2 [T, hidden], gu [T, gate_up_n]; cos, sin [T, head_dim]; pos [T] slots; rows attend
 * the cache up to `end` (causal, within the layer's window); every tensor in the layer's dtype (pos
 * int64). The kernels are called through pointers of their own prototypes' types (viasd_kernels.h),
 * so every argument is checked by the compiler. */
int viasd_layer_front(const struct viasd_layer_kernels *k, const struct viasd_layer *L, int T, const void *x,
                      void *h, void *qkv, void *q, void *a, void *x2, void *h2, void *gu, const void *cos,
                      const void *sin, const int64_t *pos, int end, int threads) {
    const int64_t H = L->hidden, D = L->head_dim, inner = (int64_t)L->heads * L->head_dim;
    const int64_t kv = (int64_t)L->kv_heads * D, e = L->dtype == 0 ? 4 : 2;
    const void *qkv_w[3] = {L->w_q, L->w_k, L->w_v}, *gate_up_w[2] = {L->w_gate, L->w_up};
    const int64_t qkv_parts[3] = {inner, kv, kv}, gate_up_parts[2] = {L->gate_up_n / 2, L->gate_up_n / 2};
    if (L->dtype != 0 && L->dtype != 1)
        return 1;
    if (k->norm(x, L->norm_in, h, T, H, L->eps_in, L->dtype))
        return 1;
    if (product(k, L, T, h, H, L->qkv_q, L->qkv_sz, L->qkv_n, qkv_w, qkv_parts, 3, qkv, NULL, threads))
        return 2;
    const char *b = (const char *)qkv;  /* q, k, v side by side in each row */
    if (k->rope(b, L->qkv_n, b + inner * e, L->qkv_n, b + (inner + kv) * e, L->qkv_n, cos, sin, pos, q, L->k_cache,
                L->v_cache, T, L->heads, L->kv_heads, L->head_dim, L->slots, L->dtype))
        return 3;
    if (k->attention(q, (int64_t)T * D, D, L->k_cache, L->v_cache, L->dtype, T, L->heads, L->kv_heads, L->head_dim,
                     L->slots, end, L->window, 0, end, L->scale, a, threads))
        return 4;
    const void *o_w[1] = {L->w_o};
    const int64_t o_parts[1] = {H};
    if (product(k, L, T, a, inner, L->o_q, L->o_sz, H, o_w, o_parts, 1, x2, x, threads))
        return 5;
    if (k->norm(x2, L->norm_post, h2, T, H, L->eps_post, L->dtype))
        return 6;
    if (product(k, L, T, h2, H, L->gate_up_q, L->gate_up_sz, L->gate_up_n, gate_up_w, gate_up_parts, 2, gu, NULL,
                threads))
        return 7;
    return 0;
}

#define PUT(v) do { if (i < n) out[i] = (int64_t)(v); i++; } while (0)

int viasd_layer_layout(int64_t *out, int n) {
    int i = 0;
    PUT(sizeof(struct viasd_layer_kernels));
    PUT(offsetof(struct viasd_layer_kernels, norm));
    PUT(offsetof(struct viasd_layer_kernels, int4_mm));
    PUT(offsetof(struct viasd_layer_kernels, f32_mm));
    PUT(offsetof(struct viasd_layer_kernels, rope));
    PUT(offsetof(struct viasd_layer_kernels, attention));
    PUT(sizeof(struct viasd_layer));
    PUT(offsetof(struct viasd_layer, norm_in));
    PUT(offsetof(struct viasd_layer, norm_post));
    PUT(offsetof(struct viasd_layer, eps_in));
    PUT(offsetof(struct viasd_layer, eps_post));
    PUT(offsetof(struct viasd_layer, qkv_q));
    PUT(offsetof(struct viasd_layer, qkv_sz));
    PUT(offsetof(struct viasd_layer, qkv_n));
    PUT(offsetof(struct viasd_layer, o_q));
    PUT(offsetof(struct viasd_layer, o_sz));
    PUT(offsetof(struct viasd_layer, gate_up_q));
    PUT(offsetof(struct viasd_layer, gate_up_sz));
    PUT(offsetof(struct viasd_layer, gate_up_n));
    PUT(offsetof(struct viasd_layer, w_q));
    PUT(offsetof(struct viasd_layer, w_k));
    PUT(offsetof(struct viasd_layer, w_v));
    PUT(offsetof(struct viasd_layer, w_o));
    PUT(offsetof(struct viasd_layer, w_gate));
    PUT(offsetof(struct viasd_layer, w_up));
    PUT(offsetof(struct viasd_layer, k_cache));
    PUT(offsetof(struct viasd_layer, v_cache));
    PUT(offsetof(struct viasd_layer, slots));
    PUT(offsetof(struct viasd_layer, group));
    PUT(offsetof(struct viasd_layer, hidden));
    PUT(offsetof(struct viasd_layer, heads));
    PUT(offsetof(struct viasd_layer, kv_heads));
    PUT(offsetof(struct viasd_layer, head_dim));
    PUT(offsetof(struct viasd_layer, scale));
    PUT(offsetof(struct viasd_layer, window));
    PUT(offsetof(struct viasd_layer, dtype));
    return i;
}
