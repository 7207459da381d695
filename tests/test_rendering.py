"""Golden files pin the two sbatch scripts a config turns into (``jobs.submission.render``): the one ``ddpjob submit``
queues (submitit's job layout) and the plain template's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ddp_core.config import load_config
from ddp_core.run.rundir import RunDir
from tests.conftest import ROOT
from tests.helpers import run_script, template_script

GOLDEN = Path(__file__).parent / "golden"
RUN = RunDir(Path("/runs/digits-golden"))
OVERRIDES = ["slurm.partition=gpu", "slurm.account=proj42", "slurm.setup=[module load cuda]",
             "slurm.additional={constraint: a100}"]  # fmt: skip
GPU = ["slurm.gpus_per_node=4", "slurm.nodes=2", "train.deterministic=true", "slurm.setup=[module load cuda/12.4]"]
# An elastic job: --nodes=MIN-MAX with tasks per node (never a fixed --ntasks), its global batch fixed.
ELASTIC = ["slurm.nodes=1-2", "data.global_batch_size=128"]
VARIANTS = {"default": [], "custom": OVERRIDES, "gpu": GPU, "elastic": ELASTIC}


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("DDPJOB_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; review and rerun with DDPJOB_UPDATE_GOLDEN=1"


@pytest.mark.parametrize("variant", VARIANTS)
def test_submitit_script(variant):
    cfg = load_config(ROOT / "configs" / "digits.yaml", VARIANTS[variant])
    check_golden(f"submitit-{variant}.sbatch", run_script(cfg, RUN, python="/usr/bin/python3"))


@pytest.mark.parametrize("variant", VARIANTS)
def test_template_script(variant):
    cfg = load_config(ROOT / "configs" / "digits.yaml", VARIANTS[variant])
    check_golden(f"template-{variant}.sbatch", template_script(cfg, RUN, python="/usr/bin/python3"))


def test_template_by_hand_is_valid_bash():
    import subprocess

    proc = subprocess.run(["bash", "-n", str(ROOT / "slurm_templates" / "ddp.sbatch")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_gpu_request_is_one_task_per_gpu():
    cfg = load_config(ROOT / "configs" / "digits.yaml", ["slurm.gpus_per_node=4", "slurm.nodes=2"])
    script = run_script(cfg, RUN, python="python")
    assert "#SBATCH --ntasks-per-node=4" in script and "#SBATCH --gpus-per-node=4" in script
    assert "#SBATCH --nodes=2" in script


def test_gpu_binding_and_cpus_per_gpu():
    def script(*overrides: str) -> str:
        cfg = load_config(ROOT / "configs" / "digits.yaml", ["slurm.cpus_per_task=null", *overrides])
        return run_script(cfg, RUN, "python")

    # Each task sees only its own GPU: --gpus-per-task, and no node-wide request beside it.
    per_task = script("slurm.gpus_per_node=2", "slurm.gpu_bind=task")
    assert "#SBATCH --gpus-per-task=1" in per_task and "--gpus-per-node" not in per_task
    # cpus_per_task unset on a GPU job with no partition known: 4 per GPU; one dp process drives all 4 GPUs.
    assert "#SBATCH --cpus-per-task=4" in script("slurm.gpus_per_node=2")
    dp = script("slurm.gpus_per_node=4", "strategy.name=dp")
    assert "#SBATCH --ntasks-per-node=1" in dp and "#SBATCH --cpus-per-task=16" in dp
    assert "#SBATCH --cpus-per-task=1" in script()  # CPU jobs: one per rank, as before
    gpu = script("slurm.gpus_per_node=2")
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" in gpu and "CUBLAS_WORKSPACE_CONFIG" not in gpu
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in script()


# Script mode with digits.yaml's slurm.* keys: the same request as the trainer, another entry module.
SCRIPT = ["run.name=digits", "script.path=/work/train.py", "script.args=[--steps, '5']", "slurm.tasks_per_node=2",
          "slurm.cpus_per_task=1", "slurm.time_min=30"]  # fmt: skip


def test_template_script_mode():
    check_golden("template-script.sbatch", template_script(load_config(None, SCRIPT), RUN, python="/usr/bin/python3"))


def test_script_mode_submitit_script_is_the_trainers():
    """submitit's batch script runs its own worker on every task (which calls ddp_core.script.run): byte for byte the
    trainer's script for the same slurm.* keys."""
    trainer = load_config(ROOT / "configs" / "digits.yaml")
    script = load_config(None, SCRIPT)
    assert run_script(script, RUN, python="python") == run_script(trainer, RUN, python="python")


# Inside an image: apptainer in front of each task's interpreter (--nv with GPUs), or pyxis' srun options. The
# checkout's own path (ddpjob's code, bound in) is written as /LIB, so the goldens hold on any checkout.
CONTAINER = {
    "apptainer": ["slurm.container.image=/images/train.sif", "slurm.container.binds=[/data:/data:ro]", *GPU],
    "pyxis": ["slurm.container.image=nvcr.io#nvidia/pytorch:24.05-py3", "slurm.container.runtime=pyxis", *GPU],
}


@pytest.mark.parametrize("variant", CONTAINER)
def test_container_scripts(variant):
    from jobs.submission.request import library_root

    cfg = load_config(ROOT / "configs" / "digits.yaml", CONTAINER[variant])
    for name, text in [("submitit", run_script(cfg, RUN, python="/usr/bin/python3")),
                       ("template", template_script(cfg, RUN, python="/usr/bin/python3"))]:  # fmt: skip
        check_golden(f"{name}-{variant}.sbatch", text.replace(str(library_root()), "/LIB"))


def test_container_nv_only_with_gpus():
    cfg = load_config(ROOT / "configs" / "digits.yaml", ["slurm.container.image=/images/train.sif"])
    script = run_script(cfg, RUN, python="/usr/bin/python3")
    assert " apptainer exec --env PYTHONPATH=" in script and "--nv" not in script
    # the watcher runs outside the image with the submitting interpreter; the tasks with the image's
    assert "/usr/bin/python3 -m ddp_core.cluster.supervise" in script
    assert "/images/train.sif python3 -u -m submitit.core._submit" in script


def test_an_image_that_is_not_a_file_is_refused_in_one_line(tmp_path):
    """The check before submitting (``jobs.submission.partitions.check_image``): an apptainer image, or a pyxis image
    given as a path, must be a file; a pyxis registry reference is the node's to resolve."""
    from ddp_core.config.container import ContainerConfig
    from ddp_core.errors import DdpJobError
    from jobs.submission.partitions import check_image

    sif = tmp_path / "train.sif"
    for image, runtime, what in [(sif, "apptainer", "does not exist"), (tmp_path, "apptainer", "is a directory"),
                                 (sif, "pyxis", "does not exist")]:  # fmt: skip
        with pytest.raises(DdpJobError) as err:
            check_image(ContainerConfig(image=str(image), runtime=runtime))
        assert str(err.value).count("\n") == 0 and f"'slurm.container.image' = '{image}' {what}" in str(err.value)
    sif.write_bytes(b"")
    check_image(ContainerConfig(image=str(sif)))
    check_image(ContainerConfig(image="nvcr.io#nvidia/pytorch:24.05-py3", runtime="pyxis"))
    check_image(ContainerConfig())
