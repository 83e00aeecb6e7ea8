"""Accelerate / Lightning / Fabric with lockstep's DDP swapped in train bit-identically to torch's DDP (2 CPU ranks).

Each case is one launch under the library's own launcher (IMPL=lockstep,torch, library_scripts/common.py): the script
trains with lockstep's DDP in the fresh processes, gives the libraries torch's class back, trains again with torch's,
and the test compares every rank's final state_dict with torch.equal. Skipped when the library is not installed.
Cost of the default level: 49 CPU-s in 20 processes, ~60 s on 2 busy cores (95 CPU-s in 28 processes with a launch per
DDP; 2026-11-26); LOCKSTEP_FULL's cases ~35 s more, the compiled cases ~30 s more (LOCKSTEP_COMPILED_LIBRARIES=1).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import run_ranks
from levels import full_only

HERE = Path(__file__).resolve().parent / "library_scripts"
PY = sys.executable
# The compiled cases (accelerate's --dynamo_backend, Fabric with a compiled model) cost ~30 s more: set the
# variable; tests/test_compile.py covers both orders of torch.compile in every run.
_COMPILED = pytest.mark.skipif(os.environ.get("LOCKSTEP_COMPILED_LIBRARIES") != "1",
                               reason="about 30 s: set LOCKSTEP_COMPILED_LIBRARIES=1")


def test_undo_gives_torch_class_back_to_library_modules_imported_after_the_patch():
    """``use_as_torch_ddp(False)``: the names it replaced, and a known library's module imported after the patch
    (Lightning's strategies take the class from torch.nn.parallel.distributed by name), hold torch's class again; a
    user's module keeps what it imported. Before, only the replaced names were restored (the library scripts gave
    the late ones back themselves)."""
    import types

    from lockstep.ddp.wrapper import DistributedDataParallel
    from lockstep.integrations.torch_ddp import TORCH_DDP, use_as_torch_ddp

    late, user = types.ModuleType("lightning._lockstep_late"), types.ModuleType("_lockstep_user_script")
    try:
        assert "torch.nn.parallel.distributed" in use_as_torch_ddp()
        for module in (late, user):  # what `from torch.nn.parallel.distributed import DistributedDataParallel` gives
            module.DistributedDataParallel = torch.nn.parallel.distributed.DistributedDataParallel
            sys.modules[module.__name__] = module
        assert late.DistributedDataParallel is DistributedDataParallel
        restored = use_as_torch_ddp(False)
        assert {"lightning._lockstep_late", "torch.nn.parallel", "torch.nn.parallel.distributed"} <= set(restored)
        assert late.DistributedDataParallel is TORCH_DDP and torch.nn.parallel.DistributedDataParallel is TORCH_DDP
        assert user.DistributedDataParallel is DistributedDataParallel
        assert use_as_torch_ddp(False) == []  # nothing left to give back
    finally:
        use_as_torch_ddp(False)
        for module in (late, user):
            sys.modules.pop(module.__name__, None)


def _require(library: str) -> None:
    # Not pytest.importorskip: that imports the library into pytest's process, which never uses it (Lightning ~4 CPU-s).
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"{library} is not installed")


def _run_both(cmd: list[str], env: dict[str, str], out: Path, timeout: int = 400) -> None:
    """One launch of ``cmd`` that trains with lockstep's DDP and then with torch's in the same processes
    (IMPL=lockstep,torch, library_scripts/common.py): ``out`` gets ``lockstep*.pt`` and ``torch*.pt``, and the
    checkpoints under ``lockstep/`` and ``torch/``. It must exit 0: no retry. (A torch-only reference run could abort
    at exit, "terminate called without an active exception", gloo's worker freeing a work as the interpreter
    finalised; lockstep's run in the same processes settles gloo's workers at exit, torch's included:
    lockstep.ddp.lifetime.)"""
    full = {**os.environ, "OMP_NUM_THREADS": "1", **env, "IMPL": "lockstep,torch", "OUT": str(out)}
    proc = subprocess.run(cmd, cwd=HERE, env=full, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def _assert_identical(a: Path, b: Path, may_fail: tuple[str, ...] = ()) -> dict:
    """Torch's run ``a`` and lockstep's ``b``: the same final state, bit for bit; returns lockstep's report."""
    sa, sb = torch.load(a, weights_only=False), torch.load(b, weights_only=False)
    ra, rb = sa.pop("__report__"), sb.pop("__report__")
    assert "lockstep" in str(rb["class"]) and "lockstep" not in str(ra["class"])
    # the scripts' own checks (resume equal, saved keys, checkpoint reload): true with both DDPs (those in
    # ``may_fail``: the same with both)
    flags = {k: v for k, v in rb.items() if isinstance(v, bool)}
    assert all(v for k, v in flags.items() if k not in may_fail), (ra, rb)
    assert flags == {k: v for k, v in ra.items() if isinstance(v, bool)}, (ra, rb)
    assert sorted(sa) == sorted(sb)
    assert [k for k in sa if not torch.equal(sa[k], sb[k])] == []
    return rb


def _load_without_lockstep(rank: int, world_size: int, directory: str) -> str:
    """Loads every checkpoint file in a process where ``import lockstep`` fails: a pickled lockstep class would raise
    there, and a "module." key would mean the wrapper's names leaked into the file. Runs in a rank of run_ranks
    (forked from its forkserver, which imported lockstep.ddp: every lockstep module is dropped first)."""
    for name in [n for n in sys.modules if n == "lockstep" or n.startswith("lockstep.")]:
        del sys.modules[name]
    sys.modules["lockstep"] = None  # type: ignore[assignment]  # import lockstep (and lockstep.x) now raises
    from safetensors.torch import load_file

    suffixes = (".ckpt", ".bin", ".pt", ".pth", ".safetensors")
    files = [p for p in Path(directory).rglob("*") if p.suffix in suffixes]
    assert files, "no checkpoint file under " + directory
    for p in files:
        obj = load_file(p) if p.suffix == ".safetensors" else torch.load(p, weights_only=False)
        sd = obj.get("state_dict", obj) if isinstance(obj, dict) else {}
        bad = [k for k in sd if isinstance(k, str) and k.startswith("module.")]
        assert not bad, (str(p), bad[:3])
    assert not any(n == "lockstep" or n.startswith("lockstep.") for n, m in sys.modules.items() if m is not None)
    return f"{len(files)} files loaded"


def _loads_without_lockstep(directory: Path) -> None:
    (said,) = run_ranks(_load_without_lockstep, world_size=1, args=(str(directory),), init=False, timeout_s=120)
    assert said.endswith("files loaded"), said


@pytest.mark.parametrize("env_hook, comm_hook, dynamo", [
    pytest.param(False, "no", "no", marks=full_only("~15 s: accelerate with use_as_torch_ddp(); env_var is the same run")),
    (True, "no", "no"),
    pytest.param(False, "fp16", "no", marks=full_only("~10 s, a comm hook through accelerate")),
    pytest.param(False, "no", "aot_eager", marks=_COMPILED),
],
                         ids=["use_as_torch_ddp", "env_var", "fp16_comm_hook", "dynamo_backend"])
def test_accelerate_bit_identical(tmp_path, env_hook, comm_hook, dynamo):
    _require("accelerate")
    launch = [PY, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", dynamo, "accelerate_run.py"]
    # --dynamo_backend: accelerate compiles the wrapped model, torch.compile(DDP(m)) (lockstep.ddp.compiled). The
    # script's 0.002 MB buckets are below dynamo's 1 MiB first bucket, where torch's DDP fails in dynamo: 25 MB.
    cap = {"BUCKET_CAP_MB": "25"} if dynamo != "no" else {}
    # JOIN=1: uneven inputs under Join, BatchNorm buffers included in the comparison. COMM_HOOK=fp16:
    # accelerate registers torch's fp16_compress_hook, which lockstep's reducer runs itself (ddp/fused_compress).
    # LOCKSTEP_AS_TORCH_DDP=1: the startup hook switches lockstep's run on; torch's run then undoes it.
    extra = {"LOCKSTEP_AS_TORCH_DDP": "1"} if env_hook else {}
    _run_both(launch, {"JOIN": "1", "COMM_HOOK": comm_hook, **cap, **extra}, tmp_path)
    # Under accelerate's dynamo the resumed run does not reproduce the first, with torch's DDP as with lockstep's
    # (accelerate's save_state/load_state with a compiled model): that check must then agree, not hold.
    may_fail = ("resumed_equal",) if dynamo != "no" else ()
    report = _assert_identical(tmp_path / "torch.pt", tmp_path / "lockstep.pt", may_fail=may_fail)
    assert report["hook_path"] == ("fused" if comm_hook == "fp16" else "none"), report
    _loads_without_lockstep(tmp_path / "lockstep")


@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=full_only("~15 s, Lightning's stock strategy")),
                                      "lockstep_ddp"])
def test_lightning_bit_identical(tmp_path, strategy):
    _require("lightning")
    _run_both([PY, "lightning_run.py"], {"STRATEGY": strategy}, tmp_path)  # torch's run: Lightning's "ddp"
    for rank in (0, 1):
        _assert_identical(tmp_path / f"torch.rank{rank}.pt", tmp_path / f"lockstep.rank{rank}.pt")
    _loads_without_lockstep(tmp_path / "lockstep")


@pytest.mark.parametrize("grad_ckpt", ["0", pytest.param("1", marks=full_only("~20 s, a second Trainer run"))],
                         ids=["find_unused", "activation_checkpointing"])
def test_hf_trainer_bit_identical(tmp_path, grad_ckpt):
    """Transformers' Trainer (through Accelerate, with its own DDP arguments) on a tiny Llama built from its config:
    the straight run and a resume from its step-8 checkpoint end bit-identical to torch's DDP."""
    _require("transformers")
    torchrun = [PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", "hf_trainer_run.py"]
    _run_both(torchrun, {"GRAD_CKPT": grad_ckpt}, tmp_path)
    report = _assert_identical(tmp_path / "torch.pt", tmp_path / "lockstep.pt")
    # Trainer's own choice of DDP arguments: find_unused_parameters unless activation checkpointing is on
    assert report["setup"] == ({"find_unused": False, "checkpointing": True} if grad_ckpt == "1"
                               else {"find_unused": True, "checkpointing": False}), report
    assert report["loss_fell"], report
    _loads_without_lockstep(tmp_path / "lockstep" / "final")


@pytest.mark.parametrize("compile_", [pytest.param("0", marks=full_only("~30 s: Fabric; Lightning's Trainer runs by default")),
                                      pytest.param("1", marks=_COMPILED)], ids=["eager", "compiled"])
def test_fabric_bit_identical(tmp_path, compile_):
    _require("lightning")
    # COMPILE=1: a compiled model given to setup, which wraps it and compiles the wrapper (lockstep.ddp.compiled)
    _run_both([PY, "fabric_run.py"], {"COMPILE": compile_}, tmp_path)
    for rank in (0, 1):
        _assert_identical(tmp_path / f"torch.rank{rank}.pt", tmp_path / f"lockstep.rank{rank}.pt")
