"""The submission pipeline, one for every way in (``submit``, ``resume``, ``prepare`` and the sbatch template, a
sweep's arrays, an adaptive search's workers, ``--dry-run``):

1. check (``checks``): the code (the task and the strategy's cut of its model, or the script), the place (``--local``,
   the container image, the partition: ``partitions``);
2. resolve (``checks.resolve``): one ``request.SlurmRequest``, resolved once and passed along;
3. render (``render``): one renderer of the batch script, for a run, an array, the search's workers and the template;
4. submit (``submit``): sbatch through the Slurm gateway inside one submit-or-withdraw.

Also here: ``commands`` (``ddpjob submit`` and ``prepare``), ``follow`` (``--wait``) and ``snapshot`` (the code copied
into a run at submit).
"""
