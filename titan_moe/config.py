"""Job configuration: torchtitan's JobConfig plus our sections, read from TOML and the CLI.

torchtitan 0.2.2's `ConfigManager` merges a custom config dataclass into its JobConfig
(`_merge_configs`), which we reuse. We do our own reading of the TOML file and of the
`--section.key value` overrides because torchtitan passes TOML values through unchecked
and reports CLI mistakes in a multi-line box; a user mistake here stops with one line that
names the key and the file.

Our additions:
  [model]  every `ModelArgs` field, optional: a value overrides the flavor's preset.
  [data]   tokenizer path, validation split fraction, data seed, Hugging Face text column.
  [balance] logging of the expert balance metrics.
  [quantize.linear.float8] min_features, next to torchtitan's float8 keys (titan_moe.float8).
  [kernels] which implementation each op runs (`titan_moe.ops.choices.KernelChoices`),
           resolved for the device when the model is built.
  [ladder] the context-length stages (`titan_moe.ladder`): `[[ladder.stages]]` tables in the
           TOML, `--ladder.stages.N.key value` (N from 1) on the command line.
torchtitan's own keys keep their meaning; `training.dataset` is one of "builtin", "text",
"hf_disk" and `training.dataset_path` points at the user's files for the last two.
"""

# No `from __future__ import annotations`: torchtitan's merge reads field types as objects.

import dataclasses
import difflib
import json
import os
import re
import sys
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass, make_dataclass
from typing import Any, Literal

from torchtitan.config import ConfigManager, JobConfig

from titan_moe.float8.config import QuantizeExtras  # also registers the float8 converters
from titan_moe.ladder import SYNTHETIC_TASKS, Ladder, apply_to_config as apply_ladder
from titan_moe.model.args import ModelArgs
from titan_moe.ops.choices import KernelChoices, check as check_kernel_choices


class ConfigError(ValueError):
    """A user mistake in a config file or on the command line; the message is one line."""


def _model_overrides_class() -> type:
    hints = typing.get_type_hints(ModelArgs)
    specs = [(f.name, hints[f.name] | None, field(default=None)) for f in fields(ModelArgs)]
    return make_dataclass("Model", specs)


@dataclass
class Data:
    tokenizer: str = ""
    """Path to a tokenizer.json (or a folder holding one); empty: the tokenizer shipped in the package."""

    val_fraction: float = 0.02
    """Fraction of the built-in corpus's documents held out for the eval loss."""

    seed: int = 0
    """Seed of the document shuffle (the data order)."""

    hf_text_column: str = "text"
    """Column holding the text when training.dataset = "hf_disk"."""

    long_documents: list[str] = field(default_factory=list)
    """Sources of long documents for ladder stages with long_fraction > 0: "packages" (each
    package of the Python standard library, its modules concatenated in import order) and/or
    "text" (each file at long_documents_path is one document). Split into train/val like the corpus."""

    long_documents_path: str = ""
    """File, folder or glob of long text files, for long_documents = ["text"]."""

    synthetic_tasks: list[str] = field(default_factory=lambda: ["passkey", "mqar"])
    """Synthetic whole-context tasks mixed in by a stage's synthetic_fraction (equal shares):
    "passkey" (a number hidden in filler text, asked for at the end) and "mqar" (key-value
    pairs spread over the context, every key asked for at the end) and "copy" (random words,
    then the same words again: the densest copying signal). Each is also evaluated."""


@dataclass
class Training:
    dataset: str = "builtin"
    """builtin (the Python standard library's sources), text (files at dataset_path) or
    hf_disk (a Hugging Face dataset saved with save_to_disk at dataset_path)."""

    exit_at_step: int = -1
    """Stop after this step (saving a full checkpoint when checkpointing is on), as a job whose
    time slot ends would; the LR schedule still follows training.steps. -1: run to the end."""

    cache_compute_weights: bool = True
    """Under autocast (one device with one_device_mixed_precision = "autocast", or DDP: fp32
    parameters, mixed_precision_param compute), cast the routed experts' weights to the compute
    dtype once per optimizer step instead of in every forward and activation-checkpoint
    recompute (the same values, so the same results; `RoutedExperts.refresh_compute_weights`).
    Costs a copy of those weights in the compute dtype. Nothing to do under FSDP (its
    all-gather casts) or without mixed precision."""

    one_device_mixed_precision: Literal["autocast", "fsdp"] = "autocast"
    """How a one-process run (world size 1) computes in mixed_precision_param. "autocast"
    (torchtitan's way without FSDP): parameters in training.dtype under torch.autocast, so the
    embedding output, the residual and AttnRes stream and their gradients stay in
    training.dtype (fp32); only matmuls and the like run in the compute dtype. "fsdp": FSDP2 over
    a one-rank mesh (`parallelize.apply_one_device_fsdp`), the numerics of a run on several
    GPUs: parameters cast to mixed_precision_param for compute, so activations and the stream
    are in that dtype too (half the stream's bytes with bf16), fp32 master weights and
    optimizer states, gradients reduced in mixed_precision_reduce; no autocast, and nothing for
    cache_compute_weights to do. Its costs: each FSDP unit's parameters are cast to the compute
    dtype in the forward and again in the backward (parallelism.fsdp_reshard_after_forward =
    "never" keeps the forward's casts instead, at their memory), every gradient is copied into
    an fp32 reduce buffer and accumulated from there, the optimizer and the norm clip see
    DTensor parameters, and the fp8 weight caches (the linears' and the experts'
    cache_weights) do not apply. Checkpoints resume across the two. No effect with more than
    one rank. The default is "autocast": at 8K x 4 compiled the two run at the same speed
    (BENCHMARKS.md), "fsdp" peaks lower (its bf16 stream), and "autocast" keeps the fp8 weight
    caches and the fp32 residual stream; choose "fsdp" for memory."""


@dataclass
class Checkpoint:
    last_save_model_only: bool = False
    """torchtitan defaults to a weights-only final save; we keep the final save resumable."""


@dataclass
class Metrics:
    log_all_ranks: bool = False
    """Under torchrun, every rank logs its info lines; default: rank 0 only (warnings and errors
    come from every rank)."""


@dataclass
class Profiling:
    nvtx: bool = False
    """Emit NVTX ranges (train step, forward, backward, optimizer, blocks, ops) for nsys."""

    nvtx_start_step: int = 0
    """On CUDA, call cudaProfilerStart before this step (nsys --capture-range=cudaProfilerApi
    records from here); 0: never."""

    nvtx_stop_step: int = 0
    """On CUDA, call cudaProfilerStop after this step (>= nvtx_start_step); 0: never (the
    capture then runs to the end of the process)."""


@dataclass
class Compile:
    passes: list[str] = field(default_factory=list)
    """Our FX passes (`titan_moe.compile_passes.PASSES`, e.g. ["router_fusion"]) run on every
    compiled region's graph before autograd; empty: none."""

    moe_regions: str = "auto"
    """How MoE layers are compiled: "auto" = one region per layer, piecewise around the
    experts under expert parallelism (where the all-to-all must stay eager); "piecewise" = always
    piecewise, with the experts eager (torchtitan 0.2.2's way for MoE blocks), to measure what
    the whole-layer region gains. Under context parallelism every layer is compiled piecewise
    around its attention; "auto" then makes the whole MoE one region (without EP)."""


@dataclass
class Parallelism:
    context_parallel_load_balancer: str | None = "headtail"
    """Under context parallelism, which MLA queries each rank computes (KDA's segments stay
    contiguous either way): "headtail" = its own first half-segment and its mirror rank's
    second one, equal causal work on rows of one long document, at the cost of moving half
    a segment's layer inputs and outputs between mirror ranks; none = its own segment's.
    torchtitan's other values do not apply (docs/parallelism.md)."""


@dataclass
class Validation:
    dataset: str = ""
    """Like training.dataset; empty: the held-out split of the training source."""


_Model = _model_overrides_class()


@dataclass
class TitanJobConfig:
    model: _Model = field(default_factory=_Model)  # type: ignore[valid-type]
    data: Data = field(default_factory=Data)
    training: Training = field(default_factory=Training)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    compile: Compile = field(default_factory=Compile)
    parallelism: Parallelism = field(default_factory=Parallelism)
    validation: Validation = field(default_factory=Validation)
    quantize: QuantizeExtras = field(default_factory=QuantizeExtras)
    kernels: KernelChoices = field(default_factory=KernelChoices)
    ladder: Ladder = field(default_factory=Ladder)


def job_config_class() -> type:
    """torchtitan's JobConfig with our sections merged in (torchtitan's own merge)."""
    return ConfigManager._merge_configs(JobConfig, TitanJobConfig)


# ---------------------------------------------------------------------------------------
# type checking and coercion of values


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, *, from_cli: bool) -> Any:
    """Return `value` converted to `tp`, or raise TypeError/ValueError with a short reason."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        # "none" on the command line is None, unless a literal option is spelled "none"
        # (`--model.attn_res none` is that mode, not "keep the flavor's value")
        literal_none = any(typing.get_origin(a) is Literal and "none" in typing.get_args(a) for a in args)
        if type(None) in args and (value is None or (from_cli and str(value).lower() == "none"
                                                     and not literal_none)):
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, from_cli=from_cli)
            except (TypeError, ValueError) as e:
                errors.append(str(e))
        raise ValueError(f"expected {' or '.join(_type_name(a) for a in args)}")
    if origin is Literal:
        for option in args:
            if value == option or (from_cli and str(value) == str(option)):
                return option
        raise ValueError(f"expected one of {list(args)}")
    if origin in (list, tuple):
        (inner, *_) = args or (Any,)
        if from_cli and isinstance(value, str):
            value = [v for v in value.split(",") if v != ""]
        if not isinstance(value, (list, tuple)):
            raise ValueError("expected a list")
        return [_coerce(v, inner, from_cli=from_cli) for v in value]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ValueError("expected a table")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_cli and str(value).lower() in ("true", "1", "yes"):
            return True
        if from_cli and str(value).lower() in ("false", "0", "no"):
            return False
        raise ValueError("expected true or false")
    if tp is int:
        if isinstance(value, bool):
            raise ValueError("expected an integer")
        if isinstance(value, int):
            return value
        if from_cli:
            return int(str(value))
        raise ValueError("expected an integer")
    if tp is float:
        if isinstance(value, bool):
            raise ValueError("expected a number")
        if isinstance(value, (int, float)):
            return float(value)
        if from_cli:
            return float(str(value))
        raise ValueError("expected a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ValueError("expected a string")
    return value


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unknown_key_message(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key.split(".")[-1], [k.split(".")[-1] for k in known], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown key {key!r}{hint}"


def _check_table(table: dict[str, Any], cls: type, prefix: str, where: str) -> dict[str, Any]:
    """Check a TOML table against dataclass `cls`; return it with values coerced."""
    hints = _field_types(cls)
    out: dict[str, Any] = {}
    for key, value in table.items():
        dotted = f"{prefix}{key}"
        if key not in hints:
            raise ConfigError(f"{where}: {_unknown_key_message(dotted, [prefix + k for k in hints])}")
        tp = hints[key]
        if is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: [{dotted}] must be a table, got {value!r}")
            out[key] = _check_table(value, tp, dotted + ".", where)
            continue
        item = _table_list_item(tp)
        if item is not None:  # [[section.key]] tables: kept as checked dicts, built after the CLI
            if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
                raise ConfigError(f"{where}: {dotted} must be a list of tables ([[{dotted}]]), got {value!r}")
            out[key] = [_check_table(v, item, f"{dotted}.{n + 1}.", where) for n, v in enumerate(value)]
            continue
        try:
            out[key] = _coerce(value, tp, from_cli=False)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where}: bad value for {dotted} = {value!r}: {e}") from None
    return out


def _table_list_item(tp: Any) -> type | None:
    """The dataclass of a `list[SomeDataclass]` field (a TOML array of tables), else None."""
    if typing.get_origin(tp) is list:
        (inner, *_) = typing.get_args(tp) or (None,)
        if is_dataclass(inner):
            return inner
    return None


def _resolve_cli_key(cls: type, dotted: str) -> tuple[list[str], Any, bool]:
    """Map 'section.key' (hyphens allowed, 'no_' prefix for booleans) to a path and type.

    An array of tables is indexed from 1: `ladder.stages.2.seq_len` is the second stage's key
    (the path holds the 0-based int 1)."""
    parts = dotted.replace("-", "_").split(".")
    path: list[Any] = []
    current = cls
    for i, part in enumerate(parts):
        item = _table_list_item(current)
        if item is not None:
            if not part.isdigit() or int(part) < 1:
                raise ConfigError(f"command line: --{'.'.join(map(str, _shown(path)))}.N.KEY needs a stage "
                                  f"number N >= 1, got {part!r}")
            path.append(int(part) - 1)
            current = item
            continue
        hints = _field_types(current)
        negate = False
        if part not in hints and part.startswith("no_") and part[3:] in hints and i == len(parts) - 1:
            part, negate = part[3:], True
        if part not in hints:
            known = [".".join(map(str, _shown(path) + [k])) for k in hints]
            raise ConfigError(f"command line: {_unknown_key_message('.'.join(parts), known)}")
        path.append(part)
        current = hints[part]
        if i < len(parts) - 1 and not is_dataclass(current) and _table_list_item(current) is None:
            raise ConfigError(f"command line: {'.'.join(map(str, _shown(path)))} is not a section")
    if is_dataclass(current) or _table_list_item(current) is not None:
        raise ConfigError(f"command line: --{'.'.join(map(str, _shown(path)))} is a section, not a key")
    return path, current, negate


def _shown(path: list[Any]) -> list[Any]:
    """A key path as the user writes it (list indices from 1)."""
    return [p + 1 if isinstance(p, int) else p for p in path]


def _parse_cli(argv: list[str], cls: type) -> list[tuple[list[str], Any]]:
    """Parse `--section.key value`, `--section.key=value` and boolean flags."""
    overrides = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"command line: unexpected argument {arg!r} (options look like --section.key value)")
        name, eq, raw = arg[2:].partition("=")
        path, tp, negate = _resolve_cli_key(cls, name)
        is_bool = tp is bool
        if eq:
            i += 1
        elif is_bool and (i + 1 >= len(argv) or argv[i + 1].startswith("--")
                          or argv[i + 1].lower() not in ("true", "false", "1", "0", "yes", "no")):
            raw = "true"
            i += 1
        elif i + 1 < len(argv):
            raw = argv[i + 1]
            i += 2
        else:
            raise ConfigError(f"command line: --{name} needs a value")
        try:
            value = _coerce(raw, tp, from_cli=True)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"command line: bad value for --{'.'.join(map(str, _shown(path)))} {raw!r}: {e}") from None
        if negate:
            value = not value
        overrides.append((path, value))
    return overrides


def _set_override(data: dict[str, Any], key_path: list[Any], value: Any) -> str:
    """Put a command-line value into the checked TOML data; returns the dotted key."""
    table: Any = data
    for n, part in enumerate(key_path[:-1]):
        if isinstance(part, int):
            dotted = ".".join(map(str, _shown(key_path[:n])))
            if part >= len(table):
                raise ConfigError(f"command line: --{'.'.join(map(str, _shown(key_path)))}: the config has "
                                  f"{len(table)} {dotted} entries (numbered from 1)")
            table = table[part]
        else:
            table = table.setdefault(part, [] if _is_list_next(key_path, n) else {})
    table[key_path[-1]] = value
    return ".".join(map(str, _shown(key_path)))


def _is_list_next(key_path: list[Any], n: int) -> bool:
    return n + 1 < len(key_path) and isinstance(key_path[n + 1], int)


def _build_table_lists(cls: type, data: dict[str, Any]) -> None:
    """Turn checked [[...]] tables (lists of dicts) into their dataclasses, in place."""
    hints = _field_types(cls)
    for key, value in data.items():
        tp = hints.get(key)
        if tp is None:
            continue
        if is_dataclass(tp) and isinstance(value, dict):
            _build_table_lists(tp, value)
        item = _table_list_item(tp)
        if item is not None:
            data[key] = [item(**v) for v in value]


def _config_file_arg(argv: list[str]) -> tuple[str | None, list[str]]:
    rest: list[str] = []
    path = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        key, eq, value = arg.partition("=")
        if key in ("--job.config_file", "--job.config-file"):
            if eq:
                path = value
                i += 1
            elif i + 1 < len(argv):
                path = argv[i + 1]
                i += 2
            else:
                raise ConfigError("command line: --job.config_file needs a path")
            continue
        rest.append(arg)
        i += 1
    return path, rest


def _print_help(cls: type) -> None:
    print("usage: python -m titan_moe.train --job.config_file FILE.toml [--section.key value ...]\n")
    hints = _field_types(cls)
    for section, sub in hints.items():
        if not is_dataclass(sub):
            continue
        print(f"[{section}]")
        defaults = sub()
        for key, tp in _field_types(sub).items():
            if is_dataclass(tp):
                continue
            print(f"  {key} = {getattr(defaults, key)!r}  ({_type_name(tp)})")


def load_config(argv: list[str] | None = None) -> JobConfig:
    """Build the JobConfig from `--job.config_file FILE` and `--section.key value` overrides.

    Precedence: command line > TOML file > defaults. Raises ConfigError (one line, naming the
    key and the file) for a missing or unreadable file, an unknown key or a bad value.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    cls = job_config_class()
    if "--help" in argv or "-h" in argv:
        _print_help(cls)
        raise SystemExit(0)
    path, rest = _config_file_arg(argv)
    data: dict[str, Any] = {}
    if path is None:
        raise ConfigError("no config file: pass --job.config_file FILE.toml (configs/debug_cpu.toml trains on "
                          "the CPU; --help lists every key)")
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"config file not found: {path}")
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
        data = _check_table(raw, cls, "", path)
    cli: dict[str, Any] = {}
    for key_path, value in _parse_cli(rest, cls):
        cli[_set_override(data, key_path, value)] = value
    set_keys = {f"{section}.{key}" for section, table in data.items() if isinstance(table, dict) for key in table}
    data.setdefault("job", {})["config_file"] = path
    try:
        _build_table_lists(cls, data)
        config = ConfigManager(cls)._dict_to_dataclass(cls, data)
    except (AssertionError, ValueError, TypeError) as e:
        raise ConfigError(f"{_source_of(str(e), path, cli)}: {e}") from None
    config._cli_settings = cli
    try:
        _check_compile_with_ac(model_args_from_config(config), config)
        _check_compile_passes(config.compile.passes)
        check_kernel_choices(config.kernels)
        _check_data_mix(config.data)
        apply_ladder(config, set_keys)
        if config.compile.moe_regions not in ("auto", "piecewise"):
            raise ValueError(f"compile.moe_regions must be 'auto' or 'piecewise', got {config.compile.moe_regions!r}")
        _check_moe_token_tile(model_args_from_config(config), config)
    except ValueError as e:
        raise ConfigError(f"{error_source(config, str(e))}: {e}") from None
    return config


def _source_of(message: str, path: str | None, cli: dict[str, Any]) -> str:
    """Where the setting a message complains about came from: "command line" when the
    message names a key given there (`section.key`) or quotes its text value (a path), else
    the config file."""
    named = any(re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", message) for key in cli)
    quoted = any(isinstance(v, str) and len(v) >= 3 and repr(v) in message for v in cli.values())
    return "command line" if path is None or named or quoted else path


def error_source(config: Any, message: str) -> str:
    """For an error found after loading (`message` names the key): "command line" or the
    config file, whichever set that key."""
    return _source_of(message, config.job.config_file, getattr(config, "_cli_settings", {}))


def run_json_cli(prog: str, run: Any, argv: list[str] | None = None) -> None:
    """Call `run(argv)` and print its summary as one JSON line; a ConfigError becomes one
    `prog: error: ...` line on stderr and exit code 2 (the tools' shared convention)."""
    try:
        summary = run(argv)
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps(summary))


def _check_compile_with_ac(args: ModelArgs, config: Any) -> None:
    """What Dynamo cannot trace inside a compiled, checkpointed layer, as a config error:
    exact QB (`qb_bins = 0`) keeps each microbatch's router scores as a plain module attribute
    ("HOP: Unsafe side effect"; the histogram mode only adds into buffers, which compiles).
    Under context parallelism no layer is compiled whole (`parallelize.apply_compile`): the
    checkpoint runs eagerly around the regions, and exact QB compiles."""
    compiled = config.compile.enable and "model" in config.compile.components
    checkpointed = config.activation_checkpoint.mode != "none"
    exact_qb = args.balance_rule == "qb" and args.qb_bins == 0 and args.top_k < args.n_routed_experts
    piecewise = config.parallelism.context_parallel_degree > 1
    if compiled and checkpointed and exact_qb and not piecewise:
        raise ValueError(
            "model.qb_bins = 0 (exact QB) cannot be compiled with activation checkpointing; "
            "set model.qb_bins > 0 (SPEC: 1000), activation_checkpoint.mode = 'none' or compile.enable = false"
        )


def _check_moe_token_tile(args: ModelArgs, config: Any) -> None:
    """`model.moe_token_tile` runs each tile's experts inside the MoE's own forward: not with
    expert parallelism (whose exchange hooks and expert FSDP unit would run once per tile) nor
    with the piecewise MoE regions that EP compiles (`titan_moe.parallelize.apply_compile`)."""
    if not args.moe_token_tile:
        return
    if config.parallelism.expert_parallel_degree > 1:
        raise ValueError(f"model.moe_token_tile = {args.moe_token_tile} does not work with expert parallelism "
                         f"(parallelism.expert_parallel_degree = {config.parallelism.expert_parallel_degree}); "
                         "set model.moe_token_tile = 0")
    if config.compile.moe_regions == "piecewise":
        raise ValueError(f"model.moe_token_tile = {args.moe_token_tile} needs whole-layer compile regions; "
                         "set compile.moe_regions = 'auto' or model.moe_token_tile = 0")


def _check_data_mix(data: Any) -> None:
    unknown = [t for t in data.synthetic_tasks if t not in SYNTHETIC_TASKS]
    if unknown:
        raise ValueError(f"data.synthetic_tasks: unknown task {unknown[0]!r}; known: {list(SYNTHETIC_TASKS)}")
    bad = [s for s in data.long_documents if s not in ("packages", "text")]
    if bad:
        raise ValueError(f"data.long_documents: unknown source {bad[0]!r}; known: ['packages', 'text']")
    if "text" in data.long_documents and not data.long_documents_path:
        raise ValueError("data.long_documents includes 'text' but data.long_documents_path is empty")


def _check_compile_passes(passes: list[str]) -> None:
    from titan_moe.compile_passes import PASSES

    unknown = [p for p in passes if p not in PASSES]
    if unknown:
        raise ValueError(f"compile.passes: unknown pass {unknown[0]!r}; known: {sorted(PASSES)}")


# ---------------------------------------------------------------------------------------
# model settings


def model_overrides(job_config: Any) -> dict[str, Any]:
    """The `[model]` ModelArgs fields that the config sets (not None)."""
    names = {f.name for f in fields(ModelArgs)}
    return {k: v for k, v in dataclasses.asdict(job_config.model).items() if k in names and v is not None}


def model_args_from_config(job_config: Any) -> ModelArgs:
    """The flavor's preset with the config's `[model]` overrides applied (validated)."""
    from titan_moe.flavors import FLAVORS

    flavor = job_config.model.flavor
    if flavor not in FLAVORS:
        raise ValueError(f"model.flavor {flavor!r} is not one of {sorted(FLAVORS)}")
    return dataclasses.replace(FLAVORS[flavor], **model_overrides(job_config))
