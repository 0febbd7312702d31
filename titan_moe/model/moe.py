"""Sparse MoE feed-forward: sigmoid router with a per-expert bias and quantile balancing
(SPEC §5), and the Stable LatentMoE block with SiTU-GLU experts (SPEC §6).

Routing (no auxiliary loss)::

    s_ij = sigmoid(w_j^T x_i)                 full-width x, fp32
    T_i  = top-k_j (s_ij + b_j)               b: fp32 buffer `expert_bias`, never trained
    p_ij = routed_scale * s_ij / Σ_{r∈T_i} s_ir   (b never enters p)

The persistent bias ``expert_bias`` changes once per optimizer step, outside autograd, in
:func:`update_expert_biases`. Quantile balancing (QB) sets every expert's bias to the
value at which it would have won exactly its share ``q = m*k/n`` of ``m`` tokens, given
the other experts' biases:

* ``alpha_ij`` = k-th largest biased score of token i among the experts other than j
  (the (k+1)-th largest overall when j is in T_i, else the k-th largest);
* ``r_ij = alpha_ij - s_ij``: expert j wins token i iff ``b_j > r_ij``;
* ``b_j`` = the value with exactly ``q`` of the ``r_ij`` below it, then ``b -= mean(b)``.

When that bias applies (``ModelArgs.qb_batch_iters``):

* 0 (lag): the bias fitted to one optimizer step's tokens routes the next step's;
* N > 0 (in-batch, the GPU flavors' form): in training, each forward routes its tokens with
  the bias fitted to those same tokens (N passes of the quantile above, starting from
  ``expert_bias``, before the top-k); ``expert_bias`` becomes the (``qb_ema``) average of
  those biases and is what eval mode routes with. A token's route then depends on the other
  tokens of its batch (later positions included) during training; at inference it does not.

At scale the quantile comes from a histogram of ``r`` over ``[min b - 1, max b + 1]``
(``r`` always lies inside: scores are in (0, 1)), whose integer counts are all-reduced
across data-parallel ranks. The DeepSeek-V3 rule ``b_j += γ sign(mean load - load_j)``
is kept as the baseline.

``ModelArgs.balance_rule = "aux_loss"`` replaces the bias by the Switch/GShard auxiliary
load-balancing loss (:func:`aux_balance_loss`, for ablation): the bias stays zero and each
training forward adds ``aux_loss_coef * E * Σ_e f_e P_e`` to the objective through
:class:`AddAuxiliaryLoss`, which leaves the forward's values (and so the loss the trainer
computes and logs) unchanged and gives the router the term's gradient.
"""

from __future__ import annotations

import contextlib
import re
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from titan_moe.model.args import ModelArgs
from titan_moe.model.ffn import SiTUGLUFeedForward
from titan_moe.model.situ import check_glu_activation, glu_packed
from titan_moe.model.weight_cache import CachedCast, WeightCacheMixin
from titan_moe.ops.dispatch import aligned_positions, combine_copies, scatter_copies, sorted_positions
from titan_moe.ops.grouped_gemm import grouped_mm
from titan_moe.ops.nvtx import nvtx_range


def _trunc_normal_(weight: Tensor, std: float) -> None:
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


# =========================================================================== routing
def route(scores_Nn: Tensor, bias_n: Tensor, top_k: int, routed_scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """Top-k selection on biased scores, weights from the unbiased ones.

    Args:
        scores_Nn: [N, n] fp32 sigmoid scores.
        bias_n: [n] per-expert bias (only moves the selection).
        top_k: experts per token.
        routed_scale: factor applied to the normalised weights.

    Returns:
        expert_idx_Nk [N, k] int64 (by decreasing biased score) and weights_Nk [N, k] fp32.
    """
    expert_idx_Nk = torch.topk(scores_Nn + bias_n.float(), top_k, dim=-1).indices
    selected_Nk = scores_Nn.gather(-1, expert_idx_Nk)
    weights_Nk = selected_Nk / selected_Nk.sum(-1, keepdim=True) * routed_scale
    return expert_idx_Nk, weights_Nk


class TopKRouter(nn.Module):
    """Sigmoid router over ``n_experts`` on full-width tokens (SPEC §5)."""

    def __init__(self, dim: int, n_experts: int, top_k: int, routed_scale: float = 1.0):
        super().__init__()
        if not 0 < top_k <= n_experts:
            raise ValueError(f"TopKRouter: need 0 < top_k <= n_experts, got {top_k}, {n_experts}")
        self.n_experts, self.top_k, self.routed_scale = n_experts, top_k, routed_scale
        self.weight = nn.Parameter(torch.empty(n_experts, dim))

    def scores(self, x_ND: Tensor) -> Tensor:
        """x_ND [N, dim] -> sigmoid scores [N, n] fp32."""
        return torch.sigmoid(F.linear(x_ND.float(), self.weight.float()))

    def forward(self, x_ND: Tensor, bias_n: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x_ND [N, dim], bias_n [n] -> scores_Nn [N, n] fp32, expert_idx_Nk [N, k], weights_Nk [N, k] fp32."""
        scores_Nn = self.scores(x_ND)
        expert_idx_Nk, weights_Nk = route(scores_Nn, bias_n, self.top_k, self.routed_scale)
        return scores_Nn, expert_idx_Nk, weights_Nk

    @torch.no_grad()
    def init_weights(self, init_std: float = 0.02) -> None:
        _trunc_normal_(self.weight, init_std)


# =========================================================================== balancing
def expert_counts(expert_idx: Tensor, n_experts: int) -> Tensor:
    """Tokens routed to each expert: [n] int64 from expert ids of any shape (static shape, no sync)."""
    flat = expert_idx.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )


def cutoff_margins(scores_mn: Tensor, bias_n: Tensor, top_k: int) -> Tensor:
    """``r_ij = alpha_ij - s_ij``, the bias expert j needs to win token i. [m, n] fp32.

    ``alpha_ij`` is the k-th largest biased score among the experts other than j. Needs
    ``top_k < n``.
    """
    m, n = scores_mn.shape
    if not 0 < top_k < n:
        raise ValueError(f"cutoff_margins: need 0 < top_k < n_experts, got top_k={top_k}, n={n}")
    scores_mn = scores_mn.float()
    top_vals_mk1, top_idx_mk1 = torch.topk(scores_mn + bias_n.float(), top_k + 1, dim=-1)
    selected_mn = torch.zeros_like(scores_mn, dtype=torch.bool).scatter_(1, top_idx_mk1[:, :top_k], True)
    alpha_mn = torch.where(selected_mn, top_vals_mk1[:, top_k : top_k + 1], top_vals_mk1[:, top_k - 1 : top_k])
    return alpha_mn - scores_mn


def exact_quantiles(r_mn: Tensor, top_k: int) -> Tensor:
    """Per expert, the value with exactly ``q = round(m*k/n)`` of its ``r`` below it. [n] fp32 (not centred).

    It is the midpoint of the q-th and (q+1)-th smallest ``r``; outside the data (q = 0 or
    q = m) it sits 0.5 beyond the extreme value.
    """
    m, n = r_mn.shape
    q = min(max(round(m * top_k / n), 0), m)
    sorted_mn = torch.sort(r_mn, dim=0).values
    padded = torch.cat([sorted_mn[:1] - 1.0, sorted_mn, sorted_mn[-1:] + 1.0])
    return 0.5 * (padded[q] + padded[q + 1])


def qb_bin_range(bias_n: Tensor) -> tuple[Tensor, Tensor]:
    """Histogram range ``[min b - 1, max b + 1]`` as 0-d fp32 tensors.

    It depends only on the (replicated) bias, so every rank bins identically.
    """
    bias_n = bias_n.float()
    return bias_n.min() - 1.0, bias_n.max() + 1.0


def qb_histogram(scores_mn: Tensor, bias_n: Tensor, top_k: int, bins: int) -> Tensor:
    """Counts of ``r_ij`` per expert in ``bins`` equal bins over :func:`qb_bin_range`. [n, bins] int64.

    A NaN margin (NaN scores or bias: a diverged run, or the meaningless weights of a run on
    torch's fake process group) counts in bin 0: NaN has no integer value, and its cast
    would index outside the histogram."""
    if bins <= 0:
        raise ValueError(f"qb_histogram: bins must be > 0, got {bins}")
    n = scores_mn.shape[1]
    r_mn = cutoff_margins(scores_mn, bias_n, top_k)
    lo, hi = qb_bin_range(bias_n)
    bin_mn = ((r_mn - lo) * (bins / (hi - lo))).floor().nan_to_num(0.0).clamp(0, bins - 1).to(torch.int64)
    flat = (bin_mn + torch.arange(n, device=r_mn.device) * bins).reshape(-1)
    counts = torch.zeros(n * bins, dtype=torch.int64, device=r_mn.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat)).view(n, bins)


def histogram_quantiles(counts_nB: Tensor, bias_n: Tensor, top_k: int) -> Tensor:
    """Per-expert quantile ``q = total*k/n`` read from a histogram. [n] fp32 (not centred).

    The first bin whose cumulative count reaches ``q``, linearly interpolated inside it:
    at most one bin width from the exact quantile. ``total`` is each expert's count sum
    (the step's token count), so counting every token twice, as an activation
    checkpointing recompute does, leaves the result unchanged.
    """
    n, bins = counts_nB.shape
    lo, hi = qb_bin_range(bias_n)
    width = (hi - lo).double() / bins
    counts = counts_nB.double()
    q_n1 = counts.sum(-1, keepdim=True) * top_k / n
    cum_nB = counts.cumsum(-1)
    first_n1 = (cum_nB < q_n1).sum(-1, keepdim=True).clamp(max=bins - 1)
    in_bin_n1 = counts.gather(-1, first_n1)
    before_n1 = cum_nB.gather(-1, first_n1) - in_bin_n1
    frac_n1 = ((q_n1 - before_n1) / in_bin_n1.clamp_min(1.0)).clamp(0.0, 1.0)
    return (lo.double() + width * (first_n1 + frac_n1)).squeeze(-1).float()


def sign_balance(load_n: Tensor, bias_n: Tensor, gamma: float) -> Tensor:
    """DeepSeek-V3 rule: ``b_j + gamma * sign(mean load - load_j)`` (not centred). [n] fp32."""
    load = load_n.double()
    return bias_n.float() + gamma * torch.sign(load.mean() - load).float()


def _all_gather_rows(x_mn: Tensor, group) -> Tensor:
    """Concatenate every rank's [m, n] rows (all ranks must hold the same m)."""
    world = dist.get_world_size(group)
    out = x_mn.new_empty(world * x_mn.shape[0], *x_mn.shape[1:])
    dist.all_gather_into_tensor(out, x_mn.contiguous(), group=group)
    return out


def _check_group(group) -> None:
    if group is not None and not (dist.is_available() and dist.is_initialized()):
        raise ValueError("a process group was given but torch.distributed is not initialized")


def quantile_balance(scores: Tensor, bias: Tensor, top_k: int, bins: int | None = None, group=None) -> Tensor:
    """New expert bias from one step's router scores by quantile balancing (SPEC §5).

    Args:
        scores: [m, n] fp32 sigmoid scores of this step's (local) tokens.
        bias: [n] current bias (the one these scores were routed with).
        top_k: experts per token (< n; with top_k == n every bias routes alike and
            zeros are returned).
        bins: None or 0 for the exact quantile; else the histogram resolution.
        group: optional process group. Exact mode all-gathers the scores over it (every
            rank must hold the same m); histogram mode all-reduces the integer counts.

    Returns:
        [n] fp32 bias, centred to mean zero, identical on every rank of ``group``.
    """
    if scores.dim() != 2 or bias.shape != (scores.shape[1],):
        raise ValueError(
            f"quantile_balance: expected scores [m, n], bias [n]; got {tuple(scores.shape)}, {tuple(bias.shape)}"
        )
    _check_group(group)
    n = scores.shape[1]
    if top_k == n:
        return torch.zeros_like(bias, dtype=torch.float32)
    if bins:
        counts_nB = qb_histogram(scores, bias, top_k, bins)
        if group is not None:
            dist.all_reduce(counts_nB, group=group)
        new_bias = histogram_quantiles(counts_nB, bias, top_k)
    else:
        r_mn = cutoff_margins(scores, bias, top_k)
        if group is not None:
            r_mn = _all_gather_rows(r_mn, group)
        new_bias = exact_quantiles(r_mn, top_k)
    return new_bias - new_bias.mean()


def aux_balance_loss(scores_Nn: Tensor, counts_E: Tensor, top_k: int) -> Tensor:
    """The auxiliary load-balancing loss ``E * Σ_e f_e P_e`` of one forward's tokens. 0-d fp32.

    ``f_e = counts_E[e] / (N k)``: the fraction of the ``N * k`` routed token copies sent to
    expert e (from the top-k, no gradient); ``P_e = mean_i s_ie / Σ_j s_ij``: expert e's mean
    router probability, the sigmoid scores normalised over all experts per token (as
    DeepSeek-V3 does for its sigmoid router). Both sum to 1, so the loss is 1 for uniform
    routing and at most E; it is differentiable in ``scores_Nn`` [N, E] through ``P``.
    """
    N, E = scores_Nn.shape
    f_E = counts_E.float() / max(N * top_k, 1)
    P_E = (scores_Nn.float() / scores_Nn.float().sum(-1, keepdim=True)).mean(0)
    return E * (f_E * P_E).sum()


class AddAuxiliaryLoss(torch.autograd.Function):
    """``x`` unchanged; the backward also gives ``aux`` (0-d) the gradient ``scale`` (0-d), as if
    ``scale * aux`` were added to the loss (DeepSeek-MoE's ``AddAuxiliaryLoss``).

    Attached to the routing weights, which every path from the router to the loss goes through,
    so it needs no side channel past the layer's output: it works inside compiled regions and
    activation checkpointing like any op, and the loss value stays the cross-entropy."""

    @staticmethod
    def forward(ctx, x: Tensor, aux: Tensor, scale: Tensor) -> Tensor:
        ctx.save_for_backward(scale)
        return x.clone()

    @staticmethod
    def backward(ctx, grad_x: Tensor):
        (scale,) = ctx.saved_tensors
        return grad_x, scale.float(), None


def load_metrics(load_n: Tensor) -> tuple[Tensor, Tensor]:
    """``max_violation = max load / mean load - 1`` and the number of experts with no token."""
    load = load_n.double()
    return load.max() / load.mean().clamp_min(1e-12) - 1.0, (load_n == 0).sum()


# =========================================================================== LatentMoE
def _in_dtype(weight: Tensor, cached: Tensor | None, dtype: torch.dtype) -> Tensor:
    """``weight.to(dtype)``, from ``cached`` (that cast, made beforehand) when it matches."""
    if cached is not None and cached.dtype == dtype and weight.dtype != dtype:
        return CachedCast.apply(weight, cached)
    return weight.to(dtype)


def refresh_compute_weights(model: nn.Module | list[nn.Module], dtype: torch.dtype) -> int:
    """`RoutedExperts.refresh_compute_weights` on every such module of ``model`` (or of each
    model part); returns how many made a cache."""
    parts = model if isinstance(model, (list, tuple)) else [model]
    return sum(m.refresh_compute_weights(dtype) for part in parts for m in part.modules()
               if isinstance(m, RoutedExperts))


class RoutedExperts(WeightCacheMixin, nn.Module):
    """``n`` SiTU-GLU experts ``latent -> hidden -> latent`` as stacked weights (expert dim 0);
    SwiGLU experts with ``activation = "swiglu"`` (``ModelArgs.expert_activation``).

    ``w_gate_up`` [E, latent, 2*hidden] (gate columns first, then up) and ``w_down``
    [E, hidden, latent] are laid out ``[E, K, N]`` for :func:`grouped_mm`.

    Under expert parallelism (applied from outside, see ``titan_moe.parallelize``) both are
    DTensors sharded on the expert dim: ``forward`` then runs this rank's ``E_local`` experts
    on the tokens the parallel style dispatched to them, and ``offs_E`` has ``E_local``
    entries.

    ``group_alignment``: the row multiple at which the experts want each group to start
    (1: anywhere). :class:`LatentMoE` lays its sorted copies out that way and passes
    ``groups_aligned=True``, except under expert parallelism (``expert_parallel``, set by
    the parallel style), whose exchange regroups the rows.

    Under autocast the fp32 weights are cast to the compute dtype in every forward (and
    activation-checkpoint recompute); :meth:`refresh_compute_weights` (the trainer calls it
    after every optimizer step, ``[training] cache_compute_weights``) makes those casts once
    per step instead: the same values, so the same results (`titan_moe.model.weight_cache`).
    """

    group_alignment = 1
    expert_parallel = False

    def __init__(self, n_experts: int, latent: int, hidden: int, beta1: float, beta2: float,
                 activation: str = "situ"):
        super().__init__()
        check_glu_activation(activation)
        self.n_experts, self.hidden = n_experts, hidden
        self.beta1, self.beta2, self.activation = beta1, beta2, activation
        self.w_gate_up = nn.Parameter(torch.empty(n_experts, latent, 2 * hidden))
        self.w_down = nn.Parameter(torch.empty(n_experts, hidden, latent))

    def forward(self, x_ML: Tensor, offs_E: Tensor, groups_aligned: bool = False) -> Tensor:
        """x_ML [M, latent] sorted by expert, offs_E [E] int32 cumulative ends -> [M, latent].

        ``groups_aligned`` (the groups start at multiples of ``group_alignment``) changes
        nothing here: any group sizes work."""
        w_gate_up, w_down = self.local_weights()
        # Under autocast the activations arrive in bf16 while the weights stay fp32; a custom
        # op is not autocast-aware, so cast the weights the way autocast would for a matmul
        # (or take the casts made once per step).
        cached = self._valid_weight_cache() or (None, None)
        z_M2H = grouped_mm(x_ML, _in_dtype(w_gate_up, cached[0], x_ML.dtype), offs_E)
        hidden_MH = glu_packed(z_M2H, self.activation, self.beta1, self.beta2)
        return grouped_mm(hidden_MH, _in_dtype(w_down, cached[1], hidden_MH.dtype), offs_E)

    def _cache_sources(self) -> tuple[Tensor, Tensor]:
        return self.w_gate_up, self.w_down

    def refresh_compute_weights(self, dtype: torch.dtype) -> bool:
        """Cast both weights to ``dtype`` now, for the forwards until they change. Returns
        whether a cache was made (False, with none kept, for DTensor or meta weights or
        weights already in ``dtype``)."""
        self._store_weight_cache(None)
        weights = self._cache_sources()
        if any(isinstance(w, DTensor) or w.device.type == "meta" or w.dtype == dtype for w in weights):
            return False
        with torch.no_grad():
            self._store_weight_cache(tuple(w.detach().to(dtype) for w in weights))
        return True

    def local_weights(self) -> tuple[Tensor, Tensor]:
        """(w_gate_up, w_down) of the experts held by this rank, as plain tensors.

        DTensor weights (expert parallelism) become their local shard, ``[E_local, ...]``:
        the dispatched tokens have a data-dependent count that a DTensor cannot express,
        and the gradient flows back into the DTensor through ``to_local``.
        """
        w_gate_up, w_down = self.w_gate_up, self.w_down
        if isinstance(w_gate_up, DTensor):
            w_gate_up = w_gate_up.to_local()
        if isinstance(w_down, DTensor):
            w_down = w_down.to_local()
        return w_gate_up, w_down

    @torch.no_grad()
    def init_weights(self, init_std: float = 0.02) -> None:
        _trunc_normal_(self.w_gate_up, init_std)
        _trunc_normal_(self.w_down, init_std)


class LatentMoE(nn.Module):
    """Stable LatentMoE block (SPEC §6)::

        u = Σ_{i∈T} p_i E_i(W_down x)            routed SiTU-GLU experts in the latent width
        y = Σ_j E_shared_j(x) + W_up RMSNorm(u)   shared experts at full width

    The ``n_shared_experts`` shared experts are held as one :class:`SiTUGLUFeedForward`
    of hidden width ``n_shared_experts * moe_shared_hidden``: a sum of SiTU-GLU experts
    equals one SiTU-GLU with their hidden units concatenated (the activation is
    elementwise), so this is the same function with fewer launches.

    Balancing state, accumulated by ``forward`` in training mode only (outside autograd):

    * ``tokens_per_expert`` [n] int64: tokens routed per expert this step (metrics and
      the sign rule);
    * ``qb_counts`` [n, qb_bins] int64 (QB with ``qb_bins > 0``): histogram of ``r_ij``
      over the bin range of the current bias, which stays fixed until the step ends;
    * in-batch QB (``qb_batch_iters > 0``): ``qb_batch_bias_sum`` [n] fp32 and
      ``qb_batch_count`` (0-d int64), the sum and number of the biases each forward routed
      with (fitted over ``balance_group``, the data-parallel group the trainer sets, so every
      rank routes with the bias of the whole global microbatch); no histogram kept;
    * exact QB (``qb_bins == 0``) keeps the latest microbatch's scores as the plain
      attribute ``step_scores`` ([N, n] fp32; replaced, not accumulated, each forward, so
      its size is one microbatch's ``N x n``; with a process group the update
      all-gathers it, so every rank must use the same ``N``). Exact mode is meant for
      small configs; at scale use ``qb_bins > 0`` (SPEC: 1000);
    * auxiliary loss (``balance_rule = "aux_loss"``): ``aux_loss_sum`` (0-d fp32) and
      ``aux_loss_count`` (0-d int64), the sum and number of the forwards' loss values (for the
      metrics). ``aux_loss_weight`` (0-d fp32, 1 unless the trainer sets it,
      :func:`set_aux_loss_weight`) is this forward's share of the step's objective: the
      gradient ``aux`` receives is ``aux_loss_coef * aux_loss_weight``.

    An activation-checkpointing recompute adds each microbatch twice; the QB quantile, the
    load ratios and the mean auxiliary loss are invariant to that. ``expert_bias`` is only
    changed by :func:`update_expert_biases`; in eval mode nothing is accumulated, except the
    routed-token counts inside :func:`recording_eval_load` (held-out balance, frozen bias).
    ``expert_bias`` must stay fp32: cast parameters, not the whole module, to bf16.

    ``token_tile`` (``ModelArgs.moe_token_tile``, 0: off): a forward of more tokens runs them
    in tiles, each under its own activation checkpoint (:meth:`forward_tiles`), with the same
    results and statistics; the backward then holds one tile's MoE activations at a time.
    """

    # Non-persistent buffers that only training reads or writes (the balance statistics);
    # inference programs are exported without them (titan_moe.export.programs).
    TRAINING_STATS = ("tokens_per_expert", "qb_counts", "qb_batch_bias_sum", "qb_batch_count",
                      "aux_loss_weight", "aux_loss_sum", "aux_loss_count")

    def __init__(self, args: ModelArgs):
        super().__init__()
        if args.n_shared_experts < 0:
            raise ValueError(f"LatentMoE: n_shared_experts must be >= 0, got {args.n_shared_experts}")
        if args.n_shared_experts > 0 and args.moe_shared_hidden <= 0:
            raise ValueError(f"LatentMoE: moe_shared_hidden must be > 0, got {args.moe_shared_hidden}")
        self.dim, self.latent = args.dim, args.moe_latent_dim
        self.n_experts, self.top_k = args.n_routed_experts, args.top_k
        self.norm_eps = args.norm_eps
        self.balance_rule, self.qb_bins = args.balance_rule, args.qb_bins
        self.qb_ema, self.sign_gamma = args.qb_ema, args.sign_gamma
        self.qb_batch_iters = args.qb_batch_iters
        self.aux_loss_coef = args.aux_loss_coef
        self.token_tile = args.moe_token_tile  # 0: off (forward_tiles)
        # Data-parallel group of the in-batch QB collectives (set by the trainer; None: local tokens).
        self.balance_group = None
        # Eval mode: count each forward's routed tokens in `tokens_per_expert` (set only by
        # `recording_eval_load`, which restores the training statistics afterwards).
        self.record_eval_load = False

        self.router = TopKRouter(args.dim, args.n_routed_experts, args.top_k, args.routed_scale)
        self.w_latent_down = nn.Linear(args.dim, args.moe_latent_dim, bias=False)
        self.experts = RoutedExperts(
            args.n_routed_experts, args.moe_latent_dim, args.moe_expert_hidden, args.situ_beta1, args.situ_beta2,
            args.expert_activation,
        )
        self.latent_norm = nn.RMSNorm(args.moe_latent_dim, eps=args.norm_eps)
        self.w_latent_up = nn.Linear(args.moe_latent_dim, args.dim, bias=False)
        self.shared_experts = (
            SiTUGLUFeedForward(
                args.dim, args.n_shared_experts * args.moe_shared_hidden, args.situ_beta1, args.situ_beta2,
                args.expert_activation,
            )
            if args.n_shared_experts > 0
            else None
        )

        n = args.n_routed_experts
        # Buffers of the balancing statistics (non-persistent, training only): see TRAINING_STATS.
        self.register_buffer("expert_bias", torch.zeros(n, dtype=torch.float32), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(n, dtype=torch.int64), persistent=False)
        if self._uses_histogram:
            self.register_buffer(
                "qb_counts", torch.zeros(n, args.qb_bins, dtype=torch.int64), persistent=False
            )
        if self._in_batch:
            self.register_buffer("qb_batch_bias_sum", torch.zeros(n, dtype=torch.float32), persistent=False)
            self.register_buffer("qb_batch_count", torch.zeros((), dtype=torch.int64), persistent=False)
        if self._aux_loss:
            self.register_buffer("aux_loss_weight", torch.ones((), dtype=torch.float32), persistent=False)
            self.register_buffer("aux_loss_sum", torch.zeros((), dtype=torch.float32), persistent=False)
            self.register_buffer("aux_loss_count", torch.zeros((), dtype=torch.int64), persistent=False)
        self.step_scores: Tensor | None = None

    @property
    def _in_batch(self) -> bool:
        return self.balance_rule == "qb" and self.qb_batch_iters > 0 and self.top_k < self.n_experts

    @property
    def _aux_loss(self) -> bool:
        return self.balance_rule == "aux_loss"

    @property
    def _uses_histogram(self) -> bool:
        return self.balance_rule == "qb" and self.qb_bins > 0 and self.top_k < self.n_experts and not self._in_batch

    # ------------------------------------------------------------------ forward
    def forward(self, x_BTD: Tensor) -> Tensor:
        """x [..., dim] (normally [B, T, dim]) -> y of the same shape and dtype.

        Three phases: :meth:`route_and_sort`, the routed experts, :meth:`combine`. Expert
        parallelism exchanges the sorted token copies around the experts call (all-to-all
        with a host sync for the split sizes), so under it the two other phases are compiled
        as separate regions (see ``titan_moe.parallelize``). With ``token_tile`` set and more
        tokens than that, :meth:`forward_tiles` runs the three phases tile by tile.
        """
        x_ND = x_BTD.reshape(-1, self.dim)
        if self.token_tile and x_ND.shape[0] > self.token_tile:
            return self.forward_tiles(x_ND).view(x_BTD.shape).to(x_BTD.dtype)
        alignment = 1 if self.experts.expert_parallel else self.experts.group_alignment
        latent_sorted_RL, offs_E, pos_Nk, weights_Nk = self.route_and_sort(x_ND, alignment)
        out_sorted_RL = self._run_experts(latent_sorted_RL, offs_E, alignment)
        y_ND = self.combine(x_ND, out_sorted_RL, pos_Nk, weights_Nk)
        return y_ND.view(x_BTD.shape).to(x_BTD.dtype)

    def _run_experts(self, latent_sorted_RL: Tensor, offs_E: Tensor, alignment: int) -> Tensor:
        with nvtx_range("moe.experts"):
            if alignment > 1:
                return self.experts(latent_sorted_RL, offs_E, groups_aligned=True)
            return self.experts(latent_sorted_RL, offs_E)

    def route_and_sort(self, x_ND: Tensor, alignment: int = 1) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Route ``x_ND`` [N, dim] and sort its ``M = N*k`` latent token copies by expert.

        Returns ``latent_sorted_RL`` [R, latent], ``offs_E`` [E] int32 cumulative ends of
        each expert's rows, ``pos_Nk`` [N, k] int64 (the sorted row of copy ``slot`` of token
        ``i``) and ``weights_Nk`` [N, k] fp32. With ``alignment`` 1, ``R = M`` and the groups
        are packed; otherwise every group starts at a multiple of ``alignment`` in a buffer
        of the static size ``R = padded_rows(M, E, alignment)`` whose rows outside the groups
        are zero (:func:`titan_moe.ops.dispatch.aligned_positions`; no host sync).
        Accumulates the balancing statistics in training. The copies are made by the
        ``titan_moe::moe_permute`` op (:mod:`titan_moe.ops.dispatch`).
        """
        k = self.top_k
        with nvtx_range("moe.router"):
            if self.training and self._in_batch:
                scores_Nn = self.router.scores(x_ND)
                bias_n = self._batch_bias(scores_Nn.detach())
                expert_idx_Nk, weights_Nk = route(scores_Nn, bias_n, k, self.router.routed_scale)
            else:
                scores_Nn, expert_idx_Nk, weights_Nk = self.router(x_ND, self.expert_bias)
            counts_E = expert_counts(expert_idx_Nk, self.n_experts)
            if self.training:
                self._accumulate(scores_Nn.detach(), counts_E)
                if self._aux_loss:
                    aux = aux_balance_loss(scores_Nn, counts_E, k)
                    self._accumulate_aux(aux.detach())
                    weights_Nk = AddAuxiliaryLoss.apply(weights_Nk, aux, self.aux_loss_weight * self.aux_loss_coef)
            elif self.record_eval_load:
                self.tokens_per_expert.add_(counts_E)
        latent_sorted_RL, offs_E, pos_Nk = self._sort(x_ND, expert_idx_Nk, counts_E, alignment)
        return latent_sorted_RL, offs_E, pos_Nk, weights_Nk

    def _sort(self, x_ND: Tensor, expert_idx_Nk: Tensor, counts_E: Tensor,
              alignment: int) -> tuple[Tensor, Tensor, Tensor]:
        """Dispatch: the latent copies of ``x_ND`` sorted by expert (the first three results of
        :meth:`route_and_sort`)."""
        k = self.top_k
        # Sort the N*k token copies by expert so that each expert's rows are contiguous.
        with nvtx_range("moe.dispatch"):
            flat_expert = expert_idx_Nk.reshape(-1)
            order_M = torch.argsort(flat_expert, stable=True)  # sorted row -> copy i*k + slot
            pos_Nk = sorted_positions(order_M, k)
            rows = None
            if alignment > 1:
                pos_Nk, offs_E, rows = aligned_positions(pos_Nk, expert_idx_Nk, counts_E, alignment)
            else:
                offs_E = torch.cumsum(counts_E, 0).to(torch.int32)
            latent_NL = self.w_latent_down(x_ND)
            latent_sorted_RL = scatter_copies(latent_NL, pos_Nk, rows)  # row pos[i, j] = latent_NL[i]
        return latent_sorted_RL, offs_E, pos_Nk

    # ------------------------------------------------------------------ token tiles
    def forward_tiles(self, x_ND: Tensor) -> Tensor:
        """The MoE of ``x_ND`` [N, dim] in tiles of at most ``token_tile`` tokens -> y_ND [N, dim].

        Each tile runs :meth:`_tile` (route, sort, experts, combine: a pure function of the
        tile, the bias and the whole-batch aux-loss fractions) under its own non-reentrant
        ``torch.utils.checkpoint`` while grad is enabled, so between the forward and the
        backward only the tiles' inputs are kept, and the backward recomputes and holds one
        tile's activations at a time. Routing is per token given the bias, so the outputs and
        gradients are those of the untiled forward. The tiles return their balance statistics,
        which are accumulated here, outside the checkpoints: a tile's recompute does not count
        its tokens again (the layer's own activation-checkpoint recompute reruns this method
        and counts the batch twice, as it does untiled). What needs the whole batch is done
        once before the tiles, from router scores computed without grad in the same tiles:
        in-batch QB's bias (:meth:`_batch_bias`) and the aux loss's expert fractions ``f``
        and its logged value. The number of tiles is ``ceil(N / token_tile)``, a Python int:
        a compiled region specializes on ``N`` (one graph per token count).
        """
        if self.experts.expert_parallel:
            raise ValueError("model.moe_token_tile > 0 does not work with expert parallelism yet; set it to 0")
        N, tile, k = x_ND.shape[0], self.token_tile, self.top_k
        starts = range(0, N, tile)
        bias_n, f_E = self.expert_bias, None
        if self.training and (self._in_batch or self._aux_loss):
            with torch.no_grad(), nvtx_range("moe.router"):
                scores_Nn = torch.cat([self.router.scores(x_ND[s : s + tile]) for s in starts])
                if self._in_batch:
                    bias_n = self._batch_bias(scores_Nn)
                if self._aux_loss:
                    counts_E = expert_counts(route(scores_Nn, bias_n, k)[0], self.n_experts)
                    self._accumulate_aux(aux_balance_loss(scores_Nn, counts_E, k))
                    f_E = counts_E.float() / max(N * k, 1)
                del scores_Nn
        checkpointed = torch.is_grad_enabled()
        ys, stats = [], []
        for s in starts:
            x_tD = x_ND[s : s + tile]
            if checkpointed:
                y_tD, counts_E, extra = checkpoint(
                    self._tile, x_tD, bias_n, f_E, N, use_reentrant=False, preserve_rng_state=False
                )
            else:
                y_tD, counts_E, extra = self._tile(x_tD, bias_n, f_E, N)
            ys.append(y_tD)
            stats.append((counts_E, extra))
        if self.record_eval_load and not self.training:
            self.tokens_per_expert.add_(torch.stack([c for c, _ in stats]).sum(0))
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert.add_(torch.stack([c for c, _ in stats]).sum(0))
                if self._uses_histogram:
                    self.qb_counts.add_(torch.stack([e for _, e in stats]).sum(0))
                elif self.balance_rule == "qb" and not self._in_batch:
                    self.step_scores = torch.cat([e for _, e in stats])
        return torch.cat(ys)

    def _tile(self, x_tD: Tensor, bias_n: Tensor, f_E: Tensor | None,
              n_tokens: int) -> tuple[Tensor, Tensor, Tensor]:
        """One tile of :meth:`forward_tiles`, without side effects (it runs again in the
        backward): ``x_tD`` [t, dim] -> (y_tD [t, dim], counts_E [n] int64, extra), where
        ``extra`` is the tile's QB histogram [n, qb_bins] (histogram QB), its detached
        scores [t, n] (exact lagged QB) or ``counts_E`` (otherwise). ``f_E`` [n] (aux loss):
        the whole batch's expert fractions; the tile's share of the loss, ``E * Σ_e f_e *
        (Σ_{i in tile} p_ie) / n_tokens``, gives its router the gradient of the untiled loss."""
        k = self.top_k
        with nvtx_range("moe.router"):
            scores_tn, expert_idx_tk, weights_tk = self.router(x_tD, bias_n)
            counts_E = expert_counts(expert_idx_tk, self.n_experts)
            extra = counts_E
            if self.training:
                if self._uses_histogram:
                    extra = qb_histogram(scores_tn.detach(), bias_n, k, self.qb_bins)
                elif self.balance_rule == "qb" and not self._in_batch:
                    extra = scores_tn.detach()
                if f_E is not None:
                    p_sum_n = (scores_tn / scores_tn.sum(-1, keepdim=True)).sum(0)
                    aux = self.n_experts * (f_E * (p_sum_n / n_tokens)).sum()
                    weights_tk = AddAuxiliaryLoss.apply(weights_tk, aux, self.aux_loss_weight * self.aux_loss_coef)
        alignment = self.experts.group_alignment
        latent_sorted_RL, offs_E, pos_tk = self._sort(x_tD, expert_idx_tk, counts_E, alignment)
        out_sorted_RL = self._run_experts(latent_sorted_RL, offs_E, alignment)
        return self.combine(x_tD, out_sorted_RL, pos_tk, weights_tk), counts_E, extra

    def combine(self, x_ND: Tensor, out_sorted_RL: Tensor, pos_Nk: Tensor, weights_Nk: Tensor) -> Tensor:
        """Unsort the experts' outputs [R, latent], weight and sum them per token, normalise,
        project up and add the shared experts of ``x_ND`` [N, dim] -> y_ND [N, dim].

        ``out_sorted_RL`` is in the layout of ``pos_Nk`` (as ``route_and_sort`` returned
        it). Unsorting, weighting and the fp32 sum over the k copies are one
        ``titan_moe::moe_unpermute_combine`` op (:mod:`titan_moe.ops.dispatch`)."""
        # Unsort, weight and sum over k in one pass (deterministic); u stays fp32 for the norm.
        with nvtx_range("moe.combine"):
            u_NL = combine_copies(out_sorted_RL, pos_Nk, weights_Nk, out_dtype=torch.float32)
            u_NL = F.rms_norm(u_NL, (self.latent,), self.latent_norm.weight.float(), self.norm_eps)
            y_ND = self.w_latent_up(u_NL.to(out_sorted_RL.dtype))
        if self.shared_experts is not None:
            with nvtx_range("moe.shared"):
                y_ND = y_ND + self.shared_experts(x_ND)
        return y_ND

    @torch.no_grad()
    def _batch_bias(self, scores_Nn: Tensor) -> Tensor:
        """In-batch QB: the bias that balances the tokens being routed, ``qb_batch_iters``
        passes of :func:`quantile_balance` from ``expert_bias``, over ``balance_group``. Summed
        into ``qb_batch_bias_sum`` for the step's update of ``expert_bias``."""
        bias_n = self.expert_bias.float()
        for _ in range(self.qb_batch_iters):
            bias_n = quantile_balance(scores_Nn, bias_n, self.top_k, self.qb_bins or None, self.balance_group)
        self.qb_batch_bias_sum.add_(bias_n)
        self.qb_batch_count.add_(1)
        return bias_n

    @torch.no_grad()
    def _accumulate_aux(self, aux: Tensor) -> None:
        self.aux_loss_sum.add_(aux)
        self.aux_loss_count.add_(1)

    def step_aux_loss(self) -> Tensor | None:
        """The mean auxiliary loss of the forwards since the last update (0-d fp32, 0 when none),
        or None unless ``balance_rule = "aux_loss"``."""
        if not self._aux_loss:
            return None
        return self.aux_loss_sum / self.aux_loss_count.clamp_min(1)

    @torch.no_grad()
    def _accumulate(self, scores_Nn: Tensor, counts_E: Tensor) -> None:
        self.tokens_per_expert.add_(counts_E)
        if self._in_batch:
            pass  # the bias statistics were gathered by _batch_bias
        elif self._uses_histogram:
            self.qb_counts.add_(qb_histogram(scores_Nn, self.expert_bias, self.top_k, self.qb_bins))
        elif self.balance_rule == "qb":
            self.step_scores = scores_Nn

    # ------------------------------------------------------------------ balancing
    @torch.no_grad()
    def update_expert_bias(self, group=None) -> tuple[Tensor, Tensor]:
        """Apply the balance rule to this step's statistics, then reset them.

        Returns 0-d tensors (max_violation, dead_experts) of the step's global load. When
        no token was seen since the last update both are 0 and the bias is kept. No host
        sync except inside the collectives.
        """
        _check_group(group)
        load_n = self.tokens_per_expert.clone()
        if group is not None:
            dist.all_reduce(load_n, group=group)
        seen = load_n.sum() > 0
        max_violation, dead = load_metrics(load_n)
        max_violation = torch.where(seen, max_violation, torch.zeros_like(max_violation))
        dead = torch.where(seen, dead, torch.zeros_like(dead))

        old_bias = self.expert_bias.float()
        new_bias = None
        if self.balance_rule == "sign":
            new_bias = sign_balance(load_n, old_bias, self.sign_gamma)
        elif self._in_batch:
            # identical on every rank: each microbatch's bias came from the group's histogram / rows
            new_bias = self.qb_batch_bias_sum / self.qb_batch_count.clamp_min(1)
        elif self._uses_histogram:
            counts_nB = self.qb_counts.clone()
            if group is not None:
                dist.all_reduce(counts_nB, group=group)
            new_bias = histogram_quantiles(counts_nB, old_bias, self.top_k)
            new_bias = new_bias - new_bias.mean()
        elif self.step_scores is not None:
            new_bias = quantile_balance(self.step_scores, old_bias, self.top_k, None, group)
        if new_bias is not None:
            if self.balance_rule == "qb" and self.qb_ema > 0:
                new_bias = self.qb_ema * old_bias + (1.0 - self.qb_ema) * new_bias
            self.expert_bias.copy_(torch.where(seen, new_bias, old_bias))
        self.reset_balance_stats()
        return max_violation, dead

    @torch.no_grad()
    def reset_balance_stats(self) -> None:
        self.tokens_per_expert.zero_()
        if self._uses_histogram:
            self.qb_counts.zero_()
        if self._in_batch:
            self.qb_batch_bias_sum.zero_()
            self.qb_batch_count.zero_()
        if self._aux_loss:
            self.aux_loss_sum.zero_()
            self.aux_loss_count.zero_()
        self.step_scores = None

    @torch.no_grad()
    def init_weights(self, init_std: float = 0.02) -> None:
        self.router.init_weights(init_std)
        _trunc_normal_(self.w_latent_down.weight, init_std)
        self.experts.init_weights(init_std)
        nn.init.ones_(self.latent_norm.weight)
        _trunc_normal_(self.w_latent_up.weight, init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
        self.expert_bias.zero_()
        if self._aux_loss:
            self.aux_loss_weight.fill_(1.0)
        self.reset_balance_stats()


_WRAPPER_PREFIXES = re.compile(r"(_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module)\.")


class BalanceStats(NamedTuple):
    """One step's load statistics of a model's MoE layers, still on the device."""

    names: list[str]  # layer names, e.g. "layers.3"
    stats_L2: Tensor  # [layers, 2]: max_violation, dead_experts (float64)
    aux_L: Tensor | None = None  # [layers]: mean auxiliary loss (balance_rule = "aux_loss"; float64)


@torch.no_grad()
def apply_expert_balance(model: nn.Module, group=None) -> BalanceStats | None:
    """Update the bias of every :class:`LatentMoE` in ``model`` from this step's statistics
    and return those statistics on the device (None without MoE layers).

    Call once per optimizer step (e.g. as an optimizer step pre-hook) with the
    data-parallel process group (``None`` for a single process); the statistics of all
    microbatches since the last call are used and then reset. No host transfer happens here,
    so the step does not wait for the GPU; :func:`balance_metrics` reads them when they are
    logged.
    """
    names, values, aux = [], [], []
    for name, module in model.named_modules():
        if isinstance(module, LatentMoE):
            step_aux = module.step_aux_loss()  # before the update resets it
            if step_aux is not None:
                aux.append(step_aux.double())
            max_violation, dead = module.update_expert_bias(group)
            names.append(_WRAPPER_PREFIXES.sub("", name) or "root")
            values.append(torch.stack([max_violation.double(), dead.double()]))
    if not names:
        return None
    return BalanceStats(names, torch.stack(values), torch.stack(aux) if aux else None)


def balance_metrics(stats: list[BalanceStats]) -> dict[str, float]:
    """``moe/<layer>/max_violation`` (max load / mean load - 1) and ``moe/<layer>/dead_experts``
    per layer, plus ``moe/max_violation_max``, ``moe/max_violation_mean`` and
    ``moe/dead_experts_total`` over all layers of `stats`; with the auxiliary loss also
    ``moe/<layer>/aux_loss`` (the step's mean of ``E * Σ_e f_e P_e``, 1 for uniform routing) and
    ``moe/aux_loss_mean`` over the layers (the objective adds ``aux_loss_coef`` times their
    sum). One host transfer. Empty without MoE layers."""
    if not stats:
        return {}
    with_aux = all(s.aux_L is not None for s in stats)
    columns = [torch.cat([s.stats_L2, s.aux_L[:, None]], 1) if with_aux else s.stats_L2 for s in stats]
    values = torch.cat(columns).cpu().tolist()
    names = [name for s in stats for name in s.names]
    metrics: dict[str, float] = {}
    for name, row in zip(names, values):
        metrics[f"moe/{name}/max_violation"] = row[0]
        metrics[f"moe/{name}/dead_experts"] = row[1]
        if with_aux:
            metrics[f"moe/{name}/aux_loss"] = row[2]
    metrics["moe/max_violation_max"] = max(v[0] for v in values)
    metrics["moe/max_violation_mean"] = sum(v[0] for v in values) / len(values)
    metrics["moe/dead_experts_total"] = sum(v[1] for v in values)
    if with_aux:
        metrics["moe/aux_loss_mean"] = sum(v[2] for v in values) / len(values)
    return metrics


def set_aux_loss_weight(model: nn.Module | list[nn.Module], weight: float) -> None:
    """Set each auxiliary-loss :class:`LatentMoE`'s share of the step's objective (no-op without).

    The trainer's loss is the token sum over every microbatch and rank divided by the global
    token count, and the ranks' gradients are summed, so each forward's cross-entropy counts
    with its share of the step's tokens. ``weight = 1 / (microbatches x ranks that route
    distinct tokens)`` gives each forward's auxiliary loss the same share, so that the step
    optimizes ``cross-entropy + aux_loss_coef * Σ_layers mean aux`` whatever the layout."""
    for part in model if isinstance(model, (list, tuple)) else [model]:
        for module in part.modules():
            if isinstance(module, LatentMoE) and module._aux_loss:
                module.aux_loss_weight.fill_(weight)


@contextlib.contextmanager
def recording_eval_load(model: nn.Module | list[nn.Module], group=None):
    """Count the routed tokens of the eval-mode forwards run inside; yields a dict that, on
    exit, holds ``eval/moe/max_violation_max``, ``eval/moe/max_violation_mean`` and
    ``eval/moe/dead_experts_total``: the load balance of those tokens, routed with the
    frozen bias (the inference setting), summed over ``group`` (the data-parallel group of
    the training statistics; None: this process). Empty without MoE layers or if no token
    was routed. The training statistics of each layer are kept aside and restored, so a
    step's bias update is unchanged by an eval run between its microbatches."""
    moes = [m for part in (model if isinstance(model, (list, tuple)) else [model])
            for m in part.modules() if isinstance(m, LatentMoE)]
    saved = [m.tokens_per_expert.clone() for m in moes]
    result: dict[str, float] = {}
    try:
        for m in moes:
            m.tokens_per_expert.zero_()
            m.record_eval_load = True
        yield result
        if moes:
            load_Ln = torch.stack([m.tokens_per_expert for m in moes])
            if group is not None:
                dist.all_reduce(load_Ln, group=group)
            stats_L2 = torch.stack([torch.stack([v, d.double()]) for v, d in map(load_metrics, load_Ln)])
            seen, rows = bool(load_Ln.sum() > 0), stats_L2.cpu().tolist()  # one host transfer
            if seen:
                violations = [v for v, _ in rows]
                result["eval/moe/max_violation_max"] = max(violations)
                result["eval/moe/max_violation_mean"] = sum(violations) / len(violations)
                result["eval/moe/dead_experts_total"] = sum(d for _, d in rows)
    finally:
        for m, tokens in zip(moes, saved):
            m.record_eval_load = False
            m.tokens_per_expert.copy_(tokens)


def update_expert_biases(model: nn.Module, group=None) -> dict[str, float]:
    """:func:`apply_expert_balance` followed by :func:`balance_metrics` (a host sync)."""
    stats = apply_expert_balance(model, group)
    return balance_metrics([stats] if stats is not None else [])
