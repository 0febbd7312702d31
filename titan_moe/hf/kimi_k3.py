"""Import of the public Kimi K3 checkpoint layout (`moonshotai/Kimi-K3`) into our model.

Names (text backbone; the release prefixes them with `language_model.`, a text-only export
with nothing; `vision_tower.*` and `mm_projector.*` are skipped and counted):

    public (model.layers.N.<...>)                      ours (layers.N.<...>)
    model.embed_tokens.weight                          tok_embeddings.weight
    lm_head.weight                                     output.weight
    model.norm.weight                                  norm.weight
    model.output_attn_res_proj.weight [1, D]           final_mix.query [D]
    model.output_attn_res_norm.weight                  final_mix.key_norm.weight
    input_layernorm / post_attention_layernorm         attention_norm / ffn_norm
    self_attention_res_proj [1, D] / _res_norm         attention_mix.query [D] / .key_norm
    mlp_res_proj [1, D] / mlp_res_norm                 ffn_mix.query [D] / .key_norm
    KDA  self_attn.{q,k,v}_proj                        attention.w{q,k,v}
         self_attn.{q,k,v}_conv1d.weight [C, 1, K]     attention.{q,k,v}_conv_weight [C, K]
         self_attn.A_log [128 * ceil(H / 128)]         attention.A_log [H] (the first H; the rest is padding)
         self_attn.dt_bias, o_norm.weight              attention.dt_bias, o_norm_weight
         self_attn.f_a_proj / f_b_proj / b_proj        attention.w_f_down / w_f_up / w_beta
         self_attn.g_proj / o_proj                     attention.w_gate / wo
    MLA  self_attn.q_a_proj / q_a_layernorm / q_b_proj attention.w_dq / q_norm / w_uq
         self_attn.kv_a_proj_with_mqa / kv_a_layernorm attention.w_dkv / kv_norm
         self_attn.kv_b_proj / g_proj / o_proj         attention.w_ukv / w_g / w_o
    dense mlp.{gate,up}_proj, mlp.down_proj            feed_forward.w_gate_up (rows: gate, then up), w_down
    MoE  block_sparse_moe.gate.weight                  feed_forward.router.weight
         block_sparse_moe.gate.e_score_correction_bias feed_forward.expert_bias
         block_sparse_moe.routed_expert_down_proj      feed_forward.w_latent_down
         block_sparse_moe.routed_expert_norm           feed_forward.latent_norm
         block_sparse_moe.routed_expert_up_proj        feed_forward.w_latent_up
         block_sparse_moe.shared_experts.{gate,up,down}_proj   feed_forward.shared_experts.w_gate_up, w_down
         block_sparse_moe.experts.E.w1 [hidden, latent]  feed_forward.experts.w_gate_up[E, :, :hidden] (transposed)
         block_sparse_moe.experts.E.w3 [hidden, latent]  feed_forward.experts.w_gate_up[E, :, hidden:] (transposed)
         block_sparse_moe.experts.E.w2 [latent, hidden]  feed_forward.experts.w_down[E] (transposed)

Routed experts come as MXFP4 (`weight_packed` + `weight_scale`, `titan_moe.hf.mxfp4`) or
unquantized (`weight`). Every other tensor is copied value for value (cast to `dtype`).

What is assumed, not confirmed against the released files (docs/hf.md): the `A_log`
padding to a multiple of 128 with the heads first; MLA's per-head order (nope dims, then
the shared "rope" dims) and KDA's head-major projections being the same as ours; the
shared experts being one fused MLP of width `num_shared_experts * moe_intermediate_size`;
the router bias meaning the same as our QB bias. The names and shapes are checked (tests)
against the meta-device K3; the numerics of an imported model are not.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from titan_moe.hf.mxfp4 import BLOCK, dequantize_mxfp4
from titan_moe.model.args import ModelArgs

SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.")
A_LOG_PAD = 128


# ------------------------------------------------------------------------------ config
def public_text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text part of a K3 `config.json` (nested `text_config` or flat)."""
    return config.get("text_config", config)


def args_from_public_config(config: dict[str, Any]) -> ModelArgs:
    """Our model arguments from a K3 `config.json` (the released one or a small one)."""
    c = public_text_config(config)
    lin = c["linear_attn_config"]
    shared = c.get("num_shared_experts") or 0
    return ModelArgs(
        vocab_size=c["vocab_size"], dim=c["hidden_size"], n_layers=c["num_hidden_layers"],
        norm_eps=c.get("rms_norm_eps", 1e-5),
        mla_layers=sorted(i - 1 for i in lin["full_attn_layers"]),  # 1-based in the config
        n_dense_layers=c.get("first_k_dense_replace", 1),
        kda_n_heads=lin["num_heads"], kda_head_dim=lin["head_dim"], kda_conv_size=lin.get("short_conv_kernel_size", 4),
        kda_g_min=lin.get("gate_lower_bound", -5.0),
        mla_n_heads=c["num_attention_heads"], mla_q_lora_rank=c["q_lora_rank"], mla_kv_lora_rank=c["kv_lora_rank"],
        mla_qk_nope_head_dim=c["qk_nope_head_dim"], mla_qk_shared_dim=c["qk_rope_head_dim"],
        mla_v_head_dim=c["v_head_dim"],
        attn_res="block", attn_res_block_size=c["attn_res_block_size"],
        n_routed_experts=c["num_experts"], top_k=c["num_experts_per_token"], n_shared_experts=shared,
        moe_latent_dim=c["routed_expert_hidden_size"], moe_expert_hidden=c["moe_intermediate_size"],
        moe_shared_hidden=c["moe_intermediate_size"], dense_hidden=c["intermediate_size"],
        routed_scale=c.get("routed_scaling_factor", 1.0),
        situ_beta1=c.get("activation_situ_beta", 4.0), situ_beta2=c.get("activation_situ_linear_beta", 25.0),
    )


def public_config_from_args(args: ModelArgs) -> dict[str, Any]:
    """A K3-schema `config.json` (text part) for our model arguments (inverse of the above)."""
    kinds = args.layer_kinds()
    return {
        "model_type": "kimi_linear", "vocab_size": args.vocab_size, "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers, "rms_norm_eps": args.norm_eps,
        "first_k_dense_replace": args.n_dense_layers, "intermediate_size": args.dense_hidden,
        "num_attention_heads": args.mla_n_heads, "q_lora_rank": args.mla_q_lora_rank,
        "kv_lora_rank": args.mla_kv_lora_rank, "qk_nope_head_dim": args.mla_qk_nope_head_dim,
        "qk_rope_head_dim": args.mla_qk_shared_dim, "v_head_dim": args.mla_v_head_dim,
        "attn_res_block_size": args.attn_res_block_size,
        "num_experts": args.n_routed_experts, "num_experts_per_token": args.top_k,
        "num_shared_experts": args.n_shared_experts, "routed_expert_hidden_size": args.moe_latent_dim,
        "moe_intermediate_size": args.moe_expert_hidden, "routed_scaling_factor": args.routed_scale,
        "activation_situ_beta": args.situ_beta1, "activation_situ_linear_beta": args.situ_beta2,
        "linear_attn_config": {
            "num_heads": args.kda_n_heads, "head_dim": args.kda_head_dim, "short_conv_kernel_size": args.kda_conv_size,
            "gate_lower_bound": args.kda_g_min, "use_full_rank_gate": True,
            "kda_layers": [i + 1 for i, k in enumerate(kinds) if k == "kda"],
            "full_attn_layers": [i + 1 for i, k in enumerate(kinds) if k == "mla"],
        },
    }


def check_supported(args: ModelArgs) -> None:
    if args.expert_activation != "situ" or args.kda_gate != "bounded":
        raise ValueError("the K3 layout has SiTU-GLU experts and the bounded KDA gate; model.expert_activation = "
                         f"{args.expert_activation!r}, model.kda_gate = {args.kda_gate!r}")
    if args.attn_res != "block":
        raise ValueError(f"the K3 layout has block AttnRes; model.attn_res = {args.attn_res!r}")
    if args.n_shared_experts > 0 and args.moe_shared_hidden != args.moe_expert_hidden:
        raise ValueError("the K3 layout's shared experts are as wide as the routed ones "
                         f"(moe_shared_hidden {args.moe_shared_hidden} != moe_expert_hidden {args.moe_expert_hidden})")


# ------------------------------------------------------------------------------ shapes
def public_shapes(args: ModelArgs) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """Public name (text-only spelling) -> (shape, dtype; None: any float dtype), as the K3
    modules define them, with MXFP4-packed routed experts."""
    D, V = args.dim, args.vocab_size
    out: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {}

    def add(name, *shape, dtype=None):
        out[name] = (tuple(shape), dtype)

    add("model.embed_tokens.weight", V, D)
    add("lm_head.weight", V, D)
    add("model.norm.weight", D)
    add("model.output_attn_res_proj.weight", 1, D)
    add("model.output_attn_res_norm.weight", D)
    H, dk, K = args.kda_n_heads, args.kda_head_dim, args.kda_conv_size
    P = H * dk
    nH, q_r, kv_r = args.mla_n_heads, args.mla_q_lora_rank, args.mla_kv_lora_rank
    nope, rope, v = args.mla_qk_nope_head_dim, args.mla_qk_shared_dim, args.mla_v_head_dim
    L, Im, E = args.moe_latent_dim, args.moe_expert_hidden, args.n_routed_experts
    for i, kind in enumerate(args.layer_kinds()):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            add(f"{p}{norm}.weight", D)
        add(f"{p}self_attention_res_proj.weight", 1, D)
        add(f"{p}mlp_res_proj.weight", 1, D)
        a = p + "self_attn."
        if kind == "kda":
            for proj in ("q_proj", "k_proj", "v_proj", "g_proj"):
                add(f"{a}{proj}.weight", P, D)
            for conv in ("q_conv1d", "k_conv1d", "v_conv1d"):
                add(f"{a}{conv}.weight", P, 1, K)
            add(f"{a}A_log", -(-H // A_LOG_PAD) * A_LOG_PAD)
            add(f"{a}dt_bias", P)
            add(f"{a}f_a_proj.weight", dk, D)
            add(f"{a}f_b_proj.weight", P, dk)
            add(f"{a}b_proj.weight", H, D)
            add(f"{a}o_norm.weight", dk)
            add(f"{a}o_proj.weight", D, P)
        else:
            add(f"{a}q_a_proj.weight", q_r, D)
            add(f"{a}q_a_layernorm.weight", q_r)
            add(f"{a}q_b_proj.weight", nH * (nope + rope), q_r)
            add(f"{a}kv_a_proj_with_mqa.weight", kv_r + rope, D)
            add(f"{a}kv_a_layernorm.weight", kv_r)
            add(f"{a}kv_b_proj.weight", nH * (nope + v), kv_r)
            add(f"{a}g_proj.weight", nH * v, D)
            add(f"{a}o_proj.weight", D, nH * v)
        if not args.is_moe_layer(i):
            add(f"{p}mlp.gate_proj.weight", args.dense_hidden, D)
            add(f"{p}mlp.up_proj.weight", args.dense_hidden, D)
            add(f"{p}mlp.down_proj.weight", D, args.dense_hidden)
            continue
        m = p + "block_sparse_moe."
        add(f"{m}gate.weight", E, D)
        add(f"{m}gate.e_score_correction_bias", E)
        add(f"{m}routed_expert_down_proj.weight", L, D)
        add(f"{m}routed_expert_norm.weight", L)
        add(f"{m}routed_expert_up_proj.weight", D, L)
        if args.n_shared_experts:
            S = args.n_shared_experts * Im
            add(f"{m}shared_experts.gate_proj.weight", S, D)
            add(f"{m}shared_experts.up_proj.weight", S, D)
            add(f"{m}shared_experts.down_proj.weight", D, S)
        for e in range(E):
            for w, (rows, cols) in (("w1", (Im, L)), ("w3", (Im, L)), ("w2", (L, Im))):
                add(f"{m}experts.{e}.{w}.weight_packed", rows, cols // 2, dtype=torch.uint8)
                add(f"{m}experts.{e}.{w}.weight_scale", rows, cols // BLOCK, dtype=torch.uint8)
    return out


# ------------------------------------------------------------------------------ readers
class Source:
    """Public tensors by text-only name: `get(name)`, `names()`."""

    def __init__(self, tensors: dict[str, torch.Tensor] | None = None):
        self.tensors = {} if tensors is None else tensors

    def names(self) -> set[str]:
        return set(self.tensors)

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def text_name(name: str) -> str | None:
    """The text-only spelling of a released name; None for the vision tower and projector."""
    if name.startswith(SKIPPED_PREFIXES):
        return None
    return name.removeprefix("language_model.")


class MetaSource(Source):
    """Empty meta-device tensors of the given shapes (a shape check needs no data)."""

    def __init__(self, shapes: dict[str, tuple[tuple[int, ...], torch.dtype | None]], dtype=torch.bfloat16):
        super().__init__()
        self.shapes, self.dtype = shapes, dtype
        self._names = set(shapes)

    def names(self) -> set[str]:
        return self._names

    def get(self, name: str) -> torch.Tensor:
        shape, dtype = self.shapes[name]
        return torch.empty(shape, dtype=dtype or self.dtype, device="meta")


class SafetensorsSource(Source):
    """A K3 checkpoint folder (index json or a single file), read lazily tensor by tensor."""

    def __init__(self, folder: str):
        from titan_moe.hf.files import weight_map

        super().__init__()
        self.folder = folder
        self.files: dict[str, tuple[str, str]] = {}
        self.skipped = 0
        for name, file in weight_map(folder).items():
            text = text_name(name)
            if text is None:
                self.skipped += 1
            else:
                self.files[text] = (name, file)
        self._open: dict[str, Any] = {}

    def names(self) -> set[str]:
        return set(self.files)

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        stored, file = self.files[name]
        if file not in self._open:
            self._open[file] = safe_open(os.path.join(self.folder, file), framework="pt")
        return self._open[file].get_tensor(stored)


# ------------------------------------------------------------------------------ import
EXPERT_CHUNK = 64  # experts dequantized at a time: bounds the float32 temporaries


def _expert_names(available: set[str], base: str) -> list[str]:
    """The stored tensors of one routed expert weight: MXFP4 (packed, scale) or plain."""
    names = [f"{base}.weight_packed", f"{base}.weight_scale"]
    if names[0] not in available:
        names = [f"{base}.weight"]
    missing = [n for n in names if n not in available]
    if missing:
        raise KeyError(f"the checkpoint has no {missing[0]}")
    return names


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.stack; on the meta device (a shape check of the full K3) the same result without
    torch.stack's slow meta path, after checking that every shape and dtype agrees."""
    first = tensors[0]
    if not first.is_meta:
        return torch.stack(tensors)
    for t in tensors:
        if t.shape != first.shape or t.dtype != first.dtype:
            raise ValueError(f"experts differ: {tuple(t.shape)} {t.dtype} vs {tuple(first.shape)} {first.dtype}")
    return torch.empty((len(tensors), *first.shape), dtype=first.dtype, device="meta")


def _stacked_experts(src: Source, available: set[str], prefix: str, w: str, experts: range, dtype: torch.dtype,
                     used: set[str]) -> torch.Tensor:
    """`w` ("w1", "w2" or "w3") of `experts`, stacked: [len(experts), out, in]."""
    names = [_expert_names(available, f"{prefix}experts.{e}.{w}") for e in experts]
    for pair in names:
        used.update(pair)
    if len(names[0]) == 2:
        return dequantize_mxfp4(_stack([src.get(n[0]) for n in names]), _stack([src.get(n[1]) for n in names]), dtype)
    return _stack([src.get(n[0]) for n in names]).to(dtype)


def _routed_experts(src: Source, available: set[str], prefix: str, args: ModelArgs, dtype: torch.dtype,
                    used: set[str], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Our `w_gate_up` [E, latent, 2 * hidden] (gate columns first) and `w_down` [E, hidden,
    latent] from the per-expert [out, in] weights, `EXPERT_CHUNK` experts at a time."""
    E, L, Hd = args.n_routed_experts, args.moe_latent_dim, args.moe_expert_hidden
    gate_up = torch.empty(E, L, 2 * Hd, dtype=dtype, device=device)
    down = torch.empty(E, Hd, L, dtype=dtype, device=device)
    step = E if device.type == "meta" else EXPERT_CHUNK  # nothing is computed on meta
    for start in range(0, E, step):
        chunk = range(start, min(E, start + step))

        def stacked_T(w, chunk=chunk):  # [n, in, out]
            return _stacked_experts(src, available, prefix, w, chunk, dtype, used).transpose(1, 2)

        gate_up[chunk.start:chunk.stop, :, :Hd] = stacked_T("w1")
        gate_up[chunk.start:chunk.stop, :, Hd:] = stacked_T("w3")
        down[chunk.start:chunk.stop] = stacked_T("w2")
    return gate_up, down


def _unpad(a_log: torch.Tensor, heads: int, name: str) -> torch.Tensor:
    """The first `heads` entries of the padded `A_log`; the padding must be zeros (else the
    assumed layout is wrong, and the import stops rather than guess)."""
    flat = a_log.reshape(-1)
    if flat.numel() < heads or (not flat.is_meta and bool(flat[heads:].any())):
        raise ValueError(f"{name}: expected {heads} heads followed by zero padding, got {flat.numel()} entries "
                         f"with {int((flat[heads:] != 0).sum()) if not flat.is_meta else '?'} nonzero past the heads")
    return flat[:heads]


def _rules(args: ModelArgs) -> Iterator[tuple[str, list[str] | Callable, Callable]]:
    """(our name, public names it reads, how to build it from them)."""

    def same(t):
        return t

    def row_vector(t):
        return t.reshape(t.shape[-1])

    yield "tok_embeddings.weight", ["model.embed_tokens.weight"], same
    for i, kind in enumerate(args.layer_kinds()):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        a, oa = p + "self_attn.", o + "attention."
        if kind == "kda":
            for theirs, ours in (("q_conv1d", "q_conv_weight"), ("k_conv1d", "k_conv_weight"),
                                 ("v_conv1d", "v_conv_weight")):
                yield oa + ours, [f"{a}{theirs}.weight"], lambda t: t.reshape(t.shape[0], t.shape[-1])
            H = args.kda_n_heads
            yield oa + "A_log", [a + "A_log"], lambda t, H=H, name=a + "A_log": _unpad(t, H, name)
            yield oa + "dt_bias", [a + "dt_bias"], same
            yield oa + "o_norm_weight", [a + "o_norm.weight"], same
            pairs = (("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv"), ("f_a_proj", "w_f_down"),
                     ("f_b_proj", "w_f_up"), ("b_proj", "w_beta"), ("g_proj", "w_gate"), ("o_proj", "wo"))
        else:
            pairs = (("q_a_proj", "w_dq"), ("q_a_layernorm", "q_norm"), ("q_b_proj", "w_uq"),
                     ("kv_a_proj_with_mqa", "w_dkv"), ("kv_a_layernorm", "kv_norm"), ("kv_b_proj", "w_ukv"),
                     ("g_proj", "w_g"), ("o_proj", "w_o"))
        for theirs, ours in pairs:
            yield f"{oa}{ours}.weight", [f"{a}{theirs}.weight"], same
        if not args.is_moe_layer(i):
            yield o + "feed_forward.w_gate_up.weight", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], \
                lambda g, u: torch.cat([g, u])
            yield o + "feed_forward.w_down.weight", [p + "mlp.down_proj.weight"], same
        else:
            m, om = p + "block_sparse_moe.", o + "feed_forward."
            yield om + "expert_bias", [m + "gate.e_score_correction_bias"], same
            yield om + "router.weight", [m + "gate.weight"], same
            yield om + "w_latent_down.weight", [m + "routed_expert_down_proj.weight"], same
            yield om + "experts", "routed_experts", m  # experts.w_gate_up and experts.w_down
            yield om + "latent_norm.weight", [m + "routed_expert_norm.weight"], same
            yield om + "w_latent_up.weight", [m + "routed_expert_up_proj.weight"], same
            if args.n_shared_experts:
                s = m + "shared_experts."
                yield om + "shared_experts.w_gate_up.weight", [s + "gate_proj.weight", s + "up_proj.weight"], \
                    lambda g, u: torch.cat([g, u])
                yield om + "shared_experts.w_down.weight", [s + "down_proj.weight"], same
        for theirs, ours in (("self_attention_res_proj.weight", "attention_mix.query"),
                             ("mlp_res_proj.weight", "ffn_mix.query")):
            yield o + ours, [p + theirs], row_vector
        for theirs, ours in (("self_attention_res_norm", "attention_mix.key_norm"),
                             ("mlp_res_norm", "ffn_mix.key_norm"),
                             ("input_layernorm", "attention_norm"), ("post_attention_layernorm", "ffn_norm")):
            yield f"{o}{ours}.weight", [f"{p}{theirs}.weight"], same
    yield "final_mix.query", ["model.output_attn_res_proj.weight"], row_vector
    yield "final_mix.key_norm.weight", ["model.output_attn_res_norm.weight"], same
    yield "norm.weight", ["model.norm.weight"], same
    yield "output.weight", ["lm_head.weight"], same


def convert(src: Source, args: ModelArgs, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """Our state dict, tensor by tensor (routed experts stacked one layer at a time), from a
    K3-layout source. Raises KeyError for a missing public tensor and ValueError for public
    tensors nothing reads (after the whole model is converted)."""
    check_supported(args)
    available = src.names()
    used: set[str] = set()
    # where the stacked experts are built: the source's device (meta for a shape check)
    device = src.get(min(available)).device if available else torch.device("cpu")
    for ours, reads, build in _rules(args):
        if reads == "routed_experts":
            gate_up, down = _routed_experts(src, available, build, args, dtype, used, device)
            yield ours + ".w_gate_up", gate_up
            yield ours + ".w_down", down
            continue
        missing = [n for n in reads if n not in available]
        if missing:
            raise KeyError(f"the checkpoint has no {missing[0]}")
        used.update(reads)
        yield ours, build(*(src.get(n) for n in reads)).to(dtype).contiguous()
    unread = sorted(available - used)
    if unread:
        raise ValueError(f"{len(unread)} tensors of the checkpoint map to nothing in the model, e.g. {unread[0]!r}")


def read_public_config(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read ({type(e).__name__}: {e})") from None


def import_k3(src_folder: str, out_folder: str, *, args: ModelArgs | None = None, dtype: torch.dtype = torch.float32,
              max_shard_bytes: int) -> tuple[ModelArgs, int]:
    """Convert a K3-layout folder into our HF layout (`titan_moe.hf.adapter`), loadable with
    `checkpoint.initial_load_in_hf`. Returns the model arguments and the number of skipped
    (vision) tensors. `args` default: from the folder's config.json."""
    from titan_moe.hf.files import write_state_dict

    if args is None:
        args = args_from_public_config(read_public_config(src_folder))
    src = SafetensorsSource(src_folder)
    write_state_dict(out_folder, args, convert(src, args, dtype), max_shard_bytes)
    return args, src.skipped
