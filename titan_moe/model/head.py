"""The output head, and its training loss in token chunks (``ModelArgs.head_chunk_tokens``).

The whole-row loss holds fp32 ``[T, V]`` logits, their log-softmax (kept for the backward)
and its gradient: about ``12 V`` bytes a token, 48 KiB at V = 4096, 48 GiB for a
million-token row. :meth:`OutputHead.loss_sum` computes the cross-entropy sum chunk by chunk,
each chunk's logits under a non-reentrant activation checkpoint, so the forward keeps only the
head's input and the backward recomputes and holds one chunk's logits at a time. Cost: the
head's matmul once more in the backward (``2 T D V`` FLOPs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100  # torchtitan's: labels with this value count in neither the loss nor its token count
# Logits computed at once by `OutputHead.token_scores`: 2^28 fp32 values (1 GiB), 65,536 tokens
# at a vocabulary of 4,096 and 1,638 at K3's 163,840.
SCORE_CHUNK_ELEMENTS = 1 << 28


def _chunk_cross_entropy_sum(h_ND: Tensor, weight_VD: Tensor, labels_N: Tensor) -> Tensor:
    logits_NV = F.linear(h_ND, weight_VD).float()
    return F.cross_entropy(logits_NV, labels_N, reduction="sum", ignore_index=IGNORE_INDEX)


class OutputHead(nn.Linear):
    """``nn.Linear(dim, vocab, bias=False)`` (the state-dict key stays ``output.weight``) with
    a chunked training loss. ``forward(h)`` gives the logits; :meth:`loss_sum` the summed
    cross-entropy without them. Called once per step either way, so FSDP2's hooks on this
    module gather and reduce its weight once."""

    def __init__(self, dim: int, vocab_size: int):
        super().__init__(dim, vocab_size, bias=False)

    def forward(self, h_BTD: Tensor, labels_BT: Tensor | None = None, chunk_tokens: int = 0,
                token_scores: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Logits ``[B, T, V]`` (fp32) of ``h_BTD``; with ``labels_BT``, the 0-d fp32 sum of the
        cross-entropy over the tokens whose label is not ``IGNORE_INDEX`` instead (chunks of
        ``chunk_tokens`` tokens; 0: one chunk); with ``token_scores`` too, each token's argmax
        and cross-entropy (:meth:`token_scores`)."""
        if labels_BT is None:
            return super().forward(h_BTD).float()
        if token_scores:
            return self.token_scores(h_BTD, labels_BT)
        return self.loss_sum(h_BTD, labels_BT, chunk_tokens)

    def token_scores(self, h_BTD: Tensor, labels_BT: Tensor, chunk_tokens: int = 0) -> tuple[Tensor, Tensor]:
        """What an evaluation reads of the logits, without ``[B, T, V]`` of them: the argmax
        prediction ``[B, T]`` int64 and the cross-entropy of ``labels_BT`` ``[B, T]`` fp32 (0
        where the label is ``IGNORE_INDEX``), the logits computed ``chunk_tokens`` tokens at a
        time (0: ``SCORE_CHUNK_ELEMENTS`` logits at a time). For forwards without autograd."""
        if labels_BT.shape != h_BTD.shape[:-1]:
            raise ValueError(f"labels shape {tuple(labels_BT.shape)} != tokens shape {tuple(h_BTD.shape[:-1])}")
        h_ND = h_BTD.reshape(-1, h_BTD.shape[-1])
        labels_N = labels_BT.reshape(-1)
        chunk = chunk_tokens if chunk_tokens > 0 else max(1, SCORE_CHUNK_ELEMENTS // self.out_features)
        preds, losses = [], []
        for start in range(0, h_ND.shape[0], chunk):
            logits_NV = F.linear(h_ND[start : start + chunk], self.weight).float()
            preds.append(logits_NV.argmax(-1))
            losses.append(F.cross_entropy(logits_NV, labels_N[start : start + chunk], reduction="none",
                                          ignore_index=IGNORE_INDEX))
        return torch.cat(preds).view(labels_BT.shape), torch.cat(losses).view(labels_BT.shape)

    def loss_sum(self, h_BTD: Tensor, labels_BT: Tensor, chunk_tokens: int = 0) -> Tensor:
        if labels_BT.shape != h_BTD.shape[:-1]:
            raise ValueError(f"labels shape {tuple(labels_BT.shape)} != tokens shape {tuple(h_BTD.shape[:-1])}")
        h_ND = h_BTD.reshape(-1, h_BTD.shape[-1])
        labels_N = labels_BT.reshape(-1)
        N = h_ND.shape[0]
        chunk = chunk_tokens if chunk_tokens > 0 else max(N, 1)
        total = h_ND.new_zeros((), dtype=torch.float32)
        for start in range(0, N, chunk):
            h_cD, labels_c = h_ND[start : start + chunk], labels_N[start : start + chunk]
            if torch.is_grad_enabled() and N > chunk:
                part = checkpoint(_chunk_cross_entropy_sum, h_cD, self.weight, labels_c,
                                  use_reentrant=False, preserve_rng_state=False)
            else:
                part = _chunk_cross_entropy_sum(h_cD, self.weight, labels_c)
            total = total + part
        return total


def loss_from_prediction(loss_fn):
    """Wrap the trainer's ``loss_fn(pred, labels)``: a 0-d ``pred`` is already the summed loss
    (a model given ``labels`` computes it in chunks, :class:`OutputHead`); logits go to
    ``loss_fn``."""

    def loss(pred: Tensor, labels: Tensor) -> Tensor:
        return pred if pred.dim() == 0 else loss_fn(pred, labels)

    return loss


def with_head_labels(model_args, extra_inputs: dict, labels: Tensor) -> dict:
    """The model's keyword inputs plus ``labels`` when ``model_args.head_chunk_tokens`` is set
    (the model then returns the summed loss, :func:`loss_from_prediction`)."""
    if getattr(model_args, "head_chunk_tokens", 0) > 0:
        return {**extra_inputs, "labels": labels}
    return extra_inputs
