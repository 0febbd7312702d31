"""Export: inference programs (`torch.export`, AOTInductor) and the compiled training graphs.

    python -m titan_moe.export --job.config_file configs/debug_cpu.toml --out exported

    state       the decode state as a flat tuple of tensors (names, shapes, empty state)
    wrappers    tensor-in/tensor-out modules around `Decoder`: Prefill, PackedPrefill, DecodeStep
    programs    export_programs, load_program, aoti_package, custom_ops_in
    graphs      dump_training_graphs: Dynamo / AOTAutograd / Inductor graphs of one step
    cli         the command line

Importing this package registers our custom ops, which loading a program needs.
"""

from titan_moe.export.graphs import RegionDump, dump_training_graphs
from titan_moe.export.programs import PROGRAMS, aoti_package, custom_ops_in, export_programs, load_program
from titan_moe.export.state import StateSpec, empty_state, state_from_caches, state_specs
from titan_moe.export.wrappers import DecodeStep, PackedPrefill, Prefill

__all__ = [
    "PROGRAMS",
    "DecodeStep",
    "PackedPrefill",
    "Prefill",
    "RegionDump",
    "StateSpec",
    "aoti_package",
    "custom_ops_in",
    "dump_training_graphs",
    "empty_state",
    "export_programs",
    "load_program",
    "state_from_caches",
    "state_specs",
]
