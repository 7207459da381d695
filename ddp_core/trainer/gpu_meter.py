"""GPU telemetry through NVML (``nvidia-ml-py``, the ``gpu`` extra): this rank's GPU's utilisation, power draw and
the energy it used, read at each progress line (``train.gpu_telemetry``). Without NVML, or without a GPU, there is
nothing to read: a warning where it was asked for (``train.gpu_telemetry=true``), never a failed job.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Optional

import torch

log = logging.getLogger(__name__)
NAN = math.nan


class GpuMeter:
    """This rank's GPU through NVML; ``sample`` gives (utilisation %, power W, joules since the last sample), NaN
    for what it cannot read."""

    def __init__(self, setting: Optional[bool], device: torch.device) -> None:
        self.nvml: Any = None
        self.handle: Any = None
        self.energy_mj: Optional[int] = None  # the device's energy counter at the last sample (millijoules)
        if setting is False:
            return
        if device.type != "cuda":
            if setting:
                log.warning("train.gpu_telemetry=true, but this rank has no GPU (%s): no GPU telemetry", device)
            return
        try:
            import pynvml
        except ImportError:
            if setting:
                log.warning("train.gpu_telemetry=true, but nvidia-ml-py is not installed: no GPU telemetry "
                            "(pip install 'ddpjob[gpu]')")  # fmt: skip
            return
        try:
            pynvml.nvmlInit()
            self.handle = _handle(pynvml, device)
            self.nvml = pynvml
        except Exception as err:  # NVML's own errors: no driver, no permission, an unsupported device
            level = logging.WARNING if setting else logging.INFO
            log.log(level, "no GPU telemetry: NVML did not start (%s)", err)
            return
        self.energy_mj = self._energy()

    @property
    def active(self) -> bool:
        return self.handle is not None

    def _energy(self) -> Optional[int]:
        try:
            return int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))  # Volta and newer
        except Exception:
            return None

    def sample(self) -> list[float]:
        if self.handle is None:
            return [NAN, NAN, NAN]
        nvml = self.nvml
        try:
            util = float(nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)
        except Exception:
            util = NAN
        try:
            power = nvml.nvmlDeviceGetPowerUsage(self.handle) / 1000.0  # milliwatts
        except Exception:
            power = NAN
        now, joules = self._energy(), NAN
        if now is not None and self.energy_mj is not None:
            joules = (now - self.energy_mj) / 1000.0
        self.energy_mj = now
        return [util, power, joules]


def _handle(pynvml: Any, device: torch.device) -> Any:
    """NVML's handle of torch's device: by UUID, since NVML counts every GPU of the node and CUDA only the visible
    ones (CUDA_VISIBLE_DEVICES, Slurm's binding)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is not None:
        text = str(uuid)
        return pynvml.nvmlDeviceGetHandleByUUID(text if text.startswith("GPU-") else f"GPU-{text}")
    return pynvml.nvmlDeviceGetHandleByIndex(index)
