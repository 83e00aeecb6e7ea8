"""Lightning Fabric, 2 CPU ranks, IMPL=torch|lockstep: setup, no_backward_sync accumulation, clip, save/load.
COMPILE=1: the model is torch.compile'd (aot_eager) before setup; Fabric compiles the wrapped model again.

    IMPL=lockstep OUT=/tmp/fab_lockstep python checks/fabric_run.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch

torch.set_num_threads(1)
from common import IMPL, check_ddp_class, digits, make_model, maybe_use_lockstep, save_result

maybe_use_lockstep()
from lightning.fabric import Fabric

if __name__ == "__main__":
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    fabric.seed_everything(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if os.environ.get("COMPILE") == "1":
        model = torch.compile(model, backend="aot_eager")
    model, opt = fabric.setup(model, opt)
    wrapped = model._forward_module
    cls = check_ddp_class(getattr(wrapped, "_orig_mod", wrapped))  # compiled: torch.compile(DDP(module))
    x, y = digits(512)
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16))
    for i, (xb, yb) in enumerate(loader):
        if i == 16:
            break
        last = i % 2 == 1
        with fabric.no_backward_sync(model, enabled=not last):
            fabric.backward(torch.nn.functional.cross_entropy(model(xb), yb))
        if last:
            fabric.clip_gradients(model, opt, max_norm=0.5)
            opt.step()
            opt.zero_grad()
    path = os.path.join("/tmp", f"fabric_{IMPL}.ckpt")
    fabric.save(path, {"model": model, "opt": opt})
    fabric.load(path, {"model": model, "opt": opt})
    save_result(f"{os.environ.get('OUT', '/tmp/fab_' + IMPL)}.rank{fabric.global_rank}.pt",
                {**model.state_dict(), "__report__": {"class": cls}})
