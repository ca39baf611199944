"""A PyTorch job on a real GPU for scripts/gpu_check.py: a conv + MLP trained with SGD on
synthetic CUDA tensors, then a planted device leak (the CUDA runtime PyTorch loaded,
called through ctypes: 5 x 1 MiB cudaMalloc, never freed).

Usage: gpu_torch.py STEPS [plant]. stdout holds only what is the same from run to run;
the time of the training steps goes to stderr as `train_s <seconds>`."""
import ctypes
import sys
import time

import torch
from torch import nn

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 200
PLANT = len(sys.argv) > 2 and sys.argv[2] == "plant"


def model():
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10),
    )


def cudart():
    """The libcudart that this process already has loaded (PyTorch's own copy)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "/libcudart.so" in path:
                return ctypes.CDLL(path)
    raise SystemExit("no libcudart.so in this process")


def plant_device_leak(rt):
    rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    for _ in range(5):
        p = ctypes.c_void_p()
        rc = rt.cudaMalloc(ctypes.byref(p), 1 << 20)
        assert rc == 0, rc
        del p


def main():
    assert torch.cuda.is_available(), "no GPU"
    torch.manual_seed(0)
    dev = torch.device("cuda")
    net = model().to(dev)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    xs = torch.randn(64, 3, 32, 32, device=dev)
    ys = torch.randint(0, 10, (64,), device=dev)
    first = None
    t = time.perf_counter()
    for _ in range(STEPS):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(xs), ys)
        loss.backward()
        opt.step()
        if first is None:
            first = loss.item()
    last = loss.item()
    torch.cuda.synchronize()
    print(f"train_s {time.perf_counter() - t:.3f}", file=sys.stderr)
    print(f"trained {STEPS} steps on {torch.cuda.get_device_name(0).split()[1]}, loss fell: {last < first}")
    if PLANT:
        plant_device_leak(cudart())
        print("planted 5 x 1 MiB")


if __name__ == "__main__":
    main()
