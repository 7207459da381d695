"""What a change on resume does to exactness: ``ddpjob resume RUN key=value ...`` continues a run from its newest
checkpoint, and ends on the bits of a run that had the new values from the start only for some keys.
``breaks(old, new)`` gives one line per changed key that makes the continuation differ from such a run (the keys that
keep the bits are listed in ``KEEP``; docs/preemption.md has the table). Torch-free: the login node says it before
anything is submitted.
"""

from __future__ import annotations

from typing import Any, Optional

from ddp_core.config.tree import Config, flatten, to_dict

# Prefixes of keys whose change keeps the bits: where and how long the job runs, what is logged and kept, budgets.
KEEP = (
    "run.",
    "wandb.",
    "log.",
    "watchdog.",
    "snapshot.",
    "trial.",
    "checkpoint.",
    "dist.timeout_s",
    "dist.init_timeout_s",
    "train.eval_every",
    "train.log_every",
    "train.eval_batches",
    "train.stop_check_ms",
    "train.straggler_factor",
    "train.log_grad_norm",
    "train.early_stop_patience",
    "train.stop_on_nan",
    "train.telemetry",
    "train.peak_tflops",
    "train.gpu_telemetry",
    "train.profile.",
    "data.eval_batch_size",
    "slurm.partition",
    "slurm.time_min",
    "slurm.account",
    "slurm.qos",
    "slurm.job_name",
    "slurm.signal",
    "slurm.signal_lead_s",
    "slurm.deadline_margin_s",
    "slurm.max_",
    "slurm.health_check",
    "slurm.array_parallelism",
    "slurm.setup",
    "slurm.additional",
    "slurm.container.",
    "slurm.cpu_bind",
    "slurm.mem_gb",
    "slurm.gpu_bind",
)
# The keys that decide how many data-parallel replicas train (and so, without a fixed global batch, its size).
WORLD = ("slurm.nodes", "slurm.tasks_per_node", "slurm.gpus_per_node")
WHY = {
    "train.seed": "the data order and every random stream (seeded from it)",
    "data.batch_size": "each replica's batch (and, without data.global_batch_size, the global batch)",
    "train.grad_accum": "the global batch (without data.global_batch_size)",
    "data.global_batch_size": "the samples of every optimizer step",
    "data.shuffle": "the data order",
    "data.num_workers": "the draws of a task that augments in its loader workers",
    "train.precision": "every step's arithmetic",
    "train.compile": "the kernels' rounding",
    "train.deterministic": "the kernels chosen",
    "train.invariant": "how gradients are summed and each shard is seeded",
    "optim.implementation": "the update's rounding (fused differs from foreach and for_loop)",
    "optim.": "the optimizer's update",
    "slurm.cpus_per_task": "the intra-op threads per rank, which order a CPU kernel's sums",
    "task.data": "the data itself",
    "strategy.": "how the model is split and its gradients reduced",
}


def breaks(old: Config, new: Config) -> list[str]:
    """One line per changed key that makes the continued run differ from a run that had the new values from the
    start; empty when the continuation keeps the bits."""
    before, after = flatten(to_dict(old)), flatten(to_dict(new))
    keys = dict.fromkeys([*before, *after])  # a key of task.data one side has not: a change too
    changed = [k for k in keys if before.get(k) != after.get(k) and not k.startswith(KEEP)]
    lines = []
    for key in changed:
        was, now = before.get(key), after.get(key)
        if key == "train.max_steps":
            if new.optim.schedule.value != "constant":
                lines.append(
                    f"{key} {was} -> {now} with optim.schedule={new.optim.schedule.value}: the learning rate decays to "
                    "the new max_steps from the checkpoint on, so the run is neither the old one nor a new one "
                    "(optim.schedule=constant keeps the bits)"
                )
            continue
        if key in WORLD:
            if (line := _world(key, was, now, new)) is not None:
                lines.append(line)
            continue
        why = next((w for prefix, w in WHY.items() if key == prefix or key.startswith(prefix)), "what the run computes")
        lines.append(f"{key} {was} -> {now} changes {why} from the checkpoint on: not a run that had it from the start")
    return lines


def _world(key: str, was: Any, now: Any, new: Config) -> Optional[str]:
    """Another world size: kept bitwise only with a fixed global batch summed world-size-invariantly."""
    if new.data.global_batch_size is None:
        return (
            f"{key} {was} -> {now}: another number of data-parallel replicas, hence another global batch "
            "(set data.global_batch_size to keep it)"
        )
    if not new.train.invariant:
        return (
            f"{key} {was} -> {now}: the same global batch, but its gradients are summed in another order: close to "
            "the longer run, not bitwise (train.invariant keeps the bits)"
        )
    return None
