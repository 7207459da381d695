"""Goodput of a long job at scale, simulated: a 1,000-node job over 30 days under published failure rates, with
ddpjob's restart and save costs, over today's requeue path and in-allocation restart (with 0, 1 and 4 spare nodes),
a range of queue waits, and the node-local checkpoint tier against the durable interval. docs/at-scale.md reads its
tables.

**The model.** Failures come as a Poisson process over the time the job holds its nodes and runs (training, saves,
start-up, restarts; not the queue), at the nodes' rate: the Llama 3 paper's 419 unexpected interruptions in 54 days
on 16,384 GPUs, 8 GPUs a node (``--interruptions``, ``--over-days``, ``--over-gpus``). A failure takes its node out of
service (a GPU, its memory, the host: the paper's hardware causes) with probability ``--node-loss-fraction``; else
the same nodes can run again (a software error, a network blip). Training runs steps of ``--step-s``, saving a
durable checkpoint every ``--every-steps`` (training blocked ``--save-s``) and a node-local one every
``--local-every-steps`` (``--local-save-s``; the tier keeps a copy on a peer node, so it survives one node's loss).
After a failure (``--detect-s`` to notice and decide):

- **requeue** (today, and whenever in-allocation restart cannot): the job waits ``--queue-s`` for a new allocation,
  starts (``--startup-s``) and resumes from the newest durable checkpoint; the node-local copies are gone.
- **in-allocation restart** (``slurm.max_restarts``): the ranks relaunch as a new job step (``--relaunch-s``, then
  ``--startup-s``) and resume from the newest durable or local checkpoint. A lost node needs a spare node
  (``slurm.spare_nodes``), else the job is requeued; a requeue brings the spares back and resets the restart budget.
  Spare nodes are allocated and idle: they count in the allocation's node-time and never fail while idle.

goodput = the training nodes' time on steps that count / the node-time held: nodes x days, with the spares
(a queue wait is lost time, as a person waiting for the run sees it). Each figure is the mean of ``--runs`` seeded
runs (seed ``--seed`` onwards): the same seeds give the same table. Defaults: the measured figures of bench/README.md
where there is one (one H200; the 2-core VM's 2-rank launch), else placeholders marked so, to be replaced by
figures measured at scale.

    .venv/bin/python bench/at_scale.py [--nodes 1000] [--days 30] [--runs 20] [--queue-s 3600] [--step-s 5] ...
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

TERMS = ("training", "checkpoint", "retrained", "startup", "restarts", "queue")
DAY = 86400.0


@dataclass(frozen=True)
class Costs:
    """What a step, a save and each part of a failure's handling cost, in seconds."""

    step_s: float = 5.0  # placeholder: a large model's step at scale
    every_steps: int = 100  # checkpoint.every_steps (its default)
    save_s: float = 1.484  # bench/README: a synchronous full save of 1.2 GB on one H200 (async: 0.004)
    local_every_steps: int = 0  # checkpoint.local_every_steps; 0: no local tier
    local_save_s: float = 0.021  # bench/README: an async save's whole cost to training (one H200), as the tier's copy
    detect_s: float = 1.0  # placeholder: a rank's death to the watcher's decision (0.3 s locally: bench/soak.py)
    startup_s: float = 4.9  # bench/README: launch -> first step, 2 ranks (the 2-core VM); 8,000 ranks: more
    relaunch_s: float = 5.0  # placeholder: the decision -> the new job step's ranks start, in the allocation
    queue_s: float = 3600.0  # placeholder: a requeued 1,000-node job's wait for nodes


@dataclass(frozen=True)
class Policy:
    name: str
    in_allocation: bool = False
    spares: int = 0
    max_restarts: int = 10**9  # per attempt (slurm.max_restarts)


@dataclass(frozen=True)
class Failure:
    after_s: float  # exposed time (allocated and running) since the previous failure
    node_lost: bool


@dataclass
class Outcome:
    nodes: int
    spares: int
    horizon_s: float
    seconds: dict[str, float] = field(default_factory=lambda: {t: 0.0 for t in TERMS})
    failures: int = 0
    requeues: int = 0
    restarts: int = 0

    def share(self, term: str) -> float:
        """A term's share of the node-time held; ``spares``: the idle spare nodes'."""
        held = (self.nodes + self.spares) * self.horizon_s
        return self.spares / (self.nodes + self.spares) if term == "spares" else self.nodes * self.seconds[term] / held

    @property
    def goodput(self) -> float:
        return self.share("training")


def poisson(rng: random.Random, rate_per_s: float, node_loss_fraction: float) -> Iterator[Failure]:
    """Failures at ``rate_per_s`` of exposed time, each losing its node with ``node_loss_fraction``."""
    while True:
        gap = rng.expovariate(rate_per_s) if rate_per_s > 0 else math.inf
        yield Failure(gap, rng.random() < node_loss_fraction)


class Simulation:
    """One job over ``horizon_s`` of wall time under ``policy`` (the module docstring)."""

    def __init__(self, costs: Costs, policy: Policy, nodes: int, horizon_s: float, failures: Iterator[Failure]):
        self.c, self.policy, self.horizon = costs, policy, horizon_s
        self.failures = failures
        self.out = Outcome(nodes, policy.spares, horizon_s)
        self.now = 0.0
        self.step = 0  # the step the ranks are at
        self.partial = 0.0  # seconds trained past ``step`` when a failure came (lost with the steps since the restore)
        self.durable = 0  # the newest durable checkpoint's step
        self.local: Optional[int] = None  # the newest node-local one's, while this allocation holds it
        self.spares_left, self.restarts_here = policy.spares, 0
        self.next = next(failures)
        self.until_failure = self.next.after_s

    def run(self) -> Outcome:
        pending = [("startup", self.c.startup_s)]
        while self.now < self.horizon:
            if pending:
                term, seconds = pending.pop(0)
                if not self.spend(term, seconds):
                    pending = self.fail()
            elif not self.train():
                pending = self.fail()
        return self.out

    def spend(self, term: str, seconds: float) -> bool:
        """``seconds`` on ``term`` (up to the horizon); False when a failure cuts it short (the queue is not
        exposed: the job holds no nodes there)."""
        room = self.horizon - self.now
        failing = term != "queue" and self.until_failure < min(seconds, room)
        used = self.until_failure if failing else min(seconds, room)
        self.out.seconds[term] += used
        self.now += used
        if term != "queue":
            self.until_failure -= used
        return not failing

    def cycle(self) -> tuple[int, float]:
        """(steps, seconds) of the save schedule's period: the steps to the next step both intervals share."""
        every, local = self.c.every_steps, self.c.local_every_steps
        steps = math.lcm(every, local) if every and local else every or local
        saves = (steps // every if every else 0) * self.c.save_s
        local_only = (steps // local - (steps // math.lcm(every, local) if every else 0)) if local else 0
        return steps, steps * self.c.step_s + saves + local_only * self.c.local_save_s

    def train(self) -> bool:
        """Train until a failure (False) or the horizon (True): whole periods of the save schedule at once, the rest
        one save's interval at a time."""
        every, local = self.c.every_steps, self.c.local_every_steps
        period, period_s = self.cycle()
        while self.now < self.horizon:
            room = min(self.until_failure, self.horizon - self.now)
            if period and self.step % period == 0 and period_s <= room:
                n = int(room // period_s)
                self.advance(n * period * self.c.step_s, n * (period_s - period * self.c.step_s), n * period_s)
                self.step += n * period
                self.durable = self.step if every else self.durable
                self.local = self.step if local else self.local
                continue
            boundary = min(s for s in (_next(self.step, every), _next(self.step, local)) if s) if period else 0
            steps_s = (boundary - self.step) * self.c.step_s if period else math.inf
            save_s = 0.0 if not period else self.c.save_s if every and boundary % every == 0 else self.c.local_save_s
            if steps_s + save_s <= room:
                self.advance(steps_s, save_s, steps_s + save_s)
                self.step = boundary
                if every and boundary % every == 0:
                    self.durable = boundary
                else:
                    self.local = boundary
                continue
            failing = self.until_failure < self.horizon - self.now
            self.partial = min(room, steps_s)  # into the steps after ``step``; the rest of ``room``, into the save
            self.advance(self.partial, room - self.partial, room)
            return not failing
        return True

    def advance(self, training: float, checkpoint: float, seconds: float) -> None:
        self.out.seconds["training"] += training
        self.out.seconds["checkpoint"] += checkpoint
        self.now += seconds
        self.until_failure -= seconds

    def fail(self) -> list[tuple[str, float]]:
        """The failure that just came: roll back to the checkpoint the next launch loads; what follows it."""
        c, lost_node = self.c, self.next.node_lost
        self.out.failures += 1
        here = self.policy.in_allocation and self.restarts_here < self.policy.max_restarts
        if here and (not lost_node or self.spares_left > 0):
            if lost_node:  # a spare takes its place; the node-local tier's peer copy survives the loss
                self.spares_left -= 1
            self.restarts_here += 1
            self.out.restarts += 1
            pending = [("restarts", c.detect_s + c.relaunch_s), ("startup", c.startup_s)]
        else:
            self.local = None  # a new allocation: the node-local copies stay behind
            self.spares_left, self.restarts_here = self.policy.spares, 0
            self.out.requeues += 1
            pending = [("restarts", c.detect_s), ("queue", c.queue_s), ("startup", c.startup_s)]
        restore = max(self.durable, self.local if self.local is not None else 0)
        lost = (self.step - restore) * c.step_s + self.partial
        self.out.seconds["training"] -= lost
        self.out.seconds["retrained"] += lost
        self.step, self.partial = restore, 0.0
        self.local = restore if self.local is not None else None
        self.next = next(self.failures)
        self.until_failure = self.next.after_s
        return pending


def _next(step: int, every: int) -> int:
    """The next multiple of ``every`` after ``step``; 0 for none."""
    return (step // every + 1) * every if every else 0


@dataclass(frozen=True)
class Scale:
    """The job and the failure rate it meets."""

    nodes: int = 1000
    gpus_per_node: int = 8
    days: float = 30.0
    interruptions: int = 419  # Llama 3 (Dubey et al., 2024): unexpected interruptions of its 405B pre-training...
    over_days: float = 54.0  # ... in 54 days ...
    over_gpus: int = 16384  # ... on 16,384 H100 GPUs
    node_loss_fraction: float = 0.77  # placeholder: the paper's hardware causes (GPU, HBM, host, ...), of all 419

    @property
    def node_rate_per_s(self) -> float:
        return self.interruptions / (self.over_days * DAY * self.over_gpus) * self.gpus_per_node


def simulate(costs: Costs, policy: Policy, scale: Scale, runs: int, seed: int) -> Outcome:
    """The mean of ``runs`` seeded runs (seeds ``seed``...): terms, shares and counts averaged."""
    mean = Outcome(scale.nodes, policy.spares, scale.days * DAY)
    for k in range(runs):
        failures = poisson(random.Random(seed + k), scale.node_rate_per_s * scale.nodes, scale.node_loss_fraction)
        one = Simulation(costs, policy, scale.nodes, scale.days * DAY, failures).run()
        for term in TERMS:
            mean.seconds[term] += one.seconds[term] / runs
        mean.failures += one.failures
        mean.requeues += one.requeues
        mean.restarts += one.restarts
    counts = (mean.failures, mean.requeues, mean.restarts)
    mean.failures, mean.requeues, mean.restarts = (round(n / runs) for n in counts)
    return mean


def policies(spares: Sequence[int] = (0, 1, 4)) -> list[Policy]:
    """Today's requeue path, and in-allocation restart with each count of spare nodes."""
    return [Policy("requeue (today: slurm.max_restarts=0)")] + [
        Policy(f"in-allocation restart, {n} spare{'s' * (n != 1)}", True, n) for n in spares
    ]


def policy_table(costs: Costs, scale: Scale, runs: int, seed: int, spares: Sequence[int]) -> str:
    head = ["policy", "goodput", "checkpoints", "trained again", "start-up", "restarts", "queue", "spares idle",
            "failures", "requeues", "restarts in allocation"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|---|" + "--:|" * (len(head) - 1)]
    budget = Policy(f"in-allocation restart, {spares[-1]} spares, slurm.max_restarts=3", True, spares[-1], 3)
    for policy in (*policies(spares), budget):
        o = simulate(costs, policy, scale, runs, seed)
        shares = " | ".join(f"{100 * o.share(t):.2f}%" for t in (*TERMS[1:], "spares"))
        counts = f"{o.failures} | {o.requeues} | {o.restarts}"
        lines.append(f"| {policy.name} | **{100 * o.goodput:.2f}%** | {shares} | {counts} |")
    return "\n".join(lines)


def queue_table(costs: Costs, scale: Scale, runs: int, seed: int, waits: Sequence[float], spares: Sequence[int]) -> str:
    compared = policies(spares)
    lines = ["| queue wait | " + " | ".join(p.name for p in compared) + " |", "|---|" + "--:|" * len(compared)]
    for wait in waits:
        waited = dataclasses.replace(costs, queue_s=wait)
        cells = [f"{100 * simulate(waited, p, scale, runs, seed).goodput:.2f}%" for p in compared]
        lines.append(f"| {_hours(wait)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tier_table(costs: Costs, scale: Scale, runs: int, seed: int, every: Sequence[int], local: Sequence[int]) -> str:
    policy = Policy("in-allocation restart, 1 spare", True, 1)
    lines = [f"| every_steps \\ local_every_steps ({policy.name}) | " + " | ".join(str(n or "off") for n in local)
             + " |", "|---|" + "--:|" * len(local)]  # fmt: skip
    for d in every:
        cells = []
        for n in local:
            tiered = dataclasses.replace(costs, every_steps=d, local_every_steps=n)
            cells.append(f"{100 * simulate(tiered, policy, scale, runs, seed).goodput:.2f}%" if n < d else "-")
        lines.append(f"| {d} ({_hours(d * costs.step_s)}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _hours(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.3g} h"
    return f"{seconds / 60:.3g} min" if seconds >= 60 else f"{seconds:g} s"


def header(costs: Costs, scale: Scale, runs: int, seed: int) -> str:
    node_mtbf = 1 / scale.node_rate_per_s
    job_mtbf = node_mtbf / scale.nodes
    daly = math.sqrt(2 * costs.save_s * job_mtbf)  # Young/Daly: the durable interval that loses the least
    return "\n".join([
        f"- job: {scale.nodes} nodes x {scale.gpus_per_node} GPUs, {scale.days:g} days; {runs} runs from seed {seed}",
        f"- failures: {scale.interruptions} in {scale.over_days:g} days on {scale.over_gpus} GPUs: MTBF "
        f"{node_mtbf * scale.gpus_per_node / 3600:,.0f} h per GPU, {node_mtbf / 3600:,.0f} h per node, "
        f"{job_mtbf / 3600:.2f} h for the job ({scale.days * DAY / job_mtbf:.0f} expected); "
        f"{100 * scale.node_loss_fraction:.0f}% lose their node",
        f"- costs: {', '.join(f'{k} {v:g}' for k, v in dataclasses.asdict(costs).items())}",
        f"- Young/Daly durable interval for save_s {costs.save_s:g} s: {daly:.0f} s = "
        f"{daly / costs.step_s:.0f} steps",
    ])  # fmt: skip


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    for f in dataclasses.fields(Costs):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    for f in dataclasses.fields(Scale):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    p.add_argument("--spares", type=int, nargs="+", default=[0, 1, 4], help="in-allocation restart's spare nodes")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--queue-waits", type=float, nargs="+", default=[0, 300, 1800, 3600, 4 * 3600, 12 * 3600])
    p.add_argument("--every", type=int, nargs="+", default=[50, 100, 200, 500, 1000])
    p.add_argument("--local", type=int, nargs="+", default=[0, 10, 25, 50])
    args = vars(p.parse_args(argv))
    costs = Costs(**{f.name: args[f.name] for f in dataclasses.fields(Costs)})
    scale = Scale(**{f.name: args[f.name] for f in dataclasses.fields(Scale)})
    runs, seed = args["runs"], args["seed"]
    print(header(costs, scale, runs, seed), end="\n\n")
    print(f"Policies (queue wait {_hours(costs.queue_s)}): each term's share of the node-time held\n")
    print(policy_table(costs, scale, runs, seed, args["spares"]), end="\n\n")
    print("Goodput by queue wait after a requeue\n")
    print(queue_table(costs, scale, runs, seed, args["queue_waits"], args["spares"]), end="\n\n")
    print("Goodput by durable interval (rows) and node-local interval (columns), in steps\n")
    print(tier_table(costs, scale, runs, seed, args["every"], args["local"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
