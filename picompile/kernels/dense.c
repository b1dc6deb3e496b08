/* picompile dense linear kernel: decode GEMV and small-T GEMM over a row-major weight matrix.
 * Built by picompile/codegen/dense.py, once per weight format, with the flags of the C FFN kernels
 * (picompile/codegen/c.py: -O3 -fopenmp -mavx2 -mfma -mf16c where the CPU has them) plus
 *   -DPI_WDTYPE=0..5    weight format: 0 float32, 1 float16, 2 bfloat16 (the bias in the same
 *                       dtype), or a block-quantized format of picompile/quant.py (GGUF's blocks
 *                       of 32 weights along K; the bias float32): 3 q8_0, 4 q4_0, 5 q4_1
 *   -mavx512f           where the CPU has AVX-512F: 16-float vectors (#ifdef __AVX512F__)
 *   -DPI_PF_BYTES=n     software prefetch distance, bytes ahead in the weight stream (tuning)
 *   -DPI_CHUNK_BYTES=n  weight bytes per work chunk (tuning)
 *   -DPI_DYNAMIC=1      chunks scheduled dynamically instead of statically (tuning)
 *   -DPI_SCALAR=1       the scalar fallback even where SIMD is available (tests)
 *
 * Exported:
 *   void pi_dense(const float* x,   [T, K] float32, row-major, contiguous (row t at x + t*K)
 *                 int64_t T,        tokens (any T >= 0; the weights are read once per group of
 *                                   up to 8 tokens, so T <= 8 reads them exactly once)
 *                 int64_t K,        input features
 *                 const wtype* W,   [O, K] row-major, contiguous; wtype = PI_WDTYPE's element.
 *                                   Quantized formats: uint8 [O, K / 32 * PI_BLOCK_BYTES], each
 *                                   row its K / 32 blocks one after another (K must be a
 *                                   multiple of 32); q4_0 / q4_1 rows in the dot layout
 *                                   (qblocks.h, quant.interleave_blocks)
 *                 int64_t O,        output features
 *                 const btype* b,   [O] bias (the weight dtype; float32 for quantized weights),
 *                                   or NULL for none
 *                 float* out);      [T, O] float32, row-major, contiguous; written fully
 *       out[t][o] = sum_k x[t][k] * W[o][k] (+ b[o]), accumulated in float32 (f16 / bf16
 *       weights convert to float32 exactly). The quantized formats (q8_0: d * q, q4_0:
 *       d * (q - 8), q4_1: d * q + m) take x rounded per block of 32 (qblocks.h: to 16 bits for
 *       q8_0, 8 for the 4-bit ones) and dot the integers exactly: out = W . round(x) (+ b).
 *       Out of memory for that rounded copy of x (T * K bytes): out is all NaN.
 *   void pi_dense_multi(const float* x, int64_t T, int64_t K,   x as pi_dense takes it
 *                       int n,                  1 <= n <= 8 matrices over that same x
 *                       const wtype* const* W, const int64_t* O, const btype* const* b,
 *                       float* const* out);     [n] each: W[i] [O[i], K], b[i] or NULL,
 *                                               out[i] [T, O[i]]
 *       out[i] = pi_dense(x, W[i], b[i]) for every i, in one parallel region (the chunks of
 *       all n matrices scheduled together; the quantized formats round x once): a decoder's q, k
 *       and v projections in one call.
 *   void pi_set_num_threads(int n);  OpenMP threads for pi_dense (<= 0: the OpenMP default)
 *   const char* pi_dense_variant(void);  e.g. "float16 avx512", "q4_0 avx2" (format and ISA)
 *
 * Parallel plan: the O output rows are cut into contiguous chunks of about PI_CHUNK_BYTES of
 * weights (whole 16-row groups, so no two threads write the same 64-byte line of out when
 * T == 1), many more chunks than threads, statically scheduled. Each row is read once for
 * all the tokens of a group: N tokens x U vector accumulators stay in registers.
 * Each output element depends only on its row, so results do not depend on the thread count.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(PI_SCALAR) && PI_SCALAR
#define PQ_SCALAR 1             /* qblocks.h's scalar paths too */
#endif
#include "qblocks.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define PI_F32 0
#define PI_F16 1
#define PI_BF16 2
#define PI_Q8_0 3
#define PI_Q4_0 4
#define PI_Q4_1 5
#ifndef PI_WDTYPE
#define PI_WDTYPE PI_F32
#endif
#define PI_QUANT (PI_WDTYPE >= PI_Q8_0) /* block-quantized weights (float32 bias) */
#define PI_Q4 (PI_WDTYPE == PI_Q4_0 || PI_WDTYPE == PI_Q4_1)
/* The vector paths convert float16 (weights, block scales) with F16C. */
#define PI_NEEDS_F16C (PI_WDTYPE == PI_F16 || PI_QUANT)
#ifndef PI_PF_BYTES
#define PI_PF_BYTES 0           /* software prefetch distance in the weight stream; 0: none.
                                   codegen/dense.py's default_tuning sets it per CPU vendor */
#endif
#ifndef PI_CHUNK_BYTES
#define PI_CHUNK_BYTES 32768    /* weight bytes per work chunk (rounded to 16 whole rows) */
#endif
#ifndef PI_DYNAMIC
#define PI_DYNAMIC 0
#endif
#ifndef PI_SCALAR
#define PI_SCALAR 0
#endif
#define PI_MAXTOK 8             /* tokens per pass over the weights */
#define PI_PARALLEL_MIN 32768   /* below this many multiply-adds (O * K * T) run one thread */
#define PI_INLINE static inline __attribute__((always_inline))

#if !PI_SCALAR && defined(__AVX512F__) && (!PI_NEEDS_F16C || defined(__F16C__))
#include <immintrin.h>
#define PI_VW 16                /* floats per vector */
#define PI_ISA "avx512"
#elif !PI_SCALAR && defined(__AVX2__) && defined(__FMA__) && (!PI_NEEDS_F16C || defined(__F16C__))
#include <immintrin.h>
#define PI_VW 8
#define PI_ISA "avx2"
#else
#define PI_VW 1
#define PI_ISA "scalar"
#endif

/* ---- weight element type (wtype), bias type (btype) and their exact conversion to float32;
 *      PI_ROW(K): wtype elements of one weight row ---- */
#if PI_WDTYPE == PI_F32
typedef float wtype;
#define PI_DTYPE "float32"
PI_INLINE float w2f(wtype v) { return v; }
#elif PI_WDTYPE == PI_F16
typedef uint16_t wtype;
#define PI_DTYPE "float16"
PI_INLINE float w2f(wtype h) { return pq_f16(h); }
#elif PI_WDTYPE == PI_BF16
typedef uint16_t wtype;
#define PI_DTYPE "bfloat16"
PI_INLINE float w2f(wtype b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#elif PI_WDTYPE == PI_Q8_0        /* 34-byte blocks: d f16, q int8[32]; w = d * q */
#define PI_DTYPE "q8_0"
#define PI_BLOCK_BYTES 34
#elif PI_WDTYPE == PI_Q4_0        /* 18-byte blocks: d f16, qs u8[16]; w = d * (nibble - 8) */
#define PI_DTYPE "q4_0"
#define PI_BLOCK_BYTES 18
#elif PI_WDTYPE == PI_Q4_1        /* 20-byte blocks: d f16, m f16, qs u8[16]; w = d * nibble + m */
#define PI_DTYPE "q4_1"
#define PI_BLOCK_BYTES 20
#else
#error "PI_WDTYPE must be 0 (float32), 1 (float16), 2 (bfloat16), 3 (q8_0), 4 (q4_0) or 5 (q4_1)"
#endif

#if PI_QUANT
typedef uint8_t wtype;            /* the blocks' bytes */
typedef float btype;
#define PI_BLOCK 32               /* weights per block, along K */
#define PI_ROW(K) ((K) / PI_BLOCK * PI_BLOCK_BYTES)
PI_INLINE float b2f(btype v) { return v; }
#else
typedef wtype btype;
#define PI_ROW(K) (K)
PI_INLINE float b2f(btype v) { return w2f(v); }
#define PI_WPL (64 / (int)sizeof(wtype)) /* weights per 64-byte cache line */
#endif

/* ---- vectors of PI_VW floats: load x, load weights (converted), fma, horizontal sum ---- */
#if PI_VW == 16
typedef __m512 vf;
PI_INLINE vf v_zero(void) { return _mm512_setzero_ps(); }
PI_INLINE vf v_loadx(const float* p) { return _mm512_loadu_ps(p); }
PI_INLINE vf v_set1(float f) { return _mm512_set1_ps(f); }
PI_INLINE vf v_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
#if !PI_QUANT
PI_INLINE vf v_loadw(const wtype* p) {
#if PI_WDTYPE == PI_F32
    return _mm512_loadu_ps(p);
#elif PI_WDTYPE == PI_F16
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#else
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
#endif
}
#endif
PI_INLINE vf v_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
PI_INLINE vf v_add(vf a, vf b) { return _mm512_add_ps(a, b); }
PI_INLINE float v_hsum(vf v) { return _mm512_reduce_add_ps(v); }
#elif PI_VW == 8
typedef __m256 vf;
PI_INLINE vf v_zero(void) { return _mm256_setzero_ps(); }
PI_INLINE vf v_loadx(const float* p) { return _mm256_loadu_ps(p); }
PI_INLINE vf v_set1(float f) { return _mm256_set1_ps(f); }
PI_INLINE vf v_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
#if !PI_QUANT
PI_INLINE vf v_loadw(const wtype* p) {
#if PI_WDTYPE == PI_F32
    return _mm256_loadu_ps(p);
#elif PI_WDTYPE == PI_F16
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
#endif
}
#endif
PI_INLINE vf v_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
PI_INLINE vf v_add(vf a, vf b) { return _mm256_add_ps(a, b); }
PI_INLINE float v_hsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#if PI_VW > 1
#define PI_PREFETCH(p) _mm_prefetch((const char*)(p), _MM_HINT_T0)
#else
#define PI_PREFETCH(p) __builtin_prefetch((const void*)(p), 0, 3)
#endif

/* A token's row as the dot products read it: float32 x, or for the quantized formats x rounded
 * to integer blocks (qblocks.h: 8 bits for 4-bit rows, 16 for q8_0). */
#if PI_QUANT
typedef const pq_act* xin;
#else
typedef const float* xin;
#endif

#if PI_QUANT
/* res[n] = w . xs[n] for n < N over one row of blocks in the dot layout: qblocks.h's integer
 * dots */
PI_INLINE void dot_n(const wtype* w, const xin* xs, int64_t K, float* res, const int N,
                     const int U) {
    (void)U;
#if PI_Q4
    pq_q4_dot(w, PI_WDTYPE == PI_Q4_1, K / PI_BLOCK, xs, res, N, PI_PF_BYTES);
#else
    pq_q8_dot(w, K / PI_BLOCK, xs, res, N, PI_PF_BYTES);
#endif
}

#else
/* res[n] = w[0:K] . xs[n][0:K] for n < N: one pass over the row w for all N tokens.
 *   w    [K] one weight row
 *   xs   [N] pointers to the token rows, each [K] float32
 *   res  [N] float32 out
 * N tokens x U accumulators of PI_VW floats (N * U <= 8); each main-loop step covers SV vectors,
 * whole cache lines of weights, one prefetch PI_PF_BYTES ahead per line where PI_PF_BYTES > 0
 * (the rows of a chunk are contiguous, so the prefetches run on into the next rows). */
PI_INLINE void dot_n(const wtype* w, const xin* xs, int64_t K, float* res,
                     const int N, const int U) {
#if PI_VW > 1
    const int VPL = PI_WPL / PI_VW;          /* vectors per cache line of weights (1..4) */
    const int SV = U > VPL ? U : VPL;        /* vectors per step: a multiple of VPL and of U */
    vf acc[PI_MAXTOK];
    for (int i = 0; i < N * U; ++i) acc[i] = v_zero();
    int64_t k = 0;
    for (; k + PI_VW * SV <= K; k += PI_VW * SV) {
        if (PI_PF_BYTES > 0)
            for (int l = 0; l < SV / VPL; ++l)
                PI_PREFETCH(w + k + l * PI_WPL + PI_PF_BYTES / (int)sizeof(wtype));
        for (int v = 0; v < SV; ++v) {
            const vf wv = v_loadw(w + k + PI_VW * v);
            for (int n = 0; n < N; ++n)
                acc[n * U + v % U] = v_fma(wv, v_loadx(xs[n] + k + PI_VW * v), acc[n * U + v % U]);
        }
    }
    for (; k + PI_VW <= K; k += PI_VW) {
        const vf wv = v_loadw(w + k);
        for (int n = 0; n < N; ++n) acc[n * U] = v_fma(wv, v_loadx(xs[n] + k), acc[n * U]);
    }
    float tail[PI_MAXTOK];
    for (int n = 0; n < N; ++n) tail[n] = 0.0f;
    for (; k < K; ++k) {
        const float wk = w2f(w[k]);
        for (int n = 0; n < N; ++n) tail[n] += wk * xs[n][k];
    }
    for (int n = 0; n < N; ++n) {
        vf s = acc[n * U];
        for (int u = 1; u < U; ++u) s = v_add(s, acc[n * U + u]);
        res[n] = v_hsum(s) + tail[n];
    }
#else
    float r[PI_MAXTOK] = {0};
    (void)U;
    for (int64_t k = 0; k < K; ++k) {
        if (PI_PF_BYTES > 0 && (k & (PI_WPL - 1)) == 0)
            PI_PREFETCH(w + k + PI_PF_BYTES / (int)sizeof(wtype));
        const float wk = w2f(w[k]);
        for (int n = 0; n < N; ++n) r[n] += wk * xs[n][k];
    }
    for (int n = 0; n < N; ++n) res[n] = r[n];
#endif
}
#endif /* PI_QUANT */

/* Rows [lo, hi) of W for one group of N tokens: out[t0 + n][o] for n < N, o in [lo, hi).
 *   x    [T, K] float32 (the group's rows start at x + t0 * K); the quantized formats read
 *   acts [T] instead (x rounded to integer blocks, qblocks.h)
 *   W    [O, PI_ROW(K)], b [O] or NULL, out [T, O] float32
 * N and U are compile-time constants in every instance (rows_group dispatches). (Cutting K into
 * blocks that keep the token rows in L1 was measured no faster, up to K = 4096.) */
PI_INLINE void rows_n(const float* x, const pq_act* acts, int64_t t0, int64_t K, const wtype* W,
                      int64_t O, const btype* b, float* out, int64_t lo, int64_t hi, const int N,
                      const int U) {
    xin xs[PI_MAXTOK];
    float* os[PI_MAXTOK];
    for (int n = 0; n < N; ++n) {
#if PI_QUANT
        (void)x;
        xs[n] = acts + t0 + n;
#else
        (void)acts;
        xs[n] = x + (t0 + n) * K;
#endif
        os[n] = out + (t0 + n) * O;
    }
    for (int64_t o = lo; o < hi; ++o) {
        float r[PI_MAXTOK];
        dot_n(W + o * PI_ROW(K), xs, K, r, N, U);
        const float bo = b ? b2f(b[o]) : 0.0f;
        for (int n = 0; n < N; ++n) os[n][o] = r[n] + bo;
    }
}

static void rows_group(const float* x, const pq_act* acts, int64_t t0, int nt, int64_t K,
                       const wtype* W, int64_t O, const btype* b, float* out, int64_t lo,
                       int64_t hi) {
    switch (nt) {
    case 1: rows_n(x, acts, t0, K, W, O, b, out, lo, hi, 1, 4); break;
    case 2: rows_n(x, acts, t0, K, W, O, b, out, lo, hi, 2, 4); break;
    case 3: rows_n(x, acts, t0, K, W, O, b, out, lo, hi, 3, 2); break;
    case 4: rows_n(x, acts, t0, K, W, O, b, out, lo, hi, 4, 2); break;
    case 5: rows_n(x, acts, t0, K, W, O, b, out, lo, hi, 5, 1); break;
    case 6: rows_n(x, acts, t0, K, W, O, b, out, lo, hi, 6, 1); break;
    case 7: rows_n(x, acts, t0, K, W, O, b, out, lo, hi, 7, 1); break;
    default: rows_n(x, acts, t0, K, W, O, b, out, lo, hi, 8, 1); break;
    }
}

static int pi_threads = 0;

void pi_set_num_threads(int n) { pi_threads = n; }

const char* pi_dense_variant(void) { return PI_DTYPE " " PI_ISA; }

#define PI_MAXMAT 8 /* matrices per pi_dense_multi call */

void pi_dense_multi(const float* x, int64_t T, int64_t K, int n, const wtype* const* W,
                    const int64_t* O, const btype* const* b, float* const* out) {
    if (T <= 0 || n <= 0 || n > PI_MAXMAT) return;
    if (K <= 0) { /* empty sums: the bias alone */
        for (int i = 0; i < n; ++i)
            for (int64_t t = 0; t < T; ++t)
                for (int64_t o = 0; o < O[i]; ++o) out[i][t * O[i] + o] = b[i] ? b2f(b[i][o]) : 0.0f;
        return;
    }
    /* chunk: whole groups of 16 rows, about PI_CHUNK_BYTES of weights; the chunks of matrix i
     * are first[i] .. first[i + 1] - 1 of one list */
    int64_t row_bytes = PI_ROW(K) * (int64_t)sizeof(wtype);
    if (row_bytes < 1) row_bytes = 1; /* (quantized weights with K < 32: not a valid call) */
    int64_t rows = (int64_t)PI_CHUNK_BYTES / row_bytes;
    rows = rows < 16 ? 16 : rows & ~(int64_t)15;
    int64_t first[PI_MAXMAT + 1], total_rows = 0;
    first[0] = 0;
    for (int i = 0; i < n; ++i) {
        first[i + 1] = first[i] + (O[i] > 0 ? (O[i] + rows - 1) / rows : 0);
        total_rows += O[i] > 0 ? O[i] : 0;
    }
    const int64_t nch = first[n];
    if (nch == 0) return;
    pq_act* acts = NULL;
#if PI_QUANT
    acts = pq_quantize_rows(x, T, K, PI_WDTYPE == PI_Q8_0); /* once for all the matrices */
    if (!acts) { /* loud, not silently wrong */
        for (int i = 0; i < n; ++i)
            for (int64_t j = 0; j < T * O[i]; ++j) out[i][j] = NAN;
        return;
    }
#endif
    int nthr = 1;
#ifdef _OPENMP
    nthr = pi_threads > 0 ? pi_threads : omp_get_max_threads();
    if ((double)total_rows * (double)K * (double)(T < PI_MAXTOK ? T : PI_MAXTOK) < PI_PARALLEL_MIN)
        nthr = 1;
    if (nthr > nch) nthr = (int)nch;
#endif
#ifdef _OPENMP
#pragma omp parallel num_threads(nthr) if (nthr > 1)
#endif
    for (int64_t t0 = 0; t0 < T; t0 += PI_MAXTOK) {
        const int nt = (int)(T - t0 < PI_MAXTOK ? T - t0 : PI_MAXTOK);
#ifdef _OPENMP
#if PI_DYNAMIC
#pragma omp for schedule(dynamic, 1) nowait
#else
#pragma omp for schedule(static) nowait
#endif
#endif
        for (int64_t c = 0; c < nch; ++c) {
            int i = 0;
            while (c >= first[i + 1]) ++i;
            const int64_t lo = (c - first[i]) * rows, hi = lo + rows < O[i] ? lo + rows : O[i];
            rows_group(x, acts, t0, nt, K, W[i], O[i], b[i], out[i], lo, hi);
        }
    }
    free(acts);
}

void pi_dense(const float* x, int64_t T, int64_t K, const wtype* W, int64_t O, const btype* b,
              float* out) {
    pi_dense_multi(x, T, K, 1, &W, &O, &b, &out);
}

#if PI_QUANT
/* Block j of a row as float32 (blk: its bytes in GGUF's layout) -> out [32]: the products the
 * reference (picompile.quant.dequantize) computes, so no contraction into an FMA. */
__attribute__((optimize("fp-contract=off")))
static void deq_block(const uint8_t* blk, float* out) {
    uint16_t h;
    memcpy(&h, blk, 2);
    const float d = pq_f16(h);
#if PI_WDTYPE == PI_Q8_0
    const int8_t* q = (const int8_t*)(blk + 2);
    for (int i = 0; i < PQ_QK; ++i) out[i] = d * (float)q[i];
#elif PI_WDTYPE == PI_Q4_0
    const uint8_t* qs = blk + 2;
    for (int i = 0; i < PQ_QK / 2; ++i) {
        out[i] = d * (float)((qs[i] & 15) - 8);
        out[i + PQ_QK / 2] = d * (float)((qs[i] >> 4) - 8);
    }
#else /* q4_1 */
    memcpy(&h, blk + 2, 2);
    const float m = pq_f16(h);
    const uint8_t* qs = blk + 4;
    for (int i = 0; i < PQ_QK / 2; ++i) {
        out[i] = d * (float)(qs[i] & 15) + m;
        out[i + PQ_QK / 2] = d * (float)(qs[i] >> 4) + m;
    }
#endif
}

/* One superblock of a row in the dot layout (qblocks.h) back to GGUF's 8 blocks. */
static void sb_to_blocks(const uint8_t* sb, uint8_t* blocks) {
    const int head = PI_WDTYPE == PI_Q4_1 ? 4 : 2;     /* scale (and minimum) bytes per block */
    const int c = PI_WDTYPE == PI_Q8_0 ? 2 : 4;        /* bytes per piece of weights */
    const int pieces = (PI_BLOCK_BYTES - head) / c;
    const uint8_t* qs = sb + PQ_SB * head;              /* [pieces][8][c] */
    for (int b = 0; b < PQ_SB; ++b) {
        uint8_t* blk = blocks + b * PI_BLOCK_BYTES;
        memcpy(blk, sb + 2 * b, 2);                                      /* dw[b] */
        if (head == 4) memcpy(blk + 2, sb + 2 * PQ_SB + 2 * b, 2);       /* m[b] (q4_1) */
        for (int v = 0; v < pieces; ++v) memcpy(blk + head + c * v, qs + PQ_SB * c * v + c * b, c);
    }
}

/* W [O, K / 32 blocks] in the kernel's layout (the dot layout when dot_layout, else GGUF's:
 * FFN down rows) -> out [O, K] float32: prefill's weights, made once per call instead of by
 * torch's elementwise ops. */
void pi_dequantize(const uint8_t* W, int64_t O, int64_t K, int dot_layout, float* out) {
    const int64_t nb = K / PQ_QK, rb = nb * PI_BLOCK_BYTES;
    const int64_t nsb = dot_layout ? nb / PQ_SB : 0; /* superblocks per row */
#ifdef _OPENMP
    const int nthr = pi_threads > 0 ? pi_threads : omp_get_max_threads();
#pragma omp parallel for schedule(static) num_threads(nthr) if (O * K >= (1 << 16))
#endif
    for (int64_t o = 0; o < O; ++o) {
        const uint8_t* row = W + o * rb;
        float* y = out + o * K;
        uint8_t blocks[PQ_SB * PI_BLOCK_BYTES];
        for (int64_t s = 0; s < nsb; ++s) {
            sb_to_blocks(row + s * PQ_SB * PI_BLOCK_BYTES, blocks);
            for (int b = 0; b < PQ_SB; ++b)
                deq_block(blocks + b * PI_BLOCK_BYTES, y + (s * PQ_SB + b) * PQ_QK);
        }
        for (int64_t j = nsb * PQ_SB; j < nb; ++j) deq_block(row + j * PI_BLOCK_BYTES, y + j * PQ_QK);
    }
}
#endif
