"""Activations, per GPU. Local tokens `t = local_batch * seq_len / cp`. Everything is bytes per
local token times `t`, plus one per-layer constant (the router's fp32 weight copy) and, for
eager MLA layers, a term in the squared local sequence length (see "Eager activations").
Compiled model. Counting rule ("kept" = held from the forward until the backward uses it):
every matmul's input in the dtype it is fed; the custom ops' saved inputs (KDA op: q, k, v,
g, beta; grouped GEMM: its input); SDPA's q, k, v, output and fp32 logsumexp; each chain of
elementwise ops (casts, gates, SiLU, SiTU, conv taps) keeps its input once; norms keep input
+ fp32 rstd; a tensor used twice counts once. Dtypes as the code produces them. This is what
fused (compiled) layers need to keep; Inductor's partitioner may keep somewhat less. Eager
PyTorch keeps 2-3x more (measured, below). Per token (D = dim, I = H*dk, S = the most AttnRes
sources, `attn_res.max_sources`):
  sub-layer prologue (x2 per layer): mixer softmax + key-norm stats `2 (S+1) * 4`; mixer
    output h (pre-norm input) `D s`; rstd 4; normed x (projection input) `D a`.
  KDA: projections wq|wk|wv concatenated, the conv input `3I a`; q, k after L2 norm and v
    (op inputs) `3I a`; L2 rstd `2H * 4`; w_f_down output `dk a`; z (gate input) `I a`;
    g (op input, fp32) `I * 4`; w_beta output `H a`; beta (fp32) `H * 4`; o (op output,
    head-norm input) `I a`; head-norm rstd `H * 4`; w_gate output `I a`; wo input `I a`.
    The chunk states `[T/64, H, dk, dv]` fp32 are not kept (the op saves only its inputs and
    recomputes them): they are in the op's workspace, below.
  MLA (r_q, r_kv, n = nope, r = shared, v head dims): w_dq output `r_q a` + rstd;
    normed c_q `r_q a`; q `H(n+r) a`; w_dkv output `(r_kv+r) a` + rstd; normed c_kv
    `r_kv a`; w_ukv output (k_n | v) `H(n+v) a`; k = [k_n, k_s] `H(n+r) a`; SDPA output
    `H v a` and logsumexp `H * 4`; o in fp32 (gate product input) `H v * 4`; w_g output
    `H v a`; w_o input `H v a`.
  dense FFN (hidden F): w_gate_up output `2F a`; hidden `F a`.
  LatentMoE (n experts, top-k, latent L, expert hidden h, shared hidden F_s = n_shared *
    moe_shared_hidden): router input x in fp32 `D * 4`; router scores fp32 `n * 4`; top-k ids
    int64 and weights fp32 `k (8+4)`; sort order + inverse int64 `2k * 8`; dispatched latent
    copies `k L a`; expert gate|up pre-activations `k 2h a`; expert hidden `k h a`; expert
    outputs, unsorted (combine input) `k L a`; u fp32 `L * 4` + rstd; w_latent_up input
    `L a`; shared experts `2 F_s a + F_s a`. Per layer constant: the router weight cast to
    fp32, `n D * 4` (when the weight is not already fp32).
  AttnRes stream: block mode keeps b_0 `D s`, one `D s` per closed block, and the partial
    sum b_cur after each sub-layer `2 D s` per layer (1 per layer under AC: only each
    layer's input); full mode keeps b_0 and every sub-layer's output, `D s` each; none mode
    keeps the running sum `2 D s` per layer.
  head: a prologue (final mix + norm) and the log-softmax output of the loss `V * 4`.
  transient peaks: head `V * 8`, two more fp32 `[T, V]` tensors (forward: the fp32 logits
    next to the `a` ones; backward: the gradients into and out of log-softmax). One layer in
    backward: eager layers (`--activations eager`) measured, op by op, what their backward
    allocates (`transient.measure_layer_peaks`: autograd's gradients and temporaries, the
    KDA Triton launchers' tensors, SDPA's memory-efficient backward; without AC and, as the
    whole "in backward" of full AC, recompute included; also their forward's peak, for the
    step walk's forward phases); fused layers a heuristic, `2 *
    largest kept tensor` (the gradients of the op being differentiated) plus workspaces: KDA
    op, the Triton backward launcher's tensors at its peak (`transient.kda_bwd_allocations`,
    contiguous inputs; `kda_bwd_workspace_per_token`): lean walk `(4C + 3dk + dv + dk dv / C
    + 1) * 4 * H` (the recomputed forward's fp32 G, A_qk, A_inv and bf16 chunk states h,
    v_new; bf16 dh, dv_new, dq/dk partials; fp32 dA_qk, dA_kk, dG, dbeta partial), classic
    `(4C + 4dk + 3dv + 2 dk dv / C + 1) * 4 * H` (fp32 but the partials, W and U too); QB histogram
    `32 n` (fp32 margins + temporary, three int64 [T, n] index tensors: the recompute's). Both add, by layout: EP all-to-all
    send + receive buffers `2 k L a` (ep > 1). The AttnRes stream gradients `(S+1) D s` are
    counted by the step walk, not here.
  context parallelism (cp > 1): the layers run as one rank of the group runs them
    (`context_parallel`, the worst rank by default): eager layers are measured that way; the
    fused count adds the per-row buffers `context_parallel.cp_buffers` counts (MLA: the row's
    all-gathered latents `cp (R+S) a` and key copies `(cp + 1/2)(R+S) a` per local token kept,
    "headtail"'s received inputs `D a` kept and its send/receive buffers `2 D a` in backward,
    the attention's score blocks as `transient_sq`; KDA on a continuing rank: the basis call's
    tensors) to the single-device entries, which CP's latent attention does not match (no
    per-head keys and values; latent queries). Compiled under CP the trainer compiles each layer
    piecewise and runs the attention's core eagerly between the regions
    (`titan_moe.context_parallel`, "Compile"): this count is not checked against such a run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import torch

from titan_moe.model.args import ModelArgs
from titan_moe.model.attn_res import max_sources
from titan_moe.ops.kda import keep_selected, residual_bytes_per_token

from titan_moe.plan.context_parallel import CP_ATTENTION_CHUNKS, CPOptions, chunk_seq_sq, cp_buffers
from titan_moe.plan.eager import eager_profiles
from titan_moe.plan.layout import ACTIVATION_MODELS, KDA_CHUNK, Layout, Precision
from titan_moe.plan.transient import LayerPeaks, _peak, kda_bwd_allocations, layer_peaks

# =========================================================================== activations
@dataclass(frozen=True)
class Entry:
    """One tensor of a layer's forward, in bytes per local token.

    kept: held until backward with AC off. mm: produced by an `aten.mm` (order matters for
    op-level SAC). sdpa: an SDPA output (always kept by op-level SAC).
    """

    name: str
    bytes: float
    kept: bool = True
    mm: bool = False
    sdpa: bool = False


@dataclass
class LayerActivations:
    """One decoder layer: its tensors in forward order, its transient workspace, constants.

    `measured` (eager model): bytes per token eager autograd saves, measured by
    `measure_eager_layer`; it replaces the entries' sum as `kept` (the entries still decide
    what op-level SAC keeps). `per_seq_sq`: bytes per sequence per squared local sequence
    length, kept like `kept` (eager MLA: the additive document mask). `peaks` (eager model,
    `transient.measure_layer_peaks`): what the layer's forward and backward allocate above
    their start, measured op by op, without AC and under full AC; they replace the fused
    heuristic (`2 * largest kept entry + workspace`, nothing for the forward).
    `layout_workspace`: the layout's buffers per token (EP all-to-all, the context-parallel
    MLA's exchange), added to every transient. `chunk_caps` (a context-parallel layer,
    `CPOptions.chunk_caps`): its `T^2` terms are its attention's score blocks, evaluated at
    `seq_sq` (below). `transient_sq`: bytes per `seq_sq` unit the fused heuristic adds to
    the backward (the compiled count's context-parallel score blocks).
    """

    kind: str
    entries: list[Entry]
    workspace: float  # fused heuristic: bytes per token, alive only while the layer runs backward
    constant: float = 0.0  # bytes per layer, independent of tokens (kept like `kept` tensors)
    measured: float | None = None
    per_seq_sq: float = 0.0
    peaks: LayerPeaks | None = None
    layout_workspace: float = 0.0
    chunk_caps: tuple[float, float] | None = None
    transient_sq: float = 0.0

    def seq_sq(self, local_batch: int, seq_local: int) -> float:
        """The second argument of the `*_at` methods for `local_batch` sequences of `seq_local`
        local tokens: the sum of their squared lengths, or for a context-parallel layer what
        its score blocks grow with (`context_parallel.chunk_seq_sq`)."""
        return chunk_seq_sq(self.chunk_caps, local_batch, seq_local)

    @cached_property
    def kept(self) -> float:
        if self.measured is not None:
            return self.measured
        return sum(e.bytes for e in self.entries if e.kept)

    @cached_property
    def _sac_saved(self) -> list[bool]:
        """Op-level SAC's choice per entry: every other mm output (1st, 3rd, ...), SDPA outputs."""
        saved, n_mm = [], 0
        for e in self.entries:
            n_mm += e.mm
            saved.append((e.mm and n_mm % 2 == 1) or e.sdpa)
        return saved

    @cached_property
    def sac_kept(self) -> float:
        """Bytes per token op-level SAC keeps for this layer."""
        return sum(e.bytes for e, keep in zip(self.entries, self._sac_saved) if keep)

    @cached_property
    def sac_recompute(self) -> float:
        """Bytes per token a SAC backward rematerialises: the kept tensors SAC did not keep."""
        return self.kept - sum(e.bytes for e, keep in zip(self.entries, self._sac_saved) if e.kept and keep)

    @cached_property
    def transient(self) -> float:
        """Bytes per token the backward adds above the kept tensors, without AC (measured:
        where T^2 terms do not matter)."""
        if self.peaks is not None:
            return self.peaks.backward.per_token + self.layout_workspace
        largest = max((e.bytes for e in self.entries if e.kept), default=0.0)
        return 2 * largest + self.workspace + self.layout_workspace

    def transient_at(self, tokens: float, seq_sq: float) -> float:
        """Bytes the backward adds above its start without AC (and in op-level SAC's backward,
        above the rematerialised tensors), for `tokens` local tokens whose sequences' squared
        lengths sum to `seq_sq`."""
        if self.peaks is not None:
            return self.peaks.backward.at(tokens, seq_sq) + self.layout_workspace * tokens
        return self.transient * tokens + self.transient_sq * seq_sq

    def full_ac_backward_at(self, tokens: float, seq_sq: float) -> float:
        """Bytes alive in the backward under full AC above its start, recompute included
        (measured; else kept + T^2 term + transient), without the per-layer constant and the
        autocast weight copies (the step walk adds those)."""
        if self.peaks is not None:
            return self.peaks.full_backward.at(tokens, seq_sq) + self.layout_workspace * tokens
        return (self.kept + self.transient) * tokens + (self.per_seq_sq + self.transient_sq) * seq_sq

    @cached_property
    def full_ac_backward_sq(self) -> float:
        """The T^2 term beside the largest per-token one (display; eager MLA: its mask)."""
        if self.peaks is not None:
            return max(self.peaks.full_backward.points)[1]
        return self.per_seq_sq

    def forward_at(self, full_ac: bool, tokens: float, seq_sq: float) -> float:
        """High-water mark of the layer's forward above its start (measured; else what a fused
        layer keeps, nothing under full AC), without constants."""
        if self.peaks is not None:
            profile = self.peaks.full_forward if full_ac else self.peaks.forward
            return profile.at(tokens, seq_sq) + self.layout_workspace * tokens
        return 0.0 if full_ac else self.kept * tokens + self.per_seq_sq * seq_sq


def _prologue(prefix: str, args: ModelArgs, s: int, a: int) -> list[Entry]:
    D = args.dim
    out = []
    if args.attn_res != "none":
        S = max_sources(args.attn_res, args.n_layers, args.attn_res_block_size)
        out.append(Entry(f"{prefix}.mix_stats", 2 * (S + 1) * 4))
        out.append(Entry(f"{prefix}.mix_out", D * s))
    out.append(Entry(f"{prefix}.norm_rstd", 4))
    out.append(Entry(f"{prefix}.norm_out", D * a))
    return out


def _kda(args: ModelArgs, a: int) -> tuple[list[Entry], float]:
    H, dk = args.kda_n_heads, args.kda_head_dim
    dv, I, D = dk, H * dk, args.dim
    e = [
        Entry("kda.wq", I * a, kept=False, mm=True),
        Entry("kda.wk", I * a, kept=False, mm=True),
        Entry("kda.wv", I * a, kept=False, mm=True),
        Entry("kda.qkv_conv_in", 3 * I * a),
        Entry("kda.qkv_op_in", 3 * I * a),
        Entry("kda.l2_rstd", 2 * H * 4),
        Entry("kda.w_f_down", dk * a, mm=True),
        Entry("kda.w_f_up", I * a, mm=True),
        Entry("kda.g_fp32", I * 4),
        Entry("kda.w_beta", H * a, mm=True),
        Entry("kda.beta_fp32", H * 4),
        Entry("kda.o", I * a),
        Entry("kda.head_rstd", H * 4),
        Entry("kda.w_gate", I * a, mm=True),
        Entry("kda.wo_in", I * a),
        Entry("kda.wo", D * a, kept=False, mm=True),
    ]
    if keep_selected():  # the kept forward's residuals (the `kda_keep` choice, on by default)
        e.append(Entry("kda.kept_residuals", kept_residual_bytes_per_token(args, a)))
    return e, kda_bwd_workspace_per_token(H, dk, dv)


def kda_bwd_workspace_per_token(H: int, dk: int, dv: int) -> float:
    """Bytes per token of the KDA Triton backward launcher's own tensors at its peak (its
    outputs, the op's gradients, excluded), from `transient.kda_bwd_allocations` with
    contiguous bf16 inputs over whole chunks: `(4C + 3dk + dv + dk dv / C + 1 + s) * 4 * H`
    (and the chunk layout's int32s; the dq / dk partials in bf16, `triton_bwd.bwd_parts_dtype`),
    where s = dk / 64 when the backward intra kernel splits the key columns (dk > 64,
    `triton_bwd.bwd_intra_bk`: its dbeta shares), else 0."""
    T = 16 * KDA_CHUNK
    with torch.device("meta"):
        q = torch.empty(1, T, H, dk, dtype=torch.bfloat16)
        v = torch.empty(1, T, H, dv, dtype=torch.bfloat16)
        g = torch.empty(1, T, H, dk)
        beta = torch.empty(1, T, H)
    events = kda_bwd_allocations(q, q, v, g, beta, 1.0, None, None, v, None)
    outputs = sum(n for name, n in events if name in ("dq", "dk", "dv", "dg", "dbeta"))
    return (_peak(events) - outputs) / T


def kept_residual_bytes_per_token(args: ModelArgs, element_bytes: int = 2, g_cumsum: bool = False) -> float:
    """Bytes per token one KDA layer's forward keeps for its backward under the `kda_keep`
    choice (on by default), for q of `element_bytes` (16-bit or fp32): the op's
    `residual_bytes_per_token`; an entry of the compiled count when the choice is on (the
    eager profile measures them: `eager.GpuKernelSaves`). `g_cumsum`: the eager layer's case,
    where `kda_prepare` hands the op G itself, so no G of its own is kept (compiled layers
    take the composite input maps and keep it)."""
    dtype = torch.bfloat16 if element_bytes == 2 else torch.float32
    return residual_bytes_per_token(args.kda_n_heads, args.kda_head_dim, args.kda_head_dim, dtype, g_cumsum)


def _mla(args: ModelArgs, a: int) -> list[Entry]:
    H, D = args.mla_n_heads, args.dim
    rq, rkv = args.mla_q_lora_rank, args.mla_kv_lora_rank
    n, r, v = args.mla_qk_nope_head_dim, args.mla_qk_shared_dim, args.mla_v_head_dim
    e = [
        Entry("mla.w_dq", rq * a, mm=True),
        Entry("mla.q_norm_rstd", 4),
        Entry("mla.c_q", rq * a),
        Entry("mla.w_uq", H * (n + r) * a, mm=True),
        Entry("mla.w_dkv", (rkv + r) * a, mm=True),
        Entry("mla.kv_norm_rstd", 4),
        Entry("mla.c_kv", rkv * a),
        Entry("mla.w_ukv", H * (n + v) * a, mm=True),
        Entry("mla.k", H * (n + r) * a),
        Entry("mla.sdpa_out", H * v * a, sdpa=True),
        Entry("mla.sdpa_lse", H * 4, sdpa=True),
        Entry("mla.o_fp32", H * v * 4),
        Entry("mla.w_g", H * v * a, mm=True),
        Entry("mla.w_o_in", H * v * a),
        Entry("mla.w_o", D * a, kept=False, mm=True),
    ]
    return e


def _context_parallel(args: ModelArgs, a: int, kind: str, cp: int, options: CPOptions) -> tuple[list[Entry], float, float]:
    """The compiled count's context-parallel terms of one layer kind, per local token (the
    counted buffers of `context_parallel.cp_buffers`, added to the fused single-device entries;
    not checked against a compiled context-parallel run): kept entries, the backward's
    workspace (MLA: "headtail"'s send and receive buffers of the layer's outputs, `2 D a`) and
    the score blocks' `transient_sq` (about four fp32 blocks of `min(c, rho L)` rows alive at the
    attention's peaks, the previous chunk's two among them: `16 H rho f / n` per `seq_sq`
    unit, `context_parallel.chunk_seq_sq`)."""
    L = 1024  # any even length: the buffers below are per local token at any length
    buffers = {name: b / L for name, b in cp_buffers(args, a, cp, L, options).items()}
    if kind == "kda":
        return [Entry("cp.kda_basis", buffers["kda.basis"])], 0.0, 0.0
    headtail = options.balance == "headtail"
    rho, f = options.attention_shape(cp)
    entries = [Entry("cp.mla_latent_gather", buffers["mla.latent_gather"]),
               Entry("cp.mla_key_copies", buffers["mla.key_copies"])]
    if headtail:
        entries.append(Entry("cp.mla_exchange", buffers["mla.exchange"]))
    return entries, 2 * args.dim * a if headtail else 0.0, 16 * args.mla_n_heads * rho * f / CP_ATTENTION_CHUNKS


def _dense_ffn(args: ModelArgs, a: int) -> list[Entry]:
    F, D = args.dense_hidden, args.dim
    return [
        Entry("ffn.w_gate_up", 2 * F * a, mm=True),
        Entry("ffn.hidden", F * a),
        Entry("ffn.w_down", D * a, kept=False, mm=True),
    ]


def _moe(args: ModelArgs, a: int, ep: int) -> tuple[list[Entry], float, float]:
    D, n, k = args.dim, args.n_routed_experts, args.top_k
    L, h = args.moe_latent_dim, args.moe_expert_hidden
    e = [
        Entry("moe.router_in_fp32", D * 4),
        Entry("moe.router_scores", n * 4, mm=True),
        Entry("moe.topk_ids_weights", k * (8 + 4)),
        Entry("moe.w_latent_down", L * a, kept=False, mm=True),
        Entry("moe.sort_order_inverse", 2 * k * 8),
        Entry("moe.dispatched", k * L * a),
        Entry("moe.expert_gate_up", k * 2 * h * a),
        Entry("moe.expert_hidden", k * h * a),
        Entry("moe.expert_out", k * L * a),
        Entry("moe.u_fp32", L * 4 + 4),
        Entry("moe.w_latent_up_in", L * a),
        Entry("moe.w_latent_up", D * a, kept=False, mm=True),
    ]
    if args.n_shared_experts > 0:
        Fs = args.n_shared_experts * args.moe_shared_hidden
        e += [
            Entry("moe.shared_gate_up", 2 * Fs * a, mm=True),
            Entry("moe.shared_hidden", Fs * a),
            Entry("moe.shared_down", D * a, kept=False, mm=True),
        ]
    qb = 32 * n if args.balance_rule == "qb" and args.qb_bins > 0 and k < n else 0.0
    all_to_all = 2 * k * L * a if ep > 1 else 0.0
    return e, qb, all_to_all


def layer_activations(
    args: ModelArgs, layer_idx: int, prec: Precision, layout: Layout, cp_options: CPOptions = CPOptions()
) -> LayerActivations:
    """The tensors of decoder layer `layer_idx` in forward order (bytes per local token); with
    `layout.cp > 1` the context-parallel terms of `_context_parallel` too."""
    a, s = prec.compute, prec.stream(layout.fsdp_enabled)
    kind = args.layer_kinds()[layer_idx]
    entries = _prologue("attn", args, s, a)
    layout_workspace = transient_sq = 0.0
    if kind == "kda":
        attn, workspace = _kda(args, a)
    else:
        attn, workspace = _mla(args, a), 0.0
    entries += attn
    if layout.cp > 1:  # the fused count's; an eager layer's measurement holds them
        cp_entries, cp_workspace, transient_sq = _context_parallel(args, a, kind, layout.cp, cp_options)
        entries += cp_entries
        workspace += cp_workspace
    chunk_caps = cp_options.chunk_caps(kind, layout.cp) if layout.cp > 1 else None
    entries += _prologue("ffn", args, s, a)
    constant = 0.0
    if args.is_moe_layer(layer_idx):
        moe, qb, all_to_all = _moe(args, a, layout.ep)
        entries += moe
        workspace += qb
        layout_workspace += all_to_all
        weight_bytes = a if layout.fsdp_enabled else prec.param
        if weight_bytes != 4:
            constant = args.n_routed_experts * args.dim * 4
        kind += "+moe"
    else:
        entries += _dense_ffn(args, a)
        kind += "+dense"
    return LayerActivations(kind, entries, workspace, constant, layout_workspace=layout_workspace,
                            chunk_caps=chunk_caps, transient_sq=transient_sq)


def model_activations(
    args: ModelArgs, prec: Precision, layout: Layout, activations: str = "compiled",
    cp_options: CPOptions = CPOptions(),
) -> list[LayerActivations]:
    """Every layer's `LayerActivations`; layers of one kind share one object.

    `activations`: "compiled" counts what fused layers keep (the entries); "eager" puts the
    bytes eager autograd saves, measured once per layer kind (`eager_profiles`), in `measured`
    and what its forward and backward allocate (`layer_peaks`) in `peaks`.
    Compiled with expert parallelism, MoE layers are compiled piecewise around their routed
    experts, which run eagerly (`parallelize.apply_compile`); the fused count holds for them
    too, because SiTU-GLU's autograd keeps only its pre-activations (tests/test_plan.py checks
    that eager experts keep exactly the `moe.expert_gate_up` and `moe.expert_hidden` bytes).
    """
    if activations not in ACTIVATION_MODELS:
        raise ValueError(f"activations must be one of {ACTIVATION_MODELS}, got {activations!r}")
    eager = activations == "eager"
    profiles = eager_profiles(args, prec, layout.fsdp_enabled, layout.cp, cp_options) if eager else {}
    peaks = layer_peaks(args, prec, layout.fsdp_enabled, layout.cp, cp_options) if eager else {}
    by_kind: dict[tuple[str, bool], LayerActivations] = {}
    layers = []
    for i, kind in enumerate(args.layer_kinds()):
        key = (kind, args.is_moe_layer(i))
        if key not in by_kind:
            layer = layer_activations(args, i, prec, layout, cp_options)
            if key in profiles:
                layer = replace(layer, measured=profiles[key].per_token, per_seq_sq=profiles[key].per_seq_sq,
                                peaks=peaks[key])
            by_kind[key] = layer
        layers.append(by_kind[key])
    return layers


def with_moe_token_tiles(layer: LayerActivations, args: ModelArgs, tokens: float) -> LayerActivations:
    """`layer` at `tokens` local tokens with `model.moe_token_tile` (`LatentMoE.forward_tiles`):
    unchanged when off, for `tokens <= moe_token_tile`, without MoE, and for measured (eager)
    layers, whose profiles are of the untiled layer. Otherwise each tile's MoE runs under its own
    checkpoint: the `moe.*` tensors are not kept until the backward (the tiles' input is the
    ffn prologue's normed x, already counted), and the backward recomputes and holds one tile's
    at a time. Counted as a workspace of `min(tokens, tile)` tokens, spread over `tokens` (exact at
    this count): the tile's kept `moe.*` bytes, twice its largest (its gradients) and its QB
    histogram temporaries (`_moe`'s `32 n`, now per tile). Op-level SAC's choice of saved
    matmul outputs is left as untiled (its caching mode also runs inside the tiles; not measured)."""
    tile = args.moe_token_tile
    moe = [e for e in layer.entries if e.name.startswith("moe.")]
    if not tile or tokens <= tile or not moe or layer.peaks is not None or layer.measured is not None:
        return layer
    share = tile / tokens
    kept = [e.bytes for e in moe if e.kept]
    qb = _moe(args, 1, 1)[1]  # the layer's QB workspace (independent of the dtype and layout)
    entries = [replace(e, kept=False) if e.name.startswith("moe.") else e for e in layer.entries]
    workspace = layer.workspace - qb + (sum(kept) + 2 * max(kept, default=0.0) + qb) * share
    return replace(layer, entries=entries, workspace=workspace)
