"""ddpjob doctor on how jobs get preempted and whether a save fits the warning: fabricated cluster setups
(tests/unit/jobs/doctor/fakes.py) asserted on findings' keys, levels and values. Limits, accounting, the clients, the
release, the nodes and the Slurm gateway's queries: test_doctor_site.py. (Against the live cluster, and the drill:
tests/cluster/test_doctor_live.py.)"""

from __future__ import annotations

import json
import os

import pytest

from ddp_core.cluster import slurm, slurm_text
from ddp_core.errors import DdpJobError
from jobs.cli import main
from jobs.doctor import checks as doctor
from tests.unit.jobs.doctor.fakes import (
    QOS,
    FakeSlurm,
    diagnose,
    make_run,
    partition,
)

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
