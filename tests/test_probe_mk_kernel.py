"""profiling/probe_mk_kernel.py: its warp-specialization probe kernel builds for sm90 on the CPU,
warp-specialized (12 warps, register reallocation) exactly when asked for."""

import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(
    """
    import sys, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sys.path.insert(0, "profiling")
    import probe_mk_kernel as probe

    bm, bn, bk = 128, 256, 64
    sig = {"a_desc": f"tensordesc<bf16[{bm},{bk}]>", "b_desc": f"tensordesc<bf16[1,{bk},{bn}]>", "c_ptr": "*bf16",
           "offs_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "E": "i32",
           "BM": "constexpr", "BN": "constexpr", "BK": "constexpr", "WS": "constexpr"}
    for ws, warps in ((0, 8), (1, 4), (2, 4), (1, 8)):
        k = triton.compile(ASTSource(fn=probe._ws_probe_kernel, signature=sig,
                                     constexprs={"BM": bm, "BN": bn, "BK": bk, "WS": ws}),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 3})
        print("RESULT", ws, warps, k.metadata.num_warps, "setmaxnreg" in k.asm["ptx"])
    """
)


def test_ws_probe_kernel_is_warp_specialized_only_at_four_warps():
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("Triton's NVIDIA backend is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    # (WS, warps asked) -> (warps run, register reallocation): the pass acts only at 4 warps
    assert results == [["0", "8", "8", "False"], ["1", "4", "12", "True"], ["2", "4", "12", "True"],
                       ["1", "8", "8", "False"]]


def test_usage_without_a_mode():
    proc = subprocess.run([sys.executable, "profiling/probe_mk_kernel.py"], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=120)
    assert proc.returncode != 0 and "usage" in proc.stderr


def test_probe_config_reads_tile_and_program_count():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "profiling"))
    import probe_mk_kernel as probe

    from titan_moe.ops.grouped_gemm.triton_kernel import parse_tile

    assert probe.probe_config("", 1408) is None
    assert probe.probe_config("256x128x64x8x3t", 1408) == parse_tile("256x128x64x8x3t", "mk")
    cfg = probe.probe_config("128x256x64x8x3t@96", 1408)
    assert (cfg.block_m, cfg.block_n, cfg.num_programs) == (128, 256, 96)
    assert probe.probe_config("@128", 1408).num_programs == 128  # the default tile (CPU: the interpreter's)
