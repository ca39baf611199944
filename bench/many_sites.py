#!/usr/bin/env python3
"""Writes a C program that calls an allocating function from many call sites, for the
unwinder's cost where one node of its tree of paths has thousands of children
(docs/benchmarks.md, twenty-fourth round).

    python3 bench/many_sites.py [--scattered] [FUNCTIONS [SITES]] > many_sites.c
    gcc -O1 -fomit-frame-pointer -o many_sites many_sites.c
    ./many_sites ROUNDS

FUNCTIONS functions (default 3,000) of SITES call sites each (default 100) to a
`noinline` function that mallocs and frees a block, all called from one loop in `main`
through a table, ROUNDS times over (default 3). Plain: a function's sites one after
another. --scattered: each function takes a site number and calls that site (a
switch), and `main` calls one site of each function in turn, so that consecutive
captures come from different functions.
"""
import sys

args = [a for a in sys.argv[1:] if not a.startswith("--")]
scattered = "--scattered" in sys.argv[1:]
functions = int(args[0]) if args else 3000
sites = int(args[1]) if len(args) > 1 else 100

out = [
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
out.append("int main(int argc, char **argv) {")
out.append("    int rounds = argc > 1 ? atoi(argv[1]) : 3;")
out.append("    for (int r = 0; r < rounds; r++)")
if scattered:
    out.append(f"        for (int j = 0; j < {sites}; j++)")
    out.append(f"            for (int i = 0; i < {functions}; i++) fns[i](j);")
else:
    out.append(f"        for (int i = 0; i < {functions}; i++) fns[i]();")
out.append("    return 0;")
out.append("}")
print("\n".join(out))
