"""The alpha-beta cost of an all-reduce: how long each algorithm takes on a link.

A message of n bytes costs ``alpha + n * beta`` (Hockney's model): alpha is the
per-message latency in seconds, beta the inverse bandwidth in seconds per byte.
An algorithm is then two numbers, how many sequential messages it sends and how
many bytes each rank pushes through its link in total:

    ring    2(N-1) * alpha + 2(N-1)/N * n * beta      (bandwidth-optimal)
    tree    R * (alpha + n * beta), R = ceil(log2 N) (+2 folding rounds when N is
            not a power of two)                        (latency-optimal)

(Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009.) The backend's native
all-reduce is modelled as a ring, which is what gloo and NCCL run for large
buffers. Reduction arithmetic is folded into beta: it is what measurements give.

Pure Python: ``lockstep plan`` imports this without paying for torch.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """A network link in the alpha-beta model."""

    name: str
    alpha_s: float
    """Latency of one message, seconds."""
    bandwidth_gb_s: float
    """Bandwidth per direction, 1e9 bytes per second (1 / beta)."""
    source: str = ""
    """Where the numbers come from."""

    def __post_init__(self):
        if not (self.alpha_s >= 0 and math.isfinite(self.alpha_s)):
            raise ValueError(f"Link.alpha_s must be a finite number >= 0, got {self.alpha_s!r}")
        if not (self.bandwidth_gb_s > 0 and math.isfinite(self.bandwidth_gb_s)):
            raise ValueError(f"Link.bandwidth_gb_s must be a finite number > 0, got {self.bandwidth_gb_s!r}")

    @property
    def beta_s_per_byte(self) -> float:
        return 1.0 / (self.bandwidth_gb_s * 1e9)


# Loopback numbers: gloo on 127.0.0.1, 2 ranks on this 2-core machine (shared with
# other jobs), our ring all-reduce, alpha-beta fitted by `lockstep bench allreduce`
# on the median of each size, 4 KiB..256 MiB, in the quietest run we had (load
# average ~4): benchmarks/results/allreduce_2026-11-22_061413_n2.md. Same run:
# native 167 us / 1.28 GB/s; fastest iterations ring 122 us / 1.62 GB/s. Under
# heavier load (allreduce_2026-11-22_060811_n2.md) the medians are ~2x slower.
LOOPBACK_ALPHA_S = 230e-6
LOOPBACK_BANDWIDTH_GB_S = 0.97

LINKS = {
    "nvlink": Link("nvlink", 3e-6, 300.0, "NVLink 3 (A100 SXM): 600 GB/s bidirectional per GPU, datasheet; "
                                          "latency: NCCL's few-microsecond step"),
    "ib-hdr": Link("ib-hdr", 5e-6, 25.0, "InfiniBand HDR: 200 Gb/s per port per direction; "
                                        "~1-2 us verbs latency plus NCCL's step"),
    "100gbe": Link("100gbe", 25e-6, 12.5, "100 Gb Ethernet, nominal; TCP latency"),
    "10gbe": Link("10gbe", 50e-6, 1.25, "10 Gb Ethernet, nominal; TCP latency"),
    "loopback": Link(
        "loopback",
        LOOPBACK_ALPHA_S,
        LOOPBACK_BANDWIDTH_GB_S,
        "measured here: gloo over 127.0.0.1, 2 ranks on 2 shared CPU cores, ring fit of `lockstep bench allreduce` "
        "(benchmarks/results/allreduce_2026-11-22_061413_n2.md)",
    ),
}

ALGORITHMS = ("native", "ring", "tree")


def link_from_bench(path: str, algorithm: str = "native") -> Link:
    """The link a ``lockstep bench allreduce`` result file measured: its alpha-beta fit of ``algorithm`` (native:
    the backend's own all-reduce, what DDP's buckets use) on the medians. ValueError, one line naming the file,
    where the file is not such a result."""
    import json

    try:
        with open(path) as f:
            result = json.load(f)
        fit = result["summary"]["fits"]["median"][algorithm]
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from None
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{path}: not a `lockstep bench allreduce` result (no {algorithm} fit in its JSON)") from None
    if "error" in fit:
        raise ValueError(f"{path}: its {algorithm} fit failed: {fit['error']}")
    meta = result.get("meta", {})
    where = meta.get("where", "gloo ranks (127.0.0.1)")
    return Link(f"measured ({os.path.basename(path)})", fit["alpha_us"] * 1e-6, fit["bandwidth_gb_s"],
                f"lockstep bench allreduce, {meta.get('world_size', '?')} {where}: {algorithm} fit of the medians")


def _check(world_size: int, algorithm: str) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is not one of {', '.join(map(repr, ALGORITHMS))}")


def latency_steps(world_size: int, algorithm: str) -> int:
    """Sequential messages one all-reduce sends (each pays alpha once)."""
    _check(world_size, algorithm)
    n = world_size
    if n == 1:
        return 0
    if algorithm == "tree":
        p = 1 << (n.bit_length() - 1)
        return (p.bit_length() - 1) + (2 if p != n else 0)
    return 2 * (n - 1)


def bytes_factor(world_size: int, algorithm: str) -> float:
    """Bytes each rank sends per byte of buffer (the busiest link's share)."""
    _check(world_size, algorithm)
    n = world_size
    if n == 1:
        return 0.0
    if algorithm == "tree":
        return float(latency_steps(n, "tree"))
    return 2.0 * (n - 1) / n


def allreduce_time_s(nbytes: float, world_size: int, link: Link, algorithm: str = "ring") -> float:
    """Predicted seconds for one all-reduce of ``nbytes`` over ``world_size`` ranks."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    return (latency_steps(world_size, algorithm) * link.alpha_s
            + bytes_factor(world_size, algorithm) * nbytes * link.beta_s_per_byte)


def diloco_sync_every_for(sync_s: float, compute_s: float, share: float = 1.0) -> int:
    """The smallest DiLoCo ``sync_every`` (H) at which an outer sync of ``sync_s`` seconds, once every H inner steps
    of ``compute_s`` each, costs at most ``share`` of the compute: sync_s / H <= share * compute_s. With share 1 the
    point where communication stops dominating the step (a blocking sync; streaming hides it behind the next inner
    steps instead)."""
    if not (compute_s > 0 and share > 0):
        raise ValueError(f"compute_s and share must be > 0, got {compute_s!r}, {share!r}")
    return max(1, math.ceil(sync_s / (share * compute_s) - 1e-9))


def bus_bandwidth_gb_s(nbytes: float, world_size: int, time_s: float) -> float:
    """NCCL-tests' bus bandwidth: n * 2(N-1)/N / t, comparable across world sizes."""
    return nbytes * bytes_factor(world_size, "ring") / time_s / 1e9


def fit_link(sizes_bytes, times_s, world_size: int, algorithm: str = "ring", name: str = "fit") -> Link:
    """Least-squares alpha and beta from measured (size, time) pairs of one algorithm.

    Minimises the *relative* error, sum(((model - t) / t)^2), so the microsecond
    timings of small buffers weigh as much as the long ones of large buffers
    (plain least squares would fit alpha to the noise of the largest size). alpha
    is clamped at zero: a negative latency means the sizes did not pin it down.
    """
    steps, factor = latency_steps(world_size, algorithm), bytes_factor(world_size, algorithm)
    pairs = [(float(s), float(t)) for s, t in zip(sizes_bytes, times_s)]
    if len(pairs) < 2 or steps == 0:
        raise ValueError(f"fit_link needs >= 2 measurements and world_size >= 2, got {len(pairs)} and {world_size}")
    if any(t <= 0 for _, t in pairs):
        raise ValueError("fit_link: every time must be > 0")
    # Rows: [steps / t, factor * n / t] . [alpha, beta] = 1
    a11 = sum((steps / t) ** 2 for _, t in pairs)
    a12 = sum(steps * factor * n / t**2 for n, t in pairs)
    a22 = sum((factor * n / t) ** 2 for n, t in pairs)
    b1 = sum(steps / t for _, t in pairs)
    b2 = sum(factor * n / t for n, t in pairs)
    det = a11 * a22 - a12 * a12
    alpha, beta = ((b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det) if det > 0 else (-1.0, 0.0)
    if alpha < 0:
        alpha, beta = 0.0, b2 / a22
    if beta <= 0:
        raise ValueError("fit_link: the times do not grow with size; cannot fit a bandwidth")
    return Link(name, alpha, 1.0 / beta / 1e9, f"fit of {algorithm} on {world_size} ranks, {len(pairs)} sizes")
