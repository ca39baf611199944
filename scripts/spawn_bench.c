// The start-up cost of a preloaded library, measured without a shell or `env` between:
//   spawn_bench N 'label:VAR=value VAR2=value' 'label:VAR=value ...' ... -- PROG [ARGS...]
// runs PROG N times with each environment (only the listed variables, PATH and HOME),
// stdout to /dev/null, the environments interleaved round by round, and prints per
// environment the wall time of posix_spawn .. wait4 (median, quartiles, mean) and the
// child's CPU time (user + system, from wait4's rusage). Built and run by
// scripts/bench_startup.sh.
#define _GNU_SOURCE
#include <fcntl.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}
static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: spawn_bench N 'label:VAR=v ...' ... -- PROG [ARGS...]\n");
        return 2;
    }
    int n = atoi(argv[1]), k = 0;
    char **specs = argv + 2;
    while (2 + k < argc && strcmp(specs[k], "--") != 0) k++;
    if (2 + k >= argc - 1 || k == 0) {
        fprintf(stderr, "spawn_bench: give at least one environment, then -- and the program\n");
        return 2;
    }
    char **av = specs + k + 1;
    char ***envs = calloc(k, sizeof(char **));
    char **labels = calloc(k, sizeof(char *));
    for (int c = 0; c < k; c++) {
        envs[c] = calloc(64, sizeof(char *));
        int m = 0;
        char *s = strdup(specs[c]), *colon = strchr(s, ':'), *eq = strchr(s, '=');
        labels[c] = specs[c];
        if (colon && (!eq || colon < eq)) {
            *colon = 0;
            labels[c] = s;
            s = colon + 1;
        }
        for (char *t = strtok(s, " "); t && m < 60; t = strtok(0, " ")) envs[c][m++] = t;
        envs[c][m++] = "PATH=/usr/local/bin:/usr/bin:/bin";
        envs[c][m++] = "HOME=/root";
    }
    double *w = calloc((size_t)n * k, sizeof(double)), *cpu = calloc((size_t)n * k, sizeof(double));
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    for (int i = 0; i < n; i++)
        for (int c = 0; c < k; c++) {
            pid_t p;
            double t0 = now();
            if (posix_spawnp(&p, av[0], &fa, 0, av, envs[c])) {
                perror("spawn");
                return 1;
            }
            int st;
            struct rusage ru;
            wait4(p, &st, 0, &ru);
            double t1 = now();
            w[c * n + i] = t1 - t0;
            cpu[c * n + i] = ru.ru_utime.tv_sec * 1e3 + ru.ru_utime.tv_usec / 1e3 + ru.ru_stime.tv_sec * 1e3 + ru.ru_stime.tv_usec / 1e3;
        }
    for (int c = 0; c < k; c++) {
        qsort(w + c * n, n, sizeof(double), cmp);
        double s = 0, cs = 0;
        for (int i = 0; i < n; i++) {
            s += w[c * n + i];
            cs += cpu[c * n + i];
        }
        printf("%-28.28s wall median %.3f p25 %.3f p75 %.3f mean %.3f ms  cpu mean %.3f ms\n", labels[c], w[c * n + n / 2], w[c * n + n / 4],
               w[c * n + 3 * n / 4], s / n, cs / n);
    }
    return 0;
}
