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
 * bfloat16 activations; returns 0, or the step that refused its arguments (1-7).
 */
#include <stdint.h>

typedef int (*norm_fn)(const void *, const void *, void *, int64_t, int64_t, float, int);
typedef int (*int4_mm_fn)(const void *, const void *, const void *, int64_t, int64_t, int64_t, int64_t, void *,
                          const void *, int);
typedef int (*rope_fn)(const void *, int64_t, const void *, int64_t, const void *, int64_t, const void *,
                       const void *, const int64_t *, void *, void *, void *, int, int, int, int, int64_t, int);
typedef int (*attention_fn)(const void *, int64_t, int64_t, const void *, const void *, int, int, int, int, int,
                            int64_t, int, int, const uint8_t *, int64_t, float, void *, int);

/* The kernels (their addresses) */
struct kernels {
    const void *norm, *int4_mm, *rope, *attention;
};

/* One layer's weights, cache and sizes (bound once) */
struct layer {
    const void *norm_in, *norm_post;
    float eps_in, eps_post;
    const void *qkv_q, *qkv_sz;
    int64_t qkv_n;
    const void *o_q, *o_sz;
    const void *gate_up_q, *gate_up_sz;
    int64_t gate_up_n;
    void *k_cache, *v_cache;
    int64_t slots, group;
    int hidden, heads, kv_heads, head_dim;
    float scale;
    int window;  /* a sliding window's keys (0: none) */
};

/* x [T, hidden]; scratch h, h2 [T, hidden], qkv [T, qkv_n], q [heads, T, head_dim], a [T, heads *
 * head_dim]; out x2 [T, hidden], gu [T, gate_up_n]; cos, sin [T, head_dim]; pos [T] slots; rows attend
 * the cache up to `end` (causal, within the layer's window). */
int viasd_layer_front(const struct kernels *k, const struct layer *L, int T, const void *x, void *h, void *qkv,
                      void *q, void *a, void *x2, void *h2, void *gu, const void *cos, const void *sin,
                      const int64_t *pos, int end, int threads) {
    const norm_fn norm = (norm_fn)k->norm;
    const int4_mm_fn mm = (int4_mm_fn)k->int4_mm;
    const int64_t H = L->hidden, D = L->head_dim, inner = (int64_t)L->heads * L->head_dim;
    if (norm(x, L->norm_in, h, T, H, L->eps_in, 1))
        return 1;
    if (mm(h, L->qkv_q, L->qkv_sz, T, L->qkv_n, H, L->group, qkv, 0, threads))
        return 2;
    const char *b = (const char *)qkv;  /* q, k, v side by side in each row, bfloat16 */
    if (((rope_fn)k->rope)(b, L->qkv_n, b + inner * 2, L->qkv_n, b + (inner + (int64_t)L->kv_heads * D) * 2,
                           L->qkv_n, cos, sin, pos, q, L->k_cache, L->v_cache, T, L->heads, L->kv_heads,
                           L->head_dim, L->slots, 1))
        return 3;
    if (((attention_fn)k->attention)(q, (int64_t)T * D, D, L->k_cache, L->v_cache, 1, T, L->heads, L->kv_heads,
                                     L->head_dim, L->slots, end, L->window, 0, end, L->scale, a, threads))
        return 4;
    if (mm(a, L->o_q, L->o_sz, T, H, inner, L->group, x2, x, threads))
        return 5;
    if (norm(x2, L->norm_post, h2, T, H, L->eps_post, 1))
        return 6;
    if (mm(h2, L->gate_up_q, L->gate_up_sz, T, L->gate_up_n, H, L->group, gu, 0, threads))
        return 7;
    return 0;
}
