"""The segment scan: KDA's inter-chunk state scan over segments combined through their
state transitions (SPEC §8's context-parallel algebra), as Triton kernels and a
plain-PyTorch reference.

Context parallelism splits a sequence over ranks; each rank then holds one segment of
chunks, and the ranks' states are joined by composing per-segment affine maps
`S -> A_s S + B_s`. This module runs that algebra on one device: `segment_scan` cuts each
sequence's chunks into segments of L chunks and runs the segments side by side (stage 3 of
`triton_fwd` with `scan="segments"`; the op's path is the sequential walk,
`triton_fwd._state_scan_kernel`, which it matches to rounding), and `segment_scan_torch`
is the reference of the decomposition. The tests check both against the sequential walk.

Per chunk c the state update is affine in the state (notation of `triton_fwd`,
`K~ = e^{G_last - G} ⊙ K`, `D_c = Diag(e^{G_last})`):

    S' = D_c S + K~^T (U - W S) = A_c S + B_c,    A_c = D_c - K~^T W  [dk, dk],  B_c = K~^T U  [dk, dv]

(in exact arithmetic A_c = Π_t (I - beta_t k_t k_t^T) Diag(e^{g_t}), a product of
contractions when beta <= 1 and ||k|| = 1, so segment transitions stay bounded). A segment
s of chunks c0..c1 maps its initial state to `A_s S + B_s` with `A_s = A_c1 ... A_c0` and
`B_s` its end state from zero. Three kernels:

    phase 1  `_segment_transition_kernel`, one program per (segment, head, column block):
             segment 0 of each sequence walks its chunks from the true initial state
             (value blocks of BV columns), writing h and V~ like the sequential scan, and
             leaves its end state; a middle segment walks the augmented state [A | B]
             (dk + dv columns, blocks of BVT) from [I | 0]: A columns see U = 0 and start
             from identity columns, B columns start from zero; the last segment does
             nothing here (nobody needs its transition).
    phase 2  `_segment_combine_kernel`, grid (dv / BV, N * H): per sequence,
             S_1 = end of segment 0, S_{s+1} = A_s S_s + B_s; writes each segment's initial
             state into h at the segment's first chunk, and in fp32 over B_{s-1} in AB
             (and the final state of sequences with fewer than two segments).
    phase 3  `_segment_walk_kernel`, grid (dv / BV, segments * H): segments s >= 1 walk
             their chunks again from their true initial state (fp32, from AB), writing h
             and V~ exactly like the sequential scan (and the final state, from the last
             segment).

The walks keep the state in fp32 and upcast W and U on load: W, U, h and V~ are in the
input dtype (see `triton_fwd`), and this scan reads and writes them as such; it computes K~
and e^{G_last} from k and G rather than reading `_wy_kernel`'s.

Segment 0 skips the transition (its initial state is known) and the last segment skips
phase 1 (its transition is never used), so a sequence of one segment is exactly the
sequential walk, and two segments are the sequential walk in two launches: splitting
starts to pay at three.

Why A_s is accumulated by walking identity columns (low-rank form) and not as a product
of dense A_c: applying one chunk to a [dk, m] block costs `W X` and `K~^T (.)`, 4 C dk m
FLOPs, so the A columns cost 4 C dk^2 per chunk, against 2 C dk^2 (forming K~^T W) +
2 dk^3 (the product) for dense matrices: at dk = 128, C = 64 that is 4.2 vs 6.3 MFLOP per
chunk and head, and the walk reuses the value walk's code (the walk is cheaper whenever
C < dk, equal at dk = C = 64; dense products would win only at dk < 64, where the scan
is cheap anyway). Applying the transition lazily (keeping only the chunk factors and
walking them in the combine, "A S" for the value block only) is not an option: the
combine would then walk every chunk of the sequence again, in order, which is the
sequential scan. A dense A_s per segment is what makes the combine short.

FLOPs per head and sequence of n = G L chunks (C = 64; a "step" = one chunk applied to
a dk x dv state = 4 C dk dv FLOPs; r = dk / dv):

    sequential:   n steps
    segments:     L (segment 0) + (G - 2) L (1 + r) (phase 1) + (G - 2) dk / (2 C) (phase 2)
                  + (G - 1) L (phase 3)
    ratio:        [G + (G - 2)(1 + r)] / G + (G - 2) dk / (2 C n)

e.g. dk = dv = 128, n = 128 (T = 8192): G = 3 -> 1.67x, G = 5 -> 2.2x, G -> inf -> 3x.
Bytes read scale about the same way (every program reads W, k and G of its chunks, value
blocks U too); the extra memory is AB, `[segments, H, dk, dk + dv]` fp32: 128 KB per
segment and head at dk = dv = 128, against 64 KB per chunk and head for h. The critical
path falls from n chunk steps to about 2 L + (G - 2) dk / (2 C) steps (a combine step is one [dk, dk] @ [dk, BV]
product per value block). So the segment scan pays only where
the sequential scan leaves SMs idle and is latency bound (few sequences * heads), and
only while the extra programs fit the idle SMs: `default_segment_chunks` picks L from a
wave model of exactly that, and falls back to one segment per sequence (the sequential
walk, with no extra work) when splitting does not pay.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from titan_moe.ops import launch_env
from titan_moe.ops.kda.triton_fwd import CHUNK, _interpreted
from titan_moe.ops.triton_runtime import sm_count

SEGMENT_ENV = "TITAN_MOE_KDA_SCAN_SEGMENT"  # chunks per segment (overrides the model)

# Wave model constants (see `default_segment_chunks`), to be confirmed on the GPU:
# programs of the walk kernels resident per SM, by dk. Compiled for sm_90 (Triton 3.6,
# tf32 dots) they take about 255 registers per thread (130 at dk = 16): 8 warps at
# dk = 128 fill the 64K-register file alone, 4 warps below that leave room for two
# (three at dk = 16). Shared memory (num_stages=1: 16-49 KB) is not the limit.
_PROGRAMS_PER_SM = {16: 3, 32: 2, 64: 2, 128: 1}


def scan_blocks(K: int, V: int) -> tuple[int, int, int]:
    """(BK, BV, BVT) of the segment scan: the state is walked in row halves of BK, value
    walks take BV columns (as the sequential scan), [A | B] walks BVT columns (wider, so
    that a middle segment needs fewer programs: at dk = dv = 128, 4 instead of 8)."""
    BV = min(V, 32)
    return min(K, 64), BV, min(2 * BV, K, V)


# ----------------------------------------------------------------------------------------
# segment layout and the choice of the segment length
# ----------------------------------------------------------------------------------------
def segment_layout(bounds: list[int], segment_chunks: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """seg_indices int32 `[S, 2]` (sequence, segment-in-sequence) and seg_offsets int32 `[N+1]`
    (each sequence's first segment) for segments of `segment_chunks` chunks. A sequence of
    n chunks has ceil(n / L) segments, the last one possibly shorter; empty sequences none.
    Built once per arguments and shared, as `triton_fwd._chunk_layout` (no host sync per call)."""
    if segment_chunks < 1:
        raise ValueError(f"segment_chunks must be >= 1, got {segment_chunks}")
    return _segment_layout_cached(tuple(bounds), segment_chunks, torch.device(device))


@functools.lru_cache(maxsize=64)
def _segment_layout_cached(bounds: tuple[int, ...], segment_chunks: int, device: torch.device):
    n_chunks = [-(-(e - s) // CHUNK) for s, e in zip(bounds[:-1], bounds[1:])]
    n_segs = [-(-nc // segment_chunks) for nc in n_chunks]
    indices = [(n, j) for n, ns in enumerate(n_segs) for j in range(ns)]
    offsets = [0]
    for ns in n_segs:
        offsets.append(offsets[-1] + ns)
    return (
        torch.tensor(indices, dtype=torch.int32, device=device).view(-1, 2),
        torch.tensor(offsets, dtype=torch.int32, device=device),
    )


def modeled_scan_time(chunk_counts: list[int], L: int, H: int, K: int, V: int, capacity: int) -> float:
    """Modeled time of the segment scan in chunk steps (see `default_segment_chunks`)."""
    _, BV, BVT = scan_blocks(K, V)
    walk, full = H * V // BV, H * (K + V) // BVT  # programs per segment: value walk / [A | B] walk
    n_segs = [-(-n // L) for n in chunk_counts if n > 0]
    if not n_segs:
        return 0.0
    p1 = sum(walk + max(ns - 2, 0) * full for ns in n_segs)
    p3 = sum((ns - 1) * walk for ns in n_segs)
    L1 = min(L, max(chunk_counts))
    t = math.ceil(p1 / capacity) * L1 + max(max(n_segs) - 2, 0) * K / (2 * CHUNK)
    if p3:
        t += math.ceil(p3 / capacity) * L1
    return t


def default_segment_chunks(chunk_counts: list[int], H: int, K: int, V: int, n_sms: int | None = None) -> int:
    """Chunks per segment L, from a wave model (or `$TITAN_MOE_KDA_SCAN_SEGMENT`).

    Model: every program of a phase takes (its chunks) x (one chunk-step time), programs
    run in waves of `capacity = n_sms * programs_per_sm`, a combine step costs dk / (2 C)
    chunk steps. Phase 1 runs one value walk per sequence (segment 0) plus an [A | B] walk
    per middle segment, phase 3 one value walk per later segment. Candidates are
    L = ceil(n_max / G) for G = 1..64; the fastest modeled one wins, ties going to the
    larger L (less work). G = 1 (L = the longest sequence) is the sequential walk itself.
    The constants are assumptions until timed; the environment variable overrides.
    """
    env = launch_env.read(SEGMENT_ENV)
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"{SEGMENT_ENV} must be a positive chunk count, got {env!r}")
        return int(env)
    n_max = max(chunk_counts, default=0)
    if n_max <= 2:
        return max(n_max, 1)
    if n_sms is None:
        n_sms = sm_count()
    capacity = n_sms * _PROGRAMS_PER_SM[max(K, V)]
    best_L, best_t = n_max, modeled_scan_time(chunk_counts, n_max, H, K, V, capacity)
    for G in range(2, 65):
        L = -(-n_max // G)
        t = modeled_scan_time(chunk_counts, L, H, K, V, capacity)
        if t < best_t:
            best_L, best_t = L, t
    return best_L


# ----------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------
@triton.jit
def _segment_location(cu_seqlens, chunk_offsets, seg_indices, i_s, L, BT: tl.constexpr):
    """(i_n, bos, T, boc, n_seg, j, c0, c1) of segment `i_s`: its sequence, the sequence's
    first token, length, first chunk (flat) and segment count, the segment's index in the
    sequence and its chunk range [c0, c1) (chunk-in-sequence)."""
    i_n = tl.load(seg_indices + 2 * i_s)
    j = tl.load(seg_indices + 2 * i_s + 1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    boc = tl.load(chunk_offsets + i_n).to(tl.int64)
    n_chunks = tl.cdiv(T, BT)
    n_seg = tl.cdiv(n_chunks, L)
    c0 = j * L
    c1 = tl.minimum(c0 + L, n_chunks)
    return i_n, bos, T, boc, n_seg, j, c0, c1


@triton.jit
def _state_rows(o_k0, o_c, i, BK: tl.constexpr, STRIDE: tl.constexpr):
    """Offsets of rows [i*BK, (i+1)*BK), columns o_c of a [*, STRIDE] row-major state."""
    return (i * BK + o_k0)[:, None] * STRIDE + o_c[None, :]


@triton.jit
def _load_state(p, o_k0, o_c, LOAD: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                STRIDE: tl.constexpr):
    """Row halves (S0, S1) of columns o_c of a [K, STRIDE] state at p, as fp32 (zeros unless
    LOAD; S1 is a zero placeholder when K == BK)."""
    if LOAD:
        b_S0 = tl.load(p + _state_rows(o_k0, o_c, 0, BK, STRIDE)).to(tl.float32)
    else:
        b_S0 = tl.zeros([BK, BV], dtype=tl.float32)
    if LOAD and K > BK:
        b_S1 = tl.load(p + _state_rows(o_k0, o_c, 1, BK, STRIDE)).to(tl.float32)
    else:
        b_S1 = tl.zeros([BK, BV], dtype=tl.float32)
    return b_S0, b_S1


@triton.jit
def _store_state(p, b_S0, b_S1, o_k0, o_c, K: tl.constexpr, BK: tl.constexpr, STRIDE: tl.constexpr):
    """Store the row halves of a state block into columns o_c of a [K, STRIDE] state at p
    (in p's dtype)."""
    tl.store(p + _state_rows(o_k0, o_c, 0, BK, STRIDE), b_S0.to(p.dtype.element_ty))
    if K > BK:
        tl.store(p + _state_rows(o_k0, o_c, 1, BK, STRIDE), b_S1.to(p.dtype.element_ty))


@triton.jit
def _decay_half(k, G, b_S, b_vn, b_G_last, tok, m_r, o_kh, K: tl.constexpr, PRECISION: tl.constexpr):
    """Rows o_kh of the state update: S_h <- e^{G_last} S_h + K~[:, o_kh]^T V~."""
    b_G = tl.load(G + tok[:, None] * K + o_kh[None, :], mask=m_r, other=0.0)
    b_k = tl.load(k + tok[:, None] * K + o_kh[None, :], mask=m_r, other=0.0).to(tl.float32)
    # masked rows have k = 0 and G = 0 >= G_last, so K~ is 0 there without another mask
    b_k_to_end = b_k * tl.exp(b_G_last[None, :] - b_G)
    return b_S * tl.exp(b_G_last)[:, None] + tl.dot(tl.trans(b_k_to_end), b_vn, input_precision=PRECISION)


@triton.jit
def _chunk_step(k, W, U, G, h, v_new, b_S0, b_S1, i_t, bos, T, i_h, i_hc, col_u, is_b,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr, STORE: tl.constexpr, PRECISION: tl.constexpr):
    """One chunk applied to a [K, BV] state block held as row halves S0, S1 ([BK, BV] each;
    S1 is unused when K == BK): V~ = U_blk - W S, S <- Diag(e^{G_last}) S + K~^T V~.

    U_blk = U[:, col_u:col_u+BV] when `is_b`, else 0 (an A block of the transition walk).
    With STORE (the true walk) S is first stored into h at flat chunk `i_hc` and V~ into
    v_new, as `triton_fwd._scan_chunk` does. K is worked in halves of BK = 64, so half of
    the [BT, K] tiles W, G, k is live at a time: compiled for sm_90 at dk = 128 (tf32) the
    walk still takes 255 registers but spills 24 bytes per thread, against 80 for
    `_scan_chunk` (both at num_stages=1).
    """
    NK: tl.constexpr = K // BK
    o_k0 = tl.arange(0, BK)
    o_c = col_u + tl.arange(0, BV)
    rows = i_t * BT + tl.arange(0, BT)
    m_r = (rows < T)[:, None]
    tok = (bos + rows) * H + i_h
    if STORE:
        _store_state(h + (i_hc * H + i_h) * K * V, b_S0, b_S1, o_k0, o_c, K, BK, V)
    b_vn = tl.load(U + tok[:, None] * V + o_c[None, :], mask=m_r & is_b, other=0.0).to(tl.float32)
    b_w0 = tl.load(W + tok[:, None] * K + o_k0[None, :], mask=m_r, other=0.0).to(tl.float32)
    b_vn -= tl.dot(b_w0, b_S0, input_precision=PRECISION)
    if NK == 2:
        b_w1 = tl.load(W + tok[:, None] * K + (BK + o_k0)[None, :], mask=m_r, other=0.0).to(tl.float32)
        b_vn -= tl.dot(b_w1, b_S1, input_precision=PRECISION)
    if STORE:
        tl.store(v_new + tok[:, None] * V + o_c[None, :], b_vn.to(v_new.dtype.element_ty), mask=m_r)
    p_last = G + ((bos + tl.minimum(i_t * BT + BT, T) - 1) * H + i_h) * K
    b_S0 = _decay_half(k, G, b_S0, b_vn, tl.load(p_last + o_k0), tok, m_r, o_k0, K, PRECISION)
    if NK == 2:
        b_S1 = _decay_half(k, G, b_S1, b_vn, tl.load(p_last + BK + o_k0), tok, m_r, BK + o_k0, K, PRECISION)
    return b_S0, b_S1


@triton.jit
def _walk(k, W, U, G, h, v_new, b_S0, b_S1, c0, c1, bos, T, boc, i_h, col_u, is_b,
          H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
          BV: tl.constexpr, STORE: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """Chunks c0..c1-1 (chunk-in-sequence) through `_chunk_step`; returns the state halves."""
    if INTERPRETED:  # runtime-bound range() crashes the interpreter, see `triton_fwd`
        i_t = c0
        while i_t < c1:
            b_S0, b_S1 = _chunk_step(k, W, U, G, h, v_new, b_S0, b_S1, i_t, bos, T, i_h, boc + i_t, col_u, is_b,
                                     H, K, V, BT, BK, BV, STORE, PRECISION)
            i_t += 1
    else:
        for i_t in range(c0, c1):
            b_S0, b_S1 = _chunk_step(k, W, U, G, h, v_new, b_S0, b_S1, i_t, bos, T, i_h, boc + i_t, col_u, is_b,
                                     H, K, V, BT, BK, BV, STORE, PRECISION)
    return b_S0, b_S1


@triton.jit
def _segment_transition_kernel(
    k, W, U, G, h, v_new, h0, AB, cu_seqlens, chunk_offsets, seg_indices, L,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, BVT: tl.constexpr, HAS_H0: tl.constexpr, PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Phase 1: segment 0 walks from the initial state; middle segments build [A_s | B_s].

    k, G, W `[TT, H, K]`; U, v_new `[TT, H, V]`; h `[chunks, H, K, V]`; h0 `[N, H, K, V]`;
    AB `[segments, H, K, K + V]` fp32 receives [A_s | B_s] of middle segments and, in its
    B columns, the end state of each segment 0. Program column i_col: for segment 0 the
    value block [i_col BV, (i_col + 1) BV) (i_col < V / BV); for a middle segment the
    block [i_col BVT, (i_col + 1) BVT) of [A | B] (i_col < (K + V) / BVT; an A block if
    it lies in the first K columns). Other programs exit.
    Grid: (max(V // BV, (K + V) // BVT), segments * H).
    """
    i_col, i_sh = tl.program_id(0), tl.program_id(1)
    i_s, i_h = i_sh // H, i_sh % H
    i_n, bos, T, boc, n_seg, j, c0, c1 = _segment_location(cu_seqlens, chunk_offsets, seg_indices, i_s, L, BT)
    o_k0 = tl.arange(0, BK)
    p_AB = AB + (i_s.to(tl.int64) * H + i_h) * K * (K + V)
    if j == 0:
        if i_col < V // BV:
            o_v = i_col * BV + tl.arange(0, BV)
            if HAS_H0:
                b_S0, b_S1 = _load_state(h0 + (i_n.to(tl.int64) * H + i_h) * K * V, o_k0, o_v, True, K, BK, BV, V)
            else:
                b_S0, b_S1 = _load_state(h0, o_k0, o_v, False, K, BK, BV, V)
            b_S0, b_S1 = _walk(k, W, U, G, h, v_new, b_S0, b_S1, c0, c1, bos, T, boc, i_h, i_col * BV, True,
                               H, K, V, BT, BK, BV, True, PRECISION, INTERPRETED)
            _store_state(p_AB, b_S0, b_S1, o_k0, K + o_v, K, BK, K + V)
    elif j < n_seg - 1:
        if i_col < (K + V) // BVT:
            cols = i_col * BVT + tl.arange(0, BVT)  # columns of [A | B]
            is_a = i_col < K // BVT
            b_S0 = ((o_k0[:, None] == cols[None, :]) & is_a).to(tl.float32)  # [I | 0] columns
            b_S1 = (((BK + o_k0)[:, None] == cols[None, :]) & is_a).to(tl.float32)
            b_S0, b_S1 = _walk(k, W, U, G, h, v_new, b_S0, b_S1, c0, c1, bos, T, boc, i_h,
                               tl.maximum(i_col * BVT - K, 0), i_col >= K // BVT,
                               H, K, V, BT, BK, BVT, False, PRECISION, INTERPRETED)
            _store_state(p_AB, b_S0, b_S1, o_k0, cols, K, BK, K + V)


@triton.jit
def _segment_combine_kernel(
    h, h0, ht, AB, cu_seqlens, chunk_offsets, seg_offsets, L,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """Phase 2: S_1 = end of segment 0, S_{s+1} = A_s S_s + B_s, one sequence, head and value block.

    Writes S_s into h at segment s's first chunk (s >= 1) and, in fp32 whatever h's dtype,
    S_{s+1} over B_s in AB (each entry of S_{s+1} depends on the same entry of B_s, so the
    store cannot overtake the load), so that AB[s - 1]'s B columns hold S_s for phase 3
    (S_1 is already there: segment 0's end state). Writes ht for sequences with at most
    one segment (phase 3 writes it for the others). Grid: (V // BV, N * H).
    """
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    boc = tl.load(chunk_offsets + i_n).to(tl.int64)
    s0 = tl.load(seg_offsets + i_n).to(tl.int64)
    n_seg = tl.cdiv(tl.cdiv(T, BT), L)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    p_S = (i_h * K + o_k[:, None]) * V + o_v[None, :]  # within one [H, K, V] state
    p_B = (i_h * K + o_k[:, None]) * (K + V) + K + o_v[None, :]  # B columns within one [H, K, K + V]
    p_A = (i_h * K + o_k[:, None]) * (K + V) + o_k[None, :]
    if n_seg == 0:
        if STORE_HT:
            if HAS_H0:
                tl.store(ht + i_n.to(tl.int64) * H * K * V + p_S, tl.load(h0 + i_n.to(tl.int64) * H * K * V + p_S))
            else:
                tl.store(ht + i_n.to(tl.int64) * H * K * V + p_S, tl.zeros([K, BV], dtype=tl.float32))
    else:
        b_S = tl.load(AB + s0 * H * K * (K + V) + p_B)
        if INTERPRETED:
            j = tl.full([], 1, dtype=tl.int64)
            while j < n_seg - 1:
                tl.store(h + (boc + j * L) * H * K * V + p_S, b_S.to(h.dtype.element_ty))
                p_seg = (s0 + j) * H * K * (K + V)
                b_S = tl.dot(tl.load(AB + p_seg + p_A), b_S, input_precision=PRECISION) + tl.load(AB + p_seg + p_B)
                tl.store(AB + p_seg + p_B, b_S)
                j += 1
        else:
            for j in range(1, n_seg - 1):
                tl.store(h + (boc + j * L) * H * K * V + p_S, b_S.to(h.dtype.element_ty))
                p_seg = (s0 + j) * H * K * (K + V)
                b_S = tl.dot(tl.load(AB + p_seg + p_A), b_S, input_precision=PRECISION) + tl.load(AB + p_seg + p_B)
                tl.store(AB + p_seg + p_B, b_S)
        if n_seg >= 2:
            tl.store(h + (boc + (n_seg - 1) * L) * H * K * V + p_S, b_S.to(h.dtype.element_ty))
        else:
            if STORE_HT:
                tl.store(ht + i_n.to(tl.int64) * H * K * V + p_S, b_S)


@triton.jit
def _segment_walk_kernel(
    k, W, U, G, h, v_new, ht, AB, cu_seqlens, chunk_offsets, seg_indices, L,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    STORE_HT: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """Phase 3: segments s >= 1 walk from their true initial state (fp32, in the B columns
    of the previous segment's AB, see `_segment_combine_kernel`).

    Writes h and v_new for their chunks, and ht from each sequence's last segment.
    Grid: (V // BV, segments * H).
    """
    i_v, i_sh = tl.program_id(0), tl.program_id(1)
    i_s, i_h = i_sh // H, i_sh % H
    i_n, bos, T, boc, n_seg, j, c0, c1 = _segment_location(cu_seqlens, chunk_offsets, seg_indices, i_s, L, BT)
    if j > 0:
        o_k0 = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        p_start = AB + ((i_s - 1).to(tl.int64) * H + i_h) * K * (K + V) + K  # B columns of segment s - 1
        b_S0, b_S1 = _load_state(p_start, o_k0, o_v, True, K, BK, BV, K + V)
        b_S0, b_S1 = _walk(k, W, U, G, h, v_new, b_S0, b_S1, c0, c1, bos, T, boc, i_h, i_v * BV, True,
                           H, K, V, BT, BK, BV, True, PRECISION, INTERPRETED)
        if STORE_HT:
            if j == n_seg - 1:
                p_ht = ht + (i_n.to(tl.int64) * H + i_h) * K * V
                _store_state(p_ht, b_S0, b_S1, o_k0, o_v, K, BK, V)


# ----------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------
def segment_scan(
    k: torch.Tensor,
    W: torch.Tensor,
    U: torch.Tensor,
    G: torch.Tensor,
    h: torch.Tensor,
    v_new: torch.Tensor,
    h0: torch.Tensor | None,
    ht: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    chunk_offsets: torch.Tensor,
    bounds: list[int],
    precision: str,
    segment_chunks: int | None = None,
) -> int:
    """Stage 3 of the forward by segments: fills h, v_new and ht like `_state_scan_kernel`.

    k `[TT, H, K]` (input dtype); G `[TT, H, K]` fp32, W `[TT, H, K]`, U `[TT, H, V]` (stage 2);
    h `[chunks, H, K, V]`, v_new `[TT, H, V]` outputs (W, U, h, v_new: the input dtype or
    fp32; upcast on load, cast on store); h0 / ht `[N, H, K, V]` fp32 or
    None; cu_seqlens / chunk_offsets as in `triton_fwd`; bounds = cu_seqlens on the host.
    segment_chunks: L, or None for `default_segment_chunks`. Returns the L used.
    """
    TT, H, K = W.shape
    V = U.shape[-1]
    N = len(bounds) - 1
    chunk_counts = [-(-(e - s) // CHUNK) for s, e in zip(bounds[:-1], bounds[1:])]
    L = segment_chunks if segment_chunks is not None else default_segment_chunks(chunk_counts, H, K, V)
    seg_indices, seg_offsets = segment_layout(bounds, L, W.device)
    n_segs = seg_indices.shape[0]
    BK, BV, BVT = scan_blocks(K, V)
    AB = torch.empty(max(n_segs, 1), H, K, K + V, dtype=torch.float32, device=W.device)
    common = dict(H=H, K=K, V=V, BT=CHUNK, BV=BV, PRECISION=precision, INTERPRETED=_interpreted(),
                  num_warps=4 if K <= 64 else 8, num_stages=1)
    # num_stages=1: a second stage would double shared memory (about 57 -> 148 KB at dk=128)
    if n_segs:
        _segment_transition_kernel[(max(V // BV, (K + V) // BVT), n_segs * H)](
            k, W, U, G, h, v_new, h0, AB, cu_seqlens, chunk_offsets, seg_indices, L,
            BK=BK, BVT=BVT, HAS_H0=h0 is not None, **common,
        )
    _segment_combine_kernel[(V // BV, N * H)](
        h, h0, ht, AB, cu_seqlens, chunk_offsets, seg_offsets, L,
        HAS_H0=h0 is not None, STORE_HT=ht is not None, **common,
    )
    if any(n > L for n in chunk_counts):  # some sequence has a second segment
        _segment_walk_kernel[(V // BV, n_segs * H)](
            k, W, U, G, h, v_new, ht, AB, cu_seqlens, chunk_offsets, seg_indices, L,
            BK=BK, STORE_HT=ht is not None, **common,
        )
    return L


# ----------------------------------------------------------------------------------------
# plain-PyTorch reference of the segment decomposition
# ----------------------------------------------------------------------------------------
def chunk_map_torch(
    k: torch.Tensor, W: torch.Tensor, U: torch.Tensor, G: torch.Tensor, s: int, e: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The affine state map `S -> A_c S + B_c` of the chunk made of tokens s..e-1.

    k, W, G `[TT, H, K]`, U `[TT, H, V]` (one dtype). Returns A_c `[H, K, K]`
    = Diag(e^{G_last}) - K~^T W, B_c `[H, K, V]` = K~^T U and K~ `[H, e - s, K]`
    = e^{G_last - G} ⊙ K.
    """
    G_last = G[e - 1]  # [H, K]
    k_to_end = (k[s:e] * torch.exp(G_last[None] - G[s:e])).transpose(0, 1)
    A = torch.diag_embed(torch.exp(G_last)) - k_to_end.transpose(1, 2) @ W[s:e].transpose(0, 1)
    B = k_to_end.transpose(1, 2) @ U[s:e].transpose(0, 1)
    return A, B, k_to_end


def segment_scan_torch(
    k: torch.Tensor,
    W: torch.Tensor,
    U: torch.Tensor,
    G: torch.Tensor,
    bounds: list[int],
    segment_chunks: int,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The segment decomposition in plain PyTorch (dense A_s), for checking the algebra.

    k, W, G `[TT, H, K]`, U `[TT, H, V]`, all in one dtype (use float64 for a tight
    check); bounds: sequence boundaries over TT; initial_state `[N, H, K, V]` or None.
    Phases 1-2: (A_s, B_s) of every segment as products of `chunk_map_torch`, then
    S_{s+1} = A_s S_s + B_s from the initial state; phase 3: each segment walks its chunks
    from S_s (V~ = U - W S, S <- e^{G_last} S + K~^T V~). Returns h `[chunks, H, K, V]`
    (each chunk's initial state), v_new `[TT, H, V]` and the final state `[N, H, K, V]`
    (from the combine, not from the walks). Python loops: small shapes only.
    """
    TT, H, K = W.shape
    V = U.shape[-1]
    N = len(bounds) - 1
    S0 = initial_state.to(W.dtype) if initial_state is not None else W.new_zeros(N, H, K, V)
    h_chunks, v_new, S_final = [], torch.zeros_like(U), torch.empty_like(S0)
    for n in range(N):
        e_tok = bounds[n + 1]
        starts = list(range(bounds[n], e_tok, CHUNK))
        segs = [starts[i : i + segment_chunks] for i in range(0, len(starts), segment_chunks)]
        S, seg_init = S0[n], []
        for seg in segs:  # phases 1 and 2
            seg_init.append(S)
            A_s, B_s = torch.eye(K, dtype=W.dtype).expand(H, K, K), W.new_zeros(H, K, V)
            for c in seg:
                A_c, B_c, _ = chunk_map_torch(k, W, U, G, c, min(c + CHUNK, e_tok))
                A_s, B_s = A_c @ A_s, A_c @ B_s + B_c
            S = A_s @ S + B_s
        S_final[n] = S
        for seg, S in zip(segs, seg_init):  # phase 3
            for c in seg:
                e = min(c + CHUNK, e_tok)
                h_chunks.append(S)
                vn = U[c:e].transpose(0, 1) - W[c:e].transpose(0, 1) @ S  # [H, e - c, V]
                v_new[c:e] = vn.transpose(0, 1)
                _, _, k_to_end = chunk_map_torch(k, W, U, G, c, e)
                S = torch.exp(G[e - 1])[..., None] * S + k_to_end.transpose(1, 2) @ vn
    h = torch.stack(h_chunks) if h_chunks else W.new_zeros(0, H, K, V)
    return h, v_new, S_final
