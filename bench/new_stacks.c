/* New-stack benchmark for scripts/bench.sh: 2^BITS (default 2^19) distinct call paths,
 * one malloc/free pair at the end of each, so that nearly every allocation has a stack
 * never seen before (as during `import torch`, which interns ~880k stacks): the cost is
 * in capturing and interning new stacks, not in the allocator. Each path is BITS levels
 * of two frames deep; built -O2 without frame pointers like distro code. */
#include <stdio.h>
#include <stdlib.h>

static volatile long sink;

__attribute__((noinline)) static void leaf(void) {
    void *p = malloc(16);
    sink += (long)p;
    free(p);
}

__attribute__((noinline)) static void left(unsigned path, int depth);
__attribute__((noinline)) static void right(unsigned path, int depth);

/* Takes the path's next bit: a call from `left` or from `right` per level. */
__attribute__((noinline)) static void descend(unsigned path, int depth) {
    if (depth == 0) {
        leaf();
        return;
    }
    if (path & 1)
        left(path >> 1, depth - 1);
    else
        right(path >> 1, depth - 1);
    sink++;
}

__attribute__((noinline)) static void left(unsigned path, int depth) { descend(path, depth); sink++; }
__attribute__((noinline)) static void right(unsigned path, int depth) { descend(path, depth); sink++; }

int main(int argc, char **argv) {
    int bits = argc > 1 ? atoi(argv[1]) : 19;
    if (bits < 1 || bits > 24) {
        fprintf(stderr, "usage: new_stacks [BITS 1..24]\n");
        return 2;
    }
    for (unsigned i = 0; i < (1u << bits); i++)
        descend(i, bits);
    printf("%u paths\n", 1u << bits);
    return 0;
}
