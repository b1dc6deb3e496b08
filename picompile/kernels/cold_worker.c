/* picompile cold worker: FFN calls on a thread of their own, the CPU half of the hybrid runtime
 * (picompile/runtime/hybrid.py). Built by picompile/codegen/cold_worker.py with the flags of
 * the other C kernels.
 *
 * Why: per block and decode step, the CPU computes the cold neurons while the GPU computes the
 * hot ones. The thread that launches the GPU kernels is busy for a few hundred microseconds;
 * if it also ran the cold part, the two would run one after the other. Here the cold part runs
 * on a worker thread in C, so neither side needs Python's GIL while the other works:
 *
 *     caller                              worker
 *     pi_cold_start(jobs, n, serial) ---> for each job in order:
 *     (device: per block, copies of x,      spin until *ready == serial (its copies landed)
 *      its cold mask, then the serial       ffn(x, mask) over the block's cold rows -> out
 *      into `ready`; the hot kernels; then  *done = serial (the device's wait sees it and
 *      it waits until *done == serial,       merges `out`)
 *      and reads `out`)
 *     pi_cold_wait(n_active)  <---------  all done: active pairs, per job and in all
 *
 * Both flags take the batch's serial, a number no earlier batch used, so a copy or a store
 * left over from an earlier batch (one that failed midway) never passes for this one's.
 *
 * A batch is every split block between two points where the host must step in (a decode step of
 * the device decoder, up to a decoder layer run on the host): the device waits for each block's
 * `done` itself (a kernel polling pinned memory, codegen/cuda.py's wait_value, or
 * pi_wait_value on the CPU stand-in), so the host neither wakes nor launches anything per
 * block. `done` may be NULL (the caller waits with pi_cold_wait before it merges).
 *
 * The FFN itself is the block's own kernel (codegen/c.py's ffn() of its variant library), called
 * through a function pointer, so the worker has no math of its own.
 *
 * Exported:
 *     int pi_cold_start(const pi_cold_job* jobs, int32_t n, int32_t serial);  0, or -1 while a
 *         batch is still outstanding, -2 when the worker thread cannot be started, -5 when n is
 *         not in 1..PI_MAX_JOBS. The jobs are copied; their buffers must stay alive until
 *         pi_cold_wait returns.
 *     int64_t pi_cold_wait(int64_t* n_active);  blocks until the batch is done. Its active
 *         (token, neuron) pairs in all (n_active, if not NULL: [n], per job), or the first
 *         error: -1 when a kernel ran out of memory, -3 when a `ready` did not take the serial
 *         within PI_READY_TIMEOUT_S seconds (the device never copied), -4 with no batch
 *         outstanding, -6 when the batch is not done within PI_BATCH_TIMEOUT_S (the worker
 *         hangs: it stays outstanding). After an error the later jobs are not run, but each
 *         `done` is still written, so a device waiting for it goes on.
 *     void pi_cold_last_seconds(int32_t k, double* ready_s, double* run_s);  job k of the last
 *         batch: its wait for `ready` and its kernel time (for the hybrid runtime's timelines)
 *     int32_t pi_wait_value(const int32_t* flag, int32_t value);  spins until *flag == value
 *         (0), or -3 after PI_READY_TIMEOUT_S seconds: the CPU stand-in of the device's wait.
 *     void pi_set_flag(int32_t* flag, int32_t value);  a release store: the CPU stand-in's
 *         `ready` (the stores before it are seen first), and a failed step's release.
 */
#include <errno.h>
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
#define PI_BATCH_TIMEOUT_S 300  /* past any batch's jobs each waiting PI_READY_TIMEOUT_S */
#define PI_MAX_JOBS 1024  /* blocks in one batch: the split blocks of a model's decode step */

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
    volatile int32_t* ready;    /* the serial once x and mask are in place; NULL: already are */
    int32_t threads;            /* OpenMP threads for the kernel (<= 0: the runtime's default) */
    volatile int32_t* done;     /* set to the batch's serial once out is written; or NULL */
} pi_cold_job;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t changed = PTHREAD_COND_INITIALIZER;
static pthread_t worker;
static int started = 0;
static int pending = 0;  /* a batch was handed over and not yet waited for */
static int done = 0;     /* the worker finished the pending batch */
static pi_cold_job jobs[PI_MAX_JOBS];
static int32_t n_jobs, batch_serial;
/* Written by the worker before `done`, read under the lock once it is set. */
static int64_t result, job_active[PI_MAX_JOBS];
static double ready_seconds[PI_MAX_JOBS], run_seconds[PI_MAX_JOBS];

static double seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Spin until *flag == value: the copies land within microseconds, sleeping would cost more. */
static int spin_until(const int32_t* flag, int32_t value) {
    const double deadline = seconds() + PI_READY_TIMEOUT_S;
    for (uint64_t spins = 1;; ++spins) {
        if (__atomic_load_n(flag, __ATOMIC_ACQUIRE) == value)
            return 0;
        pi_pause();
        if ((spins & 0xFFFFF) == 0 && seconds() > deadline)
            return -1;
    }
}

static int64_t run(const pi_cold_job* j, int32_t serial, double* ready_s, double* run_s) {
    const double t0 = seconds();
    if (j->ready && spin_until((const int32_t*)j->ready, serial) != 0)
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
        const int32_t n = n_jobs, serial = batch_serial;
        pthread_mutex_unlock(&lock);
        int64_t total = 0;
        for (int32_t k = 0; k < n; ++k) {
            int64_t r = 0;
            ready_seconds[k] = run_seconds[k] = 0.0;
            if (total >= 0)  /* after an error the rest only say they are done */
                r = run(&jobs[k], serial, &ready_seconds[k], &run_seconds[k]);
            job_active[k] = r < 0 ? 0 : r;
            total = total < 0 ? total : r < 0 ? r : total + r;
            if (jobs[k].done)  /* out is written: the device may read it */
                __atomic_store_n((int32_t*)jobs[k].done, serial, __ATOMIC_RELEASE);
        }
        pthread_mutex_lock(&lock);
        result = total;
        done = 1;
        pthread_cond_broadcast(&changed);
    }
    return NULL;
}

int pi_cold_start(const pi_cold_job* j, int32_t n, int32_t serial) {
    if (n < 1 || n > PI_MAX_JOBS)
        return -5;
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
    for (int32_t k = 0; k < n; ++k)
        jobs[k] = j[k];
    n_jobs = n;
    batch_serial = serial;
    pending = 1;
    done = 0;
    pthread_cond_broadcast(&changed);
    pthread_mutex_unlock(&lock);
    return 0;
}

int64_t pi_cold_wait(int64_t* n_active) {
    pthread_mutex_lock(&lock);
    if (!pending) {
        pthread_mutex_unlock(&lock);
        return -4;
    }
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);  /* the condition variable's clock */
    deadline.tv_sec += PI_BATCH_TIMEOUT_S;
    while (!done)
        if (pthread_cond_timedwait(&changed, &lock, &deadline) == ETIMEDOUT && !done) {
            pthread_mutex_unlock(&lock);
            return -6;
        }
    pending = 0;
    const int64_t r = result;
    if (n_active)
        for (int32_t k = 0; k < n_jobs; ++k)
            n_active[k] = job_active[k];
    pthread_mutex_unlock(&lock);
    return r;
}

void pi_cold_last_seconds(int32_t k, double* ready_s, double* run_s) {
    pthread_mutex_lock(&lock);
    const int ok = !pending && k >= 0 && k < n_jobs;
    *ready_s = ok ? ready_seconds[k] : 0.0;
    *run_s = ok ? run_seconds[k] : 0.0;
    pthread_mutex_unlock(&lock);
}

int32_t pi_wait_value(const int32_t* flag, int32_t value) {
    return spin_until(flag, value) == 0 ? 0 : -3;
}

void pi_set_flag(int32_t* flag, int32_t value) {
    __atomic_store_n(flag, value, __ATOMIC_RELEASE);
}
