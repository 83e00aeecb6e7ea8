"""docs/preemptible.md's one-machine walkthrough, run as the page writes it: its commands, then the lines it shows.

The page marks each block of the walkthrough with an HTML comment (``<!-- walkthrough: NAME -->``, invisible on the
site): the commands ``setup``, ``start``, ``kill``, ``restart``, ``cleanup``, and the lines a reader then sees,
``training``, ``after-kill`` and ``after-restart``. This test reads those blocks from the page (so the page and the
test cannot drift), renames the namespaces and the veth pair (``nodeA`` -> a name of its own: several runs, or one
left over, cannot collide) and the checkpoint folder, runs each ``start``/``restart`` line as its own process (the
page backgrounds them with ``&`` in one terminal) and checks that each shown line appears in the launchers' output
after the command before it, a number that varies from run to run (a step, a time) standing for any other.
Root only (network namespaces); ~50 s on the loaded 2-core machine (two launchers and four workers start, node B
starts again and joins in place).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import uuid

import netns
import pytest
from test_multinode import clean_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "preemptible.md")
BLOCK = re.compile(r"^<!-- walkthrough: ([\w-]+) -->\n```[^\n]*\n(.*?)^```$", re.M | re.S)
COMMANDS = ("setup", "start", "kill", "restart", "cleanup")
SHOWN = ("training", "after-kill", "after-restart")
pytestmark = pytest.mark.skipif(netns.unavailable_reason() is not None, reason=str(netns.unavailable_reason()))


def walkthrough_blocks(text: str) -> dict[str, str]:
    blocks = dict(BLOCK.findall(text))
    assert len(blocks) == text.count("<!-- walkthrough:"), "a walkthrough marker not directly above a ``` block"
    return blocks


def commands(block: str) -> list[str]:
    """The block's command lines, a line ending in a backslash joined with the next."""
    return [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def shown_pattern(line: str) -> re.Pattern:
    """A shown line as a regular expression: a step number and a decimal (a time) stand for any number."""
    parts = re.split(r"(step \d+|\d+\.\d+)", " ".join(line.split()))
    return re.compile("".join(r"step \d+" if p.startswith("step ") else r"\d+(?:\.\d+)?" if re.fullmatch(r"\d+\.\d+", p)
                              else re.escape(p) for p in parts))


def test_the_page_marks_the_walkthrough():
    blocks = walkthrough_blocks(open(PAGE).read())
    assert set(blocks) == {*COMMANDS, *SHOWN}, sorted(blocks)
    assert len(commands(blocks["start"])) == 2 and all(c.endswith("&") for c in commands(blocks["start"]))
    assert shown_pattern("left at step 23: world 4 -> 2 in 2.0 s").fullmatch("left at step 7: world 4 -> 2 in 11 s")
    assert not shown_pattern("left at step 23: world 4 -> 2 in 2.0 s").fullmatch("left at step 7: world 4 -> 1 in 1 s")


def _named(text: str, tag: str, folder: str) -> str:
    """The page's names made this run's own: namespaces, the veth pair (15 characters at most), the checkpoints."""
    for old, new in (("nodeA", f"lsw{tag}a"), ("nodeB", f"lsw{tag}b"), ("vethA", f"lswv{tag}a"),
                     ("vethB", f"lswv{tag}b")):
        text = re.sub(rf"\b{old}\b", new, text)
    return text.replace("/tmp/ckpt", folder)


class _Command:
    """One backgrounded line of the page, run from the repository's root; its output lines collected as they come."""

    def __init__(self, command: str, env: dict[str, str]) -> None:
        self.command = command
        self.lines: list[str] = []
        self.proc = subprocess.Popen(["bash", "-c", command.removesuffix("&").strip()], cwd=ROOT, env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # one terminal, as the page's
        self.reader = threading.Thread(target=lambda: self.lines.extend(line.rstrip("\n") for line in self.proc.stdout),
                                       daemon=True)
        self.reader.start()

    def text(self) -> str:
        return f"$ {self.command}\n" + "\n".join(self.lines[-60:])


class _Walkthrough:
    def __init__(self, blocks: dict[str, str], folder: str) -> None:
        self.blocks, self.tag, self.folder = blocks, uuid.uuid4().hex[:6], folder
        bin_dir = os.path.dirname(sys.executable)  # the `lockstep` console script that `pip install -e .` put there
        self.env = clean_env(PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
        self.launches: list[_Command] = []

    def shell(self, name: str) -> None:
        code = _named(self.blocks[name], self.tag, self.folder)
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", code], capture_output=True, text=True, timeout=60,
                              env=self.env, cwd=ROOT)
        assert proc.returncode == 0, f"{name}: {code}\n{proc.stdout}{proc.stderr}"

    def background(self, name: str) -> None:
        self.launches += [_Command(c, self.env) for c in commands(_named(self.blocks[name], self.tag, self.folder))]

    def lines(self) -> list[str]:
        return [line for launch in self.launches for line in list(launch.lines)]

    def output(self) -> str:
        return "\n\n".join(launch.text() for launch in self.launches)

    def expect(self, name: str, after: set[str], timeout_s: float) -> set[str]:
        """Wait until every line of block ``name`` appeared, not counting the lines in ``after``; returns the lines
        printed by then."""
        wanted = [shown_pattern(line) for line in self.blocks[name].splitlines() if line.strip()]
        deadline = time.monotonic() + timeout_s
        while True:
            new = [" ".join(line.split()) for line in self.lines() if line not in after]
            missing = [p.pattern for p in wanted if not any(p.fullmatch(line) for line in new)]
            if not missing:
                return set(self.lines())
            if time.monotonic() > deadline or all(launch.proc.poll() is not None for launch in self.launches):
                raise AssertionError(f"{name}: within {timeout_s} s, no line matching {missing}\n{self.output()}")
            time.sleep(0.2)

    def stop(self) -> None:
        for node in "ab":  # every process left in the namespaces (the page's job ends by itself after 280 steps)
            subprocess.run(f"ip netns pids lsw{self.tag}{node} | xargs -r kill -9", shell=True, capture_output=True)
        for launch in self.launches:
            launch.proc.wait(timeout=10)
            launch.reader.join(timeout=5)
        subprocess.run(["bash", "-c", _named(self.blocks["cleanup"], self.tag, self.folder)], capture_output=True)


def test_the_walkthrough_shows_the_lines_the_page_shows(tmp_path):
    run = _Walkthrough(walkthrough_blocks(open(PAGE).read()), str(tmp_path / "ckpt"))
    start = time.monotonic()
    try:
        run.shell("setup")
        run.background("start")
        seen = run.expect("training", set(), 240)
        run.shell("kill")
        seen = run.expect("after-kill", seen, 60)
        run.background("restart")
        run.expect("after-restart", seen, 120)
    finally:
        run.stop()
    print(f"walkthrough: {time.monotonic() - start:.0f} s\n{run.output()}")
