/* picompile sparse FFN kernel: the body of every variant's source.
 * picompile/codegen/c.py's `source(variant)` puts the variant's #defines (PIC_WDTYPE, PIC_DDTYPE,
 * PIC_GATED, PIC_DRELU, PIC_BIAS, PIC_ACT, ...) and the exported functions' documentation in front
 * of this file and splices qblocks.h and act.h in; the result is built once per variant (build
 * cache keyed by its hash). This file does not compile on its own.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
/* Software prefetches go to L2 (_MM_HINT_T1), not L1: a core has few L1 miss buffers and many
 * more in L2, so rows prefetched into L2 keep more bytes in flight; the L1 prefetchers and
 * the loads take them from L2. */
#ifndef PQ_PF_HINT
#define PQ_PF_HINT 2
#endif
#include "qblocks.h"
#include "act.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* Weight formats are compile-time constants: every row operation below takes its format as a
 * `const int F` argument and is always inlined, so each instance keeps only its format's code.
 * Gate and up rows are in PIC_WDTYPE, down rows in PIC_DDTYPE (see gu_dot / down_axpy). */
#define PIC_IS_QUANT(F) ((F) >= PIC_Q8_0) /* rows of GGUF blocks */
#define PIC_QK 32                         /* weights per GGUF block */
/* etype: the element type of predict's matrices: the gate / up dtype of float variants,
 * float16 where gate and up are quantized. */
#if PIC_IS_QUANT(PIC_WDTYPE)
#define PIC_EDTYPE PIC_F16
#else
#define PIC_EDTYPE PIC_WDTYPE
#endif

/* AVX2 + FMA + F16C (F16C converts float16 weights and the quantized blocks' float16 scales;
 * every AVX2 CPU has it, and build_flags enables the three together). */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PIC_SIMD 1
#else
#define PIC_SIMD 0
#endif
/* AVX-512F (codegen/c.py's ffn_flags adds -mavx512f where the CPU has it): quantized down rows
 * are added 16 floats at a time. Each output's FMAs are the AVX2 path's, so the sums are equal
 * bit for bit; it is the dequantizing (int8 -> float, one conversion per weight) that gets
 * twice as wide. */
#if PIC_SIMD && defined(__AVX512F__)
#define PIC_AVX512 1
#else
#define PIC_AVX512 0
#endif

#define PIC_INLINE static inline __attribute__((always_inline))
#define PIC_MAXTOK 8            /* tokens handled together per weight row */
#define PIC_PARALLEL_MIN 32768  /* below this many multiply-adds (m * d * T) run one thread */
#ifndef PIC_BLOCK
#define PIC_BLOCK 128           /* neurons whose first projection is computed before the rest */
#endif
#ifndef PIC_PF_ROWS
#define PIC_PF_ROWS 2           /* software prefetch distance: rows ahead in a list of rows */
#endif
#ifndef PIC_DOWN_ROWS
#define PIC_DOWN_ROWS 4         /* down rows added in one pass over the output (one token), <= 4 */
#endif
/* The down rows' prefetch distance: whole groups of PIC_DOWN_ROWS, at least PIC_PF_ROWS rows */
#define PIC_DOWN_AHEAD ((PIC_PF_ROWS + PIC_DOWN_ROWS - 1) / PIC_DOWN_ROWS * PIC_DOWN_ROWS)
#define PIC_PRED_ACC 8192       /* partial logits per pass of the predictor's second layer (32 KiB) */
#ifndef PIC_CHUNKS
#define PIC_CHUNKS 16           /* chunks of candidate neurons, each with a partial output */
#endif
#define PIC_PARTIAL_MAX_BYTES ((int64_t)64 << 20) /* cap on the partial outputs */

/* bfloat16 -> float32 (exact) */
PIC_INLINE float pic_bf16(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#if PIC_EDTYPE == PIC_F32
typedef float etype;
#else
typedef uint16_t etype;
#endif

/* ---- rows and their bytes ---- */

/* Bytes of one element of a float format */
PIC_INLINE int64_t pic_esize(const int F) { return F == PIC_F32 ? 4 : 2; }

/* Bytes of one GGUF block of a quantized format:
 * q8_0 f16 d, int8 q[32]; q4_0 f16 d, uint8 qs[16]; q4_1 f16 d, f16 m, uint8 qs[16] */
PIC_INLINE int64_t pic_qbytes(const int F) { return F == PIC_Q8_0 ? 34 : F == PIC_Q4_0 ? 18 : 20; }

/* Bytes of one weight row of d weights in format F (a neuron's row of w_gate, w_up or
 * w_down_t): every row address in the FFN goes through row_at with this stride. */
PIC_INLINE int64_t row_bytes(const int F, int64_t d) {
    return PIC_IS_QUANT(F) ? d / PIC_QK * pic_qbytes(F) : d * pic_esize(F);
}

PIC_INLINE const void* row_at(const void* w, int64_t j, int64_t rb) {
    return (const char*)w + j * rb;
}

/* ---- float rows (float32 / float16 / bfloat16 elements) ---- */

/* Element k of a float row, as float32 (exact for all three formats) */
PIC_INLINE float w2f(const int F, const void* w, int64_t k) {
    if (F == PIC_F32) return ((const float*)w)[k];
    if (F == PIC_F16) return pq_f16(((const uint16_t*)w)[k]);
    return pic_bf16(((const uint16_t*)w)[k]);
}

#if PIC_SIMD
/* Elements k .. k + 7 of a float row, as float32 */
PIC_INLINE __m256 loadw8(const int F, const void* w, int64_t k) {
    if (F == PIC_F32) return _mm256_loadu_ps((const float*)w + k);
    const __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)w + k));
    if (F == PIC_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

#endif

/* ---- activation ---- */
PIC_INLINE float act_fn(float g) {
#if PIC_ACT == PIC_RELU
    return g > 0.0f ? g : 0.0f;
#elif PIC_ACT == PIC_SILU
    return g / (1.0f + expf(-g));
#elif PIC_ACT == PIC_GELU
    return 0.5f * g * (1.0f + erff(g * 0.70710678118654752f));
#elif PIC_ACT == PIC_RELU2
    return g > 0.0f ? g * g : 0.0f;
#else
    return 0.5f * g * (1.0f + tanhf(0.79788456080286536f * (g + 0.044715f * g * g * g)));
#endif
}

/* Software prefetch. The kernel reads lists of rows of one length (the candidates' gate rows, the
 * fired neurons' up rows, their down rows), scattered over the matrix: a hardware stream
 * prefetcher learns a row only after its first lines missed, and then runs past its end into
 * rows nobody needs. So every row operation takes `pf`, the byte offset from its row to the row
 * PIC_PF_ROWS places further down its list (0: none), and prefetches that row's lines in step
 * with the lines it reads: the next rows arrive while this one is computed, a few lines at a time
 * (a whole row's prefetches at once would fill the core's miss buffers and stall it), and
 * nothing beyond a needed row is fetched. Only the first rows of a list are prefetched whole
 * (row_prefetch). */
#if PIC_SIMD
#define PIC_PREFETCH(p) _mm_prefetch((const char*)(p), PQ_PF_HINT)
#else
#define PIC_PREFETCH(p) __builtin_prefetch((const void*)(p), 0, 3)
#endif
#define PIC_WPL (64 / (int)sizeof(etype)) /* predict's weights per 64-byte cache line */

/* The n bytes at p (every cache line they touch). */
PIC_INLINE void prefetch_bytes(const void* p, int64_t n) {
    const char* c = (const char*)p;
    for (int64_t k = 0; k < n; k += 64) PIC_PREFETCH(c + k);
    if (n > 0) PIC_PREFETCH(c + n - 1);
}

/* The pf of the row operations for row `at` of a list whose rows are rows[0 .. n) of a matrix
 * with row stride rb: the offset to row at + PIC_PF_ROWS, 0 at the list's end. */
PIC_INLINE int64_t pf_to(const int64_t* rows, int64_t at, int64_t n, int64_t rb) {
    return at + PIC_PF_ROWS < n ? (rows[at + PIC_PF_ROWS] - rows[at]) * rb : 0;
}

/* res[n] = w[0:d] . xs[n][0:d] for n < N over a float row: one pass over it for all N tokens.
 * N tokens x U independent 8-float accumulators (N*U <= 8: all in registers); each main-loop
 * step covers SV vectors (whole cache lines, one prefetch per line at offset pf, unless 0). */
PIC_INLINE void fdot_n(const int F, const void* w, const float* const* xs, int64_t d, float* res,
                       const int N, const int U, int64_t pf) {
    const char* wb = (const char*)w;
    const int64_t es = pic_esize(F);
    const int WPL = 64 / (int)es;             /* weights per cache line */
#if PIC_SIMD
    const int VPL = WPL / 8;                  /* 8-float vectors per cache line of weights */
    const int SV = U > VPL ? U : VPL;         /* vectors per step */
    __m256 acc[8];
    for (int i = 0; i < N * U; ++i) acc[i] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 * SV <= d; k += 8 * SV) {
        if (pf)
            for (int l = 0; l < SV / VPL; ++l) PIC_PREFETCH(wb + (k + l * WPL) * es + pf);
        for (int v = 0; v < SV; ++v) {
            const __m256 wv = loadw8(F, w, k + 8 * v);
            for (int n = 0; n < N; ++n)
                acc[n * U + v % U] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xs[n] + k + 8 * v), acc[n * U + v % U]);
        }
    }
    for (; k + 8 <= d; k += 8) {
        const __m256 wv = loadw8(F, w, k);
        for (int n = 0; n < N; ++n)
            acc[n * U] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xs[n] + k), acc[n * U]);
    }
    for (int n = 0; n < N; ++n) {
        __m256 s = acc[n * U];
        for (int u = 1; u < U; ++u) s = _mm256_add_ps(s, acc[n * U + u]);
        float r = pq_hsum(s);
        for (int64_t kk = k; kk < d; ++kk) r += w2f(F, w, kk) * xs[n][kk];
        res[n] = r;
    }
#else
    float r[PIC_MAXTOK] = {0};
    (void)U;
    for (int64_t k = 0; k < d; ++k) {
        if (pf && (k & (WPL - 1)) == 0) PIC_PREFETCH(wb + k * es + pf);
        const float wk = w2f(F, w, k);
        for (int n = 0; n < N; ++n) r[n] += wk * xs[n][k];
    }
    for (int n = 0; n < N; ++n) res[n] = r[n];
#endif
}

/* ps[n][0:d] += hs[n] * w[0:d] for n < N over a float row: one pass over it for all N tokens
 * (prefetching at offset pf as fdot_n). */
PIC_INLINE void faxpy_n(const int F, const void* w, const float* hs, float* const* ps, int64_t d,
                        const int N, int64_t pf) {
    const char* wb = (const char*)w;
    const int64_t es = pic_esize(F);
    const int WPL = 64 / (int)es;
    int64_t k = 0;
#if PIC_SIMD
    const int VPL = WPL / 8;
    const int SV = VPL > 2 ? VPL : 2;
    __m256 hv[PIC_MAXTOK];
    for (int n = 0; n < N; ++n) hv[n] = _mm256_set1_ps(hs[n]);
    for (; k + 8 * SV <= d; k += 8 * SV) {
        if (pf)
            for (int l = 0; l < SV / VPL; ++l) PIC_PREFETCH(wb + (k + l * WPL) * es + pf);
        for (int v = 0; v < SV; ++v) {
            const __m256 wv = loadw8(F, w, k + 8 * v);
            for (int n = 0; n < N; ++n) {
                float* p = ps[n] + k + 8 * v;
                _mm256_storeu_ps(p, _mm256_fmadd_ps(hv[n], wv, _mm256_loadu_ps(p)));
            }
        }
    }
    for (; k + 8 <= d; k += 8) {
        const __m256 wv = loadw8(F, w, k);
        for (int n = 0; n < N; ++n) {
            float* p = ps[n] + k;
            _mm256_storeu_ps(p, _mm256_fmadd_ps(hv[n], wv, _mm256_loadu_ps(p)));
        }
    }
#endif
    for (; k < d; ++k) {
#if !PIC_SIMD
        if (pf && (k & (WPL - 1)) == 0) PIC_PREFETCH(wb + k * es + pf);
#endif
        const float wk = w2f(F, w, k);
        for (int n = 0; n < N; ++n) ps[n][k] += hs[n] * wk;
    }
}

/* ---- quantized rows: the row operations on GGUF blocks ----
 * A block is 32 weights along d: a float16 scale s (q4_1: and a float16 minimum m) and 32
 * integers q (q8_0: int8; q4_*: nibbles n, weight k in the low nibble of byte k for k < 16, in
 * the high nibble of byte k - 16 above). A row is dotted with x rounded to integer blocks
 * (qblocks.h: x' = dx * qx, once per call; 16 bits for q8_0 rows, 8 for 4-bit ones), in
 * integers:  q8_0: s * dx * (q . qx)    q4_0: s * dx * (n . qx) - 8 s * sx
 *            q4_1: s * dx * (n . qx) + m * sx
 * with sx = dx * sum(qx). axpy dequantizes (s * q, s * (n - 8), s * n + m) and FMAs each weight
 * into the partial outputs. Only gate and up rows are dotted with x, so the rounding of x
 * follows their format. */
#define PIC_QACT PIC_IS_QUANT(PIC_WDTYPE) /* x rounded to integer blocks */
#define PIC_QGROUP 4 /* blocks per step of the row loops */

/* Prefetches per step of the row loops: cover its bytes */
PIC_INLINE int pic_qlines(const int F) { return (int)((PIC_QGROUP * pic_qbytes(F) + 63) / 64); }

#if PIC_SIMD
/* The float16 scale at blk[0:2] (lane 0) and, for q4_1, the minimum at blk[2:4] (lane 1): one
 * 4-byte load (inside every block) and one conversion. */
PIC_INLINE __m128 qhead(const uint8_t* blk) {
    int32_t v;
    memcpy(&v, blk, 4);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(v));
}

/* The 32 integers of a block as float32, in weight order, 8 per vector: q8_0 q; q4_0 the
 * integer weight n - 8; q4_1 the nibbles n. */
PIC_INLINE void qvals(const int F, const uint8_t* blk, __m256 v[4]) {
    if (F == PIC_Q8_0) {
        for (int i = 0; i < 4; ++i)
            v[i] = _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(blk + 2 + 8 * i))));
        return;
    }
    /* qs[16] in both 128-bit halves; spread qs[0..7] and qs[8..15] over the 32-bit lanes, one
     * byte each: the low nibbles are weights 0..15, the high ones 16..31. */
    const __m256i qs = _mm256_broadcastsi128_si256(
        _mm_loadu_si128((const __m128i*)(blk + (F == PIC_Q4_1 ? 4 : 2))));
    const __m256i lo8 = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                         4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
    const __m256i hi8 = _mm256_setr_epi8(8, -1, -1, -1, 9, -1, -1, -1, 10, -1, -1, -1, 11, -1, -1, -1,
                                         12, -1, -1, -1, 13, -1, -1, -1, 14, -1, -1, -1, 15, -1, -1, -1);
    const __m256i b0 = _mm256_shuffle_epi8(qs, lo8); /* bytes 0..7, one per lane */
    const __m256i b1 = _mm256_shuffle_epi8(qs, hi8); /* bytes 8..15 */
    const __m256i m4 = _mm256_set1_epi32(15);
    __m256i n[4] = {_mm256_and_si256(b0, m4), _mm256_and_si256(b1, m4),
                    _mm256_srli_epi32(b0, 4), _mm256_srli_epi32(b1, 4)};
    for (int i = 0; i < 4; ++i) {
        if (F == PIC_Q4_0) n[i] = _mm256_sub_epi32(n[i], _mm256_set1_epi32(8));
        v[i] = _mm256_cvtepi32_ps(n[i]);
    }
}

#if PIC_AVX512
/* One block's 32 weights as float32 in two 16-float vectors (v[0]: weights 0..15) and its
 * broadcast scale s: q8_0 q and q4_0 n - 8 (to be scaled by s), q4_1 s * n + m (dequantized):
 * the values qvals and qhead give, twice as wide. */
PIC_INLINE __m512 qblock16(const int F, const uint8_t* blk, __m512 v[2]) {
    const __m128 head = qhead(blk);
    const __m512 s = _mm512_broadcastss_ps(head);
    if (F == PIC_Q8_0) {
        for (int i = 0; i < 2; ++i)
            v[i] = _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 2 + 16 * i))));
        return s;
    }
    /* byte k of qs, one per lane: its low nibble is weight k, its high nibble weight 16 + k */
    const __m512i b = _mm512_cvtepu8_epi32(
        _mm_loadu_si128((const __m128i*)(blk + (F == PIC_Q4_1 ? 4 : 2))));
    __m512i n[2] = {_mm512_and_si512(b, _mm512_set1_epi32(15)), _mm512_srli_epi32(b, 4)};
    const __m512 m = _mm512_broadcastss_ps(_mm_movehdup_ps(head)); /* q4_1's minimum */
    for (int i = 0; i < 2; ++i) {
        if (F == PIC_Q4_0) n[i] = _mm512_sub_epi32(n[i], _mm512_set1_epi32(8));
        v[i] = _mm512_cvtepi32_ps(n[i]);
        if (F == PIC_Q4_1) v[i] = _mm512_fmadd_ps(s, v[i], m);
    }
    return s;
}
#endif

#else
/* The 32 weights of a block, dequantized (the reference's arithmetic, in float32). */
PIC_INLINE void qdeq32(const int F, const uint8_t* blk, float w[32]) {
    const float s = pq_f16((uint16_t)(blk[0] | blk[1] << 8));
    if (F == PIC_Q8_0) {
        for (int i = 0; i < 32; ++i) w[i] = s * (float)(int8_t)blk[2 + i];
    } else if (F == PIC_Q4_0) {
        for (int i = 0; i < 16; ++i) {
            w[i] = s * (float)((blk[2 + i] & 15) - 8);
            w[i + 16] = s * (float)((blk[2 + i] >> 4) - 8);
        }
    } else {
        const float m = pq_f16((uint16_t)(blk[2] | blk[3] << 8));
        for (int i = 0; i < 16; ++i) {
            w[i] = s * (float)(blk[4 + i] & 15) + m;
            w[i + 16] = s * (float)(blk[4 + i] >> 4) + m;
        }
    }
}
#endif

/* res[n] = w . x'[n] for n < N over a quantized row of d weights in the dot layout, x'[n] =
 * xa[n] (token n rounded to integer blocks): qblocks.h's integer dots. */
PIC_INLINE void qdot_n(const int F, const void* row, const pq_act* const* xa, int64_t d,
                       float* res, const int N, int64_t pf) {
    if (F == PIC_Q8_0) pq_q8_dot((const uint8_t*)row, d / PIC_QK, xa, res, N, pf);
    else pq_q4_dot((const uint8_t*)row, F == PIC_Q4_1, d / PIC_QK, xa, res, N, pf);
}

#if PIC_SIMD
/* One block of qaxpy_n. */
PIC_INLINE void qaxpy_block(const int F, const uint8_t* w, int64_t b, const __m256* hv,
                            float* const* ps, const int N) {
    const uint8_t* blk = w + b * pic_qbytes(F);
#if PIC_AVX512
    __m512 v16[2];
    const __m512 s16 = qblock16(F, blk, v16);
    for (int n = 0; n < N; ++n) {
        const __m512 h = _mm512_broadcastss_ps(_mm256_castps256_ps128(hv[n]));
        const __m512 c = F == PIC_Q4_1 ? h : _mm512_mul_ps(h, s16);
        float* p = ps[n] + b * PIC_QK;
        for (int i = 0; i < 2; ++i)
            _mm512_storeu_ps(p + 16 * i, _mm512_fmadd_ps(c, v16[i], _mm512_loadu_ps(p + 16 * i)));
    }
#else
    __m256 v[4];
    qvals(F, blk, v);
    const __m128 head = qhead(blk);
    const __m256 s = _mm256_broadcastss_ps(head);
    if (F == PIC_Q4_1) {  /* dequantized: s * n + m */
        const __m256 mn = _mm256_broadcastss_ps(_mm_movehdup_ps(head));
        for (int i = 0; i < 4; ++i) v[i] = _mm256_fmadd_ps(s, v[i], mn);
    }
    for (int n = 0; n < N; ++n) {
        /* q8_0 / q4_0: h * s, the block's integers scale by it; q4_1: h */
        const __m256 c = F == PIC_Q4_1 ? hv[n] : _mm256_mul_ps(hv[n], s);
        float* p = ps[n] + b * PIC_QK;
        for (int i = 0; i < 4; ++i)
            _mm256_storeu_ps(p + 8 * i, _mm256_fmadd_ps(c, v[i], _mm256_loadu_ps(p + 8 * i)));
    }
#endif
}
#endif

/* ps[n] += hs[n] * w for n < N over a quantized row of d weights: one pass over its blocks
 * (prefetching at offset pf, see above). */
PIC_INLINE void qaxpy_n(const int F, const void* row, const float* hs, float* const* ps,
                        int64_t d, const int N, int64_t pf) {
    const uint8_t* w = (const uint8_t*)row;
    const int64_t nb = d / PIC_QK, qb = pic_qbytes(F);
#if PIC_SIMD
    __m256 hv[PIC_MAXTOK];
    for (int n = 0; n < N; ++n) hv[n] = _mm256_set1_ps(hs[n]);
    int64_t b = 0;
    for (; b + PIC_QGROUP <= nb; b += PIC_QGROUP) {
        if (pf)
            for (int l = 0; l < pic_qlines(F); ++l) PIC_PREFETCH(w + b * qb + pf + 64 * l);
        for (int k = 0; k < PIC_QGROUP; ++k) qaxpy_block(F, w, b + k, hv, ps, N);
    }
    for (; b < nb; ++b) qaxpy_block(F, w, b, hv, ps, N);
#else
    float wb[32];
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + b * qb;
        if (pf) PIC_PREFETCH(blk + pf);
        qdeq32(F, blk, wb);
        for (int n = 0; n < N; ++n) {
            float* p = ps[n] + b * PIC_QK;
            for (int i = 0; i < 32; ++i) p[i] += hs[n] * wb[i];
        }
    }
#endif
}

/* ---- the row operations, on one row of d weights in format F, for nt <= 8 tokens ----
 * pf: the offset from this row to the row to prefetch alongside it (one of the same length), or
 * 0 (see "Software prefetch" above). */
PIC_INLINE void row_prefetch(const void* row, int64_t rb) { prefetch_bytes(row, rb); }

PIC_INLINE void dot_n(const int F, const void* w, const float* const* xs, const pq_act* const* xa,
                      int64_t d, float* res, const int N, const int U, int64_t pf) {
    if (PIC_IS_QUANT(F)) qdot_n(F, w, xa, d, res, N, pf);
    else fdot_n(F, w, xs, d, res, N, U, pf);
}

PIC_INLINE void axpy_n(const int F, const void* w, const float* hs, float* const* ps, int64_t d,
                       const int N, int64_t pf) {
    if (PIC_IS_QUANT(F)) qaxpy_n(F, w, hs, ps, d, N, pf);
    else faxpy_n(F, w, hs, ps, d, N, pf);
}

/* p[0:d] += h[r] * row r for r < R, one token, R rows of format F in one pass over p: p's vectors
 * are loaded and stored once per block (or cache line) for all R rows instead of once per row
 * (adding a down row costs more instructions per byte than dotting a gate or up row, and those
 * loads and stores are a third of them). The FMAs run in row order with the same operands as
 * R row_axpy calls in turn, so p ends bit for bit as they leave it. pf[r]: row r's prefetch
 * offset (see "Software prefetch"). */
PIC_INLINE void axpy_rows(const int F, const void* const* rows, const float* h, float* p, int64_t d,
                          const int R, const int64_t* pf) {
#if PIC_SIMD
    __m256 hv[4];
    for (int r = 0; r < R; ++r) hv[r] = _mm256_set1_ps(h[r]);
    if (PIC_IS_QUANT(F)) {
        const int64_t nb = d / PIC_QK, qb = pic_qbytes(F);
        for (int64_t b0 = 0; b0 < nb; b0 += PIC_QGROUP) {
            const int64_t b1 = b0 + PIC_QGROUP < nb ? b0 + PIC_QGROUP : nb;
            if (b1 - b0 == PIC_QGROUP)
                for (int r = 0; r < R; ++r)
                    if (pf[r])
                        for (int l = 0; l < pic_qlines(F); ++l)
                            PIC_PREFETCH((const uint8_t*)rows[r] + b0 * qb + pf[r] + 64 * l);
            for (int64_t b = b0; b < b1; ++b) {
                float* pb = p + b * PIC_QK;
#if PIC_AVX512
                __m512 a16[2] = {_mm512_loadu_ps(pb), _mm512_loadu_ps(pb + 16)};
                for (int r = 0; r < R; ++r) { /* as qaxpy_block */
                    __m512 v16[2];
                    const __m512 s16 = qblock16(F, (const uint8_t*)rows[r] + b * qb, v16);
                    const __m512 hr = _mm512_set1_ps(h[r]);
                    const __m512 c = F == PIC_Q4_1 ? hr : _mm512_mul_ps(hr, s16);
                    for (int i = 0; i < 2; ++i) a16[i] = _mm512_fmadd_ps(c, v16[i], a16[i]);
                }
                for (int i = 0; i < 2; ++i) _mm512_storeu_ps(pb + 16 * i, a16[i]);
#else
                __m256 acc[4];
                for (int i = 0; i < 4; ++i) acc[i] = _mm256_loadu_ps(pb + 8 * i);
                for (int r = 0; r < R; ++r) { /* as qaxpy_block */
                    const uint8_t* blk = (const uint8_t*)rows[r] + b * qb;
                    __m256 v[4];
                    qvals(F, blk, v);
                    const __m128 head = qhead(blk);
                    const __m256 s = _mm256_broadcastss_ps(head);
                    if (F == PIC_Q4_1) {
                        const __m256 mn = _mm256_broadcastss_ps(_mm_movehdup_ps(head));
                        for (int i = 0; i < 4; ++i) v[i] = _mm256_fmadd_ps(s, v[i], mn);
                    }
                    const __m256 c = F == PIC_Q4_1 ? hv[r] : _mm256_mul_ps(hv[r], s);
                    for (int i = 0; i < 4; ++i) acc[i] = _mm256_fmadd_ps(c, v[i], acc[i]);
                }
                for (int i = 0; i < 4; ++i) _mm256_storeu_ps(pb + 8 * i, acc[i]);
#endif
            }
        }
        return;
    }
    const int64_t es = pic_esize(F);
    const int WPL = 64 / (int)es, VPL = WPL / 8; /* as faxpy_n: one cache line of each row */
    int64_t k = 0;
    for (; k + WPL <= d; k += WPL) {
        for (int r = 0; r < R; ++r)
            if (pf[r]) PIC_PREFETCH((const char*)rows[r] + k * es + pf[r]);
        for (int v = 0; v < VPL; ++v) {
            __m256 a = _mm256_loadu_ps(p + k + 8 * v);
            for (int r = 0; r < R; ++r)
                a = _mm256_fmadd_ps(hv[r], loadw8(F, rows[r], k + 8 * v), a);
            _mm256_storeu_ps(p + k + 8 * v, a);
        }
    }
    for (; k + 8 <= d; k += 8) {
        __m256 a = _mm256_loadu_ps(p + k);
        for (int r = 0; r < R; ++r) a = _mm256_fmadd_ps(hv[r], loadw8(F, rows[r], k), a);
        _mm256_storeu_ps(p + k, a);
    }
    for (; k < d; ++k)
        for (int r = 0; r < R; ++r) p[k] += h[r] * w2f(F, rows[r], k);
#else
    for (int r = 0; r < R; ++r) axpy_n(F, rows[r], h + r, &p, d, 1, pf[r]);
#endif
}

/* res[n] = row . xs[n] for n < nt (xa: the tokens rounded to integer blocks, for quantized
 * rows). Dispatches on the token count so that every instance has compile-time N and U. */
PIC_INLINE void row_dot(const int F, const void* w, const float* const* xs,
                        const pq_act* const* xa, int nt, int64_t d, float* res, int64_t pf) {
    switch (nt) {
    case 1: dot_n(F, w, xs, xa, d, res, 1, 4, pf); break;
    case 2: dot_n(F, w, xs, xa, d, res, 2, 4, pf); break;
    case 3: dot_n(F, w, xs, xa, d, res, 3, 2, pf); break;
    case 4: dot_n(F, w, xs, xa, d, res, 4, 2, pf); break;
    case 5: dot_n(F, w, xs, xa, d, res, 5, 1, pf); break;
    case 6: dot_n(F, w, xs, xa, d, res, 6, 1, pf); break;
    case 7: dot_n(F, w, xs, xa, d, res, 7, 1, pf); break;
    default: dot_n(F, w, xs, xa, d, res, 8, 1, pf); break;
    }
}

/* ps[n] += hs[n] * row for n < nt */
PIC_INLINE void row_axpy(const int F, const void* w, const float* hs, float* const* ps, int nt,
                         int64_t d, int64_t pf) {
    switch (nt) {
    case 1: axpy_n(F, w, hs, ps, d, 1, pf); break;
    case 2: axpy_n(F, w, hs, ps, d, 2, pf); break;
    case 3: axpy_n(F, w, hs, ps, d, 3, pf); break;
    case 4: axpy_n(F, w, hs, ps, d, 4, pf); break;
    case 5: axpy_n(F, w, hs, ps, d, 5, pf); break;
    case 6: axpy_n(F, w, hs, ps, d, 6, pf); break;
    case 7: axpy_n(F, w, hs, ps, d, 7, pf); break;
    default: axpy_n(F, w, hs, ps, d, 8, pf); break;
    }
}

/* The instances this library uses, one per matrix and its format: gate and up rows are only
 * ever dotted with x, down rows only ever added into the outputs, and predict's matrices are
 * etype. */
static void gu_dot(const void* w, const float* const* xs, const pq_act* const* xa, int nt,
                   int64_t d, float* res, int64_t pf) {
    row_dot(PIC_WDTYPE, w, xs, xa, nt, d, res, pf);
}

static void down_axpy(const void* w, const float* hs, float* const* ps, int nt, int64_t d,
                      int64_t pf) {
    row_axpy(PIC_DDTYPE, w, hs, ps, nt, d, pf);
}

/* axpy_rows over n <= PIC_DOWN_ROWS down rows */
static void down_axpy_rows(const void* const* rows, const float* h, float* p, int64_t d, int n,
                           const int64_t* pf) {
    switch (n) {
    case 1: axpy_rows(PIC_DDTYPE, rows, h, p, d, 1, pf); break;
#if PIC_DOWN_ROWS >= 2
    case 2: axpy_rows(PIC_DDTYPE, rows, h, p, d, 2, pf); break;
#endif
#if PIC_DOWN_ROWS >= 3
    case 3: axpy_rows(PIC_DDTYPE, rows, h, p, d, 3, pf); break;
#endif
#if PIC_DOWN_ROWS >= 4
    default: axpy_rows(PIC_DDTYPE, rows, h, p, d, 4, pf); break;
#endif
    }
}

static void pred_dot(const etype* w, const float* const* xs, int nt, int64_t d, float* res,
                     int64_t pf) {
    row_dot(PIC_EDTYPE, w, xs, NULL, nt, d, res, pf);
}

static void pred_axpy(const etype* w, const float* hs, float* const* ps, int nt, int64_t d,
                      int64_t pf) {
    row_axpy(PIC_EDTYPE, w, hs, ps, nt, d, pf);
}

/* A neuron that passed the first test: gated blocks, act(gate) != 0 for some token (its up and
 * down rows are needed); plain blocks, |h| > threshold for some token (its down row is needed). */
typedef struct {
    int64_t j;              /* neuron */
    int nf;                 /* tokens that passed */
    int tok[PIC_MAXTOK];    /* which (index into the token group) */
    float a[PIC_MAXTOK];    /* gated: act(gate); plain: h */
} pic_fired;

/* Neuron number of candidate i: idx[i], or i where idx is NULL (all neurons). */
PIC_INLINE int64_t cand(const int32_t* idx, int64_t i) { return idx ? (int64_t)idx[i] : i; }

/* The first candidate numbered j or more in an ascending list idx [M] */
static int64_t first_from(const int32_t* idx, int64_t M, int64_t j) {
    int64_t lo = 0, hi = M;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (idx[mid] < j) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* Whether token n may use neuron j: ms [nt] the tokens' rows of a predictor's mask, or NULL
 * (every candidate is every token's). */
PIC_INLINE int allowed(const uint8_t* const* ms, int n, int64_t j) { return !ms || ms[n][j]; }

/* Candidates [lo, hi) for one group of nt <= 8 tokens (rows xs, partial outputs ps, mask rows ms
 * or NULL: see `allowed`), in blocks of PIC_BLOCK neurons: first the first projection of every
 * neuron of the block, then the up / down rows of only the neurons that fired (for a token its
 * mask allows). Every pass reads a list of rows of one matrix, each row's prefetches running
 * PIC_PF_ROWS rows ahead in the list (see "Software prefetch"): the first projection's list is the
 * whole range (across blocks), the later ones the block's candidates or fired neurons, whose first
 * rows are prefetched whole as soon as they are known. Returns the number of active (token,
 * neuron) pairs. */
static int64_t run_range(int64_t lo, int64_t hi, const int32_t* idx, const float* const* xs,
                         const pq_act* const* xa, int nt, int64_t d, const void* w_gate,
                         const void* w_up, const void* w_down_t, const float* b_gate,
                         const float* b_up, float threshold, const uint8_t* const* ms,
                         float* const* ps) {
    int64_t total = 0;
    const int64_t rb = row_bytes(PIC_WDTYPE, d);  /* gate and up rows */
    const int64_t rbd = row_bytes(PIC_DDTYPE, d); /* down rows */
    const void* w_first = PIC_GATED ? w_gate : w_up; /* the rows every candidate needs */
    pic_fired f[PIC_BLOCK];
    int64_t fj[PIC_BLOCK]; /* f[q].j: the fired neurons' list, for pf_to */
#if !PIC_BIAS
    (void)b_gate; (void)b_up;
#endif
#if !PIC_GATED
    (void)w_gate; (void)b_gate;
#endif
    (void)w_first;
    for (int64_t k = lo; k < lo + PIC_PF_ROWS && k < hi; ++k)
        row_prefetch(row_at(w_first, cand(idx, k), rb), rb);
    for (int64_t b0 = lo; b0 < hi; b0 += PIC_BLOCK) {
        const int64_t b1 = b0 + PIC_BLOCK < hi ? b0 + PIC_BLOCK : hi;
        int nfired = 0;
#if PIC_GATED && PIC_H_FIRST
        float gs[PIC_BLOCK][PIC_MAXTOK]; /* gate x of the block's neurons, read first */
        for (int64_t i = b0; i < b1; ++i) {
            const int64_t j = cand(idx, i);
            const int64_t pf = i + PIC_PF_ROWS < hi ? (cand(idx, i + PIC_PF_ROWS) - j) * rb : 0;
            gu_dot(row_at(w_gate, j, rb), xs, xa, nt, d, gs[i - b0], pf);
        }
        for (int64_t k = b0; k < b0 + PIC_PF_ROWS && k < b1; ++k) /* the up rows' list */
            row_prefetch(row_at(w_up, cand(idx, k), rb), rb);
#endif
        for (int64_t i = b0; i < b1; ++i) {
            const int64_t j = cand(idx, i);
            pic_fired* fi = &f[nfired];
            float g[PIC_MAXTOK];
            fi->j = j;
            fi->nf = 0;
#if PIC_GATED && !PIC_H_FIRST
            const float b = PIC_BIAS && b_gate ? b_gate[j] : 0.0f;
            const int64_t pf = i + PIC_PF_ROWS < hi ? (cand(idx, i + PIC_PF_ROWS) - j) * rb : 0;
            gu_dot(row_at(w_gate, j, rb), xs, xa, nt, d, g, pf);
            for (int n = 0; n < nt; ++n) {
                const float a = act_fn(g[n] + b);
                if (a != 0.0f && allowed(ms, n, j)) {
                    fi->tok[fi->nf] = n; fi->a[fi->nf] = a; ++fi->nf;
                }
            }
#elif PIC_GATED  /* the gate rows of the block were read above: now its up rows */
            const float b = PIC_BIAS && b_gate ? b_gate[j] : 0.0f;
            const float bu = PIC_BIAS && b_up ? b_up[j] : 0.0f;
            const int64_t pf = i + PIC_PF_ROWS < b1 ? (cand(idx, i + PIC_PF_ROWS) - j) * rb : 0;
            gu_dot(row_at(w_up, j, rb), xs, xa, nt, d, g, pf);
            for (int n = 0; n < nt; ++n) {
                float uv = g[n] + bu;
#if PIC_DRELU
                uv = uv > 0.0f ? uv : 0.0f;
#endif
                const float h = act_fn(gs[i - b0][n] + b) * uv;
                if (fabsf(h) > threshold && allowed(ms, n, j)) {
                    fi->tok[fi->nf] = n; fi->a[fi->nf] = h; ++fi->nf;
                }
            }
#else
            const float b = PIC_BIAS && b_up ? b_up[j] : 0.0f;
            const int64_t pf = i + PIC_PF_ROWS < hi ? (cand(idx, i + PIC_PF_ROWS) - j) * rb : 0;
            gu_dot(row_at(w_up, j, rb), xs, xa, nt, d, g, pf);
            for (int n = 0; n < nt; ++n) {
                const float h = act_fn(g[n] + b);
                if (fabsf(h) > threshold && allowed(ms, n, j)) {
                    fi->tok[fi->nf] = n; fi->a[fi->nf] = h; ++fi->nf;
                }
            }
#endif
            if (fi->nf) { /* the head of the fired neurons' lists */
#if PIC_GATED && !PIC_H_FIRST
                if (nfired < PIC_PF_ROWS) row_prefetch(row_at(w_up, j, rb), rb);
#endif
                if (nfired < PIC_DOWN_AHEAD) row_prefetch(row_at(w_down_t, j, rbd), rbd);
                fj[nfired++] = j;
            }
        }
        /* One token: the down rows in groups of PIC_DOWN_ROWS (axpy_rows), prefetching
         * PIC_DOWN_AHEAD rows ahead. More tokens: one row at a time. */
        const void* gr[PIC_DOWN_ROWS];
        float gh[PIC_DOWN_ROWS];
        int64_t gpf[PIC_DOWN_ROWS];
        int ng = 0;
        for (int q = 0; q < nfired; ++q) {
            const int64_t j = f[q].j;
            float hv[PIC_MAXTOK];  /* h of the active tokens */
            float* pa[PIC_MAXTOK]; /* their partial-output rows */
            int na = 0;
#if PIC_GATED && !PIC_H_FIRST
            const float* xf[PIC_MAXTOK];
            const pq_act* xaf[PIC_MAXTOK];
            float u[PIC_MAXTOK];
            const float bu = PIC_BIAS && b_up ? b_up[j] : 0.0f;
            for (int k = 0; k < f[q].nf; ++k) {
                xf[k] = xs[f[q].tok[k]];
                xaf[k] = xa ? xa[f[q].tok[k]] : NULL;
            }
            gu_dot(row_at(w_up, j, rb), xf, xaf, f[q].nf, d, u, pf_to(fj, q, nfired, rb));
            for (int k = 0; k < f[q].nf; ++k) {
                float uv = u[k] + bu;
#if PIC_DRELU
                uv = uv > 0.0f ? uv : 0.0f;
#endif
                const float h = f[q].a[k] * uv;
                if (fabsf(h) > threshold) { hv[na] = h; pa[na] = ps[f[q].tok[k]]; ++na; }
            }
#else
            for (int k = 0; k < f[q].nf; ++k) { hv[k] = f[q].a[k]; pa[k] = ps[f[q].tok[k]]; }
            na = f[q].nf;
#endif
            total += na;
            if (nt == 1) {
                if (na) {
                    gr[ng] = row_at(w_down_t, j, rbd);
                    gh[ng] = hv[0];
                    gpf[ng++] = q + PIC_DOWN_AHEAD < nfired
                                    ? (fj[q + PIC_DOWN_AHEAD] - j) * rbd : 0;
                } else if (q + PIC_DOWN_AHEAD < nfired) { /* the prefetch this row would make */
                    row_prefetch(row_at(w_down_t, fj[q + PIC_DOWN_AHEAD], rbd), rbd);
                }
                if (ng == PIC_DOWN_ROWS || (ng && q + 1 == nfired)) {
                    down_axpy_rows(gr, gh, ps[0], d, ng, gpf);
                    ng = 0;
                }
                continue;
            }
            if (na) down_axpy(row_at(w_down_t, j, rbd), hv, pa, na, d, pf_to(fj, q, nfired, rbd));
            else if (q + PIC_PF_ROWS < nfired) /* the prefetch this row would have made */
                row_prefetch(row_at(w_down_t, fj[q + PIC_PF_ROWS], rbd), rbd);
        }
    }
    return total;
}

static int pic_threads = 0;

void pic_set_num_threads(int n) { pic_threads = n; }

const char* pic_variant(void) { return PIC_VARIANT; }

/* The neurons set in any of the T rows of mask [T, n_ff], ascending, into idx; their count.
 * Eight bytes at a time, one bit per nonzero byte (a predictor sets about one neuron in ten: a
 * word's few set neurons are its set bits). */
static int64_t mask_union(const uint8_t* mask, int64_t T, int64_t n_ff, int32_t* idx) {
    int64_t m = 0, j = 0;
    for (; j + 8 <= n_ff; j += 8) {
        uint64_t any = 0, w;
        for (int64_t t = 0; t < T; ++t) {
            memcpy(&w, mask + t * n_ff + j, 8);
            any |= w;
        }
        const uint64_t lo7 = 0x7f7f7f7f7f7f7f7full;
        any = (((any & lo7) + lo7) | any) & ~lo7; /* bit 8k + 7: byte k (little-endian) != 0 */
        while (any) {
            idx[m++] = (int32_t)(j + (__builtin_ctzll(any) >> 3));
            any &= any - 1;
        }
    }
    for (; j < n_ff; ++j) {
        uint8_t any = 0;
        for (int64_t t = 0; t < T; ++t) any |= mask[t * n_ff + j];
        if (any) idx[m++] = (int32_t)j;
    }
    return m;
}

static void ffn_candidates(const float* x, int64_t T, int64_t d, int64_t n_ff,
                           const void* w_gate, const void* w_up, const void* w_down_t,
                           const float* b_gate, const float* b_up, const float* b_down,
                           const int32_t* idx, int64_t m, int by_neuron,
                           const uint8_t* mask, float threshold, float* out,
                           int64_t* n_active);

/* ffn and ffn_stable: with a predictor's mask (idx NULL), the union's rows are read once for all
 * the tokens and each token uses its own (one token: its row is the union). by_neuron: see
 * ffn_candidates. */
static void ffn_masked(const float* x, int64_t T, int64_t d, int64_t n_ff,
                       const void* w_gate, const void* w_up, const void* w_down_t,
                       const float* b_gate, const float* b_up, const float* b_down,
                       const int32_t* idx, int64_t m, const uint8_t* mask, float threshold,
                       float* out, int64_t* n_active, int by_neuron) {
    if (idx || !mask) {
        ffn_candidates(x, T, d, n_ff, w_gate, w_up, w_down_t, b_gate, b_up, b_down, idx, m,
                       0, NULL, threshold, out, n_active);
        return;
    }
    int32_t* predicted = (int32_t*)malloc((size_t)(n_ff > 0 ? n_ff : 1) * sizeof(int32_t));
    if (!predicted) { *n_active = -1; return; }
    m = T > 0 ? mask_union(mask, T, n_ff, predicted) : 0;
    ffn_candidates(x, T, d, n_ff, w_gate, w_up, w_down_t, b_gate, b_up, b_down, predicted, m,
                   by_neuron, T > 1 ? mask : NULL, threshold, out, n_active);
    free(predicted);
}

void ffn(const float* x, int64_t T, int64_t d, int64_t n_ff,
         const void* w_gate, const void* w_up, const void* w_down_t,
         const float* b_gate, const float* b_up, const float* b_down,
         const int32_t* idx, int64_t m, const uint8_t* mask, float threshold, float* out,
         int64_t* n_active) {
    ffn_masked(x, T, d, n_ff, w_gate, w_up, w_down_t, b_gate, b_up, b_down, idx, m, mask,
               threshold, out, n_active, 0);
}

void ffn_stable(const float* x, int64_t T, int64_t d, int64_t n_ff,
                const void* w_gate, const void* w_up, const void* w_down_t,
                const float* b_gate, const float* b_up, const float* b_down,
                const int32_t* idx, int64_t m, const uint8_t* mask, float threshold,
                float* out, int64_t* n_active) {
    ffn_masked(x, T, d, n_ff, w_gate, w_up, w_down_t, b_gate, b_up, b_down, idx, m, mask,
               threshold, out, n_active, 1);
}

int predict(const float* x, int64_t T, int64_t d, int64_t r, int64_t n_ff,
            const etype* p1, const float* pb1, const etype* p2t, const float* pb2,
            float tau, uint8_t* mask) {
    if (T <= 0) return 0;
    const size_t rr = (size_t)(r > 0 ? r : 1);
    float* z = (float*)malloc((size_t)T * rr * sizeof(float)); /* [T, r] */
    int32_t* live = (int32_t*)malloc(rr * sizeof(int32_t));    /* rows of p2t some token needs */
    if (!z || !live) { free(z); free(live); return -1; }
    int nthr = 1;
#ifdef _OPENMP
    nthr = pic_threads > 0 ? pic_threads : omp_get_max_threads();
#endif
    for (int64_t t0 = 0; t0 < T; t0 += PIC_MAXTOK) {
        const int nt = (int)(T - t0 < PIC_MAXTOK ? T - t0 : PIC_MAXTOK);
        const float* xs[PIC_MAXTOK];
        for (int n = 0; n < nt; ++n) xs[n] = x + (t0 + n) * d;
        int64_t nlive = 0;
        const int par = (double)r * (double)(d + n_ff) * nt >= PIC_PARALLEL_MIN;
        (void)par;
#ifdef _OPENMP
#pragma omp parallel if(par) num_threads(nthr)
#endif
        {
            /* z = relu(p1 x + pb1): threads split the rows of p1 */
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
            for (int64_t i = 0; i < r; ++i) {
                float s[PIC_MAXTOK];
                /* two tokens at a time (the row from L1 after the first pass), so that each
                 * token's sums run in the order of a call of its own: a predictor's pick at tau
                 * must not depend on how many tokens a call has (row_dot's accumulators do) */
                for (int n0 = 0; n0 < nt; n0 += 2)
                    pred_dot(p1 + i * d, xs + n0, nt - n0 < 2 ? 1 : 2, d, s + n0,
                             n0 == 0 && i + PIC_PF_ROWS < r
                                 ? PIC_PF_ROWS * d * (int64_t)sizeof(etype) : 0);
                for (int n = 0; n < nt; ++n) {
                    const float v = s[n] + pb1[i];
                    z[(t0 + n) * r + i] = v > 0.0f ? v : 0.0f;
                }
            }
            /* (barrier) the rows i where relu left z nonzero for some token: about half */
#ifdef _OPENMP
#pragma omp single
#endif
            for (int64_t i = 0; i < r; ++i) {
                int any = 0;
                for (int n = 0; n < nt; ++n) any |= z[(t0 + n) * r + i] != 0.0f;
                if (any) live[nlive++] = (int32_t)i;
            }
            /* (barrier) mask = p2 z + pb2 > tau with p2 transposed ([r, n_ff]): each thread takes
             * one contiguous slice of the neurons (whole cache lines) and accumulates
             * z[i] * p2t[i, slice] over the live rows i, prefetching the slices of the rows
             * PIC_PF_ROWS further down the list. */
            int me = 0, nth = 1;
#ifdef _OPENMP
            me = omp_get_thread_num();
            nth = omp_get_num_threads();
#endif
            const int64_t lines = (n_ff + PIC_WPL - 1) / PIC_WPL;
            const int64_t lo = lines * me / nth * PIC_WPL;
            const int64_t hi_ = lines * (me + 1) / nth * PIC_WPL, hi = hi_ < n_ff ? hi_ : n_ff;
            const int64_t per = PIC_PRED_ACC / nt; /* neurons per pass */
            float acc[PIC_PRED_ACC];
            for (int64_t j0 = lo; j0 < hi; j0 += per) {
                const int64_t nj = hi - j0 < per ? hi - j0 : per;
                float* ps[PIC_MAXTOK];
                for (int n = 0; n < nt; ++n) {
                    ps[n] = acc + n * nj;
                    memcpy(ps[n], pb2 + j0, (size_t)nj * sizeof(float));
                }
                for (int64_t q = 0; q < PIC_PF_ROWS && q < nlive; ++q)
                    row_prefetch(p2t + live[q] * n_ff + j0, nj * (int64_t)sizeof(etype));
                for (int64_t q = 0; q < nlive; ++q) {
                    const int64_t i = live[q];
                    float zi[PIC_MAXTOK];
                    for (int n = 0; n < nt; ++n) zi[n] = z[(t0 + n) * r + i];
                    const int64_t pf = q + PIC_PF_ROWS < nlive
                        ? (live[q + PIC_PF_ROWS] - i) * n_ff * (int64_t)sizeof(etype) : 0;
                    pred_axpy(p2t + i * n_ff + j0, zi, ps, nt, nj, pf);
                }
                for (int n = 0; n < nt; ++n)
                    for (int64_t j = 0; j < nj; ++j) mask[(t0 + n) * n_ff + j0 + j] = ps[n][j] > tau;
            }
        }
    }
    free(z);
    free(live);
    return 0;
}

static void ffn_candidates(const float* x, int64_t T, int64_t d, int64_t n_ff,
                           const void* w_gate, const void* w_up, const void* w_down_t,
                           const float* b_gate, const float* b_up, const float* b_down,
                           const int32_t* idx, int64_t m, int by_neuron,
                           const uint8_t* mask, float threshold, float* out,
                           int64_t* n_active) {
    const int64_t M = idx ? m : n_ff; /* candidate neurons */
    *n_active = 0;
    if (T <= 0 || d <= 0) return;
#if !PIC_BIAS
    (void)b_down;
#endif
    const int64_t dp = (d + 15) & ~(int64_t)15; /* partial rows padded to 64 bytes */
    /* The candidates are cut into nch contiguous chunks, each with its own partial output
     * [T][dp]. Threads take chunks dynamically (a descheduled thread does not hold the others
     * up) and the partials are summed in chunk order, so the result does not depend on the
     * thread count or on which thread ran which chunk. The chunks are equal runs of the list,
     * or with by_neuron (idx given, ascending) ranges of neuron numbers, so that a token's sums
     * do not depend on which other neurons the list holds (the other tokens' in a call of
     * several), at the price of uneven chunks where the firing neurons bunch (hot-first
     * orders). */
    const int64_t most = by_neuron ? n_ff : M;
    int64_t nch = most < PIC_CHUNKS ? most : PIC_CHUNKS;
    while (nch > 1 && nch * T * dp * (int64_t)sizeof(float) > PIC_PARTIAL_MAX_BYTES) nch /= 2;
    int nthr = 1;
#ifdef _OPENMP
    nthr = pic_threads > 0 ? pic_threads : omp_get_max_threads();
    if ((double)M * (double)d * (double)T < PIC_PARALLEL_MIN) nthr = 1;
    if (nthr > nch) nthr = nch > 0 ? (int)nch : 1;
#endif
    size_t bytes = (size_t)(nch > 0 ? nch : 1) * (size_t)T * (size_t)dp * sizeof(float);
    float* part = (float*)aligned_alloc(64, (bytes + 63) & ~(size_t)63);
    if (!part) { *n_active = -1; return; }
    pq_act* acts = NULL; /* [T] x rounded to integer blocks (PIC_QACT) */
#if PIC_QACT
    acts = pq_quantize_rows(x, T, d, PIC_WDTYPE == PIC_Q8_0); /* q8_0 rows: 16 bits */
    if (!acts) { free(part); *n_active = -1; return; }
#endif
    int64_t total = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(nthr) reduction(+ : total)
#endif
    {
        const float* xs[PIC_MAXTOK];
        const pq_act* xa[PIC_MAXTOK] = {NULL};
        const uint8_t* ms[PIC_MAXTOK]; /* the tokens' mask rows [n_ff] */
        float* ps[PIC_MAXTOK];
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t c = 0; c < nch; ++c) {
            float* mine = part + (size_t)c * T * dp;
            memset(mine, 0, (size_t)T * dp * sizeof(float));
            /* gate rows stream in order; by_neuron: chunk c holds the candidates numbered
             * n_ff * c / nch and up (idx ascending), whatever else the list holds */
            const int64_t lo = by_neuron ? first_from(idx, M, n_ff * c / nch) : M * c / nch;
            const int64_t hi = by_neuron ? first_from(idx, M, n_ff * (c + 1) / nch)
                                         : M * (c + 1) / nch;
            for (int64_t t0 = 0; t0 < T; t0 += PIC_MAXTOK) {
                const int nt = (int)(T - t0 < PIC_MAXTOK ? T - t0 : PIC_MAXTOK);
                for (int n = 0; n < nt; ++n) {
                    xs[n] = x + (t0 + n) * d;
                    if (acts) xa[n] = acts + t0 + n;
                    if (mask) ms[n] = mask + (t0 + n) * n_ff;
                    ps[n] = mine + (t0 + n) * dp;
                }
                total += run_range(lo, hi, idx, xs, acts ? xa : NULL, nt, d, w_gate, w_up,
                                   w_down_t, b_gate, b_up, threshold, mask ? ms : NULL, ps);
            }
        } /* implicit barrier: all partials complete */
        /* out[t][k] = b_down[k] + sum over chunks, in chunk order; threads split the columns. */
#ifdef _OPENMP
#pragma omp for schedule(static) collapse(2)
#endif
        for (int64_t t = 0; t < T; ++t) {
            for (int64_t kb = 0; kb < dp; kb += 64) {
                const int64_t nk = kb + 64 < d ? 64 : d - kb;
                float s[64]; /* chunk after chunk into 64 sums (vectorized along k) */
                for (int64_t k = 0; k < nk; ++k)
#if PIC_BIAS
                    s[k] = b_down ? b_down[kb + k] : 0.0f;
#else
                    s[k] = 0.0f;
#endif
                for (int64_t c = 0; c < nch; ++c) {
                    const float* pc = part + ((size_t)c * T + t) * dp + kb;
                    for (int64_t k = 0; k < nk; ++k) s[k] += pc[k];
                }
                memcpy(out + t * d + kb, s, (size_t)nk * sizeof(float));
            }
        }
    }
    free(part);
    free(acts);
    *n_active = total;
}
