"""ddp_core: the compute-node side of ddpjob. Layers, top to bottom (``pyproject.toml``'s import contracts):

- ``runtime`` and ``task``: the public API users' code imports (script mode's helper, the Task API), which
  nothing inside ddp_core imports;
- ``launch`` (the trainer's entry points, ``python -m ddp_core``);
- ``script`` (script mode), then ``trainer`` (the built-in loop);
- ``checkpoint``, ``strategies`` and ``search``, then ``tasks`` (the Task API and built-in tasks);
- ``distributed`` (torch.distributed: process groups, collectives, RNG state), then ``cluster`` (rank/world,
  Slurm, signals, the exit policy), then ``run`` (the run directory), then ``config`` (the schema, torch-free),
  then ``errors``, ``locations`` (whether a location names object storage) and ``python_m`` (the ``python -m``
  form of every command line ddpjob writes).
"""
