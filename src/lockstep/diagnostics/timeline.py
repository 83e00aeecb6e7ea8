"""The overlap timeline's outputs: Chrome trace JSON, the summary (printed and JSON) and a PNG of one step.

Input: each rank's events from ``trace.TraceRecorder`` (already on rank 0's clock). The summary answers
"did communication hide behind backward?": per rank and step, compute (forward + backward), communication
(the union of the buckets' all-reduce spans), exposed communication (the end-of-backward wait: what
overlap did not hide), the overlap share (1 - exposed / communication), and per bucket its size, measured
all-reduce time and bandwidth beside the alpha-beta cost model's prediction for the same size
(``lockstep.costmodel``: pure arithmetic, a leaf below every part; see tests/test_layout.py).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from lockstep.costmodel import LINKS, allreduce_time_s, bus_bandwidth_gb_s

_COLOURS = {"forward": "#4e79a7", "backward": "#59a14f", "wait": "#e15759", "host": "#bab0ac",
            "comm": ("#f28e2b", "#b07aa1")}


def chrome_trace(per_rank: list[dict]) -> dict:
    """The Chrome trace-event JSON (``ph: X`` spans in microseconds; one process per rank, one thread per row)."""
    origin = min((e["start"] for r in per_rank for e in r["events"]), default=0.0)
    out: list[dict] = []
    for r in per_rank:
        pid = r["rank"]
        out.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"rank {pid}"}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
        threads = {0: "compute", 1: "wait / host"}
        for e in r["events"]:
            ts = (e["start"] - origin) * 1e6
            args = dict(e["args"], step=e["step"])
            if e["cat"] == "ready":
                out.append({"name": e["name"], "ph": "i", "s": "t", "pid": pid, "tid": 0, "ts": ts, "args": args})
                continue
            tid = 0 if e["cat"] == "compute" else 1 if e["cat"] in ("wait", "host") else 10 + e["args"]["bucket"]
            if tid >= 10:
                threads[tid] = f"all-reduce bucket {e['args']['bucket']}"
            out.append({"name": e["name"], "cat": e["cat"], "ph": "X", "pid": pid, "tid": tid, "ts": ts,
                        "dur": max(0.0, (e["end"] - e["start"]) * 1e6), "args": args})
        for tid, name in threads.items():
            out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"clock": "rank 0's time.perf_counter; offsets measured through the store",
                          "offsets_s": {r["rank"]: r["offset_s"] for r in per_rank}}}


def _union_s(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def _duration_s(events: list[dict], cat: str, name: str | None = None) -> float:
    """Summed seconds of the events of category ``cat`` (and ``name``, if given)."""
    return sum(e["end"] - e["start"] for e in events if e["cat"] == cat and (name is None or e["name"] == name))


def step_breakdown(events: list[dict]) -> dict[int, dict]:
    """Per step: step, compute, forward, backward, communication, exposed, host times in seconds."""
    steps = sorted({e["step"] for e in events})
    starts = {s: min(e["start"] for e in events if e["step"] == s) for s in steps}
    out = {}
    for i, s in enumerate(steps):
        mine = [e for e in events if e["step"] == s]
        end = starts[steps[i + 1]] if i + 1 < len(steps) else max(e["end"] for e in mine)
        comm = _union_s([(e["start"], e["end"]) for e in mine if e["cat"] == "comm"])
        exposed = _duration_s(mine, "wait", "end-of-backward wait")
        fwd, bwd = _duration_s(mine, "compute", "forward"), _duration_s(mine, "compute", "backward")
        out[s] = {"step_s": end - starts[s], "forward_s": fwd, "backward_s": bwd, "compute_s": fwd + bwd,
                  "comm_s": comm, "exposed_comm_s": exposed, "host_s": _duration_s(mine, "host"),
                  "overlap_share": (1.0 - exposed / comm) if comm > 0 else None}
    return out


def summarise(per_rank: list[dict], world_size: int, link_name: str) -> dict:
    """Medians over the window, per rank and overall, and per bucket measured vs predicted all-reduce time."""
    link = LINKS[link_name]
    ranks: list[dict] = []
    buckets: dict[int, dict] = {}  # bucket index -> its size and measured all-reduce times
    keys = ("step_s", "forward_s", "backward_s", "compute_s", "comm_s", "exposed_comm_s", "host_s")
    for r in per_rank:
        steps = step_breakdown(r["events"])
        row = {"rank": r["rank"], "steps": sorted(steps), "clock_offset_s": r["offset_s"]}
        for k in keys:
            row[k] = statistics.median(v[k] for v in steps.values()) if steps else 0.0
        row["overlap_share"] = (1.0 - row["exposed_comm_s"] / row["comm_s"]) if row["comm_s"] > 0 else None
        ranks.append(row)
        for e in r["events"]:
            if e["cat"] == "comm":
                entry = buckets.setdefault(e["args"]["bucket"], {"bucket": e["args"]["bucket"],
                                                                 "nbytes": e["args"]["nbytes"], "times": []})
                entry["times"].append(e["end"] - e["start"])
    bucket_rows = []
    for b in sorted(buckets):
        info = buckets[b]
        t = statistics.median(info["times"])
        predicted = allreduce_time_s(info["nbytes"], world_size, link, "ring")
        bucket_rows.append({"bucket": b, "nbytes": info["nbytes"], "allreduce_s": t, "samples": len(info["times"]),
                            "algbw_gb_s": info["nbytes"] / t / 1e9 if t > 0 else None,
                            "busbw_gb_s": (bus_bandwidth_gb_s(info["nbytes"], world_size, t)
                                           if t > 0 and world_size > 1 else None),
                            "predicted_s": predicted})
    overall = {k: statistics.mean(r[k] for r in ranks) for k in keys}
    overall["overlap_share"] = (1.0 - overall["exposed_comm_s"] / overall["comm_s"]) if overall["comm_s"] > 0 else None
    return {"world_size": world_size,
            "link": {"name": link.name, "alpha_s": link.alpha_s, "bandwidth_gb_s": link.bandwidth_gb_s},
            "overall": overall, "ranks": ranks, "buckets": bucket_rows}


def format_summary(summary: dict) -> str:
    def ms(v: float) -> str:
        return f"{v * 1e3:9.2f}"

    def pct(v: float | None) -> str:
        return "      n/a" if v is None else f"{v:9.0%}"

    lines = ["rank   step ms compute ms   comm ms exposed ms  overlap  host ms (optimizer, data)"]
    for r in summary["ranks"] + [dict(summary["overall"], rank="all")]:
        lines.append(f"{r['rank']!s:>4} {ms(r['step_s'])} {ms(r['compute_s'])}  {ms(r['comm_s'])}  "
                     f"{ms(r['exposed_comm_s'])}"
                     f" {pct(r['overlap_share'])} {ms(r['host_s'])}")
    link = summary["link"]
    lines += ["", f"bucket      bytes  all-reduce ms   algbw GB/s  predicted ms ({link['name']} ring: alpha "
                  f"{link['alpha_s'] * 1e6:g} us, {link['bandwidth_gb_s']:g} GB/s)"]
    for b in summary["buckets"]:
        bw = "      n/a" if b["algbw_gb_s"] is None else f"{b['algbw_gb_s']:9.3f}"
        lines.append(f"{b['bucket']:6d} {b['nbytes']:10d}  {ms(b['allreduce_s'])}     {bw}  {ms(b['predicted_s'])}")
    return "\n".join(lines)


def plot_step(per_rank: list[dict], path: Path, step: int | None = None) -> int:
    """A PNG of one step per rank: compute and waits on top, the buckets' all-reduces drawn under them."""
    from matplotlib.figure import Figure  # the object API: no pyplot state, safe off the main thread

    steps = sorted(set.intersection(*({e["step"] for e in r["events"]} for r in per_rank)))
    if step is None:
        step = steps[len(steps) // 2] if steps else 0
    chosen = [[e for e in r["events"] if e["step"] == step] for r in per_rank]
    origin = min((e["start"] for events in chosen for e in events), default=0.0)
    fig = Figure(figsize=(10, 1.0 + 1.3 * len(per_rank)))
    ax = fig.subplots()
    labels, ticks = [], []
    for i, (r, events) in enumerate(zip(per_rank, chosen)):
        top, bottom = 2 * i + 0.1, 2 * i + 1.05  # the y axis is inverted: compute above its all-reduces
        for e in events:
            x, w = (e["start"] - origin) * 1e3, (e["end"] - e["start"]) * 1e3
            if e["cat"] == "compute":
                ax.broken_barh([(x, w)], (top, 0.8), color=_COLOURS[e["name"]])
            elif e["cat"] in ("wait", "host") and not e["name"].startswith("wait bucket"):
                ax.broken_barh([(x, w)], (top, 0.8), color=_COLOURS[e["cat"]], alpha=0.9 if e["cat"] == "wait" else 0.6)
            elif e["cat"] == "comm":
                b = e["args"]["bucket"]
                y = bottom + 0.42 * (b % 2)  # alternate half-rows: a bucket queued behind another overlaps it
                ax.broken_barh([(x, w)], (y, 0.38), color=_COLOURS["comm"][b % 2], edgecolor="black", linewidth=0.4)
                ax.text(x + w / 2, y + 0.19, f"b{b}", ha="center", va="center", fontsize=7)
            elif e["cat"] == "ready":
                ax.plot([x, x], [top + 0.4, bottom], color="black", linewidth=0.5, alpha=0.5)  # bucket ready
        labels += [f"rank {r['rank']} all-reduce", f"rank {r['rank']} compute"]
        ticks += [bottom + 0.4, top + 0.4]
    ax.set_yticks(ticks, labels)
    ax.invert_yaxis()  # rank 0 on top
    ax.set_xlabel(f"ms since the start of step {step} (one clock for all ranks)")
    ax.set_title("one DDP step per rank: forward (blue), backward (green), end-of-backward wait (red), "
                 "optimizer/data (grey); bucket all-reduces below", fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return step


def write_outputs(per_rank: list[dict], trace_dir: Path, world_size: int, link_name: str, quiet: bool = False,
                  window: dict | None = None):
    """Rank 0, once the window closes: trace.json, summary.json, timeline.png; the summary printed.

    ``window``: the steps asked for and recorded, what closed it, and any ranks missing (kept in the summary).
    """
    trace_dir.mkdir(parents=True, exist_ok=True)
    paths = {"trace": trace_dir / "trace.json", "summary": trace_dir / "summary.json",
             "png": trace_dir / "timeline.png"}
    paths["trace"].write_text(json.dumps(chrome_trace(per_rank)))
    summary = summarise(per_rank, world_size, link_name)
    if window is not None:
        summary["window"] = window
    summary["png_step"] = plot_step(per_rank, paths["png"])
    paths["summary"].write_text(json.dumps(summary, indent=1))
    if not quiet:
        print(f"lockstep trace: {paths['trace']} (open in https://ui.perfetto.dev or chrome://tracing), "
              f"{paths['png'].name}, {paths['summary'].name}\n{format_summary(summary)}", flush=True)
    return paths, summary
