/* An int4 weight widened to bfloat16 in one pass (viasd_kernels.cpu_int4_widen).
 *
 * A prompt's prefill multiplies each int4 layer through one dense product over the layer's weight
 * widened to bfloat16 (viasd_core/runtime/weight_formats.py: PackedLinear.widened). PyTorch's
 * operators widen it in five passes over a float32 copy (unpack each half of a block, multiply by
 * the scales, add the shifts, round). A group of `group` inputs of one output takes only 16 values,
 * so this computes those 16 once per output and group, with the operators' arithmetic in float32,
 * each step rounded on its own (no fused multiply-add: built with fp-contract off),
 *
 *   shift     = zero - 8 * scale                         (8 * scale is exact)
 *   value[q]  = bf16(float(q) * scale + shift)           rounded to nearest, ties to even
 *
 * and then writes each weight as the value its 4 bits name, reading the packed bytes once: bit for
 * bit the operators' result (tests/test_kernels_cpu_int4_widen.py checks it).
 *
 * Layout (PyTorch's CPU int4 packing in blocks of `block` outputs, 64 on AVX-512 builds, 32 on
 * AVX2): the weight [N, K] is N / block blocks of [K, block / 2] bytes; byte j of row k holds output
 * j of the block in its low nibble and output j + block / 2 in its high nibble. scale_and_zero is
 * [K / group, N, 2] bfloat16 (scale, zero). Built once per machine by viasd_kernels/cpu_int4_widen.py.
 */
#include <stdint.h>
#include <string.h>

#include "cpu_bf16.h"
#include "viasd_kernels.h"
#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

#define MAX_BLOCK 64
#define MAX_GROUP 256

/* out [N, K] bfloat16 from the packed weight q and scale_and_zero sz. Returns 0, or -1 for
 * arguments it cannot take. */
VIASD_NO_CONTRACT
int viasd_int4_widen(const uint8_t *q, const uint16_t *sz, int64_t N, int64_t K, int64_t group, int block,
                     uint16_t *out, int threads) {
    VIASD_NO_CONTRACT_BODY
    if (block <= 0 || block > MAX_BLOCK || block % 2 || N <= 0 || N % block || K <= 0 || group <= 0
        || group > MAX_GROUP || K % group)
        return -1;
    const int half = block / 2;
    const int64_t blocks = N / block, groups = K / group;
    #pragma omp parallel for collapse(2) num_threads(threads > 0 ? threads : 1) schedule(static)
    for (int64_t nb = 0; nb < blocks; nb++) {
        for (int64_t g = 0; g < groups; g++) {
            uint16_t value[MAX_BLOCK][16];
            uint8_t bytes[MAX_BLOCK / 2][MAX_GROUP];  /* the group's bytes, by output pair */
            for (int j = 0; j < block; j++) {
                const uint16_t *p = sz + (g * N + nb * block + j) * 2;
                float s = bf16_to_f32(p[0]);
                float eight_s = 8.0f * s;
                float shift = bf16_to_f32(p[1]) - eight_s;
                for (int v = 0; v < 16; v++) {
                    float scaled = (float)v * s;
                    value[j][v] = f32_to_bf16(scaled + shift);
                }
            }
            const uint8_t *rows = q + (nb * K + g * group) * half;
            for (int64_t kk = 0; kk < group; kk++)
                for (int j = 0; j < half; j++)
                    bytes[j][kk] = rows[kk * half + j];
            for (int j = 0; j < half; j++) {
                uint16_t *lo = out + (nb * block + j) * K + g * group;
                uint16_t *hi = out + (nb * block + j + half) * K + g * group;
                int64_t kk = 0;
#if defined(__AVX512BW__)
                /* 32 weights at a time: each 4-bit code picks its 16-bit value from the output's 16 */
                __m512i lo_values = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)value[j]));
                __m512i hi_values = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)value[j + half]));
                for (; kk + 32 <= group; kk += 32) {
                    __m512i codes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)&bytes[j][kk]));
                    __m512i lo_codes = _mm512_and_si512(codes, _mm512_set1_epi16(0xF));
                    __m512i hi_codes = _mm512_srli_epi16(codes, 4);
                    _mm512_storeu_si512((void *)(lo + kk), _mm512_permutexvar_epi16(lo_codes, lo_values));
                    _mm512_storeu_si512((void *)(hi + kk), _mm512_permutexvar_epi16(hi_codes, hi_values));
                }
#endif
                for (; kk < group; kk++) {
                    lo[kk] = value[j][bytes[j][kk] & 0xF];
                    hi[kk] = value[j + half][bytes[j][kk] >> 4];
                }
            }
        }
    }
    return 0;
}
