"""A PyTorch job on a real GPU for scripts/gpu_check.py: a conv + MLP trained with SGD on
synthetic CUDA tensors, then a planted device leak (the CUDA runtime PyTorch loaded,
called through ctypes: 5 x 1 MiB cudaMalloc, never freed).

Usage: gpu_torch.py STEPS [plant]. stdout holds only what is the same from run to run;
the time of the training steps goes to stderr as `train_s <seconds>`.

       gpu_torch.py hook SECONDS: the same model trained for SECONDS (100 steps a second
at most) with a forward hook that keeps a copy of every output of the first linear
layer on the GPU (64 KiB a step), as a user caching activations for later would: a
CUDA tensor leak that is freed when the function returns, so that only growth shows it.
The leaking line carries a `# LEAK` comment (gpu_check.py finds its number from it).

       gpu_torch.py clean SECONDS: the same loop with no hook: nothing grows."""
import ctypes
import sys
import time

import torch
from torch import nn

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 200
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


def setup():
    """The model on the GPU, its optimizer and one fixed batch."""
    assert torch.cuda.is_available(), "no GPU"
    torch.manual_seed(0)
    dev = torch.device("cuda")
    net = model().to(dev)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    xs = torch.randn(64, 3, 32, 32, device=dev)
    ys = torch.randint(0, 10, (64,), device=dev)
    return net, opt, xs, ys


def train_with_hook(seconds, leak=True):
    net, opt, xs, ys = setup()
    cache = []

    def keep(module, inputs, output):
        cache.append(output.detach().clone())  # LEAK

    if leak:
        net[7].register_forward_hook(keep)
    start = time.perf_counter()
    steps = 0
    while time.perf_counter() - start < seconds:
        opt.zero_grad()
        nn.functional.cross_entropy(net(xs), ys).backward()
        opt.step()
        steps += 1
        torch.cuda.synchronize()
        time.sleep(max(0.0, start + steps / 100 - time.perf_counter()))
    print(f"kept {len(cache) == (steps if leak else 0)} activations")


def main():
    if len(sys.argv) > 1 and sys.argv[1] in ("hook", "clean"):
        train_with_hook(float(sys.argv[2]), sys.argv[1] == "hook")
        return
    net, opt, xs, ys = setup()
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
