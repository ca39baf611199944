/* leaktrace's C API: leak checks by region, for test runners.
 *
 * The functions live in libleaktrace.so, which `leaktrace run` (or LD_PRELOAD) puts in
 * front of the program. Declare them weak so that the program also runs without it:
 *
 *     if (leaktrace_mark) leaktrace_mark();
 *     run_one_test();
 *     if (leaktrace_snapshot) leaktrace_snapshot("suite.test");
 *
 * A check classifies, with the pointer scan, the blocks allocated since the last
 * leaktrace_mark() and still outstanding: definite and indirect leaks count, memory
 * still reachable (a cache, a global) does not. Each check is kept under its label in
 * the process's report (`checks`) and shown by `leaktrace report`.
 *
 * LeakSanitizer's interface (<sanitizer/lsan_interface.h>) is exported too:
 * __lsan_do_leak_check, __lsan_do_recoverable_leak_check, __lsan_ignore_object,
 * __lsan_disable, __lsan_enable, __lsan_register_root_region,
 * __lsan_unregister_root_region.
 */
#ifndef LEAKTRACE_H
#define LEAKTRACE_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when this process is tracked, 0 otherwise. */
int leaktrace_active(void) __attribute__((weak));

/* Starts a region: what the program allocates from now on is what the next
 * leaktrace_snapshot checks. Returns 1, or 0 when nothing is tracked. */
int leaktrace_mark(void) __attribute__((weak));

/* Checks the region and keeps the result under `label`. Returns the bytes leaked
 * (definite + indirect, after suppressions), or -1 when nothing is tracked or the
 * scan is off (LEAKTRACE_SCAN=0). */
long long leaktrace_snapshot(const char *label) __attribute__((weak));

/* The last check as JSON, NUL-terminated in buf (cut to len - 1 bytes): counts and
 * the largest leaks with their stacks as text. Returns the JSON's full length, 0 when
 * there was no check. */
size_t leaktrace_snapshot_json(char *buf, size_t len) __attribute__((weak));

#ifdef __cplusplus
}
#endif

#endif
