"""Time to quality across a shaped link: DDP against DiLoCo (issue #44), one rank a node, in one run.

Needs root, ``ip`` and ``tc`` (otherwise it says why and exits 0, a skip). ``tests/netns.py`` builds two network
namespaces joined by a veth pair, each end shaped with a token bucket (``tc qdisc replace dev VETH root tbf rate
RATE burst 256kb latency 100ms``) at each of ``--rates``; one rank (1 thread, gloo over the veth) runs in each.
Per rate and task the two ranks train each contender in turn, from the same initial parameters and the same
per-rank batches:

    ddp          lockstep.DistributedDataParallel (its defaults), AdamW: every step all-reduces the gradients;
                 it trains ``--steps`` steps, and its final eval loss and wall time set the target and the cap
    single       rank 0 alone (the other rank waits), the same AdamW and batch a rank: what one node does alone
    diloco_h<H>  lockstep.DiLoCo(sync_every=H), AdamW inner steps; the outer optimizer ``--outer-lr`` /
                 ``--outer-momentum`` (default SGD lr 1.0 without momentum: the best of the settings measured in
                 300 GPT steps, docs/diloco.md; the paper's lr 0.7 with Nesterov 0.9 overshoots in runs this
                 short) and ``--warmup-steps`` synchronous steps first (default 0)
    streaming    lockstep.DiLoCo(sync_every=50, fragments=2, overlap_steps=1): each fragment's all-reduce
                 launched after its step and landed one inner step later

Every contender but DDP trains at least DDP's steps (its eval loss there is the "equal inner steps" figure) and
then on until its eval loss reaches DDP's final one or its wall time passes ``--time-cap`` x DDP's.

The tasks: ``gpt``, a 4-layer character-level GPT (0.8M parameters, context 32, 8 sequences a step) on a text
corpus generated deterministically here (``corpus``: sentences of a small grammar over some sixty words, so the
loss keeps falling for thousands of steps), and ``cnn``, the demo's DigitsCNN on scikit-learn's digits
(``lockstep.train.data``). The eval loss is measured every ``--eval-every`` steps on rank 0 (DiLoCo's: of the
synced copy, the model every node agrees on), off the clock; wall time is the training's alone. Rank 0 reads its
veth's ``tx_bytes`` (``wire_account.py``'s counter) around each contender: the bytes node 0 sent a step.

Reported per rate and task: DDP's final eval loss (the target), each contender's wall time to reach it (the first
evaluation at or below it) as a ratio to DDP's, its eval loss after as many inner steps as DDP took (DiLoCo: after
a last full sync), and its bytes a step as a multiple of DDP's, over the whole run and over the outer loop alone
(after the warm-up; the goal: <= 1.1 / H). A plot of eval loss
against wall time per rate and task (matplotlib), all in ``--out`` (benchmarks/results/diloco-<date>.md, .json,
.png).

    python benchmarks/diloco.py [--rates 100mbit,1gbit] [--tasks gpt,cnn] [--steps gpt:200,cnn:300] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
CONTENDERS = ("ddp", "single", "diloco_h10", "diloco_h50", "diloco_h200", "streaming")
WARMUP_STEPS, OUTER_LR, OUTER_MOMENTUM = 0, 1.0, 0.0  # measured best in 300 GPT steps (docs/diloco.md)


# ---------------------------------------------------------------------------------------------- the corpus
def corpus(n_sentences: int = 40_000, seed: int = 0) -> str:
    """Sentences of a small grammar, the same text on every machine (Python's ``random`` with a fixed seed): a
    subject, a verb agreeing with it, an object, sometimes a place and a time. Words come in Zipf-like
    frequencies, so a character model learns the common ones early and the rare ones for a long time."""
    rng = random.Random(seed)
    nouns = ("cat dog bird horse farmer teacher child river mountain engine garden letter doctor sailor baker "
             "window candle village forest student painter hunter dragon castle merchant soldier queen king "
             "wizard robot pilot").split()
    verbs = ("see find follow carry paint watch build open close visit call help love fear chase remember "
             "answer measure gather".split())
    adjectives = "old young red quiet bright heavy small brave golden silent tired clever".split()
    places = "near the river|in the forest|under the bridge|behind the castle|at the market|on the hill".split("|")
    times = "at dawn|every morning|before winter|after the storm|at night|in spring".split("|")

    def pick(words: list[str]) -> str:
        return words[min(int(rng.paretovariate(1.2)) - 1, len(words) - 1)]  # Zipf-like: the first words most

    def noun_phrase() -> tuple[str, bool]:
        plural = rng.random() < 0.3
        noun = pick(nouns) + ("s" if plural else "")
        adjective = pick(adjectives) + " " if rng.random() < 0.5 else ""
        return f"{'the' if plural or rng.random() < 0.6 else 'a'} {adjective}{noun}", plural

    lines = []
    for _ in range(n_sentences):
        subject, plural = noun_phrase()
        verb = pick(verbs) + ("" if plural else "s")
        obj, _ = noun_phrase()
        tail = (" " + rng.choice(places) if rng.random() < 0.4 else "") + (" " + rng.choice(times)
                                                                          if rng.random() < 0.3 else "")
        lines.append(f"{subject} {verb} {obj}{tail}.")
    return " ".join(lines)


# ---------------------------------------------------------------------------------------------- the tasks
class Block(nn.Module):
    def __init__(self, d: int, heads: int, context: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.register_buffer("mask", torch.triu(torch.ones(context, context, dtype=torch.bool), 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask[:t, :t], need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A character-level GPT: token and position embeddings, 4 pre-norm blocks, a linear head; 0.8M parameters."""

    def __init__(self, vocab: int, d: int = 128, layers: int = 4, heads: int = 4, context: int = 32) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.Sequential(*[Block(d, heads, context) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.ln(self.blocks(x)))


class Task:
    """A model, its per-rank batches (a generator per rank and contender: every contender sees the same ones) and
    a fixed eval set."""

    def __init__(self, name: str):
        self.name = name
        if name == "gpt":
            text = corpus()
            chars = sorted(set(text))
            data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
            split = int(len(data) * 0.9)
            # 8 sequences of 32 characters a step: a small step's compute against 0.8M parameters' 3.2 MB
            self.train_tokens, self.vocab, self.context = data[:split], len(chars), 32
            g = torch.Generator().manual_seed(1)
            starts = torch.randint(split, len(data) - self.context - 1, (64,), generator=g)
            self.eval_x = torch.stack([data[s:s + self.context] for s in starts])
            self.eval_y = torch.stack([data[s + 1:s + 1 + self.context] for s in starts])
            self.batch_size, self.lr = 8, 2e-3
        else:
            from lockstep.train.data import digits_datasets

            train, test = digits_datasets(seed=0)
            self.train_x, self.train_y = train.tensors
            self.eval_x, self.eval_y = test.tensors
            self.batch_size, self.lr = 16, 1e-3

    def model(self) -> nn.Module:
        torch.manual_seed(0)
        if self.name == "gpt":
            return GPT(self.vocab, context=self.context)
        from lockstep.train.demo import DigitsCNN

        return DigitsCNN()

    def batch(self, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        if self.name == "gpt":
            starts = torch.randint(0, len(self.train_tokens) - self.context - 1, (self.batch_size,), generator=g)
            x = torch.stack([self.train_tokens[s:s + self.context] for s in starts])
            y = torch.stack([self.train_tokens[s + 1:s + 1 + self.context] for s in starts])
            return x, y
        index = torch.randint(0, len(self.train_y), (self.batch_size,), generator=g)
        return self.train_x[index], self.train_y[index]

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = model(x)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    @torch.no_grad()
    def eval_loss(self, model: nn.Module) -> float:
        model.eval()
        loss = self.loss(model, self.eval_x, self.eval_y).item()
        model.train()
        return loss


# ---------------------------------------------------------------------------------------------- one rank
def _tx_bytes() -> int:
    path = Path("/sys/class/net") / os.environ.get("GLOO_SOCKET_IFNAME", "") / "statistics" / "tx_bytes"
    return int(path.read_text()) if path.exists() else 0


def _diloco_config(name: str, outer: dict):
    from lockstep import DiLoCoConfig

    if name == "streaming":
        return DiLoCoConfig(sync_every=50, fragments=2, overlap_steps=1, **outer)
    return DiLoCoConfig(sync_every=int(name.removeprefix("diloco_h")), **outer)


def train_contender(task: Task, name: str, steps: int, eval_every: int, outer: dict, target: float | None = None,
                    time_cap_s: float | None = None) -> dict:
    """One contender on this rank; rank 0's curve of (inner step, wall s, eval loss) and bytes sent.

    DDP (``target`` None) trains ``steps`` steps. The others train at least ``steps`` (their eval loss at DDP's
    steps) and go on until their eval loss is at or below ``target`` (DDP's final) or their wall time passes
    ``time_cap_s``: rank 0 decides at each evaluation and tells the other (off the clock)."""
    import lockstep

    rank = dist.get_rank()
    model = task.model()
    alone = name == "single"
    if alone and rank != 0:
        dist.barrier()  # rank 1 idles while rank 0 trains alone (a barrier's wait spins no core)
        return {}
    net: nn.Module = model
    diloco = None
    if name == "ddp":
        net = lockstep.DistributedDataParallel(model)
    elif name != "single":
        diloco = lockstep.DiLoCo(model, _diloco_config(name, outer))
    opt = torch.optim.AdamW(model.parameters(), lr=task.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(1000 + rank)
    curve = [(0, 0.0, task.eval_loss(model))] if rank == 0 else []
    wall_s, tx_start, step, going = 0.0, _tx_bytes(), 0, True
    warmup = diloco.config.warmup_steps if diloco is not None else 0
    tx_warm = tx_start
    while going:
        if step == warmup:
            tx_warm = _tx_bytes()  # the outer loop's bytes are counted from here
        step += 1
        t0 = time.perf_counter()
        x, y = task.batch(g)
        task.loss(net, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if diloco is not None:
            diloco.step()
            if step == steps:
                diloco.sync()  # every fragment at DDP's step count: the model evaluated at equal inner steps
        wall_s += time.perf_counter() - t0
        if step % eval_every == 0 or (target is None and step == steps):
            stop = torch.zeros(1)
            if rank == 0:
                with diloco.global_parameters() if diloco is not None else contextlib.nullcontext():
                    curve.append((step, wall_s, task.eval_loss(model)))
                reached = target is not None and curve[-1][2] <= target
                stop[0] = step >= steps and (target is None or reached or wall_s >= (time_cap_s or 0.0))
            if not alone:
                dist.broadcast(stop, src=0)  # the other rank waits for rank 0's evaluation: off the clock on both
            going = not bool(stop[0])
    tx = _tx_bytes() - tx_start
    if alone:
        dist.barrier()
    return {"curve": curve, "tx_bytes": tx, "steps": step, "numel": sum(p.numel() for p in model.parameters()),
            "warmup_steps": warmup, "outer_tx_bytes": _tx_bytes() - tx_warm,
            "sync_nbytes": diloco.wire_nbytes if diloco is not None else None}


def worker(config_path: str) -> int:
    """One rank, inside its namespace: RANK, WORLD_SIZE, MASTER_ADDR/PORT and GLOO_SOCKET_IFNAME in the env."""
    cfg = json.loads(Path(config_path).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    try:
        results = {}
        for task_name in cfg["tasks"]:
            task = Task(task_name)
            target = cap = None
            for name in ["ddp", *(c for c in cfg["contenders"] if c != "ddp")]:  # DDP first: it sets the target
                dist.barrier()
                r = train_contender(task, name, cfg["steps"][task_name], cfg["eval_every"][task_name],
                                    cfg["outer"], target, cap)
                results[f"{task_name}/{name}"] = r
                if name == "ddp":
                    final = torch.tensor([r["curve"][-1][2], r["curve"][-1][1]] if r["curve"] else [0.0, 0.0],
                                         dtype=torch.float64)
                    dist.broadcast(final, src=0)
                    target, cap = float(final[0]), cfg["time_cap"] * float(final[1])
                if dist.get_rank() == 0:
                    print(f"diloco.py: {cfg['rate']} {task_name} {name}: {_short(results[f'{task_name}/{name}'])}",
                          flush=True)
        if dist.get_rank() == 0:
            Path(cfg["result"]).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()
    return 0


def _short(r: dict) -> str:
    step, wall, loss = r["curve"][-1]
    return f"{step} steps in {wall:.1f} s, eval loss {loss:.4f}, {r['tx_bytes'] / max(step, 1) / 1e3:.1f} kB a step"


# ---------------------------------------------------------------------------------------------- the report
def time_to(curve: list, target: float) -> tuple[int, float] | None:
    """(inner step, wall seconds) at the first evaluation at or below ``target`` (None: never)."""
    return next(((step, wall) for step, wall, loss in curve if loss <= target), None)


def loss_at(curve: list, step: int) -> float:
    return next(loss for s, _, loss in curve if s >= step)


def summarise(results: dict, task: str, steps: int) -> dict:
    ddp = results[f"{task}/ddp"]
    target = ddp["curve"][-1][2]
    ddp_time = ddp["curve"][-1][1]
    ddp_bytes = ddp["tx_bytes"] / ddp["steps"]
    rows = {}
    for name in CONTENDERS:
        r = results.get(f"{task}/{name}")
        if not r:
            continue
        reach = time_to(r["curve"], target)
        h = 50 if name == "streaming" else int(name.removeprefix("diloco_h")) if name.startswith("diloco") else 1
        outer_steps = r["steps"] - r.get("warmup_steps", 0)
        rows[name] = {"time_to_target_s": reach[1] if reach else None,
                      "steps_to_target": reach[0] if reach else None,
                      "time_ratio": reach[1] / ddp_time if reach is not None else None,
                      "eval_loss_at_steps": loss_at(r["curve"], steps),
                      "loss_vs_ddp": loss_at(r["curve"], steps) / target - 1,
                      "final_step": r["curve"][-1][0], "final_eval_loss": r["curve"][-1][2],
                      "bytes_per_step": r["tx_bytes"] / r["steps"],
                      "bytes_ratio": r["tx_bytes"] / r["steps"] / ddp_bytes if name != "single" else None,
                      "outer_bytes_ratio": (r.get("outer_tx_bytes", r["tx_bytes"]) / max(outer_steps, 1) / ddp_bytes
                                            if name.startswith(("diloco", "streaming")) else None),
                      "bytes_goal": 1.1 / h if name.startswith(("diloco", "streaming")) else None,
                      "wall_s": r["curve"][-1][1], "step_ms": 1e3 * r["curve"][-1][1] / r["curve"][-1][0]}
    return {"target": target, "ddp_time_s": ddp_time, "ddp_steps": ddp["steps"], "rows": rows}


def markdown(rate: str, task: str, s: dict) -> list[str]:
    out = [f"### {task} at {rate}", "",
           f"DDP's final eval loss {s['target']:.4f} after {s['ddp_steps']} steps in {s['ddp_time_s']:.1f} s (the "
           f"target).", "",
           "| contender | step ms | time to DDP's final loss (at step) | x DDP's time | eval loss at DDP's steps "
           "| vs DDP | last eval (step) | bytes a step | x DDP's | outer loop's x DDP's | goal (1.1/H) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in s["rows"].items():
        reach = (f"{r['time_to_target_s']:.1f} s ({r['steps_to_target']})" if r["time_to_target_s"] is not None
                 else "not reached")
        ratio = f"{r['time_ratio']:.3f}" if r["time_ratio"] is not None else "-"
        bratio = f"{r['bytes_ratio']:.4f}" if r["bytes_ratio"] is not None else "-"
        oratio = f"{r['outer_bytes_ratio']:.4f}" if r.get("outer_bytes_ratio") is not None else "-"
        goal = f"{r['bytes_goal']:.4f}" if r["bytes_goal"] is not None else "-"
        out.append(f"| {name} | {r['step_ms']:.1f} | {reach} | {ratio} | {r['eval_loss_at_steps']:.4f} | "
                   f"{r['loss_vs_ddp']:+.1%} | {r['final_eval_loss']:.4f} ({r['final_step']}) | "
                   f"{r['bytes_per_step'] / 1e3:.1f} kB | {bratio} | {oratio} | {goal} |")
    return [*out, ""]


def plot(results: dict, rates: list[str], tasks: list[str], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(len(tasks), len(rates), figsize=(6 * len(rates), 4 * len(tasks)), squeeze=False)
    for i, task in enumerate(tasks):
        for j, rate in enumerate(rates):
            ax = axes[i][j]
            for name in CONTENDERS:
                r = results.get(rate, {}).get(f"{task}/{name}")
                if r:
                    ax.plot([c[1] for c in r["curve"]], [c[2] for c in r["curve"]], label=name, marker=".")
            ax.set_xscale("symlog", linthresh=1.0)
            ax.set_title(f"{task} at {rate}")
            ax.set_xlabel("wall time (s, training only)")
            ax.set_ylabel("eval loss")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True


# ---------------------------------------------------------------------------------------------- the launcher
def skip_reason() -> str | None:
    sys.path.insert(0, str(REPO / "tests"))
    import netns

    reason = netns.unavailable_reason()
    if reason is None and subprocess.run(["which", "tc"], capture_output=True).returncode != 0:
        reason = "shaping the link needs the `tc` command (apt-get install iproute2)"
    return reason


def _launch(nodes, cfg_path: Path, timeout_s: float) -> bool:
    port = random.randint(20000, 40000)
    procs = []
    for n, node in enumerate(nodes):
        env = dict(os.environ, RANK=str(n), WORLD_SIZE=str(len(nodes)), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   GROUP_RANK=str(n), MASTER_ADDR=nodes[0].addr, MASTER_PORT=str(port),
                   GLOO_SOCKET_IFNAME=node.interface, PYTHONPATH=str(REPO / "src"))
        argv = node.command([sys.executable, str(Path(__file__).resolve()), "--worker", str(cfg_path)])
        procs.append(subprocess.Popen(argv, env=env))
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                print("diloco.py: a rank failed or ran out of time; stopping the other", file=sys.stderr)
                return False
            time.sleep(0.5)
        return all(p.returncode == 0 for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--rates", default="100mbit,1gbit")
    p.add_argument("--tasks", default="gpt,cnn")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--steps", default="gpt:200,cnn:300", help="DDP's steps a task (task:steps,...)")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--time-cap", type=float, default=0.8,
                   help="the others train until DDP's final eval loss or this multiple of DDP's wall time")
    p.add_argument("--warmup-steps", type=int, default=WARMUP_STEPS, help="DiLoCoConfig.warmup_steps")
    p.add_argument("--outer-lr", type=float, default=OUTER_LR)
    p.add_argument("--outer-momentum", type=float, default=OUTER_MOMENTUM)
    p.add_argument("--timeout-s", type=float, default=3600)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    reason = skip_reason()
    if reason:
        print(f"diloco.py: skipped: {reason}")
        return 0
    import netns

    rates, tasks = args.rates.split(","), args.tasks.split(",")
    steps = {k: int(v) for k, v in (item.split(":") for item in args.steps.split(","))}
    started, load_before = datetime.datetime.now(), os.getloadavg()
    results: dict = {}
    with netns.two_nodes() as nodes, tempfile.TemporaryDirectory() as tmp:
        for rate in rates:
            for node in nodes:
                node.shape(rate)
            outer = {"warmup_steps": args.warmup_steps, "outer_lr": args.outer_lr,
                     "outer_momentum": args.outer_momentum, "nesterov": args.outer_momentum > 0}
            cfg = {"tasks": tasks, "contenders": args.contenders.split(","), "steps": steps, "rate": rate,
                   "outer": outer, "time_cap": args.time_cap,
                   "eval_every": dict.fromkeys(tasks, args.eval_every), "result": str(Path(tmp) / f"{rate}.json")}
            cfg_path = Path(tmp) / f"{rate}.cfg.json"
            cfg_path.write_text(json.dumps(cfg))
            if _launch(nodes, cfg_path, args.timeout_s):
                results[rate] = json.loads(Path(cfg["result"]).read_text())
    _write(args, results, rates, tasks, steps, started, load_before)
    return 0


def _write(args, results: dict, rates: list[str], tasks: list[str], steps: dict, started, load_before) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"diloco-{started:%Y-%m-%d-%H%M%S}"
    summaries = {rate: {task: summarise(results[rate], task, steps[task]) for task in tasks}
                 for rate in rates if rate in results}
    lines = [f"# DiLoCo against DDP across a shaped link ({started:%Y-%m-%d %H:%M})", "",
             f"`python benchmarks/diloco.py --rates {args.rates} --tasks {args.tasks} --steps {args.steps}`: two "
             f"namespaces, one rank (1 thread) each, veth shaped with tbf; load average before "
             f"{load_before[0]:.1f}, after {os.getloadavg()[0]:.1f} (a shared 2-core machine: compute times vary "
             f"with it). Wall time is training only (evaluations off the clock); bytes: node 0's veth tx_bytes.", ""]
    for rate, by_task in summaries.items():
        for task, s in by_task.items():
            lines += markdown(rate, task, s)
    for rate in rates:
        if rate not in results:
            lines.append(f"{rate}: the run failed (see the console)")
    if plot(results, rates, tasks, out / f"{stem}.png"):
        lines += [f"![eval loss against wall time]({stem}.png)", ""]
    (out / f"{stem}.md").write_text("\n".join(lines))
    (out / f"{stem}.json").write_text(json.dumps({"results": results, "summaries": summaries}, indent=1))
    print("\n".join(lines))
    print(f"diloco.py: wrote {out / stem}.md, .json, .png")


if __name__ == "__main__":
    sys.exit(main())
