/* picompile: GGUF block decoding written once for the CUDA kernels and a host test harness.
 *
 * The CUDA sparse FFN kernels (ffn_cuda_q.cuh) dequantize q8_0 / q4_0 / q4_1 rows in registers
 * with these functions; tests/test_quant_decode_host.py compiles the very same text with gcc (as
 * C) and g++ (as C++) and checks it against picompile.quant.dequantize and
 * quant.round_activations bit for bit: the CPU evidence that the GPU decodes blocks right. So this file includes nothing and
 * uses only what both sides have: under nvcc / NVRTC the functions are __host__ __device__, under
 * a C compiler plain static inline (the host harness includes <math.h> first, for rintf).
 *
 * Blocks (picompile/quant.py; little-endian, GGUF's block_q8_0 / block_q4_0 / block_q4_1):
 *     q8_0  34 bytes  d f16, q int8[32]                w[i] = d * q[i]
 *     q4_0  18 bytes  d f16, qs[16]                    w[i] = d * (n[i] - 8)
 *     q4_1  20 bytes  d f16, m f16, qs[16]             w[i] = d * n[i] + m
 *     n[i] = qs[i] & 15 for i < 16, qs[i - 16] >> 4 above
 * Rows are their blocks one after another (GGUF's layout: FFN down rows), or, for the gate / up
 * rows the CPU kernels dot with x, the dot layout (quant.interleave_blocks, qblocks.h): each run
 * of 8 blocks holds their 8 scales, their 8 minimums (q4_1), then their weight bytes in pieces
 * of C bytes, [pieces][8][C] with [v][b][c] = block b's weight byte Cv + c (4 pieces of 4 qs
 * bytes for the 4-bit formats, 16 of 2 q bytes for q8_0); the last nb % 8 blocks stay as GGUF
 * has them. pqd_row_block
 * reads a block of either layout, so the GPU takes the CPU's rows as they are.
 *
 * A weight is exact whether or not a compiler fuses d * n + m: d is a float16 (11 significant
 * bits) and n, q at most 8 bits, so d * n is exact in float32 and only the add rounds.
 */
#ifndef PICOMPILE_QDECODE_H
#define PICOMPILE_QDECODE_H

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define PQD_FN static __host__ __device__ __forceinline__
#else
#define PQD_FN static inline
#endif

#define PQD_QK 32 /* weights per block */
#define PQD_SB 8  /* blocks per superblock of the dot layout */

/* Format codes (compile-time constants in the CUDA kernels: their branches fold). */
#define PQD_Q8_0 0
#define PQD_Q4_0 1
#define PQD_Q4_1 2
#define PQD_BLOCK_BYTES(fmt) ((fmt) == PQD_Q8_0 ? 34 : (fmt) == PQD_Q4_0 ? 18 : 20)

PQD_FN float pqd_bits_float(unsigned u) {
    union { unsigned u; float f; } v;
    v.u = u;
    return v.f;
}

/* float16 (raw bits) -> float32, exact: subnormals are mant * 2^-24 (exact in float32). */
PQD_FN float pqd_f16(unsigned short h) {
    const unsigned sign = (unsigned)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (e == 0) {
        const float m = (float)mant * 5.9604644775390625e-8f;
        return sign ? -m : m;
    }
    if (e == 0x1f) return pqd_bits_float(sign | 0x7f800000u | (mant << 13)); /* inf, nan */
    return pqd_bits_float(sign | ((e + 112u) << 23) | (mant << 13));
}

/* The little-endian float16 at p, widened. */
PQD_FN float pqd_f16_at(const unsigned char* p) {
    return pqd_f16((unsigned short)(p[0] | (p[1] << 8)));
}

/* 4-bit value i (0..31) of a block's qs [16]. */
PQD_FN int pqd_nibble(const unsigned char* qs, int i) {
    return i < 16 ? (qs[i] & 15) : (qs[i - 16] >> 4);
}

/* One weight from its block's decoded scale d (and minimum m) and its stored value. */
PQD_FN float pqd_w_q8_0(float d, int q) { return d * (float)q; }
PQD_FN float pqd_w_q4_0(float d, int n) { return d * (float)(n - 8); }
PQD_FN float pqd_w_q4_1(float d, float m, int n) { return d * (float)n + m; }

/* Where block j of a row of nb blocks of 4-bit `fmt` sits: its scale d (and minimum m) and its
 * 16 qs bytes gathered into qs [16]. dot: the row is in the dot layout (else GGUF's). */
PQD_FN void pqd_q4_parts(int fmt, const unsigned char* row, long long nb, long long j, int dot,
                         float* d, float* m, unsigned char* qs) {
    const long long bb = PQD_BLOCK_BYTES(fmt), nsb = dot ? nb / PQD_SB : 0;
    if (j < nsb * PQD_SB) { /* in a superblock */
        const unsigned char* sb = row + j / PQD_SB * PQD_SB * bb;
        const int b = (int)(j % PQD_SB), hb = fmt == PQD_Q4_1 ? 4 * PQD_SB : 2 * PQD_SB;
        *d = pqd_f16_at(sb + 2 * b);
        *m = fmt == PQD_Q4_1 ? pqd_f16_at(sb + 2 * PQD_SB + 2 * b) : 0.0f;
        for (int v = 0; v < 4; ++v)
            for (int c = 0; c < 4; ++c) qs[4 * v + c] = sb[hb + 32 * v + 4 * b + c];
    } else {
        const unsigned char* blk = row + j * bb;
        *d = pqd_f16_at(blk);
        *m = fmt == PQD_Q4_1 ? pqd_f16_at(blk + 2) : 0.0f;
        for (int i = 0; i < 16; ++i) qs[i] = blk[(fmt == PQD_Q4_1 ? 4 : 2) + i];
    }
}

/* Block j of a row (nb blocks of `fmt`; dot: the row in the dot layout) -> w [32] float32,
 * what quant.dequantize makes of it. */
PQD_FN void pqd_row_block(int fmt, const unsigned char* row, long long nb, long long j, int dot,
                          float* w) {
    if (fmt == PQD_Q8_0) {
        if (dot && j < nb / PQD_SB * PQD_SB) { /* in a superblock: q [16][8][2] after 8 scales */
            const unsigned char* sb = row + j / PQD_SB * PQD_SB * 34;
            const int b = (int)(j % PQD_SB);
            const float d = pqd_f16_at(sb + 2 * b);
            for (int i = 0; i < PQD_QK; ++i)
                w[i] = pqd_w_q8_0(d, (signed char)sb[2 * PQD_SB + 16 * (i / 2) + 2 * b + i % 2]);
            return;
        }
        const unsigned char* blk = row + j * 34;
        const float d = pqd_f16_at(blk);
        for (int i = 0; i < PQD_QK; ++i) w[i] = pqd_w_q8_0(d, (signed char)blk[2 + i]);
        return;
    }
    float d, m;
    unsigned char qs[16];
    pqd_q4_parts(fmt, row, nb, j, dot, &d, &m, qs);
    for (int i = 0; i < PQD_QK; ++i)
        w[i] = fmt == PQD_Q4_1 ? pqd_w_q4_1(d, m, pqd_nibble(qs, i)) : pqd_w_q4_0(d, pqd_nibble(qs, i));
}

/* Weights k0 .. k0 + n - 1 of a q8_0 row (GGUF's layout), all in one block (k0 % 32 + n <= 32)
 * -> w [n]: the down projection's columns. */
PQD_FN void pqd_q8_0_run(const unsigned char* row, long long k0, int n, float* w) {
    const unsigned char* blk = row + k0 / PQD_QK * 34;
    const float d = pqd_f16_at(blk);
    const int i0 = (int)(k0 % PQD_QK);
    for (int k = 0; k < n; ++k) w[k] = pqd_w_q8_0(d, (signed char)blk[2 + i0 + k]);
}

/* x [32] -> out [32]: x rounded per block as the quantized kernels read it, bit for bit
 * quant.round_activations: d = max|x| / levels (127: 8 bits, the 4-bit formats; 32767: 16 bits,
 * q8_0), out = round-half-even(x * (1 / d)) * d (all zero when max|x| == 0). */
PQD_FN void pqd_round_block(const float* x, float levels, float* out) {
    float amax = 0.0f;
    for (int i = 0; i < PQD_QK; ++i) {
        const float a = x[i] < 0.0f ? -x[i] : x[i];
        amax = a > amax ? a : amax;
    }
    const float d = amax / levels, inv = d != 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < PQD_QK; ++i) out[i] = rintf(x[i] * inv) * d;
}

#endif /* PICOMPILE_QDECODE_H */
