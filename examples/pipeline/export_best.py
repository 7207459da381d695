"""The digits pipeline's export step (configs/pipelines/digits.yaml): the train step's best checkpoint, which the
step's ``${steps.train.best_checkpoint}`` names (resolved as this step starts), written as one plain model state
dict, as ``ddpjob export --best`` writes it: ``task.build_model(**task.model).load_state_dict`` takes it."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint", required=True, help="a checkpoint: step_N.pt (full) or step_N.dcp (sharded)")
    parser.add_argument("--out", required=True, help="the state dict file to write")
    args = parser.parse_args()
    path = Path(args.checkpoint)
    if path.suffix == ".dcp":  # fsdp's sharded checkpoint, gathered here as `ddpjob export` does
        from ddp_core.checkpoint.sharded import read_model_state

        state = read_model_state(path)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)["model"]
    torch.save(state, args.out)
    print(f"exported {path} -> {args.out} ({len(state)} tensors)")


if __name__ == "__main__":
    main()
