"""Muon with orthogonalized updates per block (per attention head, per expert), and AdamW for
the rest, in one ``torch.optim.Optimizer`` (SPEC §8).

One optimizer holds two kinds of parameter group:

* Muon groups (``group["muon"]`` True). Each parameter is cut into independent 2-D blocks
  and every block gets its own Newton–Schulz orthogonalization, exactly what
  ``torch.optim.Muon`` does to one 2-D matrix::

      B  <- mu B + (1 - mu) g                      (momentum buffer, whole parameter)
      U  =  g + mu (B - g)                         (Nesterov, as torch.optim.Muon)
      O_b = NS5(U_b)                               per block b (bf16, 5 quintic steps)
      p  <- p (1 - lr wd) - lr * 0.2 sqrt(max(m_b, n_b)) * O_b

  The block layout is given per group by two integers:

  - ``block_dim = -1``: the whole 2-D matrix is one block (plain Muon);
  - ``block_dim = 0``: rows in blocks of ``block_size`` (a ``[H*hd, in]`` projection whose
    output is split by head: one block per head);
  - ``block_dim = 1``: columns in blocks of ``block_size`` (a ``[out, H*hd]`` output
    projection whose input is split by head);
  - ``block_dim = -2``: a 3-D ``[E, a, b]`` stack of experts, one ``[a, b]`` block each.

* AdamW groups (``group["muon"]`` False): torch's AdamW update, decoupled weight decay.

Learning rate. Muon's update has singular values near 1, so an ``m x n`` block's update has
RMS ``1/sqrt(max(m, n))``. We scale each block by ``0.2 sqrt(max(m, n))`` (Moonshot's
"Muon is Scalable for LLM Training", ``adjust_lr_fn="match_rms_adamw"`` in torch): every
update then has RMS 0.2, about what AdamW's updates have, so one learning rate and one
weight decay (the AdamW ones of ``[optimizer]``) serve both kinds of group and the config's
LR schedule and LR sweeps carry over unchanged. The factor uses the block's shape, not the
whole matrix's: a head block is what is orthogonalized, so its shape sets the RMS. (Keller
Jordan's original ``sqrt(max(1, m/n))`` would need a separate, ~10-50x larger Muon LR.)

Sharded parameters (FSDP2, expert parallelism). Parameters may be DTensors. The momentum
buffer and the AdamW moments are elementwise and stay sharded like the parameter. For the
orthogonalization, a block must be whole on one rank:

* when the parameter is sharded on dim 0 only (FSDP2's ``Shard(0)``, EP's ``Shard(0)`` over
  experts, FSDP2's ``_StridedShard(0)`` over EP's experts) and the local shard starts and
  ends on block boundaries (rows per rank a multiple of the head size; experts are always
  whole along dim 0), each rank orthogonalizes its own blocks, with no communication;
* experts that FSDP2 shards on dim 1 (``efsdp x ep > E``): the update is gathered over the
  FSDP ranks only, so each rank orthogonalizes its E/ep expert-parallel experts;
* otherwise (column blocks such as ``wo``, whole-matrix blocks, a shard boundary inside a
  head) the update is all-gathered (``full_tensor``), every rank orthogonalizes all blocks
  of that parameter (redundantly) and keeps its own shard. That costs one all-gather of the
  parameter's size per step and a world-size-fold repeat of its NS work; it is the simple,
  exact choice, not the fast one (Moonlight's distributed Muon assigns each whole matrix
  to one rank instead).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, torch.optim.Muon's default
NS_STEPS = 5
NS_EPS = 1e-7
MOMENTUM = 0.95
RMS_MATCH = 0.2  # update RMS of every Muon block (Moonshot's AdamW-matching factor)

WHOLE, ROWS, COLS, EXPERTS = -1, 0, 1, -2


def zeropower_newton_schulz(G_Bmn: Tensor, steps: int = NS_STEPS, eps: float = NS_EPS,
                            coefficients: tuple[float, float, float] = NS_COEFFICIENTS) -> Tensor:
    """Orthogonalize every ``[m, n]`` matrix of ``G_Bmn`` [B, m, n] independently, in bf16,
    with the same operations as ``torch.optim.Muon`` applies to one matrix. Returns bf16."""
    a, b, c = coefficients
    X = G_Bmn.bfloat16()
    tall = G_Bmn.shape[-2] > G_Bmn.shape[-1]
    if tall:
        X = X.mT
    X = X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a)
    return X.mT if tall else X


def to_blocks(x: Tensor, block_dim: int, block_size: int) -> Tensor:
    """The blocks of a 2-D (or, for experts, 3-D) tensor as a [B, m, n] tensor (a copy for columns)."""
    if block_dim == EXPERTS:
        if x.dim() != 3:
            raise ValueError(f"expert blocks need a 3-D [E, a, b] tensor, got {tuple(x.shape)}")
        return x
    if x.dim() != 2:
        raise ValueError(f"Muon blocks need a 2-D tensor, got {tuple(x.shape)}")
    m, n = x.shape
    if block_dim == WHOLE:
        return x.unsqueeze(0)
    if block_dim == ROWS:
        if m % block_size:
            raise ValueError(f"{m} rows do not split into blocks of {block_size}")
        return x.view(m // block_size, block_size, n)
    if block_dim == COLS:
        if n % block_size:
            raise ValueError(f"{n} columns do not split into blocks of {block_size}")
        return x.view(m, n // block_size, block_size).transpose(0, 1)
    raise ValueError(f"unknown block_dim {block_dim}")


def from_blocks(blocks_Bmn: Tensor, shape: torch.Size, block_dim: int) -> Tensor:
    """Inverse of :func:`to_blocks`."""
    if block_dim == COLS:
        return blocks_Bmn.transpose(0, 1).reshape(shape)
    return blocks_Bmn.reshape(shape)


def block_update(update: Tensor, block_dim: int, block_size: int) -> Tensor:
    """Orthogonalized update, each block scaled to RMS ``RMS_MATCH``; same shape, bf16."""
    blocks = to_blocks(update, block_dim, block_size)
    m, n = blocks.shape[-2:]
    ortho = zeropower_newton_schulz(blocks) * (RMS_MATCH * math.sqrt(max(m, n)))
    return from_blocks(ortho, update.shape, block_dim)


def _shards_dim0(pl) -> bool:
    """A placement that cuts dim 0 only: ``Shard(0)``, or FSDP2's ``_StridedShard`` on dim 0
    (FSDP over expert-parallel experts), a subclass of ``Shard``."""
    return isinstance(pl, Shard) and pl.dim == 0


def _local_blocks_whole(p: DTensor, block_dim: int, block_size: int) -> bool:
    """Whether every block of ``p`` lies whole in this rank's shard (dim-0 sharding aligned to blocks)."""
    if block_dim not in (ROWS, EXPERTS):
        return all(isinstance(pl, Replicate) for pl in p.placements)
    if block_dim == EXPERTS:  # any cut of the expert dim leaves whole experts
        return all(isinstance(pl, Replicate) or _shards_dim0(pl) for pl in p.placements)
    if not all(isinstance(pl, Replicate) or (type(pl) is Shard and pl.dim == 0) for pl in p.placements):
        return False
    local_shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return offset[0] % block_size == 0 and local_shape[0] % block_size == 0


def _gathered_placements(p: DTensor, block_dim: int) -> list:
    """The placements the update is redistributed to when its blocks are cut: experts keep
    their ``Shard(0)`` (expert-parallel) cuts and gather the rest (FSDP's ``Shard(1)``), so a
    rank orthogonalizes its own E/ep experts, not the layer's E; other blocks gather whole."""
    if block_dim == EXPERTS:
        return [pl if type(pl) is Shard and pl.dim == 0 else Replicate() for pl in p.placements]
    return [Replicate()] * p.device_mesh.ndim


class Muon(torch.optim.Optimizer):
    """Per-block Muon for the groups marked ``muon`` and AdamW for the others (module docstring).

    Args:
        params: parameter groups; Muon groups carry ``muon=True``, ``block_dim`` and
            ``block_size`` (see the module docstring); others are AdamW groups.
        lr, weight_decay: shared by both kinds (Muon's per-block RMS matching makes that valid).
        momentum: Muon's momentum (Nesterov).
        betas, eps: AdamW's.
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = MOMENTUM,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8):
        if lr < 0 or weight_decay < 0 or not 0 <= momentum < 1:
            raise ValueError(f"Muon: need lr >= 0, weight_decay >= 0, 0 <= momentum < 1; got {lr}, "
                             f"{weight_decay}, {momentum}")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, betas=betas, eps=eps,
                        muon=False, block_dim=WHOLE, block_size=0)
        super().__init__(params, defaults)
        for group in self.param_groups:
            if not group["muon"]:
                continue
            for p in group["params"]:
                to_blocks(torch.empty(p.shape, device="meta"), group["block_dim"], group["block_size"])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["muon"]:
                self._muon_group(group)
            else:
                self._adamw_group(group)
        return loss

    def _muon_group(self, group: dict[str, Any]) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        block_dim, block_size = group["block_dim"], group["block_size"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - mu)
            update = p.grad.lerp(buf, mu)
            if isinstance(p, DTensor):
                if _local_blocks_whole(p, block_dim, block_size):
                    ortho_local = block_update(update.to_local(), block_dim, block_size)
                else:
                    mesh = p.device_mesh
                    kept = _gathered_placements(p, block_dim)
                    part = block_update(update.redistribute(mesh, kept).to_local(), block_dim, block_size)
                    ortho_local = DTensor.from_local(
                        part, mesh, kept, run_check=False, shape=p.shape, stride=p.stride()
                    ).redistribute(mesh, p.placements).to_local()
                target = p.to_local()
            else:
                ortho_local, target = block_update(update, block_dim, block_size), p
            target.mul_(1 - lr * wd)
            target.add_(ortho_local.to(target.dtype), alpha=-lr)

    def _adamw_group(self, group: dict[str, Any]) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            grad, state = p.grad, self.state[p]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            step = state["step"].item()
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            p.mul_(1 - lr * wd)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            bias1, bias2 = 1 - beta1**step, 1 - beta2**step
            denom = (exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(eps)
            p.addcdiv_(exp_avg, denom, value=-lr / bias1)
