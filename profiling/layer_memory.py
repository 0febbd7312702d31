"""Measured memory of one decoder layer of each kind on the GPU, beside `titan_moe.plan`'s model.

    python profiling/layer_memory.py [--flavor small_1gpu] [--seq-lens 8192,32768]

For the first layer of each kind (KDA/MLA x dense/MoE) of the flavor, built on the GPU with
random weights in fp32 and run as training runs it (CUDA autocast to bf16, one packed row of
T tokens in two documents, the AttnRes stream started from a `[1, T, D]` fp32 embedding):

* kept: allocated bytes after the forward minus before it, less the layer's output stream
  tensors (what autograd holds from the forward to the backward, without AC);
* backward: the peak allocated during `backward()` above the bytes allocated when it
  starts (the layer's transient workspace, gradients of its inputs included);
* full AC: the same layer under `torch.utils.checkpoint` (non-reentrant, as torchtitan's
  full AC): the peak during backward above its start, which holds the recompute (kept) and
  the transient together.

All three divided by the tokens. The planner's numbers for the same kind are printed beside:
its kept bytes (eager profile + T^2 term), its backward transient and its full-AC backward
(`LayerActivations.transient_at` / `full_ac_backward_at`; these leave out the incoming stream
gradient, about 4 KiB per token at small_1gpu's width, which the step walk counts apart).
Parameter gradients are excluded (`.grad` is set to None by a hook before accumulation
would allocate; the planner counts gradients separately). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torch.utils.checkpoint import checkpoint

from titan_moe.flavors import FLAVORS
from titan_moe.model.attn_res import ResidualStream
from titan_moe.model.decoder import DecoderLayer
from titan_moe.model.packing import cu_seqlens_from_doc_ids
from titan_moe.plan.activations import model_activations
from titan_moe.plan.layout import Layout, Precision

MIB = 2**20


def _stream(args, T: int, device) -> ResidualStream:
    embed_BTD = torch.randn(1, T, args.dim, device=device, requires_grad=True)
    return ResidualStream.start(embed_BTD, args.attn_res, args.n_layers, args.attn_res_block_size)


def _drop_param_grads(layer: torch.nn.Module) -> list:
    """Post-accumulate hooks that free each parameter's gradient as soon as it is formed."""
    def free(p):
        p.grad = None
    return [p.register_post_accumulate_grad_hook(free) for p in layer.parameters()]


def measure(layer: DecoderLayer, args, T: int, full_ac: bool) -> dict:
    device = torch.device("cuda")
    doc_ids_BT = torch.zeros(1, T, dtype=torch.int32, device=device)
    doc_ids_BT[:, T // 3:] = 1
    cu_seqlens = cu_seqlens_from_doc_ids(doc_ids_BT)
    stream = _stream(args, T, device)
    probe_BTD = torch.randn(1, T, args.dim, device=device)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()

    def run(*tensors):
        return layer(tensors, doc_ids_BT=doc_ids_BT, cu_seqlens=cu_seqlens)

    with torch.autocast("cuda", dtype=torch.bfloat16):
        if full_ac:
            out = checkpoint(run, *stream.tensors(), use_reentrant=False)
        else:
            out = run(*stream.tensors())
    out_bytes = sum(t.untyped_storage().nbytes() for t in torch.utils._pytree.tree_leaves(out)
                    if isinstance(t, torch.Tensor) and t.is_floating_point())
    loss = (out[2].float() * probe_BTD).sum()
    torch.cuda.synchronize()
    after_fwd = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del out, loss
    return {"kept": (after_fwd - before - out_bytes) / T, "backward": (peak - after_fwd) / T}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flavor", default="small_1gpu", choices=sorted(FLAVORS))
    parser.add_argument("--seq-lens", default="8192,32768")
    opts = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("layer_memory: needs a CUDA device", file=sys.stderr)
        return 2
    args = FLAVORS[opts.flavor]
    prec = Precision(param=4, compute=2, reduce=4)
    planned = model_activations(args, prec, Layout(1, 1, 1, 1), activations="eager")
    rows = []
    seen = set()
    for i, kind in enumerate(args.layer_kinds()):
        key = (kind, args.is_moe_layer(i))
        if key in seen:
            continue
        seen.add(key)
        torch.manual_seed(i)
        layer = DecoderLayer(i, args).cuda().train()
        layer.init_weights(0.02)
        hooks = _drop_param_grads(layer)
        plan = planned[i]
        for T in [int(s) for s in opts.seq_lens.split(",")]:
            none = measure(layer, args, T, full_ac=False)
            full = measure(layer, args, T, full_ac=True)
            kept_plan = plan.kept + plan.per_seq_sq * T
            rows.append({
                "kind": plan.kind, "layer": i, "T": T,
                "kept": none["kept"], "backward": none["backward"], "full_ac_backward": full["backward"],
                "plan_kept": kept_plan, "plan_transient": plan.transient_at(T, T * T) / T,
                "plan_full_ac_backward": plan.full_ac_backward_at(T, T * T) / T,
            })
            r = rows[-1]
            print(f"{kind}{'+moe' if key[1] else '+dense'} layer {i} T={T}: KiB/token measured kept "
                  f"{r['kept'] / 1024:.1f} backward {r['backward'] / 1024:.1f} full-AC backward "
                  f"{r['full_ac_backward'] / 1024:.1f} | planned kept {kept_plan / 1024:.1f} transient "
                  f"{r['plan_transient'] / 1024:.1f} full-AC {r['plan_full_ac_backward'] / 1024:.1f}", flush=True)
            torch.cuda.empty_cache()
        for h in hooks:
            h.remove()
        del layer
        torch.cuda.empty_cache()
    print(json.dumps({"flavor": opts.flavor, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
