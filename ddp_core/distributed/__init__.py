"""distributed: torch.distributed for one attempt (the config's ``dist`` section is read here).

Named for what it wraps, ``torch.distributed`` (which these modules import as ``dist``). Owns:

- ``groups``: the process group's life (the rendezvous, init with the backend per device, the health check's
  all-reduce, barrier and teardown) and the device each rank trains on;
- ``collectives``: the host-side collectives the trainer uses (sums, float and object gathers, hosts, key unions);
- ``rng``: per-rank RNG state (seeding, capture and restore for checkpoints, ``rng_untouched``);
- ``hints``: what to try after a communication failure, for a rank's error line;
- ``guard``: the collective guard that rehearses a GPU node's process groups on a CPU machine;
- ``straggler``: each rank's own work per step, and the slowest rank;
- ``suspend``: the hooks that lift collective timeouts while Slurm suspends a job.

Imports ``cluster``, ``config`` and ``errors``; exposes nothing at package level (import the module you need).
"""
