"""One rank of the default caps' link verdict over a shaped link (tests/test_link_default.py): MASTER_ADDR, RANK,
WORLD_SIZE and GLOO_SOCKET_IFNAME from the test. For each kind named (argv), trains a default-caps model beside one
with bucket_cap_mb=25 and prints one JSON line: whether each went to trials, the default's layouts per step, its log
lines, the parameters' bits compared. Before each kind after the first it waits for the file GO_DIR/<kind> (argv
``--go-dir``): the test re-shapes the link while both ranks wait, so one process per rank serves every kind (an
interpreter and its process group started once)."""

import argparse
import json
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lockstep

# "small" (12 x 257 KB: 1 MB caps make several buckets of it, 25 MB one; two backwards, the trials' 5 caps x (1 + 3)
# steps, two with the choice) or "serial" (5 x 4 MiB, above the 16 MiB from which a slow wire's buckets go one at a
# time: three steps, the verdict only): width, depth, steps
KINDS = {"small": (256, 12, 24), "serial": (1024, 5, 3)}


def layers(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width),
                         *[nn.Sequential(nn.ReLU(), nn.Linear(width, width)) for _ in range(depth - 1)])


def run(kind: str) -> dict:
    """Both models trained side by side; what the test asserts on."""
    width, depth, steps = KINDS[kind]
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("lockstep.ddp.autotune")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    models = {"default": lockstep.DistributedDataParallel(layers(width, depth)),
              "fixed": lockstep.DistributedDataParallel(layers(width, depth), bucket_cap_mb=25)}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for k, m in models.items()}
    gen = torch.Generator().manual_seed(dist.get_rank())
    layouts = []
    for _ in range(steps):
        x, y = torch.randn(8, width, generator=gen), torch.randint(0, width, (8,), generator=gen)
        for name, model in models.items():
            opts[name].zero_grad()
            F.cross_entropy(model(x), y).backward()
            opts[name].step()
        layouts.append(models["default"].reducer.bucket_layout())
    logger.removeHandler(handler)
    reducers = {k: m.reducer for k, m in models.items()}
    same = all(torch.equal(a, b) for a, b in zip(models["default"].parameters(), models["fixed"].parameters()))
    return {"rank": dist.get_rank(), "kind": kind,
            "tuned": {k: r.tuner is not None and r.tuner.done for k, r in reducers.items()},
            "trials": {k: r.tuner is not None for k, r in reducers.items()},
            "serial": reducers["default"].serial_launch,
            "votes": {k: r.link.vote for k, r in reducers.items()},
            "tail": [reducers["default"].link.tail_bytes, reducers["default"].link.tail_s],
            "chosen": (reducers["default"].tuner.result or {}).get("chosen_mb", "none")
            if reducers["default"].tuner else "none",
            "layouts": layouts, "logs": [r.getMessage() for r in records], "same_bits": same}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("kinds", nargs="*", default=["small"], choices=sorted(KINDS))
    p.add_argument("--go-dir", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for n, kind in enumerate(args.kinds):
        while n and not os.path.exists(os.path.join(args.go_dir, kind)):
            time.sleep(0.05)  # the test shapes the link for this kind, then writes the file
        print(json.dumps(run(kind)), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
