/* picompile: activations quantized to 8 bits per block of 32, and the integer dot product of a
 * 4-bit weight block (q4_0 / q4_1) with them.
 *
 * Spliced into dense.c and the generated FFN source (picompile.codegen.c.package_source inlines
 * `#include "q8_act.h"`), so a kernel's cache key covers it. llama.cpp's scheme: a 4-bit block
 * dotted with float32 x costs more instructions per weight than two cores can issue at memory
 * speed (BENCHMARKS.md, session 6); with x as int8 it is one widening of the nibbles and one
 * integer multiply-add per token. The reference (picompile.quant.round_activations) rounds x the
 * same way, bit for bit, before its float matmul.
 *
 * Per block b of 32 values of a token row x [K] (K a multiple of 32):
 *     amax = max |x[i]|,  d[b] = amax / 127,  q[i] = round-half-even(x[i] * (1 / d[b]))
 *     (all zero when amax == 0),  s[b] = d[b] * sum(q[i])
 * A 4-bit block (scale dw; q4_0 weight dw * (n - 8), q4_1 dw * n + m) dotted with that block:
 *     q4_0: dw * d[b] * (n . q) - 8 * dw * s[b]        q4_1: dw * d[b] * (n . q) + m * s[b]
 * n . q (nibbles 0..15 times int8) is exact in int32.
 */
#ifndef PICOMPILE_Q8_ACT_H
#define PICOMPILE_Q8_ACT_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define PQ_QK 32 /* values per block */

/* One token's quantized row: q [K] int8, d [K / 32] block scales, s [K / 32] d * sum(q). */
typedef struct {
    const int8_t* q;
    const float* d;
    const float* s;
} pq_act;

/* x [K] float32 -> q [K], d [K / 32], s [K / 32]. The AVX2 path computes exactly what the scalar
 * one does (the same IEEE operations, round half to even). */
static void pq_quantize(const float* x, int64_t K, int8_t* q, float* d, float* s) {
    for (int64_t b = 0; b < K / PQ_QK; ++b) {
        const float* xb = x + b * PQ_QK;
        int8_t* qb = q + b * PQ_QK;
#if defined(__AVX2__)
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
#else
        float amax = 0.0f;
        for (int i = 0; i < PQ_QK; ++i) {
            const float a = fabsf(xb[i]);
            amax = a > amax ? a : amax;
        }
#endif
        const float db = amax / 127.0f, inv = db != 0.0f ? 1.0f / db : 0.0f;
        int32_t sum = 0;
#if defined(__AVX2__)
        const __m256 iv = _mm256_set1_ps(inv);
        __m256i qi[4];
        for (int i = 0; i < 4; ++i)
            qi[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], iv),
                                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        /* int32 -> int8 in order: packs interleave the 128-bit lanes, the permute restores them */
        const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]), p16b = _mm256_packs_epi32(qi[2], qi[3]);
        const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b),
                                                       _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i*)qb, p8);
        const __m256i s32 = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        sum = _mm_cvtsi128_si32(s4);
#else
        for (int i = 0; i < PQ_QK; ++i) {
            qb[i] = (int8_t)nearbyintf(xb[i] * inv);
            sum += qb[i];
        }
#endif
        d[b] = db;
        s[b] = db * (float)sum;
    }
}

/* The T rows of x [T, K] quantized: pq_act [T] followed by their data, one allocation (the
 * caller frees the returned pointer); NULL when out of memory. */
static pq_act* pq_quantize_rows(const float* x, int64_t T, int64_t K) {
    const int64_t nb = K / PQ_QK;
    pq_act* a = (pq_act*)malloc((size_t)T * (sizeof(pq_act) + (size_t)K + 2 * (size_t)nb * sizeof(float)));
    if (!a) return NULL;
    float* ds = (float*)(a + T); /* per row: d [nb], then s [nb] */
    int8_t* qs = (int8_t*)(ds + 2 * T * nb);
    for (int64_t t = 0; t < T; ++t) {
        float *d = ds + 2 * t * nb, *s = d + nb;
        pq_quantize(x + t * K, K, qs + t * K, d, s);
        a[t].q = qs + t * K;
        a[t].d = d;
        a[t].s = s;
    }
    return a;
}

/* n . q over one block: the 32 nibbles of qs [16] (weight i: the low nibble of qs[i] for i < 16,
 * the high nibble of qs[i - 16] above) times q [32] int8, exact. */
static inline int32_t pq_dot_scalar(const uint8_t* qs, const int8_t* q) {
    int32_t t = 0;
    for (int i = 0; i < 16; ++i) t += (qs[i] & 15) * q[i] + (qs[i] >> 4) * q[i + 16];
    return t;
}

#if defined(__AVX2__)
/* The 32 nibbles of qs [16] as unsigned bytes, in weight order. */
static inline __attribute__((always_inline)) __m256i pq_nibbles(const uint8_t* qs) {
    const __m128i b = _mm_loadu_si128((const __m128i*)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(15));
}

/* 8 partial sums of n[i] * q[i] (n unsigned <= 15, q int8) as float32; their total is n . q.
 * (maddubs cannot saturate: two products are at most 2 * 15 * 128.) */
static inline __attribute__((always_inline)) __m256 pq_dot8(__m256i n, const int8_t* q) {
    const __m256i qv = _mm256_loadu_si256((const __m256i*)q);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), n, qv));
#else
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(n, qv), _mm256_set1_epi16(1)));
#endif
}

static inline __attribute__((always_inline)) float pq_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif
#endif /* PICOMPILE_Q8_ACT_H */
