"""NCCL's flight recorder: the last collectives of every NCCL process group, in a ring buffer inside torch
(``TORCH_NCCL_TRACE_BUFFER_SIZE`` entries), dumped next to the hang watchdog's stacks (``RUN/hangs/<attempt>/``)
when a rank hangs. Which collective a rank is stuck in, with its sequence number, sizes and state, is what the
stacks cannot say: ``python -m torch.distributed.flight_recorder.fr_trace RUN/hangs/<attempt>`` reads the dumps of
all ranks together. Only on GPUs (NCCL); a CPU run (gloo) has none.

Torch-free at import, as the watchdog that calls ``dump`` (script mode's too).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)
BUFFER_ENV = "TORCH_NCCL_TRACE_BUFFER_SIZE"
BUFFER_ENTRIES = "2000"  # collectives kept per process group: a few steps of a large model's, a few MB of host memory
DUMP_PREFIX = "nccl_trace_rank"  # what fr_trace looks for: <prefix><rank>


def enable(cuda: bool) -> None:
    """Before the NCCL process group exists (it reads the variable when it is created); a user's own size stays."""
    if cuda:
        os.environ.setdefault(BUFFER_ENV, BUFFER_ENTRIES)


def dump(folder: Path, rank: int) -> Optional[Path]:
    """This rank's flight recorder in ``folder``, or None where there is none (no NCCL group, no buffer)."""
    torch = sys.modules.get("torch")
    if torch is None or not os.environ.get(BUFFER_ENV) or not torch.cuda.is_available():
        return None
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    c10d = getattr(torch._C, "_distributed_c10d", None)
    reader = getattr(c10d, "_dump_nccl_trace", None)  # torch's own entry point (the same as its dump on timeout)
    if reader is None:
        return None
    try:
        data = reader()
    except Exception as err:  # a hang is being reported: a failed dump must not hide it
        log.warning("no NCCL flight recorder dump: %s", err)
        return None
    path = folder / f"{DUMP_PREFIX}{rank}"
    path.write_bytes(data)
    return path
