"""The matched peer harness (profiling/peer_*.py, profiling/step_flops.py) on the CPU.

The FLOP formula on hand-computed cases, the flavor mapping (shapes equal where the models
match), the peer's documents against our doc ids, the long-document rows, and a two-step
CPU training run of the peer spec and of our model tabulated by the harness. The GPU runs
themselves (compiled, FlexAttention) are not exercised here.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "profiling"))

import peer_long_docs  # noqa: E402
import peer_spec  # noqa: E402
import peer_step  # noqa: E402
import step_flops  # noqa: E402
from titan_moe.config import load_config  # noqa: E402
from titan_moe.data.loader import build_dataloader  # noqa: E402
from titan_moe.data.tokenizer import load_tokenizer  # noqa: E402
from titan_moe.flavors import FLAVORS  # noqa: E402
from titan_moe.model.decoder import Decoder  # noqa: E402
from titan_moe.model.flops import count_params  # noqa: E402

SMALL_CONFIG = str(REPO / "configs" / "small_1gpu.toml")


# ------------------------------------------------------------------------------ FLOP formula
def test_pairs_of_documents_of_known_lengths():
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 0, 0]])
    assert step_flops.segment_lengths(doc_ids[0]) == [3, 2, 1]
    assert step_flops.segment_lengths(doc_ids[1]) == [6]
    # 3*4/2 + 2*3/2 + 1*2/2 = 6 + 3 + 1; a single document of 6: 21
    assert step_flops.doc_mask_pairs(doc_ids) == 10 + 21
    assert step_flops.full_causal_pairs(2, 6) == 42
    # 8K row of two documents of 4K: half the pairs of one 8K document, plus the diagonal
    assert step_flops.causal_pairs([4096, 4096]) == 2 * 4096 * 4097 // 2


def test_step_flops_by_hand():
    fm = step_flops.FlopModel(active_matmul_params=1000, softmax_layers=2, heads=3, qk_head_dim=5, v_head_dim=7,
                              linear_layers=1, linear_heads=2, linear_head_dim=4)
    tokens, pairs = 6, 10
    matmul = 6 * 1000 * 6  # 36,000
    attention = 6 * 3 * (5 + 7) * 10 * 2  # 4,320
    kda = 6 * 2 * (2 * 4 * 4 + 64 * 2 * 4) * 6 * 1  # 6*2*544*6 = 39,168
    assert fm.step_flops(tokens, pairs) == matmul + attention + kda == 79_488


class _ToyMoE(nn.Module):
    """Names as in torchtitan's DeepSeek-V3: embeddings, a router, routed and shared experts."""

    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(100, 8)  # left out
        self.norm = nn.RMSNorm(8)  # a vector: left out
        self.layers = nn.ModuleDict({"0": nn.Module()})
        moe = nn.Module()
        moe.router = nn.Module()
        moe.router.gate = nn.Linear(8, 4, bias=False)  # 32, every token
        moe.experts = nn.Module()
        moe.experts.w1 = nn.Parameter(torch.empty(4, 16, 8))  # 512, routed
        moe.experts.w2 = nn.Parameter(torch.empty(4, 8, 16))  # 512, routed
        moe.shared_experts = nn.Module()
        moe.shared_experts.w1 = nn.Linear(8, 16, bias=False)  # 128, every token
        self.layers["0"].moe = moe
        self.output = nn.Linear(8, 100, bias=False)  # 800


def test_active_matmul_params_by_hand():
    # routed: 1024 parameters, top-1 of 4 experts -> 256
    assert step_flops.active_matmul_params(_ToyMoE(), top_k=1, n_experts=4) == 32 + 256 + 128 + 800


def test_active_params_of_our_model_agree_with_its_own_count():
    args = FLAVORS["debug"]
    with torch.device("meta"):
        model = Decoder(args)
    vectors = sum(p.numel() for p in model.parameters() if p.ndim < 2)
    ours = step_flops.flop_model_ours(args)
    assert ours.active_matmul_params == count_params(model, args).active_excluding_embedding - vectors
    assert (ours.softmax_layers, ours.linear_layers) == (args.layer_kinds().count("mla"), args.layer_kinds().count("kda"))


# --------------------------------------------------------------------------- flavor mapping
def _shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def test_small_1gpu_maps_to_deepseek_v3_shapes():
    ours_args = FLAVORS["small_1gpu"]
    peer_args = peer_spec.peer_args(ours_args)
    with torch.device("meta"):
        ours, peer = _shapes(Decoder(ours_args)), _shapes(peer_spec.DeepSeekV3Model(peer_args))
    for name in ("tok_embeddings.weight", "output.weight", "norm.weight"):
        assert ours[name] == peer[name]
    assert sum(1 for n in peer if n.endswith("attention.wkv_b.weight")) == ours_args.n_layers
    mla = ours_args.layer_kinds().index("mla")
    o, p = f"layers.{mla}.attention.", f"layers.{mla}.attention."
    for mine, theirs in (("w_dq", "wq_a"), ("w_uq", "wq_b"), ("w_dkv", "wkv_a"), ("w_ukv", "wkv_b"), ("w_o", "wo")):
        assert ours[o + mine + ".weight"] == peer[p + theirs + ".weight"], mine
    # dense first layer: our fused gate+up is the peer's w1 and w3 stacked
    (h2, d) = ours["layers.0.feed_forward.w_gate_up.weight"]
    assert peer["layers.0.feed_forward.w1.weight"] == peer["layers.0.feed_forward.w3.weight"] == (h2 // 2, d)
    assert ours["layers.0.feed_forward.w_down.weight"] == peer["layers.0.feed_forward.w2.weight"]
    # MoE layer: router and shared experts equal; routed experts full width in the peer
    m = ours_args.n_dense_layers
    assert ours[f"layers.{m}.feed_forward.router.weight"] == peer[f"layers.{m}.moe.router.gate.weight"]
    (sh2, _) = ours[f"layers.{m}.feed_forward.shared_experts.w_gate_up.weight"]
    assert peer[f"layers.{m}.moe.shared_experts.w1.weight"] == (sh2 // 2, ours_args.dim)
    assert ours[f"layers.{m}.feed_forward.shared_experts.w_down.weight"] == peer[f"layers.{m}.moe.shared_experts.w2.weight"]
    E, H = ours_args.n_routed_experts, ours_args.moe_expert_hidden
    assert peer[f"layers.{m}.moe.experts.w1"] == (E, H, ours_args.dim)
    assert ours[f"layers.{m}.feed_forward.experts.w_down"] == (E, H, ours_args.moe_latent_dim)
    assert peer_args.moe_args.top_k == ours_args.top_k


def test_peer_args_follow_the_model_section_and_keep_their_mask():
    job = load_config(["--job.config_file", SMALL_CONFIG, "--model.name", "titan_peer_dsv3", "--model.dim", "512",
                       "--model.n_layers", "6", "--training.seq_len", "1024"])
    args = peer_spec.PeerArgs(attn_type="flex", attn_mask_type="block_causal")
    args.update_from_config(job)
    assert (args.dim, args.n_layers, args.max_seq_len) == (512, 6, 1024)
    assert (args.attn_type, args.attn_mask_type) == ("flex", "block_causal")
    assert args.q_lora_rank == FLAVORS["small_1gpu"].mla_q_lora_rank


def test_unmatched_shared_width_is_a_clear_error():
    with pytest.raises(ValueError, match="moe_expert_hidden"):
        peer_spec.peer_args(dataclasses.replace(FLAVORS["debug"], moe_shared_hidden=100))


# ------------------------------------------------------------------------ same documents
def test_block_causal_from_eos_sees_our_documents():
    """torchtitan's own document mask (from the eos id) on our rows equals our doc ids."""
    from torchtitan.models.attention import get_document_mask_mod

    tokenizer = load_tokenizer()
    loader = build_dataloader(tokenizer=tokenizer, source="builtin", path=None, split="train", seq_len=512,
                              local_batch_size=4, dp_rank=0, dp_world_size=1)
    q, kv = torch.arange(512)[:, None], torch.arange(512)[None, :]
    boundaries = 0
    for _, (input_dict, _labels) in zip(range(3), loader):
        tokens, doc_ids = input_dict["input"], input_dict["doc_ids"]
        mask_mod = get_document_mask_mod(tokens.clone(), tokenizer.eos_id)
        for b in range(tokens.shape[0]):
            theirs = mask_mod(torch.tensor(b), torch.tensor(0), q, kv)
            assert torch.equal(theirs, doc_ids[b][:, None] == doc_ids[b][None, :])
            boundaries += int(doc_ids[b].max())
    assert boundaries > 0  # the rows did hold several documents


def test_peer_loader_hands_the_same_tokens_without_doc_ids():
    job = load_config(["--job.config_file", SMALL_CONFIG, "--training.seq_len", "256", "--training.local_batch_size", "2"])
    tokenizer = load_tokenizer()
    peer = peer_spec.build_peer_dataloader(dp_world_size=1, dp_rank=0, tokenizer=tokenizer, job_config=job)
    from titan_moe.data.from_config import dataloader_from_config

    ours = dataloader_from_config(job, tokenizer=tokenizer, split="train", dp_rank=0, dp_world_size=1)
    for (p_in, p_labels), (o_in, o_labels) in zip(peer, ours):
        assert set(p_in) == {"input"}
        assert torch.equal(p_in["input"], o_in["input"]) and torch.equal(p_labels, o_labels)
        break


# -------------------------------------------------------------------------- long documents
def test_long_documents_make_rows_of_one_document(tmp_path):
    seq_len, count = 1024, 3
    folder = tmp_path / "long"
    manifest = peer_long_docs.write_long_documents(str(folder), seq_len=seq_len, count=count)
    assert manifest["passes"] == 1 and manifest["tokens_per_document"] == seq_len - 1
    tokenizer = load_tokenizer()
    files = sorted(folder.glob("doc_*.txt"))
    assert len(files) == count
    assert all(len(tokenizer.encode(f.read_text(encoding="utf-8"))) == seq_len - 1 for f in files)
    loader = build_dataloader(tokenizer=tokenizer, source="text", path=str(folder), split="train", seq_len=seq_len,
                              local_batch_size=1, dp_rank=0, dp_world_size=1, val_fraction=0.0)
    for _, (input_dict, labels) in zip(range(2 * count), loader):  # two epochs: rows stay aligned
        assert int(input_dict["doc_ids"].max()) == 0
        assert input_dict["input"][0, 0] == tokenizer.bos_id
        assert not (input_dict["input"] == tokenizer.eos_id).any() and labels[0, -1] == tokenizer.eos_id
    # consecutive pieces of one stream: the second starts where the first ends
    first = peer_long_docs.long_documents(tokenizer, seq_len, 2)[0]
    texts, stream = peer_long_docs.stdlib_texts_in_package_order(), ""
    while len(stream) < len(first[0] + first[1]):
        stream = stream + "\n" + next(texts) if stream else next(texts)
    assert stream.startswith(first[0] + first[1])
    mtime = (folder / "doc_00000.txt").stat().st_mtime_ns
    peer_long_docs.write_long_documents(str(folder), seq_len=seq_len, count=count)  # reused
    assert (folder / "doc_00000.txt").stat().st_mtime_ns == mtime


# ---------------------------------------------------------------------- training, harness
# torchtitan 0.2.2's MoE counts tokens per expert with torch.histc on int64, which has no
# CPU kernel ("histogram_cpu" not implemented for 'Long'); on the CPU the run goes through this
# shim, which counts in float32 and casts back (exact for counts below 2^24). The GPU path
# runs torchtitan unchanged.
_HISTC_SHIM = """
import runpy, sys, torch
_histc = torch.histc
def histc(input, *args, **kwargs):
    if input.device.type == "cpu" and not input.is_floating_point():
        return _histc(input.float(), *args, **kwargs).to(input.dtype)
    return _histc(input, *args, **kwargs)
torch.histc = histc
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

_CPU = ["--model.flavor", "debug", "--compile.no_enable", "--debug.seed", "0"]


@pytest.mark.slow
def test_peer_and_ours_train_on_cpu_and_the_harness_tabulates(tmp_path):
    """Two steps of the peer (plain causal: FlexAttention has no CPU backward) and of ours,
    with the harness's own arguments; then the harness's table of the two dumps."""
    out = tmp_path / "out"
    argv = ["--seq-len", "128", "--batch", "2", "--steps", "2", "--warmup", "0", "--out", str(out),
            "--runs", "ours,peer_causal", "--config", SMALL_CONFIG, "--", *_CPU]
    args, extra = peer_step.parse_args(argv)
    plan = peer_step.Plan(128, 2, 2, 0, SMALL_CONFIG, out, extra)
    shim = tmp_path / "shim.py"
    shim.write_text(_HISTC_SHIM)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for run, command in (
        ("peer_causal", [sys.executable, str(shim), *plan.command("peer_causal", "builtin")[5:]]),
        ("ours", [sys.executable, *plan.command("ours", "builtin")[5:]]),
    ):
        proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (run, proc.stdout[-2000:] + proc.stderr[-4000:])
    summary = peer_step.main([*argv[:-len(_CPU) - 1], "--table-only", "--", *_CPU])
    rows = {r["run"]: r for r in summary["rows"]}
    assert rows["peer_causal"]["attention"] == "sdpa causal"
    assert rows["ours"]["attention"] == "MLA chunked, doc mask"
    for r in rows.values():
        assert r["status"] == "ok" and r["tokens_per_s"] > 0 and r["tflops"] > 0 and r["steps_measured"] == [1, 2]
    # the same rows: the causal peer's mask sees one document a row, ours the loader's documents
    pairs = peer_step.builtin_pairs(plan, "builtin", 2)
    assert rows["peer_causal"]["docs_per_row"] == 1.0
    assert rows["ours"]["docs_per_row"] == sum(p["docs"] for p in pairs) / 4
    ours_fm, peer_fm = peer_step.flop_model("ours", plan.trainer_argv("ours", "builtin")), \
        peer_step.flop_model("peer_causal", plan.trainer_argv("peer_causal", "builtin"))
    assert rows["ours"]["gflop_per_token"] * 1e9 * 512 == pytest.approx(
        ours_fm.step_flops(512, sum(p["doc"] for p in pairs)))
    assert rows["peer_causal"]["gflop_per_token"] * 1e9 * 512 == pytest.approx(
        peer_fm.step_flops(512, 2 * 2 * 128 * 129 // 2))
    assert (out / "table.md").read_text().count("| ok |") == 2


def test_harness_rejects_unknown_runs_and_rows():
    for bad in (["--runs", "ours,nope"], ["--rows", "short"], ["--steps", "3", "--warmup", "3"]):
        with pytest.raises(SystemExit):
            peer_step.parse_args(["--seq-len", "8", "--batch", "1", "--out", "x", *bad])
