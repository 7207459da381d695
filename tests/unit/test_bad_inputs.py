"""A table of what an HPC user (or someone probing the login node) types, and what ddpjob must answer.

Every row goes through what ``ddpjob submit`` runs before anything exists: ``load_config`` on
``configs/digits.yaml`` with the row's overrides (or on the row's own file) and ``check_and_resolve`` (which
imports the task and checks its arguments); sweep rows through ``load_sweep``. A refused row must raise one
``DdpJobError`` whose message is one line naming the key (``needle``) with a non-empty hint; an accepted row must
load, and hold the value it names. Any other exception fails. ``ROWS`` is the table (``len(ROWS)`` counts it);
the rows already in tests/unit/ddp_core/config/test_config.py and tests/unit/jobs/test_cli.py are not repeated here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ddp_core.config import load_config
from ddp_core.errors import DdpJobError
from jobs.submission.checks import check_and_resolve
from jobs.sweeps.arrays import check_sweep
from jobs.sweeps.spec import load_sweep
from tests.support.helpers import ROOT

DIGITS = ROOT / "configs" / "digits.yaml"


@dataclass(frozen=True)
class Row:
    id: str
    source: str  # "override": key=value items on digits.yaml | "file": a config file | "sweep": a sweep file
    given: tuple[str, ...] | str | bytes
    outcome: str  # "refused" | "accepted"
    needle: str = ""  # refused: in the one-line message, naming the key
    key: str = ""  # accepted: a dotted key of the loaded config ...
    value: Any = None  # ... and the value it must hold


def refused(id: str, given: str | tuple[str, ...] | bytes, needle: str, source: str = "override") -> Row:
    return Row(id, source, (given,) if source == "override" and isinstance(given, str) else given, "refused", needle)


def accepted(id: str, given: str | tuple[str, ...], key: str, value: Any, source: str = "override") -> Row:
    return Row(id, source, (given,) if source == "override" and isinstance(given, str) else given, "accepted",
               key=key, value=value)  # fmt: skip


def config_file(body: str) -> str:
    return f"run: {{name: ok}}\n{body}\n"


def sweep_file(body: str) -> str:
    return f"base: {DIGITS}\n{body}\n"


def bomb(levels: int, width: int) -> str:
    """Each alias level multiplies the values by ``width``: a few hundred bytes that expand to width**levels."""
    lines = [f"l0: &l0 [{', '.join(['x'] * width)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return "    " + "\n    ".join(lines)


NESTED = "[" * 40 + "]" * 40
CHARLM = "ddp_core.tasks.charlm:CharLMTask"
# The same in one flow-style value: anchors a0..a6, each nine aliases of the one before (9**7 values).
FLOW_BOMB = ", ".join(f"&a{i} [" + ", ".join([f"*a{i - 1}" if i else "1"] * 9) + "]" for i in range(7))


def annotated(data: str) -> str:
    return config_file(f"task: {{target: 'tests.support.metric_tasks:AnnotatedTask', {data}}}")


ROWS: list[Row] = [
    # --- numbers out of range, non-finite, huge, negative, of the wrong kind (one or two per numeric key) ---
    refused("eval_batch_size_zero", "data.eval_batch_size=0", "'data.eval_batch_size' = 0 is invalid: must be > 0"),
    refused("eval_batch_size_huge", "data.eval_batch_size=2000000", "'data.eval_batch_size' = 2000000"),
    refused("num_workers_negative", "data.num_workers=-1", "'data.num_workers' = -1 is invalid: must be >= 0"),
    refused("num_workers_huge", "data.num_workers=257", "'data.num_workers' = 257 is invalid: must be at most 256"),
    refused("grad_accum_zero", "train.grad_accum=0", "'train.grad_accum' = 0 is invalid"),
    refused("grad_accum_huge", "train.grad_accum=100000", "'train.grad_accum' = 100000 is invalid"),
    refused("max_steps_negative", "train.max_steps=-5", "'train.max_steps' = -5 is invalid"),
    refused("max_steps_float", "train.max_steps=1e3", "bad value for config key 'train.max_steps'"),
    refused("max_steps_huge", "train.max_steps=99999999999999999999999", "'train.max_steps' = 9999"),
    refused("eval_every_negative", "train.eval_every=-1", "'train.eval_every' = -1 is invalid: must be >= 0"),
    refused("log_every_zero", "train.log_every=0", "'train.log_every' = 0 is invalid: must be > 0"),
    refused("seed_negative", "train.seed=-1", "'train.seed' = -1 is invalid"),
    # --- performance: MFU's peak, the profile window (train.max_steps 300 in digits.yaml) ---
    refused("peak_tflops_zero", "train.peak_tflops=0", "'train.peak_tflops' = 0.0 is invalid: must be > 0"),
    refused("peak_tflops_negative", "train.peak_tflops=-1", "'train.peak_tflops' = -1.0 is invalid: must be > 0"),
    refused("profile_beyond_max_steps", ("train.profile.start_step=498", "train.profile.steps=5"),
            "'train.profile.start_step' = 498 is invalid: the window (steps 499-503) ends beyond train.max_steps"),
    refused("profile_steps_negative", "train.profile.steps=-1", "'train.profile.steps' = -1 is invalid"),
    refused("profile_steps_huge", "train.profile.steps=5000", "'train.profile.steps' = 5000 is invalid"),
    refused("profile_start_negative", "train.profile.start_step=-1", "'train.profile.start_step' = -1 is invalid"),
    accepted("profile_window", ("train.profile.start_step=10", "train.profile.steps=5"), "train.profile.steps", 5),
    accepted("gpu_telemetry_asked", "train.gpu_telemetry=true", "train.gpu_telemetry", True),
    refused("lr_zero", "optim.lr=0", "'optim.lr' = 0.0 is invalid: must be > 0"),
    refused("lr_negative", "optim.lr=-1e-3", "'optim.lr' = -0.001 is invalid"),
    refused("lr_nan", "optim.lr=.nan", "'optim.lr' = nan is invalid: must be a finite number"),
    refused("lr_overflow", "optim.lr=1e400", "'optim.lr' = inf is invalid"),
    refused("lr_bool", "optim.lr=true", "bad value for config key 'optim.lr'"),
    refused("weight_decay_negative", "optim.weight_decay=-0.1", "'optim.weight_decay' = -0.1 is invalid"),
    refused("weight_decay_inf", "optim.weight_decay=.inf", "'optim.weight_decay' = inf is invalid"),
    refused("momentum_one", "optim.momentum=1", "'optim.momentum' = 1.0 is invalid: must be in [0, 1)"),
    refused("grad_clip_negative", "optim.grad_clip=-1", "'optim.grad_clip' = -1.0 is invalid"),
    refused("warmup_negative", "optim.warmup_steps=-1", "'optim.warmup_steps' = -1 is invalid"),
    refused("every_steps_negative", "checkpoint.every_steps=-1", "'checkpoint.every_steps' = -1 is invalid"),
    refused("keep_last_zero", "checkpoint.keep_last=0", "'checkpoint.keep_last' = 0 is invalid"),
    refused("sigterm_budget_inf", "checkpoint.sigterm_budget_s=.inf", "'checkpoint.sigterm_budget_s' = inf"),
    refused("local_every_negative", "checkpoint.local_every_steps=-2",
            "'checkpoint.local_every_steps' = -2 is invalid: must be >= 0"),
    refused("local_path_relative", ("checkpoint.local_every_steps=10", "checkpoint.local_path=shm"),
            "'checkpoint.local_path' = 'shm' is invalid: must be an absolute path"),
    refused("local_path_dotdot", ("checkpoint.local_every_steps=10", "checkpoint.local_path=/dev/shm/../home"),
            "'checkpoint.local_path' = '/dev/shm/../home' is invalid: no '..'"),
    refused("local_every_not_below_durable", ("checkpoint.local_every_steps=100", "checkpoint.every_steps=100"),
            "'checkpoint.local_every_steps' = 100 is invalid: must be below checkpoint.every_steps (100)"),
    accepted("local_path_relative_while_off", "checkpoint.local_path=shm", "checkpoint.local_path", "shm"),
    accepted("local_every_with_final_only", ("checkpoint.local_every_steps=5", "checkpoint.every_steps=0"),
             "checkpoint.local_every_steps", 5),
    refused("timeout_zero", "dist.timeout_s=0", "'dist.timeout_s' = 0.0 is invalid: must be > 0"),
    refused("timeout_minus_inf", "dist.timeout_s=-.inf", "'dist.timeout_s' = -inf is invalid"),
    refused("init_timeout_nan", "dist.init_timeout_s=.nan", "'dist.init_timeout_s' = nan is invalid"),
    refused("nodes_zero", "slurm.nodes=0", "'slurm.nodes' = 0 is invalid: must be > 0"),
    refused("nodes_huge", "slurm.nodes=70000", "'slurm.nodes' = 70000 is invalid: must be at most 65536"),
    refused("nodes_fraction", "slurm.nodes=2.5", "bad value for config key 'slurm.nodes'"),
    # --- slurm.nodes as a range MIN-MAX (an elastic job) ---
    refused("nodes_range_reversed", "slurm.nodes=2-1", "'slurm.nodes' = '2-1' is invalid: MIN 2 > MAX 1"),
    refused("nodes_range_zero", "slurm.nodes=0-2", "'slurm.nodes' = '0-2' is invalid: MIN must be >= 1 (got 0)"),
    refused("nodes_word", "slurm.nodes=two", "'slurm.nodes' = 'two' is invalid: not a node count or MIN-MAX"),
    refused("nodes_range_open", config_file("slurm: {nodes: 1-}"), "'slurm.nodes' = '1-' is invalid", "file"),
    refused("nodes_range_huge", "slurm.nodes=1-70000", "'slurm.nodes' = '1-70000' is invalid: must be at most"),
    refused("nodes_range_dp", ("strategy.name=dp", "slurm.nodes=1-2"), "'slurm.nodes' = the range '1-2', which"),
    refused("nodes_range_model_parallel", ("strategy.name=model_parallel", "slurm.nodes=1-2"), "one process on one"),
    refused("nodes_range_local", "slurm.nodes=1-2", "'slurm.nodes' = '1-2': more than one node cannot run with"),
    refused("nodes_range_pipeline", ("strategy={name: pipeline, stages: 4, microbatches: 4}", "slurm.nodes=1-2"),
            "'strategy.stages' = 4 is invalid: must divide the world size (2 = "),
    refused("global_batch_elastic", ("slurm.nodes=1-2", "data.global_batch_size=64"),
            "slurm.nodes = '1-2' may run on 2 node(s), world size 4, with 4 data-parallel replicas"),
    refused("gpus_negative", "slurm.gpus_per_node=-1", "'slurm.gpus_per_node' = -1 is invalid"),
    # --- slurm.container (docs/containers.md) ---
    refused("container_runtime", ("slurm.container.image=/i.sif", "slurm.container.runtime=docker"),
            "'slurm.container.runtime' = 'docker' is not a container runtime"),
    refused("container_image_empty", config_file("slurm: {container: {image: ' '}}"),
            "'slurm.container.image' = ' ' is not an image path", "file"),
    refused("container_bind_relative", ("slurm.container.image=/i.sif", "slurm.container.binds=[data]"),
            "'slurm.container.binds' has 'data', which is not an absolute bind"),
    refused("container_bind_comma", ("slurm.container.image=/i.sif", "slurm.container.binds=['/a,/etc']"),
            "'slurm.container.binds' has '/a,/etc', which is not an absolute bind"),
    refused("container_bind_dotdot", ("slurm.container.image=/i.sif", "slurm.container.binds=[/data/../etc]"),
            "'slurm.container.binds' has '/data/../etc'"),
    refused("container_binds_without_image", "slurm.container.binds=[/data]", "'slurm.container.binds' = ['/data'] is"),
    refused("container_local", "slurm.container.image=/i.sif", "'slurm.container.image' = '/i.sif': --local runs"),
    refused("gpus_huge", "slurm.gpus_per_node=65", "'slurm.gpus_per_node' = 65 is invalid: must be at most 64"),
    refused("tasks_zero", "slurm.tasks_per_node=0", "'slurm.tasks_per_node' = 0 is invalid"),
    refused("tasks_huge", "slurm.tasks_per_node=2000", "'slurm.tasks_per_node' = 2000 is invalid"),
    refused("cpus_zero", "slurm.cpus_per_task=0", "'slurm.cpus_per_task' = 0 is invalid"),
    refused("cpus_huge", "slurm.cpus_per_task=5000", "'slurm.cpus_per_task' = 5000 is invalid"),
    refused("mem_zero", "slurm.mem_gb=0", "'slurm.mem_gb' = 0.0 is invalid: must be > 0"),
    refused("mem_nan", "slurm.mem_gb=.nan", "'slurm.mem_gb' = nan is invalid"),
    refused("mem_words", "slurm.mem_gb=lots", "bad value for config key 'slurm.mem_gb'"),
    refused("time_zero", "slurm.time_min=0", "'slurm.time_min' = 0 is invalid"),
    refused("signal_lead_negative", "slurm.signal_lead_s=-1", "'slurm.signal_lead_s' = -1 is invalid"),
    refused("signal_lead_past_limit", "slurm.signal_lead_s=1800", "below the time limit (1800 s)"),
    refused("deadline_margin_negative", "slurm.deadline_margin_s=-5",
            "'slurm.deadline_margin_s' = -5 is invalid: must be >= 0 (hint: set slurm.deadline_margin_s=0 or more)"),
    refused("deadline_margin_past_limit", ("slurm.time_min=1", "slurm.signal=none", "slurm.deadline_margin_s=60"),
            "'slurm.deadline_margin_s' = 60 is invalid: must be below the time limit (60 s) (hint: set "
            "slurm.deadline_margin_s below 60, or raise slurm.time_min)"),
    refused("signal_lead_past_short_limit", ("slurm.time_min=1", "slurm.deadline_margin_s=10"),
            "'slurm.signal_lead_s' = 120 is invalid: must be below the time limit (60 s)"),
    refused("max_timeouts_negative", "slurm.max_timeouts=-1", "'slurm.max_timeouts' = -1 is invalid"),
    refused("max_preemptions_negative", "slurm.max_preemptions=-1", "'slurm.max_preemptions' = -1 is invalid"),
    refused("max_restarts_negative", "slurm.max_restarts=-1", "'slurm.max_restarts' = -1 is invalid"),
    refused("spare_nodes_negative", "slurm.spare_nodes=-1", "'slurm.spare_nodes' = -1 is invalid"),
    refused("array_parallelism_zero", "slurm.array_parallelism=0", "'slurm.array_parallelism' = 0 is invalid"),
    refused("pipeline_stages_zero", "strategy={name: pipeline, stages: 0}", "'strategy.stages' = 0 is invalid"),
    refused("pipeline_microbatches", "strategy={name: pipeline, microbatches: 3}", "'strategy.microbatches' = 3"),
    refused("split_zero", "strategy.split=[0]", "'strategy.split' = [0] is invalid: entries must be > 0"),
    accepted("lr_int", "optim.lr=1", "optim.lr", 1.0),
    accepted("mem_fraction", "slurm.mem_gb=0.5", "slurm.mem_gb", 0.5),
    # No warning signal: its lead is moot (a one-minute job with the default 120 s), the deadline stop's margin is not.
    accepted("signal_none", ("slurm.signal=none", "slurm.time_min=1"), "slurm.signal", "none"),
    accepted("signal_null", config_file("slurm: {signal: null, time_min: 1, deadline_margin_s: 59}"), "slurm.signal",
             None, "file"),
    accepted("pipeline", "strategy={name: pipeline, stages: 2, microbatches: 4}", "strategy.microbatches", 4),
    # --- data.global_batch_size: a multiple of data.batch_size x the job's data-parallel replicas ---
    refused("global_batch_zero", "data.global_batch_size=0", "'data.global_batch_size' = 0 is invalid"),
    refused("global_batch_indivisible", "data.global_batch_size=100", "'data.global_batch_size' = 100 is invalid: the "
            "job has 2 data-parallel replicas, and the global batch must be a multiple of data.batch_size x replicas "
            "(32 x 2 = 64)"),
    refused("global_batch_two_nodes", ("slurm.nodes=2", "data.global_batch_size=64"), "(32 x 4 = 128)"),
    refused("global_batch_pipeline", ("strategy={name: pipeline, stages: 2, microbatches: 4}",
                                      "data.global_batch_size=48"), "1 data-parallel replica, and"),
    refused("global_batch_and_grad_accum", ("data.global_batch_size=128", "train.grad_accum=2"),
            "'train.grad_accum' = 2 is set, but with data.global_batch_size = 128"),
    accepted("global_batch", "data.global_batch_size=256", "data.global_batch_size", 256),
    accepted("global_batch_dp", ("strategy.name=dp", "data.global_batch_size=96"), "data.global_batch_size", 96),
    # --- train.invariant: ddp (or one process), a global batch of a power of two of shards, replicas dividing it ---
    *(refused(f"invariant_{name}", ("train.invariant=true", f"strategy.name={name}", "data.global_batch_size=128"),
              f"'train.invariant' = true is invalid with strategy.name='{name}'")
      for name in ("fsdp", "pipeline", "dp", "model_parallel")),
    refused("invariant_no_global_batch", "train.invariant=true",
            "'train.invariant' = true needs 'data.global_batch_size'"),
    refused("invariant_shards", ("train.invariant=true", "data.global_batch_size=192"),
            "'data.global_batch_size' = 192 is invalid with train.invariant=true: it must be data.batch_size (32) x a "
            "power of two"),
    refused("invariant_three_ranks", ("train.invariant=true", "slurm.tasks_per_node=3", "data.global_batch_size=128"),
            "'train.invariant' = true is invalid at 3 data-parallel replicas (the job)"),
    refused("invariant_elastic", ("train.invariant=true", "slurm.nodes=1-3", "data.global_batch_size=128"),
            "'train.invariant' = true is invalid at 6 data-parallel replicas (the job at 3 node(s))"),
    accepted("invariant", ("train.invariant=true", "data.global_batch_size=128"), "train.invariant", True),
    # --- wrong types for a section or a key ---
    refused("section_int", "data=3", "bad value for config key 'data': 3"),
    refused("section_list", "optim=[1]", "bad value for config key 'optim': [1]"),
    refused("section_string", "train=abc", "bad value for config key 'train': 'abc'"),
    refused("section_in_file", config_file("slurm: [nodes, 2]"), "bad value for config key 'slurm'", "file"),
    refused("setup_string", "slurm.setup=abc", "bad value for config key 'slurm.setup'"),
    refused("setup_item_mapping", "slurm.setup=[{a: 1}]", "bad value for config key 'slurm.setup[0]'"),
    refused("tags_mapping", "wandb.tags={a: 1}", "bad value for config key 'wandb.tags'"),
    refused("tags_nested_list", "wandb.tags=[[a]]", "bad value for config key 'wandb.tags[0]'"),
    refused("task_model_list", "task.model=[1,2]", "bad value for config key 'task.model'"),
    refused("nodes_list", "slurm.nodes=[1]", "bad value for config key 'slurm.nodes'"),
    refused("name_mapping", "run.name={a: 1}", "bad value for config key 'run.name'"),
    refused("split_word", "strategy.split=[1, a]", "bad value for config key 'strategy.split[1]'"),
    refused("additional_list", "slurm.additional=[1]", "bad value for config key 'slurm.additional'"),
    refused("additional_value_list", "slurm.additional.gres=[1]", "'slurm.additional.gres' = [1] is invalid"),
    refused("additional_value_null", "slurm.additional.exclusive=null", "'slurm.additional.exclusive' = None"),
    refused("int_key", config_file("task: {model: {1: 2}}"), "config key 1 under 'task.model'", "file"),
    refused("list_index_key", "wandb.tags[0]=x", "override 'wandb.tags[0]=x' does not start with a dotted"),
    refused("spaced_key", " optim.lr =3e-4", "override ' optim.lr =3e-4' does not start with a dotted config"),
    # --- booleans: true/false only; OmegaConf turned 2, yes, on, 1 into True ---
    refused("bool_two", "data.shuffle=2", "bad value for config key 'data.shuffle': 2 (hint: use true or false)"),
    refused("bool_yes", "data.shuffle=yes", "bad value for config key 'data.shuffle': 'yes'"),
    refused("bool_on", "train.deterministic=on", "bad value for config key 'train.deterministic': 'on'"),
    refused("bool_zero", "train.stop_on_nan=0", "bad value for config key 'train.stop_on_nan': 0"),
    refused("bool_one", "checkpoint.async_save=1", "bad value for config key 'checkpoint.async_save': 1"),
    refused("bool_no", "strategy.find_unused_parameters=no", "'strategy.find_unused_parameters': 'no'"),
    refused("bool_null", "strategy.reshard_after_forward=null", "'strategy.reshard_after_forward'"),
    refused("bool_in_section", "data={shuffle: 2}", "bad value for config key 'data.shuffle': 2"),
    refused("bool_off_in_file", config_file("data: {shuffle: off}"), "'data.shuffle': 'off'", "file"),
    refused("bool_one_in_file", config_file("train: {deterministic: 1}"), "'train.deterministic': 1", "file"),
    accepted("bool_false", "data.shuffle=false", "data.shuffle", False),
    accepted("bool_capital", "data.shuffle=True", "data.shuffle", True),
    accepted("bool_quoted", 'data.shuffle="false"', "data.shuffle", False),
    accepted("bool_upper_in_file", config_file("data: {shuffle: FALSE}"), "data.shuffle", False, "file"),
    # --- unknown keys, bad enum values ---
    refused("unknown_slurm_key", "slurm.partitoin=gpu", "unknown config key 'slurm.partitoin'"),
    refused("unknown_section", config_file("trian: {max_steps: 3}"), "unknown config key 'trian'", "file"),
    refused("unknown_task_data", "task.data.evalfraction=0.1", "unknown config key 'task.data.evalfraction'"),
    refused("enum_optimizer", "optim.name=adam", "bad value for config key 'optim.name'"),
    refused("enum_schedule", "optim.schedule=step", "bad value for config key 'optim.schedule'"),
    refused("enum_wandb_mode_on", "wandb.mode=on", "bad value for config key 'wandb.mode'"),
    refused("enum_strategy", "strategy.name=horovod", "bad value for config key 'strategy.name'"),
    refused("tracker_name", "log.trackers=[tensorboard,tb]", "'log.trackers' = ['tensorboard', 'tb'] is invalid"),
    refused("tracker_not_a_list", "log.trackers=csv", "bad value for config key 'log.trackers'"),
    refused("mlflow_uri", "log.mlflow.tracking_uri=host", "'log.mlflow.tracking_uri' = 'host' is invalid"),
    refused("enum_precision_case", "train.precision=FP32", "bad value for config key 'train.precision'"),
    refused("gpu_bind", "slurm.gpu_bind=socket", "'slurm.gpu_bind' = 'socket' is invalid"),
    refused("cpu_bind", "slurm.cpu_bind=all", "'slurm.cpu_bind' = 'all' is invalid"),
    refused("signal_term", "slurm.signal=TERM", "'slurm.signal' = 'TERM' is invalid"),
    refused("pipeline_schedule", "strategy={name: pipeline, schedule: zb}", "'strategy.schedule' = 'zb' is invalid"),
    refused("mixed_precision", "strategy.mixed_precision=fp16", "'strategy.mixed_precision' = 'fp16' is invalid"),
    refused("guard", "dist.guard=mpi", "'dist.guard' = 'mpi' is invalid"),
    # --- strings that reach the batch script: whitespace, control characters, shell ---
    refused("job_name_tab", config_file('slurm: {job_name: "a\\tb"}'), "'slurm.job_name' = 'a\\tb' is invalid", "file"),
    refused("job_name_tab_override", "slurm.job_name=a\tb", "override 'slurm.job_name=a\\tb' is not valid YAML"),
    refused("account_command", "slurm.account=$(id)", "'slurm.account' = '$(id)' is invalid"),
    refused("name_semicolon", "run.name=x;rm", "'run.name' = 'x;rm' is invalid"),
    refused("name_newline_override", "run.name=x\ny", "'run.name' = 'x y' is invalid"),  # YAML folds the line
    refused("partition_line", config_file('slurm: {partition: "gpu\\n#SBATCH --qos=high"}'), "'slurm.partition'",
            "file"),
    refused("qos_backticks", "slurm.qos=`id`", "override 'slurm.qos=`id`' is not valid YAML"),
    refused("root_space", "run.root=/tmp/a b", "'run.root' = '/tmp/a b' is invalid"),
    refused("setup_carriage_return", config_file('slurm: {setup: ["a\\rb"]}'), "'slurm.setup[0]'", "file"),
    refused("job_name_line_separator", config_file('slurm: {job_name: "a\\u2028b"}'), "'slurm.job_name'", "file"),
    refused("additional_dashes", "slurm.additional={--partition: evil}", "'slurm.additional' = '--partition'"),
    refused("additional_space", 'slurm.additional={"mail type": ALL}', "'slurm.additional' = 'mail type'"),
    refused("additional_value_shell", 'slurm.additional={wrap: "x;y"}', "'slurm.additional.wrap' = 'x;y'"),
    accepted("additional_flag", "slurm.additional={exclusive: true}", "slurm.additional", {"exclusive": True}),
    accepted("job_name_word", "slurm.job_name=my-job_1.2", "slurm.job_name", "my-job_1.2"),
    accepted("tags_free_text", "wandb.tags=['a b', 'c:d', '1e3']", "wandb.tags", ["a b", "c:d", "1e3"]),
    accepted("literal_interpolation", "slurm.setup=['export P=\\${HOME}/bin']", "slurm.setup",
             ["export P=${HOME}/bin"]),
    # --- interpolations: secrets stay in the environment; unresolvable ones are one error ---
    refused("secret_aws", "wandb.entity=${oc.env:AWS_SECRET_ACCESS_KEY}",
            "override 'wandb.entity' interpolates ${oc.env:AWS_SECRET_ACCESS_KEY}"),
    refused("secret_in_setup", config_file("slurm: {setup: ['echo ${oc.env:GITHUB_TOKEN}']}"),
            "interpolates ${oc.env:GITHUB_TOKEN}, which looks like a secret", "file"),
    refused("secret_with_default", "wandb.group=${oc.env:PASSWORD_FILE,x}", "interpolates ${oc.env:PASSWORD_FILE}"),
    refused("secret_quoted", "wandb.entity=\"${oc.env:'WANDB_API_KEY'}\"", "interpolates ${oc.env:WANDB_API_KEY}"),
    refused("secret_computed_name", "wandb.group=${oc.env:${run.name}}", "whose name is itself interpolated"),
    refused("secret_url_userinfo", "log.mlflow.tracking_uri=postgresql://u:secret@db/mlflow",
            "'log.mlflow.tracking_uri' has credentials in its URL"),
    refused("secret_setup_export", "slurm.setup=['export HF_TOKEN=hf_abc']", "'slurm.setup[0]' sets HF_TOKEN"),
    accepted("secret_setup_from_file", "slurm.setup=['export HF_TOKEN=$(cat ~/.hf)']", "slurm.setup",
             ["export HF_TOKEN=$(cat ~/.hf)"]),
    accepted("url_without_userinfo", "log.mlflow.tracking_uri=postgresql://db/mlflow", "log.mlflow.tracking_uri",
             "postgresql://db/mlflow"),
    refused("env_unset", "wandb.group=${oc.env:DDPJOB_SURELY_UNSET_VARIABLE}", "invalid config at 'wandb.group'"),
    refused("interpolation_unclosed", "wandb.group=${oc.env:HOME", "invalid config at 'wandb.group'"),
    refused("interpolation_self", config_file("wandb: {group: '${wandb.group}'}"), "at 'wandb.group'", "file"),
    # --- task.target ---
    refused("target_empty_module", "task.target=:DigitsTask", "'task.target' = ':DigitsTask' is invalid"),
    refused("target_relative", "task.target=..x:Y", "'task.target' = '..x:Y' is invalid"),
    refused("target_space", "task.target=a b:C", "'task.target' = 'a b:C' is invalid"),
    refused("target_not_a_task", "task.target=os:system", "task.target 'os:system': 'system' is not a ddp_core"),
    refused("target_abstract", "task.target=ddp_core.task:Task", "task.target 'ddp_core.task:Task' is abstract"),
    refused("target_yaml_mapping", "task.target=ddp_core.tasks.digits:", "bad value for config key 'task.target'"),
    # --- task arguments: the task's annotations and check_args ---
    refused("hidden_word", "task.model.hidden=abc",
            "config key 'task.model.hidden' = 'abc' is invalid: DigitsTask.build_model expects int"),
    refused("hidden_float", "task.model.hidden=64.0", "'task.model.hidden' = 64.0 is invalid: DigitsTask.build_model"),
    refused("hidden_bool", "task.model.hidden=true", "'task.model.hidden' = True is invalid"),
    refused("depth_list", "task.model.depth=[1]", "'task.model.depth' = [1] is invalid"),
    refused("split_seed_word", "task.data.split_seed=x",
            "'task.data.split_seed' = 'x' is invalid: DigitsTask.__init__ expects int"),
    refused("eval_fraction_two", "task.data.eval_fraction=2.0", "'task.data.eval_fraction' = 2.0 is invalid"),
    refused("eval_fraction_zero", "task.data.eval_fraction=0", "'task.data.eval_fraction' = 0 is invalid"),
    refused("eval_fraction_tiny", "task.data.eval_fraction=0.0001", "leaves none of 1797 images to eval"),
    refused("eval_fraction_nan", "task.data.eval_fraction=.nan", "'task.data.eval_fraction' = nan is invalid"),
    refused("split_seed_negative", "task.data.split_seed=-1", "'task.data.split_seed' = -1 is invalid"),
    refused("dropout_one", "task.model.dropout=1.0", "'task.model.dropout' = 1.0 is invalid: must be in [0, 1)"),
    refused("hidden_zero", "task.model.hidden=0", "'task.model.hidden' = 0 is invalid: must be in [1, 65536]"),
    refused("binary_value", "task.model.hidden=!!binary aGk=", "bad value for config key 'task.model.hidden': b'hi'"),
    refused("subclass_kwargs_bound", ("task.target=tests.support.tasks:SlowDigitsTask", "task.data.eval_fraction=2.0"),
            "'task.data.eval_fraction' = 2.0 is invalid: must be in (0, 1)"),
    refused("subclass_own_type", ("task.target=tests.support.tasks:SlowDigitsTask", "task.data.pause_s=abc"),
            "'task.data.pause_s' = 'abc' is invalid: SlowDigitsTask.__init__ expects float"),
    refused("subclass_base_type", ("task.target=tests.support.tasks:SlowDigitsTask", "task.data.split_seed=1.5"),
            "'task.data.split_seed' = 1.5 is invalid: DigitsTask.__init__ expects int"),
    refused("charlm_heads", config_file(f"task: {{target: {CHARLM}, model: {{d_model: 64, n_heads: 5}}}}"),
            "'task.model.n_heads' = 5 is invalid: must divide task.model.d_model = 64", "file"),
    refused("charlm_zero_heads", config_file(f"task: {{target: {CHARLM}, model: {{n_heads: 0}}}}"),
            "'task.model.n_heads' = 0 is invalid: must be >= 1", "file"),
    accepted("dropout_int", "task.model.dropout=0", "task.model", {"hidden": 128, "depth": 2, "dropout": 0}),
    accepted("eval_fraction_half", "task.data.eval_fraction=0.5", "task.data", {"eval_fraction": 0.5}),
    accepted("subclass_own_arg", ("task.target=tests.support.tasks:SlowDigitsTask", "task.data.pause_s=1"), "task.data",
             {"eval_fraction": 0.2, "pause_s": 1}),
    refused("optional_str", annotated("data: {path: 3}"), "'task.data.path' = 3 is invalid: AnnotatedTask.__init__ "
            "expects Optional[str]", "file"),
    accepted("optional_none", annotated("data: {path: null}"), "task.data", {"path": None}, "file"),
    refused("list_items", annotated("data: {sizes: [1, a]}"), "'task.data.sizes' = [1, 'a'] is invalid", "file"),
    accepted("list_ints", annotated("data: {sizes: [1, 2]}"), "task.data", {"sizes": [1, 2]}, "file"),
    refused("literal", annotated("data: {mode: c}"), "'task.data.mode' = 'c' is invalid: AnnotatedTask.__init__ "
            "expects Literal['a', 'b']", "file"),
    refused("dict_values", annotated("data: {weights: {x: a}}"), "'task.data.weights' = {'x': 'a'} is invalid", "file"),
    accepted("dict_int_for_float", annotated("data: {weights: {x: 1}}"), "task.data", {"weights": {"x": 1}}, "file"),
    refused("union", annotated("data: {scale: 1.5}"), "'task.data.scale' = 1.5 is invalid", "file"),
    accepted("union_str", annotated("data: {scale: x}"), "task.data", {"scale": "x"}, "file"),
    refused("tuple_length", annotated("data: {shape: [1]}"), "'task.data.shape' = [1] is invalid", "file"),
    accepted("no_annotation", annotated("data: {anything: {a: [1]}}"), "task.data", {"anything": {"a": [1]}}, "file"),
    refused("kwargs_named", annotated("model: {width: 1.5}"), "'task.model.width' = 1.5 is invalid", "file"),
    accepted("kwargs_extra", annotated("model: {other: [1]}"), "task.model", {"other": [1]}, "file"),
    # --- YAML: bombs, nesting, tags, encodings, lists ---
    refused("bomb_between_limits", config_file(f"task:\n  model:\n{bomb(3, 30)}"), "cannot be read by OmegaConf",
            "file"),
    refused("bomb_override", f"task.model.x=[{FLOW_BOMB}]", "expands to more than 100000 values"),
    refused("alias_cycle", config_file("task: {model: {a: &a [*a]}}"), "has a YAML alias that contains itself", "file"),
    refused("nested_file", config_file(f"task: {{model: {{x: {NESTED}}}}}"), "nests deeper than 32 levels", "file"),
    refused("nested_override", f"task.model.x={NESTED}", "nests deeper than 32 levels"),
    refused("python_apply_tag", config_file("task: !!python/object/apply:os.system [id]"), "is not valid YAML", "file"),
    refused("python_tag_override", "task.model.x=!!python/object/apply:os.system [id]", "is not valid YAML"),
    refused("set_tag", config_file("wandb: {tags: !!set {a, b}}"), "bad value for config key 'wandb.tags'", "file"),
    refused("latin1", "run: {name: caf\xe9}\n".encode("latin-1"), "is not UTF-8 text", "file"),
    refused("nul_character", config_file("wandb: {group: '\x00'}"), "is not valid YAML", "file"),
    refused("run_as_list", config_file("data: [batch_size, 8]"), "bad value for config key 'data'", "file"),
    refused("unterminated_override", "optim.lr=[", "override 'optim.lr=[' is not valid YAML"),
    refused("duplicate_key_override", "task.model={a: 1, a: 2}", "override 'task.model={a: 1, a: 2}' repeats the key"),
    # --- sweep specs: refused naming the file and the problem, never "nothing to sweep" ---
    refused("sweep_list", "- grid: {optim.lr: [1, 2]}\n", "holds a list, not a mapping", "sweep"),
    refused("sweep_syntax", "grid: {optim.lr: [1, 2}\n", "is not valid YAML at line 1", "sweep"),
    refused("sweep_grid_list", sweep_file("grid: [optim.lr]"), "sweep key 'grid' must be a mapping", "sweep"),
    refused("sweep_huge_range", sweep_file("grid: {train.seed: 'range(0,1000000000000)'}"),
            "has range(0,1000000000000) of more than 10000 values", "sweep"),
    refused("sweep_huge_trials", sweep_file("random: {trials: 1000000000, params: {optim.lr: {dist: choice, "
                                            "values: [1, 2]}}}"), "has 1000000000 trials, more than 10000", "sweep"),
    refused("sweep_missing_base", "base: nope.yaml\ngrid: {optim.lr: [1, 2]}\n", "nope.yaml' not found", "sweep"),
    refused("sweep_nan_bound", sweep_file("random: {trials: 2, params: {optim.lr: {dist: uniform, low: .nan, "
                                          "high: 1}}}"), "bounds must be finite numbers", "sweep"),
    refused("sweep_bool_coercion", sweep_file("grid: {data.shuffle: [true, 2]}"),
            "bad value for config key 'data.shuffle': 2", "sweep"),
    refused("sweep_not_utf8", b"grid: {optim.lr: [1, \xff]}\n", "is not UTF-8 text", "sweep"),
    refused("sweep_duplicate", sweep_file("grid: {optim.lr: [1, 2]}\ngrid: {optim.lr: [3]}"), "repeats the key 'grid'",
            "sweep"),
    refused("sweep_newline_key", sweep_file('grid: {"optim.lr\\nx": [1, 2]}'), "'optim.lr\\nx' is not a dotted",
            "sweep"),
    accepted("sweep_grid", sweep_file("name: lr\ngrid: {optim.lr: [1.0e-3, 2.0e-3]}"), "name", "lr", "sweep"),
    refused("sweep_task_arg", sweep_file("grid: {task.data.eval_fraction: [0.5, 2.0]}"),
            "'task.data.eval_fraction' = 2.0 is invalid: must be in (0, 1)", "sweep"),
]  # fmt: skip


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    return obj


def _load(row: Row, tmp_path: Path) -> Any:
    if row.source == "override":
        cfg = load_config(DIGITS, list(row.given))
        check_and_resolve(cfg, local=True)
        return cfg
    path = tmp_path / ("sweep.yaml" if row.source == "sweep" else "config.yaml")
    path.write_bytes(row.given if isinstance(row.given, bytes) else str(row.given).encode())
    if row.source == "sweep":
        sweep = load_sweep(path)
        check_sweep(sweep, local_check=False)  # what `ddpjob sweep` checks before submitting: the task's arguments
        return sweep
    cfg = load_config(path)
    check_and_resolve(cfg, local=True)
    return cfg


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_bad_input(row: Row, tmp_path: Path) -> None:
    if row.outcome == "accepted":
        loaded = _load(row, tmp_path)
        assert _get(loaded, row.key) == row.value
        return
    with pytest.raises(DdpJobError) as err:
        _load(row, tmp_path)
    text = str(err.value)
    assert len(text.splitlines()) == 1, text
    assert row.needle in text, text
    assert err.value.hint.strip(), text
    assert "nothing to sweep" not in text


def test_the_table_is_well_formed() -> None:
    assert len({row.id for row in ROWS}) == len(ROWS)
    for row in ROWS:
        assert row.outcome in ("refused", "accepted") and row.source in ("override", "file", "sweep"), row
        assert bool(row.needle) == (row.outcome == "refused") and bool(row.key) == (row.outcome == "accepted"), row
