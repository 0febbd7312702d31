"""The output head's chunked training loss (`model.head_chunk_tokens`, titan_moe.model.head) and
the evaluations' per-token scores (`OutputHead.token_scores`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from titan_moe.flavors import FLAVORS
from titan_moe.model.args import ModelArgs
from titan_moe.model.decoder import Decoder
from titan_moe.model.head import IGNORE_INDEX, OutputHead, loss_from_prediction, with_head_labels


def _inputs(B=2, T=37, D=16, V=50, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, D, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, V, (B, T), generator=gen)
    labels[0, :5] = IGNORE_INDEX  # masked tokens count nowhere
    return h, labels


@pytest.mark.parametrize("chunk", [0, 1, 10, 37, 74, 500])
def test_chunked_loss_and_gradients_equal_the_whole_logits(chunk):
    h, labels = _inputs()
    head = OutputHead(16, 50).double()
    torch.nn.init.normal_(head.weight)
    h_ref = h.clone().requires_grad_()
    ref = F.cross_entropy(head(h_ref).flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)
    ref.backward()
    grad_w_ref = head.weight.grad.clone()
    head.weight.grad = None
    h_got = h.clone().requires_grad_()
    got = head(h_got, labels, chunk)
    assert got.dim() == 0 and got.dtype == torch.float32  # summed in fp32, as torchtitan's loss
    got.backward()
    assert got.item() == pytest.approx(ref.item(), rel=1e-6)
    torch.testing.assert_close(h_got.grad, h_ref.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(head.weight.grad, grad_w_ref, rtol=1e-6, atol=1e-7)
    assert h_got.grad[0, :5].abs().max() == 0  # ignored labels give no gradient


def test_chunked_forward_keeps_no_vocab_sized_tensor():
    h, labels = _inputs(B=1, T=512, D=8, V=1000)
    h = h.float().requires_grad_()
    head = OutputHead(8, 1000)
    saved: list[int] = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = head(h, labels, 64)
    assert max(saved) < 1000 * 64  # what stays for the backward: inputs, no [chunk, V] logits
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        saved.clear()
        head(h, labels, 0)  # one chunk, no checkpoint: the whole log-softmax is kept
    assert max(saved) >= 512 * 1000
    loss.backward()
    assert h.grad is not None and torch.isfinite(h.grad).all()


def test_decoder_returns_the_summed_loss_given_labels():
    args = dataclasses.replace(FLAVORS["debug"], dim=32, n_layers=4, head_chunk_tokens=24)
    torch.manual_seed(0)
    model = Decoder(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (2, 40))
    doc_ids = torch.cat([torch.zeros(2, 25, dtype=torch.long), torch.ones(2, 15, dtype=torch.long)], 1)
    labels = torch.randint(0, args.vocab_size, (2, 40))
    logits = model(tokens, doc_ids)
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    ref.backward()
    grads_ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    got = model(tokens, doc_ids, labels=labels)
    got.backward()
    assert got.item() == pytest.approx(ref.item(), rel=1e-6)
    for name, param in model.named_parameters():
        if name in grads_ref:
            torch.testing.assert_close(param.grad, grads_ref[name], rtol=1e-4, atol=1e-6, msg=name)
    # the trainer's plumbing: labels reach the model only with chunks set; a 0-d prediction is the loss
    assert "labels" in with_head_labels(args, {"doc_ids": doc_ids}, labels)
    assert "labels" not in with_head_labels(FLAVORS["debug"], {"doc_ids": doc_ids}, labels)
    loss_fn = loss_from_prediction(lambda pred, lab: torch.tensor(-1.0))
    assert loss_fn(got, labels) is got and loss_fn(logits, labels).item() == -1.0


@pytest.mark.parametrize("chunk", [0, 1, 10, 500])
def test_token_scores_equal_the_whole_logits_argmax_and_cross_entropy(chunk, monkeypatch):
    h, labels = _inputs()
    head = OutputHead(16, 50).double()
    torch.nn.init.normal_(head.weight)
    logits = head(h)
    with torch.no_grad():
        pred, loss = head(h, labels, 0, token_scores=True) if chunk == 0 else head.token_scores(h, labels, chunk)
    assert pred.shape == loss.shape == labels.shape and pred.dtype == torch.int64 and loss.dtype == torch.float32
    assert torch.equal(pred, logits.argmax(-1))
    want = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none", ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(loss, want.float(), rtol=1e-6, atol=1e-6)
    assert not loss[0, :5].any()  # ignored labels score 0
    seen: list[int] = []  # the default chunk: SCORE_CHUNK_ELEMENTS logits at a time
    monkeypatch.setattr("titan_moe.model.head.SCORE_CHUNK_ELEMENTS", 50 * 8)
    monkeypatch.setattr("titan_moe.model.head.F.linear", lambda x, w: seen.append(x.shape[0]) or x @ w.T)
    head.token_scores(h, labels)
    assert max(seen) == 8 and sum(seen) == h.shape[0] * h.shape[1]


def test_bad_chunk_and_labels_are_refused():
    with pytest.raises(ValueError, match="model.head_chunk_tokens"):
        ModelArgs(head_chunk_tokens=-1)
    with pytest.raises(ValueError, match="labels shape"):
        OutputHead(4, 10)(torch.zeros(1, 6, 4), torch.zeros(1, 5, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="labels shape"):
        OutputHead(4, 10).token_scores(torch.zeros(1, 6, 4), torch.zeros(1, 5, dtype=torch.long))


def _fsdp_head_worker(rank: int, world: int, reshard: str) -> None:
    """FSDP2 over the gloo ranks (the head and final norm one unit, resharded after the forward
    or not): the chunked loss gives every rank the loss and the (sharded) gradients of the
    whole-logits loss. Both models are built, seeded and sharded alike, so they start equal."""
    from torch.distributed.tensor import DTensor
    from torchtitan.distributed import ParallelDims

    from titan_moe.runtime.device import configure_torchtitan_device

    configure_torchtitan_device()
    from titan_moe.config import load_config, model_args_from_config
    from titan_moe.parallelize import parallelize_decoder
    from titan_moe.train import _use_plain_sum_for_gloo
    from tiny import CONFIG, TINY_CLI

    def build(chunk: int):
        config = load_config(["--job.config_file", CONFIG, *TINY_CLI, "--model.head_chunk_tokens", str(chunk),
                              "--parallelism.fsdp_reshard_after_forward", reshard])
        args = model_args_from_config(config)
        with torch.device("meta"):
            model = Decoder(args)
        dims = ParallelDims(dp_shard=-1, dp_replicate=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=world)
        model = parallelize_decoder(model, dims, config)
        _use_plain_sum_for_gloo([model])
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        with torch.no_grad():
            model.init_weights()
        return model, args

    gen = torch.Generator().manual_seed(rank)
    whole, args = build(0)
    tokens = torch.randint(0, args.vocab_size, (2, 48), generator=gen)
    labels = torch.randint(0, args.vocab_size, (2, 48), generator=gen)
    ref = F.cross_entropy(whole(tokens).flatten(0, 1), labels.flatten(), reduction="sum")
    ref.backward()
    chunked, _ = build(20)
    got = chunked(tokens, labels=labels)
    got.backward()
    assert got.item() == pytest.approx(ref.item(), rel=1e-6)
    for (name, p_ref), (_, p_got) in zip(whole.named_parameters(), chunked.named_parameters(), strict=True):
        assert isinstance(p_got, DTensor) and (p_ref.grad is None) == (p_got.grad is None), name
        if p_ref.grad is not None:
            torch.testing.assert_close(p_got.grad.full_tensor(), p_ref.grad.full_tensor(), rtol=1e-4, atol=1e-6,
                                       msg=name)


@pytest.mark.parametrize("reshard", ["default", pytest.param("always", marks=pytest.mark.slow)])
def test_chunked_loss_under_fsdp_on_two_ranks(tmp_path, reshard):
    from gloo_ranks import spawn_gloo

    spawn_gloo(_fsdp_head_worker, 2, tmp_path, reshard)
