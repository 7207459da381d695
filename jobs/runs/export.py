"""``ddpjob export RUN [--step S] OUT.pt``: a run's checkpoint as one plain model state dict, for inference.

Works for both checkpoint kinds: a full one (``step_X.pt``, written by rank 0) and a sharded one
(``step_X.dcp/``, written by every rank under fsdp), which is gathered here, in this one process, without a
process group. The output has the plain model's keys (``task.build_model(**task.model).load_state_dict`` takes
it, strictly) and whole tensors, and loads with ``torch.load(OUT, weights_only=True)``. The checkpoint is the
newest one whose checksums verify, the ``--step`` given, or with ``--best`` the one ``checkpoint.monitor`` marked
best (each must verify). torch is imported only when the
command runs: ``ddpjob --help`` stays instant on a login node.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir
from jobs.runs.lookup import RUN_HELP, resolve

if TYPE_CHECKING:
    import torch

    from ddp_core.checkpoint.store import CheckpointInfo


def add_parser(sub: Any) -> None:
    """Register ``export`` on ``ddpjob``'s subparsers."""
    p = sub.add_parser("export", help="write a run's checkpoint as one plain model state-dict file (for inference)")
    p.add_argument("run_dir", metavar="RUN", help=RUN_HELP)
    p.add_argument(
        "out", metavar="OUT.pt", help="the file to write (replaced if it exists): a path, or a URL (s3://BUCKET/KEY)"
    )
    p.add_argument("--step", type=int, help="export this step's checkpoint (default: the newest that verifies)")
    p.add_argument("--best", action="store_true", help="export the best checkpoint (checkpoint.monitor)")
    p.add_argument("--root", default="runs", help="where to look for a run named by a job id or a name (default: runs)")


def find_checkpoint(run_dir: RunDir, step: Optional[int], best: bool = False) -> CheckpointInfo:
    from ddp_core.checkpoint import store as checkpoint

    where = run_dir.recorded_checkpoints()  # RUN/checkpoints, or the run's folder under checkpoint.dir (a URL)
    if best:
        if step is not None:
            raise DdpJobError("export takes --step or --best, not both", "drop one of them")
        step = checkpoint.best_step(where)
        if step is None:
            raise DdpJobError(
                f"run {run_dir.name} has no best checkpoint marked in {where}",
                "set checkpoint.monitor (e.g. min:eval/loss) for the run to keep one; export --step S names another",
            )
    info = checkpoint.find_latest(where) if step is None else checkpoint.find(where, step)
    if info is not None:
        return info
    steps = checkpoint.steps(where)
    if step is None:
        raise DdpJobError(
            f"run {run_dir.name} has no complete checkpoint in {where}",
            "checkpoints appear every checkpoint.every_steps steps and at the end of training",
        )
    if step in steps:
        raise DdpJobError(
            f"the checkpoint of step {step} of run {run_dir.name} does not verify (see the warning above)",
            f"export another step: {[s for s in steps if s != step]}",
        )
    hint = f"checkpoints exist for steps {steps}" if steps else "this run has no checkpoints yet"
    raise DdpJobError(f"run {run_dir.name} has no checkpoint of step {step}", hint)


def model_state(info: CheckpointInfo) -> dict[str, torch.Tensor]:
    """The whole model's weights of a checkpoint of either kind, under the plain model's keys."""
    from ddp_core.checkpoint import sharded as sharded_checkpoint
    from ddp_core.checkpoint import store as checkpoint

    if info.kind == checkpoint.SHARDED:
        return sharded_checkpoint.read_model_state(info.path)
    return checkpoint.load(info)["model"]


def export(
    run_dir: RunDir, out: Union[Path, str], step: Optional[int] = None, best: bool = False
) -> tuple[CheckpointInfo, dict[str, torch.Tensor]]:
    """Write the checkpoint's model state to ``out`` (a path, or an object storage URL, as ``checkpoint.dir``
    takes them), whole or not at all: a reader of OUT never sees half a file. Returns which checkpoint and the
    state."""
    import hashlib

    import torch

    from ddp_core.checkpoint import store as checkpoint

    info = find_checkpoint(run_dir, step, best)
    state = model_state(info)
    storage, name = checkpoint.split(out)
    try:
        storage.write_data(name, lambda f: torch.save(state, f), hashlib.sha256())
    except Exception as err:  # a store's errors (credentials, endpoint, a missing bucket) are not all OSErrors
        if isinstance(out, Path):
            raise
        cause = " ".join(str(err).split())[:300]
        raise DdpJobError(
            f"cannot write {out} ({type(err).__name__}: {cause})",
            "check the bucket, and the credentials and endpoint the AWS tools read (docs/object-storage.md)",
        ) from None
    return info, state


def cmd_export(args: argparse.Namespace) -> int:
    from ddp_core.checkpoint import storage, store

    run_dir = RunDir(resolve(args.run_dir, Path(args.root)))
    out = args.out if storage.is_url(args.out) else Path(args.out)
    info, state = export(run_dir, out, args.step, args.best)
    params = sum(t.numel() for t in state.values())
    where, name = store.split(out)
    size = where.size(name)
    print(f"checkpoint: {info.path} (step {info.step}, {info.kind})")
    print(f"exported:   {out} ({len(state)} tensors, {params / 1e6:.2f}M values, {size / 1e6:.1f} MB)")
    return 0


COMMANDS = {"export": cmd_export}
