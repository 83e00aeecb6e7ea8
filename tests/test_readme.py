"""The README opens with the two commands, and CI runs the second one verbatim."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme_commands():
    text = open(os.path.join(ROOT, "README.md")).read()
    return re.findall(r"```bash\n(.+?)\n```", text)


def test_readme_opens_with_setup_and_main_job_then_tests():
    commands = _readme_commands()
    assert commands[0].startswith("python -m pip install torch==2.13.0") and commands[0].endswith("lockstep demo")
    assert commands[1].startswith("python -m pip install torch==2.13.0") and "pytest" in commands[1]


def test_ci_runs_the_readme_test_command():
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert _readme_commands()[1] in ci
