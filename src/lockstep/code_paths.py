"""Which source files are library code (lockstep's, torch's, Python's own, installed packages') and which the user's.

Reports that name "the user's line" (a failed rank's report, a hang report) walk a traceback or a stack to
its innermost frame outside the libraries. What is a library is decided by where the packages really are
on this machine (``lockstep.__file__``, ``torch.__file__``, sysconfig's paths), never by a folder's name:
a clone checked out into a folder named ``lockstep`` (what ``git clone .../lockstep`` gives) holds the
user's own scripts, and a report must point at them.
"""

from __future__ import annotations

import functools
import os
import site
import sysconfig

# src/lockstep (or site-packages/lockstep): this file's own package, wherever it was imported from
LOCKSTEP_DIR = os.path.dirname(os.path.abspath(__file__))


def _as_dirs(paths: list[str]) -> tuple[str, ...]:
    """Each path as a folder prefix, both as written and with symlinks resolved (a venv links its prefix)."""
    found: list[str] = []
    for path in paths:
        for form in (os.path.abspath(path), os.path.realpath(path)):
            prefix = form.rstrip(os.sep) + os.sep
            if prefix not in found:
                found.append(prefix)
    return tuple(found)


@functools.lru_cache(maxsize=1)
def framework_dirs() -> tuple[str, ...]:
    """lockstep's and torch's package folders."""
    import torch

    return _as_dirs([LOCKSTEP_DIR, os.path.dirname(os.path.abspath(torch.__file__))])


@functools.lru_cache(maxsize=1)
def _python_dirs() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the standard library's folders, the installed packages' folders)."""
    paths = sysconfig.get_paths()
    stdlib = [paths[key] for key in ("stdlib", "platstdlib") if paths.get(key)]
    packages = [paths[key] for key in ("purelib", "platlib") if paths.get(key)]
    packages += list(getattr(site, "getsitepackages", list)())
    user_site = getattr(site, "getusersitepackages", lambda: None)()
    if isinstance(user_site, str):
        packages.append(user_site)
    return _as_dirs(stdlib), _as_dirs(packages)


def is_framework_code(filename: str) -> bool:
    """True for a file of lockstep's or torch's own package."""
    return os.path.abspath(filename).startswith(framework_dirs())


def is_library_code(filename: str, installed_packages: bool = True) -> bool:
    """True for lockstep's, torch's and the standard library's files (``<frozen ...>`` included).

    ``installed_packages``: whether the other installed packages (site-packages: transformers, a user's
    own pip-installed package) count as library code too. A failure report wants the line of the user's
    script; a hang report the innermost frame outside torch and lockstep, a model library's included.
    """
    if filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>: no file of the user's
        return filename.startswith("<frozen")
    path = os.path.abspath(filename)
    if path.startswith(framework_dirs()):
        return True
    stdlib, packages = _python_dirs()
    # site-packages lies under the stdlib folder: look at it first. Another environment's site-packages (a
    # worker run by another interpreter) is still an installed package's folder.
    if path.startswith(packages) or os.sep + "site-packages" + os.sep in path:
        return installed_packages
    return path.startswith(stdlib)
