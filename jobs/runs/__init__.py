"""Runs that exist: naming one (``lookup.resolve``, the one run reference every command takes), which runs and Slurm
jobs a command is about (``listing``, ``attempts``), and the commands on them: ``status`` (with ``ranking`` and
``notes``), ``logs`` and ``cancel``, ``resume`` (through the submission pipeline), ``export`` and ``sync``.
"""
