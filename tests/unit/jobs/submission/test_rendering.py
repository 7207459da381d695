"""Golden files pin the two sbatch scripts a config turns into (``jobs.submission.render``): the one ``ddpjob submit``
queues (submitit's job layout) and the plain template's."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

from ddp_core import python_m
from ddp_core.config import load_config
from jobs.submission.render import TASK_ENTRY, TEMPLATE
from jobs.submission.request import SlurmRequest
from tests.support.cli_runner import run_cli
from tests.support.golden import RUN, check_golden
from tests.support.helpers import ROOT, run_script, template_script, write_shadowing_files

OVERRIDES = ["slurm.partition=gpu", "slurm.account=proj42", "slurm.setup=[module load cuda]",
             "slurm.additional={constraint: a100}"]  # fmt: skip
GPU = ["slurm.gpus_per_node=4", "slurm.nodes=2", "train.deterministic=true", "slurm.setup=[module load cuda/12.4]"]
# An elastic job: --nodes=MIN-MAX with tasks per node (never a fixed --ntasks), its global batch fixed.
ELASTIC = ["slurm.nodes=1-2", "data.global_batch_size=128"]
VARIANTS = {"default": [], "custom": OVERRIDES, "gpu": GPU, "elastic": ELASTIC}


@pytest.mark.parametrize("variant", VARIANTS)
def test_submitit_script(variant):
    cfg = load_config(ROOT / "configs" / "digits.yaml", VARIANTS[variant])
    check_golden(f"submitit-{variant}.sbatch", run_script(cfg, RUN, python="/usr/bin/python3"))


@pytest.mark.parametrize("variant", VARIANTS)
def test_template_script(variant):
    cfg = load_config(ROOT / "configs" / "digits.yaml", VARIANTS[variant])
    check_golden(f"template-{variant}.sbatch", template_script(cfg, RUN, python="/usr/bin/python3"))


def test_template_by_hand_is_valid_bash():
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
    assert shlex.join(["/usr/bin/python3", *python_m.words("ddp_core.cluster.supervise")]) in script
    assert shlex.join(["/images/train.sif", "python3", "-u", *python_m.words(TASK_ENTRY)]) in script


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


def test_a_users_jobs_py_or_ddp_core_py_does_not_shadow_the_batch_scripts_commands(tmp_path):
    """The rendered template's own lines, run in a submit directory holding jobs.py, ddp_core.py and submitit.py:
    `jobs prepare` (which still imports the user's task module from that directory, as ``python -m`` did), the
    watcher's two calls, and the srun line (an srun that runs its command here); then submitit's task command and
    torchrun's worker command, as they are built."""
    write_shadowing_files(tmp_path)
    (tmp_path / "usertask.py").write_text("from ddp_core.tasks.digits import DigitsTask as UserTask\n")
    cfg = load_config(ROOT / "configs" / "digits.yaml")
    text = template_script(cfg, RUN, python=sys.executable)
    setup = text.split("# >>> ddpjob setup\n")[1].split("# <<< ddpjob setup\n")[0]
    prepare = next(line for line in text.splitlines() if " jobs prepare " in line)
    srun = text[text.index("\nddpjob_steps srun ") :]
    script = f"""{setup}
trap - EXIT
set -e
srun() {{ while [[ $1 == -* ]]; do case $1 in --output|--error) shift 2;; *) shift;; esac; done; "$@"; }}
SLURM_JOB_ID=77
set -- {ROOT / "configs" / "digits.yaml"} run.root={tmp_path / "runs"} task.target=usertask:UserTask
{prepare.strip()}
echo "prepared $RUN_DIR"
(RUN_DIR=; ddpjob_watch 3) || echo "watch $?"
(SLURM_RESTART_COUNT=1 RUN_DIR={tmp_path / "missing"}; ddpjob_begin; echo "begin $?")
RUN_DIR=--help
{srun}"""
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "in the submit directory was imported" not in out, out
    assert f"prepared {tmp_path / 'runs'}/digits-77" in out
    assert "task:\n  target: usertask:UserTask" in (tmp_path / "runs" / "digits-77" / "config.yaml").read_text()
    assert "watch 3" in out and "begin 0" in out  # the watcher's own answers: 3 back for no run directory, go on
    assert "usage: python -m ddp_core" in out  # the srun line's task ran ddpjob's trainer entry
    # The submitted script's task command (submitit's job entry, on --help for a folder) and torchrun's workers'
    task = next(
        line
        for line in run_script(cfg, RUN, python=sys.executable).splitlines()
        if line.startswith("ddpjob_steps srun ")
    )
    entry = shlex.split(task)[shlex.split(task).index(sys.executable) :][:-1]
    for command in ([*entry, "--help"], [sys.executable, "-u", *python_m.words("ddp_core.script"), "--help"]):
        proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stdout + proc.stderr


def test_the_template_and_submit_sh_spell_python_m_as_ddp_core_does():
    """The template's own setup block (sbatch by hand) and scripts/submit.sh carry ``ddp_core.python_m``'s words."""
    line = f"PYTHON_M=({shlex.join(python_m.RUN_MODULE)})"
    for path in (TEMPLATE, ROOT / "scripts" / "submit.sh"):
        assert line in path.read_text().splitlines(), path


def test_no_warning_signal_renders_no_signal_option(tmp_path):
    """``slurm.signal: none``: neither script asks Slurm for a warning signal, nor does ``--dry-run`` show one; the
    tasks still start with the signal they take as the warning held (USR2: a deadline stop is recorded as it)."""
    off = ["slurm.signal=none", "slurm.time_min=1", "slurm.deadline_margin_s=20"]
    cfg = load_config(ROOT / "configs" / "digits.yaml", off)
    on = load_config(ROOT / "configs" / "digits.yaml", ["slurm.time_min=1", "slurm.signal_lead_s=50"])
    for render in (run_script, template_script):
        with_signal, without = render(on, RUN, python="/usr/bin/python3"), render(cfg, RUN, python="/usr/bin/python3")
        assert "#SBATCH --signal=USR2@50\n" in with_signal and "--signal=" not in without
        assert without == with_signal.replace("#SBATCH --signal=USR2@50\n", "")  # nothing else differs
    proc = run_cli(
        "submit", str(ROOT / "configs" / "digits.yaml"), "--dry-run", "--no-cluster-check", *off, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --requeue" in proc.stdout and "--signal" not in proc.stdout
    assert "  signal: none\n" in proc.stdout  # the resolved config says so


def test_the_templates_own_setup_block_has_the_watch_lines_a_rendered_one_has():
    """``sbatch slurm_templates/ddp.sbatch CONFIG`` by hand runs the file's own setup block, not a rendered one: it
    must define what its srun line calls (``ddpjob_steps``) as the renderer would (a job once failed on
    ``ddpjob_steps: command not found`` when only the rendered copies had it)."""
    request = SlurmRequest.resolve(load_config(ROOT / "configs" / "digits.yaml"))
    words = ('"${RUN_DIR:-}"', '"${RUN_DIR:-}/slurm/${SLURM_JOB_ID}_batch.out"', '"$PYTHON" "${PYTHON_M[@]}"')
    block = TEMPLATE.read_text().split("# >>> ddpjob setup\n")[1].split("# <<< ddpjob setup\n")[0].splitlines()
    assert [line for line in request.watch_lines(*words) if line not in block] == []
