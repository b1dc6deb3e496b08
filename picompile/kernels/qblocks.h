/* picompile: GGUF block helpers shared by the CPU kernels (dense.c and the generated FFN source):
 * float16 -> float32, activations rounded to 8 bits per block of 32, and the dot product of a row
 * of 4-bit blocks (q4_0 / q4_1) with them in integers.
 *
 * Spliced into both sources (picompile.codegen.c.package_source inlines `#include "qblocks.h"`),
 * so a kernel's cache key covers it. The int8 activations are llama.cpp's scheme: a 4-bit block
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
 *
 * SIMD: AVX2 + FMA + F16C (VNNI's vpdpbusd where AVX512_VNNI and AVX512VL are enabled), unless
 * PQ_SCALAR is defined before the #include; the rounding of x is the same either way.
 */
#ifndef PICOMPILE_QBLOCKS_H
#define PICOMPILE_QBLOCKS_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(PQ_SCALAR)
#include <immintrin.h>
#define PQ_SIMD 1
#else
#define PQ_SIMD 0
#endif
#define PQ_INLINE static inline __attribute__((always_inline))

#define PQ_QK 32 /* values per block */

/* float16 -> float32, exact, in software (the scalar paths) */
PQ_INLINE float pq_f16(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);          /* inf, nan */
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);  /* normal: rebias 15 -> 127 */
    } else if (mant == 0) {
        bits = sign;                                         /* +-0 */
    } else {                                                 /* subnormal: normalize */
        exp = 113;
        while (!(mant & 0x400u)) { mant <<= 1; exp--; }
        bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

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
#if PQ_SIMD
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
#if PQ_SIMD
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
PQ_INLINE int32_t pq_dot_scalar(const uint8_t* qs, const int8_t* q) {
    int32_t t = 0;
    for (int i = 0; i < 16; ++i) t += (qs[i] & 15) * q[i] + (qs[i] >> 4) * q[i + 16];
    return t;
}

#if PQ_SIMD
/* The 32 nibbles of qs [16] as unsigned bytes, in weight order. */
PQ_INLINE __m256i pq_nibbles(const uint8_t* qs) {
    const __m128i b = _mm_loadu_si128((const __m128i*)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(15));
}

/* 8 partial sums of n[i] * q[i] (n unsigned <= 15, q int8) as float32; their total is n . q.
 * (maddubs cannot saturate: two products are at most 2 * 15 * 128.) */
PQ_INLINE __m256 pq_dot8(__m256i n, const int8_t* q) {
    const __m256i qv = _mm256_loadu_si256((const __m256i*)q);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), n, qv));
#else
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(n, qv), _mm256_set1_epi16(1)));
#endif
}

PQ_INLINE float pq_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Block j of a 4-bit row against N tokens: acc[n * U + u] += dw * d * (n . q) (8 lanes),
 * corr[n] += c * s (c: dw for q4_0, m for q4_1). */
PQ_INLINE void pq_q4_block(const uint8_t* blk, const int q4_1, int64_t j, const pq_act* const* xa,
                           __m256* acc, float* corr, const int N, const int U, const int u) {
    int32_t head;
    memcpy(&head, blk, 4); /* dw, and for q4_1 m: one conversion */
    const __m128 h = _mm_cvtph_ps(_mm_cvtsi32_si128(head));
    const float dw = _mm_cvtss_f32(h), c = q4_1 ? _mm_cvtss_f32(_mm_movehdup_ps(h)) : dw;
    const __m256i nib = pq_nibbles(blk + (q4_1 ? 4 : 2));
    for (int n = 0; n < N; ++n) {
        acc[n * U + u] = _mm256_fmadd_ps(pq_dot8(nib, xa[n]->q + j * PQ_QK),
                                         _mm256_set1_ps(dw * xa[n]->d[j]), acc[n * U + u]);
        corr[n] = fmaf(c, xa[n]->s[j], corr[n]);
    }
}
#endif

/* res[n] = row . x'[n] for n < N (N <= 8) over one row of nb 4-bit blocks (q4_1: 20-byte blocks
 * f16 dw, f16 m, qs[16]; q4_0: 18-byte blocks f16 dw, qs[16]), x'[n] = xa[n] rounded. N x U
 * accumulators of 8 floats (N * U <= 8; consecutive blocks take turns); with pf > 0 one
 * prefetch pf bytes ahead per 64 bytes of a step's blocks. */
PQ_INLINE void pq_q4_dot(const uint8_t* row, const int q4_1, int64_t nb, const pq_act* const* xa,
                         float* res, const int N, const int U, const int pf) {
    const int64_t bb = q4_1 ? 20 : 18;
    const float sign = q4_1 ? 1.0f : -8.0f; /* the block-sum term: + m s, -8 dw s */
    float corr[8];
    for (int n = 0; n < N; ++n) corr[n] = 0.0f;
#if PQ_SIMD
    __m256 acc[8];
    for (int i = 0; i < N * U; ++i) acc[i] = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + U <= nb; j += U) {
        if (pf > 0)
            for (int64_t l = 0; l < (U * bb + 63) / 64; ++l)
                _mm_prefetch((const char*)(row + j * bb + pf + 64 * l), _MM_HINT_T0);
        for (int u = 0; u < U; ++u) pq_q4_block(row + (j + u) * bb, q4_1, j + u, xa, acc, corr, N, U, u);
    }
    for (; j < nb; ++j) pq_q4_block(row + j * bb, q4_1, j, xa, acc, corr, N, U, 0);
    for (int n = 0; n < N; ++n) {
        __m256 t = acc[n * U];
        for (int u = 1; u < U; ++u) t = _mm256_add_ps(t, acc[n * U + u]);
        res[n] = pq_hsum(t) + sign * corr[n];
    }
#else
    float r[8] = {0};
    (void)U;
    for (int64_t j = 0; j < nb; ++j) {
        const uint8_t* blk = row + j * bb;
        if (pf > 0) __builtin_prefetch(blk + pf, 0, 3);
        const float dw = pq_f16((uint16_t)(blk[0] | blk[1] << 8));
        const float c = q4_1 ? pq_f16((uint16_t)(blk[2] | blk[3] << 8)) : dw;
        for (int n = 0; n < N; ++n) {
            r[n] += (float)pq_dot_scalar(blk + (q4_1 ? 4 : 2), xa[n]->q + j * PQ_QK) * (dw * xa[n]->d[j]);
            corr[n] += c * xa[n]->s[j];
        }
    }
    for (int n = 0; n < N; ++n) res[n] = r[n] + sign * corr[n];
#endif
}
/* ---- 4-bit rows in groups of 8: the dense kernel's layout (picompile.quant.interleave_rows) ----
 * Rows 8g .. 8g + 7 of a matrix (g < O / 8; the O % 8 rows after them stay as GGUF has them) take
 * the bytes those 8 GGUF rows took; block j of the group (the 8 rows' blocks j) is 8 * bb bytes:
 *     d   f16 [8]          row r's scale
 *     m   f16 [8]          row r's minimum (q4_1 only)
 *     qs  u8 [4][8][4]     qs[v][r][c] = row r's GGUF byte qs[4v + c]: weight 4v + c in its low
 *                          nibble, weight 16 + 4v + c in its high nibble
 * So 32-bit lane r of vector v holds four weights of row r: one broadcast of four int8 of x
 * meets all 8 rows, a vector of 8 row sums needs no horizontal add, and the 8 rows' scales
 * apply as one vector (llama.cpp's repacked Q4_0 rows are the same idea). */
#define PQ_GROUP 8

#if PQ_SIMD
PQ_INLINE __m256i pq_bcast4(const int8_t* q) { /* q[0..3] in every 32-bit lane */
    int32_t v;
    memcpy(&v, q, 4);
    return _mm256_set1_epi32(v);
}

/* int32 [8]: lane r = sum over the block's 32 weights of row r times q [32], exact. nib[i]:
 * the unsigned weights that meet q[4i .. 4i + 3] (i < 4: low nibbles of vector i, else the
 * high nibbles of vector i - 4). maddubs pairs stay in int16: 8 steps of two products of at
 * most 15 * 127 sum to at most 30480. */
PQ_INLINE __m256i pq_dot_group(const __m256i* nib, const int8_t* q) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    __m256i s = _mm256_setzero_si256();
    for (int i = 0; i < 8; ++i) s = _mm256_dpbusd_epi32(s, nib[i], pq_bcast4(q + 4 * i));
    return s;
#else
    __m256i s = _mm256_maddubs_epi16(nib[0], pq_bcast4(q));
    for (int i = 1; i < 8; ++i) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(nib[i], pq_bcast4(q + 4 * i)));
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
#endif
}
#endif

/* res[n * 8 + r] = row r . x'[n] for the 8 rows of one group (grp: its first byte) and n < N
 * (N <= 8), x'[n] = xa[n] rounded; nb blocks per row; with pf > 0 a prefetch pf bytes ahead
 * per 64 bytes. Per block: q4_0 adds dw * (dx * (n . q) - 8 sx), q4_1 dw dx (n . q) + m sx. */
PQ_INLINE void pq_q4x8_dot(const uint8_t* grp, const int q4_1, int64_t nb, const pq_act* const* xa,
                           float* res, const int N, const int pf) {
    const int64_t gb = PQ_GROUP * (q4_1 ? 20 : 18); /* bytes of one block of the group */
    const int hb = q4_1 ? 32 : 16;                  /* its scales (and minimums) */
#if PQ_SIMD
    __m256 acc[8];
    for (int n = 0; n < N; ++n) acc[n] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(15);
    for (int64_t j = 0; j < nb; ++j) {
        const uint8_t* blk = grp + j * gb;
        if (pf > 0)
            for (int64_t l = 0; l < (gb + 63) / 64; ++l)
                _mm_prefetch((const char*)(blk + pf + 64 * l), _MM_HINT_T0);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)blk));
        const __m256 mw = q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 16)))
                               : _mm256_setzero_ps();
        __m256i nib[8];
        for (int v = 0; v < 4; ++v) {
            const __m256i b = _mm256_loadu_si256((const __m256i*)(blk + hb + 32 * v));
            nib[v] = _mm256_and_si256(b, low);
            nib[4 + v] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
        }
        for (int n = 0; n < N; ++n) {
            const __m256 sf = _mm256_cvtepi32_ps(pq_dot_group(nib, xa[n]->q + j * PQ_QK));
            const float dx = xa[n]->d[j], sx = xa[n]->s[j];
            if (q4_1) {
                acc[n] = _mm256_fmadd_ps(sf, _mm256_mul_ps(dw, _mm256_set1_ps(dx)), acc[n]);
                acc[n] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sx), acc[n]);
            } else {
                acc[n] = _mm256_fmadd_ps(
                    dw, _mm256_fmadd_ps(sf, _mm256_set1_ps(dx), _mm256_set1_ps(-8.0f * sx)), acc[n]);
            }
        }
    }
    for (int n = 0; n < N; ++n) _mm256_storeu_ps(res + PQ_GROUP * n, acc[n]);
#else
    for (int n = 0; n < N; ++n)
        for (int r = 0; r < PQ_GROUP; ++r) res[PQ_GROUP * n + r] = 0.0f;
    for (int64_t j = 0; j < nb; ++j) {
        const uint8_t* blk = grp + j * gb;
        if (pf > 0) __builtin_prefetch(blk + pf, 0, 3);
        for (int r = 0; r < PQ_GROUP; ++r) {
            const float dw = pq_f16((uint16_t)(blk[2 * r] | blk[2 * r + 1] << 8));
            const float m = q4_1 ? pq_f16((uint16_t)(blk[16 + 2 * r] | blk[17 + 2 * r] << 8)) : 0.0f;
            uint8_t qs[16]; /* row r's GGUF qs bytes */
            for (int v = 0; v < 4; ++v)
                for (int c = 0; c < 4; ++c) qs[4 * v + c] = blk[hb + 32 * v + 4 * r + c];
            for (int n = 0; n < N; ++n) {
                const float dx = xa[n]->d[j], sx = xa[n]->s[j];
                const float t = (float)pq_dot_scalar(qs, xa[n]->q + j * PQ_QK);
                float* out = res + PQ_GROUP * n + r;
                *out = q4_1 ? fmaf(m, sx, fmaf(t, dw * dx, *out)) : fmaf(dw, fmaf(t, dx, -8.0f * sx), *out);
            }
        }
    }
#endif
}
#endif /* PICOMPILE_QBLOCKS_H */
