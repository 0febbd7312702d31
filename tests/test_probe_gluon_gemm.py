"""profiling/probe_gluon_gemm.py: its warp-specialized Gluon grouped GEMM builds for sm90 on the
CPU, forward, dx (transposed weights) and dw, with the partitions it states (Gluon has no interpreter: its results are checked on the
GPU, where the probe compares every output with torch._grouped_mm before timing it)."""

import os
import subprocess
import sys
import textwrap

from triton_mode import compiled_script_results

PROFILING = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "profiling")

_SCRIPT = textwrap.dedent(
    """
    import sys, torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type
    sys.path.insert(0, PROFILING)
    import probe_gluon_gemm as probe

    results = {}
    x = torch.empty(4096, 2048, dtype=torch.bfloat16)
    w = torch.empty(8, 2048, 1408, dtype=torch.bfloat16)
    out = torch.empty(4096, 1408, dtype=torch.bfloat16)
    dx = torch.empty(4096, 2048, dtype=torch.bfloat16)
    for i, (name, (bm, bn, bk, stages, warps)) in enumerate(probe.VARIANTS.items()):
        product = ("fwd", "dx")[i % 2]
        if product == "fwd":
            a, b, c, transposed = probe.descriptors(x, w, out, bm, bn, bk)
        else:  # dy [M, N] @ w^T: w transposed, the output K wide
            a, b, c, transposed = probe.descriptors(out, w.transpose(1, 2), dx, bm, bn, bk)
        assert transposed == (product == "dx")
        sig = {"a_desc": mangle_type(a), "b_desc": mangle_type(b), "c_desc": mangle_type(c), "c_ptr": "*bf16",
               "offs_ptr": "*i32", "M": "i32", "N": "i32", "E": "i32", "K": "i32", "stride_cm": "i32"}
        consts = {"STAGES": stages, "BLOCK_E": 128, "B_TRANSPOSED": transposed, "num_warps": warps}
        kernel = probe._ws_grouped_mm_kernel
        if warps == "pp":  # two 4-warp consumers
            kernel, consts = probe._pingpong_grouped_mm_kernel, dict(consts, num_warps=4, CONSUMER_REGS=232)
        sig.update({n: "constexpr" for n in consts})
        src = GluonASTSource(fn=kernel, signature=sig, constexprs=consts)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": consts["num_warps"]})
        ptx = k.asm["ptx"]
        results[name + "_" + product] = (warps, k.metadata.num_warps, k.metadata.shared, "setmaxnreg" in ptx,
                                         f"wgmma.mma_async.sync.aligned.m64n{bn}k16" in ptx,
                                         "cp.async.bulk.tensor.2d" in ptx, "mbarrier.try_wait" in ptx)
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    dw = torch.empty(8 * 2048, 1408, dtype=torch.bfloat16)
    for name, (bm, bk, bn, stages, warps) in probe.DW_VARIANTS.items():
        d = TensorDescriptor(dw, list(dw.shape), [1408, 1], [bk, bn],
                             gl.NVMMASharedLayout.get_default_for([bk, bn], gl.bfloat16))
        sig = {"x_ptr": "*bf16", "g_ptr": "*bf16", "dw_desc": mangle_type(d), "offs_ptr": "*i32", "M": "i32",
               "K": "i32", "N": "i32", "E": "i32", "stride_xm": "i32", "stride_gm": "i32", "BM": "constexpr",
               "STAGES": "constexpr", "num_warps": "constexpr"}
        src = GluonASTSource(fn=probe._ws_grouped_dw_kernel, signature=sig,
                             constexprs={"BM": bm, "STAGES": stages, "num_warps": warps})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        ptx = k.asm["ptx"]
        # per-group descriptors made on the device: global scratch and the tensormap fence
        assert k.metadata.global_scratch_size > 0 and "fence.proxy.tensormap" in ptx, name
        results[name] = (warps, k.metadata.num_warps, k.metadata.shared, "setmaxnreg" in ptx,
                         f"wgmma.mma_async.sync.aligned.m64n{bn}k16" in ptx,
                         "cp.async.bulk.tensor.2d" in ptx, "mbarrier.try_wait" in ptx)
    print("RESULT", repr(results))
    """
)


def test_gluon_probe_builds_warp_specialized_for_sm90():
    results = compiled_script_results(_SCRIPT.replace("PROFILING", repr(PROFILING)))
    assert len(results) == 10, results
    for name, (warps, warps_run, shared, maxnreg, wgmma, tma_copies, waits) in results.items():
        # the consumers' warps (ping-pong: two groups of 4) plus one warp group for the load
        # partition's single warp
        assert warps_run == (8 if warps == "pp" else warps) + 4, (name, warps_run)
        assert maxnreg and wgmma and tma_copies and waits, (name, results[name])
        assert 0 < shared <= 232448, (name, shared)  # sm90's shared memory per block


def test_usage_with_unknown_arguments():
    proc = subprocess.run([sys.executable, "profiling/probe_gluon_gemm.py", "128x256x64s3,bogus"], text=True,
                          capture_output=True, cwd=os.path.dirname(PROFILING), timeout=120)
    assert proc.returncode != 0 and "usage" in proc.stderr
