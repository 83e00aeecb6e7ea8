"""lockstep's diagnostics on a small transformer, with a fault to inject: what each report looks like.

    lockstep launch --nproc-per-node 2 examples/debugging.py                      # healthy, 12 steps
    lockstep launch --nproc-per-node 2 examples/debugging.py --nan-on-rank 1      # a NaN gradient at step 4
    lockstep launch --nproc-per-node 2 examples/debugging.py --skip-on-rank 1     # rank 1 skips optimizer step 4
    LOCKSTEP_TRACE=runs/trace lockstep launch --nproc-per-node 2 examples/debugging.py   # timeline of steps 5..10
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import lockstep


class Transformer(nn.Module):
    """Embedding + 4 encoder layers + head: 52 parameter tensors, ~2.2M parameters (benchmarks/ddp_step.py's)."""

    def __init__(self, vocab: int = 1000, d_model: int = 192, layers: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, 4, 4 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 10)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)).mean(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--nan-on-rank", type=int, help="this rank's loss becomes NaN at step 4")
    p.add_argument("--skip-on-rank", type=int, help="this rank skips its optimizer step at step 4")
    args = p.parse_args()
    env = lockstep.init()
    torch.manual_seed(0)
    model = lockstep.DistributedDataParallel(Transformer(), bucket_cap_mb=2, detect_nonfinite=True, check_replicas_every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(env.rank)
    try:
        for step in range(1, args.steps + 1):
            tokens, labels = torch.randint(0, 1000, (16, 32), generator=g), torch.randint(0, 10, (16,), generator=g)
            opt.zero_grad()
            loss = F.cross_entropy(model(tokens), labels)
            if step == 4 and env.rank == args.nan_on_rank:
                loss = loss * model.module.head.bias[0] / 0.0 * 0.0  # 0/0: NaN in the head's bias gradient
            loss.backward()
            if not (step == 4 and env.rank == args.skip_on_rank):
                opt.step()
        if lockstep.is_main():
            print(f"{args.steps} steps, loss {loss.item():.4f}")
    finally:
        lockstep.shutdown()


if __name__ == "__main__":
    main()
