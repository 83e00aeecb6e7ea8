"""The package's parts depend on each other one way only, with no import cycles, and every public
name the README and the docs show imports.

Imports are read from the source (ast), lazy ones inside functions included, so a wrong-way import
fails here before it can become a cycle at run time. The layers are the table in the "Layout" section
of docs/architecture.md; a part may import only parts on a lower layer.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "lockstep"

# part -> layer. A part is a subpackage or a top-level module; a module may import parts of lower layers.
LAYERS = {
    "slurm": 0, "sampler": 0, "network": 0, "code_paths": 0, "costmodel": 0, "keys": 0,
    "process_group": 1,
    "collectives": 2,
    "comm_hooks": 3, "optim": 3,
    "ddp": 4, "diagnostics": 4,
    "launch": 5, "perf": 5, "integrations": 5,
    "train": 6,
    "__init__": 7, "cli": 8, "__main__": 9,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def part_of(module: str) -> str:
    """``lockstep.ddp.reducer`` -> ``ddp``; ``lockstep.sampler`` -> ``sampler``; ``lockstep`` -> ``__init__``."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else "__init__"


def is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:]) if "." in name else Path()
    return (PACKAGE / rel).with_suffix(".py").exists() or (PACKAGE / rel / "__init__.py").exists()


def lockstep_imports(source: str) -> list[tuple[int, str]]:
    """(line, imported lockstep module) for every import in ``source``, lazy ones included."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("lockstep")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lockstep") and not node.level:
            for alias in node.names:  # `from lockstep.train import checkpoint` imports a module
                candidate = f"{node.module}.{alias.name}"
                found.append((node.lineno, candidate if is_module(candidate) else node.module))
    return found


# Same-layer or upward imports allowed by name, each one way (the reverse stays forbidden):
# ddp builds the diagnostics its arguments ask for (DDP(trace_dir=..., detect_nonfinite=...)). The cost model
# (pure arithmetic that imports nothing of lockstep) is a leaf of its own at the bottom, below the DDP, so that the
# timeline summary prices all-reduces with it; perf/ (plan, the benchmark commands) sits above the DDP.
ALLOWED = {("ddp", "lockstep.diagnostics")}


def wrong_way_imports(module: str, source: str) -> list[str]:
    here = part_of(module)
    bad = []
    for line, target in lockstep_imports(source):
        there = part_of(target)
        if any(here == a and (target == b or target.startswith(b + ".")) for a, b in ALLOWED):
            continue
        if there != here and LAYERS[there] >= LAYERS[here]:
            bad.append(f"{module}:{line} imports {target} ({here} is layer {LAYERS[here]}, {there} is layer {LAYERS[there]})")
    return bad


def all_modules() -> dict[str, str]:
    return {module_name(p): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_part_has_a_layer():
    assert {part_of(m) for m in all_modules()} <= set(LAYERS)


def test_imports_point_down_the_layers():
    bad = [b for module, source in all_modules().items() for b in wrong_way_imports(module, source)]
    assert not bad, "wrong-way imports:\n" + "\n".join(bad)


def test_checker_catches_a_wrong_way_import():
    # The rule must be able to fail: the reducer reaching up into the Trainer, and a hook into the wrapper.
    assert wrong_way_imports("lockstep.ddp.reducer", "from lockstep.train.trainer import Trainer\n")
    assert wrong_way_imports("lockstep.comm_hooks.stages", "def f():\n    import lockstep.ddp.wrapper\n")
    assert not wrong_way_imports("lockstep.train.trainer", "from lockstep.ddp.wrapper import DistributedDataParallel\n")
    # The allowed exception is one way: diagnostics never import ddp; nor perf (its commands sit above the DDP).
    assert not wrong_way_imports("lockstep.ddp.diagnose", "from lockstep.diagnostics.trace import TraceRecorder\n")
    assert wrong_way_imports("lockstep.diagnostics.trace", "from lockstep.ddp.observe import attach\n")
    assert wrong_way_imports("lockstep.diagnostics.timeline", "from lockstep.perf.plan import make_plan\n")


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles():
    graph = {m: {t for _, t in lockstep_imports(src) if t != m} for m, src in all_modules().items()}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]


# STYLE.md: a module as long as its one concept needs, functions about 60 lines. A file cap pushed the reducer into
# small files (a step came to touch 18 of them); the limit is on functions: none over 120 lines, and no more over 60
# than there were when the file cap went (15, 2026-11-26), so the count can only go down.
FUNCTION_LINES, LONG_FUNCTION_LINES, LONG_FUNCTIONS_ALLOWED = 120, 60, 15


def function_lengths() -> dict[str, int]:
    """``module.function`` (nested and methods by their own name) -> its lines, decorators excluded."""
    lengths = {}
    for module, src in all_modules().items():
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lengths[f"{module}.{node.name}:{node.lineno}"] = node.end_lineno - node.lineno + 1
    return lengths


def test_functions_stay_readable():
    lengths = function_lengths()
    too_long = {f: n for f, n in lengths.items() if n > FUNCTION_LINES}
    assert not too_long, f"functions over {FUNCTION_LINES} lines: {too_long}"
    long = sorted((n, f) for f, n in lengths.items() if n > LONG_FUNCTION_LINES)
    assert len(long) <= LONG_FUNCTIONS_ALLOWED, f"more functions over {LONG_FUNCTION_LINES} lines than before: {long}"


DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_architecture_layout_table_matches_layers():
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## Layout"):]
    for part, layer in LAYERS.items():
        if part.startswith("__") or part == "cli":
            continue
        if (PACKAGE / part).is_dir() or (PACKAGE / f"{part}.py").exists():
            assert re.search(rf"^\| {layer} \|[^|]*\b{part}\b", section, re.M), f"docs/architecture.md layout table: {part} on layer {layer}"


def readme_names() -> list[str]:
    """Every dotted ``lockstep.*`` name and every ``from lockstep... import ...`` the README and docs/ show."""
    text = "\n".join(page.read_text() for page in DOC_PAGES)
    names = set(re.findall(r"\blockstep(?:\.[A-Za-z_]\w*)+", text))
    for module, parenthesised, single in re.findall(r"from (lockstep[\w.]*) import (?:\(([^)]*)\)|(.*))", text):
        imported = re.sub(r"#.*", "", parenthesised or single)
        for item in imported.split(","):
            if item.split():
                names.add(f"{module}.{item.split()[0]}")  # `Name as alias` -> Name
    return sorted(n.rstrip(".") for n in names)


@pytest.mark.parametrize("dotted", readme_names())
def test_readme_name_imports(dotted):
    pieces = dotted.split(".")
    obj = importlib.import_module(pieces[0])
    for i, piece in enumerate(pieces[1:], start=1):
        try:
            obj = getattr(obj, piece)
        except AttributeError:
            obj = importlib.import_module(".".join(pieces[: i + 1]))


# STYLE.md habit 8: an object's state lives with the object. The reducer's collaborators (observers, the non-finite
# check, the comm hook, the caps, ...) are set through its methods; no other module assigns to ``reducer.<attr>``.
REDUCER_MODULES = {"lockstep.ddp.reducer"}


def _assigned_targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, (ast.Assign, ast.Delete)):
        pending = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        pending = [node.target]
    else:
        return []
    found = []
    while pending:
        target = pending.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            pending += target.elts
        elif isinstance(target, ast.Starred):
            pending.append(target.value)
        else:
            found.append(target)
    return found


REDUCER_CLASSES = ("Reducer", "TorchReducer")  # the reducer and torch's surface of it (ddp/torch_surface.py)


def _is_reducer(node: ast.expr, names: frozenset[str] = frozenset()) -> bool:
    """``reducer``, ``self.reducer``, ``ddp.reducer``, ``self._reducer``, or a name bound to a reducer in the scope
    (``names``: ``self`` in a subclass of the reducer, a parameter annotated as one, a variable made by one)."""
    if isinstance(node, ast.Name) and node.id in names:
        return True
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name in ("reducer", "_reducer")


def _names_a_reducer(annotation: ast.expr | None) -> bool:
    text = ast.unparse(annotation) if annotation is not None else ""
    return any(re.search(rf"\b{cls}\b", text) for cls in REDUCER_CLASSES)


def _reducer_names(function: ast.AST, in_reducer_class: bool) -> frozenset[str]:
    """The names that hold a reducer inside ``function``: whatever name it is reached by."""
    names = set()
    if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        arguments = [*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs]
        if in_reducer_class and arguments:
            names.add(arguments[0].arg)  # self
        names |= {a.arg for a in arguments if _names_a_reducer(a.annotation)}
    for node in ast.walk(function):
        made = isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
            _names_a_reducer(node.value.func)
        annotated = isinstance(node, ast.AnnAssign) and _names_a_reducer(node.annotation)
        if made or annotated:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return frozenset(names)


def _scopes(tree: ast.AST) -> list[tuple[ast.AST, frozenset[str]]]:
    """Each function (and the module) with the names that hold a reducer in it."""
    scopes: list[tuple[ast.AST, frozenset[str]]] = [(tree, _reducer_names(tree, False))]
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            subclass = any(_names_a_reducer(base) for base in node.bases)
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    scopes.append((item, _reducer_names(item, subclass)))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            scopes.append((node, _reducer_names(node, False)))
    return scopes


def reducer_writes(module: str, source: str) -> list[str]:
    """``module:line target`` for each assignment (or setattr) to a reducer's attribute outside the reducer, through
    whatever name holds it."""
    if module in REDUCER_MODULES:
        return []
    bad = set()
    for scope, names in _scopes(ast.parse(source)):
        for node in ast.walk(scope):
            for target in _assigned_targets(node):
                while isinstance(target, ast.Subscript):  # reducer.caps[0] = ... writes the reducer's state too
                    target = target.value
                if isinstance(target, ast.Attribute) and _is_reducer(target.value, names):
                    bad.add(f"{module}:{node.lineno} {ast.unparse(target)}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                    and node.args and _is_reducer(node.args[0], names)):
                bad.add(f"{module}:{node.lineno} setattr({ast.unparse(node.args[0])}, ...)")
    return sorted(bad)


def test_only_the_reducer_writes_its_attributes():
    bad = [b for module, source in all_modules().items() for b in reducer_writes(module, source)]
    assert not bad, "reducer attributes assigned outside ddp/reducer.py (add a Reducer method):\n" + "\n".join(bad)


def test_checker_catches_a_reducer_write():
    # The rule must be able to fail, on each way the old tree wrote the reducer's attributes.
    assert reducer_writes("lockstep.ddp.diagnose", "ddp.reducer.observer = attach(ddp.reducer.observer, x)\n")
    assert reducer_writes("lockstep.ddp.wrapper", "self.reducer.comm_hook, self.reducer.comm_hook_state = h, s\n")
    assert reducer_writes("lockstep.ddp.overlap_step", "def f(reducer):\n    reducer.bucket_cap_bytes = 1\n")
    assert reducer_writes("lockstep.train.faults", "reducer.caps[0] += 1\nsetattr(reducer, 'x', 1)\n")
    assert not reducer_writes("lockstep.ddp.reducer", "self.observer = attach(self.observer, x)\n")
    # through any name: self in a subclass of the reducer, a parameter annotated as one, a variable made by one
    assert reducer_writes("lockstep.ddp.torch_surface", "class TorchReducer(Reducer):\n    def f(self):\n"
                          "        self.usage = None\n")
    assert reducer_writes("lockstep.ddp.overlap_step", "def f(r: Reducer):\n    r.bucket_cap_bytes = 1\n")
    assert reducer_writes("lockstep.ddp.wrapper", "def f():\n    r = TorchReducer(p)\n    r.usage = None\n")
    assert not reducer_writes("lockstep.ddp.wrapper", "class Other:\n    def f(self):\n        self.usage = None\n")
    assert not reducer_writes("lockstep.ddp.wrapper", "self.reducer = Reducer()\nreducer.attach_observer(x)\n")


# Issue #43: a key the launcher and the workers share is spelled once, in lockstep/keys.py. Two spellings of one key
# (the store takeover's was a literal in launch/elastic.py and another in train/inplace.py) drift apart silently.
SHARED_NAME = re.compile(r"^(lockstep/(inplace|resumed)|LOCKSTEP_(INPLACE\w*|JOB_ID|REPORT_RESUME|HANG_TIMEOUT_S|LOG_DIR|"
                         r"GLOO_IFNAME_PICKED|AS_TORCH_DDP)\b)")


def spelled_shared_names(module: str, source: str) -> list[str]:
    """``module:line literal`` for each string (or f-string's leading text) outside lockstep.keys that spells a
    shared store key or environment name."""
    if module == "lockstep.keys":
        return []
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            node = node.values[0]
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and SHARED_NAME.match(node.value):
            found.append(f"{module}:{node.lineno} {node.value!r}")
    return found


def test_shared_keys_have_one_home():
    bad = [b for module, source in all_modules().items() for b in spelled_shared_names(module, source)]
    assert not bad, "store keys or environment names spelled outside lockstep/keys.py:\n" + "\n".join(bad)
    assert spelled_shared_names("lockstep.launch.elastic", 'KEY = "lockstep/inplace/takeover"\n')
    assert spelled_shared_names("lockstep.train.x", 'k = f"lockstep/inplace/{g}/alarm"\n')
    assert spelled_shared_names("lockstep.launch.agent", 'updates["LOCKSTEP_INPLACE_STORES"] = "{}"\n')
    assert spelled_shared_names("lockstep.launch.agent", 'updates["LOCKSTEP_LOG_DIR"] = log_dir\n')
    assert not spelled_shared_names("lockstep.launch.agent", 'updates["LOCKSTEP_LOG_DIRECTORY"] = log_dir\n')
    assert not spelled_shared_names("lockstep.keys", 'KEY = "lockstep/inplace/takeover"\n')


# Issue #43: the Trainer's fields are written by the Trainer alone. A checkpoint read back is a state the Trainer
# applies (``Trainer._resume``), a save's outcome one it records; checkpoint.py wrote 18 of its fields before.
def trainer_writes(module: str, source: str) -> list[str]:
    """``module:line target`` for each assignment to ``trainer.<attr>`` (or ``trainer.<attr>.append``) outside
    train/trainer.py."""
    if module == "lockstep.train.trainer":
        return []
    bad = set()
    for node in ast.walk(ast.parse(source)):
        for target in _assigned_targets(node):
            while isinstance(target, ast.Subscript):
                target = target.value
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                    and target.value.id == "trainer":
                bad.add(f"{module}:{node.lineno} {ast.unparse(target)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "append" \
                and isinstance(node.func.value, ast.Attribute) and isinstance(node.func.value.value, ast.Name) \
                and node.func.value.value.id == "trainer":
            bad.add(f"{module}:{node.lineno} {ast.unparse(node.func)}")
    return sorted(bad)


def test_only_the_trainer_writes_its_fields():
    bad = [b for module, source in all_modules().items() for b in trainer_writes(module, source)]
    assert not bad, "Trainer fields assigned outside train/trainer.py (return a state the Trainer applies):\n" + \
        "\n".join(bad)
    assert trainer_writes("lockstep.train.checkpoint", "trainer.step, trainer.epoch = 1, 2\n")
    assert trainer_writes("lockstep.train.checkpoint", "trainer.save_errors.append('x')\n")
    assert not trainer_writes("lockstep.train.trainer", "trainer.step = 1\n")
