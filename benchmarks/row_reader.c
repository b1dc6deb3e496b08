/* The sparse FFN kernel's reads without its arithmetic (benchmarks/ffn_rows.py's "rows"): the
 * rows one predicted-mode call reads, each read once and folded into an XOR, so the time is what
 * the memory system takes for that access pattern (scattered rows of a few KB) on these threads.
 * The kernel's GB/s over this one's says how much of the pattern's speed the arithmetic leaves.
 *
 *   void read_rows(const uint8_t* gate,   [n_ff, gate_bytes] (gate rows; up rows alike)
 *                  const uint8_t* up,     [n_ff, gate_bytes]
 *                  const uint8_t* down,   [n_ff, down_bytes] (down_t rows)
 *                  int64_t gate_bytes, int64_t down_bytes,   multiples of 64
 *                  const int32_t* cand, int64_t m,    candidate neurons, ascending
 *                  const uint8_t* fired,  [n_ff] 1 where the neuron's gate fires: its up and
 *                                         down rows are read too, as the kernel reads them
 *                  int pf_rows,           software prefetch (to L2), candidates ahead; 0: none
 *                  uint64_t* sink);       the XOR of everything read (keeps the loads)
 * Candidates are split into contiguous, equal runs over the OpenMP threads (static), as the
 * kernel's chunks are.
 */
#include <immintrin.h>
#include <stdint.h>

static inline __m256i fold(const uint8_t* p, int64_t n, __m256i acc) {
    for (int64_t i = 0; i < n; i += 64) {
        acc = _mm256_xor_si256(acc, _mm256_loadu_si256((const __m256i*)(p + i)));
        acc = _mm256_xor_si256(acc, _mm256_loadu_si256((const __m256i*)(p + i + 32)));
    }
    return acc;
}

static inline void prefetch(const uint8_t* p, int64_t n) {
    for (int64_t i = 0; i < n; i += 64) _mm_prefetch((const char*)(p + i), _MM_HINT_T1);
}

void read_rows(const uint8_t* gate, const uint8_t* up, const uint8_t* down, int64_t gate_bytes,
               int64_t down_bytes, const int32_t* cand, int64_t m, const uint8_t* fired,
               int pf_rows, uint64_t* sink) {
    uint64_t total = 0;
#pragma omp parallel for schedule(static) reduction(^ : total)
    for (int64_t c = 0; c < m; ++c) {
        if (pf_rows > 0 && c + pf_rows < m) {
            const int64_t a = cand[c + pf_rows];
            prefetch(gate + a * gate_bytes, gate_bytes);
            if (fired[a]) {
                prefetch(up + a * gate_bytes, gate_bytes);
                prefetch(down + a * down_bytes, down_bytes);
            }
        }
        const int64_t j = cand[c];
        __m256i acc = fold(gate + j * gate_bytes, gate_bytes, _mm256_setzero_si256());
        if (fired[j]) {
            acc = fold(up + j * gate_bytes, gate_bytes, acc);
            acc = fold(down + j * down_bytes, down_bytes, acc);
        }
        total ^= (uint64_t)_mm256_extract_epi64(acc, 0) ^ (uint64_t)_mm256_extract_epi64(acc, 1) ^
                 (uint64_t)_mm256_extract_epi64(acc, 2) ^ (uint64_t)_mm256_extract_epi64(acc, 3);
    }
    *sink = total;
}
