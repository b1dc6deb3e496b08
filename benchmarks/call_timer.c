/* benchmarks' timer for the dense kernel: calls pi_dense back to back from C, as the whole-step
 * decoder does, so a call's time is the kernel's own (no ctypes marshalling, no Python between
 * calls). Built by benchmarks/dense_quant.py with picompile's compiler and flags. */
#include <stdint.h>
#include <time.h>

typedef void (*dense_fn)(const float* x, int64_t T, int64_t K, const void* W, int64_t O,
                         const void* b, float* out);

/* seconds[i] = wall time of call i of n, call i reading weight copy W[i % nw] [O, row bytes];
 * x [T, K] float32, out [T, O] float32. One untimed call first (threads up, pages touched). */
void pi_time_dense(dense_fn fn, int n, const float* x, int64_t T, int64_t K,
                   const void* const* W, int nw, int64_t O, float* out, double* seconds) {
    fn(x, T, K, W[nw - 1], O, (const void*)0, out);
    for (int i = 0; i < n; ++i) {
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        fn(x, T, K, W[i % nw], O, (const void*)0, out);
        clock_gettime(CLOCK_MONOTONIC, &b);
        seconds[i] = (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
    }
}
