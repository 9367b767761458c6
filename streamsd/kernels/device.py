"""What the kernels' launch plans read off the device."""

from __future__ import annotations

import functools

import torch


@functools.cache  # asked per launch plan: the answer depends on the device alone
def sm_count(device: torch.device) -> int:
    """The device's multiprocessors (4 for a CPU, where the interpreter runs the kernels in tests)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
