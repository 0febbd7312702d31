"""titan_moe.ops.eager_path: when an op call may skip the custom-op dispatch (CPU)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from titan_moe.ops.eager_path import takes_direct_path
from titan_moe.ops.grouped_gemm import grouped_mm


class PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_direct_path_only_for_real_tensors_in_eager_calls(monkeypatch):
    x, w = torch.randn(4, 8), torch.randn(2, 8, 8)
    assert takes_direct_path(x, w, None)
    assert not takes_direct_path(x, torch.empty(2, 8, 8, device="meta"))
    with PassThrough():
        assert not takes_direct_path(x, w)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
    assert not takes_direct_path(fake, w)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not takes_direct_path(x, w)


def test_fake_tensors_take_the_op_and_its_fake_implementation():
    """Under FakeTensorMode (the memory planner's measurement) the grouped GEMM goes through
    the op, whose fake implementation reads no offsets; the direct path would read them."""
    with FakeTensorMode():
        x = torch.randn(32, 16, requires_grad=True)
        w = torch.randn(2, 16, 8, requires_grad=True)
        offs = torch.tensor([16, 32], dtype=torch.int32)
        out = grouped_mm(x, w, offs)
        out.sum().backward()
        assert out.shape == (32, 8) and w.grad.shape == (2, 16, 8)
