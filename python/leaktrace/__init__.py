"""leaktrace from Python: leak checks by region, in a process that runs under
`leaktrace run` (or with libleaktrace.so in LD_PRELOAD).

    import leaktrace
    leaktrace.mark()
    step()
    check = leaktrace.snapshot("step")   # None when the process is not traced
    if check and check["definite"]["bytes"]: ...

A check classifies, with the pointer scan, the blocks allocated since the last
`mark()` and still outstanding: definite and indirect leaks count, memory still
reachable (caches, globals, anything a Python object holds) does not. Every check is
kept in the process's report (`checks`) and shown by `leaktrace report`.

The pytest plugin (`pytest --leaktrace`) is built on these; see `leaktrace.pytest_plugin`.
"""
import ctypes
import json
import re

__all__ = ["active", "mark", "snapshot", "parse_size", "format_size"]

_lib = None
_looked = False


def _library():
    global _lib, _looked
    if _looked:
        return _lib
    _looked = True
    try:
        lib = ctypes.CDLL(None)
        lib.leaktrace_active.restype = ctypes.c_int
        lib.leaktrace_mark.restype = ctypes.c_int
        lib.leaktrace_snapshot.restype = ctypes.c_longlong
        lib.leaktrace_snapshot.argtypes = [ctypes.c_char_p]
        lib.leaktrace_snapshot_json.restype = ctypes.c_size_t
        lib.leaktrace_snapshot_json.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    _lib = lib
    return lib


def active():
    """Whether this process is traced by leaktrace (its library is loaded and recording)."""
    lib = _library()
    return bool(lib and lib.leaktrace_active())


def mark():
    """Starts a region: what is allocated from now on is what the next snapshot checks.
    Returns False when the process is not traced."""
    lib = _library()
    return bool(lib and lib.leaktrace_mark())


def snapshot(label):
    """Checks the region and keeps the result under `label`. Returns the check as a dict
    (`definite`, `indirect`, `reachable`, `suppressed`: {"bytes", "blocks"};
    `leak_groups`; `leaks`: the largest, each with `frames` as text lines), or None when
    the process is not traced or its pointer scan is off."""
    lib = _library()
    if not lib or not lib.leaktrace_active():
        return None
    if lib.leaktrace_snapshot(str(label).encode("utf-8", "replace")) < 0:
        return None
    size = lib.leaktrace_snapshot_json(None, 0)
    buf = ctypes.create_string_buffer(size + 1)
    lib.leaktrace_snapshot_json(buf, size + 1)
    return json.loads(buf.value.decode("utf-8", "replace"))


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


def parse_size(text):
    """Bytes in `text`: an integer, or a number and a unit ("512", "1 MB", "1.5MiB";
    KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (write e.g. 1024, '512 KiB' or '1 MB')")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n):
    """`n` bytes for people: "812 B", "4.0 KiB", "1.5 MiB"."""
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
