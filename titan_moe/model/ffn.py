"""Dense SiTU-GLU feed-forward (SPEC §6): the first layer's FFN and the MoE shared experts
(SwiGLU for those with `ModelArgs.expert_activation = "swiglu"`)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from titan_moe.model.situ import DEFAULT_BETA1, DEFAULT_BETA2, check_glu_activation, glu_packed


class SiTUGLUFeedForward(nn.Module):
    """``y = W_d situ_glu(W_g x, W_u x)``, ``dim -> hidden -> dim``, no biases.

    The gate and up projections are fused into one Linear ``w_gate_up`` (dim -> 2*hidden)
    whose output rows are ``[gate (hidden); up (hidden)]``: a column-wise tensor-parallel
    split must shard the two halves separately, not the fused weight as one block.
    ``activation`` "swiglu" replaces SiTU-GLU by ``silu(z_g) * z_u`` (the betas are then unused).
    """

    def __init__(self, dim: int, hidden: int, beta1: float = DEFAULT_BETA1, beta2: float = DEFAULT_BETA2,
                 activation: str = "situ"):
        super().__init__()
        if dim <= 0 or hidden <= 0:
            raise ValueError(f"SiTUGLUFeedForward: dim and hidden must be > 0, got {dim}, {hidden}")
        if beta1 <= 0 or beta2 <= 0:
            raise ValueError(f"SiTUGLUFeedForward: beta1 and beta2 must be > 0, got {beta1}, {beta2}")
        check_glu_activation(activation)
        self.dim, self.hidden = dim, hidden
        self.beta1, self.beta2, self.activation = beta1, beta2, activation
        self.w_gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.w_down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """x [..., dim] -> [..., dim]."""
        return self.w_down(glu_packed(self.w_gate_up(x), self.activation, self.beta1, self.beta2))

    @torch.no_grad()
    def init_weights(self, init_std: float = 0.02) -> None:
        for weight in (self.w_gate_up.weight, self.w_down.weight):
            nn.init.trunc_normal_(weight, mean=0.0, std=init_std, a=-3 * init_std, b=3 * init_std)
