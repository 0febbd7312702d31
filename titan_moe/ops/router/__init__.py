"""Fused sigmoid router top-k (``titan_moe::router_topk`` custom op) and its plain-PyTorch reference."""

from titan_moe.ops.router.op import router_topk
from titan_moe.ops.router.reference import (
    ranking_key,
    router_topk_backward_torch,
    router_topk_torch,
    topk_indices,
)

__all__ = ["router_topk", "router_topk_torch", "router_topk_backward_torch", "ranking_key", "topk_indices"]
