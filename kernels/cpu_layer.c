/* A decoder layer's calls up to its MLP activation in one call, for a CPU's short passes
 * (viasd_kernels.cpu_layer).
 *
 * A 1-token int4 pass of a 30-layer model paid about 49 us a layer in calls alone (Python, ctypes,
 * the operators between the kernels), a third of the pass. This function runs, in order, the very
 * kernels the pass calls one by one, handed to it as function pointers (no second copy of any
 * arithmetic: every number is the one the separate calls compute):
 *
 *   h    = rms_norm(x)                        (cpu_rms_norm)
 *   qkv  = h W_qkv^T                          (cpu_packed_mm, int4)
 *   q    = rope(q); the cache takes rope(k), v (cpu_rope_write)
 *   a    = row attention of q over the cache  (cpu_row_attention)
 *   x2   = x + a W_o^T                        (cpu_packed_mm, the residual added as it stores)
 *   h2   = rms_norm(x2)
 *   gu   = h2 W_gate_up^T
 *
 * The caller then runs silu(gate) * up and the down product (with x2 as its residual) as before.
 * bfloat16 activations; returns 0, or the step that refused its arguments (1-7). The structs and the
 * prototypes are viasd_kernels.h's.
 */
#include <stddef.h>
#include <stdint.h>

#include "viasd_kernels.h"

/* x [T, hidden]; scratch h, h2 [T, hidden], qkv [T, qkv_n], q [heads, T, head_dim], a [T, heads *
 * head_dim]; out x2 [T, hidden], gu [T, gate_up_n]; cos, sin [T, head_dim]; pos [T] slots; rows attend
 * the cache up to `end` (causal, within the layer's window). The kernels are called through pointers
 * of their own prototypes' types (viasd_kernels.h), so every argument is checked by the compiler. */
int viasd_layer_front(const struct viasd_layer_kernels *k, const struct viasd_layer *L, int T, const void *x,
                      void *h, void *qkv, void *q, void *a, void *x2, void *h2, void *gu, const void *cos,
                      const void *sin, const int64_t *pos, int end, int threads) {
    const int64_t H = L->hidden, D = L->head_dim, inner = (int64_t)L->heads * L->head_dim;
    if (k->norm(x, L->norm_in, h, T, H, L->eps_in, 1))
        return 1;
    if (k->int4_mm(h, L->qkv_q, L->qkv_sz, T, L->qkv_n, H, L->group, qkv, 0, threads))
        return 2;
    const char *b = (const char *)qkv;  /* q, k, v side by side in each row, bfloat16 */
    if (k->rope(b, L->qkv_n, b + inner * 2, L->qkv_n, b + (inner + (int64_t)L->kv_heads * D) * 2, L->qkv_n, cos, sin,
                pos, q, L->k_cache, L->v_cache, T, L->heads, L->kv_heads, L->head_dim, L->slots, 1))
        return 3;
    if (k->attention(q, (int64_t)T * D, D, L->k_cache, L->v_cache, 1, T, L->heads, L->kv_heads, L->head_dim,
                     L->slots, end, L->window, 0, end, L->scale, a, threads))
        return 4;
    if (k->int4_mm(a, L->o_q, L->o_sz, T, H, inner, L->group, x2, x, threads))
        return 5;
    if (k->norm(x2, L->norm_post, h2, T, H, L->eps_post, 1))
        return 6;
    if (k->int4_mm(h2, L->gate_up_q, L->gate_up_sz, T, L->gate_up_n, H, L->group, gu, 0, threads))
        return 7;
    return 0;
}

#define PUT(v) do { if (i < n) out[i] = (int64_t)(v); i++; } while (0)

int viasd_layer_layout(int64_t *out, int n) {
    int i = 0;
    PUT(sizeof(struct viasd_layer_kernels));
    PUT(offsetof(struct viasd_layer_kernels, norm));
    PUT(offsetof(struct viasd_layer_kernels, int4_mm));
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
    return i;
}
