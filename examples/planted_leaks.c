/* The example program of the README: a small "training loop" with planted leaks. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct { float *weights; size_t n; } Layer;

void *volatile keep_forever;

__attribute__((noinline)) Layer *make_layer(size_t n) {
    Layer *l = malloc(sizeof *l);
    l->weights = calloc(n, sizeof(float));
    l->n = n;
    return l;
}

__attribute__((noinline)) void free_layer(Layer *l) {
    free(l->weights); /* planted leak: the Layer struct itself is never freed */
}

__attribute__((noinline)) char *format_metrics(int step, float loss) {
    char *s = malloc(64);
    snprintf(s, 64, "step=%d loss=%.3f", step, loss);
    return s;
}

__attribute__((noinline)) void train_step(int step) {
    Layer *l = make_layer(256);
    float loss = 1.0f / (float)(step + 1);
    char *metrics = format_metrics(step, loss);
    if (step % 10 == 0) keep_forever = metrics; /* planted leak: every 10th string kept */
    else free(metrics);
    free_layer(l);
}

int main(void) {
    for (int step = 0; step < 100; step++) train_step(step);
    puts("trained 100 steps");
    return 0;
}
