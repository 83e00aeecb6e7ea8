"""Run PyTorch's DDP-under-distributed-autograd tests (torch/testing/_internal/distributed/ddp_under_dist_autograd_test.py).

torch's ``test/distributed/rpc`` composition of ``DdpComparisonTest`` and ``DdpUnderDistAutogradTest`` with
the TensorPipe RPC agent (CPU, gloo, spawned ranks: 2-5 processes per test), with the test module's
``DistributedDataParallel`` (its ``from torch.nn.parallel import ...`` global) swapped for lockstep's. The
gradients of ``dist_autograd.backward`` land in the RPC context, not in ``.grad``
(``lockstep.ddp.dist_autograd``); the tests compare them with a local DDP backward's and check a hybrid
RPC + DDP model trains as one process would.

  LOCKSTEP_SUITE_IMPL=torch|lockstep   which DDP (default lockstep)
  names on the command line            run only the tests whose name contains one of them

Prints unittest's verbose report, then one ``RESULT <name> passed|failed|skipped`` line per test, and exits 0
when every test passed. About 60 s on 2 cores (each test spawns its ranks, which import torch).
"""

from __future__ import annotations

import os
import sys
import unittest

IMPL = os.environ.get("LOCKSTEP_SUITE_IMPL", "lockstep")
if IMPL not in ("torch", "lockstep"):
    raise SystemExit(f"LOCKSTEP_SUITE_IMPL must be 'torch' or 'lockstep', got {IMPL!r}")

import torch  # noqa: E402,F401  (before torch's testing modules)
from torch.testing._internal.common_distributed import MultiProcessTestCase  # noqa: E402
from torch.testing._internal.distributed import ddp_under_dist_autograd_test as ddp_rpc  # noqa: E402
from torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture import (  # noqa: E402
    TensorPipeRpcAgentTestFixture,
)

if IMPL == "lockstep":  # at import, so in every spawned rank too (spawn re-imports this module)
    import lockstep

    ddp_rpc.DistributedDataParallel = lockstep.DistributedDataParallel


class TestDdpComparison(TensorPipeRpcAgentTestFixture, ddp_rpc.DdpComparisonTest, MultiProcessTestCase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


class TestDdpUnderDistAutograd(TensorPipeRpcAgentTestFixture, ddp_rpc.DdpUnderDistAutogradTest, MultiProcessTestCase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


def main(argv: list[str]) -> int:
    wanted = [a for a in argv if not a.startswith("-")]
    suite = unittest.TestSuite()
    for cls in (TestDdpComparison, TestDdpUnderDistAutograd):
        for name in unittest.TestLoader().getTestCaseNames(cls):
            if not wanted or any(w in name for w in wanted):
                suite.addTest(cls(name))
    names = [t._testMethodName for t in suite]  # before run(): a suite lets go of its tests as they finish
    ddp = ddp_rpc.DistributedDataParallel
    print(f"impl={IMPL} ddp={ddp.__module__}.{ddp.__qualname__} tests={suite.countTestCases()}", flush=True)
    result = unittest.TextTestRunner(verbosity=2, stream=sys.stdout).run(suite)
    # One machine-readable line per test at the end (the ranks may print between a test's name and its outcome).
    outcome = {t._testMethodName: "failed" for t, _ in result.failures + result.errors}
    outcome.update({t._testMethodName: "skipped" for t, _ in result.skipped})
    for name in names:
        print(f"RESULT {name} {outcome.get(name, 'passed')}", flush=True)
    return 0 if result.wasSuccessful() and not result.skipped else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
