"""pipelines: runs that wait for earlier runs (``ddpjob submit --after``, ``after``) and pipeline files of named
steps (``ddpjob pipeline FILE``: ``spec`` reads and checks the file, ``launch`` submits the steps in order, ``record``
keeps their run directories and jobs, ``status`` shows them). A step's references to an earlier step's outputs are
resolved on the compute node as it starts (``ddp_core.checkpoint.step_refs``). See docs/pipelines.md."""
