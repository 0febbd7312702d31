"""The context ladder: stage config and schedule, the mixed data stream, synthetic tasks,
long documents, the evaluations (oracle and random models), and the trainer end to end."""

from __future__ import annotations

import json
import math
import os
import random
import struct
import subprocess
import sys
import zlib

import pytest
import torch

from titan_moe import evaluate
from titan_moe.config import ConfigError, load_config
from titan_moe.data import build_dataloader, load_tokenizer, text_source
from titan_moe.data.long_documents import import_order, package_documents, unseen_package_documents
from titan_moe.data.packing import IGNORE_INDEX
from titan_moe.data.synthetic import Filler, SyntheticTasks, copy_task, mqar_task, passkey_task, task_rng
from titan_moe.ladder import Ladder, Stage, lr_lambda, resolve_stages, short_length

from tiny import REPO, TINY_CLI, environment, records, start_all, started_runs

LADDER_TOML = """
[job]
dump_folder = "{dump}"
[model]
name = "titan_moe"
flavor = "debug"
[data]
long_documents = ["packages"]
[training]
local_batch_size = 4
global_batch_size = 4
dtype = "float32"
mixed_precision_param = "float32"
[optimizer]
lr = 1e-3
[lr_scheduler]
warmup_steps = 2
decay_type = "cosine"
min_lr_factor = 0.1
[[ladder.stages]]
seq_len = 64
steps = 3
[[ladder.stages]]
seq_len = 128
steps = 3
local_batch_size = 2
global_batch_size = 2
lr = 5e-4
long_fraction = 0.3
synthetic_fraction = 0.1
[[ladder.stages]]
seq_len = 256
steps = 3
local_batch_size = 1
global_batch_size = 1
long_fraction = 0.5
synthetic_fraction = 0.1
[ladder]
eval_depths = [0.5]
eval_samples = 1
eval_mqar_pairs = 1
eval_loss_docs = 1
[checkpoint]
enable = true
interval = 2
[metrics]
log_freq = 1
[validation]
enable = false
[debug]
seed = 0
"""


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def _write_config(tmp_path, text=LADDER_TOML):
    path = tmp_path / "ladder.toml"
    path.write_text(text.format(dump=tmp_path / "run"))
    return str(path)


# ------------------------------------------------------------------------ config
def test_stages_load_override_and_fill_training(tmp_path):
    path = _write_config(tmp_path)
    config = load_config(["--job.config_file", path, "--ladder.stages.2.steps", "5",
                          "--ladder.stages.3.synthetic_fraction=0.05"])
    stages = config.ladder.stages
    assert [s.seq_len for s in stages] == [64, 128, 256] and stages[1].steps == 5
    assert stages[2].synthetic_fraction == 0.05
    # [training] describes the ladder: its total steps, the last stage's rows and batch
    assert config.training.steps == 11 and config.training.seq_len == 256
    assert config.training.local_batch_size == 1


@pytest.mark.parametrize("args,message", [
    (["--ladder.stages.4.steps", "1"], "has 3 ladder.stages entries"),
    (["--ladder.stages.0.steps", "1"], "stage number N >= 1"),
    (["--ladder.stages.1.stepz", "1"], "unknown key 'ladder.stages.1.stepz' (did you mean 'steps'?)"),
    (["--ladder.stages.1.steps", "x"], "bad value for --ladder.stages.1.steps"),
    (["--training.seq_len", "64"], "training.seq_len is set by [[ladder.stages]]"),
    (["--ladder.stages.2.seq_len", "32"], "shorter than the stage before"),
    (["--ladder.stages.2.decay_type", "step"], "decay_type must be one of"),
    (["--ladder.stages.2.long_fraction", "0.95"], "must stay below 1"),
    (["--ladder.stages.2.synthetic_max_length", "32"], "ladder.stages.2.synthetic_max_length must be 0 (whole-row"),
    (["--ladder.eval_lengths", "1024,0"], "ladder.eval_lengths must be lengths >= 1"),
    (["--ladder.eval_every", "-1"], "ladder.eval_every must be >= 0"),
    (["--data.synthetic_tasks", "passkey,needle"], "unknown task 'needle'"),
    (["--ladder.eval_packages_path", "/no/such/folder"], "ladder.eval_packages_path '/no/such/folder' is not a directory"),
    (["--ladder.eval_packages_path", str(REPO), "--data.long_documents", "text", "--data.long_documents_path",
      str(REPO / "titan_moe")], "overlaps data.long_documents_path"),
])
def test_bad_stage_keys_are_one_line_errors(tmp_path, args, message):
    path = _write_config(tmp_path)
    with pytest.raises(ConfigError) as e:
        load_config(["--job.config_file", path, *args])
    assert message in str(e.value) and "\n" not in str(e.value)


def _unknown_key_run(folder):
    """The trainer on a ladder config with an unknown key in stage 2: (config path, process)."""
    folder.mkdir()
    path = _write_config(folder, LADDER_TOML.replace("steps = 3\nlocal_batch_size = 2", "steps = 3\nbatch = 2"))
    return path, subprocess.run([sys.executable, "-m", "titan_moe.train", "--job.config_file", path],
                                cwd=REPO, env=environment(), capture_output=True, text=True, timeout=120)


def test_unknown_key_in_a_stage_table_exits_2(runs):
    path, proc = runs[1]["unknown key"].result()
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == f"titan_moe.train: error: {path}: unknown key 'ladder.stages.2.batch'"


def test_lr_schedule_per_stage():
    class T:
        local_batch_size, global_batch_size = 4, -1

    class O:
        lr = 1e-3

    class S:
        warmup_steps, decay_type, min_lr_factor = 2, "cosine", 0.1

    ladder = Ladder(stages=[Stage(seq_len=8, steps=6), Stage(seq_len=16, steps=4, lr=5e-4, decay_type="linear"),
                            Stage(seq_len=32, steps=3, decay_type="constant", warmup_steps=1)])
    stages = resolve_stages(ladder, T, O, S)
    assert [(s.start, s.end) for s in stages] == [(0, 6), (6, 10), (10, 13)]
    f = lr_lambda(stages, 1e-3)
    lrs = [f(k) for k in range(13)]  # factor of steps 1..13
    assert lrs[0] == pytest.approx(1 / 3) and lrs[1] == pytest.approx(2 / 3)  # warm-up of stage 1
    assert lrs[2] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lrs[5] == pytest.approx(0.1)  # stage 1 ends at min_lr_factor
    assert lrs[6] == pytest.approx(0.5 * (0.1 + 0.9 * 0.75))  # stage 2: no warm-up, linear, lr 5e-4
    assert lrs[9] == pytest.approx(0.5 * 0.1)
    assert lrs[10] == pytest.approx(0.5) and lrs[11] == lrs[12] == pytest.approx(1.0)
    assert short_length(1 << 20) == "1M" and short_length(262144) == "256K" and short_length(300) == "300"


@pytest.mark.parametrize("resumed_at, recorded, evaluated", [
    (6, False, True),   # stopped at a stage's end before its evaluations finished
    (6, True, False),   # its evaluations finished before the stop
    (5, False, False),  # mid-stage: nothing to evaluate
    (0, False, False),  # a fresh run
])
def test_resume_at_a_stage_end_finishes_its_evaluations(tmp_path, resumed_at, recorded, evaluated):
    from types import SimpleNamespace

    from titan_moe.stages import LadderRun

    ladder = Ladder(stages=[Stage(seq_len=8, steps=6), Stage(seq_len=16, steps=4)])
    training = SimpleNamespace(local_batch_size=4, global_batch_size=-1)
    schedule = SimpleNamespace(warmup_steps=2, decay_type="cosine", min_lr_factor=0.1)
    config = SimpleNamespace(ladder=ladder, training=training, optimizer=SimpleNamespace(lr=1e-3),
                             lr_scheduler=schedule, job=SimpleNamespace(dump_folder=str(tmp_path)))
    run = LadderRun(trainer=None, job_config=config)
    calls = []
    run.evaluate = lambda stage, step: calls.append((stage.index, step))
    evaluate.record(str(tmp_path), resumed_at - 1, 8, {"eval/passkey/8/d0.00": 1.0})  # an earlier step's
    if recorded:
        evaluate.record(str(tmp_path), resumed_at, 8, {"eval/passkey/8/d0.00": 1.0})
    else:  # a record of this step cut short when the process stopped
        with open(tmp_path / "metrics.jsonl", "a") as f:
            f.write(f'{{"step": {resumed_at}, "seq_len": 8, "eval/passk')
    run.after_step(resumed_at)  # the check before the first step of this process
    assert calls == ([(0, resumed_at)] if evaluated else [])


# -------------------------------------------------------------- synthetic tasks
@pytest.fixture(scope="module")
def filler(tok):
    return Filler(text_source(str(REPO / "titan_moe" / "data"), "train", 0.0), tok)


def test_tasks_have_exact_length_and_answer_only_mask(tok, filler):
    for length in (64, 100, 257, 1024):
        for i in range(3):
            rng = task_rng(0, i)
            for task in (passkey_task(tok, filler, length, rng), mqar_task(tok, filler, length, rng),
                         copy_task(tok, filler, length, rng)):
                assert len(task.tokens) == len(task.loss_mask) == length
                assert task.tokens[0] == tok.bos_id and task.tokens[-1] == tok.eos_id
                answered = [j for j, m in enumerate(task.loss_mask) if m]
                assert answered == [j for s, e in task.answers for j in range(s, e)] and answered
    task = passkey_task(tok, filler, 300, task_rng(0, 0), depth=0.0)
    text = tok.decode(task.tokens[1:-1])
    assert text.startswith("\n# The pass key is " + task.info["key"])
    assert tok.decode(task.tokens[task.answers[0][0]:task.answers[0][1]]) == " " + task.info["key"]
    with pytest.raises(ValueError, match="needs at least"):
        passkey_task(tok, filler, 20, task_rng(0, 0))


def test_copy_task_repeats_random_words_as_its_answer(tok, filler):
    for length in (64, 65, 1000):
        task = copy_task(tok, filler, length, task_rng(1, length))
        (start, end), = task.answers
        n = task.info["copied"]
        assert end - start == n and end == length - 2 and n >= (length - 16) // 2
        copied = task.tokens[start:end]
        middle = tok.encode("\n# Again:\n")
        assert task.tokens[start - len(middle):start] == middle
        assert task.tokens[start - len(middle) - n:start - len(middle)] == copied
        words = tok.decode(copied).split()
        assert all(len(w) <= 4 and w.isalpha() for w in words) and len(set(words)) > len(words) // 2
    assert copy_task(tok, filler, 200, task_rng(1, 0)).tokens != copy_task(tok, filler, 200, task_rng(1, 1)).tokens
    with pytest.raises(ValueError, match="needs at least"):
        copy_task(tok, filler, 10, task_rng(0, 0))
    tasks = SyntheticTasks(tok, filler, ["copy"], seed=0)
    assert tasks.task(5, 128).kind == "copy" and tasks.min_length == 64


def induction_oracle(vocab: int, max_n: int = 8):
    """A model that copies: at each position it predicts the token that followed the most
    recent earlier occurrence of the longest matching n-gram ending here."""

    def logits(tokens_BT, doc_ids_BT):
        B, T = tokens_BT.shape
        out = torch.zeros(B, T, vocab)
        for b in range(B):
            seq = tokens_BT[b].tolist()
            last_end: dict[tuple, int] = {}
            for t in range(T):
                for n in range(min(max_n, t + 1), 0, -1):
                    s = last_end.get(tuple(seq[t - n + 1 : t + 1]))
                    if s is not None:
                        out[b, t, seq[s + 1]] = 1.0
                        break
                for n in range(1, min(max_n, t) + 1):  # n-grams ending at t - 1, followed by seq[t]
                    last_end[tuple(seq[t - n : t])] = t - 1
        return out

    return logits


def test_evaluator_oracle_copies_everything_random_model_is_at_chance(tok, filler):
    oracle = evaluate.scores_from_logits(induction_oracle(tok.get_vocab_size()))
    passkey = evaluate.passkey_accuracy(oracle, tok, filler, [128, 384], [0.0, 0.5, 1.0], samples=3)
    assert set(passkey.values()) == {1.0}
    assert evaluate.mqar_accuracy(oracle, tok, filler, [384], samples=3, n_pairs=6) == {384: 1.0}
    # the oracle matches n-grams, so right after the repeat starts a one-token match can point
    # at another place of the list where that token also stands: near 1, not 1
    assert min(evaluate.copy_accuracy(oracle, tok, filler, [64, 384], samples=3).values()) > 0.95
    gen = torch.Generator().manual_seed(0)

    @evaluate.scores_from_logits
    def random_model(tokens_BT, doc_ids_BT):
        return torch.randn(*tokens_BT.shape, tok.get_vocab_size(), generator=gen)

    # chance: a 5-digit key is 2-3 tokens of a 4096 vocabulary, an MQAR value 1-2: < 1e-3 a question
    passkey = evaluate.passkey_accuracy(random_model, tok, filler, [128, 384], [0.0, 0.5, 1.0], samples=3)
    assert set(passkey.values()) == {0.0}
    assert evaluate.mqar_accuracy(random_model, tok, filler, [384], samples=3, n_pairs=6) == {384: 0.0}
    assert evaluate.copy_accuracy(random_model, tok, filler, [384], samples=3)[384] < 0.01


def test_long_cells_go_through_the_model_a_few_rows_at_a_time(tok, filler, monkeypatch):
    """Past the token budget a forward holds fewer rows (one at the longest); the results are
    those of whole-cell forwards."""
    oracle = induction_oracle(tok.get_vocab_size())
    seen = []

    @evaluate.scores_from_logits
    def counting(tokens_BT, doc_ids_BT):
        seen.append(tuple(tokens_BT.shape))
        return oracle(tokens_BT, doc_ids_BT)

    whole = evaluate.passkey_accuracy(counting, tok, filler, [128, 384], [0.0, 1.0], samples=3)
    assert {rows for rows, _ in seen} == {3}
    docs = [list(range(2, 402)), list(range(3, 403)), list(range(4, 404))]
    loss_whole = evaluate.loss_by_position(counting, docs, 384)
    monkeypatch.setattr(evaluate, "EVAL_FORWARD_TOKENS", 300)
    seen.clear()
    assert evaluate.passkey_accuracy(counting, tok, filler, [128, 384], [0.0, 1.0], samples=3) == whole
    loss_split = evaluate.loss_by_position(counting, docs, 384)
    assert loss_split.keys() == loss_whole.keys()
    for bucket, (loss, count) in loss_whole.items():  # sums in another order: equal to rounding
        assert loss_split[bucket] == (pytest.approx(loss, rel=1e-6), count)
    assert max(rows * length for rows, length in seen if length <= 300) <= 300
    assert {rows for rows, length in seen if length > 300} == {1}


def test_ladder_evaluation_runs_compiled_models_eagerly(tmp_path):
    """The stage's evaluation calls a compiled model without compiling it (every evaluation
    shape would be a compile), and records its metrics."""
    import contextlib
    import types

    from titan_moe.config import model_args_from_config
    from titan_moe.data.from_config import tokenizer_from_config
    from titan_moe.model.decoder import Decoder
    from titan_moe.stages import LadderRun

    config = load_config(["--job.config_file", _write_config(tmp_path), "--ladder.eval_samples", "1"])
    torch.manual_seed(0)
    model = Decoder(model_args_from_config(config))
    model.init_weights()
    trainer = types.SimpleNamespace(tokenizer=tokenizer_from_config(config), model_parts=[torch.compile(model)],
                                    device="cpu", maybe_enable_amp=contextlib.nullcontext(),
                                    parallel_dims=types.SimpleNamespace(cp_enabled=False))
    run = LadderRun(trainer, config)
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    metrics = run.evaluate(run.stages[0], 3)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before
    assert "eval/passkey/64" in metrics and evaluate.recorded(config.job.dump_folder, 3)
    assert trainer.model_parts[0].training  # back in training mode


def test_loss_by_position_uniform_model_and_buckets():
    assert evaluate.position_buckets(300) == [(0, 64), (64, 128), (128, 256), (256, 300)]
    V = 50

    @evaluate.scores_from_logits
    def uniform(tokens_BT, doc_ids_BT):
        return torch.zeros(*tokens_BT.shape, V)

    docs = [[t % V for t in range(301)], list(range(40)), [1]]
    result = evaluate.loss_by_position(uniform, docs, 300)
    assert result[(0, 64)] == (pytest.approx(math.log(V)), 64 + 39)
    assert result[(256, 300)] == (pytest.approx(math.log(V)), 44)


def test_metrics_table_and_heatmap(tmp_path):
    metrics = {"eval/passkey/256/d0.00": 1.0, "eval/passkey/256/d1.00": 0.5, "eval/passkey/256": 0.75,
               "eval/passkey/1K/d0.00": 0.0, "eval/passkey/1K/d1.00": 0.25, "eval/passkey/1K": 0.125,
               "eval/mqar/1K": 0.5, "eval/copy/1K": 0.25, "eval/loss_by_pos/0-64": 3.0}
    table = evaluate.format_table(metrics)
    assert "length      256" in table and "[0-64) 3.000" in table
    assert table.splitlines()[2].endswith("0.12   0.50   0.25") and table.splitlines()[1].endswith("0.75      -      -")
    evaluate.record(str(tmp_path), 7, 1024, metrics, "1K")
    line = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert line["step"] == 7 and line["seq_len"] == 1024 and line["eval/mqar/1K"] == 0.5
    png = (tmp_path / "passkey_7.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = struct.unpack(">II", png[16:24])
    assert (w, h) == (2 * 24 + 1, 2 * 24 + 1)
    idat_len = struct.unpack(">I", png[33:37])[0]
    pixels = zlib.decompress(png[41 : 41 + idat_len])
    row = 12 * (w + 1)  # a row inside the first length (256): white then grey
    assert pixels[row + 1 + 12] == 255 and pixels[row + 1 + 24 + 12] == 128


def test_evaluation_runs_in_the_training_compute_dtype_on_cuda():
    # FlashAttention-2 (the CUDA varlen MLA path) rejects fp32: a bf16 run is evaluated in bf16,
    # an fp32 run on CUDA falls back to the chunked path; the CPU always evaluates in fp32
    bf16 = load_config(["--job.config_file", str(REPO / "configs" / "ladder_1gpu.toml")])
    assert evaluate.evaluation_dtype(bf16, "cuda") == torch.bfloat16 and bf16.model.mla_attention is None
    assert evaluate.evaluation_dtype(bf16, "cpu") == torch.float32
    fp32 = load_config(["--job.config_file", str(REPO / "configs" / "ladder_cpu.toml")])
    assert evaluate.evaluation_dtype(fp32, "cpu") == torch.float32 and fp32.model.mla_attention is None
    assert evaluate.evaluation_dtype(fp32, "cuda") == torch.float32 and fp32.model.mla_attention == "chunked"
    dense = load_config(["--job.config_file", str(REPO / "configs" / "ladder_cpu.toml"), "--model.mla_attention",
                         "dense"])
    assert evaluate.evaluation_dtype(dense, "cuda") == torch.float32 and dense.model.mla_attention == "dense"
    layer = torch.nn.Linear(2, 2)
    layer.register_buffer("expert_bias", torch.zeros(2))
    evaluate.cast_parameters(layer, torch.bfloat16)
    assert layer.weight.dtype == layer.bias.dtype == torch.bfloat16 and layer.expert_bias.dtype == torch.float32


# ---------------------------------------------------------------- long documents
def test_import_order_and_package_split(tmp_path):
    files = {"pkg/__init__.py": "from .b import x\nfrom pkg import a\n", "pkg/a.py": "import os\n",
             "pkg/b.py": "from . import c\n", "pkg/c.py": "from .a import y\n", "pkg/d.py": "import pkg.b\n"}
    order = import_order(files)
    assert order.index("pkg/a.py") < order.index("pkg/c.py") < order.index("pkg/b.py") < order.index("pkg/__init__.py")
    assert order.index("pkg/b.py") < order.index("pkg/d.py") and sorted(order) == sorted(files)
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text(text)
    docs = package_documents("train", 0.0, root=str(tmp_path))
    assert len(docs) == 1 and docs[0].startswith("# file: pkg/a.py\nimport os\n")
    # the real standard library: train and val documents never share a file
    train, val = package_documents("train"), package_documents("val")
    train_files = {f for _, rels in train.packages for f in rels}
    val_files = {f for _, rels in val.packages for f in rels}
    assert train_files and val_files and not train_files & val_files


def test_empty_val_packages_are_skipped_but_no_held_out_text_is_an_error(tmp_path, tok):
    # a standard library whose packages have no two held-out files: its val split is empty
    # (evaluation reads the other sources), its train split still may not be
    for rel in ("pkg/__init__.py", "pkg/a.py"):
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    assert len(package_documents("val", 0.0, root=str(tmp_path))) == 0
    with pytest.raises(ValueError, match="no package with two or more files"):
        package_documents("train", 1.0, root=str(tmp_path))
    config = load_config(["--job.config_file", _write_config(tmp_path)])
    assert evaluate.loss_documents(config, ["a held-out file\n" * 40], tok, seq_len=16)
    bare = load_config(["--job.config_file", _write_config(tmp_path), "--data.long_documents", ""])
    with pytest.raises(ValueError, match="no held-out documents"):
        evaluate.loss_sources(bare, [])


def test_unseen_packages_join_the_loss_documents(tmp_path, tok):
    # two packages of code never trained on: each one document, whole and in import order
    for pkg, n in (("small", 2), ("big", 6)):
        for i in range(n):
            path = tmp_path / pkg / ("__init__.py" if i == 0 else f"m{i}.py")
            path.parent.mkdir(exist_ok=True)
            path.write_text(f"def f{i}(x):\n    return x + {i}\n" * 30)
    docs = unseen_package_documents(str(tmp_path))
    assert [name for name, _ in docs.packages] == ["big", "small"] and len(docs.packages[0][1]) == 6
    unseen = [tok.encode(docs[i], add_bos=True, add_eos=True) for i in range(2)]
    val = ["a short held-out file\n" * 3]
    args = ["--job.config_file", _write_config(tmp_path), "--ladder.eval_loss_docs", "8"]
    without = evaluate.loss_documents(load_config(args), val, tok, seq_len=64)
    held_out = evaluate.loss_documents(load_config([*args, "--ladder.eval_packages_path", str(tmp_path)]), val, tok,
                                       seq_len=64)
    # compared on what the loss by position reads, the first seq_len + 1 tokens (a long
    # document is tokenized from a prefix of its text only)
    heads = lambda docs: [d[:65] for d in docs]  # noqa: E731
    assert not any(u in heads(without) for u in heads(unseen)) and all(u in heads(held_out) for u in heads(unseen))
    assert all(len(d) >= 65 for d in held_out[:2])
    cut = evaluate.held_out_documents(docs, tok, 65, 1)[0]  # a prefix: no [eos] where the text goes on
    assert len(docs[0]) > evaluate.PREFIX_CHARS_PER_TOKEN * 65 and cut[-1] != tok.eos_id and len(cut) >= 65
    # pooled with the val splits (the corpus's file, the standard library's val packages), longest first
    assert len(held_out) == len(without) + 2 and [len(d) for d in held_out] == sorted(map(len, held_out), reverse=True)
    with pytest.raises(ValueError, match="no such directory"):
        unseen_package_documents(str(tmp_path / "missing"))
    # checked at load also without stages (the evaluate command reads the key)
    with pytest.raises(ConfigError, match="is not a directory"):
        load_config(["--job.config_file", str(REPO / "configs" / "debug_cpu.toml"),
                     "--ladder.eval_packages_path", str(tmp_path / "missing")])


# ------------------------------------------------------------ mixed data stream
def _mixed_loader(tok, filler, corpus, seq_len=48, batch=2):
    long_docs = text_source(os.path.join(corpus, "long"), "train", 0.0)
    synthetic = SyntheticTasks(tok, filler, ["passkey", "mqar"], seed=3)
    return build_dataloader(tokenizer=tok, source="text", path=os.path.join(corpus, "d*.txt"), split="train", seq_len=seq_len,
                            local_batch_size=batch, dp_rank=0, dp_world_size=1, seed=3, val_fraction=0.0,
                            long_documents=long_docs, synthetic=synthetic)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "def", "x", "=", "42", "\n"]
    for i in range(40):
        (root / f"d{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(rng.randint(5, 120))))
    (root / "long").mkdir()
    for i in range(12):  # a few hundred tokens each
        (root / "long" / f"l{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(rng.randint(200, 500))))
    return str(root)


# (index, seq_len, rows, long_fraction, synthetic_fraction, synthetic_max_length)
STAGES = [(0, 48, 2, 0.0, 0.0, 0), (1, 96, 2, 0.3, 0.1, 0), (2, 200, 1, 0.5, 0.1, 0), (3, 600, 1, 0.0, 0.2, 150)]


def _run(loader, plan):
    """Batches of a staged run: plan = [(stage, batches)]; returns the flat list."""
    out = []
    for stage, n in plan:
        index, seq_len, batch, long_f, synth_f, synth_max = STAGES[stage]
        loader.set_stage(index, seq_len=seq_len, local_batch_size=batch, long_fraction=long_f,
                         synthetic_fraction=synth_f, synthetic_max_length=synth_max)
        it = iter(loader)
        out += [next(it) for _ in range(n)]
    return out


def test_mix_shares_uncut_tasks_and_answer_only_loss(tok, filler, corpus):
    loader = _mixed_loader(tok, filler, corpus)
    batches = _run(loader, [(0, 2), (2, 60)])[2:]
    state = loader.state_dict()["dp_rank_0"]
    total = state["corpus_tokens"] + state["long_tokens"] + state["synth_tokens"]
    assert abs(state["synth_tokens"] / total - 0.1) < 0.04 and abs(state["long_tokens"] / total - 0.5) < 0.1
    tasks_seen = 0
    for x, y in batches:
        ids, doc_ids = x["input"][0], x["doc_ids"][0]
        masked = y[0] == IGNORE_INDEX
        if not masked.any():
            continue
        # the synthetic document is the row's last, starts with bos and ends the row (uncut)
        start = int((doc_ids == doc_ids[-1]).nonzero()[0])
        assert ids[start] == tok.bos_id and masked[: max(start - 1, 0)].sum() == 0
        assert y[0, -1] == IGNORE_INDEX  # predicting the eos (the row's last label) is no target
        answer = y[0][~masked][(~masked).nonzero()[:, 0] >= start]
        assert 0 < len(answer) < 0.5 * (len(ids) - start)  # the loss is on the answers only
        tasks_seen += 1
    assert tasks_seen >= 3


def _tasks_of_row(doc_ids, labels):
    """[start, end) of each synthetic task of one row: the documents whose labels are mostly
    IGNORE_INDEX (a corpus document's are all targets), leaving out a row's first piece of one
    token (a document's eos cut off by the row end, whose label is a task's bos)."""
    starts = [0] + [j for j in range(1, len(doc_ids)) if doc_ids[j] != doc_ids[j - 1]] + [len(doc_ids)]
    return [(a, b) for a, b in zip(starts, starts[1:])
            if (labels[a:b] == IGNORE_INDEX).float().mean() > 0.5 and (a, b) != (0, 1)]


def test_short_tasks_many_to_a_row_uncut_with_the_share_kept(tok, filler, corpus):
    loader = _mixed_loader(tok, filler, corpus)
    batches = _run(loader, [(3, 40)])
    state = loader.state_dict()["dp_rank_0"]
    total = state["corpus_tokens"] + state["long_tokens"] + state["synth_tokens"]
    assert abs(state["synth_tokens"] / total - 0.2) < 0.05
    lengths, rows_with_two = [], 0
    for x, y in batches:
        ids, doc_ids, labels = x["input"][0], x["doc_ids"][0], y[0]
        tasks = _tasks_of_row(doc_ids, labels)
        for a, b in tasks:
            # whole inside the row: its bos first, its eos the last input before the next
            # document or the row's last label (no target)
            assert ids[a] == tok.bos_id and (ids[b - 1] == tok.eos_id if b < len(ids) else labels[-1] == IGNORE_INDEX)
            assert (labels[a:b] != IGNORE_INDEX).sum() > 0  # answers to learn
            lengths.append(b - a + (b == len(ids)))  # the eos is the row's last label at its end
        rows_with_two += len(tasks) >= 2
    assert len(lengths) >= 20 and rows_with_two >= 3
    # within [shortest task, synthetic_max_length], or the rest of the row (< a shortest task more)
    assert min(lengths) >= 64 and max(lengths) <= 150 + 63
    assert len(set(lengths)) >= 10  # drawn, not one size
    with pytest.raises(ValueError, match="synthetic_max_length must be 0"):
        loader.set_stage(4, seq_len=600, local_batch_size=1, synthetic_fraction=0.1, synthetic_max_length=32)


def test_short_tasks_keep_a_high_share_beside_long_corpus_documents(tok, filler, corpus):
    # corpus documents of several rows each: a row left with a gap no task fits must not hand
    # the stream to the corpus (the share fell to a few percent of 0.8 that way)
    synthetic = SyntheticTasks(tok, filler, ["copy"], seed=3)
    loader = build_dataloader(tokenizer=tok, source="text", path=os.path.join(corpus, "long", "l*.txt"), split="train",
                              seq_len=100, local_batch_size=2, dp_rank=0, dp_world_size=1, seed=3, val_fraction=0.0,
                              synthetic=synthetic)
    loader.set_stage(0, seq_len=100, local_batch_size=2, synthetic_fraction=0.8, synthetic_max_length=64)
    it = iter(loader)  # 300 batches: the first rows are corpus documents, that the tasks then catch up on
    batches = [next(it) for _ in range(300)]
    state = loader.state_dict()["dp_rank_0"]
    assert abs(state["synth_tokens"] / (state["corpus_tokens"] + state["synth_tokens"]) - 0.8) < 0.05
    lengths = [b - a + (b == 100) for x, y in batches for r in range(2)
               for a, b in _tasks_of_row(x["doc_ids"][r], y[r])]
    assert min(lengths) >= 64 and max(lengths) <= 64 + 63 and len(lengths) > 60


def test_mixed_stream_resumes_exactly_across_stages(tok, filler, corpus):
    plan = [(0, 5), (1, 12), (2, 9), (3, 6)]
    reference = _run(_mixed_loader(tok, filler, corpus), plan)
    flat_plan = [s for s, n in plan for _ in range(n)]
    for cut in (3, 5, 6, 11, 17, 20, 28):
        first = _mixed_loader(tok, filler, corpus)
        done = []
        k = 0
        while k < cut:  # the batches before the cut, stage by stage
            stage = flat_plan[k]
            n = min(cut, flat_plan.index(stage) + flat_plan.count(stage)) - k
            done += _run(first, [(stage, n)])
            k += n
        state = first.state_dict()
        resumed = _mixed_loader(tok, filler, corpus)
        resumed.load_state_dict(state)
        rest_plan = []
        for stage in flat_plan[cut:]:
            if rest_plan and rest_plan[-1][0] == stage:
                rest_plan[-1] = (stage, rest_plan[-1][1] + 1)
            else:
                rest_plan.append((stage, 1))
        rest = _run(resumed, rest_plan)
        for (x, y), (xr, yr) in zip(done + rest, reference, strict=True):
            assert torch.equal(x["input"], xr["input"]) and torch.equal(y, yr)
            assert torch.equal(x["doc_ids"], xr["doc_ids"])


# ------------------------------------------------------------------- end to end
def _ladder_cli(tmp_path, *extra):
    cli = [a for a in TINY_CLI]
    for key in ("--training.seq_len", "--training.global_batch_size", "--training.local_batch_size"):
        i = cli.index(key)
        del cli[i : i + 2]
    cli.remove("--checkpoint.no_enable")
    return [sys.executable, "-m", "titan_moe.train", "--job.config_file", _write_config(tmp_path), *cli, *extra]


def _train(tmp_path, dump, *extra, env=None):
    cmd = _ladder_cli(tmp_path, "--job.dump_folder", str(dump), *extra)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**environment(), "OMP_NUM_THREADS": "1", **(env or {})})
    return proc


def _ladder_chain(root, *runs):
    """A function running `runs` (dump folder name, extra arguments, environment) one after
    the other under `root`: the list of their CompletedProcess."""

    def run():
        out = []
        for dump, extra, env in runs:
            config = root / f"{dump}_config"  # each chain writes its own copy of the config
            config.mkdir(exist_ok=True)
            out.append(_train(config, root / dump, *extra, env=env))
        return out
    return run


def start_runs(root):
    """Queue the uninterrupted ladder run, which CI checks and both resumes compare with (it
    also evaluates every 2 steps, the resumed runs do not: their equal losses show that the
    evaluations leave training as it was), and the run stopped by an unknown key
    (tests/tiny.py): (root folder, {"full": future of its runs' CompletedProcess, "unknown
    key": future of (its config, its CompletedProcess)})."""
    return root, start_all({"unknown key": lambda: _unknown_key_run(root / "unknown_key"),
                            "full": _ladder_chain(root, ("full", ["--ladder.eval_every", "2"], None))})


def start_slow_runs(root, ci_runs):
    """Queue the interrupted runs of the slow tests below, as `start_runs` (`ci_runs`, what
    `start_runs` returned, is not read here: conftest.py passes it to every file's)."""
    return root, start_all({
        # stopped inside stage 2 (step 5, after the checkpoint of step 4), then run again
        "split": _ladder_chain(root, ("split", ["--training.exit_at_step", "5"], None), ("split", [], None)),
        # killed inside the save of step 8, then run again
        "killed": _ladder_chain(root, ("killed", [], {"TITAN_MOE_KILL_DURING_SAVE_STEP": "8"}), ("killed", [], None)),
    })


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return started_runs(start_runs, tmp_path_factory)


@pytest.fixture(scope="module")
def slow_runs(runs, tmp_path_factory):  # after `runs`: the slow chains queue behind the CI ones
    return started_runs(start_slow_runs, tmp_path_factory, runs)


def test_ladder_runs_its_stages_with_evaluations_and_checkpoints(runs):
    """Three stages of three steps: each step at its stage's length, the evaluations at each
    stage's end and every 2 steps inside (`ladder.eval_every`, at the lengths so far), a
    checkpoint at each stage's end (besides the interval's)."""
    root, futures = runs
    full = root / "full"
    (proc,) = futures["full"].result()
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = proc.stdout + proc.stderr
    assert log.count("ladder: stage ") == 3 and "ladder: evaluations at the end of stage '256'" in log
    recs = records(full)
    assert [recs[s]["seq_len"] for s in range(1, 10)] == [64] * 3 + [128] * 3 + [256] * 3
    evals = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines() if "eval/passkey" in line]
    assert [(e["step"], e["seq_len"]) for e in evals] == [(2, 64), (3, 64), (4, 128), (6, 128), (8, 256), (9, 256)]
    assert "eval/passkey/128" in evals[2] and "eval/passkey/256" not in evals[2]
    assert "ladder: evaluations inside stage '128' (step 4, " in log
    assert "ladder: evaluations of stage '256': passkey at 64, 128, 256 done (" in log  # progress lines
    assert "ladder: evaluations of stage '256': held-out loss by position over 1 documents done (" in log
    assert "eval/passkey/256/d0.50" in evals[-1] and "eval/loss_by_pos/0-64" in evals[-1]
    assert all((full / "checkpoint" / f"step-{s}" / ".metadata").is_file() for s in (3, 6, 9))
    assert (full / "passkey_9.png").is_file()


@pytest.mark.slow  # four training processes, two at a time
def test_ladder_stopped_mid_stage_resumes_bit_identically(runs, slow_runs):
    """Stopped inside stage 2 (step 5, after the checkpoint of step 4), then run again: every
    step's loss equals the uninterrupted run's."""
    root, futures = slow_runs
    assert runs[1]["full"].result()[0].returncode == 0
    stopped, proc = futures["split"].result()
    assert stopped.returncode == 0, stopped.stderr[-4000:]
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Loading the checkpoint" in proc.stdout + proc.stderr
    reference, resumed = records(runs[0] / "full"), records(root / "split")
    assert sorted(resumed) == list(range(1, 10))
    for step in range(1, 10):
        assert resumed[step]["loss"] == reference[step]["loss"], step


@pytest.mark.slow
def test_ladder_killed_mid_stage_resumes_from_last_checkpoint(runs, slow_runs):
    root, futures = slow_runs
    assert runs[1]["full"].result()[0].returncode == 0
    crashed, proc = futures["killed"].result()
    assert crashed.returncode != 0
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "step-6" in proc.stdout + proc.stderr
    reference, resumed = records(runs[0] / "full"), records(root / "killed")
    for step in (7, 8, 9):
        assert resumed[step]["loss"] == reference[step]["loss"], step


def test_ladder_evaluations_under_context_parallelism_match_one_process(tmp_path):
    """The first stage (128-token rows, 3 steps, stopped at its end by
    `training.exit_at_step`) under CP2 evaluates whole rows through
    `context_parallel_scores_fn`: the stage-end held-out loss by position (and the task
    accuracies) are the one-process run's, where the whole rows given to the segment layers
    would be off (tests/test_context_parallel_model.py shows it on logits). The sharded
    (FSDP2 over the cp ranks) run then saves after the evaluations' forwards, which left the
    root's parameters gathered and failed the save, and saves step 3 once, not again for
    the exit."""
    stage = ["--ladder.stages.1.seq_len", "128", "--training.exit_at_step", "3", "--ladder.eval_loss_docs", "2"]
    out = {}
    for name, launcher in (("one", []), ("cp2", ["-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone"])):
        folder = tmp_path / name
        folder.mkdir()
        cmd = _ladder_cli(folder, "--job.dump_folder", str(folder / "run"), *stage)
        if launcher:
            cmd = [cmd[0], *launcher, *cmd[1:], "--parallelism.context_parallel_degree", "2"]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                              env={**environment(), "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert (proc.stdout + proc.stderr).count("Saving the checkpoint") == 2  # steps 2 (interval) and 3
        lines = (folder / "run" / "metrics.jsonl").read_text().splitlines()
        (out[name],) = [json.loads(line) for line in lines if "eval/loss_by_pos/0-64" in line]
    one, cp2 = out["one"], out["cp2"]
    assert sorted(one) == sorted(cp2) and one["step"] == 3
    for key in one:
        if key.startswith("eval/"):
            assert cp2[key] == pytest.approx(one[key], rel=1e-5), key


@pytest.mark.slow  # three training runs over two processes each
def test_ladder_changes_its_layout_at_a_stage_end(tmp_path):
    """Stopped at the first stage's end under FSDP2 over two ranks and run again under CP2
    (one data-parallel rank, two microbatches: the same global batch), the ladder continues:
    the same rows, losses of steps 4-9 as the uninterrupted FSDP2 run's up to the reduction
    order (measured: 9e-5 relative at most)."""
    stages = ["--ladder.stages.1.seq_len", "128", "--ladder.stages.1.local_batch_size", "2",
              "--ladder.stages.2.local_batch_size", "1", "--ladder.stages.3.global_batch_size", "2"]
    torchrun = ["-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone"]

    def run(name, *extra):
        folder = tmp_path / f"{name}_config"
        folder.mkdir(exist_ok=True)
        cmd = _ladder_cli(folder, "--job.dump_folder", str(tmp_path / name), *stages, *extra)
        proc = subprocess.run([cmd[0], *torchrun, *cmd[1:]], cwd=REPO, capture_output=True, text=True, timeout=600,
                              env={**environment(), "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-4000:]
        return proc.stdout + proc.stderr

    run("fsdp2")
    run("switched", "--training.exit_at_step", "3")
    log = run("switched", "--parallelism.context_parallel_degree", "2")
    assert "Applied context parallelism over 2 ranks" in log and "Loading the checkpoint" in log
    ref, got = records(tmp_path / "fsdp2"), records(tmp_path / "switched")
    assert sorted(got) == sorted(ref) == list(range(1, 10))
    for step in range(1, 10):
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-3 if step > 3 else 1e-7), step
