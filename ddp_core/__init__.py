"""ddp_core: the compute-node side of ddpjob — rank bootstrap, strategies, the shared trainer."""
