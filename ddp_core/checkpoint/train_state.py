"""What a checkpoint holds besides the model and the optimizer: ``TrainState`` (position, LR schedule, the partial
progress-line loss, every rank's RNG, world size, config) and ``Carried``, the components that ride along with their
own ``state_dict``s, so the loop never builds the dict.

``shared`` components hold the same state on every rank (the monitor, the fp16 loss scaler): rank 0's is saved and
every rank loads it. ``per_rank`` ones differ by rank (a stream loader's position, partial train-metric sums):
every rank's is gathered to rank 0 with the RNG states, and each rank gets its own back when the world size is
unchanged. A checkpoint written before a component existed loads with that component's fresh state.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Protocol

from ddp_core.cluster.env import DistEnv
from ddp_core.config.batch import replicas
from ddp_core.distributed import collectives, rng

log = logging.getLogger(__name__)


@dataclass
class Position:
    """Where the run is: optimizer steps done, and the data position to resume the loader at. The data position is
    counted in samples of the epoch's global stream, not per rank, so it means the same at any world size."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    samples_in_epoch: int = 0  # samples of this epoch's stream already consumed, all ranks together


def read_position(saved: Mapping[str, Any], world_size: int, config: Mapping[str, Any]) -> Position:
    """A checkpoint's position. One written before positions were counted in samples holds ``micro_in_epoch``,
    micro-batches per data-parallel replica: times the micro-batch and the replicas it was written with."""
    position = dict(saved)
    if "micro_in_epoch" in position:
        strategy = config.get("strategy", {})
        data_world = replicas(strategy.get("name", "ddp"), strategy.get("stages", 1), world_size)
        batch_size = config.get("data", {}).get("batch_size", 0)
        position["samples_in_epoch"] = position.pop("micro_in_epoch") * batch_size * data_world
    return Position(**position)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Carried:
    def __init__(self, shared: Mapping[str, Stateful], per_rank: Mapping[str, Stateful]) -> None:
        self.shared, self.per_rank = dict(shared), dict(per_rank)

    def shared_state(self) -> dict[str, Any]:
        """The shared components' entries (rank 0's are saved)."""
        return {name: part.state_dict() for name, part in self.shared.items()}

    def own_state(self) -> dict[str, Any]:
        """This rank's part of the checkpoint's ``per_rank`` list."""
        return {name: part.state_dict() for name, part in self.per_rank.items()}

    def load(self, state: Mapping[str, Any], env: DistEnv) -> None:
        for name, part in self.shared.items():
            if name in state:
                part.load_state_dict(state[name])
        ranks = state.get("per_rank")
        if ranks is None:
            return
        if len(ranks) != env.world_size:
            log.warning(
                "checkpoint was written by %d ranks, now %d: %s start afresh (a stream restarts its epoch)",
                len(ranks),
                env.world_size,
                ", ".join(self.per_rank),
            )
            return
        for name, part in self.per_rank.items():
            if name in ranks[env.rank]:
                part.load_state_dict(ranks[env.rank][name])


class PartialLoss(Protocol):
    """The partial average of the next progress line (``trainer.metrics.RunningLoss``), as a CPU tensor."""

    def state(self) -> Any: ...

    def load(self, state: Any) -> None: ...


def assemble(shared: Mapping[str, Any], owns: list[Any]) -> dict[str, Any]:
    """A checkpoint's train state entries: rank 0's ``shared`` part, and every rank's own part (``TrainState.parts``)
    in rank order (none on ranks other than 0 of a durable save: their state is complete on rank 0 only)."""
    return dict(shared) | {"rng": [own["rng"] for own in owns], "per_rank": [own["per_rank"] for own in owns]}


class TrainState:
    """What a checkpoint holds besides the model and the optimizer (which the strategy saves its own way): where the
    run is (``pos``), the LR schedule, the partial progress-line loss, every rank's RNG, the world size and config it
    was written at, and the carried components (``Carried``). ``state_dict`` and ``load_state_dict`` are collective:
    the RNG states and per-rank parts travel to and from rank 0. The keys are those of every earlier checkpoint."""

    def __init__(self, scheduler: Any, log_loss: PartialLoss, carried: Carried, config: dict[str, Any]) -> None:
        self.pos = Position()
        self.scheduler, self.log_loss, self.carried, self.config = scheduler, log_loss, carried, config

    def state_dict(self, env: DistEnv) -> dict[str, Any]:
        """Collective; complete on rank 0."""
        shared, own = self.parts(env)
        return assemble(shared, collectives.gather_to_main(own, env))

    def parts(self, env: DistEnv) -> tuple[dict[str, Any], dict[str, Any]]:
        """This rank's state without a collective: (the entries rank 0's of which are saved, this rank's own: its
        RNG and ``per_rank`` part). ``assemble`` makes a checkpoint's entries of rank 0's and every rank's own."""
        shared = {
            "scheduler": self.scheduler.state_dict(),
            "position": asdict(self.pos),
            "log_loss": self.log_loss.state(),
            "world_size": env.world_size,
            "config": self.config,
        } | self.carried.shared_state()
        return shared, {"rng": rng.rng_state(), "per_rank": self.carried.own_state()}

    def load_state_dict(self, state: Mapping[str, Any], env: DistEnv) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.pos = read_position(state["position"], state["world_size"], state["config"])
        self.log_loss.load(state["log_loss"])
        self.carried.load(state, env)
        if state["world_size"] == env.world_size:
            rng.set_rng_state(state["rng"][env.rank])
        elif self.config["train"]["invariant"]:  # this attempt seeds each shard's streams from (seed, step, shard)
            log.info(
                "checkpoint was written at world size %d, now %d: train.invariant seeds every shard's RNG itself",
                state["world_size"],
                env.world_size,
            )
        else:
            log.warning(
                "checkpoint was written at world size %d, now %d: RNG streams restart",
                state["world_size"],
                env.world_size,
            )
