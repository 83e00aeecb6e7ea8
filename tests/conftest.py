"""The suite's shared set-up: tests/ importable in spawned ranks, and how pytest-xdist shares the files out.

pyproject.toml's addopts run the suite on three xdist workers (``-n 3 --dist loadgroup``; on 2 cores a third
uses what the files that wait for launches leave), so that the README's command, which CI runs, is the parallel
one. A unit of work is a whole file, never less: a file starts its spawned group once, in a module-scoped
fixture, and a file split across workers would start it on each (the scheduler below). Two units span several
files (``pytest.mark.xdist_group``, set here): the files whose assertions are about time with a margin one more
busy process can eat (``TIMING``) run last, alone, one after another on one worker; the files that build the
same network namespaces (``NETNS``: one pair of addresses) run one after another on one worker, first, beside
the other files. The slowest other files go first (``SLOWEST_FIRST``), so that the workers end together instead
of one starting a long file at the end. ``-n 0`` runs everything in this process, one test after another (``-s``
needs it).
"""

import os
import sys

import pytest

# Spawned ranks unpickle test functions by module name: make tests/ importable in them.
sys.path.insert(0, os.path.dirname(__file__))
# PYTHONDONTWRITEBYTECODE (set in this machine's image and CI's) made every interpreter the suite starts (~600: ranks,
# launchers, scripts) compile lockstep's modules and the tests' scripts again, ~0.2 CPU-s each: they write and read
# __pycache__ instead (git ignores it).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# Files whose assertions are about time with a margin that one more busy process can eat: a hang reported within
# 2 x its 6 s timeout, a straggler named from its wait standing out of the step noise, the plan's fit to a measured
# all-reduce, a collective with a lost peer failing within 10 s. They form one unit of work, "timing", that runs last
# and alone: one file after another on one worker, once the other worker has finished and left, so that they see the
# machine as a run without xdist did. Not here, though they time things: the launcher's files (test_launch,
# test_launch_reports, test_faults: bounds of 10-120 s on events that take 1-5 s, passed with the machine at load
# 4-24), test_grad_hook.py (the slow-wire rule needs 16 MiB of gradients, its model has 40 KiB) and
# test_launch_network.py (its bounds, 60 and 90 s, are 10 x a give-up that takes 2-6 s).
TIMING = {"test_hang.py", "test_trainer_features.py", "test_collectives.py", "test_plan.py"}
# Files that build the same two network namespaces (10.201.0.1 and .2): one unit, "netns", one file after the other.
# Their bounds (a lost node noticed within its heartbeat timeout + 25 s, in-place recovery within 30 s against a goal
# of 5 s, a restart within 90 s) leave room for the file beside them; the longest unit, so it starts first.
NETNS = {"test_multinode.py", "test_elastic_launch.py", "test_link_default.py", "test_walkthrough.py"}
# The other units that take longest, longest first (seconds of -n0 runs of one file, 2026-11-26, the machine's load
# 1-13 from other jobs, after run_ranks forked its ranks from a preloaded forkserver: ~130, 104, 60, 52, 51, 44, 40,
# 38, 37, 34, 31, 30, 30; the launcher's three files ~57, 56, 49 in the xdist run of 2026-11-26; under xdist beside
# another file each takes ~1.5-2 x that); the other files follow in collection order, then the timing group.
SLOWEST_FIRST = [
    *sorted(NETNS), "test_wrapping_libraries.py", "test_inplace_loopback.py", "test_exits.py", "test_bench.py",
    "test_launch.py", "test_faults.py", "test_docs.py", "test_launch_reports.py", "test_compile.py",
    "test_torch_ddp_suite.py", "test_memory.py", "test_demo.py", "test_comm_hooks.py", "test_ddp_parity.py",
    "test_examples.py", "test_launch_network.py", "test_trainer.py",
]


def pytest_configure(config: pytest.Config) -> None:
    # Declared here too, so that a run without xdist knows the mark.
    config.addinivalue_line("markers", "xdist_group(name): run these files' tests on one worker, one after another")


def _order(item: pytest.Item) -> int:
    if item.path.name in TIMING:
        return len(SLOWEST_FIRST) + 1
    return SLOWEST_FIRST.index(item.path.name) if item.path.name in SLOWEST_FIRST else len(SLOWEST_FIRST)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in TIMING:
            item.add_marker(pytest.mark.xdist_group("timing"))
        elif item.path.name in NETNS:
            item.add_marker(pytest.mark.xdist_group("netns"))
    # Stable: each file's tests keep their order, and every worker sorts alike (xdist checks they collected alike).
    items.sort(key=_order)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """Units of work are files, or an ``xdist_group`` across files, in the order collected; "timing" runs alone."""
    from xdist.scheduler import LoadGroupScheduling

    class FileOrGroupScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            # The unit from the file's name, not from the "@<group>" that xdist appends to a grouped test's id: with
            # pytest 9.2 that suffix no longer appears (xdist 3.8), and every file ran as a unit of its own, the
            # timing group beside the others (a fresh venv's run, 2026-11-26: test_plan's fit failed under load).
            path = nodeid.split("::", 1)[0].split("@", 1)[0]
            name = os.path.basename(path)
            return "timing" if name in TIMING else "netns" if name in NETNS else path

        def _assign_work_unit(self, node) -> None:
            others = [other for other in self.nodes if other is not node]
            if next(iter(self.workqueue)) == "timing" and others:
                # A worker runs its last test only once it is sent more work or told to stop: at 1 test left
                # everywhere, the others are told to stop, and the unit goes out when they are gone (remove_node).
                if all(self._pending_of(self.assigned_work[n]) <= 1 for n in self.nodes):
                    for other in others:
                        if not other.shutting_down:
                            other.shutdown()
                return
            super()._assign_work_unit(node)

        def remove_node(self, node):
            crashed = super().remove_node(node)
            for other in self.nodes:
                self._reschedule(other)
            return crashed

    config.option.loadscopereorder = False  # keep SLOWEST_FIRST's order, not the files' test counts
    return FileOrGroupScheduling(config, log)
