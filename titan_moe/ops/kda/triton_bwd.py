"""Triton backward kernels for chunked bounded-decay delta attention (KDA, SPEC §1).

Forward per chunk (notation of `triton_fwd`; G = chunk-local cumsum of g, C = 64):

    A_qk = scale tril(Q e^{G_i - G_j} K^T),   A_kk = Diag(beta) strict_tril(K e^{G_i - G_j} K^T)
    X = (I + A_kk)^{-1},   W = X Diag(beta) (e^G ⊙ K),   U = X Diag(beta) V
    V~ = U - W S,   O = scale (Q ⊙ e^G) S + A_qk V~,   S' = Diag(e^{G_last}) S + (e^{G_last - G} ⊙ K)^T V~

Backward, given dO and dS_final (`dht`), the forward's intermediates kept by the forward
(`triton_fwd.kept_forward`) or recomputed by `triton_fwd.kda_fwd_states` (sequential walk):

    stage 1  `_bwd_state_scan_kernel`  per sequence, chunks in reverse: store dS' (gradient of
             the state after the chunk), dV~ = A_qk^T dO + (e^{G_last - G} ⊙ K) dS',
             dS = Diag(e^{G_last}) dS' + scale (Q ⊙ e^G)^T dO - W^T dV~  (ends at dh0).
             `_bwd_walk_prep_kernel` first computes the state-independent terms (per chunk:
             scale Q ⊙ e^G, and A_qk^T dO into dV~'s buffer); K~ and e^{G_last} come from
             the forward's `_wy_kernel`; dS' and dV~ are stored in the input dtype
             (`triton_fwd`'s docstring)
    stage 2  everything that needs whole-chunk matrices, in two kernels:
             `_bwd_chunk_keys_kernel` per chunk and block of key columns: dW = -dV~ S^T;
             dK, dQ, dG from the state terms and from W = X (beta e^G K), and the block's
             share of dbeta;
             `_bwd_chunk_values_kernel` per chunk: dA_qk = dO V~^T; dU = dV~;
             dv = beta ⊙ X^T dU, and dA_kk = -X^T (dV~ V~^T) (strictly lower; see below)

The gradient of A_kk without dX. Through X = (I + A_kk)^{-1}, dA_kk = -X^T dX X^T with
dX = dU (beta V)^T + dW (beta e^G K)^T = dV~ (beta V - (beta e^G K) S)^T, since U and W reach
the loss only through V~ = U - W S. The forward's own relation X (beta V - (beta e^G K) S) = V~
makes that dV~ ((I + A_kk) V~)^T, so dA_kk = -X^T dV~ V~^T (I + A_kk)^T X^T = -X^T (dV~ V~^T):
no S, no dX, and no cancellation between the two terms of dX, so the product takes the
kernels' own dot precision.
    stage 3  `_bwd_intra_kernel`  per 16-token tile, the gradients of A_qk and A_kk into
             q, k, beta and G, with the same anchored dense tile dots as the forward
    stage 4  `_bwd_reverse_cumsum_kernel`  dg = reverse cumsum of dG inside each chunk
             (skipped with `g_cumsum`: dG is returned, `kda_prepare_bwd` sums it)

Stage 3 and the tile anchors: tile I of a chunk, anchor c_I = G at its middle row. As rows
(tiles J <= I): dq_I = Σ_J (dA_qk[I,J] @ (K_J ⊙ e^{c_I - G_J})) ⊙ e^{G_I - c_I}, and likewise
R_I from dA_kk. As columns, tile J takes from every row tile I >= J, around I's own anchor:
dk_J += Σ_I (dA[I,J]^T @ (x_I ⊙ e^{G_I - c_I})) ⊙ e^{c_I - G_J}. Every factor is at most e^40
(see `triton_fwd`), and dA is already zero above the diagonal, so the diagonal tile is the
same dense dot with nothing to mask. The G gradients follow from
d e^{G_i - G_j} = e^{G_i - G_j} (dG_i - dG_j): dG_i += q_i ⊙ dq_i + k_i ⊙ dk_i(row part),
dG_j -= k_j ⊙ dk_j(column part).

Why both sides use row tile I's anchor and, with tf32 dots, tf32-rounded operands
(`_round_tf32`): dg is the reverse cumsum inside each chunk of dG, where every pair (i, j)
adds +x_ij at i (row side) and -x_ij at j (column side), and dg, up to e^5 times smaller
than its terms, keeps only what does not cancel. Rounding the exp-scaled operands
a_i = q_i e^(G_i - c_I), beta_i k_i e^(G_i - c_I) and b_j = k_j e^(c_I - G_j) to tf32 once
and using the same rounded values in the dots and in dG's products on both sides makes both
copies a_i dA_ij b_j of the same tf32 numbers, which cancel to fp32 accumulation; an anchor
per side (or unrounded factors) leaves the tf32 rounding of different operands in dg,
several times fla's error at long context. dq and dk themselves keep tf32's rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from titan_moe.ops import launch_env
from titan_moe.ops.kda.triton_fwd import (
    CHUNK,
    N_TILES,
    TILE,
    _WARPS,
    _chunk_location,
    _env_ints,
    _interpreted,
    _prefetch_decay,
    dot_precision,
    env_register_cap,
    kda_fwd_states,
    scan_stages,
    sequential_scan_config,
    state_from_residuals,
    tile_warps,
    walk_tiles_wide,
)
from titan_moe.ops.triton_runtime import launch_with_fewer_stages_if_needed, row_major_descriptor

# stage 2's launch: "BKxBVxKEYS_WARPSxVALUES_WARPS", e.g. 64x64x8x8 (the default, see `bwd_chunk_config`)
BWD_CHUNK_ENV = "TITAN_MOE_KDA_BWD_CHUNK"
# key columns per program of the backward intra kernel, see `bwd_intra_bk`
BWD_INTRA_BK_ENV = "TITAN_MOE_KDA_BWD_INTRA_BK"
# register cap of the backward intra kernel (0: none), see `bwd_intra_register_cap`
BWD_INTRA_MAXNREG_ENV = "TITAN_MOE_KDA_BWD_INTRA_MAXNREG"
# register caps of stage 2's kernels: "KEYSxVALUES" (0: no cap), see `bwd_register_caps`
BWD_MAXNREG_ENV = "TITAN_MOE_KDA_BWD_MAXNREG"


def bwd_chunk_config(K: int, V: int) -> tuple[int, int, int, int]:
    """(BK, BV, keys warps, values warps) of stage 2: `_bwd_chunk_keys_kernel` runs one
    program per chunk, head and BK key columns, both stage-2 kernels loop over BV value
    columns. Default 64 x 64 with 8 warps each, clipped to dk and dv: 64 key columns at 8
    warps need 128 registers and spill 24 bytes on sm_90, two blocks per SM
    (`profiling/kernel_resources.py`), where all 128 key columns at 16 warps fit one.
    `$TITAN_MOE_KDA_BWD_CHUNK` ("BKxBVxWKxWV", read per call) overrides it for tuning."""
    bk, bv, wk, wv = _env_ints(BWD_CHUNK_ENV, "64x64x8x8", "64x32x8x8 (BKxBVxKEYS_WARPSxVALUES_WARPS)", 4)
    if bk not in (16, 32, 64, 128) or bv not in (16, 32, 64, 128):
        raise ValueError(f"{BWD_CHUNK_ENV}: BK and BV must be 16, 32, 64 or 128, got {bk}x{bv}")
    if wk not in _WARPS or wv not in _WARPS:
        raise ValueError(f"{BWD_CHUNK_ENV}: warps must be powers of two in [1, 16], got {wk}x{wv}")
    return min(bk, K), min(bv, V), wk, wv


def bwd_parts_dtype(input_dtype: torch.dtype) -> torch.dtype:
    """The dtype in which `_bwd_chunk_keys_kernel` hands its dq and dk terms to
    `_bwd_intra_kernel` (dG's stays fp32: it is summed over the chunk): bf16 for bf16 inputs,
    whose gradients are bf16 anyway (it halves the bytes of two `[T, H, dk]` passes at one
    more rounding of those terms), fp32 for the others (fp16 keeps three more mantissa bits
    than bf16: its gradients' bounds would not hold)."""
    return torch.bfloat16 if input_dtype == torch.bfloat16 else torch.float32


def _row_descriptors(views: list):
    """Host TMA descriptors of 2-D row-major ``(tensor, box)`` pairs, or None where TMA
    cannot describe one of them (`row_major_descriptor`)."""
    descriptors = [row_major_descriptor(t, block) for t, block in views]
    return None if any(d is None for d in descriptors) else descriptors


def _token_rows(t: torch.Tensor) -> torch.Tensor:
    """``[TT, H, C]`` (or ``[B, T, H, C]``) as the 2-D ``[TT, H * C]`` the TMA boxes index."""
    return t.reshape(-1, t.shape[-2] * t.shape[-1])


def bwd_intra_bk(K: int) -> int:
    """Key columns per program of `_bwd_intra_kernel`: 64 by default, clipped to dk (at dk = 128
    each 16-row tile's columns go to two adjacent programs, with 4 warps, `tile_warps`: more
    programs with fewer registers each than one 8-warp program per tile);
    `$TITAN_MOE_KDA_BWD_INTRA_BK` (16, 32, 64 or 128, read per call, clipped to dk) overrides
    it for tuning."""
    text = launch_env.read(BWD_INTRA_BK_ENV) or "64"
    if text not in ("16", "32", "64", "128"):
        raise ValueError(f"{BWD_INTRA_BK_ENV} must be 16, 32, 64 or 128, got {text!r}")
    return min(int(text), K)


def bwd_register_caps() -> tuple[dict, dict]:
    """Launch options of `_bwd_chunk_keys_kernel` and `_bwd_chunk_values_kernel` that cap their
    registers per thread (Triton's `maxnreg`), read per call from `$TITAN_MOE_KDA_BWD_MAXNREG`
    ("KEYSxVALUES", 0: no cap). Default 128 x 128: at dk = dv = 128 on sm_90
    (`profiling/kernel_resources.py`) two 8-warp blocks of each kernel then fit on an SM
    instead of one. A kernel that needs fewer registers is unaffected."""
    caps = _env_ints(BWD_MAXNREG_ENV, "128x128", "0x128 (KEYSxVALUES, 0: no cap)", 2)
    if any(c and not 32 <= c <= 255 for c in caps):
        raise ValueError(f"{BWD_MAXNREG_ENV}: caps must be 0 (none) or 32 to 255 registers, got {caps}")
    return tuple({"maxnreg": c} if c else {} for c in caps)


def bwd_intra_register_cap() -> dict:
    """Launch option of `_bwd_intra_kernel` capping its registers per thread (Triton's
    `maxnreg`), read per call from `$TITAN_MOE_KDA_BWD_INTRA_MAXNREG` (0: no cap, else 32 to
    255). Default 96: at dk = 128 on sm_90 (`profiling/kernel_resources.py`) the kernel,
    which finishes its row side before its column side, holds 116 registers at 4 warps
    uncapped (four blocks per SM); capped at 96 it spills 56 bytes per thread and five fit."""
    return env_register_cap(BWD_INTRA_MAXNREG_ENV, 96)


# ----------------------------------------------------------------------------------------
# stage 1: reverse state scan
# ----------------------------------------------------------------------------------------
@triton.jit
def _bwd_walk_prep_kernel(
    q, G, Aqk, do, q_decay, dv_new, scale, cu_seqlens, chunk_indices,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The reverse walk's state-independent terms, one chunk per program:
    q_decay = scale Q ⊙ e^G (`[TT, H, K]`, input dtype) and dV~'s local part A_qk^T dO,
    written into dv_new (`[TT, H, V]`, input dtype; the walk adds its state term in place).
    Grid: (chunks, H).
    """
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, T, i_t = _chunk_location(cu_seqlens, chunk_indices, i_c)
    o_t = tl.arange(0, BT)
    rows = i_t * BT + o_t
    m_r = (rows < T)[:, None]
    tok = (bos + rows) * H + i_h
    p_k = tok[:, None] * K + tl.arange(0, K)[None, :]
    b_q = tl.load(q + p_k, mask=m_r, other=0.0).to(tl.float32)
    b_G = tl.load(G + p_k, mask=m_r, other=0.0)
    tl.store(q_decay + p_k, (b_q * tl.exp(b_G) * scale).to(q_decay.dtype.element_ty), mask=m_r)
    b_A = tl.load(Aqk + tok[:, None] * BT + o_t[None, :], mask=m_r & (o_t[:, None] >= o_t[None, :]), other=0.0)
    for i_v in range(0, V // BV):
        p_v = tok[:, None] * V + (i_v * BV + tl.arange(0, BV))[None, :]
        b_do = tl.load(do + p_v, mask=m_r, other=0.0).to(tl.float32)
        b_dvn = tl.dot(tl.trans(b_A), b_do, input_precision=PRECISION)
        tl.store(dv_new + p_v, b_dvn.to(dv_new.dtype.element_ty), mask=m_r)


@triton.jit
def _bwd_walk_prefetch(decay, dv_new, i_t, n_chunks, bos, T, boc, i_h, o_k, o_v, H: tl.constexpr,
                       K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr):
    """The reverse walk's small per-chunk loads, issued one chunk ahead: e^{G_last} (`[K]`
    fp32) and dV~'s local part A_qk^T dO from dv_new (`[BT, BV]`, dv_new's dtype: the caller
    converts it where it uses it, so that nothing in this iteration waits for the load) of
    chunk i_t; zeros when i_t is outside [0, n_chunks). Triton's software pipeliner (3.6)
    leaves both loads in the loop body, on the walk's critical path (see
    `triton_fwd._prefetch_decay`)."""
    b_decay = _prefetch_decay(decay, boc, i_t, n_chunks, i_h, o_k, H, K)
    valid = (i_t >= 0) & (i_t < n_chunks)
    rows = i_t * BT + tl.arange(0, BT)
    p_v = ((bos + rows) * H + i_h)[:, None] * V + o_v[None, :]
    b_dvn = tl.load(dv_new + p_v, mask=((rows < T) & valid)[:, None], other=0.0)
    return b_decay, b_dvn


@triton.jit
def _bwd_scan_chunk(W, Kt, q_decay, do, dh, dv_new, b_dS, b_decay, b_dvn, i_t, bos, T, boc, i_h, o_k, o_v,
                    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, PRECISION: tl.constexpr):
    """One chunk of the reverse recurrence: store dS', write dV~, return dS at the chunk start.

    b_dS stays fp32; the dots take it (and dV~) in W's dtype (the input dtype, fp32
    accumulation). K~ comes from `_wy_kernel`, scale Q ⊙ e^G from `_bwd_walk_prep_kernel`
    (dv_new holds A_qk^T dO on entry); e^{G_last} and A_qk^T dO arrive one chunk ahead as
    `b_decay`, `b_dvn` (`_bwd_walk_prefetch`).
    """
    tl.store(dh + ((boc + i_t) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :], b_dS.to(dh.dtype.element_ty))
    rows = i_t * BT + tl.arange(0, BT)
    m_r = (rows < T)[:, None]
    tok = (bos + rows) * H + i_h
    p_k = tok[:, None] * K + o_k[None, :]
    p_v = tok[:, None] * V + o_v[None, :]
    b_w = tl.load(W + p_k, mask=m_r, other=0.0)
    b_k_to_end = tl.load(Kt + p_k, mask=m_r, other=0.0)
    b_q_decay = tl.load(q_decay + p_k, mask=m_r, other=0.0)
    # dO may come in another dtype than the inputs
    b_do = tl.load(do + p_v, mask=m_r, other=0.0).to(b_q_decay.dtype)
    b_dvn = b_dvn.to(tl.float32) + tl.dot(b_k_to_end, b_dS.to(b_k_to_end.dtype), input_precision=PRECISION)
    tl.store(dv_new + p_v, b_dvn.to(dv_new.dtype.element_ty), mask=m_r)
    b_dS = b_dS * b_decay[:, None] + tl.dot(tl.trans(b_q_decay), b_do, input_precision=PRECISION)
    return b_dS - tl.dot(tl.trans(b_w), b_dvn.to(b_w.dtype), input_precision=PRECISION)


@triton.jit
def _bwd_state_scan_kernel(
    W, Kt, q_decay, decay, do, dh, dv_new, dht, dh0, cu_seqlens, chunk_offsets,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """Walk one sequence's chunks backwards for one head and BV state columns.

    W, Kt, q_decay: `[TT, H, K]`; decay `[chunks, H, K]` fp32; do `[TT, H, V]`; dh
    `[chunks, H, K, V]` receives dS' (gradient of each chunk's final state); dv_new
    `[TT, H, V]` holds A_qk^T dO and receives dV~; dht, dh0 `[N, H, K, V]` fp32. Dtypes in
    `triton_fwd`'s docstring. Grid: (V // BV, N * H).
    """
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    boc = tl.load(chunk_offsets + i_n).to(tl.int64)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    p_S = i_h * K * V + o_k[:, None] * V + o_v[None, :]

    if HAS_DHT:
        b_dS = tl.load(dht + i_n * H * K * V + p_S)
    else:
        b_dS = tl.zeros([K, BV], dtype=tl.float32)
    n_chunks = tl.cdiv(T, BT)
    b_decay, b_dvn = _bwd_walk_prefetch(decay, dv_new, n_chunks - 1, n_chunks, bos, T, boc, i_h, o_k, o_v,
                                        H, K, V, BT)
    if INTERPRETED:  # see `triton_fwd._state_scan_kernel`
        i_t = n_chunks - 1
        while i_t >= 0:
            b_decay_next, b_dvn_next = _bwd_walk_prefetch(decay, dv_new, i_t - 1, n_chunks, bos, T, boc, i_h,
                                                          o_k, o_v, H, K, V, BT)
            b_dS = _bwd_scan_chunk(W, Kt, q_decay, do, dh, dv_new, b_dS, b_decay, b_dvn, i_t, bos, T, boc, i_h,
                                   o_k, o_v, H, K, V, BT, PRECISION)
            b_decay, b_dvn = b_decay_next, b_dvn_next
            i_t -= 1
    else:
        for i_r in range(0, n_chunks):
            i_t = n_chunks - 1 - i_r
            b_decay_next, b_dvn_next = _bwd_walk_prefetch(decay, dv_new, i_t - 1, n_chunks, bos, T, boc, i_h,
                                                          o_k, o_v, H, K, V, BT)
            b_dS = _bwd_scan_chunk(W, Kt, q_decay, do, dh, dv_new, b_dS, b_decay, b_dvn, i_t, bos, T, boc, i_h,
                                   o_k, o_v, H, K, V, BT, PRECISION)
            b_decay, b_dvn = b_decay_next, b_dvn_next
    if STORE_DH0:
        tl.store(dh0 + i_n * H * K * V + p_S, b_dS)


# ----------------------------------------------------------------------------------------
# stage 2: whole-chunk gradients (state terms, WY factors, dA_qk, dA_kk)
# ----------------------------------------------------------------------------------------
@triton.jit
def _chunk_rows(cu_seqlens, chunk_indices, i_c, i_h, H: tl.constexpr, BT: tl.constexpr):
    """Chunk i_c's rows for head i_h: (bos, T, i_t) of `_chunk_location`, the in-chunk
    offsets o_t, the sequence positions rows, their mask m_t (rows < T) and the `[TT, H]`
    row indices tok."""
    bos, T, i_t = _chunk_location(cu_seqlens, chunk_indices, i_c)
    o_t = tl.arange(0, BT)
    rows = i_t * BT + o_t
    return bos, T, i_t, o_t, rows, rows < T, (bos + rows) * H + i_h


@triton.jit
def _bwd_chunk_keys_kernel(
    q, k, G, beta, Ainv, h, dh, v_new, dv_new, do,
    dq_part, dk_part, dG_part, dbeta_keys, scale, cu_seqlens, chunk_indices, TT,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, PRECISION: tl.constexpr,
):
    """One chunk and BK key columns: the state terms and W = X (beta e^G K) of dq, dk, dG,
    and this block's share of dbeta.

    Inputs as in the forward (`[TT, H, ·]`, h/dh `[chunks, H, K, V]`), dv_new = dV~ from
    stage 1. h, dh, v_new, dv_new are in the input dtype and meet the tensor cores in it; do
    is cast to it (o, hence do, has q's dtype in every caller), so 16-bit tiles are 16-bit
    dot operands (exactly the tf32 dot of their fp32 upcasts: tf32 keeps bf16's and fp16's
    mantissas). The chunk's q, k, G load after the value loop, so that their registers are
    free during it. Writes dq_part, dk_part `[TT, H, K]` (`bwd_parts_dtype`) and dG_part
    `[TT, H, K]` fp32 for its columns; dbeta_keys `[K // BK, TT, H]` fp32 at its block index
    (summed by `_bwd_chunk_values_kernel`). Grid: (chunks, H, K // BK).
    """
    i_c, i_h, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, T, i_t, o_t, rows, m_t, tok = _chunk_rows(cu_seqlens, chunk_indices, i_c, i_h, H, BT)
    m_r = m_t[:, None]
    o_k = i_k * BK + tl.arange(0, BK)
    walk_dt = h.dtype.element_ty

    last = tl.minimum(i_t * BT + BT, T) - 1
    p_k = tok[:, None] * K + o_k[None, :]
    b_G_last = tl.load(G + ((bos + last) * H + i_h) * K + o_k)
    b_beta = tl.load(beta + tok, mask=m_t, other=0.0).to(tl.float32)
    b_X = tl.load(Ainv + tok[:, None] * BT + o_t[None, :], mask=m_r & (o_t[:, None] >= o_t[None, :]), other=0.0)
    b_dq_state = tl.zeros([BT, BK], dtype=tl.float32)  # dO S^T
    b_dk_state = tl.zeros([BT, BK], dtype=tl.float32)  # V~ dS'^T
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)  # -dV~ S^T
    b_s_ds = tl.zeros([BK], dtype=tl.float32)  # Σ_v S ⊙ dS'
    for i_v in range(0, V // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        p_v = tok[:, None] * V + o_v[None, :]
        p_S = (i_c.to(tl.int64) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
        b_S = tl.load(h + p_S)
        b_dS = tl.load(dh + p_S)
        b_do = tl.load(do + p_v, mask=m_r, other=0.0).to(walk_dt)
        b_vn = tl.load(v_new + p_v, mask=m_r, other=0.0)
        b_dvn = tl.load(dv_new + p_v, mask=m_r, other=0.0)
        b_dq_state += tl.dot(b_do, tl.trans(b_S), input_precision=PRECISION)
        b_dk_state += tl.dot(b_vn, tl.trans(b_dS), input_precision=PRECISION)
        b_dw -= tl.dot(b_dvn, tl.trans(b_S), input_precision=PRECISION)
        b_s_ds += tl.sum(b_S.to(tl.float32) * b_dS.to(tl.float32), axis=1)

    b_q = tl.load(q + p_k, mask=m_r, other=0.0).to(tl.float32)
    b_k = tl.load(k + p_k, mask=m_r, other=0.0).to(tl.float32)
    b_G = tl.load(G + p_k, mask=m_r, other=0.0)
    b_eG = tl.exp(b_G)
    b_dq = b_dq_state * b_eG * scale
    b_dk_state = tl.where(m_r, b_dk_state * tl.exp(b_G_last[None, :] - b_G), 0.0)
    b_y = tl.dot(tl.trans(b_X), b_dw, input_precision=PRECISION)  # X^T dW
    b_dk = b_dk_state + b_y * b_eG * b_beta[:, None]
    b_dG = b_q * b_dq - b_k * b_dk_state + b_k * b_eG * b_beta[:, None] * b_y
    # G_last = G at the chunk's last token: its gradient lands on that row
    b_dG_last = tl.exp(b_G_last) * b_s_ds + tl.sum(b_k * b_dk_state, axis=0)
    b_dG += tl.where((rows == last)[:, None], b_dG_last[None, :], 0.0)
    tl.store(dq_part + p_k, b_dq.to(dq_part.dtype.element_ty), mask=m_r)
    tl.store(dk_part + p_k, b_dk.to(dk_part.dtype.element_ty), mask=m_r)
    tl.store(dG_part + p_k, b_dG, mask=m_r)
    share = i_k.to(tl.int64) * TT * H + tok
    tl.store(dbeta_keys + share, tl.sum(b_y * b_eG * b_k, axis=1), mask=m_t)


@triton.jit
def _bwd_chunk_values_kernel(
    v, beta, Ainv, v_new, dv_new, do, dbeta_keys,
    dAqk, dAkk, dbeta_part, dv, scale, cu_seqlens, chunk_indices, TT,
    H: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, NK: tl.constexpr,
    PRECISION: tl.constexpr, TMA_LOADS: tl.constexpr = False,
):
    """One chunk: dA_qk = dO V~^T, dv and dbeta from U = X (beta V), with the key blocks'
    dbeta shares of `_bwd_chunk_keys_kernel` added, and dA_kk = -X^T (dV~ V~^T) (the module
    docstring): dV~ V~^T over the value loop in the input dtype, as dO V~^T, then one
    [BT, BT] product with X.

    Writes dAqk (= scale dO V~^T, lower incl. diagonal) and dAkk (strictly lower) `[TT, H,
    BT]` fp32; dbeta_part `[TT, H]` fp32 (all but the A_kk tiles' share, which
    `_bwd_intra_kernel` adds); dv `[TT, H, V]` (v's dtype).
    With TMA_LOADS, v, v_new, dv_new, do are TMA descriptors (the launcher's default where
    TMA can describe them) without a row mask: rows >= T (the next sequence's) reach dA_qk's
    and dA_kk's rows >= T and, in their rows < T, only columns above the diagonal; X^T dU
    through X's zero rows; dv's rows >= T, never stored.
    Grid: (chunks, H).
    """
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, T, i_t, o_t, rows, m_t, tok = _chunk_rows(cu_seqlens, chunk_indices, i_c, i_h, H, BT)
    m_r = m_t[:, None]
    walk_dt = v_new.dtype if TMA_LOADS else v_new.dtype.element_ty
    m_tril = o_t[:, None] >= o_t[None, :]
    b_X = tl.load(Ainv + tok[:, None] * BT + o_t[None, :], mask=m_r & m_tril, other=0.0)
    b_beta = tl.load(beta + tok, mask=m_t, other=0.0).to(tl.float32)
    b_dA = tl.zeros([BT, BT], dtype=tl.float32)  # dV~ V~^T, then dA_kk
    b_dbeta = tl.zeros([BT], dtype=tl.float32)
    for i_k in tl.static_range(NK):
        b_dbeta += tl.load(dbeta_keys + i_k * TT * H + tok.to(tl.int64), mask=m_t, other=0.0)

    b_dAqk = tl.zeros([BT, BT], dtype=tl.float32)
    for i_v in range(0, V // BV):
        p_v = tok[:, None] * V + (i_v * BV + tl.arange(0, BV))[None, :]
        if TMA_LOADS:
            row_t, col_v = (bos + i_t * BT).to(tl.int32), i_h * V + i_v * BV  # (box coordinates are 32-bit)
            b_do = do.load([row_t, col_v]).to(walk_dt)
            b_vn = v_new.load([row_t, col_v])
            b_dvn_w = dv_new.load([row_t, col_v])
            b_v = v.load([row_t, col_v]).to(tl.float32)
        else:
            b_do = tl.load(do + p_v, mask=m_r, other=0.0).to(walk_dt)
            b_vn = tl.load(v_new + p_v, mask=m_r, other=0.0)
            b_dvn_w = tl.load(dv_new + p_v, mask=m_r, other=0.0)
            b_v = tl.load(v + p_v, mask=m_r, other=0.0).to(tl.float32)
        b_dAqk += tl.dot(b_do, tl.trans(b_vn), input_precision=PRECISION)
        b_z = tl.dot(tl.trans(b_X), b_dvn_w.to(tl.float32), input_precision=PRECISION)  # Z = X^T dU
        b_dA += tl.dot(b_dvn_w, tl.trans(b_vn), input_precision=PRECISION)  # dV~ V~^T
        tl.store(dv + p_v, (b_z * b_beta[:, None]).to(dv.dtype.element_ty), mask=m_r)
        b_dbeta += tl.sum(b_z * b_v, axis=1)
    p_a = tok.to(tl.int64)[:, None] * BT + o_t[None, :]
    tl.store(dAqk + p_a, tl.where(m_tril, b_dAqk * scale, 0.0), mask=m_r)
    tl.store(dbeta_part + tok, b_dbeta, mask=m_t)
    b_dA = -tl.dot(tl.trans(b_X), b_dA, input_precision=PRECISION)  # -X^T (dV~ V~^T)
    tl.store(dAkk + p_a, tl.where(o_t[:, None] > o_t[None, :], b_dA, 0.0), mask=m_r)


# ----------------------------------------------------------------------------------------
# stage 3: gradients of the intra-chunk tiles
# ----------------------------------------------------------------------------------------
@triton.jit
def _load_rows(q, k, G, beta, tok, m, o_k, K: tl.constexpr):
    """q, k (fp32), G `[rows, len(o_k)]` and beta `[rows]` (fp32) of the rows tok
    (= token * H + head) where m holds, zeros elsewhere."""
    p = tok[:, None] * K + o_k[None, :]
    b_q = tl.load(q + p, mask=m[:, None], other=0.0).to(tl.float32)
    b_k = tl.load(k + p, mask=m[:, None], other=0.0).to(tl.float32)
    b_G = tl.load(G + p, mask=m[:, None], other=0.0)
    b_beta = tl.load(beta + tok, mask=m, other=0.0).to(tl.float32)
    return b_q, b_k, b_G, b_beta


@triton.jit
def _round_tf32(x, ROUND: tl.constexpr):
    """fp32 x rounded to the nearest tf32 (ties away from zero, as cvt.rna.tf32.f32) when
    ROUND, so that a tf32 dot takes it unchanged; x itself otherwise. |x| far below fp32's
    largest value (the exp-scaled operands here are at most e^40 |q|)."""
    if ROUND:
        bits = x.to(tl.uint32, bitcast=True)
        return ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return x


@triton.jit
def _bwd_intra_row_terms(k, G, dAqk, dAkk, b_dq, b_R, b_c, tok, m_r, i_t, i_j, bos, T, i_h, o_r, o_k,
                         H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                         PRECISION: tl.constexpr, ROUND: tl.constexpr = False):
    """Tile J's terms (J <= the row tile) of a row tile's dq and R (before the row decay),
    added to b_dq, b_R `[BC, BK]`. ROUND: the column operand k_j e^(c - G_j) rounded to tf32
    first (`_round_tf32`)."""
    cols = i_t * BT + i_j * BC + o_r
    m_c = cols < T
    p_c = ((bos + cols) * H + i_h)[:, None] * K + o_k[None, :]
    b_kc = tl.load(k + p_c, mask=m_c[:, None], other=0.0).to(tl.float32)
    b_Gc = tl.load(G + p_c, mask=m_c[:, None], other=0.0)
    b_k_col = _round_tf32(b_kc * tl.exp(tl.where(m_c[:, None], b_c[None, :] - b_Gc, float("-inf"))), ROUND)  # <= e^40
    p_a = tok[:, None] * BT + (i_j * BC + o_r)[None, :]
    b_dAqk = tl.load(dAqk + p_a, mask=m_r[:, None], other=0.0)
    b_dAkk = tl.load(dAkk + p_a, mask=m_r[:, None], other=0.0)
    b_dq += tl.dot(b_dAqk, b_k_col, input_precision=PRECISION)
    b_R += tl.dot(b_dAkk, b_k_col, input_precision=PRECISION)
    return b_dq, b_R


@triton.jit
def _bwd_intra_column_terms(q, k, G, beta, dAqk, dAkk, b_dk, b_dG, b_k, b_G, m_r, i_t, i_r, i_i,
                            bos, T, i_h, o_r, o_k, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                            BC: tl.constexpr, PRECISION: tl.constexpr, ROUND: tl.constexpr):
    """Row tile I's terms of column tile i_i's dk, around I's anchor c_I (the module
    docstring's pairing), each decayed to the column rows here
    (b_dk += e^(c_I - G_j) t), and their dG share with the column operand the row side
    of I rounds the same way (b_dG -= round(k_j e^(c_I - G_j)) t), where
    t = dAqk[I, j]^T round(q_I e^(G_I - c_I)) + dAkk[I, j]^T round(beta_I k_I e^(G_I - c_I)).
    b_k, b_G `[BC, BK]`: the column tile's own rows (fp32)."""
    row0_r = i_t * BT + i_r * BC
    if row0_r < T:
        rows_r = row0_r + o_r
        m_rr = rows_r < T
        tok_r = (bos + rows_r) * H + i_h
        b_qr, b_kr, b_Gr, b_br = _load_rows(q, k, G, beta, tok_r, m_rr, o_k, K)
        anchor = row0_r + tl.minimum(T - row0_r, BC) // 2  # as the row side of tile I takes it
        b_cr = tl.load(G + ((bos + anchor) * H + i_h) * K + o_k)
        b_e = tl.exp(tl.where(m_rr[:, None], b_Gr - b_cr[None, :], float("-inf")))  # <= e^40
        p_a = tok_r[:, None] * BT + (i_i * BC + o_r)[None, :]
        b_dAqk = tl.load(dAqk + p_a, mask=m_rr[:, None], other=0.0)
        b_dAkk = tl.load(dAkk + p_a, mask=m_rr[:, None], other=0.0)
        b_t = tl.dot(tl.trans(b_dAqk), _round_tf32(b_qr * b_e, ROUND), input_precision=PRECISION)
        b_t = tl.dot(tl.trans(b_dAkk), _round_tf32(b_kr * b_e * b_br[:, None], ROUND), acc=b_t,
                     input_precision=PRECISION)
        b_col_decay = tl.exp(tl.where(m_r[:, None], b_cr[None, :] - b_G, float("-inf")))  # <= 1 off I's tile
        b_dk += b_col_decay * b_t
        b_dG -= _round_tf32(b_k * b_col_decay, ROUND) * b_t
    return b_dk, b_dG


@triton.jit
def _bwd_intra_store_rows(dq_part, dbeta_part, dq, dbeta, dbeta_keys, b_dq, b_k, b_R, p_r, tok, m_r, i_kb, TT,
                          H: tl.constexpr, NK: tl.constexpr):
    """A row tile's final dq (dq_part + b_dq, dq's dtype) and its dbeta: dbeta_part + Σ_c k ⊙ R
    (beta's dtype) when NK == 1, else this key block's Σ_c k ⊙ R into dbeta_keys (fp32)."""
    b_dq += tl.load(dq_part + p_r, mask=m_r[:, None], other=0.0).to(tl.float32)
    tl.store(dq + p_r, b_dq.to(dq.dtype.element_ty), mask=m_r[:, None])
    if NK == 1:
        b_db = tl.load(dbeta_part + tok, mask=m_r, other=0.0) + tl.sum(b_k * b_R, axis=1)
        tl.store(dbeta + tok, b_db.to(dbeta.dtype.element_ty), mask=m_r)
    else:
        tl.store(dbeta_keys + i_kb.to(tl.int64) * TT * H + tok, tl.sum(b_k * b_R, axis=1), mask=m_r)


@triton.jit
def _bwd_intra_kernel(
    q, k, G, beta, dAqk, dAkk, dq_part, dk_part, dG_part, dbeta_part, dq, dk, dbeta, dbeta_keys,
    cu_seqlens, chunk_indices, TT,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Tile T of one chunk: add the A_qk / A_kk gradients to its rows' dq, dk, dG, dbeta.

    As rows of A (tiles J <= T): dq_T = Σ_J dAqk[T,J] (K_J e^{G_T - G_J}),
    R_T = Σ_J dAkk[T,J] (K_J e^{G_T - G_J}), giving dk += beta R, dbeta += Σ_c k ⊙ R and
    dG += q ⊙ dq + beta k ⊙ R. As columns (tiles I >= T):
    dk_T += Σ_I dAqk[I,T]^T (Q_I e^{G_I - G_T}) + dAkk[I,T]^T (beta_I K_I e^{G_I - G_T}),
    dG -= k ⊙ (that), each row tile I around its own anchor, with the operands rounded as its
    row side rounds them (the module docstring); every tile, the diagonal one included, is
    one dense dot (dA is zero above the diagonal).
    Every term is per key column (the dA tiles carry no key index), so a program takes BK of
    the K columns: the K // BK programs of one tile are adjacent in the grid, so that the
    tile's dA rows are read from L2 after the first. Final dq, dk (input dtype) are written
    and dG_part is completed in place for those columns; dbeta (beta's dtype) directly when
    BK == K, else each program's share of Σ_c k ⊙ R into dbeta_keys `[K // BK, TT, H]` fp32
    (the launcher adds them to dbeta_part). Grid: (chunks * BT // BC * K // BK, H).
    """
    ROUND: tl.constexpr = PRECISION == "tf32"
    NC: tl.constexpr = BT // BC
    NK: tl.constexpr = K // BK
    i_ci, i_kb = tl.program_id(0) // NK, tl.program_id(0) % NK
    i_c, i_i, i_h = i_ci // NC, i_ci % NC, tl.program_id(1)
    bos, T, i_t = _chunk_location(cu_seqlens, chunk_indices, i_c)
    row0 = i_t * BT + i_i * BC
    if row0 >= T:
        return
    o_r = tl.arange(0, BC)
    o_k = i_kb * BK + tl.arange(0, BK)
    rows = row0 + o_r
    m_r = rows < T
    tok = (bos + rows) * H + i_h
    p_r = tok[:, None] * K + o_k[None, :]
    b_q, b_k, b_G, b_beta = _load_rows(q, k, G, beta, tok, m_r, o_k, K)
    anchor = row0 + tl.minimum(T - row0, BC) // 2  # middle of the valid rows
    b_c = tl.load(G + ((bos + anchor) * H + i_h) * K + o_k)

    # this tile as rows: tiles J <= T
    b_dq = tl.zeros([BC, BK], dtype=tl.float32)
    b_R = tl.zeros([BC, BK], dtype=tl.float32)
    for i_j in tl.static_range(NC):
        if i_j <= i_i:
            b_dq, b_R = _bwd_intra_row_terms(k, G, dAqk, dAkk, b_dq, b_R, b_c, tok, m_r, i_t, i_j, bos, T, i_h,
                                             o_r, o_k, H, K, BT, BC, PRECISION, ROUND)
    b_row_decay = tl.exp(tl.where(m_r[:, None], b_G - b_c[None, :], float("-inf")))  # <= e^40
    m_rk = m_r[:, None]
    # dG's row terms from the operands the column sides round alike; then dq, dbeta and
    # dk's row share are final, so only k, G and the two accumulators stay live through
    # the column side (fewer registers, `bwd_intra_register_cap`)
    b_dG = (_round_tf32(b_q * b_row_decay, ROUND) * b_dq
            + _round_tf32(b_k * b_row_decay * b_beta[:, None], ROUND) * b_R)
    b_R *= b_row_decay
    _bwd_intra_store_rows(dq_part, dbeta_part, dq, dbeta, dbeta_keys, b_dq * b_row_decay, b_k, b_R, p_r,
                          tok, m_r, i_kb, TT, H, NK)
    b_dk = b_beta[:, None] * b_R
    for i_r in tl.static_range(NC):
        if i_r >= i_i:
            b_dk, b_dG = _bwd_intra_column_terms(
                q, k, G, beta, dAqk, dAkk, b_dk, b_dG, b_k, b_G, m_r, i_t, i_r, i_i, bos, T, i_h,
                o_r, o_k, H, K, BT, BC, PRECISION, ROUND)
    b_dk += tl.load(dk_part + p_r, mask=m_rk, other=0.0).to(tl.float32)
    tl.store(dk + p_r, b_dk.to(dk.dtype.element_ty), mask=m_rk)
    b_dG += tl.load(dG_part + p_r, mask=m_rk, other=0.0)
    tl.store(dG_part + p_r, b_dG, mask=m_rk)


# ----------------------------------------------------------------------------------------
# stage 4: dg from dG
# ----------------------------------------------------------------------------------------
@triton.jit
def _bwd_reverse_cumsum_kernel(dG, dg, cu_seqlens, chunk_indices, H: tl.constexpr, K: tl.constexpr,
                               BT: tl.constexpr):
    """dg[t] = Σ_{s >= t, s in t's chunk} dG[s] (G is the chunk-local cumsum of g).

    dG `[TT, H, K]` fp32, dg `[TT, H, K]` (g's dtype). Grid: (chunks, H).
    """
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, T, i_t = _chunk_location(cu_seqlens, chunk_indices, i_c)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = (o_t < T)[:, None]
    offs = ((bos + o_t) * H + i_h)[:, None] * K + tl.arange(0, K)[None, :]
    b_dG = tl.load(dG + offs, mask=m_t, other=0.0)
    tl.store(dg + offs, tl.cumsum(b_dG, axis=0, reverse=True).to(dg.dtype.element_ty), mask=m_t)


# ----------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------
def chunk_kda_bwd_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    do: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    dht: torch.Tensor | None = None,
    kept: list[torch.Tensor] | None = None,
    g_cumsum: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of `chunk_kda_fwd_triton`.

    Args: the forward's inputs (same contract), `do [B, T, H, dv]` (gradient of o),
    `dht [N, H, dk, dv]` fp32 (gradient of the final state) or None, and `kept`: the
    residuals of `triton_fwd.kept_forward` on the same inputs, or None to recompute them
    (stages 1-3 of the forward). With
    `g_cumsum` (g is the chunk-local cumsum G, see `chunk_kda_fwd_triton`) dg is dG: the
    reverse cumsum of stage 4 is left to the caller (`kda_prepare_bwd` does it in its pass).

    Returns:
        `(dq, dk, dv, dg, dbeta, dh0)` in the dtypes of q, k, v, g, beta; dh0
        `[N, H, dk, dv]` fp32, or None without an initial state.
    """
    if kept is None:
        st = kda_fwd_states(q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state=False,
                            output_q_decay=False, g_cumsum=g_cumsum)
    else:
        st = state_from_residuals(q, k, v, g, beta, initial_state, cu_seqlens, kept, g_cumsum)
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = st.cu_seqlens.shape[0] - 1
    if do.shape != v.shape:
        raise ValueError(f"do must have v's shape {tuple(v.shape)}, got {tuple(do.shape)}")
    if dht is not None and (tuple(dht.shape) != (N, H, K, V) or dht.dtype != torch.float32):
        raise ValueError(f"dht must be float32 [N, H, dk, dv] = {(N, H, K, V)}, got {dht.dtype} {tuple(dht.shape)}")
    q, k, v, beta, do = (x.contiguous() for x in (q, k, v, beta, do))
    dht = dht.contiguous() if dht is not None else None
    n_chunks = st.chunk_indices.shape[0]
    TT = B * T
    f32 = dict(dtype=torch.float32, device=q.device)
    precision = dot_precision(q.dtype)
    # what the walk writes: the input dtype (`triton_fwd`'s docstring)
    walk_dt = dict(dtype=q.dtype, device=q.device)
    dh = torch.empty(n_chunks, H, K, V, **walk_dt)
    dv_new = torch.empty(TT, H, V, **walk_dt)
    dh0 = torch.empty(N, H, K, V, **f32) if initial_state is not None else None

    # the walk's state-independent terms
    q_decay = torch.empty(TT, H, K, **walk_dt)
    _bwd_walk_prep_kernel[(n_chunks, H)](
        q, st.G, st.Aqk, do, q_decay, dv_new, scale, st.cu_seqlens, st.chunk_indices,
        H=H, K=K, V=V, BT=CHUNK, BV=min(V, 64), PRECISION=precision, num_warps=4,
    )
    BV, warps = sequential_scan_config(K, V, walks=N * H)
    launch_with_fewer_stages_if_needed(
        _bwd_state_scan_kernel, (V // BV, N * H),
        st.W, st.k_to_end, q_decay, st.decay, do, dh, dv_new, dht, dh0, st.cu_seqlens, st.chunk_offsets,
        H=H, K=K, V=V, BT=CHUNK, BV=BV, HAS_DHT=dht is not None, STORE_DH0=dh0 is not None,
        PRECISION=precision, INTERPRETED=_interpreted(), num_warps=warps,
        num_stages=scan_stages(BV, walk_tiles_wide(K, q.dtype))[1],
    )
    # read by the walks only: free them before the stages below
    q_decay = st.W = st.k_to_end = st.decay = None

    parts_dt = dict(dtype=bwd_parts_dtype(q.dtype), device=q.device)
    dq_part = torch.empty(TT, H, K, **parts_dt)
    dk_part = torch.empty(TT, H, K, **parts_dt)
    dG = torch.empty(TT, H, K, **f32)
    BK, BV, keys_warps, values_warps = bwd_chunk_config(K, V)
    keys_cap, values_cap = bwd_register_caps()
    dbeta_keys = torch.empty(K // BK, TT, H, **f32)
    _bwd_chunk_keys_kernel[(n_chunks, H, K // BK)](
        q, k, st.G, beta, st.Ainv, st.h, dh, st.v_new, dv_new, do,
        dq_part, dk_part, dG, dbeta_keys, scale, st.cu_seqlens, st.chunk_indices, TT,
        H=H, K=K, V=V, BT=CHUNK, BK=BK, BV=BV, PRECISION=precision,
        num_warps=keys_warps, num_stages=2, **keys_cap,
    )
    dAqk = torch.empty(TT, H, CHUNK, **f32)
    dAkk = torch.empty(TT, H, CHUNK, **f32)
    dbeta_part = torch.empty(TT, H, **f32)
    dv = torch.empty_like(v)
    # the value loop's operands through TMA descriptors where TMA can describe them
    loop_operands = (v, st.v_new, dv_new, do)
    descriptors = _row_descriptors([(_token_rows(x), [CHUNK, BV]) for x in loop_operands])
    v_arg, vn_arg, dvn_arg, do_arg = descriptors or loop_operands
    _bwd_chunk_values_kernel[(n_chunks, H)](
        v_arg, beta, st.Ainv, vn_arg, dvn_arg, do_arg, dbeta_keys,
        dAqk, dAkk, dbeta_part, dv, scale, st.cu_seqlens, st.chunk_indices, TT,
        H=H, V=V, BT=CHUNK, BV=BV, NK=K // BK, PRECISION=precision, TMA_LOADS=descriptors is not None,
        num_warps=values_warps, num_stages=2, **values_cap,
    )
    dbeta_keys = None

    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    intra_bk = bwd_intra_bk(K)
    dbeta = torch.empty_like(beta) if intra_bk == K else None
    dbeta_keys = torch.empty(K // intra_bk, TT, H, **f32) if intra_bk < K else None
    _bwd_intra_kernel[(n_chunks * N_TILES * (K // intra_bk), H)](
        q, k, st.G, beta, dAqk, dAkk, dq_part, dk_part, dG, dbeta_part, dq, dk, dbeta, dbeta_keys,
        st.cu_seqlens, st.chunk_indices, TT, H=H, K=K, BT=CHUNK, BC=TILE, BK=intra_bk, PRECISION=precision,
        num_warps=tile_warps()[2], **bwd_intra_register_cap(),
    )
    if dbeta_keys is not None:
        dbeta = (dbeta_part + dbeta_keys.sum(0)).to(beta.dtype).view(beta.shape)

    if g_cumsum:
        return dq, dk, dv.view_as(v), dG.view(g.shape).to(g.dtype), dbeta, dh0
    dg = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    _bwd_reverse_cumsum_kernel[(n_chunks, H)](dG, dg, st.cu_seqlens, st.chunk_indices, H=H, K=K, BT=CHUNK)
    return dq, dk, dv.view_as(v), dg, dbeta, dh0
