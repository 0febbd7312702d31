"""Which implementation an op with a Triton kernel and a PyTorch path runs, from its
environment switch (read per call): "auto" (default: Triton on CUDA, PyTorch elsewhere),
"torch" or "triton". Triton is not imported here: importing it decides, once per process,
whether `@triton.jit` kernels are compiled or interpreted."""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "torch", "triton")


def resolve_auto_backend(env: str, op: str, device: torch.device) -> str:
    """"torch" or "triton" for a call of `op` on `device`, from `$env`; a ValueError naming
    `op` and `env` for any other value."""
    name = os.environ.get(env) or "auto"
    if name not in BACKENDS:
        raise ValueError(f"{op}: {env} must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name
