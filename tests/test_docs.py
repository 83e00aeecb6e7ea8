"""The code blocks that the README and docs/ mark to run do run, and the output they show is what they print.

A block is marked by an HTML comment on the line before its fence (invisible on the site and on GitHub):

    <!-- run: python [expect="TEXT"] [exit=N] -->
        a script, run with `python` in a fresh folder
    <!-- run: launch file=NAME [args="FLAGS"] [expect="TEXT"] [exit=N] -->
        saved as NAME and run with `python -m lockstep launch --nproc-per-node 2 FLAGS NAME` in a fresh folder
    <!-- run: shell name=NAME [expect="TEXT"] [exit=N] -->
        each line a command, run by bash in a fresh folder that holds a link to the repository's examples/
        (the pages run them as `lockstep launch ... examples/NAME.py`, from the repository's root)
    <!-- output: NAME -->
        the block below shows (part of) the output of the run named NAME (its file= or name=), on any page

A run passes when it exits with N (default 0) and every `expect` text is in its output. An output block passes
when each line it shows is a line of the real output, compared after the `[rankN]: ` prefixes are dropped and
runs of spaces collapsed: a line `...` skips, `…` or `...` inside a line stands for any text, and a decimal
number, a pid or a thread id for any other (timings and pids differ from run to run); a `$ command` line is the
command. Identical blocks (the README's drop-in is also the site's) run once. Each launch costs a few seconds
of rank start-up, so the pages mark a handful of blocks, not every one.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- (run|output): (.*?) -->\n```[^\n]*\n(.*?)^```$", re.M | re.S)
ANY_MARKER = re.compile(r"^<!-- (run|output):", re.M)
MODES = ("python", "launch", "shell")
TIMEOUT_S = 180  # a launch takes 10-25 s on a loaded 2-core machine; the hang example ends ~10 s into step 3


@dataclasses.dataclass(frozen=True)
class Block:
    page: str
    line: int
    kind: str  # "run" or "output"
    options: tuple  # (mode, key=value, ...) of a run; (name,) of an output
    code: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def parse(page: Path) -> list[Block]:
    text = page.read_text()
    blocks = [Block(page.relative_to(ROOT).as_posix(), text.count("\n", 0, m.start()) + 1, m.group(1),
                    tuple(shlex.split(m.group(2))), m.group(3)) for m in MARKER.finditer(text)]
    # A marker that is not directly above a fenced block would silently test nothing.
    assert len(blocks) == len(ANY_MARKER.findall(text)), f"{page.name}: a run/output marker not directly above a ``` block"
    return blocks


ALL = [b for page in PAGES for b in parse(page)]


@dataclasses.dataclass(frozen=True)
class Run:
    mode: str
    name: str
    code: str
    args: str = ""
    exit: int = 0
    expect: tuple = ()


def run_of(block: Block) -> Run:
    mode, *pairs = block.options
    assert mode in MODES, f"{block.where}: run mode {mode!r}, not one of {MODES}"
    opts: dict = {"expect": []}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        assert sep and key in ("file", "name", "args", "exit", "expect"), f"{block.where}: option {pair!r}"
        if key == "expect":
            opts["expect"].append(value)
        else:
            opts[key] = value
    name = opts.get("file") or opts.get("name") or f"{block.page}:{block.line}"
    assert mode != "launch" or "file" in opts, f"{block.where}: a launch block needs file=NAME.py"
    return Run(mode, name, block.code, opts.get("args", ""), int(opts.get("exit", 0)), tuple(opts["expect"]))


RUNS: dict[str, Run] = {}
for _block in (b for b in ALL if b.kind == "run"):
    _run = run_of(_block)
    assert RUNS.setdefault(_run.name, _run) == _run, f"{_block.where}: two different blocks are named {_run.name}"
OUTPUTS = [b for b in ALL if b.kind == "output"]


def execute(run: Run, folder: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, TMPDIR=str(folder), PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p))
    env.pop("LOCKSTEP_HANG_TIMEOUT_S", None)  # the pages' examples assume lockstep's defaults
    if run.mode == "shell":
        (folder / "examples").symlink_to(ROOT / "examples")
        cmd = ["bash", "-euo", "pipefail", "-c", run.code]
    else:
        script = folder / (run.name if run.name.endswith(".py") else "block.py")
        script.write_text(run.code)
        cmd = [sys.executable, script.name] if run.mode == "python" else [
            sys.executable, "-m", "lockstep", "launch", "--nproc-per-node", "2", *shlex.split(run.args), script.name]
    with subprocess.Popen(cmd, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:  # its own group: a timeout ends the ranks too
        try:
            out, err = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            err += f"\n(killed after {TIMEOUT_S} s)"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


_results: dict[str, tuple[subprocess.CompletedProcess, list[str]]] = {}


def result(name: str, tmp_path_factory) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Each run once per session, whichever test asks first."""
    if name not in _results:
        proc = execute(RUNS[name], tmp_path_factory.mktemp(re.sub(r"\W", "_", name)))
        _results[name] = proc, [normalise(line) for line in (proc.stdout + proc.stderr).splitlines()]
    return _results[name]


def normalise(line: str) -> str:
    while (stripped := re.sub(r"^\[rank\d+\]:\s?", "", line)) != line:  # `[rank0]: [rank0]: ...` nests
        line = stripped
    return " ".join(line.split())


def pattern(shown: str) -> re.Pattern:
    """A shown output line as a regular expression: `…` any text, numbers that vary between runs any number."""
    parts = re.split(r"(…|\.\.\.|\d+\.\d+|pid \d+|0x[0-9a-f]+)", normalise(shown))
    wild = {"…": ".*", "...": ".*"}
    out = []
    for part in parts:
        if part in wild:
            out.append(wild[part])
        elif re.fullmatch(r"\d+\.\d+", part):
            out.append(r"\d+(?:\.\d+)?")
        elif re.fullmatch(r"pid \d+", part):
            out.append(r"pid \d+")
        elif re.fullmatch(r"0x[0-9a-f]+", part):
            out.append("0x[0-9a-f]+")
        else:
            out.append(re.escape(part))
    return re.compile("".join(out))


def test_pages_mark_blocks_to_run():
    # Cannot pass on a tree without marked blocks: each mode is used, and the README shows real output.
    assert {r.mode for r in RUNS.values()} == set(MODES)
    assert any(b.page == "README.md" and b.kind == "run" for b in ALL)
    assert any(b.page == "README.md" and b.kind == "output" for b in ALL)
    for block in OUTPUTS:
        assert block.options and block.options[0] in RUNS, f"{block.where}: output of {block.options}, which no block runs"


def test_output_pattern():
    assert pattern("[rank0]: waited 5.6 s in step 3").fullmatch("waited 12.25 s in step 3")
    assert not pattern("[rank0]: waited 5.6 s in step 3").fullmatch("waited 12.25 s in step 4")
    assert pattern("worker rank 1 (on …, pid 16241) failed").fullmatch("worker rank 1 (on vm, pid 7) failed")
    assert normalise("[rank1]: [rank1]: RuntimeError:   x") == "RuntimeError: x"


@pytest.mark.parametrize("name", sorted(RUNS))
def test_block_runs(name, tmp_path_factory):
    run = RUNS[name]
    proc, lines = result(name, tmp_path_factory)
    shown = f"{run.mode} {name} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    assert proc.returncode == run.exit, shown
    for text in run.expect:
        assert any(text in line for line in lines), f"{text!r} not in the output\n{shown}"


@pytest.mark.parametrize("block", OUTPUTS, ids=[b.where for b in OUTPUTS])
def test_shown_output_is_real(block, tmp_path_factory):
    proc, lines = result(block.options[0], tmp_path_factory)
    missing = []
    for shown in block.code.splitlines():
        if not normalise(shown) or normalise(shown) == "..." or shown.startswith("$ "):
            continue
        if not any(pattern(shown).fullmatch(line) for line in lines):
            missing.append(shown)
    assert not missing, ("lines shown that the run did not print:\n" + "\n".join(missing)
                         + f"\n--- the run's output\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")


def test_site_builds_strict(tmp_path):
    # What CI runs first (.ci/run): a broken link or anchor, or a page missing from mkdocs.yml's nav, fails.
    pytest.importorskip("mkdocs", reason="mkdocs comes with the dev extra: pip install -e '.[dev]'")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "site" / "architecture" / "index.html").exists()
