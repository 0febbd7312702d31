"""The public Kimi K3 layout: MXFP4 decoding, a synthetic checkpoint in that layout imported
value for value, and the name/shape map against the meta-device K3."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from torchtitan.components.checkpoint import MODEL, CheckpointManager, ModelWrapper

from tiny import TINY_ARGS, call_main
from titan_moe.flavors import FLAVORS
from titan_moe.hf import kimi_k3
from titan_moe.hf.__main__ import main as hf_main
from titan_moe.hf.adapter import TitanStateDictAdapter, model_shapes, read_config
from titan_moe.hf.files import read_tensors
from titan_moe.hf.mxfp4 import dequantize_mxfp4
from titan_moe.model.decoder import Decoder


def _e2m1(code: int) -> float:
    """OCP MX E2M1 from its bit fields: sign, 2 exponent bits (bias 1), 1 mantissa bit."""
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    return sign * (0.5 * mantissa if exponent == 0 else 2.0 ** (exponent - 1) * (1 + 0.5 * mantissa))


def _reference_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Float64 decode written from the spec, independent of titan_moe.hf.mxfp4."""
    codes = torch.empty(*packed.shape[:-1], 2 * packed.shape[-1], dtype=torch.long)
    codes[..., 0::2] = (packed & 0x0F).long()
    codes[..., 1::2] = (packed >> 4).long()
    table = torch.tensor([_e2m1(c) for c in range(16)], dtype=torch.float64)
    factor = torch.pow(2.0, scale.double() - 127).repeat_interleave(32, dim=-1)
    return table[codes] * factor


# ----------------------------------------------------------------------------- MXFP4
def test_mxfp4_decodes_known_codes_exactly():
    # one row of 64 values (2 blocks): codes 0..15 four times; block scales 2^3 and 2^-127
    codes = torch.arange(64) % 16
    packed = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8)[None]
    scale = torch.tensor([[130, 0]], dtype=torch.uint8)
    got = dequantize_mxfp4(packed, scale)
    magnitudes = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    expected = [(1 if c < 8 else -1) * magnitudes[c % 8] * (8.0 if i < 32 else 2.0 ** -127)
                for i, c in enumerate(codes.tolist())]
    assert got.dtype == torch.float32
    assert got[0].tolist() == expected  # exact, the subnormal 2^-127 scale included
    assert torch.signbit(got[0, 8])  # code 8 is -0
    # byte 0x21: low nibble (element 0) is code 1 = 0.5, high nibble (element 1) code 2 = 1.0
    first = dequantize_mxfp4(torch.full((1, 16), 0x21, dtype=torch.uint8), torch.tensor([[127]], dtype=torch.uint8))
    assert first[0, :4].tolist() == [0.5, 1.0, 0.5, 1.0]
    # E8M0 255 is NaN; leading dimensions (stacked experts) decode alike
    nan = dequantize_mxfp4(torch.full((2, 3, 16), 0x77, dtype=torch.uint8),
                           torch.full((2, 3, 1), 255, dtype=torch.uint8))
    assert nan.shape == (2, 3, 32) and nan.isnan().all()
    # random bytes against the float64 decode written from the spec
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (5, 7, 48), dtype=torch.uint8, generator=gen)
    scale = torch.randint(1, 250, (5, 7, 3), dtype=torch.uint8, generator=gen)
    assert torch.equal(dequantize_mxfp4(packed, scale).double(), _reference_mxfp4(packed, scale))
    assert torch.equal(dequantize_mxfp4(packed, scale, torch.bfloat16).float(),
                       _reference_mxfp4(packed, scale).float())  # at most 2 significant bits: exact in bf16
    with pytest.raises(ValueError, match="shapes do not match"):
        dequantize_mxfp4(packed, scale[..., :2])


# ------------------------------------------------------------------ synthetic checkpoint
# Our tiny model in K3 proportions: latent width a multiple of 32 (MXFP4 blocks), two shared
# experts as wide as a routed one, KDA heads padded to 128 in A_log.
SMALL = dataclasses.replace(TINY_ARGS, moe_latent_dim=64, moe_expert_hidden=32, moe_shared_hidden=32,
                            n_shared_experts=2)

# one-to-one names (ours <- public, without "model.layers.N."), written out from the name table
_SAME_KDA = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "w_f_down": "f_a_proj", "w_f_up": "f_b_proj",
             "w_beta": "b_proj", "w_gate": "g_proj", "wo": "o_proj"}
_SAME_MLA = {"w_dq": "q_a_proj", "q_norm": "q_a_layernorm", "w_uq": "q_b_proj", "w_dkv": "kv_a_proj_with_mqa",
             "kv_norm": "kv_a_layernorm", "w_ukv": "kv_b_proj", "w_g": "g_proj", "w_o": "o_proj"}
_SAME_LAYER = {"attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
               "attention_mix.key_norm.weight": "self_attention_res_norm.weight",
               "ffn_mix.key_norm.weight": "mlp_res_norm.weight",
               "feed_forward.router.weight": "block_sparse_moe.gate.weight",
               "feed_forward.expert_bias": "block_sparse_moe.gate.e_score_correction_bias",
               "feed_forward.w_latent_down.weight": "block_sparse_moe.routed_expert_down_proj.weight",
               "feed_forward.latent_norm.weight": "block_sparse_moe.routed_expert_norm.weight",
               "feed_forward.w_latent_up.weight": "block_sparse_moe.routed_expert_up_proj.weight",
               "feed_forward.shared_experts.w_down.weight": "block_sparse_moe.shared_experts.down_proj.weight",
               "feed_forward.w_down.weight": "mlp.down_proj.weight",
               "attention.dt_bias": "self_attn.dt_bias", "attention.o_norm_weight": "self_attn.o_norm.weight"}
_SAME_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight", "final_mix.key_norm.weight": "model.output_attn_res_norm.weight"}


def _write_k3_checkpoint(folder, args, drop: str | None = None, a_log_tail: float = 0.0) -> dict[str, torch.Tensor]:
    """A checkpoint in the released layout (`language_model.` prefix, bf16 weights, MXFP4
    routed experts, 3 shards, index json, nested config.json, two vision tensors)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for name, (shape, dtype) in kimi_k3.public_shapes(args).items():
        if name.endswith("weight_packed"):
            tensors[name] = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
        elif name.endswith("weight_scale"):
            tensors[name] = torch.randint(118, 137, shape, dtype=torch.uint8, generator=gen)
        elif name.endswith("A_log"):  # heads first, then zero padding
            tensors[name] = torch.full(shape, a_log_tail, dtype=torch.float32)
            tensors[name][:args.kda_n_heads] = torch.randn(args.kda_n_heads, generator=gen)
        else:
            tensors[name] = torch.randn(shape, generator=gen).to(torch.bfloat16)
    stored = {"language_model." + n: t for n, t in tensors.items() if n != drop}
    stored["vision_tower.patch_embed.proj.weight"] = torch.randn(8, 3, generator=gen)
    stored["mm_projector.proj.0.weight"] = torch.randn(4, 8, generator=gen)
    folder.mkdir()
    files: dict[str, dict[str, torch.Tensor]] = {}
    for i, (name, t) in enumerate(stored.items()):
        files.setdefault(f"model-{i % 3 + 1:05d}-of-00003.safetensors", {})[name] = t
    for file, part in files.items():
        save_file(part, str(folder / file))
    weight_map = {n: f for f, part in files.items() for n in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {"model_type": "kimi_k3", "text_config": kimi_k3.public_config_from_args(args), "vision_config": {}}
    (folder / "config.json").write_text(json.dumps(config))
    return tensors


def _run(argv) -> tuple[int, str, str]:
    return call_main(hf_main, argv)


def test_synthetic_k3_checkpoint_imports_value_for_value(tmp_path):
    src, out = tmp_path / "k3", tmp_path / "ours"
    public = _write_k3_checkpoint(src, SMALL)
    code, stdout, stderr = _run(["import-k3", str(src), str(out), "--max-shard-gib", "0.0005"])
    assert code == 0, stderr
    assert "2 vision tensors skipped" in stdout
    # the recorded model (from the K3 config: no training-only fields such as qb_ema) has our shapes
    assert model_shapes(read_config(str(out))) == model_shapes(SMALL)
    got = {n.removeprefix("model."): t for n, t in read_tensors(str(out)).items()}
    got["output.weight"] = got.pop("lm_head.weight")
    assert set(got) == set(model_shapes(SMALL))
    assert len(list(out.glob("model-*.safetensors"))) > 1

    checked = set()

    def check(ours: str, expected: torch.Tensor) -> None:
        assert got[ours].dtype == torch.float32, ours
        assert torch.equal(got[ours].double(), expected.double()), ours
        checked.add(ours)

    for ours, theirs in _SAME_TOP.items():
        check(ours, public[theirs])
    check("final_mix.query", public["model.output_attn_res_proj.weight"][0])
    H, Im = SMALL.kda_n_heads, SMALL.moe_expert_hidden
    for i, kind in enumerate(SMALL.layer_kinds()):
        o, p = f"layers.{i}.", f"model.layers.{i}."
        for ours, theirs in _SAME_LAYER.items():
            if o + ours in got:
                check(o + ours, public[p + theirs])
        check(o + "attention_mix.query", public[p + "self_attention_res_proj.weight"][0])
        check(o + "ffn_mix.query", public[p + "mlp_res_proj.weight"][0])
        for ours, theirs in (_SAME_KDA if kind == "kda" else _SAME_MLA).items():
            check(f"{o}attention.{ours}.weight", public[f"{p}self_attn.{theirs}.weight"])
        if kind == "kda":
            check(o + "attention.A_log", public[p + "self_attn.A_log"][:H])
            for x in "qkv":
                check(f"{o}attention.{x}_conv_weight", public[f"{p}self_attn.{x}_conv1d.weight"][:, 0, :])
        if i == 0:
            check(o + "feed_forward.w_gate_up.weight",
                  torch.cat([public[p + "mlp.gate_proj.weight"], public[p + "mlp.up_proj.weight"]]))
            continue
        m = p + "block_sparse_moe."
        check(o + "feed_forward.shared_experts.w_gate_up.weight",
              torch.cat([public[m + "shared_experts.gate_proj.weight"], public[m + "shared_experts.up_proj.weight"]]))
        assert got[o + "feed_forward.shared_experts.w_gate_up.weight"].shape[0] == 2 * 2 * Im  # 2 shared experts

        def expert(e, w):
            base = f"{m}experts.{e}.{w}"
            return _reference_mxfp4(public[base + ".weight_packed"], public[base + ".weight_scale"])

        gate_up, down = got[o + "feed_forward.experts.w_gate_up"], got[o + "feed_forward.experts.w_down"]
        for e in range(SMALL.n_routed_experts):
            assert torch.equal(gate_up[e, :, :Im].double(), expert(e, "w1").T)
            assert torch.equal(gate_up[e, :, Im:].double(), expert(e, "w3").T)
            assert torch.equal(down[e].double(), expert(e, "w2").T)
        checked.update({o + "feed_forward.experts.w_gate_up", o + "feed_forward.experts.w_down"})
    assert checked == set(got)

    # the folder loads through torchtitan's HF path (checkpoint.initial_load_in_hf) and runs
    args = read_config(str(out))
    model = Decoder(args)
    manager = SimpleNamespace(sd_adapter=TitanStateDictAdapter(args, None), states={MODEL: ModelWrapper(model)})
    CheckpointManager.dcp_load(manager, ModelWrapper(model).state_dict(), str(out), from_hf=True, from_quantized=False)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, got[name]), name
    with torch.no_grad():
        logits = model(torch.randint(0, SMALL.vocab_size, (1, 16)))
    assert torch.isfinite(logits).all()


def test_a_missing_expert_tensor_is_one_line_naming_it(tmp_path):
    missing = "model.layers.2.block_sparse_moe.experts.5.w3.weight_scale"
    _write_k3_checkpoint(tmp_path / "k3", SMALL, drop=missing)
    code, _, stderr = _run(["import-k3", str(tmp_path / "k3"), str(tmp_path / "ours")])
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert missing in stderr


def test_a_log_padding_that_is_not_zero_stops_the_import(tmp_path):
    _write_k3_checkpoint(tmp_path / "k3", SMALL, a_log_tail=0.5)
    code, _, stderr = _run(["import-k3", str(tmp_path / "k3"), str(tmp_path / "ours")])
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert "model.layers.0.self_attn.A_log: expected 2 heads followed by zero padding" in stderr


# ---------------------------------------------------------------- against the meta K3
# The released text config's values (moonshotai/Kimi-K3 config.json text_config, as NeMo
# Automodel's K3 config documents its defaults; tech report Table 1).
K3_TEXT_CONFIG = {
    "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 33792, "num_hidden_layers": 93,
    "num_attention_heads": 96, "rms_norm_eps": 1e-5, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "num_experts": 896,
    "num_experts_per_token": 16, "num_shared_experts": 2, "moe_intermediate_size": 3072,
    "routed_expert_hidden_size": 3584, "first_k_dense_replace": 1, "attn_res_block_size": 12,
    "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0, "routed_scaling_factor": 1.0,
    "linear_attn_config": {
        "head_dim": 128, "num_heads": 96, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
        "full_attn_layers": [*range(4, 93, 4), 93], "kda_layers": [i for i in range(1, 94) if i % 4 and i != 93],
    },
}


def test_k3_config_and_name_shape_map_match_the_meta_device_k3():
    k3 = FLAVORS["k3"]
    args = kimi_k3.args_from_public_config({"model_type": "kimi_k3", "text_config": K3_TEXT_CONFIG})
    assert args.layer_kinds() == k3.layer_kinds() and args.layer_kinds().count("mla") == 24
    shape_fields = [f.name for f in dataclasses.fields(k3)
                    if f.name not in ("mla_layers", "norm_eps", "qb_bins", "qb_ema", "qb_batch_iters", "balance_rule",
                                      "sign_gamma", "init_std", "mla_attention")]
    assert {f: getattr(args, f) for f in shape_fields} == {f: getattr(k3, f) for f in shape_fields}

    public = kimi_k3.public_shapes(k3)
    u8 = torch.uint8
    # shapes seen in the released files (per-expert [out, in] MXFP4: in / 2 bytes, in / 32 scales)
    assert public["model.layers.12.block_sparse_moe.experts.0.w1.weight_packed"] == ((3072, 1792), u8)
    assert public["model.layers.12.block_sparse_moe.experts.895.w3.weight_scale"] == ((3072, 112), u8)
    assert public["model.layers.92.block_sparse_moe.experts.7.w2.weight_packed"] == ((3584, 1536), u8)
    assert public["model.layers.0.self_attn.A_log"][0] == (128,)
    assert public["model.layers.0.self_attn.q_conv1d.weight"][0] == (12288, 1, 4)
    assert public["model.layers.3.self_attn.kv_a_proj_with_mqa.weight"][0] == (576, 7168)
    assert public["model.layers.1.self_attention_res_proj.weight"][0] == (1, 7168)
    assert "model.layers.0.mlp.gate_proj.weight" in public
    assert "model.layers.0.block_sparse_moe.gate.weight" not in public
    assert len(public) == 5 + 93 * 6 + 69 * 14 + 24 * 8 + 3 + 92 * (5 + 3 + 896 * 6)

    # every tensor of the meta-device K3 is built, with its shape, from exactly the public
    # tensors above (convert raises for a missing public tensor or one nothing reads)
    built = {name: t.shape for name, t in kimi_k3.convert(kimi_k3.MetaSource(public), k3, torch.bfloat16)}
    assert built == model_shapes(k3)
