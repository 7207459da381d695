"""trainer: the built-in training loop and what it drives.

Owns the loop (``loop.Trainer``, which ``launch`` builds on every rank), the data pipeline with its resumable
sampler (``data``), the optimizer and LR schedule (``optim``), running metrics (``metrics``), the best-checkpoint
monitor and early stopping (``monitor``), the records rank 0 sends to the experiment trackers (``progress``) and the
hang watchdog (``watchdog``). Imports the packages below it: ``checkpoint``, ``strategies``, ``search`` (the pruner's
reporter), ``tasks``, ``dist``, ``cluster``, ``trackers``, ``run``, ``config``.
"""
