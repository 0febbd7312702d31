"""Which parameters of our decoder Muon orthogonalizes, and in which blocks (SPEC §8).

Per head (``H`` heads; ``hd`` = that projection's per-head width):

==========================  ==================  =======================================
module / weight             shape               blocks
==========================  ==================  =======================================
KDA ``wq wk wv w_gate``     ``[H*hd, dim]``     rows, one ``[hd, dim]`` block per head
KDA ``w_f_up``              ``[H*hd, hd]``      rows, per head (per-channel decay)
KDA ``wo``                  ``[dim, H*hd]``     columns, one ``[dim, hd]`` per head
MLA ``w_uq``                ``[H*(n+s), r_q]``  rows, per head (nope + shared query dims)
MLA ``w_ukv``               ``[H*(n+v), r_kv]`` rows, per head (its key and value rows)
MLA ``w_g``                 ``[H*v, dim]``      rows, per head
MLA ``w_o``                 ``[dim, H*v]``      columns, per head
routed experts              ``[E, a, b]``       one block per expert (both weights)
==========================  ==================  =======================================

Whole matrices (one block): the shared low-rank projections (KDA ``w_f_down``, ``w_beta``;
MLA ``w_dq``, ``w_dkv``), the dense and shared-expert SiTU-GLU weights, the latent
``w_latent_down``/``w_latent_up``. AdamW, as Muon recipes do: the token embedding, the
output head, the router, every vector (norm weights, AttnRes queries, ``A_log``,
``dt_bias``) and the KDA short-convolution filters (per-channel filters, not a map between
feature spaces). Weight decay: everything except :func:`no_weight_decay` parameters.
"""

from __future__ import annotations

import re

from torch import nn

from titan_moe.model.kda import KimiDeltaAttention
from titan_moe.model.mla import GatedMLA
from titan_moe.model.moe import RoutedExperts, TopKRouter
from titan_moe.optim.muon import COLS, EXPERTS, ROWS, WHOLE

_WRAPPERS = re.compile(r"(_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module)\.")


def no_weight_decay(name: str, param) -> bool:
    """SPEC §1: no decay on the KDA decay parameters; none on vectors (norm weights, AttnRes
    queries) either, as usual for AdamW."""
    return name.endswith(("A_log", "dt_bias")) or param.ndim < 2


def _head_blocks(module: nn.Module) -> dict[str, tuple[int, int]]:
    """{weight attribute path: (block_dim, block_size)} of the per-head matrices of an attention module."""
    if isinstance(module, KimiDeltaAttention):
        hd = module.head_dim
        rows = {f"{w}.weight": (ROWS, hd) for w in ("wq", "wk", "wv", "w_gate", "w_f_up")}
        return {**rows, "wo.weight": (COLS, hd)}
    if isinstance(module, GatedMLA):
        return {
            "w_uq.weight": (ROWS, module.qk_head_dim),
            "w_ukv.weight": (ROWS, module.qk_nope_dim + module.v_head_dim),
            "w_g.weight": (ROWS, module.v_head_dim),
            "w_o.weight": (COLS, module.v_head_dim),
        }
    return {}


def block_layout(model: nn.Module) -> dict[str, tuple[int, int] | None]:
    """{parameter name: (block_dim, block_size)} for Muon parameters, None for AdamW ones."""
    layout: dict[str, tuple[int, int] | None] = {}
    special: dict[int, tuple[int, int] | None] = {}
    for module in model.modules():
        if isinstance(module, (KimiDeltaAttention, GatedMLA)):
            for path, spec in _head_blocks(module).items():
                special[id(module.get_parameter(path))] = spec
        elif isinstance(module, RoutedExperts):
            for p in module.parameters(recurse=False):
                special[id(p)] = (EXPERTS, 1)
        elif isinstance(module, (TopKRouter, nn.Embedding)):
            for p in module.parameters(recurse=False):
                special[id(p)] = None
    for name, p in model.named_parameters():
        clean = _WRAPPERS.sub("", name)
        if id(p) in special:
            layout[name] = special[id(p)]
        elif p.ndim == 2 and clean != "output.weight" and not clean.endswith("conv_weight"):
            layout[name] = (WHOLE, 0)
        elif p.ndim <= 2:
            layout[name] = None
        else:
            raise ValueError(f"Muon: no block layout for the {p.ndim}-D parameter {name}")
    return layout


def muon_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Parameter groups for :class:`titan_moe.optim.muon.Muon`: one per Muon block layout,
    plus AdamW groups with and without weight decay. Empty groups are left out."""
    groups: dict[tuple, dict] = {}
    layout = block_layout(model)
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        spec = layout[name]
        if spec is not None:
            key = ("muon", *spec)
            group = groups.setdefault(key, {"params": [], "muon": True, "block_dim": spec[0],
                                            "block_size": spec[1], "weight_decay": weight_decay})
        else:
            decay = 0.0 if no_weight_decay(name, p) else weight_decay
            group = groups.setdefault(("adamw", decay), {"params": [], "muon": False, "weight_decay": decay})
        group["params"].append(p)
    return list(groups.values())
