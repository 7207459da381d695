"""ddpjob doctor and the Slurm gateway: fabricated cluster setups (output formats captured from the local Slurm
22.05 cluster with read-only commands) asserted on findings' keys, levels and values. (Against the live cluster, and
the drill: tests/cluster/test_doctor_live.py.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Optional, Sequence

import pytest

from ddp_core.cluster import releases, slurm, slurm_text
from ddp_core.errors import DdpJobError
from jobs.cli import main
from jobs.doctor import checks as doctor
from jobs.runs.attempts import job_attempts
from jobs.submission import partitions as cluster

# `scontrol show config` (the keys doctor and the gateway read, among a few others, as Slurm prints them)
CONFIG = {
    "AccountingStorageType": "accounting_storage/slurmdbd",
    "ClusterName": "ddpjob",
    "JobRequeue": "1",
    "KillWait": "10 sec",
    "MaxArraySize": "1001",
    "PreemptMode": "REQUEUE",
    "PreemptType": "preempt/partition_prio",
    "PreemptExemptTime": "00:00:00",
    "SlurmctldParameters": "(null)",
    "SLURM_VERSION": "22.05.8",
}
# `scontrol show partition -o low`
LOW = (
    "PartitionName=low AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=NO QoS=N/A "
    "DefaultTime=NONE DisableRootJobs=NO ExclusiveUser=NO GraceTime=30 Hidden=NO MaxNodes=UNLIMITED "
    "MaxTime=UNLIMITED MinNodes=0 LLN=NO MaxCPUsPerNode=UNLIMITED Nodes=n[1-2] PriorityJobFactor=1 PriorityTier=1 "
    "RootOnly=NO ReqResv=NO OverSubscribe=NO OverTimeLimit=NONE PreemptMode=REQUEUE State=UP TotalCPUs=8 "
    "TotalNodes=2 SelectTypeParameters=NONE JobDefaults=(null) DefMemPerNode=UNLIMITED MaxMemPerNode=UNLIMITED "
    "TRES=cpu=8,mem=8000M,node=2,billing=8"
)
# `sacctmgr -n -P show qos format=Name,Preempt,PreemptMode,GraceTime,MaxSubmitPU`
QOS = "normal||cluster|00:00:00|\nlow||requeue|00:00:30|\nhigh|low|cluster|00:00:00|\n"
# `sacctmgr -n -P show assoc where user=... format=Partition,DefaultQOS,MaxSubmit,GrpSubmit`
ASSOC = "|||\n"
# what the node probe prints on a node with scontrol and sacct and no container runtime
PROBED = "node=n1\nscontrol=/usr/bin/scontrol\nsacct=/usr/bin/sacct\napptainer=\nsingularity=\nenroot=\n"


def partition(name: str, **fields: str) -> str:
    """The ``low`` line, renamed, with other values for ``fields``."""
    line = LOW.replace("PartitionName=low", f"PartitionName={name}")
    for key, value in fields.items():
        line = re.sub(rf"(?<= ){key}=\S*", f"{key}={value}", line)
    return line


PARTITIONS = [
    partition("local", Default="YES", GraceTime="0", PreemptMode="OFF"),
    partition("low"),
    partition("low-cancel", PreemptMode="CANCEL"),
    partition("high", PriorityTier="10", GraceTime="0", PreemptMode="OFF"),
]


class FakeSlurm:
    """Answers the read-only commands doctor runs; anything else fails the test."""

    def __init__(
        self,
        partitions: Sequence[str] = tuple(PARTITIONS),
        qos: Optional[str] = QOS,
        assoc: Optional[str] = ASSOC,
        sacct_rc: int = 0,
        node: tuple[int, str, str] = (0, PROBED, ""),
        srun_help: str = "Usage: srun [OPTIONS(0)... [executable(0) [args(0)...]]]",
        **config: str,
    ) -> None:
        merged = CONFIG | config
        self.config = "Configuration data as of 2026-11-22T19:16:58\n" + "".join(
            f"{k:<23} = {v}\n" for k, v in merged.items()
        )
        self.partitions, self.qos, self.assoc, self.sacct_rc = list(partitions), qos, assoc, sacct_rc
        self.node, self.srun_help = node, srun_help  # the node probe's (rc, stdout, stderr); srun --help
        self.calls: list[list[str]] = []

    def __call__(self, cmd: Sequence[str]) -> subprocess.CompletedProcess[str]:
        cmd = list(cmd)
        self.calls.append(cmd)
        ok = lambda out: subprocess.CompletedProcess(cmd, 0, out, "")  # noqa: E731
        fail = lambda err: subprocess.CompletedProcess(cmd, 1, "", err)  # noqa: E731
        if cmd == ["scontrol", "show", "config"]:
            return ok(self.config)
        if cmd[:4] == ["scontrol", "show", "partition", "-o"]:
            lines = [p for p in self.partitions if len(cmd) == 4 or p.startswith(f"PartitionName={cmd[4]} ")]
            return ok("\n".join(lines) + "\n") if lines else fail(f"Partition {cmd[4]} not found")
        if cmd[:5] == ["sacctmgr", "-n", "-P", "show", "qos"]:
            return ok(self.qos) if self.qos is not None else fail("sacctmgr: error: Problem talking to the database")
        if cmd[:5] == ["sacctmgr", "-n", "-P", "show", "assoc"]:
            return (
                ok(self.assoc) if self.assoc is not None else fail("sacctmgr: error: Problem talking to the database")
            )
        if cmd[0] == "sacct":
            return subprocess.CompletedProcess(cmd, self.sacct_rc, "", "" if not self.sacct_rc else "sacct: error: x")
        if cmd == ["srun", "--help"]:
            return ok(self.srun_help)
        if cmd[0] == "srun":
            return subprocess.CompletedProcess(cmd, *self.node)
        raise AssertionError(f"doctor ran an unexpected command: {cmd}")


def make_run(path: Path, saves: Sequence[float] = (), config: str = "") -> Path:
    path.mkdir(parents=True)
    (path / "config.yaml").write_text("run:\n  name: t\n" + config)
    lines = [{"step": 10, "time": 1.0, "split": "train", "loss": 1.0}]
    lines += [{"step": 10 * (i + 1), "time": 2.0, "split": "checkpoint", "save_s": s} for i, s in enumerate(saves)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def diagnose(fake: FakeSlurm, partition: Optional[str] = None, run: Optional[Path] = None) -> dict[str, doctor.Finding]:
    findings = doctor.diagnose(slurm.SlurmGateway(fake), partition, run)
    by_key = {f.key: f for f in findings}
    assert len(by_key) == len(findings), "keys are unique"
    assert all(f.level in ("ok", "info", "warn", "problem", "unknown") for f in findings)
    assert all(f.fix for f in findings if f.level == "problem"), "every problem names its fix"
    return by_key


@pytest.fixture(autouse=True)
def _no_runs_here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # ./runs is where doctor looks for the newest run


# --- how jobs get preempted -----------------------------------------------------------------------------------


def test_preempt_none_never_preempts(tmp_path):
    run = make_run(tmp_path / "run", saves=[0.5])
    f = diagnose(FakeSlurm(PreemptType="preempt/none", PreemptMode="OFF"), run=run)
    assert f["partition"].value == "local"  # the cluster's default partition
    assert f["preempt_type"].value == "none"
    assert (f["preempt_mode"].level, f["preempt_mode"].value) == ("ok", "OFF")
    assert f["on_preemption"].value == "OFF"
    assert f["save_fits"].level == "ok"
    assert not [k for k, x in f.items() if x.level == "problem"]


def test_a_cluster_without_preemption_reads_the_same_on_every_release():
    # Slurm 22.05 prints "preempt/none"; 24.11 and 26.05 print "(null)" (measured on scripts/slurm-local --slurm)
    for printed in ("preempt/none", "(null)"):
        config = slurm_text.parse_config(f"PreemptType             = {printed}\nPreemptMode             = OFF\n")
        assert config["PreemptType"] == "preempt/none"


def test_partition_prio_requeue_with_grace_time(tmp_path):
    run = make_run(tmp_path / "run", saves=[0.02, 0.03, 2.0])
    f = diagnose(FakeSlurm(), "low", run)
    assert f["preempt_type"].value == "partition_prio"
    assert (f["preempt_mode"].level, f["preempt_mode"].value) == ("info", "REQUEUE")
    assert "high" in f["preempt_mode"].message  # the higher PriorityTier partition preempts it
    assert f["grace_time"].value == 30 and f["kill_wait"].value == 10
    assert (f["send_user_signal"].level, f["send_user_signal"].value) == ("info", False)
    assert f["on_preemption"].value == "REQUEUE" and f["on_time_limit"].value == 120
    assert f["save_fits"].level == "ok"
    assert f["save_fits"].value == {"save_s": 2.0, "needed_s": 8, "window_s": 30}  # ceil(2 x 1.5 + 5)
    assert f["sigterm_budget"].level == "ok" and f["signal_lead"].level == "ok"
    assert f["job_requeue"].level == "ok" and f["accounting"].level == "ok"
    assert f["max_array_size"].value == 1001
    assert f["max_submit_jobs"].level == "ok"
    assert f["scontrol_on_nodes"].level == "ok"  # the node probe found it (test_what_the_compute_nodes_have)


def test_a_background_save_is_measured_by_its_write_time(tmp_path):
    # checkpoint.async_save: training blocked 0.1 s, but a signal's (synchronous) save costs the 12 s write.
    run = make_run(tmp_path / "run", saves=[0.1, 0.1])
    lines = run.joinpath("metrics.jsonl").read_text().splitlines()
    lines[-1] = json.dumps(json.loads(lines[-1]) | {"write_s": 12.0})
    run.joinpath("metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert doctor.read_run(run).save_s == 12.0


def test_partition_without_own_mode_takes_the_global_one():
    f = diagnose(FakeSlurm([partition("low", PreemptMode="")], PreemptMode="CANCEL"), "low")
    assert f["preempt_mode"].value == "CANCEL"


def test_nothing_above_means_nothing_preempts_today():
    f = diagnose(FakeSlurm([partition("low", Default="YES")]))
    assert f["preempt_mode"].value == "REQUEUE" and "nothing today" in f["preempt_mode"].message


def test_cancel_mode_ends_the_job_and_resume_continues():
    f = diagnose(FakeSlurm(), "low-cancel")
    assert f["preempt_mode"].value == "CANCEL" and f["on_preemption"].value == "CANCEL"
    assert "ddpjob resume" in f["on_preemption"].message
    assert f["save_fits"].level == "unknown" and f["save_fits"].value is None  # no run measured here


def test_suspend_only_pauses(tmp_path):
    run = make_run(tmp_path / "run", saves=[100.0])
    f = diagnose(FakeSlurm([partition("low", PreemptMode="SUSPEND,GANG", Default="YES")]), run=run)
    assert f["preempt_mode"].value == "SUSPEND" and f["on_preemption"].value == "SUSPEND"
    assert f["save_fits"].level == "ok" and f["sigterm_budget"].level == "ok"  # nothing to save in time for
    assert f["signal_lead"].level == "problem"  # 100 s saves still miss a 120 s warning at the time limit


def test_preempt_qos_lists_who_preempts_whom(tmp_path):
    qos_config = {"PreemptType": "preempt/qos", "PreemptMode": "CANCEL"}
    run = make_run(tmp_path / "low", saves=[1.0], config="slurm:\n  qos: low\n")
    f = diagnose(FakeSlurm(**qos_config), "low", run)
    assert f["preempt_type"].value == "qos"
    assert f["preempt_mode"].value == "REQUEUE"  # the QOS's own mode, not the global one
    assert (
        "QOS low" in f["preempt_mode"].message
        and "high preempts low (REQUEUE, GraceTime 30 s)" in f["preempt_mode"].message
    )
    assert f["grace_time"].value == 30 and f["save_fits"].value["window_s"] == 30

    # the user's default QOS (normal) is preempted by nobody
    assert diagnose(FakeSlurm(**qos_config), "low")["preempt_mode"].value == "OFF"
    # PreemptMode=cluster: the global mode
    cluster_mode = QOS.replace("low||requeue", "low||cluster")
    assert diagnose(FakeSlurm(qos=cluster_mode, **qos_config), "low", run)["preempt_mode"].value == "CANCEL"
    # no accounting: which QOS preempts which cannot be read
    f = diagnose(FakeSlurm(qos=None, assoc=None, sacct_rc=1, **qos_config), "low", run)
    assert f["preempt_mode"].level == "unknown" and f["max_submit_jobs"].level == "unknown"


def test_preempt_send_user_signal(tmp_path):
    run = make_run(tmp_path / "run", saves=[25.0])  # over checkpoint.sigterm_budget_s=20, inside GraceTime 100
    params = "enable_configless,preempt_send_user_signal"
    f = diagnose(FakeSlurm([partition("low", GraceTime="100")], SlurmctldParameters=params), "low", run)
    assert (f["send_user_signal"].level, f["send_user_signal"].value) == ("ok", True)
    assert "USR2" in f["on_preemption"].message
    assert f["sigterm_budget"].level == "ok"  # the warning signal comes first: the budget does not apply
    f = diagnose(FakeSlurm([partition("low", GraceTime="100")]), "low", run)
    assert f["sigterm_budget"].level == "problem" and "checkpoint.sigterm_budget_s=43" in f["sigterm_budget"].fix


def test_job_requeue_off_is_a_warning_as_ddpjob_passes_requeue():
    f = diagnose(FakeSlurm(JobRequeue="0"), "low")
    assert (f["job_requeue"].level, f["job_requeue"].value) == ("warn", 0)
    assert "ddpjob resume" in f["job_requeue"].fix


# --- checkpoint save time against the grace time --------------------------------------------------------------


def test_save_that_does_not_fit_the_grace_time_is_a_problem(tmp_path, capsys, monkeypatch):
    run = make_run(tmp_path / "run", saves=[1.0, 40.0, 3.0])
    f = diagnose(FakeSlurm(), "low", run)
    assert f["save_fits"].level == "problem"
    assert f["save_fits"].value == {"save_s": 40.0, "needed_s": 65, "window_s": 30}
    assert "GraceTime >= 65 s on partition low" in f["save_fits"].fix and "checkpoint.every_steps" in f["save_fits"].fix
    assert f["sigterm_budget"].level == "problem"  # SIGTERM and 40 s > 20 s: the trainer would not even save
    assert f["signal_lead"].level == "ok"

    monkeypatch.setattr(slurm.GATEWAY, "runner", FakeSlurm())
    assert main(["doctor", "--partition", "low", "--run", str(run), "--json"]) == 1
    printed = {x["key"]: x for x in json.loads(capsys.readouterr().out)}
    assert printed["save_fits"]["level"] == "problem" and printed["save_fits"]["value"]["needed_s"] == 65
    assert main(["doctor", "--partition", "local", "--run", str(run)]) == 0  # not preempted there
    assert "OK       preempt_mode" in capsys.readouterr().out


def test_without_grace_time_kill_wait_is_the_window(tmp_path):
    run = make_run(tmp_path / "run", saves=[4.0])  # needs 11 s; KillWait gives 10
    f = diagnose(FakeSlurm([partition("low", GraceTime="0")]), "low", run)
    assert f["save_fits"].level == "problem" and f["save_fits"].value["window_s"] == 10
    assert "KillWait" in f["save_fits"].message
    f = diagnose(FakeSlurm([partition("low", GraceTime="0")], KillWait="30 sec"), "low", run)
    assert f["save_fits"].level == "ok"


def test_signal_lead_too_short_for_the_save(tmp_path):
    run = make_run(tmp_path / "run", saves=[100.0], config="slurm:\n  signal_lead_s: 60\n  time_min: 60\n")
    f = diagnose(FakeSlurm(), "local", run)
    assert (f["signal_lead"].level, f["signal_lead"].value) == ("problem", 60)
    assert f["signal_lead"].fix == "set slurm.signal_lead_s=155 or more"


def test_without_a_signal_the_deadline_stop_is_what_happens_at_the_time_limit(tmp_path):
    config = "slurm:\n  signal: none\n  deadline_margin_s: 45\n"
    f = diagnose(FakeSlurm(), "local", make_run(tmp_path / "run", saves=[100.0], config=config))
    assert f["signal_lead"].level == "ok" and "deadline stop" in f["signal_lead"].message
    assert "no warning signal (slurm.signal: none)" in f["on_time_limit"].message
    assert "slurm.deadline_margin_s=45" in f["on_time_limit"].message


def test_recent_saves_of_the_newest_run_count(tmp_path):
    old = make_run(tmp_path / "runs" / "old", saves=[50.0])
    new = make_run(tmp_path / "runs" / "sweep" / "trial", saves=[90.0, 1, 1, 1, 1, 2.0])  # 90 s is not recent
    os.utime(old / "metrics.jsonl", (1000, 1000))
    os.utime(new / "metrics.jsonl", (2000, 2000))  # newest
    f = diagnose(FakeSlurm(), "low")
    assert f["save_fits"].value["save_s"] == 2.0 and "runs/sweep/trial" in f["save_fits"].message
    make_run(tmp_path / "runs" / "fresh")  # newer, but no checkpoint yet: the newest measured one counts
    assert diagnose(FakeSlurm(), "low")["save_fits"].value["save_s"] == 2.0


def test_run_without_checkpoints_measures_nothing(tmp_path):
    f = diagnose(FakeSlurm(), "low", make_run(tmp_path / "run"))
    assert [f[k].level for k in ("save_fits", "sigterm_budget", "signal_lead")] == ["unknown"] * 3
    with pytest.raises(DdpJobError, match="not a run directory"):
        diagnose(FakeSlurm(), "low", tmp_path / "nope")


# --- limits, accounting, bad input ----------------------------------------------------------------------------


def test_submit_limits_from_association_and_qos():
    f = diagnose(FakeSlurm(assoc="|normal|100|\n", MaxArraySize="501"), "low")
    assert f["max_array_size"].value == 501
    assert (f["max_submit_jobs"].level, f["max_submit_jobs"].value) == ("warn", 100)
    qos = QOS.replace("normal||cluster|00:00:00|", "normal||cluster|00:00:00|50")
    assert diagnose(FakeSlurm(qos=qos, assoc="|normal|100|\n"), "low")["max_submit_jobs"].value == 50
    other_partition = "high|normal|10|\n"  # an association limit for another partition does not apply
    assert diagnose(FakeSlurm(assoc=other_partition), "low")["max_submit_jobs"].level == "ok"


def test_accounting():
    fake = FakeSlurm(AccountingStorageType="accounting_storage/none")
    f = diagnose(fake, "low")
    assert (f["accounting"].level, f["accounting"].value) == ("warn", False)
    assert f["max_submit_jobs"].level == "unknown"
    assert not [c for c in fake.calls if c[0] in ("sacct", "sacctmgr")]  # nothing to ask
    f = diagnose(FakeSlurm(sacct_rc=1), "low")
    assert f["accounting"].level == "warn" and "sacct: error" in f["accounting"].message


def test_missing_partition_is_a_user_error(monkeypatch, capsys):
    with pytest.raises(DdpJobError, match="partition 'nosuch' not found") as err:
        diagnose(FakeSlurm(), "nosuch")
    assert "local, low, low-cancel, high" in err.value.hint
    with pytest.raises(DdpJobError, match="no default partition"):
        diagnose(FakeSlurm([partition("low")]))
    monkeypatch.setattr(slurm.GATEWAY, "runner", FakeSlurm())
    assert main(["doctor", "--partition", "nosuch"]) == 2
    assert "partition 'nosuch' not found (hint:" in capsys.readouterr().err


def test_slurm_durations():
    cases = {"30": 30, "10 sec": 10, "00:00:30": 30, "01:30": 90, "1-00:00:10": 86410, "": 0, "UNLIMITED": 0}
    assert {text: slurm_text.duration_s(text) for text in cases} == cases


# --- the gateway on the login side ----------------------------------------------------------------------------


def test_missing_client_and_stuck_controller(tmp_path):
    proc = slurm.run_command(["ddpjob-no-such-slurm-client"])
    assert proc.returncode == slurm.MISSING
    # A client that cannot be started (here not executable; on a loaded node, a fork's EFAULT) is an answer too, not
    # an exception: a torchrun agent once died of one with its workers running.
    unstartable = tmp_path / "scontrol"
    unstartable.write_text("#!/bin/sh\n")
    proc = slurm.run_command([str(unstartable), "show", "job"])
    assert proc.returncode == slurm.NOT_STARTED and "could not be started" in proc.stderr
    assert slurm.SlurmGateway(lambda cmd: slurm.run_command([str(unstartable), *cmd[1:]])).show_job("5") is None
    gone = slurm.SlurmGateway(lambda cmd: subprocess.CompletedProcess(list(cmd), 127, "", "not found"))
    assert gone.squeue_ids(["5"]) == [] and gone.sacct_state("5") == ""
    assert gone.sacct(["5"], "State") == slurm.Accounting([], "sacct is not installed here")
    with pytest.raises(DdpJobError, match=r"Slurm commands .* are not on PATH"):
        cluster.query_partitions(gone)
    assert job_attempts(["100"], runner=gone.runner)[0] == []  # status then goes on with attempts.jsonl
    stuck = slurm.SlurmGateway(lambda cmd: subprocess.CompletedProcess(list(cmd), 124, "", "no answer"))
    assert stuck.sacct(["100"], "State").error == "no answer"  # accounting that does not answer: status falls back
    with pytest.raises(DdpJobError, match=r"squeue did not answer within 60 s \(hint: is the Slurm controller up"):
        job_attempts(["100"], runner=stuck.runner)  # ... to the controller, which does not answer either
    assert stuck.show_job("5") is None  # the trainer's calls never raise
    refused = slurm.SlurmGateway(
        lambda cmd: subprocess.CompletedProcess(
            list(cmd), 1, "", "x\nslurm_load_ctl_conf error: Unable to contact slurm controller"
        )
    )
    assert refused.show_config() is None
    with pytest.raises(DdpJobError, match=r"^scontrol show config failed: slurm_load_ctl_conf error: Unable to conta"):
        doctor.read_cluster(refused, None)  # doctor's one line says what scontrol said


def test_gateway_queries_parse_slurm_output():
    answers = {"squeue": "5300_3 5304\n90 90\n", "sacct": "CANCELLED by 0\n", "sinfo": "local*|2|4|gpu:2\n"}
    calls: list[list[str]] = []

    def fake(cmd: Sequence[str]) -> subprocess.CompletedProcess[str]:
        calls.append(list(cmd))
        return subprocess.CompletedProcess(list(cmd), 0, answers[cmd[0]], "")

    gateway = slurm.SlurmGateway(fake)
    assert gateway.squeue_ids(["5300", "90"]) == [("5300_3", "5304"), ("90", "90")]
    assert gateway.sacct_state("77") == "CANCELLED"
    assert calls[-1] == ["sacct", "-n", "-P", "-X", "-o", "State", "-j", "77"]
    assert cluster.query_partitions(gateway)[0] == cluster.Partition("local", 2, 4, 2, default=True)


# --- the release and the compute nodes -----------------------------------------------------------------------


def test_release_and_what_it_does():
    f = diagnose(FakeSlurm(), "low")
    assert (f["slurm_release"].level, f["slurm_release"].value) == ("ok", "22.05.8")
    assert "--cpus-per-task" in f["release_srun_cpus"].message and "release_requeue" not in f
    f = diagnose(FakeSlurm(SLURM_VERSION="24.11.5"), "low")
    assert f["release_requeue"].level == "info" and "requeues the job once more" in f["release_requeue"].message
    assert "ends COMPLETED" in f["release_requeue"].message
    assert "release_requeue" not in diagnose(FakeSlurm(SLURM_VERSION="26.05.5"), "low")
    for old_or_new in ("21.08.8", "27.05.1"):
        found = diagnose(FakeSlurm(SLURM_VERSION=old_or_new), "low")["slurm_release"]
        assert found.level == "warn" and "untested release" in found.message and "--drill" in found.message
    assert diagnose(FakeSlurm(SLURM_VERSION="23.11.4"), "low")["slurm_release"].level == "info"
    # every fact of the table applies to a tested release, and each names what it is
    assert {fact.key for v in releases.TESTED for fact in releases.facts_for(f"{v}.1")} == {
        fact.key for fact in releases.FACTS
    }  # fmt: skip


def test_what_the_compute_nodes_have():
    f = diagnose(FakeSlurm(), "low")
    assert [f[k].value for k in ("scontrol_on_nodes", "sacct_on_nodes", "container_runtime")] == [True, True, []]
    bare = PROBED.replace("/usr/bin/scontrol", "").replace("/usr/bin/sacct", "") + "apptainer=/usr/bin/apptainer\n"
    fake = FakeSlurm(node=(0, bare, ""), srun_help="  --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH")
    f = diagnose(fake, "low")
    assert (f["scontrol_on_nodes"].level, f["scontrol_on_nodes"].value) == ("info", False)
    assert "the job requeues itself from the batch script instead" in f["scontrol_on_nodes"].message
    assert f["sacct_on_nodes"].value is False and f["container_runtime"].value == ["apptainer", "pyxis"]
    probe = [c for c in fake.calls if c[0] == "srun" and c[1] != "--help"]
    assert probe[0][:6] == ["srun", "-p", "low", "-N1", "-n1", "--time=1"] and "--immediate=20" in probe[0]
    busy = (1, "", "srun: error: Unable to allocate resources: Requested nodes are busy\n")
    f = diagnose(FakeSlurm(node=busy), "low")  # a busy partition: said, not waited for
    assert f["scontrol_on_nodes"].level == "unknown" and "Requested nodes are busy" in f["scontrol_on_nodes"].message


def test_a_runs_image_is_where_the_nodes_are_probed(tmp_path):
    """With --run of a run inside an apptainer image, the probe runs inside it: what that job's ranks would find."""
    seen = FakeSlurm(node=(0, PROBED.replace("/usr/bin/scontrol", ""), ""))
    image = tmp_path / "img.sif"
    run = make_run(tmp_path / "run", config=f"slurm:\n  container:\n    image: {image}\n")
    f = diagnose(seen, "low", run)
    probe = [c for c in seen.calls if c[0] == "srun" and c[1] != "--help"][-1]
    assert probe[-6:-3] == ["apptainer", "exec", str(image)] and probe[-3:-1] == ["sh", "-c"]
    assert f"inside {image}: the job requeues itself from the batch script" in f["scontrol_on_nodes"].message


def test_how_tasks_hold_the_warning_signal(monkeypatch):
    """This machine's env (coreutils 9) blocks signals itself; without it tasks use the python bootstrap."""
    assert diagnose(FakeSlurm(), "low")["held_signals"].value == "env"
    monkeypatch.setattr(doctor.signals.shutil, "which", lambda name: None)
    doctor.signals.env_blocks_signals.cache_clear()
    try:
        finding = diagnose(FakeSlurm(), "low")["held_signals"]
    finally:
        doctor.signals.env_blocks_signals.cache_clear()
    assert (finding.level, finding.value) == ("info", "python") and "bootstrap" in finding.message
