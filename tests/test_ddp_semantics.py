"""Full DDP semantics against torch's DDP: unused parameters, static graph, buffers, join, odd models, errors.

One group of 2 ranks runs every case; the hang cases run under the group's timeout and
must come back as errors with the expected text on every rank.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dist_utils import run_ranks
from models import Branchy


class Repeated(nn.Module):
    """One layer applied twice; optionally through activation checkpointing; optionally an unused layer."""

    def __init__(self, ckpt=None, with_unused=False):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.layer = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)
        self.unused = nn.Linear(4, 4) if with_unused else None
        self.ckpt = ckpt

    def forward(self, x):
        h = torch.relu(self.inp(x))
        for _ in range(2):
            if self.ckpt is None:
                h = torch.tanh(self.layer(h))
            else:
                h = checkpoint(lambda t: torch.tanh(self.layer(t)), h, use_reentrant=self.ckpt == "reentrant")
        return self.out(h)


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        image = x.reshape(-1, 1, 8, 1).expand(-1, 1, 8, 8).contiguous()  # (N, 8) rows -> 8x8 images
        return self.head(torch.relu(self.bn(self.conv(image))).flatten(1))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mid(self.embed(tokens)))).mean(1)


class MixedDtype(nn.Module):
    def __init__(self):
        super().__init__()
        self.f32 = nn.Linear(8, 8)
        self.bf16 = nn.Linear(8, 4).to(torch.bfloat16)

    def forward(self, x):
        return self.bf16(torch.relu(self.f32(x)).to(torch.bfloat16)).float()


class DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        return {"logits": self.a(x), "aux": (self.b(x), x.shape[0])}


def _loss(out, y):
    if isinstance(out, dict):
        return F.cross_entropy(out["logits"], y) + out["aux"][0].pow(2).mean()
    return F.cross_entropy(out, y)


def _side_by_side(rank, make, steps=8, ours_kw=None, torch_kw=None, inputs=None, micro=1, n_in=8, n_out=4,
                  dtype_in=torch.float32, momentum=0.9):
    """Train lockstep's and torch's DDP on the same data; return the max param diff and grad-None mismatches."""
    import lockstep

    torch.manual_seed(100 + rank)  # different inits: the start-up broadcast matters
    seed = torch.initial_seed()
    models = []
    for cls, kw in ((lockstep.DistributedDataParallel, ours_kw or {}), (nn.parallel.DistributedDataParallel, ours_kw or {} if torch_kw is None else torch_kw)):
        torch.manual_seed(seed)
        models.append(cls(make(), **kw))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=momentum) for m in models]
    none_mismatch = 0
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randint(0, 20, (4 * micro, 5), generator=gen) if dtype_in == torch.long else torch.randn(4 * micro, n_in, generator=gen)
        y = torch.randint(0, n_out, (4 * micro,), generator=gen)
        for model, opt in zip(models, opts):
            opt.zero_grad()
            for m, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
                ctx = model.no_sync() if m < micro - 1 else contextlib.nullcontext()
                with ctx:
                    kwargs = inputs(step, rank, m) if inputs else {}
                    (_loss(model(xm, **kwargs), ym) / micro).backward()
        none_mismatch += sum((p.grad is None) != (q.grad is None) for p, q in zip(models[0].parameters(), models[1].parameters()))
        for opt in opts:
            opt.step()
    diff = max((p - q).abs().max().item() for p, q in zip(models[0].state_dict().values(), models[1].state_dict().values())
               if p.is_floating_point())
    flat = torch.cat([p.detach().float().reshape(-1) for p in models[0].parameters()])
    return {"diff": diff, "none_mismatch": none_mismatch, "flat": flat}


def _nosync_reference(steps=8, micro=4):
    """Single process: each rank's accumulated window gradient (zero where unused), averaged over 2 ranks."""
    torch.manual_seed(100)
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        per_rank = []
        for r in range(2):
            gen = torch.Generator().manual_seed(1000 * step + r)
            x, y = torch.randn(4 * micro, 8, generator=gen), torch.randint(0, 4, (4 * micro,), generator=gen)
            model.zero_grad()
            for m, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
                branch = "b" if (r == 0 and m == 0) else "a"
                (F.cross_entropy(model(xm, branch=branch), ym) / micro).backward()
            per_rank.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = per_rank[0][i] / 2 + per_rank[1][i] / 2
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _capture(fn):
    try:
        fn()
        return None
    except Exception as e:  # noqa: BLE001 - the type and text are the result
        return (type(e).__name__, str(e))


def _unused_error_cases(rank):
    import lockstep

    out = {}

    def run(branch_of_rank):
        torch.manual_seed(0)
        model = lockstep.DistributedDataParallel(Branchy())
        x = torch.randn(4, 8)
        model(x, branch=branch_of_rank[rank]).sum().backward()

    def run_hooked(branch_of_rank):
        torch.manual_seed(0)
        model = lockstep.DistributedDataParallel(Branchy())
        model.register_comm_hook(None, lockstep.comm_hooks.fp16_compress_hook)
        model(torch.randn(4, 8), branch=branch_of_rank[rank]).sum().backward()

    out["each_misses_one"] = _capture(lambda: run({0: "a", 1: "b"}))
    out["one_rank_misses"] = _capture(lambda: run({0: "both", 1: "a"}))
    out["all_miss_same"] = _capture(lambda: run({0: "a", 1: "a"}))

    def deferred():
        # The CUDA path (the flag read one backward late, no host sync) forced on CPU: the backward that misses
        # a gradient passes, the next one raises on every rank, naming that backward's parameters.
        torch.manual_seed(0)
        model = lockstep.DistributedDataParallel(Branchy())
        model.reducer.usage.flag.deferred = True
        x = torch.randn(4, 8)
        model(x, branch="both").sum().backward()  # nothing missing: nothing raised later either
        model(x, branch={0: "a", 1: "both"}[rank]).sum().backward()
        out["deferred_first"] = "passed"
        model(x, branch="both").sum().backward()

    out["deferred"] = _capture(deferred)

    def deferred_hooked():  # the same with a comm hook: its flag travels in an all-reduce of its own
        torch.manual_seed(0)
        model = lockstep.DistributedDataParallel(Branchy())
        model.register_comm_hook(None, lockstep.comm_hooks.fp16_compress_hook)
        model.reducer.usage.flag.deferred = True
        x = torch.randn(4, 8)
        model(x, branch={0: "a", 1: "both"}[rank]).sum().backward()
        out["deferred_hooked_first"] = "passed"
        model(x, branch="both").sum().backward()

    out["deferred_hooked"] = _capture(deferred_hooked)
    out["hooked_at_once"] = _capture(lambda: run_hooked({0: "a", 1: "both"}))

    def double_fire():
        torch.manual_seed(0)
        model = lockstep.DistributedDataParallel(Repeated(ckpt="reentrant"))
        model(torch.randn(4, 8)).sum().backward()

    out["double_fire"] = _capture(double_fire)
    # The group still works after every error: no rank is stuck inside a collective.
    t = torch.ones(1)
    dist.all_reduce(t)
    out["alive"] = t.item()
    return out


def _join_case(rank, divide, throw=False, first_batches=10, bn_no_sync=False):
    import contextlib

    import lockstep

    results = {}
    for name, cls in (("ours", lockstep.DistributedDataParallel), ("torch", nn.parallel.DistributedDataParallel)):
        torch.manual_seed(7)
        middle = nn.BatchNorm1d(16) if bn_no_sync else nn.ReLU()
        model = cls(nn.Sequential(nn.Linear(8, 16), middle, nn.Linear(16, 4)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(rank)
        batches = [(torch.randn(4, 8, generator=gen), torch.randint(0, 4, (4,), generator=gen)) for _ in range(first_batches + 3 * rank)]
        error = None
        try:
            with model.join(divide_by_initial_world_size=divide, throw_on_early_termination=throw):
                for i, (x, y) in enumerate(batches):
                    # bn_no_sync: every other micro-batch under no_sync (the joined rank must skip the shadow
                    # backward then) and BatchNorm buffers broadcast from the highest rank still training
                    quiet = model.no_sync() if bn_no_sync and i % 2 == 0 else contextlib.nullcontext()
                    with quiet:
                        F.cross_entropy(model(x), y).backward()
                    if not (bn_no_sync and i % 2 == 0):
                        opt.step()
                        opt.zero_grad()
        except RuntimeError as e:
            error = str(e)
        results[name] = ([t.detach().clone() for t in model.state_dict().values()], error)
    if throw:
        return results["ours"][1], results["torch"][1]
    diff = max((p.double() - q.double()).abs().max().item() for p, q in zip(results["ours"][0], results["torch"][0]))
    return diff, torch.cat([p.reshape(-1).double() for p in results["ours"][0]])


def _constructor_cases(rank):
    import lockstep

    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lockstep.DistributedDataParallel(nn.Linear(2, 2), broadcast_buffers=False)
    out["future_warning"] = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        both = lockstep.DistributedDataParallel(nn.Linear(2, 2), broadcast_buffers=True, forward_sync_buffers=False)
    # As torch 2.13: forward_sync_buffers wins, with a FutureWarning that says so.
    out["both"] = (both.forward_sync_buffers, both.broadcast_buffers, [str(w.message) for w in caught])
    for name, kw in {
        "mixed_precision": {"mixed_precision": object()},
        "skip_unused": {"skip_all_reduce_unused_params": True},
        "delay": {"delay_all_reduce_named_params": [("w", nn.Parameter(torch.ones(1)))]},
        "mesh_and_group": {"device_mesh": object(), "process_group": dist.group.WORLD},
        "cap_list": {"bucket_cap_mb_list": [1, 0]},
    }.items():
        out[name] = _capture(lambda kw=kw: lockstep.DistributedDataParallel(nn.Linear(2, 2), **kw))
    model = lockstep.DistributedDataParallel(nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]), bucket_cap_mb_list=[0.001, 0.02])
    out["cap_list_layout"] = model.reducer.bucket_layout()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    out["mesh_group_size"] = dist.get_world_size(lockstep.DistributedDataParallel(nn.Linear(2, 2), device_mesh=mesh).process_group)
    return out


def _inplace_output(rank):
    """Outputs are the module's own tensors: in-place ops on them work, under every mode."""
    import lockstep

    diffs = {}
    for name, kw in {"default": {}, "static": {"static_graph": True}, "unused": {"find_unused_parameters": True}}.items():
        grads = []
        for cls in (lockstep.DistributedDataParallel, nn.parallel.DistributedDataParallel):
            torch.manual_seed(3)
            model = cls(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)), **kw)
            out = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(rank)))
            out.mul_(2).relu_()
            out.sum().backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        diffs[name] = (grads[0] - grads[1]).abs().max().item()
    return diffs


def _forward_without_backward(rank):
    """find_unused_parameters: a grad-enabled forward with no backward (different branches per rank) changes nothing."""
    import lockstep

    torch.manual_seed(5)
    ours = lockstep.DistributedDataParallel(Branchy(), find_unused_parameters=True)
    torch.manual_seed(5)
    theirs = nn.parallel.DistributedDataParallel(Branchy(), find_unused_parameters=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    for step in range(4):
        gen = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(4, 8, generator=gen), torch.randint(0, 4, (4,), generator=gen)
        ours(x, branch="a" if rank == 0 else "b")  # a validation-style forward: outputs dropped, no backward
        for model, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            F.cross_entropy(model(x, branch="both"), y).backward()
            opt.step()
    return max((p - q).abs().max().item() for p, q in zip(ours.parameters(), theirs.parameters()))


def _aborted_backward(rank):
    """An exception half-way through backward: the next forward finishes that reduction and raises, no hang."""
    import lockstep

    torch.manual_seed(0)
    model = lockstep.DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)), bucket_cap_mb=1e-6)
    def boom(grad):
        raise ValueError("user hook failed")

    out = model(torch.randn(4, 8))
    model.module[2].weight.register_hook(boom)  # fires after the last layer's bias is reduced
    first = _capture(lambda: out.sum().backward())
    second = _capture(lambda: model(torch.randn(4, 8)))
    t = torch.ones(1)
    dist.all_reduce(t)
    return first, second, t.item()


def _all_cases(rank, world_size):
    def branch_each_step(step, r, m):
        return {"branch": ["a", "b", "both"][(step + r) % 3]}

    def branch_nosync(step, r, m):
        # Parameter b is used only in the first (no_sync) micro-batch on rank 0, never on rank 1.
        return {"branch": "b" if (r == 0 and m == 0) else "a"}

    cases = {
        "find_unused": _side_by_side(rank, Branchy, ours_kw={"find_unused_parameters": True}, inputs=branch_each_step),
        "find_unused_view": _side_by_side(rank, Branchy, ours_kw={"find_unused_parameters": True, "gradient_as_bucket_view": True},
                                          torch_kw={"find_unused_parameters": True}, inputs=branch_each_step),
        "find_unused_nosync": _side_by_side(rank, Branchy, ours_kw={"find_unused_parameters": True}, inputs=branch_nosync, micro=4),
        "static_repeated": _side_by_side(rank, Repeated, ours_kw={"static_graph": True}),
        "static_ckpt_reentrant": _side_by_side(rank, lambda: Repeated("reentrant"), ours_kw={"static_graph": True}),
        "static_ckpt_nonreentrant": _side_by_side(rank, lambda: Repeated("nonreentrant"), ours_kw={"static_graph": True}),
        "static_unused": _side_by_side(rank, lambda: Repeated(with_unused=True), ours_kw={"static_graph": True}),
        "bn_broadcast": _side_by_side(rank, BNNet, ours_kw={"forward_sync_buffers": True}, torch_kw={}, n_out=3),
        "bn_local": _side_by_side(rank, BNNet, ours_kw={"forward_sync_buffers": False}, torch_kw={"broadcast_buffers": False}, n_out=3),
        "tied": _side_by_side(rank, Tied, dtype_in=torch.long, n_out=20),
        "mixed_dtype": _side_by_side(rank, MixedDtype),
        "dict_out": _side_by_side(rank, DictOut),
        "nosync_reference": _nosync_reference(),
        "inplace": _inplace_output(rank),
        "forward_only": _forward_without_backward(rank),
        "aborted": _aborted_backward(rank),
        "errors": _unused_error_cases(rank),
        "join_initial": _join_case(rank, True),
        "join_active": _join_case(rank, False),
        "join_throw": _join_case(rank, True, throw=True),
        # rank 0 has no batch at all: it joins before its first backward, while rank 1 rebuilds its buckets
        "join_at_once": _join_case(rank, True, first_batches=0),
        "join_bn_no_sync": _join_case(rank, True, bn_no_sync=True),
        "constructor": _constructor_cases(rank),
    }
    return cases


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all_cases, 2, timeout_s=400, pg_timeout_s=60)


PARITY = ["find_unused", "find_unused_view", "find_unused_nosync", "static_repeated", "static_ckpt_reentrant",
          "static_ckpt_nonreentrant", "static_unused", "bn_broadcast", "bn_local", "tied", "mixed_dtype", "dict_out"]


@pytest.mark.parametrize("case", PARITY)
def test_parity_with_torch(results, case):
    for rank in range(2):
        assert results[rank][case]["diff"] == 0.0, (rank, results[rank][case]["diff"])
        assert results[rank][case]["none_mismatch"] == 0


@pytest.mark.parametrize("case", [c for c in PARITY if c != "bn_local"])
def test_replicas_identical(results, case):
    assert torch.equal(results[0][case]["flat"], results[1][case]["flat"])


def test_find_unused_under_no_sync_synchronises_window_usage(results):
    # 'b' is used only in rank 0's first no_sync micro-batch: it must still be averaged (PyTorch #69031).
    assert torch.equal(results[0]["find_unused_nosync"]["flat"], results[0]["nosync_reference"])


def test_aborted_backward_raises_at_next_forward_without_hang(results):
    for rank in range(2):
        first, second, alive = results[rank]["aborted"]
        assert first[0] == "ValueError" and "user hook failed" in first[1]
        assert second[0] == "RuntimeError" and "received no gradient" in second[1] and "'0.weight'" in second[1]
        assert alive == 2.0


def test_forward_without_backward_launches_nothing(results):
    assert [results[rank]["forward_only"] for rank in range(2)] == [0.0, 0.0]


def test_in_place_ops_on_outputs(results):
    for rank in range(2):
        assert results[rank]["inplace"] == {"default": 0.0, "static": 0.0, "unused": 0.0}


def test_bn_local_buffers_differ_but_params_agree(results):
    # Parameters are averaged either way; only buffers stay local with forward_sync_buffers=False.
    assert torch.equal(results[0]["bn_local"]["flat"], results[1]["bn_local"]["flat"])


def test_unused_parameter_errors_name_parameter_and_rank(results):
    for rank in range(2):
        errors = results[rank]["errors"]
        assert errors["alive"] == 2.0
        kind, text = errors["each_misses_one"]
        assert kind == "RuntimeError"
        assert "rank 0: 'b.weight', 'b.bias'" in text and "rank 1: 'a.weight', 'a.bias'" in text
        assert "find_unused_parameters=True" in text and "static_graph=True" in text
        kind, text = errors["one_rank_misses"]
        assert "rank 1: 'b.weight', 'b.bias'" in text and "rank 0:" not in text
        kind, text = errors["all_miss_same"]
        assert "rank 0: 'b.weight', 'b.bias'" in text and "rank 1: 'b.weight', 'b.bias'" in text


def test_missing_gradient_read_one_backward_late_raises_on_every_rank(results):
    for rank in range(2):
        errors = results[rank]["errors"]
        for case in ("deferred", "deferred_hooked"):
            assert errors[f"{case}_first"] == "passed"
            kind, text = errors[case]
            assert kind == "RuntimeError" and "received no gradient in the previous backward" in text, case
            assert "rank 0: 'b.weight', 'b.bias'" in text and "rank 1:" not in text, case
        kind, text = errors["hooked_at_once"]  # CPU, not forced: this backward
        assert "received no gradient in this backward" in text and "rank 0: 'b.weight', 'b.bias'" in text


def test_gradient_twice_without_static_graph(results):
    for rank in range(2):
        kind, text = results[rank]["errors"]["double_fire"]
        assert kind == "RuntimeError"
        assert "'layer.weight'" in text or "'layer.bias'" in text
        assert "activation checkpointing" in text and "static_graph=True" in text


@pytest.mark.parametrize("case", ["join_initial", "join_active", "join_at_once", "join_bn_no_sync"])
def test_join_matches_torch_and_replicas_agree(results, case):
    for rank in range(2):
        diff, _ = results[rank][case]
        assert diff == 0.0
    assert torch.equal(results[0][case][1], results[1][case][1])


def test_join_throw_on_early_termination(results):
    for rank in range(2):
        ours, theirs = results[rank]["join_throw"]
        assert ours is not None and "exhausted" in ours
        assert theirs is not None


def test_constructor_arguments(results):
    c = results[0]["constructor"]
    assert any("forward_sync_buffers" in m for m in c["future_warning"])
    assert c["mixed_precision"][0] == "ValueError" and "mixed_precision" in c["mixed_precision"][1]
    assert "skip_all_reduce_unused_params" in c["skip_unused"][1]
    assert "delay_all_reduce_named_params" in c["delay"][1]
    assert "process_group or device_mesh" in c["mesh_and_group"][1]
    forward_sync, alias, warned = c["both"]
    assert forward_sync is False and alias is False
    assert any("ignored when `forward_sync_buffers` is provided" in m for m in warned)
    assert "bucket_cap_mb_list" in c["cap_list"][1]
    # 0.001 MiB first, then 0.02 MiB (~20 KiB); a bucket closes once it holds its cap (torch's rule): bias +
    # 16 KiB weight fill the first, two layers the second (16.6 KiB after one is still under 20 KiB).
    assert c["cap_list_layout"] == [[7, 6], [5, 4, 3, 2], [1, 0]]
    assert c["mesh_group_size"] == 2


def test_signature_accepts_every_torch_argument():
    import lockstep

    ours = inspect.signature(lockstep.DistributedDataParallel.__init__).parameters
    theirs = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    assert set(theirs) <= set(ours), set(theirs) - set(ours)
    for name, param in theirs.items():
        assert ours[name].default == param.default or name == "broadcast_buffers", name
