"""Library code is where the packages really are, not a folder's name (issue #34): no processes."""

from __future__ import annotations

import os
import sys

import torch

import lockstep
from lockstep.code_paths import is_framework_code, is_library_code
from lockstep.diagnostics.progress import user_location


def test_a_users_file_in_a_folder_named_lockstep_or_torch_is_the_users():
    for folder in ("lockstep", "torch", "lib/python3.11"):
        path = f"/tmp/clone/{folder}/examples/train.py"
        assert not is_library_code(path) and not is_framework_code(path), path


def test_lockstep_torch_and_the_stdlib_are_library_code():
    assert is_framework_code(lockstep.__file__) and is_framework_code(torch.nn.functional.__file__)
    assert is_library_code(os.__file__) and not is_framework_code(os.__file__)
    assert is_library_code("<frozen importlib._bootstrap>") and not is_library_code("<string>")


def test_installed_packages_count_as_library_code_where_asked():
    import pytest as installed  # a package from site-packages

    assert is_library_code(installed.__file__)
    assert not is_library_code(installed.__file__, installed_packages=False)


def test_hang_reports_name_the_users_line_from_a_folder_named_lockstep(tmp_path):
    # The hang report's "where": the innermost frame outside torch and lockstep, here a file under .../lockstep/
    folder = tmp_path / "lockstep"
    folder.mkdir()
    (folder / "train.py").write_text("import sys\n\n\ndef step():\n    return sys._getframe()\n")
    namespace: dict = {}
    exec(compile((folder / "train.py").read_text(), str(folder / "train.py"), "exec"), namespace)
    frame = namespace["step"]()
    assert user_location(frame) == "train.py:5 in step"
