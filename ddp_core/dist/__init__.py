"""dist: torch.distributed for one attempt.

Owns the process group's life (``groups``: init with retries, the backend per device, seeding, barrier and
teardown), the collective guard that checks every rank calls the same collective (``guard``), straggler detection
(``straggler``) and the suspend/resume hooks that stretch collective timeouts while Slurm suspends a job
(``suspend``). Imports ``cluster``, ``config`` and ``errors``.
"""
