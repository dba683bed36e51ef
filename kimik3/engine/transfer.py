"""Host-to-device copies for the engine's per-step index and value lists."""

from __future__ import annotations

import torch


def on_device(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A host list as a device tensor, copied from pinned memory without waiting for the device
    (a pageable copy waits for the step still running there)."""
    device = torch.device(device)
    return torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda").to(device, non_blocking=True)
