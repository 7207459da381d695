"""ddpjob doctor on what a site sets beyond preemption: submit limits, accounting, the clients and the controller,
the release and the compute nodes; and the Slurm gateway's queries (fabricated, as test_doctor.py)."""

from __future__ import annotations

import subprocess
from typing import Sequence

import pytest

from ddp_core.cluster import releases, slurm, slurm_text
from ddp_core.errors import DdpJobError
from jobs.cli import main
from jobs.doctor import checks as doctor
from jobs.runs.attempts import job_attempts
from jobs.submission import partitions as cluster
from tests.unit.jobs.doctor.fakes import (
    PROBED,
    QOS,
    FakeSlurm,
    diagnose,
    make_run,
    partition,
)


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
