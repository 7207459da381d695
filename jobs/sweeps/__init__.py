"""Sweeps: many runs of one config. ``command`` is ``ddpjob sweep``; ``spec`` and ``values`` read a grid or random
sweep (a sweep YAML or ``key=v1,v2`` overrides), ``arrays`` submits its trials as job arrays through the submission
pipeline, ``record`` is what it leaves for the report (``sweep.json``, each key's scale). ``search_spec`` and
``search`` are the adaptive sweep (Optuna): one array of workers that ask the study for trials.
"""
