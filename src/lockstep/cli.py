"""The ``lockstep`` command: a thin dispatcher to one module per subcommand.

Each subcommand lives in its own module as a function ``(argv) -> int``; the
dispatcher imports only that module, so ``lockstep plan`` never pays for torch's
distributed start-up and a broken subcommand cannot break the others.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, function taking argv and returning an exit code, one-line help)
SUBCOMMANDS = {
    "launch": ("lockstep.launch.launcher", "cli_main", "run a script on N processes per node (torch's elastic agent)"),
    "slurm-script": ("lockstep.launch.launcher", "slurm_script_main", "print a ready sbatch script"),
    "demo": ("lockstep.train.demo", "cli_main", "train a small CNN on digits with DDP on 2 CPU processes"),
    "bench": ("lockstep.perf.bench", "cli_main", "benchmarks: `lockstep bench allreduce`, `lockstep bench scaling`"),
    "plan": ("lockstep.perf.plan", "cli_main", "memory and communication cost model"),
}


def _usage() -> str:
    lines = ["usage: lockstep <command> [args...]", "", "commands:"]
    lines += [f"  {name:<14}{help_text}" for name, (_, _, help_text) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command in ("-V", "--version"):
        from lockstep import __version__

        print(__version__)
        return 0
    if command not in SUBCOMMANDS:
        print(f"lockstep: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, function_name, _ = SUBCOMMANDS[command]
    handler = getattr(importlib.import_module(module_name), function_name)
    return int(handler(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
