"""profiling/probe_mk_kernel.py: its tile specs and its usage line."""

import os
import subprocess
import sys


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
