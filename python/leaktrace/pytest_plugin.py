"""pytest plugin: which test leaks.

    leaktrace run -- pytest --leaktrace

Around each test function, the plugin starts a leak-check region, runs the test,
collects Python's garbage, and checks what the test allocated and left outstanding with
leaktrace's pointer scan. Only definite and indirect leaks count against a test: what a
test leaves in caches, globals or any live Python object is reachable and does not (the
noise that makes per-test leak checks flag every test). Stacks carry the test's Python
lines.

Options: --leaktrace, --leaktrace-limit SIZE (default 0: any leak fails),
--leaktrace-warmup N (run each test N times before the measured run, so that lazy
caches fill first). Per test: @pytest.mark.leaktrace(limit="1 MB", warmup=1).
"""
import gc
import inspect

import pytest

import leaktrace

_KEY = pytest.StashKey() if hasattr(pytest, "StashKey") else None


def pytest_addoption(parser):
    group = parser.getgroup("leaktrace", "leak check per test (leaktrace)")
    group.addoption("--leaktrace", action="store_true", default=False,
                    help="check each test for leaked native memory (run under `leaktrace run`)")
    group.addoption("--leaktrace-limit", default="0", metavar="SIZE",
                    help="bytes a test may leak (definite + indirect) before it fails, e.g. '1 MB' (default 0)")
    group.addoption("--leaktrace-warmup", type=int, default=0, metavar="N",
                    help="run each test N times before the measured run (default 0)")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "leaktrace(limit=SIZE, warmup=N): this test's leak limit and warm-up runs (pytest --leaktrace)")
    if not config.getoption("leaktrace"):
        return
    try:
        leaktrace.parse_size(config.getoption("leaktrace_limit"))
    except ValueError as e:
        raise pytest.UsageError(f"--leaktrace-limit: {e}")
    if not leaktrace.active():
        raise pytest.UsageError(
            "pytest --leaktrace needs the leaktrace library in this process: run "
            "`leaktrace run -- pytest --leaktrace ...` (or put libleaktrace.so in LD_PRELOAD)")
    config.pluginmanager.register(_Checker(config), "leaktrace-checker")


class _Checker:
    def __init__(self, config):
        self.config = config
        self.limit = leaktrace.parse_size(config.getoption("leaktrace_limit"))
        self.warmup = config.getoption("leaktrace_warmup")
        self.results = []

    def _settings(self, item):
        limit, warmup = self.limit, self.warmup
        marker = item.get_closest_marker("leaktrace")
        if marker is not None:
            if "limit" in marker.kwargs:
                limit = leaktrace.parse_size(marker.kwargs["limit"])
            if "warmup" in marker.kwargs:
                warmup = int(marker.kwargs["warmup"])
        return limit, warmup

    @pytest.hookimpl(hookwrapper=True)
    def pytest_pyfunc_call(self, pyfuncitem):
        limit, warmup = self._settings(pyfuncitem)
        func = pyfuncitem.obj
        if warmup and not inspect.iscoroutinefunction(func):
            args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
            for _ in range(warmup):
                func(**args)
        gc.collect()
        leaktrace.mark()
        outcome = yield
        if outcome.excinfo is not None:
            return
        gc.collect()
        check = leaktrace.snapshot(pyfuncitem.nodeid)
        if check is not None:
            pyfuncitem.stash[_KEY] = (check, limit)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        if call.when != "call" or _KEY not in item.stash:
            return
        check, limit = item.stash[_KEY]
        leaked = check["definite"]["bytes"] + check["indirect"]["bytes"]
        if leaked:
            self.results.append((item.nodeid, leaked, limit, check))
        if report.passed and leaked > limit:
            report.outcome = "failed"
            report.longrepr = _describe(item.nodeid, leaked, limit, check)

    def pytest_terminal_summary(self, terminalreporter):
        if not self.results:
            return
        terminalreporter.section("leaktrace")
        for nodeid, leaked, limit, check in self.results:
            verdict = "FAIL" if leaked > limit else "ok  "
            terminalreporter.write_line(
                f"{verdict} {nodeid}: {leaktrace.format_size(leaked)} leaked "
                f"({check['definite']['bytes']} B definite, {check['indirect']['bytes']} B indirect; "
                f"limit {leaktrace.format_size(limit)})")


def _describe(nodeid, leaked, limit, check):
    lines = [
        f"leaktrace: {nodeid} leaked {leaktrace.format_size(leaked)} ({leaked} bytes), over its limit of "
        f"{leaktrace.format_size(limit)}: {check['definite']['bytes']} bytes definite, "
        f"{check['indirect']['bytes']} bytes indirect, in {check['leak_groups']} group(s)",
    ]
    for leak in check["leaks"][:3]:
        size = leak["definite"]["bytes"] + leak["indirect"]["bytes"]
        lines.append(f"\n{size} bytes from {leak['api']} ({leak['kind']}):")
        lines.extend(f"    {f}" for f in leak["frames"][:12])
    lines.append("\nraise the limit with @pytest.mark.leaktrace(limit=\"...\") or --leaktrace-limit; "
                 "suppress a known leak with LEAKTRACE_SUPPRESSIONS")
    return "\n".join(lines)
