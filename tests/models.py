"""Small models and data shared by the multi-rank tests: an MLP, a CNN and a transformer (>= 50 tensors)."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_in: int = 32, hidden: int = 64, d_out: int = 10):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, d_out))

    def forward(self, x):
        return self.net(x)


class CNN(nn.Module):
    def __init__(self, d_out: int = 10):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Conv2d(8, 16, 3), nn.ReLU())
        self.head = nn.Linear(16 * 6 * 6, d_out)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


class TinyTransformer(nn.Module):
    """Embedding + 4 encoder layers (12 tensors each) + head: 52 parameter tensors."""

    def __init__(self, vocab: int = 50, d_model: int = 32, n_layers: int = 4, d_out: int = 10):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, d_out)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


MODELS = {"mlp": MLP, "cnn": CNN, "transformer": TinyTransformer}


def make_batch(kind: str, n: int, generator: torch.Generator):
    """Inputs and integer class targets for ``kind``."""
    if kind == "mlp":
        x = torch.randn(n, 32, generator=generator)
    elif kind == "cnn":
        x = torch.randn(n, 1, 10, 10, generator=generator)
    else:
        x = torch.randint(0, 50, (n, 6), generator=generator)
    return x, torch.randint(0, 10, (n,), generator=generator)


def build(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[kind]()


class Branchy(nn.Module):
    """Head ``a``, ``b`` or ``both`` per call: the other head is unused (find_unused_parameters)."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.a = nn.Linear(16, 4)
        self.b = nn.Linear(16, 4)

    def forward(self, x, branch="a"):
        h = torch.relu(self.trunk(x))
        if branch == "both":
            return self.a(h) + self.b(h)
        return self.a(h) if branch == "a" else self.b(h)
