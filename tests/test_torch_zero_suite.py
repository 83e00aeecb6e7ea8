"""PyTorch's own ZeroRedundancyOptimizer tests (pytorch's test/distributed/optim/test_zero_redundancy_optimizer.py)
against lockstep's class, with lockstep's DistributedDataParallel where they build a DDP.

``tests/torch_suite/run_torch_zero_tests.py`` runs the file's tests once per module (gloo, world size 1 and 2,
forked ranks, ``skip_if_no_gpu`` stripped so the GPU-per-rank tests run on the CPU; ~15 s). The torch wheel does
not install pytorch's test/ tree and lockstep does not copy it: set ``LOCKSTEP_TORCH_TEST_DIR`` to a pytorch
checkout's ``test/`` directory (the installed release's); without it every case here is skipped, saying so.

INCLUDED pass with torch's class in the same mode and must pass with lockstep's. NEEDS_ACCELERATOR are skipped by
torch's own gates on a machine without GPUs, each with its reason; tests/README.md has the table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUNNER = REPO / "tests" / "torch_suite" / "run_torch_zero_tests.py"
SUITE_TIMEOUT_S = 600

pytestmark = pytest.mark.timeout(SUITE_TIMEOUT_S + 120)

_PARITY = [f"test_local_optimizer_parity_optimizer_class_str_{o}_maximize_{m}"
           for o in ("Adam", "AdamW", "SGD") for m in ("False", "True")]
INCLUDED = [
    *(f"TestZeroRedundancyOptimizerSingleRank.{n}" for n in (
        "test_constructor", "test_lr_scheduler", "test_same_dense_param_type", "test_state_dict",
        "test_step_with_extra_inner_key", "test_step_with_kwargs", "test_step_without_closure", "test_zero_grad")),
    *(f"TestZeroRedundancyOptimizerDistributed.{n}" for n in (
        "test_add_param_group", "test_collect_shards", *_PARITY, "test_lr_scheduler", "test_multiple_param_groups",
        "test_nondefault_process_group",  # returns early below 4 ranks, with torch's class too
        "test_sharding", "test_step", "test_step_with_closure", "test_zero_join_cpu")),
]

_OVERLAP = ("needs NCCL (requires_accelerator_dist_backend: torch's overlap hangs on gloo, pytorch#62300); with "
            "lockstep's class it would fail on a GPU machine too: lockstep refuses overlap_with_ddp=True (torch's "
            "overlap is a comm hook of torch's own DDP, ddp_zero_hook)")
NEEDS_ACCELERATOR = {
    **{f"TestZeroRedundancyOptimizerDistributed.test_ddp_zero_overlap_use_gpu_True_use_interleaved_hook_{i}"
       f"_gradient_as_bucket_view_{g}_static_graph_{s}_shard_buckets_{b}": _OVERLAP
       for i in ("False", "True") for g in ("False", "True") for s in ("False", "True") for b in ("False", "True")},
    "TestZeroRedundancyOptimizerDistributed.test_zero_join_gpu": "needs NCCL (requires_accelerator_dist_backend); "
                                                                "test_zero_join_cpu runs the same test on gloo",
    "TestZeroRedundancyOptimizerDistributed.test_zero_model_parallel_parameters_as_bucket_view_False":
        "needs 4 GPUs (skip_if_lt_x_gpu(4): a model split over two devices per rank)",
    "TestZeroRedundancyOptimizerDistributed.test_zero_model_parallel_parameters_as_bucket_view_True":
        "needs 4 GPUs (skip_if_lt_x_gpu(4))",
}


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torch_zero_suite")
    out, log = tmp / "lockstep.json", tmp / "lockstep.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKSTEP_SUITE_")}
    env.update(LOCKSTEP_SUITE_IMPL="lockstep", LOCKSTEP_SUITE_OUT=str(out))
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, str(RUNNER.relative_to(REPO))], cwd=REPO, env=env, stdout=f,
                              stderr=subprocess.STDOUT, timeout=SUITE_TIMEOUT_S)
    if proc.returncode == 3:
        pytest.skip(log.read_text().strip().splitlines()[-1])
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"{RUNNER.name} exited {proc.returncode} (log: {log})\n{log.read_text()[-4000:]}", pytrace=False)
    data = json.loads(out.read_text())
    data["log"] = str(log)
    return data


@pytest.mark.parametrize("name", INCLUDED)
def test_included_passes(suite, name):
    rec = suite["tests"].get(name)
    assert rec is not None, f"{name} was not run (log: {suite['log']})"
    assert rec["outcome"] == "passed", f"{name} {rec['outcome']}: {rec['detail']} (log: {suite['log']})"


@pytest.mark.parametrize("name", sorted(NEEDS_ACCELERATOR))
def test_needs_accelerator(suite, name):
    rec = suite["tests"].get(name)
    assert rec is not None, f"{name} was not run (log: {suite['log']})"
    if rec["outcome"] == "skipped":
        pytest.skip(f"{NEEDS_ACCELERATOR[name]} [torch's gate: {rec['detail']}]")
    if "overlap" not in name:  # a machine with the GPUs: the test ran, and must pass
        assert rec["outcome"] == "passed", f"{name} {rec['outcome']}: {rec['detail']}"
    else:
        pytest.xfail(f"{rec['outcome']} on this machine, as expected: {_OVERLAP}")


def test_summary(suite, capsys):
    tests = suite["tests"]
    listed = [*INCLUDED, *NEEDS_ACCELERATOR]
    assert len(listed) == len(set(listed)), "a test is listed twice"
    assert set(tests) == set(listed), f"not listed here: {sorted(set(tests) - set(listed))}; " \
                                      f"listed but not in torch's file: {sorted(set(listed) - set(tests))}"
    passed = sum(1 for n in INCLUDED if tests[n]["outcome"] == "passed")
    with capsys.disabled():
        print(f"\n[torch ZeRO suite] {passed} of {len(INCLUDED)} torch ZeroRedundancyOptimizer tests pass with "
              f"lockstep's class; {len(NEEDS_ACCELERATOR)} need an accelerator (torch {suite['torch']}, "
              f"{suite['wall_s']:.0f} s; log: {suite['log']})")
    assert passed == len(INCLUDED)
