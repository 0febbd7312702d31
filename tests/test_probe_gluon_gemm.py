"""profiling/probe_gluon_gemm.py: its warp-specialized Gluon grouped GEMM kernels (forward, dx
with transposed weights, dw) build for sm90 on the CPU with the partitions they state. Gluon has
no interpreter: their results are checked on the GPU, where the probe compares every output
with torch._grouped_mm's before timing it."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from triton_mode import compiled_script_results

PROFILING = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "profiling")

_SCRIPT = textwrap.dedent(
    """
    import pathlib, subprocess, sys, tempfile, torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type
    sys.path.insert(0, PROFILING)
    import probe_gluon_gemm as probe

    CUOBJDUMP = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"

    def stack_bytes(cubin):  # spilled bytes per thread, -1 where cuobjdump is not shipped
        if not CUOBJDUMP.exists():
            return -1
        with tempfile.TemporaryDirectory() as folder:
            path = pathlib.Path(folder) / "k.cubin"
            path.write_bytes(cubin)
            usage = subprocess.run([str(CUOBJDUMP), "-res-usage", str(path)], capture_output=True, text=True).stdout
        return int(usage.split("STACK:")[1].split()[0])

    def build(kernel, sig, consts, bn):
        sig = dict(sig, **{n: "constexpr" for n in consts})
        k = triton.compile(GluonASTSource(fn=kernel, signature=sig, constexprs=consts),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": consts["num_warps"]})
        ptx = k.asm["ptx"]
        return (k.metadata.num_warps, k.metadata.shared, stack_bytes(k.asm["cubin"]), "setmaxnreg" in ptx,
                f"wgmma.mma_async.sync.aligned.m64n{bn}k16" in ptx, "cp.async.bulk.tensor.2d" in ptx,
                "mbarrier.try_wait" in ptx, k.metadata.global_scratch_size > 0 and "fence.proxy.tensormap" in ptx)

    results = {}
    x, w = torch.empty(4096, 2048, dtype=torch.bfloat16), torch.empty(8, 2048, 1408, dtype=torch.bfloat16)
    out, dx = torch.empty(4096, 1408, dtype=torch.bfloat16), torch.empty(4096, 2048, dtype=torch.bfloat16)
    for i, (name, (bm, bn, bk, stages, warps)) in enumerate(probe.VARIANTS.items()):
        product = ("fwd", "dx")[i % 2]  # dx: dy [M, N] @ w^T, w transposed, the output K wide
        a, b, c, transposed = (probe.descriptors(x, w, out, bm, bn, bk) if product == "fwd" else
                               probe.descriptors(out, w.transpose(1, 2), dx, bm, bn, bk))
        assert transposed == (product == "dx")
        sig = {"a_desc": mangle_type(a), "b_desc": mangle_type(b), "c_desc": mangle_type(c), "c_ptr": "*bf16",
               "offs_ptr": "*i32", "M": "i32", "N": "i32", "E": "i32", "K": "i32", "stride_cm": "i32"}
        consts = {"STAGES": stages, "BLOCK_E": 128, "B_TRANSPOSED": transposed, "num_warps": warps}
        if warps == "pp":  # two 4-warp consumers and the load warp's group
            kernel, kind, expected_warps = probe._pingpong_grouped_mm_kernel, "ws", 12
            consts = dict(consts, num_warps=4, CONSUMER_REGS=232)
        elif name.startswith("np"):  # no partitions
            kernel, kind, expected_warps = probe._pipelined_grouped_mm_kernel, "np", warps
        else:  # the consumer's warps and the load warp's group
            kernel, kind, expected_warps = probe._ws_grouped_mm_kernel, "ws", warps + 4
        results[name + "_" + product] = (expected_warps, kind) + build(kernel, sig, consts, bn)
    dw = torch.empty(8 * 2048, 1408, dtype=torch.bfloat16)
    for name, (bm, bk, bn, stages, warps) in probe.DW_VARIANTS.items():
        d = TensorDescriptor(dw, list(dw.shape), [1408, 1], [bk, bn],
                             gl.NVMMASharedLayout.get_default_for([bk, bn], gl.bfloat16))
        sig = {"x_ptr": "*bf16", "g_ptr": "*bf16", "dw_desc": mangle_type(d), "offs_ptr": "*i32", "M": "i32",
               "K": "i32", "N": "i32", "E": "i32", "stride_xm": "i32", "stride_gm": "i32"}
        results[name] = (warps + 4, "dw") + build(probe._ws_grouped_dw_kernel, sig,
                                              {"BM": bm, "STAGES": stages, "num_warps": warps}, bn)
    print("RESULT", repr(results))
    """
)


def test_gluon_probe_builds_warp_specialized_for_sm90():
    results = compiled_script_results(_SCRIPT.replace("PROFILING", repr(PROFILING)))
    assert len(results) == 11, results
    for name, (expected_warps, kind, warps, shared, stack, maxnreg, wgmma, tma, waits, device_descs) in results.items():
        assert warps == expected_warps, (name, warps)
        # registers moved between the partitions exactly where there are partitions
        assert maxnreg == (kind != "np"), (name, maxnreg)
        assert wgmma and tma and waits, (name, results[name])  # wgmma, TMA copies, mbarrier waits
        assert 0 < shared <= 232448, (name, shared)  # sm90's shared memory per block
        assert stack in (0, -1), (name, stack)  # no spills (-1: no cuobjdump to read them)
        # the dw makes its per-group TMA descriptors on the device (scratch, tensormap fence)
        assert device_descs == (kind == "dw"), (name, device_descs)


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
    with pytest.raises(ValueError, match="multiple of the dw tile"):
        probe.ws_grouped_dw(torch.zeros(5, 96, dtype=torch.bfloat16), torch.zeros(5, 128, dtype=torch.bfloat16),
                            offs, "dw128x128x64s4")


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

    if variant in probe.DW_VARIANTS:  # against torch's dw, empty groups zero
        dw = probe.ws_grouped_dw(x, dy, offs, variant)
        want = torch._grouped_mm(x.t(), dy, offs=offs)
        want[torch.tensor(sizes, device="cuda") == 0] = 0
        errors = [err(dw, want)]
    else:  # the forward and dx
        errors = [err(probe.ws_grouped_mm(x, w, offs, variant), torch._grouped_mm(x, w, offs=offs)),
                  err(probe.ws_grouped_mm(dy, w.transpose(1, 2), offs, variant),
                      torch._grouped_mm(dy, w.transpose(1, 2), offs=offs))]
    print("RESULT", max(errors))
    """
)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs an sm90 (Hopper) GPU")
@pytest.mark.parametrize("variant", ["128x256x64s3", "256x128x64s3", "pp128x128x64s4", "np128x256x64s3",
                                     "dw256x128x64s3", "dw128x128x64s4"])
def test_gluon_kernels_match_torch_on_random_ragged_groups(variant):
    """Each schedule's outputs (forward and dx, or dw) against torch._grouped_mm's on fresh
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
