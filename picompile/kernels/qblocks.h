/* picompile: GGUF block helpers shared by the CPU kernels (dense.c and the generated FFN source):
 * float16 -> float32, activations rounded to integers per block of 32, and the dot product of a
 * row of blocks (q8_0, q4_0, q4_1) with them in integers.
 *
 * Spliced into both sources (picompile.codegen.build.package_source inlines `#include "qblocks.h"`),
 * so a kernel's cache key covers it. Integer activations are llama.cpp's scheme: a quantized
 * block dotted with float32 x costs more instructions per weight than two cores can issue at
 * memory speed (BENCHMARKS.md, sessions 6 and 15). 4-bit rows take x rounded to 8 bits (one
 * integer multiply-add per 32 weights and token); q8_0 rows take it rounded to 16 bits (int8 x,
 * llama.cpp's choice, cost SmolLM2 +0.44% perplexity at q8_0; int8 weights times int16 x are
 * one multiply-add per 16 weights, as fast as the sign trick int8 x int8 needs). The reference
 * (picompile.quant.round_activations) rounds x the same way, bit for bit, before its float
 * matmul.
 *
 * Per block b of 32 values of a token row x [K] (K a multiple of 32), L = 127 (8 bits) or
 * 32767 (16 bits):
 *     amax = max |x[i]|,  d[b] = amax / L,  q[i] = round-half-even(x[i] * (1 / d[b]))
 *     (all zero when amax == 0),  s[b] = d[b] * sum(q[i]) (8 bits)
 * A block (scale dw; q8_0 weight dw * w, q4_0 dw * (n - 8), q4_1 dw * n + m) dotted with it:
 *     q8_0: dw * d[b] * (w . q)     q4_0: dw * d[b] * (n . q) - 8 * dw * s[b]
 *     q4_1: dw * d[b] * (n . q) + m * s[b]
 * w . q (int8 times int16) and n . q (nibbles 0..15 times int8) are exact in int32.
 *
 * The dot layout (picompile.quant.interleave_blocks): a row that is dotted with x (dense
 * weights, FFN gate and up rows) keeps its bytes but each run of PQ_SB = 8 blocks (256 weights)
 * is a superblock: the 8 blocks' float16 scales dw[8], for q4_1 their minimums m[8], then their
 * weights in pieces. 4-bit: qs [4][8][4], qs[v][b][c] = block b's GGUF byte qs[4v + c] (its
 * weights 4v + c, low nibble, and 16 + 4v + c, high nibble); q8_0: w [16][8][2], w[v][b][c] =
 * block b's weight 2v + c. The nb % 8 blocks after the last superblock stay as GGUF has them.
 * x's integers are stored to match (pq_act_index): per superblock [8][8][4] with [i][b][c] =
 * x[32b + 4i + c] for 4-bit rows (pieces i < 4 meet the low nibbles, i >= 4 the high ones),
 * [16][8][2] with [v][b][c] = x[32b + 2v + c] for q8_0 rows. Then 32-bit lane b of every vector
 * belongs to block b: no horizontal sum per block, and the 8 blocks' scales apply as one vector
 * (llama.cpp's repacked Q4_0 rows interleave several rows; this interleaves blocks of one row,
 * which keeps a neuron's row contiguous for the sparse kernels). FFN down rows are added into
 * the output, not dotted: they keep GGUF's layout.
 *
 * SIMD: AVX2 + FMA + F16C (VNNI's vpdpbusd for 4-bit rows where AVX512_VNNI and AVX512VL are
 * enabled), unless PQ_SCALAR is defined before the #include; the rounding of x is the same
 * either way.
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
#ifndef PQ_PF_HINT
#define PQ_PF_HINT 3 /* software prefetches: _MM_HINT_T0 (3), into every cache level */
#endif

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

#define PQ_SB 8 /* blocks per superblock of the dot layout */

/* One token's quantized row, for 4-bit rows: q [K] int8 (in the dot layout's order, see above),
 * d [K / 32] block scales, s [K / 32] d * sum(q); for q8_0 rows: q16 [K] int16 (the q8_0 dot
 * layout's order), d. The other pointers NULL. */
typedef struct {
    const int8_t* q;
    const int16_t* q16;
    const float* d;
    const float* s;
} pq_act;

/* Where x's value k of block j sits in pq_act.q (nb blocks in all; wide: q16): the dot
 * layout's order, pieces of 4 values (4-bit rows) or 2 (q8_0 rows). */
PQ_INLINE int64_t pq_act_index(int64_t nb, int64_t j, int k, int wide) {
    const int64_t g = j / PQ_SB;
    if (g >= nb / PQ_SB) return j * PQ_QK + k; /* a tail block: natural order */
    const int c = wide ? 2 : 4;                /* values per piece: piece k / c */
    return g * PQ_SB * PQ_QK + PQ_SB * c * (k / c) + c * (j % PQ_SB) + k % c;
}

/* x's block j of an 8-bit pq_act in natural order: out [32] */
PQ_INLINE void pq_act_block(const pq_act* a, int64_t nb, int64_t j, int8_t* out) {
    for (int k = 0; k < PQ_QK; ++k) out[k] = a->q[pq_act_index(nb, j, k, 0)];
}

/* max |x[i]| over one block xb [32] (the same value on both paths) */
PQ_INLINE float pq_block_amax(const float* xb) {
#if PQ_SIMD
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 mx = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 8 * i)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    return _mm_cvtss_f32(m4);
#else
    float amax = 0.0f;
    for (int i = 0; i < PQ_QK; ++i) {
        const float a = fabsf(xb[i]);
        amax = a > amax ? a : amax;
    }
    return amax;
#endif
}

#if PQ_SIMD
/* qi [4] (8 int32 each) = round-half-even(xb[i] * inv) for the block xb [32], in order: what
 * the scalar paths' nearbyintf computes */
PQ_INLINE void pq_block_round(const float* xb, float inv, __m256i* qi) {
    const __m256 iv = _mm256_set1_ps(inv);
    for (int i = 0; i < 4; ++i)
        qi[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * i), iv),
                                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

/* x [K] float32 -> q [K] int8 (the dot layout's order), d [K / 32], s [K / 32]. The AVX2 path
 * computes exactly what the scalar one does (the same IEEE operations, round half to even). */
static void pq_quantize(const float* x, int64_t K, int8_t* q, float* d, float* s) {
    const int64_t nb = K / PQ_QK;
    for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + b * PQ_QK;
        int8_t qb[PQ_QK]; /* natural order, then placed */
        const float db = pq_block_amax(xb) / 127.0f, inv = db != 0.0f ? 1.0f / db : 0.0f;
        int32_t sum = 0;
#if PQ_SIMD
        __m256i qi[4];
        pq_block_round(xb, inv, qi);
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
        for (int k = 0; k < PQ_QK; k += 4) memcpy(q + pq_act_index(nb, b, k, 0), qb + k, 4);
    }
}

/* x [K] float32 -> q16 [K] int16 (the q8_0 dot layout's order), d [K / 32]: 16 bits per block,
 * d = amax / 32767. The AVX2 path computes exactly what the scalar one does. */
static void pq_quantize16(const float* x, int64_t K, int16_t* q16, float* d) {
    const int64_t nb = K / PQ_QK;
    for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + b * PQ_QK;
        int16_t qb[PQ_QK]; /* natural order, then placed */
        const float db = pq_block_amax(xb) / 32767.0f, inv = db != 0.0f ? 1.0f / db : 0.0f;
#if PQ_SIMD
        __m256i qi[4];
        pq_block_round(xb, inv, qi);
        for (int i = 0; i < 4; i += 2) /* int32 -> int16 in order, 16 values at a time */
            _mm256_storeu_si256((__m256i*)(qb + 8 * i),
                                _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[i], qi[i + 1]), 0xd8));
#else
        for (int i = 0; i < PQ_QK; ++i) qb[i] = (int16_t)nearbyintf(xb[i] * inv);
#endif
        d[b] = db;
        for (int k = 0; k < PQ_QK; k += 2) memcpy(q16 + pq_act_index(nb, b, k, 1), qb + k, 4);
    }
}

/* The T rows of x [T, K] quantized, to 8 bits (4-bit rows) or with wide to 16 (q8_0 rows):
 * pq_act [T] followed by their data, one allocation (the caller frees the returned pointer);
 * NULL when out of memory. */
static pq_act* pq_quantize_rows(const float* x, int64_t T, int64_t K, int wide) {
    const int64_t nb = K / PQ_QK, vb = wide ? 2 : 1; /* bytes per value */
    const size_t row = sizeof(pq_act) + (size_t)(vb * K) + 2 * (size_t)nb * sizeof(float);
    pq_act* a = (pq_act*)malloc((size_t)T * row);
    if (!a) return NULL;
    float* ds = (float*)(a + T); /* per row: d [nb], then s [nb] */
    char* qs = (char*)(ds + 2 * T * nb); /* then the values */
    for (int64_t t = 0; t < T; ++t) {
        float *d = ds + 2 * t * nb, *s = d + nb;
        if (wide) {
            pq_quantize16(x + t * K, K, (int16_t*)(qs + 2 * t * K), d);
            a[t] = (pq_act){NULL, (const int16_t*)(qs + 2 * t * K), d, NULL};
        } else {
            pq_quantize(x + t * K, K, (int8_t*)(qs + t * K), d, s);
            a[t] = (pq_act){(const int8_t*)(qs + t * K), NULL, d, s};
        }
    }
    return a;
}

#if !PQ_SIMD
/* w . q over 32 pairs (int8 weights, int16 x), exact. Not vectorized by the compiler: GCC 12
 * turns int8 dot loops into vpdpbusd (unsigned times signed) where AVX512_VNNI is enabled,
 * which is wrong for w < 0 (seen with int8 x). */
__attribute__((optimize("no-tree-vectorize")))
static int32_t pq_dot_w8x16_scalar(const int8_t* w, const int16_t* q) {
    int32_t t = 0;
    for (int i = 0; i < PQ_QK; ++i) t += (int32_t)w[i] * (int32_t)q[i];
    return t;
}
#endif

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

/* int32 [8]: lane b = block b's n . q over one superblock, exact. nib[i]: its unsigned weights
 * that meet xq [256] (the dot layout's x) piece i: low nibbles of vector i for i < 4, else the
 * high nibbles of vector i - 4. maddubs pairs stay in int16: 8 steps of two products of at
 * most 15 * 127 sum to at most 30480. */
PQ_INLINE __m256i pq_dot_sb(const __m256i* nib, const int8_t* xq) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    __m256i s = _mm256_setzero_si256();
    for (int i = 0; i < 8; ++i)
        s = _mm256_dpbusd_epi32(s, nib[i], _mm256_loadu_si256((const __m256i*)(xq + 32 * i)));
    return s;
#else
    __m256i s = _mm256_maddubs_epi16(nib[0], _mm256_loadu_si256((const __m256i*)xq));
    for (int i = 1; i < 8; ++i)
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(nib[i], _mm256_loadu_si256((const __m256i*)(xq + 32 * i))));
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
#endif
}

PQ_INLINE float pq_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Block j of a 4-bit row (blk: its GGUF bytes; x's block j in natural order, a tail block)
 * against N tokens: acc[n] += dw * d * (n . q) (8 lanes), corr[n] += c * s (c: dw for q4_0, m
 * for q4_1). */
PQ_INLINE void pq_q4_block(const uint8_t* blk, const int q4_1, int64_t j, const pq_act* const* xa,
                           __m256* acc, float* corr, const int N) {
    int32_t head;
    memcpy(&head, blk, 4); /* dw, and for q4_1 m: one conversion */
    const __m128 h = _mm_cvtph_ps(_mm_cvtsi32_si128(head));
    const float dw = _mm_cvtss_f32(h), c = q4_1 ? _mm_cvtss_f32(_mm_movehdup_ps(h)) : dw;
    const __m256i nib = pq_nibbles(blk + (q4_1 ? 4 : 2));
    for (int n = 0; n < N; ++n) {
        acc[n] = _mm256_fmadd_ps(pq_dot8(nib, xa[n]->q + j * PQ_QK), _mm256_set1_ps(dw * xa[n]->d[j]),
                                 acc[n]);
        corr[n] = fmaf(c, xa[n]->s[j], corr[n]);
    }
}
#endif

/* res[n] = row . x'[n] for n < N (N <= 8) over one row of nb 4-bit blocks in the dot layout
 * (q4_1: 20-byte blocks f16 dw, f16 m, qs[16]; q4_0: 18-byte blocks f16 dw, qs[16]; each run of
 * 8 in a superblock, see above), x'[n] = xa[n] rounded. With pf != 0 one prefetch pf bytes away
 * per 64 bytes. Per block: q4_0 adds dw * (dx * (n . q) - 8 sx), q4_1 dw dx (n . q) + m sx. */
PQ_INLINE void pq_q4_dot(const uint8_t* row, const int q4_1, int64_t nb, const pq_act* const* xa,
                         float* res, const int N, const int64_t pf) {
    const int64_t bb = q4_1 ? 20 : 18, sbb = PQ_SB * bb, nsb = nb / PQ_SB;
    const int hb = q4_1 ? 4 * PQ_SB : 2 * PQ_SB; /* a superblock's scales (and minimums) */
#if PQ_SIMD
    __m256 acc[8];
    float corr[8]; /* the tail blocks' block-sum terms */
#pragma GCC unroll 8
    for (int n = 0; n < N; ++n) {
        acc[n] = _mm256_setzero_ps();
        corr[n] = 0.0f;
    }
    const __m256i low = _mm256_set1_epi8(15);
    for (int64_t g = 0; g < nsb; ++g) {
        const uint8_t* blk = row + g * sbb;
        if (pf != 0)
            for (int64_t l = 0; l < (sbb + 63) / 64; ++l)
                _mm_prefetch((const char*)(blk + pf + 64 * l), PQ_PF_HINT);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)blk));
        const __m256 mw = q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 16)))
                               : _mm256_setzero_ps();
        __m256i nib[8];
        for (int v = 0; v < 4; ++v) {
            const __m256i b = _mm256_loadu_si256((const __m256i*)(blk + hb + 32 * v));
            nib[v] = _mm256_and_si256(b, low);
            nib[4 + v] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
        }
#pragma GCC unroll 8
        for (int n = 0; n < N; ++n) {
            const __m256 sf = _mm256_cvtepi32_ps(pq_dot_sb(nib, xa[n]->q + g * PQ_SB * PQ_QK));
            const __m256 dx = _mm256_loadu_ps(xa[n]->d + g * PQ_SB);
            const __m256 sx = _mm256_loadu_ps(xa[n]->s + g * PQ_SB);
            if (q4_1) {
                acc[n] = _mm256_fmadd_ps(sf, _mm256_mul_ps(dw, dx), acc[n]);
                acc[n] = _mm256_fmadd_ps(mw, sx, acc[n]);
            } else {
                acc[n] = _mm256_fmadd_ps(
                    dw, _mm256_fmadd_ps(sf, dx, _mm256_mul_ps(_mm256_set1_ps(-8.0f), sx)), acc[n]);
            }
        }
    }
    for (int64_t j = nsb * PQ_SB; j < nb; ++j) /* the tail: blocks as GGUF has them */
        pq_q4_block(row + nsb * sbb + (j - nsb * PQ_SB) * bb, q4_1, j, xa, acc, corr, N);
    for (int n = 0; n < N; ++n) res[n] = pq_hsum(acc[n]) + (q4_1 ? 1.0f : -8.0f) * corr[n];
#else
    float r[8] = {0};
    for (int64_t j = 0; j < nb; ++j) {
        const int64_t g = j / PQ_SB, b = j % PQ_SB;
        const uint8_t* blk;
        uint8_t qs[16]; /* the block's GGUF qs bytes */
        float dw, m;
        if (g < nsb) { /* in a superblock */
            blk = row + g * sbb;
            if (pf != 0 && b == 0) __builtin_prefetch(blk + pf, 0, 3);
            dw = pq_f16((uint16_t)(blk[2 * b] | blk[2 * b + 1] << 8));
            m = q4_1 ? pq_f16((uint16_t)(blk[16 + 2 * b] | blk[17 + 2 * b] << 8)) : 0.0f;
            for (int v = 0; v < 4; ++v)
                for (int c = 0; c < 4; ++c) qs[4 * v + c] = blk[hb + 32 * v + 4 * b + c];
        } else {
            blk = row + nsb * sbb + (j - nsb * PQ_SB) * bb;
            if (pf != 0) __builtin_prefetch(blk + pf, 0, 3);
            dw = pq_f16((uint16_t)(blk[0] | blk[1] << 8));
            m = q4_1 ? pq_f16((uint16_t)(blk[2] | blk[3] << 8)) : 0.0f;
            memcpy(qs, blk + (q4_1 ? 4 : 2), 16);
        }
        for (int n = 0; n < N; ++n) {
            int8_t q[PQ_QK]; /* x's block j in natural order */
            pq_act_block(xa[n], nb, j, q);
            const float t = (float)pq_dot_scalar(qs, q), dx = xa[n]->d[j], sx = xa[n]->s[j];
            r[n] = q4_1 ? fmaf(m, sx, fmaf(t, dw * dx, r[n])) : fmaf(dw, fmaf(t, dx, -8.0f * sx), r[n]);
        }
    }
    for (int n = 0; n < N; ++n) res[n] = r[n];
#endif
}

/* res[n] = row . x'[n] for n < N (N <= 8) over one row of nb q8_0 blocks in the dot layout
 * (34-byte blocks: f16 dw, int8 w[32]; each run of 8 in a superblock, see above), x'[n] = xa[n]
 * rounded to 16 bits (pq_quantize16). Per block dw * dx * (w . q), the integer dot exact. With
 * pf != 0 one prefetch pf bytes away per 64 bytes. */
PQ_INLINE void pq_q8_dot(const uint8_t* row, int64_t nb, const pq_act* const* xa, float* res,
                         const int N, const int64_t pf) {
    const int64_t bb = 34, sbb = PQ_SB * bb, nsb = nb / PQ_SB;
#if PQ_SIMD
    __m256 acc[8];
    const int16_t* xq[8]; /* each token's x, and its block scales */
    const float* xd[8];
#pragma GCC unroll 8
    for (int n = 0; n < N; ++n) {
        acc[n] = _mm256_setzero_ps();
        xq[n] = xa[n]->q16;
        xd[n] = xa[n]->d;
    }
    for (int64_t g = 0; g < nsb; ++g) {
        const uint8_t* sb = row + g * sbb;
        if (pf != 0)
            for (int64_t l = 0; l < (sbb + 63) / 64; ++l)
                _mm_prefetch((const char*)(sb + pf + 64 * l), PQ_PF_HINT);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)sb));
        /* int32 sums of each token, lane b: block b's w . q, exact: the superblock's weights in
         * the dot layout (16 pieces of 8 blocks x 2 weights) against x's int16 in the same
         * order, one int16 multiply-add per piece and token (|products| <= 128 * 32767, 32 of
         * them per lane: within int32); the token loops unrolled, so the sums and acc stay in
         * registers */
        __m256i s[8];
#pragma GCC unroll 8
        for (int n = 0; n < N; ++n) s[n] = _mm256_setzero_si256();
        for (int i = 0; i < 16; ++i) { /* a piece's weights widened to int16 once, for all */
            const __m256i w = _mm256_cvtepi8_epi16(
                _mm_loadu_si128((const __m128i*)(sb + 2 * PQ_SB + 16 * i)));
#pragma GCC unroll 8
            for (int n = 0; n < N; ++n)
                s[n] = _mm256_add_epi32(s[n], _mm256_madd_epi16(
                    w, _mm256_loadu_si256((const __m256i*)(xq[n] + g * PQ_SB * PQ_QK + 16 * i))));
        }
#pragma GCC unroll 8
        for (int n = 0; n < N; ++n)
            acc[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[n]),
                                     _mm256_mul_ps(dw, _mm256_loadu_ps(xd[n] + g * PQ_SB)), acc[n]);
    }
    for (int64_t j = nsb * PQ_SB; j < nb; ++j) { /* the blocks after the last superblock, as
                                                    GGUF has them (x's in natural order) */
        const uint8_t* blk = row + j * bb;
        const float dw = pq_f16((uint16_t)(blk[0] | blk[1] << 8));
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(blk + 2)));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(blk + 18)));
        for (int n = 0; n < N; ++n) {
            const int16_t* q = xa[n]->q16 + j * PQ_QK;
            const __m256i p = _mm256_add_epi32(
                _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i*)q)),
                _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i*)(q + 16))));
            acc[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * xa[n]->d[j]), acc[n]);
        }
    }
    for (int n = 0; n < N; ++n) res[n] = pq_hsum(acc[n]);
#else
    float r[8] = {0};
    for (int64_t j = 0; j < nb; ++j) {
        const int64_t g = j / PQ_SB, b = j % PQ_SB;
        int8_t w[PQ_QK]; /* the block's weights in order */
        float dw;
        if (g < nsb) {
            const uint8_t* sb = row + g * sbb;
            if (pf != 0 && b == 0) __builtin_prefetch(sb + pf, 0, 3);
            dw = pq_f16((uint16_t)(sb[2 * b] | sb[2 * b + 1] << 8));
            for (int i = 0; i < 16; ++i) memcpy(w + 2 * i, sb + 2 * PQ_SB + 16 * i + 2 * b, 2);
        } else {
            const uint8_t* blk = row + j * bb;
            dw = pq_f16((uint16_t)(blk[0] | blk[1] << 8));
            memcpy(w, blk + 2, PQ_QK);
        }
        for (int n = 0; n < N; ++n) {
            int16_t q[PQ_QK]; /* x's block j in natural order */
            for (int k = 0; k < PQ_QK; ++k) q[k] = xa[n]->q16[pq_act_index(nb, j, k, 1)];
            r[n] = fmaf((float)pq_dot_w8x16_scalar(w, q), dw * xa[n]->d[j], r[n]);
        }
    }
    for (int n = 0; n < N; ++n) res[n] = r[n];
#endif
}
#endif /* PICOMPILE_QBLOCKS_H */
