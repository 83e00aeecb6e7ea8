"""A plain torchrun DDP script; it differs from the torch version in the two lockstep imports only.

    torchrun --standalone --nproc-per-node 2 examples/torchrun_drop_in.py

To get the torch version, swap the two marked imports back. On CPU with 2 ranks both
versions end with the same parameters, bit for bit (the script prints their sha256).
"""

import hashlib

import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

from lockstep import DistributedDataParallel as DDP  # torch: from torch.nn.parallel import DistributedDataParallel as DDP
from lockstep import DistributedSampler  # torch: from torch.utils.data.distributed import DistributedSampler


def main():
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    digits = load_digits()  # 1,797 8x8 images, bundled with scikit-learn
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)

    model = DDP(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    for epoch in range(5):
        sampler.set_epoch(epoch)
        total, count = torch.zeros(()), 0
        for inputs, targets in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(inputs), targets)
            loss.backward()
            optimizer.step()
            total += loss.detach() * len(targets)
            count += len(targets)
        if rank == 0:
            print(f"epoch {epoch} loss {(total / count).item():.4f}", flush=True)

    if rank == 0:
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.module.parameters()))
        print(f"parameters sha256 {digest.hexdigest()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
