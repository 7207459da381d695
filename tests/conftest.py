"""Shared fixtures. Slurm-marked tests need the local cluster (scripts/slurm-local up); with
DDPJOB_REQUIRE_SLURM=1 (set by scripts/test and CI) a missing cluster fails them instead of skipping.

A test marked ``cluster_profile("NAME")`` needs the cluster started with ``scripts/slurm-local up --profile NAME``
(preemption setups are global to a cluster). Tests for another profile than the running one are deselected;
``--cluster-profile-only`` keeps only the running profile's tests (scripts/test runs one such pass per profile).

Slurm releases: the full suite runs on one release (22.05, the host's). A test marked ``slurm_interface`` exercises
one of Slurm's interfaces (submitting, arrays, status, requeue, preemption, GRES, ...) and runs again on each other
tested release: ``--release-pass`` keeps only those (and the running release's ``cluster_release`` tests) whose
profile is the running one (a test without ``cluster_profile`` belongs to "preempt", as in the first pass);
scripts/test runs one such pass per release and profile. A test marked ``cluster_release("R", ...)`` needs one of
those releases (apptainer: only the 26.05 root filesystem has it) and is deselected on any other."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ddp_core.cluster.slurm import GATEWAY
from tests.support import cluster_guard
from tests.support.helpers import running_profile

ROOT = Path(__file__).resolve().parent.parent
NICE = 5  # tests without the cluster: see _yield_to_cluster_jobs


@pytest.fixture(scope="session", autouse=True)
def _job_environment():
    # Jobs inherit the submitter's environment: let them import tests.support.tasks, and keep threads low.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("WANDB_SILENT", "true")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cluster-profile-only", action="store_true",
                     help="run only tests marked cluster_profile(P) for the running cluster's profile P")  # fmt: skip
    parser.addoption("--release-pass", action="store_true",
                     help="only the slurm_interface and cluster_release tests of the running profile")  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    if mismatch := cluster_guard.instance_mismatch(os.environ):
        # the cluster guard would lock one cluster and clean up (scancel) another's jobs
        raise pytest.UsageError(f'{mismatch}: eval "$(scripts/slurm-local env)" with DDPJOB_SLURM_HOME set')
    if getattr(config.option, "dist", "no") == "loadgroup" and pytest.version_tuple >= (9,):
        # xdist 3.8 groups by rewriting node ids, which pytest 9 no longer reads: every group would be split.
        raise pytest.UsageError("--dist loadgroup needs pytest < 9 here (pyproject.toml pins it): scripts/setup")


def running_release() -> str:
    """The local cluster's Slurm release ("22.05", "24.11", ...), as the gateway reads it; "" if none answers."""
    return ".".join(GATEWAY.version().split(".")[:2])


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks to group the tests
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slurm"):
            # Under pytest-xdist (--dist loadgroup) the cluster tests run in two lanes, each on its own worker and one
            # test at a time: lane "a" holds the tests that need the cluster alone and some shared ones, lane "b" only
            # shared ones, which tests/cluster_guard.turn lets run beside lane a's. Whole modules go to one lane, so
            # a module's reference run is computed once. A third worker runs the tests that need no cluster.
            item.add_marker(pytest.mark.xdist_group(f"slurm-{lane(item)}"))
    # Each lane runs its shared tests first, its exclusive ones last: lane b's shared tests then run beside lane a's
    # instead of making lane a's exclusive tests wait for them (that waiting cost ~400 s a suite). Stable: a
    # module's tests stay in order and together.
    items.sort(key=exclusive)
    wanted = {item: m.args[0] for item in items if (m := item.get_closest_marker("cluster_profile"))}
    releases = {item: m.args for item in items if (m := item.get_closest_marker("cluster_release"))}
    only, release_pass = config.getoption("--cluster-profile-only"), config.getoption("--release-pass")
    if not wanted and not releases and not only and not release_pass:
        return
    profile = running_profile()
    if release_pass:
        keep = [i for i in items if (i.get_closest_marker("slurm_interface") or i in releases)]
        keep = [i for i in keep if wanted.get(i, "preempt") == profile]
    else:
        keep = [i for i in items if wanted.get(i, None if only else profile) == profile]
    if releases:
        release = running_release()
        keep = [i for i in keep if i not in releases or release in releases[i]]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep


def exclusive(item: pytest.Item) -> bool:
    """A cluster test that takes the cluster alone (tests/support/cluster_guard.py)."""
    return item.get_closest_marker("slurm") is not None and item.get_closest_marker("cluster_shared") is None


def lane(item: pytest.Item) -> str:
    """The cluster-test lane: ``cluster_shared(LANE)``'s, else "a" (the tests that need the cluster alone)."""
    shared = item.get_closest_marker("cluster_shared")
    return shared.args[0] if shared else "a"


def _cluster_up() -> bool:
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and any(state in out.stdout for state in ("idle", "mix", "alloc"))


@pytest.fixture(scope="session")
def slurm_cluster():
    if not _cluster_up():
        if os.environ.get("DDPJOB_REQUIRE_SLURM") == "1":
            pytest.fail("the local Slurm cluster is not up (scripts/slurm-local up)")
        pytest.skip("no Slurm cluster (scripts/slurm-local up); set DDPJOB_REQUIRE_SLURM=1 to fail instead")
    return True


@pytest.fixture(autouse=True)
def _yield_to_cluster_jobs(request: pytest.FixtureRequest):
    """A test that needs no cluster runs niced (it and the processes it starts): on a machine of few cores the
    cluster tests' jobs, which run at the nice of slurmd, go first, as they are the suite's longest path (a lane
    runs its tests one by one); the rest fill the gaps while the lanes wait on Slurm. Only where the nice can be
    taken back (root), as the same worker runs cluster tests next."""
    if request.node.get_closest_marker("slurm") or os.geteuid() != 0 or os.environ.get("DDPJOB_TEST_NICE") == "0":
        yield
        return
    before = os.getpriority(os.PRIO_PROCESS, 0)
    os.setpriority(os.PRIO_PROCESS, 0, max(before, NICE))
    try:
        yield
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, before)


@pytest.fixture(autouse=True)
def _cluster_turn(request: pytest.FixtureRequest):
    """Each cluster test takes its turn on the cluster, alone or shared, and starts on a healthy one (an idle one
    when alone): see tests/support/cluster_guard.py."""
    if not (request.node.get_closest_marker("slurm") and _cluster_up()):
        yield
        return
    with cluster_guard.turn(shared=request.node.get_closest_marker("cluster_shared") is not None) as repairs:
        for repair in repairs:
            print(f"cluster guard: {repair}")
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.failed and report.when == "call" and item.get_closest_marker("slurm"):
        report.sections.append(("cluster state after the failure", cluster_guard.snapshot()))
