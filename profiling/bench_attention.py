"""MLA attention over packed documents on one GPU: each path beside causal SDPA over one
document of the same length (the bound), at MLA's head dims, bf16, forward and
forward+backward.

    python profiling/bench_attention.py --seq-lens 32768 131072 [--heads 8] [--json OUT.json]

Rows per length: document mixes {T} (one document), {T-1, 1}, {T/2, T/2} and the first
row of the built-in corpus packed at T. Paths: "varlen" (the model's CUDA default: torch's
varlen_attn, FlashAttention-2, v padded to the qk dim), "dense" (SDPA with the [B, 1, T, T]
mask; skipped above --dense-max), the bound "causal_sdpa" (SDPA is_causal over one
document; cuDNN where torch picks it). Each document-masked path's o and dq are compared
with the exact chunked op's (err_o, err_dq). With --fresh-rows N: fwd+bwd per batch over N
successive corpus batches, twice (`fresh_rows`). TFLOP/s count the work the mask leaves: per row sum over documents of l^2/2 query-key pairs, times
2 * (qk + v) FLOPs forward and 2.5x that backward. Peak memory is the allocator's peak
during forward+backward, minus the inputs.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from titan_moe.model.packing import cu_seqlens_from_doc_ids
from titan_moe.ops.attention import doc_attention_chunked, doc_starts
from titan_moe.ops.attention.varlen import varlen_causal


def corpus_doc_ids(T: int) -> torch.Tensor:
    """The doc ids [1, T] of the first training row of the built-in corpus at T."""
    return corpus_batches(T, 1, 1)[0]


def ids_from_lengths(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])[None]


def doc_lengths(ids_1T: torch.Tensor) -> list[int]:
    return torch.unique_consecutive(ids_1T[0], return_counts=True)[1].tolist()


def masked_flops(lengths: list[int], H: int, K: int, V: int) -> tuple[float, float]:
    pairs = sum(n * (n + 1) / 2 for n in lengths)
    fwd = 2 * pairs * H * (K + V)
    return fwd, 3.5 * fwd


def time_ms(fn, warmup: int = 3, reps: int = 10) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def bench_row(name: str, ids_1T: torch.Tensor, H: int, K: int, V: int, dense_max: int, paths: list[str]) -> list[dict]:
    T = ids_1T.shape[1]
    dev = "cuda"
    scale = K**-0.5
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k = (torch.randn(1, H, T, K, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    v = torch.randn(1, H, T, V, device=dev, dtype=torch.bfloat16, generator=gen)
    do = torch.randn(1, H, T, V, device=dev, dtype=torch.bfloat16, generator=gen)
    ids = ids_1T.to(dev)
    lengths = doc_lengths(ids_1T)
    fwd_flops, fb_flops = masked_flops(lengths, H, K, V)
    one_fwd, one_fb = masked_flops([T], H, K, V)
    results = []
    # the exact chunked op (fp32 softmax) as every path's correctness reference
    qr = q.detach().clone().requires_grad_()
    o_ref = doc_attention_chunked(qr, k, v, doc_starts(ids), scale)
    reference = {"o": o_ref.detach().float(), "dq": torch.autograd.grad(o_ref, qr, do)[0].float()}
    del qr, o_ref

    def make(path: str):
        if path == "causal_sdpa":
            return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale), one_fwd, one_fb
        if path == "dense":
            from titan_moe.model.packing import same_doc_causal_mask

            m = same_doc_causal_mask(ids)
            return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale), fwd_flops, fb_flops
        if path == "varlen":
            cu = cu_seqlens_from_doc_ids(ids)
            max_len = max(lengths)

            def run(q, k, v):
                o = varlen_causal(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, max_len, scale)
                return o.transpose(0, 1)[None]

            return run, fwd_flops, fb_flops
        raise ValueError(path)

    for path in paths:
        if path == "dense" and T > dense_max:
            continue
        row = {"row": name, "T": T, "docs": len(lengths), "path": path}
        try:
            fn, f_fwd, f_fb = make(path)
            qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))

            def fwd():
                with torch.no_grad():
                    fn(q, k, v)

            def fwd_bwd():
                o = fn(qg, kg, vg)
                torch.autograd.grad(o, (qg, kg, vg), do)

            # correctness beside the timing: o and dq against the chunked op's
            o = fn(qg, kg, vg)
            grads = torch.autograd.grad(o, (qg, kg, vg), do)
            if path != "causal_sdpa":
                def rel(a, b):
                    return ((a.float() - b).norm() / b.norm()).item()

                row.update(err_o=round(rel(o.detach(), reference["o"]), 5), err_dq=round(rel(grads[0], reference["dq"]), 5))
            del o, grads
            ms_f = time_ms(fwd)
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            ms_fb = time_ms(fwd_bwd)
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            row.update(fwd_ms=round(ms_f, 3), fwd_bwd_ms=round(ms_fb, 3),
                       fwd_tflops=round(f_fwd / ms_f / 1e9, 1), fwd_bwd_tflops=round(f_fb / ms_fb / 1e9, 1),
                       peak_gib=round(peak, 3))
        except Exception as e:  # a path that fails is reported, the others still run
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print(json.dumps(row), flush=True)
        results.append(row)
    return results


def corpus_batches(T: int, B: int, n: int) -> list[torch.Tensor]:
    """The doc ids [B, T] of the first n training batches of the built-in corpus at T."""
    from titan_moe.config import load_config
    from titan_moe.data.from_config import dataloader_from_config, tokenizer_from_config

    config = load_config(["--job.config_file", "configs/small_1gpu.toml", "--training.seq_len", str(T),
                          "--training.local_batch_size", str(B)])
    loader = dataloader_from_config(config, tokenizer=tokenizer_from_config(config), split="train", dp_rank=0, dp_world_size=1)
    out = []
    for batch, _ in loader:
        out.append(batch["doc_ids"].to(torch.int32))
        if len(out) == n:
            return out
    return out


def fresh_rows(T: int, B: int, n: int, H: int, K: int, V: int, paths: list[str]) -> list[dict]:
    """fwd+bwd wall time per batch over n successive corpus batches [B, T], as training meets
    them (every batch new), then the same batches again: a path whose first pass is much slower
    pays a per-shape cost (a cuDNN call per document, tried and removed, built an execution
    plan per new document length: docs/LOG.md)."""
    import time

    dev, scale = "cuda", K**-0.5
    batches = corpus_batches(T, B, n)
    gen = torch.Generator(device=dev).manual_seed(0)
    # the model's layout: [B, T, H, K] projections viewed as [B, H, T, K]
    q, k = (torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16, generator=gen).transpose(1, 2) for _ in range(2))
    v = torch.randn(B, T, H, V, device=dev, dtype=torch.bfloat16, generator=gen).transpose(1, 2)
    do = torch.randn(B, H, T, V, device=dev, dtype=torch.bfloat16, generator=gen)
    results = []
    for path in paths:
        for rep in range(2):
            times, docs = [], 0
            for ids_BT in batches:
                ids = ids_BT.to(dev)
                qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if path == "dense":
                    from titan_moe.model.packing import same_doc_causal_mask

                    o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=same_doc_causal_mask(ids), scale=scale)
                elif path == "varlen":
                    cu = cu_seqlens_from_doc_ids(ids)  # every row's first token starts a document
                    max_len = int((cu[1:] - cu[:-1]).max())
                    docs += cu.numel() - 1

                    def thd(x):
                        return x.transpose(1, 2).reshape(B * T, H, x.shape[-1])

                    o_thd = varlen_causal(thd(qg), thd(kg), thd(vg), cu, max_len, scale)
                    o = o_thd.reshape(B, T, H, V).transpose(1, 2)
                else:
                    raise ValueError(path)
                torch.autograd.grad(o, (qg, kg, vg), do)
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
            row = {"fresh_rows": path, "T": T, "B": B, "pass": rep + 1, "batches": len(batches),
                   "docs_per_batch": round(docs / len(batches), 1),
                   "first_ms": round(times[0], 1), "median_ms": round(sorted(times)[len(times) // 2], 1),
                   "total_ms": round(sum(times), 1)}
            print(json.dumps(row), flush=True)
            results.append(row)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[32768])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--qk-dim", type=int, default=192)
    p.add_argument("--v-dim", type=int, default=128)
    p.add_argument("--paths", nargs="+", default=["causal_sdpa", "varlen", "dense"],
                   help="of causal_sdpa, varlen, dense")
    p.add_argument("--dense-max", type=int, default=32768, help="longest T for the dense-mask path")
    p.add_argument("--json", default="")
    p.add_argument("--fresh-rows", type=int, default=0, metavar="N",
                   help="instead: fwd+bwd per corpus batch over N successive batches, twice (fresh_rows)")
    p.add_argument("--batch", type=int, default=1, help="rows per batch with --fresh-rows")
    a = p.parse_args()
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    out = []
    if a.fresh_rows:
        for T in a.seq_lens:
            for path in a.paths:
                try:
                    out += fresh_rows(T, a.batch, a.fresh_rows, a.heads, a.qk_dim, a.v_dim, [path])
                except Exception as e:  # a path that fails is reported, the others still run
                    print(json.dumps({"fresh_rows": path, "T": T, "error": f"{type(e).__name__}: {str(e)[:300]}"}),
                          flush=True)
        a.seq_lens = []
    for T in a.seq_lens:
        rows = {"one_doc": ids_from_lengths([T]), "T-1,1": ids_from_lengths([T - 1, 1]),
                "half,half": ids_from_lengths([T // 2, T - T // 2]), "corpus": corpus_doc_ids(T)}
        for name, ids in rows.items():
            out += bench_row(name, ids, a.heads, a.qk_dim, a.v_dim, a.dense_max, a.paths)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
