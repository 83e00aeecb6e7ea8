"""Accelerate 1.15 on 2 CPU ranks with torch's DDP or lockstep's (IMPL=torch|lockstep|lockstep,torch).

    IMPL=lockstep,torch OUT=/tmp/acc accelerate launch --multi_gpu --num_processes 2 accelerate_run.py
    (accelerate launch --cpu with 2 processes wants mpirun; --multi_gpu uses torchrun's launcher and works on
    CPU-only machines; or: torchrun --nproc_per_node 2 accelerate_run.py)

Covers: prepare, accumulate() with 2 micro-batches (no_sync under the hood), clip_grad_norm_,
no_sync + trigger_sync_in_backward (reaches model.reducer.prepare_for_backward([])),
save_state / load_state (resume reproduces the same end state), save_model (keys without
"module."), unwrap_model, Join([model]) with uneven inputs (accelerate.join_uneven_inputs is a no-op on CPU),
--dynamo_backend (accelerate then compiles the wrapped model; BUCKET_CAP_MB overrides the 0.002 MB buckets).
Rank 0 writes each run's final state to $OUT/<impl>.pt (checkpoints under $OUT/<impl>/); the test compares them bit for
bit. With IMPL=lockstep,torch both runs share the processes (and the process group): accelerate's shared state is
reset between them, and end_training() comes after the last, with lockstep's model alive.
"""

from __future__ import annotations

import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

torch.set_num_threads(1)
from common import OUT, RUNS, check_ddp_class, digits, make_model, out_path, save_result, switch_to  # noqa: E402

switch_to(RUNS[0])  # before accelerate is imported, as a script that calls use_as_torch_ddp() at its top

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import DistributedDataParallelKwargs, set_seed  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

STEPS_A, STEPS_B = 6, 6  # optimizer steps before / after the checkpoint
MICRO = 8  # per-rank micro-batch


def train_steps(acc, model, opt, batches, steps):
    loss_fn = torch.nn.CrossEntropyLoss()
    done = 0
    it = iter(batches)
    while done < steps:
        for _ in range(2):  # two micro-batches per optimizer step
            x, y = next(it)
            with acc.accumulate(model):
                loss = loss_fn(model(x), y)
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), 0.5)
                    opt.step()
                    opt.zero_grad()
        done += 1


def prepare(impl):
    switch_to(impl)
    # A second run in the same processes starts from a fresh Accelerator: the shared state is cleared, the process
    # group (PartialState) kept.
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    set_seed(0)
    # several buckets even for this small model; COMM_HOOK=fp16|bf16|power_sgd|batched_power_sgd picks accelerate's hook
    from accelerate.utils import DDPCommunicationHookType

    hook = os.environ.get("COMM_HOOK", "no")
    state = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2} if "power" in hook else {}
    ddp_kwargs = DistributedDataParallelKwargs(
        bucket_cap_mb=float(os.environ.get("BUCKET_CAP_MB", "0.002")), comm_hook=DDPCommunicationHookType(hook), comm_state_option=state
    )
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2, kwargs_handlers=[ddp_kwargs])
    assert acc.num_processes == 2, acc.state
    x, y = digits(1024)
    loader = DataLoader(TensorDataset(x, y), batch_size=MICRO, shuffle=False)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt, loader = acc.prepare(model, opt, loader)
    return acc, model, opt, list(loader)  # the per-rank shards, in order


def train_save_resume(acc, model, ddp, opt, batches, ckpt) -> dict:
    """Steps, a no_sync pair, save_state, more steps, load_state and the same steps again, save_model: the checks."""
    train_steps(acc, model, opt, batches, STEPS_A)

    # no_sync + trigger_sync_in_backward: two forwards, the second backward synchronises the sum.
    loss_fn = torch.nn.CrossEntropyLoss()
    (xa, ya), (xb, yb) = batches[2 * STEPS_A], batches[2 * STEPS_A + 1]
    with acc.no_sync(model):
        la = loss_fn(model(xa), ya)
        lb = loss_fn(model(xb), yb)
    acc.backward(la)
    with acc.trigger_sync_in_backward(model):
        acc.backward(lb)
    opt.step()
    opt.zero_grad()

    acc.save_state(os.path.join(ckpt, "state"))
    rest = batches[2 * STEPS_A + 2 :]
    train_steps(acc, model, opt, rest, STEPS_B)
    first_end = {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}

    acc.load_state(os.path.join(ckpt, "state"))
    train_steps(acc, model, opt, rest, STEPS_B)
    second_end = acc.unwrap_model(model).state_dict()
    resumed_equal = all(torch.equal(first_end[k], second_end[k]) for k in first_end)

    acc.save_model(model, os.path.join(ckpt, "model"))
    acc.wait_for_everyone()
    from safetensors.torch import load_file

    saved = load_file(os.path.join(ckpt, "model", "model.safetensors"))
    saved_keys_ok = sorted(saved) == sorted(k for k in second_end) and all(torch.equal(saved[k], second_end[k]) for k in saved)
    prefix_ok = all(k.startswith("module.") for k in ddp.state_dict())
    return {"resumed_equal": resumed_equal, "saved_keys_ok": saved_keys_ok, "prefix_ok": prefix_ok}


def join_uneven(acc, model, ddp, opt, batches) -> dict:
    """Uneven inputs (JOIN=1): rank 1 gets one batch fewer; Join shadows the missing collectives. Returns the state
    before it. accelerate's own join_uneven_inputs is a no-op on CPU (multi_device is GPU/XPU/... only), so torch's
    Join is used directly. Parameters and BatchNorm buffers stay bit-identical to torch's (buffers come from the
    highest rank still training, as torch's)."""
    if os.environ.get("JOIN", "0") != "1":
        return {}
    from torch.distributed.algorithms.join import Join

    loss_fn = torch.nn.CrossEntropyLoss()
    before_join = {f"before_join.{k}": v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    with Join([ddp]):
        n = 3 if acc.process_index == 0 else 2
        for i in range(n):
            xj, yj = batches[i]
            loss = loss_fn(model(xj), yj)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
    return before_join


def run(impl: str):
    acc, model, opt, batches = prepare(impl)
    ddp = getattr(model, "_orig_mod", model)  # --dynamo_backend: accelerate compiles the wrapped model
    cls = check_ddp_class(ddp)
    checks = train_save_resume(acc, model, ddp, opt, batches, os.path.join(OUT, impl))
    before_join = join_uneven(acc, model, ddp, opt, batches)
    # Every rank's state: rank 0's buffers are never overwritten by a broadcast, the other ranks' show when it ran.
    from accelerate.utils import gather_object

    mine = {f"rank{acc.process_index}.{k}": v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    mine.update({f"rank{acc.process_index}.{k}": v for k, v in before_join.items()})
    final = {}
    for part in gather_object([mine]):
        final.update(part)
    if acc.is_main_process:
        reducer = getattr(ddp, "reducer", None)
        # How lockstep's reducer runs the registered hook: "fused" (run by the reducer itself), "called", "none".
        hook_path = ("none" if getattr(reducer, "comm_hook", None) is None
                     else "fused" if getattr(reducer, "fused", None) is not None else "called")
        report = {"class": cls, **checks, "hook_path": hook_path}
        print("REPORT", impl, report, flush=True)
        save_result(out_path(impl), {**final, "__report__": report})
    acc.wait_for_everyone()
    return acc


def main() -> None:
    accs = {impl: run(impl) for impl in RUNS}  # each holds its prepared model
    if len(accs) > 1:
        # torch's DDP goes while the group lives, lockstep's stays to the end as in a run of its own: torch's DDP
        # freed after destroy_process_group frees the group, whose destructor joins gloo's workers holding the GIL
        # (a worker still letting go of a work waits for it for good: hangs seen in test_examples' combined run).
        accs.pop("torch").free_memory()
        gc.collect()
    next(iter(accs.values())).end_training()


if __name__ == "__main__":
    main()
