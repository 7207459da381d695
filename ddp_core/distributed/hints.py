"""What to try next after a communication failure: the hint appended to a rank's error line (``launch``, script
mode)."""

from __future__ import annotations

import torch.distributed as dist


def failure_hint(err: BaseException) -> str:
    """What to try next for a communication failure (NCCL, gloo, the rendezvous store)."""
    if isinstance(err, dist.DistError) or "NCCL" in str(err) or "Gloo" in str(err):
        return (
            " (hint: a peer rank may have died first: read every rank's log; for NCCL's own diagnosis resubmit "
            "with slurm.setup='[\"export NCCL_DEBUG=INFO\"]'; on multi-NIC nodes pick the interface with "
            "NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME; a collective slower than dist.timeout_s is reported as a "
            "timeout)"
        )
    return ""
