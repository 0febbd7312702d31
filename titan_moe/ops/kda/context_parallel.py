"""KDA over a sequence split across ranks (context parallelism, SPEC §8), and the short
convolution's halo.

Each rank of a context-parallel group holds one contiguous segment of `T` tokens of the
packed row (rank r: global tokens `[r T, (r+1) T)`). KDA's state update is affine in the
state, so a segment maps the state entering it to the state leaving it as

    S_out = M_r S_in + S0_r,    M_r = Π_t (I - beta_t k_t k_t^T) Diag(e^{g_t})  [dk, dk],

with `S0_r` the end state when the segment starts from zero (the map acts on the dk side
of the `[dk, dv]` state). A document that starts inside the segment (or at its first
token) cuts the chain: the end state no longer depends on `S_in`, so `M_r = 0`. Only the
segment's first document piece, the tokens before its first document start, continues the
incoming state; for its tokens, by the same linearity,

    o_t = o_t|_{S_in = 0} + S_in^T (scale P_t^T q_t),    P_t = the transition up to token t.

`kda_context_parallel` does, per rank:

1. one `chunk_kda` call over the segment (local `cu_seqlens`), the first piece starting
   from zero when it continues a document from the previous rank: outputs `o|_{S_in=0}`
   and `S0_r` (the last piece's end state);
2. when the first piece continues a document, a second call over that piece alone with
   `v = 0`, dv = dk and the identity as initial state: its outputs are the basis
   `scale P_t^T q_t` `[T1, H, dk]` and its end state is `M_r` (when no document starts in
   the segment; the basis call walks the identity's columns, as `triton_scan` does);
3. a differentiable all-gather of `[M_r | S0_r]` over the group, and the scan
   `S_in(r) = M_{r-1} S_in(r-1) + S0_{r-1}`, started at the last rank before r whose
   segment holds a document start (its state is its S0), so rank r pays only for the
   ranks since the last cut;
4. `o += S_in^T basis` for the first piece.

Autograd carries the gradients back: into `S_in`, through the scan and the all-gather's
backward, a reduce-scatter, to `M_j`, `S0_j` of earlier ranks,
and from there through their `chunk_kda` backward (the op takes the final-state gradient);
the state gradient thus runs from later ranks to earlier ones.

Costs per rank (N rows, H heads, first piece of T1 tokens): the basis call is a second
`chunk_kda` forward and backward over T1 tokens at dv = dk (for a rank inside a long
document T1 = T: about twice the KDA op's work at dk = dv); it keeps the basis
`[N, T1, H, dk]` in v's dtype plus what the op keeps for its backward. Communication: an
all-gather of `cp x N x H x dk x (dk + dv)` state values (fp32; at H = 64, dk = dv = 128:
8 MiB a rank, 64 MiB gathered at cp = 8) in the forward and a reduce-scatter of the same
size in the backward; the gathered tensor stays alive for the scan's backward on ranks
whose first piece continues a document. The scan: at most cp - 1 products
`[dk, dk] @ [dk, dv]` per row and head. The basis is in v's dtype (bf16 inputs: rounded
like the op's own outputs); states and the correction are fp32.

The host-side facts (where the documents fall) come from `context_parallel_layout`, once per
batch outside compiled code; `kda_context_parallel` itself, with its functional
all-gather, traces with `torch.compile(fullgraph=True)` (tested with the aot_eager backend),
but every layout is a new set of constants for the trace (its branches and slice lengths),
so a compiled caller recompiles per layout: the trainer runs it eagerly between compiled
regions (`titan_moe.context_parallel`, "Compile").

`conv_halo` gives each rank the previous rank's last `conv_size - 1` inputs of the short
convolution (zeros on rank 0), differentiably.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from titan_moe.ops.kda.chunk_torch import seqlens_bounds
from titan_moe.ops.kda.op import chunk_kda


# ----------------------------------------------------------------------------------------
# the layout of the row over the ranks
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SegmentLayout:
    """How the documents of the packed row fall on one rank's segment (host-side facts,
    hashable: a compiled caller sees them as constants).

    rank, cp, T: this rank's place in the group, the group's size, tokens per segment.
    varlen: whether the row is packed (`cu_seqlens`, one row) or each of the batch rows
        is one sequence (no `cu_seqlens`).
    n_docs: the row's document count (varlen), to check `initial_state`.
    local_bounds: the boundaries of the segment's document pieces, local positions from
        0 to T (the `cu_seqlens` of the local call; empty pieces dropped).
    piece_docs: the global document index of each piece.
    continues: whether the first piece continues a document begun on an earlier rank
        (then it starts from the incoming state, else from its document's initial state).
    first_end: local end of the first piece.
    cuts: per rank of the group, whether a document starts in its segment (its first
        token included); rank 0's always does. A cut rank's end state does not depend
        on the state entering it.
    """

    rank: int
    cp: int
    T: int
    varlen: bool
    n_docs: int
    local_bounds: tuple[int, ...]
    piece_docs: tuple[int, ...]
    continues: bool
    first_end: int
    cuts: tuple[bool, ...]


def segment_layout(
    bounds: list[int] | tuple[int, ...], rank: int, cp: int, T: int, varlen: bool = True
) -> SegmentLayout:
    """The layout of rank `rank`'s segment `[rank T, (rank+1) T)` of a row of `cp T` tokens
    whose documents have the global boundaries `bounds` (`cu_seqlens` as a list)."""
    if not 0 <= rank < cp:
        raise ValueError(f"rank must lie in [0, {cp}), got {rank}")
    if bounds[0] != 0 or bounds[-1] != cp * T or any(a > b for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing from 0 to cp * T = {cp * T}, got {list(bounds)}")
    return _segment_layout(tuple(bounds), rank, cp, T, varlen)


@functools.lru_cache(maxsize=256)
def _segment_layout(bounds: tuple[int, ...], rank: int, cp: int, T: int, varlen: bool) -> SegmentLayout:
    lo, hi = rank * T, (rank + 1) * T
    local, docs = [0], []
    n = bisect.bisect_right(bounds, lo) - 1  # the document holding token lo (the last of equal bounds)
    while n < len(bounds) - 1 and bounds[n] < hi:
        end = min(bounds[n + 1], hi) - lo
        if end > local[-1]:
            local.append(end)
            docs.append(n)
        n += 1
    cuts = tuple(any(j * T <= b < (j + 1) * T for b in bounds[:-1]) for j in range(cp))
    continues = bounds[docs[0]] < lo
    return SegmentLayout(rank, cp, T, varlen, len(bounds) - 1, tuple(local), tuple(docs), continues, local[1], cuts)


def context_parallel_layout(
    cu_seqlens: Tensor | None, T: int, group: dist.ProcessGroup | None = None
) -> tuple[SegmentLayout, Tensor | None]:
    """This rank's `SegmentLayout` and the local `cu_seqlens` of its pieces (int32, on
    cu_seqlens' device; None without cu_seqlens), for `kda_context_parallel`.

    cu_seqlens: int `[N+1]`, the boundaries of the row's N documents over all `cp T` tokens,
    the same on every rank; None: each batch row is one sequence spread over the ranks.
    Reads cu_seqlens on the host (once per tensor object, `seqlens_bounds`): call it
    outside compiled code, once per batch, and pass the results to every KDA layer. The
    local tensor is one object per layout, so `chunk_kda`'s own host read of it is
    cached too. The group's rank order is the segments' order.
    """
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    if cu_seqlens is None:
        return segment_layout([0, cp * T], rank, cp, T, varlen=False), None
    layout = segment_layout(seqlens_bounds(cu_seqlens, cp * T), rank, cp, T)
    return layout, local_cu_seqlens(layout.local_bounds, cu_seqlens.device)


@functools.lru_cache(maxsize=256)
def local_cu_seqlens(local_bounds: tuple[int, ...], device: torch.device) -> Tensor:
    """int32 `cu_seqlens` of a segment's pieces (`SegmentLayout.local_bounds`) on `device`,
    one tensor object per layout and device (so `chunk_kda`'s host read of it is cached)."""
    return torch.tensor(local_bounds, dtype=torch.int32, device=device)


# ----------------------------------------------------------------------------------------
# collectives
# ----------------------------------------------------------------------------------------
class _Tie(torch.autograd.Function):
    """`out` unchanged; `anchor` gets a zero gradient. A rank whose result does not use the
    all-gather's output would otherwise skip the gather's backward, a collective that the
    other ranks wait in.

    The zero is `0 * sum(grad)`, not a constant: compiled, the partitioner moves work that
    needs no tangent into the forward graph, and a constant zero would put this rank's
    reduce-scatter there, out of step with the other ranks' (seen as a hang)."""

    @staticmethod
    def forward(ctx, out: Tensor, anchor: Tensor) -> Tensor:
        ctx.anchor_meta = (anchor.shape, anchor.dtype, anchor.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        shape, dtype, device = ctx.anchor_meta
        return grad, torch.zeros(shape, dtype=dtype, device=device) + (grad.sum() * 0).to(dtype)


def all_gather_ranks(x: Tensor, group, cp: int) -> Tensor:
    """`[cp, *x.shape]`: every rank's x, differentiable (the backward sums each rank's
    gradients back to their owner, a reduce-scatter). A functional collective, which
    `torch.compile` traces; `all_gather_single_autograd` is torch 2.13's name, 2.11 has
    `all_gather_tensor_autograd` (deprecated in 2.13)."""
    group = dist.group.WORLD if group is None else group
    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    parts = funcol.wait_tensor(gather(x.contiguous(), 0, group))
    return parts.view(cp, *x.shape)


def _tied(out: Tensor, parts: Tensor) -> Tensor:
    if torch.is_grad_enabled() and parts.requires_grad:
        return _Tie.apply(out, parts)
    return out


# ----------------------------------------------------------------------------------------
# KDA across ranks
# ----------------------------------------------------------------------------------------
def kda_context_parallel(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    layout: SegmentLayout,
    local_cu_seqlens: Tensor | None,
    *,
    group: dist.ProcessGroup | None = None,
    initial_state: Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    gate_in_kernel: bool = False,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float = -5.0,
) -> Tensor:
    """`chunk_kda` over a row split across the ranks of `group` (see the module docstring).

    Every rank passes its segment: q, k, g `[B, T, H, dk]`, v `[B, T, H, dv]`, beta
    `[B, T, H]` (rank r holds global tokens `[r T, (r+1) T)`; T is the same on every
    rank; B = 1 for a packed row), with `layout, local_cu_seqlens =
    context_parallel_layout(cu_seqlens, T, group)`, and

        initial_state: `[N, H, dk, dv]` (N documents of the packed row, or N = B), each
            document's state before its first token, the same on every rank, or None
            (zeros). Each rank's gradient for it is that rank's share: their sum over the
            group is the gradient of the whole row (what the reduction of a replicated
            input gives).

    scale, use_qk_l2norm, gate_in_kernel, A_log, dt_bias, lower_bound: as `chunk_kda`.
    Returns this segment's `o [B, T, H, dv]` in v's dtype, equal (up to rounding) to the
    matching slice of `chunk_kda` on the whole row; differentiable in every input. All
    ranks must call it together (it runs collectives in the forward and the backward).
    """
    if q.dim() != 4 or q.shape[1] != layout.T:
        raise ValueError(f"q must be [B, T = {layout.T}, H, dk] (the layout's T), got shape {tuple(q.shape)}")
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    if layout.varlen and (B != 1 or local_cu_seqlens is None):
        raise ValueError(f"a packed row needs B = 1 and local_cu_seqlens, got B={B}")
    n_docs = layout.n_docs if layout.varlen else B
    if initial_state is not None and initial_state.shape != (n_docs, H, dk, dv):
        raise ValueError(
            f"initial_state must be [N, H, dk, dv] = {(n_docs, H, dk, dv)}, got {tuple(initial_state.shape)}"
        )
    state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    op_args = dict(
        scale=scale, use_qk_l2norm=use_qk_l2norm, gate_in_kernel=gate_in_kernel,
        A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
    )

    # 1. the segment from its pieces' own initial states, the continued piece from zero
    h0 = None
    if initial_state is not None:
        h0 = initial_state.to(state_dtype)
        if layout.varlen:
            h0 = torch.stack([h0[n] for n in layout.piece_docs])
        if layout.continues:
            n_first = 1 if layout.varlen else B
            h0 = torch.cat([h0.new_zeros(n_first, H, dk, dv), h0[n_first:]])
    o, ht = chunk_kda(
        q, k, v, g, beta, initial_state=h0, output_final_state=True,
        cu_seqlens=local_cu_seqlens if layout.varlen else None, **op_args,
    )
    S0 = ht[-1:] if layout.varlen else ht  # [R, H, dk, dv], R rows of states
    R = S0.shape[0]

    # 2. the basis of the continued piece, and its transition M when it fills the segment
    cut = layout.cuts[layout.rank]
    M = S0.new_zeros(R, H, dk, dk)
    T1 = layout.first_end
    if layout.continues:
        eye = torch.eye(dk, dtype=state_dtype, device=q.device).expand(R, H, dk, dk)
        basis, M_end = chunk_kda(
            q[:, :T1], k[:, :T1], v.new_zeros(B, T1, H, dk), g[:, :T1], beta[:, :T1],
            initial_state=eye.contiguous(), output_final_state=not cut, **op_args,
        )
        if not cut:
            M = M_end

    # 3. all ranks' maps, and the state entering this segment
    parts = all_gather_ranks(torch.cat([M, S0.to(state_dtype)], dim=-1), group, layout.cp)
    if not layout.continues:
        return _tied(o, parts)
    j0 = max(j for j in range(layout.rank) if layout.cuts[j])
    S_in = parts[j0][..., dk:]
    for j in range(j0 + 1, layout.rank):
        S_in = parts[j][..., :dk] @ S_in + parts[j][..., dk:]

    # 4. the continued piece's outputs from its true incoming state
    o_first = o[:, :T1].to(state_dtype) + torch.einsum("bthk,bhkv->bthv", basis.to(state_dtype), S_in)
    return torch.cat([o_first.to(o.dtype), o[:, T1:]], dim=1)


# ----------------------------------------------------------------------------------------
# the short convolution's left context
# ----------------------------------------------------------------------------------------
def conv_halo(x_local: Tensor, conv_size: int, group: dist.ProcessGroup | None = None,
              continues: bool = True) -> Tensor:
    """The previous rank's last `conv_size - 1` tokens of `x_local [B, T, C]` (the short
    convolution's input, `titan_moe.model.short_conv`): `[B, conv_size - 1, C]`, zeros on
    rank 0 and when `continues` is False (a document starts at this segment's first token).
    Differentiable: the halo's gradient returns to the previous rank's tokens. All ranks
    call it together. T must be at least `conv_size - 1`.

    The layer then convolves `cat([halo, x_local], dim=1)` and keeps the last T outputs,
    under the document mask of the extended tokens: the halo's tokens carry their own
    document ids (global positions `r T - conv_size + 1 .. r T - 1`, from the row's
    `cu_seqlens`; the previous segment may end with a document start), so that no token
    reads across a document start. The group's rank order is the segments' order.
    """
    B, T, C = x_local.shape
    width = conv_size - 1
    if conv_size < 1 or T < width:
        raise ValueError(f"conv_size must be in [1, T + 1] = [1, {T + 1}], got {conv_size}")
    rank = dist.get_rank(group)
    parts = all_gather_ranks(x_local[:, T - width :].contiguous(), group, dist.get_world_size(group))
    if rank == 0 or not continues:
        return _tied(x_local.new_zeros(B, width, C), parts)
    return parts[rank - 1]
