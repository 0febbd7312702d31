"""Building Gluon grouped GEMM kernels for sm90 on the CPU (Gluon has no interpreter), for the
tests of the op's "gluon" backend: `build_results` compiles named kernels in a fresh process
and returns, per build, what `check_builds` asserts."""

import textwrap

from triton_mode import compiled_script_results

_SCRIPT = textwrap.dedent(
    """
    import pathlib, subprocess, sys, tempfile, torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type
    from titan_moe.ops.grouped_gemm import gluon_kernel as gk

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
    for name, product in MM_BUILDS:  # dx: dy [M, N] @ w^T, w transposed, the output K wide
        bm, bn, bk, stages = gk.MM_TILES[name]
        a, b, c, transposed = (gk.mm_descriptors(x, w, out, bm, bn, bk) if product == "fwd" else
                               gk.mm_descriptors(out, w.transpose(1, 2), dx, bm, bn, bk))
        assert transposed == (product == "dx")
        sig = {"a_desc": mangle_type(a), "b_desc": mangle_type(b), "c_desc": mangle_type(c), "c_ptr": "*bf16",
               "offs_ptr": "*i32", "M": "i32", "N": "i32", "E": "i32", "K": "i32", "stride_cm": "i32"}
        consts = {"STAGES": stages, "BLOCK_E": 128, "B_TRANSPOSED": transposed}
        # the ping-pong kernel: two 4-warp consumers and the load warp's group
        consts = dict(consts, num_warps=4, CONSUMER_REGS=gk.PINGPONG_CONSUMER_REGS, DIRECT=gk.tile_flags(name)[0])
        results[name + "_" + product] = (12, "ws") + build(gk._pingpong_grouped_mm_kernel, sig, consts, bn)
    dw = torch.empty(8 * 2048, 1408, dtype=torch.bfloat16)
    for name in DW_BUILDS:
        bm, bk, bn, stages, warps = gk.DW_TILES[name]
        d = gk._descriptor(dw, [bk, bn])
        xd, gd = gk._descriptor(x, [bm, bk]), gk._descriptor(out, [bm, bn])
        sig = {"x_desc": mangle_type(xd), "g_desc": mangle_type(gd), "x_ptr": "*bf16", "g_ptr": "*bf16",
               "dw_desc": mangle_type(d), "offs_ptr": "*i32", "M": "i32", "K": "i32", "N": "i32", "E": "i32",
               "stride_xm": "i32", "stride_gm": "i32"}
        direct, host_descs = gk.tile_flags(name)
        if warps == "pp":
            kernel, expected_warps = gk._pingpong_grouped_dw_kernel, 12
            consts = {"BM": bm, "STAGES": stages, "CONSUMER_REGS": gk.PINGPONG_CONSUMER_REGS,
                      "HOST_DESCS": host_descs, "num_warps": 4}
        else:
            kernel, expected_warps = gk._ws_grouped_dw_kernel, warps + 4
            sig = {n: ("*bf16" if n == "dw_ptr" else sig[n]) for n in gk._ws_grouped_dw_kernel.arg_names
                   if n in sig or n == "dw_ptr"}
            consts = {"BM": bm, "STAGES": stages, "DIRECT": direct,
                      "HOST_DESCS": host_descs, "num_warps": warps}
        results[name] = (expected_warps, "dw") + build(kernel, sig, consts, bn)
    print("RESULT", repr(results))
    """
)


def build_results(mm_builds: list, dw_builds: list) -> dict:
    """sm90 builds of forward / dx kernels ``mm_builds`` ((name of MM_TILES, "fwd" or "dx")
    pairs) and dw kernels ``dw_builds`` (names of DW_TILES): per build (its expected warps,
    its kind: "ws" or "dw", then the compiled warps, shared bytes, spilled bytes (-1:
    unknown), setmaxnreg, wgmma at the tile width, TMA copies, mbarrier waits, device-made
    descriptors)."""
    script = _SCRIPT.replace("MM_BUILDS", repr(mm_builds)).replace("DW_BUILDS", repr(dw_builds))
    return compiled_script_results(script)


def check_builds(results: dict) -> None:
    """Each build has the warps its partitions state, setmaxnreg exactly where there are
    partitions, wgmma / TMA copies / mbarrier waits, sm90's shared memory, no spills, and
    device-made descriptors exactly in the dw kernels."""
    for name, (expected_warps, kind, warps, shared, stack, maxnreg, wgmma, tma, waits, device_descs) in results.items():
        assert warps == expected_warps, (name, warps)
        assert maxnreg, (name, maxnreg)
        assert wgmma and tma and waits, (name, results[name])
        assert 0 < shared <= 232448, (name, shared)  # sm90's shared memory per block
        assert stack in (0, -1), (name, stack)  # no spills (-1: no cuobjdump to read them)
        assert device_descs == (kind == "dw"), (name, device_descs)
