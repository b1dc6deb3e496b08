/* picompile cold worker: one FFN call on a thread of its own, the CPU half of the hybrid runtime
 * (picompile/runtime/hybrid.py). Built by picompile/codegen/cold_worker.py with the flags of
 * the other C kernels.
 *
 * Why: per block and decode step, the CPU computes the cold neurons while the GPU computes the
 * hot ones. The thread that launches the GPU kernels is busy for a few hundred microseconds;
 * if it also ran the cold part, the two would run one after the other. Here the cold part runs
 * on a worker thread in C, so neither side needs Python's GIL while the other works:
 *
 *     caller                              worker
 *     queue device->pinned copies of x, the cold mask, then `ready` (0 -> 1)
 *     pi_cold_start(job)   ------------>  spin until *ready != 0 (the copies have landed)
 *     launch the GPU (hot) kernels        ffn(x, mask) over the cold rows -> out
 *     pi_cold_wait()       <------------  done: n_active
 *
 * The FFN itself is the block's own kernel (codegen/c.py's ffn() of its variant library), called
 * through a function pointer, so the worker has no math of its own.
 *
 * Exported:
 *     int pi_cold_start(const pi_cold_job* job);  0, or -1 while a job is still outstanding,
 *         -2 when the worker thread cannot be started. The job is copied; its buffers must stay
 *         alive until pi_cold_wait returns.
 *     int64_t pi_cold_wait(void);  blocks until the job is done. Its active (token, neuron) pairs,
 *         or -1 when the kernel ran out of memory, -3 when `ready` did not turn nonzero within
 *         PI_READY_TIMEOUT_S seconds (the device never copied), -4 with no job outstanding.
 *     void pi_cold_last_seconds(double* ready_s, double* run_s);  the last job's wait for `ready`
 *         and its kernel time (for the hybrid runtime's timeline)
 */
#include <pthread.h>
#include <stdint.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define pi_pause() _mm_pause()
#else
#define pi_pause() ((void)0)
#endif

#define PI_READY_TIMEOUT_S 60.0

typedef void (*pi_ffn_fn)(const float* x, int64_t T, int64_t d, int64_t n_ff, const void* w_gate,
                          const void* w_up, const void* w_down_t, const float* b_gate,
                          const float* b_up, const float* b_down, const int32_t* idx, int64_t m,
                          const uint8_t* mask, float threshold, float* out, int64_t* n_active);

typedef struct {
    void* fn;                   /* ffn of the cold rows' variant library */
    const void* w_gate;         /* [n_ff, d] or NULL (plain block) */
    const void* w_up;           /* [n_ff, d] */
    const void* w_down_t;       /* [n_ff, d] */
    const float* b_gate;        /* [n_ff] or NULL */
    const float* b_up;          /* [n_ff] or NULL */
    const float* b_down;        /* [d] or NULL */
    int64_t n_ff, d, T;
    float threshold;
    const float* x;             /* [T, d] float32 */
    const uint8_t* mask;        /* [T, n_ff] bool, or NULL: every neuron is a candidate */
    float* out;                 /* [T, d] float32 */
    const volatile int32_t* ready; /* nonzero once x and mask are in place; NULL: already are */
    int32_t threads;            /* OpenMP threads for the kernel (<= 0: the runtime's default) */
} pi_cold_job;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t changed = PTHREAD_COND_INITIALIZER;
static pthread_t worker;
static int started = 0;
static int pending = 0;  /* a job was handed over and not yet waited for */
static int done = 0;     /* the worker finished the pending job */
static pi_cold_job job;
static int64_t result;
static double last_ready_s, last_run_s;  /* written by the worker before `done`, under the lock */

static double seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Spin until *ready != 0: the copies land within microseconds, sleeping would cost more. */
static int wait_ready(const volatile int32_t* ready) {
    if (!ready)
        return 0;
    const double deadline = seconds() + PI_READY_TIMEOUT_S;
    for (uint64_t spins = 1;; ++spins) {
        if (__atomic_load_n((const int32_t*)ready, __ATOMIC_ACQUIRE) != 0)
            return 0;
        pi_pause();
        if ((spins & 0xFFFFF) == 0 && seconds() > deadline)
            return -1;
    }
}

static int64_t run(const pi_cold_job* j, double* ready_s, double* run_s) {
    const double t0 = seconds();
    if (wait_ready(j->ready) != 0)
        return -3;
    const double t1 = seconds();
#ifdef _OPENMP
    if (j->threads > 0)
        omp_set_num_threads(j->threads);  /* this thread's own team */
#endif
    int64_t n_active = 0;
    ((pi_ffn_fn)j->fn)(j->x, j->T, j->d, j->n_ff, j->w_gate, j->w_up, j->w_down_t, j->b_gate,
                       j->b_up, j->b_down, NULL, j->n_ff, j->mask, j->threshold, j->out, &n_active);
    *ready_s = t1 - t0;
    *run_s = seconds() - t1;
    return n_active < 0 ? -1 : n_active;
}

static void* loop(void* arg) {
    (void)arg;
    pthread_mutex_lock(&lock);
    for (;;) {
        while (!pending || done)
            pthread_cond_wait(&changed, &lock);
        pi_cold_job j = job;
        pthread_mutex_unlock(&lock);
        double ready_s = 0.0, run_s = 0.0;
        const int64_t r = run(&j, &ready_s, &run_s);
        pthread_mutex_lock(&lock);
        result = r;
        last_ready_s = ready_s;
        last_run_s = run_s;
        done = 1;
        pthread_cond_broadcast(&changed);
    }
    return NULL;
}

int pi_cold_start(const pi_cold_job* j) {
    pthread_mutex_lock(&lock);
    if (pending) {
        pthread_mutex_unlock(&lock);
        return -1;
    }
    if (!started) {
        if (pthread_create(&worker, NULL, loop, NULL) != 0) {
            pthread_mutex_unlock(&lock);
            return -2;
        }
        pthread_detach(worker);
        started = 1;
    }
    job = *j;
    pending = 1;
    done = 0;
    pthread_cond_broadcast(&changed);
    pthread_mutex_unlock(&lock);
    return 0;
}

int64_t pi_cold_wait(void) {
    pthread_mutex_lock(&lock);
    if (!pending) {
        pthread_mutex_unlock(&lock);
        return -4;
    }
    while (!done)
        pthread_cond_wait(&changed, &lock);
    pending = 0;
    const int64_t r = result;
    pthread_mutex_unlock(&lock);
    return r;
}

void pi_cold_last_seconds(double* ready_s, double* run_s) {
    pthread_mutex_lock(&lock);
    *ready_s = last_ready_s;
    *run_s = last_run_s;
    pthread_mutex_unlock(&lock);
}
