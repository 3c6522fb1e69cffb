/* The one interface of viasd_kernels' C functions: the prototype of every function a kernel's library
 * exports, and the structs they take.
 *
 * Every C file includes this header (and cpu_build.py passes `-include viasd_kernels.h` too, so a
 * file that forgets is still checked), so the compiler checks each definition against its prototype
 * (a definition that differs is an error; a global function without a prototype here is an error
 * too: cpu_build.py builds with -Werror=missing-prototypes). The Python side reads its ctypes
 * argument and result types from this file (cpu_build.py parses it: `prototypes`), and cpu_layer.py
 * its structs, so a signature is written once. Adding a kernel: its prototype here, `#include
 * "viasd_kernels.h"` in its C file, `cpu_build.function(SOURCE, build_dir, "viasd_...")` in Python.
 *
 * What the parser takes (keep to it): one declaration a statement, `int`, `int64_t`, `float` and
 * `void` as values, any pointer (`const uint16_t *`, `const struct viasd_layer *`, `__typeof__(f) *`)
 * as an address; comments anywhere. cpu_build.py hashes this header with every C file, so a change
 * here rebuilds them all.
 */
#ifndef VIASD_KERNELS_H
#define VIASD_KERNELS_H

#include <stdint.h>

/* cpu_rms_norm.c */
int viasd_rms_norm(const void *x, const void *w, void *out, int64_t rows, int64_t H, float eps, int dtype);

/* cpu_rope_write.c */
int viasd_rope_write(const void *q, int64_t q_st, const void *k, int64_t k_st, const void *v, int64_t v_st,
                     const void *cos, const void *sin, const int64_t *pos, void *q_out, void *kc, void *vc, int T,
                     int Hq, int Hkv, int D, int64_t S, int dtype);

/* cpu_row_attention.c */
int viasd_row_attention(const void *q, int64_t q_sh, int64_t q_st, const void *k, const void *v, int dtype, int T,
                        int Hq, int Hkv, int D, int64_t S, int end, int window, const uint8_t *mask,
                        int64_t mask_stride, float scale, void *out, int threads);
int viasd_row_attention_plain(const void *q, int64_t q_sh, int64_t q_st, const void *k, const void *v, int dtype,
                              int T, int Hq, int Hkv, int D, int64_t S, int end, int window, const uint8_t *mask,
                              int64_t mask_stride, float scale, void *out, int threads);
int viasd_row_attention_lanes(void);

/* cpu_int4_widen.c */
int viasd_int4_widen(const uint8_t *q, const uint16_t *sz, int64_t N, int64_t K, int64_t group, int block,
                     uint16_t *out, int threads);

/* cpu_packed_mm.c */
int viasd_packed_mm_available(void);
int viasd_int4_mm(const uint16_t *x, const uint8_t *q, const uint16_t *sz, int64_t M, int64_t N, int64_t K,
                  int64_t group, uint16_t *out, const uint16_t *residual, int threads);
int viasd_int8_mm(const uint16_t *x, const int8_t *q, const uint16_t *scale, int64_t M, int64_t N, int64_t K,
                  uint16_t *out, const uint16_t *residual, int threads);
int viasd_int8g_mm(const uint16_t *x, const int8_t *q, const float *gs, int64_t M, int64_t N, int64_t K, float *out,
                   const float *residual, int threads);
int viasd_packed_mm_fma(void);
int viasd_int4_mm_portable64(const uint16_t *x, const uint8_t *q, const uint16_t *sz, int64_t M, int64_t N,
                             int64_t K, int64_t group, uint16_t *out, const uint16_t *residual, int threads);
int viasd_int4_mm_portable32(const uint16_t *x, const uint8_t *q, const uint16_t *sz, int64_t M, int64_t N,
                             int64_t K, int64_t group, uint16_t *out, const uint16_t *residual, int threads);
int viasd_int8_mm_portable(const uint16_t *x, const int8_t *q, const uint16_t *scale, int64_t M, int64_t N,
                           int64_t K, uint16_t *out, const uint16_t *residual, int threads);
int viasd_int8g_mm_portable(const uint16_t *x, const int8_t *q, const float *gs, int64_t M, int64_t N, int64_t K,
                            float *out, const float *residual, int threads);

/* cpu_int4_q8.c */
int viasd_int4_q8_available(void);
int viasd_int4_mm_q8_32(const uint16_t *x, const uint8_t *q, const uint16_t *sz, int64_t M, int64_t N, int64_t K,
                        int64_t group, uint16_t *out, const uint16_t *residual, int threads);
int viasd_int4_mm_q8_64(const uint16_t *x, const uint8_t *q, const uint16_t *sz, int64_t M, int64_t N, int64_t K,
                        int64_t group, uint16_t *out, const uint16_t *residual, int threads);
int viasd_int8_mm_q8(const uint16_t *x, const int8_t *q, const uint16_t *scale, int64_t M, int64_t N, int64_t K,
                     uint16_t *out, const uint16_t *residual, int threads);

/* cpu_f32_mm.c */
int viasd_f32_mm_vector_bits(void);
int viasd_f32_mm(const float *x, const float *w, const float *bias, int64_t M, int64_t N, int64_t K, float *out,
                 const float *residual, int threads);
int viasd_f32_mm_ld(const float *x, const float *w, const float *bias, int64_t M, int64_t N, int64_t K, float *out,
                    const float *residual, int64_t ld, int threads);

/* cpu_layer.c: the kernels a layer's front half calls (their addresses, typed by their prototypes
 * above) */
struct viasd_layer_kernels {
    __typeof__(viasd_rms_norm) *norm;
    __typeof__(viasd_int4_mm) *int4_mm;
    __typeof__(viasd_f32_mm_ld) *f32_mm;
    __typeof__(viasd_rope_write) *rope;
    __typeof__(viasd_row_attention) *attention;
};

/* One layer's weights, cache and sizes (bound once): an int4 layer's fused q/k/v, o and gate/up
 * products (qkv_q .. gate_up_sz, bfloat16 activations), or a float32 layer's seven weights (w_q ..
 * w_up); qkv_n and gate_up_n are the fused outputs' widths either way */
struct viasd_layer {
    const void *norm_in;
    const void *norm_post;
    float eps_in;
    float eps_post;
    const void *qkv_q;
    const void *qkv_sz;
    int64_t qkv_n;
    const void *o_q;
    const void *o_sz;
    const void *gate_up_q;
    const void *gate_up_sz;
    int64_t gate_up_n;
    const void *w_q;  /* float32 layers (dtype 0): each product's weight [N, K] (int4: NULL) */
    const void *w_k;
    const void *w_v;
    const void *w_o;
    const void *w_gate;
    const void *w_up;
    void *k_cache;
    void *v_cache;
    int64_t slots;
    int64_t group;
    int hidden;
    int heads;
    int kv_heads;
    int head_dim;
    float scale;
    int window;  /* a sliding window's keys (0: none) */
    int dtype;  /* 0: float32 activations and weights (f32_mm); 1: bfloat16 activations, int4 weights (int4_mm) */
};

int viasd_layer_front(const struct viasd_layer_kernels *k, const struct viasd_layer *L, int T, const void *x,
                      void *h, void *qkv, void *q, void *a, void *x2, void *h2, void *gu, const void *cos,
                      const void *sin, const int64_t *pos, int end, int threads);

/* The two structs as this compiler lays them out, into out[0 .. n): the size of struct
 * viasd_layer_kernels, its fields' offsets in order, the size of struct viasd_layer, its fields'
 * offsets in order. Returns how many values that is (tests/test_kernels_contract.py compares them
 * with ctypes'). */
int viasd_layer_layout(int64_t *out, int n);

#endif
