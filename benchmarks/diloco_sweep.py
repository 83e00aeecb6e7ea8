"""DiLoCo's outer settings at equal inner steps, two nodes simulated in one process (quality only, no wire).

The same arithmetic as ``lockstep.DiLoCo`` at one rank a node (pseudo-gradient = synced copy - replica, averaged,
an outer SGD step on the synced copy, copied back; a warm-up that averages the parameters after each step) on
``benchmarks/diloco.py``'s tasks, batches and seeds, without processes or a link: each setting's eval loss every
``eval_every`` steps, against DDP (the two replicas' gradients averaged each step) and one node alone. What it
answers is which outer optimizer, H and warm-up keep DiLoCo's loss near DDP's in a run this short; the shaped-link
benchmark then times the chosen one. Each setting is a JSON object on the command line:

    python benchmarks/diloco_sweep.py gpt 300 '{"kind": "ddp"}' '{"kind": "diloco", "H": 10, "outer_lr": 1.0, "mom": 0}'
"""

from __future__ import annotations

import copy
import json
import sys
import time

import torch
from diloco import Task


def _copy_into(models: list[torch.nn.Module], anchor: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for a, *ps in zip(anchor, *[m.parameters() for m in models]):
            for p in ps:
                p.copy_(a)


def run(task: Task, kind: str, steps: int, H: int = 50, outer_lr: float = 0.7, mom: float = 0.9,
        nesterov: bool = True, warmup: int = 0, eval_every: int = 50) -> list[tuple[int, float]]:
    base = task.model()
    n = 1 if kind == "single" else 2
    models = [copy.deepcopy(base) for _ in range(n)]
    opts = [torch.optim.AdamW(m.parameters(), lr=task.lr, weight_decay=0.0) for m in models]
    gens = [torch.Generator().manual_seed(1000 + r) for r in range(n)]  # the benchmark's per-rank batches
    anchor = [p.detach().clone() for p in base.parameters()]
    outer = torch.optim.SGD(anchor, lr=outer_lr, momentum=mom, nesterov=nesterov and mom > 0)
    curve = []
    for step in range(1, steps + 1):
        for m, g in zip(models, gens):
            x, y = task.batch(g)
            task.loss(m, x, y).backward()
        if kind == "ddp":
            with torch.no_grad():
                for ps in zip(*[m.parameters() for m in models]):
                    mean = sum(p.grad for p in ps) / n
                    for p in ps:
                        p.grad.copy_(mean)
        for o in opts:
            o.step()
            o.zero_grad()
        if kind == "diloco" and (step <= warmup or (step - warmup) % H == 0):
            with torch.no_grad():
                for a, *ps in zip(anchor, *[m.parameters() for m in models]):
                    delta = sum(a - p for p in ps) / n
                    if step <= warmup:
                        a.sub_(delta)  # the warm-up: the replicas' mean
                    else:
                        a.grad = delta
            if step > warmup:
                outer.step()
                outer.zero_grad(set_to_none=True)
            _copy_into(models, anchor)
        if step % eval_every == 0:
            m = copy.deepcopy(models[0])
            if kind == "diloco":
                _copy_into([m], anchor)  # the synced copy, as the benchmark evaluates it
            curve.append((step, round(task.eval_loss(m), 4)))
    return curve


def main() -> None:
    torch.set_num_threads(1)
    task, steps = Task(sys.argv[1]), int(sys.argv[2])
    for spec in sys.argv[3:]:
        kwargs = json.loads(spec)
        t0 = time.perf_counter()
        print(json.dumps(kwargs), run(task, steps=steps, **kwargs), f"{time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
