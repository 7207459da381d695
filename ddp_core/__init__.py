"""ddp_core: the compute-node side of ddpjob. Layers, top to bottom (``pyproject.toml``'s import contracts):

- ``launch`` (the trainer's entry points), ``runtime``/``task``/``search_worker`` (public names kept for users'
  code and pickled entry points);
- ``script`` (script mode), then ``trainer`` (the built-in loop);
- ``checkpoint``, ``strategies`` and ``search``, then ``tasks`` (the Task API and built-in tasks);
- ``distributed`` (torch.distributed: process groups, collectives, RNG state), then ``cluster`` (rank/world,
  Slurm, signals, the exit policy), then ``run`` (the run directory), then ``config`` (the schema, torch-free),
  then ``errors``.
"""
