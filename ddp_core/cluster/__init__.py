"""cluster: where this process runs and how it ends. Torch-free.

Owns the rank/world view (``env.DistEnv``, read once from Slurm's, torchrun's or a lone process's environment), the
Slurm gateway (``slurm``: every ``scontrol``/``sacct`` call, one injectable runner), the warning and termination
signals (``signals``, ``preemption.StopFlag``), the preemption decisions (``preemption.decide``), the exit policy
(``exits``: named exit codes and the only place a compute-side process ends), what an attempt's failure was
(``failures``: the failure table, excluded nodes), the node checks before an attempt's first step (``health``), the
batch script's watcher of its attempt (``supervise``: restart, requeue or fail after srun returns), the watch of
the batch node in a job that outlives its nodes (``batch_node``), what a node's state means (``node_state.gone``),
rank 0's lock on its run directory, broken when its holder died with its node (``run_lock``), and rank-prefixed
logging (``log``). Imports ``config``, ``run`` and ``errors`` only.
"""
