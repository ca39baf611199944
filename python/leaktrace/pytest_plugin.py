"""pytest plugin: which test leaks.

    leaktrace run -- pytest --leaktrace

Around each test function, the plugin starts a leak-check region, runs the test,
collects Python's garbage, and checks what the test allocated and left outstanding with
leaktrace's pointer scan. Only definite and indirect leaks count against a test: what a
test leaves in caches, globals or any live Python object is reachable and does not (the
noise that makes per-test leak checks flag every test). Stacks carry the test's Python
lines.

Memory a test keeps reachable is not a leak, but a test whose kept memory grows each
time it runs is (a global list, a cache that never evicts): with a growth limit, the
test runs --leaktrace-repeat times (5) and fails when what it keeps (leaked and still
reachable) after its last run exceeds what it kept after its first by more than the
limit — pytest-memray's `limit_memory`, measured across repetitions.

Options: --leaktrace, --leaktrace-limit SIZE (default 0: any leak fails),
--leaktrace-warmup N (run each test N times before the measured run, so that lazy
caches fill first), --leaktrace-growth-limit SIZE (off by default),
--leaktrace-repeat N (runs measured for growth, default 5), --leaktrace-full-stacks
(every frame in failures: by default pytest's and pluggy's frames are left out).
Per test: @pytest.mark.leaktrace(limit="1 MB", warmup=1, growth_limit="64 KiB",
repeat=5). The terminal summary lists the tests that failed a check (with -v, every
test that leaked or grew).
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
    group.addoption("--leaktrace-growth-limit", default=None, metavar="SIZE",
                    help="fail a test whose kept memory (leaked + still reachable) grows by more than SIZE "
                         "from its first to its last repeated run, e.g. '64 KiB' (default: off)")
    group.addoption("--leaktrace-repeat", type=int, default=5, metavar="N",
                    help="runs of each test measured for growth under a growth limit (default 5)")
    group.addoption("--leaktrace-full-stacks", action="store_true", default=False,
                    help="show every frame of a leak's stack in failures (default: without pytest's and pluggy's)")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "leaktrace(limit=SIZE, warmup=N, growth_limit=SIZE, repeat=N): this test's leak limit, warm-up "
        "runs, growth limit and repeated runs (pytest --leaktrace)")
    if not config.getoption("leaktrace"):
        return
    for option in ("leaktrace_limit", "leaktrace_growth_limit"):
        try:
            if config.getoption(option) is not None:
                leaktrace.parse_size(config.getoption(option))
        except ValueError as e:
            raise pytest.UsageError(f"--{option.replace('_', '-')}: {e}")
    if config.getoption("leaktrace_repeat") < 2:
        raise pytest.UsageError("--leaktrace-repeat: at least 2 runs are needed to see growth")
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
        growth = config.getoption("leaktrace_growth_limit")
        self.growth_limit = None if growth is None else leaktrace.parse_size(growth)
        self.repeat = config.getoption("leaktrace_repeat")
        self.full_stacks = config.getoption("leaktrace_full_stacks")
        self.verbose = config.getoption("verbose") > 0
        self.results = []

    def _settings(self, item):
        limit, warmup, growth_limit, repeat = self.limit, self.warmup, self.growth_limit, self.repeat
        marker = item.get_closest_marker("leaktrace")
        if marker is not None:
            if "limit" in marker.kwargs:
                limit = leaktrace.parse_size(marker.kwargs["limit"])
            if "warmup" in marker.kwargs:
                warmup = int(marker.kwargs["warmup"])
            if "growth_limit" in marker.kwargs:
                growth_limit = leaktrace.parse_size(marker.kwargs["growth_limit"])
            if "repeat" in marker.kwargs:
                repeat = max(2, int(marker.kwargs["repeat"]))
        return limit, warmup, growth_limit, repeat

    @pytest.hookimpl(hookwrapper=True)
    def pytest_pyfunc_call(self, pyfuncitem):
        limit, warmup, growth_limit, repeat = self._settings(pyfuncitem)
        func = pyfuncitem.obj
        sync = not inspect.iscoroutinefunction(func)
        args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
        if warmup and sync:
            for _ in range(warmup):
                func(**args)
        gc.collect()
        leaktrace.mark()
        outcome = yield
        if outcome.excinfo is not None:
            return
        gc.collect()
        check = leaktrace.snapshot(pyfuncitem.nodeid)
        if check is None:
            return
        kept = []
        if growth_limit is not None and sync:
            # What the region keeps after each run: leaked and still reachable alike.
            kept.append(_kept(check))
            for run in range(2, repeat + 1):
                func(**args)
                gc.collect()
                again = leaktrace.snapshot(f"{pyfuncitem.nodeid} (run {run})")
                if again is None:
                    break
                kept.append(_kept(again))
        pyfuncitem.stash[_KEY] = (check, limit, growth_limit, kept)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        if call.when != "call" or _KEY not in item.stash:
            return
        check, limit, growth_limit, kept = item.stash[_KEY]
        leaked = check["definite"]["bytes"] + check["indirect"]["bytes"]
        growth = kept[-1] - kept[0] if len(kept) > 1 else 0
        failures = []
        if leaked > limit:
            failures.append(_describe(item.nodeid, leaked, limit, check, self.full_stacks))
        if growth_limit is not None and growth > growth_limit:
            failures.append(_describe_growth(item.nodeid, kept, growth_limit))
        if leaked or growth > 0:
            self.results.append((item.nodeid, leaked, limit, check, growth, growth_limit, bool(failures)))
        if report.passed and failures:
            report.outcome = "failed"
            report.longrepr = _Failure("\n\n".join(failures))

    def pytest_terminal_summary(self, terminalreporter):
        shown = [r for r in self.results if r[-1] or self.verbose]
        if not shown:
            return
        terminalreporter.section("leaktrace")
        for nodeid, leaked, limit, check, growth, growth_limit, failed in shown:
            parts = []
            if leaked:
                parts.append(f"{leaktrace.format_size(leaked)} leaked (limit {leaktrace.format_size(limit)})")
            if growth > 0:
                bound = "no limit" if growth_limit is None else f"limit {leaktrace.format_size(growth_limit)}"
                parts.append(f"kept {leaktrace.format_size(growth)} more over its repeated runs ({bound})")
            terminalreporter.write_line(f"{'FAIL' if failed else 'ok  '} {nodeid}: {'; '.join(parts)}")


class _Crash:
    """What pytest's short summary and JUnit's message read: the first line alone."""

    def __init__(self, message):
        self.message = message
        self.path = ""
        self.lineno = 0


class _Failure:
    """A failure's text, shown once in full (FAILURES) and once as one line (the short
    summary), instead of the whole stack twice."""

    def __init__(self, text):
        self.text = text
        self.reprcrash = _Crash(text.splitlines()[0])

    def toterminal(self, tw):
        for line in self.text.splitlines():
            tw.line(line)

    def __str__(self):
        return self.text


def _kept(check):
    return sum(check[k]["bytes"] for k in ("definite", "indirect", "reachable"))


# Frames of the test runner itself, left out of failures unless --leaktrace-full-stacks.
_HARNESS = ("/_pytest/", "/pluggy/", "/pytest/", "leaktrace/pytest_plugin.py", "/runpy.py", "<frozen ")


def _user_frames(frames, full):
    if full:
        return frames
    return [f for f in frames if not any(h in f for h in _HARNESS)]


def _describe_growth(nodeid, kept, growth_limit):
    return (
        f"leaktrace: {nodeid} kept {leaktrace.format_size(kept[-1] - kept[0])} more after {len(kept)} runs than "
        f"after its first ({kept[0]} -> {kept[-1]} bytes leaked or still reachable), over its growth limit of "
        f"{leaktrace.format_size(growth_limit)}: each run keeps memory that the next one does not free "
        f"(a global list, a cache that never evicts).\n"
        f"raise the limit with @pytest.mark.leaktrace(growth_limit=\"...\") or --leaktrace-growth-limit")


def _describe(nodeid, leaked, limit, check, full=False):
    lines = [
        f"leaktrace: {nodeid} leaked {leaktrace.format_size(leaked)} ({leaked} bytes), over its limit of "
        f"{leaktrace.format_size(limit)}: {check['definite']['bytes']} bytes definite, "
        f"{check['indirect']['bytes']} bytes indirect, in {check['leak_groups']} group(s)",
    ]
    for leak in check["leaks"][:3]:
        size = leak["definite"]["bytes"] + leak["indirect"]["bytes"]
        lines.append(f"\n{size} bytes from {leak['api']} ({leak['kind']}):")
        frames = _user_frames(leak["frames"], full)
        lines.extend(f"    {f}" for f in frames[:12])
        if not full and len(frames) < len(leak["frames"]):
            lines.append(f"    ({len(leak['frames']) - len(frames)} frame(s) of pytest and pluggy left out; "
                         "--leaktrace-full-stacks shows them)")
    lines.append("\nraise the limit with @pytest.mark.leaktrace(limit=\"...\") or --leaktrace-limit; "
                 "suppress a known leak with LEAKTRACE_SUPPRESSIONS")
    return "\n".join(lines)
