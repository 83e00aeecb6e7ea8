"""``lockstep launch``: run a script or a function on N workers per node with torch's elastic agent.

``launcher`` is the front (arguments, ``launch_function``, the CLI); ``agent`` maps
the options onto torch's ``LaunchConfig`` and runs the agent; ``output`` prefixes
each rank's lines and writes the failure report.
"""

from lockstep.launch.launcher import (
    LaunchError,
    LaunchOptions,
    RendezvousFailed,
    cli_main,
    launch_function,
    parse_launch_args,
    run_agent,
    slurm_script_main,
)

__all__ = [
    "LaunchError", "LaunchOptions", "RendezvousFailed", "cli_main", "launch_function", "parse_launch_args",
    "run_agent", "slurm_script_main",
]
