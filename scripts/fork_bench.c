// The cost of a fork in a traced process: a program that allocates a block, forks, and
// waits for the child, N times; the child leaves with _exit (MODE 0) or executes
// /bin/true (MODE 1), as a shell, `make` or a compiler driver does. Prints the mean
// time of one fork..wait. Built and run by scripts/bench_startup.sh.
//   fork_bench N MODE
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: fork_bench N MODE (0: the child _exits, 1: it executes /bin/true)\n");
        return 2;
    }
    int n = atoi(argv[1]), mode = atoi(argv[2]);
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (int i = 0; i < n; i++) {
        void *volatile p = malloc(100 + i);
        (void)p;
        pid_t c = fork();
        if (c == 0) {
            if (mode == 1)
                execl("/bin/true", "true", (char *)0);
            _exit(0);
        }
        int st;
        waitpid(c, &st, 0);
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("%.3f\n", ((b.tv_sec - a.tv_sec) * 1e3 + (b.tv_nsec - a.tv_nsec) / 1e6) / n);
    return 0;
}
