"""The README opens with the two commands, and CI runs the second one verbatim."""

import os
import re
import subprocess

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
    (fake / "python").write_text('#!/bin/sh\necho "python ran in $PWD"; [ -f tests/test_readme.py ] && echo "tree here"\n'
                                 "exit 1\n")
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
    if os.path.basename(ROOT) != "lockstep":
        assert not os.path.exists(os.path.dirname(ran_in[1])), "the copy outlived the run"
