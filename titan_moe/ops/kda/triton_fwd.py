"""Triton forward kernels for chunked bounded-decay delta attention (KDA, SPEC §1).

Per head, with state `S ∈ R^{dk×dv}` (fp32):

    S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T,   o_t = scale * S_t^T q_t

Chunked evaluation (chunk C = 64 tokens, cut into NC = 4 tiles of 16; G = cumsum of g
inside the chunk):

    stage 1  `_chunk_cumsum_kernel`   G = chunk-local cumsum(g) (skipped with `g_cumsum`: the
                                      input-map op `kda_prepare` then hands over G itself)
    stage 2  `_intra_columns_kernel`  A_qk[i,j] = scale Σ_c q_ic k_jc e^{G_ic - G_jc}   (j <= i)
                                      A_kk[i,j] = beta_i Σ_c k_ic k_jc e^{G_ic - G_jc}  (j <  i)
                                      Q^ = scale Q ⊙ e^G (the output's operand); one
                                      program per column tile
             `_diag_inverse_kernel`   X_II = (I + A_kk[I,I])^{-1} (diagonal 16x16 blocks)
             `_wy_kernel`             X = (I + A_kk)^{-1} (off-diagonal blocks),
                                      W = X (beta e^G ⊙ K),  U = X (beta V),
                                      K~ = e^{G_last - G} ⊙ K,  e^{G_last}
    stage 3  `_state_scan_kernel`     per sequence, chunk by chunk: store S (the chunk's
                                      initial state), V~ = U - W S,
                                      S <- Diag(e^{G_last}) S + K~^T V~
                                      (or, with `scan="segments"`, the segment scan of
                                      `triton_scan`, SPEC §8's context-parallel algebra)
    stage 4  `_output_kernel`         O = Q^ S + A_qk V~

Why every 16x16 tile of A is one dense dot (the kernel's contract, SPEC §1): the caller
guarantees `g >= g_min = -5` per token, so inside a 16-token tile G spans less than
16 * 5 = 80. Row tile I gets one anchor `c_I` = G at its middle row (row 8, or the middle
of the valid rows of a sequence's last tile). For rows i of tile I and columns j of any
tile J <= I,

    e^{G_i - G_j} = e^{G_i - c_I} * e^{c_I - G_j},
    G_i - c_I in [-35, 40]               (i is at most 8 rows before / 7 after the anchor)
    c_I - G_j in [-40, 35] if J == I,    <= 0 if J < I (j lies before the whole tile)

so both factors stay below e^40 ~ 2.4e17, far inside fp32 (max ~e^88.7): the tile is
`(x_I ⊙ e^{G_I - c_I}) @ (k_J ⊙ e^{c_I - G_J})^T`, one `tl.dot`, for the diagonal tile as
for the others. The diagonal tile differs only in the causal mask applied to the dot's
result; there is no per-position path. (`_intra_columns_kernel` anchors each column tile,
with the same bounds and the roles of rows and columns swapped.) Factors that underflow
(c_I - G_j < -87 for distant tiles) flush entries whose true value is below e^{40-87}, i.e.
negligible next to the O(1) entries. e^80 would overflow fp16, so exp-scaled operands are always fp32 here.

Inputs may be fp32, bf16 or fp16; `o` is written in v's dtype. G and the A matrices are
always fp32, and every dot outside the walks takes fp32 operands (inputs upcast on load):
`ieee` for fp32 inputs, tf32 otherwise (tf32 keeps 10 mantissa bits, more than the bf16
inputs carry); the 16x16 tile inverses always use ieee.

The sequential state walks (stage 3 here, stage 1 of `triton_bwd`) are serial and latency
bound: every exp and dot in the loop is paid chunk after chunk, for every block of state
columns. So everything that does not depend on the state comes from parallel kernels: K~
(input dtype) and e^{G_last} (fp32, `[chunks, H, dk]`) from `_wy_kernel`, scale Q ⊙ e^G and
A_qk^T dO (input dtype) from `triton_bwd._bwd_walk_prep_kernel`; a step does only what needs
the state: V~ = U - W S and S <- e^{G_last} ⊙ S + K~^T V~ (backward: dV~ += K~ dS',
dS = e^{G_last} ⊙ dS' + (scale Q ⊙ e^G)^T dO - W^T dV~), every dot on input-dtype operands
(the fp32 register state cast at the dot) with fp32 accumulation, as fla's chunk kernels do.
W, U, K~, V~, h (backward: dV~ and dh) are stored in the input dtype, so fp32 inputs keep
fp32 throughout. 16-bit operands halve the bytes a step loads and run at the tensor cores'
16-bit rate; h and dh (dk dv / C values a token) are the largest intermediates. h and dh in
bf16 (as fla keeps h) rather than fp32 was decided on accuracy: the bf16 errors against the
float64 recurrence stay within the bounds of the GPU tests, and fp32 h and dh would improve
dk and dg by about a tenth only.

Bytes per token and head of the forward's intermediates (C = 64; s = 2 for bf16/fp16 inputs,
4 for fp32; in brackets dk = dv = 128 with bf16 inputs): G 4 dk, A_qk / A_inv 4 C each (A_kk
freed before the walk), W s dk, U s dv (freed after the walk), K~ s dk, V~ s dv,
h s dk dv / C, e^{G_last} 4 dk / C: [2568 at the walk, 2312 returned]; with fp32 inputs
4104 / 3592. The backward's walk (`triton_bwd`) adds dh s dk dv / C, dV~ s dv and
scale Q ⊙ e^G s dk ([1024]) and frees W, K~, e^{G_last} and scale Q ⊙ e^G after it: [4612]
at the backward's end (fp32 inputs 6148).

Token layout: every kernel sees the inputs as one flat token stream `[TT, H, d]`
(`TT = B*T`), cut into sequences by `cu_seqlens` (fixed-length batches get
`cu_seqlens = [0, T, 2T, ...]`). `chunk_indices [NCH, 2]` lists (sequence, chunk-in-sequence)
for every chunk; `chunk_offsets [N+1]` is the index of each sequence's first chunk.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from titan_moe.ops import launch_env
from titan_moe.ops.kda.chunk_torch import CHUNK, check_kda_inputs, seqlens_bounds
from titan_moe.ops.kda.kept import RESIDUAL_NAMES, max_chunk_rows, residual_specs
from titan_moe.ops.triton_runtime import is_interpreted, launch_with_fewer_stages_if_needed, sm_count

TILE = 16  # BC: tokens per sub-chunk tile; the span exponentiated directly
N_TILES = CHUNK // TILE
# register cap of `_wy_kernel` (Triton's maxnreg): at dk = dv = 128 on sm_90 it takes 206
# registers uncapped (2 blocks of 4 warps per SM) and 168 with a 24-byte stack capped (3
# blocks, `profiling/kernel_resources.py`). A launch option only: results do not change.
WY_MAXNREG = 168
_SUPPORTED_DIMS = (16, 32, 64, 128)
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------------------
# shared index helpers
# ----------------------------------------------------------------------------------------
@triton.jit
def _chunk_location(cu_seqlens, chunk_indices, i_c):
    """(bos, T, i_t) of flat chunk `i_c`: first token and length of its sequence, chunk-in-sequence."""
    i_n = tl.load(chunk_indices + 2 * i_c)
    i_t = tl.load(chunk_indices + 2 * i_c + 1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    return bos, eos - bos, i_t


@triton.jit
def _tile_location(cu_seqlens, chunk_indices, BT: tl.constexpr, BC: tl.constexpr):
    """(bos, T, i_t, i_i, i_h, row0) of a per-tile program (grid (chunks * BT // BC, H)):
    `_chunk_location` of its chunk, its tile i_i in the chunk, its head and the tile's first
    row in the sequence (row0 >= T: the tile is past the sequence's end)."""
    i_ci, i_h = tl.program_id(0), tl.program_id(1)
    i_c, i_i = i_ci // (BT // BC), i_ci % (BT // BC)
    bos, T, i_t = _chunk_location(cu_seqlens, chunk_indices, i_c)
    return bos, T, i_t, i_i, i_h, i_t * BT + i_i * BC


# ----------------------------------------------------------------------------------------
# stage 1: chunk-local cumulative decay
# ----------------------------------------------------------------------------------------
@triton.jit
def _chunk_cumsum_kernel(g, G, cu_seqlens, chunk_indices, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr):
    """G[t] = Σ_{s <= t, s in t's chunk} g[s], per channel.

    g: `[TT, H, K]` (any float dtype), G: `[TT, H, K]` fp32. Grid: (chunks, H).
    """
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, T, i_t = _chunk_location(cu_seqlens, chunk_indices, i_c)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = (o_t < T)[:, None]
    offs = ((bos + o_t) * H + i_h)[:, None] * K + tl.arange(0, K)[None, :]
    b_g = tl.load(g + offs, mask=m_t, other=0.0).to(tl.float32)
    tl.store(G + offs, tl.cumsum(b_g, axis=0), mask=m_t)


# ----------------------------------------------------------------------------------------
# stage 2a: A_qk and A_kk, one dense dot per 16x16 tile
# ----------------------------------------------------------------------------------------
@triton.jit
def _intra_columns_kernel(
    q, k, G, beta, Aqk, Akk, q_decay, scale, cu_seqlens, chunk_indices,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    PRECISION: tl.constexpr, STORE_Q_DECAY: tl.constexpr,
):
    """Column tile J of one chunk: tiles (I >= J, J) of A_qk and A_kk as one `[BT, BC]` dot
    pair over the chunk's rows.

    q, k, G: `[TT, H, K]`; beta `[TT, H]`; Aqk, Akk: `[TT, H, BT]` fp32, row t holding its
    chunk's row (columns are chunk positions). Only tiles on or below the diagonal are
    written, and in them only rows of valid tokens; readers mask accordingly. With
    STORE_Q_DECAY also q_decay = scale Q ⊙ e^G (`[TT, H, K]`, its dtype; e^G <= 1).

    One anchor c_J = G at the column tile's middle row serves every row tile: rows i >= 16 J
    have G_i - c_J <= 40 (G falls along the chunk) and the columns c_J - G_j <= 40 (the
    module docstring's bounds with the roles of rows and columns swapped); rows before the
    column tile get exp(-inf) = 0 (their factor could overflow, and their entries lie above
    the diagonal). The reduction over dk runs in K // BK steps of BK columns (registers).
    With STORE_Q_DECAY also the column tile's own rows of q_decay = scale Q ⊙ e^G.
    Grid: (chunks * BT // BC, H).
    """
    bos, T, i_t, i_j, i_h, col0 = _tile_location(cu_seqlens, chunk_indices, BT, BC)
    if col0 >= T:
        return
    o_t = tl.arange(0, BT)
    o_r = tl.arange(0, BC)
    rows = i_t * BT + o_t
    m_rows = (rows < T) & (o_t >= i_j * BC)  # the rows at or below the column tile
    cols = col0 + o_r
    m_c = cols < T
    tok_r = (bos + rows) * H + i_h
    tok_c = (bos + cols) * H + i_h
    anchor = col0 + tl.minimum(T - col0, BC) // 2  # middle of the valid rows
    b_beta = tl.load(beta + tok_r, mask=m_rows, other=0.0).to(tl.float32)
    b_aqk = tl.zeros([BT, BC], dtype=tl.float32)
    b_akk = tl.zeros([BT, BC], dtype=tl.float32)
    for i_k in tl.static_range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_c = tl.load(G + ((bos + anchor) * H + i_h) * K + o_k)
        p_c = tok_c[:, None] * K + o_k[None, :]
        b_kc = tl.load(k + p_c, mask=m_c[:, None], other=0.0).to(tl.float32)
        b_Gc = tl.load(G + p_c, mask=m_c[:, None], other=0.0)
        b_k_col_t = tl.trans(b_kc * tl.exp(tl.where(m_c[:, None], b_c[None, :] - b_Gc, float("-inf"))))  # <= e^40
        p_r = tok_r[:, None] * K + o_k[None, :]
        b_q = tl.load(q + p_r, mask=m_rows[:, None], other=0.0).to(tl.float32)
        b_k = tl.load(k + p_r, mask=m_rows[:, None], other=0.0).to(tl.float32)
        b_G = tl.load(G + p_r, mask=m_rows[:, None], other=0.0)
        b_row_decay = tl.exp(tl.where(m_rows[:, None], b_G - b_c[None, :], float("-inf")))  # <= e^40
        b_aqk += tl.dot(b_q * b_row_decay * scale, b_k_col_t, input_precision=PRECISION)
        b_akk += tl.dot(b_k * b_row_decay, b_k_col_t, input_precision=PRECISION)
        if STORE_Q_DECAY:  # the column tile's own rows (e^G <= 1)
            b_qc = tl.load(q + p_c, mask=m_c[:, None], other=0.0).to(tl.float32)
            tl.store(q_decay + p_c, (b_qc * tl.exp(b_Gc) * scale).to(q_decay.dtype.element_ty), mask=m_c[:, None])
    # causal masks in chunk coordinates: j <= i for A_qk, j < i for A_kk (entries dropped in
    # the diagonal tile are finite: each factor is at most e^40)
    o_col = i_j * BC + o_r
    p_a = tok_r[:, None] * BT + o_col[None, :]
    tl.store(Aqk + p_a, tl.where(o_t[:, None] >= o_col[None, :], b_aqk, 0.0), mask=m_rows[:, None])
    tl.store(Akk + p_a, tl.where(o_t[:, None] > o_col[None, :], b_akk * b_beta[:, None], 0.0), mask=m_rows[:, None])


# ----------------------------------------------------------------------------------------
# stage 2b: the diagonal blocks of (I + A_kk)^{-1}
# ----------------------------------------------------------------------------------------
@triton.jit
def _diag_inverse_kernel(Akk, Ainv, cu_seqlens, chunk_indices, H: tl.constexpr, BT: tl.constexpr,
                         BC: tl.constexpr):
    """X_II = (I + A_kk[I,I])^{-1} for diagonal tile I of one chunk, into Ainv's diagonal.

    Akk, Ainv: `[TT, H, BT]` fp32 (A_kk's diagonal tiles are strictly lower, from
    `_intra_columns_kernel`). The substitution is a chain of BC - 1 dependent row steps, each
    a reduction across the tile; launched with one warp, those reductions are register
    shuffles inside the warp, with no barrier between warps (the same four chains per chunk
    interleaved inside `_wy_kernel`'s four warps cost several times more). Grid:
    (chunks * BT // BC, H).
    """
    bos, T, i_t, i_i, i_h, row0 = _tile_location(cu_seqlens, chunk_indices, BT, BC)
    if row0 >= T:
        return
    o = tl.arange(0, BC)
    rows = row0 + o
    p = ((bos + rows) * H + i_h)[:, None] * BT + (i_i * BC + o)[None, :]
    m = (rows < T)[:, None]
    b_X = _invert_unit_lower_tile(tl.load(Akk + p, mask=m, other=0.0), BC)
    tl.store(Ainv + p, b_X, mask=m)


# ----------------------------------------------------------------------------------------
# stage 2c: the rest of (I + A_kk)^{-1} and the WY factors W, U
# ----------------------------------------------------------------------------------------
@triton.jit
def _substitution_step(b_A, b_X, is_r):
    """One row of forward substitution: row r of X = (I + A)^{-1} (rows < r final) is
    `e_r - Σ_{m<r} A[r, m] X[m, :]`; `is_r` selects row r."""
    b_a_r = tl.sum(tl.where(is_r, b_A, 0.0), axis=0)  # A[r, :], indexed by m
    b_x_r = -tl.sum(b_a_r[:, None] * b_X, axis=0)  # -Σ_m A[r, m] X[m, :]
    return tl.where(is_r, b_X + b_x_r[None, :], b_X)


@triton.jit
def _invert_unit_lower_tile(b_A, BC: tl.constexpr):
    """(I + A)^{-1} of a strictly lower-triangular `[BC, BC]` tile (a chunk's diagonal block),
    by forward substitution, rows filled in order so that the rows a step reads are final.
    (The log-depth product (I - A)(I + A^2)(I + A^4)... is shorter but sums terms far larger
    than the result; substitution is stable.)
    """
    o = tl.arange(0, BC)
    b_X = (o[:, None] == o[None, :]).to(tl.float32)
    for r in tl.static_range(1, BC):
        b_X = _substitution_step(b_A, b_X, o[:, None] == r)
    return b_X


@triton.jit
def _load_a_tile(Akk, bos, T, i_t, i_h, I: tl.constexpr, J: tl.constexpr, H: tl.constexpr,
                 BT: tl.constexpr, BC: tl.constexpr):
    """Tile (I, J) of a chunk's A_kk (`[BC, BC]` fp32), zero on rows of invalid tokens."""
    o = tl.arange(0, BC)
    rows = i_t * BT + I * BC + o
    p = ((bos + rows) * H + i_h)[:, None] * BT + (J * BC + o)[None, :]
    return tl.load(Akk + p, mask=(rows < T)[:, None], other=0.0)


@triton.jit
def _load_rows(x, bos, T, i_t, i_h, I: tl.constexpr, o_d, H: tl.constexpr, D: tl.constexpr,
               BT: tl.constexpr, BC: tl.constexpr):
    """Rows of tile I of a chunk from a `[TT, H, D]` tensor, columns `o_d`, as fp32 (0 if invalid)."""
    rows = i_t * BT + I * BC + tl.arange(0, BC)
    p = ((bos + rows) * H + i_h)[:, None] * D + o_d[None, :]
    return tl.load(x + p, mask=(rows < T)[:, None], other=0.0).to(tl.float32)


@triton.jit
def _load_beta(beta, bos, T, i_t, i_h, I: tl.constexpr, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """beta for the rows of tile I of a chunk (`[BC]` fp32, 0 if invalid)."""
    rows = i_t * BT + I * BC + tl.arange(0, BC)
    return tl.load(beta + (bos + rows) * H + i_h, mask=rows < T, other=0.0).to(tl.float32)


@triton.jit
def _store_rows(x, b_x, bos, T, i_t, i_h, I: tl.constexpr, o_d, H: tl.constexpr, D: tl.constexpr,
                BT: tl.constexpr, BC: tl.constexpr):
    """Store `b_x [BC, len(o_d)]` into the rows of tile I of a chunk (valid tokens only)."""
    rows = i_t * BT + I * BC + tl.arange(0, BC)
    p = ((bos + rows) * H + i_h)[:, None] * D + o_d[None, :]
    tl.store(x + p, b_x.to(x.dtype.element_ty), mask=(rows < T)[:, None])


@triton.jit
def _store_tril_product(out, b_X00, b_X10, b_X11, b_X20, b_X21, b_X22, b_X30, b_X31, b_X32, b_X33,
                        b_y0, b_y1, b_y2, b_y3, bos, T, i_t, i_h, o_d, H: tl.constexpr, D: tl.constexpr,
                        BT: tl.constexpr, BC: tl.constexpr, PRECISION: tl.constexpr):
    """out[chunk rows, o_d] = X @ Y for block lower-triangular X (4x4 blocks of 16), Y given
    as its 4 row blocks `[BC, len(o_d)]`; out is `[TT, H, D]`."""
    b_r0 = tl.dot(b_X00, b_y0, input_precision=PRECISION)
    b_r1 = tl.dot(b_X10, b_y0, input_precision=PRECISION) + tl.dot(b_X11, b_y1, input_precision=PRECISION)
    b_r2 = tl.dot(b_X20, b_y0, input_precision=PRECISION) + tl.dot(b_X21, b_y1, input_precision=PRECISION)
    b_r2 += tl.dot(b_X22, b_y2, input_precision=PRECISION)
    b_r3 = tl.dot(b_X30, b_y0, input_precision=PRECISION) + tl.dot(b_X31, b_y1, input_precision=PRECISION)
    b_r3 += tl.dot(b_X32, b_y2, input_precision=PRECISION) + tl.dot(b_X33, b_y3, input_precision=PRECISION)
    _store_rows(out, b_r0, bos, T, i_t, i_h, 0, o_d, H, D, BT, BC)
    _store_rows(out, b_r1, bos, T, i_t, i_h, 1, o_d, H, D, BT, BC)
    _store_rows(out, b_r2, bos, T, i_t, i_h, 2, o_d, H, D, BT, BC)
    _store_rows(out, b_r3, bos, T, i_t, i_h, 3, o_d, H, D, BT, BC)


@triton.jit
def _key_tile(k, G, Kt, b_beta, b_G_last, bos, T, i_t, i_h, I: tl.constexpr, o_k, H: tl.constexpr,
              K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Rows of tile I, columns o_k of `beta e^G ⊙ K` (W's right factor); also stores them as
    `K~ = e^{G_last - G} ⊙ K` into Kt (0 on invalid rows: k loads as 0)."""
    b_G = _load_rows(G, bos, T, i_t, i_h, I, o_k, H, K, BT, BC)
    b_k = _load_rows(k, bos, T, i_t, i_h, I, o_k, H, K, BT, BC)
    _store_rows(Kt, b_k * tl.exp(b_G_last[None, :] - b_G), bos, T, i_t, i_h, I, o_k, H, K, BT, BC)
    return b_beta * tl.exp(b_G) * b_k


@triton.jit
def _wy_kernel(
    k, v, G, beta, Akk, Ainv, W, U, Kt, decay, cu_seqlens, chunk_indices,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    """X = (I + A_kk)^{-1} for one chunk, then W = X (beta e^G ⊙ K) and U = X (beta V).

    Akk: `[TT, H, BT]` off-diagonal tiles from `_intra_columns_kernel`; Ainv: `[TT, H, BT]`
    fp32 holds X's diagonal blocks (from `_diag_inverse_kernel`) and receives the
    rest of its lower block triangle; W `[TT, H, K]`, U `[TT, H, V]` in the input dtype
    (stores cast). The chunk is 4 tiles of 16 (BT == 4 * BC). X is block lower triangular:
    X_IJ = -X_II Σ_{J<=M<I} A_IM X_MJ for J < I. e^G <= 1 here (G <= 0).
    Also the walk's state-independent factors: Kt `[TT, H, K]` (input dtype) receives
    K~ = e^{G_last - G} ⊙ K, decay `[chunks, H, K]` fp32 e^{G_last} (G_last = G at the
    chunk's last valid token). Grid: (chunks, H).
    """
    tl.static_assert(BT == 4 * BC)
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, T, i_t = _chunk_location(cu_seqlens, chunk_indices, i_c)

    # off-diagonal blocks of A_kk and the diagonal blocks of X (`_diag_inverse_kernel`)
    b_A10 = _load_a_tile(Akk, bos, T, i_t, i_h, 1, 0, H, BT, BC)
    b_A20 = _load_a_tile(Akk, bos, T, i_t, i_h, 2, 0, H, BT, BC)
    b_A21 = _load_a_tile(Akk, bos, T, i_t, i_h, 2, 1, H, BT, BC)
    b_A30 = _load_a_tile(Akk, bos, T, i_t, i_h, 3, 0, H, BT, BC)
    b_A31 = _load_a_tile(Akk, bos, T, i_t, i_h, 3, 1, H, BT, BC)
    b_A32 = _load_a_tile(Akk, bos, T, i_t, i_h, 3, 2, H, BT, BC)
    b_X00 = _load_a_tile(Ainv, bos, T, i_t, i_h, 0, 0, H, BT, BC)
    b_X11 = _load_a_tile(Ainv, bos, T, i_t, i_h, 1, 1, H, BT, BC)
    b_X22 = _load_a_tile(Ainv, bos, T, i_t, i_h, 2, 2, H, BT, BC)
    b_X33 = _load_a_tile(Ainv, bos, T, i_t, i_h, 3, 3, H, BT, BC)

    # off-diagonal blocks, one block diagonal at a time
    b_X10 = -tl.dot(tl.dot(b_X11, b_A10, input_precision="ieee"), b_X00, input_precision="ieee")
    b_X21 = -tl.dot(tl.dot(b_X22, b_A21, input_precision="ieee"), b_X11, input_precision="ieee")
    b_X32 = -tl.dot(tl.dot(b_X33, b_A32, input_precision="ieee"), b_X22, input_precision="ieee")
    b_X20 = -tl.dot(
        b_X22,
        tl.dot(b_A20, b_X00, input_precision="ieee") + tl.dot(b_A21, b_X10, input_precision="ieee"),
        input_precision="ieee",
    )
    b_X31 = -tl.dot(
        b_X33,
        tl.dot(b_A31, b_X11, input_precision="ieee") + tl.dot(b_A32, b_X21, input_precision="ieee"),
        input_precision="ieee",
    )
    b_X30 = -tl.dot(
        b_X33,
        tl.dot(b_A30, b_X00, input_precision="ieee")
        + tl.dot(b_A31, b_X10, input_precision="ieee")
        + tl.dot(b_A32, b_X20, input_precision="ieee"),
        input_precision="ieee",
    )

    # keep X for the backward pass (its diagonal blocks are there already)
    o_c = tl.arange(0, BC)
    _store_rows(Ainv, b_X10, bos, T, i_t, i_h, 1, o_c, H, BT, BT, BC)
    _store_rows(Ainv, b_X20, bos, T, i_t, i_h, 2, o_c, H, BT, BT, BC)
    _store_rows(Ainv, b_X21, bos, T, i_t, i_h, 2, BC + o_c, H, BT, BT, BC)
    _store_rows(Ainv, b_X30, bos, T, i_t, i_h, 3, o_c, H, BT, BT, BC)
    _store_rows(Ainv, b_X31, bos, T, i_t, i_h, 3, BC + o_c, H, BT, BT, BC)
    _store_rows(Ainv, b_X32, bos, T, i_t, i_h, 3, 2 * BC + o_c, H, BT, BT, BC)

    b_b0 = _load_beta(beta, bos, T, i_t, i_h, 0, H, BT, BC)[:, None]
    b_b1 = _load_beta(beta, bos, T, i_t, i_h, 1, H, BT, BC)[:, None]
    b_b2 = _load_beta(beta, bos, T, i_t, i_h, 2, H, BT, BC)[:, None]
    b_b3 = _load_beta(beta, bos, T, i_t, i_h, 3, H, BT, BC)[:, None]

    # W = X (beta e^G ⊙ K), one block of K columns at a time (and K~, e^{G_last})
    last = tl.minimum(i_t * BT + BT, T) - 1
    for i_k in range(0, K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_G_last = tl.load(G + ((bos + last) * H + i_h) * K + o_k)
        tl.store(decay + (i_c.to(tl.int64) * H + i_h) * K + o_k, tl.exp(b_G_last))
        b_y0 = _key_tile(k, G, Kt, b_b0, b_G_last, bos, T, i_t, i_h, 0, o_k, H, K, BT, BC)
        b_y1 = _key_tile(k, G, Kt, b_b1, b_G_last, bos, T, i_t, i_h, 1, o_k, H, K, BT, BC)
        b_y2 = _key_tile(k, G, Kt, b_b2, b_G_last, bos, T, i_t, i_h, 2, o_k, H, K, BT, BC)
        b_y3 = _key_tile(k, G, Kt, b_b3, b_G_last, bos, T, i_t, i_h, 3, o_k, H, K, BT, BC)
        _store_tril_product(W, b_X00, b_X10, b_X11, b_X20, b_X21, b_X22, b_X30, b_X31, b_X32, b_X33,
                            b_y0, b_y1, b_y2, b_y3, bos, T, i_t, i_h, o_k, H, K, BT, BC, PRECISION)

    # U = X (beta V)
    for i_v in range(0, V // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        b_y0 = b_b0 * _load_rows(v, bos, T, i_t, i_h, 0, o_v, H, V, BT, BC)
        b_y1 = b_b1 * _load_rows(v, bos, T, i_t, i_h, 1, o_v, H, V, BT, BC)
        b_y2 = b_b2 * _load_rows(v, bos, T, i_t, i_h, 2, o_v, H, V, BT, BC)
        b_y3 = b_b3 * _load_rows(v, bos, T, i_t, i_h, 3, o_v, H, V, BT, BC)
        _store_tril_product(U, b_X00, b_X10, b_X11, b_X20, b_X21, b_X22, b_X30, b_X31, b_X32, b_X33,
                            b_y0, b_y1, b_y2, b_y3, bos, T, i_t, i_h, o_v, H, V, BT, BC, PRECISION)


# ----------------------------------------------------------------------------------------
# stage 3: the inter-chunk state recurrence
# ----------------------------------------------------------------------------------------
@triton.jit
def _scan_chunk(W, U, Kt, h, v_new, b_S, b_decay, i_t, bos, T, boc, i_h, o_k, o_v,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, PRECISION: tl.constexpr):
    """One chunk of the state recurrence: store S, write V~ = U - W S, return the next S.

    The state b_S stays fp32; the dots take it (and V~) in W's dtype (the input dtype, fp32
    accumulation). K~ comes from `_wy_kernel`, e^{G_last} as `b_decay`, which the walk
    loaded one chunk ahead (`_prefetch_decay`).
    """
    tl.store(h + ((boc + i_t) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :], b_S.to(h.dtype.element_ty))
    rows = i_t * BT + tl.arange(0, BT)
    m_r = (rows < T)[:, None]
    tok = (bos + rows) * H + i_h
    b_w = tl.load(W + tok[:, None] * K + o_k[None, :], mask=m_r, other=0.0)
    b_u = tl.load(U + tok[:, None] * V + o_v[None, :], mask=m_r, other=0.0).to(tl.float32)
    b_vn = b_u - tl.dot(b_w, b_S.to(b_w.dtype), input_precision=PRECISION)
    tl.store(v_new + tok[:, None] * V + o_v[None, :], b_vn.to(v_new.dtype.element_ty), mask=m_r)
    b_k_to_end = tl.load(Kt + tok[:, None] * K + o_k[None, :], mask=m_r, other=0.0)
    return b_S * b_decay[:, None] + tl.dot(tl.trans(b_k_to_end), b_vn.to(b_k_to_end.dtype), input_precision=PRECISION)


@triton.jit
def _prefetch_decay(decay, boc, i_t, n_chunks, i_h, o_k, H: tl.constexpr, K: tl.constexpr):
    """e^{G_last} of chunk i_t (`[K]` fp32 from `decay [chunks, H, K]`), zeros when i_t is
    outside [0, n_chunks).

    The walks call this one chunk ahead: Triton's software pipeliner (3.6) leaves this
    small load in the loop body, where its global-memory latency sat on the walk's critical
    path every chunk (`profiling/kernel_resources.py`'s `loop loads` column finds such loads)."""
    valid = (i_t >= 0) & (i_t < n_chunks)
    # (o_k < K) is all true: it turns the scalar condition into a [K] mask
    return tl.load(decay + ((boc + i_t) * H + i_h) * K + o_k, mask=(o_k < K) & valid, other=0.0)


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision of the kernels' fp32-operand products (the anchored tiles
    e^(G - c) q / k, the WY products, dA's products): "ieee" for fp32 (and wider) inputs,
    "tf32" for 16-bit ones (tf32 keeps 10 mantissa bits, more than bf16 inputs carry; the
    backward's intra kernel rounds the operands of each cancelling pair alike, so tf32
    suffices for the gate's gradient there too, `triton_bwd._bwd_intra_kernel`). Dots of
    16-bit operands run at the operands' precision whatever this says."""
    return "ieee" if dtype.itemsize >= 4 else "tf32"


SCAN_BV_ENV = "TITAN_MOE_KDA_SCAN_BV"  # state columns per program of the sequential walks
SCAN_WARPS_ENV = "TITAN_MOE_KDA_SCAN_WARPS"  # warps per program of the sequential walks
SCAN_STAGES_ENV = "TITAN_MOE_KDA_SCAN_STAGES"  # "FWDxBWD" software-pipeline stages of the walks


def walk_tiles_wide(K: int, dtype: torch.dtype) -> bool:
    """Whether the walks' `[BT, dk]` operands are fp32 tiles wider than 64 columns (32-bit
    inputs at dk > 64): `scan_stages`' `wide_tiles`."""
    return K > 64 and dtype.itemsize != 2


def scan_stages(BV: int, wide_tiles: bool) -> tuple[int, int]:
    """(forward, backward) software-pipeline stages of the sequential walks at BV state
    columns per program. `wide_tiles`: the walks' `[BT, dk]` operands are fp32 at dk > 64
    (fp32 inputs), whose shared memory fits 2 stages forward and 1 backward on sm_90.
    Otherwise 3 at BV = 16 (the walks of few, long sequences, where the next chunks' loads
    are the latency to hide), else 2. `$TITAN_MOE_KDA_SCAN_STAGES` ("FWDxBWD", 1-4 each,
    read per call) overrides both for tuning; the walks launch through
    `launch_with_fewer_stages_if_needed`, so a count whose shared memory does not fit falls
    back to fewer stages with a warning."""
    fwd, bwd = (2, 1) if wide_tiles else (3, 3) if BV <= 16 else (2, 2)
    fwd, bwd = _env_ints(SCAN_STAGES_ENV, f"{fwd}x{bwd}", "3x3 (FWDxBWD)", 2)
    if not (1 <= fwd <= 4 and 1 <= bwd <= 4):
        raise ValueError(f"{SCAN_STAGES_ENV}: stages must be 1 to 4, got {fwd}x{bwd}")
    return fwd, bwd


def sequential_scan_config(K: int, V: int, walks: int = 1, n_sms: int | None = None) -> tuple[int, int]:
    """(BV, num_warps) of the sequential state walks, forward and backward.

    The walks run `walks * (V / BV)` programs (`walks` = sequences x heads), each over all
    chunks of its sequence. Default: 4 warps and the widest BV (16, 32, 64 or 128, at most V)
    that still gives every SM a program (`n_sms`, default the current CUDA device's count);
    when even BV = 16 does not, BV = 16: a walk is latency bound, so idle SMs cost more
    than narrower programs. `$TITAN_MOE_KDA_SCAN_BV` (16, 32, 64 or 128; at most V) and
    `$TITAN_MOE_KDA_SCAN_WARPS` (1-16, a power of two) override them for tuning, read per call.
    """
    env_bv = launch_env.read(SCAN_BV_ENV)
    if env_bv:
        bv = int(env_bv)
    else:
        n_sms = n_sms if n_sms is not None else sm_count()
        widths = [w for w in (128, 64, 32, 16) if w <= V]
        bv = next((w for w in widths if walks * (V // w) >= n_sms), widths[-1])
    warps = int(launch_env.read(SCAN_WARPS_ENV) or 4)
    if bv not in (16, 32, 64, 128) or bv > V:
        raise ValueError(f"{SCAN_BV_ENV} must be 16, 32, 64 or 128 and at most dv = {V}, got {bv}")
    if warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"{SCAN_WARPS_ENV} must be a power of two in [1, 16], got {warps}")
    if bv == 16 and warps >= 8:
        # the backward walk hits an illegal memory access at 16 columns and 8 warps (sm_90,
        # Triton 3.6, dk = 128; the interpreter agrees with the reference there)
        raise ValueError(f"{SCAN_BV_ENV}=16 needs {SCAN_WARPS_ENV} <= 4 (16 x 8 crashes the backward walk)")
    return bv, warps


@triton.jit
def _state_scan_kernel(
    W, U, Kt, decay, h, v_new, h0, ht, cu_seqlens, chunk_offsets,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """Walk one sequence's chunks for one head and one block of BV state columns.

    W, Kt: `[TT, H, K]`; U, v_new: `[TT, H, V]` (input dtype); h: `[chunks, H, K, V]`
    (input dtype) receives each chunk's initial state; h0, ht: `[N, H, K, V]` fp32; decay
    `[chunks, H, K]` fp32 (Kt and decay from `_wy_kernel`). Per chunk: V~ = U - W S, then
    S <- Diag(e^{G_last}) S + K~^T V~, where G_last is G at the chunk's last valid token (all
    exponents <= 0). Grid: (V // BV, N * H).
    """
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    boc = tl.load(chunk_offsets + i_n).to(tl.int64)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    p_S = i_h * K * V + o_k[:, None] * V + o_v[None, :]  # within one [H, K, V] state

    if HAS_H0:
        b_S = tl.load(h0 + i_n * H * K * V + p_S)
    else:
        b_S = tl.zeros([K, BV], dtype=tl.float32)
    n_chunks = tl.cdiv(T, BT)
    b_decay = _prefetch_decay(decay, boc, 0, n_chunks, i_h, o_k, H, K)
    if INTERPRETED:
        # Triton 3.6's interpreter cannot take a runtime bound in range() (it calls int()
        # on a 1-element array), so it walks the chunks with a while loop.
        i_t = tl.zeros([], dtype=tl.int64)
        while i_t < n_chunks:
            b_decay_next = _prefetch_decay(decay, boc, i_t + 1, n_chunks, i_h, o_k, H, K)
            b_S = _scan_chunk(W, U, Kt, h, v_new, b_S, b_decay, i_t, bos, T, boc, i_h, o_k, o_v,
                              H, K, V, BT, PRECISION)
            b_decay = b_decay_next
            i_t += 1
    else:
        # compiled: a for loop, which the compiler software-pipelines (loads of the next
        # chunk overlap this chunk's dots; the decay row, which it leaves in the loop body,
        # is loaded one chunk ahead by hand)
        for i_t in range(0, n_chunks):
            b_decay_next = _prefetch_decay(decay, boc, i_t + 1, n_chunks, i_h, o_k, H, K)
            b_S = _scan_chunk(W, U, Kt, h, v_new, b_S, b_decay, i_t, bos, T, boc, i_h, o_k, o_v,
                              H, K, V, BT, PRECISION)
            b_decay = b_decay_next
    if STORE_HT:
        tl.store(ht + i_n * H * K * V + p_S, b_S)


# ----------------------------------------------------------------------------------------
# stage 4: outputs
# ----------------------------------------------------------------------------------------
@triton.jit
def _output_kernel(
    q_decay, Aqk, h, v_new, o, cu_seqlens, chunk_indices,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """O = (scale Q ⊙ e^G) S + A_qk V~ for one chunk, head and block of BV outputs.

    q_decay: `[TT, H, K]` scale Q ⊙ e^G from `_intra_columns_kernel`, h: `[chunks, H, K, V]`,
    v_new `[TT, H, V]`, all three in the input dtype: the first dot takes them as they are
    (fp32 accumulation, as the walk's own dots); Aqk: `[TT, H, BT]` fp32 (scale included,
    lower triangle incl. the diagonal is valid), the second dot upcasts V~ to it; o
    `[TT, H, V]`.
    Grid: (V // BV, chunks, H).
    """
    i_v, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, T, i_t = _chunk_location(cu_seqlens, chunk_indices, i_c)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    rows = i_t * BT + o_t
    m_r = (rows < T)[:, None]
    tok = (bos + rows) * H + i_h

    b_qd = tl.load(q_decay + tok[:, None] * K + o_k[None, :], mask=m_r, other=0.0)
    b_S = tl.load(h + (i_c.to(tl.int64) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :])
    b_o = tl.dot(b_qd, b_S.to(b_qd.dtype), input_precision=PRECISION)

    m_a = m_r & (o_t[:, None] >= o_t[None, :])
    b_A = tl.load(Aqk + tok[:, None] * BT + o_t[None, :], mask=m_a, other=0.0)
    b_vn = tl.load(v_new + tok[:, None] * V + o_v[None, :], mask=m_r, other=0.0).to(tl.float32)
    b_o += tl.dot(b_A, b_vn, input_precision=PRECISION)
    tl.store(o + tok[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_r)


# ----------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------
def _interpreted() -> bool:
    """Whether the kernels were built for the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    return is_interpreted(_state_scan_kernel)


def _chunk_layout(bounds: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cu_seqlens int32 `[N+1]`, chunk_indices int32 `[chunks, 2]`, chunk_offsets int32 `[N+1]`.

    Built once per (bounds, device) and shared (read-only) by later calls: every step of a
    fixed-length batch has the same layout, and building it anew costs three pageable
    host-to-device copies, each of which blocks the host until the GPU has drained its
    queue, so that the GPU then idles while the host launches the next kernels."""
    return _chunk_layout_cached(tuple(bounds), torch.device(device))


@functools.lru_cache(maxsize=64)
def _chunk_layout_cached(bounds: tuple[int, ...], device: torch.device):
    n_chunks = [-(-(e - s) // CHUNK) for s, e in zip(bounds[:-1], bounds[1:])]
    indices = [(n, t) for n, nt in enumerate(n_chunks) for t in range(nt)]
    offsets = [0]
    for nt in n_chunks:
        offsets.append(offsets[-1] + nt)
    return (
        torch.tensor(bounds, dtype=torch.int32, device=device),
        torch.tensor(indices, dtype=torch.int32, device=device).view(-1, 2),
        torch.tensor(offsets, dtype=torch.int32, device=device),
    )


@dataclass
class KDAForwardState:
    """Intermediates of the chunked forward (stages 1-3), kept for the output stage and
    the backward pass (`TT = B*T` tokens, `C = 64`; dtypes in the module docstring).

    G `[TT, H, dk]` fp32; Aqk, Ainv `[TT, H, C]` fp32 (row t holds its chunk's row; the lower
    triangle incl. the diagonal is valid, A_qk includes `scale`); W `[TT, H, dk]`;
    v_new `[TT, H, dv]`; h `[chunks, H, dk, dv]` (each chunk's initial state);
    final_state `[N, H, dk, dv]` fp32 or None; the chunk layout; the dot precision used;
    k_to_end `[TT, H, dk]` (e^{G_last - G} ⊙ K) and decay `[chunks, H, dk]` fp32
    (e^{G_last}); q_decay `[TT, H, dk]` (scale Q ⊙ e^G, for the output; None in the
    backward's recompute and in a state rebuilt from residuals). W, v_new, h, k_to_end and
    q_decay are in the input dtype. U (the forward walk's input) is not kept.
    """

    G: torch.Tensor
    Aqk: torch.Tensor
    Ainv: torch.Tensor
    W: torch.Tensor | None
    h: torch.Tensor
    v_new: torch.Tensor
    final_state: torch.Tensor | None
    cu_seqlens: torch.Tensor
    chunk_indices: torch.Tensor
    chunk_offsets: torch.Tensor
    precision: str
    k_to_end: torch.Tensor | None
    decay: torch.Tensor | None
    q_decay: torch.Tensor | None = None


def check_triton_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens) -> tuple[int, list[int]]:
    """The operator contract (`check_kda_inputs`) plus what these kernels need.

    Returns N and the sequence boundaries as a host list (reading cu_seqlens syncs).
    """
    N = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, _, K = q.shape
    V = v.shape[-1]
    if q.dtype not in _INPUT_DTYPES:
        raise ValueError(f"the Triton KDA kernels take fp32/bf16/fp16 q, k, v, got {q.dtype}")
    if K not in _SUPPORTED_DIMS or V not in _SUPPORTED_DIMS:
        raise ValueError(f"dk and dv must be one of {_SUPPORTED_DIMS}, got dk={K}, dv={V}")
    if initial_state is not None and initial_state.dtype != torch.float32:
        raise ValueError(f"initial_state must be float32, got {initial_state.dtype}")
    if g.dtype == torch.float16:
        raise ValueError("g must be fp32 or bf16: fp16 rounds the log decay too coarsely")
    bounds = list(range(0, B * T + 1, T)) if cu_seqlens is None else seqlens_bounds(cu_seqlens, T)
    return N, bounds


SCANS = ("sequential", "segments")


def kda_fwd_states(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    output_final_state: bool = False,
    scan: str = "sequential",
    segment_chunks: int | None = None,
    chunk_rows: int | None = None,
    output_q_decay: bool = True,
    g_cumsum: bool = False,
) -> KDAForwardState:
    """Stages 1-3 of the forward: chunk cumsum, A_qk / WY factors, the state scan.

    Arguments as for `chunk_kda_fwd_triton` (with `g_cumsum` stage 1 is skipped: g is G). The
    backward pass calls this to recompute what it needs (with `output_q_decay=False`: the
    output's operand scale Q ⊙ e^G is then not stored), unless the forward kept it
    (`titan_moe.ops.kda.kept`). `chunk_rows` (at least the chunk count) sizes h and decay along
    their first dimension: the kept forward allocates the shape-only bound `max_chunk_rows` so
    that its outputs' shapes do not depend on cu_seqlens' values; the rows past the chunk count
    stay unwritten.
    """
    if scan not in SCANS:
        raise ValueError(f"scan must be one of {SCANS}, got {scan!r}")
    N, bounds = check_triton_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    cu, chunk_indices, chunk_offsets = _chunk_layout(bounds, q.device)
    n_chunks = chunk_indices.shape[0]
    rows = n_chunks if chunk_rows is None else chunk_rows
    if rows < n_chunks:
        raise ValueError(f"chunk_rows={chunk_rows} is below the chunk count {n_chunks}")
    precision = dot_precision(q.dtype)

    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    TT = B * T
    f32 = dict(dtype=torch.float32, device=q.device)
    G = g.view(TT, H, K).float() if g_cumsum else torch.empty(TT, H, K, **f32)
    Aqk = torch.empty(TT, H, CHUNK, **f32)
    Akk = torch.empty(TT, H, CHUNK, **f32)
    Ainv = torch.empty(TT, H, CHUNK, **f32)
    # what the walk reads and writes: the input dtype (module docstring)
    walk_dt = dict(dtype=q.dtype, device=q.device)
    q_decay = torch.empty(TT, H, K, **walk_dt) if output_q_decay else None
    W = torch.empty(TT, H, K, **walk_dt)
    U = torch.empty(TT, H, V, **walk_dt)
    h = torch.empty(rows, H, K, V, **walk_dt)
    v_new = torch.empty(TT, H, V, **walk_dt)
    ht = torch.empty(N, H, K, V, **f32) if output_final_state else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    k_to_end = torch.empty(TT, H, K, **walk_dt)
    decay = torch.empty(rows, H, K, **f32)

    inverse_warps, wy_warps, _ = tile_warps()
    if not g_cumsum:
        _chunk_cumsum_kernel[(n_chunks, H)](g, G, cu, chunk_indices, H=H, K=K, BT=CHUNK, num_warps=4)
    intra_bk, intra_warps = intra_config(K)
    _intra_columns_kernel[(n_chunks * N_TILES, H)](
        q, k, G, beta, Aqk, Akk, q_decay, scale, cu, chunk_indices,
        H=H, K=K, BT=CHUNK, BC=TILE, BK=intra_bk, PRECISION=precision, STORE_Q_DECAY=output_q_decay,
        num_warps=intra_warps, **intra_register_cap(),
    )
    _diag_inverse_kernel[(n_chunks * N_TILES, H)](
        Akk, Ainv, cu, chunk_indices, H=H, BT=CHUNK, BC=TILE, num_warps=inverse_warps,
    )
    _wy_kernel[(n_chunks, H)](
        k, v, G, beta, Akk, Ainv, W, U, k_to_end, decay, cu, chunk_indices,
        H=H, K=K, V=V, BT=CHUNK, BC=TILE, BK=min(K, 64), BV=min(V, 64), PRECISION=precision,
        num_warps=wy_warps, maxnreg=WY_MAXNREG,
    )
    Akk = None  # dead before the walk (as `plan.transient` models)
    if scan == "segments":
        # late import: triton_scan imports this module
        from titan_moe.ops.kda.triton_scan import segment_scan

        segment_scan(k, W, U, G, h, v_new, h0, ht, cu, chunk_offsets, bounds, precision, segment_chunks)
    else:
        BV, warps = sequential_scan_config(K, V, walks=N * H)
        launch_with_fewer_stages_if_needed(
            _state_scan_kernel, (V // BV, N * H),
            W, U, k_to_end, decay, h, v_new, h0, ht, cu, chunk_offsets,
            H=H, K=K, V=V, BT=CHUNK, BV=BV, HAS_H0=h0 is not None, STORE_HT=output_final_state,
            PRECISION=precision, INTERPRETED=_interpreted(), num_warps=warps,
            num_stages=scan_stages(BV, walk_tiles_wide(K, q.dtype))[0],
        )
    U = None  # read by the forward walk only
    return KDAForwardState(
        G=G, Aqk=Aqk, Ainv=Ainv, W=W, h=h, v_new=v_new, final_state=ht,
        cu_seqlens=cu, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets, precision=precision,
        k_to_end=k_to_end, decay=decay, q_decay=q_decay,
    )


def kept_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    output_final_state: bool = False,
    g_cumsum: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """`chunk_kda_fwd_triton` that also returns the intermediates the backward needs
    (`RESIDUAL_NAMES`, shapes in `residual_specs`), so that `chunk_kda_bwd_triton(kept=...)`
    does not recompute them. Uses the sequential state walk."""
    B, T = q.shape[:2]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    rows = max_chunk_rows(B, T, N, cu_seqlens is not None)
    st = kda_fwd_states(q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state,
                        chunk_rows=rows, g_cumsum=g_cumsum)
    o = kda_fwd_output(q, v, st)
    residuals = [getattr(st, name) for name in RESIDUAL_NAMES]
    if g_cumsum:  # G is the input g (or its fp32 copy): the backward reads it there
        residuals[0] = None
    # one empty tensor per missing residual: an op's returns may not alias each other
    return o, st.final_state, [q.new_empty(0, dtype=torch.float32) if r is None else r for r in residuals]


def state_from_residuals(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, residuals: list[torch.Tensor],
    g_cumsum: bool = False,
) -> KDAForwardState:
    """The `KDAForwardState` that `kept_forward` built, from its residuals (the chunk layout
    is recomputed: one host read of cu_seqlens, as the recomputing backward does; with
    `g_cumsum`, G is g)."""
    N, bounds = check_triton_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if len(residuals) != len(RESIDUAL_NAMES):
        raise ValueError(f"expected {len(RESIDUAL_NAMES)} residuals {RESIDUAL_NAMES}, got {len(residuals)}")
    specs = residual_specs(q, v, N, cu_seqlens is not None, g_cumsum)
    for (shape, dtype), r, name in zip(specs, residuals, RESIDUAL_NAMES):
        if tuple(r.shape) != shape or r.dtype != dtype:
            raise ValueError(f"residual {name}: expected {dtype} {shape}, got {r.dtype} {tuple(r.shape)}")
    cu, chunk_indices, chunk_offsets = _chunk_layout(bounds, q.device)
    fields = dict(zip(RESIDUAL_NAMES, residuals))
    if g_cumsum:
        fields["G"] = g.reshape(-1, *g.shape[2:]).float().contiguous()
    return KDAForwardState(
        final_state=None, cu_seqlens=cu, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets,
        precision=dot_precision(q.dtype), **fields,
    )


def chunk_kda_fwd_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    output_final_state: bool = False,
    scan: str = "sequential",
    segment_chunks: int | None = None,
    g_cumsum: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA forward with Triton kernels.

    Args:
        q, k: `[B, T, H, dk]`; v: `[B, T, H, dv]`; fp32, bf16 or fp16, one dtype.
        g: `[B, T, H, dk]` log decay (fp32 or bf16), already bounded: `-5 <= g <= 0`
            (not checked here; below -5 the tile exponents may overflow). With `g_cumsum`,
            g is instead its chunk-local cumsum G (fp32 preferred; `kda_prepare` emits it).
        beta: `[B, T, H]`.
        scale: query scale.
        initial_state: `[N, H, dk, dv]` fp32, or None (zeros).
        cu_seqlens: int `[N+1]` packed-sequence boundaries (B must be 1), or None (N = B).
            Read on the host (one device sync).
        output_final_state: also return the state after each sequence's last token.
        scan: the inter-chunk state scan, "sequential" (one program walks a sequence's
            chunks; the op's path) or "segments" (segments of chunks side by side, combined
            through their state transitions: SPEC §8's context-parallel algebra,
            `triton_scan.segment_scan`).
        segment_chunks: chunks per segment of the segment scan; None picks it from
            `$TITAN_MOE_KDA_SCAN_SEGMENT` or the wave model in `triton_scan`.

    dk and dv must be 16, 32, 64 or 128.

    Returns:
        `o [B, T, H, dv]` in v's dtype and `final_state [N, H, dk, dv]` fp32 (None unless
        `output_final_state`).
    """
    st = kda_fwd_states(q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, scan, segment_chunks,
                        g_cumsum=g_cumsum)
    return kda_fwd_output(q, v, st), st.final_state


def kda_fwd_output(q: torch.Tensor, v: torch.Tensor, st: KDAForwardState) -> torch.Tensor:
    """Stage 4: `o [B, T, H, dv]` (v's dtype) from the stage 1-3 intermediates `st` (made
    with `output_q_decay`; the scale is inside st.q_decay and st.Aqk)."""
    if st.q_decay is None:
        raise ValueError("kda_fwd_output needs the state's q_decay (kda_fwd_states(output_q_decay=True))")
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=q.device)
    BV, warps = output_config(V)
    _output_kernel[(V // BV, st.chunk_indices.shape[0], H)](
        st.q_decay, st.Aqk, st.h, st.v_new, o, st.cu_seqlens, st.chunk_indices,
        H=H, K=K, V=V, BT=CHUNK, BV=BV, PRECISION=st.precision, num_warps=warps,
    )
    return o


OUTPUT_ENV = "TITAN_MOE_KDA_OUTPUT"  # "BVxWARPS" of `_output_kernel`, for tuning
TILE_WARPS_ENV = "TITAN_MOE_KDA_TILE_WARPS"  # warps of the per-tile kernels, for tuning (`tile_warps`)
INTRA_ENV = "TITAN_MOE_KDA_INTRA"  # "BKxWARPS" of `_intra_columns_kernel`, for tuning (`intra_config`)
INTRA_MAXNREG_ENV = "TITAN_MOE_KDA_INTRA_MAXNREG"  # register cap of `_intra_columns_kernel` (`intra_register_cap`)
_WARPS = (1, 2, 4, 8, 16)


def _env_ints(name: str, default: str, example: str, count: int) -> tuple[int, ...]:
    """`$name` (`count` integers joined by x, read per call; `default` when unset)."""
    text = launch_env.read(name) or default
    try:
        values = tuple(int(x) for x in text.split("x"))
    except ValueError:
        values = ()
    if len(values) != count:
        raise ValueError(f"{name} must be {count} integers joined by x, e.g. {example}, got {text!r}")
    return values


def output_config(V: int) -> tuple[int, int]:
    """(BV, num_warps) of `_output_kernel`: default 64 value columns per program, 4 warps,
    clipped to dv; `$TITAN_MOE_KDA_OUTPUT` ("BVxWARPS", read per call) overrides it for tuning."""
    bv, warps = _env_ints(OUTPUT_ENV, "64x4", "64x4", 2)
    if bv not in (16, 32, 64, 128) or warps not in _WARPS:
        raise ValueError(f"{OUTPUT_ENV}: BV must be 16, 32, 64 or 128 and warps a power of two <= 16, got {bv}x{warps}")
    return min(bv, V), warps


def intra_register_cap() -> dict:
    """Launch option of `_intra_columns_kernel` capping its registers per thread (Triton's
    `maxnreg`), read per call from `$TITAN_MOE_KDA_INTRA_MAXNREG` (0: no cap, else 32 to
    255). Default 96: at 32 key columns and 4 warps the kernel holds 127 registers on sm_90
    uncapped (four blocks per SM); capped it spills 40 bytes per thread and five fit."""
    return env_register_cap(INTRA_MAXNREG_ENV, 96)


def env_register_cap(name: str, default: int) -> dict:
    """`{"maxnreg": cap}` from `$name` (read per call; `default` when unset), or {} for 0 (no
    cap); caps outside 32 to 255 raise. The cap holds for whatever launch the other tuning
    switches pick, so set 0 when timing launches other than the default."""
    (cap,) = _env_ints(name, str(default), f"{default} (0: no cap)", 1)
    if cap and not 32 <= cap <= 255:
        raise ValueError(f"{name} must be 0 (none) or 32 to 255 registers, got {cap}")
    return {"maxnreg": cap} if cap else {}


def intra_config(K: int) -> tuple[int, int]:
    """(BK, warps) of `_intra_columns_kernel` (one program per column tile, one [BT, BC] dot
    pair over the chunk's rows, dk in steps of BK, clipped to dk): default 32 x 4;
    `$TITAN_MOE_KDA_INTRA` ("BKxWARPS", read per call) overrides it for tuning."""
    bk, warps = _env_ints(INTRA_ENV, "32x4", "32x4 (BKxWARPS)", 2)
    if bk not in (16, 32, 64, 128) or warps not in _WARPS:
        raise ValueError(f"{INTRA_ENV}: BK must be 16, 32, 64 or 128 and warps a power of two <= 16, "
                         f"got {bk}x{warps}")
    return min(bk, K), warps


def tile_warps() -> tuple[int, int, int]:
    """num_warps of `_diag_inverse_kernel`, `_wy_kernel` and `triton_bwd._bwd_intra_kernel`:
    default 1, 4, 4 (one warp keeps the inverse's row reductions inside a warp);
    `$TITAN_MOE_KDA_TILE_WARPS` ("INVERSExWYxBWD_INTRA", read per call) overrides them for
    tuning."""
    warps = _env_ints(TILE_WARPS_ENV, "1x4x4", "2x4x8", 3)
    if any(w not in _WARPS for w in warps):
        raise ValueError(f"{TILE_WARPS_ENV}: warps must be powers of two <= 16, got {warps}")
    return warps
