"""All-reduce bandwidth benchmark: native vs ring vs tree on local gloo ranks.

A thin wrapper so the benchmark can be run from a checkout without the console
script; all the logic (spawning ranks, timing, the alpha-beta fit, the plot) is in
``lockstep.perf.bench``. Results go to benchmarks/results/ as dated JSON, markdown and PNG.

    python benchmarks/allreduce.py --min-size 4KiB --max-size 256MiB
"""

import sys

from lockstep.perf.bench import cli_main

if __name__ == "__main__":
    sys.exit(cli_main(["allreduce", *sys.argv[1:]]))
