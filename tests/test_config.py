"""Config loading: TOML + CLI precedence, and one clear line for each kind of user mistake."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tiny import environment, start_all, started_runs
from titan_moe.config import ConfigError, load_config, model_args_from_config

REPO = Path(__file__).resolve().parents[1]
DEBUG_TOML = str(REPO / "configs" / "debug_cpu.toml")


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_toml_then_cli_precedence():
    cfg = load_config(["--job.config_file", DEBUG_TOML, "--training.steps", "7", "--model.dim=96",
                       "--checkpoint.enable"])
    assert cfg.training.steps == 7
    assert cfg.training.seq_len == 256  # from the TOML
    assert cfg.checkpoint.enable is True
    args = model_args_from_config(cfg)
    assert args.dim == 96  # CLI override of one model field
    assert args.n_layers == 4  # the debug flavor's preset


@pytest.mark.parametrize("mode", ["none", "full", "block"])
def test_cli_literal_named_none_is_that_option(mode):
    # model keys are optional (None keeps the flavor's value), but "none" is also one of
    # attn_res's modes: the mode wins, from the command line as from the TOML
    cfg = load_config(["--job.config_file", DEBUG_TOML, "--model.attn_res", mode])
    assert model_args_from_config(cfg).attn_res == mode


def test_unknown_toml_key_names_key_and_file(tmp_path):
    path = _write(tmp_path, "[training]\nstepz = 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(["--job.config_file", path])
    msg = str(e.value)
    assert path in msg and "training.stepz" in msg and "steps" in msg  # suggests the close match
    assert "\n" not in msg


def test_unknown_section(tmp_path):
    path = _write(tmp_path, "[trainingz]\nsteps = 3\n")
    with pytest.raises(ConfigError, match="trainingz"):
        load_config(["--job.config_file", path])


@pytest.mark.parametrize(
    "toml, key",
    [
        ('[training]\nsteps = "ten"\n', "training.steps"),
        ("[checkpoint]\nenable = 3\n", "checkpoint.enable"),
        ('[training]\ndtype = "float13"\n', "training.dtype"),
        ('[model]\nmla_layers = ["a"]\n', "model.mla_layers"),
    ],
)
def test_bad_toml_value_names_key_and_file(tmp_path, toml, key):
    path = _write(tmp_path, toml)
    with pytest.raises(ConfigError) as e:
        load_config(["--job.config_file", path])
    assert key in str(e.value) and path in str(e.value)


def test_bad_model_value_is_reported_with_file(tmp_path):
    path = _write(tmp_path, '[model]\nname = "titan_moe"\nflavor = "debug"\nkda_g_min = -7.0\n')
    with pytest.raises(ConfigError, match=r"kda_g_min.*\[-5, 0\)"):
        load_config(["--job.config_file", path])


def test_bad_cli_key_and_value():
    with pytest.raises(ConfigError, match="training.stepz"):
        load_config(["--job.config_file", DEBUG_TOML, "--training.stepz", "3"])
    with pytest.raises(ConfigError, match="--training.steps 'abc'"):
        load_config(["--job.config_file", DEBUG_TOML, "--training.steps", "abc"])


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(["--job.config_file", str(tmp_path / "nope.toml")])


def test_invalid_toml_syntax(tmp_path):
    path = _write(tmp_path, "[training\nsteps = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(["--job.config_file", path])


def _run_train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "titan_moe.train", *args], capture_output=True, text=True,
                          cwd=REPO, env=environment(), timeout=300)


CLI_ERRORS = [
    (["--job.config_file", "configs/nope.toml"], "config file not found: configs/nope.toml"),
    (["--job.config_file", DEBUG_TOML, "--training.stepz", "3"], "training.stepz"),
    (["--job.config_file", DEBUG_TOML, "--training.steps", "x"], "training.steps"),
    (["--job.config_file", DEBUG_TOML, "--data.tokenizer", "/nonexistent/tok.json"], "/nonexistent/tok.json"),
]


def start_runs(root):
    """Queue the trainer processes of the command-line tests below (tests/tiny.py), two at a
    time: command-line arguments (a tuple) -> future of the CompletedProcess."""
    return start_all({tuple(args): lambda args=args: _run_train(*args) for args in
                      [*(args for args, _ in CLI_ERRORS), ["--help"]]})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return started_runs(start_runs, tmp_path_factory)


@pytest.mark.parametrize("args, needle", CLI_ERRORS)
def test_cli_errors_exit_nonzero_with_one_line(args, needle, runs):
    proc = runs[tuple(args)].result()
    assert proc.returncode == 2, proc.stderr[-2000:]
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("titan_moe.train: error:")]
    assert len(error_lines) == 1 and needle in error_lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.toml")),
                         ids=lambda p: p.name)
def test_every_shipped_config_loads_and_builds_on_meta(path):
    """Each file in configs/ passes the checker, and its model builds on the meta device
    with the matmul share of its training FLOPs that `titan_moe.inspect` reports."""
    from titan_moe.inspect import inspect_model

    summary = inspect_model(["--job.config_file", str(path)])
    assert summary["total_params"] > summary["active_params"] > 0
    # At 64K tokens a row and beyond (the ladders' last stages), attention's T^2 FLOPs may
    # outweigh the matmuls of a narrow model: 0.19 for ladder_1gpu at 128K.
    long_rows = load_config(["--job.config_file", str(path)]).training.seq_len >= 65536
    assert (0.0 if long_rows else 0.5) < summary["matmul_flops_share"] < 1.0


def test_exact_qb_with_compile_and_checkpointing_is_refused(tmp_path):
    """Exact QB stores scores as a module attribute, which a compiled checkpointed layer
    cannot set; the histogram mode compiles (tests/test_compile.py)."""
    path = _write(tmp_path, '[model]\nname = "titan_moe"\nflavor = "debug"\n')
    compiled_ac = ["--compile.enable", "--activation_checkpoint.mode", "full"]
    with pytest.raises(ConfigError, match=r"qb_bins = 0 .*activation checkpointing"):
        load_config(["--job.config_file", path, *compiled_ac])
    assert load_config(["--job.config_file", path, *compiled_ac, "--model.qb_bins", "100"]).model.qb_bins == 100
    assert load_config(["--job.config_file", path, "--compile.enable", "--activation_checkpoint.mode", "none"])


def test_mla_attention_is_a_model_key(tmp_path):
    """The MLA attention path is chosen in the config (validated like any model key); varlen
    with compile and activation checkpointing is accepted (its cu_seqlens are built outside
    the checkpointed layers)."""
    path = _write(tmp_path, '[model]\nname = "titan_moe"\nflavor = "debug"\nqb_bins = 100\nmla_attention = "varlen"\n')
    config = load_config(["--job.config_file", path, "--compile.enable", "--activation_checkpoint.mode", "selective"])
    assert config.model.mla_attention == "varlen"
    assert load_config(["--job.config_file", path, "--model.mla_attention", "dense"]).model.mla_attention == "dense"
    with pytest.raises(ConfigError, match="mla_attention"):
        load_config(["--job.config_file", path, "--model.mla_attention", "ring"])


def test_local_batch_fits_the_global_batch_over_data_parallel_ranks(tmp_path, monkeypatch):
    from titan_moe.train import _fit_local_batch_to_global

    path = _write(tmp_path, '[model]\nname = "titan_moe"\nflavor = "debug"\n[training]\nlocal_batch_size = 4\n'
                            'global_batch_size = 4\n[validation]\nlocal_batch_size = 2\n')
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = load_config(["--job.config_file", path])
    _fit_local_batch_to_global(config)
    assert (config.training.local_batch_size, config.validation.local_batch_size) == (2, 1)
    monkeypatch.setenv("WORLD_SIZE", "4")
    config = load_config(["--job.config_file", path])
    with pytest.raises(ConfigError, match=r"validation.local_batch_size .* = 2 is not divisible by the 4"):
        _fit_local_batch_to_global(config)


def test_fake_backend_simulates_the_world_size_of_ngpu(tmp_path, monkeypatch):
    """`--comm.mode fake_backend` is one process playing rank 0 of `NGPU` ranks (torchtitan's
    variable): the batch fits those ranks; a missing `NGPU` and the "local_tensor" mode stop
    with one line."""
    from titan_moe.train import _fit_local_batch_to_global

    path = _write(tmp_path, '[model]\nname = "titan_moe"\nflavor = "debug"\n[training]\nlocal_batch_size = 4\n'
                            'global_batch_size = 4\n')
    fake = ["--job.config_file", path, "--comm.mode", "fake_backend"]
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("NGPU", "4")
    config = load_config([*fake, "--parallelism.context_parallel_degree", "2"])
    _fit_local_batch_to_global(config)
    assert config.training.local_batch_size == 2  # 4 ranks, cp 2: 2 data-parallel ranks
    monkeypatch.delenv("NGPU")
    with pytest.raises(ConfigError, match="comm.mode = 'fake_backend' needs NGPU=N"):
        _fit_local_batch_to_global(load_config(fake))
    with pytest.raises(ConfigError, match="comm.mode = 'local_tensor' is not supported"):
        _fit_local_batch_to_global(load_config(["--job.config_file", path, "--comm.mode", "local_tensor"]))


# ---------------------------------------------------------------------------------------
# [kernels]: which implementation each op runs (titan_moe.ops.choices)


def test_kernels_section_from_toml_and_cli(tmp_path):
    from titan_moe.ops.choices import KernelChoices

    assert load_config(["--job.config_file", DEBUG_TOML]).kernels == KernelChoices()  # the defaults
    path = _write(tmp_path, '[model]\nflavor = "debug"\n[kernels]\nsitu = "torch"\ngrouped_mm = "fwd=triton,dw=loop"\n')
    cfg = load_config(["--job.config_file", path, "--kernels.dispatch", "torch", "--kernels.situ", "triton"])
    assert (cfg.kernels.situ, cfg.kernels.dispatch, cfg.kernels.grouped_mm) == ("triton", "torch", "fwd=triton,dw=loop")


@pytest.mark.parametrize("toml, needle", [
    ('[kernels]\nsitu = "cuda"\n', "kernels.situ"),
    ('[kernels]\ngrouped_mm = "cutlass"\n', "kernels.grouped_mm"),
    ('[kernels]\ngrouped_mm = "fwd=triton,dgrad=loop"\n', "kernels.grouped_mm"),
    ('[kernels]\nrouter = "torch"\n', "kernels.router"),
])
def test_bad_kernels_value_is_one_config_error_line(tmp_path, toml, needle):
    path = _write(tmp_path, '[model]\nflavor = "debug"\n' + toml)
    with pytest.raises(ConfigError, match=needle) as err:
        load_config(["--job.config_file", path])
    assert "\n" not in str(err.value) and path in str(err.value)


def test_help_lists_the_kernels_section(runs):
    proc = runs[("--help",)].result()
    assert proc.returncode == 0
    section = proc.stdout.split("[kernels]", 1)[1]
    assert "situ = 'auto'" in section and "grouped_mm = 'auto'" in section
