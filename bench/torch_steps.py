"""Steady-state PyTorch training steps, timed inside the process (scripts/bench_steps.sh):
the same conv + MLP as tests/fixtures/frameworks/torch_train.py on one fixed batch, no
DataLoader workers. Prints the median time of ROUNDS rounds of 50 steps, after one
round of warm-up, as `steps50_ms <ms>`."""
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "frameworks"))
import torch  # noqa: E402
from torch import nn  # noqa: E402

import torch_train  # noqa: E402

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 8
torch.manual_seed(0)
net = torch_train.model()
opt = torch.optim.SGD(net.parameters(), lr=0.05)
ds = torch_train.data()
xs = torch.stack([ds[i][0] for i in range(32)])
ys = torch.stack([torch.as_tensor(ds[i][1]) for i in range(32)])
times = []
for r in range(ROUNDS + 1):
    t = time.perf_counter()
    for _ in range(50):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(xs), ys)
        loss.backward()
        opt.step()
    if r > 0:
        times.append(time.perf_counter() - t)
print(f"steps50_ms {1000 * statistics.median(times):.1f}")
