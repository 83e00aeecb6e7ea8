"""A benchmark run against two source trees of lockstep, alternately, and its ratios side by side.

One process cannot import two versions of lockstep, so "before" and "after" are separate runs of the same command
(``PYTHONPATH`` pointing at each tree's ``src``), alternated round by round (before, after; then after, before ...)
so that a shared machine's drifting load falls on both alike. Each run's ratios are against a contender both trees
run the same way (torch's DDP, the compute-alone floor): those are what is compared, never raw milliseconds across
runs. Reads the JSON the benchmark writes (``benchmarks/ddp_step.py``'s ``results.<model>.ratios``, ``memory.py``'s
``results``) from a folder of its own per run.

    python benchmarks/before_after.py --before /tmp/before/src --after src --rounds 2 -- \\
        benchmarks/ddp_step.py --models mlp,cnn,transformer --contenders torch,lockstep_25,floor,compute
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile


def run_once(tree: str, command: list[str]) -> dict:
    """The benchmark once with ``tree`` first on the path; its JSON record."""
    out = tempfile.mkdtemp(prefix="before_after_")
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    subprocess.run([sys.executable, *command, "--out", out], env=env, check=True, stdout=subprocess.DEVNULL)
    (path,) = glob.glob(os.path.join(out, "*.json"))
    with open(path) as f:
        return json.load(f)


def ratios_of(record: dict) -> dict[str, float]:
    """``model: numerator/denominator`` -> the median per-block ratio (ddp_step.py's records); for memory.py's,
    ``model: cell`` -> the cell's median peak in MiB (a peak is not paced by the load: compared as it is)."""
    found = {}
    results = record.get("results", {})
    for model, result in results.get("models", {}).items():
        for cell, runs in result.get("cells", {}).items():
            found[f"{model}: {cell} peak MiB"] = statistics.median(r["peak_bytes"] for r in runs) / 2**20
    for model, result in results.items():
        if isinstance(result, dict):
            for pair, r in result.get("ratios", {}).items():
                found[f"{model}: {pair}"] = r["median"]
    return found


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the src folder of the tree before")
    parser.add_argument("--after", required=True, help="the src folder of the tree after")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    if not command:
        parser.error("give the benchmark command after --")
    seen: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    for r in range(args.rounds):
        order = (("before", args.before), ("after", args.after))
        for name, tree in order if r % 2 == 0 else order[::-1]:
            for key, value in ratios_of(run_once(tree, command)).items():
                seen[name].setdefault(key, []).append(value)
    print(f"| ratio (median of {args.rounds} runs each, alternated) | before | after | after / before |")
    print("|---|---|---|---|")
    for key in seen["before"]:
        if key in seen["after"]:
            b, a = statistics.median(seen["before"][key]), statistics.median(seen["after"][key])
            print(f"| {key} | {b:.3f} | {a:.3f} | {a / b:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
