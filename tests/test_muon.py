"""Per-head Muon (SPEC §8): each block's update against torch.optim.Muon on that block alone,
the AdamW groups against torch.optim.AdamW, the block layout of our decoder, checkpoint
round trips through the train spec, and FSDP2 shards on two gloo ranks."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn
from torchtitan.config.job_config import Optimizer as OptimizerConfig
from torchtitan.distributed import ParallelDims

from gloo_ranks import spawn_gloo
from test_train_spec import _model
from tiny import losses, run_train, start_all, started_runs
from titan_moe.optim import Muon, block_layout
from titan_moe.optim.muon import COLS, EXPERTS, ROWS, WHOLE, to_blocks
from titan_moe.train_spec import build_optimizers_with_expert_balance

LR, WD = 0.02, 0.1


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# (shape, block_dim, block_size): row blocks (wide and tall heads), column blocks, whole, experts
LAYOUTS = [((48, 20), ROWS, 12), ((12, 40), ROWS, 3), ((20, 36), COLS, 12), ((30, 17), WHOLE, 0),
           ((3, 10, 24), EXPERTS, 1)]


@pytest.mark.parametrize("shape,block_dim,block_size", LAYOUTS)
def test_each_block_matches_torch_muon_on_that_block(shape, block_dim, block_size):
    gen = torch.Generator().manual_seed(sum(shape) + block_dim)
    p = nn.Parameter(torch.randn(shape, generator=gen))
    ours = Muon([{"params": [p], "muon": True, "block_dim": block_dim, "block_size": block_size}],
                lr=LR, weight_decay=WD)
    blocks = [nn.Parameter(b.clone()) for b in to_blocks(p.detach(), block_dim, block_size)]
    ref = torch.optim.Muon(blocks, lr=LR, weight_decay=WD, momentum=0.95, nesterov=True,
                           adjust_lr_fn="match_rms_adamw")
    start = p.detach().clone()
    for _ in range(3):  # fresh gradients each step: exercises the momentum buffer
        grad = torch.randn(shape, generator=gen)
        p.grad = grad.clone()
        for b, g in zip(blocks, to_blocks(grad, block_dim, block_size)):
            b.grad = g.clone()
        ours.step()
        ref.step()
    ours_delta = to_blocks(p.detach() - start, block_dim, block_size)
    for i, b in enumerate(blocks):
        ref_delta = b.detach() - to_blocks(start, block_dim, block_size)[i]
        # Both run NS in bf16; batched and single matmuls (and the norm) may round differently:
        # under one bf16 ulp (2^-8 = 3.9e-3) of the update (measured ~1.1e-3), far below a wrong
        # block layout or LR factor (those change the update by O(1)).
        assert _rel(ours_delta[i], ref_delta) < 4e-3, i


def test_adamw_groups_match_torch_adamw():
    gen = torch.Generator().manual_seed(7)
    p = nn.Parameter(torch.randn(6, 5, generator=gen))
    q = nn.Parameter(p.detach().clone())
    ours = Muon([{"params": [p]}], lr=1e-2, weight_decay=WD, betas=(0.9, 0.95), eps=1e-8)
    ref = torch.optim.AdamW([q], lr=1e-2, weight_decay=WD, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    for _ in range(4):
        grad = torch.randn(6, 5, generator=gen)
        p.grad, q.grad = grad.clone(), grad.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)  # same fp32 formula, op order may differ


def test_block_layout_of_the_decoder():
    model = _model()
    layout = block_layout(model)
    kda = next(m for m in model.modules() if type(m).__name__ == "KimiDeltaAttention")
    mla = next(m for m in model.modules() if type(m).__name__ == "GatedMLA")
    kname = next(n for n, m in model.named_modules() if m is kda)
    mname = next(n for n, m in model.named_modules() if m is mla)
    assert layout[f"{kname}.wq.weight"] == (ROWS, kda.head_dim)
    assert layout[f"{kname}.wo.weight"] == (COLS, kda.head_dim)
    assert layout[f"{kname}.w_f_down.weight"] == (WHOLE, 0)
    assert layout[f"{kname}.q_conv_weight"] is None and layout[f"{kname}.A_log"] is None
    assert layout[f"{mname}.w_ukv.weight"] == (ROWS, mla.qk_nope_dim + mla.v_head_dim)
    assert layout[f"{mname}.w_o.weight"] == (COLS, mla.v_head_dim)
    assert layout[f"{mname}.w_dq.weight"] == (WHOLE, 0)
    moe = [n for n in layout if n.endswith("experts.w_gate_up")]
    assert moe and all(layout[n] == (EXPERTS, 1) for n in moe)
    assert all(layout[n] is None for n in layout if n.endswith("router.weight"))
    assert layout["tok_embeddings.weight"] is None and layout["output.weight"] is None
    assert all(layout[n] is None for n, p in model.named_parameters() if p.ndim == 1)
    # every per-head matrix splits into exactly n_heads blocks
    for attn, name in ((kda, kname), (mla, mname)):
        for n, p in attn.named_parameters():
            spec = layout[f"{name}.{n}"]
            if spec is not None and spec[0] in (ROWS, COLS):
                assert to_blocks(p.detach(), *spec).shape[0] == attn.n_heads, n


def _dims():
    return ParallelDims(dp_shard=1, dp_replicate=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)


def _train_step(model, optimizers, seed):
    gen = torch.Generator().manual_seed(seed)
    optimizers.zero_grad()
    logits = model(torch.randint(0, 4096, (2, 64), generator=gen))
    logits.logsumexp(-1).mean().backward()
    optimizers.step()


def test_train_spec_builds_muon_keeps_balance_hook_and_resumes():
    config = OptimizerConfig(name="Muon", lr=3e-3, weight_decay=0.1)
    model = _model()
    optimizers = build_optimizers_with_expert_balance([model], config, _dims())
    (opt,) = optimizers.optimizers
    assert isinstance(opt, Muon)
    assert any(g["muon"] and g["block_dim"] == EXPERTS for g in opt.param_groups)
    n_params = sum(len(g["params"]) for g in opt.param_groups)
    assert n_params == len(list(model.parameters()))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _train_step(model, optimizers, 0)
    assert optimizers.expert_balance_stats  # the expert-balance pre-hook still runs
    # every parameter with a gradient moved (AttnRes queries start at zero and get none yet)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) == (p.grad is None or not p.grad.any()), n

    # resume: a fresh model and optimizer loaded from (model, optimizer) state continue identically
    state = copy.deepcopy(optimizers.state_dict())  # a save/load round trip shares no tensors
    assert any(k.endswith("momentum_buffer") for k in state) and any(k.endswith("exp_avg_sq") for k in state)
    model2 = _model()
    model2.load_state_dict(model.state_dict())
    optimizers2 = build_optimizers_with_expert_balance([model2], config, _dims())
    optimizers2.load_state_dict(state)
    _train_step(model, optimizers, 1)
    _train_step(model2, optimizers2, 1)
    for (n, p), p2 in zip(model.named_parameters(), model2.parameters()):
        torch.testing.assert_close(p2, p, rtol=0, atol=0, msg=n)


# --------------------------------------------------------------------------- FSDP2, two gloo ranks
class _Toy(nn.Module):
    """One parameter per block layout, sized so that dim-0 shards over 2 ranks are aligned for
    ``aligned`` (24 rows, heads of 4: 12 rows a rank) and cut a head in two for ``split``."""

    LAYOUT = {"aligned": (ROWS, 4), "split": (ROWS, 8), "cols": (COLS, 5), "whole": (WHOLE, 0),
              "experts": (EXPERTS, 1), "vec": None}

    def __init__(self):
        super().__init__()
        self.aligned = nn.Parameter(torch.randn(24, 10))
        self.split = nn.Parameter(torch.randn(24, 10))  # 12 rows a rank cut the second head of 8
        self.cols = nn.Parameter(torch.randn(14, 15))
        self.whole = nn.Parameter(torch.randn(9, 13))
        self.experts = nn.Parameter(torch.randn(4, 6, 10))
        self.vec = nn.Parameter(torch.randn(11))


def _toy_groups(toy):
    groups = []
    for name, spec in _Toy.LAYOUT.items():
        p = getattr(toy, name)
        groups.append({"params": [p]} if spec is None else
                      {"params": [p], "muon": True, "block_dim": spec[0], "block_size": spec[1]})
    return groups


def _toy_grads(step):
    gen = torch.Generator().manual_seed(100 + step)
    toy = _Toy()
    return {n: torch.randn(p.shape, generator=gen) for n, p in toy.named_parameters()}


def _toy_reference(steps):
    torch.manual_seed(0)
    toy = _Toy()
    opt = Muon(_toy_groups(toy), lr=LR, weight_decay=WD)
    for step in range(steps):
        for n, p in toy.named_parameters():
            p.grad = _toy_grads(step)[n]
        opt.step()
    return {n: p.detach() for n, p in toy.named_parameters()}


def _fsdp_rank(rank, world, steps, expected):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    torch.manual_seed(0)
    toy = _Toy()
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(toy, mesh=mesh)
    opt = Muon(_toy_groups(toy), lr=LR, weight_decay=WD)
    for step in range(steps):
        grads = _toy_grads(step)
        for n, p in toy.named_parameters():
            p.grad = distribute_tensor(grads[n], mesh, p.placements)
        opt.step()
    for n, p in toy.named_parameters():
        # NS runs in bf16 on a shard or on the gathered matrix: the same blocks, the same ops
        torch.testing.assert_close(p.full_tensor(), expected[n], rtol=0, atol=1e-6, msg=n)


@pytest.mark.slow
def test_fsdp2_shards_match_single_process(tmp_path):
    os.environ["OMP_NUM_THREADS"] = "1"
    steps = 2
    spawn_gloo(_fsdp_rank, 2, tmp_path, steps, _toy_reference(steps))


class _Experts(nn.Module):
    def __init__(self, n_experts: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n_experts, 6, 10))


def _expert_grads(n_experts, step):
    return torch.randn(n_experts, 6, 10, generator=torch.Generator().manual_seed(200 + step))


def _experts_reference(n_experts, steps):
    torch.manual_seed(0)
    experts = _Experts(n_experts)
    opt = Muon([{"params": [experts.w], "muon": True, "block_dim": EXPERTS, "block_size": 1}], lr=LR, weight_decay=WD)
    for step in range(steps):
        experts.w.grad = _expert_grads(n_experts, step)
        opt.step()
    return experts.w.detach()


def _ep_fsdp_rank(rank, world, n_experts, ep, steps, expected):
    """Experts as the trainer shards them: EP's Shard(0) over "ep", then FSDP2 over "efsdp"
    (dim 0, FSDP's _StridedShard, while efsdp * ep <= E; else dim 1)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    import titan_moe.optim.muon as muon

    efsdp = world // ep
    mesh = init_device_mesh("cpu", (efsdp, ep), mesh_dim_names=("efsdp", "ep"))
    torch.manual_seed(0)
    experts = _Experts(n_experts)
    experts.w = nn.Parameter(distribute_tensor(experts.w.data, mesh["ep"], [Shard(0)]))
    fully_shard(experts, mesh=mesh["efsdp"],
                shard_placement_fn=(lambda p: Shard(1)) if efsdp * ep > n_experts else None)
    seen = []
    original = muon.block_update
    muon.block_update = lambda u, *a: seen.append(tuple(u.shape)) or original(u, *a)  # this process only
    opt = Muon([{"params": [experts.w], "muon": True, "block_dim": EXPERTS, "block_size": 1}], lr=LR, weight_decay=WD)
    for step in range(steps):
        experts.w.grad = distribute_tensor(_expert_grads(n_experts, step), experts.w.device_mesh,
                                           experts.w.placements)
        opt.step()
    torch.testing.assert_close(experts.w.full_tensor(), expected, rtol=0, atol=1e-6)
    # each rank orthogonalizes its own E / ep experts, never the layer's E
    assert seen == [(n_experts // ep, 6, 10)] * steps, seen


@pytest.mark.parametrize("n_experts", [4, 2])  # FSDP on dim 0 (strided over EP) / on dim 1
def test_ep_and_fsdp_experts_orthogonalize_their_own_experts(tmp_path, n_experts):
    os.environ["OMP_NUM_THREADS"] = "1"
    steps = 2
    spawn_gloo(_ep_fsdp_rank, 4, tmp_path, n_experts, 2, steps, _experts_reference(n_experts, steps))


# --------------------------------------------------------------------------- through the trainer
MUON_RESUME = ["--training.steps", "5", "--checkpoint.enable", "--checkpoint.interval", "3", "--optimizer.name",
               "Muon"]


def _chain(root, *runs):
    return lambda: [run_train(root / name, *args, nproc=nproc) for name, args, nproc in runs]


MUON_LAYOUTS = {"fsdp": ([], 2), "fsdp_ep": (["--parallelism.expert_parallel_degree", "2"], 2)}


MUON_ONE = ["--training.steps", "3", "--optimizer.name", "Muon"]


def _layout_run(root, name):
    args, nproc = MUON_LAYOUTS[name]
    return _chain(root, (name, [*MUON_ONE, *args], nproc))


def start_runs(root):
    """Queue the one-process trainer run with Muon, the one CI runs (tests/tiny.py): (root
    folder, name -> future of the list of its runs' CompletedProcess). It saves its last step
    (saving does not change what it computes)."""
    return root, start_all({"one": _chain(root, ("one", [*MUON_ONE, "--checkpoint.enable", "--checkpoint.interval",
                                                          "3"], 1))})


def start_slow_runs(root, ci_runs):
    """Queue the runs that only the slow tests below read, as `start_runs` (`ci_runs`, what
    `start_runs` returned, is not read here: conftest.py passes it to every file's)."""
    chains = {name: _layout_run(root, name) for name in ("fsdp", "fsdp_ep")}
    chains["split"] = _chain(root, ("split", [*MUON_RESUME, "--training.exit_at_step", "3"], 1),
                             ("split", MUON_RESUME, 1))
    chains["full"] = _chain(root, ("full", MUON_RESUME, 1))
    return root, start_all(chains)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return started_runs(start_runs, tmp_path_factory)


@pytest.fixture(scope="module")
def slow_runs(runs, tmp_path_factory):  # after `runs`: the slow chains queue behind the CI ones
    return started_runs(start_slow_runs, tmp_path_factory, runs)


def test_trainer_trains_with_muon(runs):
    """`--optimizer.name Muon` through the trainer, one process: the loss falls over three
    steps, and the checkpoint of step 3 holds Muon's momentum for the per-head matrices and
    AdamW's moments, not momentum, for the embedding."""
    from torch.distributed.checkpoint import FileSystemReader

    root, futures = runs
    (proc,) = futures["one"].result()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    got = losses(root / "one")
    assert sorted(got) == [1, 2, 3] and got[3] < got[1]
    keys = set(FileSystemReader(str(root / "one" / "checkpoint" / "step-3")).read_metadata().state_dict_metadata)
    state = "optimizer.state.{}.{}"
    assert state.format("layers.0.attention.wq.weight", "momentum_buffer") in keys
    assert state.format("layers.0.attention.wq.weight", "exp_avg_sq") not in keys
    assert state.format("tok_embeddings.weight", "exp_avg_sq") in keys
    assert state.format("tok_embeddings.weight", "momentum_buffer") not in keys


@pytest.mark.slow
def test_trainer_with_muon_matches_across_fsdp_and_ep_layouts(runs, slow_runs):
    """`--optimizer.name Muon` trains the (narrowed) debug config in one process, on 2 FSDP
    ranks and on 2 FSDP+EP ranks to the same losses. In FSDP the 2-head projections (16 rows a
    head, 32 rows: one head a rank) are orthogonalized on their shard, the column blocks and
    whole matrices gathered; under EP each rank holds whole experts."""
    got = {}
    for name, (root, futures) in (("one", runs), ("fsdp", slow_runs), ("fsdp_ep", slow_runs)):
        (proc,) = futures[name].result()
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        got[name] = losses(root / name)
    for name in ("fsdp", "fsdp_ep"):
        # the gradients differ by fp32 summation order only; NS in bf16 can round a few
        # elements differently (one bf16 ulp, 0.4%), far below a wrong block or shard (O(1))
        for step in (1, 2, 3):
            assert got[name][step] == pytest.approx(got["one"][step], rel=1e-4), (name, step)


@pytest.mark.slow
def test_trainer_resumes_muon_bit_identically(slow_runs):
    """A DCP checkpoint at step 3 holds Muon's momentum buffers and the AdamW moments: the
    resumed run continues with the very losses of an uninterrupted one (the same ops on the
    same values, so exact equality)."""
    root, futures = slow_runs
    for proc in futures["full"].result() + futures["split"].result():
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    reference, resumed = losses(root / "full"), losses(root / "split")
    assert sorted(resumed) == [1, 2, 3, 4, 5]
    for step in (4, 5):
        assert resumed[step] == reference[step], (step, resumed[step], reference[step])
