"""Context-parallel rows of the plan: each layer as one rank of a `cp` group runs it
(`titan_moe.context_parallel`), measured like the single-device layers (`eager`, `transient`)
on torch's fake process group, plus the per-row buffers counted from the layer structure.

What one rank of a CP group holds that the layer on `L = T / cp` tokens of one device does
not (T tokens a row, B rows, R = kv_lora_rank, S = qk_shared_dim, D = dim, `a` the compute
dtype's bytes, H and dk KDA's heads and head dim, c = 512 the query chunk of
`doc_attention_chunked`):

* MLA (`ContextParallelMLA`): the all-gathered latents `[c_kv | k_s]` of the row, `B T (R+S) a`
  per MLA layer, kept from the forward to the backward (the attention saves views of them as
  its values); the key copy each computed block makes (`cat([c_kv, k_s])` up to the block's
  last query, saved as the attention's keys): under "headtail" the two blocks of every rank
  reach `(2r+1) L/2` and `(2cp-2r) L/2` tokens, together `B (T + L/2) (R+S) a`; without the
  balance rank r's reach `(r+1) L` (the plan takes r = cp - 1: `B T (R+S) a`). Per local
  token the queries are latent (`[H, R+S]` instead of `[H, n+r]`) and no per-head keys or
  values exist. "headtail" moves the second half-segment's layer input to the mirror rank and
  its output back (all-to-alls of `D a` a token; the received inputs are kept by the block's
  projections). The attention runs query chunk by query chunk (`doc_attention_chunked`):
  each chunk scores `min(c, rows)` queries against the keys from its earliest document start,
  fp32 `[B, H, min(c, rows), span]` score blocks, about four alive at the forward's and the
  backward's peak (the chunk's scores and probabilities and the previous chunk's): with one
  document filling the row the last chunk's span is the whole row (the rank computing the
  row's last half-segment: rank 0 under "headtail", 4 x 2 GiB at small_1gpu, T = 128K).
* KDA (`ContextParallelKDA`): a rank whose segment continues a document from the previous
  rank runs a second `chunk_kda` over that first piece (`v = 0`, the identity as initial
  state): it keeps the zero values and the basis `[T1, H, dk]` (T1 = L for a rank inside a
  long document), the basis in fp32 for the correction's einsum and what the op keeps for its
  backward (its residuals at dv = dk under `kda_keep`), and its backward runs a second KDA
  backward. The states' all-gather (`cp x H x dk x (dk + dv)` fp32 a row, 8 MiB at cp 8 and
  small_1gpu) and the short convolution's halo (`conv_size - 1` tokens) do not grow with T.

Which rank. The plan is for the worst rank of a row that is one document: MLA layers as on
the rank with the longest key span (rank 0 under "headtail": its late half-segment is the
row's last; without the balance rank cp - 1), KDA layers as on a rank that continues the
document (rank 1; all ranks but 0 do, alike up to constants). No single rank is both, so
this bounds every rank from above. Rank 0, which never continues a document, holds less per
KDA layer (`CPOptions(rank=0)`; the CLI prints its totals too). `max_doc_len` caps the
key span of a query chunk at `max_doc_len + c` (documents no longer than that); the plan
still counts the basis over the whole segment.

How the measurement maps to real lengths. The layers are measured at L = 128, 256, 384 local
tokens (`transient.TRANSIENT_TOKENS`), each attention call split into four query chunks
(`CP_ATTENTION_CHUNKS`: the measuring counter sets the ops' chunk size; several, so that the
previous chunk's scores and probabilities, alive while the next chunk's are made, are
counted, reaching nearly as far as the last chunk's), so the score blocks' bytes grow as
L^2: the fit's `Q` terms. At real lengths a
chunk holds `min(c, rows)` rows and its span is capped by the documents:
`CPOptions.chunk_caps` and `chunk_seq_sq` turn `Q` into bytes accordingly
(`LayerActivations.seq_sq`). Every `Q` term of a context-parallel layer is such a block: it
has no other `T^2` tensor (no document mask). The span-sized tensors of a chunk that are not
score blocks (its fp32 keys and values, the backward's per-head `[span, R]` products) are
per-token terms of the fit and are not capped by `max_doc_len`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titan_moe.context_parallel import BALANCES, ContextParallelKDA, ContextParallelMLA, RowSegments, RowsSlot
from titan_moe.model.args import ModelArgs
from titan_moe.model.kda import KimiDeltaAttention
from titan_moe.model.mla import GatedMLA
from titan_moe.ops.attention.chunked import DEFAULT_CHUNK as ATTENTION_CHUNK
from titan_moe.ops.kda import residual_bytes_per_token
from titan_moe.ops.kda.context_parallel import segment_layout

CP_ATTENTION_CHUNKS = 4  # query chunks per attention call of a measured layer (module docstring)


@dataclass(frozen=True)
class CPOptions:
    """How the plan's context-parallel rows are taken (module docstring, "Which rank").

    balance: `parallelism.context_parallel_load_balancer` ("headtail" or None).
    rank: None for the worst rank (the default), or one rank r (0 .. cp - 1) for every layer.
    max_doc_len: the longest document of a row in tokens; None: one document fills the row.
    """

    balance: str | None = "headtail"
    rank: int | None = None
    max_doc_len: int | None = None

    def __post_init__(self) -> None:
        if self.balance not in BALANCES:
            raise ValueError(f"balance must be one of {BALANCES}, got {self.balance!r}")
        if self.rank is not None and self.rank < 0:
            raise ValueError(f"rank must be >= 0, got {self.rank}")
        if self.max_doc_len is not None and self.max_doc_len < 1:
            raise ValueError(f"max_doc_len must be >= 1, got {self.max_doc_len}")

    def measured_rank(self, kind: str, cp: int) -> int:
        """The rank whose layer of `kind` ("kda" or "mla") the plan measures."""
        if self.rank is not None:
            if self.rank >= cp:
                raise ValueError(f"rank {self.rank} does not exist in a group of {cp}")
            return self.rank
        if kind == "kda":
            return 1
        return 0 if self.balance == "headtail" else cp - 1

    def chunk_caps(self, kind: str, cp: int) -> tuple[float, float] | None:
        """(rows, span) caps, in local tokens, of the measured layer's `Q` terms (module
        docstring). `rho L` is the queries of one attention call (a "headtail" block: rho =
        1/2), `f L` the end of the largest one's keys; measured, its n = `CP_ATTENTION_CHUNKS`
        chunks hold `rho L / n` rows and its last one scores `f L` keys, so `Q L^2` stands for
        `k (rho L / n) (f L)` bytes; a real chunk holds `min(c, rho L)` rows and scores
        `min(f L, max_doc_len + c)` keys: `Q n min(c / rho, L) min(L, (max_doc_len + c) / f)`
        (`chunk_seq_sq`). None for KDA."""
        if kind != "mla":
            return None
        rho, f = self.attention_shape(cp)
        span = float("inf") if self.max_doc_len is None else (self.max_doc_len + ATTENTION_CHUNK) / f
        return ATTENTION_CHUNK / rho, span

    def attention_shape(self, cp: int) -> tuple[float, float]:
        """(rho, f) of the measured MLA rank: its attention calls' queries (`rho L`) and the
        end of the largest call's keys (`f L`)."""
        rank = self.measured_rank("mla", cp)
        if self.balance == "headtail":  # blocks 2r and 2cp - 1 - 2r, ending at (r + 1/2) L and (cp - r) L
            return 0.5, max(cp - rank, rank + 0.5)
        return 1.0, rank + 1


def chunk_seq_sq(caps: tuple[float, float] | None, local_batch: int, seq_local: int) -> float:
    """The `seq_sq` argument of a layer's profiles: `B L^2` (the sequences' squared local
    lengths), or under `caps` (`CPOptions.chunk_caps`) `B n min(rows, L) min(span, L)`, n =
    `CP_ATTENTION_CHUNKS`: affine in L from `rows` on (one full query chunk a call); below it
    a call is one chunk, counted as n (an upper bound there: no previous chunk is alive)."""
    if caps is None:
        return float(local_batch * seq_local**2)
    rows, span = caps
    return local_batch * CP_ATTENTION_CHUNKS * min(rows, seq_local) * min(span, seq_local)


# =========================================================================== measuring
@dataclass(frozen=True)
class RankSetting:
    """One rank of a CP group of `cp`, as the measured layer runs it: installed on a
    `zero_layer` (`install`) and given, per measuring length, the rows of one document
    (`set_rows`). Run it inside `fake_group(rank, cp)`."""

    rank: int
    cp: int
    balance: str | None = "headtail"

    def install(self, layer) -> None:
        """Swap `layer`'s attention to its context-parallel class (as
        `context_parallel.apply_context_parallel` does), with its own rows slot."""
        attention = layer.attention
        if isinstance(attention, KimiDeltaAttention):
            attention.__class__ = ContextParallelKDA
        elif isinstance(attention, GatedMLA):
            attention.__class__ = ContextParallelMLA
            attention.cp_headtail = self.balance == "headtail"
        else:
            raise ValueError(f"context parallelism does not know the mixer {type(attention).__name__}")
        attention.cp_slot = RowsSlot()

    def set_rows(self, layer, args: ModelArgs, L: int) -> tuple[torch.Tensor, ...]:
        """Give the installed layer this rank's facts of one packed row of `cp L` tokens that is
        one document (as `context_parallel.row_segments` derives them); returns their tensors
        (not the layer's: the batch's, shared by all layers)."""
        layout = segment_layout([0, self.cp * L], self.rank, self.cp, L)
        local_cu = torch.tensor(layout.local_bounds, dtype=torch.int32)
        starts_BT = torch.zeros(1, self.cp * L, dtype=torch.int32)
        width = args.kda_conv_size - 1
        conv_ids_BX = torch.zeros(1, width + L, dtype=torch.int32)
        if self.rank == 0:
            conv_ids_BX[:, :width] = -1  # before the row's start
        group = dist.group.WORLD
        layer.attention.cp_slot.rows = RowSegments(group, self.rank, self.cp, ((layout, local_cu),), starts_BT,
                                                   conv_ids_BX)
        return local_cu, starts_BT, conv_ids_BX


@contextlib.contextmanager
def fake_group(rank: int, cp: int):
    """Torch's fake process group of `cp` ranks as the default group, this process its rank
    `rank` (collectives move no data; their outputs are allocated as on a GPU), for the
    duration. Refused when a process group is already initialised."""
    if dist.is_initialized():
        raise RuntimeError("measuring a context-parallel layer needs a process without an initialised "
                           "process group (it plays one rank on torch's fake backend)")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cp)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


# =========================================================================== counted buffers
def cp_buffers(args: ModelArgs, a: int, cp: int, L: int, options: CPOptions = CPOptions(),
               local_batch: int = 1) -> dict[str, float]:
    """Bytes, per layer of each kind, of the per-row buffers one rank of a CP group holds
    (module docstring), for `L` local tokens a row and `local_batch` rows, at the rank the plan
    takes (`options`): a display of what the measured layers hold beyond a single-device
    layer, and the compiled count's context-parallel terms.

    mla.latent_gather: the all-gathered latents of the row, kept.
    mla.key_copies: the computed blocks' keys, kept.
    mla.exchange: "headtail"'s received layer inputs, kept (0 without the balance).
    mla.score_blocks: one fp32 score block of the largest query chunk (the forward and the
        backward each hold about four at their peak).
    kda.basis: a continuing rank's basis call over its whole segment, kept: the zero values
        `[L, H, dk]` and the call's own L2-normalised q and k (`kda_prepare`) in `a`, its fp32
        gate cumsum G, the basis in fp32 (the correction's einsum keeps it) and the op's
        residuals at dv = dk (0 on rank 0).
    kda.state_gather: the all-gathered `[M | S0]` states (fp32, one set a row).
    """
    R, S, D, T = args.mla_kv_lora_rank, args.mla_qk_shared_dim, args.dim, cp * L
    H, dk = args.kda_n_heads, args.kda_head_dim
    B = local_batch
    headtail = options.balance == "headtail"
    mla_rank = options.measured_rank("mla", cp)
    reach = T + L / 2 if headtail else (mla_rank + 1) * L
    rho, f = options.attention_shape(cp)
    chunk_rows = min(ATTENTION_CHUNK, rho * L)
    doc_span = float("inf") if options.max_doc_len is None else options.max_doc_len + ATTENTION_CHUNK
    chunk_span = min(f * L, doc_span)
    continues = options.measured_rank("kda", cp) > 0
    dtype = torch.bfloat16 if a == 2 else torch.float32
    # the zero values, the prepared q and k (`kda_prepare`: the basis call's own), its fp32 G
    # and the fp32 basis the correction's einsum keeps, and the op's residuals at dv = dk
    basis = (3 * a + 8) * H * dk + residual_bytes_per_token(H, dk, dk, dtype, True) if continues else 0.0
    return {
        "mla.latent_gather": float(B * T * (R + S) * a),
        "mla.key_copies": float(B * reach * (R + S) * a),
        "mla.exchange": float(B * L * D * a) if headtail else 0.0,
        "mla.score_blocks": float(B * args.mla_n_heads * chunk_rows * chunk_span * 4),
        "kda.basis": float(B * L * basis),
        "kda.state_gather": float(B * cp * H * dk * 2 * dk * 4),
    }
