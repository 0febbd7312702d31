"""Hugging Face safetensors: our layout through torchtitan's own save and load, a training run
that saves last in HF and one that starts from it."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager, ModelWrapper

from tiny import TINY_ARGS, run_train
from titan_moe.hf.adapter import INDEX_FILE, TitanStateDictAdapter, finish_save, read_config
from titan_moe.hf.files import read_tensors, write_state_dict
from titan_moe.model.decoder import Decoder


def _model(seed: int) -> Decoder:
    torch.manual_seed(seed)
    model = Decoder(TINY_ARGS)
    model.init_weights()
    with torch.no_grad():  # the QB bias is a saved buffer; give it values too
        for name, buf in model.named_buffers():
            if name.endswith("expert_bias"):
                buf.normal_()
    return model


def _manager(model, adapter) -> SimpleNamespace:
    """What torchtitan's CheckpointManager.dcp_save / dcp_load read of their `self`."""
    return SimpleNamespace(sd_adapter=adapter, pg=None, states={MODEL: ModelWrapper(model)})


def test_round_trip_through_torchtitans_hf_save_and_load_is_bit_exact(tmp_path):
    saved = _model(0)
    # ~1 MB of fp32 weights in shards of at most 200 kB: several shards, whole layers each
    adapter = TitanStateDictAdapter(TINY_ARGS, None, max_shard_bytes=200_000)
    folder = str(tmp_path / "step-2")
    CheckpointManager.dcp_save(_manager(saved, adapter), ModelWrapper(saved).state_dict(), folder,
                               AsyncMode.DISABLED, to_hf=True)
    finish_save(folder, TINY_ARGS)

    files = sorted(os.listdir(folder))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert files == sorted(shards + [INDEX_FILE, "config.json"])  # the per-rank parts are gone
    index = json.loads((tmp_path / "step-2" / INDEX_FILE).read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert read_config(folder) == TINY_ARGS

    expected = saved.state_dict()
    # the files hold our tensors under their HF names (read without DCP)
    on_disk = read_tensors(folder)
    assert set(on_disk) == {"lm_head.weight"} | {"model." + n for n in expected if n != "output.weight"}
    assert torch.equal(on_disk["lm_head.weight"], expected["output.weight"])
    # every layer lies whole in one shard
    for layer in range(TINY_ARGS.n_layers):
        assert len({f for n, f in index["weight_map"].items() if n.startswith(f"model.layers.{layer}.")}) == 1

    loaded = _model(1)
    assert not torch.equal(loaded.state_dict()["output.weight"], expected["output.weight"])
    CheckpointManager.dcp_load(_manager(loaded, TitanStateDictAdapter(TINY_ARGS, None)),
                               ModelWrapper(loaded).state_dict(), folder, from_hf=True, from_quantized=False)
    got = loaded.state_dict()
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_files_writer_matches_the_trainers_layout(tmp_path):
    """The converter's writer (no DCP) gives a folder that torchtitan's HF reader loads."""
    saved = _model(2)
    folder = str(tmp_path / "written")
    write_state_dict(folder, TINY_ARGS, saved.state_dict(), max_shard_bytes=300_000)
    assert read_config(folder) == TINY_ARGS
    loaded = _model(3)
    CheckpointManager.dcp_load(_manager(loaded, TitanStateDictAdapter(TINY_ARGS, None)),
                               ModelWrapper(loaded).state_dict(), folder, from_hf=True, from_quantized=False)
    for name, tensor in saved.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_quantized_load_is_refused_in_one_sentence():
    adapter = TitanStateDictAdapter(TINY_ARGS, None)
    with pytest.raises(ValueError, match="import-k3"):
        adapter.get_hf_storage_reader(".", from_quantized=True)


@pytest.mark.slow
def test_training_saves_last_in_hf_and_a_new_run_starts_from_it(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    hf_last = ["--checkpoint.enable", "--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only"]
    proc = run_train(first, "--training.steps", "2", *hf_last)
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = first / "checkpoint" / "step-2"
    assert (saved / INDEX_FILE).is_file() and (saved / "config.json").is_file()
    assert not (saved / "sharded").exists()

    # One step at learning rate 0 from the HF save: the weights it saves are the ones it loaded
    # (only the QB expert bias moves, by the balancing step), not the seed's initialisation.
    proc = run_train(second, "--training.steps", "1", *hf_last, "--optimizer.lr", "0",
                     "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(saved))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loading from HF safetensors" in proc.stdout + proc.stderr
    before, after = read_tensors(str(saved)), read_tensors(str(second / "checkpoint" / "step-1"))
    assert set(before) == set(after)
    moved = sorted(n for n in before if not torch.equal(before[n], after[n]))
    assert moved == [f"model.layers.{i}.feed_forward.expert_bias" for i in range(1, TINY_ARGS.n_layers)]

    args = read_config(str(saved))  # the trained model (the shipped tokenizer's vocabulary)
    torch.manual_seed(0)  # the runs' debug.seed: the initialisation run 2 had before its load
    init = Decoder(args)
    init.init_weights()
    assert init.state_dict()["output.weight"].shape == after["lm_head.weight"].shape
    assert not torch.equal(init.state_dict()["output.weight"], after["lm_head.weight"])
