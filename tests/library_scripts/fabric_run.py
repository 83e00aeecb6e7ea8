"""Lightning Fabric, 2 CPU ranks, IMPL=torch|lockstep|lockstep,torch: setup, no_backward_sync accumulation, clip,
save/load. COMPILE=1: the model is torch.compile'd (aot_eager) before setup; Fabric compiles the wrapped model again.
IMPL=lockstep,torch: one launch, lockstep's run then torch's, each set up afresh by the same Fabric. Each rank writes
each run's final state_dict to $OUT/<impl>.rank<r>.pt.

    IMPL=lockstep,torch OUT=/tmp/fab python tests/library_scripts/fabric_run.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch

torch.set_num_threads(1)
from common import OUT, RUNS, check_ddp_class, digits, make_model, out_path, save_result, switch_to

switch_to(RUNS[0])  # before Lightning is imported, as a script that calls use_as_torch_ddp() at its top
from lightning.fabric import Fabric


def run(fabric: Fabric, impl: str) -> None:
    switch_to(impl)
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
    path = os.path.join(OUT, f"{impl}.ckpt")
    fabric.save(path, {"model": model, "opt": opt})
    fabric.load(path, {"model": model, "opt": opt})
    save_result(out_path(impl, f".rank{fabric.global_rank}.pt"), {**model.state_dict(), "__report__": {"class": cls}})


if __name__ == "__main__":
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    os.makedirs(OUT, exist_ok=True)
    for impl in RUNS:
        run(fabric, impl)
