"""Rank 0's watch of the batch node in a job with spare nodes (``ddp_core.cluster.batch_node``): when Slurm says the
node is gone, the ranks stop as for the warning signal and rank 0 sends the job through the queue within
``slurm.max_failures``. Slurm's answers come from a fabricated gateway (tests/support/policy.py); the batch node that
dies for real is in tests/cluster/test_restart_in_allocation.py."""

from __future__ import annotations

import signal
import socket
import subprocess

from ddp_core.cluster import batch_node
from ddp_core.cluster.env import DistEnv
from ddp_core.cluster.exits import ExitCode
from ddp_core.cluster.preemption import StopFlag
from ddp_core.cluster.slurm import SlurmGateway
from tests.support.policy import ENV, Slurm, events, run_dir


class Node:
    """A gateway whose batch node ``n1`` answers ``states`` in turn (the last one from then on)."""

    def __init__(self, *states: str, batch_host: str = "n1") -> None:
        self.states, self.batch_host, self.asked = list(states), batch_host, 0
        self.gateway = SlurmGateway(self.answer)
        self.commands: list[tuple[str, ...]] = []

    def answer(self, cmd: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
        self.commands.append(cmd)
        out = ""
        if cmd[:3] == ("scontrol", "show", "job"):
            out = f"JobId={cmd[-1]} JobState=RUNNING Partition=local Restarts=0 BatchHost={self.batch_host} "
            out += "NumNodes=2 NumCPUs=4 NumTasks=4\n"  # what an elastic job of 2 tasks a node got
        elif cmd[:3] == ("scontrol", "show", "node"):
            self.asked += 1
            out = f"NodeName={cmd[-1]} State={self.states.pop(0) if len(self.states) > 1 else self.states[0]}\n"
        return subprocess.CompletedProcess(cmd, 0, out, "")


def test_the_watch_stops_the_ranks_once_slurm_says_the_batch_node_is_gone():
    node = Node("MIXED", "MIXED", "MIXED+NOT_RESPONDING")
    flag = StopFlag("USR2", handlers=False)
    watch = batch_node.Watch("n1", batch_node.stopping(flag), node.gateway, interval_s=0.01)
    watch.thread.join(timeout=10)
    assert not watch.thread.is_alive() and node.asked == 3  # it asks no more once it has stopped the ranks
    assert (flag.received, flag.lost_batch_node) == (signal.SIGUSR2, "n1")


def test_a_stopped_watch_stops_nothing():
    node = Node("IDLE")
    flag = StopFlag("USR2", handlers=False)
    watch = batch_node.Watch("n1", batch_node.stopping(flag), node.gateway, interval_s=0.01)
    watch.stop()
    watch.thread.join(timeout=10)
    assert (flag.received, flag.lost_batch_node) == (0, None)


def test_only_rank_0_of_a_job_with_spare_nodes_watches_a_batch_node_it_does_not_run_on(tmp_path):
    spare_run = run_dir(tmp_path / "spare", "slurm.spare_nodes=1")
    spare = spare_run.load_config().slurm
    plain = run_dir(tmp_path / "plain").load_config().slurm
    stop = batch_node.stopping(StopFlag("USR2", handlers=False))
    watch = batch_node.watch(spare, ENV, spare_run, stop, Node("IDLE").gateway)
    assert watch is not None and watch.host == "n1"
    watch.stop()
    # No --no-kill: Slurm requeues the job.
    assert batch_node.watch(plain, ENV, spare_run, stop, Node("IDLE").gateway) is None
    rank_1 = DistEnv(rank=1, world_size=2, slurm_job_id="57", node_rank=1)
    assert batch_node.watch(spare, rank_1, spare_run, stop, Node("IDLE").gateway) is None
    here = Node("IDLE", batch_host=socket.gethostname()).gateway
    assert batch_node.watch(spare, ENV, spare_run, stop, here) is None  # rank 0 on the batch node would die with it
    assert batch_node.watch(spare, DistEnv(), spare_run, stop, Node("IDLE").gateway) is None  # outside Slurm


def test_an_elastic_job_without_spares_is_requeued_from_its_second_node_when_the_batch_node_dies(tmp_path):
    """slurm.nodes=1-2: rank 0 runs on the batch node and dies with it, so the first rank of node 1 watches and
    requeues the job itself (no rank can checkpoint without rank 0); no other rank watches."""
    run = run_dir(tmp_path, "slurm.nodes=1-2", "slurm.tasks_per_node=2")
    slurm, flag = run.load_config().slurm, StopFlag("USR2", handlers=False)
    node_1 = DistEnv(rank=2, world_size=4, local_rank=0, node_rank=1, slurm_job_id="57", job_id="57")
    for other in (ENV, DistEnv(rank=3, world_size=4, local_rank=1, node_rank=1, slurm_job_id="57")):
        assert batch_node.watch(slurm, other, run, batch_node.stopping(flag), Node("IDLE").gateway) is None
    node = Node("MIXED", "DOWN+NOT_RESPONDING")
    watch = batch_node.watch(slurm, node_1, run, batch_node.stopping(flag), node.gateway, interval_s=0.01)
    assert watch is not None and watch.host == "n1"
    watch.thread.join(timeout=30)
    assert not watch.thread.is_alive() and ("scontrol", "requeue", "57") in node.commands
    # n1, lost, is excluded (the partition holds the one node the job needs without it); back in the queue the job
    # would wait for the 2 nodes it had: it gets its range back.
    excluded, resized = ("JobId=57", "ExcNodeList=n1"), ("JobId=57", "NumNodes=1-2", "NumTasks=2")
    assert {("scontrol", "update", *excluded), ("scontrol", "update", *resized)} == set(node.commands[-2:])
    assert events(run) == [("failure", "n1"), ("excluded", "n1"), ("requeued", "failure")] and flag.received == 0


def test_the_lost_batch_node_is_an_infrastructure_failure_that_requeues_the_job(tmp_path):
    run, slurm = run_dir(tmp_path, "slurm.spare_nodes=1"), Slurm()
    code = batch_node.requeue_after("n1", run.load_config().slurm, run, ENV, 40, slurm.gateway)
    assert code == ExitCode.REQUEUED  # n1, lost, is excluded: the partition n[1-3] holds a node and a spare without it
    assert slurm.asked() == [("scontrol", "requeue", "57"), ("scontrol", "update", "JobId=57", "ExcNodeList=n1")]
    assert events(run) == [("failure", "n1"), ("excluded", "n1"), ("requeued", "failure")]
    failure = run.events()[0]
    assert (failure["kind"], failure["step"]) == ("infrastructure", 40) and "batch node n1" in failure["error"]
    # Its budget spent, the job ends there with the reason, never requeued.
    run2, slurm2 = run_dir(tmp_path / "2", "slurm.spare_nodes=1", "slurm.max_failures=0"), Slurm()
    assert (
        batch_node.requeue_after("n1", run2.load_config().slurm, run2, ENV, 40, slurm2.gateway) == ExitCode.BUDGET_SPENT
    )
    assert slurm2.asked() == []


def test_a_script_is_told_through_its_warning_signal_or_the_log_says_nothing_can(tmp_path, caplog):
    signalled = run_dir(tmp_path / "usr2", "slurm.spare_nodes=1").load_config().slurm
    silent = run_dir(tmp_path / "none", "slurm.spare_nodes=1", "slurm.signal=none").load_config().slurm
    assert batch_node.script_told(signalled, "n1") and not caplog.records
    assert not batch_node.script_told(silent, "n1")
    assert "slurm.signal is none: nothing tells the script that batch node n1 is gone" in caplog.text
