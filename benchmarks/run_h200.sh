#!/usr/bin/env bash
# The GPU runs behind benchmarks/results: one stage per measurement, named by what it measures, each on one H200
# unless its comment says two GPUs.
#
#   bash benchmarks/run_h200.sh STAGE [STAGE ...]     # results land in $OUT (default /tmp/h200_out)
#
# Each stage writes the result file of the same name as the committed one; benchmarks/results/README.md ("Result
# files") lists which stage made which file, and every JSON records its exact command, GPU and versions.
# Needs torch with CUDA, transformers, trl, datasets, accelerate, peft (and liger-kernel for the `--liger` stages,
# pytest-xdist for the test stages that pass `-n`). On a machine without network, put their wheels in .whl/ (at its
# top, or as benchmarks/gpu_compile.sh lays them out: .whl/async, .whl/common, .whl/hub): they are installed into
# /tmp/site and /tmp/common first.
set -uo pipefail
# USE_HUB_KERNELS=0: from transformers 5.25 on, loading a model and `model.train()` fetch Hugging Face Hub kernels
# by default, which a machine without the Hub cannot (every side alike: TRL's trainer too)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false NCCL_NVLS_ENABLE=0
export USE_HUB_KERNELS=0
for wheels in ".whl/*.whl" ".whl/async/*.whl"; do
  if compgen -G "$wheels" >/dev/null && [ ! -d /tmp/site/trl ]; then
    # shellcheck disable=SC2086
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels \
      >/dev/null 2>&1 || exit 1
  fi
done
export PYTHONPATH=/tmp/site:$PWD
if compgen -G ".whl/common/*.whl" >/dev/null && [ ! -d /tmp/common/transformers ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/common \
    .whl/common/*.whl >/dev/null 2>&1 || exit 1
  # huggingface_hub 2.x imports httpx2 lazily (transformers imports without it, a download fails): always install it
  if compgen -G ".whl/hub/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/common \
      .whl/hub/*.whl >/dev/null 2>&1 || exit 1
  fi
fi
[ -d /tmp/common/transformers ] && export PYTHONPATH=/tmp/common:$PYTHONPATH
export OUT=${OUT:-/tmp/h200_out}  # exported: the job scripts some stages run write there too
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
# The card in the names of the files a stage writes where it may run on an H100 too (the same 989 TFLOP/s dense bf16
# peak, 80 GB at 3.35 TB/s against the H200's 141 GB at 4.8 TB/s): those stages name their file with `_$card_`.
card=h200
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100 && card=h100
python3 -c "import torch, transformers, trl, peft, accelerate; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'trl', trl.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__)"

# Output filter: drop warnings, keep the last lines (the result table).
quiet() { grep -v -i warn | grep -v "^\[transformers\]" | tail -"${1:-20}"; }
# The hybrid results ran on transformers' torch kernels: flash-linear-attention 0.6 refuses its gated-delta-rule
# backward on Hopper with Triton < 3.7.1 (wrong gradients, fla-org/flash-linear-attention#640); the image has
# Triton 3.6.
without_fla() { rm -rf /tmp/site/fla /tmp/site/fla_core* /tmp/site/flash_linear_attention*; }
# fla 0.6 on its Triton kernels (the `fla_triton` route of benchmarks/gdn_kernels.py), with its autotuning results
# from earlier calls (benchmarks/hybrid_env.sh says which); installed once per machine.
with_fla06() {
  if [ ! -d /tmp/fla06/fla ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fla06 .whl/hybrid/fla06/*.whl || return 1
    mkdir -p /tmp/triton && tar xzf benchmarks/cache/triton_autotune_h200.tgz -C /tmp/triton
  fi
  export PYTHONPATH=/tmp/fla06:$PYTHONPATH TRITON_CACHE_DIR=/tmp/triton FLA_CACHE_RESULTS=1
}
# FlashAttention-4 for FlexAttention's FLASH backend: the two halves of benchmarks/fa4_wheels.sh's packed site (the
# first kept in /tmp by stage `fa4-site-1`, the second carried as .fa4/2), unpacked once per machine. A call carries
# at most 64 MiB with the work tree (about 20 MiB, most of it the result files' per-token log-probabilities): a half
# (35 MiB) and .whl (22 MiB) do not fit together beside it. Where a stage says "carry .fa4/2 and .whl", run
# `fa4-site-1` (carry .fa4/1), then any stage carrying .whl (its wheels stay installed in /tmp/site and /tmp/common
# on the warm machine; `async-grpo-warm-start-1.7b` needs nothing more), then the stage carrying .fa4/2 alone, each
# call within the 30 s a machine stays warm.
with_fa4() {
  mkdir -p /tmp/fa4parts && cp .fa4/2/* /tmp/fa4parts/ 2>/dev/null
  if [ ! -d /tmp/fa4site/flash_attn ]; then
    python3 - /tmp/fa4site /tmp/fa4parts/fa4_site.tar.xz.part-* <<'PY' || { echo "no FA4 site: run fa4-site-1 first"; return 1; }
import io, sys, tarfile
data = b"".join(open(part, "rb").read() for part in sorted(sys.argv[2:]))
with tarfile.open(fileobj=io.BytesIO(data), mode="r:xz") as tar:
    tar.extractall(sys.argv[1], filter="tar")
PY
  fi
  # The site's nvidia_cutlass_dsl_packages.pth puts `cutlass` on the path only in a site directory, not through
  # PYTHONPATH: its folder is added here.
  export PYTHONPATH=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
  python3 -c "import flash_attn.cute, torch; print('flash_attn.cute with torch', torch.__version__)"
}
# The last lines of a pytest log that say what passed and what failed.
summary() { grep -E "FAILED|ERROR|passed|failed" "$1" | tail -"${2:-20}"; }
# A test log's head: its command (the first argument), then the card, versions and commit (HF_TREE_ATTN_COMMIT).
log_head() {
  echo "# $1"
  python3 -c "import torch, transformers, trl, accelerate; print('# one', torch.cuda.get_device_name(), 'torch',
torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__, 'accelerate',
accelerate.__version__, end='; ')"
  echo "commit ${HF_TREE_ATTN_COMMIT:-unknown}, $([ "${HF_TREE_ATTN_DIRTY:-0}" = 1 ] && echo dirty || echo clean)"
}

for stage in "$@"; do
  echo "=== $stage"
  case $stage in
    # ---- the trainer phase, tree vs flat in one process (bench_tree_vs_flat.py)
    trainer-phase-0.6b)  # GRPO shapes, the agent workload, no sharing; one end-to-end step; the recompile check
      timeout 500 python3 benchmarks/bench_tree_vs_flat.py --models qwen3-0.6b --scale 0.5 --e2e --recompile-check \
        --repeats 2 --out "$OUT/tree_vs_flat_h200_qwen3-0.6b.json" 2>&1 | quiet 40 ;;
    trainer-phase-0.6b-memory)  # peak memory with the gradient probes off the GPU
      timeout 170 python3 benchmarks/bench_tree_vs_flat.py --models qwen3-0.6b --scale 0.5 --repeats 1 \
        --workloads no_sharing grpo_G16_P4096_C512 --out "$OUT/tree_vs_flat_h200_qwen3-0.6b_memory.json" 2>&1 \
        | quiet ;;
    trainer-phase-1.7b-agent)
      timeout 300 python3 benchmarks/bench_tree_vs_flat.py --models qwen3-1.7b --scale 0.5 --repeats 2 \
        --workloads tau2_like_agent --out "$OUT/tree_vs_flat_h200_qwen3-1.7b_agent.json" 2>&1 | quiet ;;
    trainer-phase-8b)
      timeout 420 python3 benchmarks/bench_tree_vs_flat.py --models qwen3-8b --scale 0.25 --repeats 1 \
        --workloads grpo_G16_P4096_C512 --out "$OUT/tree_vs_flat_h200_qwen3-8b.json" 2>&1 | quiet ;;
    recompute-1.7b)  # eager layers: every layer recomputed vs tree_recompute="auto"
      timeout 150 python3 benchmarks/bench_tree_vs_flat.py --models qwen3-1.7b --scale 0.5 --repeats 1 \
        --workloads grpo_G16_P4096_C512 --checkpointing all \
        --out "$OUT/tree_vs_flat_h200_qwen3-1.7b_ckpt-all.json" 2>&1 | quiet 3
      timeout 150 python3 benchmarks/bench_tree_vs_flat.py --models qwen3-1.7b --scale 0.5 --repeats 1 \
        --workloads grpo_G16_P4096_C512 --checkpointing auto \
        --out "$OUT/tree_vs_flat_h200_qwen3-1.7b_ckpt-auto.json" 2>&1 | quiet 3 ;;
    sliding-window-gemma3-1b)  # window 512 < 4,096-token prompts
      timeout 200 python3 benchmarks/bench_tree_vs_flat.py --models gemma3-1b --workloads grpo_G16_P4096_C512 \
        --scale 0.5 --repeats 1 --out "$OUT/tree_vs_flat_h200_gemma3-1b.json" 2>&1 | quiet ;;
    liger-compiled-1.7b)  # Liger's kernels + regional compile on every method
      timeout 240 python3 benchmarks/bench_tree_vs_flat.py --models qwen3-1.7b --scale 0.5 --repeats 1 \
        --workloads grpo_G16_P4096_C512 --checkpointing auto --liger --compile-layers \
        --out "$OUT/tree_vs_flat_h200_qwen3-1.7b_liger_compile.json" 2>&1 | quiet 3 ;;
    prefix-kernels-vs-flex-1.7b)  # compiled layers; the tree with the shared-prefix kernels and with FlexAttention
      timeout 300 python3 benchmarks/bench_tree_vs_flat.py --models qwen3-1.7b --scale 0.5 --repeats 2 \
        --workloads grpo_G16_P4096_C512 --checkpointing auto --compile-layers --compare-flex \
        --out "$OUT/tree_vs_flat_h200_qwen3-1.7b_compile_prefix.json" 2>&1 | quiet 3 ;;
    prefix-kernels-vs-flex-8b)
      timeout 400 python3 benchmarks/bench_tree_vs_flat.py --models qwen3-8b --scale 0.25 --repeats 1 \
        --workloads grpo_G16_P4096_C512 --checkpointing auto --compile-layers --compare-flex \
        --out "$OUT/tree_vs_flat_h200_qwen3-8b_compile_prefix.json" 2>&1 | quiet 3 ;;
    kept-attention-1.7b)  # checkpointed layers keep the kernels' attention vs recompute it (whole-layer recompute)
      timeout 200 python3 benchmarks/bench_tree_vs_flat.py --models qwen3-1.7b --scale 0.5 --repeats 2 \
        --workloads grpo_G16_P4096_C512 --checkpointing auto --compile-layers --compare-whole-recompute \
        --out "$OUT/tree_vs_flat_h200_qwen3-1.7b_compile_keep.json" 2>&1 | quiet 2 ;;
    kept-attention-8b)
      timeout 300 python3 benchmarks/bench_tree_vs_flat.py --models qwen3-8b --scale 0.25 --repeats 1 \
        --workloads grpo_G16_P4096_C512 --checkpointing auto --compile-layers --compare-whole-recompute \
        --out "$OUT/tree_vs_flat_h200_qwen3-8b_compile_keep.json" 2>&1 | quiet 2 ;;
    activation-budget-1.7b)  # the default bound and tree_activation_budget_gib 40 / 80, side by side
      timeout 300 python3 benchmarks/bench_tree_vs_flat.py --models qwen3-1.7b --scale 0.5 --repeats 2 \
        --workloads grpo_G16_P4096_C512 --checkpointing auto --compile-layers --compare-budget-gib 40 80 \
        --out "$OUT/tree_vs_flat_h200_qwen3-1.7b_compile_budget.json" 2>&1 | quiet 4 ;;
    # ---- hybrids (transformers' torch kernels for the recurrent layers)
    hybrid-qwen3.5-grpo)  # one prompt group (scale 0.25)
      without_fla
      timeout 230 python3 benchmarks/bench_tree_vs_flat.py --models qwen3.5-0.8b --scale 0.25 --repeats 1 \
        --workloads grpo_G16_P4096_C512 --out "$OUT/tree_vs_flat_h200_qwen3.5-0.8b.json" 2>&1 | quiet 3 ;;
    hybrid-qwen3.5-agent)  # ~500 s
      without_fla
      timeout 540 python3 benchmarks/bench_tree_vs_flat.py --models qwen3.5-0.8b --scale 0.25 --repeats 1 \
        --workloads agent_20_turns --out "$OUT/tree_vs_flat_h200_qwen3.5-0.8b_agent20.json" 2>&1 | quiet 3 ;;
    hybrid-level-cost)  # one Gated DeltaNet scan, level by level vs one call over as many tokens
      without_fla
      timeout 80 python3 benchmarks/bench_levels.py --device cuda --heads 16 --dim 128 --scale 1 \
        --out "$OUT/levels_h200.json" 2>&1 | quiet 8 ;;
    hybrid-kernels)  # every Gated DeltaNet kernel route checked against the torch reference, then parity tests and
      # benchmark rows on the first route that passes (gpu_hybrid_kernels.sh, ~9 min; carry .whl/hybrid)
      bash benchmarks/gpu_hybrid_kernels.sh
      mv "$OUT/kernel_checks.json" "$OUT/hybrid_kernel_checks_h200.json"
      mv "$OUT/hybrid_gpu.log" "$OUT/hybrid_kernels_h200.log"
      mv "$OUT/gpu_tests_hybrid_kernels.log" "$OUT/h200_gpu_tests_hybrid_kernels.log" ;;
    # The delta rule in two kernel calls vs level by level, on fla 0.6's Triton kernels (carry .whl/hybrid/fla06 and
    # .whl/common): the kernel alone both ways, the route's parity tests, and Qwen3.5-0.8B's 20-turn agent row (two
    # calls back to back on one warm machine: hybrid-two-pass, then hybrid-two-pass-rows).
    hybrid-two-pass)
      with_fla06
      timeout 150 python3 benchmarks/bench_levels.py --device cuda --heads 16 --dim 128 --scale 1 --repeats 5 \
        --gdn-route fla_triton --out "$OUT/levels_h200_fla_triton.json" 2>&1 | quiet 4
      # bf16 only: fp32 on fla's Triton kernels autotuned past a 300 s limit
      timeout 200 python3 -m pytest -v -s -rfEs -m gpu -p no:cacheprovider tests/test_gpu_recurrent.py \
        -k "fla_triton and (two_calls or each_kernel_route) and bf16" >"$OUT/h200_gpu_tests_two_pass.log" 2>&1
      summary "$OUT/h200_gpu_tests_two_pass.log" 40 ;;
    hybrid-two-pass-side-by-side)  # the two paths on one forest each, Qwen3.5 heads, bf16, 2 to 40 levels
      with_fla06
      timeout 300 python3 -m pytest -v -s -rfEs -m gpu -p no:cacheprovider tests/test_gpu_recurrent.py \
        -k "fla_triton and two_calls and qwen3_5_k128 and bf16" >"$OUT/h200_gpu_tests_two_pass_side_by_side.log" 2>&1
      summary "$OUT/h200_gpu_tests_two_pass_side_by_side.log" 40 ;;
    hybrid-two-pass-rows)
      with_fla06
      timeout 330 python3 benchmarks/bench_tree_vs_flat.py --models qwen3.5-0.8b --workloads agent_20_turns \
        --scale 0.25 --repeats 2 --gdn-route fla_triton \
        --out "$OUT/tree_vs_flat_h200_qwen3.5-0.8b_agent20_fla_triton.json" 2>&1 | quiet 4 ;;
    hybrid-two-pass-rows-paired)  # the same row with 8 timed repeats per method, paired per repeat (carry
      # .whl/hybrid/fla06 and .whl/common)
      with_fla06
      timeout 570 python3 benchmarks/bench_tree_vs_flat.py --models qwen3.5-0.8b --workloads agent_20_turns \
        --scale 0.25 --repeats 8 --gdn-route fla_triton \
        --out "$OUT/tree_vs_flat_${card}_qwen3.5-0.8b_agent20_fla_triton_paired.json" 2>&1 | quiet 6 ;;
    hybrid-two-pass-rows-2b-paired)  # the same row at the Qwen3.5-2B shape (a flat padded step ~22 s; carry
      # .whl/hybrid/fla06)
      with_fla06
      timeout 580 python3 benchmarks/bench_tree_vs_flat.py --models qwen3.5-2b --workloads agent_20_turns \
        --scale 0.25 --repeats 8 --gdn-route fla_triton \
        --out "$OUT/tree_vs_flat_${card}_qwen3.5-2b_agent20_fla_triton_paired.json" 2>&1 | quiet 6 ;;
    hybrid-grpo-fla-triton-paired)  # one GRPO group (2 levels: the level loop) on fla's Triton kernels, 0.8B and 2B
      # shapes, 8 timed repeats per method, paired per repeat (carry .whl/hybrid/fla06)
      with_fla06
      timeout 280 python3 benchmarks/bench_tree_vs_flat.py --models qwen3.5-0.8b --workloads grpo_G16_P4096_C512 \
        --scale 0.25 --repeats 8 --gdn-route fla_triton \
        --out "$OUT/tree_vs_flat_${card}_qwen3.5-0.8b_grpo_fla_triton_paired.json" 2>&1 | quiet 6
      timeout 280 python3 benchmarks/bench_tree_vs_flat.py --models qwen3.5-2b --workloads grpo_G16_P4096_C512 \
        --scale 0.25 --repeats 8 --gdn-route fla_triton \
        --out "$OUT/tree_vs_flat_${card}_qwen3.5-2b_grpo_fla_triton_paired.json" 2>&1 | quiet 6 ;;
    hybrid-async-fla)  # TreeAsyncGRPOTrainer on Qwen3.5 shapes, fla's Triton kernels (TRL refuses hybrids: the tree alone)
      with_fla06
      timeout 270 python3 benchmarks/bench_async_grpo.py --models qwen3.5-0.8b --workloads tau2_like grpo_mixed \
        --sides tree --token-budget 16384 --gdn-route fla_triton \
        --out "$OUT/async_grpo_h200_qwen3.5-0.8b_fla_triton.json" 2>&1 | grep -E "^qwen|^  tree|rror:"
      timeout 270 python3 benchmarks/bench_async_grpo.py --models qwen3.5-2b --workloads tau2_like grpo_mixed \
        --sides tree --token-budget 16384 --gdn-route fla_triton \
        --out "$OUT/async_grpo_h200_qwen3.5-2b_fla_triton.json" 2>&1 | grep -E "^qwen|^  tree|rror:" ;;
    # gpu_hybrid_rows.sh: two calls made back to back on one (warm) machine, the first filling the compile and autotuning
    # caches in /tmp beside the route's parity tests, the second timing the rows (carry .whl/hybrid; ~9 min each)
    hybrid-rows-warm)  # fla + TileLang: the route's 10 parity tests and one untimed run of each 0.8B benchmark
      PHASE=warm BUDGET=560 JOBS="qwen3.5-0.8b_grpo@fla_tilelang qwen3.5-0.8b_agent20@fla_tilelang levels@fla_tilelang" \
        bash benchmarks/gpu_hybrid_rows.sh ;;
    hybrid-rows)  # the 0.8B GRPO row, timed
      PHASE=rows BUDGET=330 JOBS="qwen3.5-0.8b_grpo@fla_tilelang" bash benchmarks/gpu_hybrid_rows.sh
      cp /tmp/hyb/rows/qwen3.5-0.8b_grpo_fla_tilelang.json "$OUT/tree_vs_flat_h200_qwen3.5-0.8b_fla_tilelang.json" ;;
    hybrid-rows-2b-warm)  # the tree-vs-flat parity tests again and the 2B row untimed
      PHASE=warm JOBS="qwen3.5-2b_grpo@fla_tilelang" PARITY_K=tree_matches BUDGET=330 bash benchmarks/gpu_hybrid_rows.sh
      { echo "# PHASE=warm BUDGET=560 bash benchmarks/gpu_hybrid_rows.sh   (and the stage hybrid-rows-2b-warm)"
        cat /tmp/hyb/warm/parity_*.log; } >"$OUT/h200_gpu_tests_hybrid_rows.log" ;;
    hybrid-rows-2b)  # the 2B row, timed
      PHASE=rows JOBS="qwen3.5-2b_grpo@fla_tilelang" BUDGET=200 bash benchmarks/gpu_hybrid_rows.sh
      cp /tmp/hyb/rows/qwen3.5-2b_grpo_fla_tilelang.json "$OUT/tree_vs_flat_h200_qwen3.5-2b_fla_tilelang.json" ;;
    # The same two-call pattern over three routes (fla + TileLang, FlashQLA, fla's Triton kernels alone), with the
    # level-by-level scans handing fla each level's boundaries on the host (no device read-back per call).
    hybrid-routes-warm)  # the routes' parity tests (fp32 on fla + TileLang, bf16 on the others), the K = 64 kernel
      # checks with fla's Hopper refusal kept and lifted, and the three benchmarks below untimed. The checks run
      #   python benchmarks/gdn_kernel_check.py --route fla_triton --head-dims 64
      #   python benchmarks/gdn_kernel_check.py --route fla_tilelang --head-dims 64
      PHASE=warm BUDGET=570 JOBS="qwen3.5-0.8b_grpo@flash_qla qwen3.5-2b_agent20@fla_tilelang levels@fla_tilelang" \
        PARITY_ROUTES="fla_tilelang flash_qla fla_triton" \
        PARITY_K="not (fla_tilelang and bf16) and not (fla_triton and (fp32 or varlen))" \
        CHECKS="fla_triton:64 fla_tilelang:64" bash benchmarks/gpu_hybrid_rows.sh
      cp /tmp/hyb/warm/check_fla_triton_k64.json "$OUT/hybrid_kernel_checks_h200_fla_triton_k64.json"
      cp /tmp/hyb/warm/check_fla_tilelang_k64.json "$OUT/hybrid_kernel_checks_h200_fla_tilelang_k64.json"
      cat /tmp/hyb/warm/parity_*.log >"$OUT/h200_gpu_tests_hybrid_routes.log" ;;
    hybrid-routes-rows)  # the level cost, the 0.8B GRPO row on FlashQLA and the 2B agent row, timed. FlashQLA's row
      # runs python benchmarks/bench_tree_vs_flat.py --models qwen3.5-0.8b --workloads grpo_G16_P4096_C512 --scale 0.25 --repeats 1 --gdn-route flash_qla
      PHASE=rows BUDGET=540 JOBS="levels@fla_tilelang qwen3.5-0.8b_grpo@flash_qla qwen3.5-2b_agent20@fla_tilelang" \
        bash benchmarks/gpu_hybrid_rows.sh
      cp /tmp/hyb/rows/levels_fla_tilelang.json "$OUT/levels_h200_fla_tilelang.json"
      cp /tmp/hyb/rows/qwen3.5-0.8b_grpo_flash_qla.json "$OUT/tree_vs_flat_h200_qwen3.5-0.8b_flash_qla.json"
      cp /tmp/hyb/rows/qwen3.5-2b_agent20_fla_tilelang.json \
        "$OUT/tree_vs_flat_h200_qwen3.5-2b_agent20_fla_tilelang.json" ;;
    hybrid-routes-rows-agent)  # the 0.8B agent row, timed (the stage above ran out of time before it)
      PHASE=rows BUDGET=390 JOBS="qwen3.5-0.8b_agent20@fla_tilelang" bash benchmarks/gpu_hybrid_rows.sh
      cp /tmp/hyb/rows/qwen3.5-0.8b_agent20_fla_tilelang.json \
        "$OUT/tree_vs_flat_h200_qwen3.5-0.8b_agent20_fla_tilelang.json" ;;
    hybrid-routes-parity-next)  # Qwen3-Next's K = 128 parity tests that ran out of memory or time beside the others
      PHASE=warm BUDGET=430 JOBS=" " PARITY_ROUTES="fla_tilelang flash_qla fla_triton" \
        PARITY_K="tree_matches and qwen3_next_k128 and ((fla_tilelang and fp32) or (flash_qla and bf16) or (fla_triton and bf16))" \
        bash benchmarks/gpu_hybrid_rows.sh
      cat /tmp/hyb/warm/parity_*.log >>"$OUT/h200_gpu_tests_hybrid_routes.log" ;;
    hybrid-kernels-fla-tilelang-rows)  # the benchmark rows alone on fla + TileLang: no checks, no parity test (on a
      # fresh machine: the script keeps its work files, status lines included, in /tmp/hyb)
      ROUTES=fla_tilelang CHECKS=0 PARITY_K=no_such_test BENCH_MAX=330 BUDGET=500 bash benchmarks/gpu_hybrid_kernels.sh
      mv "$OUT/hybrid_gpu.log" "$OUT/hybrid_kernels_h200_fla_tilelang_rows.log" ;;
    # ---- where the step's time goes (profile_step.py: one step under the torch profiler)
    profile-1.7b-eager)
      timeout 150 python3 benchmarks/profile_step.py --model qwen3-1.7b --method tree \
        --out "$OUT/profile_h200_qwen3-1.7b_tree.json" 2>&1 | quiet 30
      timeout 150 python3 benchmarks/profile_step.py --model qwen3-1.7b --method flat_padded \
        --out "$OUT/profile_h200_qwen3-1.7b_flat_padded.json" 2>&1 | quiet 30 ;;
    profile-1.7b-liger-compiled)  # recompute auto and none; whole logs kept (recompiles listed)
      TORCH_LOGS=recompiles timeout 240 python3 benchmarks/profile_step.py --model qwen3-1.7b --method tree --liger \
        --compile-layers --checkpointing auto --out "$OUT/profile_h200_qwen3-1.7b_tree_liger_compile_ckpt-auto.json" \
        > "$OUT/profile_liger_compile_auto.log" 2>&1; grep -A12 "^qwen3" "$OUT/profile_liger_compile_auto.log"
      TORCH_LOGS=recompiles timeout 240 python3 benchmarks/profile_step.py --model qwen3-1.7b --method tree --liger \
        --compile-layers --checkpointing none --out "$OUT/profile_h200_qwen3-1.7b_tree_liger_compile_ckpt-none.json" \
        > "$OUT/profile_liger_compile_none.log" 2>&1; grep -A12 "^qwen3" "$OUT/profile_liger_compile_none.log" ;;
    profile-1.7b-compiled)  # compiled layers, the shared-prefix kernels, recompute auto with kept attention
      timeout 200 python3 benchmarks/profile_step.py --model qwen3-1.7b --method tree --compile-layers \
        --checkpointing auto --out "$OUT/profile_h200_qwen3-1.7b_tree_compile_keep.json" 2>&1 | quiet 14 ;;
    flex-kernel-options)  # FlexAttention kernel options on the eager 1.7B tree step (~40 s each)
      timeout 110 python3 benchmarks/profile_step.py --model qwen3-1.7b --method tree --flex-kernel-options '{}' \
        --out "$OUT/profile_h200_qwen3-1.7b_tree_flex-default.json" 2>&1 | grep -E "^qwen3|attention" | head -3
      timeout 110 python3 benchmarks/profile_step.py --model qwen3-1.7b --method tree \
        --flex-kernel-options '{"USE_TMA": true}' \
        --out "$OUT/profile_h200_qwen3-1.7b_tree_flex-tma.json" 2>&1 | grep -E "^qwen3|attention" | head -3
      timeout 110 python3 benchmarks/profile_step.py --model qwen3-1.7b --method tree \
        --flex-kernel-options '{"ROWS_GUARANTEED_SAFE": true}' \
        --out "$OUT/profile_h200_qwen3-1.7b_tree_flex-rows-safe.json" 2>&1 | grep -E "^qwen3|attention" | head -3
      timeout 110 python3 benchmarks/profile_step.py --model qwen3-1.7b --method tree \
        --flex-kernel-options '{"USE_TMA": true, "ROWS_GUARANTEED_SAFE": true}' \
        --out "$OUT/profile_h200_qwen3-1.7b_tree_flex-tma-rows-safe.json" 2>&1 | grep -E "^qwen3|attention" | head -3
      timeout 110 python3 benchmarks/profile_step.py --model qwen3-1.7b --method tree \
        --flex-kernel-options '{"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2}' \
        --out "$OUT/profile_h200_qwen3-1.7b_tree_flex-block128x128.json" 2>&1 | grep -E "^qwen3|attention" | head -3 ;;
    # ---- the shared-prefix attention kernels alone
    prefix-attention)  # vs FlexAttention on GRPO forests, per training step; twice (the CUDA rule is fit to both)
      timeout 120 python3 benchmarks/bench_prefix_attention.py --out "$OUT/prefix_attention_h200.json" 2>&1 | quiet
      timeout 120 python3 benchmarks/bench_prefix_attention.py --out "$OUT/prefix_attention_h200_repeat.json" 2>&1 \
        | quiet ;;
    prefix-attention-parts)  # each cuDNN call, the merge, per tree: GPU time vs the host's launch time
      timeout 120 python3 benchmarks/prefix_attention_parts.py --out "$OUT/prefix_attention_parts_h200.json" 2>&1 \
        | quiet 40 ;;
    attention-gathered-paths)  # tree attention as one varlen flash call over gathered paths vs FlexAttention, new
      # forests of both async workloads (Qwen3-1.7B heads)
      timeout 200 python3 benchmarks/attention_gathered_paths.py --workload grpo_mixed \
        --out "$OUT/attention_gathered_paths_h200_grpo_mixed.json" 2>&1 | quiet 40
      timeout 200 python3 benchmarks/attention_gathered_paths.py --workload tau2_like \
        --out "$OUT/attention_gathered_paths_h200_tau2_like.json" 2>&1 | quiet 40 ;;
    # ---- whole GRPO steps through trainer.train(), per generation mode (TreeGRPOTrainer vs trl.GRPOTrainer)
    generation-modes)  # HF generate, paired per step: TRL's side, then the tree and the float32 reference resuming
      # the file (gpu_compile.sh's generation-modes phase; two calls made back to back on one machine; carry .whl)
      timeout 450 python3 benchmarks/bench_generation_modes.py --models qwen3-0.6b \
        --warmup 2 --steps 8 --resume --modes generate --sides trl --out "$OUT/generation_modes_h200_paired.json" \
        2>&1 | grep -E "^qwen|^  |rror:"
      timeout 420 python3 benchmarks/bench_generation_modes.py --models qwen3-0.6b \
        --warmup 2 --steps 8 --resume --modes generate --sides tree reference \
        --out "$OUT/generation_modes_h200_paired.json" 2>&1 | grep -E "^qwen|^  |rror:" ;;
    generation-modes-more)
      timeout 280 python3 benchmarks/bench_generation_modes.py --modes continuous_batching static_cache compiled \
        --steps 3 --out "$OUT/generation_modes_h200_more.json" 2>&1 | grep -v -i warn | grep -E "^\||step|skipped" ;;
    generation-modes-static)
      timeout 280 python3 benchmarks/bench_generation_modes.py --modes static_cache compiled --steps 2 \
        --out "$OUT/generation_modes_h200_static.json" 2>&1 | grep -v -i warn | grep -E "^\||step|skipped" ;;
    generation-modes-flat)  # TRL flat with continuous batching alone
      timeout 250 python3 benchmarks/bench_generation_modes.py --modes continuous_batching --sides flat --steps 2 \
        --out "$OUT/generation_modes_h200_flat_continuous_batching.json" 2>&1 | grep -v -i warn \
        | grep -E "^\||step|skipped" ;;
    generation-modes-flat-compiled)  # TRL flat with torch_compile=True alone; each step is printed as it ends
      timeout 500 python3 benchmarks/bench_generation_modes.py --modes compiled --sides flat --steps 3 \
        --out "$OUT/generation_modes_h200_flat_compiled.json" 2>&1 | grep -v -i warn \
        | grep -E "^\||step [0-9]|skipped" | tee "$OUT/generation_modes_h200_flat_compiled.log" ;;
    # ---- the GRPO trainers against TRL's own through trainer.train(), and the async trainer's GPU tests
    async-grpo)  # gpu_async.sh (~13 min with every step; carry .whl/async): the shared-prefix kernels on new shapes,
      # tests/test_gpu_async_grpo.py, TreeAsyncGRPOTrainer vs TRL's AsyncGRPOTrainer (bench_async_grpo.py),
      # TreeGRPOTrainer vs trl.GRPOTrainer (bench_sync_grpo.py); the committed files came from calls with SKIP subsets
      # (h200_gpu_async.log holds two of them)
      bash benchmarks/gpu_async.sh
      mv "$OUT/gpu_async.log" "$OUT/h200_gpu_async.log" ;;
    compile-async-1.7b)  # TreeAsyncGRPOTrainer on its default compiled layers vs TRL's AsyncGRPOTrainer at its defaults
      # and with accelerate's regional compile, paired per step (gpu_compile.sh's async-1.7b-grpo and async-1.7b-tau2
      # phases, GRPO_SIDES="reference trl tree trl_compiled" GRPO_LIMIT=380; two calls made back to back, the second
      # resuming the file; carry .whl/async)
      timeout 380 python3 benchmarks/bench_async_grpo.py --warmup 2 --steps 8 --resume \
        --models qwen3-1.7b --workloads grpo_mixed --sides reference trl tree trl_compiled \
        --out "$OUT/async_grpo_h200_qwen3-1.7b_paired.json" 2>&1 | grep -E "^qwen|^  |rror:"
      timeout 340 python3 benchmarks/bench_async_grpo.py --warmup 2 --steps 8 --resume \
        --models qwen3-1.7b --workloads tau2_like --sides reference trl tree trl_compiled \
        --out "$OUT/async_grpo_h200_qwen3-1.7b_paired.json" 2>&1 | grep -E "^qwen|^  |rror:" ;;
    compile-async-8b)  # the same at the Qwen3-8B shape, TRL at its defaults (carry .whl)
      timeout 560 python3 benchmarks/bench_async_grpo.py --warmup 2 --steps 8 --resume \
        --models qwen3-8b --workloads grpo_mixed --sides reference trl tree \
        --out "$OUT/async_grpo_h200_qwen3-8b_paired.json" 2>&1 | grep -E "^qwen|^  |rror:"
      # the agent rows, in a second call on the same machine (gpu_compile.sh's async-8b-tau2 phase: the float32
      # reference scores one micro-batch and stops, which fits beside the 8B shape)
      timeout 480 python3 benchmarks/bench_async_grpo.py --warmup 2 --steps 8 --resume \
        --models qwen3-8b --workloads tau2_like --sides reference trl tree \
        --out "$OUT/async_grpo_h200_qwen3-8b_paired_tau2.json" 2>&1 | grep -E "^qwen|^  |rror:" ;;
    compile-async-1.7b-profiled)  # the same rows, one more step per side under the torch profiler (gpu_compile.sh's
      # async-1.7b-profiled phase; transformers 5.24 from .whl/common; carry .whl)
      timeout 270 python3 benchmarks/bench_async_grpo.py --warmup 2 --steps 8 --resume \
        --profile --models qwen3-1.7b --workloads grpo_mixed --sides reference trl tree trl_compiled \
        --out "$OUT/async_grpo_h200_qwen3-1.7b_profiled.json" 2>&1 | grep -E "^qwen|^  |rror:"
      timeout 380 python3 benchmarks/bench_async_grpo.py --warmup 2 --steps 8 --resume \
        --profile --models qwen3-1.7b --workloads tau2_like --sides reference trl tree trl_compiled \
        --out "$OUT/async_grpo_h200_qwen3-1.7b_profiled.json" 2>&1 | grep -E "^qwen|^  |rror:" ;;
    compile-sync-1.7b)  # TreeGRPOTrainer on its defaults vs trl.GRPOTrainer, paired per step (gpu_compile.sh's
      # sync-1.7b phase, then sync-1.7b-tree resuming its file in a second call; carry .whl)
      timeout 220 python3 benchmarks/bench_sync_grpo.py --warmup 2 --steps 8 --resume \
        --models qwen3-1.7b --workloads grpo_mixed --sides reference trl tree \
        --out "$OUT/sync_grpo_h200_qwen3-1.7b_paired.json" 2>&1 | grep -E "^qwen|^  |rror:"
      timeout 190 python3 benchmarks/bench_sync_grpo.py --warmup 2 --steps 8 --resume \
        --models qwen3-1.7b --workloads grpo_mixed --sides tree \
        --out "$OUT/sync_grpo_h200_qwen3-1.7b_paired.json" 2>&1 | grep -E "^qwen|^  |rror:" ;;
    compile-sync-1.7b-p4096)  # the same on the fixed-length row, every side in one call (gpu_compile.sh's
      # sync-1.7b-p4096 phase; carry .whl)
      timeout 560 python3 benchmarks/bench_sync_grpo.py --warmup 2 --steps 8 --resume \
        --models qwen3-1.7b --workloads grpo_P4096_C512 --sides reference trl tree \
        --out "$OUT/sync_grpo_h200_qwen3-1.7b_P4096_paired.json" 2>&1 | grep -E "^qwen|^  |rror:" ;;
    compile-sync-8b-p4096)  # the same at the Qwen3-8B shape (gpu_compile.sh's sync-8b-p4096 phase; carry .whl)
      timeout 560 python3 benchmarks/bench_sync_grpo.py --warmup 2 --steps 8 --resume \
        --models qwen3-8b --workloads grpo_P4096_C512 --sides reference trl tree \
        --out "$OUT/sync_grpo_h200_qwen3-8b_P4096_paired.json" 2>&1 | grep -E "^qwen|^  |rror:" ;;
    beyond-grpo-paired)  # TreeSFTTrainer / TreeDPOTrainer, the reward and RLOO trainers vs TRL's, each side in its own
      # process, paired per step (gpu_compile.sh's beyond-grpo and beyond-grpo-more phases, the last row by itself;
      # calls made back to back, each resuming the file; carry .whl)
      timeout 450 python3 benchmarks/bench_trees_beyond_grpo.py --models qwen3-1.7b \
        --warmup 2 --steps 8 --resume --workloads sft_system_prompt dpo_long_prompt \
        --out "$OUT/trees_beyond_grpo_h200_paired.json" 2>&1 | grep -E "^qwen|^  |rror:"
      timeout 450 python3 benchmarks/bench_trees_beyond_grpo.py --models qwen3-1.7b \
        --warmup 2 --steps 8 --resume --workloads dpo_long_prompt sft_agent_turns \
        --out "$OUT/trees_beyond_grpo_h200_paired.json" 2>&1 | grep -E "^qwen|^  |rror:"
      timeout 450 python3 benchmarks/bench_trees_beyond_grpo.py --models qwen3-1.7b \
        --warmup 2 --steps 8 --resume --workloads sft_agent_turns reward_pairs rloo_groups \
        --out "$OUT/trees_beyond_grpo_h200_paired.json" 2>&1 | grep -E "^qwen|^  |rror:"
      timeout 450 python3 benchmarks/bench_trees_beyond_grpo.py --models qwen3-1.7b \
        --warmup 2 --steps 8 --resume --workloads rloo_groups \
        --out "$OUT/trees_beyond_grpo_h200_paired.json" 2>&1 | grep -E "^qwen|^  |rror:" ;;
    gpu-tests-rest)  # the async hybrid and compile-once tests alone, GPT-OSS's CUDA precision cells (gpu_compile.sh's
      # gpu-tests-rest phase; transformers 5.24 from .whl/common)
      timeout 150 python3 -m pytest -v -rfEs -m gpu -p no:cacheprovider \
        tests/test_gpu_async_grpo.py::test_hybrid_log_probs_on_cuda \
        tests/test_gpu_async_grpo.py::test_default_compile_on_cuda_compiles_once_for_all_lengths 2>&1 \
        | grep -v DEBUG > "$OUT/h200_gpu_tests_async_rest.log"
      timeout 100 python3 -m pytest -v -rfEs -m gpu -p no:cacheprovider tests/test_precision.py -k "gpt_oss and cuda" \
        2>&1 | grep -v DEBUG > "$OUT/h200_gpu_tests_precision_gpt_oss.log" ;;
    gpu-tests-all)  # every gpu-marked test but the hybrid kernels' and DeepSpeed's, 8 workers on one GPU (~9 min;
      # gpu_compile.sh's gpu-tests phase, transformers 5.24 from .whl/common)
      timeout 540 python3 -m pytest -v -rfEs -m gpu -p no:cacheprovider -n 8 --timeout 300 tests \
        --ignore tests/test_gpu_recurrent.py --ignore tests/test_gpu_deepspeed.py 2>&1 | grep -v DEBUG \
        > "$OUT/h200_gpu_tests_all.log" ;;
    gpu-tests-all-current)  # the same on the present code, on either card, the log headed by its command, card,
      # versions and commit (carry .whl: transformers 5.25 and `kernels` from .whl/common, trl from .whl/async). Two
      # CPU threads a worker: with torch's default (every core for each of the 8 workers) the float32 CPU references
      # oversubscribe the cores, and `test_hybrid_log_probs_on_cuda` (2 min alone) reached its 300 s limit
      log="$OUT/${card}_gpu_tests_all.log"
      log_head "OMP_NUM_THREADS=2 python3 -m pytest -v -rfEs -m gpu -p no:cacheprovider -n 8 --timeout 300 tests --ignore tests/test_gpu_recurrent.py --ignore tests/test_gpu_deepspeed.py   (stage gpu-tests-all-current of benchmarks/run_h200.sh)" > "$log"
      OMP_NUM_THREADS=2 timeout 560 python3 -m pytest -v -rfEs -m gpu -p no:cacheprovider -n 8 --timeout 300 tests \
        --ignore tests/test_gpu_recurrent.py --ignore tests/test_gpu_deepspeed.py 2>&1 | grep -v DEBUG >> "$log"
      summary "$log" 30 ;;
    gpu-tests-prefix-reuse)  # prefix reuse on CUDA, both attention paths (an older run, on the H200)
      timeout 300 python3 -m pytest -v -rfEs -m gpu -p no:cacheprovider tests/test_gpu_prefix_reuse.py 2>&1 \
        | grep -v DEBUG > "$OUT/h200_gpu_tests_prefix_reuse.log" ;;
    gpu-tests-prefix-reuse-current)  # the same on the present code, on either card, inductor-compiled chunks included,
      # the log headed by its command, card, versions and commit (carry .whl)
      log="$OUT/${card}_gpu_tests_prefix_reuse_current.log"
      log_head "python3 -m pytest -v -rfEs -m gpu -p no:cacheprovider tests/test_gpu_prefix_reuse.py   (stage gpu-tests-prefix-reuse-current of benchmarks/run_h200.sh)" > "$log"
      timeout 400 python3 -m pytest -v -rfEs -m gpu -p no:cacheprovider tests/test_gpu_prefix_reuse.py 2>&1 \
        | grep -v DEBUG >> "$log"
      summary "$log" 30 ;;
    prefix-reuse-gpu-split)  # one step split into micro-batches (what the trainers do without prefix reuse), Qwen3-0.6B
      # shape on the agent workload whose split repeats most (~26 s a step: its attention spans histories of up to
      # 50k tokens); its own call, then `prefix-reuse-gpu` on the same machine
      timeout 560 python3 benchmarks/bench_prefix_reuse_gpu.py --models qwen3-0.6b --workloads agent_2x20x4 \
        --methods split --warmup 1 --steps 8 --first-dir /tmp/prefix_reuse_first \
        --out "$OUT/prefix_reuse_gpu_h200_qwen3-0.6b.json" 2>&1 | quiet 12
      cp "$OUT/prefix_reuse_gpu_h200_qwen3-0.6b.json" /tmp/prefix_reuse_gpu_h200_qwen3-0.6b.json ;;
    prefix-reuse-gpu)  # the same step as one forest in chunks (prefix reuse, FlexAttention path) in a process of its
      # own, paired step by step with `prefix-reuse-gpu-split`'s (kept in /tmp by that stage) and checked against it
      # (on a machine since given back, the committed file's split, and one split step re-run for the agreement check)
      cp /tmp/prefix_reuse_gpu_h200_qwen3-0.6b.json "$OUT/" 2>/dev/null \
        || cp benchmarks/results/prefix_reuse_gpu_h200_qwen3-0.6b.json "$OUT/"
      timeout 560 python3 benchmarks/bench_prefix_reuse_gpu.py --models qwen3-0.6b --workloads agent_2x20x4 \
        --methods reuse --resume --warmup 2 --steps 8 --first-dir /tmp/prefix_reuse_first \
        --out "$OUT/prefix_reuse_gpu_h200_qwen3-0.6b.json" 2>&1 | quiet 12
      cp "$OUT/prefix_reuse_gpu_h200_qwen3-0.6b.json" /tmp/prefix_reuse_gpu_h200_qwen3-0.6b.json ;;
    prefix-reuse-gpu-kept)  # the same step with every chunk's forward graph kept for the backward (no chunk recomputed
      # there), after `prefix-reuse-gpu`, paired with its split and its recomputing reuse step by step
      cp /tmp/prefix_reuse_gpu_h200_qwen3-0.6b.json "$OUT/" 2>/dev/null \
        || cp benchmarks/results/prefix_reuse_gpu_h200_qwen3-0.6b.json "$OUT/"
      timeout 560 python3 benchmarks/bench_prefix_reuse_gpu.py --models qwen3-0.6b --workloads agent_2x20x4 \
        --methods reuse_kept --resume --warmup 2 --steps 8 --first-dir /tmp/prefix_reuse_first \
        --out "$OUT/prefix_reuse_gpu_h200_qwen3-0.6b.json" 2>&1 | quiet 12 ;;
    prefix-reuse-gpu-no-ckpt)  # prefix reuse on the same step without the model's own layer checkpointing (each chunk
      # recomputed once, not each layer again in the backward), in 32k-row chunks for the activations it then holds
      timeout 560 python3 benchmarks/bench_prefix_reuse_gpu.py --models qwen3-0.6b --workloads agent_2x20x4 \
        --methods reuse --checkpointing none --budget 32768 --warmup 2 --steps 8 \
        --out "$OUT/prefix_reuse_gpu_h200_qwen3-0.6b_no_ckpt.json" 2>&1 | quiet 12 ;;
    prefix-reuse-gpu-8b-trajectory)  # the 96k-token trajectory with 8 branches at the Qwen3-8B shape, with AdamW's
      # states held (the split refuses it): does one step fit in one H200, and how long is it. In chunks of 2,176 rows,
      # the planner's least estimate (43.7 GiB beside 89 GiB of weights, gradients and moments; at the workload's
      # 32k-row budget it estimates 62.5 GiB, past the H200); ~1 min a step by the FLOP count, so 2 measured steps
      timeout 560 python3 benchmarks/bench_prefix_reuse_gpu.py --models qwen3-8b --workloads trajectory_96k \
        --budget 2176 --methods reuse --optimizer --warmup 1 --steps 2 \
        --out "$OUT/prefix_reuse_gpu_h200_qwen3-8b_trajectory.json" 2>&1 | quiet 12 ;;
    prefix-reuse-gpu-1.7b-split)  # `prefix-reuse-gpu-split` at the Qwen3-1.7B shape on the 4-conversation agent step
      timeout 560 python3 benchmarks/bench_prefix_reuse_gpu.py --models qwen3-1.7b --workloads agent_4x20 \
        --methods split --warmup 1 --steps 8 --first-dir /tmp/prefix_reuse_first \
        --out "$OUT/prefix_reuse_gpu_h200_qwen3-1.7b.json" 2>&1 | quiet 12
      cp "$OUT/prefix_reuse_gpu_h200_qwen3-1.7b.json" /tmp/prefix_reuse_gpu_h200_qwen3-1.7b.json ;;
    prefix-reuse-gpu-1.7b)  # `prefix-reuse-gpu` at the same shape, after `prefix-reuse-gpu-1.7b-split`
      cp /tmp/prefix_reuse_gpu_h200_qwen3-1.7b.json "$OUT/" 2>/dev/null \
        || cp benchmarks/results/prefix_reuse_gpu_h200_qwen3-1.7b.json "$OUT/"
      timeout 560 python3 benchmarks/bench_prefix_reuse_gpu.py --models qwen3-1.7b --workloads agent_4x20 \
        --methods reuse --resume --warmup 2 --steps 8 --first-dir /tmp/prefix_reuse_first \
        --out "$OUT/prefix_reuse_gpu_h200_qwen3-1.7b.json" 2>&1 | quiet 12 ;;
    prefix-reuse-gpu-1.7b-kept)  # the split and prefix reuse with every chunk's forward graph kept, one call, the
      # Qwen3-1.7B step of `prefix-reuse-gpu-1.7b` (its FLOPs predict 1.17x: benchmarks/prefix_reuse_work.py); ~9 min
      timeout 590 python3 benchmarks/bench_prefix_reuse_gpu.py --models qwen3-1.7b --workloads agent_4x20 \
        --methods split reuse_kept --warmup 1 --steps 8 \
        --out "$OUT/prefix_reuse_gpu_${card}_qwen3-1.7b_kept.json" 2>&1 | quiet 12 ;;
    prefix-reuse-gpu-1.7b-compiled)  # the step of `prefix-reuse-gpu-1.7b` with both layouts' decoder layers compiled
      # in place (inductor, dynamic shapes: the trainers' CUDA default), prefix reuse's chunks included; either card
      timeout 590 python3 benchmarks/bench_prefix_reuse_gpu.py --models qwen3-1.7b --workloads agent_4x20 \
        --methods split reuse --compile --warmup 2 --steps 8 \
        --out "$OUT/prefix_reuse_gpu_${card}_qwen3-1.7b_compiled.json" 2>&1 | quiet 12 ;;
    prefix-reuse-gpu-1.7b-compiled-profiled)  # where prefix reuse's time goes on compiled layers: one warm step
      # under the torch profiler of `prefix-reuse-gpu-1.7b-compiled`'s prefix reuse (its compiled chunks ran slower
      # than eager ones, whose profile is `prefix-reuse-gpu-1.7b-profiled`'s), then with every chunk's graph kept (no
      # chunk recomputed); either card
      timeout 400 python3 benchmarks/bench_prefix_reuse_gpu.py --models qwen3-1.7b --workloads agent_4x20 \
        --methods reuse reuse_kept --compile --warmup 1 --steps 1 --profile \
        --out "$OUT/prefix_reuse_gpu_${card}_qwen3-1.7b_compiled_profiled.json" 2>&1 | quiet 12 ;;
    prefix-reuse-gpu-1.7b-flex-configs)  # the settings inductor gave the FlexAttention kernels (block sizes, warps,
      # stages, IS_DIVISIBLE, ...) of prefix reuse's chunks on eager layers (FlexAttention compiled on its own) and on
      # compiled layers (inside the layer graphs, where `prefix-reuse-gpu-1.7b-compiled-profiled` found them 1.4-1.8x
      # slower), and of the compiled split: each run into a fresh inductor cache, one warm-up and one timed step (the
      # compiled ones record dynamo's recompile reasons per step; their time limits cover the warm-up, where every
      # graph compiles, not always the timed step: those are `prefix-reuse-gpu-1.7b-compiled`'s); either card
      for side in reuse_eager reuse_compiled split_compiled; do rm -rf "/tmp/ind_$side"; done
      TORCHINDUCTOR_CACHE_DIR=/tmp/ind_reuse_eager timeout 150 python3 benchmarks/bench_prefix_reuse_gpu.py \
        --models qwen3-1.7b --workloads agent_4x20 --methods reuse --warmup 1 --steps 1 \
        --out "$OUT/prefix_reuse_gpu_${card}_qwen3-1.7b_flex_reuse_eager.json" 2>&1 | quiet 4
      TORCHINDUCTOR_CACHE_DIR=/tmp/ind_reuse_compiled timeout 210 python3 benchmarks/bench_prefix_reuse_gpu.py \
        --models qwen3-1.7b --workloads agent_4x20 --methods reuse --compile --warmup 1 --steps 1 \
        --out "$OUT/prefix_reuse_gpu_${card}_qwen3-1.7b_flex_reuse_compiled.json" 2>&1 | quiet 4
      TORCHINDUCTOR_CACHE_DIR=/tmp/ind_split_compiled timeout 150 python3 benchmarks/bench_prefix_reuse_gpu.py \
        --models qwen3-1.7b --workloads agent_4x20 --methods split --compile --warmup 1 --steps 1 \
        --out "$OUT/prefix_reuse_gpu_${card}_qwen3-1.7b_flex_split_compiled.json" 2>&1 | quiet 4
      python3 benchmarks/flex_kernel_configs.py reuse_eager=/tmp/ind_reuse_eager \
        reuse_compiled=/tmp/ind_reuse_compiled split_compiled=/tmp/ind_split_compiled \
        --out "$OUT/flex_kernel_configs_${card}_qwen3-1.7b.json" 2>&1 | tail -30 ;;
    prefix-reuse-gpu-1.7b-divisible)  # FlexAttention's kernels with the lengths declared multiples of 128 (meant
      # to turn `IS_DIVISIBLE` on in the dynamic-shape layer graphs; on torch 2.11 it did not): the compiled split and
      # compiled prefix reuse, one warm
      # step each under the torch profiler (per-call times), into a fresh inductor cache whose kernels
      # flex_kernel_configs.py then reads (the same without the declaration: `prefix-reuse-gpu-1.7b-compiled-profiled`
      # and `-flex-configs`); either card
      rm -rf /tmp/ind_divisible
      TORCHINDUCTOR_CACHE_DIR=/tmp/ind_divisible timeout 480 python3 benchmarks/bench_prefix_reuse_gpu.py \
        --models qwen3-1.7b --workloads agent_4x20 --methods split reuse --compile --warmup 1 --steps 1 --profile \
        --out "$OUT/prefix_reuse_gpu_${card}_qwen3-1.7b_divisible_profiled.json" 2>&1 | quiet 12
      python3 benchmarks/flex_kernel_configs.py declared=/tmp/ind_divisible \
        --out "$OUT/flex_kernel_configs_${card}_qwen3-1.7b_divisible.json" 2>&1 | tail -20 ;;
    prefix-reuse-gpu-1.7b-aligned)  # compiled prefix reuse with the context operator's layer token on the keys'
      # device (a CPU token made inductor take the operator's keys and values as unaligned: FlexAttention without
      # its 16-byte alignment hint, 72 / 171 ms a forward / backward call against the eager chunks' 41 / 126 ms in
      # `prefix-reuse-gpu-1.7b-divisible`): one warm-up, 2 timed steps, one profiled step, into a fresh inductor
      # cache whose kernels flex_kernel_configs.py then reads; then the eager chunks' warm step under the profiler on
      # the same card (the per-call times to compare with); either card
      rm -rf /tmp/ind_aligned
      TORCHINDUCTOR_CACHE_DIR=/tmp/ind_aligned timeout 300 python3 benchmarks/bench_prefix_reuse_gpu.py \
        --models qwen3-1.7b --workloads agent_4x20 --methods reuse --compile --warmup 1 --steps 2 --profile \
        --out "$OUT/prefix_reuse_gpu_${card}_qwen3-1.7b_aligned_profiled.json" 2>&1 | quiet 12
      timeout 200 python3 benchmarks/bench_prefix_reuse_gpu.py --models qwen3-1.7b --workloads agent_4x20 \
        --methods reuse --warmup 1 --steps 1 --profile \
        --out "$OUT/prefix_reuse_gpu_${card}_qwen3-1.7b_aligned_eager_profiled.json" 2>&1 | quiet 12
      python3 benchmarks/flex_kernel_configs.py aligned=/tmp/ind_aligned \
        --out "$OUT/flex_kernel_configs_${card}_qwen3-1.7b_aligned.json" 2>&1 | tail -12 ;;
    prefix-reuse-gpu-1.7b-compiled-aligned)  # prefix reuse on compiled layers with its chunks compiled (`reuse`, the
      # keys and values aligned since `prefix-reuse-gpu-1.7b-compiled`) and eager (`reuse_eager`, the trainers'
      # default until this stage's steps), each in its own process, 8 steps paired by step with each other (`paired_layers`: the evidence for
      # the chunks' default layers) and with the compiled split of `prefix-reuse-gpu-1.7b-compiled` (its steps read
      # back from that file, the split's code unchanged since). One method a call (~8 min each with the split's
      # agreement step): the stage again on the same warm machine runs the one its file in /tmp lacks; on the card
      # of that file (an H100)
      f="$OUT/prefix_reuse_gpu_${card}_qwen3-1.7b_compiled_aligned.json"
      method=reuse
      if cp "/tmp/$(basename "$f")" "$OUT/" 2>/dev/null; then  # the first call's file: its `reuse` measured in full?
        python3 -c "import json, sys; r = json.load(open('$f'))['rows'][0]['methods']['reuse']
sys.exit('incomplete' in r or 'refused' in r)" 2>/dev/null && method=reuse_eager
      else
        cp "benchmarks/results/prefix_reuse_gpu_${card}_qwen3-1.7b_compiled.json" "$f"
      fi
      if [ "$method" = reuse ]; then
        timeout 590 python3 benchmarks/bench_prefix_reuse_gpu.py --models qwen3-1.7b --workloads agent_4x20 \
          --methods reuse --compile --resume --first-dir /tmp/first_compiled_aligned --warmup 1 --steps 8 \
          --out "$f" 2>&1 | quiet 12
      else
        timeout 590 python3 benchmarks/bench_prefix_reuse_gpu.py --models qwen3-1.7b --workloads agent_4x20 \
          --methods reuse_eager --compile --resume --first-dir /tmp/first_compiled_aligned --warmup 1 --steps 8 \
          --out "$f" 2>&1 | quiet 12
      fi
      cp "$f" /tmp/ 2>/dev/null ;;
    prefix-reuse-gpu-1.7b-compiled-kept)  # prefix reuse with every chunk's graph kept on compiled layers, paired
      # with the compiled split of `prefix-reuse-gpu-1.7b-compiled` (its steps read back from that file; one split
      # step rerun for the agreement check), on the card of that file (an H100)
      cp "benchmarks/results/prefix_reuse_gpu_${card}_qwen3-1.7b_compiled.json" \
        "$OUT/prefix_reuse_gpu_${card}_qwen3-1.7b_compiled_kept.json"
      timeout 590 python3 benchmarks/bench_prefix_reuse_gpu.py --models qwen3-1.7b --workloads agent_4x20 \
        --methods reuse_kept --compile --resume --warmup 2 --steps 8 \
        --out "$OUT/prefix_reuse_gpu_${card}_qwen3-1.7b_compiled_kept.json" 2>&1 | quiet 12 ;;
    prefix-reuse-gpu-1.7b-profiled)  # where the time of `prefix-reuse-gpu-1.7b`'s steps goes: one warm step of each
      # layout under the torch profiler (prefix reuse ran 0.86x the split there, 0.99x by its executed FLOPs: it ran
      # them at 29.5% of the peak against the split's 34.1%, benchmarks/prefix_reuse_work.py)
      timeout 560 python3 benchmarks/bench_prefix_reuse_gpu.py --models qwen3-1.7b --workloads agent_4x20 \
        --methods split reuse --warmup 1 --steps 1 --profile \
        --out "$OUT/prefix_reuse_gpu_${card}_qwen3-1.7b_profiled.json" 2>&1 | quiet 12 ;;
    async-prefix-reuse-1.7b-trl)  # TRL's AsyncGRPOTrainer (and its float32 reference) on long agent conversations
      # that span a step's 4 rows of 65,536 tokens; then `async-prefix-reuse-1.7b-tree` on the same machine. Either
      # card. A call that runs out of time leaves its sides in /tmp; the stage again on the warm machine resumes from
      # them, and on a fresh one from the file the last call sent back, carried as .partial/ (git-ignored)
      cp /tmp/async_prefix_reuse_${card}_qwen3-1.7b.json "$OUT/" 2>/dev/null \
        || cp .partial/async_prefix_reuse_${card}_qwen3-1.7b.json "$OUT/" 2>/dev/null
      timeout 560 python3 benchmarks/bench_async_grpo.py --warmup 2 --steps 8 --resume --models qwen3-1.7b \
        --workloads agent_2x20x4 --token-budget 65536 --accumulation 4 --sides reference trl \
        --out "$OUT/async_prefix_reuse_${card}_qwen3-1.7b.json" 2>&1 | grep -E "^qwen|^  |rror:"
      cp "$OUT/async_prefix_reuse_${card}_qwen3-1.7b.json" /tmp/ 2>/dev/null ;;
    async-prefix-reuse-1.7b-tree)  # the tree without and with prefix reuse on the same rows, paired with TRL's (each
      # side through the CUDA default: decoder layers compiled in place, prefix reuse's chunks on them)
      cp /tmp/async_prefix_reuse_${card}_qwen3-1.7b.json "$OUT/" 2>/dev/null \
        || cp .partial/async_prefix_reuse_${card}_qwen3-1.7b.json "$OUT/" 2>/dev/null
      timeout 560 python3 benchmarks/bench_async_grpo.py --warmup 2 --steps 8 --resume --models qwen3-1.7b \
        --workloads agent_2x20x4 --token-budget 65536 --accumulation 4 --sides tree tree_reuse \
        --out "$OUT/async_prefix_reuse_${card}_qwen3-1.7b.json" 2>&1 | grep -E "^qwen|^  |rror:"
      cp "$OUT/async_prefix_reuse_${card}_qwen3-1.7b.json" /tmp/ 2>/dev/null ;;
    fa4-site-1)  # the first half of FlashAttention-4's packed site (benchmarks/fa4_wheels.sh; carry .fa4/1), kept
      # in /tmp for `flex-flash-backend` on the same warm machine
      mkdir -p /tmp/fa4parts && cp .fa4/1/* /tmp/fa4parts/ && ls -la /tmp/fa4parts ;;
    gpu-tests-compiled-layers)  # the trainers' CUDA path in one test: decoder layers compiled with dynamic shapes
      # under non-reentrant checkpointing against the float32 flat forward, two forest lengths on one model
      timeout 300 python3 -m pytest -q -rfEs -m gpu -p no:cacheprovider tests/test_gpu.py -k compiled_checkpointed \
        > "$OUT/${card}_gpu_tests_compiled_layers.log" 2>&1
      grep -E "^E   " "$OUT/${card}_gpu_tests_compiled_layers.log" | head -20
      summary "$OUT/${card}_gpu_tests_compiled_layers.log" ;;
    fa4-tests)  # the FlashAttention-4 GPU tests, their whole log kept, under checkpoint debugging (a recompute that
      # differs from its forward names the ops of both) and TORCH_LOGS of recompiles and graph breaks (carry .fa4/2
      # and .whl, right after `fa4-site-1`)
      with_fa4 || continue
      TORCH_LOGS=recompiles,graph_breaks timeout 420 python3 -c "import sys, pytest, torch.utils.checkpoint as c
c.set_checkpoint_debug_enabled(True).__enter__(); sys.exit(pytest.main(sys.argv[1:]))" -q -rfEs -m gpu \
        -p no:cacheprovider --continue-on-collection-errors tests/test_gpu.py tests/test_varlen_attention.py \
        tests/test_prefix_attention.py -k "flash_backend or fa4 or compiled_checkpointed" > "$OUT/${card}_gpu_tests_fa4.log" 2>&1
      grep -E "^E   " "$OUT/${card}_gpu_tests_fa4.log" | head -30; summary "$OUT/${card}_gpu_tests_fa4.log" 30 ;;
    gpu-tests-async-fa4)  # test_gpu_async_grpo.py with FlashAttention-4 installed: TreeAsyncGRPOTrainer on its default
      # (FlexAttention's FLASH backend in the compiled layers) against TRL's AsyncGRPOTrainer, each side's error
      # against a float32 run (carry .fa4/2 and .whl, after `fa4-site-1` on the same machine)
      with_fa4 || continue
      timeout 330 python3 -m pytest -q -rfEs -m gpu -p no:cacheprovider tests/test_gpu_async_grpo.py \
        > "$OUT/${card}_gpu_tests_async_fa4.log" 2>&1
      grep -E "^E   " "$OUT/${card}_gpu_tests_async_fa4.log" | head -20; summary "$OUT/${card}_gpu_tests_async_fa4.log" ;;
    flex-flash-backend)  # FlexAttention's FlashAttention-4 backend against its Triton one on the tree's block mask,
      # and the shared-prefix attention on FlashAttention-4's varlen kernels (GRPO forests) against cuDNN's, forward +
      # backward, new forests (carry .fa4/2 and .whl, right after `fa4-site-1`)
      with_fa4 || continue
      timeout 240 python3 benchmarks/attention_gathered_paths.py --workload grpo_mixed \
        --kernels flex flex_flash fa4_gathered prefix_fa4 prefix_cudnn \
        --out "$OUT/attention_flex_flash_${card}_grpo_mixed.json" 2>&1 | quiet 40 ;;
    fa4-agent-trees)  # the same kernels on τ²-like agent trees (not two-level: no shared-prefix kernels), after
      # `flex-flash-backend` on the same machine (carry .fa4/2)
      with_fa4 || continue
      timeout 400 python3 benchmarks/attention_gathered_paths.py --workload tau2_like \
        --kernels flex flex_flash fa4_gathered --out "$OUT/attention_flex_flash_${card}_tau2_like.json" 2>&1 | quiet 40 ;;
    async-grpo-flash-compiled-1.7b)  # FlexAttention on FlashAttention-4's kernels in TreeAsyncGRPOTrainer's
      # compiled layers (its masks in buffers of static size) against its Triton kernels and TRL's AsyncGRPOTrainer at
      # its defaults, each judged by its error to TRL's float32 run, through trainer.train() (carry .fa4/2 and .whl,
      # after `fa4-site-1` on the same machine). The committed file ran before the FLASH backend was the trainers'
      # default where FlashAttention-4 is installed: its `tree` side is what `tree_triton` names now
      with_fa4 || continue
      timeout 580 python3 benchmarks/bench_async_grpo.py --warmup 2 --steps 8 --models qwen3-1.7b \
        --workloads grpo_mixed --sides reference tree_triton tree_flash \
        --out "$OUT/async_grpo_${card}_qwen3-1.7b_flash_compiled.json" 2>&1 | grep -E "^qwen|^  |rror:"
      timeout 200 python3 benchmarks/bench_async_grpo.py --warmup 2 --steps 8 --resume --models qwen3-1.7b \
        --workloads grpo_mixed --sides trl --out "$OUT/async_grpo_${card}_qwen3-1.7b_flash_compiled.json" 2>&1 \
        | grep -E "^qwen|^  |rror:" ;;
    async-grpo-flash-compiled-1.7b-agent)  # the same on τ²-like agent conversations (carry .fa4/2 and .whl, after
      # `fa4-site-1` on the same machine; the committed file's `tree` is `tree_triton`, as above)
      with_fa4 || continue
      timeout 400 python3 benchmarks/bench_async_grpo.py --warmup 2 --steps 8 --models qwen3-1.7b \
        --workloads tau2_like --sides reference tree_triton tree_flash \
        --out "$OUT/async_grpo_${card}_qwen3-1.7b_flash_compiled_tau2.json" 2>&1 | grep -E "^qwen|^  |rror:"
      timeout 200 python3 benchmarks/bench_async_grpo.py --warmup 2 --steps 8 --resume --models qwen3-1.7b \
        --workloads tau2_like --sides trl --out "$OUT/async_grpo_${card}_qwen3-1.7b_flash_compiled_tau2.json" 2>&1 \
        | grep -E "^qwen|^  |rror:" ;;
    async-grpo-default-1.7b)  # TreeAsyncGRPOTrainer at its defaults with FlashAttention-4 installed (FlexAttention's
      # FLASH backend in its compiled layers) against TRL's AsyncGRPOTrainer at its defaults and with accelerate's
      # regional compile, GRPO groups, each judged by its error to TRL's float32 run; one more step per side under the
      # torch profiler, where each side's kernel time goes (carry .fa4/2 and .whl, after `fa4-site-1` on the same
      # machine)
      with_fa4 || continue
      timeout 570 python3 benchmarks/bench_async_grpo.py --warmup 2 --steps 8 --resume --profile --models qwen3-1.7b \
        --workloads grpo_mixed --sides reference tree trl_compiled trl \
        --out "$OUT/async_grpo_${card}_qwen3-1.7b_default.json" 2>&1 | grep -E "^qwen|^  |rror:" ;;
    async-grpo-warm-start-1.7b)  # what the tree's first step costs with an empty compile cache and again in a new
      # process on the same machine with the caches the first left (inductor's and Triton's, both in fresh folders so
      # that no earlier stage warms the first), on the FlexAttention Triton kernels (no carry but .whl); first step
      # and the measured steps of each run
      rm -rf /tmp/warm_start_inductor /tmp/warm_start_triton
      export TORCHINDUCTOR_CACHE_DIR=/tmp/warm_start_inductor TRITON_CACHE_DIR=/tmp/warm_start_triton
      timeout 280 python3 benchmarks/bench_async_grpo.py --warmup 2 --steps 8 --models qwen3-1.7b \
        --workloads grpo_mixed --sides tree --out "$OUT/async_grpo_${card}_qwen3-1.7b_cold_start.json" 2>&1 \
        | grep -E "^qwen|^  |rror:"
      timeout 280 python3 benchmarks/bench_async_grpo.py --warmup 2 --steps 8 --models qwen3-1.7b \
        --workloads grpo_mixed --sides tree --out "$OUT/async_grpo_${card}_qwen3-1.7b_warm_start.json" 2>&1 \
        | grep -E "^qwen|^  |rror:"
      unset TORCHINDUCTOR_CACHE_DIR TRITON_CACHE_DIR ;;
    async-grpo-default-1.7b-agent)  # the same on τ²-like agent conversations (carry .fa4/2 and .whl, after
      # `fa4-site-1` on the same machine)
      with_fa4 || continue
      timeout 570 python3 benchmarks/bench_async_grpo.py --warmup 2 --steps 8 --resume --profile --models qwen3-1.7b \
        --workloads tau2_like --sides reference trl_compiled tree trl \
        --out "$OUT/async_grpo_${card}_qwen3-1.7b_default_tau2.json" 2>&1 | grep -E "^qwen|^  |rror:" ;;
    async-grpo-default-8b)  # the Qwen3-8B shape on the same terms as `async-grpo-default-1.7b`, against TRL with
      # accelerate's regional compile (its fastest setting), then at its defaults (the side left for a second call
      # where the first runs out of time), GRPO groups, one profiled step per side (an H200: the
      # 8B shape's optimizer state does not fit an H100 beside it; carry .fa4/2 and .whl, after `fa4-site-1`). A call
      # that runs out of time leaves its sides in /tmp; the same stage again on the warm machine resumes from them,
      # and on a fresh one from the file the last call sent back, carried as .partial/ (git-ignored)
      with_fa4 || continue
      cp /tmp/async_grpo_${card}_qwen3-8b_default.json "$OUT/" 2>/dev/null \
        || cp .partial/async_grpo_${card}_qwen3-8b_default.json "$OUT/" 2>/dev/null
      timeout 580 python3 benchmarks/bench_async_grpo.py --warmup 2 --steps 8 --resume --profile --models qwen3-8b \
        --workloads grpo_mixed --sides reference tree trl_compiled trl \
        --out "$OUT/async_grpo_${card}_qwen3-8b_default.json" 2>&1 | grep -E "^qwen|^  |rror:"
      cp "$OUT/async_grpo_${card}_qwen3-8b_default.json" /tmp/ 2>/dev/null ;;
    async-grpo-default-8b-agent)  # the same on τ²-like agent conversations (an H200; carry .fa4/2 and .whl, after
      # `fa4-site-1` on the same machine; resumes as `async-grpo-default-8b` does)
      with_fa4 || continue
      cp /tmp/async_grpo_${card}_qwen3-8b_default_tau2.json "$OUT/" 2>/dev/null \
        || cp .partial/async_grpo_${card}_qwen3-8b_default_tau2.json "$OUT/" 2>/dev/null
      timeout 580 python3 benchmarks/bench_async_grpo.py --warmup 2 --steps 8 --resume --profile --models qwen3-8b \
        --workloads tau2_like --sides reference tree trl_compiled trl \
        --out "$OUT/async_grpo_${card}_qwen3-8b_default_tau2.json" 2>&1 | grep -E "^qwen|^  |rror:"
      cp "$OUT/async_grpo_${card}_qwen3-8b_default_tau2.json" /tmp/ 2>/dev/null ;;
    async-grpo-fa4-1.7b)  # the shared-prefix attention on FlashAttention-4's varlen kernels (HF_TREE_ATTN_PREFIX_KERNEL)
      # against the default through trainer.train(), each judged by its error to TRL's float32 run (a direct check
      # of one bf16 run against another cannot tell rounding from a fault); carry .fa4/2 and .whl after `fa4-site-1`.
      # The committed file ran before the FLASH backend was the default: both sides' FlexAttention calls on Triton
      with_fa4 || continue
      timeout 580 python3 benchmarks/bench_async_grpo.py --warmup 2 --steps 8 --models qwen3-1.7b \
        --workloads grpo_mixed --sides reference tree tree_fa4 --out "$OUT/async_grpo_${card}_qwen3-1.7b_fa4.json" \
        2>&1 | grep -E "^qwen|^  |rror:" ;;
    prefix-reuse-gpu-1.7b-reference)  # the float32 reference for `prefix-reuse-gpu-1.7b`'s agreement check (its
      # direct bf16 bound failed there): the layouts' first steps judged by their error to float32, after the other
      # two stages (or on the committed file, rerunning one step of each layout)
      cp /tmp/prefix_reuse_gpu_h200_qwen3-1.7b.json "$OUT/" 2>/dev/null \
        || cp benchmarks/results/prefix_reuse_gpu_h200_qwen3-1.7b.json "$OUT/"
      timeout 560 python3 benchmarks/bench_prefix_reuse_gpu.py --models qwen3-1.7b --workloads agent_4x20 \
        --methods reference --resume --first-dir /tmp/prefix_reuse_first \
        --out "$OUT/prefix_reuse_gpu_h200_qwen3-1.7b.json" 2>&1 | quiet 12 ;;
    async-grpo-prefix-kernels)  # the tree side of the 1.7B rows on the shared-prefix kernels for every two-level
      # forest (the committed file ran before the CUDA rule waited for recurring shapes: the size rule alone)
      HF_TREE_ATTN_PREFIX_ATTENTION=always timeout 200 python3 benchmarks/bench_async_grpo.py \
        --models qwen3-1.7b --workloads grpo_mixed tau2_like --profile \
        --out "$OUT/async_grpo_h200_qwen3-1.7b_prefix_kernels.json" 2>&1 | grep -E "^qwen|rror:" ;;
    async-grpo-more)  # the CUDA rule's GPU test (transformers from .whl/common), a Qwen3.5 hybrid on the tree alone
      # (TRL refuses it), Qwen3-8B on the agent rows (~4 min; carry .whl/async and .whl/common)
      PYTHONPATH=/tmp/common:/tmp/site:$PWD timeout 70 python3 -m pytest -q -rf -m gpu -p no:cacheprovider \
        tests/test_prefix_attention.py -k "kernels_only_where or fused_merge" 2>&1 | tail -4 \
        | tee "$OUT/h200_gpu_tests_prefix_rule.log"
      timeout 110 python3 benchmarks/bench_async_grpo.py --models qwen3.5-0.8b \
        --workloads grpo_mixed --token-budget 16384 --warmup 2 --steps 2 \
        --out "$OUT/async_grpo_h200_qwen3.5-0.8b.json" 2>&1 | grep -E "^qwen|rror:"
      timeout 140 python3 benchmarks/bench_async_grpo.py --models qwen3-8b \
        --workloads tau2_like --warmup 2 --steps 2 --out "$OUT/async_grpo_h200_qwen3-8b_tau2.json" 2>&1 \
        | grep -E "^qwen|rror:" ;;
    # The four trees-beyond-grpo stages ran the one-process version of bench_trees_beyond_grpo.py (both sides in one
    # process, ratio of medians; `git show 290af27:benchmarks/bench_trees_beyond_grpo.py`, whose grpo_reward_model
    # workload and --detect-anomaly flag the paired version dropped); its rows now run in gpu_compile.sh's
    # beyond-grpo and beyond-grpo-more phases.
    trees-beyond-grpo)  # gpu_trees_beyond_grpo.sh (~6 min; carry .whl/trees_beyond_grpo): tests/test_gpu_trees.py,
      # then TreeSFTTrainer / TreeDPOTrainer / reward-model trees vs TRL's trainers through train()
      bash benchmarks/gpu_trees_beyond_grpo.sh
      cat "$OUT/gpu_trees_tests.log" "$OUT/trees_beyond_grpo_h200_bench.log" > "$OUT/trees_beyond_grpo_h200.log" ;;
    trees-beyond-grpo-more)  # the per-turn SFT row and the reward-model GRPO row alone (carry .whl/trees_beyond_grpo)
      TESTS=0 WORKLOADS="sft_agent_turns grpo_reward_model" RESULT=trees_beyond_grpo_h200_more \
        bash benchmarks/gpu_trees_beyond_grpo.sh ;;
    # The next two run after trees-beyond-grpo(-more) on the same machine: its wheels in /tmp/site_trees_beyond_grpo.
    trees-beyond-grpo-cudnn-nan)  # which backward op returns the NaN in TRL's flat GRPO update (autograd anomaly mode)
      [ -d /tmp/site_trees_beyond_grpo/trl ] || { echo "run trees-beyond-grpo-more first"; continue; }
      PYTHONPATH=/tmp/site_trees_beyond_grpo:$PWD timeout 150 python3 benchmarks/bench_trees_beyond_grpo.py \
        --workloads grpo_reward_model --steps 4 --detect-anomaly --out "$OUT/diag_anomaly.json" \
        > "$OUT/trees_beyond_grpo_h200_cudnn_nan.log" 2>&1 ;;
    trees-beyond-grpo-reward-model)  # the reward-model GRPO row with SDPA's cuDNN backend off on both sides
      [ -d /tmp/site_trees_beyond_grpo/trl ] || { echo "run trees-beyond-grpo-more first"; continue; }
      PYTHONPATH=/tmp/site_trees_beyond_grpo:$PWD timeout 225 python3 benchmarks/bench_trees_beyond_grpo.py \
        --workloads grpo_reward_model --no-cudnn-sdpa --out "$OUT/trees_beyond_grpo_h200_reward_model.json" ;;
    deepspeed)  # gpu_deepspeed.sh (~6 min; carry .whl/deepspeed): tests/test_gpu_deepspeed.py, TreeGRPOTrainer vs
      # trl.GRPOTrainer under ZeRO-2 and ZeRO-3 in bf16 (one GPU), then the main job under ZeRO-3
      bash benchmarks/gpu_deepspeed.sh
      { echo "# bash benchmarks/gpu_deepspeed.sh"; cat "$OUT/versions.txt" "$OUT/gpu_deepspeed_tests.log"; } \
        > "$OUT/${card}_gpu_tests_deepspeed.log"
      mv "$OUT/deepspeed_zero2_bf16.json" "$OUT/deepspeed_zero2_bf16_${card}.json"
      mv "$OUT/deepspeed_zero3_bf16.json" "$OUT/deepspeed_zero3_bf16_${card}.json"
      { echo "# accelerate launch --config_file trainers/configs/deepspeed_zero3.yaml --num_processes 1" \
          "trainers/grpo_tree.py --max_steps 20 --logging_steps 5 --output_dir /tmp/ds_main_job"
        cat "$OUT/main_job_zero3.log"; } > "$OUT/deepspeed_main_job_zero3_${card}.log" && rm "$OUT/main_job_zero3.log" ;;
    # ---- gradients with fused layer kernels vs eager (grad_check.py), Qwen3-8B shape
    grad-check-8b-12-layers)  # compiled layers, Liger + compiled layers, on 12 of the 36 layers
      timeout 260 python3 benchmarks/grad_check.py --model qwen3-8b --layers 12 --variants compile liger_compile \
        --out "$OUT/grad_check_h200_qwen3-8b-L12.json" > "$OUT/grad_check_8b_12_layers.log" 2>&1
      grep -E "^(eager|compile|liger)" "$OUT/grad_check_8b_12_layers.log" \
        || tail -20 "$OUT/grad_check_8b_12_layers.log" ;;
    grad-check-8b-liger)  # Liger alone and Liger + compiled layers, 36 layers
      timeout 330 python3 benchmarks/grad_check.py --model qwen3-8b --variants liger liger_compile \
        --methods tree tree_ckpt_all flat_packed --out "$OUT/grad_check_h200_qwen3-8b.json" \
        > "$OUT/grad_check_8b_liger.log" 2>&1
      grep -E "^(eager|compile|liger)" "$OUT/grad_check_8b_liger.log" \
        || tail -20 "$OUT/grad_check_8b_liger.log" ;;
    grad-check-8b-compiled)  # compiled layers alone, 36 layers
      timeout 300 python3 benchmarks/grad_check.py --model qwen3-8b --variants compile --methods tree flat_packed \
        --out "$OUT/grad_check_h200_qwen3-8b_compile.json" > "$OUT/grad_check_8b_compiled.log" 2>&1
      grep -E "^(eager|compile)" "$OUT/grad_check_8b_compiled.log" || tail -20 "$OUT/grad_check_8b_compiled.log" ;;
    grad-check-8b-no-mix-order)  # Liger + compiled layers without inductor's mix-order reduction (pytorch#193061)
      TORCHINDUCTOR_MIX_ORDER_REDUCTION=0 timeout 300 python3 benchmarks/grad_check.py --model qwen3-8b \
        --variants liger_compile --methods tree flat_packed --out "$OUT/grad_check_h200_qwen3-8b_no-mix-order.json" \
        > "$OUT/grad_check_8b_no_mix_order.log" 2>&1
      grep -E "^(eager|liger)" "$OUT/grad_check_8b_no_mix_order.log" \
        || tail -20 "$OUT/grad_check_8b_no_mix_order.log" ;;
    # ---- the GPU tests
    gpu-tests)  # every test marked gpu
      timeout 330 python3 -m pytest -q -rf -m gpu -p no:cacheprovider tests/ > "$OUT/h200_gpu_tests.log" 2>&1
      summary "$OUT/h200_gpu_tests.log" ;;
    gpu-tests-kernels)  # the shared-prefix kernels, Liger / regional compile, the dense families, the GRPO trainer
      timeout 230 python3 -m pytest -q -rf -m gpu -p no:cacheprovider tests/test_prefix_attention.py \
        tests/test_kernels.py tests/test_gpu.py tests/test_grpo_trainer.py > "$OUT/${card}_gpu_tests_kernels.log" 2>&1
      summary "$OUT/${card}_gpu_tests_kernels.log" ;;
    gpu-tests-kernels-always)  # the same with the kernels on every two-level forest, small ones included
      HF_TREE_ATTN_PREFIX_ATTENTION=always timeout 300 python3 -m pytest -q -rf -n 4 -m gpu -p no:cacheprovider \
        tests/test_prefix_attention.py tests/test_kernels.py tests/test_gpu.py tests/test_grpo_trainer.py \
        > "$OUT/h200_gpu_tests_kernels_always.log" 2>&1
      summary "$OUT/h200_gpu_tests_kernels_always.log" ;;
    gpu-tests-kept-attention)  # checkpointed layers that keep the kernels' attention, eager and inductor
      timeout 120 python3 -m pytest -q -rf -m gpu -p no:cacheprovider tests/test_recompute.py \
        > "$OUT/h200_gpu_tests_kept_attention.log" 2>&1
      summary "$OUT/h200_gpu_tests_kept_attention.log" 5 ;;
    gpu-tests-coverage)  # every accepted family on compiled FlexAttention vs its per-sequence eager forward
      without_fla  # 8 processes share the GPU: each family compiles its own kernels
      timeout 380 python3 -m pytest -v -rf -n 8 --durations=5 -m gpu -p no:cacheprovider tests/test_gpu_coverage.py \
        > "$OUT/h200_gpu_tests_coverage.log" 2>&1
      summary "$OUT/h200_gpu_tests_coverage.log" 30 ;;
    gpu-tests-precision)  # test_precision.py on CUDA without the hybrids, stopped at 70 s
      timeout -s INT 70 python3 -m pytest -q -rf -m gpu tests/test_precision.py \
        -k "not qwen3_5 and not nemotron_h and not lfm2" > "$OUT/h200_gpu_tests_precision.log" 2>&1
      summary "$OUT/h200_gpu_tests_precision.log" ;;
    gpu-tests-hybrids)  # Qwen3.5 / LFM2 / Nemotron-H trees on CUDA (fla's kernels where installed); carry
      # .whl/async, .whl/common and .whl/hub (transformers 5.25: the image's 5.17 has the gate refuse LFM2 trees)
      timeout 300 python3 -m pytest -q -rfEs -m gpu -p no:cacheprovider tests/test_gpu_recurrent.py \
        > "$OUT/${card}_gpu_tests_hybrids.log" 2>&1
      summary "$OUT/${card}_gpu_tests_hybrids.log" ;;
    # ---- two GPUs (nvidia-h200-x2)
    fsdp2-main-job)  # the main job under FSDP2 on two processes
      timeout 400 python3 -m accelerate.commands.launch --config_file trainers/configs/fsdp2.yaml \
        trainers/grpo_tree.py --max_steps 60 --logging_steps 10 --output_dir /tmp/fsdp2_out 2>&1 \
        | tee "$OUT/fsdp2_2gpu_h200.log" | grep -vi warn | tail -25
      ls /tmp/fsdp2_out | tee -a "$OUT/fsdp2_2gpu_h200.log" ;;
    fsdp2-prefix-reuse-tests)  # the main job under FSDP2 with prefix reuse, and the one without (multi_gpu tests)
      timeout 560 python3 -m pytest -q -rf -m multi_gpu -p no:cacheprovider tests/test_main_job.py -k fsdp2 \
        > "$OUT/h200x2_fsdp2_prefix_reuse_tests.log" 2>&1
      summary "$OUT/h200x2_fsdp2_prefix_reuse_tests.log" ;;
    balance-fsdp2)  # tree vs flat, balanced vs not, Qwen3-1.7B shape under FSDP2; a tiny-shape check first
      timeout 120 python3 -m accelerate.commands.launch --config_file trainers/configs/fsdp2.yaml \
        benchmarks/bench_balance_fsdp.py --model tiny --length-scale 0.05 --steps 2 --accumulation 1 \
        --configs flat tree_balanced --out "$OUT/balance_fsdp2_tiny.json" > "$OUT/balance_fsdp2_tiny.log" 2>&1 \
        || { tail -30 "$OUT/balance_fsdp2_tiny.log"; continue; }
      timeout 200 python3 -m accelerate.commands.launch --config_file trainers/configs/fsdp2.yaml \
        benchmarks/bench_balance_fsdp.py --length-scale 0.5 --steps 3 --out "$OUT/balance_fsdp2_h200.json" \
        > "$OUT/balance_fsdp2_h200.log" 2>&1; grep -E "^(flat|tree)|Error" "$OUT/balance_fsdp2_h200.log" | tail -12 ;;
    *)
      echo "unknown stage: $stage (the stages are the case labels of $0)"; exit 2 ;;
  esac
done
