"""State that rides along in every checkpoint beside the model, optimizer, schedule, position and RNG: the
components' own ``state_dict``s, so the loop never builds the dict.

``shared`` components hold the same state on every rank (the monitor, the fp16 loss scaler): rank 0's is saved and
every rank loads it. ``per_rank`` ones differ by rank (a stream loader's position, partial train-metric sums):
every rank's is gathered to rank 0 with the RNG states, and each rank gets its own back when the world size is
unchanged. A checkpoint written before a component existed loads with that component's fresh state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Protocol

from ddp_core.cluster.env import DistEnv
from ddp_core.dist import groups as distributed

log = logging.getLogger(__name__)


@dataclass
class Position:
    """Where the run is: optimizer steps done, and the data position to resume the loader at."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    micro_in_epoch: int = 0  # micro-batches of this epoch already consumed (per rank)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Carried:
    def __init__(self, shared: Mapping[str, Stateful], per_rank: Mapping[str, Stateful]) -> None:
        self.shared, self.per_rank = dict(shared), dict(per_rank)

    def state(self, env: DistEnv) -> dict[str, Any]:
        """Collective: the checkpoint's entries (complete on rank 0)."""
        mine = {name: part.state_dict() for name, part in self.per_rank.items()}
        return {name: part.state_dict() for name, part in self.shared.items()} | {
            "per_rank": distributed.gather_to_main(mine, env)
        }

    def load(self, state: Mapping[str, Any], env: DistEnv) -> None:
        for name, part in self.shared.items():
            if name in state:
                part.load_state_dict(state[name])
        ranks = state.get("per_rank")
        if ranks is None:
            return
        if len(ranks) != env.world_size:
            log.warning("checkpoint was written by %d ranks, now %d: %s start afresh (a stream restarts its epoch)",
                        len(ranks), env.world_size, ", ".join(self.per_rank))  # fmt: skip
            return
        for name, part in self.per_rank.items():
            if name in ranks[env.rank]:
                part.load_state_dict(ranks[env.rank][name])
