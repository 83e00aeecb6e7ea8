"""Reducer behaviour seen from outside: overlap (with and without comm hooks), rebuild from the observed order,
bad input, compatibility."""

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dist_utils import run_ranks


class Reordered(nn.Module):
    """Registered in the opposite order to use: reverse registration order is the wrong guess."""

    def __init__(self):
        super().__init__()
        self.late = nn.Linear(16, 4)
        self.early = nn.Linear(8, 16)

    def forward(self, x):
        return self.late(torch.relu(self.early(x)))


def _big_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def _step(model, x, y):
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()


def _overlap(rank, world_size):
    import lockstep

    model = lockstep.DistributedDataParallel(_big_mlp())
    model.reducer.events = []
    x, y = torch.randn(4, 256), torch.randint(0, 10, (4,))
    per_iteration = []
    for _ in range(2):
        model.reducer.events.clear()
        _step(model, x, y)
        per_iteration.append(list(model.reducer.events))
    return per_iteration, model.reducer.bucket_layout(), model.comm_stats()


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps first: this rank reaches every bucket late."""

    @staticmethod
    def forward(ctx, x, delay_s):
        ctx.delay_s = delay_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.delay_s)
        return grad, None


HOOK_DELAY_S = 0.5
HOOK_CAP_MB = 0.03  # 4 buckets of _big_mlp: [b2, w2], [b1], [w1] (direct), [b0, w0]


def _hook_overlap(rank, world_size):
    """Per hook: 3 steps at 4 buckets; in step 2 rank 0 is late, in step 1 rank 1, so the other rank's buckets
    cannot complete while its backward goes on. Recorded: events, and at each launch how many earlier
    buckets of this backward were still in flight."""
    import lockstep
    from lockstep.ddp.observe import StepObserver
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    class InFlight(StepObserver):
        def __init__(self, reducer):
            self.reducer, self.counts = reducer, []

        def bucket_launch(self, bucket_index, numel, seq):
            # A called hook's work is its Future; a fused one's (``fused_compress``) the all-reduce's dist.Work.
            done = [b.work.done() if hasattr(b.work, "done") else b.work.is_completed() for b in self.reducer.buckets[:bucket_index]]
            self.counts.append(done.count(False))

    def unknown(state, bucket):  # torch's all-reduce hook behind a wrapper the reducer cannot know
        return default_hooks.allreduce_hook(state, bucket)

    hooks = {"fp16": lockstep.comm_hooks.fp16_compress_hook, "torch_fp16": default_hooks.fp16_compress_hook,
             "unknown": unknown}
    gen = torch.Generator().manual_seed(rank)
    data = [(torch.randn(4, 256, generator=gen), torch.randint(0, 10, (4,), generator=gen)) for _ in range(3)]
    out = {}
    for name, hook in hooks.items():
        model = lockstep.DistributedDataParallel(_big_mlp(), bucket_cap_mb=HOOK_CAP_MB)
        model.register_comm_hook(None, hook)
        observer = model.reducer.observer = InFlight(model.reducer)
        steps = []
        for step, (x, y) in enumerate(data):
            model.reducer.events = []
            observer.counts = []
            loss = F.cross_entropy(model(x), y)
            _SlowBackward.apply(loss, HOOK_DELAY_S if step == 2 - rank else 0.0).backward()
            steps.append((model.reducer.events, observer.counts, model.reducer.bucket_layout()))
        out[name] = {"steps": steps, "grads": [p.grad.clone() for p in model.parameters()]}  # summed over the 3 steps
    torch_ddp = nn.parallel.DistributedDataParallel(_big_mlp(), bucket_cap_mb=HOOK_CAP_MB)
    torch_ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    for x, y in data:
        F.cross_entropy(torch_ddp(x), y).backward()
    out["torch_ddp_grads"] = [p.grad.clone() for p in torch_ddp.parameters()]
    return out


AUTO_STEPS = 10


def _autotune_records():
    """The autotune logger's records from now on (INFO and up), and the handler to remove afterwards."""
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("lockstep.ddp.autotune")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return records, handler


def _auto(rank, world_size):
    """bucket_cap_mb=AutoBucketCap(3 caps, 1+1 steps each) against a fixed 25 MB cap and torch's DDP, 10 SGD steps."""
    import logging

    import lockstep
    from lockstep.ddp.autotune import AutoBucketCap

    records, handler = _autotune_records()
    config = AutoBucketCap(caps_mb=(0.01, 0.002, None), warmup_steps=1, timed_steps=1)
    models = {
        "auto": lockstep.DistributedDataParallel(_big_mlp(), bucket_cap_mb=config),
        # the trials move gradients that live in the buckets (kept by zero_grad(set_to_none=False)) with them
        "auto_view": lockstep.DistributedDataParallel(_big_mlp(), bucket_cap_mb=config, gradient_as_bucket_view=True),
        "fixed": lockstep.DistributedDataParallel(_big_mlp(), bucket_cap_mb=25),
        "torch": nn.parallel.DistributedDataParallel(_big_mlp()),
    }
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for k, m in models.items()}
    gen = torch.Generator().manual_seed(rank)
    layouts = []
    drains = []  # the steps done when the tuner waited for the device (on a GPU: torch.cuda.synchronize)
    models["auto"].reducer.tuner.drain = lambda: drains.append(len(layouts))
    for _ in range(AUTO_STEPS):
        x, y = torch.randn(8, 256, generator=gen), torch.randint(0, 10, (8,), generator=gen)
        for name, model in models.items():
            opts[name].zero_grad(set_to_none=name != "auto_view")
            F.cross_entropy(model(x), y).backward()
            opts[name].step()
        layouts.append(models["auto"].reducer.bucket_layout())
    models["auto"](x)  # the forward after the last trial step decides
    logging.getLogger("lockstep.ddp.autotune").removeHandler(handler)
    # Uneven inputs: rank 0 joins after 2 steps, while the trials still switch layouts (it shadows them).
    joined = {}
    for name, model in {"auto": lockstep.DistributedDataParallel(_big_mlp(), bucket_cap_mb=config),
                        "torch": nn.parallel.DistributedDataParallel(_big_mlp())}.items():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with model.join():
            for _ in range(2 if rank == 0 else AUTO_STEPS):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
        joined[name] = [p.detach().clone() for p in model.parameters()]
    errors = {}
    for name, build in {"word": lambda: lockstep.DistributedDataParallel(nn.Linear(2, 2), bucket_cap_mb="fast"),
                        "with_list": lambda: lockstep.DistributedDataParallel(nn.Linear(2, 2), bucket_cap_mb="auto",
                                                                              bucket_cap_mb_list=[1.0]),
                        "config": lambda: AutoBucketCap(caps_mb=(0,))}.items():
        try:
            build()
        except ValueError as e:
            errors[name] = str(e)
    return {
        "params": {k: [p.detach().clone() for p in m.parameters()] for k, m in models.items()},
        "layouts": layouts, "final": models["auto"].reducer.bucket_layout(),
        "result": models["auto"].reducer.tuner.result, "drains": drains, "joined": joined, "logs": [r.getMessage() for r in records], "errors": errors,
    }


LINK_STEPS = 24  # two backwards, then the default trials' 5 caps x (1 + 3) steps, then two with the choice


def _link_verdict(rank, world_size):
    """The default caps' verdict on the tail of the backward after the rebuild (the second): rank 1 comes 0.3 s late
    to it, so rank 0's last 3 MB take 0.3 s to come back (a slow wire, to rank 0), rank 1's a few ms (the last to
    arrive waits for the wire alone). The ranks agree at that backward's end (test_link_default.py has a real
    slow link)."""
    import logging

    import lockstep

    records, handler = _autotune_records()
    def layers():  # 12 x 257 KB: 1 MB caps make several buckets of it, 25 MB one
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(256, 256), *[nn.Sequential(nn.ReLU(), nn.Linear(256, 256)) for _ in range(11)])

    models = {"default": lockstep.DistributedDataParallel(layers()),
              "fixed": lockstep.DistributedDataParallel(layers(), bucket_cap_mb=25),  # asked for: kept
              "torch": nn.parallel.DistributedDataParallel(layers())}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for k, m in models.items()}
    gen = torch.Generator().manual_seed(rank)
    layouts = []
    torch.distributed.barrier()  # the cases before end at different times on the two ranks
    for step in range(LINK_STEPS):
        x, y = torch.randn(8, 256, generator=gen), torch.randint(0, 256, (8,), generator=gen)
        for name, model in models.items():
            opts[name].zero_grad()
            loss = F.cross_entropy(model(x), y)
            if step == 1 and rank == 1 and name != "torch":
                time.sleep(0.3)
            loss.backward()
            opts[name].step()
        layouts.append(models["default"].reducer.bucket_layout())
    logging.getLogger("lockstep.ddp.autotune").removeHandler(handler)
    # Rank 0 joins after one step: its shadow of the judged (second) backward takes part in the agreement.
    joined = {}
    for name, build in (("default", lockstep.DistributedDataParallel), ("torch", nn.parallel.DistributedDataParallel)):
        model = build(layers())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with model.join():
            for _ in range(1 if rank == 0 else 4):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
        joined[name] = [p.detach().clone() for p in model.parameters()]
    reducers = {k: models[k].reducer for k in ("default", "fixed")}
    return {"params": {k: [p.detach().clone() for p in m.parameters()] for k, m in models.items()},
            "layouts": layouts, "votes": {k: r.link.vote for k, r in reducers.items()},
            "tail": (reducers["default"].link.tail_bytes, reducers["default"].link.tail_s), "joined": joined,
            "tuned": {k: r.tuner is not None and r.tuner.done for k, r in reducers.items()},
            "logs": [r.getMessage() for r in records]}


def _rebuild(rank, world_size):
    import lockstep

    torch.manual_seed(0)
    ours = lockstep.DistributedDataParallel(Reordered(), bucket_cap_mb=1e-6)  # one parameter per bucket
    torch.manual_seed(0)
    theirs = nn.parallel.DistributedDataParallel(Reordered(), bucket_cap_mb=1e-6)
    initial = ours.reducer.bucket_layout()
    ours.reducer.events = []
    opt_a = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(theirs.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    layouts = []
    for _ in range(3):
        x, y = torch.randn(5, 8, generator=gen), torch.randint(0, 4, (5,), generator=gen)
        for model, opt in ((ours, opt_a), (theirs, opt_b)):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        layouts.append(ours.reducer.bucket_layout())
    first_order = [i for kind, i in ours.reducer.events if kind == "ready"][:4]
    diff = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), theirs.parameters()))
    return initial, first_order, layouts, ours.reducer.buckets_rebuilt, diff


def _bad_input(rank, world_size):
    import lockstep

    errors = {}

    def capture(name, build):
        try:
            build()
            errors[name] = None
        except Exception as e:  # noqa: BLE001 - we record the type and text
            errors[name] = (type(e).__name__, str(e))

    capture("shape", lambda: lockstep.DistributedDataParallel(nn.Sequential(nn.Linear(8, 4 if rank == 0 else 5))))
    capture("count", lambda: lockstep.DistributedDataParallel(
        nn.Sequential(nn.Linear(8, 4), *([nn.Linear(4, 4)] if rank == 1 else []))))
    capture("dtype", lambda: lockstep.DistributedDataParallel(
        nn.Sequential(nn.Linear(8, 4)).to(torch.float64 if rank == 1 else torch.float32)))
    capture("cap0", lambda: lockstep.DistributedDataParallel(nn.Linear(2, 2), bucket_cap_mb=0))
    capture("cap_neg", lambda: lockstep.DistributedDataParallel(nn.Linear(2, 2), bucket_cap_mb=-1))
    capture("not_module", lambda: lockstep.DistributedDataParallel(lambda x: x))
    capture("cpu_device_ids", lambda: lockstep.DistributedDataParallel(nn.Linear(2, 2), device_ids=[0]))
    # After all these failures the group still works: nobody was left inside a collective.
    t = torch.ones(1)
    torch.distributed.all_reduce(t)
    return errors, t.item()


def _compat(rank, world_size):
    import lockstep

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    ours = lockstep.DistributedDataParallel(module)
    theirs = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    frozen = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    frozen[0].weight.requires_grad_(False)
    frozen_ddp = lockstep.DistributedDataParallel(frozen)
    frozen_ddp(torch.randn(3, 4)).sum().backward()
    return {
        "keys": (list(ours.state_dict()), list(theirs.state_dict())),
        "module_is": ours.module is module,
        "frozen_bucketed": sorted(i for b in frozen_ddp.reducer.bucket_layout() for i in b),
        "frozen_grad_none": frozen[0].weight.grad is None,
        "reload": ours.load_state_dict(theirs.state_dict()) is not None,
    }


def _first_bucket(rank, world_size):
    """Rank 0 and rank 1 wish differently for the first bucket; the rebuilt layout is rank 0's on both."""
    import lockstep

    out = {}
    for rank0_small in (False, True):
        small = rank0_small if rank == 0 else not rank0_small
        cls = type("FirstBucketDDP", (lockstep.DistributedDataParallel,), {"small_first_bucket": small})
        build = lambda: nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])  # 8 x 257 KB
        torch.manual_seed(0)
        ours = cls(build(), bucket_cap_mb=25)  # torch's cap, fixed: the default's link trials never relayout it
        torch.manual_seed(0)
        theirs = nn.parallel.DistributedDataParallel(build())
        initial = ours.reducer.bucket_layout()
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
        gen = torch.Generator().manual_seed(rank)
        for _ in range(3):
            x, y = torch.randn(4, 256, generator=gen), torch.randint(0, 256, (4,), generator=gen)
            for model, opt in zip((ours, theirs), opts):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
        diff = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), theirs.parameters()))
        out[rank0_small] = (initial, ours.reducer.bucket_layout(), ours.reducer.first_bucket_bytes, diff)
    return out


def _join_with_status_exchange(rank, world_size):
    """Uneven inputs under join where every backward also exchanges a status all-reduce (a comm hook,
    find_unused_parameters) and the NaN check's: the joined rank must shadow them in the training ranks' order."""
    import lockstep
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import torch.distributed as dist

    out, issued, real = {}, [], dist.all_reduce

    def recording(tensor, *args, **kwargs):  # the real collective, noted: (dtype, numel) in issue order
        issued.append((str(tensor.dtype), tensor.numel()))
        return real(tensor, *args, **kwargs)

    for name, kw, hook in (("fp16", {}, default_hooks.fp16_compress_hook), ("unused", {"find_unused_parameters": True}, None)):
        finals = []
        for make in (lambda m: lockstep.DistributedDataParallel(m, detect_nonfinite=True, **kw),
                     lambda m: nn.parallel.DistributedDataParallel(m, **kw)):
            dist.all_reduce = recording if not finals else real  # lockstep's run only
            torch.manual_seed(3)
            model = make(_big_mlp())
            if hook is not None:
                model.register_comm_hook(None, hook)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            gen = torch.Generator().manual_seed(rank)
            with model.join():
                for _ in range(2 + 2 * rank):
                    opt.zero_grad()
                    F.cross_entropy(model(torch.randn(4, 256, generator=gen)), torch.randint(0, 10, (4,), generator=gen)).backward()
                    opt.step()
            finals.append([p.detach().clone() for p in model.parameters()])
        dist.all_reduce = real
        out[name] = (max((a - b).abs().max().item() for a, b in zip(*finals)), list(issued))
        issued.clear()
    return out


def _all_cases(rank, world_size):
    return {"join_status": _join_with_status_exchange(rank, world_size), "first_bucket": _first_bucket(rank, world_size), "overlap": _overlap(rank, world_size), "hook_overlap": _hook_overlap(rank, world_size),
            "rebuild": _rebuild(rank, world_size), "auto": _auto(rank, world_size),
            "link": _link_verdict(rank, world_size),
            "bad": _bad_input(rank, world_size), "compat": _compat(rank, world_size)}


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all_cases, 2, timeout_s=180)


def test_overlap_a_bucket_launches_before_the_last_gradient(results):
    for rank in range(2):
        iterations, layout, stats = results[rank]["overlap"]
        assert len(layout) >= 2
        for events in iterations:
            last_ready = max(i for i, e in enumerate(events) if e[0] == "ready")
            first_launch = min(i for i, e in enumerate(events) if e[0] == "launch")
            assert first_launch < last_ready, events
            # Buckets launch in index order on every rank.
            assert [e[1] for e in events if e[0] == "launch"] == list(range(len(layout)))
        assert stats["steps"] == 2 and stats["comm_wait_s"] >= 0.0


def _launch_before_next_ready(events, layout):
    """For each bucket k but the last two: k+1 launched before bucket k+2's last gradient was ready."""
    position = {e: i for i, e in enumerate(events)}
    return all(
        position[("launch", k + 1)] < max(position[("ready", i)] for i in layout[k + 2]) for k in range(len(layout) - 2)
    )


def test_hooks_issuing_collectives_up_front_keep_every_bucket_in_flight(results):
    # Rank r's peer (1 - r) is late in step 1 + r: there, with an up-front hook (ours, torch's fp16 hook), each bucket
    # launches as soon as it is ready, while the earlier ones are still in flight, overlapping backward.
    for rank in range(2):
        res = results[rank]["hook_overlap"]
        for name in ("fp16", "torch_fp16"):
            events, in_flight, layout = res[name]["steps"][1 + rank]
            assert len(layout) == 3, layout  # [b2, w2], [w1] (direct), [b1, b0, w0]
            assert [e[1] for e in events if e[0] == "launch"] == [0, 1, 2], (name, events)
            assert max(in_flight) >= 2, (name, rank, in_flight)
            assert _launch_before_next_ready(events, layout), (name, rank, events)


def test_unknown_hook_keeps_one_bucket_in_flight(results):
    # A hook the reducer cannot vouch for may issue collectives from callbacks: one bucket at a time, always.
    for rank in range(2):
        for events, in_flight, layout in results[rank]["hook_overlap"]["unknown"]["steps"]:
            assert in_flight == [0] * len(layout), (rank, in_flight)
        events, _, layout = results[rank]["hook_overlap"]["unknown"]["steps"][1 + rank]
        assert not _launch_before_next_ready(events, layout), events  # held back while the late peer sleeps


def test_overlapped_hooks_bitwise_equal_torchs_ddp(results):
    for rank in range(2):
        res = results[rank]["hook_overlap"]
        for name in ("fp16", "torch_fp16"):
            assert all(torch.equal(a, b) for a, b in zip(res[name]["grads"], res["torch_ddp_grads"])), name
        # the unknown hook is a plain average: different from fp16 (so the comparison above can fail)
        assert not all(torch.equal(a, b) for a, b in zip(res["unknown"]["grads"], res["torch_ddp_grads"]))


def test_auto_bucket_cap_tries_each_cap_then_keeps_rank_0s_fastest(results):
    from lockstep.ddp.buckets import MIB, assign_buckets

    r0, r1 = results[0]["auto"], results[1]["auto"]
    assert r0["result"] == r1["result"] and r0["final"] == r1["final"] and r0["layouts"] == r1["layouts"]
    result = r0["result"]
    medians = result["median_step_s"]
    assert len(medians) == 3 and all(0 < m < 10 for m in medians), result
    assert result["chosen_mb"] == result["caps_mb"][medians.index(min(medians))]
    # Steps 2-7 ran the trials (two steps per cap): three different layouts. A bucket closes once it holds its
    # cap (torch's rule), so at 10 KB: [b2, w2], [w1] (direct, which leaves the open bucket open), [b1, b0, w0];
    # at 2 KB b1, b0 and w0 part (b1 and b0 alone are 4 KB): [b2, w2], [b1], [w1], [b0], [w0].
    trial_layouts = r0["layouts"][1:7]
    assert trial_layouts[0] == trial_layouts[1] and len(trial_layouts[0]) == 3
    assert trial_layouts[2] == trial_layouts[3] and len(trial_layouts[2]) == 5
    assert len({str(layout) for layout in trial_layouts}) == 3
    order = [i for bucket in trial_layouts[2] for i in bucket]  # one parameter's bucket closing after another's
    # One bucket, in the same order, but for _big_mlp's 4 MiB weight (index 2): a direct bucket of its own
    # (``ddp.copy_in``), first (it closes at once), the rest left open, so last.
    assert trial_layouts[4] == trial_layouts[5] == [[2], [i for i in order if i != 2]]
    assert r0["layouts"][7:] == [r0["final"]] * 3
    # The device is waited for at each trial step's boundary (forwards 0-7; the 8th decides), never after.
    assert r0["drains"] == r1["drains"] == list(range(8))
    # The kept layout is the chosen cap's, over the observed order.
    cap = 1 << 62 if result["chosen_mb"] is None else int(result["chosen_mb"] * MIB)
    params = [p for p in r0["params"]["auto"]]
    plans = assign_buckets(params, order, cap, bucket_caps_bytes=[min(MIB, cap), cap] if cap < 1 << 62 else [cap],
                           direct_min_bytes=4 * MIB)
    assert r0["final"] == [plan.param_indices for plan in plans]
    # Logged once per model (two tuned here: auto, auto_view), on rank 0, with the choice and the times.
    assert len(r0["logs"]) == 2 and not r1["logs"]
    assert "bucket_cap_mb='auto' chose" in r0["logs"][0] and "10 KB" not in r0["logs"][0], r0["logs"]


def test_the_link_verdict_is_agreed_and_a_late_peer_is_no_slow_wire(results):
    # issue #35: the default caps go to "auto"'s trials only where every rank's second backward said the wire is
    # slow (one all-reduce at its end); rank 0 waited 0.3 s for rank 1, rank 1 only for the wire
    r0, r1 = results[0]["link"], results[1]["link"]
    assert r0["votes"]["default"], r0["tail"]
    agreed = r0["votes"]["default"] and r1["votes"]["default"]  # rank 1 says fast unless a loaded machine slowed it
    assert r0["tuned"] == r1["tuned"] == {"default": agreed, "fixed": False}, (r0["tail"], r1["tail"])
    assert r0["layouts"] == r1["layouts"]
    distinct = len({str(layout) for layout in r0["layouts"][1:]})  # the trials: 1 MB caps split it, 4 MB on do not
    assert distinct >= 2 if agreed else distinct == 1, r0["layouts"]
    assert len(r0["logs"]) == (2 if agreed else 0) and not r1["logs"], (r0["logs"], r1["logs"])
    for rank in (0, 1):  # a joined rank's shadow of the judged backward votes too; the bits are torch's
        joined = results[rank]["link"]["joined"]
        assert all(torch.equal(a, b) for a, b in zip(joined["default"], joined["torch"])), rank
    for rank in (0, 1):  # whatever the layouts, no bit changes at 2 ranks
        params = results[rank]["link"]["params"]
        for other in ("fixed", "torch"):
            assert all(torch.equal(a, b) for a, b in zip(params["default"], params[other])), (rank, other)


def test_the_link_verdict_reads_the_tails_rate_and_share():
    from lockstep.ddp.autotune import tail_wants_trials

    assert tail_wants_trials(4_800_000, 0.300, 0.040)  # a small CNN's bucket through 100 Mbit/s
    assert tail_wants_trials(4_800_000, 0.016, 0.040)  # ... through 2.5 Gbit/s: 0.3 GB/s, 40% of the backward
    assert not tail_wants_trials(5_300_000, 0.004, 0.040)  # loopback: 1.3 GB/s
    assert not tail_wants_trials(4_800_000, 0.016, 0.400)  # a slow wire, but its tail is 4% of the backward
    assert not tail_wants_trials(500_000, 0.300, 0.040)  # under 1 MiB left: nothing worth splitting


def test_auto_bucket_cap_trains_bit_identical_to_a_fixed_cap(results):
    for rank in range(2):
        params = results[rank]["auto"]["params"]
        for other in ("fixed", "torch", "auto_view"):
            assert all(torch.equal(a, b) for a, b in zip(params["auto"], params[other])), (rank, other)
        assert not all(torch.equal(a, b) for a, b in zip(params["auto"], _big_mlp().parameters()))  # it trained


def test_auto_bucket_cap_with_a_joined_rank(results):
    for rank in range(2):
        joined = results[rank]["auto"]["joined"]
        assert all(torch.equal(a, b) for a, b in zip(joined["auto"], joined["torch"])), rank


def test_auto_bucket_cap_bad_input(results):
    errors = results[0]["auto"]["errors"]
    assert "bucket_cap_mb must be a number > 0 or 'auto', got 'fast'" in errors["word"]
    assert "bucket_cap_mb_list" in errors["with_list"]
    assert "AutoBucketCap.caps_mb" in errors["config"]


def test_first_bucket_after_the_rebuild_is_rank_0s_choice(results):
    # The first step has the 1 MiB first bucket on every rank (each builds it alone); the rebuild takes
    # rank 0's wish (``small_first_bucket``), so the layouts agree even where the ranks judge differently.
    torch_layout = [list(range(15, 7, -1)), list(range(7, -1, -1))]  # reverse order; 4 layers fill 1 MiB
    for rank0_small, want_first, want_layout in ((False, 25 << 20, [list(range(15, -1, -1))]), (True, 1 << 20, torch_layout)):
        got = [results[rank]["first_bucket"][rank0_small] for rank in range(2)]
        for initial, rebuilt, first, diff in got:
            assert initial == torch_layout
            assert (rebuilt, first) == (want_layout, want_first), rank0_small
            assert diff == 0.0  # bit-identical to torch's DDP whatever the buckets


def test_join_shadows_the_status_exchange_in_order(results):
    # A comm hook's flag and find_unused_parameters' bitmap are launched right behind the buckets, before the
    # NaN check's all-reduce; the joined rank's shadow issues them in that order too, and training matches torch's.
    for name in ("fp16", "unused"):
        (diff0, issued0), (diff1, issued1) = (results[rank]["join_status"][name] for rank in range(2))
        assert diff0 == diff1 == 0.0, name
        assert issued0 == issued1, (name, issued0, issued1)  # the joined rank 0 issued what rank 1 did, in order
        assert ("torch.int32", 1) in issued1 if name == "fp16" else len(issued1) > 4, issued1


def test_rebuild_follows_observed_order(results):
    for rank in range(2):
        initial, first_order, layouts, rebuilt, diff = results[rank]["rebuild"]
        assert initial == [[3], [2], [1], [0]]  # reverse registration: early.bias, early.weight, late.bias, late.weight
        assert rebuilt
        # Rank 0's observed order is the layout on every rank.
        assert layouts[1] == [[i] for i in results[0]["rebuild"][1]]
        assert layouts[1] != initial and layouts[2] == layouts[1]
        assert diff == 0.0


def test_mismatched_models_raise_on_every_rank(results):
    for rank in range(2):
        errors, group_still_works = results[rank]["bad"]
        assert group_still_works == 2.0
        kind, text = errors["shape"]
        assert kind == "RuntimeError"
        assert "parameter '0.weight' has shape (4, 8) dtype torch.float32 on rank 0 but shape (5, 8)" in text
        assert "on rank 1" in text
        # torch's phrases too (torch 2.4's DDP tests match them: test_torch_ddp_suite on that torch)
        assert "appears not to match sizes of the same param in process 0" in text
        kind, text = errors["count"]
        assert "rank 0 has 2 parameters and rank 1 has 4" in text and "'1.weight' on rank 1" in text
        assert "DDP expects same model across all ranks" in text
        kind, text = errors["dtype"]
        assert "'0.weight'" in text and "torch.float64 on rank 1" in text
        assert "appears not to match dtype of the same param in process 0" in text


def test_bad_arguments(results):
    errors, _ = results[0]["bad"]
    assert errors["cap0"][0] == "ValueError" and "bucket_cap_mb must be > 0, got 0" in errors["cap0"][1]
    assert errors["cap_neg"][0] == "ValueError"
    assert errors["not_module"][0] == "TypeError" and "torch.nn.Module" in errors["not_module"][1]
    assert errors["cpu_device_ids"][0] == "ValueError" and "device_ids must be None for a CPU module" in errors["cpu_device_ids"][1]


def test_state_dict_and_module_compatible_with_torch(results):
    compat = results[0]["compat"]
    ours, theirs = compat["keys"]
    assert ours == theirs and ours[0] == "module.0.weight"
    assert compat["module_is"] and compat["reload"]
    assert compat["frozen_bucketed"] == [0, 1, 2]  # 4 parameters, the frozen weight left out
    assert compat["frozen_grad_none"]
