#!/usr/bin/env bash
# Submit a config through slurm_templates/ddp.sbatch with plain sbatch (no submitit):
#   scripts/submit.sh configs/digits.yaml [key=value ...]
# Validates the config, creates the run directory, renders RUN_DIR/slurm/job.sbatch from the template
# (its #SBATCH lines from the config's slurm section) and sbatch's it. Prints job id and run directory.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${DDPJOB_PYTHON:-$ROOT/.venv/bin/python}
[[ -x "$PYTHON" ]] || PYTHON=python3

# `python -m jobs`, unshadowed by a jobs.py or ddp_core.py in the working directory (ddp_core/python_m.py).
PYTHON_M=(-c 'import os,runpy,sys;del sys.path[0];i=sys.argv.index("-m");m=sys.argv[i+1];[__import__(p) for p in ("ddp_core",m.split(".")[0])];sys.path.insert(0,os.getcwd());sys.argv=sys.argv[i+1:];runpy.run_module(m,run_name="__main__",alter_sys=True)' -m)
RUN_DIR=$("$PYTHON" "${PYTHON_M[@]}" jobs prepare --sbatch-script "$@")
if ! JOB_ID=$(sbatch --parsable "$RUN_DIR/slurm/job.sbatch" "$RUN_DIR"); then
    echo "submit.sh: sbatch failed; removing $RUN_DIR" >&2
    rm -rf -- "$RUN_DIR"
    exit 1
fi
JOB_ID=${JOB_ID%%;*}
echo "job:     $JOB_ID"
echo "run dir: $RUN_DIR"
echo "log:     $RUN_DIR/slurm/${JOB_ID}_batch.out (ranks: ${JOB_ID}_<rank>_log.err)"
