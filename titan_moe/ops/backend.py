"""Device facts the ops' path choices depend on, asked without importing Triton.

Importing Triton decides, once per process, whether `@triton.jit` kernels are compiled or
interpreted, so nothing here imports it; the kernel modules answer for their own kernels
(`titan_moe.ops.triton_runtime.kernel_runs_on`).
"""

from __future__ import annotations

import functools
import os

import torch


def triton_runs_on(device_type: str) -> bool:
    """Whether our Triton kernels can run on devices of `device_type`: CUDA, or the CPU when
    Triton's interpreter is on (`TRITON_INTERPRET=1`, Triton's own variable: the CPU tests)."""
    return device_type == "cuda" or (device_type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of CUDA `device` (asked once per device), None off CUDA."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def is_sm90(device: torch.device) -> bool:
    """Whether `device` is a CUDA GPU of compute capability 9.x (H100, H200): where our sm90
    tiles, TMA loads and Gluon kernels were built and measured. False on the CPU, also under
    Triton's interpreter."""
    capability = cuda_capability(device)
    return capability is not None and capability[0] == 9
