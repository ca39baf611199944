"""Steady-state PyTorch training steps, timed inside the process (scripts/bench_steps.sh).

Two models, on one fixed batch, no DataLoader workers:
- `small` (default): the conv + MLP of tests/fixtures/frameworks/torch_train.py, SGD;
  rounds of 50 steps; ~1,200 allocations a step.
- `big`: 8 residual conv blocks with batch norm, dropout and GELU, a LayerNorm MLP head,
  Adam; rounds of 10 steps; ~38,000 allocations a step, most of its time in the
  allocator and the dispatcher rather than in arithmetic (the harder case for a tracer).

Prints the median time of ROUNDS rounds, after one round of warm-up, as
`steps50_ms <ms>` or `steps10_ms <ms>`.

    python3 bench/torch_steps.py [ROUNDS] [small|big]
"""
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "frameworks"))
import torch  # noqa: E402
from torch import nn  # noqa: E402

import torch_train  # noqa: E402

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 8
MODEL = sys.argv[2] if len(sys.argv) > 2 else "small"


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        y = torch.relu(self.b1(self.c1(x)))
        y = self.drop(self.b2(self.c2(y)))
        return nn.functional.gelu(x + y)


torch.manual_seed(0)
if MODEL == "big":
    net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), *[Block(8) for _ in range(8)], nn.AdaptiveAvgPool2d(4),
                        nn.Flatten(), nn.Linear(128, 64), nn.LayerNorm(64), nn.Tanh(), nn.Linear(64, 10))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    xs, ys = torch.randn(16, 1, 16, 16), torch.randint(0, 10, (16,))
    STEPS = 10
else:
    net = torch_train.model()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    ds = torch_train.data()
    xs = torch.stack([ds[i][0] for i in range(32)])
    ys = torch.stack([torch.as_tensor(ds[i][1]) for i in range(32)])
    STEPS = 50
times = []
for r in range(ROUNDS + 1):
    t = time.perf_counter()
    for _ in range(STEPS):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(xs), ys)
        loss.backward()
        opt.step()
    if r > 0:
        times.append(time.perf_counter() - t)
print(f"steps{STEPS}_ms {1000 * statistics.median(times):.1f}")
