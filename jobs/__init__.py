"""jobs: the login-node side of ddpjob. It loads and checks configs, submits and follows Slurm jobs, and reads what
runs leave on disk. Never imports torch at module import (``ddpjob --help`` must be instant on a login node).

Packages by concern, in layers that import only downwards (``pyproject.toml``'s import-linter contracts, no cycles):

- ``jobs.cli``: the ``ddpjob`` parser and its dispatch, nothing else;
- ``jobs.doctor`` (the cluster's checks, the node probe, the drill) and ``jobs.report`` (pages and tables of runs
  and sweeps), which never import each other;
- ``jobs.runs``: naming a run (``lookup``), its jobs and attempts, ``status``, ``logs``/``cancel``, ``resume``,
  ``export``, ``sync``;
- ``jobs.sweeps``: grid and random sweeps as job arrays, adaptive searches (Optuna), what a sweep records;
- ``jobs.submission``: the one submission pipeline (check, resolve, render, submit) that every way in goes through,
  with the partitions and the code snapshot.
"""
