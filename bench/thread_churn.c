/* 20,000 threads created and joined one after another, each allocating once: the cost
 * of a thread start under the library (its pthread_create hook notes the new thread's
 * stack bounds before the routine runs). */
#include <pthread.h>
#include <stdlib.h>
static void *run(void *a) { void *p = malloc(64); free(p); return a; }
int main(void) { for (int i = 0; i < 20000; i++) { pthread_t t; pthread_create(&t, 0, run, 0); pthread_join(t, 0); } return 0; }
