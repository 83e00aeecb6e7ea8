"""Sparse gradients: ``nn.Embedding`` / ``nn.EmbeddingBag`` with ``sparse=True`` under lockstep's DDP.

torch's DDP (gloo) gives such a weight a bucket of its own and all-reduces its gradient as a sparse
tensor (divided in place first), leaving ``.grad`` sparse; lockstep does the same. One group of 2
gloo ranks runs every case. The evidence:

* parity: 4 SGD steps give the bits of torch's DDP, with copied gradients, bucket views (True) and
  lockstep's ``None``, static_graph, find_unused_parameters, torch's allreduce comm hook; ``.grad``
  stays sparse; the gradients equal one process's on the whole batch (torch's own sparse test);
* the layout: the sparse weights have buckets of their own, as torch's ``_compute_bucket_assignment_by_size``
  makes them for the order the gradients came in;
* join with uneven inputs: equals torch's DDP under join, and torch's DDP where the rank without data sends a
  zero loss instead;
* a deliberate difference: under find_unused_parameters, a rank that did not use the embedding takes the
  average of the ranks that did (torch's DDP raises "Expected sparse gradient to be defined.");
  where no rank used it its ``.grad`` stays None;
* errors: a gradient missing on one rank fails on both, naming it; a sparse gradient from a module
  not declared sparse is refused, naming the parameter; ``detect_nonfinite`` names a NaN in a dense or a
  sparse gradient where the last bucket is sparse.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from dist_utils import run_ranks

STEPS = 4
VOCAB, DIM = 50, 16


class _Net(nn.Module):
    """Two sparse tables (the first, defined first, is the last gradient of backward) and a dense head."""

    def __init__(self):
        super().__init__()
        self.words = nn.Embedding(VOCAB, DIM, sparse=True)
        self.bag = nn.EmbeddingBag(VOCAB, DIM, mode="sum", sparse=True)
        self.dense = nn.Linear(2 * DIM, 64)
        self.head = nn.Linear(64, 5)

    def forward(self, tokens, use_words: bool = True):
        words = self.words(tokens).mean(1) if use_words else torch.zeros(tokens.shape[0], DIM)
        return self.head(torch.relu(self.dense(torch.cat([words, self.bag(tokens)], 1))))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _Net()


def _batches(rank: int, steps: int = STEPS, per_rank: int = 6):
    gen = torch.Generator().manual_seed(100 + rank)
    return [(torch.randint(0, VOCAB, (per_rank, 7), generator=gen), torch.randint(0, 5, (per_rank,), generator=gen))
            for _ in range(steps)]


def _train(model, batches, hook=None, join: bool = False, zero_loss_after: int | None = None):
    if hook is not None:
        model.register_comm_hook(None, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # no momentum: SGD takes sparse gradients as they are
    with model.join() if join else contextlib.nullcontext():
        for step, (tokens, labels) in enumerate(batches):
            opt.zero_grad()
            loss = F.cross_entropy(model(tokens), labels)
            if zero_loss_after is not None and step >= zero_loss_after:
                loss = loss * 0.0  # what this rank adds: nothing (the joined rank's shadow, for torch's DDP)
            loss.backward()
            opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _all_cases(rank: int, world_size: int) -> dict:
    import lockstep

    out: dict = {}
    ours = lockstep.DistributedDataParallel
    torchs = nn.parallel.DistributedDataParallel
    batches = _batches(rank)

    variants = {
        "copies": {},
        "view": {"gradient_as_bucket_view": True},
        "alias": {"gradient_as_bucket_view": None},
        "static": {"static_graph": True},
        "find_unused": {"find_unused_parameters": True},
        "small_buckets": {"bucket_cap_mb": 0.0003},  # the dense weights in two buckets (the head's, the body's)
    }
    for name, kwargs in variants.items():
        model = ours(_model(), **kwargs)
        mine = _train(model, batches)
        theirs = _train(torchs(_model(), **{**kwargs, "gradient_as_bucket_view": bool(kwargs.get("gradient_as_bucket_view"))}), batches)
        grad = model.module.words.weight.grad
        out[f"parity/{name}"] = {"max_diff": (mine - theirs).abs().max().item(), "sparse_grad": grad is not None and grad.is_sparse,
                                 "layout": model.reducer.bucket_layout(), "sparse_buckets": [b.plan.sparse for b in model.reducer.buckets]}
        if name == "small_buckets":
            reducer = model.reducer
            flags = reducer.sparse
            order = reducer._param_order  # the order the first backward's gradients came in (rank 0's)
            theirs_layout, _ = dist._compute_bucket_assignment_by_size(
                [reducer.params[i] for i in order], [reducer.first_bucket_bytes, reducer.bucket_cap_bytes], flags, order)
            out["layout_torch"] = [list(b) for b in theirs_layout]
            out["sparse_flags"] = flags

    # torch's allreduce hook divides the sparse buffer and all-reduces it.
    mine = _train(ours(_model()), batches, hook=default_hooks.allreduce_hook)
    theirs = _train(torchs(_model()), batches, hook=default_hooks.allreduce_hook)
    out["parity/allreduce_hook"] = {"max_diff": (mine - theirs).abs().max().item()}

    # torch's own sparse test: one backward on the half batch equals one process on the whole batch.
    full_tokens = torch.cat([_batches(r)[0][0] for r in range(world_size)])
    full_labels = torch.cat([_batches(r)[0][1] for r in range(world_size)])
    single = _model()
    F.cross_entropy(single(full_tokens), full_labels).backward()
    model = ours(_model())
    F.cross_entropy(model(*batches[0][:1]), batches[0][1]).backward()
    out["vs_single"] = max((a.grad.to_dense() - b.grad.to_dense()).abs().max().item()
                           for a, b in zip(single.parameters(), model.module.parameters()))

    # Uneven inputs: rank 0 has 2 batches, rank 1 four; the joined rank shadows the sparse buckets with empty
    # sparse tensors. Against torch's DDP under join, and torch's DDP where rank 0 sends zero losses instead.
    uneven = _batches(rank, steps=2 + 2 * rank)
    mine = _train(ours(_model()), uneven, join=True)
    theirs = _train(torchs(_model()), uneven, join=True)
    zeros = _train(torchs(_model()), _batches(rank, steps=4), zero_loss_after=2 if rank == 0 else None)
    out["join"] = ((mine - theirs).abs().max().item(), (mine - zeros).abs().max().item())

    # find_unused_parameters, the word table unused on rank 1 only: rank 1 gets rank 0's gradient / 2.
    model = ours(_model(), find_unused_parameters=True)
    tokens, labels = batches[0]
    F.cross_entropy(model(tokens, use_words=rank == 0), labels).backward()
    local = torch.zeros(VOCAB, DIM)
    if rank == 0:  # rank 0's own local gradient, recomputed on a plain copy of the model
        plain = _model()
        F.cross_entropy(plain(tokens), labels).backward()
        local = plain.words.weight.grad.coalesce().to_dense()  # coalesced as gloo sums it: the same additions
    dist.all_reduce(local)  # rank 0's local gradient on both ranks
    grad = model.module.words.weight.grad
    out["unused_on_one"] = {"sparse": grad is not None and grad.is_sparse,
                            "max_diff": (grad.to_dense() - local / 2).abs().max().item() if grad is not None else None}
    # ... and unused on both: its .grad stays None, the rest trains.
    model = ours(_model(), find_unused_parameters=True)
    F.cross_entropy(model(tokens, use_words=False), labels).backward()
    out["unused_on_both"] = (model.module.words.weight.grad is None, model.module.bag.weight.grad is not None)

    # Without find_unused_parameters, the word table skipped on rank 1: both ranks raise, naming it.
    model = ours(_model())
    try:
        F.cross_entropy(model(tokens, use_words=rank == 0), labels).backward()
        out["missing"] = "no error"
    except RuntimeError as e:
        out["missing"] = str(e)

    # The NaN check where the last bucket is sparse (no spare element to carry its count): a NaN put into the
    # head's gradients, then into the word table's, on rank 1 only, each raised on both ranks, naming it.
    for where in ("head", "words"):
        model = ours(_model(), detect_nonfinite=True, bucket_cap_mb=0.0003)
        F.cross_entropy(model(tokens), labels).backward()  # the rebuilt layout: [head], [dense], [bag], [words]
        out["nan/last_sparse"] = model.reducer.buckets[-1].plan.sparse
        poison = model.module.head.weight if where == "head" else model.module.words.weight
        handle = poison.register_hook(lambda g: g * float("nan")) if rank == 1 else None
        try:
            F.cross_entropy(model(tokens), labels).backward()
            out[f"nan/{where}"] = "no error"
        except RuntimeError as e:
            out[f"nan/{where}"] = f"{type(e).__name__}: {e}"
        if handle is not None:
            handle.remove()

    # A sparse gradient where the module did not say sparse=True (F.embedding(sparse=True) in a custom module).
    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Parameter(torch.randn(VOCAB, DIM))

        def forward(self, tokens):
            return F.embedding(tokens, self.table, sparse=True).sum()

    torch.manual_seed(0)
    model = ours(Custom())
    try:
        model(tokens).backward()
        out["undeclared"] = "no error"
    except RuntimeError as e:
        out["undeclared"] = str(e)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all_cases, 2, timeout_s=240)


def test_sparse_gradients_equal_torchs_ddp_bit_for_bit(results):
    for rank in range(2):
        cases = {k: v for k, v in results[rank].items() if k.startswith("parity/")}
        assert len(cases) == 7
        for name, case in cases.items():
            assert case["max_diff"] == 0.0, (rank, name, case)
            if "sparse_grad" in case:
                assert case["sparse_grad"], (rank, name)
                # One bucket each for the two tables, nothing else in them.
                layout, sparse = case["layout"], case["sparse_buckets"]
                assert sorted(b[0] for b, s in zip(layout, sparse) if s) == [0, 1] and all(len(b) == 1 for b, s in zip(layout, sparse) if s), (name, case)


def test_layout_is_torchs_with_sparse_buckets(results):
    assert results[0]["sparse_flags"] == [True, True, False, False, False, False]
    for rank in range(2):
        assert results[rank]["parity/small_buckets"]["layout"] == results[rank]["layout_torch"], results[rank]
        assert len(results[rank]["layout_torch"]) >= 4


def test_gradients_equal_one_process_on_the_whole_batch(results):
    assert results[0]["vs_single"] < 1e-6 and results[1]["vs_single"] < 1e-6, (results[0]["vs_single"], results[1]["vs_single"])


def test_join_with_sparse_buckets(results):
    assert results[0]["join"] == (0.0, 0.0) and results[1]["join"] == (0.0, 0.0)


def test_unused_sparse_table_on_one_rank_takes_the_average(results):
    """Deliberately not torch's: its DDP raises "Expected sparse gradient to be defined." on rank 1."""
    for rank in range(2):
        case = results[rank]["unused_on_one"]
        assert case["sparse"] and case["max_diff"] == 0.0, (rank, case)
        assert results[rank]["unused_on_both"] == (True, True)


def test_missing_sparse_gradient_fails_on_both_ranks(results):
    for rank in range(2):
        message = results[rank]["missing"]
        assert "received no gradient" in message and "rank 1: 'words.weight'" in message and "rank 0" not in message, (rank, message)


def test_nan_check_with_a_sparse_last_bucket(results):
    """The count of non-finite buckets travels in its own all-reduce where the last bucket is sparse (it rode in a
    spare element that a sparse bucket does not send, so a NaN went unseen); sparse values are checked before
    their all-reduce, which overwrites them."""
    for rank in range(2):
        assert results[rank]["nan/last_sparse"]
        head, words = results[rank]["nan/head"], results[rank]["nan/words"]
        assert head.startswith("NonfiniteGradientError") and "on rank 1" in head and "'head.weight'" in head, head
        assert words.startswith("NonfiniteGradientError") and "rank 1: 1 of 6 parameters, 'words.weight'" in words, words


def test_sparse_gradient_of_an_undeclared_module_is_refused(results):
    for rank in range(2):
        message = results[rank]["undeclared"]
        assert "'table'" in message and "sparse" in message and "nn.Embedding" in message, message
