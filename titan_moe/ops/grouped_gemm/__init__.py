"""Grouped expert GEMM (``titan_moe::grouped_mm`` custom ops) and its plain-PyTorch reference."""

from titan_moe.ops.grouped_gemm.op import grouped_mm
from titan_moe.ops.grouped_gemm.reference import grouped_mm_dw_reference, grouped_mm_reference

__all__ = ["grouped_mm", "grouped_mm_reference", "grouped_mm_dw_reference"]
