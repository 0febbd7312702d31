"""The whole decoder under context parallelism (`titan_moe.context_parallel`) against the
one-process decoder on the same rows: logits, every parameter's gradient, on gloo CPU ranks.

Each rank builds the same model from a seed and computes the reference on the whole rows
itself; then a copy with `apply_context_parallel` runs on the rank's segment of every row
(tokens and document ids sliced along T, as the trainer slices them), its loss weighted by
the same fixed tensor, and the parameter gradients are summed over the ranks (what FSDP's
reduction does). Each rank also checks that its KDA and MLA layers saw L = T / cp tokens.

Rows (T = 128): documents crossing segment boundaries, one document longer than a segment
(cp = 4: it covers rank 1 wholly, so that rank's transition M carries the state), a
one-token document, documents starting exactly at a segment's first token, and a row that
is one document; with MLA's queries on their own rank and balanced ("headtail": half-
segments moved between the ranks), and the rows unpacked (no document ids), balanced.

Tolerance: the model is fp32; the segments' KDA chunks are not the whole row's (the state
crosses the ranks by the transition algebra, not by the same chunk products) and MLA runs
in latent space, so the two sides agree to fp32 rounding accumulated through four layers
and their backward: at most 1.3e-5 relative measured (cp 2 and 4, over every parameter's
gradient; the largest is A_log's, a sum over every token with cancellation, which falls to
2e-7 with the decoder in float64); 1e-4 leaves room and still catches a wrong halo, document cut or missing
gradient term (a zeroed halo gives 1.8).

On torch's fake backend (one process as one rank) the segments' document facts come from
this rank's ids repeated along the row, with no collective read (last test).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from gloo_ranks import spawn_gloo
from numerics import rel_err
from tiny import TINY_ARGS

T = 128
RTOL = 1e-4
ROWS = [  # document lengths per row, summing to T
    [10, 70, 1, 47],
    [T],
    [32, 32, 64],
]


def _model():
    from titan_moe.model.decoder import Decoder

    torch.manual_seed(0)
    model = Decoder(dataclasses.replace(TINY_ARGS, mla_attention="chunked"))
    model.init_weights()
    return model


def _batch():
    gen = torch.Generator().manual_seed(1)
    doc_ids = torch.stack([
        torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(row)]) for row in ROWS
    ])
    tokens = torch.randint(0, TINY_ARGS.vocab_size, doc_ids.shape, generator=gen)
    weight = torch.randn(*doc_ids.shape, TINY_ARGS.vocab_size, generator=gen)
    return tokens, doc_ids, weight


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _worker(rank: int, world: int) -> None:
    import torch.distributed as dist

    from titan_moe.context_parallel import apply_context_parallel, row_segments, segment_of
    from titan_moe.ops.attention import doc_starts

    tokens, doc_ids, weight = _batch()
    L = T // world
    rows = row_segments(segment_of(tokens, rank, world), segment_of(doc_ids, rank, world), dist.group.WORLD, 4)
    assert torch.equal(rows.starts_BL, segment_of(doc_starts(doc_ids), rank, world))
    halo_ids = doc_ids[:, rank * L - 3 : rank * L] if rank else torch.full((3, 3), -1, dtype=torch.int32)
    assert torch.equal(rows.conv_ids_BX, torch.cat([halo_ids, segment_of(doc_ids, rank, world)], dim=1))
    for packed, balance in ((True, None), (True, "headtail"), (False, "headtail")):
        ids = doc_ids if packed else None
        reference = _model()
        logits_ref = reference(tokens, ids)
        (logits_ref * weight).sum().backward()

        model = copy.deepcopy(reference)
        model.zero_grad(set_to_none=True)
        apply_context_parallel(model, dist.group.WORLD, balance)
        seen = []
        for layer in model.layers.values():
            layer.attention.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
        local_ids = segment_of(ids, rank, world) if packed else None
        logits = model(segment_of(tokens, rank, world), local_ids)
        (logits * segment_of(weight, rank, world)).sum().backward()
        assert seen == [L] * len(model.layers), f"rank {rank}: the layers saw {seen} tokens, not {L}"

        errors = {"logits": rel_err(logits, segment_of(logits_ref, rank, world))}
        grads, grads_ref = _grads(model), _grads(reference)
        assert grads.keys() == grads_ref.keys()
        for name, grad in grads.items():
            dist.all_reduce(grad)
            errors[name] = rel_err(grad, grads_ref[name])
        bad = {name: err for name, err in errors.items() if not err <= RTOL}
        assert not bad, f"cp={world}, rank {rank}, packed={packed}, {balance}: relative errors above {RTOL}: {bad}"


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_decoder_under_context_parallelism_matches_one_process(world, tmp_path):
    spawn_gloo(_worker, world, tmp_path)


def _whole_row_scores_worker(rank: int, world: int) -> None:
    """`context_parallel_scores_fn` on rows of a length the layout does not take (T = 100,
    padded to 128 at cp 2): the one-process model's argmax and cross-entropy on every rank,
    for packed rows and for rows of one document (all ids 0, as the evaluator passes them)."""
    import torch.distributed as dist

    from titan_moe.context_parallel import apply_context_parallel, context_parallel_scores_fn
    from titan_moe.evaluate import scores_from_logits

    tokens, doc_ids, _ = _batch()
    tokens, doc_ids = tokens[:, :100], doc_ids[:, :100]
    targets = torch.roll(tokens, -1, dims=1)
    targets[0, ::7] = -100  # ignored targets score 0
    reference = _model().eval()
    model = copy.deepcopy(reference)
    apply_context_parallel(model, dist.group.WORLD, "headtail")
    scores_fn = context_parallel_scores_fn(model, "cpu", dist.group.WORLD)
    with torch.no_grad():
        for ids in (doc_ids, torch.zeros_like(doc_ids)):
            (pred, loss), (pred_ref, loss_ref) = scores_fn(tokens, ids, targets), scores_from_logits(reference)(
                tokens, ids, targets)
            assert pred.shape == loss.shape == (tokens.shape[0], 100) and not loss[0, ::7].any()
            err = rel_err(loss, loss_ref)
            assert err <= RTOL, f"rank {rank}: whole-row cross-entropy off by {err}"
            top2 = reference(tokens, ids).topk(2, dim=-1).values
            clear = (top2[..., 0] - top2[..., 1]) > 1e-3  # argmax not decided by rounding
            assert clear.float().mean() > 0.9 and torch.equal(pred[clear], pred_ref[clear]), f"rank {rank}: argmax"


def test_whole_row_scores_under_context_parallelism_match_one_process(tmp_path):
    spawn_gloo(_whole_row_scores_worker, 2, tmp_path)


def test_fake_backend_takes_every_segment_to_hold_this_ranks_ids(monkeypatch):
    """On torch's fake backend (`row_segments(..., fake_backend=True)`) the document ids are
    not all-gathered: the whole row is this segment's ids repeated, and every document fact
    (KDA layout, MLA starts, halo ids) follows from that row."""
    import torch.distributed as dist

    from titan_moe.context_parallel import row_segments
    from titan_moe.ops.attention import doc_starts

    def no_collective(*args, **kwargs):
        raise AssertionError("the fake backend's all-gather was read")

    rank, cp, conv_size = 2, 4, 4
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: cp)
    monkeypatch.setattr(dist, "all_gather", no_collective)
    for ids, continues in (([7] * 64, True), ([3] * 20 + [4] * 44, False)):  # one document; a start inside
        ids_BL = torch.tensor([ids])
        rows = row_segments(torch.zeros_like(ids_BL), ids_BL, None, conv_size, fake_backend=True)
        ids_BT = ids_BL.repeat(1, cp)
        assert torch.equal(rows.starts_BT, doc_starts(ids_BT))
        ((layout, _),) = rows.kda
        assert (layout.rank, layout.cp, layout.T, layout.continues) == (rank, cp, 64, continues)
        assert torch.equal(rows.conv_ids_BX[0, conv_size - 1:], ids_BL[0])
        assert torch.equal(rows.conv_ids_BX[0, : conv_size - 1], ids_BL[0, -(conv_size - 1):])
