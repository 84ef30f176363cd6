"""A PyTorch training loop for the plugin's GPU-machine tests.

Trains a small MLP on a fixed synthetic regression task and appends "step <n> loss <x>" to
OUT.<pid> every step; also holds a 2 GiB tensor whose checksum it reports on SIGUSR1, so a
restore can be checked for both continuing training and intact device memory.
"""

import os
import signal
import sys
import time

import torch

out = sys.argv[sys.argv.index("--out") + 1]
verify = False


def on_usr1(_sig, _frame):
    global verify
    verify = True


def line(text):
    with open(f"{out}.{os.getpid()}", "a") as f:
        f.write(text + "\n")


signal.signal(signal.SIGUSR1, on_usr1)
torch.manual_seed(0)
dev = torch.device("cuda")
big = torch.arange(512 * 1024 * 1024, device=dev, dtype=torch.int32)  # 2 GiB
expected = int(big.sum(dtype=torch.int64).item())
model = torch.nn.Sequential(
    torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1)
).to(dev)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x = torch.randn(4096, 256, device=dev)
y = x[:, :8].sum(dim=1, keepdim=True)
line(f"ready pid={os.getpid()}")
step = 0
while True:
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    step += 1
    line(f"step {step} loss {loss.item():.6f}")
    if verify:
        verify = False
        got = int(big.sum(dtype=torch.int64).item())
        line("verify ok" if got == expected else f"verify FAIL {got} != {expected}")
    time.sleep(0.02)
