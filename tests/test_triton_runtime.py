"""titan_moe.ops.triton_runtime's host-side helpers (CPU)."""

from __future__ import annotations

import triton

from titan_moe.ops.triton_runtime import cdiv, next_power_of_2


def test_grid_helpers_equal_tritons():
    """The launchers' integer helpers give Triton's values, zero and negatives included."""
    for a in range(-5, 70):
        for b in (1, 2, 3, 16, 64):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
    for n in [*range(0, 300), 1023, 1024, 1025, 4095, 4096, 65_536, 65_537]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n



def test_compile_log_names_the_kernel_and_step_and_lets_the_compile_go_on(caplog):
    from triton import knobs

    from titan_moe.ops.triton_runtime import log_jit_compiles

    before = knobs.runtime.jit_cache_hook
    try:
        log_jit_compiles(step_of=lambda: 7)
        hook = knobs.runtime.jit_cache_hook
        with caplog.at_level("WARNING"):
            # the keywords Triton's JITFunction._call_hook passes
            go_on = hook(key=("k",), repr="_state_scan_kernel[num_warps=4](cu_seqlens: *i32, n: i32D)", fn=None,
                         compile={}, is_manual_warmup=False, already_compiled=False)
        assert not go_on  # a true value would make Triton skip the compile
        assert "triton: compiling _state_scan_kernel[num_warps=4](cu_seqlens: *i32, n: i32D) (step 7)" in caplog.text
    finally:
        knobs.runtime.jit_cache_hook = before
