/* picompile decoder step: a decode token (or up to 8 consecutive ones) through a whole pre-norm
 * decoder stack in one call (runtime/decoder.py's Family: Llama and its relatives, Granite,
 * Gemma, OPT). Built by picompile/codegen/decoder.py with the flags of the other C kernels
 * (c.build_flags()).
 *
 *     x *= embed_scale             (Gemma: sqrt(d); Granite: its embedding multiplier)
 *     x += pos_embed[pos]          learned positions (OPT), where the model has them
 * Per layer (pre-norm, as Hugging Face's LlamaDecoderLayer, OPTDecoderLayer, Gemma2DecoderLayer
 * and their relatives):
 *     h = norm(x, attn_norm)       RMSNorm, or LayerNorm (with its bias) where layer_norm is set
 *     q, k, v = Wq h (+bq), Wk h (+bk), Wv h (+bv)          (GQA: n_kv_heads <= n_heads)
 *         or [q; k; v] = Wqkv h (+bqkv) where the model fuses them (Phi-3)
 *     q, k per head = rmsnorm(head, q_norm / k_norm)        where the model has them (Qwen3)
 *     rotate q, k by the layer's rope tables at `pos` (rotate_half form over each head's first
 *         rot_dim dimensions: pairs i and i + rot_dim/2), where the model has them
 *     k, v -> the layer's cache at `pos` (float32; float16 / bfloat16 for a 16-bit model where
 *         the build has AVX2 and F16C: pi_decoder_kv_16bit)
 *     a[head] = softmax(cap(scale * q[head] . K[kv(head)][t0..pos])) V[kv(head)][t0..pos]
 *         t0 = pos - window + 1 in a sliding-window layer (those before it are not read), else 0;
 *         cap(s) = attn_softcap * tanh(s / attn_softcap) where set (Gemma 2)
 *     x += post_attn_norm(Wo a (+bo)) * residual_scale   the post-norm where the layer has one
 *                                  (Gemma 2, 3); residual_scale 1 but in Granite
 *     h = norm(x, ffn_norm)
 *     x += post_ffn_norm(ffn(h)) * residual_scale   the block's sparse FFN kernel (and its
 *                                  predictor, if any)
 * then  logits = cap(W_lm norm(x, final_norm) / logit_divisor), cap by logit_softcap where set,
 *       logit_divisor 1 but in Granite.
 *
 * The weight-bearing work runs in picompile's other kernels, called through function pointers
 * the caller takes from their loaded libraries (so each keeps its own dtype, variant and build):
 *     pi_dense (kernels/dense.c) for every linear layer (pi_dense_multi for q, k and v together
 *     where they share a library), ffn / predict (codegen/c.py) for the FFN.
 * This file does the glue: norms, RoPE, the KV cache and attention, all in float32.
 *
 * A step takes T consecutive tokens (1 <= T <= PI_STEP_MAX) at positions pos..pos+T-1: one
 * decode token, or a token and the tokens drafted after it (speculative decoding), whose
 * weights every linear layer and FFN reads once for all T; token t attends to positions
 * 0..pos+t (its own keys and values are written first).
 *
 * Exported:
 *     int64_t pi_decoder_work_floats(const pi_decoder* m);  float32 scratch the step needs
 *     int pi_decoder_step(const pi_decoder* m, int64_t pos, int64_t T, float* x, float* logits);
 *         x [T, d] float32: the tokens' embeddings in, clobbered; logits [T, vocab] float32 out.
 *         logits NULL: the layers only, x the residual stream out (a run of layers that a
 *         device decoder leaves on the CPU: embed_scale 1, no pos_embed, no head).
 *         Returns 0, -1 for positions outside [0, max_len), -2 when an FFN kernel ran out of
 *         memory, -3 for T outside [1, PI_STEP_MAX].
 *     int pi_decoder_step_max(void);  PI_STEP_MAX
 *     void pi_decoder_set_num_threads(int n);  OpenMP threads for attention (<= 0: default)
 *     int pi_decoder_kv_16bit(void);  1 where the cache may hold float16 / bfloat16 (kv_dtype)
 *     float pi_decoder_softmax_exp(float* s, int64_t n, float mx);  attention's exponentials:
 *         s [n] = e^(s - mx) in place, their sum returned (for tests against torch.exp)
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PI_KV16 1
#else
#define PI_KV16 0
#endif
#ifdef _OPENMP
#include <omp.h>
#endif
#define PI_INLINE static inline __attribute__((always_inline))

typedef void (*pi_dense_fn)(const float* x, int64_t T, int64_t K, const void* W, int64_t O,
                            const void* b, float* out);
typedef void (*pi_dense_multi_fn)(const float* x, int64_t T, int64_t K, int n,
                                  const void* const* W, const int64_t* O, const void* const* b,
                                  float* const* out);
typedef void (*pi_ffn_fn)(const float* x, int64_t T, int64_t d, int64_t n_ff, const void* w_gate,
                          const void* w_up, const void* w_down_t, const float* b_gate,
                          const float* b_up, const float* b_down, const int32_t* idx, int64_t m,
                          const uint8_t* mask, float threshold, float* out, int64_t* n_active);
typedef int (*pi_predict_fn)(const float* x, int64_t T, int64_t d, int64_t r, int64_t n_ff,
                             const void* p1, const float* pb1, const void* p2t,
                             const float* pb2, float tau, uint8_t* mask);

typedef struct {          /* y [out_features] = W x + b, W [out_features, in] in its own dtype */
    void* fn;             /* pi_dense of the library built for W's dtype */
    const void* w;
    const void* b;        /* or NULL */
    int64_t out_features;
} pi_linear;

typedef struct {          /* the arguments of codegen/c.py's ffn() and predict() */
    void* fn;             /* ffn of the block's variant library */
    const void* w_gate;   /* [n_ff, d] or NULL (plain block) */
    const void* w_up;     /* [n_ff, d] */
    const void* w_down_t; /* [n_ff, d] */
    const float* b_gate;  /* [n_ff] or NULL */
    const float* b_up;    /* [n_ff] or NULL */
    const float* b_down;  /* [d] or NULL */
    int64_t n_ff;
    float threshold;
    void* predict;        /* predict of a float16 variant library, or NULL: no predictor */
    const void* p1;       /* [rank, d] float16 */
    const float* pb1;     /* [rank] */
    const void* p2t;      /* [rank, n_ff] float16 */
    const float* pb2;     /* [n_ff] */
    int64_t rank;
    float tau;
} pi_ffn;

typedef struct {
    const float* attn_norm;  /* [d] */
    const float* attn_norm_b;/* [d] LayerNorm bias, or NULL */
    const float* ffn_norm;   /* [d] */
    const float* ffn_norm_b; /* [d] or NULL */
    const float* q_norm;     /* [head_dim] RMSNorm of each query head, or NULL */
    const float* k_norm;     /* [head_dim] and of each key head, or NULL */
    const float* post_attn_norm; /* [d] norm of the attention's output, or NULL */
    const float* post_ffn_norm;  /* [d] norm of the FFN's output, or NULL */
    const float* rope_cos;   /* [max_len, rot_dim], or NULL: no rotary embedding */
    const float* rope_sin;   /* [max_len, rot_dim] */
    int64_t window;          /* attend to the last `window` positions; 0: to all */
    pi_linear q, k, v, o;    /* k.fn NULL: q projects to [q; k; v] (qd + 2 kvd outputs) */
    pi_ffn ffn;
    void* k_cache;           /* [n_kv_heads, max_len, head_dim] of kv_dtype */
    void* v_cache;           /* [n_kv_heads, max_len, head_dim] */
    void* qkv_fn;            /* pi_dense_multi of the library q, k and v share (one call for
                                the three), or NULL: three pi_dense calls */
} pi_layer;

typedef struct {
    int64_t n_layers, d, n_heads, n_kv_heads, head_dim, max_len, vocab;
    int64_t layer_norm;      /* 0: RMSNorm, 1: LayerNorm (mean removed, bias added) */
    int64_t parallel;        /* 1: the FFN reads the layer's input, not the attention's output */
    int64_t qkv_per_head;    /* 1: a fused projection writes each head's [q; k; v] in turn
                                (GPT-NeoX; as many key / value heads as query heads) */
    int64_t rot_dim;         /* dimensions of each head RoPE rotates (head_dim, or fewer) */
    int64_t kv_dtype;        /* the KV cache's: 0 float32, 1 float16, 2 bfloat16 (PI_KV16) */
    float eps;               /* the norms' epsilon */
    float scale;             /* attention scores scale (head_dim ** -0.5 for Llama) */
    float embed_scale;       /* the embedding's factor (1: none) */
    float attn_softcap;      /* attention scores capped by tanh (0: not) */
    float logit_softcap;     /* and the logits (0: not) */
    float residual_scale;    /* each sublayer's output times it before the residual add (1) */
    float logit_divisor;     /* the logits divided by it (1) */
    const float* pos_embed;  /* [max_len, d] learned position embeddings, or NULL */
    const pi_layer* layers;  /* [n_layers] */
    const float* final_norm; /* [d] */
    const float* final_norm_b; /* [d] or NULL */
    pi_linear lm_head;
    int64_t* n_active;       /* [n_layers]: active neurons computed, accumulated per layer */
    float* work;             /* [pi_decoder_work_floats(m)] scratch */
    uint8_t* mask;           /* [PI_STEP_MAX, max n_ff] predicted-neuron masks scratch */
} pi_decoder;

static int pi_threads = 0;

void pi_decoder_set_num_threads(int n) { pi_threads = n; }

/* Attention of one token over the cache, split like flash-decoding: the positions t0..pos of
 * each KV head are cut into chunks (of PI_ATT_CHUNK positions, and at least PI_ATT_UNITS pieces
 * of work in all where there are positions enough; counts that depend on the position alone, so
 * the result does not depend on the thread count), and one piece of work is a KV head's chunk
 * for all the query heads that share that head (GQA): each cached key and value row comes from
 * memory once per token, and long contexts keep every thread busy. A piece keeps, per query
 * head, the largest score m, the sum l of e^(s - m) and o = sum of e^(s - m) v over its
 * positions; the pieces merge in chunk order:
 *     out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c,   M = max_c m_c. */
#ifndef PI_ATT_CHUNK
#define PI_ATT_CHUNK 256
#endif
#ifndef PI_ATT_UNITS
#define PI_ATT_UNITS 8
#endif

/* chunks per KV head for n positions */
static int64_t att_chunks(const pi_decoder* m, int64_t n) {
    int64_t c = (n + PI_ATT_CHUNK - 1) / PI_ATT_CHUNK;
    const int64_t want = (PI_ATT_UNITS + m->n_kv_heads - 1) / m->n_kv_heads;
    if (c < want) c = want < (n + 15) / 16 ? want : (n + 15) / 16; /* chunks of >= 16 positions */
    return c > 0 ? c : 1;
}

/* tokens per step: the dense and FFN kernels' group, whose weights they read once */
#define PI_STEP_MAX 8

int pi_decoder_step_max(void) { return PI_STEP_MAX; }

/* work: h, y [PI_STEP_MAX, d]; qkv [PI_STEP_MAX, qd + 2 kvd]; att [PI_STEP_MAX, qd]; scores
 * [n_heads, max_len] and parts [n_heads, chunks, head_dim + 2], one token's at a time */
int64_t pi_decoder_work_floats(const pi_decoder* m) {
    const int64_t qd = m->n_heads * m->head_dim, kvd = m->n_kv_heads * m->head_dim;
    return PI_STEP_MAX * (2 * m->d + 2 * qd + 2 * kvd) + m->n_heads * m->max_len
           + m->n_heads * att_chunks(m, m->max_len) * (m->head_dim + 2);
}

/* out [d] = x / sqrt(mean(x^2) + eps) * w, as HF's RMSNorm computes it in float32; with
 * layer_norm, (x - mean(x)) / sqrt(var(x) + eps) * w + b as torch's LayerNorm (b may be NULL).
 * out may be x. */
static void normalize(const float* x, int64_t d, int64_t layer_norm, float eps, const float* w,
                      const float* b, float* out) {
    double mean = 0.0;
    if (layer_norm) {
        for (int64_t i = 0; i < d; ++i) mean += x[i];
        mean /= (double)d;
    }
    double ss = 0.0;
    for (int64_t i = 0; i < d; ++i) ss += ((double)x[i] - mean) * ((double)x[i] - mean);
    const float r = 1.0f / sqrtf((float)(ss / (double)d) + eps), mu = (float)mean;
    for (int64_t i = 0; i < d; ++i) out[i] = (x[i] - mu) * r * w[i] + (b ? b[i] : 0.0f);
}

/* the model's norm of the residual stream x [d] */
static void norm(const pi_decoder* m, const float* x, const float* w, const float* b, float* out) {
    normalize(x, m->d, m->layer_norm, m->eps, w, b, out);
}

/* heads [n, hd] each RMS-normed in place by w [hd] (no-op for w NULL) */
static void head_norm(const pi_decoder* m, float* heads, int64_t n, const float* w) {
    if (!w) return;
    for (int64_t h = 0; h < n; ++h) {
        float* head = heads + h * m->head_dim;
        normalize(head, m->head_dim, 0, m->eps, w, NULL, head);
    }
}

/* out [T, out_features] = x [T, in_features] W^T (+ b) */
static void linear(const pi_linear* l, const float* x, int64_t T, int64_t in_features,
                   float* out) {
    ((pi_dense_fn)l->fn)(x, T, in_features, l->w, l->out_features, l->b, out);
}

/* heads [n, hd] rotated in place over their first rot dimensions: rotate_half form, cos / sin
 * [rot] rows of the position */
static void rope(float* heads, int64_t n, int64_t hd, int64_t rot, const float* cos,
                 const float* sin) {
    const int64_t half = rot / 2;
    for (int64_t h = 0; h < n; ++h) {
        float* v = heads + h * hd;
        for (int64_t i = 0; i < half; ++i) {
            const float a = v[i], b = v[i + half];
            v[i] = a * cos[i] - b * sin[i];
            v[i + half] = b * cos[i + half] + a * sin[i + half];
        }
    }
}

static float dot(const float* a, const float* b, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};  /* 8 lanes: vectorised without reassociation */
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
}

int pi_decoder_kv_16bit(void) { return PI_KV16; }

#if PI_KV16
/* 8 cached 16-bit values (float16, or bfloat16 where bf) as float32 */
static inline __m256 kv_load8(const uint16_t* p, int bf) {
    const __m128i h = _mm_loadu_si128((const __m128i*)p);
    return bf ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
              : _mm256_cvtph_ps(h);
}

/* a [n] . b [n] of 16-bit values; n a multiple of 8 (head_dim: checked by the caller) */
static float dot_kv16(const float* a, const uint16_t* b, int64_t n, int bf) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), kv_load8(b + i, bf), acc);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* x [n] float32 -> 16-bit values at out, rounded to nearest even */
static void store_kv16(uint16_t* out, const float* x, int64_t n, int bf) {
    for (int64_t i = 0; i < n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        if (bf) {  /* round to nearest even on the upper 16 bits (no NaN in a cache) */
            const __m256i u = _mm256_castps_si256(v);
            const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
            const __m256i r = _mm256_srli_epi32(
                _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
            const __m256i packed = _mm256_packus_epi32(r, r);  /* per 128-bit lane */
            const __m128i lo = _mm256_castsi256_si128(packed);
            const __m128i hi = _mm256_extracti128_si256(packed, 1);
            _mm_storeu_si128((__m128i*)(out + i), _mm_unpacklo_epi64(lo, hi));
        } else {
            _mm_storeu_si128((__m128i*)(out + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
        }
    }
}
#endif

#if PI_KV16
/* e^x for x <= 0 (scores less their maximum), 8 lanes: Cephes' expf (x - n ln 2 in two parts,
 * a degree-5 polynomial, times 2^n): within 1 ulp of e^x rounded for every float32 x whose e^x
 * is a normal float32 (checked exhaustively over [-88, 0]); 0 below, where it is not. */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.336544f); /* ln of float32's smallest normal */
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif

/* s [n] = e^(s - mx) in place; their sum */
static float exp_shifted(float* s, int64_t n, float mx) {
    int64_t t = 0;
    float sum = 0.0f;
#if PI_KV16
    __m256 acc = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(mx)));
        _mm256_storeu_ps(s + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int i = 0; i < 8; ++i) sum += lanes[i];
#endif
    for (; t < n; ++t) { s[t] = expf(s[t] - mx); sum += s[t]; }
    return sum;
}

float pi_decoder_softmax_exp(float* s, int64_t n, float mx) { return exp_shifted(s, n, mx); }

/* q [hd] . the cache row at `at` (float32, or 16-bit where kv_dtype) */
static float key_dot(const pi_decoder* m, const void* cache, int64_t at, const float* q) {
#if PI_KV16
    if (m->kv_dtype) return dot_kv16(q, (const uint16_t*)cache + at, m->head_dim, m->kv_dtype == 2);
#endif
    return dot(q, (const float*)cache + at, m->head_dim);
}

#if PI_KV16
/* 8 values of a cache row from i on, as float32 */
PI_INLINE __m256 cache8(const void* row, int64_t i, const int kv) {
    return kv ? kv_load8((const uint16_t*)row + i, kv == 2) : _mm256_loadu_ps((const float*)row + i);
}

/* q [hd] . the 8 cache rows at `at`, at + hd, ... (hd a multiple of 8): 8 dots at once, summed
 * across lanes together (a tree of hadd) instead of one horizontal sum each */
PI_INLINE __m256 key_dot8(const pi_decoder* m, const void* cache, int64_t at, const float* q,
                          const int kv) {
    const int64_t hd = m->head_dim;
    const size_t es = kv ? 2 : 4;
    const char* rows = (const char*)cache + (size_t)at * es;
    __m256 acc[8];
    for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < hd; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        for (int r = 0; r < 8; ++r)
            acc[r] = _mm256_fmadd_ps(qv, cache8(rows + (size_t)(r * hd) * es, i, kv), acc[r]);
    }
    const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    /* s0: rows 0..3 over the low lanes, then rows 0..3 over the high ones; s1 rows 4..7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}

/* s[t] = q . key row t for t = a, a + 8, ... while 8 rows remain, 8 at a time (cache kind kv,
 * a constant in each instance: 0 float32, 1 float16, 2 bfloat16); the first t not done */
PI_INLINE int64_t key_dots8(const pi_decoder* m, const void* cache, int64_t base, const float* q,
                            int64_t a, int64_t b, float* s, const int kv) {
    int64_t t = a;
    for (; t + 8 <= b; t += 8)
        _mm256_storeu_ps(s + t, key_dot8(m, cache, base + t * m->head_dim, q, kv));
    return t;
}

/* value_sum in SIMD (head_dim a multiple of 8): 64 outputs at a time in registers over all the
 * rows, then 8 at a time */
PI_INLINE void value_sum8(const pi_decoder* m, const void* cache, int64_t base, const float* w,
                          int64_t a, int64_t b, float* o, const int kv) {
    const int64_t hd = m->head_dim;
    const size_t es = kv ? 2 : 4;
    const char* rows = (const char*)cache + (size_t)base * es;
    int64_t i = 0;
    for (; i + 64 <= hd; i += 64) {
        __m256 acc[8];
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
        for (int64_t t = a; t < b; ++t) {
            const __m256 wt = _mm256_set1_ps(w[t]);
            const void* row = rows + (size_t)(t * hd) * es;
            for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(wt, cache8(row, i + 8 * j, kv), acc[j]);
        }
        for (int j = 0; j < 8; ++j) _mm256_storeu_ps(o + i + 8 * j, acc[j]);
    }
    for (; i < hd; i += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t t = a; t < b; ++t)
            acc = _mm256_fmadd_ps(_mm256_set1_ps(w[t]), cache8(rows + (size_t)(t * hd) * es, i, kv), acc);
        _mm256_storeu_ps(o + i, acc);
    }
}
#endif

/* The SIMD instance for the cache's kind, or -1: float32 rows whose head_dim is not a
 * multiple of 8 (a 16-bit cache's always is: runtime/decoder.py checks) */
static int simd_kind(const pi_decoder* m) {
    return PI_KV16 && (m->kv_dtype || m->head_dim % 8 == 0) ? (int)m->kv_dtype : -1;
}

/* s[t] = q . key row t (at base + t * hd) * scale for t in a..b-1 */
static void key_dots(const pi_decoder* m, const void* cache, int64_t base, const float* q,
                     int64_t a, int64_t b, float* s) {
    int64_t t = a;
#if PI_KV16
    switch (simd_kind(m)) {
    case 0: t = key_dots8(m, cache, base, q, a, b, s, 0); break;
    case 1: t = key_dots8(m, cache, base, q, a, b, s, 1); break;
    case 2: t = key_dots8(m, cache, base, q, a, b, s, 2); break;
    }
#endif
    for (; t < b; ++t) s[t] = key_dot(m, cache, base + t * m->head_dim, q);
    for (t = a; t < b; ++t) s[t] *= m->scale;
}

/* o [hd] = sum over t in a..b-1 of w[t] * the value rows t (at base + t * hd) */
static void value_sum(const pi_decoder* m, const void* cache, int64_t base, const float* w,
                      int64_t a, int64_t b, float* o) {
    const int64_t hd = m->head_dim;
#if PI_KV16
    switch (simd_kind(m)) {
    case 0: value_sum8(m, cache, base, w, a, b, o, 0); return;
    case 1: value_sum8(m, cache, base, w, a, b, o, 1); return;
    case 2: value_sum8(m, cache, base, w, a, b, o, 2); return;
    }
#endif
    memset(o, 0, (size_t)hd * sizeof(float));
    for (int64_t t = a; t < b; ++t) {
        const float* v = (const float*)cache + base + t * hd;
        for (int64_t i = 0; i < hd; ++i) o[i] += w[t] * v[i];
    }
}

/* One piece of work: KV head g's positions a..b-1 for its G query heads q [G, hd] (scores
 * [G][max_len] at those positions; part [G][hd + 2]: o, then m and l). Head after head, so
 * that a head's 64 outputs at a time stay in registers; the chunk's rows are read from memory
 * by the first head, from the cache by the others. */
static void attend_chunk(const pi_decoder* m, const pi_layer* L, int64_t g, int64_t a, int64_t b,
                         const float* q, float* scores, float* part) {
    const int64_t hd = m->head_dim, G = m->n_heads / m->n_kv_heads, base = g * m->max_len * hd;
    const float cap = m->attn_softcap;
    for (int64_t h = 0; h < G; ++h) {
        const float* qh = q + h * hd;
        float* s = scores + h * m->max_len;
        float mx = -INFINITY;
        key_dots(m, L->k_cache, base, qh, a, b, s);
        for (int64_t t = a; t < b; ++t) {
            if (cap > 0.0f) s[t] = cap * tanhf(s[t] / cap);
            mx = s[t] > mx ? s[t] : mx;
        }
        float* p = part + h * (hd + 2);
        p[hd] = mx;
        p[hd + 1] = exp_shifted(s + a, b - a, mx);
        value_sum(m, L->v_cache, base, s, a, b, p);
    }
}

/* out [n_heads, hd]: attention of q [n_heads, hd] over cache positions 0..pos (t0..pos in a
 * sliding-window layer); scores [n_heads, max_len] and parts [n_heads, chunks, hd + 2] scratch */
static void attention(const pi_decoder* m, const pi_layer* L, const float* q, int64_t pos,
                      float* scores, float* parts, float* out) {
    const int64_t H = m->n_heads, hd = m->head_dim, G = H / m->n_kv_heads;
    const int64_t t0 = L->window > 0 && pos >= L->window ? pos - L->window + 1 : 0;
    const int64_t n = pos + 1 - t0, C = att_chunks(m, n), units = m->n_kv_heads * C;
    const int64_t stride = G * (hd + 2); /* one piece's parts */
#ifdef _OPENMP
    const int nt = pi_threads > 0 ? pi_threads : omp_get_max_threads();
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (n * H * hd >= 32768)
#endif
    for (int64_t u = 0; u < units; ++u) {
        const int64_t g = u / C, c = u % C;
        attend_chunk(m, L, g, t0 + n * c / C, t0 + n * (c + 1) / C, q + g * G * hd,
                     scores + g * G * m->max_len, parts + u * stride);
    }
    for (int64_t h = 0; h < H; ++h) { /* merge the chunks of each query head */
        const int64_t g = h / G;
        const float* p0 = parts + g * C * stride + (h % G) * (hd + 2);
        float M = -INFINITY, l = 0.0f;
        for (int64_t c = 0; c < C; ++c) M = p0[c * stride + hd] > M ? p0[c * stride + hd] : M;
        float* o = out + h * hd;
        memset(o, 0, (size_t)hd * sizeof(float));
        for (int64_t c = 0; c < C; ++c) {
            const float* p = p0 + c * stride;
            const float w = expf(p[hd] - M);
            l += w * p[hd + 1];
            for (int64_t i = 0; i < hd; ++i) o[i] += w * p[i];
        }
        const float inv = 1.0f / l;
        for (int64_t i = 0; i < hd; ++i) o[i] *= inv;
    }
}

static void add(float* x, const float* y, int64_t d) {
    for (int64_t i = 0; i < d; ++i) x[i] += y[i];
}

/* x [d] += y * scale: a sublayer's output into the residual stream */
static void add_scaled(float* x, const float* y, float scale, int64_t d) {
    if (scale == 1.0f) add(x, y, d);
    else for (int64_t i = 0; i < d; ++i) x[i] += y[i] * scale;
}

int pi_decoder_step(const pi_decoder* m, int64_t pos, int64_t T, float* x, float* logits) {
    if (T < 1 || T > PI_STEP_MAX) return -3;
    if (pos < 0 || pos > m->max_len - T) return -1;
    const int64_t d = m->d, hd = m->head_dim, V = m->vocab;
    const int64_t qd = m->n_heads * hd, kvd = m->n_kv_heads * hd, qkvd = qd + 2 * kvd;
    float* h = m->work;                          /* [T, d] normed input of a sublayer */
    float* y = h + PI_STEP_MAX * d;              /* [T, d] a sublayer's output */
    float* qkv = y + PI_STEP_MAX * d;            /* [T, qkvd] q, k and v of the tokens */
    float* att = qkv + PI_STEP_MAX * qkvd;       /* [T, qd] */
    float* scores = att + PI_STEP_MAX * qd;      /* [n_heads, max_len] */
    float* parts = scores + m->n_heads * m->max_len; /* [n_heads, chunks, head_dim + 2] */
    for (int64_t t = 0; t < T; ++t) {
        float* xt = x + t * d;
        if (m->embed_scale != 1.0f)
            for (int64_t i = 0; i < d; ++i) xt[i] *= m->embed_scale;
        if (m->pos_embed) add(xt, m->pos_embed + (pos + t) * d, d);
    }
    for (int64_t l = 0; l < m->n_layers; ++l) {
        const pi_layer* L = m->layers + l;
        for (int64_t t = 0; t < T; ++t) norm(m, x + t * d, L->attn_norm, L->attn_norm_b, h + t * d);
        /* token t's q, k, v at q + t * qs, k + t * ks, v + t * ks: a fused projection writes
         * each token's [q; k; v] row, separate ones q [T, qd], then k and v [T, kvd] */
        float *q = qkv, *k, *v;
        int64_t qs, ks;
        if (L->qkv_fn || L->k.fn) {
            k = q + T * qd, v = k + T * kvd, qs = qd, ks = kvd;
            if (L->qkv_fn) {
                const void* W[3] = {L->q.w, L->k.w, L->v.w};
                const void* B[3] = {L->q.b, L->k.b, L->v.b};
                const int64_t O[3] = {L->q.out_features, L->k.out_features, L->v.out_features};
                float* out[3] = {q, k, v};
                ((pi_dense_multi_fn)L->qkv_fn)(h, T, d, 3, W, O, B, out);
            } else {
                linear(&L->q, h, T, d, q);
                linear(&L->k, h, T, d, k);
                linear(&L->v, h, T, d, v);
            }
        } else {
            k = q + qd, v = k + kvd, qs = ks = qkvd;
            linear(&L->q, h, T, d, q);  /* fused: q's linear is [q; k; v] */
            if (m->qkv_per_head)  /* [head][q, k, v][hd] -> [q, k, v][head][hd], att as scratch */
                for (int64_t t = 0; t < T; ++t) {
                    float* row = q + t * qkvd;
                    memcpy(att, row, (size_t)qkvd * sizeof(float));
                    for (int64_t g = 0; g < m->n_heads; ++g)
                        for (int64_t j = 0; j < 3; ++j)
                            memcpy(row + j * qd + g * hd, att + (g * 3 + j) * hd,
                                   (size_t)hd * sizeof(float));
                }
        }
        for (int64_t t = 0; t < T; ++t) {
            float *qt = q + t * qs, *kt = k + t * ks, *vt = v + t * ks;
            head_norm(m, qt, m->n_heads, L->q_norm);
            head_norm(m, kt, m->n_kv_heads, L->k_norm);
            if (L->rope_cos) {
                const int64_t r = m->rot_dim, at = (pos + t) * r;
                rope(qt, m->n_heads, hd, r, L->rope_cos + at, L->rope_sin + at);
                rope(kt, m->n_kv_heads, hd, r, L->rope_cos + at, L->rope_sin + at);
            }
            for (int64_t g = 0; g < m->n_kv_heads; ++g) {
                const int64_t at = (g * m->max_len + pos + t) * hd;  /* the position's row */
#if PI_KV16
                if (m->kv_dtype) {
                    store_kv16((uint16_t*)L->k_cache + at, kt + g * hd, hd, m->kv_dtype == 2);
                    store_kv16((uint16_t*)L->v_cache + at, vt + g * hd, hd, m->kv_dtype == 2);
                    continue;
                }
#endif
                memcpy((float*)L->k_cache + at, kt + g * hd, (size_t)hd * sizeof(float));
                memcpy((float*)L->v_cache + at, vt + g * hd, (size_t)hd * sizeof(float));
            }
        }
        for (int64_t t = 0; t < T; ++t)  /* every token's keys and values are in the cache */
            attention(m, L, q + t * qs, pos + t, scores, parts, att + t * qd);
        linear(&L->o, att, T, qd, y);
        for (int64_t t = 0; t < T; ++t) {
            if (L->post_attn_norm) norm(m, y + t * d, L->post_attn_norm, NULL, y + t * d);
            if (m->parallel) norm(m, x + t * d, L->ffn_norm, L->ffn_norm_b, h + t * d);
            add_scaled(x + t * d, y + t * d, m->residual_scale, d);
            if (!m->parallel) norm(m, x + t * d, L->ffn_norm, L->ffn_norm_b, h + t * d);
        }
        const pi_ffn* f = &L->ffn;
        const uint8_t* mask = NULL;  /* [T, n_ff] */
        if (f->predict) {
            if (((pi_predict_fn)f->predict)(h, T, d, f->rank, f->n_ff, f->p1, f->pb1, f->p2t,
                                            f->pb2, f->tau, m->mask) != 0)
                return -2;
            mask = m->mask;
        }
        int64_t n_active = 0;
        ((pi_ffn_fn)f->fn)(h, T, d, f->n_ff, f->w_gate, f->w_up, f->w_down_t, f->b_gate,
                           f->b_up, f->b_down, NULL, f->n_ff, mask, f->threshold, y, &n_active);
        if (n_active < 0) return -2;
        m->n_active[l] += n_active;
        for (int64_t t = 0; t < T; ++t) {
            if (L->post_ffn_norm) norm(m, y + t * d, L->post_ffn_norm, NULL, y + t * d);
            add_scaled(x + t * d, y + t * d, m->residual_scale, d);
        }
    }
    if (!logits) return 0;
    for (int64_t t = 0; t < T; ++t) norm(m, x + t * d, m->final_norm, m->final_norm_b, h + t * d);
    linear(&m->lm_head, h, T, d, logits);
    if (m->logit_divisor != 1.0f)
        for (int64_t i = 0; i < T * V; ++i) logits[i] /= m->logit_divisor;
    if (m->logit_softcap > 0.0f)
        for (int64_t i = 0; i < T * V; ++i)
            logits[i] = m->logit_softcap * tanhf(logits[i] / m->logit_softcap);
    return 0;
}
