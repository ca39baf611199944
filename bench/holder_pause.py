"""The longest pause a training step sees: a loop that keeps a tensor per step in a
replay deque (a local of main(), cleared at the end), so that its line grows and
leaktrace looks for the holder while it grows. Prints the worst step's time beyond its
sleep; run it plain and under leaktrace:
    python3 bench/holder_pause.py 1200
    LD_PRELOAD=target/release/libleaktrace.so python3 bench/holder_pause.py 1200
"""
import collections
import sys
import time

import torch

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 400


def main():
    replay = collections.deque()
    worst = 0.0
    t_all = time.perf_counter()
    for step in range(STEPS):
        t0 = time.perf_counter()
        state = torch.randn(1024)
        replay.append((state, step))
        sum(float(s[0].sum()) for s in list(replay)[-8:])
        time.sleep(0.005)
        worst = max(worst, time.perf_counter() - t0 - 0.005)
    print(f"worst_step_extra_ms={worst * 1000:.1f} total_s={time.perf_counter() - t_all:.2f}", file=sys.stderr)
    replay.clear()


main()
