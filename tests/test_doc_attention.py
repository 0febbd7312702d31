"""Packed causal attention (titan_moe.ops.attention) against a float64 per-document reference.

Tolerances: in float64 the chunked op and the reference differ only in summation order over
at most a few hundred terms (~1e-15 relative); 1e-12 leaves a wide margin and still catches
any wrong mask or missing key (O(1e-1) errors). In fp32 the softmax, weighted sums and the
backward's recomputation add ~1e-6; 1e-5 as in test_mla.
"""

from __future__ import annotations

import pytest
import torch
from numerics import rel_err
from torch.utils._python_dispatch import TorchDispatchMode

from titan_moe.ops.attention import doc_attention_chunked, doc_attention_reference, doc_starts
from titan_moe.ops.attention.chunked import chunked_backward, chunked_forward


def doc_ids_from_lengths(rows: list[list[int]]) -> torch.Tensor:
    """int32 [B, T] from per-row document lengths (each row summing to T)."""
    return torch.stack([
        torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)]) for lengths in rows
    ])


def random_qkv(B: int, H: int, T: int, K: int, V: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, d, generator=gen, dtype=torch.float64).to(dtype).requires_grad_() for d in (K, K, V)]


def assert_same_outputs_and_grads(out, ref, leaves, tol: float) -> None:
    """out == ref within `tol`, and so are the gradients of (out * g).sum() and (ref * g).sum()
    with respect to `leaves` (q, k, v) for one random g."""
    assert rel_err(out, ref) < tol
    g = torch.randn_like(out)
    got = torch.autograd.grad((out * g).sum(), leaves)
    want = torch.autograd.grad((ref * g).sum(), leaves)
    for name, a, b in zip("qkv", got, want):
        assert rel_err(a, b) < tol, name


MIXES = {
    "several": [[40, 1, 100, 59], [200]],
    "one_token_docs": [[1, 1, 1, 97, 1, 99], [1] * 200],
    "long_and_one": [[199, 1], [13, 187]],
}


def test_doc_starts():
    ids = doc_ids_from_lengths([[2, 3, 1], [6]])
    assert doc_starts(ids).tolist() == [[0, 0, 2, 2, 2, 5], [0] * 6]
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        doc_starts(ids[0])


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("chunk", [7, 64, 512])  # T = 200: not a multiple of 7 or 64; one chunk
def test_chunked_matches_float64_reference_with_gradients(mix, chunk):
    ids = doc_ids_from_lengths(MIXES[mix])
    q, k, v = random_qkv(2, 3, 200, 12, 8, torch.float64, seed=chunk)  # qk and v dims differ
    o = doc_attention_chunked(q, k, v, doc_starts(ids), 0.3, chunk=chunk)
    assert_same_outputs_and_grads(o, doc_attention_reference(q, k, v, ids, 0.3), (q, k, v), 1e-12)


@pytest.mark.parametrize("offset", [0, 77, 120])
def test_query_slices_with_offset_equal_the_whole_row(offset):
    """A context-parallel rank's queries (a slice at `offset`) against the keys before and within
    it give the whole row's outputs for that slice, and the gradients it contributes."""
    ids = doc_ids_from_lengths(MIXES["several"])
    q, k, v = random_qkv(2, 3, 200, 12, 8, torch.float64, seed=offset)
    starts = doc_starts(ids)
    end = min(offset + 80, 200)
    whole = doc_attention_chunked(q, k, v, starts, 0.3, chunk=32)
    part = doc_attention_chunked(q[:, :, offset:end], k[:, :, :end], v[:, :, :end], starts[:, offset:end], 0.3,
                                 chunk=32, q_offset=offset)
    assert_same_outputs_and_grads(part, whole[:, :, offset:end], (q, k, v), 1e-12)


def test_keys_shared_by_all_heads_equal_expanded_keys():
    """Hk = 1 (MLA's latent keys): the same outputs as the keys repeated per head, and key and
    value gradients summed over the heads."""
    ids = doc_ids_from_lengths(MIXES["one_token_docs"])
    q = torch.randn(2, 4, 200, 10, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 1, 200, d, dtype=torch.float64, requires_grad=True) for d in (10, 6))
    starts = doc_starts(ids)
    shared = doc_attention_chunked(q, k, v, starts, 0.4, chunk=48)
    expanded = doc_attention_chunked(q, k.expand(-1, 4, -1, -1), v.expand(-1, 4, -1, -1), starts, 0.4, chunk=48)
    assert_same_outputs_and_grads(shared, expanded, (q, k, v), 1e-12)
    with pytest.raises(ValueError, match="cover positions"):
        doc_attention_chunked(q[:, :, 100:], k[:, :, :150], v[:, :, :150], starts[:, 100:], 0.4, q_offset=100)


def test_chunked_fp32_and_bf16_against_float64():
    """fp32 within 1e-5; bf16 inputs (fp32 softmax inside) within bf16's rounding of inputs
    and output, ~1e-2 (as test_mla's bf16 bound)."""
    ids = doc_ids_from_lengths(MIXES["several"])
    q, k, v = random_qkv(2, 2, 200, 16, 16, torch.float64, seed=1)
    ref = doc_attention_reference(q, k, v, ids, 0.25)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        args = [t.detach().to(dtype) for t in (q, k, v)]
        o = doc_attention_chunked(*args, doc_starts(ids), 0.25, chunk=64)
        assert o.dtype == dtype and rel_err(o, ref) < tol, dtype


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an aten op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_chunked_never_forms_a_T_by_T_tensor():
    """One document filling the row (the worst case): forward and backward stay within
    O(B * H * chunk * T) elements per tensor, far below B * H * T * T."""
    B, H, T, chunk = 1, 2, 2048, 64
    ids = torch.zeros(B, T, dtype=torch.int32)
    q, k, v = (t.detach() for t in random_qkv(B, H, T, 8, 8, torch.float32, seed=2))
    starts = doc_starts(ids)
    with LargestTensor() as mode:
        o, lse = chunked_forward(q, k, v, starts, 0.3, chunk)
        chunked_backward(torch.ones_like(o), q, k, v, o, lse, starts, 0.3, chunk)
    assert mode.largest <= B * H * chunk * T
    assert mode.largest < B * H * T * T // 16


def test_chunked_rejects_bad_arguments():
    q, k, v = (t.detach() for t in random_qkv(1, 1, 8, 4, 4, torch.float32, seed=3))
    with pytest.raises(ValueError, match="chunk"):
        doc_attention_chunked(q, k, v, torch.zeros(1, 8, dtype=torch.int32), 0.5, chunk=0)
    with pytest.raises(ValueError, match="starts"):
        doc_attention_chunked(q, k, v, torch.zeros(1, 7, dtype=torch.int32), 0.5)


def test_chunked_op_passes_opcheck_and_compiles_without_graph_breaks():
    ids = doc_ids_from_lengths([[3, 9, 4]])
    q, k, v = random_qkv(1, 2, 16, 4, 4, torch.float32, seed=4)
    starts = doc_starts(ids)
    torch.library.opcheck(torch.ops.titan_moe.doc_attention_fwd.default, (q, k, v, starts, 0.5, 8, 0))
    # as MLA passes them: [B, T, H, D] tensors transposed to [B, H, T, D]
    q_t, k_t, v_t = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.titan_moe.doc_attention_fwd.default, (q_t, k_t, v_t, starts, 0.5, 8, 0))
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, k, v, ids: doc_attention_chunked(q, k, v, doc_starts(ids), 0.5, chunk=8), backend="aot_eager", fullgraph=True
    )
    assert rel_err(compiled(q, k, v, ids), doc_attention_reference(q, k, v, ids, 0.5)) < 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [[[5, 300, 30, 1, 64], [400]], [[1, 1, 398], [399, 1]], [[150, 250], [260, 140]]])
def test_varlen_matches_float64_reference_cuda(rows):
    """One varlen FlashAttention-2 call over both rows (bf16) at MLA's head dims (qk 192, v 128)
    against the float64 per-document reference, forward and gradients: one-token documents,
    documents ending at the row's end, two rows flattened into one stream."""
    from titan_moe.model.packing import cu_seqlens_from_doc_ids
    from titan_moe.ops.attention import doc_attention_varlen

    ids = doc_ids_from_lengths(rows)
    q, k, v = random_qkv(2, 2, 400, 192, 128, torch.float64, seed=6)
    ref = doc_attention_reference(q, k, v, ids, 0.07)
    g = torch.randn_like(ref)
    want = torch.autograd.grad((ref * g).sum(), (q, k, v))
    args = [t.detach().to("cuda", torch.bfloat16).transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
    o = doc_attention_varlen(*args, cu_seqlens_from_doc_ids(ids.cuda()), 0.07).transpose(1, 2)
    got = torch.autograd.grad((o * g.to("cuda", torch.bfloat16)).sum(), args)
    assert rel_err(o, ref) < 2e-2
    for name, a, b in zip("qkv", got, want):
        assert rel_err(a.transpose(1, 2), b) < 4e-2, name
