"""Regional compile under context parallelism (`compile.enable` with
`parallelism.context_parallel_degree > 1`, `titan_moe.parallelize.apply_compile`): every
layer is compiled piecewise, its context-parallel attention runs eagerly between the
regions (collectives and the batch's document layouts stay outside them).

Checked with the aot_eager backend (Dynamo + AOTAutograd without Inductor's CPU compile
time), as tests/test_compile.py and the compiled EP run of tests/test_parallel.py do:

* the decoder on two gloo ranks, layers checkpointed (torchtitan's `apply_ac`, then
  compile, the trainer's order; exact QB, which a checkpointed layer compiled whole refuses),
  over three batches whose documents fall differently on the segments, against the
  one-process eager decoder: logits and every parameter's gradient; no graph break, no
  graph compiled after the first batch, and the start-up line naming the regions;
* (slow: three training runs, about a minute on two cores) training, 3 steps of the tiny
  model on 4 rows of 256 tokens: CP2 compiled against CP2 eager and one process (losses and
  gradient norms), the start-up line, and no graph compiled after step 1 although a later
  step's rows fall otherwise on the segments (recorded in the run); CP2 x EP2 with full
  activation checkpointing (the MoE's experts and their exchange eager as well).

Tolerances. Compiled against eager CP2: the same ops in the same order, traced; aot_eager
runs the ATen decompositions of a few composite ops (RMSNorm, SiLU, softmax), which may
round differently in fp32: 1e-6 relative at step 1 leaves room for that, 1e-5 at later
steps and for the gradient norm, where one step's rounding moves the next step's weights
(measured: no difference at all at steps 1-3, losses and gradient norms). Against one
process: the context-parallel tolerances of tests/test_context_parallel_train.py (the KDA
state and MLA in latent space sum in another order; the gradient norm's A_log/dt_bias
terms cancel, 2e-5 measured there and here). The decoder test: 1e-4 relative, as
tests/test_context_parallel_model.py (1.3e-5 measured there eager; here at most 7e-6).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import re
import subprocess
from pathlib import Path

import pytest
import torch

from gloo_ranks import spawn_gloo
from numerics import rel_err
from tiny import CONFIG, REPO, TINY_ARGS, TINY_CLI, environment, records, start_all, started_runs, train_command

# ------------------------------------------------------------------------------------------ the decoder
T = 128
RTOL = 1e-4
UNWRAPPED = re.compile(r"(_orig_mod|_checkpoint_wrapped_module)\.")  # the wrappers' names in parameter names
BATCHES = [  # per step, document lengths per row (summing to T): every step cuts the segments differently
    [[10, 70, 1, 47], [T], [32, 32, 64]],
    [[100, 28], [5, 5, 5, 113], [64, 64]],
    [[1, 126, 1], [40, 50, 38], [T]],
]


def _model():
    from titan_moe.model.decoder import Decoder

    torch.manual_seed(0)
    model = Decoder(dataclasses.replace(TINY_ARGS, mla_attention="chunked"))
    model.init_weights()
    return model


def _batch(step: int):
    gen = torch.Generator().manual_seed(step)
    doc_ids = torch.stack([
        torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(row)]) for row in BATCHES[step]
    ])
    tokens = torch.randint(0, TINY_ARGS.vocab_size, doc_ids.shape, generator=gen)
    weight = torch.randn(*doc_ids.shape, TINY_ARGS.vocab_size, generator=gen)
    return tokens, doc_ids, weight


def _decoder_worker(rank: int, world: int) -> None:
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from torchtitan.config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.tools.logging import logger

    from titan_moe.context_parallel import apply_context_parallel, segment_of
    from titan_moe.parallelize import apply_compile

    reference = _model()
    model = copy.deepcopy(reference)
    apply_context_parallel(model, dist.group.WORLD, "headtail")
    apply_ac(model, ActivationCheckpoint(mode="full"), model_compile_enabled=True)
    torch._dynamo.reset()
    counters.clear()
    lines = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    apply_compile(model, SimpleNamespace(backend="aot_eager", passes=[], moe_regions="auto"), ep_enabled=False,
                  cp_enabled=True)
    logger.removeHandler(handler)
    (line,) = lines  # the start-up line
    assert line.startswith("Compiled each layer piecewise under context parallelism: regions "), line
    for region in ("attention_mix", "attention_norm", "ffn_mix", "ffn_norm", "feed_forward",
                   "kda.input_projections", "kda.halo_conv", "kda.output_projection",
                   "mla._queries", "mla._latents", "mla._gate_and_project"):
        assert region in line, (region, line)
    assert "the context-parallel attention runs eagerly" in line and "experts" not in line, line
    for layer in model.layers.values():  # checkpointed, not compiled whole; its attention eager
        block = layer._checkpoint_wrapped_module
        assert not hasattr(block, "_orig_mod") and hasattr(block.ffn_norm, "_orig_mod")
        assert not hasattr(block.attention, "_orig_mod")
        for method in block.attention.compile_regions:
            assert hasattr(getattr(block.attention, method), "_torchdynamo_orig_callable"), method
    slot = model.layers["0"]._checkpoint_wrapped_module.attention.cp_slot

    graphs, layouts = [], []
    for step in range(len(BATCHES)):
        tokens, doc_ids, weight = _batch(step)
        for m in (reference, model):
            m.zero_grad(set_to_none=True)
        logits_ref = reference(tokens, doc_ids)
        (logits_ref * weight).sum().backward()
        logits = model(segment_of(tokens, rank, world), segment_of(doc_ids, rank, world))
        (logits * segment_of(weight, rank, world)).sum().backward()
        graphs.append(counters["stats"]["unique_graphs"])
        layouts.append(tuple(layout for layout, _ in slot.current().kda))

        errors = {"logits": rel_err(logits, segment_of(logits_ref, rank, world))}
        grads = {UNWRAPPED.sub("", n): p.grad for n, p in model.named_parameters()}
        assert grads.keys() == dict(reference.named_parameters()).keys()
        for name, p in reference.named_parameters():
            assert grads[name] is not None, name
            dist.all_reduce(grads[name])
            errors[name] = rel_err(grads[name], p.grad)
        bad = {name: err for name, err in errors.items() if not err <= RTOL}
        assert not bad, f"rank {rank}, step {step + 1}: relative errors above {RTOL}: {bad}"
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert len(set(layouts)) == len(BATCHES), "the batches must fall differently on the segments"
    assert graphs[0] > 0 and graphs == [graphs[0]] * len(graphs), f"rank {rank}: graphs after each step {graphs}"


def test_checkpointed_decoder_compiles_piecewise_under_cp2(tmp_path):
    """CP2, headtail balance, full activation checkpointing then compile (the trainer's
    order): matches the one-process eager decoder on three batches whose documents fall
    differently on the segments, with every graph compiled at the first batch."""
    spawn_gloo(_decoder_worker, 2, tmp_path)


# ------------------------------------------------------------------------------------------ training
STEPS = 3
SEQ = ["--training.seq_len", "256"]
CP2 = ["--parallelism.context_parallel_degree", "2"]
EP2 = ["--parallelism.expert_parallel_degree", "2"]
COMPILE = ["--compile.enable", "--compile.backend", "aot_eager"]
STEP1_RTOL, LATER_RTOL, GRAD_NORM_RTOL = 1e-5, 1e-4, 1e-4  # against one process (module docstring)
SAME_STEP1_RTOL, SAME_LATER_RTOL = 1e-6, 1e-5  # compiled against eager, both CP2

# Run as each rank's script under torchrun: the trainer, with a record after every step of
# Dynamo's graph count, its graph breaks and how the step's rows fell on this rank's segment
# (the KDA layouts that the context-parallel pre-hook derived), written to <folder>/rank<r>.json.
_RECORD_GRAPHS = """
import json, os, sys
from pathlib import Path
from torch._dynamo.utils import counters
import titan_moe.train as train

seen = []
step = train.TitanTrainer.train_step

def train_step(self, data_iterator):
    step(self, data_iterator)
    slot = next(m.cp_slot for part in self.model_parts for m in part.modules() if hasattr(m, "cp_slot"))
    seen.append({"step": self.step, "graphs": counters["stats"]["unique_graphs"],
                 "graph_breaks": sum(counters["graph_break"].values()),
                 "layouts": [repr(layout) for layout, _ in slot.current().kda]})

train.TitanTrainer.train_step = train_step
try:
    train.main(sys.argv[2:])
finally:
    Path(sys.argv[1], f"rank{os.environ['RANK']}.json").write_text(json.dumps(seen))
"""


def _run(dump: Path, *args: str, nproc: int = 1, record_graphs: bool = False) -> dict:
    command = train_command(dump, "--training.steps", str(STEPS), *SEQ, *args, nproc=nproc)
    if record_graphs:  # torchrun runs the recording script instead of `-m titan_moe.train`
        dump.mkdir(parents=True, exist_ok=True)
        script = dump / "record_graphs.py"
        script.write_text(_RECORD_GRAPHS)
        at = command.index("titan_moe.train") - 1
        command = [*command[:at], str(script), str(dump), *command[at + 2 :]]
    proc = subprocess.run(command, cwd=REPO, env={**environment(), "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    return {"dump": dump, "log": log}


def start_runs(root: Path) -> dict:
    """Queue the shared training runs of this file (tests/tiny.py): name -> future of
    `_run`'s result."""
    return start_all({
        "compiled CP2": lambda: _run(root / "compiled_cp2", *CP2, *COMPILE, nproc=2, record_graphs=True),
        "one process": lambda: _run(root / "one_process"),
        "CP2": lambda: _run(root / "cp2", *CP2, nproc=2),
    })


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return started_runs(start_runs, tmp_path_factory)


def _assert_close(got: dict, ref: dict, rtols: dict, label: str) -> None:
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1)), label
    for step in ref:
        for key, rtol in rtols(step).items():
            a, b = got[step][key], ref[step][key]
            assert abs(a - b) <= rtol * abs(b), (label, step, key, a, b)


@pytest.mark.slow
def test_compiled_cp2_training_matches_eager_and_one_process(runs):
    compiled = runs["compiled CP2"].result()
    log = compiled["log"]
    assert "Applied context parallelism over 2 ranks" in log
    line = next(line for line in log.splitlines() if "Compiled each layer piecewise under context parallelism" in line)
    for region in ("attention_mix", "ffn_norm", "feed_forward", "kda.input_projections", "kda.halo_conv",
                   "kda.output_projection", "mla._queries", "mla._latents", "mla._gate_and_project"):
        assert region in line, region
    assert "the context-parallel attention runs eagerly" in line
    got = records(compiled["dump"])
    _assert_close(got, records(runs["CP2"].result()["dump"]),
                  lambda step: {"loss": SAME_STEP1_RTOL if step == 1 else SAME_LATER_RTOL,
                                "grad_norm": SAME_LATER_RTOL}, "compiled CP2 vs eager CP2")
    _assert_close(got, records(runs["one process"].result()["dump"]),
                  lambda step: {"loss": STEP1_RTOL if step == 1 else LATER_RTOL, "grad_norm": GRAD_NORM_RTOL},
                  "compiled CP2 vs one process")
    for rank in range(2):
        seen = json.loads((compiled["dump"] / f"rank{rank}.json").read_text())
        assert [s["step"] for s in seen] == list(range(1, STEPS + 1)), seen
        assert all(s["graph_breaks"] == 0 for s in seen), seen
        # a later step's rows fall otherwise on the segment (the loader's rows: step 2's last
        # row holds document starts), and nothing new is compiled
        assert any(s["layouts"] != seen[0]["layouts"] for s in seen[1:]), seen
        assert seen[0]["graphs"] > 0 and {s["graphs"] for s in seen} == {seen[0]["graphs"]}, seen


@pytest.mark.slow
def test_compiled_cp2_ep2_with_full_checkpointing_matches_one_process(runs, tmp_path):
    """CP2 x EP2 (the MoE layers' experts and their all-to-all eager too, `route_and_sort`
    and `combine` compiled), each rank its own MLA queries, layers fully checkpointed."""
    got = _run(tmp_path / "cp2_ep2", *CP2, *EP2, *COMPILE, "--parallelism.context_parallel_load_balancer", "none",
               "--activation_checkpoint.mode", "full", nproc=2)
    assert "Applied full activation checkpointing" in got["log"]
    assert "moe.route_and_sort" in got["log"] and "routed experts and their exchange run eagerly" in got["log"]
    _assert_close(records(got["dump"]), records(runs["one process"].result()["dump"]),
                  lambda step: {"loss": STEP1_RTOL if step == 1 else LATER_RTOL, "grad_norm": GRAD_NORM_RTOL},
                  "compiled CP2 x EP2, full AC, vs one process")


def test_compile_is_accepted_with_context_parallelism():
    """`compile.enable` with CP passes the layout check (also with activation checkpointing
    and exact QB, which a layer compiled whole refuses), and with validation."""
    from titan_moe.config import ConfigError, load_config, model_args_from_config
    from titan_moe.context_parallel import check_context_parallel

    base = ["--job.config_file", CONFIG, *TINY_CLI, *SEQ, *CP2, "--compile.enable"]
    config = load_config([*base, "--activation_checkpoint.mode", "full"])
    assert config.compile.enable and model_args_from_config(config).qb_bins == 0
    check_context_parallel(config)
    check_context_parallel(load_config([*base, "--validation.enable"]))
    with pytest.raises(ConfigError, match="exact QB"):  # without CP the layer is compiled whole
        load_config(["--job.config_file", CONFIG, *TINY_CLI, *SEQ, "--compile.enable",
                     "--activation_checkpoint.mode", "full"])
