/* Malloc-heavy benchmark for scripts/bench.sh.
 * TOTAL malloc/free pairs (default 2,000,000) split over THREADS threads; sizes
 * 16..4096 bytes; a window of 1000 live blocks per thread; every allocation happens
 * ~30 frames deep (a recursive descent of 28..30 frames, then one of four allocation
 * helpers). Built with -O2 -fomit-frame-pointer like distro code. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#define WINDOW 1000
#define BATCH 1000

static long total_pairs = 2000000;
static int threads = 1;

typedef struct { void *window[WINDOW]; unsigned seed; long done; } Ctx;

static inline unsigned next_rand(unsigned *s) {
    unsigned x = *s; x ^= x << 13; x ^= x >> 17; x ^= x << 5; return *s = x;
}

__attribute__((noinline)) void *alloc_a(size_t n) { void *p = malloc(n); __asm__ volatile("" ::: "memory"); return p; }
__attribute__((noinline)) void *alloc_b(size_t n) { void *p = malloc(n); __asm__ volatile("" ::: "memory"); return p; }
__attribute__((noinline)) void *alloc_c(size_t n) { void *p = malloc(n); __asm__ volatile("" ::: "memory"); return p; }
__attribute__((noinline)) void *alloc_d(size_t n) { void *p = malloc(n); __asm__ volatile("" ::: "memory"); return p; }

__attribute__((noinline)) void leaf_work(Ctx *c) {
    for (int i = 0; i < BATCH; i++) {
        unsigned r = next_rand(&c->seed);
        size_t size = 16 + r % 4081;
        int slot = (r >> 12) % WINDOW;
        free(c->window[slot]);
        void *p;
        switch (r & 3) {
        case 0: p = alloc_a(size); break;
        case 1: p = alloc_b(size); break;
        case 2: p = alloc_c(size); break;
        default: p = alloc_d(size); break;
        }
        ((volatile char *)p)[0] = 1;
        c->window[slot] = p;
    }
    c->done += BATCH;
}

__attribute__((noinline)) void descend(int depth, Ctx *c) {
    if (depth == 0) leaf_work(c);
    else descend(depth - 1, c);
    __asm__ volatile("" ::: "memory"); /* no tail call: a real frame per level */
}

static void *run(void *arg) {
    Ctx *c = calloc(1, sizeof *c);
    c->seed = 2463534242u + (unsigned)(long)arg;
    long mine = total_pairs / threads;
    for (int b = 0; c->done < mine; b++) descend(28 + b % 3, c);
    for (int i = 0; i < WINDOW; i++) free(c->window[i]);
    free(c);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc > 1) threads = atoi(argv[1]);
    if (argc > 2) total_pairs = atol(argv[2]);
    if (threads < 1) threads = 1;
    pthread_t th[64];
    for (long i = 0; i < threads && i < 64; i++) pthread_create(&th[i], NULL, run, (void *)i);
    for (int i = 0; i < threads && i < 64; i++) pthread_join(th[i], NULL);
    printf("%ld pairs on %d thread(s)\n", total_pairs, threads);
    return 0;
}
