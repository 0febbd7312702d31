"""Optimizers beyond torchtitan's Adam/AdamW: per-head Muon (SPEC §8)."""

from titan_moe.optim.muon import Muon
from titan_moe.optim.param_groups import block_layout, muon_param_groups, no_weight_decay

__all__ = ["Muon", "block_layout", "muon_param_groups", "no_weight_decay"]
