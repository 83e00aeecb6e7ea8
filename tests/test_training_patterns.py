"""Training patterns real scripts use, each run with lockstep's DDP and torch's side by side (issue: drop-in).

One 2-rank group runs every pattern with both classes and returns the parameters after a few steps;
the tests compare them exactly. Where torch's DDP gives a wrong result (WGAN-GP under static_graph) the
reference is torch's DDP without static_graph, checked against one process on the whole batch.
Also: a module changed after wrapping (a replaced head, a frozen layer) is named in the error, and a
replaced head under find_unused_parameters, which neither DDP averages, is warned about once.
"""

from __future__ import annotations

import dataclasses
import gc
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.utils.prune as prune
from torch import nn

from dist_utils import run_ranks

IMPLS = ("lockstep", "torch")
MODES = {"default": {}, "find_unused": {"find_unused_parameters": True}, "view": {"gradient_as_bucket_view": True},
         "static": {"static_graph": True}}


def _ddp_class(impl):
    import lockstep

    return lockstep.DistributedDataParallel if impl == "lockstep" else nn.parallel.DistributedDataParallel


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def _params(*models):
    return [p.detach().clone() for m in models for p in m.parameters()]


def _capture(fn):
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 - the type and the text are the result
        return (type(e).__name__, str(e))


def _wgan_gp(critic, batches):
    """A WGAN-GP critic step: the gradient penalty differentiates the critic's input gradient (create_graph)."""
    opt = torch.optim.SGD(critic.parameters(), lr=1e-2)
    for real, fake, mix in batches:
        losses = []
        for r, f, a in zip(real, fake, mix):  # one chunk per rank; one process runs both chunks
            x = (a * r + (1 - a) * f).requires_grad_(True)
            (grad_x,) = torch.autograd.grad(critic(x).sum(), x, create_graph=True)
            penalty = ((grad_x.norm(dim=1) - 1) ** 2).mean()
            losses.append(critic(f).mean() - critic(r).mean() + 10 * penalty)
        opt.zero_grad()
        (sum(losses) / len(losses)).backward()
        opt.step()
    return _params(critic)


def _r1_penalty(critic):
    """StyleGAN's R1: the penalty's autograd.grad runs through the *same* forward's output, then one backward
    takes both terms. Before lockstep told autograd.grad from backward, that grad call ended DDP's step, so the
    backward after it was not averaged (the replicas drifted apart, silently)."""
    gen, opt = torch.Generator().manual_seed(dist.get_rank()), torch.optim.SGD(critic.parameters(), lr=1e-2)
    for _ in range(3):
        x = torch.randn(4, 6, generator=gen).requires_grad_(True)
        out = critic(x)
        (grad_x,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        loss = torch.nn.functional.softplus(-out).mean() + 5 * grad_x.pow(2).sum(1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return _params(critic)


class _WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.unused = nn.Linear(6, 16), nn.Linear(16, 3), nn.Linear(3, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _adversarial(ddp, attack=True):
    """FGSM adversarial training: the attack's autograd.grad goes through the wrapper, then a step on x_adv.
    Returns the parameters and how many collectives the reducer launched (the attack must launch none)."""
    gen, opt = torch.Generator().manual_seed(dist.get_rank()), torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(3):
        x, y = torch.randn(4, 6, generator=gen), torch.randint(0, 3, (4,), generator=gen)
        x_adv = x.clone().requires_grad_(True)
        if attack:
            (grad_x,) = torch.autograd.grad(nn.functional.cross_entropy(ddp(x_adv), y), x_adv)
            x_adv = (x + 0.1 * grad_x.sign()).detach()
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x_adv), y).backward()
        opt.step()
    return _params(ddp), getattr(getattr(ddp, "reducer", None), "launch_seq", None)


def _gan_batches(ranks):
    gens = [torch.Generator().manual_seed(r) for r in ranks]
    return [tuple([torch.randn(4, 6, generator=g) for g in gens] if k < 2 else [torch.rand(4, 1, generator=g) for g in gens]
                  for k in range(3)) for _ in range(3)]


def _retain_graph(ddp):
    """Two backwards of one forward (retain_graph=True), then a step."""
    gen, opt = torch.Generator().manual_seed(dist.get_rank()), torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        out = ddp(torch.randn(4, 6, generator=gen))
        out.sum().backward(retain_graph=True)
        out.pow(2).sum().backward()
        opt.step()
    return _params(ddp)


def _two_models(impl, kw):
    """An encoder and a head wrapped apart, trained by one backward through both."""
    DDP = _ddp_class(impl)
    encoder = DDP(_net(), **kw)
    torch.manual_seed(1)
    head = DDP(nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2)), **kw)
    gen = torch.Generator().manual_seed(dist.get_rank())
    opt = torch.optim.SGD(list(encoder.parameters()) + list(head.parameters()), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        h = encoder(torch.randn(4, 6, generator=gen))
        (head(h).pow(2).sum() + h.sum()).backward()
        opt.step()
    return _params(encoder, head)


def _zero_redundancy(ddp):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    gen = torch.Generator().manual_seed(dist.get_rank())
    opt = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=1e-2)
    for _ in range(4):
        opt.zero_grad()
        ddp(torch.randn(4, 6, generator=gen)).pow(2).sum().backward()
        opt.step()
    return _params(ddp)


def _pruned(impl, kw):
    """torch.nn.utils.prune: weight_orig is the parameter, the mask a buffer (different on each rank: broadcast)."""
    inner = _net()
    prune.l1_unstructured(inner[2], "weight", amount=0.5 if dist.get_rank() == 0 else 0.3)
    ddp = _ddp_class(impl)(inner, **kw)
    gen, opt = torch.Generator().manual_seed(dist.get_rank()), torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        ddp(torch.randn(4, 6, generator=gen)).sum().backward()
        opt.step()
    return _params(ddp) + [inner[2].weight_mask.clone()]


def _rewrap_after_unfreezing(impl, kw):
    """Fine-tuning: train the top with the bottom frozen, then unfreeze and wrap the module again."""
    DDP = _ddp_class(impl)
    inner = _net()
    inner[0].requires_grad_(False)
    ddp = DDP(inner, **kw)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for phase in range(2):
        opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            ddp(torch.randn(4, 6, generator=gen)).sum().backward()
            opt.step()
        if phase == 0:
            inner.requires_grad_(True)
            ddp = DDP(ddp.module, **kw)  # the old wrapper is dropped: its hooks must not fire again
            gc.collect()
    return _params(ddp)


class _Checkpointed(nn.Module):
    """The middle layer under torch.utils.checkpoint, once or in two segments."""

    def __init__(self, reentrant, segments):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 3)
        self.reentrant, self.segments = reentrant, segments

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.a(x))
        for _ in range(self.segments):
            h = checkpoint(lambda t: torch.tanh(self.b(t)), h, use_reentrant=self.reentrant)
        return self.c(h)


def _checkpointed(impl, kw, reentrant, segments):
    ddp = _ddp_class(impl)(_Checkpointed(reentrant, segments), **kw)
    gen, opt = torch.Generator().manual_seed(dist.get_rank()), torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        ddp(torch.randn(4, 6, generator=gen)).sum().backward()
        opt.step()
    return _params(ddp)


class _AllCheckpointed(nn.Module):
    """Every parameter behind reentrant checkpoints, and one unused: the outer backward runs no AccumulateGrad
    node itself (the nested ones do), so the unused parameter is marked at the first hook, not at backward start."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c, self.unused = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 3), nn.Linear(2, 2)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(lambda t: torch.tanh(self.b(torch.tanh(self.a(t)))), x, use_reentrant=True)
        return checkpoint(self.c, h, use_reentrant=True)


def _all_checkpointed(impl):
    ddp = _ddp_class(impl)(_AllCheckpointed(), static_graph=True)
    gen, opt = torch.Generator().manual_seed(dist.get_rank()), torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(4):
        opt.zero_grad()
        ddp(torch.randn(4, 6, generator=gen).requires_grad_(True)).sum().backward()
        opt.step()
    return _params(ddp)


@dataclasses.dataclass
class _Output:
    logits: torch.Tensor
    aux: torch.Tensor
    note: str = "a field that is no tensor"


class _DataclassOut(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.unused = nn.Linear(6, 8), nn.Linear(8, 3), nn.Linear(2, 2)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return _Output(self.b(h), h.mean())


def _dataclass_output(impl, kw):
    """A forward that returns a dataclass: torch's DDP finds its tensors (_find_tensors); lockstep's graph walk
    did not, so under find_unused_parameters every parameter was marked unused and its gradient then raised."""
    ddp = _ddp_class(impl)(_DataclassOut(), **kw)
    gen, opt = torch.Generator().manual_seed(dist.get_rank()), torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(3):
        out = ddp(torch.randn(4, 6, generator=gen))
        opt.zero_grad()
        (out.logits.sum() + out.aux).backward()
        opt.step()
    return _params(ddp)


def _averaged_model(impl, kw):
    """torch.optim.swa_utils.AveragedModel of the wrapper (it deep-copies it), then update_bn through it."""
    from torch.optim.swa_utils import AveragedModel, update_bn

    torch.manual_seed(0)
    ddp = _ddp_class(impl)(nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3)), **kw)
    ema = AveragedModel(ddp)
    gen, opt = torch.Generator().manual_seed(dist.get_rank()), torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        ddp(torch.randn(4, 6, generator=gen)).sum().backward()
        opt.step()
        ema.update_parameters(ddp)
    update_bn([torch.randn(4, 6, generator=gen) for _ in range(2)], ema)
    return _params(ddp, ema) + [b.clone() for b in ema.buffers() if b.is_floating_point()]


def _changed_after_wrapping(impl, change, kw):
    """Train two steps, change the module (replace the head / freeze the first layer), train two more."""
    ddp = _ddp_class(impl)(_net(), **kw)
    gen = torch.Generator().manual_seed(dist.get_rank())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        def train():
            for step in range(4):
                if step == 2 and change == "replace":
                    torch.manual_seed(5)
                    ddp.module[4] = nn.Linear(16, 3)
                elif step == 2:
                    ddp.module[0].requires_grad_(False)
                opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=0.1)
                opt.zero_grad()
                ddp(torch.randn(4, 6, generator=gen)).sum().backward()
                opt.step()
            return _params(ddp)

        result = _capture(train)
    warned = [str(w.message) for w in caught if "not built with" in str(w.message)]
    return {"result": result, "warned": warned}


def _all_cases(rank, world_size):
    out = {"gp_single": _wgan_gp(_net(), _gan_batches(range(world_size)))} if rank == 0 else {}
    for impl in IMPLS:
        DDP = _ddp_class(impl)
        for mode, kw in MODES.items():
            out[impl, mode, "wgan_gp"] = _wgan_gp(DDP(_net(), **kw), _gan_batches([rank]))
            out[impl, mode, "retain_graph"] = _capture(lambda: _retain_graph(DDP(_net(), **kw)))
            out[impl, mode, "two_models"] = _two_models(impl, kw)
            out[impl, mode, "zero"] = _zero_redundancy(DDP(_net(), **kw))
            out[impl, mode, "pruned"] = _pruned(impl, kw)
            out[impl, mode, "rewrap"] = _rewrap_after_unfreezing(impl, kw)
            out[impl, mode, "averaged_model"] = _averaged_model(impl, kw)
            out[impl, mode, "r1"] = _r1_penalty(DDP(_net(), **kw))
            if mode in ("find_unused", "static"):
                out[impl, mode, "adversarial"] = _capture(lambda: _adversarial(DDP(_WithUnused(), **kw)))
                if impl == "lockstep":
                    out[impl, mode, "adversarial", "no attack"] = _adversarial(DDP(_WithUnused(), **kw), attack=False)
            for reentrant in (False, True):
                for segments in (1, 2):
                    out[impl, mode, "checkpoint", reentrant, segments] = _capture(
                        lambda: _checkpointed(impl, kw, reentrant, segments))
        out[impl, "static", "all_checkpointed"] = _all_checkpointed(impl)
        for mode in ("find_unused", "static"):
            out[impl, mode, "dataclass"] = _capture(lambda: _dataclass_output(impl, MODES[mode]))
        for change in ("replace", "freeze"):
            for mode in ("default", "find_unused"):
                out[impl, mode, change] = _changed_after_wrapping(impl, change, MODES[mode])
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all_cases, 2, timeout_s=300)


def _exact(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("pattern", ["retain_graph", "two_models", "zero", "pruned", "rewrap", "averaged_model"])
@pytest.mark.parametrize("mode", list(MODES))
def test_pattern_equals_torch(results, pattern, mode):
    def params(r, impl):
        got = r[impl, mode, pattern]
        if pattern == "retain_graph":
            assert got[0] == "ok", (impl, got)
            got = got[1]
        return got

    for r in results:
        assert _exact(params(r, "lockstep"), params(r, "torch"))
    # Not the same on every rank, in either DDP: retain_graph's second backward follows no forward, so it is not
    # averaged; update_bn's last forward leaves each rank's own BatchNorm statistics in the averaged model.
    if pattern not in ("retain_graph", "averaged_model"):
        assert _exact(params(results[0], "lockstep"), params(results[1], "lockstep"))  # the replicas stay identical


def test_gradient_penalty_under_static_graph(results):
    """WGAN-GP: torch.autograd.grad(create_graph=True) inside the step, then backward through its result.

    lockstep equals torch's DDP bit for bit in every mode but static_graph, where torch's DDP is the one that
    is wrong (it differs from one process on the whole batch from the first step); lockstep's static_graph
    gives the same parameters as its and torch's other modes."""
    reference = results[0]["gp_single"]
    for r in results:
        torch_default = r["torch", "default", "wgan_gp"]
        assert max((a - b).abs().max().item() for a, b in zip(torch_default, reference)) < 1e-6  # one process: rounding
        for mode in MODES:
            assert _exact(r["lockstep", mode, "wgan_gp"], torch_default), mode
            if mode != "static":
                assert _exact(r["torch", mode, "wgan_gp"], torch_default), mode


def test_replaced_or_frozen_parameters_are_named_in_the_error(results):
    for r in results:
        for change, words in (("replace", "changed in the module after DistributedDataParallel was built: '4.weight' "
                                          "(replaced), '4.bias' (replaced): build DistributedDataParallel after"),
                              ("freeze", "set to requires_grad=False after DistributedDataParallel was built: "
                                         "'0.weight', '0.bias': pass find_unused_parameters=True")):
            kind, text = r["lockstep", "default", change]["result"]
            assert kind == "RuntimeError" and r["torch", "default", change]["result"][0] == "RuntimeError", (kind, text)
            assert f"On ranks 0, 1, parameters were {words}" in text, text
            assert "Expected to have finished reduction" in text  # torch's key sentence stays


def test_replaced_head_under_find_unused_warns_once(results):
    """Neither DDP averages a head replaced after wrapping (same parameters as torch's, replicas drift apart);
    lockstep says so once, naming it. A frozen layer under find_unused_parameters is fine: no warning."""
    for r in results:
        ours, theirs = r["lockstep", "find_unused", "replace"], r["torch", "find_unused", "replace"]
        assert ours["result"][0] == theirs["result"][0] == "ok"
        assert _exact(ours["result"][1], theirs["result"][1])
        assert len(ours["warned"]) == 1 and "('4.weight', '4.bias')" in ours["warned"][0], ours["warned"]
        assert "not averaged across ranks" in ours["warned"][0] and theirs["warned"] == []
        frozen = r["lockstep", "find_unused", "freeze"]
        assert frozen["result"][0] == "ok" and frozen["warned"] == []
        assert _exact(frozen["result"][1], r["torch", "find_unused", "freeze"]["result"][1])
    drift = [i for i, (a, b) in enumerate(zip(results[0]["lockstep", "find_unused", "replace"]["result"][1],
                                              results[1]["lockstep", "find_unused", "replace"]["result"][1]))
             if not torch.equal(a, b)]
    assert drift == [4]  # the new head's weight (its bias's gradient, 4 per output, is the same on both ranks)


@pytest.mark.parametrize("mode", list(MODES))
def test_activation_checkpointing(results, mode):
    """torch.utils.checkpoint, one segment or two, reentrant or not: the same parameters as torch's DDP where
    torch's trains, an error where torch's raises (reentrant: every mode but static_graph, except one segment
    under the default and bucket views), and lockstep's error says which option to change."""
    for r in results:
        for reentrant in (False, True):
            for segments in (1, 2):
                ours, theirs = r["lockstep", mode, "checkpoint", reentrant, segments], r["torch", mode, "checkpoint", reentrant, segments]
                assert ours[0] == theirs[0], (reentrant, segments, ours, theirs)
                should_fail = reentrant and mode != "static" and (segments == 2 or mode == "find_unused")
                assert (ours[0] != "ok") == should_fail, (reentrant, segments, ours)
                if ours[0] == "ok":
                    assert _exact(ours[1], theirs[1]), (reentrant, segments)
                    continue
                assert "Expected to mark a variable ready only once" in theirs[1] and "Expected to mark a variable ready only once" in ours[1]
                assert "'b." in ours[1] and "use_reentrant=False" in ours[1], ours[1]
                if mode == "find_unused":
                    assert "after find_unused_parameters=True had marked it unused" in ours[1], ours[1]
                    assert "pass static_graph=True instead of find_unused_parameters=True" in ours[1]
                else:
                    assert "received its gradient twice in one backward" in ours[1] and "pass static_graph=True" in ours[1]


def test_every_parameter_behind_reentrant_checkpoints_under_static_graph(results):
    for r in results:
        assert _exact(r["lockstep", "static", "all_checkpointed"], r["torch", "static", "all_checkpointed"])
    assert _exact(results[0]["lockstep", "static", "all_checkpointed"], results[1]["lockstep", "static", "all_checkpointed"])


def test_gradient_penalty_through_the_same_forward(results):
    """R1 (autograd.grad on the forward's output, then backward): averaged, so the replicas stay identical, and
    equal to torch's DDP in every mode but static_graph, where torch's is the one that differs (its replicas
    drift apart); lockstep's static_graph equals the other modes."""
    for r in results:
        reference = r["torch", "default", "r1"]
        for mode in MODES:
            assert _exact(r["lockstep", mode, "r1"], reference), mode
            if mode != "static":
                assert _exact(r["torch", mode, "r1"], reference), mode
    for mode in MODES:
        assert _exact(results[0]["lockstep", mode, "r1"], results[1]["lockstep", mode, "r1"]), mode  # failed before


def test_adversarial_attack_through_the_wrapper_launches_nothing(results):
    """FGSM: the attack's autograd.grad through the wrapper neither ends DDP's step nor launches collectives
    (before: a whole round of all-reduces under find_unused_parameters, an error under static_graph); the
    parameters equal torch's find_unused_parameters run (torch's static_graph differs: it is wrong here)."""
    for r in results:
        status, (reference, _) = r["torch", "find_unused", "adversarial"]
        assert status == "ok"
        for mode in ("find_unused", "static"):
            status, got = r["lockstep", mode, "adversarial"]
            assert status == "ok", got
            params, launches = got
            assert _exact(params, reference), mode
            assert launches == r["lockstep", mode, "adversarial", "no attack"][1], (mode, launches)


def test_dataclass_outputs(results):
    """find_unused_parameters finds the tensors of a dataclass output, as torch's; under static_graph lockstep
    gives the same parameters (torch's static_graph differs there, here by ~0.2: it is the one that is wrong)."""
    for r in results:
        status, reference = r["torch", "find_unused", "dataclass"]
        assert status == "ok", reference
        for mode in ("find_unused", "static"):
            status, got = r["lockstep", mode, "dataclass"]
            assert status == "ok", got  # find_unused raised "received its gradient ... after ... marked it unused"
            assert _exact(got, reference), mode
    assert _exact(results[0]["lockstep", "static", "dataclass"][1], results[1]["lockstep", "static", "dataclass"][1])
