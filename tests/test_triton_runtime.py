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

