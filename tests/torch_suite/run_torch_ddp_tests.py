"""Run PyTorch's own DDP tests (torch/testing/_internal/distributed/distributed_test.py) against lockstep.

The test class is torch's ``test/distributed/test_distributed_spawn.py`` composition,
``TestDistBackend + DistributedTest._DistTestBase`` (gloo, world size 2), restricted to the
methods whose name contains ``ddp`` or ``DistributedDataParallel`` (case-insensitive) and those in ``BUILDS_DDP``
(they build a DDP model under another name), with
the DDP class swapped in the namespaces the test module uses:

* ``distributed_test.DistributedDataParallel``   (the module global, ``from torch.nn.parallel import ...``)
* ``torch.nn.parallel.DistributedDataParallel``  (``nn.parallel.DistributedDataParallel`` and
  ``torch.nn.parallel.DistributedDataParallel`` in the tests; ``torch.nn.parallel.distributed``'s own
  name is left alone, so torch internals keep their class)
* ``distributed_test.DistributedSampler``         (only ``test_DistributedSampler_padding`` uses it)

The swap runs when this module is imported, i.e. in the parent and again in every rank process
(``spawn`` re-imports this module to unpickle ``cls._run``); ``_run`` applies it once more before the
test body, so it cannot be missed.

Environment switches (all optional):

  LOCKSTEP_SUITE_IMPL=torch|lockstep   which DDP/DistributedSampler (default lockstep)
  LOCKSTEP_SUITE_CPU_MAP=0|1           run the GPU-gated tests on CPU: strip skip_if_lt_x_gpu /
                                       skip_if_no_gpu, map CUDA devices to CPU (see _cpu_map), drop
                                       device_ids/output_device for CPU modules (default 0)
  LOCKSTEP_SUITE_START=spawn|fork      how the 2 rank processes start (default spawn, as torch's CI:
                                       ~15 s/test here, mostly 2x re-importing torch + the test module;
                                       fork: ~0.5 s/test, same outcomes in every run compared here)
  LOCKSTEP_SUITE_FILTER=REGEX          further restrict the selection (re.search on the test name)
  LOCKSTEP_SUITE_EXTRA=REGEX           add other _DistTestBase tests (e.g. DistributedSampler_padding)
  LOCKSTEP_SUITE_FAST_SKIP=0|1         (default 1) skip GPU-gated tests in the parent instead of
                                       spawning 2 ranks that exit with the skip code (same outcome)
  LOCKSTEP_SUITE_COMPAT=0|1           diagnostic: give lockstep's class torch's plain attributes (no logic) to
                                       see whether the behaviour behind an AttributeError is right
  LOCKSTEP_SUITE_OUT=FILE.json         where ``python run_torch_ddp_tests.py`` writes per-test results
                                       (default: <tempdir>/lockstep-torch-suite-<impl>[-cpumap][-fork].json)
  LOCKSTEP_SRC=DIR                     diagnostic: another lockstep source tree put first on sys.path
                                       (default: unset, the installed lockstep is used)
  BACKEND / WORLD_SIZE / TEMP_DIR / DISTRIBUTED_TESTS_DEFAULT_TIMEOUT  default gloo / 2 / a temp dir / 180

torch's ``common_utils`` imports ``expecttest`` (in lockstep's ``dev`` extra).
``tests/test_torch_ddp_suite.py`` runs this module once (CPU-map, fork) and checks the outcomes.

Run (from the repository root):
  LOCKSTEP_SUITE_IMPL=torch    nice -n 10 python tests/torch_suite/run_torch_ddp_tests.py   # table + JSON
  LOCKSTEP_SUITE_IMPL=lockstep nice -n 10 python tests/torch_suite/run_torch_ddp_tests.py
  LOCKSTEP_SUITE_IMPL=lockstep LOCKSTEP_SUITE_CPU_MAP=1 LOCKSTEP_SUITE_START=fork \
      nice -n 10 python tests/torch_suite/run_torch_ddp_tests.py
  LOCKSTEP_SUITE_IMPL=lockstep nice -n 10 python -m pytest -q tests/torch_suite/run_torch_ddp_tests.py -k uneven
  python tests/torch_suite/run_torch_ddp_tests.py --list                    # the selection
  python tests/torch_suite/run_torch_ddp_tests.py test_ddp_create_graph     # named tests only
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
import time
import types
import unittest

# ----------------------------------------------------------------------------- environment
# Before torch's test modules are imported: they read BACKEND / WORLD_SIZE / the timeout at import.
# lockstep registers a ``torch.backends`` entry point (lockstep.integrations.autoload) that ``import torch`` runs;
# with LOCKSTEP_AS_TORCH_DDP=1 it would swap torch's own class behind our back (the "torch" baseline would be
# lockstep), and with LOCKSTEP_SRC pointing at an older tree it may not exist. Neither may touch the comparison.
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
os.environ.pop("LOCKSTEP_AS_TORCH_DDP", None)
os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "180")
os.environ.setdefault("PYTORCH_PRINT_REPRO_ON_FAILURE", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # 2 ranks on 2 shared cores: no intra-op oversubscription
if "TEMP_DIR" not in os.environ:  # setUp makes a fresh one per test anyway (initialize_temp_directories)
    import atexit
    import shutil

    _tmp = tempfile.mkdtemp(prefix="torchsuite_")
    os.makedirs(os.path.join(_tmp, "barrier"), exist_ok=True)
    os.environ["TEMP_DIR"] = _tmp  # the rank processes inherit it, so only the parent creates (and removes) it
    atexit.register(shutil.rmtree, _tmp, True)

if os.environ.get("LOCKSTEP_SRC"):  # diagnostic override; by default the installed lockstep is used
    sys.path.insert(0, os.path.abspath(os.environ["LOCKSTEP_SRC"]))

try:
    import expecttest  # noqa: F401  (torch.testing._internal.common_utils imports it)
except ImportError:
    raise SystemExit("torch's test utilities need the expecttest package: pip install expecttest "
                     "(it is in lockstep's dev extra)") from None

IMPL = os.environ.get("LOCKSTEP_SUITE_IMPL", "lockstep").strip().lower()
if IMPL not in ("torch", "lockstep"):
    raise SystemExit(f"LOCKSTEP_SUITE_IMPL must be torch or lockstep, got {IMPL!r}")
CPU_MAP = os.environ.get("LOCKSTEP_SUITE_CPU_MAP", "0") == "1"
START = os.environ.get("LOCKSTEP_SUITE_START", "spawn")
FAST_SKIP = os.environ.get("LOCKSTEP_SUITE_FAST_SKIP", "1") == "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.parallel  # noqa: E402
from torch.testing._internal import common_distributed as cd  # noqa: E402
from torch.testing._internal.distributed import distributed_test as dt  # noqa: E402

TORCH_DDP = torch.nn.parallel.distributed.DistributedDataParallel
TORCH_SAMPLER = torch.utils.data.distributed.DistributedSampler
if TORCH_DDP.__module__ != "torch.nn.parallel.distributed" or TORCH_SAMPLER.__module__ != "torch.utils.data.distributed":
    raise SystemExit(f"torch's own DDP/DistributedSampler were replaced before this runner: {TORCH_DDP}, {TORCH_SAMPLER}")

# ----------------------------------------------------------------------------- selection
_Base = dt.DistributedTest._DistTestBase
_SELECT = re.compile(r"ddp|distributeddataparallel", re.IGNORECASE)


# Tests that build a DistributedDataParallel but have neither word in their name (found by reading the file for
# ``DistributedDataParallel(`` outside the selected tests, torch 2.13); those a release lacks are left out.
BUILDS_DDP = (
    "test_compute_bucket_assignment_by_size_sparse_error_with_logger",
    "test_compute_bucket_assignment_by_size_sparse_error_without_logger",
    "test_get_data_parallel_params",
    "test_invalid_static_graph",
    "test_output_unused_in_loss_dict_module",
    "test_output_unused_in_loss_tuple_module",
    "test_post_localSGD_optimizer_parity",
    "test_post_localSGD_optimizer_parity_grad_is_view",
    "test_post_localSGD_optimizer_parity_with_hierarchical_sgd",
    "test_post_localSGD_optimizer_parity_with_hierarchical_sgd_grad_is_view",
    "test_post_localSGD_optimizer_step_reload",
    "test_static_graph_api_cpu",
    "test_sync_bn_logged",
    "test_undefined_grad_parity_unused_parameters",
    "test_verify_model_across_rank_with_logger",
    "test_verify_model_across_rank_without_logger",
)


def all_ddp_tests() -> list[str]:
    """The methods of _DistTestBase whose name contains ddp / DistributedDataParallel (case-insensitive), and
    ``BUILDS_DDP``."""
    named = [n for n in dir(_Base) if n.startswith("test") and _SELECT.search(n) and callable(getattr(_Base, n))]
    return sorted(named + [n for n in BUILDS_DDP if hasattr(_Base, n)])


def selected_tests() -> list[str]:
    names = all_ddp_tests()
    extra = os.environ.get("LOCKSTEP_SUITE_EXTRA")
    if extra:
        names += [n for n in dir(_Base) if n.startswith("test") and re.search(extra, n) and n not in names]
    flt = os.environ.get("LOCKSTEP_SUITE_FILTER")
    if flt:
        names = [n for n in names if re.search(flt, n)]
    return sorted(names)


SELECTED = selected_tests()

# ----------------------------------------------------------------------------- GPU gates
def _dummy():
    pass


# Code objects of the inner wrappers of torch's GPU-count gates: every use of the decorator shares them.
_GATE_CODES = {
    cd.skip_if_lt_x_gpu(2)(_dummy).__code__: "skip_if_lt_x_gpu",
    cd.skip_if_no_gpu(_dummy).__code__: "skip_if_no_gpu",
}


def gpu_gates(fn) -> list[str]:
    """The GPU-count gates among ``fn``'s decorators (followed through ``__wrapped__``)."""
    found = []
    while fn is not None:
        name = _GATE_CODES.get(getattr(fn, "__code__", None))
        if name == "skip_if_lt_x_gpu":
            cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
            name = f"skip_if_lt_x_gpu({cells['x'].cell_contents})" if "x" in cells else name
        if name:
            found.append(name)
        fn = getattr(fn, "__wrapped__", None)
    return found


def strip_gpu_gates(fn, replace_inner=None):
    """``fn`` without its GPU-count gate wrappers; other wrappers (with_dist_debug_levels...) are kept.

    A kept wrapper is copied with its ``func`` closure cell pointing at the rebuilt inner function.
    ``replace_inner(f)`` (optional) gives the function to use instead of the innermost, undecorated one.
    """
    if getattr(fn, "__code__", None) in _GATE_CODES:
        return strip_gpu_gates(fn.__wrapped__, replace_inner)
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        return replace_inner(fn) if replace_inner else fn
    new_inner = strip_gpu_gates(inner, replace_inner)
    if new_inner is inner:
        return fn
    closure = tuple(
        types.CellType(new_inner) if c.cell_contents is inner else c for c in (fn.__closure__ or ())
    )
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, closure)
    copy.__dict__.update(fn.__dict__)
    copy.__wrapped__ = new_inner
    copy.__qualname__, copy.__doc__, copy.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


# CPU-map only: source edits that keep a test's subject but make it CPU-sized.
SOURCE_PATCHES = {
    # a 1000x1000 input through Conv2d(32, 256, 5) is ~200 GFLOP per forward: hours on 1 CPU thread
    "test_ddp_uneven_inputs": [("dim = 1000", "dim = 64")],
}


def _patched_source(fn):
    """``fn`` (an undecorated _DistTestBase method) recompiled from its source with SOURCE_PATCHES applied."""
    import inspect
    import textwrap

    edits = SOURCE_PATCHES.get(fn.__name__)
    if not edits:
        return fn
    src = textwrap.dedent(inspect.getsource(fn))
    src = src[src.index("def "):]  # decorators are handled by strip_gpu_gates' chain
    for old, new in edits:
        if old not in src:
            raise RuntimeError(f"source patch for {fn.__name__}: {old!r} not found (torch changed?)")
        src = src.replace(old, new)
    ns: dict = {}
    exec(compile(src, inspect.getsourcefile(fn), "exec"), fn.__globals__, ns)
    return ns[fn.__name__]


# ----------------------------------------------------------------------------- CPU mapping
def _is_cuda(d) -> bool:
    if isinstance(d, bool):
        return False
    if isinstance(d, int):
        return True  # an int device is a CUDA ordinal
    if isinstance(d, str):
        return d.startswith("cuda")
    return isinstance(d, torch.device) and d.type == "cuda"


class _CudaToCpu(torch.overrides.TorchFunctionMode):
    """Every CUDA device a torch call names becomes the CPU (``device=``, ``Tensor.to``, ``.cuda()``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to:  # args[0] is the tensor
            args = tuple(("cpu" if (i > 0 and _is_cuda(a)) else a) for i, a in enumerate(args))
        elif func is torch._C._nn._parse_to:  # nn.Module.to(...)'s argument parser
            args = tuple(("cpu" if _is_cuda(a) else a) for a in args)
        return func(*args, **kwargs)


class _FakeStream:
    def __init__(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def wait_stream(self, *a):
        pass

    def wait_event(self, *a):
        pass

    def record_event(self, *a):
        return None


def _cpu_map_patch_cuda(rank: int) -> None:
    """torch.cuda calls the tests make, as no-ops / CPU answers (in the rank processes only)."""
    c = torch.cuda
    c.set_device = lambda *a, **k: None
    c.synchronize = lambda *a, **k: None
    c.current_device = lambda: rank
    c.device_count = lambda: int(os.environ["WORLD_SIZE"])
    c.device = lambda *a, **k: contextlib.nullcontext()
    c.Stream = _FakeStream
    c.stream = lambda *a, **k: contextlib.nullcontext()
    c.current_stream = lambda *a, **k: _FakeStream()
    c.empty_cache = lambda: None
    if hasattr(torch, "accelerator"):  # torch >= 2.6; optimizer_overlap_hooks asks it for the stream
        torch.accelerator.current_stream = lambda *a, **k: _FakeStream()


def _cpu_shim(ddp_cls, tag):
    """``ddp_cls`` accepting ``device_ids=[rank]`` / ``output_device`` for a CPU module (they are dropped).

    A module-level class (``CpuMapped_<tag>``) so that ``torch.save(model_DDP)`` can pickle it by name.
    """

    def __init__(self, module, device_ids=None, output_device=None, *args, **kwargs):
        if all(p.device.type == "cpu" for p in module.parameters()):
            device_ids, output_device = None, None
        ddp_cls.__init__(self, module, device_ids, output_device, *args, **kwargs)

    name = f"CpuMapped_{tag}"
    cls = type(name, (ddp_cls,), {"__init__": __init__, "__module__": __name__, "__qualname__": name})
    globals()[name] = cls
    return cls


def _compat_shim(ddp_cls):
    """Diagnostic only (LOCKSTEP_SUITE_COMPAT=1): lockstep's class plus torch's plain attributes / no-op hooks.

    Each addition is a value or a one-line alias with no logic, so a test that passes with it shows that
    lockstep's *behaviour* was right and only the attribute was missing.
    """

    def __init__(self, module, *args, **kwargs):
        ddp_cls.__init__(self, module, *args, **kwargs)
        caps = kwargs.get("bucket_cap_mb_list")
        self.bucket_bytes_cap_list = [int(c * 1024 * 1024) for c in caps] if caps else []
        self.device_mesh = kwargs.get("device_mesh")
        self.broadcast_bucket_size = int(250 * 1024 * 1024)  # torch's value

    ns = {
        "__init__": __init__,
        "forward_sync_buffers": property(lambda self: self.broadcast_buffers),
        "_set_ddp_sink_clone": lambda self, val: None,  # lockstep never clones outputs
        "_remove_autograd_hooks": lambda self: self.reducer.remove_hooks(),
        "__module__": __name__,
        "__qualname__": "Compat_lockstep",
    }
    cls = type("Compat_lockstep", (ddp_cls,), ns)
    globals()["Compat_lockstep"] = cls
    return cls


# ----------------------------------------------------------------------------- the swap
def impl_classes():
    if IMPL == "torch":
        ddp, sampler = TORCH_DDP, TORCH_SAMPLER
    else:
        import lockstep

        ddp, sampler = lockstep.DistributedDataParallel, lockstep.DistributedSampler
        if os.environ.get("LOCKSTEP_SUITE_COMPAT") == "1":
            ddp = _compat_shim(ddp)
    return (_cpu_shim(ddp, IMPL) if CPU_MAP else ddp), sampler


_SWAPPED: tuple | None = None


def apply_swap() -> None:
    global _SWAPPED
    if _SWAPPED is None:
        _SWAPPED = impl_classes()
    ddp, sampler = _SWAPPED
    dt.DistributedDataParallel = ddp
    torch.nn.parallel.DistributedDataParallel = ddp
    dt.DistributedSampler = sampler


apply_swap()

# ----------------------------------------------------------------------------- the test class
class TestTorchDDPSuite(dt.TestDistBackend, _Base):
    """torch's TestDistBackendWithSpawn, DDP tests only, with the selected DDP class."""

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):
        apply_swap()  # already done at import in this process; harmless, and explicit
        if CPU_MAP:
            _cpu_map_patch_cuda(rank)
            mode = _CudaToCpu()
            mode.__enter__()  # for the rest of this rank process (it exits after the test)
        super()._run(rank, test_name, file_name, pipe, **kwargs)

    def setUp(self):
        method = getattr(type(self), self._testMethodName, None)
        if FAST_SKIP and not CPU_MAP and not (torch.cuda.is_available() and torch.cuda.device_count() >= 2):
            gates = gpu_gates(method)
            if gates:  # the ranks would exit with TEST_SKIPS' code: same outcome without 2 spawns
                raise unittest.SkipTest(f"GPU-gated ({', '.join(gates)}): {cd.TEST_SKIPS['multi-gpu-2'].message}")
        super().setUp()
        if START == "fork":
            self._start_processes(torch.multiprocessing.get_context("fork").Process)
        else:
            self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()


# Only the selection is collected (unittest and pytest ignore non-callable attributes). Not None:
# TestDistBackend.setUp reads ``self.test_ddp_has_finalized.__wrapped__`` whatever the selection.
_HIDDEN = types.SimpleNamespace(__wrapped__=None)
for _name in dir(_Base):
    if _name.startswith("test") and _name not in SELECTED:
        setattr(TestTorchDDPSuite, _name, _HIDDEN)
if CPU_MAP:
    for _name in SELECTED:
        setattr(TestTorchDDPSuite, _name, strip_gpu_gates(getattr(_Base, _name), _patched_source))

TestTorchDDPSuite.__name__ = TestTorchDDPSuite.__qualname__ = "TestTorchDDPSuite"


# ----------------------------------------------------------------------------- standalone runner
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Failure)|AssertionError)\b.*$", re.M)


def _short_error(text: str) -> str:
    """The exception line of each failing rank's traceback (deduplicated), or of the parent's error."""
    blocks = re.split(r"Process \d+ exited with error code \d+ and exception:\n", text)[1:] or [text]
    found = []
    for block in blocks:
        hits = [m.group(0).strip() for m in _EXC_LINE.finditer(block)]
        line = hits[-1] if hits else block.strip().splitlines()[-1:] and block.strip().splitlines()[-1]
        if line and line not in found:
            found.append(line)
    return " | ".join(found)[:500]


class _Recorder(unittest.TextTestResult):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.records: dict[str, dict] = {}
        self._t0 = 0.0

    def startTest(self, test):
        self._t0 = time.perf_counter()
        super().startTest(test)

    def _rec(self, test, outcome, detail=""):
        self.records[test._testMethodName] = {
            "outcome": outcome,
            "seconds": round(time.perf_counter() - self._t0, 2),
            "detail": detail,
        }

    def addSuccess(self, test):
        super().addSuccess(test)
        self._rec(test, "passed")

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._rec(test, "skipped", str(reason))

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._rec(test, "failed", _short_error(self._exc_info_to_string(err, test)))

    def addError(self, test, err):
        super().addError(test, err)
        self._rec(test, "failed", _short_error(self._exc_info_to_string(err, test)))

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._rec(test, "passed", "expected failure")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._rec(test, "failed", "unexpected success")


def _impl_name(cls) -> str:
    """The DDP class under the runner's shims (CpuMapped_* / Compat_*)."""
    while cls.__module__ == __name__:
        cls = cls.__mro__[1]
    return f"{cls.__module__}.{cls.__qualname__}"


def main(argv: list[str]) -> int:
    if "--list" in argv:
        for n in SELECTED:
            gates = gpu_gates(getattr(_Base, n))
            why = getattr(getattr(_Base, n), "__unittest_skip_why__", None)
            print(f"{n:70s} {'skip@decoration: ' + why if why else ', '.join(gates)}")
        print(f"{len(SELECTED)} tests selected of {sum(1 for n in dir(_Base) if n.startswith('test'))} in _DistTestBase")
        return 0
    asked = [a for a in argv if not a.startswith("-")]
    # A name this torch's _DistTestBase lacks (added or removed in another release) is not run; the JSON's
    # "selection" says which tests this release has.
    names = [n for n in asked if hasattr(_Base, n)] if asked else SELECTED
    suite = unittest.TestSuite(TestTorchDDPSuite(n) for n in names)
    tag = f"{IMPL}{'-cpumap' if CPU_MAP else ''}{'-fork' if START == 'fork' else ''}"
    out = os.path.abspath(os.environ.get("LOCKSTEP_SUITE_OUT")
                          or os.path.join(tempfile.gettempdir(), f"lockstep-torch-suite-{tag}.json"))
    print(f"impl={IMPL} cpu_map={CPU_MAP} start={START} tests={len(names)} backend={os.environ['BACKEND']} "
          f"world_size={os.environ['WORLD_SIZE']} ddp={_impl_name(dt.DistributedDataParallel)}"
          + (f" lockstep={os.path.dirname(sys.modules['lockstep'].__file__)}" if IMPL == "lockstep" else ""), flush=True)
    t0 = time.perf_counter()
    result = unittest.TextTestRunner(resultclass=_Recorder, verbosity=2, stream=sys.stdout).run(suite)
    wall = time.perf_counter() - t0
    recs = result.records
    counts = {k: sum(1 for r in recs.values() if r["outcome"] == k) for k in ("passed", "skipped", "failed")}
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"impl": IMPL, "cpu_map": CPU_MAP, "start": START, "wall_s": round(wall, 1),
                   "torch": torch.__version__, "selection": SELECTED,
                   "counts": counts, "tests": recs}, f, indent=1, sort_keys=True)
    print(f"\n{'test':70s} {'outcome':8s} {'s':>6s}  detail")
    for n in sorted(recs):
        r = recs[n]
        print(f"{n:70s} {r['outcome']:8s} {r['seconds']:6.1f}  {r['detail'][:150]}")
    print(f"\n[{tag}] {counts['passed']} passed / {counts['skipped']} skipped / {counts['failed']} failed "
          f"of {len(recs)} in {wall:.0f} s -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
