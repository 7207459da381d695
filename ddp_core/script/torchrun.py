"""Script mode's torchrun launcher (``script.launcher: torchrun``): each node's one Slurm task becomes a torchrun agent
that starts the node's ranks.

``python -m ddp_core.script RUN`` (and ``ddp_core.script.run``, what submitit calls) hands over to ``run_agent`` when
the run's config says torchrun and the process is not one of torchrun's workers already (no
``TORCHELASTIC_RUN_ID``). The agent runs ``torch.distributed.run`` (torchrun's own entry: ``parse_args`` and ``run``)
in this process, no shell in between, with ``-m ddp_core.script RUN`` as the worker command: each worker is then an
ordinary script-mode rank (``ddp_core.script``), which reads torchrun's variables (``DistEnv.from_env`` prefers them
to the ``SLURM_*`` ones the worker inherits from its agent), exports the same contract as srun mode and runs the
script in its own process. ``DDPJOB_RESTART_COUNT`` still comes from ``SLURM_RESTART_COUNT``, inherited.

**Rendezvous: static**, on the first node: ``--nnodes=N --node-rank=SLURM_NODEID --master-addr=<first node>
--master-port=<port>``, all from the agent's ``DistEnv`` (the address and port srun mode's rank 0 serves; the port is
derived from the job id, so jobs sharing a node do not collide). The agent of node 0 serves the TCP store and the
workers join it (``TORCHELASTIC_USE_AGENT_STORE``). Static over c10d: Slurm already fixed the nodes and their
order before any agent starts, so there is nothing to negotiate. Static keeps global ranks in Slurm's node order (rank
0 on the first node, ranks ``node * nproc + local``, as srun mode numbers them) and needs no rendezvous round;
c10d numbers nodes in the order they arrive and exists for elastic membership, which ``--max-restarts=0`` (Slurm
requeues a run, torchrun never restarts it) makes moot. Outside Slurm (``--local``, or by hand): one node,
127.0.0.1, a free port (``MASTER_PORT`` if set).

**Signals.** torch's agent handles SIGTERM/SIGINT/SIGHUP/SIGQUIT only from the main thread, by stopping its workers
(its shutdown timeout, then SIGKILL) and leaving; it does not pass on the warning signal (newer torch's
``--signals-to-handle`` can add it to that list, but the agent would then stop its workers and leave on it too). Here
torch's agent runs in a helper thread (so it installs no handlers) and the main thread owns the signals:

- SIGTERM, SIGINT, SIGHUP: passed on at once to every worker, which then behaves as an srun-mode rank does (a plain
  script ends; one using ``ddp_core.runtime`` records it, checkpoints and exits by itself). The agent keeps waiting for
  its workers: Slurm's own SIGKILL after KillWait bounds it, as in srun mode, instead of torch's 30 s. With no worker
  running (still in the rendezvous, or all gone), the agent leaves at once with 128 + the signal, as a plain process
  would.
- The warning signal (``slurm.signal``): passed on to each worker once it handles that signal (``ddp_core.runtime``
  or the script's framework installed a handler, read from ``/proc/PID/status``), also to workers that reach that
  point after the signal arrived; never to one that has no handler (still starting, or a plain script:
  ``ddp_core.script`` holds the warning until a handler takes it, ``ddp_core.cluster.signals``). Workers start with the
  warning signal and SIGTERM held, as srun-mode ranks do: the agent thread that starts them holds both (see
  ``run_agent``). A plain script that resumes itself (``script.resume_args``): where Slurm signals every process of
  the step (proctrack/cgroup, linuxproc), rank 0's worker gets the warning itself and requeues the job, as in srun
  mode (``cluster.signals.when_held``); where it signals only the task (proctrack/pgid: torch's workers have sessions
  of their own), node 0's agent does, once no worker has taken the warning for a longer grace and the attempt has
  not recorded a requeue (``on_unhandled_warning``). Where Slurm's warning never came by ``end -
  slurm.signal_lead_s``, node 0's agent takes it as come then (``ddp_core.cluster.deadline``): its workers get it,
  and the others agree on it at their next optimizer step (``ddp_core.script.deferred``). torch starts every worker in a
  session of its own (``start_new_session``), so a signal to the agent's process group would not reach them:
  each worker process is signalled by pid, its own children (DataLoader workers) are not.

Workers are the agent's child processes running ``-m ddp_core.script`` (``/proc``: Linux, as Slurm is).

**Exit codes.** All workers exit 0: 0. Otherwise one failed worker gives the agent's code: its own exit code
(``runtime.requeue``'s 3, 4, 5 and 143 survive; a raised exception is 1), or 128 + N for a worker killed by signal N.
Once a worker fails, torch's agent stops the node's others (SIGTERM) and reports them as failed too, in the same
second: the worker named is the one with its own exit code, else one killed by another signal, else by SIGTERM
(earliest, then lowest rank). An error of the agent itself (the rendezvous timed out, the port is taken): logged, 1.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Callable, Optional

from ddp_core import python_m
from ddp_core.cluster import batch_node, deadline, signals
from ddp_core.cluster import rendezvous as meeting
from ddp_core.cluster.env import DistEnv
from ddp_core.cluster.exits import leave
from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir

if TYPE_CHECKING:
    from ddp_core.config import Config

log = logging.getLogger("ddp_core.script")

WORKER_MODULE = "ddp_core.script"
# Twice cluster.signals.when_held's grace: a framework that installs its handler late, and then a worker that got the
# warning itself (rank 0's when_held), take it first.
HELD_WARNING_GRACE_S = 4.0
# Signals that end a worker, passed on to every worker at once (the warning signal is passed on more carefully).
TERMINATING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# How often torch's agent polls its workers, and the main thread looks for workers owed the warning signal.
POLL_S = 0.2


@dataclass(frozen=True)
class Rendezvous:
    """Where the node agents of one attempt meet: torchrun's static rendezvous."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    run_id: str  # --rdzv-id: torchrun's TORCHELASTIC_RUN_ID for the workers (the Slurm job id)


def rendezvous(env: DistEnv, run_dir: Path, timeout_s: float = 600.0) -> Rendezvous:
    """This agent's rendezvous from its ``DistEnv``: the Slurm step's nodes (one task each), or one local node. Node
    0's agent, which serves torchrun's store, picks the port (the derived one, else a free one) and publishes it in
    ``run_dir``; the others read it (``cluster.rendezvous``), waiting up to ``timeout_s``."""
    if env.source == "slurm":
        if env.world_size != env.num_nodes:
            raise DdpJobError(
                f"script.launcher=torchrun runs one Slurm task per node, but this step has {env.world_size} tasks on "
                f"{env.num_nodes} node(s)",
                "submit with ddpjob (its request for torchrun is --ntasks-per-node=1), or run srun --ntasks-per-node=1",
            )
        port = meeting.agree(env, run_dir, env.node_rank == 0, timeout_s)
        return Rendezvous(env.num_nodes, env.node_rank, env.master_addr, port, env.job_id or "none")
    if env.world_size > 1:
        raise DdpJobError(
            f"script.launcher=torchrun: this process is already rank {env.rank} of {env.world_size} ({env.source}); "
            "torchrun's agent starts the ranks itself",
            "start one `python -m ddp_core.script RUN` per node, or set script.launcher=srun",
        )
    port = int(os.environ.get("MASTER_PORT") or 0) or meeting.free_port()
    return Rendezvous(1, 0, "127.0.0.1", port, env.job_id or f"local-{os.getpid()}")


def torchrun_argv(rdzv: Rendezvous, nproc_per_node: int, run_dir: Path) -> list[str]:
    """torchrun's command line for this node's agent (without ``torchrun`` itself). Each worker runs ``python -u -m
    ddp_core.script RUN`` in ``ddp_core.python_m``'s form (``--no-python``: the interpreter is named here, torchrun's
    own ``PYTHON_EXEC`` or this one, as torchrun would pick), so a user's ``ddp_core.py`` in the submit directory,
    every worker's working directory, cannot shadow ddpjob's."""
    return [
        f"--nnodes={rdzv.nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=static",
        f"--rdzv-id={rdzv.run_id}",
        f"--node-rank={rdzv.node_rank}",
        f"--master-addr={rdzv.master_addr}",
        f"--master-port={rdzv.master_port}",
        "--max-restarts=0",  # ddpjob restarts a failed step itself, as a new srun step (the batch script's loop)
        f"--monitor-interval={POLL_S}",
        "--no-python",
        os.environ.get("PYTHON_EXEC", sys.executable),
        "-u",
        *python_m.words(WORKER_MODULE),
        str(run_dir),
    ]


def _children(parent: int) -> list[int]:
    """Child processes of ``parent``: ``/proc/PID/task/*/children``, else a scan of ``/proc/*/stat``."""
    tasks = Path(f"/proc/{parent}/task")
    found: list[int] = []
    try:
        for task in tasks.iterdir():
            found.extend(int(pid) for pid in (task / "children").read_text().split())
        return found
    except OSError:  # a kernel without CONFIG_PROC_CHILDREN
        pass
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                # The command name (2nd field) may hold spaces and parentheses: the fields after its last ')'.
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                    found.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return found


def worker_pids(parent: Optional[int] = None) -> list[int]:
    """The agent's workers: its children running ``-m ddp_core.script``."""
    pids = []
    for pid in _children(os.getpid() if parent is None else parent):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # exited meanwhile
        if b"-m" in argv and WORKER_MODULE.encode() in argv:
            pids.append(pid)
    return pids


def handles(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (``SigCgt`` in ``/proc/PID/status``): it neither dies of
    the signal nor ignores it."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


class Forwarder:
    """Signal handlers of the agent's main thread: pass signals on to the workers (see the module docstring)."""

    def __init__(self, warning: signal.Signals) -> None:
        self.warning = warning
        self.warning_pending = False
        self.warning_at: Optional[float] = None  # time.monotonic() of its first arrival
        self.warned: set[int] = set()
        for sig in (*TERMINATING, warning):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if signum == self.warning:
            self.warning_pending = True
            self.warning_at = self.warning_at or time.monotonic()
            self.deliver_warning()
            return
        workers = worker_pids()
        if not workers:
            log.warning("%s with no worker running: the agent leaves", signal.Signals(signum).name)
            leave(128 + signum)  # torch's agent thread holds no state worth a teardown; a daemon thread
        for pid in workers:
            _kill(pid, signum)

    def warn_if_none(self, why: str = "by slurm.signal_lead_s before the time limit") -> None:
        """Slurm's warning is due (``why``) and has not come: take it as come now (``run_agent``)."""
        if self.warning_at is None:
            log.warning("no %s %s: the agent sends it itself", self.warning.name, why)
            self._handle(self.warning, None)

    def deliver_warning(self) -> None:
        """The warning signal to every worker that handles it and has not had it yet."""
        if not self.warning_pending:
            return
        for pid in worker_pids():
            if pid not in self.warned and handles(pid, self.warning):
                _kill(pid, self.warning)
                self.warned.add(pid)

    def unhandled(self, grace_s: float) -> bool:
        """Whether the warning came ``grace_s`` ago or more and no worker has taken it (none handles it)."""
        return self.warning_at is not None and not self.warned and time.monotonic() - self.warning_at >= grace_s


def _blame(exitcode: int) -> int:
    """Which failure explains the others: once one worker fails, torch's agent stops the rest with SIGTERM (SIGKILL
    after its timeout) and reports them as failures too, all stamped to the same second. A worker's own exit code
    first, then a death by another signal (the OOM killer's SIGKILL), then SIGTERM."""
    if exitcode > 0:
        return 0
    return 2 if -exitcode == signal.SIGTERM else 1


class _NoThreadWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Failed to register signal handlers since torchelastic is running on")


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass  # exited meanwhile


def exit_code(
    error: Optional[BaseException], host: str, world_size: int, on_killed: Optional[Callable[[int, str], None]] = None
) -> int:
    """The agent's exit code for what torch's ``run`` raised (None: every worker exited 0). ``on_killed``: called with
    the rank and the signal's name when the failure that explains the others is a worker killed by a signal."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if error is None:
        return 0
    if not isinstance(error, ChildFailedError):
        log.error("torchrun agent on %s failed: %s: %s", host, type(error).__name__, error, exc_info=error)
        return 1
    rank, first = min(error.failures.items(), key=lambda item: (_blame(item[1].exitcode), item[1].timestamp, item[0]))
    code = first.exitcode if first.exitcode >= 0 else 128 - first.exitcode
    how = f"was killed by {signal.Signals(-first.exitcode).name}" if first.exitcode < 0 else f"exited with code {code}"
    others = len(error.failures) - 1
    log.warning(
        "rank %d/%d on %s %s first%s: the agent exits %d",
        rank,
        world_size,
        host,
        how,
        f" ({others} more of this node's ranks exited non-zero)" if others else "",
        code,
    )
    # A worker killed by a signal of its own (not the agent's SIGTERM to the rest) explains its peers' errors, whatever
    # exit code the agent passes on.
    signalled = [(f.timestamp, r, -f.exitcode) for r, f in error.failures.items() if f.exitcode < 0]
    signalled = [s for s in signalled if s[2] != signal.SIGTERM]
    if signalled and on_killed is not None:
        _, killed_rank, signum = min(signalled)
        on_killed(killed_rank, signal.Signals(signum).name)
    return code


def run_agent(
    run_dir: Path, cfg: Config, env: DistEnv, on_unhandled_warning: Optional[Callable[[], None]] = None
) -> int:
    """Run this node's torchrun agent until its workers end; returns the agent's exit code (module docstring).
    ``on_unhandled_warning``: called once when no worker takes the warning signal (``Forwarder.unhandled``)."""
    from torch.distributed import run as torchrun

    from ddp_core.config import ranks_per_node

    host = socket.gethostname()
    nproc = ranks_per_node(cfg)
    try:
        rdzv = rendezvous(env, run_dir, cfg.dist.init_timeout_s)
    except DdpJobError as err:
        log.error("%s", err)
        return 2
    # Outside a batch script that set it: each worker's threads get its share of this task's CPUs.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, env.cpus_per_rank // nproc)))
    argv = torchrun_argv(rdzv, nproc, run_dir)
    log.info("torchrun %s", " ".join(argv))
    args = torchrun.parse_args(argv)
    forwarder = Forwarder(signals.warning_signal(cfg.slurm.warning))
    outcome: list[BaseException] = []

    def agent() -> None:
        try:
            torchrun.run(args)
        except BaseException as err:
            outcome.append(err)

    # Asked before the workers start: nothing in this thread may fail while they run (an exception here would leave
    # them running without their agent, holding the run directory's lock; measured on the local cluster).
    due = deadline.warning_due(cfg.slurm, env) if env.is_main else None  # node 0's agent: rank 0's
    lost = threading.Event()  # the batch node of a job with spare nodes is gone (cluster.batch_node): warn now

    def lost_batch_node(host: str) -> None:
        if batch_node.script_told(cfg.slurm, host):
            lost.set()

    watch = batch_node.watch(cfg.slurm, env, RunDir(run_dir), lost_batch_node)
    # In a helper thread, torch's agent installs no signal handlers: this (main) thread keeps them (module docstring).
    # torch warns that its workers could then be orphaned; here they cannot, so the warning would only mislead.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_NoThreadWarning())
    thread = threading.Thread(target=agent, name="torchrun-agent", daemon=True)
    thread.start()
    # Started while this task still held the warning signal and SIGTERM (cluster.signals): the agent thread keeps
    # them held, and so do the workers it starts, from their first instruction. This thread handles them from now.
    signals.release(forwarder.warning, signal.SIGTERM)
    while thread.is_alive():
        thread.join(POLL_S)  # signal handlers run here, between waits
        if due is not None and time.time() >= due:
            due = None
            forwarder.warn_if_none()
        if lost.is_set():
            lost.clear()
            forwarder.warn_if_none("since the batch node is gone")
        forwarder.deliver_warning()
        if on_unhandled_warning is not None and forwarder.unhandled(HELD_WARNING_GRACE_S):
            on_unhandled_warning()
            on_unhandled_warning = None

    def killed(rank: int, name: str) -> None:
        # What srun reports of a task killed by a signal, which it cannot see here (the agent is the task): the
        # batch script's watcher reads it as the attempt's infrastructure failure (cluster.failures).
        fields = {"job_id": env.job_id, "restart_count": env.restart_count, "rank": rank, "host": host, "step": None}
        error = f"killed by a signal ({name})"
        RunDir(run_dir).log_event("rank_failed", **fields, kind="infrastructure", error=error, signal=name)

    if watch is not None:
        watch.stop()
    return exit_code(outcome[0] if outcome else None, host, rdzv.nnodes * nproc, killed)
