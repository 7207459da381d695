"""The login side of a restart inside the allocation: spare nodes in the request (``--nodes``, the partition check),
``--no-kill``, and the batch script's loop of job steps (``SlurmRequest.watch_lines``'s ``ddpjob_steps``), run by
bash with a stand-in srun and watcher so each exit path is shown. The jobs that restart for real are in
tests/cluster/test_restart_in_allocation.py; the rendered scripts are goldens (test_rendering.py)."""

from __future__ import annotations

import re
import shlex
import socket
import subprocess
from pathlib import Path

import pytest

from ddp_core.config import load_config
from ddp_core.errors import DdpJobError
from jobs.submission.partitions import Partition
from jobs.submission.request import SlurmRequest
from tests.support.helpers import ROOT

DIGITS = ROOT / "configs" / "digits.yaml"  # 2 ranks per node


def test_spare_nodes_are_allocated_beside_the_ranks_nodes_and_checked_against_the_partition():
    request = SlurmRequest.resolve(load_config(DIGITS, ["slurm.nodes=2", "slurm.spare_nodes=1"]))
    options = request.sbatch_options()
    assert (options["nodes"], options["ntasks-per-node"], options["no-kill"]) == (3, 2, True)
    nodes = "$((SLURM_JOB_NUM_NODES - 1))"
    assert request.first_step_options() == f'--nodes={nodes} --ntasks=$(({nodes} * 2)) --exclude="$(hostname)"'
    # --no-kill only where a job can go on without a node: with a spare, or an elastic one.
    assert "no-kill" not in SlurmRequest.resolve(load_config(DIGITS, ["slurm.nodes=2"])).sbatch_options()
    elastic = SlurmRequest.resolve(load_config(DIGITS, ["slurm.nodes=1-2", "slurm.spare_nodes=2"]))
    assert elastic.sbatch_options()["nodes"] == "3-4" and elastic.sbatch_options()["no-kill"] is True
    part = Partition("local", nodes=2, cpus_per_node=4, gpus_per_node=0)
    with pytest.raises(
        DdpJobError, match=re.escape("'slurm.spare_nodes' = 1: with slurm.nodes = 2 a job needs 3")
    ) as err:
        request.check_fits(part)
    assert err.value.hint.startswith("use slurm.spare_nodes<=0")
    assert SlurmRequest.resolve(load_config(DIGITS)).first_step_options() == ""


FAKE_SRUN = """#!/bin/bash
echo "launch=$DDPJOB_LAUNCH args=$*" >> {calls}
n=$(wc -l < {calls})
[ "$n" -ge {succeed_at} ] && exit 0
exit 137
"""
FAKE_WATCHER = """#!/bin/bash
# argv: MODULE --in-allocation RUN_DIR LOG STATUS (the runner's words come first)
echo "watcher $*" >> {calls}
{answer}
"""


def steps(tmp_path: Path, answer: str, succeed_at: int, spares: int = 0) -> tuple[int, list[str], str]:
    """Run the rendered lines and ``ddpjob_steps FAKE_SRUN a b`` in bash: (exit code, calls, stderr)."""
    calls = tmp_path / "calls"
    srun, watcher = tmp_path / "srun", tmp_path / "watcher"
    srun.write_text(FAKE_SRUN.format(calls=calls, succeed_at=succeed_at))
    watcher.write_text(FAKE_WATCHER.format(calls=calls, answer=answer))
    for path in (srun, watcher):
        path.chmod(0o755)
    request = SlurmRequest.resolve(load_config(DIGITS, ["slurm.nodes=2", f"slurm.spare_nodes={spares}"]))
    lines = request.watch_lines(shlex.quote(str(tmp_path)), shlex.quote(str(tmp_path / "log")), str(watcher))
    script = "\n".join(["set -euo pipefail", *lines, f"ddpjob_steps {shlex.quote(str(srun))} a b"])
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "57", "SLURM_JOB_NUM_NODES": "3"}
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=30)
    return proc.returncode, calls.read_text().splitlines(), proc.stderr


def test_a_restart_runs_the_next_step_with_the_watchers_nodes(tmp_path):
    code, calls, err = steps(tmp_path, "echo --nodes=2 --nodelist=n1,n3; exit 10", succeed_at=3, spares=1)
    assert code == 0, err
    # The first step leaves a spare idle: the batch node, which runs the batch script.
    assert calls[0] == f"launch=0 args=--nodes=2 --ntasks=4 --exclude={socket.gethostname()} a b"
    assert calls[1].startswith("watcher ddp_core.cluster.supervise --in-allocation") and calls[1].endswith(" 137")
    assert calls[2] == "launch=1 args=--nodes=2 --nodelist=n1,n3 a b"
    assert "ddpjob: attempt 0 of job 57 started on" in err and ", job step 1" in err


@pytest.mark.parametrize(("answer", "expected"), [("exit 0", 0), ("exit 3", 3), ("exit 137", 137)])
def test_the_watchers_other_answers_end_the_attempt(tmp_path, answer, expected):
    """0: requeued (the job ends, Slurm runs it again); another code: the job ends with it. No second step, and the
    EXIT trap does not ask the watcher again."""
    code, calls, err = steps(tmp_path, answer, succeed_at=99)
    assert code == expected, err
    assert [c.split()[0] for c in calls] == ["launch=0", "watcher"]


def test_a_step_that_succeeds_asks_nobody(tmp_path):
    code, calls, err = steps(tmp_path, "exit 10", succeed_at=1)
    assert (code, calls) == (0, ["launch=0 args=a b"]), err
