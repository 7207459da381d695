"""A run that is one trial of an adaptive sweep (``ddpjob sweep --search``): its binding to the Optuna study, and the
reporter that sends each eval's monitored value to that trial and asks whether to prune it.

The ``trial:`` config section is written by the sweep's worker (``ddp_core.search.worker``) into the trial's run
directory; a run without it (every ordinary run) never imports Optuna. Rank 0 reports and decides; the trainer shares
the decision with every rank, so all of them leave the loop after the same eval.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional

from ddp_core.config import TrialConfig
from ddp_core.errors import DdpJobError
from ddp_core.search.study import load_study, open_storage, read_spec

if TYPE_CHECKING:
    import optuna

log = logging.getLogger(__name__)


def bound_trial(storage: optuna.storages.BaseStorage, study: optuna.Study, number: int) -> optuna.Trial:
    """The live ``Trial`` of an existing trial number of ``study`` (loaded from ``storage``), through public APIs
    only: to report to it, or to resume it."""
    import optuna

    study_id = storage.get_study_id_from_name(study.study_name)
    return optuna.trial.Trial(study, storage.get_trial_id_from_study_id_trial_number(study_id, number))


class Reporter:
    """Rank 0 of a bound run: ``report(step, metrics)`` sends the monitored eval value to the trial and returns
    whether the pruner says to stop."""

    def __init__(self, cfg: TrialConfig) -> None:
        import optuna

        self.cfg = cfg
        storage = open_storage(str(cfg.storage))
        self.study = load_study(storage, read_spec(Path(str(cfg.storage)).parent))
        self.trial = bound_trial(storage, self.study, cfg.number)
        optuna.logging.set_verbosity(optuna.logging.WARNING)

    def report(self, step: int, metrics: Mapping[str, float]) -> bool:
        value = metrics.get(self.cfg.metric)
        if value is None:
            raise DdpJobError(
                f"the eval metrics have no '{self.cfg.metric}' (they have {', '.join(sorted(metrics))})",
                "set the search's metric to one of them, e.g. min:eval/loss",
            )
        # A diverged run reports inf, which every pruner ranks last (a NaN would be one more special case for them).
        # A requeued attempt that reports a step again is ignored by Optuna (the first value of a step is kept).
        self.trial.report(float(value) if math.isfinite(value) else math.inf, step)
        pruned = self.trial.should_prune()
        if pruned:
            log.info("trial %d pruned at step %d (%s %.4g)", self.cfg.number, step, self.cfg.metric, value)
        return pruned


def reporter(cfg: TrialConfig, is_main: bool) -> Optional[Reporter]:
    """Rank 0's reporter for a bound run, else None (other ranks, ordinary runs)."""
    return Reporter(cfg) if cfg.bound and is_main else None


def final_value(final: Optional[Mapping[str, Any]], metric: str) -> Optional[float]:
    """The monitored value of a completed run's final eval (attempts.jsonl's ``completed`` event)."""
    value = (final or {}).get(metric)
    return float(value) if isinstance(value, (int, float)) else None


def decide(rep: Optional[Reporter], step: int, metrics: Mapping[str, float]) -> bool:
    """Collective, on every rank of a bound run after an eval: rank 0 reports and asks the pruner; every rank gets
    rank 0's answer, so all of them leave the loop after the same step."""
    from ddp_core.distributed import collectives  # torch: the trainer has it loaded by now

    mine = float(rep.report(step, metrics)) if rep is not None else 0.0
    return collectives.all_gather_floats([mine])[0][0] > 0
