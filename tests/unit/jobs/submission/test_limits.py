"""A site's limits (``jobs.submission.limits``): sbatch's refusals by an association or a QOS, as the local cluster's
site profile prints them (tests/cluster/test_site_profile.py submits them for real), read as one line naming the limit
and its fix; and the submit limit a sweep must fit, from sacctmgr's rows."""

from __future__ import annotations

from jobs.submission import limits

QOS_LINES = (
    "sbatch: error: QOSMaxSubmitJobPerUserLimit\nsbatch: error: Batch job submission failed: Job violates "
    "accounting/QOS policy (job submit limit, user's size and/or time limits)\n"
)
NO_ASSOCIATION = (
    "sbatch: error: Batch job submission failed: Invalid account or account/partition combination specified"
)


def test_each_refusal_names_its_limit_and_the_fix():
    line, fix = limits.refusal(QOS_LINES) or ("", "")
    assert line == "sbatch refused the job: the QOS's MaxSubmitJobPerUser limit (QOSMaxSubmitJobPerUserLimit)"
    assert "squeue --me" in fix and "slurm.qos" in fix
    line, fix = limits.refusal("sbatch: error: AssocMaxWallDurationPerJobLimit\n...") or ("", "")
    assert "your association's MaxWallDurationPerJob limit" in line and "slurm.time_min" in fix
    line, fix = limits.refusal("sbatch: error: QOSMaxCpuPerUserLimit") or ("", "")
    assert "MaxCpuPerUser" in line and "slurm.cpus_per_task" in fix
    line, fix = limits.refusal(NO_ASSOCIATION) or ("", "")
    assert "no association with that account and partition" in line and "slurm.account" in fix
    assert limits.refusal("sbatch: error: Invalid --mem specification") is None  # not a limit: said as it is


def test_the_submit_limit_is_the_fewest_that_applies():
    qos = [{"Name": "site", "MaxSubmitPU": "6"}, {"Name": "normal", "MaxSubmitPU": ""}]
    assoc = [{"Partition": "", "DefaultQOS": "site", "MaxSubmit": "10", "GrpSubmit": ""}]
    assert limits.job_qos(assoc, None) == "site" and limits.job_qos(assoc, "normal") == "normal"
    assert limits.submit_limit(qos, assoc, "site", "local") == (6, "QOS site MaxSubmitPU")
    assert limits.submit_limit(qos, assoc, "normal", "local") == (10, "association MaxSubmit")
    assert limits.submit_limit(qos, [], "normal", "local") is None
