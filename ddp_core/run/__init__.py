"""run: a run's directory on the shared filesystem. Torch-free.

Owns the layout of a run directory (``rundir.RunDir``: its config, its events log, its locks, checkpoints' and
hangs' folders), the code snapshot taken at submit and put first on ``sys.path`` on the compute nodes
(``snapshot``), who may write and read it (``permissions``, with ``entry``: submitit's job entry behind that check),
the progress lines and final result a run reports (``reporting``), and the rule for every folder ddpjob makes outside
a run directory: this user's alone, checked (``private``). Imports ``config`` and ``errors`` only.
"""
