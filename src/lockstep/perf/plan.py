"""``lockstep plan``: will a model fit, and how well will data parallelism scale?

Memory per replica is counted in bytes per parameter by component (the ZeRO
paper's accounting, Rajbhandari et al. 2020): mixed precision keeps 2-byte
weights and gradients plus a 4-byte master copy, and Adam two 4-byte moments, so
2 + 2 + 4 + 8 = 16 bytes per parameter, 112 GB for 7B parameters before any
activation. Communication is the alpha-beta cost of all-reducing the gradients
bucket by bucket (``lockstep.costmodel``), and the step time overlaps it with
the backward pass the way DDP's reducer does: bucket k is reduced while the
backward still computes buckets k+1.. .

Everything here is arithmetic on a typed config, so it runs in milliseconds and
imports torch only to count a model's parameters (``--model module:factory``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import TypedDict

from lockstep.costmodel import LINKS, Link, allreduce_time_s, diloco_sync_every_for, link_from_bench

GB = 1e9
PRECISIONS = {  # name -> (weight bytes, gradient bytes, master-weight bytes, bytes per optimizer state)
    "fp32": (4, 4, 0, 4),
    "mixed": (2, 2, 4, 4),  # fp16/bf16 compute, fp32 master weights and optimizer states
    "bf16": (2, 2, 0, 2),
    "fp16": (2, 2, 0, 2),
}
OPTIMIZERS = {"adam": 2, "adamw": 2, "sgd": 1, "sgd-nomomentum": 0}  # states per parameter
# Share of a step's compute that is backward (backward costs about twice forward).
BACKWARD_SHARE = 2.0 / 3.0
SCALING_WORLD_SIZES = [2**k for k in range(11)]  # 1 .. 1024


class PlanConfigError(ValueError):
    """A bad ``PlanConfig`` field; ``field`` names it, so ``lockstep plan`` can name its flag instead."""

    def __init__(self, field: str, problem: str):
        self.field, self.problem = field, problem
        super().__init__(f"PlanConfig.{field} {problem}")


@dataclass
class PlanConfig:
    """What ``lockstep plan`` needs to know about a job."""

    params: float | None = None
    """Parameter count (e.g. 7e9). Exactly one of ``params`` and ``model``."""
    model: str | None = None
    """A model as ``module:factory``; the factory is called with no arguments to count its parameters."""
    precision: str = "mixed"
    """One of fp32, mixed (fp16/bf16 compute + fp32 master), bf16, fp16."""
    optimizer: str = "adam"
    """One of adam, adamw, sgd (with momentum), sgd-nomomentum."""
    world_size: int = 8
    """Data-parallel replicas."""
    device_memory_gb: float = 80.0
    """Memory per device, 1e9 bytes."""
    link: str | Link = "nvlink"
    """A preset name (see ``lockstep.costmodel.LINKS``) or a ``Link``."""
    compute_ms: float | None = None
    """Forward + backward time of one step on one device; None: no step-time prediction."""
    activation_gb: float | None = None
    """Activation memory per replica, 1e9 bytes (not derived: it depends on batch and sequence). None: not
    known; counted as 0, and every verdict says it is before activations."""
    bucket_cap_mb: float = 25.0
    """DDP's gradient bucket size, MiB: each bucket pays the all-reduce latency once."""

    def __post_init__(self):
        if (self.params is None) == (self.model is None):
            raise ValueError("PlanConfig: give exactly one of `params` and `model`")
        if self.model is not None:
            if not isinstance(self.model, str) or self.model.count(":") != 1 or not all(self.model.split(":")):
                raise PlanConfigError("model", f"must look like 'package.module:factory', got {self.model!r}")
            self.params = count_parameters(self.model)
        if not (isinstance(self.params, (int, float)) and math.isfinite(self.params) and self.params > 0):
            raise PlanConfigError("params", f"must be a number > 0, got {self.params!r}")
        if self.precision not in PRECISIONS:
            raise PlanConfigError("precision", f"must be one of {sorted(PRECISIONS)}, got {self.precision!r}")
        if self.optimizer not in OPTIMIZERS:
            raise PlanConfigError("optimizer", f"must be one of {sorted(OPTIMIZERS)}, got {self.optimizer!r}")
        if not isinstance(self.world_size, int) or isinstance(self.world_size, bool) or self.world_size < 1:
            raise PlanConfigError("world_size", f"must be an integer >= 1, got {self.world_size!r}")
        if not (self.device_memory_gb > 0 and math.isfinite(self.device_memory_gb)):
            raise PlanConfigError("device_memory_gb", f"must be a finite number > 0, got {self.device_memory_gb!r}")
        if isinstance(self.link, str):
            if self.link not in LINKS:
                raise PlanConfigError("link", f"must be one of {sorted(LINKS)} or a Link, got {self.link!r}")
            self.link = LINKS[self.link]
        elif not isinstance(self.link, Link):
            raise PlanConfigError("link", f"must be a preset name or a Link, got {type(self.link).__name__}")
        if self.compute_ms is not None and not (self.compute_ms > 0 and math.isfinite(self.compute_ms)):
            raise PlanConfigError("compute_ms", f"must be a finite number > 0 (or None), got {self.compute_ms!r}")
        if self.activation_gb is not None and not (self.activation_gb >= 0 and math.isfinite(self.activation_gb)):
            raise PlanConfigError("activation_gb",
                                  f"must be a finite number >= 0 (or None), got {self.activation_gb!r}")
        if not (self.bucket_cap_mb > 0 and math.isfinite(self.bucket_cap_mb)):
            raise PlanConfigError("bucket_cap_mb", f"must be a finite number > 0, got {self.bucket_cap_mb!r}")

    # Typed views of the two fields __post_init__ resolves (a model counted, a preset name looked up): the cost
    # functions read these, so a config mutated afterwards into an unresolved state fails with its field's name.
    @property
    def param_count(self) -> float:
        """``params`` after validation (a ``model`` counted)."""
        if self.params is None:
            raise PlanConfigError("params", "is not resolved: set it (or model) and build a new PlanConfig")
        return self.params

    @property
    def resolved_link(self) -> Link:
        """``link`` after validation (a preset name looked up)."""
        if not isinstance(self.link, Link):
            raise PlanConfigError("link", f"is not resolved: got {self.link!r}; build a new PlanConfig")
        return self.link


def count_parameters(spec: str) -> int:
    """Import ``module:factory``, build the model and count its parameters."""
    module_name, factory_name = spec.split(":")
    try:
        factory = getattr(importlib.import_module(module_name), factory_name)
    except (ImportError, AttributeError) as e:
        raise PlanConfigError("model", f"{spec!r}: cannot load it ({e})") from e
    model = factory()
    if not hasattr(model, "parameters"):
        raise PlanConfigError("model", f"{spec!r}: the factory returned a {type(model).__name__}, not a torch module")
    return sum(p.numel() for p in model.parameters())


class StepTimes(TypedDict):
    """Predicted step time at the config's world size, milliseconds; ``efficiency`` is compute / overlapped step."""

    compute: float
    no_overlap: float
    overlap: float
    efficiency: float
    algorithm: str
    """The faster all-reduce algorithm at this world size ("ring" or "tree"), used for the times above."""
    overlap_step: float
    """With ``overlap_optimizer_step``: the next forward overlaps the wire too (``overlapped_step_time_s``)."""
    fp16: float
    """DDP (plain overlap) with the fp16 compress hook: half the bytes on the wire."""


@dataclass
class Plan:
    """The answer: every number ``lockstep plan`` prints."""

    config: PlanConfig
    memory_gb: dict[str, float]
    fits: bool
    sharded_memory_gb: dict[str, float]
    comm_ms: dict[str, float]
    step_ms: StepTimes | None
    scaling: list[dict] = field(default_factory=list)
    recommendation: str = ""
    activations_counted: bool = True
    """False when ``activation_gb`` was not given: ``fits`` is then before activations."""
    diloco: dict | None = None
    """DiLoCo across this link (``diloco_plan``): an outer sync's seconds and the H where it stops dominating."""


def memory_by_component_gb(config: PlanConfig) -> dict[str, float]:
    weight, grad, master, state = PRECISIONS[config.precision]
    p = config.param_count
    parts = {
        "weights": p * weight / GB,
        "gradients": p * grad / GB,
        "master_weights": p * master / GB,
        "optimizer_state": p * state * OPTIMIZERS[config.optimizer] / GB,
        "activations": config.activation_gb or 0.0,
    }
    parts["total"] = sum(parts.values())
    return parts


def comm_time_s(config: PlanConfig, world_size: int, algorithm: str) -> float:
    """All-reduce time of one step's gradients, bucket by bucket (each bucket pays its latency)."""
    grad_nbytes = config.param_count * PRECISIONS[config.precision][1]
    bucket_nbytes = config.bucket_cap_mb * (1 << 20)
    full, rest = divmod(grad_nbytes, bucket_nbytes)
    link = config.resolved_link
    t = full * allreduce_time_s(bucket_nbytes, world_size, link, algorithm)
    return t + (allreduce_time_s(rest, world_size, link, algorithm) if rest else 0.0)


def step_time_s(config: PlanConfig, comm_s: float) -> tuple[float, float]:
    """(without overlap, with overlap) step time for a step whose all-reduce takes ``comm_s``.

    With overlap, buckets become ready evenly through the backward pass and are
    reduced one at a time: the last finishes at max(backward + one bucket,
    backward / buckets + all of them) after the backward starts.
    """
    if config.compute_ms is None:
        raise PlanConfigError("compute_ms", "is None: a step time needs the compute time of one step")
    compute = config.compute_ms / 1e3
    backward = compute * BACKWARD_SHARE
    buckets = buckets_of(config)
    overlapped = (compute - backward) + max(backward + comm_s / buckets, backward / buckets + comm_s)
    return compute + comm_s, overlapped


def buckets_of(config: PlanConfig) -> int:
    """How many buckets the gradients make at ``bucket_cap_mb``."""
    grad_nbytes = config.param_count * PRECISIONS[config.precision][1]
    return max(1, math.ceil(grad_nbytes / (config.bucket_cap_mb * (1 << 20))))


def overlapped_step_time_s(config: PlanConfig, comm_s: float) -> float:
    """Step time with ``overlap_optimizer_step``: each bucket's parameters are stepped in the next forward as their
    average lands, the first layers' first, so the wire stays busy across the step boundary except while the next
    step's first bucket is computed (a bucket's share of the forward and the backward): max(compute, that + the
    all-reduce)."""
    if config.compute_ms is None:
        raise PlanConfigError("compute_ms", "is None: a step time needs the compute time of one step")
    compute = config.compute_ms / 1e3
    return max(compute, comm_s + compute / buckets_of(config))


def diloco_plan(config: PlanConfig) -> dict | None:
    """An outer sync of DiLoCo (``lockstep.DiLoCo``: the fp32 pseudo-gradients, all-reduced in bucket_cap_mb buckets
    over world_size nodes) against H inner steps of compute_ms; None without compute_ms."""
    if config.compute_ms is None:
        return None
    pseudo = dataclasses.replace(config, precision="fp32")  # the pseudo-gradients cross as fp32 (bf16: half)
    sync_s = min(comm_time_s(pseudo, config.world_size, a) for a in ("ring", "tree"))
    compute_s = config.compute_ms / 1e3
    return {"sync_nbytes": config.param_count * 4, "sync_ms": sync_s * 1e3,
            "h_dominates": diloco_sync_every_for(sync_s, compute_s),
            "h_10_percent": diloco_sync_every_for(sync_s, compute_s, 0.1)}


def make_plan(config: PlanConfig) -> Plan:
    memory = memory_by_component_gb(config)
    fits = memory["total"] <= config.device_memory_gb
    n = config.world_size
    states = memory["master_weights"] + memory["optimizer_state"]
    act = memory["activations"]
    sharded = {  # per-rank memory at this world size with each ZeRO stage
        "zero1": memory["weights"] + memory["gradients"] + states / n + act,
        "zero2": memory["weights"] + (memory["gradients"] + states) / n + act,
        "zero3_fsdp": (memory["weights"] + memory["gradients"] + states) / n + act,
    }
    comm = {a: comm_time_s(config, n, a) * 1e3 for a in ("ring", "tree")}
    best = min(comm, key=comm.__getitem__)
    step_ms: StepTimes | None = None
    scaling = []
    for size in SCALING_WORLD_SIZES:
        row = {"world_size": size, "ring_ms": comm_time_s(config, size, "ring") * 1e3,
               "tree_ms": comm_time_s(config, size, "tree") * 1e3}
        if config.compute_ms is not None:
            _, overlapped = step_time_s(config, min(row["ring_ms"], row["tree_ms"]) / 1e3)
            row["step_ms"] = overlapped * 1e3
            row["efficiency"] = config.compute_ms / row["step_ms"]
        scaling.append(row)
    if config.compute_ms is not None:
        plain, overlapped = step_time_s(config, comm[best] / 1e3)
        _, fp16 = step_time_s(config, comm_time_s(dataclasses.replace(config, precision="fp16"), n, best))
        step_ms = StepTimes(compute=config.compute_ms, no_overlap=plain * 1e3, overlap=overlapped * 1e3,
                            efficiency=config.compute_ms / (overlapped * 1e3), algorithm=best,
                            overlap_step=overlapped_step_time_s(config, comm[best] / 1e3) * 1e3, fp16=fp16 * 1e3)
    plan = Plan(config, memory, fits, sharded, comm, step_ms, scaling,
                activations_counted=config.activation_gb is not None, diloco=diloco_plan(config))
    plan.recommendation = recommend(plan)
    return plan


# How to get each sharding stage with lockstep: printed beside a recommendation that names the stage. ZeRO-1 is
# lockstep.ZeroRedundancyOptimizer (torch's API; tests/test_zero.py: bit for bit with torch's class and with a plain
# optimizer under lockstep's DDP), ZeRO-2 DistributedDataParallel.zero_optimizer (gradients reduce-scattered in the
# reducer); sharded weights need torch's FSDP in place of lockstep's DDP. docs/zero.md says when to use which.
OPTIMIZER_CLASSES = {"adam": "torch.optim.Adam", "adamw": "torch.optim.AdamW", "sgd": "torch.optim.SGD",
                     "sgd-nomomentum": "torch.optim.SGD"}


def how(stage: str, optimizer: str = "adamw") -> str:
    """The lockstep call (or torch's) that gives ``stage``, with the plan's optimizer class in it."""
    cls = OPTIMIZER_CLASSES[optimizer]
    return {
        "zero1": f"opt = lockstep.ZeroRedundancyOptimizer(model.parameters(), optimizer_class={cls}, lr=...) "
                 "with model = lockstep.DistributedDataParallel(...)",
        "zero2": f"opt = model.zero_optimizer({cls}, stage=2, lr=...) with model = "
                 "lockstep.DistributedDataParallel(...) (DistributedDataParallel.zero_optimizer)",
        "zero3_fsdp": "torch's FSDP, torch.distributed.fsdp.fully_shard(model), "
                      "in place of lockstep.DistributedDataParallel",
    }[stage]


HOW = {stage: how(stage) for stage in ("zero1", "zero2", "zero3_fsdp")}
STAGE_NAMES = {"zero1": "ZeRO-1 (shard optimizer state)", "zero2": "ZeRO-2 (shard gradients and optimizer state)",
               "zero3_fsdp": "ZeRO-3 / FSDP (shard everything)"}
# What each stage sends a step, in the gradients' bytes (ring: each factor times (N-1)/N): DDP all-reduces them (2);
# ZeRO-1 all-reduces them and sends the updated parameters to every rank (3, parameters as large as gradients);
# ZeRO-2 reduce-scatters them and all-gathers the parameters (2); FSDP all-gathers the parameters for the forward
# and again for the backward, and reduce-scatters the gradients (3).
WIRE = {"zero1": "+50% bytes on the wire (the updated parameters, sent from their owners after the step)",
        "zero2": "the same bytes on the wire as DDP (reduce-scatter + all-gather instead of all-reduce)",
        "zero3_fsdp": "+50% bytes on the wire (the parameters gathered for forward and backward)"}


def min_world_size(plan: Plan, stage: str) -> int | None:
    """The fewest ranks at which ``stage`` fits a device, or None where the part it does not shard is too big."""
    kept, sharded = _kept_and_sharded(plan.memory_gb, stage)
    free = plan.config.device_memory_gb - kept - plan.memory_gb["activations"]
    return max(1, math.ceil(sharded / free)) if free > 0 else None


def _kept_and_sharded(mem: dict[str, float], stage: str) -> tuple[float, float]:
    """(GB every rank keeps whole, GB divided over the ranks) with ``stage``; activations apart."""
    states = mem["master_weights"] + mem["optimizer_state"]
    return {"zero1": (mem["weights"] + mem["gradients"], states),
            "zero2": (mem["weights"], mem["gradients"] + states),
            "zero3_fsdp": (0.0, mem["weights"] + mem["gradients"] + states)}[stage]


def _fits_text(plan: Plan) -> str:
    """"Fits (16.0 of 80 GB)", or, with activations unknown, says the verdict is before them."""
    c, mem = plan.config, plan.memory_gb
    if c.activation_gb is None:
        return (f"Fits before activations ({mem['total']:.1f} of {c.device_memory_gb:g} GB, "
                f"{c.device_memory_gb - mem['total']:.1f} GB left for them; pass --activation-gb)")
    return f"Fits ({mem['total']:.1f} of {c.device_memory_gb:g} GB)"


def recommend(plan: Plan) -> str:
    if not plan.fits:
        return _sharding_advice(plan)
    fits = _fits_text(plan)
    if plan.step_ms is None:
        return f"{fits}: plain DDP. Pass --compute-ms to check scaling."
    eff = plan.step_ms["efficiency"]
    if eff >= 0.8:
        return f"{fits}: plain DDP, predicted efficiency {eff:.0%}."
    compute_ms = plan.step_ms["compute"]  # the config's compute_ms
    exposed = plan.step_ms["overlap"] - compute_ms  # communication the backward could not hide
    pays = _what_pays(plan.step_ms)
    for k in range(2, 257):  # k micro-steps per all-reduce (no_sync on the first k-1)
        if k * compute_ms / (k * compute_ms + exposed) >= 0.9:
            return (f"{fits}, but communication-bound (efficiency {eff:.0%}): accumulate gradients over {k} "
                    f"micro-steps (DDP no_sync) for >= 90%, or use a faster link / compressed gradients.{pays}")
    return (f"{fits}, but communication dominates (efficiency {eff:.0%}): use a faster link or fewer replicas."
            f"{pays}")


def _sharding_advice(plan: Plan) -> str:
    """"Does not fit" turned into the first ZeRO stage that fits at this N, its GB per rank and the call that gives
    it; where only FSDP fits (or nothing), also the N at which lockstep's ZeRO-2 would."""
    c, mem = plan.config, plan.memory_gb
    head = f"Does not fit: {mem['total']:.1f} GB per replica > {c.device_memory_gb:g} GB."
    before = "" if c.activation_gb is not None else \
        "\n  (that is before activations, which are not counted: pass --activation-gb)"
    zero2_at = min_world_size(plan, "zero2")
    later = (f"\n  or ZeRO-2 with lockstep at N >= {zero2_at}: "
             f"{_sharded_at(plan, 'zero2', zero2_at):.1f} GB per rank ({how('zero2', c.optimizer)})"
             if zero2_at is not None and zero2_at > c.world_size else "")
    for stage, need in plan.sharded_memory_gb.items():
        if need <= c.device_memory_gb:
            return (f"{head} Fits with {STAGE_NAMES[stage]} at N={c.world_size}: {need:.1f} GB per rank, "
                    f"{WIRE[stage]}.{before}\n  how: {how(stage, c.optimizer)}{later if stage == 'zero3_fsdp' else ''}")
    whole = mem["total"] - mem["activations"]
    free = c.device_memory_gb - mem["activations"]
    need_n = math.ceil(whole / free) if free > 0 else None
    more = f"FSDP needs N >= {need_n} devices" if need_n else "the activations alone exceed a device"
    return (f"Does not fit even fully sharded at N={c.world_size}: {more} ({HOW['zero3_fsdp']}); or add "
            f"tensor/pipeline parallelism or activation checkpointing.{later}")


def _sharded_at(plan: Plan, stage: str, world_size: int) -> float:
    """GB per rank with ``stage`` at ``world_size`` ranks (the config's own N is ``sharded_memory_gb``)."""
    kept, sharded = _kept_and_sharded(plan.memory_gb, stage)
    return kept + sharded / world_size + plan.memory_gb["activations"]


def _what_pays(step_ms: StepTimes) -> str:
    """Whether the overlapped optimizer step and fp16 compression pay, by their predicted step against DDP's."""
    plain = step_ms["overlap"]
    lines = []
    for key, what in (("overlap_step", "opt = model.overlap_optimizer_step(opt) (the same bits)"),
                      ("fp16", "the fp16 compress hook (fp16 rounding of the averages)")):
        gain = 1 - step_ms[key] / plain  # type: ignore[literal-required]
        verdict = "pays" if gain >= 0.05 else "does not pay"
        lines.append(f"\n  {what}: {step_ms[key]:.1f} ms a step, {gain:+.0%} against DDP's {plain:.1f}: {verdict}")  # type: ignore[literal-required]
    return "".join(lines)


def format_plan(plan: Plan) -> str:
    c, link = plan.config, plan.config.resolved_link
    out = [f"{c.params:.3g} parameters, {c.precision} precision, {c.optimizer}, N={c.world_size}, "
           f"{c.device_memory_gb:g} GB per device, link {link.name} "
           f"(alpha {link.alpha_s * 1e6:g} us, {link.bandwidth_gb_s:g} GB/s)", "", "memory per replica (GB):"]
    unknown = c.activation_gb is None
    for k, v in plan.memory_gb.items():
        per_param = "" if k == "activations" else f"   {v * GB / c.param_count:5.1f} B/param"
        out.append(f"  {k:<16}{v:10.2f}{per_param}")
    verdict = "yes" if plan.fits else "NO"
    if unknown and plan.fits:  # never a bare "yes": activations often outweigh the rest (batch x sequence x layers)
        verdict += f", before activations ({c.device_memory_gb - plan.memory_gb['total']:.2f} GB left for them)"
    out.append(f"  fits in {c.device_memory_gb:g} GB: {verdict}")
    if unknown:
        out.append("  activations are not counted: unknown (pass --activation-gb; torch.cuda.max_memory_allocated() "
                   "after one step, less the rest, measures them)")
    out.append("  sharded, per rank: " + ", ".join(f"{k} {v:.2f}" for k, v in plan.sharded_memory_gb.items()))
    out.append(f"  ZeRO-1 with lockstep: {how('zero1', c.optimizer)}")
    out.append(f"  ZeRO-2 with lockstep: {how('zero2', c.optimizer)}")
    out.append(f"  ZeRO-3: {HOW['zero3_fsdp']}")
    out.append(f"\ngradient all-reduce per step at N={c.world_size}: ring {plan.comm_ms['ring']:.2f} ms, "
               f"tree {plan.comm_ms['tree']:.2f} ms ({c.bucket_cap_mb:g} MiB buckets)")
    if plan.step_ms:
        s = plan.step_ms
        out.append(f"step time: compute {s['compute']:.2f} ms, without overlap {s['no_overlap']:.2f} ms, "
                   f"with overlap {s['overlap']:.2f} ms ({s['algorithm']}), efficiency {s['efficiency']:.1%}")
        out.append(f"  with overlap_optimizer_step {s['overlap_step']:.2f} ms, with the fp16 hook {s['fp16']:.2f} ms")
    if plan.diloco:
        d = plan.diloco
        out.append(f"DiLoCo across this link (lockstep.DiLoCo): an outer sync all-reduces {d['sync_nbytes'] / 1e6:.1f} "
                   f"MB in {d['sync_ms']:.1f} ms; communication stops dominating at sync_every (H) >= "
                   f"{d['h_dominates']} (sync / H <= compute), under 10% of the step at H >= {d['h_10_percent']}")
    out.append("\n     N    ring ms    tree ms   efficiency")
    for row in plan.scaling:
        eff = f"{row['efficiency']:10.1%}" if "efficiency" in row else "       n/a"
        out.append(f"{row['world_size']:6d} {row['ring_ms']:10.2f} {row['tree_ms']:10.2f}   {eff}")
    out.append(f"\nrecommendation: {plan.recommendation}")
    return "\n".join(out)


# PlanConfig field -> the flag that sets it, for errors that name what the user typed.
FLAGS = {"params": "--params", "model": "--model", "precision": "--precision", "optimizer": "--optimizer",
         "world_size": "--world-size", "device_memory_gb": "--device-memory-gb", "link": "--link",
         "compute_ms": "--compute-ms", "activation_gb": "--activation-gb", "bucket_cap_mb": "--bucket-cap-mb"}


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lockstep plan", description="memory and communication cost model for DDP")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=float, help="parameter count, e.g. 7e9")
    what.add_argument("--model", help="module:factory building the model (its parameters are counted)")
    p.add_argument("--precision", default="mixed", choices=sorted(PRECISIONS))
    p.add_argument("--optimizer", default="adam", choices=sorted(OPTIMIZERS))
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--device-memory-gb", type=float, default=80.0)
    p.add_argument("--link", default=None, choices=sorted(LINKS), help="a link's nominal numbers (default nvlink)")
    p.add_argument("--link-from", metavar="FILE",
                   help="the link a 'lockstep bench allreduce' result (its .json) measured, e.g. run across the "
                        "nodes with 'lockstep launch ... -m lockstep bench allreduce'")
    p.add_argument("--alpha-us", type=float, help="override the link's latency, microseconds")
    p.add_argument("--bandwidth-gb-s", type=float, help="override the link's bandwidth, GB/s")
    p.add_argument("--compute-ms", type=float, help="forward+backward time of one step on one device")
    p.add_argument("--activation-gb", type=float, default=None,
                   help="activation memory per replica, GB (default: not counted, and the verdict says so)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = p.parse_args(argv)
    if args.model and "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # `--model mymodels:build` from the project directory, like `python -m`
    if args.link_from is not None and args.link is not None:
        p.error("argument --link-from: give --link or --link-from, not both")
    try:
        link = LINKS[args.link or "nvlink"] if args.link_from is None else link_from_bench(args.link_from)
    except ValueError as e:
        p.error(f"argument --link-from: {e}")
    if args.alpha_us is not None and not (args.alpha_us >= 0 and math.isfinite(args.alpha_us)):
        p.error(f"argument --alpha-us: must be a finite number >= 0, got {args.alpha_us:g}")
    if args.bandwidth_gb_s is not None and not (args.bandwidth_gb_s > 0 and math.isfinite(args.bandwidth_gb_s)):
        p.error(f"argument --bandwidth-gb-s: must be a finite number > 0, got {args.bandwidth_gb_s:g}")
    if args.alpha_us is not None or args.bandwidth_gb_s is not None:
        alpha_s = link.alpha_s if args.alpha_us is None else args.alpha_us * 1e-6
        bandwidth_gb_s = link.bandwidth_gb_s if args.bandwidth_gb_s is None else args.bandwidth_gb_s
        link = dataclasses.replace(link, name=f"{link.name} (overridden)", source="command line",
                                   alpha_s=alpha_s, bandwidth_gb_s=bandwidth_gb_s)
    try:
        config = PlanConfig(params=args.params, model=args.model, precision=args.precision, optimizer=args.optimizer,
                            world_size=args.world_size, device_memory_gb=args.device_memory_gb, link=link,
                            compute_ms=args.compute_ms, activation_gb=args.activation_gb,
                            bucket_cap_mb=args.bucket_cap_mb)
    except PlanConfigError as e:
        p.error(f"argument {FLAGS.get(e.field, e.field)}: {e.problem}")
    except Exception as e:  # the --model factory itself failed: its error, on one line, naming the flag
        p.error(f"argument --model: {args.model}: {type(e).__name__}: {e}")
    plan = make_plan(config)
    if args.json:
        print(json.dumps(dataclasses.asdict(plan), indent=1, default=str))
    else:
        print(format_plan(plan))
    return 0
