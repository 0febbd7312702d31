"""Where our Triton kernels can run: compiled on CUDA, or on CPU under the interpreter.

Triton decides at import whether `@triton.jit` builds interpreted functions
(`TRITON_INTERPRET=1`, used by the CPU tests) or compiled kernels; a kernel built one way
cannot run the other way. Each kernel module answers through its own kernel object.
"""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction


def is_interpreted(kernel) -> bool:
    """Whether `kernel` (a `@triton.jit` function) was built for the Triton interpreter."""
    return isinstance(kernel, InterpretedFunction)


def kernel_runs_on(kernel, device: torch.device) -> bool:
    """Whether `kernel` can run on tensors of `device`: CUDA when compiled, CPU when interpreted."""
    if device.type == "cuda":
        return not is_interpreted(kernel)
    return device.type == "cpu" and is_interpreted(kernel)


def check_runs_on(kernel, device: torch.device, caller: str, module: str) -> None:
    """Raise a ValueError naming `caller` when `kernel` (from kernel module `module`) cannot
    run on `device`."""
    if not kernel_runs_on(kernel, device):
        raise ValueError(
            f"{caller}: the Triton kernels run on CUDA, or on CPU when TRITON_INTERPRET=1 was set before "
            f"{module} was imported; got device {device} "
            f"(interpreter {'on' if is_interpreted(kernel) else 'off'})"
        )
