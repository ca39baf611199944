"""The cost of one leak check (`leaktrace.snapshot`, what `pytest --leaktrace` runs per
test): ten checks, each after `leaktrace.mark()`, timed; prints the median. With an
argument, `import torch` and a matmul first (the heap of a PyTorch test suite).

    LD_PRELOAD=target/release/libleaktrace.so python3 bench/check_cost.py [torch]
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
import leaktrace  # noqa: E402

if len(sys.argv) > 1:
    import torch
    x = torch.randn(256, 256) @ torch.randn(256, 256)
if not leaktrace.active():
    sys.exit("check_cost: run it under leaktrace (LD_PRELOAD=target/release/libleaktrace.so)")
ts = []
for i in range(10):
    leaktrace.mark()
    t = time.perf_counter()
    leaktrace.snapshot(f"c{i}")
    ts.append((time.perf_counter() - t) * 1000)
ts.sort()
print(f"check median {ts[5]:.1f} ms (min {ts[0]:.1f}, max {ts[-1]:.1f})")
