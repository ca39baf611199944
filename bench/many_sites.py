#!/usr/bin/env python3
"""Writes a C program that calls an allocating function from many call sites, for the
unwinder's cost where one node of its tree of paths has thousands of children
(docs/benchmarks.md, twenty-fourth round).

    python3 bench/many_sites.py [--scattered] [--threads=N] [FUNCTIONS [SITES]] > many_sites.c
    gcc -O1 -fomit-frame-pointer -pthread -o many_sites many_sites.c
    ./many_sites ROUNDS

FUNCTIONS functions (default 3,000) of SITES call sites each (default 100) to a
`noinline` function that mallocs and frees a block, all called from one loop in `main`
through a table, ROUNDS times over (default 3). Plain: a function's sites one after
another. --scattered: each function takes a site number and calls that site (a
switch), and `main` calls one site of each function in turn, so that consecutive
captures come from different functions. --threads=N: N threads run those rounds at
once (each with its own tree of paths in the unwinder).
"""
import sys

args = [a for a in sys.argv[1:] if not a.startswith("--")]
scattered = "--scattered" in sys.argv[1:]
threads = next((int(a.split("=", 1)[1]) for a in sys.argv[1:] if a.startswith("--threads=")), 0)
functions = int(args[0]) if args else 3000
sites = int(args[1]) if len(args) > 1 else 100

out = [
    "#include <pthread.h>",
    "#include <stdlib.h>",
    "__attribute__((noinline)) void leaf(int n) {",
    '    void *p = malloc(16 + n);',
    '    __asm__ volatile("" ::"r"(p) : "memory");',
    "    free(p);",
    "}",
]
for i in range(functions):
    if scattered:
        cases = " ".join(f"case {j}: leaf({j}); break;" for j in range(sites))
        out.append(f'__attribute__((noinline)) void f{i}(int j) {{ switch (j) {{ {cases} }} __asm__ volatile(""); }}')
    else:
        calls = " ".join(f"leaf({j});" for j in range(sites))
        out.append(f'__attribute__((noinline)) void f{i}(void) {{ {calls} __asm__ volatile(""); }}')
kind = "void (*)(int)" if scattered else "void (*)(void)"
out.append(f"typedef {kind.replace('(*)', '(*fn)')};")
out.append("static fn fns[] = {" + ", ".join(f"f{i}" for i in range(functions)) + "};")
out.append("static int rounds = 3;")
out.append("static void *run(void *arg) {")
out.append("    (void)arg;")
out.append("    for (int r = 0; r < rounds; r++)")
if scattered:
    out.append(f"        for (int j = 0; j < {sites}; j++)")
    out.append(f"            for (int i = 0; i < {functions}; i++) fns[i](j);")
else:
    out.append(f"        for (int i = 0; i < {functions}; i++) fns[i]();")
out.append("    return NULL;")
out.append("}")
out.append("int main(int argc, char **argv) {")
out.append("    if (argc > 1) rounds = atoi(argv[1]);")
if threads:
    out.append(f"    pthread_t t[{threads}];")
    out.append(f"    for (int i = 0; i < {threads}; i++) pthread_create(&t[i], NULL, run, NULL);")
    out.append(f"    for (int i = 0; i < {threads}; i++) pthread_join(t[i], NULL);")
else:
    out.append("    run(NULL);")
out.append("    return 0;")
out.append("}")
print("\n".join(out))
