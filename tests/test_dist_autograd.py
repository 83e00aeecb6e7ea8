"""lockstep's DDP under torch's distributed autograd (RPC) against torch's DDP doing the same, bit for bit.

``dist_autograd.backward`` puts gradients in the RPC context, not in ``.grad`` (``lockstep.ddp.dist_autograd``).
torch's own tests of it (``ddp_under_dist_autograd_test.py``) run in ``test_torch_ddp_suite.py``; here what they
leave out, on 2 ranks with different data: ``gradient_as_bucket_view`` True and False, several steps of SGD
read from the context's gradients, ``.grad`` left as it was by the distributed backward (None, then a local
backward's values), and a local ``loss.backward()`` inside a context block (the tensor hooks take it; the
node hooks must not mark a parameter twice).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dist_utils import run_ranks


def _train(impl: str, gradient_as_bucket_view: bool, rank: int) -> dict:
    import torch.distributed.autograd as dist_autograd

    import lockstep

    ddp_class = lockstep.DistributedDataParallel if impl == "lockstep" else nn.parallel.DistributedDataParallel
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ddp = ddp_class(model, gradient_as_bucket_view=gradient_as_bucket_view, bucket_cap_mb=0.0005)  # 2+ buckets
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data: averaging changes the result
    out: dict = {"context_grads": [], "grad_none_after_dist": []}
    for _ in range(3):
        x = torch.randn(5, 8, generator=gen)
        with dist_autograd.context() as context_id:
            loss = ddp(x).pow(2).sum()
            dist_autograd.backward(context_id, [loss])
            grads = dist_autograd.get_gradients(context_id)
            out["context_grads"].append([grads[p].clone() for p in model.parameters()])
            out["grad_none_after_dist"].append([p.grad is None for p in model.parameters()])
            with torch.no_grad():
                for p in model.parameters():
                    p.sub_(0.1 * grads[p])
    # A local backward inside a context block: .grad as usual, averaged once.
    x = torch.randn(5, 8, generator=gen)
    with dist_autograd.context():
        ddp(x).pow(2).sum().backward()
    out["local_in_context"] = [p.grad.clone() for p in model.parameters()]
    # Then a distributed backward leaves those .grad values as they were.
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [ddp(x).pow(2).sum()])
        out["context_after_local"] = [dist_autograd.get_gradients(context_id)[p].clone() for p in model.parameters()]
    out["local_kept"] = [torch.equal(p.grad, g) for p, g in zip(model.parameters(), out["local_in_context"])]
    out["params"] = [p.detach().clone() for p in model.parameters()]
    return out


def _cases(rank: int, world_size: int, rpc_init_file: str) -> dict:
    import torch.distributed.rpc as rpc

    options = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{rpc_init_file}", rpc_timeout=60)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    try:
        return {(impl, view): _train(impl, view, rank) for impl in ("torch", "lockstep") for view in (False, True)}
    finally:
        rpc.shutdown()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_cases, 2, args=(str(tmp_path_factory.mktemp("rpc") / "init"),), timeout_s=300)


def _equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("view", [False, True], ids=["copy", "bucket_view"])
def test_context_gradients_equal_torchs_ddp(results, view):
    for rank in range(2):
        mine, theirs = results[rank][("lockstep", view)], results[rank][("torch", view)]
        for step, (a, b) in enumerate(zip(mine["context_grads"], theirs["context_grads"])):
            assert _equal(a, b), f"rank {rank} step {step}: the context's gradients differ from torch's DDP"
        assert _equal(mine["params"], theirs["params"]), f"rank {rank}: parameters differ from torch's DDP"
        assert _equal(mine["local_in_context"], theirs["local_in_context"])
        assert _equal(mine["context_after_local"], theirs["context_after_local"])
    # Averaged: both ranks hold the same gradients although their data differ.
    assert _equal(results[0][("lockstep", view)]["context_grads"][0], results[1][("lockstep", view)]["context_grads"][0])


@pytest.mark.parametrize("view", [False, True], ids=["copy", "bucket_view"])
def test_distributed_backward_leaves_grad_alone(results, view):
    for rank in range(2):
        mine = results[rank][("lockstep", view)]
        assert all(all(step) for step in mine["grad_none_after_dist"]), mine["grad_none_after_dist"]
        assert all(mine["local_kept"]), mine["local_kept"]
