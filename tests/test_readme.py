"""The README opens with the two commands, and CI runs the second one verbatim."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme_commands():
    text = open(os.path.join(ROOT, "README.md")).read()
    return re.findall(r"```bash\n(.+?)\n```", text)


def test_readme_opens_with_setup_and_main_job_then_tests():
    commands = _readme_commands()
    assert commands[0].startswith("python -m pip install torch==2.13.0") and commands[0].endswith("lockstep demo")
    assert commands[1].startswith("python -m pip install torch==2.13.0") and "pytest" in commands[1]


def test_the_demo_command_installs_the_package_alone_and_the_test_command_the_dev_extra():
    # issue #34 item 4: the dev extra is ~75 packages (4-5 min) that the demo never imports; `pip install -e .`
    # (~30) runs it. A fresh venv with only these two installs ran `lockstep demo` on 2026-11-26.
    demo, tests = _readme_commands()[:2]
    assert demo == "python -m pip install torch==2.13.0 && python -m pip install -e . && lockstep demo"
    assert "dev" not in demo
    assert 'python -m pip install -e ".[dev]" && python -m pytest' in tests


def test_ci_runs_the_readme_test_command():
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert _readme_commands()[1] in ci


def test_readme_stays_a_two_minute_read_and_its_links_resolve():
    # STYLE.md: the README is a newcomer's first two minutes; the rest lives in docs/ (the MkDocs site).
    text = open(os.path.join(ROOT, "README.md")).read()
    assert text.count("\n") <= 150, f"README.md has {text.count(chr(10))} lines; move detail to docs/"
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert any(link.startswith("docs/") for link in links)
    missing = [link for link in links if "://" not in link and not os.path.exists(os.path.join(ROOT, link))]
    assert not missing, f"README links to files that do not exist: {missing}"
    # mkdocs.yml's nav lists every page the README links to (mkdocs --strict checks the pages' own links).
    nav = open(os.path.join(ROOT, "mkdocs.yml")).read()
    assert all(os.path.basename(link) in nav for link in links if link.startswith("docs/") and link.endswith(".md"))


def test_ci_runs_the_tests_from_a_checkout_folder_named_lockstep(tmp_path):
    # issue #34 item 1: CI clones into a folder of its own naming; .ci/run must still run the suite from .../lockstep.
    # A stand-in `python` (the first command .ci/run runs after choosing its folder) prints where it was started and
    # fails, which ends the script there.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").write_text('#!/bin/sh\necho "python ran in $PWD"\n'
                                 '[ -f tests/test_readme.py ] && echo "tree here"\n'
                                 'git ls-files --error-unmatch tests/test_readme.py >/dev/null && echo "a checkout"\n'
                                 'exit 1\n')
    (fake / "ip").write_text("#!/bin/sh\nexit 0\n")  # so that the iproute2 check installs nothing
    for tool in fake.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", os.path.join(ROOT, ".ci", "run")], env=env, capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode != 0, proc.stdout
    ran_in = re.search(r"^python ran in (.+)$", proc.stdout, re.MULTILINE)
    assert ran_in, proc.stdout + proc.stderr
    assert os.path.basename(ran_in[1]) == "lockstep", proc.stdout
    assert "tree here" in proc.stdout, proc.stdout
    # tests ask git what the checkout tracks and ignores (tests/test_bench.py): the copy must be one, as a clone is
    assert "a checkout" in proc.stdout, proc.stdout + proc.stderr
    if os.path.basename(ROOT) != "lockstep":
        assert not os.path.exists(os.path.dirname(ran_in[1])), "the copy outlived the run"


_LOGGING_TEST = '''import os, time
def _log(name):
    start = time.time(); time.sleep(0.3)
    with open(os.environ["SCHEDULE_LOG"], "a") as f:
        f.write(f"{name} {os.environ.get('PYTEST_XDIST_WORKER')} {start} {time.time()}\\n")
'''


def test_the_test_command_runs_files_side_by_side_and_the_timing_group_last_and_alone(tmp_path):
    # issue #34 item 7: pyproject's addopts and tests/conftest.py's scheduler, run on stand-in files: a file's tests
    # stay on one worker (its spawned group starts once), files run side by side, NETNS's files one after the other on
    # one worker beside the rest, and TIMING's files only once the rest has ended.
    import conftest

    addopts = re.search(r"^addopts = .*$", open(os.path.join(ROOT, "pyproject.toml")).read(), re.MULTILINE)[0]
    (tmp_path / "pyproject.toml").write_text(f"[tool.pytest.ini_options]\n{addopts}\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "conftest.py").write_text(open(os.path.join(ROOT, "tests", "conftest.py")).read())
    timing = sorted(conftest.TIMING)[:2]
    netns = sorted(conftest.NETNS)
    for name in ["test_one.py", "test_two.py", *timing, *netns]:
        wait = "    time.sleep(0.5)\n" if name in netns else ""  # the longest unit, as the real ones are
        cases = "".join(f"def test_{i}():\n{wait}    _log('{name} {i}')\n" for i in range(3))
        (tmp_path / "tests" / name).write_text(_LOGGING_TEST + cases)
    log = tmp_path / "log"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=tmp_path,
                          env={**os.environ, "SCHEDULE_LOG": str(log)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = [line.split() for line in log.read_text().splitlines()]  # file, case, worker, start, end
    workers = {}
    for file, _, worker, _, _ in runs:
        workers.setdefault(file, set()).add(worker)
    assert all(len(w) == 1 for w in workers.values()), workers
    others_end = max(float(end) for file, _, _, _, end in runs if file not in timing)
    assert all(float(start) >= others_end for file, _, _, start, _ in runs if file in timing), runs
    # the namespaces' files share one worker, one after the other, and start before the plain files end
    assert len(set().union(*(workers[name] for name in netns))) == 1, workers
    spans = {name: [float(t) for file, _, _, start, end in runs if file == name for t in (start, end)]
             for name in netns}
    in_turn = sorted(netns, key=lambda name: min(spans[name]))
    first = in_turn[0]
    assert all(max(spans[a]) <= min(spans[b]) for a, b in zip(in_turn, in_turn[1:])), spans
    plain_end = max(float(end) for file, _, _, _, end in runs if file in ("test_one.py", "test_two.py"))
    assert min(spans[first]) < plain_end, (spans, plain_end)
    assert workers["test_one.py"] != workers[first], workers  # side by side, one on each worker


def test_the_schedules_file_names_are_test_files():
    # A renamed file would fall out of the timing group or the order without a word: every name must exist.
    import conftest

    names = [*conftest.TIMING, *conftest.NETNS, *conftest.SLOWEST_FIRST]
    missing = [name for name in names if not os.path.exists(os.path.join(ROOT, "tests", name))]
    assert not missing, f"tests/conftest.py names files that do not exist: {missing}"
