"""Block attention residuals (AttnRes, SPEC §4): a learned softmax over depth replaces x + f(x).

Sources of the residual stream:

* ``b_0``: the token embedding;
* ``b_n``: the sum of the sub-layer outputs of finished block ``n`` (attention and FFN are
  both sub-layers);
* ``b_cur``: the partial sum of the current block so far.

Before sub-layer ``l`` (and once more after the last layer, before the final norm) a mixer
with its own pseudo-query ``w_l`` and key-norm weight aggregates the available sources::

    alpha_i = softmax_i( w_l^T RMSNorm_l(v_i) )        h_l = sum_i alpha_i v_i     (fp32)

Modes (``ModelArgs.attn_res``):

* ``"block"``: a block is ``block_size`` layers; it closes after the FFN of its last layer.
  The last block may be partial (K3: 93 layers, blocks of 12, the eighth has 9 layers).
* ``"full"``: every sub-layer output is its own source (an ablation; see memory note below).
* ``"none"``: the plain pre-norm residual stream ``x <- x + f(norm(x))``; the mixer returns
  the running sum ``x`` and its parameters are unused.

When is ``b_cur`` a source? Only once a sub-layer of the current block has written to it.
An empty ``b_cur`` is the zero vector: as a source it would have logit ``w^T RMSNorm(0) = 0``,
take probability mass (1/(n+1) at zero init) and pull ``h`` toward zero while carrying no
information. The Attention Residuals paper's reference pseudo-code (``block_attn_res(blocks,
partial_block, ...)``, arXiv 2603.15031) mixes ``blocks + [partial_block]`` and only starts a
new, empty partial block after that mix, so the first sub-layer of block ``n+1`` sees
``b_0 .. b_n`` and no empty partial sum. The stream here closes a block eagerly (moves
``b_n`` into the buffer) and masks the empty ``b_cur`` out, which gives the same source set.
The very first sub-layer therefore sees ``b_0`` alone and gets ``h = b_0``.

Compilation: one graph per source count. Under regional compile (one compiled region per
decoder layer, SPEC §4) a layer receives exactly the sources that exist before it: ``b_0``
and the blocks closed so far, as a tuple of ``[B, T, D]`` tensors, plus ``b_cur`` and a 0-dim
"written" flag. The tuple's length is fixed within a block, so Dynamo compiles one graph per
(layer kind, block) pair and reuses it for the block's other layers of that kind
(`titan_moe.parallelize` raises the recompile limit to cover them). Padding the tuple to
``S_max`` zero slots with a device-side count would give one graph for every layer, but the
mixers would read, and the backward write gradients for, the zero slots, and autograd would
sum those gradients across every layer that took them: work that grows with ``S_max``
rather than with the sources that exist (BENCHMARKS.md, "Training step"). Nothing else that varies
per layer may be a Python value read inside the compiled region: closing a block therefore
happens in `ResidualStream.end_layer`, which the decoder calls between layers, outside the
compiled layers, and ``b_cur``'s state is the 0-dim flag (one graph for a block's first layer
and its others). Every source is its own tensor, none aliases another or ``b_cur``, and all
share one ``requires_grad`` (Dynamo guards on aliasing and on ``requires_grad``). All stream
methods are functional: they return a new stream and never write into a tensor that autograd
may have saved.

Memory: closing a block (outside the compiled layers) appends ``b_cur`` to the tuple and
copies nothing, so a block-mode stream holds ``b_0``, the closed blocks and one
empty-``b_cur`` placeholder per block beside the layers' own inputs. Full mode pushes after
every sub-layer inside the compiled layer: every layer sees a new source count, so it
compiles one graph per layer (an ablation for small models, not for paper scale).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from titan_moe.model.args import AttnResMode
from titan_moe.ops.nvtx import nvtx_wrap

_MODES = ("block", "full", "none")

# (sources, partial_BTD, partial_used): see ResidualStream.
StreamTensors = tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]


def max_sources(mode: str, n_layers: int, block_size: int) -> int:
    """The most sources a stream holds (the final mixer's count): b_0 plus every source that
    can be pushed.

    block: b_0 and each block that can close (``n_layers // block_size``; a trailing partial
    block stays in ``b_cur``); full: b_0 and one per sub-layer; none: no sources.
    """
    if mode == "block":
        return 1 + n_layers // block_size
    if mode == "full":
        return 1 + 2 * n_layers
    return 0


def sources_before_layer(mode: str, layer_idx: int, block_size: int) -> int:
    """The number of sources layer ``layer_idx`` (0-based) receives: block mode b_0 and the
    blocks closed before it; full mode b_0 and the outputs of the sub-layers before it."""
    if mode == "block":
        return 1 + layer_idx // block_size
    if mode == "full":
        return 1 + 2 * layer_idx
    return 0


@dataclass
class ResidualStream:
    """The residual stream between sub-layers (see module docstring).

    Fields:
        sources: the finished sources [B, T, D] each, in order (b_0, closed blocks or, in full
            mode, sub-layer outputs); empty in none mode.
        partial_BTD: [B, T, D] b_cur in block mode; the running residual ``x`` in none mode;
            unused in full mode. While ``partial_used`` is False its content is ignored (it
            then holds a zeros placeholder of its own, never a source, with the sources'
            ``requires_grad``: Dynamo guards on aliasing and on ``requires_grad``).
        partial_used: bool 0-dim tensor, True once a sub-layer of the current block wrote to
            ``partial_BTD`` (always True in none mode, always False in full mode).
        mode: "block" | "full" | "none".
        block_size: layers per block (block mode; kept for `end_layer`).

    All tensors share the dtype of the embedding passed to `start`; mixers compute in fp32.
    """

    sources: tuple[torch.Tensor, ...]
    partial_BTD: torch.Tensor
    partial_used: torch.Tensor
    mode: str
    block_size: int

    @property
    def n_sources(self) -> int:
        return len(self.sources)

    @classmethod
    def start(cls, embed_BTD: torch.Tensor, mode: AttnResMode, n_layers: int, block_size: int) -> ResidualStream:
        """The stream before the first layer: ``b_0 = embed_BTD`` (or ``x = embed_BTD``)."""
        if mode not in _MODES:
            raise ValueError(f"attn_res mode must be one of {_MODES}, got {mode!r}")
        if n_layers <= 0 or block_size <= 0:
            raise ValueError(f"n_layers and block_size must be > 0, got {n_layers} and {block_size}")
        if embed_BTD.dim() != 3:
            raise ValueError(f"embedding must be [B, T, D], got shape {tuple(embed_BTD.shape)}")
        if mode == "none":
            sources, partial_BTD, used = (), embed_BTD, True
        else:
            sources, partial_BTD, used = (embed_BTD,), _placeholder(embed_BTD), False
        return cls(
            sources=sources,
            partial_BTD=partial_BTD,
            # torch.full, not torch.tensor: a traced factory call instead of a 0-d constant lifted
            # into exported programs (AOTInductor on CUDA crashed loading such constants).
            partial_used=torch.full((), used, dtype=torch.bool, device=embed_BTD.device),
            mode=mode,
            block_size=block_size,
        )

    def tensors(self) -> StreamTensors:
        """The sources and the two other tensors, the form in which a `DecoderLayer` takes and
        returns the stream."""
        return self.sources, self.partial_BTD, self.partial_used

    def with_tensors(self, tensors: StreamTensors) -> ResidualStream:
        """This stream's mode and block size around `tensors` (as `tensors()` orders them)."""
        return ResidualStream(*tensors, self.mode, self.block_size)

    def _replace(self, **changes) -> ResidualStream:
        fields = dict(
            sources=self.sources,
            partial_BTD=self.partial_BTD,
            partial_used=self.partial_used,
            mode=self.mode,
            block_size=self.block_size,
        )
        fields.update(changes)
        return ResidualStream(**fields)

    def add(self, out_BTD: torch.Tensor) -> ResidualStream:
        """Record one sub-layer's output [B, T, D] (cast to the stream dtype).

        block: ``b_cur += out``; full: push ``out`` as a new source; none: ``x += out``.
        Safe inside a compiled region: nothing here depends on the layer index.
        """
        out_BTD = out_BTD.to(self.partial_BTD.dtype)
        if self.mode == "full":
            return self._replace(sources=(*self.sources, out_BTD))
        if self.mode == "none":
            return self._replace(partial_BTD=self.partial_BTD + out_BTD)
        partial_BTD = torch.where(self.partial_used, self.partial_BTD + out_BTD, out_BTD)
        return self._replace(partial_BTD=partial_BTD, partial_used=torch.ones_like(self.partial_used))

    def closes_block_after(self, layer_idx: int) -> bool:
        """True when layer ``layer_idx`` (0-based) is the last layer of a block (block mode)."""
        return self.mode == "block" and (layer_idx + 1) % self.block_size == 0

    def close_block(self) -> ResidualStream:
        """Block mode: append ``b_cur`` as a finished block ``b_n`` (no copy) and start an
        empty one (a placeholder of its own: no aliasing)."""
        if self.mode != "block":
            raise ValueError(f"close_block is only defined in block mode, stream mode is {self.mode!r}")
        return self._replace(
            sources=(*self.sources, self.partial_BTD),
            partial_BTD=_placeholder(self.partial_BTD),
            partial_used=torch.zeros_like(self.partial_used),
        )

    def end_layer(self, layer_idx: int) -> ResidualStream:
        """Call after layer ``layer_idx`` (both sub-layers) has added its outputs.

        Closes the block when the layer is the block's last one (block mode only); otherwise
        returns the stream unchanged. Call it outside a compiled layer: it branches on the
        Python int ``layer_idx``.
        """
        if not self.closes_block_after(layer_idx):
            return self
        return self.close_block()


def _placeholder(like_BTD: torch.Tensor) -> torch.Tensor:
    """Zeros shaped like a source, a tensor of its own, requiring grad whenever autograd
    records (as the blocks that replace it do, even with a frozen embedding)."""
    return torch.zeros_like(like_BTD).requires_grad_(torch.is_grad_enabled())


def _flatten_stream(stream: ResidualStream):
    tensors = (*stream.sources, stream.partial_BTD, stream.partial_used)
    return tensors, (len(stream.sources), stream.mode, stream.block_size)


def _unflatten_stream(tensors, context) -> ResidualStream:
    n_slots, mode, block_size = context
    tensors = list(tensors)
    return ResidualStream(tuple(tensors[:n_slots]), *tensors[n_slots:], mode, block_size)


# A pytree node, so that code walking a layer's inputs and outputs finds the stream's tensors:
# FSDP2 registers its pre-backward (re-gather) hooks on the tensors of each unit's outputs.
# Without this, torch 2.11's FSDP2 saw no tensor in a decoder layer's output, freed the layer's
# gathered weights after the forward and never gathered them again before its backward
# ("setStorage ... out of bounds for storage of size 0").
torch.utils._pytree.register_pytree_node(
    ResidualStream, _flatten_stream, _unflatten_stream,
    serialized_type_name="titan_moe.model.attn_res.ResidualStream",
)


def _weighted_sum(p_SBT: torch.Tensor, v_BTD: Sequence[torch.Tensor]) -> torch.Tensor:
    """``sum_s p[s, ..., None] * v[s]`` -> [B, T, D], one source at a time.

    Shapes: p [S, B, T] (the mixing weights), v S tensors [B, T, D] (the sources). Not an einsum:
    that lowers to a batched matmul with one [1, S] x [S, D] product per token (batch B*T),
    a shape the GEMM kernels run far below bandwidth, in the backward too. Term by term,
    eager mode holds one [B, T, D] product at a time, and a compiled region fuses the sum
    into one pass over the sources.
    """
    h_BTD = p_SBT[0, ..., None] * v_BTD[0]
    for s in range(1, len(v_BTD)):
        h_BTD = h_BTD + p_SBT[s, ..., None] * v_BTD[s]
    return h_BTD


class AttnResMixer(nn.Module):
    """One AttnRes aggregation: ``h = sum_i softmax_i(w^T RMSNorm(v_i)) v_i`` over the stream's sources.

    Parameters: ``query`` [D] (the pseudo-query ``w``, zero init, so the first mix is uniform)
    and ``key_norm`` (an RMSNorm whose weight scales the keys). ``forward(stream) -> h_BTD``
    computes logits, softmax and the weighted sum in fp32 and returns ``h`` in the stream's
    dtype. In none mode it returns the running residual sum.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.query = nn.Parameter(torch.zeros(dim))
        self.key_norm = nn.RMSNorm(dim, eps=eps)

    @nvtx_wrap("attn_res.mix")
    def forward(self, stream: ResidualStream) -> torch.Tensor:
        if stream.mode == "none":
            return stream.partial_BTD
        # fp32 on purpose, also under autocast (which would run the logit matmul and the
        # weighted sum in bf16, each on its own bf16 copy of the [S, B, T, D] sources, both
        # kept for the backward): the sources are read as they are stored.
        with torch.autocast(stream.partial_BTD.device.type, enabled=False):
            return self._mix(stream)

    def _mix(self, stream: ResidualStream) -> torch.Tensor:
        # logit = RMSNorm(v) . q = (v . (w * q)) / rms(v): the same number without a normalised
        # copy of the sources, which the matmul would keep for the backward ([B, T, D] fp32 a
        # source, where this form keeps only [B, T] scalars beside the sources themselves).
        wq_D = self.key_norm.weight.float() * self.query.float()

        # Products and sums over D instead of matmuls with a vector: a matmul here becomes a
        # batched GEMV (or, in the backward, a GEMM per token with batch B*T) that ran at a
        # tiny fraction of bandwidth, while a compiled mul-and-sum fuses into one reduction
        # that reads the sources once.
        def logits(v_XD: torch.Tensor) -> torch.Tensor:
            return (v_XD * wq_D).sum(-1) * torch.rsqrt(v_XD.square().mean(-1) + self.eps)

        v_BTD = [v.float() for v in stream.sources]
        S = len(v_BTD)
        logit_SBT = torch.stack([logits(v) for v in v_BTD])
        if stream.mode == "full":
            p_SBT = torch.softmax(logit_SBT, dim=0)
            h_BTD = _weighted_sum(p_SBT, v_BTD)
        else:
            cur_BTD = stream.partial_BTD.float()
            logit_BT = logits(cur_BTD).masked_fill(~stream.partial_used, float("-inf"))
            p_SBT = torch.softmax(torch.cat([logit_SBT, logit_BT[None]], dim=0), dim=0)
            h_BTD = _weighted_sum(p_SBT[:S], v_BTD) + p_SBT[S, ..., None] * cur_BTD
        return h_BTD.to(stream.partial_BTD.dtype)

    @torch.no_grad()
    def init_weights(self, init_std: float = 0.02) -> None:
        """Zero pseudo-query (uniform mix, as SPEC §4 prescribes) and unit key-norm weight.

        ``init_std`` is accepted for the common module interface and not used.
        """
        nn.init.zeros_(self.query)
        nn.init.ones_(self.key_norm.weight)
