#!/usr/bin/env bash
# The GPU checks in one command: GPU tests, kernel benchmarks and short training runs, each
# under its own time limit, every output in its own file under OUT (written as it runs, so a
# run cut short keeps what it finished). Ends with OUT/summary.txt: one line per section
# with its exit code and seconds.
#
#   bash profiling/gpu_suite.sh OUT [SECTION ...]
#
# Sections (default: all that the GPU count allows, in this order):
#   tests      pytest -m gpu in two runs, each under its own limit (together they take about
#              9 minutes on the H200): tests_kernels (the kernels against their references) and
#              tests_compile (Inductor layer compiles and CUDA export, test_compile_inductor.py
#              and test_export.py)
#   kda        profiling/bench_kda.py: our op at the shapes, with the backward recomputing
#              the forward's intermediates (TITAN_MOE_KDA_KEEP=0) and the old classic walk
#   kda_tune   profiling/bench_kda.py at 32K and 8 x 4K: launch configurations of the state
#              walks (BVxWARPS), the whole-chunk backward (TITAN_MOE_KDA_BWD_CHUNK), the
#              output kernel (TITAN_MOE_KDA_OUTPUT), the per-tile kernels' warps
#              (TITAN_MOE_KDA_TILE_WARPS) and the walks' pipeline stages (TITAN_MOE_KDA_SCAN_STAGES)
#              (not in the default list)
#   kda_caps   profiling/bench_kda.py at 32K and 8 x 4K: the register caps of the backward's
#              whole-chunk kernels (TITAN_MOE_KDA_BWD_MAXNREG; default 128x128x168) beside no caps
#              and beside the keys kernel uncapped, the backward intra kernel's cap
#              (TITAN_MOE_KDA_BWD_INTRA_MAXNREG; default 96) beside none, 128, 104, 88 and 80, and
#              the forward A-tile kernel's (TITAN_MOE_KDA_INTRA_MAXNREG; default 96) beside none and
#              80 (not in the default list)
#   kda_intra  profiling/bench_kda.py at 32K and 8 x 4K: the backward intra kernel's key columns
#              per program (TITAN_MOE_KDA_BWD_INTRA_BK) and warps (TITAN_MOE_KDA_TILE_WARPS' last
#              value) beside the default 64 x 4 (not in the default list)
#   kda_keys   profiling/bench_kda.py at 32K and 8 x 4K: the keys kernel's launch
#              (TITAN_MOE_KDA_BWD_CHUNK) beside the default, 64 key columns per program at 8 warps
#              with the chunk's q, k, G loaded after the value loop: all 128 key columns at 16
#              warps (the earlier default), with 32 value columns, at 8 warps, and with early
#              loads (TITAN_MOE_KDA_KEYS_LOADS=early) (not in the default list)
#   kda_bwd_tma  the KDA GPU tests with the keys and values kernels' loads through TMA
#              descriptors (TITAN_MOE_KDA_BWD_TMA=all), then profiling/bench_kda.py at 32K and 8 x 4K:
#              pointer loads in both (none), the keys kernel's TMA loads, and both, beside the
#              default (values) (not in the default list)
#   kda_forms  the forward's A tiles by column tile (TITAN_MOE_KDA_INTRA, the default columns32x4)
#              against the row-tile kernel (tiles) and other launches: their GPU tests, then
#              profiling/bench_kda.py at 32K and 8 x 4K (not in the default list)
#   kda_dakk   profiling/bench_kda.py at 32K and 8 x 4K: dA_kk formed in the values kernel with tf32
#              dots (TITAN_MOE_KDA_DAKK, the default) beside the inverse form and tf32x3 dots (their
#              tests: kda_verify) (not in the default list)
#   kda_parts  profiling/bench_kda.py at 32K and 8 x 4K: the default (bf16 dq / dk partials, 64 key
#              columns at 8 warps, late loads) beside fp32 partials (TITAN_MOE_KDA_BWD_PARTS), 128 key
#              columns at 16 warps, early loads, and the previous default (fp32, 128 columns)
#              (their tests: kda_verify) (not in the default list)
#   kda_verify the KDA GPU tests (-m gpu: float64 references, fla beside them, kept against
#              recomputed, input maps, scans) and the kernel-form tests compiled on the GPU (dA_kk
#              forms, bf16 partials, the keys and intra launches, autograd) (not in the default list)
#   kda_long   the long-context KDA GPU tests (tests/test_kda_long_context.py: 32K and 128K in bf16
#              against our chunked path in fp32 and fla, 128K with g = g_min); also run by
#              kda_verify (not in the default list)
#   kda_paired the backward intra kernel's paired form with tf32 dots (the default): its GPU tests (the
#              long-context ones included), its errors beside the anchored form
#              (TITAN_MOE_KDA_BWD_INTRA_FORM=anchored) in tf32x3 (the earlier default) and in plain tf32
#              (profiling/kda_grad_errors.py, also at g = g_min), and their timing at 32K and 8 x 4K
#              (not in the default list)
#   kda_fla_paired  kda_fla_all with the paired form and tf32 dots named (today's defaults) (not in
#              the default list)
#   kda_fla_all  profiling/bench_kda.py --kernels 8 at the four shapes ($SUITE_KDA_SHAPES: the
#              sequence lengths to keep) with fla in the same run (its autotuning results: see
#              TRITON_CACHE_DIR below) (not in the default list)
#   gemm_default  10 eager training steps of small_1gpu with the grouped GEMM's default backend
#              (auto), then the same with TITAN_MOE_GROUPED_MM_BACKEND=native (not in the default list)
#   kda_prepare  profiling/bench_kda.py at 32K and 8 x 4K: the input maps' chunk mode
#              (TITAN_MOE_KDA_PREPARE_CHUNK, FWD,BWD): the default split64 forward, fused backward,
#              beside fused and split32 / split64 in both (not in the default list)
#   kda_ncu    Nsight Compute on one warm forward and one forward+backward call of our op at 32K
#              ($SUITE_NCU_SHAPES): kda_ncu_details.csv, kda_ncu_raw.csv and, from them,
#              kda_ncu_table.txt (profiling/ncu_table.py: per kernel time, DRAM and SM throughput,
#              occupancy, stall reasons) (not in the default list)
#   kda_fla    profiling/bench_kda.py --kernels 6: ours against fla in the same run (fla's
#              autotuning takes minutes on a fresh machine)
#   kda_graphs profiling/bench_kda.py --cuda-graphs at 8K and 32K: ours and fla, each also
#              replayed from a CUDA graph (the host's share of each call) (not in the default list)
#   moe        profiling/bench_moe.py --dispatch: grouped GEMM, fp8 providers, MoE layer, dispatch
#   gemm_tma   the grouped GEMM and MoE tests (compiled on the GPU) with TITAN_MOE_GROUPED_MM_TMA=1:
#              the TMA loads in autograd's backward thread, where a thread with no CUDA context
#              once failed to encode descriptors (not in the default list)
#   gemm_tiles profiling/bench_moe.py --sweep-tiles at E = 64 (balanced, Zipf 1.1): each Triton
#              product (forward, TMA forward, dx, dw) over tile candidates beside
#              torch._grouped_mm on the same product, then (gemm_best) the whole op with the
#              winners (--best-tiles) in $TITAN_MOE_GROUPED_MM_TILES (not in the default list)
#   train      small_1gpu eager and compiled, 30 steps each (tokens/s, memory)
#   train_ep   small_1gpu FSDP2 x EP2 compiled, 30 steps (needs 2 GPUs)
#   fp8        small_1gpu compiled, fp8 linears and experts, 30 steps
#   regions    small_1gpu compiled with [compile] moe_regions = "piecewise" (torchtitan's MoE
#              compile) beside the default whole-layer regions, 30 steps each (not in the default list)
#   aoti       profiling/aoti_isolate.py: which layer kind's AOTInductor package fails on CUDA
#              (not in the default list)
#   fp8_fused  small_1gpu eager with fp8 linears and experts, the experts on our fused fp8 grouped
#              GEMM (TITAN_MOE_FP8_EXPERTS_GEMM=fused) beside torchao's, 30 steps each (not in the
#              default list)
#   wide       wide_1gpu (width 4096) compiled, bf16 then fp8 (rowwise linears, our fused fp8 expert
#              GEMM), 12 steps each: the whole-step float8 ratio (not in the default list)
#   wide_recipes  wide_1gpu compiled, fp8 linears only (tensorwise, then rowwise), then tensorwise
#              linears with our fused fp8 experts, 12 steps each (not in the default list)
#   fp8_experts  the fp8 experts against bf16: profiling/bench_moe.py's MoE layer (device kernels
#              per provider, the per-step weight refresh timed apart) and grouped GEMM cases at
#              E = 64, then wide_1gpu compiled, 12 steps each: bf16, tensorwise fp8 linears,
#              tensorwise linears + fp8 experts, and the same with the expert weights quantized
#              per call (TITAN_MOE_FP8_WEIGHT_CACHE=0) (not in the default list)
#   fp8_dw_rows  the fp8 weight gradient from the row-quantized codes (wgrad="fp8_rows"): the
#              fp8 GEMM tests on CUDA, the requantization kernel's tiles (bench_step_parts.py
#              --parts requant), the grouped GEMM cases at E = 64 (provider
#              fp8_cached_w_dw8rows beside fp8_cached_w and native), then wide_1gpu compiled with
#              TITAN_MOE_FP8_EXPERTS_WGRAD=fp8_rows, 12 steps (not in the default list)
#   fp8_situ   SiTU-GLU fused into the fp8 down GEMM's row quantization (TITAN_MOE_FP8_SITU_QUANT=1):
#              its CUDA tests, the kernel against SiTU-GLU then the row quantization
#              (bench_step_parts.py --parts situ_quant,dw, with the dw's fp32 widening against ATen's
#              cast), the down GEMM's call with and without it
#              (probe_fp8_wgrad.py --situ), then wide_1gpu compiled, 12 steps each, in
#              one run: bf16, fp8 with TITAN_MOE_FP8_EXPERTS_WGRAD=fp8_rows, and the same with the
#              fused SiTU-GLU and the Triton dw widening (TITAN_MOE_FP8_WIDEN=triton; the parts
#              above time each alone) (not in the default list)
#   fp8_all*   sections end with profiling/step_table.py over their runs: tokens/s, fp8 / bf16,
#              losses and memory in one table
#   fp8_all    every fp8 step option at once, the candidate recipe for the whole-step goal: the
#              GPU tests of the newest pieces (cached fp8 linear weights and bf16 expert casts, fused
#              SiTU quantization, Triton widening), then wide_1gpu compiled, 24 steps each (the table's
#              mean after step 4 is the ratio to read): bf16, then tensorwise fp8
#              linears with cache_weights + fp8 experts with wgrad "fp8_rows", situ_quant and
#              TITAN_MOE_FP8_WIDEN=triton (not in the default list)
#   fp8_all_wide  fp8_all's two training runs and table without its tests
#   fp8_all_parts  bench_step_parts.py --parts linear_cache,situ_quant,dw: the cached linear weight
#              casts, the fused SiTU quantization and the Triton widening, each against its
#              earlier form (not in the default list)
#   fp8_all_accum  the same two wide_1gpu runs with two microbatches per optimizer step
#              (--training.global_batch_size 8: 32K tokens per step, so the per-step optimizer
#              and weight refreshes count half as much per token) (not in the default list)
#   fp8_all_b8 the same two wide_1gpu runs at local batch 8 (32K tokens per step in one
#              microbatch: ~56 GiB of fp32 weights, gradients and AdamW state plus activations under
#              full checkpointing) (not in the default list)
#   fp8_all_small  the same pair on small_1gpu compiled (width 1024, 8K tokens per step), 40
#              steps, one after the other: the small config's fp8 / bf16 speed ratio, which the
#              loss check cannot give (not in the default list)
#   fp8_dw_programs  the fp8 weight gradient on our kernel with 2-3 persistent programs per SM
#              (small tiles that let two share an SM) beside torch's, and the forward / dx kernel
#              at two programs per SM beside its default, CUDA-graph replays at E = 64 and the K3
#              latent shapes: whether overlapping programs lifts the small-group GEMMs (not in
#              the default list)
#   dw_store_tma  the weight-gradient kernels with TMA stores (TileConfig.store_tma: a tile's
#              store drains while the program computes its next tile) beside their pointer-store
#              defaults and torch's: bf16 (--dw-tiles, auto's forward and dx) and fp8
#              (--fp8-dw-tiles, all three products on our kernels), CUDA-graph replays at E = 64
#              and the K3 latent shapes (not in the default list)
#   tail_tiles  the forward / dx kernels with tail tiles (TileConfig.tail_m: a group's rows past
#              its last full tile in 16-64-row tiles computed transposed), fp8 (--fp8-tiles) and
#              bf16 (--mk-tiles), beside the defaults, CUDA-graph replays under Zipf(1.1) and at the
#              K3 latent shapes (144-160-row groups), after the tail tiles' GPU tests (not in the
#              default list)
#   fwd_store_tma  the forward / dx kernels with TMA stores of their full tiles (TileConfig.store_tma
#              on kind mk / mk8: a tile's store drains while the program computes its next one),
#              bf16 (--mk-tiles) and fp8 (--fp8-tiles, incl. with tail tiles), and the bf16 dw with
#              TMA stores, with and without TMA loads (--dw-tiles), beside the defaults
#              and torch, CUDA-graph replays at E = 64 (balanced, Zipf 1.1) and the K3 latent
#              shapes, after the store and tail tests on the GPU (not in the default list)
#   fp8_kernels_b8  fp8_all at local batch 8 twice, the fp8 GEMMs on torch._scaled_grouped_mm
#              (`kernels = "torch"`) then the forward and dx on our Triton kernel ("triton"), 24
#              steps each, and their table: what the kernel choice does to the whole step (not in
#              the default list)
#   fp8_all_profile  the fp8_all_b8 pair, 12 steps each, step 12 under torch.profiler, each trace's
#              40 most expensive kernels (profiling/summarize_trace.py): where the step goes
#              outside the GEMMs (not in the default list)
#   fp8_all_loss  the loss check with the fp8_all recipe: small_1gpu compiled, 300 steps, bf16
#              and fp8_all started together (they share the GPU: their tokens/s are not speeds)
#              (not in the default list)
#   fp8_ablate wide_1gpu compiled, 24 steps each: the fp8_all recipe without the fused SiTU
#              quantization and Triton widening, then without cache_weights (table against
#              fp8_all_wide's runs in the same OUT) (not in the default list)
#   fp8_gemm   the fp8 expert GEMM against bf16 at the MoE issue's shapes: first the grouped-GEMM
#              and fp8 GEMM tests on the GPU (test_grouped_gemm_triton.py, test_float8_grouped.py,
#              test_float8_experts_recipe.py), then probe_fp8_wgrad.py at E = 64 with
#              --host-profile 20 (kernel sums, wall time and the host's Python per call), then
#              providers native, auto, fp8_cached_w, fp8_cached_w_dw8rows, fp8_cached_w_auto (wgrad
#              "auto") (the default fp8 kernels),
#              fp8_rows_torch (all fp8 GEMMs on torch's) at E = 64 (balanced,
#              Zipf 1.1) and the K3 latent experts (balanced) as CUDA-graph replays
#              (--cuda-graph), then at E = 64 with host launches (not in the default list)
#   fp8_gemm_short  fp8_gemm without the probe and the host launches: the grouped-GEMM and fp8
#              grouped tests, then native, auto, fp8_cached_w_dw8rows and fp8_cached_w_auto at
#              E = 64 (balanced, Zipf 1.1) and K3's latent shapes as CUDA-graph replays (not in
#              the default list)
#   dw_fp8     the fp8 dw kernel's load forms beside the default recipe: fp8_gemm_short's tests,
#              providers and cases (K3's down projection left out) plus --fp8-dw-tiles at the
#              opt-in tile with pointer loads, per-group device descriptors (fp8dwg_,
#              TITAN_MOE_GROUPED_MM_DW_TMA=group) and the flat loop ("f"), and two programs per SM
#              (not in the default list)
#   dw_fp8_down  dw_fp8's benchmark at K3's down projection (not in the default list)
#   gemm_auto  the bf16 grouped-GEMM GPU tests, then native, auto, tma_dw_native (auto's forward
#              and dx, torch's dw) and fp8 (w quantized beforehand, wgrad "auto") at E = 64 and K3's
#              down projection (not in the default list)
#   gemm_width the grouped-GEMM GPU tests, then native beside auto at E = 64 (output width 1,408)
#              and the MoE layer benchmark's expert shapes (widths 2,816 / 1,024): the forward / dx
#              tile by output width (not in the default list)
#   mk_tails   the grouped-GEMM tail-tile tests compiled, then profiling/probe_mk_kernel.py's tile
#              probe: 16-bit upright tail tiles (rTAILu) against the default forward / dx tiles
#              and native under E = 64's balanced and Zipf groups (not in the default list)
#   gluon_op   the op's "gluon" backend: its GPU tests (every tile against the loop through autograd),
#              then profiling/bench_moe.py through the op at E = 64 and the MoE layer's expert
#              shapes: native, auto, gluon (default tiles), its forward / dx with our Triton dw,
#              and two ping-pong dw tiles; then the MoE layer with the gluon backend beside
#              native, auto and torchtitan (not in the default list)
#   gluon_host the op's "gluon" backend after its host-cost cuts: all its GPU tests, the host time
#              per call of each backend (profiling/host_cost_gemm.py), the MoE layer with gluon
#              beside native, auto and torchtitan with each one's device kernels, then the GEMM
#              products through the op with the other forward / dx and dw tiles, among them tiles
#              stored from registers with the staging buffers' memory given to the ring ("...d")
#              (not in the default list)
#   gluon_dw_host  the Gluon dw with its whole row blocks read through the host's descriptors of
#              x and grad (tiles ending in "h"; only a group's partial last block through
#              descriptors made on the device): their GPU tests, then the GEMM products through the
#              op beside the default dw tiles (not in the default list)
#   gemm_goals  the op's default (auto) against torch._grouped_mm: the GPU tests of the Gluon
#              backend, the op and the MoE layer, the GEMM products through the op (native, auto,
#              gluon) at E = 64 and the layer's shapes, then the eager MoE layer against
#              torchtitan's (not in the default list)
#   gluon      profiling/probe_gluon_gemm.py: a warp-specialized grouped GEMM forward, dx and dw in
#              Gluon (one TMA load warp; cooperative or ping-pong wgmma consumers; one kernel without
#              partitions, pipelined by hand, for comparison), seven variants at
#              E = 64 balanced and Zipf, each run in its own process under $PROBE_LIMIT_S (default
#              60) seconds (not in the default list)
#   dw_bf16    the bf16 dw kernel's forms (--dw-tiles: pointer loads, host descriptors, per-group
#              device descriptors, the flat loop) beside auto / torch's dw at E = 64 and K3's down
#              projection (not in the default list)
#   parts      profiling/bench_step_parts.py: the AttnRes mix, SiTU-GLU forms, the weight refresh
#              and the fp32 weight gradient at wide_1gpu's shapes (not in the default list)
#   keep       small_1gpu eager, 30 steps, with TITAN_MOE_KDA_KEEP=0 (the KDA backward recomputes
#              the forward's intermediates) beside the default, which keeps them (not in the default list)
# Time limits per command: $SUITE_TIMEOUT seconds (default 540), and with $SUITE_DEADLINE set
# (seconds from the suite's start) no command runs past that point: each gets what is left, one
# with less than 20 seconds left is skipped (rc=124, "skipped" in summary.txt). A command over
# its limit gets SIGTERM, then SIGKILL 10 seconds later (a trainer that outlived SIGTERM once
# kept the GPU busy under the next section's benchmark). The training runs' dump folders
# go under $SUITE_DUMP (default OUT). SUITE_DRY_RUN=1 writes each
# command to summary.txt instead of running it; SUITE_GPUS overrides the GPU count (both for
# checking the script without a GPU).
# Triton's cache (compiled kernels, and the autotuning results that fla's kernels keep on disk)
# is $TRITON_CACHE_DIR, by default build/triton_cache in the checkout (ignored by git), so that a
# later call on the same machine reuses it; the suite then copies the autotuning results
# (*.autotune.json, a few KiB each) into one archive, OUT/triton_autotune.tar.gz, with their
# folders: `tar -xzf triton_autotune.tar.gz -C build/triton_cache` on a fresh machine and fla's
# autotuning (minutes at 32K) is skipped there. The suite does that itself with
# $SUITE_AUTOTUNE_IN (default profiling/fla_autotune_h200.tar.gz: fla-core 0.6.0's kernels under
# triton 3.6 at the benchmark's shapes, from the 102nd GPU run; empty: none).
set -u
OUT=${1:?usage: bash profiling/gpu_suite.sh OUT [SECTION ...]}
shift
mkdir -p "$OUT"
GPUS=${SUITE_GPUS:-$(python -c "import torch; print(torch.cuda.device_count())")}
if [ "$GPUS" -lt 1 ]; then
    echo "gpu_suite: no CUDA device" >&2
    exit 2
fi
SECTIONS=("$@")
if [ ${#SECTIONS[@]} -eq 0 ]; then
    SECTIONS=(tests kda moe train fp8)
    [ "$GPUS" -ge 2 ] && SECTIONS+=(train_ep)
fi
LIMIT=${SUITE_TIMEOUT:-540}
DUMP=${SUITE_DUMP:-$OUT}  # the training runs' dump folders (traces, metrics, checkpoints)
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/build/triton_cache}
# autotuning results measured before (fla's kernels on the H200): put where Triton looks for them,
# files already there kept, so that fla's autotuning is skipped where the Triton and fla versions match
AUTOTUNE_IN=${SUITE_AUTOTUNE_IN-$PWD/profiling/fla_autotune_h200.tar.gz}
if [ "${SUITE_DRY_RUN:-0}" != 1 ] && [ -n "$AUTOTUNE_IN" ] && [ -f "$AUTOTUNE_IN" ]; then
    mkdir -p "$TRITON_CACHE_DIR" && tar -xzf "$AUTOTUNE_IN" -C "$TRITON_CACHE_DIR" --skip-old-files
fi
SMALL=(-m titan_moe.train --job.config_file configs/small_1gpu.toml --training.steps 30
       --metrics.log_freq 5 --validation.freq 1000)
SMALL10=(-m titan_moe.train --job.config_file configs/small_1gpu.toml --training.steps 10
         --metrics.log_freq 5 --validation.freq 1000)
WIDE=(-m titan_moe.train --job.config_file configs/wide_1gpu.toml --training.steps 12 --metrics.log_freq 4)
FP8=(--model.converters titan_float8,titan_float8_experts --quantize.linear.float8.recipe_name rowwise)
# fp8_all's recipe: every fp8 option on (the Triton widening is a kernel choice, set by environment)
FP8_TW=(--model.converters titan_float8,titan_float8_experts --quantize.linear.float8.recipe_name tensorwise)
LINEAR_CACHE=(--quantize.linear.float8.cache_weights)
EXPERTS_ROWS=(--quantize.grouped_mm.float8.wgrad fp8_rows)
EXPERTS_SITU=(--quantize.grouped_mm.float8.situ_quant)
FP8_ALL=("${FP8_TW[@]}" "${LINEAR_CACHE[@]}" "${EXPERTS_ROWS[@]}" "${EXPERTS_SITU[@]}")
FP8_ALL_ENV=(TITAN_MOE_FP8_WIDEN=triton)

run() {  # run NAME COMMAND...: COMMAND's output to OUT/NAME.txt, a summary line
    local name=$1 start=$SECONDS rc
    shift
    if [ "${SUITE_DRY_RUN:-0}" = 1 ]; then
        echo "$name: $*" >> "$OUT/summary.txt"
        return
    fi
    local limit=$LIMIT
    if [ -n "${SUITE_DEADLINE:-}" ]; then
        local left=$((SUITE_DEADLINE - SECONDS))
        if [ "$left" -lt 20 ]; then
            echo "$name rc=124 seconds=0 skipped: ${left}s left before SUITE_DEADLINE" | tee -a "$OUT/summary.txt" >&2
            return
        fi
        [ "$left" -lt "$limit" ] && limit=$left
    fi
    echo "gpu_suite: $name (limit ${limit}s) ..." >&2
    timeout -k 10 "$limit" "$@" > "$OUT/$name.txt" 2>&1
    rc=$?
    echo "$name rc=$rc seconds=$((SECONDS - start))" | tee -a "$OUT/summary.txt" >&2
}

run_kda_long() {  # the long-context KDA GPU tests (kda_long, kda_verify)
    run kda_long python -m pytest -m gpu -q -s -rsx -p no:cacheprovider tests/test_kda_long_context.py
}

# fp8_all_pair NAME [TRAINER ARGS...]: wide_1gpu bf16, then the fp8_all recipe, then their table.
# 24 steps (compiling takes about 2 minutes, a step under a second), so that the ratio is the
# mean over five logged windows after the warm-up instead of two.
# PAIR is the trainer invocation both runs share (fp8_all_small sets the small_1gpu one).
WIDE_PAIR=(-m titan_moe.train --job.config_file configs/wide_1gpu.toml --training.steps 24 --metrics.log_freq 4)
SMALL_PAIR=(-m titan_moe.train --job.config_file configs/small_1gpu.toml --compile.enable --training.steps 40
            --metrics.log_freq 4 --validation.freq 1000)
PAIR=("${WIDE_PAIR[@]}")
fp8_all_pair() {
    local name=$1
    shift
    run "${name}_bf16" torchrun --standalone --nproc_per_node=1 "${PAIR[@]}" "$@" \
        --job.dump_folder "$DUMP/${name}_bf16"
    run "${name}_fp8" env "${FP8_ALL_ENV[@]}" torchrun --standalone --nproc_per_node=1 "${PAIR[@]}" "$@" \
        "${FP8_ALL[@]}" --job.dump_folder "$DUMP/${name}_fp8"
    run "${name}_table" python profiling/step_table.py "$DUMP/${name}_bf16" "$DUMP/${name}_fp8" --mean-after 4
}

for section in "${SECTIONS[@]}"; do
    case $section in
        tests)
            GPU_TESTS=(python -m pytest -m gpu -q -rsx --runxfail -o faulthandler_timeout=300)
            COMPILE_TESTS=(tests/test_compile_inductor.py tests/test_export.py)
            run tests_kernels "${GPU_TESTS[@]}" tests "${COMPILE_TESTS[@]/#/--ignore=}"
            run tests_compile "${GPU_TESTS[@]}" "${COMPILE_TESTS[@]}" ;;
        kda) run kda python profiling/bench_kda.py --no-fla --kernels 6 \
                --variants recompute:TITAN_MOE_KDA_KEEP=0,classic:TITAN_MOE_KDA_WALK=classic+TITAN_MOE_KDA_PREPARE=composite+TITAN_MOE_KDA_KEEP=0 ;;
        kda_tune) run kda_tune python profiling/bench_kda.py --no-fla --kernels 4 --shapes 32768,4096 \
                --scan-configs 16x4,32x4,64x4,128x4 \
                --variants c64x32:TITAN_MOE_KDA_BWD_CHUNK=64x32x8x8,c128:TITAN_MOE_KDA_BWD_CHUNK=128x32x16x8,o128x4:TITAN_MOE_KDA_OUTPUT=128x4,o32x2:TITAN_MOE_KDA_OUTPUT=32x2,inv2:TITAN_MOE_KDA_TILE_WARPS=4x2x4x8,bi4:TITAN_MOE_KDA_TILE_WARPS=4x1x4x4,it8:TITAN_MOE_KDA_TILE_WARPS=8x1x4x8,st2x2:TITAN_MOE_KDA_SCAN_STAGES=2x2,st4x4:TITAN_MOE_KDA_SCAN_STAGES=4x4 ;;
        kda_caps) run kda_caps python profiling/bench_kda.py --no-fla --kernels 8 --shapes 32768,4096 \
                --variants nocaps:TITAN_MOE_KDA_BWD_MAXNREG=0x0x0,caps_vd:TITAN_MOE_KDA_BWD_MAXNREG=0x128x168,intra_nocap:TITAN_MOE_KDA_BWD_INTRA_MAXNREG=0,intra_cap128:TITAN_MOE_KDA_BWD_INTRA_MAXNREG=128,intra_cap104:TITAN_MOE_KDA_BWD_INTRA_MAXNREG=104,intra_cap88:TITAN_MOE_KDA_BWD_INTRA_MAXNREG=88,intra_cap80:TITAN_MOE_KDA_BWD_INTRA_MAXNREG=80,cols_nocap:TITAN_MOE_KDA_INTRA_MAXNREG=0,cols_cap80:TITAN_MOE_KDA_INTRA_MAXNREG=80 ;;
        kda_intra) run kda_intra python profiling/bench_kda.py --no-fla --kernels 8 --shapes 32768,4096 \
                --variants bk128w8:TITAN_MOE_KDA_BWD_INTRA_BK=128+TITAN_MOE_KDA_TILE_WARPS=4x1x4x8,bk128w4:TITAN_MOE_KDA_BWD_INTRA_BK=128,bk64w2:TITAN_MOE_KDA_TILE_WARPS=4x1x4x2,bk64w8:TITAN_MOE_KDA_TILE_WARPS=4x1x4x8,bk32w2:TITAN_MOE_KDA_BWD_INTRA_BK=32+TITAN_MOE_KDA_TILE_WARPS=4x1x4x2 ;;
        kda_keys) run kda_keys python profiling/bench_kda.py --no-fla --kernels 8 --shapes 32768,4096 \
                --variants k128w16:TITAN_MOE_KDA_BWD_CHUNK=128x64x16x8,k128w16bv32:TITAN_MOE_KDA_BWD_CHUNK=128x32x16x8,k128w8:TITAN_MOE_KDA_BWD_CHUNK=128x64x8x8,k128early:TITAN_MOE_KDA_BWD_CHUNK=128x64x16x8+TITAN_MOE_KDA_KEYS_LOADS=early ;;
        kda_bwd_tma)  # stage 2's value-loop operands through TMA descriptors
            run kda_bwd_tma_tests env TITAN_MOE_KDA_BWD_TMA=all python -m pytest -m gpu -q -rsx \
                -p no:cacheprovider tests/test_kda_triton.py tests/test_kda_kept.py
            run kda_bwd_tma python profiling/bench_kda.py --no-fla --kernels 8 --shapes 32768,4096 \
                --variants none:TITAN_MOE_KDA_BWD_TMA=none,keys:TITAN_MOE_KDA_BWD_TMA=keys,both:TITAN_MOE_KDA_BWD_TMA=all ;;
        kda_forms)  # the forward's A tiles by column tile
            run kda_forms_tests python -m pytest -q -rsx -p no:cacheprovider tests/test_kda_triton.py \
                -k "intra_columns"
            run kda_forms python profiling/bench_kda.py --no-fla --kernels 8 --shapes 32768,4096 \
                --variants tiles:TITAN_MOE_KDA_INTRA=tiles,c64:TITAN_MOE_KDA_INTRA=columns64x4,c16:TITAN_MOE_KDA_INTRA=columns16x4 ;;
        kda_dakk)  # dA_kk = -X^T (dV~ V~^T) in the values kernel
            run kda_dakk python profiling/bench_kda.py --no-fla --kernels 8 --shapes 32768,4096 \
                --variants inverse:TITAN_MOE_KDA_DAKK=inverse,tf32x3:TITAN_MOE_KDA_DAKK=values:tf32x3 ;;
        kda_parts)  # the keys kernel after dA_kk left it: bf16 partials, its launch, the bf16 gradient errors
            run kda_parts python profiling/bench_kda.py --no-fla --kernels 8 --shapes 32768,4096 \
                --variants parts_fp32:TITAN_MOE_KDA_BWD_PARTS=fp32,k128:TITAN_MOE_KDA_BWD_CHUNK=128x64x16x8,k64early:TITAN_MOE_KDA_KEYS_LOADS=early,k128fp32:TITAN_MOE_KDA_BWD_PARTS=fp32+TITAN_MOE_KDA_BWD_CHUNK=128x64x16x8 ;;
        kda_verify)  # the KDA GPU tests with today's defaults, compiled: float64 references, forms, partials
            run kda_verify_tests python -m pytest -m gpu -q -s -rsx -p no:cacheprovider tests/test_kda_triton.py \
                tests/test_kda_kept.py tests/test_kda_prepare.py tests/test_kda_scan.py
            run kda_verify_forms python -m pytest -q -rsx -p no:cacheprovider tests/test_kda_triton.py \
                -k "dakk or partials or bwd_matches_autograd or intra_columns or keys_kernel or key_split"
            run_kda_long ;;
        kda_long) run_kda_long ;;
        kda_paired)  # the backward intra kernel's default paired form beside its anchored form
            ANCHORED=anchored:TITAN_MOE_KDA_BWD_INTRA_FORM=anchored
            ANCHORED_TF32=anchored_tf32:TITAN_MOE_KDA_BWD_INTRA_FORM=anchored+TITAN_MOE_KDA_DOTS=tf32
            run kda_paired_tests python -m pytest \
                -q -s -rsx -p no:cacheprovider tests/test_kda_triton.py tests/test_kda_long_context.py \
                -k "paired or bwd_matches_autograd or backward_vs_float64 or long_context or bound_everywhere"
            run kda_paired_errors python profiling/kda_grad_errors.py --T 32768 \
                --variants "$ANCHORED,$ANCHORED_TF32"
            run kda_paired_errors_gmin python profiling/kda_grad_errors.py --T 32768 --gate-min \
                --variants "$ANCHORED,$ANCHORED_TF32"
            run kda_paired python profiling/bench_kda.py --no-fla --kernels 4 --shapes 32768,4096 \
                --variants "$ANCHORED,$ANCHORED_TF32" ;;
        kda_fla_paired) run kda_fla_paired env TITAN_MOE_KDA_BWD_INTRA_FORM=paired TITAN_MOE_KDA_DOTS=tf32 \
                python profiling/bench_kda.py --kernels 8 --watchdog 300 \
                --shapes "${SUITE_KDA_SHAPES:-8192,32768,131072,4096}" ;;
        kda_fla_all) run kda_fla_all python profiling/bench_kda.py --kernels 8 --watchdog 300 \
                --shapes "${SUITE_KDA_SHAPES:-8192,32768,131072,4096}" ;;
        gemm_default)  # training steps with the grouped GEMM's default beside native
            run gemm_default_auto torchrun --standalone --nproc_per_node=1 "${SMALL10[@]}" \
                --job.dump_folder "$DUMP/gemm_default_auto"
            run gemm_default_native env TITAN_MOE_GROUPED_MM_BACKEND=native torchrun --standalone \
                --nproc_per_node=1 "${SMALL10[@]}" --job.dump_folder "$DUMP/gemm_default_native" ;;
        kda_prepare) run kda_prepare python profiling/bench_kda.py --no-fla --kernels 10 --shapes 32768,4096 \
                --variants fused:TITAN_MOE_KDA_PREPARE_CHUNK=fused,split32:TITAN_MOE_KDA_PREPARE_CHUNK=split32,split64:TITAN_MOE_KDA_PREPARE_CHUNK=split64 ;;
        kda_ncu)
            NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -n 1)
            run kda_ncu "${NCU:-ncu}" --clock-control none --profile-from-start off --section SpeedOfLight \
                --section Occupancy --section LaunchStats --section WarpStateStats \
                --section MemoryWorkloadAnalysis -f -o "$OUT/kda_ncu" \
                python profiling/bench_kda.py --no-fla --profile-once --shapes "${SUITE_NCU_SHAPES:-32768}"
            if [ -f "$OUT/kda_ncu.ncu-rep" ]; then
                "${NCU:-ncu}" -i "$OUT/kda_ncu.ncu-rep" --csv --page details > "$OUT/kda_ncu_details.csv"
                "${NCU:-ncu}" -i "$OUT/kda_ncu.ncu-rep" --csv --page raw > "$OUT/kda_ncu_raw.csv"
                rm -f "$OUT/kda_ncu.ncu-rep"  # the CSVs hold what the table reads; fewer files to fetch
            fi
            run kda_ncu_table python profiling/ncu_table.py "$OUT/kda_ncu_details.csv" \
                --raw "$OUT/kda_ncu_raw.csv" ;;
        kda_fla) run kda_fla python profiling/bench_kda.py --kernels 6 --watchdog 120 ;;
        kda_graphs) run kda_graphs python profiling/bench_kda.py --cuda-graphs --shapes 8192,32768 --watchdog 120 ;;
        moe) run moe python profiling/bench_moe.py --dispatch ;;
        gemm_tma) run gemm_tma env TITAN_MOE_GROUPED_MM_TMA=1 python -m pytest -q -rsx -p no:cacheprovider \
                tests/test_grouped_gemm_triton.py tests/test_grouped_gemm.py tests/test_moe.py ;;
        gemm_tiles)
            run gemm_tiles python profiling/bench_moe.py --skip-layer --gemm-cases e64_balanced,e64_zipf1.1 \
                --sweep-tiles
            # the winners through the whole op, beside the peer in the same run
            BEST=$(python profiling/bench_moe.py --best-tiles "$OUT/gemm_tiles.txt" 2>/dev/null) || BEST=
            run gemm_best env TITAN_MOE_GROUPED_MM_TILES="$BEST" python profiling/bench_moe.py --skip-layer \
                --gemm-cases e64_balanced,e64_zipf1.1 ;;
        train)
            run train_eager torchrun --standalone --nproc_per_node=1 "${SMALL[@]}" --job.dump_folder "$DUMP/train_eager"
            run train_compiled torchrun --standalone --nproc_per_node=1 "${SMALL[@]}" --compile.enable \
                --job.dump_folder "$DUMP/train_compiled" ;;
        train_ep)
            run train_ep torchrun --standalone --nproc_per_node=2 "${SMALL[@]}" --compile.enable \
                --parallelism.data_parallel_shard_degree 2 --parallelism.expert_parallel_degree 2 \
                --validation.local_batch_size 2 --job.dump_folder "$DUMP/train_ep" ;;
        fp8) run fp8 torchrun --standalone --nproc_per_node=1 "${SMALL[@]}" --compile.enable "${FP8[@]}" \
                --job.dump_folder "$DUMP/fp8" ;;
        regions)
            run regions_whole torchrun --standalone --nproc_per_node=1 "${SMALL[@]}" --compile.enable \
                --job.dump_folder "$DUMP/regions_whole"
            run regions_piecewise torchrun --standalone --nproc_per_node=1 "${SMALL[@]}" --compile.enable \
                --compile.moe_regions piecewise --job.dump_folder "$DUMP/regions_piecewise" ;;
        aoti) run aoti python profiling/aoti_isolate.py --device cuda ;;
        fp8_fused)
            run fp8_torchao env TITAN_MOE_FP8_EXPERTS_GEMM=torchao torchrun --standalone --nproc_per_node=1 \
                "${SMALL[@]}" "${FP8[@]}" --job.dump_folder "$DUMP/fp8_torchao"
            run fp8_fused env TITAN_MOE_FP8_EXPERTS_GEMM=fused torchrun --standalone --nproc_per_node=1 \
                "${SMALL[@]}" "${FP8[@]}" --job.dump_folder "$DUMP/fp8_fused" ;;
        wide)
            run wide_bf16 torchrun --standalone --nproc_per_node=1 "${WIDE[@]}" --job.dump_folder "$DUMP/wide_bf16"
            run wide_fp8 env TITAN_MOE_FP8_EXPERTS_GEMM=fused torchrun --standalone --nproc_per_node=1 \
                "${WIDE[@]}" "${FP8[@]}" --job.dump_folder "$DUMP/wide_fp8" ;;
        wide_recipes)
            run wide_fp8_linears_tensorwise torchrun --standalone --nproc_per_node=1 "${WIDE[@]}" \
                --model.converters titan_float8 --quantize.linear.float8.recipe_name tensorwise \
                --job.dump_folder "$DUMP/wide_fp8_lt"
            run wide_fp8_linears_rowwise torchrun --standalone --nproc_per_node=1 "${WIDE[@]}" \
                --model.converters titan_float8 --quantize.linear.float8.recipe_name rowwise \
                --job.dump_folder "$DUMP/wide_fp8_lr"
            run wide_fp8_tensorwise_fused env TITAN_MOE_FP8_EXPERTS_GEMM=fused torchrun --standalone \
                --nproc_per_node=1 "${WIDE[@]}" --model.converters titan_float8,titan_float8_experts \
                --quantize.linear.float8.recipe_name tensorwise --job.dump_folder "$DUMP/wide_fp8_tf" ;;
        fp8_experts)
            run fp8_layer python profiling/bench_moe.py --skip-gemm --layer-kernels 8
            run fp8_gemm python profiling/bench_moe.py --skip-layer --gemm-cases e64_balanced,e64_zipf1.1
            FP8_TENSORWISE=(--quantize.linear.float8.recipe_name tensorwise)
            run fp8_wide_bf16 torchrun --standalone --nproc_per_node=1 "${WIDE[@]}" --job.dump_folder "$DUMP/fp8_wide_bf16"
            run fp8_wide_linears torchrun --standalone --nproc_per_node=1 "${WIDE[@]}" --model.converters titan_float8 \
                "${FP8_TENSORWISE[@]}" --job.dump_folder "$DUMP/fp8_wide_linears"
            run fp8_wide_experts env TITAN_MOE_FP8_EXPERTS_GEMM=fused torchrun --standalone --nproc_per_node=1 \
                "${WIDE[@]}" --model.converters titan_float8,titan_float8_experts "${FP8_TENSORWISE[@]}" \
                --job.dump_folder "$DUMP/fp8_wide_experts"
            run fp8_wide_experts_per_call env TITAN_MOE_FP8_EXPERTS_GEMM=fused TITAN_MOE_FP8_WEIGHT_CACHE=0 \
                torchrun --standalone --nproc_per_node=1 "${WIDE[@]}" --model.converters titan_float8,titan_float8_experts \
                "${FP8_TENSORWISE[@]}" --job.dump_folder "$DUMP/fp8_wide_experts_per_call" ;;
        fp8_dw_rows)
            run fp8_dw_rows_tests python -m pytest -q -rsx -p no:cacheprovider tests/test_float8_grouped.py
            run fp8_dw_rows_requant python profiling/bench_step_parts.py --parts requant
            run fp8_dw_rows_gemm python profiling/bench_moe.py --skip-layer --gemm-cases e64_balanced,e64_zipf1.1 \
                --gemm-providers native,fp8_cached_w,fp8_cached_w_dw8rows
            run fp8_dw_rows_wide env TITAN_MOE_FP8_EXPERTS_WGRAD=fp8_rows torchrun --standalone --nproc_per_node=1 \
                "${WIDE[@]}" --model.converters titan_float8,titan_float8_experts \
                --quantize.linear.float8.recipe_name tensorwise --job.dump_folder "$DUMP/fp8_dw_rows_wide" ;;
        fp8_situ)
            FP8_ROWS=(--model.converters titan_float8,titan_float8_experts --quantize.linear.float8.recipe_name tensorwise)
            run fp8_situ_tests python -m pytest -q -rsx -p no:cacheprovider tests/test_float8_grouped.py -k "situ or cuda"
            run fp8_situ_parts python profiling/bench_step_parts.py --parts situ_quant,dw
            run fp8_situ_probe python profiling/probe_fp8_wgrad.py --situ --shapes 16,4096,2048
            run fp8_situ_wide_bf16 torchrun --standalone --nproc_per_node=1 "${WIDE[@]}" --job.dump_folder "$DUMP/fp8_situ_bf16"
            run fp8_situ_wide_rows env TITAN_MOE_FP8_EXPERTS_WGRAD=fp8_rows torchrun --standalone --nproc_per_node=1 \
                "${WIDE[@]}" "${FP8_ROWS[@]}" --job.dump_folder "$DUMP/fp8_situ_rows"
            run fp8_situ_wide_fused env TITAN_MOE_FP8_EXPERTS_WGRAD=fp8_rows TITAN_MOE_FP8_SITU_QUANT=1 \
                TITAN_MOE_FP8_WIDEN=triton torchrun \
                --standalone --nproc_per_node=1 "${WIDE[@]}" "${FP8_ROWS[@]}" --job.dump_folder "$DUMP/fp8_situ_fused" ;;
        fp8_all)
            run fp8_all_tests python -m pytest -q -rsx -p no:cacheprovider tests/test_float8_cached_linear.py \
                tests/test_compute_weight_cache.py tests/test_widen.py tests/test_float8_grouped.py \
                -k "cached or cuda or sm90 or widen or situ"
            fp8_all_pair fp8_all_wide ;;
        fp8_all_wide) fp8_all_pair fp8_all_wide ;;
        fp8_all_parts) run fp8_all_parts python profiling/bench_step_parts.py --parts linear_cache,situ_quant,dw ;;
        fp8_all_accum) fp8_all_pair fp8_all_accum --training.global_batch_size 8 ;;
        fp8_all_b8) fp8_all_pair fp8_all_b8 --training.local_batch_size 8 ;;
        fp8_dw_programs)
            run fp8_dw_programs python profiling/bench_moe.py --skip-layer --cuda-graph \
                --gemm-providers native,fp8_rows_torch,fp8_cached_w_dw8rows \
                --fp8-tiles 128x128x128x8x3x2,128x128x128x4x3x2 \
                --fp8-dw-tiles 64x128x128x4x3x2,64x128x128x8x3x2,64x128x128x4x2x3,32x128x128x4x3x3,64x64x128x4x3x3 \
                --gemm-cases e64_balanced,k3_gate_up_balanced,k3_down_balanced ;;
        dw_store_tma)
            run dw_store_tma python profiling/bench_moe.py --skip-layer --cuda-graph \
                --gemm-providers native,auto,fp8_cached_w_dw8rows,fp8_rows_triton_all \
                --dw-tiles 64x128x256x8x3t,64x128x128x8x4t,64x256x128x8x3t,64x128x128x4x2x2t \
                --fp8-dw-tiles 128x128x128x8x4t,128x256x128x8x3t,64x128x128x4x3x2t,64x256x128x8x4t,128x128x256x8x3t \
                --gemm-cases e64_balanced,e64_zipf1.1,k3_gate_up_balanced,k3_down_balanced ;;
        tail_tiles)
            run tail_tiles_tests python -m pytest -q -rsx -p no:cacheprovider tests/test_grouped_gemm_triton.py \
                -k "tail or cuda"
            run tail_tiles python profiling/bench_moe.py --skip-layer --cuda-graph \
                --gemm-providers native,auto,fp8_cached_w_dw8rows,fp8_cached_w \
                --fp8-tiles 128x256x128x8x3r32,128x128x128x8x3r32,128x256x128x8x3r16 \
                --mk-tiles 128x256x64x8x3r32,128x128x64x8x4r32 \
                --gemm-cases e64_zipf1.1,k3_gate_up_balanced,k3_down_balanced ;;
        fwd_store_tma)
            run fwd_store_tma_tests python -m pytest -q -rsx -p no:cacheprovider tests/test_grouped_gemm_triton.py \
                -k "store or tail or cuda or scaled_fp8_dw"
            run fwd_store_tma python profiling/bench_moe.py --skip-layer --cuda-graph \
                --gemm-providers native,auto,fp8_cached_w_dw8rows \
                --mk-tiles 256x128x64x8x3t,128x256x64x8x3t --dw-tiles 64x256x128x8x3t \
                --fp8-tiles 256x128x128x8x3t,128x256x128x8x3r32t \
                --gemm-cases e64_balanced,e64_zipf1.1,k3_gate_up_balanced,k3_down_balanced ;;
        fp8_kernels_b8)
            for kernels in torch triton; do
                run "fp8_kernels_b8_$kernels" env "${FP8_ALL_ENV[@]}" torchrun --standalone --nproc_per_node=1 \
                    "${WIDE_PAIR[@]}" --training.local_batch_size 8 "${FP8_ALL[@]}" \
                    --quantize.grouped_mm.float8.kernels "$kernels" --job.dump_folder "$DUMP/fp8_kernels_b8_$kernels"
            done
            run fp8_kernels_b8_table python profiling/step_table.py "$DUMP/fp8_kernels_b8_torch" \
                "$DUMP/fp8_kernels_b8_triton" --mean-after 4 ;;
        fp8_all_small) PAIR=("${SMALL_PAIR[@]}"); fp8_all_pair fp8_all_small; PAIR=("${WIDE_PAIR[@]}") ;;
        fp8_all_profile)
            PROFILE=(--training.local_batch_size 8 --training.steps 12 --profiling.enable_profiling
                     --profiling.profile_freq 12)
            fp8_all_pair fp8_all_profile "${PROFILE[@]}"
            for run_name in bf16 fp8; do
                run "fp8_all_profile_${run_name}_kernels" python profiling/summarize_trace.py --category kernel --top 40 \
                    "$DUMP/fp8_all_profile_${run_name}/profile_traces/iteration_12"
            done ;;
        fp8_all_loss)
            LOSS=(-m titan_moe.train --job.config_file configs/small_1gpu.toml --metrics.log_freq 10 --compile.enable)
            run fp8_all_loss_bf16 torchrun --standalone --nproc_per_node=1 "${LOSS[@]}" \
                --job.dump_folder "$DUMP/fp8_all_loss_bf16" &
            run fp8_all_loss_fp8 env "${FP8_ALL_ENV[@]}" torchrun --standalone --nproc_per_node=1 \
                "${LOSS[@]}" "${FP8_ALL[@]}" --job.dump_folder "$DUMP/fp8_all_loss_fp8" &
            wait
            run fp8_all_loss_table python profiling/step_table.py "$DUMP/fp8_all_loss_bf16" "$DUMP/fp8_all_loss_fp8" \
                --steps 100,200,300 ;;
        fp8_ablate)  # no_situ first: the no_cache run was the one measured so far (64th run)
            run fp8_ablate_no_situ torchrun --standalone --nproc_per_node=1 "${WIDE_PAIR[@]}" \
                "${FP8_TW[@]}" "${LINEAR_CACHE[@]}" "${EXPERTS_ROWS[@]}" --job.dump_folder "$DUMP/fp8_ablate_no_situ"
            run fp8_ablate_no_cache env "${FP8_ALL_ENV[@]}" torchrun --standalone --nproc_per_node=1 "${WIDE_PAIR[@]}" \
                "${FP8_TW[@]}" "${EXPERTS_ROWS[@]}" "${EXPERTS_SITU[@]}" --job.dump_folder "$DUMP/fp8_ablate_no_cache"
            run fp8_ablate_table python profiling/step_table.py "$DUMP/fp8_ablate_no_cache" "$DUMP/fp8_ablate_no_situ" \
                "$DUMP/fp8_all_wide_fp8" "$DUMP/fp8_all_wide_bf16" --baseline fp8_all_wide_bf16 --mean-after 4 ;;
        fp8_gemm)
            GEMM_ARGS=(--skip-layer --gemm-providers native,auto,fp8_cached_w,fp8_cached_w_dw8rows,fp8_cached_w_auto,fp8_rows_torch)
            run fp8_gemm_tests python -m pytest -q -rsx -p no:cacheprovider tests/test_grouped_gemm_triton.py \
                tests/test_float8_grouped.py tests/test_float8_experts_recipe.py
            run fp8_gemm_probe python profiling/probe_fp8_wgrad.py --shapes 64,2048,1408 --weights bf16 \
                --host-profile 20
            run fp8_gemm_graph python profiling/bench_moe.py "${GEMM_ARGS[@]}" --cuda-graph \
                --gemm-cases e64_balanced,e64_zipf1.1,k3_gate_up_balanced,k3_down_balanced
            run fp8_gemm_host python profiling/bench_moe.py "${GEMM_ARGS[@]}" --gemm-cases e64_balanced,e64_zipf1.1 ;;
        fp8_gemm_short)  # fp8_gemm without the probe and the host launches
            run fp8_gemm_short_tests python -m pytest -q -rsx -p no:cacheprovider tests/test_grouped_gemm_triton.py \
                tests/test_float8_grouped.py
            run fp8_gemm_short python profiling/bench_moe.py --skip-layer --cuda-graph \
                --gemm-providers native,auto,fp8_cached_w_dw8rows,fp8_cached_w_auto \
                --gemm-cases e64_balanced,e64_zipf1.1,k3_gate_up_balanced,k3_down_balanced ;;
        dw_fp8)  # fp8 dw forms beside the default recipe (fp8_gemm_short's providers and cases)
            run dw_fp8_tests python -m pytest -q -rsx -p no:cacheprovider tests/test_grouped_gemm_triton.py \
                tests/test_float8_grouped.py
            run dw_fp8 python profiling/bench_moe.py --skip-layer --cuda-graph \
                --gemm-providers native,auto,fp8_cached_w_dw8rows,fp8_cached_w_auto \
                --fp8-dw-tiles 128x256x128x8x3t,128x256x128x8x3tf,64x128x128x4x3x2t \
                --gemm-cases e64_balanced,e64_zipf1.1,k3_gate_up_balanced ;;
        dw_fp8_down)  # dw_fp8's providers at K3's down projection
            run dw_fp8_down python profiling/bench_moe.py --skip-layer --cuda-graph \
                --gemm-providers native,auto,fp8_cached_w_dw8rows,fp8_cached_w_auto \
                --fp8-dw-tiles 128x256x128x8x3t,128x256x128x8x3tf,64x128x128x4x3x2t \
                --gemm-cases k3_down_balanced ;;
        gemm_auto)  # the bf16 defaults through the op: auto (its dw on our kernel at E = 64) beside native
            run gemm_auto_tests python -m pytest -q -rsx -p no:cacheprovider tests/test_grouped_gemm_triton.py \
                tests/test_grouped_gemm.py -k "cuda or gpu"
            run gemm_auto python profiling/bench_moe.py --skip-layer --cuda-graph \
                --gemm-providers native,auto,tma_dw_native,fp8_cached_w_auto \
                --gemm-cases e64_balanced,e64_zipf1.1,k3_down_balanced ;;
        gemm_width)  # the forward / dx tile by output width (128x256 at multiples of 256) through the op
            run gemm_width_tests python -m pytest -q -rsx -p no:cacheprovider tests/test_grouped_gemm_triton.py \
                -k "cuda or gpu"
            run gemm_width python profiling/bench_moe.py --skip-layer --cuda-graph --gemm-providers native,auto \
                --gemm-cases e64_balanced,e64_zipf1.1,layer_gate_up,layer_down ;;
        mk_tails)  # bf16 upright tail tiles (opt-in) in the forward / dx, beside the defaults and native
            run mk_tails_tests python -m pytest -q -rsx -p no:cacheprovider tests/test_grouped_gemm_triton.py -k tail
            run mk_tails python profiling/probe_mk_kernel.py tiles e64_bal,e64_zipf,e64_m32k_zipf \
                ,256x128x64x8x3r128ut,256x128x64x8x3r64ut,128x256x64x8x3r64ut,128x256x64x8x3t ;;
        gluon_op)  # the op's Gluon backend: GPU tests, GEMM products through the op, the MoE layer
            run gluon_op_tests python -m pytest -q -rsx -p no:cacheprovider tests/test_grouped_gemm_gluon.py
            run gluon_op python profiling/bench_moe.py --skip-layer --cuda-graph \
                --gemm-providers native,auto,gluon,gluon_dwtriton,gluon_ppdw128x128x64s5,gluon_ppdw128x128x128s2 \
                --gemm-cases e64_balanced,e64_zipf1.1,layer_gate_up,layer_down
            run gluon_layer python profiling/bench_moe.py --skip-gemm --layer-providers ours_auto,ours_gluon,ours_gluon_dwtriton ;;
        gluon_host)  # the Gluon backend's host cost per call, the MoE layer, the other forward / dx tiles
            run gluon_host_tests python -m pytest -q -rsx -p no:cacheprovider tests/test_grouped_gemm_gluon.py
            run gluon_host python profiling/host_cost_gemm.py
            run gluon_host_layer python profiling/bench_moe.py --skip-gemm --layer-providers ours_auto,ours_gluon \
                --layer-kernels 14
            run gluon_host_gemm python profiling/bench_moe.py --skip-layer --cuda-graph \
                --gemm-providers native,gluon,gluon_pp64x256x64s4,gluon_pp128x128x64s6d,gluon_pp64x256x64s5d,gluon_dw256x128x64s4d,gluon_dw128x256x64s4d \
                --gemm-cases e64_balanced,e64_zipf1.1,layer_gate_up,layer_down ;;
        gluon_dw_host)  # the dw's whole row blocks through host descriptors
            run gluon_dw_host_tests python -m pytest -q -rsx -p no:cacheprovider tests/test_grouped_gemm_gluon.py \
                -k "3h or 4dh or s5h or not autograd"
            run gluon_dw_host python profiling/bench_moe.py --skip-layer --cuda-graph \
                --gemm-providers native,gluon,gluon_dw256x128x64s3h,gluon_dw128x256x64s3h,gluon_dw256x128x64s4dh,gluon_dw128x256x64s3,gluon_ppdw128x128x64s5h \
                --gemm-cases e64_balanced,e64_zipf1.1,layer_gate_up,layer_down ;;
        gemm_goals)  # the default backend against torch._grouped_mm, then the layer against torchtitan's
            run gemm_goals_tests python -m pytest -q -rsx -p no:cacheprovider -m gpu tests/test_grouped_gemm_gluon.py \
                tests/test_grouped_gemm.py tests/test_moe.py
            run gemm_goals python profiling/bench_moe.py --skip-layer --cuda-graph --gemm-providers native,auto,gluon \
                --gemm-cases e64_balanced,e64_zipf1.1,layer_gate_up,layer_down
            run gemm_goals_layer python profiling/bench_moe.py --skip-gemm --layer-providers ours_auto \
                --layer-kernels 14 ;;
        gluon)  # Gluon grouped GEMM kernels (a probe): their GPU tests, then each beside native and our Triton kernel
            run gluon_tests python -m pytest -q -rsx -p no:cacheprovider tests/test_probe_gluon_gemm.py
            run gluon python profiling/probe_gluon_gemm.py \
                128x256x64s3,pp128x128x64s4,np128x256x64s3,256x128x64s3,pp128x128x64s5,dw256x128x64s3,dw128x256x64s3 ;;
        dw_bf16)  # bf16 dw forms beside torch's
            run dw_bf16 python profiling/bench_moe.py --skip-layer --cuda-graph \
                --gemm-providers native,auto,tma_dw_native \
                --dw-tiles 64x128x256x8x3t,64x128x256x8x3tf \
                --gemm-cases e64_balanced,e64_zipf1.1,k3_down_balanced ;;
        parts) run parts python profiling/bench_step_parts.py ;;
        keep)
            run keep_on torchrun --standalone --nproc_per_node=1 "${SMALL[@]}" --job.dump_folder "$DUMP/keep_on"
            run keep_off env TITAN_MOE_KDA_KEEP=0 torchrun --standalone --nproc_per_node=1 "${SMALL[@]}" \
                --job.dump_folder "$DUMP/keep_off" ;;
        *) echo "gpu_suite: unknown section $section" >&2; exit 2 ;;
    esac
done
if [ -d "$TRITON_CACHE_DIR" ]; then  # the autotuning results, for a later machine: one archive
    AUTOTUNE_OUT=$(cd "$OUT" && pwd)/triton_autotune.tar.gz
    (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | sort > "$AUTOTUNE_OUT.list"
     [ -s "$AUTOTUNE_OUT.list" ] && tar -czf "$AUTOTUNE_OUT" -T "$AUTOTUNE_OUT.list"
     rm -f "$AUTOTUNE_OUT.list")
fi
