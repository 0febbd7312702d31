"""profiling/probe_gluon_gemm.py: its own warp-specialized Gluon schedules (forward, dx with
transposed weights) build for sm90 on the CPU with the partitions they state. Gluon has no
interpreter: their results are checked on the GPU, where the probe compares every output with
torch._grouped_mm's before timing it."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from gluon_builds import build_results, check_builds

PROFILING = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "profiling")

def test_gluon_probe_builds_warp_specialized_for_sm90():
    """The probe's own schedules (cooperative and unpartitioned, forward and dx) build for sm90
    with the warps, registers, wgmma, TMA and shared memory they state and no spills (the
    backend's kernels: tests/test_grouped_gemm_gluon.py)."""
    results = build_results(PROFILING, [("128x256x64s3", "fwd"), ("256x128x64s3", "dx"), ("128x128x64s4", "fwd"),
                                        ("np128x256x64s3", "dx"), ("np256x128x64s3", "fwd")], [])
    assert len(results) == 5, results
    check_builds(results)


def test_usage_with_unknown_arguments():
    proc = subprocess.run([sys.executable, "profiling/probe_gluon_gemm.py", "128x256x64s3,bogus"], text=True,
                          capture_output=True, cwd=os.path.dirname(PROFILING), timeout=120)
    assert proc.returncode != 0 and "usage" in proc.stderr


def test_probe_refuses_reductions_its_boxes_cannot_tile():
    """The probe's kernels need the reduction to be a whole number of BK steps (so that a
    box never crosses into the next expert) and at least STAGES - 1 of them (the unpartitioned
    kernel's prologue); both are refused on the host, before any launch."""
    sys.path.insert(0, PROFILING)
    import probe_gluon_gemm as probe

    offs = torch.tensor([3, 5], dtype=torch.int32)
    for k in (40, 64):  # 40: not a multiple of 64; 64: one step, the 3-stage variant needs two
        x, w = torch.zeros(5, k, dtype=torch.bfloat16), torch.zeros(2, k, 256, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="multiple of BK"):
            probe.ws_grouped_mm(x, w, offs, "np128x256x64s3")


_RESULTS_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, PROFILING)
    import probe_gluon_gemm as probe

    variant = sys.argv[1]
    gen = torch.Generator(device="cuda").manual_seed(7)
    sizes = [0, 300, 37, 0, 512, 129, 1, 200]  # empty groups, partial tiles, a group inside one tile
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    M, K, N = sum(sizes), 256, 384
    x = torch.randn(M, K, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(len(sizes), K, N, device="cuda", generator=gen) / K ** 0.5).bfloat16()
    dy = torch.randn(M, N, device="cuda", generator=gen).bfloat16()

    def err(got, want):
        got, want = got.float(), want.float()
        return ((got - want).abs().max() / want.abs().max()).item()

    errors = [err(probe.ws_grouped_mm(x, w, offs, variant), torch._grouped_mm(x, w, offs=offs)),
              err(probe.ws_grouped_mm(dy, w.transpose(1, 2), offs, variant),
                  torch._grouped_mm(dy, w.transpose(1, 2), offs=offs))]
    print("RESULT", max(errors))
    """
)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs an sm90 (Hopper) GPU")
@pytest.mark.parametrize("variant", ["128x256x64s3", "256x128x64s3", "np128x256x64s3"])
def test_gluon_kernels_match_torch_on_random_ragged_groups(variant):
    """Each of the probe's own schedules' outputs (forward and dx; the backend's ping-pong and
    dw kernels: tests/test_grouped_gemm_gluon.py) against torch._grouped_mm's on fresh
    random bf16 inputs with empty groups and partial tiles, relative error below 1e-2 (bf16
    outputs of fp32 sums). Each runs in its own process under a time limit: a
    warp-specialized kernel that deadlocks fails the test instead of holding the suite."""
    script = _RESULTS_SCRIPT.replace("PROFILING", repr(PROFILING))
    try:
        proc = subprocess.run([sys.executable, "-c", script, variant], capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{variant}: no result within 180 s (a hang)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    error = float(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")).split()[1])
    assert error < 1e-2, (variant, error)
