/* picompile dense linear kernel: decode GEMV and small-T GEMM over a row-major weight matrix.
 * Built by picompile/codegen/dense.py, once per weight dtype, with the flags of the C FFN kernels
 * (picompile/codegen/c.py: -O3 -fopenmp -mavx2 -mfma -mf16c where the CPU has them) plus
 *   -DPI_WDTYPE=0|1|2   weight (and bias) dtype: 0 float32, 1 float16, 2 bfloat16
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
 *                 const wtype* W,   [O, K] row-major, contiguous; wtype = PI_WDTYPE's element
 *                 int64_t O,        output features
 *                 const wtype* b,   [O] bias in the weight dtype, or NULL for none
 *                 float* out);      [T, O] float32, row-major, contiguous; written fully
 *       out[t][o] = sum_k x[t][k] * W[o][k] (+ b[o]), accumulated in float32 (f16 / bf16
 *       weights convert to float32 exactly).
 *   void pi_set_num_threads(int n);  OpenMP threads for pi_dense (<= 0: the OpenMP default)
 *   const char* pi_dense_variant(void);  e.g. "float16 avx512" (dtype and vector ISA built)
 *
 * Parallel plan: the O output rows are cut into contiguous chunks of about PI_CHUNK_BYTES of
 * weights (whole 16-row groups, so no two threads write the same 64-byte line of out when
 * T == 1), many more chunks than threads, statically scheduled. Each row is read once for
 * all the tokens of a group: N tokens x U vector accumulators stay in registers.
 * Each output element depends only on its row, so results do not depend on the thread count.
 */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define PI_F32 0
#define PI_F16 1
#define PI_BF16 2
#ifndef PI_WDTYPE
#define PI_WDTYPE PI_F32
#endif
#ifndef PI_PF_BYTES
#define PI_PF_BYTES 0           /* software prefetch distance in the weight stream; 0: none (the
                                   hardware prefetchers follow the contiguous chunks as well or
                                   better, measured with benchmarks/gemv.py on AMD EPYC Zen 4) */
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

#if !PI_SCALAR && defined(__AVX512F__) && (PI_WDTYPE != PI_F16 || defined(__F16C__))
#include <immintrin.h>
#define PI_VW 16                /* floats per vector */
#define PI_ISA "avx512"
#elif !PI_SCALAR && defined(__AVX2__) && defined(__FMA__) && (PI_WDTYPE != PI_F16 || defined(__F16C__))
#include <immintrin.h>
#define PI_VW 8
#define PI_ISA "avx2"
#else
#define PI_VW 1
#define PI_ISA "scalar"
#endif

/* ---- weight element type and its exact conversion to float32 ---- */
#if PI_WDTYPE == PI_F32
typedef float wtype;
#define PI_DTYPE "float32"
PI_INLINE float w2f(wtype v) { return v; }
#elif PI_WDTYPE == PI_F16
typedef uint16_t wtype;
#define PI_DTYPE "float16"
PI_INLINE float w2f(wtype h) {
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
#elif PI_WDTYPE == PI_BF16
typedef uint16_t wtype;
#define PI_DTYPE "bfloat16"
PI_INLINE float w2f(wtype b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#else
#error "PI_WDTYPE must be 0 (float32), 1 (float16) or 2 (bfloat16)"
#endif

#define PI_WPL (64 / (int)sizeof(wtype)) /* weights per 64-byte cache line */

/* ---- vectors of PI_VW floats: load x, load weights (converted), fma, horizontal sum ---- */
#if PI_VW == 16
typedef __m512 vf;
PI_INLINE vf v_zero(void) { return _mm512_setzero_ps(); }
PI_INLINE vf v_loadx(const float* p) { return _mm512_loadu_ps(p); }
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
PI_INLINE vf v_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
PI_INLINE vf v_add(vf a, vf b) { return _mm512_add_ps(a, b); }
PI_INLINE float v_hsum(vf v) { return _mm512_reduce_add_ps(v); }
#elif PI_VW == 8
typedef __m256 vf;
PI_INLINE vf v_zero(void) { return _mm256_setzero_ps(); }
PI_INLINE vf v_loadx(const float* p) { return _mm256_loadu_ps(p); }
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

/* res[n] = w[0:K] . xs[n][0:K] for n < N: one pass over the row w for all N tokens.
 *   w    [K] one weight row
 *   xs   [N] pointers to the token rows, each [K] float32
 *   res  [N] float32 out
 * N tokens x U accumulators of PI_VW floats (N * U <= 8); each main-loop step covers SV vectors,
 * whole cache lines of weights, one prefetch PI_PF_BYTES ahead per line where PI_PF_BYTES > 0
 * (the rows of a chunk are contiguous, so the prefetches run on into the next rows). */
PI_INLINE void dot_n(const wtype* w, const float* const* xs, int64_t K, float* res,
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

/* Rows [lo, hi) of W for one group of N tokens: out[t0 + n][o] for n < N, o in [lo, hi).
 *   x    [T, K] float32 (the group's rows start at x + t0 * K)
 *   W    [O, K], b [O] or NULL, out [T, O] float32
 * N and U are compile-time constants in every instance (rows_group dispatches). (Cutting K into
 * blocks that keep the token rows in L1 was measured no faster, up to K = 4096.) */
PI_INLINE void rows_n(const float* x, int64_t t0, int64_t K, const wtype* W, int64_t O,
                      const wtype* b, float* out, int64_t lo, int64_t hi, const int N,
                      const int U) {
    const float* xs[PI_MAXTOK];
    float* os[PI_MAXTOK];
    for (int n = 0; n < N; ++n) { xs[n] = x + (t0 + n) * K; os[n] = out + (t0 + n) * O; }
    for (int64_t o = lo; o < hi; ++o) {
        float r[PI_MAXTOK];
        dot_n(W + o * K, xs, K, r, N, U);
        const float bo = b ? w2f(b[o]) : 0.0f;
        for (int n = 0; n < N; ++n) os[n][o] = r[n] + bo;
    }
}

static void rows_group(const float* x, int64_t t0, int nt, int64_t K, const wtype* W, int64_t O,
                       const wtype* b, float* out, int64_t lo, int64_t hi) {
    switch (nt) {
    case 1: rows_n(x, t0, K, W, O, b, out, lo, hi, 1, 4); break;
    case 2: rows_n(x, t0, K, W, O, b, out, lo, hi, 2, 4); break;
    case 3: rows_n(x, t0, K, W, O, b, out, lo, hi, 3, 2); break;
    case 4: rows_n(x, t0, K, W, O, b, out, lo, hi, 4, 2); break;
    case 5: rows_n(x, t0, K, W, O, b, out, lo, hi, 5, 1); break;
    case 6: rows_n(x, t0, K, W, O, b, out, lo, hi, 6, 1); break;
    case 7: rows_n(x, t0, K, W, O, b, out, lo, hi, 7, 1); break;
    default: rows_n(x, t0, K, W, O, b, out, lo, hi, 8, 1); break;
    }
}

static int pi_threads = 0;

void pi_set_num_threads(int n) { pi_threads = n; }

const char* pi_dense_variant(void) { return PI_DTYPE " " PI_ISA; }

void pi_dense(const float* x, int64_t T, int64_t K, const wtype* W, int64_t O, const wtype* b,
              float* out) {
    if (T <= 0 || O <= 0) return;
    if (K <= 0) { /* empty sums: the bias alone */
        for (int64_t t = 0; t < T; ++t)
            for (int64_t o = 0; o < O; ++o) out[t * O + o] = b ? w2f(b[o]) : 0.0f;
        return;
    }
    /* chunk: whole groups of 16 rows, about PI_CHUNK_BYTES of weights */
    int64_t rows = (int64_t)PI_CHUNK_BYTES / (K * (int64_t)sizeof(wtype));
    rows = rows < 16 ? 16 : rows & ~(int64_t)15;
    const int64_t nch = (O + rows - 1) / rows;
    int nthr = 1;
#ifdef _OPENMP
    nthr = pi_threads > 0 ? pi_threads : omp_get_max_threads();
    if ((double)O * (double)K * (double)(T < PI_MAXTOK ? T : PI_MAXTOK) < PI_PARALLEL_MIN) nthr = 1;
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
            const int64_t lo = c * rows, hi = lo + rows < O ? lo + rows : O;
            rows_group(x, t0, nt, K, W, O, b, out, lo, hi);
        }
    }
}
