"""How Slurm's commands answer, read in one place: the exit codes the gateway's runner gives a client that did not
run, ``Key=Value`` records and ``scontrol show config``, durations, preemption modes, exit codes as sacct writes
them, whether accounting answered, and whether the controller refused a call for its rate limit.

The gateway (``cluster.slurm``) runs the commands; this module only reads what they print, so every reading of an
answer has one definition that the gateway, the trainer's watchers and ``ddpjob doctor`` share. Torch-free.
"""

from __future__ import annotations

import re
import subprocess
from typing import Mapping, Optional

MISSING = 127  # the shell's code for "command not found": what a missing client returns here
NOT_STARTED = 126  # the shell's code for a command it found but could not run
TIMED_OUT = 124  # timeout(1)'s code: what a controller that does not answer returns here
RATE_LIMITED = 75  # sysexits' EX_TEMPFAIL: the controller refused the call for its rate limit, try again later

# What slurmctld answers a client over its token bucket (``SlurmctldParameters=rl_enable``, Slurm 23.02+), as
# libslurm's error table spells it (24.11 and 26.05): SLURMCTLD_COMMUNICATIONS_BACKOFF ("... momentarily", after
# which the client library itself sleeps and retries a few times) and SLURMCTLD_COMMUNICATIONS_HARD_DROP ("...
# later"). A client prints it after its own prefix: "slurm_load_jobs error: Rate limit exceeded, please retry
# momentarily", "squeue: error: ...".
RATE_LIMIT_MESSAGES = ("Rate limit exceeded, please retry momentarily", "Rate limit exceeded, please retry later")


def rate_limited(proc: subprocess.CompletedProcess[str]) -> bool:
    """Whether the controller refused this call for its per-user rate limit: an answer that means "ask again later",
    never that a job is gone or a state unknown."""
    return proc.returncode != 0 and any(m.lower() in (proc.stderr or "").lower() for m in RATE_LIMIT_MESSAGES)


def parse_fields(text: str) -> dict[str, str]:
    """``Key=Value`` pairs of one ``scontrol show ... -o`` record (values may not contain spaces, except the
    last keys Slurm prints, which hold the rest of the line)."""
    out: dict[str, str] = {}
    for match in re.finditer(r"(\S+?)=(\S*)", text):
        out.setdefault(match[1], match[2])
    return out


def parse_node(line: str) -> dict[str, str]:
    """``scontrol show node -o``'s record: ``parse_fields``, with ``Reason`` whole (an admin's words, spaces and all)
    less Slurm's ``[user@time]``."""
    fields = parse_fields(line)
    if reason := re.search(r"\bReason=(.*?)(?=\s\S+=|$)", line):
        fields["Reason"] = re.sub(r"\s*\[[^\]]*@[^\]]*\]$", "", reason[1].strip())
    return fields


# What Slurm releases print differently in ``scontrol show config`` (the project runs against 22.05, 24.11 and
# 26.05), and what the callers read instead: 24.11+ print "(null)" for no preemption, 22.05 "preempt/none".
CONFIG_SPELLINGS = {("PreemptType", "(null)"): "preempt/none"}


def parse_config(text: str) -> dict[str, str]:
    """``scontrol show config``'s ``Key = Value`` lines, spelled alike on every release (``CONFIG_SPELLINGS``)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and " " not in key.strip():
            out[key.strip()] = CONFIG_SPELLINGS.get((key.strip(), value.strip()), value.strip())
    return out


def config_answer(proc: subprocess.CompletedProcess[str]) -> Optional[dict[str, str]]:
    """``scontrol show config``'s answer, None when there is none. A whole answer counts at exit 1 too: scontrol ends
    it with a ping of the controllers, which it does not retry when rate-limited ("Slurmctld(primary) at H is DOWN"
    under the configuration: 26.05, a user whose jobs spent her RPC budget)."""
    if proc.returncode == 0 or proc.stdout.startswith("Configuration data as of"):
        return parse_config(proc.stdout)
    return None


def duration_s(text: str) -> int:
    """Slurm's durations ("30", "10 sec", "00:00:30", "1-00:00:00") in seconds; 0 when empty or unlimited."""
    days, _, clock = text.strip().removesuffix("sec").strip().rpartition("-")
    parts = clock.split(":")
    if not all(p.isdigit() for p in parts) or not (days or "0").isdigit():
        return 0
    return int(days or 0) * 86400 + sum(int(p) * 60**i for i, p in enumerate(reversed(parts)))


def mode_word(value: str) -> str:
    """A PreemptMode's first word, upper case: "SUSPEND,GANG" -> "SUSPEND", "requeue" -> "REQUEUE"; "" if unset."""
    return value.split(",")[0].strip().upper()


def effective_preempt_mode(config: Mapping[str, str], partition: Mapping[str, str], qos_mode: str) -> str:
    """The PreemptMode a job is preempted with: its partition's under preempt/partition_prio, its QOS's
    (``qos_mode``; "cluster" or unset: the global one) under preempt/qos, the global one where those are unset;
    OFF on a cluster without preemption. The trainer and ``ddpjob doctor`` both decide on it."""
    default = mode_word(config.get("PreemptMode", "OFF")) or "OFF"
    kind = config.get("PreemptType", "preempt/none")
    if kind.endswith("partition_prio"):
        return mode_word(partition.get("PreemptMode", "")) or default
    if kind.endswith("/qos"):
        own = mode_word(qos_mode)
        return default if own in ("", "CLUSTER") else own
    return "OFF"


def exit_text(status: str) -> str:
    """squeue's exit_code (a wait status: 768) as sacct writes it ("3:0"); "0:0" when not a number."""
    code = int(status) if status.strip().isdigit() else 0
    return f"{code >> 8}:{code & 0x7F}"


def first_word_state(rows: list[list[str]]) -> str:
    """The state of a one-column ``State`` answer's first row, first word ('CANCELLED by 0' -> 'CANCELLED'); ''.
    A job that lost a node and went on without it (``--no-kill``) has a ``RESIZING`` row for the allocation it had
    before: its state is the row after it."""
    states = [row[0].split()[0] for row in rows if row and row[0].split()]
    return next((state for state in states if state != "RESIZING"), states[0] if states else "")


def accounting_failure(proc: subprocess.CompletedProcess[str]) -> Optional[str]:
    """The one place that says whether accounting answered a ``sacct``/``sacctmgr`` call: None when it did, else one
    line why not: the client not installed here, slurmdbd down ("Problem talking to the database"), accounting
    switched off ("Slurm accounting storage is disabled"), or no answer within the timeout."""
    if proc.returncode == 0:
        return None
    if proc.returncode == MISSING:
        return f"{proc.args[0]} is not installed here"
    lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    return lines[-1] if lines else f"{proc.args[0]} exited {proc.returncode}"


def rss_bytes(text: str) -> float:
    """sacct's ``154004K`` / ``2.5G`` in bytes (K, M, G, T are 1024's)."""
    scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}.get(text[-1:].upper(), 1)
    try:
        return float(text.rstrip("KMGTkmgt")) * scale
    except ValueError:
        return 0.0


def out_of_memory_peak(text: str, job_id: str) -> Optional[tuple[str, str]]:
    """From ``sacct -P -o JobID,State,MaxRSS,ReqMem``'s ``text``: (the highest MaxRSS of a step that ran out of memory,
    the memory the job asked for), as sacct writes them; None before accounting holds such a peak."""
    rows = [line.split("|") for line in text.splitlines() if line.count("|") == 3]
    asked = next((r[3] for r in rows if r[0] == job_id and r[3]), "")
    peaks = [r[2] for r in rows if r[1].startswith("OUT_OF_MEMORY") and rss_bytes(r[2]) > 0]
    return (max(peaks, key=rss_bytes), asked) if peaks else None


def queue_extra(fields: list[str]) -> tuple[str, str]:
    """A queue row's reason and start time, "" where squeue left them out or does not know (N/A, (null))."""
    reason, start = [*(f.strip() if f.strip() not in ("N/A", "(null)", "Unknown") else "" for f in fields), "", ""][:2]
    return reason, start
