"""The ``lockstep`` command: a thin dispatcher to one module per subcommand.

Each subcommand lives in its own module as a function ``(argv) -> int``; the
dispatcher imports only that module, so ``lockstep plan`` never pays for torch's
distributed start-up and a broken subcommand cannot break the others.

It behaves as argparse and torchrun do at the edges: ``--help`` to stdout with exit 0, a missing or
unknown command to stderr with exit 2, and output piped into ``head`` ends quietly when the reader
goes (no ``BrokenPipeError`` traceback). One difference: a bad argument is one line naming it (exit 2),
not argparse's usage block with the error at its foot.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Iterator
from typing import NoReturn

# subcommand -> (module, function taking argv and returning an exit code, one-line help)
SUBCOMMANDS = {
    "launch": ("lockstep.launch.launcher", "cli_main", "run a script on N processes per node (torch's elastic agent)"),
    "slurm-script": ("lockstep.launch.launcher", "slurm_script_main", "print a ready sbatch script"),
    "demo": ("lockstep.train.demo", "cli_main", "train a small CNN on digits with DDP on 2 CPU processes"),
    "bench": ("lockstep.perf.bench", "cli_main", "benchmarks: lockstep bench allreduce, lockstep bench scaling"),
    "plan": ("lockstep.perf.plan", "cli_main", "memory and communication cost model"),
    "env": ("lockstep.diagnostics.environment", "cli_main",
            "versions, backends, GPUs, network and env vars for a bug report"),
}


def _usage() -> str:
    lines = ["usage: lockstep [-h] [-V] <command> [args...]", "", "commands:"]
    lines += [f"  {name:<16}{help_text}" for name, (_, _, help_text) in SUBCOMMANDS.items()]
    lines += ["", "options:", f"  {'-h, --help':<16}show this help and exit",
              f"  {'-V, --version':<16}print lockstep's version and exit",
              "", "lockstep <command> --help describes a command's arguments."]
    return "\n".join(lines)


def _one_line_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """argparse's ``error`` without the usage block (23 lines for ``lockstep launch``, which buried the one
    that mattered). A message about one argument ("argument --nnodes: ...", "--epochs must be >= 1") says all;
    one that names none or several (unrecognized arguments, a required one missing) gets the pointer to --help."""
    hint = "" if message.startswith(("argument ", "-")) else f"\n  see {parser.prog} --help"
    parser.exit(2, f"{parser.prog}: error: {message}{hint}\n")


@contextlib.contextmanager
def _one_line_argument_errors() -> Iterator[None]:
    # Every subcommand builds its own parser in its own module; this process is the `lockstep` command's, so the
    # rule is set here once for all of them (and undone after, for a caller of main() in its own process).
    error = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = _one_line_error  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        argparse.ArgumentParser.error = error  # type: ignore[method-assign]


def _dispatch(argv: list[str]) -> int:
    if not argv:  # as argparse with a required argument: usage to stderr, exit 2
        print(f"{_usage()}\nlockstep: error: a command is required", file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if command in ("-V", "--version"):
        from lockstep import __version__

        print(f"lockstep {__version__}")
        return 0
    if command not in SUBCOMMANDS:
        print(f"lockstep: error: unknown command {command!r} (commands: {', '.join(SUBCOMMANDS)})", file=sys.stderr)
        return 2
    module_name, function_name, _ = SUBCOMMANDS[command]
    handler = getattr(importlib.import_module(module_name), function_name)
    with _one_line_argument_errors():
        return int(handler(rest) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        code = _dispatch(argv)
        sys.stdout.flush()  # inside the try: buffered output meets a closed pipe here, not at interpreter exit
        return code
    except BrokenPipeError:
        # The reader went (`lockstep plan ... | head`). Python's recipe (docs: signal, "Note on SIGPIPE"):
        # point stdout at /dev/null so the interpreter's own flush at exit cannot raise again, exit 1.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
