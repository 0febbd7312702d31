"""Memory planner (`titan_moe.plan`): sharding arithmetic, activation model, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from titan_moe.flavors import FLAVORS
from titan_moe.model.args import ModelArgs
from titan_moe.model.attn_res import ResidualStream
from titan_moe.model.decoder import Decoder
from titan_moe.model.flops import count_params
from titan_moe.model.packing import same_doc_causal_mask
from titan_moe.plan import (
    AC_MODES,
    GpuKernelSaves,
    Layout,
    Precision,
    activation_memory,
    eager_saved_bytes,
    enumerate_layouts,
    fsdp_shard_numel,
    inventory,
    layer_activations,
    main,
    measure_eager_layer,
    model_activations,
    param_memory,
    sharding_checks,
    zero_layer,
)

REPO = Path(__file__).resolve().parents[1]
K3_TOML = str(REPO / "configs" / "k3.toml")
DEBUG_TOML = str(REPO / "configs" / "debug_cpu.toml")
FP32_MASTER = Precision(param=4, compute=2)  # fp32 params/grads/AdamW, bf16 compute
BF16 = Precision(param=2, compute=2)


def _tiny(**overrides) -> ModelArgs:
    """Every parameter's first dim is a multiple of 4, so FSDP over 2 or 4 ranks pads nothing."""
    base = dict(
        vocab_size=256, dim=32, n_layers=4, n_dense_layers=1,
        kda_n_heads=4, kda_head_dim=8,
        mla_n_heads=4, mla_q_lora_rank=16, mla_kv_lora_rank=8, mla_qk_nope_head_dim=8,
        mla_qk_shared_dim=4, mla_v_head_dim=8,
        attn_res="block", attn_res_block_size=2,
        n_routed_experts=8, top_k=2, n_shared_experts=1,
        moe_latent_dim=16, moe_expert_hidden=24, moe_shared_hidden=20, dense_hidden=40,
    )
    return ModelArgs(**{**base, **overrides})


def _meta_model(args: ModelArgs) -> Decoder:
    with torch.device("meta"):
        return Decoder(args)


# ----------------------------------------------------------------------------- parameters
def test_param_grad_optimizer_bytes_match_a_hand_count():
    args = _tiny()
    model = _meta_model(args)
    inv = inventory(model, args)
    # Independent count: the routed experts from the widths, everything else from named_parameters.
    n_moe = args.n_layers - args.n_dense_layers
    L, h, E = args.moe_latent_dim, args.moe_expert_hidden, args.n_routed_experts
    experts = n_moe * E * (L * 2 * h + h * L)
    total = sum(p.numel() for _, p in model.named_parameters())
    assert all(p.shape[0] % 4 == 0 for p in model.parameters()), "the tiny config must shard without padding"
    assert (inv.total, inv.routed_experts) == (total, experts)
    assert inv.total == count_params(model, args).total

    for layout in (Layout(1, 4, 1, 1), Layout(1, 2, 2, 2), Layout(2, 4, 1, 4)):
        m = param_memory(inv, layout, FP32_MASTER)
        per_gpu = experts // layout.fsdp + (total - experts) // layout.fsdp
        assert m.params == 4 * per_gpu and m.grads == 4 * per_gpu and m.optimizer == 8 * per_gpu
        assert m.params + m.grads + m.optimizer == 16 * per_gpu  # mixed precision: 16 B per sharded param
        b = param_memory(inv, layout, BF16)
        assert b.params + b.grads + b.optimizer == 8 * per_gpu
        buffers = sum(buf.numel() * buf.element_size() for buf in model.buffers())
        assert m.buffers == buffers  # replicated, never sharded
        assert all(sharding_checks(inv, layout).values())


@pytest.mark.parametrize("shape,degree,dim", [
    ((10, 3), 4, 0), ((7,), 8, 0), ((8, 5, 6), 3, 0), ((4, 9, 2), 4, 1), ((96,), 2048, 0), ((12, 16), 5, 0),
])
def test_fsdp_shard_is_the_first_torch_chunk(shape, degree, dim):
    first_chunk = torch.empty(shape).chunk(degree, dim=dim)[0].numel()
    assert fsdp_shard_numel(shape, degree, dim) == first_chunk


def test_doubling_dp_halves_param_bytes_and_ep_only_moves_experts():
    args = _tiny()
    inv = inventory(_meta_model(args), args)
    two, four = param_memory(inv, Layout(1, 2, 1, 1), FP32_MASTER), param_memory(inv, Layout(1, 4, 1, 1), FP32_MASTER)
    for field in ("params", "grads", "optimizer"):
        assert getattr(four, field) * 2 == getattr(two, field)
    # HSDP replicas reduce nothing.
    assert param_memory(inv, Layout(2, 4, 1, 1), FP32_MASTER).params == four.params

    # EP with ep | dp_shard * cp: same per-GPU experts, smaller gathered expert units.
    by_ep = {ep: param_memory(inv, Layout(1, 4, 1, ep), FP32_MASTER) for ep in (1, 2, 4)}
    for ep, m in by_ep.items():
        assert (m.params, m.grads, m.optimizer) == (four.params, four.grads, four.optimizer), ep
    gathered = [by_ep[ep].largest_unit for ep in (1, 2, 4)]
    assert gathered[0] > gathered[1] > gathered[2]
    expert_layer = args.n_routed_experts * 3 * args.moe_latent_dim * args.moe_expert_hidden
    assert gathered[0] - gathered[2] == expert_layer - expert_layer // 4  # only local experts gathered

    # CP shards like dp_shard.
    assert param_memory(inv, Layout(1, 2, 2, 4), FP32_MASTER).params == four.params


def test_ep_layouts_follow_torchtitan_constraints():
    layouts = enumerate_layouts(16, n_experts=12, seq_len=8192)
    assert {lay.n_gpus for lay in layouts} == {16}
    for lay in layouts:
        assert lay.fsdp % lay.ep == 0 and 12 % lay.ep == 0 and lay.cp in (1, 2, 4, 8)
    assert {lay.ep for lay in layouts if lay.cp == 1} == {1, 2, 4}
    assert all(lay.cp in (1, 2) for lay in enumerate_layouts(16, 12, seq_len=6))  # cp must divide seq_len
    with pytest.raises(ValueError):
        Layout(1, 4, 1, 3)


# ----------------------------------------------------------------------------- activations
@pytest.mark.parametrize("flavor", ["tiny", "k3"])
def test_activation_bytes_scale_with_tokens_and_ac_orders_them(flavor):
    args = _tiny() if flavor == "tiny" else FLAVORS["k3"]
    layout = Layout(1, 8, 2, 2)
    for ac in AC_MODES:
        peak = lambda b, s: activation_memory(args, BF16, layout, ac, b, s).peak  # noqa: E731
        base = peak(1, 0)  # the per-layer constants (router weight copies)
        assert peak(1, 2048) - base == pytest.approx(2 * (peak(1, 1024) - base), rel=1e-12)
        assert peak(2, 1024) == pytest.approx(peak(1, 2048), rel=1e-12)
        assert peak(3, 1024) - base == pytest.approx(3 * (peak(1, 1024) - base), rel=1e-12)
        # CP divides the tokens per GPU.
        assert activation_memory(args, BF16, layout, ac, 1, 4096).tokens == 2048
    for option in ("op", "2"):
        mem = {ac: activation_memory(args, BF16, layout, ac, 1, 4096, sac_option=option).peak for ac in AC_MODES}
        assert mem["full"] < mem["selective"] < mem["none"], (option, mem)


class _MMRecorder(TorchDispatchMode):
    """Bytes per token of every aten.mm output, in call order."""

    def __init__(self, tokens: int):
        super().__init__()
        self.tokens, self.out = tokens, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.mm.default:
            self.out.append(out.numel() * out.element_size() / self.tokens)
        return out


def _bf16_tiny_model(args: ModelArgs) -> Decoder:
    torch.manual_seed(0)
    model = Decoder(args)
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():  # parameters only: expert_bias stays fp32
            p.data = p.data.to(torch.bfloat16)
    return model


def test_mm_entries_match_the_matmuls_the_model_runs():
    """Op-level SAC keeps every other aten.mm output: the plan's mm list (order, bytes, dtype)
    must be the one the layers really dispatch."""
    args = _tiny()
    model = _bf16_tiny_model(args)
    B, T = 2, 12
    tokens = torch.randint(0, args.vocab_size, (B, T))
    kinds = set()
    for i in range(args.n_layers):
        stream = ResidualStream.start(model.tok_embeddings(tokens), args.attn_res, args.n_layers,
                                      args.attn_res_block_size)
        recorder = _MMRecorder(B * T)
        with recorder:
            model.layers[str(i)](stream)
        planned = layer_activations(args, i, BF16, Layout(1, 2, 1, 1))
        kinds.add(planned.kind)
        assert recorder.out == [e.bytes for e in planned.entries if e.mm], planned.kind
    assert kinds == {"kda+dense", "kda+moe", "mla+moe"}


# ----------------------------------------------------------------------------- eager activations
def _first_layer_of_each_kind(args: ModelArgs) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for i, kind in enumerate(args.layer_kinds()):
        kinds.setdefault(kind + ("+moe" if args.is_moe_layer(i) else "+dense"), i)
    return kinds


def _setting(fsdp: bool) -> tuple[torch.dtype, torch.dtype | None]:
    """(weight and stream dtype, autocast dtype) of FP32_MASTER training without / with FSDP."""
    return (torch.bfloat16, None) if fsdp else (torch.float32, torch.bfloat16)


@pytest.mark.parametrize("fsdp", [False, True])
def test_eager_fit_predicts_a_direct_measurement_at_another_length(fsdp):
    """The per-token bytes (fit at T = 64, 128, 192 on top_k + 2 and top_k + 4 experts,
    extrapolated to n) and the T^2 term predict what the full layer (all n experts) saves at
    T = 320. Tolerance 0.5%: saved sizes are exact polynomials in T at multiples of 64, the
    slack only covers tile-rounded sizes (the logsumexp's 32-row padding)."""
    args = _tiny()  # n = 8 > top_k + 4 = 6: the expert-count extrapolation is exercised
    dtype, amp = _setting(fsdp)
    for kind, i in _first_layer_of_each_kind(args).items():
        profile = measure_eager_layer(args, i, FP32_MASTER, fsdp, fake=False)
        assert profile.kind == kind and not profile.fake
        assert profile.experts == ((4, 6) if kind.endswith("moe") else ())
        layer = zero_layer(args, i, dtype)
        direct = eager_saved_bytes(layer, args, 320, dtype, amp) - eager_saved_bytes(layer, args, 64, dtype, amp)
        predicted = profile.per_token * (320 - 64) + profile.per_seq_sq * (320**2 - 64**2)
        assert direct == pytest.approx(predicted, rel=5e-3), kind
        # The only T^2 term is MLA's additive document mask in the compute dtype (bf16).
        assert profile.per_seq_sq == (2.0 if kind.startswith("mla") else 0.0), kind


@pytest.mark.parametrize("fsdp", [False, True])
def test_fake_tensor_measurement_agrees_with_the_cpu_one(fsdp):
    """The fallback for layers too large for CPU memory gives the same bytes as real tensors."""
    args = _tiny(dim=48, attn_res="full")
    for i in _first_layer_of_each_kind(args).values():
        real = measure_eager_layer(args, i, FP32_MASTER, fsdp, fake=False)
        fake = measure_eager_layer(args, i, FP32_MASTER, fsdp, fake=True)
        assert fake.fake and (fake.per_token, fake.per_seq_sq) == (real.per_token, real.per_seq_sq)


@pytest.mark.parametrize("flavor,fsdp", [("tiny", False), ("tiny", True), ("small_1gpu", False), ("k3", True)])
def test_eager_keeps_at_least_the_compiled_count_for_every_layer_kind(flavor, fsdp):
    """Eager keeps every tensor a fused layer keeps plus its upcasts and intermediates."""
    args = _tiny() if flavor == "tiny" else FLAVORS[flavor]
    layout = Layout(1, 2, 1, 1) if fsdp else Layout(1, 1, 1, 1)
    kinds = _first_layer_of_each_kind(args)
    assert set(kinds) == {"kda+dense", "kda+moe", "mla+moe"}
    for kind, i in kinds.items():
        compiled = layer_activations(args, i, FP32_MASTER, layout)
        eager = measure_eager_layer(args, i, FP32_MASTER, fsdp, fake=flavor != "tiny")  # fake: fast
        assert eager.per_token >= compiled.kept, (kind, eager.per_token, compiled.kept)


def test_eager_layers_enter_the_ac_accounting():
    """AC none keeps every layer's measured bytes and T^2 term; full AC keeps none of them
    (only the stream) and recomputes one layer; op-level SAC keeps the compiled SAC set."""
    args = _tiny()
    layout = Layout(1, 1, 1, 1)
    compiled = model_activations(args, FP32_MASTER, layout, "compiled")
    eager = model_activations(args, FP32_MASTER, layout, "eager")
    B, T = 2, 1024
    extra = sum((e.kept - c.kept) * B * T + e.per_seq_sq * B * T * T for c, e in zip(compiled, eager))
    assert extra > 0
    mem = {(name, ac): activation_memory(args, FP32_MASTER, layout, ac, B, T, layers)
           for name, layers in (("compiled", compiled), ("eager", eager)) for ac in AC_MODES}
    assert mem["eager", "none"].detail["layers_kept"] - mem["compiled", "none"].detail["layers_kept"] == (
        pytest.approx(extra, rel=1e-12))
    for ac in ("full", "selective"):
        for part in ("layers_kept", "stream_kept", "head_kept"):
            assert mem["eager", ac].detail[part] == mem["compiled", ac].detail[part], (ac, part)
    assert mem["eager", "full"].peak > mem["compiled", "full"].peak
    assert mem["eager", "full"].peak < mem["eager", "selective"].peak < mem["eager", "none"].peak


def test_gpu_kernel_stand_ins_keep_values_and_save_what_the_kernels_save():
    """SDPA (boolean mask) and matching-dtype RMSNorm give the ops' values and save the CUDA
    kernels' tensors; RMSNorm with a weight of another dtype is left to the composite."""
    torch.manual_seed(0)
    B, H, T, K, V = 1, 3, 40, 16, 8
    q, k = torch.randn(B, H, T, K), torch.randn(B, H, T, K)
    v = torch.randn(B, H, T, V, requires_grad=True)
    doc_ids = torch.tensor([[0] * 25 + [1] * 15], dtype=torch.int32)
    mask = same_doc_causal_mask(doc_ids)
    x, w = torch.randn(5, T, 32, requires_grad=True), torch.rand(32) + 0.5

    def saved_by(fn):
        saved = []

        def pack(t):
            saved.append((t.dtype, tuple(t.shape)))
            return t

        with GpuKernelSaves(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
        return out, saved

    out, saved = saved_by(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    assert (out - ref).norm() / ref.norm() < 1e-6  # same backend underneath: rounding only
    assert saved == [(torch.float32, (B, H, T, K)), (torch.float32, (B, H, T, K)), (torch.float32, (B, H, T, V)),
                     (torch.float32, (B, H, T, V)), (torch.float32, (B, H, 64)), (torch.float32, (B, 1, T, T))]

    out, saved = saved_by(lambda: F.rms_norm(x, (32,), w, 1e-6))
    ref = F.rms_norm(x, (32,), w, 1e-6)
    assert (out - ref).norm() / ref.norm() < 1e-6
    assert saved == [(torch.float32, (5, T, 32)), (torch.float32, (5, T, 1)), (torch.float32, (32,))]

    _, saved = saved_by(lambda: F.rms_norm(x.bfloat16(), (32,), w, 1e-6))  # CUDA: composite too
    assert (torch.float32, (5, T, 32)) in saved and len(saved) > 3


# ----------------------------------------------------------------------------- CLI
def _run(capsys, *argv: str) -> tuple[list[str], dict]:
    main(list(argv))
    lines = capsys.readouterr().out.strip().splitlines()
    return lines, json.loads(lines[-1])


def test_cli_k3_on_2048_gpus_prints_a_json_summary(capsys):
    lines, summary = _run(capsys, "--job.config_file", K3_TOML, "--gpus", "2048", "--gpu-mem-gib", "141")
    expected = {"config", "gpus", "gpu_mem_gib", "headroom", "usable_gib", "ac", "seq_len", "local_batch",
                "precision", "total_params", "routed_expert_params", "other_params", "fits", "best", "layouts",
                "min_gpus", "sanity"}
    assert expected <= set(summary)
    assert summary["gpus"] == 2048 and summary["ac"] == "full" and summary["seq_len"] == 8192
    assert summary["sanity"] == {"params_match_inspect": True, "shard_sums_match_totals": True}
    assert summary["total_params"] == count_params(_meta_model(FLAVORS["k3"]), FLAVORS["k3"]).total
    assert all(lay["dp_replicate"] * lay["dp_shard"] * lay["cp"] == 2048 for lay in summary["layouts"])
    assert set(summary["min_gpus"]) == set(AC_MODES)
    for best in summary["best"]:
        assert best["fits"]["full"] and best["gib"]["total_full"] <= summary["usable_gib"]
    totals = [b["gib"]["total_full"] for b in summary["best"]]
    assert totals == sorted(totals)


def test_cli_k3_does_not_fit_on_8_gpus(capsys):
    _, summary = _run(capsys, "--job.config_file", K3_TOML, "--gpus", "8", "--gpu-mem-gib", "141", "--ac", "full")
    assert summary["fits"] is False and summary["best"] == []
    for lay in summary["layouts"]:
        assert not any(lay["fits"].values())
        # Independent floor: 8 B per parameter (bf16 weights, grads, two AdamW moments) over 8 GPUs.
        states = lay["gib"]["params"] + lay["gib"]["grads"] + lay["gib"]["optimizer"]
        assert states * 2**30 >= 8 * summary["total_params"] / 8
    assert all(n is None or n > 8 for n in summary["min_gpus"].values())


def test_cli_activations_flag_defaults_to_the_compile_setting(capsys):
    """debug_cpu has [compile] enable = false: eager by default, compiled with the flag or with
    compile on. Eager keeps more without AC; parameters are the same."""
    base = ("--job.config_file", DEBUG_TOML, "--gpus", "1", "--gpu-mem-gib", "141")
    _, default = _run(capsys, *base)
    _, flag = _run(capsys, *base, "--activations", "compiled")
    _, compile_on = _run(capsys, *base, "--compile.enable", "true")
    _, forced = _run(capsys, *base, "--compile.enable", "true", "--activations", "eager")
    assert (default["activations"], flag["activations"]) == ("eager", "compiled")
    assert (compile_on["activations"], forced["activations"]) == ("compiled", "eager")
    assert "eager_profiles" in default and "eager_profiles" not in flag
    profiles = default["eager_profiles"]["no_fsdp"]  # one GPU: no FSDP
    assert set(profiles) == {"kda+dense", "kda+moe", "mla+moe"}
    assert all(p["measured_on"] == "cpu" for p in profiles.values())
    eager, compiled = default["layouts"][0]["gib"], flag["layouts"][0]["gib"]
    assert eager["activations_none"] > compiled["activations_none"]
    assert eager["params"] == compiled["params"] and forced["layouts"][0]["gib"] == eager


@pytest.mark.parametrize("argv,message", [
    (["--gpus", "0"], "--gpus must be >= 1"),
    (["--gpus", "eight"], "bad value for --gpus"),
    ([], "--gpus N is required"),
    (["--gpus", "8", "--ac", "sometimes"], "--ac must be one of"),
    (["--gpus", "8", "--activations", "jit"], "--activations must be one of"),
    (["--gpus", "8", "--gpu-mem-gib", "-1"], "--gpu-mem-gib must be > 0"),
    (["--gpus", "8", "--seq-len"], "--seq-len needs a value"),
    (["--gpus", "8", "--training.stepz", "3"], "unknown key"),
    (["--gpus", "8", "--job.config_file", "missing.toml"], "config file not found"),
])
def test_bad_arguments_give_one_line_and_exit_2(argv, message, capsys):
    full = argv if "--job.config_file" in argv else ["--job.config_file", K3_TOML, *argv]
    with pytest.raises(SystemExit) as exc:
        main(full)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("titan_moe.plan: error:") and message in err, err
