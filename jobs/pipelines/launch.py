"""``ddpjob pipeline FILE``: every step checked, then the steps submitted in order, each waiting for its ``after:``.

1. The file (``jobs.pipelines.spec``): keys, steps, ``after`` names, cycles.
2. Every step's config, as ``ddpjob submit`` loads and checks it (``load_from_args``, ``checks.check``: the config,
   the task's or script's code, the cluster), and its ``${steps.NAME.FIELD}`` references (a known step it runs after,
   a known field). OmegaConf would read such a reference as one of its own interpolations: each is swapped for a
   placeholder while the config loads and put back after, so the step's config.yaml keeps it for the compute node
   (``ddp_core.checkpoint.step_refs``). Nothing is submitted until every step passed.
3. The steps, in order, through the one submission pipeline (``checks.resolve`` with the step's ``--dependency``,
   ``submit``). Each step's run directory gets the earlier steps' run directories (``step_refs.write_record``), and
   the pipeline's record (``jobs.pipelines.record``) each step's job. A rerun keeps the steps that completed or are
   still queued or running after kept steps (``keep``); a step whose condition can no longer be met (``after:
   train:notok`` when train completed) is skipped, with the reason. A submission that fails cancels the steps this
   command had queued, and keeps the record as it was.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ddp_core.checkpoint import step_refs
from ddp_core.cluster.slurm import GATEWAY
from ddp_core.config import Config
from ddp_core.errors import DdpJobError
from ddp_core.run import private
from jobs.pipelines import record, spec
from jobs.pipelines.after import MODES, dependency, satisfied
from jobs.submission import checks, partitions
from jobs.submission import commands as submission

PLACEHOLDER = "__ddpjob_step_ref_{}__"  # a plain YAML word, whatever quoting surrounds the reference
_PLACEHOLDER = re.compile(r"__ddpjob_step_ref_(\d+)__")


@dataclass
class Prepared:
    step: spec.Step
    cfg: Config
    part: Optional[partitions.Partition]


def hide(text: str, table: list[str], where: str) -> str:
    """``text`` with each reference swapped for a placeholder (``table`` keeps them, by number); a ``${steps.``
    that is not a whole reference is refused."""

    def swap(match: re.Match[str]) -> str:
        table.append(match[0])
        return PLACEHOLDER.format(len(table) - 1)

    hidden = step_refs.REFERENCE.sub(swap, text)
    if "${steps." in hidden:
        bad = hidden[hidden.index("${steps.") :].split()[0]
        raise DdpJobError(
            f"{where}: '{bad}' is not a reference", "write ${steps.NAME.FIELD}, e.g. ${steps.train.run_dir}"
        )
    return hidden


def load_step(pipe: spec.Pipeline, step: spec.Step, cluster: bool, folder: Path, checked: bool = True) -> Prepared:
    """Step 2 for one step (see the module docstring); ``folder``: where a config file's copy with placeholders goes.
    ``checked=False``: the config and its references only, not submit's checks (a laptop sending the pipeline)."""
    where = f"pipeline {pipe.file}: step '{step.name}'"
    table: list[str] = []
    config = step.config
    if config is not None and Path(config).is_file():
        text = Path(config).read_text(encoding="utf-8", errors="replace")
        if (hidden := hide(text, table, where)) != text:
            config = str(folder / f"{step.name}.yaml")
            Path(config).write_text(hidden, encoding="utf-8")
    overrides = [f"run.name={pipe.name}-{step.name}", *(hide(o, table, where) for o in step.overrides)]
    for arg in step.args or ():
        hide(arg, [], where)  # taken as they are (never YAML): checked only
    args = argparse.Namespace(
        config=config,
        overrides=overrides,
        script=step.script,
        script_args=list(step.args) if step.args is not None else None,
        no_snapshot=False,
    )
    try:
        cfg = submission.load_from_args(args)
        step_refs.walk(cfg, lambda text: _PLACEHOLDER.sub(lambda m: table[int(m[1])], text))
        spec.check_references(pipe, step, step_refs.references(cfg))
        part = checks.check(cfg, cluster=cluster) if checked else None
    except DdpJobError as err:
        if err.message.startswith(where):
            raise
        raise DdpJobError(f"{where}: {err.message}", err.hint) from None
    return Prepared(step, cfg, part)


def plan(pipe: spec.Pipeline, before: Optional[record.Record], fresh: bool) -> tuple[dict[str, str], list[str]]:
    """(the steps a rerun keeps, with their state; the jobs it cancels): ``keep`` on the record's states now."""
    if before is None:
        return {}, []
    known = {s.name for s in pipe.steps}
    found = record.states(
        record.Record(before.name, before.file, {k: v for k, v in before.steps.items() if k in known})
    )
    return keep(pipe, found, before, fresh)


def keep(
    pipe: spec.Pipeline, found: dict[str, str], before: record.Record, fresh: bool
) -> tuple[dict[str, str], list[str]]:
    """A completed step is kept, and so is a queued or running one whose earlier steps are all kept (its job stands);
    one whose earlier step is submitted again would wait for a job that has ended: it is submitted again too, its old
    job cancelled. ``fresh``: nothing is kept."""
    from jobs.runs.status import ACTIVE_STATES

    kept: dict[str, str] = {}
    stale: list[str] = []
    for step in pipe.steps:  # earlier steps first
        state = found.get(step.name, "")
        waiting = state in ACTIVE_STATES and all(a.ref in kept for a in step.after)
        if not fresh and (state == "COMPLETED" or waiting):
            kept[step.name] = state
        elif state in ACTIVE_STATES:
            stale.append(before.steps[step.name].job_id)
    return kept, stale


def waits_for(step: spec.Step, rec: record.Record, kept: dict[str, str]) -> tuple[list[str], str]:
    """(the ``--dependency`` items of ``step``, why it is skipped instead, or "")."""
    items = []
    for a in step.after:
        up, state = rec.steps[a.ref], kept.get(a.ref)
        if up.skipped:  # never ran: it neither completed nor failed
            if a.mode != "any":
                return [], f"{a.ref} was skipped"
            continue
        met = satisfied(state, a.mode) if state is not None else None
        if met is None:
            items.append(f"{MODES[a.mode]}:{up.job_id}")
        elif not met:
            return [], f"{a.ref} ended {state}, and this step runs after {a}"
    return items, ""


def submit_steps(pipe: spec.Pipeline, prepared: dict[str, Prepared], kept: dict[str, str], rec: record.Record) -> None:
    """Step 3 (see the module docstring), one line per step; ``rec`` holds the kept steps and gains the others."""
    from ddp_core.run.rundir import create_run_dir
    from jobs.submission.submit import submit

    for step in pipe.steps:
        if step.name in kept:
            entry = rec.steps[step.name]
            print(f"{step.name}: kept ({kept[step.name]}), job {entry.job_id}, run dir {entry.run_dir}")
            continue
        items, skipped = waits_for(step, rec, kept)
        after = [str(a) for a in step.after]
        if skipped:
            rec.steps[step.name] = record.Entry(after=after, skipped=skipped, submitted=record.now())
            print(f"{step.name}: skipped ({skipped})")
            continue
        cfg, part = prepared[step.name].cfg, prepared[step.name].part
        request = checks.resolve(cfg, part, run_root=Path(cfg.run.root).resolve(), dependency=dependency(items))
        run_dir = create_run_dir(cfg)
        earlier = {name: e.run_dir for name, e in rec.steps.items() if e.run_dir}
        step_refs.write_record(run_dir.path, pipe.name, step.name, earlier)
        sub = submit(cfg, request, run_dir)
        rec.steps[step.name] = record.Entry(str(run_dir.path), sub.job_id, after, record.now())
        rec.write(pipe.folder)
        waits = f", after {', '.join(items)}" if items else ""
        print(f"{step.name}: job {sub.job_id}{waits}, run dir {run_dir.path}", flush=True)


def submitted_or_withdrawn(pipe: spec.Pipeline, prepared: dict[str, Prepared], kept: dict[str, str],
                           rec: record.Record, before: Optional[record.Record]) -> None:  # fmt: skip
    """``submit_steps``, all or nothing: when a step's submission fails, the jobs this command queued are cancelled
    and the record is put back as it was."""
    try:
        submit_steps(pipe, prepared, kept, rec)
    except BaseException as err:
        queued = [e.job_id for name, e in rec.steps.items() if name not in kept and e.job_id]
        if queued:
            GATEWAY.cancel(queued)
        if before is not None:
            before.write(pipe.folder)
        else:
            (pipe.folder / record.FILE).unlink(missing_ok=True)
        if isinstance(err, DdpJobError) and queued:
            raise DdpJobError(f"{err.message} (cancelled this pipeline's jobs {', '.join(queued)})", err.hint) from None
        raise
    rec.write(pipe.folder)


def dry_run(pipe: spec.Pipeline, kept: dict[str, str], rec: record.Record) -> None:
    """What ``submit_steps`` would do, without submitting: each step kept, submitted (after which jobs) or skipped."""
    for step in pipe.steps:
        if step.name in kept:
            print(f"{step.name}: kept ({kept[step.name]}), job {rec.steps[step.name].job_id}")
            continue
        items, skipped = waits_for(step, rec, kept)
        rec.steps[step.name] = record.Entry(job_id=f"<{step.name}>", skipped=skipped)
        waits = f" (sbatch --dependency={dependency(items)})" if items else ""
        print(f"{step.name}: skipped ({skipped})" if skipped else f"{step.name}: would be submitted{waits}")


def cmd_pipeline(args: argparse.Namespace) -> int:
    pipe = spec.load(Path(args.file))
    before = record.read(pipe.folder)
    kept, stale = plan(pipe, before, args.fresh)
    with private.temporary("pipeline") as folder:
        cluster = not args.no_cluster_check
        todo = [s for s in pipe.steps if s.name not in kept]
        prepared = {s.name: load_step(pipe, s, cluster, folder) for s in todo}
    steps = {k: v for k, v in (before.steps if before else {}).items() if k in kept}
    rec = record.Record(pipe.name, str(pipe.file.resolve()), steps)
    print(f"pipeline {pipe.name}: {len(todo)} to submit, {len(kept)} kept (record: {pipe.folder / record.FILE})")
    if args.dry_run:
        dry_run(pipe, kept, rec)
    else:
        if stale:  # after every step passed its checks: a refused rerun leaves the pipeline as it was
            GATEWAY.cancel(stale)
            print(f"cancelled job {', '.join(stale)}: waiting for a step that is submitted again")
        submitted_or_withdrawn(pipe, prepared, kept, rec, before)
    return 0


def add_parser(sub: Any) -> None:
    """Register ``pipeline`` on ``ddpjob``'s subparsers."""
    p = sub.add_parser("pipeline", help="check every step of a pipeline file, then submit them in order (reruns: "
                       "only the steps that did not complete)")  # fmt: skip
    p.add_argument("file", metavar="FILE", help="a pipeline file, e.g. configs/pipelines/digits.yaml")
    p.add_argument("--dry-run", action="store_true", help="check every step and say what would be submitted")
    p.add_argument("--fresh", action="store_true", help="submit every step again, the completed ones too")
    p.add_argument("--no-cluster-check", action="store_true", help="skip checking the requests against sinfo")


COMMANDS = {"pipeline": cmd_pipeline}
