"""The bf16 -> fp32 widening kernel (`titan_moe.float8.widen`): bit for bit ``t.float()``.

Without CUDA the kernel runs under the Triton interpreter (set before the module is imported;
`test_in_fresh_interpreter_process` reruns the file when Triton was imported earlier
without it); `test_compiles_for_sm90_with_vector_accesses` checks the GPU build.
"""

from __future__ import annotations

import textwrap

import pytest
from triton_mode import (compiled_script_results, interpret_without_gpu, kernel_test_setup, rerun_under_interpreter,
                         spy_on)
import torch

CUDA = interpret_without_gpu()

from titan_moe.float8 import widen  # noqa: E402
from titan_moe.ops.triton_runtime import is_interpreted  # noqa: E402

KERNELS_RUN_HERE, DEVICE, needs_kernels = kernel_test_setup(CUDA, is_interpreted(widen._widen_kernel),
                                                            "test_in_fresh_interpreter_process")


def special_values() -> torch.Tensor:
    """Every bf16 bit pattern: NaNs, infinities, signed zeros, subnormals and the normals."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


@needs_kernels
@pytest.mark.parametrize("shape", [(65536,), (3, 5000), (0, 7), (1,)])
def test_kernel_equals_float_bit_for_bit(shape):
    n = torch.Size(shape).numel()
    t = special_values().repeat(n // 65536 + 1)[:n].reshape(shape).to(DEVICE)
    got = widen.widen_to_fp32_triton(t)
    assert got.dtype == torch.float32 and got.shape == t.shape and got.is_contiguous()
    assert torch.equal(got.cpu().view(torch.int32), t.cpu().float().view(torch.int32))


@needs_kernels
@pytest.mark.parametrize("choice", ["", "torch", "triton"])
def test_non_contiguous_input_and_dispatch(choice, monkeypatch):
    """The backend picks the kernel ("triton") or torch's cast (default); either way the
    values of ``t.float()``; other dtypes always take torch's cast."""
    calls = spy_on(monkeypatch, widen, ["widen_to_fp32_triton"])
    t = torch.randn(16, 24, generator=torch.Generator().manual_seed(0)).bfloat16().to(DEVICE).t()
    assert torch.equal(widen.widen_to_fp32(t, choice), t.float())
    half = torch.randn(4, 4).half().to(DEVICE)
    assert torch.equal(widen.widen_to_fp32(half, choice), half.float())
    assert calls == (["widen_to_fp32_triton"] if choice == "triton" else [])


def test_backend_rejects_unknown_values():
    with pytest.raises(ValueError, match="torch or triton"):
        widen.widen_to_fp32(torch.zeros(2, dtype=torch.bfloat16), "cuda")


def test_rejects_other_dtypes():
    with pytest.raises(ValueError, match="expected bf16"):
        widen.widen_to_fp32_triton(torch.zeros(4))


@pytest.mark.skipif(KERNELS_RUN_HERE, reason="the kernels already run in this process")
def test_in_fresh_interpreter_process():
    rerun_under_interpreter(__file__, also_deselect="compiles_for_sm90")


_COMPILE_SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from titan_moe.float8 import widen

    sig = {"src_ptr": "*i16", "dst_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    attrs = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]}
    src = ASTSource(fn=widen._widen_kernel, signature=sig, constexprs={"BLOCK": widen.BLOCK}, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
    print("RESULT", repr({"vector_loads": "ld.global.v4.b32" in ptx, "vector_stores": "st.global.v4.b32" in ptx}))
    """
)


def test_compiles_for_sm90_with_vector_accesses():
    """The GPU build loads and stores 16-byte vectors (the point of the kernel against ATen's
    element-wise casting copy)."""
    results = compiled_script_results(_COMPILE_SCRIPT)
    assert results == {"vector_loads": True, "vector_stores": True}, results
