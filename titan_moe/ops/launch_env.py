"""The one module that reads `TITAN_MOE_*` environment variables.

Environment variables are for launch tuning and debugging only: kernel tiles, warps, register
caps, debug checks, test hooks. None of them changes which path the model runs or what it
computes on the CPU; behaviour choices are config keys (`titan_moe.ops.choices`).

Every variable is listed in `VARIABLES` (name -> what it tunes); docs/environment.md is the
table for users. Reading a name that is not listed is a programming error.
"""

from __future__ import annotations

import os

VARIABLES: dict[str, str] = {
    "TITAN_MOE_KILL_DURING_SAVE_STEP": "test hook: SIGKILL the trainer while it writes this step's checkpoint",
    # grouped GEMM and fp8 GEMM launches (GPU only; same products, other tiles or load forms)
    "TITAN_MOE_GROUPED_MM_TILES": "tuning: GPU tiles of the Triton grouped-GEMM kernels, 'KIND=SPEC,...' with KIND "
                                  "mk (forward/dx), k (dw), mk8, k8 (fp8) and SPEC BMxBNxBKxWARPSxSTAGES[...] "
                                  "(titan_moe.ops.grouped_gemm.triton_kernel.parse_tile)",
    "TITAN_MOE_GLUON_GEMM_TILES": "tuning: tile names 'FWD,DX,DW' of the Gluon grouped-GEMM kernels (an empty entry "
                                  "keeps the default; titan_moe.ops.grouped_gemm.gluon_kernel.tiles)",
    "TITAN_MOE_GROUPED_MM_TMA": "tuning: '0' loads the Triton forward/dx kernels' operands with pointer loads "
                                "instead of TMA descriptors on sm90",
    "TITAN_MOE_GROUPED_MM_DW_TMA": "tuning: the Triton dw kernels' load form: '0' pointer loads, '1' host TMA "
                                   "descriptors, 'group' per-group descriptors made in the kernel",
    "TITAN_MOE_FP8_CHECK_OFFSETS": "debug: '1' adds a device-side assert that the fp8 grouped GEMM's group ends are "
                                   "multiples of 16 on CUDA (always checked on the CPU)",
    "TITAN_MOE_LOG_TRITON_COMPILES": "debug: '1' logs every compile of one of our Triton kernels (name, launch "
                                      "options, argument specializations) with the trainer step it happens in",
    "TITAN_MOE_DEBUG": "debug: '1' checks input contracts outside compiled code at the cost of a host sync "
                       "(chunk_kda: the gate lies in [lower_bound, 0])",
    # KDA kernel launches (GPU only; same results, other launch configurations)
    "TITAN_MOE_KDA_SCAN_BV": "tuning: state columns per program of the KDA state walks, 16/32/64/128 "
                             "(titan_moe.ops.kda.triton_fwd.sequential_scan_config)",
    "TITAN_MOE_KDA_SCAN_WARPS": "tuning: warps per program of the KDA state walks, a power of two <= 16",
    "TITAN_MOE_KDA_SCAN_STAGES": "tuning: 'FWDxBWD' software-pipeline stages of the KDA state walks, 1-4 each",
    "TITAN_MOE_KDA_SCAN_SEGMENT": "tuning: chunks per segment of the KDA segment scan (titan_moe.ops.kda.triton_scan)",
    "TITAN_MOE_KDA_OUTPUT": "tuning: 'BVxWARPS' of the KDA forward's output kernel",
    "TITAN_MOE_KDA_INTRA": "tuning: 'BKxWARPS' of the KDA forward's A-tile kernel (titan_moe.ops.kda.triton_fwd.intra_config)",
    "TITAN_MOE_KDA_INTRA_MAXNREG": "tuning: register cap of the KDA forward's A-tile kernel (0: none; default 96)",
    "TITAN_MOE_KDA_TILE_WARPS": "tuning: 'INVERSExWYxBWD_INTRA' warps of the KDA per-tile kernels (default 1x4x4)",
    "TITAN_MOE_KDA_BWD_CHUNK": "tuning: 'BKxBVxKEYS_WARPSxVALUES_WARPS' of the KDA backward's whole-chunk kernels "
                               "(default 64x64x8x8)",
    "TITAN_MOE_KDA_BWD_MAXNREG": "tuning: 'KEYSxVALUES' register caps of the KDA backward's whole-chunk kernels "
                                 "(0: none; default 128x128)",
    "TITAN_MOE_KDA_BWD_INTRA_BK": "tuning: key columns per program of the KDA backward's intra kernel, 16/32/64/128",
    "TITAN_MOE_KDA_BWD_INTRA_MAXNREG": "tuning: register cap of the KDA backward's intra kernel (0: none; default 96)",
    "TITAN_MOE_KDA_PREPARE_CHUNK_WARPS": "tuning: warps of the KDA input maps' backward kernel in chunk mode "
                                         "(default 8)",
}


def read(name: str) -> str | None:
    """The value of `$name` (None when unset or empty); `name` must be listed in VARIABLES."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not a listed TITAN_MOE_* variable (titan_moe.ops.launch_env.VARIABLES)")
    return os.environ.get(name) or None
