/* The CPU kernels' thread pool: rl_parallel_for(fn, job, num_rows, chunk_rows) runs
 * fn(job, n0, n1) over [0, num_rows) in chunks of chunk_rows on the pool's threads and the
 * caller. Rows are claimed from one atomic ticket word (generation << 32 | next chunk) by every
 * participant, so on an oversubscribed machine the caller never waits for a worker that has not
 * been scheduled: it takes the chunks itself and waits only for chunks already being computed.
 * Workers spin briefly after a job, then sleep on a condition variable. Which thread computes a
 * chunk never changes its result.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RL_PAUSE() _mm_pause()
#else
#define RL_PAUSE() ((void)0)
#endif

typedef void (*task_fn)(const void *, int64_t, int64_t); /* rows [n0, n1) of a job */

#define RL_MAX_THREADS 64
#define RL_SPIN 20000

static struct {
    pthread_t threads[RL_MAX_THREADS];
    int num_threads; /* including the caller */
    atomic_ullong ticket;
    atomic_long finished;
    atomic_int sleepers;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    const void *job;
    task_fn fn;
    int64_t num_rows, num_chunks, chunk_rows;
    unsigned long long generation;
} pool = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER, .num_threads = 1};

static void relax(long i) {
    RL_PAUSE();
    if ((i & 1023) == 1023) sched_yield();
}

/* Claim and compute chunks of generation ``gen`` until none is left. */
static void work(unsigned long long gen) {
    for (;;) {
        unsigned long long t = atomic_load(&pool.ticket);
        if ((t >> 32) != gen || (int64_t)(t & 0xffffffffu) >= pool.num_chunks) return;
        if (!atomic_compare_exchange_weak(&pool.ticket, &t, t + 1)) continue;
        int64_t n0 = (int64_t)(t & 0xffffffffu) * pool.chunk_rows;
        int64_t n1 = n0 + pool.chunk_rows < pool.num_rows ? n0 + pool.chunk_rows : pool.num_rows;
        pool.fn(pool.job, n0, n1);
        atomic_fetch_add(&pool.finished, 1);
    }
}

static void *worker(void *arg) {
    (void)arg;
    unsigned long long seen = 0;
    for (;;) {
        unsigned long long gen = atomic_load(&pool.ticket) >> 32;
        for (long spin = 0; gen == seen && spin < RL_SPIN; spin++) {
            relax(spin);
            gen = atomic_load(&pool.ticket) >> 32;
        }
        if (gen == seen) {
            pthread_mutex_lock(&pool.mu);
            atomic_fetch_add(&pool.sleepers, 1);
            while ((gen = atomic_load(&pool.ticket) >> 32) == seen)
                pthread_cond_wait(&pool.cv, &pool.mu);
            atomic_fetch_sub(&pool.sleepers, 1);
            pthread_mutex_unlock(&pool.mu);
        }
        seen = gen;
        work(gen);
    }
    return NULL;
}

int rl_set_threads(int n) {
    if (n < 1) n = 1;
    if (n > RL_MAX_THREADS) n = RL_MAX_THREADS;
    for (int t = pool.num_threads; t < n; t++) {
        if (pthread_create(&pool.threads[t], NULL, worker, NULL) != 0) break;
        pthread_detach(pool.threads[t]);
        pool.num_threads = t + 1;
    }
    return pool.num_threads; /* workers are never torn down */
}

static pthread_mutex_t run_mu = PTHREAD_MUTEX_INITIALIZER;

void rl_parallel_for(task_fn fn, const void *job, int64_t num_rows, int64_t chunk_rows) {
    if (pool.num_threads == 1 || num_rows <= chunk_rows) {
        fn(job, 0, num_rows);
        return;
    }
    pthread_mutex_lock(&run_mu); /* one job at a time (several Python threads may call) */
    /* Close the previous generation first: a late worker that read its ticket must not take the
     * fields written below for a chunk of it (its chunk index would pass the new num_chunks
     * check, and its finished count would end this job early). */
    atomic_store(&pool.ticket, (pool.generation << 32) | 0xffffffffull);
    pool.job = job;
    pool.fn = fn;
    pool.num_rows = num_rows;
    pool.chunk_rows = chunk_rows;
    pool.num_chunks = (num_rows + chunk_rows - 1) / chunk_rows;
    atomic_store(&pool.finished, 0);
    unsigned long long gen = ++pool.generation;
    atomic_store(&pool.ticket, gen << 32);
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_broadcast(&pool.cv);
        pthread_mutex_unlock(&pool.mu);
    }
    work(gen);
    for (long i = 0; atomic_load(&pool.finished) < pool.num_chunks; i++) relax(i);
    pthread_mutex_unlock(&run_mu);
}

int rl_num_threads(void) { return pool.num_threads; }

