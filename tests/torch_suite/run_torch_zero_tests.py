"""Run PyTorch's own ZeroRedundancyOptimizer tests against lockstep's class.

torch's tests live in pytorch's source tree (``test/distributed/optim/test_zero_redundancy_optimizer.py``), which
the torch wheel does not install, and lockstep does not copy them: this runner imports the file from a pytorch
checkout. Where none is given it exits 3 saying so (``tests/test_torch_zero_suite.py`` then skips, with that reason).

The file's two classes (``TestZeroRedundancyOptimizerSingleRank``, world size 1, and ``...Distributed``, world
size 2 on a machine without GPUs) run on gloo with the names swapped in the test module's namespace:

* ``ZeroRedundancyOptimizer`` -> ``lockstep.ZeroRedundancyOptimizer``
* ``DDP``                     -> ``lockstep.DistributedDataParallel`` (the parity and join tests build one)

In CPU mode (the default) ``skip_if_no_gpu`` is made a no-op before the file is imported, so the tests that gate
on a GPU per rank but run on any device (step, closure, LR scheduler, parity with a local optimizer, state
consolidation) run on the CPU; the gates that need a real accelerator (``requires_accelerator_dist_backend``,
``skip_if_lt_x_gpu(4)``) stay. The ranks are forked (the test module is loaded from a path a spawned child could
not import).

Environment switches (all optional):

  LOCKSTEP_TORCH_TEST_DIR=DIR    pytorch's ``test/`` directory (a checkout of the installed torch's release)
  LOCKSTEP_SUITE_IMPL=torch|lockstep   whose ZeroRedundancyOptimizer and DDP (default lockstep)
  LOCKSTEP_SUITE_CPU_MAP=0|1     strip ``skip_if_no_gpu`` (default 1)
  LOCKSTEP_SUITE_FILTER=REGEX    run only the tests whose name matches
  LOCKSTEP_SUITE_OUT=FILE.json   per-test outcomes (default <tempdir>/lockstep-torch-zero-<impl>.json)

Run (from the repository root):
  LOCKSTEP_TORCH_TEST_DIR=~/pytorch/test python tests/torch_suite/run_torch_zero_tests.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import tempfile
import time
import traceback
import unittest
from pathlib import Path

os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"  # lockstep's autoload must not swap torch's DDP for the baseline
os.environ.pop("LOCKSTEP_AS_TORCH_DDP", None)
os.environ.setdefault("OMP_NUM_THREADS", "1")
MISSING_EXIT = 3
RELATIVE = Path("distributed") / "optim" / "test_zero_redundancy_optimizer.py"

IMPL = os.environ.get("LOCKSTEP_SUITE_IMPL", "lockstep").strip().lower()
CPU_MAP = os.environ.get("LOCKSTEP_SUITE_CPU_MAP", "1") == "1"


def test_file() -> Path | None:
    """torch's test file under LOCKSTEP_TORCH_TEST_DIR, or None."""
    root = os.environ.get("LOCKSTEP_TORCH_TEST_DIR")
    path = Path(root).expanduser() / RELATIVE if root else None
    return path if path is not None and path.is_file() else None


def load_module(path: Path):
    """torch's test module, with the GPU-per-rank gate stripped (CPU mode) and the implementation swapped."""
    from torch.testing._internal import common_distributed as cd

    if CPU_MAP:
        cd.skip_if_no_gpu = lambda fn: fn  # the file imports the name: patch it before the import
    spec = importlib.util.spec_from_file_location("torch_zero_tests", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    if IMPL == "lockstep":
        import lockstep

        module.ZeroRedundancyOptimizer = lockstep.ZeroRedundancyOptimizer
        module.DDP = lockstep.DistributedDataParallel
    return module


def _fork_ranks(self) -> None:
    import torch
    from torch.testing._internal.common_distributed import MultiProcessTestCase

    MultiProcessTestCase.setUp(self)  # the file store; DistributedTestBase.setUp would spawn the ranks
    os.environ["WORLD_SIZE"] = str(self.world_size)
    self._start_processes(torch.multiprocessing.get_context("fork").Process)


_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Failure)|AssertionError)\b.*$", re.M)


class _Recorder(unittest.TextTestResult):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.records: dict[str, dict] = {}
        self._t0 = 0.0

    def startTest(self, test):
        self._t0 = time.perf_counter()
        super().startTest(test)

    def _rec(self, test, outcome: str, detail: str = "") -> None:
        name = f"{type(test).__name__}.{test._testMethodName}"
        self.records[name] = {"outcome": outcome, "seconds": round(time.perf_counter() - self._t0, 2), "detail": detail}

    def addSuccess(self, test):
        super().addSuccess(test)
        self._rec(test, "passed")

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._rec(test, "skipped", str(reason))

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._rec(test, "failed", _short(err))

    def addError(self, test, err):
        super().addError(test, err)
        self._rec(test, "failed", _short(err))


def _short(err) -> str:
    text = "".join(traceback.format_exception(*err))
    hits = list(dict.fromkeys(m.group(0).strip() for m in _EXC_LINE.finditer(text)))
    return " | ".join(hits)[-500:] or text.strip().splitlines()[-1]


def main(argv: list[str]) -> int:
    path = test_file()
    if path is None:
        print(f"torch's {RELATIVE} is not here: the torch wheel does not install pytorch's test/ tree; set "
              "LOCKSTEP_TORCH_TEST_DIR to a pytorch checkout's test/ directory", file=sys.stderr)
        return MISSING_EXIT
    import torch

    module = load_module(path)
    classes = [module.TestZeroRedundancyOptimizerSingleRank, module.TestZeroRedundancyOptimizerDistributed]
    pattern = os.environ.get("LOCKSTEP_SUITE_FILTER", "")
    suite = unittest.TestSuite()
    for cls in classes:
        cls.setUp = _fork_ranks
        for name in sorted(n for n in dir(cls) if n.startswith("test_") and callable(getattr(cls, n))):
            if re.search(pattern, name) and (not argv or name in argv):
                suite.addTest(cls(name))
    t0 = time.perf_counter()
    result = unittest.TextTestRunner(resultclass=_Recorder, verbosity=2, stream=sys.stdout).run(suite)
    records = result.records  # type: ignore[attr-defined]
    out = os.environ.get("LOCKSTEP_SUITE_OUT") or os.path.join(tempfile.gettempdir(), f"lockstep-torch-zero-{IMPL}.json")
    with open(out, "w") as f:
        json.dump({"impl": IMPL, "cpu_map": CPU_MAP, "torch": torch.__version__, "file": str(path),
                   "wall_s": round(time.perf_counter() - t0, 1), "tests": records}, f, indent=1)
    for name, rec in records.items():
        print(f"{name:90s} {rec['outcome']:8s} {rec['seconds']:6.1f}  {rec['detail'][:150]}")
    counts = {k: sum(1 for r in records.values() if r["outcome"] == k) for k in ("passed", "skipped", "failed")}
    print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped ({IMPL}; JSON: {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
