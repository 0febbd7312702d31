"""Kimi delta attention layer: bounded-decay delta rule with short convolutions (SPEC §1).

    q, k, v = SiLU(ShortConv(W_q x)), SiLU(ShortConv(W_k x)), SiLU(ShortConv(W_v x))
    q, k    = per-head L2 norm (eps 1e-6)
    g       = g_min * sigmoid(exp(A_log) * (W_f_up W_f_down x + dt_bias))     [H, dk]
              (kda_gate = "unbounded": -exp(A_log) * softplus(W_f_up W_f_down x + dt_bias))
    beta    = sigmoid(W_b x)                                                  [H]
    o       = KDA(q, k, v, g, beta)                                           [H, dv]
    y       = W_o [ sigmoid(W_g x) ⊙ RMSNorm_head(o) ]

The recurrence runs in `titan_moe.ops.kda` (custom op for training/prefill, a recurrent
step for decoding). Packed documents (`doc_ids_BT`, `cu_seqlens`, see `packing.py`) never
see each other: the short convolution masks taps across a document start and the state
restarts at every `cu_seqlens` boundary.

`ModelArgs.kda_gate = "unbounded"` (an ablation of the bound) computes the softplus gate here
and hands the op finished gates; only the PyTorch chunked path takes them (the trainer
resolves `kernels.kda` to torch; a layer asked to run the Triton kernels on CUDA raises).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from titan_moe.model.args import ModelArgs
from titan_moe.model.short_conv import short_conv_silu, short_conv_silu_reference
from titan_moe.ops.kda import chunk_kda, kda_decode_step, softplus_gate
from titan_moe.ops.kda.triton_op import kernels_selected
from titan_moe.ops.nvtx import nvtx_wrap

_DT_MIN, _DT_MAX, _DT_FLOOR = 1e-3, 1e-1, 1e-4


@dataclass
class KDACache:
    """Generation state of one KDA layer (no packing).

    conv_state: `[B, conv_size - 1, 3 * H * dk]`, the last projected q|k|v inputs of the
        short convolution (activation dtype).
    recurrent_state: `[B, H, dk, dv]` fp32.
    The layer replaces both fields (it does not write into the old tensors).
    """

    conv_state: torch.Tensor
    recurrent_state: torch.Tensor

    @classmethod
    def empty(
        cls,
        args: ModelArgs,
        batch_size: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> KDACache:
        """A zero cache (no tokens seen) for `batch_size` sequences; `dtype` for conv_state."""
        H, d = args.kda_n_heads, args.kda_head_dim
        return cls(
            conv_state=torch.zeros(batch_size, args.kda_conv_size - 1, 3 * H * d, device=device, dtype=dtype),
            recurrent_state=torch.zeros(batch_size, H, d, d, device=device, dtype=torch.float32),
        )


def doc_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """int32 [B, T] document numbers from boundaries of the flattened stream (no host sync)."""
    starts = torch.zeros(B * T + 1, dtype=torch.int32, device=cu_seqlens.device)
    starts = starts.index_fill(0, cu_seqlens.long(), 1)[:-1]
    return starts.cumsum(0, dtype=torch.int32).view(B, T)


def check_unbounded_gate_path(device: torch.device) -> None:
    """A ValueError when the `[kernels] kda` choice in force would run the Triton kernels on
    `device` (CUDA) for unbounded gates, which they do not take."""
    if device.type == "cuda" and kernels_selected(device):
        raise ValueError("model.kda_gate = 'unbounded' runs the PyTorch KDA path only, but kernels.kda picks the "
                         "Triton kernels here: set kernels.kda = 'torch'")


class KimiDeltaAttention(nn.Module):
    """KDA token mixer: `[B, T, dim] -> [B, T, dim]`.

    Shapes come from `ModelArgs`: `H = kda_n_heads`, `dk = dv = kda_head_dim`, short
    convolution width `kda_conv_size`, gate bound `kda_g_min`.
    """

    no_weight_decay_names = ("A_log", "dt_bias")

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.dim = args.dim
        self.n_heads = H = args.kda_n_heads
        self.head_dim = d = args.kda_head_dim
        self.conv_size = args.kda_conv_size
        self.g_min = args.kda_g_min
        self.gate = args.kda_gate
        self.norm_eps = args.norm_eps
        inner = H * d

        self.wq = nn.Linear(args.dim, inner, bias=False)
        self.wk = nn.Linear(args.dim, inner, bias=False)
        self.wv = nn.Linear(args.dim, inner, bias=False)
        # depthwise causal conv taps, [channels, conv_size]; the last tap hits the current token
        self.q_conv_weight = nn.Parameter(torch.empty(inner, self.conv_size))
        self.k_conv_weight = nn.Parameter(torch.empty(inner, self.conv_size))
        self.v_conv_weight = nn.Parameter(torch.empty(inner, self.conv_size))
        # low-rank decay projection (rank dk) and the bounded gate's parameters
        self.w_f_down = nn.Linear(args.dim, d, bias=False)
        self.w_f_up = nn.Linear(d, inner, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(inner))
        self.w_beta = nn.Linear(args.dim, H, bias=False)
        # output: per-head RMSNorm (weight shared by heads), full-rank sigmoid gate, W_o
        self.o_norm_weight = nn.Parameter(torch.empty(d))
        self.w_gate = nn.Linear(args.dim, inner, bias=False)
        self.wo = nn.Linear(inner, args.dim, bias=False)
        self.init_weights(args.init_std)

    # ------------------------------------------------------------------------------------
    def init_weights(self, init_std: float = 0.02) -> None:
        """(Re)initialise every parameter in place (works on DTensors and after to_empty).

        Also marks `A_log` and `dt_bias` with `_no_weight_decay = True` (again here, because
        `to_empty` and FSDP sharding replace the Parameter objects and drop attributes).
        """
        for name in self.no_weight_decay_names:
            getattr(self, name)._no_weight_decay = True
        with torch.no_grad():
            for lin in (self.wq, self.wk, self.wv, self.w_f_down, self.w_f_up, self.w_beta, self.w_gate, self.wo):
                nn.init.trunc_normal_(lin.weight, mean=0.0, std=init_std, a=-3 * init_std, b=3 * init_std)
            bound = 1.0 / math.sqrt(self.conv_size)  # nn.Conv1d's default for a depthwise conv
            for w in (self.q_conv_weight, self.k_conv_weight, self.v_conv_weight):
                nn.init.uniform_(w, -bound, bound)
            self.A_log.zero_()
            # dt ~ logUniform(1e-3, 1e-1), dt_bias = softplus^{-1}(dt) = dt + log(-expm1(-dt))
            self.dt_bias.uniform_(math.log(_DT_MIN), math.log(_DT_MAX)).exp_().clamp_(min=_DT_FLOOR)
            self.dt_bias.add_(torch.log(-torch.expm1(-self.dt_bias)))
            self.o_norm_weight.fill_(1.0)

    # ------------------------------------------------------------------------------------
    def _short_conv(
        self, x_BTC: torch.Tensor, doc_ids_BT: torch.Tensor | None, conv_state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Depthwise causal conv over q|k|v channels, then SiLU (`titan_moe.model.short_conv`).

        `conv_state [B, conv_size-1, C]` is the left context (zeros when None). Returns the
        activations in x's dtype and the new conv state (the last conv_size-1 inputs).
        """
        w_CK = torch.cat([self.q_conv_weight, self.k_conv_weight, self.v_conv_weight])
        if conv_state is not None:  # decode / chunked prefill
            return short_conv_silu_reference(x_BTC, w_CK, doc_ids_BT, conv_state)
        B, _, C = x_BTC.shape
        left = self.conv_size - 1
        new_state = torch.cat([x_BTC.new_zeros(B, left, C), x_BTC], dim=1)[:, x_BTC.shape[1] :]
        return short_conv_silu(x_BTC, w_CK, doc_ids_BT), new_state

    @nvtx_wrap("kda.inputs")
    def attention_inputs(
        self,
        x_BTD: torch.Tensor,
        doc_ids_BT: torch.Tensor | None = None,
        conv_state: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """The operator inputs before the in-op L2 norm and gate.

        Returns `q, k [B,T,H,dk]` (after conv+SiLU, not yet normalised), `v [B,T,H,dv]`,
        `z [B,T,H,dk]` (raw gate input: g = kda_gate(z, A_log, dt_bias, g_min)),
        `beta [B,T,H]` fp32, and the new conv state `[B, conv_size-1, 3*H*dk]`.
        """
        qkv_BTC, z, beta = self.input_projections(x_BTD)
        qkv_BTC, new_conv_state = self._short_conv(qkv_BTC, doc_ids_BT, conv_state)
        q, k, v = self.split_heads(qkv_BTC)
        return q, k, v, z, beta, new_conv_state

    def input_projections(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every projection of `x_BTD` before the short convolution: the q|k|v channels
        `[B, T, 3*H*dk]` (the convolution's input), `z [B,T,H,dk]` and `beta [B,T,H]` fp32."""
        B, T, _ = x_BTD.shape
        qkv_BTC = torch.cat([self.wq(x_BTD), self.wk(x_BTD), self.wv(x_BTD)], dim=-1)
        z = self.w_f_up(self.w_f_down(x_BTD)).view(B, T, self.n_heads, self.head_dim)
        beta = torch.sigmoid(self.w_beta(x_BTD).float())
        return qkv_BTC, z, beta

    def split_heads(self, qkv_BTC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k `[B,T,H,dk]` and v `[B,T,H,dv]` (views) of the q|k|v channels."""
        B, T, _ = qkv_BTC.shape
        H, d = self.n_heads, self.head_dim
        q, k, v = (t.view(B, T, H, d) for t in qkv_BTC.split(H * d, dim=-1))
        return q, k, v

    def gate_inputs(self, z_BTHK: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The gate operand and keyword arguments of `chunk_kda` / `kda_decode_step`: the raw
        `z` with the bounded gate applied in the op, or (`kda_gate = "unbounded"`) the finished
        fp32 softplus gate, which the op takes as given (on its PyTorch path only)."""
        if self.gate == "bounded":
            return z_BTHK, dict(use_qk_l2norm=True, gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias,
                                lower_bound=self.g_min)
        check_unbounded_gate_path(z_BTHK.device)
        return softplus_gate(z_BTHK, self.A_log, self.dt_bias), dict(use_qk_l2norm=True)

    @nvtx_wrap("kda.output")
    def output_projection(self, o_BTHV: torch.Tensor, x_BTD: torch.Tensor) -> torch.Tensor:
        """`W_o [sigmoid(W_g x) ⊙ RMSNorm_head(o)]`, norm and gate in fp32."""
        B, T, H, dv = o_BTHV.shape
        o = o_BTHV.float()
        o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + self.norm_eps) * self.o_norm_weight.float()
        gate = torch.sigmoid(self.w_gate(x_BTD).float()).view(B, T, H, dv)
        return self.wo((o * gate).reshape(B, T, H * dv).to(x_BTD.dtype))

    # ------------------------------------------------------------------------------------
    def _check_args(self, x_BTD, doc_ids_BT, cu_seqlens, cache) -> None:
        if x_BTD.dim() != 3 or x_BTD.shape[-1] != self.dim:
            raise ValueError(f"x must be [B, T, {self.dim}], got {tuple(x_BTD.shape)}")
        B, T, _ = x_BTD.shape
        if doc_ids_BT is not None:
            if tuple(doc_ids_BT.shape) != (B, T):
                raise ValueError(f"doc_ids_BT must be [B, T] = {(B, T)}, got {tuple(doc_ids_BT.shape)}")
            if cu_seqlens is None:
                raise ValueError(
                    "doc_ids_BT without cu_seqlens would let the recurrent state cross documents; "
                    "pass cu_seqlens = packing.cu_seqlens_from_doc_ids(doc_ids_BT) too"
                )
        if cu_seqlens is not None and (cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64)):
            raise ValueError(f"cu_seqlens must be a 1-D int32 tensor, got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
        if cache is not None:
            if doc_ids_BT is not None or cu_seqlens is not None:
                raise ValueError("a KDACache (generation) cannot be combined with packed documents")
            H, d = self.n_heads, self.head_dim
            if tuple(cache.conv_state.shape) != (B, self.conv_size - 1, 3 * H * d):
                raise ValueError(
                    f"cache.conv_state must be {(B, self.conv_size - 1, 3 * H * d)}, got {tuple(cache.conv_state.shape)}"
                )
            if tuple(cache.recurrent_state.shape) != (B, H, d, d):
                raise ValueError(f"cache.recurrent_state must be {(B, H, d, d)}, got {tuple(cache.recurrent_state.shape)}")
            if cache.recurrent_state.dtype != torch.float32:
                raise ValueError(f"cache.recurrent_state must be float32, got {cache.recurrent_state.dtype}")

    def forward(
        self,
        x_BTD: torch.Tensor,
        doc_ids_BT: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        cache: KDACache | None = None,
    ) -> torch.Tensor:
        """KDA over `x_BTD [B, T, dim]`.

        Packing: `cu_seqlens` (int32 [N+1] over the flattened B*T stream, from
        `packing.cu_seqlens_from_doc_ids`, row ends included) restarts the state at every
        document; `doc_ids_BT` (optional alongside it, derived from cu_seqlens if absent)
        masks the short convolution. Both None: each row is one causal sequence.
        Cache (generation, no packing): continues from `cache` and updates it; T == 1 uses
        the recurrent decode step, T > 1 the chunked op.
        """
        self._check_args(x_BTD, doc_ids_BT, cu_seqlens, cache)
        B, T, _ = x_BTD.shape
        if cu_seqlens is not None and doc_ids_BT is None:
            doc_ids_BT = doc_ids_from_cu_seqlens(cu_seqlens, B, T)
        q, k, v, z, beta, new_conv_state = self.attention_inputs(
            x_BTD, doc_ids_BT, None if cache is None else cache.conv_state
        )
        z, gate_args = self.gate_inputs(z)
        if cache is not None and T == 1:
            o_BHV, state = kda_decode_step(
                q[:, 0], k[:, 0], v[:, 0], z[:, 0], beta[:, 0], cache.recurrent_state, **gate_args
            )
            o = o_BHV[:, None]
        elif cache is not None:
            o, state = chunk_kda(
                q, k, v, z, beta, initial_state=cache.recurrent_state, output_final_state=True, **gate_args
            )
        else:
            if cu_seqlens is not None:  # varlen: one row of B*T tokens
                q, k, v, z, beta = (t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, z, beta))
            o, _ = chunk_kda(q, k, v, z, beta, cu_seqlens=cu_seqlens, **gate_args)
            o = o.view(B, T, *o.shape[2:])
        if cache is not None:
            cache.conv_state, cache.recurrent_state = new_conv_state, state
        return self.output_projection(o, x_BTD)
