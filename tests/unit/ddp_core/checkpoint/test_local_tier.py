"""The node-local checkpoint tier (``checkpoint.local_every_steps``): copies written in the background and pruned to
two, the newer of the local and the durable tier loaded at start, corrupt and truncated copies skipped, a copy of
another run under the same job id removed, the copies removed at the end, the checks of ``checkpoint.local_path`` on
the node, and, in 2 processes with a node each (host names given), a node that replaced a dead one served by its
peer: any node's copy under a full-state strategy, the peer node's replica of its shards under a sharded one; and a
real FSDP2 state restored from its local shards. Bitwise exact resume of whole jobs: tests/cluster/test_local_tier.py.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddp_core.checkpoint import local_restore, store
from ddp_core.checkpoint.local import LocalTier, fill_shards, local_shards
from ddp_core.checkpoint.local_replica import Parts, pack, ring_peers, unpack
from ddp_core.checkpoint.manager import Restored
from ddp_core.cluster.env import DistEnv
from ddp_core.config import CheckpointConfig
from ddp_core.errors import DdpJobError
from ddp_core.run import private
from ddp_core.run.rundir import RunDir
from tests.support.local_tier import node_folder, rig, steps_in, train, weights
from tests.support.process_group import spawn

# --- one process ------------------------------------------------------------------------------------------------


def test_copies_every_n_steps_keep_two_and_the_newest_is_restored_exactly(tmp_path):
    a = rig(tmp_path)
    train(a, 6)
    at_6, optim_6, rng_6 = weights(a.model), copy.deepcopy(a.optimizer.state_dict()), torch.get_rng_state()
    train(a, 1)  # step 7: no copy
    a.manager.close()
    assert steps_in(node_folder(tmp_path) / "full") == [4, 6]  # 2, 4, 6 written; the newest 2 kept
    assert (node_folder(tmp_path) / "run.txt").read_text().strip() == str(tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists()  # no durable checkpoint before step 10

    b = rig(tmp_path, seed=1)
    assert b.manager.load_latest(b.state) == Restored("local", 6)
    assert b.state.pos.step == 6 and b.state.scheduler.last_epoch == 6
    assert all(torch.equal(w, at_6[k]) for k, w in weights(b.model).items())
    assert str(b.optimizer.state_dict()) == str(optim_6)
    assert torch.equal(torch.get_rng_state(), rng_6)
    b.manager.close()


def test_the_durable_checkpoint_wins_when_it_is_as_new(tmp_path):
    a = rig(tmp_path, every_steps=5, local_every_steps=2)
    train(a, 7)  # local 2, 4, 6; durable 5
    a.manager.save(a.state)  # durable 7, as a signal's save would be
    a.manager.close()
    b = rig(tmp_path, seed=1, every_steps=5, local_every_steps=2)
    assert b.manager.load_latest(b.state) == Restored("durable", 7)


def test_the_local_copy_wins_when_it_is_newer_than_the_durable_one(tmp_path, caplog):
    a = rig(tmp_path, every_steps=5, local_every_steps=2)
    train(a, 9)  # durable 5; local 2, 4, 6, 8
    a.manager.close()
    b = rig(tmp_path, seed=1, every_steps=5, local_every_steps=2)
    with caplog.at_level(logging.INFO):
        assert b.manager.load_latest(b.state) == Restored("local", 8)
    assert "resumed from the node-local copy of step 8 (epoch 0) from this node" in caplog.text
    assert "newest durable checkpoint (step 5): tier local" in caplog.text


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "no manifest"])
def test_a_damaged_newest_copy_falls_back_to_the_one_before(tmp_path, caplog, damage):
    a = rig(tmp_path)
    train(a, 6)
    a.manager.close()
    newest = node_folder(tmp_path) / "full" / "step_00000006.pt"
    data = bytearray(newest.read_bytes())
    if damage == "corrupt":
        data[len(data) // 2] ^= 0xFF
        newest.write_bytes(bytes(data))
    elif damage == "truncated":
        newest.write_bytes(bytes(data[:-100]))
    else:
        newest.with_suffix(".json").unlink()  # killed before its manifest: not a copy
    b = rig(tmp_path, seed=1)
    with caplog.at_level(logging.WARNING):
        assert b.manager.load_latest(b.state) == Restored("local", 4)
    if damage != "no manifest":
        assert "skipping checkpoint step_00000006.pt" in caplog.text


def test_no_copy_newer_than_the_durable_one_and_none_at_all_start_fresh_or_durable(tmp_path):
    a = rig(tmp_path)
    assert a.manager.load_latest(a.state) is None  # nothing yet
    train(a, 11)  # durable 10, local up to 8
    a.manager.close()
    b = rig(tmp_path, seed=1)
    assert b.manager.load_latest(b.state) == Restored("durable", 10)


def test_copies_of_another_run_under_the_same_job_id_are_removed_not_loaded(tmp_path, caplog):
    a = rig(tmp_path, run="first")
    train(a, 4)
    a.manager.close()
    with caplog.at_level(logging.WARNING):
        b = rig(tmp_path, seed=1, run="second")  # the job id came round again (or a sweep worker's next trial)
    assert "local copies of another run" in caplog.text
    assert b.manager.load_latest(b.state) is None
    assert not (node_folder(tmp_path) / "full").exists()
    assert (node_folder(tmp_path) / "run.txt").read_text().strip() == str(tmp_path / "second")


def test_the_copies_are_removed_when_the_run_is_over(tmp_path):
    a = rig(tmp_path)
    train(a, 4)
    a.manager.close()
    a.manager.discard_local()
    assert not (tmp_path / "shm" / private.per_user_name("77")).exists()
    assert (tmp_path / "shm").is_dir()


def test_without_a_job_id_the_tier_is_off(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        a = rig(tmp_path, env=DistEnv(job_id=None))
    assert a.manager.local is None and "no job id to key node-local copies by: off" in caplog.text
    train(a, 4)
    assert not list((tmp_path / "shm").iterdir())


def test_a_missing_or_unusable_local_path_fails_on_the_node_naming_the_key(tmp_path):
    with pytest.raises(DdpJobError, match=r"checkpoint\.local_path .*/nowhere on .* does not exist") as err:
        rig(tmp_path, local_path=str(tmp_path / "nowhere"))
    assert "checkpoint.local_every_steps=0" in err.value.hint
    (tmp_path / "file").write_text("")
    with pytest.raises(DdpJobError, match=r"checkpoint\.local_path .*/file on .* is not a folder"):
        rig(tmp_path, local_path=str(tmp_path / "file"))


def test_too_little_room_for_the_copies_fails_naming_the_key(tmp_path):
    a = rig(tmp_path)
    assert a.manager.local is not None
    with pytest.raises(DdpJobError, match=r"checkpoint\.local_path .* has \d+ MB for the node-local tier, which needs"):
        a.manager.local.check_room(1 << 60)  # the real statvfs of tmp_path, against an exabyte of state
    a.manager.local.check_room(1000)


def test_ring_peers_pair_each_node_with_the_next_and_the_previous():
    assert ring_peers(["a", "a"], 0) == (None, None)  # one node: nothing to replicate to
    assert ring_peers(["a", "b"], 0) == (1, 1) and ring_peers(["a", "b"], 1) == (0, 0)
    hosts = ["a", "a", "b", "b", "c", "c"]
    assert [ring_peers(hosts, r) for r in range(6)] == [(2, 4), (3, 5), (4, 0), (5, 1), (0, 2), (1, 3)]
    assert ring_peers(["a", "a", "b"], 1) == (None, None)  # node b has no second rank


def test_local_shards_round_trip_plain_values_and_tensors():
    template = {"model": {"w": torch.zeros(3)}, "optimizer": {"state": {"w": {"step": torch.tensor(0.0)}},
                "param_groups": [{"lr": 0.1, "params": ["w"]}]}}  # fmt: skip
    saved = local_shards({"model": {"w": torch.ones(3)}, "optimizer": {"state": {"w": {"step": torch.tensor(5.0)}},
                          "param_groups": [{"lr": 0.2, "params": ["w"]}]}})  # fmt: skip
    filled = fill_shards(template, saved)
    assert filled["model"]["w"] is template["model"]["w"] and torch.equal(template["model"]["w"], torch.ones(3))
    assert float(filled["optimizer"]["state"]["w"]["step"]) == 5.0
    assert filled["optimizer"]["param_groups"] == [{"lr": 0.2, "params": ["w"]}]


# --- two processes, a node each ---------------------------------------------------------------------------------


def _tier(tmp: Path, rank: int, world: int, kind: str, host: str, job: str) -> LocalTier:
    cfg = CheckpointConfig(every_steps=0, local_every_steps=1, local_path=str(tmp / "shm"))
    return LocalTier(cfg, DistEnv(rank=rank, world_size=world, job_id=job), RunDir(tmp / "run"), kind, None, host)


def _spare_node_gets_its_copy_from_a_peer(rank: int, world: int, tmp: Path) -> None:
    # Full-state: each node writes its own copy, with every rank's own part; node b dies, c takes its place and
    # gets node a's copy.
    tier = _tier(tmp, rank, world, store.FULL, "ab"[rank], "5")
    for step in (1, 2, 3):
        tier.save(step, {"w": torch.full((3,), float(step))}, pack({"rank": rank, "step": step}))
    tier.close()
    assert steps_in(tmp / "shm" / private.per_user_name("5") / "ab"[rank] / "full") == [2, 3]
    spare = _tier(tmp, rank, world, store.FULL, "ac"[rank], "5")
    found = local_restore.restore(spare, -1)
    assert found is not None and found[0] == 3 and torch.equal(found[1]["w"], torch.full((3,), 3.0))
    assert {r: unpack(part) for r, part in found[1]["ranks"].items()} == {r: {"rank": r, "step": 3} for r in (0, 1)}
    assert found[2] == ("this node" if rank == 0 else "rank 0 on a")
    assert local_restore.restore(spare, 3) is None  # a durable checkpoint of step 3: nothing newer here

    # Sharded: each rank's copy (its shards, rank 0's part and its own) is also kept on the peer node; c gets rank
    # 1's copy from its replica on a.
    tier = _tier(tmp, rank, world, store.SHARDED, "ab"[rank], "6")
    for step in (1, 2, 3):
        tier.save(step, {"shards": {"w": torch.full((2,), 10.0 * rank + step)}}, pack({"rank": rank, "step": step}))
    tier.close()
    dist.barrier()
    job = tmp / "shm" / private.per_user_name("6")
    assert steps_in(job / "ab"[rank] / "w2" / f"rank-{rank}") == [2, 3]
    assert steps_in(job / "ab"[rank] / "w2" / f"rank-{1 - rank}") == [2, 3]  # the peer node's replica
    spare = _tier(tmp, rank, world, store.SHARDED, "ac"[rank], "6")
    found = local_restore.restore(spare, -1)
    assert found is not None and found[0] == 3
    assert torch.equal(found[1]["shards"]["w"], torch.full((2,), 10.0 * rank + 3))
    assert {r: unpack(part) for r, part in found[1]["ranks"].items()} == {r: {"rank": r, "step": 3} for r in {0, rank}}
    assert found[2] == ("this node" if rank == 0 else "rank 0 on a")
    dist.barrier()
    if rank == 0:  # the replica of rank 1's newest copy is corrupt: step 2 is the newest both ranks can get
        replica = job / "a" / "w2" / "rank-1" / "step_00000003.pt"
        replica.write_bytes(replica.read_bytes()[:-10])
    dist.barrier()
    found = local_restore.restore(spare, -1)
    assert found is not None and found[0] == 2 and float(found[1]["shards"]["w"][0]) == 10.0 * rank + 2

    # The parts travel in a slot of the last copy's size; one that outgrew it is sent again in a larger one.
    parts = Parts(spare.group, rank, world)
    for sizes in ((10, 10), (5000, 10000), (3, 3), (20000, 20000)):
        own = bytes([rank]) * sizes[rank]
        assert parts.gather(own, every=True) == {r: bytes([r]) * sizes[r] for r in (0, 1)}
        assert parts.gather(own, every=False) == {0: bytes([0]) * sizes[0], rank: own}
    assert parts.slot == 20480

    # Full-state, both ranks on one node: its first rank writes the copy, the other sends its own part along.
    tier = _tier(tmp, rank, world, store.FULL, "a", "7")
    assert (tier.writer is not None) == (rank == 0)
    for step in (1, 2):
        tier.save(step, {"w": torch.full((3,), float(step))}, pack({"rank": rank, "step": step}))
    tier.close()
    found = local_restore.restore(_tier(tmp, rank, world, store.FULL, "a", "7"), -1)
    assert found is not None and found[0] == 2 and found[2] == "this node"
    assert {r: unpack(part) for r, part in found[1]["ranks"].items()} == {r: {"rank": r, "step": 2} for r in (0, 1)}


def test_a_node_that_replaced_a_dead_one_gets_its_copy_from_a_peer(tmp_path):
    (tmp_path / "shm").mkdir()
    spawn(_spare_node_gets_its_copy_from_a_peer, 2, tmp_path, tmp_path)


def _fsdp_restores_from_its_local_shards(rank: int, world: int, tmp: Path) -> None:
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world, job_id="9")
    a = rig(tmp, env=env, strategy="fsdp", every_steps=0, local_every_steps=3)
    train(a, 8)  # copies of steps 3 and 6
    after = {k: v.full_tensor() for k, v in a.model.state_dict().items()}
    a.manager.close()
    b = rig(tmp, seed=1, env=env, strategy="fsdp", every_steps=0, local_every_steps=3)
    assert b.manager.load_latest(b.state) == Restored("local", 6)
    train(b, 2)
    assert all(torch.equal(v.full_tensor(), after[k]) for k, v in b.model.state_dict().items())
    b.manager.close()
    b.manager.discard_local()


def test_fsdp_shards_restore_from_their_local_copies_and_train_on_bitwise(tmp_path):
    spawn(_fsdp_restores_from_its_local_shards, 2, tmp_path, tmp_path)
