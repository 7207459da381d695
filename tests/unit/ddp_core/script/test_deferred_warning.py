"""Script mode calls a script's own handler for the warning signal at an optimizer step every rank agrees on
(``ddp_core.script.deferred``), and catches ranks that stop making progress after it. Without Slurm: two ranks of
``python -m ddp_core.script RUN`` on this host; the Lightning script on the cluster is
tests/cluster/test_lightning.py."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from ddp_core.cluster.exits import ExitCode
from tests.support.helpers import events, wait_for
from tests.support.script_ranks import Ranks, make_run

# A handler that saves as Lightning's does: with a collective (its barrier). The signal goes to rank 0 alone, while it
# is in Python and rank 1 is about to wait in backward's all-reduce for it: run where the signal found rank 0, the
# barrier would meet rank 1's all-reduce. ``--stall``: rank 1's handler never returns (a save stuck on one rank).
SCRIPT = """
import os, signal, sys, time
import torch, torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
step = 0

def handler(signum, frame):
    print(f"rank {rank}: handler for {signum} at step {step}", flush=True)
    if "--stall" in sys.argv and rank == 1:
        time.sleep(600)
    dist.barrier()

assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # held, and looks unhandled (Lightning checks this)
signal.signal(signal.SIGUSR1, handler)
assert signal.getsignal(signal.SIGUSR1) is handler
for step in range(40):
    if step in (10, 25) and rank == 0:
        os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.05 if rank == 0 else 0)
    model(torch.ones(8, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
signal.signal(signal.SIGUSR1, signal.SIG_DFL)
print(f"rank {rank}: done", flush=True)
"""


def _run(tmp_path: Path, *args: str, overrides: tuple[str, ...] = ()) -> tuple[Path, Ranks]:
    script = tmp_path / "handles_usr1.py"
    script.write_text(SCRIPT)
    run = make_run(tmp_path, script, args=args, overrides=("slurm.signal=USR1", *overrides))
    return run, Ranks(run, 2, tmp_path / "logs")


def test_every_rank_runs_the_scripts_handler_at_the_same_step(tmp_path):
    """Two warnings to rank 0 alone: each reaches both ranks' handler once, in the same step, and the run goes on."""
    run, ranks = _run(tmp_path)
    assert ranks.wait() == [0, 0], ranks.all_text()
    handled = [re.findall(r"handler for 10 at step (\d+)", ranks.text(r)) for r in (0, 1)]
    assert handled[0] == handled[1] and len(handled[0]) == 2, ranks.all_text()
    first, second = (int(s) for s in handled[0])
    assert 10 <= first < 25 <= second < 40, handled  # after each signal, never before
    assert all(f"rank {r}: done" in ranks.text(r) for r in (0, 1))
    assert [e["event"] for e in events(run)] == ["start", "completed"]
    assert not (run / "hangs").exists()  # the watchdog armed by the warning left nothing behind


def test_ranks_that_stop_after_the_warning_are_caught(tmp_path):
    """Rank 1's handler never returns: no optimizer step after the warning for watchdog.stall_s, and the attempt ends
    as a hang (outside Slurm: recorded, exit HUNG) instead of holding its allocation to the time limit."""
    run, ranks = _run(tmp_path, "--stall", overrides=("watchdog.stall_s=4",))
    # The rank that coordinates the hang records it and exits HUNG; under srun --kill-on-bad-exit ends the other one,
    # which here only its own watchdog would end, two minutes later: ended as srun would.
    wait_for(lambda: any(p.poll() == ExitCode.HUNG for p in ranks.procs), 120, "the hang's coordinator to exit")
    for proc in ranks.procs:
        if proc.poll() is None:
            proc.kill()
    assert ExitCode.HUNG in ranks.wait(), ranks.all_text()
    hang = events(run, "hang")
    assert len(hang) == 1 and "no progress for 4 s" in hang[0]["summary"], events(run)
    folder = Path(hang[0]["stacks"])
    assert "time.sleep(600)" in (folder / "rank1.txt").read_text()  # the stuck rank's stack, its source line
    assert json.loads((folder / "rank1.json").read_text())["step"] > 10  # optimizer steps, when it stalled
    assert "no progress for 4 s; suspect rank 1" in (folder / "summary.txt").read_text()


# Steps until the script's handler has run (on both ranks in the same step), at most 400 (20 s).
WAITS = """
import signal, time
import torch, torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
handled = []
signal.signal(signal.SIGUSR1, lambda signum, frame: handled.append(step))
for step in range(400):
    time.sleep(0.05)
    model(torch.ones(8, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    if handled:
        break
print(f"rank {rank}: handled at steps {handled}", flush=True)
"""


def test_a_warning_that_never_comes_is_sent_by_ddpjob_at_its_time(tmp_path):
    """No signal from Slurm: rank 0 sends the configured one itself ``slurm.signal_lead_s`` before the job's end
    (``SLURM_JOB_END_TIME``, here 3 s after the ranks start), and both ranks run the script's handler in one step."""
    script = tmp_path / "waits.py"
    script.write_text(WAITS)
    run = make_run(tmp_path, script, overrides=("slurm.signal=USR1", "slurm.signal_lead_s=60"))
    end = {"SLURM_JOB_END_TIME": str(int(time.time()) + 63)}
    ranks = Ranks(run, 2, tmp_path / "logs", job_id="424242", extra=end)
    assert ranks.wait() == [0, 0], ranks.all_text()
    handled = [re.findall(r"handled at steps \[(\d+)\]", ranks.text(r)) for r in (0, 1)]
    assert handled[0] == handled[1] and len(handled[0]) == 1, ranks.all_text()
    assert "no SIGUSR1 by 60 s before the time limit (slurm.signal_lead_s): ddpjob sends it itself" in ranks.text(0)
    assert "ddpjob sends it itself" not in ranks.text(1)  # rank 0's alone: the exchange carries it
