"""SLURM's view of a job: expanding its compressed node lists, and the rank layout srun gives.

SLURM writes host lists compressed (``node[01-03,07],gpu5``); every rank must
expand them the same way to agree on the master address without talking.
"""

from __future__ import annotations

import re

_BRACKET = re.compile(r"^(?P<prefix>[^\[\]]*)\[(?P<body>[^\[\]]+)\](?P<rest>.*)$")


def _split_top_level(nodelist: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"SLURM node list {nodelist!r}: unbalanced ']' at position {i}")
        elif ch == "," and depth == 0:
            parts.append(nodelist[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"SLURM node list {nodelist!r}: unbalanced '['")
    parts.append(nodelist[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_one(host: str, whole: str) -> list[str]:
    m = _BRACKET.match(host)
    if m is None:
        return [host]
    prefix, body, rest = m.group("prefix"), m.group("body"), m.group("rest")
    suffixes = _expand_one(rest, whole) if rest else [""]
    names = []
    for item in body.split(","):
        item = item.strip()
        if "-" in item:
            lo, hi = item.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()) or int(lo) > int(hi):
                raise ValueError(f"SLURM node list {whole!r}: bad range {item!r}")
            width = len(lo)  # SLURM keeps zero padding: node[01-03] -> node01..node03
            numbers = [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
        else:
            if not item.isdigit():
                raise ValueError(f"SLURM node list {whole!r}: bad index {item!r}")
            numbers = [item]
        names.extend(prefix + n + s for n in numbers for s in suffixes)
    return names


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM host list: ``"node[01-03,07],login"`` -> ``["node01", "node02", "node03", "node07", "login"]``."""
    if not nodelist or not nodelist.strip():
        raise ValueError("SLURM node list is empty (SLURM_JOB_NODELIST)")
    hosts: list[str] = []
    for part in _split_top_level(nodelist.strip()):
        hosts.extend(_expand_one(part, nodelist))
    return hosts


def port_from_job_id(job_id: str | int, base_port: int = 20000, span: int = 20000) -> int:
    """A port every rank of the job derives alike, without talking: base + job_id mod span."""
    try:
        job = int(str(job_id).split("_")[0])
    except ValueError as e:
        raise ValueError(f"SLURM_JOB_ID={job_id!r} is not a number") from e
    return base_port + job % span
