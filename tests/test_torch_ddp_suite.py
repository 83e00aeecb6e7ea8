"""PyTorch's own DDP tests (torch/testing/_internal/distributed/distributed_test.py) against lockstep's class.

``tests/torch_suite/run_torch_ddp_tests.py`` runs torch's ``_DistTestBase`` DDP tests (gloo, 2 ranks) with
lockstep's DistributedDataParallel/DistributedSampler swapped in, in CPU-map mode (the GPU-gated tests run on
the CPU) with forked ranks. It runs once per module (about a minute on 2 cores); the tests here read its JSON.

INCLUDED: every selected test that passes with torch's own class in the same mode, minus the exclusions below
(tests that need CUDA for real, tests that assert torch internals, lockstep's deliberate differences), plus
test_DistributedSampler_padding. tests/README.md gives the table with the reasons.

The lists are torch 2.13's suite. The smoke set (.ci/smoke) runs this module on the oldest and newest torch
too: there an INCLUDED test that release lacks is skipped, saying so, and a test that 2.13 skips but that
release runs (SKIPPED_BY_TORCH) must pass with lockstep's class.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from levels import full_only

REPO = Path(__file__).resolve().parents[1]
RUNNER = REPO / "tests" / "torch_suite" / "run_torch_ddp_tests.py"
SUITE_TIMEOUT_S = 600  # the whole run: ~60 s on 2 idle cores

# The setup of the first test runs the whole suite: more than the ini's per-test 300 s under load.
pytestmark = pytest.mark.timeout(SUITE_TIMEOUT_S + 120)

# Pass with torch's class (CPU-map, fork) and are not excluded: each must pass with lockstep's.
INCLUDED = [
    "test_DistributedDataParallelCPU",
    "test_DistributedDataParallelCPU_grad_is_view",
    "test_DistributedDataParallel_requires_grad",
    "test_DistributedDataParallel_with_amp_and_grad_is_view",  # passes vacuously on CPU (cuda autocast is off)
    "test_DistributedSampler_padding",  # LOCKSTEP_SUITE_EXTRA: the one sampler test
    "test_ddp_apply_optim_in_backward",
    "test_ddp_apply_optim_in_backward_grad_as_bucket_view_false",
    "test_ddp_apply_optim_in_backward_ignored_params",
    "test_ddp_broadcast_buffer",
    "test_ddp_broadcast_buffer_via_hook",
    "test_ddp_broadcast_buffers_deprecation_warning",
    "test_ddp_bucket_cap_mb_list",
    "test_ddp_buffer_hook_allreduce",
    "test_ddp_buffer_hook_allreduce_return_future",
    "test_ddp_comm_hook_logging",  # no entry before a hook; a built-in hook logged by its type, as torch's logger
    "test_ddp_compile_static_graph",
    "test_ddp_create_graph",
    "test_ddp_device_mesh_initialization",
    "test_ddp_forward_backward_hook",
    "test_ddp_grad_div_uneven_inputs",
    "test_ddp_hook_parity_allreduce",
    "test_ddp_hook_parity_allreduce_process_group",
    "test_ddp_hook_parity_post_localSGD",
    "test_ddp_hook_parity_powerSGD",
    "test_ddp_ignore_params_arg",
    "test_ddp_init_sync_buffers_with_forward_sync_buffers_false",
    "test_ddp_join_model_equivalence",
    "test_ddp_join_respects_forward_sync_buffers_false",
    "test_ddp_model_diff_num_params_across_ranks",
    "test_ddp_namedtuple",
    "test_ddp_new_tensor_in_fwd",
    "test_ddp_new_tensor_in_fwd_static_graph",
    "test_ddp_python_error_logged",  # an error raised after construction is in the logging data, as torch notes it
    "test_ddp_remove_autograd_hooks",
    "test_ddp_returns_tensor_with_no_grad",
    "test_ddp_shared_grad_acc_unused_params",
    "test_ddp_sink_noclone",
    "test_ddp_static_graph_nested_types",
    "test_ddp_sync_module_states",
    "test_ddp_uneven_input_exception",
    "test_ddp_uneven_input_join_disable",
    "test_ddp_uneven_inputs",  # the runner shrinks its input (dim 1000 -> 64) for the CPU
    "test_ddp_zero_output_features",
    "test_detect_ddp_is_actually_static",  # reducer._ddp_graph_static(): the unused set changed between iterations
    "test_dump_DDP_relevant_env_vars",
    "test_stateless_api_with_ddp",
    # BUILDS_DDP (the runner): tests that build a DDP model under another name
    "test_compute_bucket_assignment_by_size_sparse_error_without_logger",
    "test_get_data_parallel_params",  # the static helper and _ddp_ignored, as torch's
    "test_invalid_static_graph",  # a changed static graph: torch's text, and in the logging data
    "test_output_unused_in_loss_dict_module",
    "test_output_unused_in_loss_tuple_module",
    "test_post_localSGD_optimizer_parity",
    "test_post_localSGD_optimizer_parity_grad_is_view",
    "test_post_localSGD_optimizer_parity_with_hierarchical_sgd",
    "test_post_localSGD_optimizer_parity_with_hierarchical_sgd_grad_is_view",
    "test_post_localSGD_optimizer_step_reload",
    "test_static_graph_api_cpu",  # _set_static_graph after training started: torch's text, logged
    "test_undefined_grad_parity_unused_parameters",
    "test_verify_model_across_rank_without_logger",
]

# Pass with torch's class but assert torch's internals (private reducer / logging / profiler details).
INTERNALS = {
    "test_ddp_build_debug_param_to_name_mapping": "calls _build_params_for_reducer / _build_debug_param_to_name_mapping",
    "test_ddp_build_debug_param_to_name_mapping_requires_grad": "same private helpers",
    "test_ddp_control_flow_different_across_ranks": "reducer._get_local_used_map(); then torch's iteration-2 error text",
    "test_ddp_control_flow_same_across_ranks": "reducer._get_local_used_map(); then torch's iteration-2 error text",
    "test_ddp_logging_data_cpu": "the full _get_ddp_logging_data() dict (timings, bucket strings, env fields)",
    "test_ddp_native_mixed_precision_ignored_params": "per-parameter _mp_param/_fp_param of torch's mixed precision",
    "test_ddp_profiling_torch_profiler": "a 'search_unused_parameters' profiler event of torch's C++ reducer",
    # Both hand ``ddp.logger`` (torch's C++ Logger of its C++ reducer) to torch's C++ helpers. On 2.13 the first
    # passes anyway (its try/except also catches the missing attribute) and torch skips the second
    # (pytorch#85012); on 2.4 and 2.11 both fail with lockstep's class, which has no C++ reducer to log for.
    "test_verify_model_across_rank_with_logger": "passes ddp.logger (torch's C++ Logger) to a C++ helper",
    "test_compute_bucket_assignment_by_size_sparse_error_with_logger": "same",
}

# lockstep raises the missing-gradient error at the end of the first backward that misses gradients;
# torch raises at the next forward (iteration 2), and these tests expect it there.
DELIBERATE = {
    "test_ddp_multiple_nested_unused_params_error": "error in iteration 1 (end of backward), torch's in iteration 2",
    "test_ddp_multiple_nested_unused_params_err_ignore_params": "same, with ignored parameters",
    "test_ddp_unused_params_rebuild_buckets_exception": "same; torch's text and logged error expected",
}

# Not in the torch-pass set: fail with torch's own class on the CPU (they need CUDA) or skipped by torch itself.
NEEDS_CUDA = {
    **{f"test_DistributedDataParallel_SyncBatchNorm{s}": "SyncBatchNorm needs a GPU"
       for s in ("", "_2D_Input", "_Channels_Last", "_Diff_Input_Sizes_Running_Value",
                 "_Diff_Input_Sizes_gradient", "_No_Affine", "_Single_Input_Per_Process", "_half")},
    "test_ddp_uneven_inputs_stop_iteration_sync_bn": "SyncBatchNorm needs a GPU",
    "test_ddp_inference": "SyncBatchNorm (torch's DDP refuses it in a CPU module)",
    **{f"test_ddp_native_mixed_precision_{s}": "torch's mixed precision records device events"
       for s in ("grad_as_bucket_view_no_set_grad_none", "grad_as_bucket_view_set_grad_to_none",
                 "no_grad_as_bucket_view_no_set_grad_none", "no_grad_as_bucket_view_set_grad_to_none")},
    "test_ddp_device": "asserts GPU placement of the outputs",
    "test_ddp_logging_data_gpu": "asserts device_ids / output_device in the logging data",
    "test_sync_bn_logged": "SyncBatchNorm needs a GPU",
}
SKIPPED_BY_TORCH = [
    "test_DistributedDataParallel",  # runs on torch 2.4-2.11 (CPU-map): must pass there
    "test_DistributedDataParallel_non_default_stream",  # likewise
    "test_ddp_has_finalized",
    "test_ddp_hook_pickling_powerSGD",
    "test_ddp_model_diff_shape_across_ranks",  # runs on torch 2.4-2.11; 2.4 matches the error's text
    "test_ddp_profiling_autograd_profiler",
    "test_ddp_profiling_execution_trace",
    "test_ddp_sync_bn_training_vs_eval",
    # torch 2.4 only (gone by 2.11), and skipped there: they need world size 4
    "test_ddp_update_process_group_default_group",
    "test_ddp_update_process_group_grad_undefined",
    "test_ddp_update_process_group_new_group",
    "test_ddp_update_process_group_no_find_unused",
]


def _selected_names(request) -> list[str] | None:
    """The INCLUDED names this session selected, or None for the whole suite (test_summary selected)."""
    mine = [item for item in request.session.items if item.module is request.module]
    if any(item.originalname == "test_summary" for item in mine):
        return None
    return [item.callspec.params["name"] for item in mine if hasattr(item, "callspec")]


def _runner_env(**switches: str) -> dict[str, str]:
    """The environment of a torch-suite runner: lockstep's class, this test's switches, none of the caller's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKSTEP_SUITE_")}
    return {**env, "LOCKSTEP_SUITE_IMPL": "lockstep", **switches}


@pytest.fixture(scope="module")
def suite(request, tmp_path_factory):
    """Run the runner once (only the selected tests when test_summary is deselected, e.g. ``-k uneven``)."""
    names = _selected_names(request)
    tmp = tmp_path_factory.mktemp("torch_suite")
    out, log = tmp / "lockstep.json", tmp / "lockstep.log"
    env = _runner_env(
        LOCKSTEP_SUITE_CPU_MAP="1",
        LOCKSTEP_SUITE_START="fork",
        LOCKSTEP_SUITE_EXTRA="^test_DistributedSampler_padding$",
        LOCKSTEP_SUITE_OUT=str(out),
    )
    cmd = [sys.executable, str(RUNNER.relative_to(REPO)), *(names or [])]
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=SUITE_TIMEOUT_S)
    if proc.returncode != 0 or not out.exists():
        tail = log.read_text()[-4000:]
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode} (log: {log})\n{tail}", pytrace=False)
    data = json.loads(out.read_text())
    data["log"] = str(log)
    data["whole"] = names is None
    return data


def _count_line(suite: dict) -> str:
    tests = suite["tests"]
    present = [n for n in INCLUDED if n in suite["selection"]]
    passed = sum(1 for n in present if tests.get(n, {}).get("outcome") == "passed")
    return (f"{passed} of {len(present)} torch DDP tests pass; {len(DELIBERATE)} deliberate differences"
            f" (torch {suite['torch']})")



# Included tests that lockstep does not pass yet: open gaps, not exclusions. Each is expected to fail
# (strict: once one passes, this list must shrink), and tests/README.md names what is missing.
KNOWN_GAPS = {
}

@pytest.mark.parametrize("name", INCLUDED)
def test_included_passes(suite, name):
    if name in KNOWN_GAPS:
        rec = suite["tests"].get(name, {})
        assert rec.get("outcome") != "passed", f"{name} passes now: remove it from KNOWN_GAPS"
        pytest.xfail(f"known gap: {KNOWN_GAPS[name]}")
    rec = suite["tests"].get(name)
    if name not in suite["selection"]:  # another torch release than the lists' (the smoke set)
        pytest.skip(f"{name} is not in torch {suite['torch']}'s distributed_test.py")
    assert rec is not None, f"{name} was not run (log: {suite['log']})"
    count = f"{_count_line(suite)} " if suite["whole"] else ""
    assert rec["outcome"] == "passed", f"{name} {rec['outcome']}: {rec['detail']}\n{count}(log: {suite['log']})"


def test_summary(suite, capsys):
    tests = suite["tests"]
    line = _count_line(suite)
    with capsys.disabled():  # shown without -s
        print(f"\n[torch DDP suite] {line} ({suite['wall_s']:.0f} s; log: {suite['log']})")

    # Every test of the runner's selection is accounted for exactly once (a new torch may add or rename some;
    # a listed test that this torch lacks is one an older or newer release has).
    groups = [INCLUDED, INTERNALS, DELIBERATE, NEEDS_CUDA, SKIPPED_BY_TORCH]
    listed = [n for g in groups for n in g]
    assert len(listed) == len(set(listed)), "a test is listed twice"
    assert set(tests) == set(suite["selection"]), "the runner did not run its whole selection"
    assert not set(tests) - set(listed), f"in torch {suite['torch']}'s suite, not listed here: {sorted(set(tests) - set(listed))}"
    failing = [f"{n}: {tests[n]['detail'][:200]}" for n in INCLUDED
               if n in tests and tests[n]["outcome"] != "passed" and n not in KNOWN_GAPS]
    assert not failing, line + "\n" + "\n".join(failing)
    # What torch 2.13 skips but another release runs (CPU-map) is torch's DDP test too: lockstep passes it.
    ran = [n for n in SKIPPED_BY_TORCH if tests.get(n, {}).get("outcome") not in (None, "skipped")]
    failing = [f"{n}: {tests[n]['detail'][:200]}" for n in ran if tests[n]["outcome"] != "passed"]
    assert not failing, f"run by torch {suite['torch']}:\n" + "\n".join(failing)


# torch's DDP under distributed autograd (RPC): ddp_under_dist_autograd_test.py, 8 tests, each spawning its
# ranks (~60 s). dist_autograd.backward leaves gradients in the RPC context, not in .grad; before
# lockstep.ddp.dist_autograd, 7 of the 8 failed with lockstep's class (gradients left un-averaged, silently).
RPC_RUNNER = REPO / "tests" / "torch_suite" / "run_torch_rpc_ddp_tests.py"
RPC_TESTS = {
    "test_ddp_comparison", "test_ddp_comparison_uneven_inputs", "test_ddp_dist_autograd_local_vs_remote",
    "test_ddp_dist_autograd_sparse_grads", "test_backward_ddp_inside", "test_backward_ddp_outside",
    "test_backward_ddp_outside_uneven_inputs", "test_backward_no_ddp",
}


# torch's own race in DdpUnderDistAutogradTest: the master's RPC reaches a trainer (Trainer.__init__ calls
# dist.new_group) before that trainer's init_process_group has returned; seen once on torch 2.4 under load,
# before any DDP exists. A test that failed that way is run again, once.
_TORCH_START_RACE = "Default process group has not been initialized"


def _run_rpc_suite(names: list[str], log_path) -> tuple[dict[str, str], str]:
    env = _runner_env(OMP_NUM_THREADS="1")
    with open(log_path, "w") as err:
        proc = subprocess.run([sys.executable, str(RPC_RUNNER.relative_to(REPO)), *names], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=err, text=True, timeout=SUITE_TIMEOUT_S)
    return dict(re.findall(r"^RESULT (test_\w+) (\w+)$", proc.stdout, re.M)), proc.stdout


@full_only("~140 s: torch's DDP-under-RPC tests (tests/test_dist_autograd.py checks lockstep's RPC path in every run)")
def test_ddp_under_distributed_autograd(tmp_path):
    outcomes, out = _run_rpc_suite([], tmp_path / "rpc.log")
    assert set(outcomes) == RPC_TESTS, f"ran {sorted(outcomes)}\n{out[-3000:]}"
    failed = sorted(n for n, o in outcomes.items() if o != "passed")
    if failed and _TORCH_START_RACE in out:
        print(f"torch's start-up race ({_TORCH_START_RACE!r}) in {failed}: run again, once", file=sys.stderr)
        again, out = _run_rpc_suite(failed, tmp_path / "rpc_again.log")
        outcomes.update({n: o for n, o in again.items() if n in failed})
    failed = {n: o for n, o in outcomes.items() if o != "passed"}
    assert not failed, f"{failed}\n{out[-3000:]}\n(ranks' log: {tmp_path})"
