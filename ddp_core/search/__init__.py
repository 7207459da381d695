"""search: adaptive sweeps with Optuna.

Owns the study in a sweep's journal file (``study``: create, ask, the search space and samplers), the trial side
of pruning (``pruning``: a trial's reporter and the prune decision every rank agrees on) and the worker each array
task of a search runs (``worker``: asks for trials, runs each as a job step, settles its result). Imports ``dist``,
``run``, ``config`` and ``errors``.
"""
