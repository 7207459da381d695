"""The W&B tracker (log.trackers: wandb, the default): fixed run id, files inside the run directory, never fatal to
training; a failed online init falls back to an offline record that ``ddpjob sync`` uploads."""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from ddp_core.config import Config, WandbConfig, WandbMode, to_dict
from ddp_core.run.rundir import RunDir
from ddp_core.trackers.base import Outcome

log = logging.getLogger(__name__)


def open_tracker(cfg: Config, run_dir: RunDir, run_id: str) -> Optional[WandbRun]:
    """The run's W&B run, or None: ``wandb.mode=disabled`` (nothing imported), or W&B could not start at all."""
    if cfg.wandb.mode is WandbMode.disabled:
        return None
    run = WandbRun(cfg.wandb, run_dir, run_id, to_dict(cfg))
    return run if run.run is not None else None


class WandbRun:
    """One attempt's W&B run, under the ddpjob run's id (``resume="allow"``, explicit ``step=``)."""

    name = "W&B"

    def __init__(self, cfg: WandbConfig, run_dir: RunDir, run_id: str, config: dict[str, Any]) -> None:
        self.run: Optional[Any] = None
        # W&B reads these only from the environment; set in this rank-0 process before init so its cache
        # and staging files stay inside the run directory rather than a shared ~/.cache.
        for var, sub in (("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data"), ("WANDB_CONFIG_DIR", "config")):
            os.environ.setdefault(var, str(run_dir.wandb / sub))
        try:
            import wandb
        except Exception as err:  # a broken install is W&B trouble too
            log.warning("W&B disabled for this run: %s", _one_line(err))
            return
        try:
            self.run = self._init(wandb, cfg, cfg.mode.value, run_dir, run_id, config)
        except Exception as err:
            if cfg.mode is not WandbMode.online:
                log.warning("W&B disabled for this run: %s", _one_line(err))
            else:
                self.run = self._fall_back_offline(wandb, cfg, run_dir, run_id, config, err)
        if self.run is not None:
            log.info("W&B run %s (%s) in %s", run_id, self.run.settings.mode, run_dir.wandb)

    @classmethod
    def _fall_back_offline(
        cls, wandb: Any, cfg: WandbConfig, run_dir: RunDir, run_id: str, config: dict[str, Any], err: Exception
    ) -> Optional[Any]:
        """Retry a failed online init offline, under the same run id, so that ``ddpjob sync`` can upload it later.

        A failed online init (a server that cannot be reached) leaves W&B's service process holding the run id,
        and an offline init of the same id in this process is then refused ("run ID ... is in use"): tear that
        service down first; the offline init starts a fresh one."""
        try:
            wandb.teardown()
        except Exception as teardown_err:  # the offline init below says whether it mattered
            log.debug("W&B teardown after the failed online init: %s", teardown_err)
        try:
            run = cls._init(wandb, cfg, "offline", run_dir, run_id, config)
        except Exception as err2:
            log.warning(
                "W&B online init failed (%s), and offline too (%s): W&B disabled for this run",
                _one_line(err),
                _one_line(err2),
            )
            return None
        log.warning(
            "W&B online init failed (%s); logging offline instead: upload later with `ddpjob sync %s`",
            _one_line(err),
            run_dir.path,
        )
        return run

    @staticmethod
    def _init(wandb: Any, cfg: WandbConfig, mode: str, run_dir: RunDir, run_id: str, config: dict[str, Any]) -> Any:
        return wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            group=cfg.group,
            tags=list(cfg.tags) or None,
            mode=mode,
            id=run_id,
            resume="allow",
            dir=str(run_dir.path),
            name=run_dir.name,
            config=config,
            settings=wandb.Settings(silent=True, console="off"),
        )

    def params(self, values: dict[str, Any]) -> None:
        """Nothing: W&B took the config at init (``config=``), nested as the config's sections."""

    def metrics(self, values: dict[str, float], step: int) -> None:
        if self.run is not None:
            self._guard("log", lambda: self.run.log(values, step=step))

    def finish(self, outcome: Outcome) -> None:
        if self.run is not None:
            # Slurm signals every process of a step: on SIGTERM, W&B's service process may already be gone.
            self._guard("finish", lambda: self.run.finish(exit_code=1 if outcome == "failed" else 0))
            self.run = None

    def _guard(self, what: str, call: Any) -> None:
        try:
            call()
        except Exception as err:  # W&B trouble must never end a training run
            log.warning("W&B %s failed (%s: %s); W&B logging stops for this attempt", what, type(err).__name__, err)
            self.run = None


def _one_line(err: BaseException) -> str:
    """W&B's errors span lines (the error, then what it was retrying): a warning stays one log line."""
    return f"{type(err).__name__}: {' '.join(str(err).split())}"
