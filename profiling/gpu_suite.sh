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
#   kda        profiling/bench_kda.py: our op at the shapes, and with the backward
#              recomputing the forward's intermediates (kernels.kda_keep = false)
#   kda_verify the KDA GPU tests (-m gpu: float64 references, fla beside them, kept against
#              recomputed, input maps, scans) and the kernel tests compiled on the GPU (autograd,
#              g = g_min, bf16 partials, TMA against pointer loads, the launch knobs) (not in the
#              default list)
#   kda_long   the long-context KDA GPU tests (tests/test_kda_long_context.py: 32K and 128K in bf16
#              against our chunked path in fp32 and fla, 128K with g = g_min); also run by
#              kda_verify (not in the default list)
#   kda_fla_all  profiling/bench_kda.py --kernels 8 at the four shapes ($SUITE_KDA_SHAPES: the
#              sequence lengths to keep) with fla in the same run (its autotuning results: see
#              TRITON_CACHE_DIR below) (not in the default list)
#   kda_ncu    Nsight Compute on one warm forward and one forward+backward call of our op at 32K
#              ($SUITE_NCU_SHAPES): kda_ncu_details.csv, kda_ncu_raw.csv and, from them,
#              kda_ncu_table.txt (profiling/ncu_table.py: per kernel time, DRAM and SM throughput,
#              occupancy, stall reasons) (not in the default list)
#   kda_fla    profiling/bench_kda.py --kernels 6: ours against fla in the same run (fla's
#              autotuning takes minutes on a fresh machine)
#   kda_graphs profiling/bench_kda.py --cuda-graphs at 8K and 32K: ours and fla, each also
#              replayed from a CUDA graph (the host's share of each call) (not in the default list)
#   moe        profiling/bench_moe.py --dispatch: grouped GEMM, fp8 providers, MoE layer, dispatch
#   train      small_1gpu eager and compiled, 30 steps each (tokens/s, memory)
#   train_ep   small_1gpu FSDP2 x EP2 compiled, 30 steps (needs 2 GPUs)
#   fp8        small_1gpu compiled, fp8 linears and experts, 30 steps
#   regions    small_1gpu compiled with [compile] moe_regions = "piecewise" (torchtitan's MoE
#              compile) beside the default whole-layer regions, 30 steps each (not in the default list)
#   aoti       profiling/aoti_isolate.py: which layer kind's AOTInductor package fails on CUDA
#              (not in the default list)
#   fp8_all*   the fp8_all recipe (tensorwise fp8 linears with cache_weights, fp8 experts with
#              wgrad "fp8_rows", situ_quant and widen "triton") beside bf16; each section ends with
#              profiling/step_table.py over its runs: tokens/s, fp8 / bf16, losses and memory
#   fp8_all_b8 two wide_1gpu runs, 24 steps each, at local batch 8 (32K tokens per step in one
#              microbatch: ~56 GiB of fp32 weights, gradients and AdamW state plus activations under
#              full checkpointing) (not in the default list)
#   fp8_all_small  the same pair on small_1gpu compiled (width 1024, 8K tokens per step), 40
#              steps, one after the other: the small config's fp8 / bf16 speed ratio, which the
#              loss check cannot give (not in the default list)
#   fp8_all_loss  the loss check with the fp8_all recipe: small_1gpu compiled, 300 steps, bf16
#              and fp8_all started together (they share the GPU: their tokens/s are not speeds)
#              (not in the default list)
#   dw_fp8     the fp8 dw kernel's load forms beside the default recipe: the grouped-GEMM and fp8
#              grouped tests, providers native, auto, fp8_cached_w_dw8rows and fp8_cached_w_auto at
#              E = 64 (balanced, Zipf 1.1) and K3's gate|up as CUDA-graph replays, plus
#              --fp8-dw-tiles at the opt-in tile with pointer loads, per-group device descriptors
#              (fp8dwg_, TITAN_MOE_GROUPED_MM_DW_TMA=group) and the flat loop ("f"), and two
#              programs per SM (not in the default list)
#   gemm_auto  the bf16 grouped-GEMM GPU tests, then native, auto, tma_dw_native (auto's forward
#              and dx, torch's dw) and fp8 (w quantized beforehand, wgrad "auto") at E = 64 and K3's
#              down projection (not in the default list)
#   gemm_goals  the op's default (auto) against torch._grouped_mm: the GPU tests of the Gluon
#              backend, the op and the MoE layer, the GEMM products through the op (native, auto,
#              gluon) at E = 64 and the layer's shapes, then the eager MoE layer against
#              torchtitan's (not in the default list)
#   parts      profiling/bench_step_parts.py: the AttnRes mix, SiTU-GLU forms, the weight refresh
#              and the fp32 weight gradient at wide_1gpu's shapes (not in the default list)
#   mla_attention  profiling/bench_attention.py at 32K and 128K: MLA attention over packed documents
#              per path (varlen, dense) beside causal SDPA over one document, then the same paths
#              over 8 successive corpus rows (--fresh-rows) (not in the default list)
#   mla_step   small_1gpu compiled at 32K x 1, 16 steps, once per CUDA model.mla_attention path
#              (dense, varlen), each with TORCH_LOGS=recompiles,graph_breaks (in its output file), then
#              profiling/step_table.py over the two (not in the default list)
#   keep       small_1gpu eager, 30 steps, with --kernels.kda_keep False (the KDA backward recomputes
#              the forward's intermediates) beside the default, which keeps them (not in the default list)
#   one_device_mp  small_1gpu compiled at 8K x 4, 20 steps, with training.one_device_mixed_precision
#              "autocast" (fp32 stream) and then "fsdp" (FSDP2 on the one GPU: bf16 stream), the same
#              initial weights (debug.seed), then profiling/step_table.py over the two (not in the
#              default list)
#   ladder     configs/ladder_1gpu.toml, the one-GPU context ladder 8K -> 32K -> 128K, held-out
#              loss by position on torch's source (ladder.eval_packages_path); $SUITE_LADDER_ARGS adds
#              overrides (e.g. --ladder.stages.1.steps 200 to fit a call) (not in the default list)
#   ablate_balance  scripts/ablate.py, arms qb, sign and qb_batch on small_1gpu compiled at 8K x 4,
#              200 steps, two at once on a GPU over 100 GB (not in the default list)
#   long_step  profiling/peer_step.py at 128K x 1 on one-document rows, ours and MLA in every layer,
#              full AC in FSDP mode with 64K MoE token tiles, 16K-token head chunks and expandable
#              allocator segments (what fits one 80 GB H100) (not in the default list)
#   ladder_compare  scripts/ladder_compare.py on configs/ladder_1gpu.toml: the ladder, its
#              no-synthetic baseline and the all-MLA variant, $SUITE_LADDER_JOBS (default 2) at a
#              time, the held-out packages as in `ladder`; rerun to resume ($SUITE_LADDER_ARGS: e.g.
#              --exit-at-step 400) (not in the default list)
#   ablate_recipe  scripts/ablate.py on the ladder_1gpu flavor (~150M) at 8K x 1 compiled, 300 steps,
#              held-out loss every 50, seeds $SUITE_ABLATE_SEEDS (default 0,1), four arms at once
#              (six on a GPU over 100 GB): every arm of the recipe's ablation and the LR sweep
#              ($SUITE_ABLATE_ARMS: others); rerun to go on (finished arms are kept) (not in the
#              default list)
#   step_profile  small_1gpu compiled at 8K x 4, 14 steps, step 12 under torch.profiler with NVTX
#              ranges, then profiling/summarize_trace.py --gpu: busy and idle %, kernel time by
#              category, top kernels, Inductor's kernels pooled by fusion (not in the default list)
#   long_memory small_1gpu compiled at 64K x 1 with full AC, 2 steps under a memory snapshot:
#              profiling/memory_snapshot.py's summary (the trace's peak and what was live then,
#              by allocating code) beside the planner's row; then the same 2 steps with
#              kernels.kda_keep = false and both peaks side by side (profiling/step_table.py)
#              (not in the default list)
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
# $SUITE_AUTOTUNE_IN (such an archive from an earlier run; unset or empty: none).
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
AUTOTUNE_IN=${SUITE_AUTOTUNE_IN:-}
if [ "${SUITE_DRY_RUN:-0}" != 1 ] && [ -n "$AUTOTUNE_IN" ] && [ -f "$AUTOTUNE_IN" ]; then
    mkdir -p "$TRITON_CACHE_DIR" && tar -xzf "$AUTOTUNE_IN" -C "$TRITON_CACHE_DIR" --skip-old-files
fi
SMALL=(-m titan_moe.train --job.config_file configs/small_1gpu.toml --training.steps 30
       --metrics.log_freq 5 --validation.freq 1000)
FP8=(--model.converters titan_float8,titan_float8_experts --quantize.linear.float8.recipe_name rowwise)
# fp8_all's recipe: every fp8 option on
FP8_TW=(--model.converters titan_float8,titan_float8_experts --quantize.linear.float8.recipe_name tensorwise)
LINEAR_CACHE=(--quantize.linear.float8.cache_weights)
EXPERTS_ROWS=(--quantize.grouped_mm.float8.wgrad fp8_rows)
EXPERTS_SITU=(--quantize.grouped_mm.float8.situ_quant --quantize.grouped_mm.float8.widen triton)
FP8_ALL=("${FP8_TW[@]}" "${LINEAR_CACHE[@]}" "${EXPERTS_ROWS[@]}" "${EXPERTS_SITU[@]}")

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
MP_PAIR=(-m titan_moe.train --job.config_file configs/small_1gpu.toml --compile.enable --training.local_batch_size 4
         --training.steps 20 --metrics.log_freq 2 --validation.no_enable --debug.seed 0)
fp8_all_pair() {
    local name=$1
    shift
    run "${name}_bf16" torchrun --standalone --nproc_per_node=1 "${PAIR[@]}" "$@" \
        --job.dump_folder "$DUMP/${name}_bf16"
    run "${name}_fp8" torchrun --standalone --nproc_per_node=1 "${PAIR[@]}" "$@" \
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
        kda) run kda python profiling/bench_kda.py --no-fla --kernels 6 --variants recompute:kernels.kda_keep=false ;;
        kda_verify)  # the KDA GPU tests with today's defaults, compiled: float64 references, forms, partials
            run kda_verify_tests python -m pytest -m gpu -q -s -rsx -p no:cacheprovider tests/test_kda_triton.py \
                tests/test_kda_kept.py tests/test_kda_prepare.py tests/test_kda_scan.py
            run kda_verify_kernels python -m pytest -q -rsx -p no:cacheprovider tests/test_kda_triton.py \
                -k "bwd_matches_autograd or gate_min or partials or tma or override or key_split"
            run_kda_long ;;
        kda_long) run_kda_long ;;
        kda_fla_all) run kda_fla_all python profiling/bench_kda.py --kernels 8 --watchdog 300 \
                --shapes "${SUITE_KDA_SHAPES:-8192,32768,131072,4096}" ;;
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
        train)
            run train_eager torchrun --standalone --nproc_per_node=1 "${SMALL[@]}" --job.dump_folder "$DUMP/train_eager"
            run train_compiled torchrun --standalone --nproc_per_node=1 "${SMALL[@]}" --compile.enable \
                --job.dump_folder "$DUMP/train_compiled" ;;
        train_ep)
            run train_ep torchrun --standalone --nproc_per_node=2 "${SMALL[@]}" --compile.enable \
                --parallelism.data_parallel_shard_degree 2 --parallelism.expert_parallel_degree 2 \
                --validation.local_batch_size 2 --job.dump_folder "$DUMP/train_ep" ;;
        one_device_mp)
            for mode in autocast fsdp; do
                run "one_device_mp_$mode" torchrun --standalone --nproc_per_node=1 "${MP_PAIR[@]}" \
                    --training.one_device_mixed_precision "$mode" --job.dump_folder "$DUMP/one_device_mp_$mode"
            done
            run one_device_mp_table python profiling/step_table.py "$DUMP/one_device_mp_autocast" \
                "$DUMP/one_device_mp_fsdp" --mean-after 6 ;;
        fp8) run fp8 torchrun --standalone --nproc_per_node=1 "${SMALL[@]}" --compile.enable "${FP8[@]}" \
                --job.dump_folder "$DUMP/fp8" ;;
        regions)
            run regions_whole torchrun --standalone --nproc_per_node=1 "${SMALL[@]}" --compile.enable \
                --job.dump_folder "$DUMP/regions_whole"
            run regions_piecewise torchrun --standalone --nproc_per_node=1 "${SMALL[@]}" --compile.enable \
                --compile.moe_regions piecewise --job.dump_folder "$DUMP/regions_piecewise" ;;
        aoti) run aoti python profiling/aoti_isolate.py --device cuda ;;
        fp8_all_b8) fp8_all_pair fp8_all_b8 --training.local_batch_size 8 ;;
        fp8_all_small) PAIR=("${SMALL_PAIR[@]}"); fp8_all_pair fp8_all_small; PAIR=("${WIDE_PAIR[@]}") ;;
        fp8_all_loss)
            LOSS=(-m titan_moe.train --job.config_file configs/small_1gpu.toml --metrics.log_freq 10 --compile.enable)
            run fp8_all_loss_bf16 torchrun --standalone --nproc_per_node=1 "${LOSS[@]}" \
                --job.dump_folder "$DUMP/fp8_all_loss_bf16" &
            run fp8_all_loss_fp8 torchrun --standalone --nproc_per_node=1 \
                "${LOSS[@]}" "${FP8_ALL[@]}" --job.dump_folder "$DUMP/fp8_all_loss_fp8" &
            wait
            run fp8_all_loss_table python profiling/step_table.py "$DUMP/fp8_all_loss_bf16" "$DUMP/fp8_all_loss_fp8" \
                --steps 100,200,300 ;;
        dw_fp8)  # fp8 dw forms beside the default recipe (fp8_gemm_short's providers and cases)
            run dw_fp8_tests python -m pytest -q -rsx -p no:cacheprovider tests/test_grouped_gemm_triton.py \
                tests/test_float8_grouped.py
            run dw_fp8 python profiling/bench_moe.py --skip-layer --cuda-graph \
                --gemm-providers native,auto,fp8_cached_w_dw8rows,fp8_cached_w_auto \
                --fp8-dw-tiles 128x256x128x8x3t,128x256x128x8x3tf,64x128x128x4x3x2t \
                --gemm-cases e64_balanced,e64_zipf1.1,k3_gate_up_balanced ;;
        gemm_auto)  # the bf16 defaults through the op: auto (its dw on our kernel at E = 64) beside native
            run gemm_auto_tests python -m pytest -q -rsx -p no:cacheprovider tests/test_grouped_gemm_triton.py \
                tests/test_grouped_gemm.py -k "cuda or gpu"
            run gemm_auto python profiling/bench_moe.py --skip-layer --cuda-graph \
                --gemm-providers native,auto,tma_dw_native,fp8_cached_w_auto \
                --gemm-cases e64_balanced,e64_zipf1.1,k3_down_balanced ;;
        gemm_goals)  # the default backend against torch._grouped_mm, then the layer against torchtitan's
            run gemm_goals_tests python -m pytest -q -rsx -p no:cacheprovider -m gpu tests/test_grouped_gemm_gluon.py \
                tests/test_grouped_gemm.py tests/test_moe.py
            run gemm_goals python profiling/bench_moe.py --skip-layer --cuda-graph --gemm-providers native,auto,gluon \
                --gemm-cases e64_balanced,e64_zipf1.1,layer_gate_up,layer_down
            run gemm_goals_layer python profiling/bench_moe.py --skip-gemm --layer-providers ours_auto \
                --layer-kernels 14 ;;
        parts) run parts python profiling/bench_step_parts.py ;;
        mla_attention)
            run mla_attention python profiling/bench_attention.py --seq-lens 32768 131072 \
                --paths causal_sdpa varlen dense
            run mla_attention_rows python profiling/bench_attention.py --seq-lens 32768 --fresh-rows 8 \
                --paths varlen dense ;;
        mla_step)
            for path in dense varlen; do
                TORCH_LOGS=recompiles,graph_breaks run "mla_step_$path" torchrun --standalone --nproc_per_node=1 \
                    "${SMALL[@]}" --compile.enable --training.seq_len 32768 --training.steps 16 --metrics.log_freq 2 \
                    --validation.no_enable --model.mla_attention "$path" --job.dump_folder "$DUMP/mla_step_$path"
            done
            run mla_step_table python profiling/step_table.py "$DUMP/mla_step_dense" "$DUMP/mla_step_varlen" \
                --mean-after 4 ;;
        keep)
            run keep_on torchrun --standalone --nproc_per_node=1 "${SMALL[@]}" --job.dump_folder "$DUMP/keep_on"
            run keep_off torchrun --standalone --nproc_per_node=1 "${SMALL[@]}" --kernels.kda_keep False \
                --job.dump_folder "$DUMP/keep_off" ;;
        ladder)
            # the held-out long documents: torch's own source, which no run trains on
            TORCH_SOURCE=$(python -c "import os, torch; print(os.path.dirname(torch.__file__))")
            run ladder python -m titan_moe.train --job.config_file configs/ladder_1gpu.toml \
                --job.dump_folder "$DUMP/ladder" --ladder.eval_packages_path "$TORCH_SOURCE" \
                ${SUITE_LADDER_ARGS:-} ;;
        ladder_compare)
            TORCH_SOURCE=$(python -c "import os, torch; print(os.path.dirname(torch.__file__))")
            run ladder_compare python scripts/ladder_compare.py --out "$DUMP/ladder_compare" \
                --jobs "${SUITE_LADDER_JOBS:-2}" --job.config_file configs/ladder_1gpu.toml \
                --ladder.eval_packages_path "$TORCH_SOURCE" ${SUITE_LADDER_ARGS:-} ;;
        ablate_recipe)
            ABLATE_JOBS=$(python -c "import torch; print(6 if torch.cuda.is_available() and \
torch.cuda.get_device_properties(0).total_memory > 100 * 2**30 else 4)")
            run ablate_recipe python scripts/ablate.py --out "$DUMP/ablate_recipe" \
                --arms "${SUITE_ABLATE_ARMS:-recipe,qb,sign,aux_loss,attn_res_full,attn_res_none,swiglu,unbounded_gate,muon,adamw@3e-3,muon@3e-3}" \
                --seeds "${SUITE_ABLATE_SEEDS:-0,1}" --jobs "$ABLATE_JOBS" --eval-every 50 \
                --job.config_file configs/small_1gpu.toml --model.flavor ladder_1gpu --compile.enable \
                --training.steps 300 --metrics.log_freq 1 --validation.steps 4 ;;
        ablate_balance)
            # two arms at once on a GPU of more than 100 GB (two small_1gpu 8K x 4 runs fit)
            ABLATE_JOBS=$(python -c "import torch; print(2 if torch.cuda.is_available() and \
torch.cuda.get_device_properties(0).total_memory > 100 * 2**30 else 1)")
            run ablate_balance python scripts/ablate.py --out "$DUMP/ablate_balance" --arms qb,sign,qb_batch \
                --seeds 0 --jobs "$ABLATE_JOBS" --job.config_file configs/small_1gpu.toml --compile.enable \
                --training.local_batch_size 4 --training.steps 200 --metrics.log_freq 1 --validation.steps 4 ;;
        long_step)
            PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True run long_step python profiling/peer_step.py \
                --seq-len 131072 --batch 1 --rows long --runs ours,ours_all_mla --steps 7 --warmup 3 \
                --out "$DUMP/long_step" --budget-s "$LIMIT" -- --activation_checkpoint.mode full \
                --training.one_device_mixed_precision fsdp --model.moe_token_tile 65536 \
                --model.head_chunk_tokens 16384 ;;
        step_profile)
            run step_profile torchrun --standalone --nproc_per_node=1 -m titan_moe.train \
                --job.config_file configs/small_1gpu.toml --compile.enable --training.local_batch_size 4 \
                --training.steps 14 --metrics.log_freq 1 --validation.no_enable --checkpoint.no_enable \
                --profiling.enable_profiling --profiling.profile_freq 12 --profiling.nvtx \
                --job.dump_folder "$DUMP/step_profile"
            run step_profile_gpu python profiling/summarize_trace.py --gpu "$DUMP/step_profile/profile_traces" ;;
        long_memory)
            LONG_MEMORY=(--job.config_file configs/small_1gpu.toml --compile.enable --training.seq_len 65536
                         --activation_checkpoint.mode full)
            run long_memory torchrun --standalone --nproc_per_node=1 -m titan_moe.train "${LONG_MEMORY[@]}" \
                --training.steps 2 --metrics.log_freq 1 --validation.no_enable --checkpoint.no_enable \
                --profiling.enable_memory_snapshot --profiling.profile_freq 2 --job.dump_folder "$DUMP/long_memory"
            run long_memory_summary python profiling/memory_snapshot.py --top 40 \
                "$DUMP/long_memory/memory_snapshot/iteration_2/rank0_memory_snapshot.pickle"
            run long_memory_plan python -m titan_moe.plan "${LONG_MEMORY[@]}" --gpus 1 --gpu-mem-gib 80 --ac full
            run long_memory_nokeep torchrun --standalone --nproc_per_node=1 -m titan_moe.train "${LONG_MEMORY[@]}" \
                --training.steps 2 --metrics.log_freq 1 --validation.no_enable --checkpoint.no_enable \
                --kernels.kda_keep False --job.dump_folder "$DUMP/long_memory_nokeep"
            run long_memory_table python profiling/step_table.py "$DUMP/long_memory" "$DUMP/long_memory_nokeep" ;;
        *) echo "gpu_suite: unknown section $section" >&2; exit 2 ;;
    esac
done
if [ -d "$TRITON_CACHE_DIR" ]; then  # the autotuning results, for a later machine: one archive
    AUTOTUNE_OUT=$(cd "$OUT" && pwd)/triton_autotune.tar.gz
    (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | sort > "$AUTOTUNE_OUT.list"
     [ -s "$AUTOTUNE_OUT.list" ] && tar -czf "$AUTOTUNE_OUT" -T "$AUTOTUNE_OUT.list"
     rm -f "$AUTOTUNE_OUT.list")
fi
