"""checkpoint: what a run saves and how it comes back.

Owns the on-disk format (``store``: checksummed files, a manifest written last, finding the newest verified
checkpoint, pruning and the best copy), the writers (``full``: one file from rank 0, synchronous or staged to host
memory and written in the background through ``staging``; ``sharded``: torch.distributed.checkpoint, one shard per
rank), the state a checkpoint holds besides the model and optimizer (``train_state``: step, loader position,
per-rank RNG), and the node-local tier below the durable checkpoints (``local``, ``local_replica``,
``local_restore``: frequent copies in node memory, replicated across nodes, restored when newer). Imports ``dist``,
``run``, ``cluster`` and ``errors``.
"""
