"""Train torchtitan's DeepSeek-V3 peer (profiling/peer_spec.py) with our trainer.

    torchrun --nproc_per_node=1 profiling/peer_train.py --job.config_file configs/small_1gpu.toml \
        --model.name titan_peer_dsv3 --validation.no_enable [--section.key value ...]

The same entry point as `python -m titan_moe.train` (config loading, device handling, the
`metrics.jsonl` log) with the peer specs registered; `--model.name` picks one of
`peer_spec.PEER_SPECS`, `--model.flavor` one of our flavors (mapped to DeepSeek-V3's args).
With `debug.seed` set, the peer's initial weights are built on the CPU from the seed (as the
trainer does for our model), so every layout starts from the same weights.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from titan_moe import train  # noqa: E402  (first: it points torchtitan at this process's device)

import peer_spec  # noqa: E402


def _init_peer_independent_of_layout(model_parts, model_args, seed: int) -> None:
    """`titan_moe.train._init_independent_of_layout` for the DeepSeek-V3 peer."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        with torch.device("cpu"):
            full = peer_spec.DeepSeekV3Model(model_args)
        full.init_weights()
    (model,) = model_parts
    set_model_state_dict(model, full.state_dict(), options=StateDictOptions(full_state_dict=True))


if __name__ == "__main__":
    peer_spec.register()
    train._init_independent_of_layout = _init_peer_independent_of_layout
    train.main()
