/* Scan-rate benchmark for scripts/bench_scan.sh: N blocks (default 1,048,576) of SIZE
 * bytes (default 1024: 1 GiB in all), chained in a list from a global so the scan must
 * follow every block; the rest of each block is filled with non-pointer data. */
#include <stdlib.h>
#include <string.h>

struct block { struct block *next; };
struct block *head;

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 1L << 20;
    long size = argc > 2 ? atol(argv[2]) : 1024;
    for (long i = 0; i < n; i++) {
        struct block *b = malloc(size);
        memset(b, 0x5a, size);
        b->next = head;
        head = b;
    }
    return 0;
}
