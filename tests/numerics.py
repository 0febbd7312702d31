"""Shared numeric helpers for the tests."""

from __future__ import annotations

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| over the whole tensor, in float64 on the CPU.

    The floor on the denominator only matters when ref is exactly zero: then any nonzero
    `out` gives a huge error and an exact zero gives 0.
    """
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
