#!/usr/bin/env bash
# The tree trainers' default fast path (compiled decoder layers) on one H200: its GPU tests, and the trainers against
# TRL's own through trainer.train(), each side in its own process, paired per step (benchmarks/harness.py).
#
#   PHASES="async-1.7b-grpo tests" bash benchmarks/gpu_compile.sh      (repository root, .whl/async carried)
#   PHASES=beyond-grpo bash benchmarks/gpu_compile.sh, then PHASES=beyond-grpo-more (one call each: ~5 + ~6 min)
#   PHASES=generation-modes bash benchmarks/gpu_compile.sh, then PHASES=generation-modes-tree (~5 min each)
#
# Phases write into $KEEP (/tmp, which a warm machine keeps between calls made back to back), so a benchmark split
# over several calls resumes its file (--resume pairs the sides measured earlier with the new ones); everything in
# $KEEP is copied to $OUT at the end of each call. The inductor cache (/tmp/torchinductor_root) is kept the same
# way: a later call's first steps compile from it. Each phase has its own time limit.
#
# The H200 image has no trl or datasets: four pure-Python wheels travel in .whl/async (see gpu_async.sh). The copy
# of the repository there may carry stale git metadata: HF_TREE_ATTN_COMMIT (and HF_TREE_ATTN_DIRTY=1) name the commit
# it came from, and the result files take them over what git says there.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
export USE_HUB_KERNELS=0  # no Hub to fetch the kernels transformers 5.25 swaps in by default
export NCCL_NVLS_ENABLE=0 TRL_EXPERIMENTAL_SILENCE=1
OUT=${OUT:-/tmp/gpu_compile_out}
KEEP=${KEEP:-/tmp/gpu_compile}
mkdir -p "$OUT" "$KEEP"
if ! python3 -c "import trl, datasets" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/async/trl-1.16.0-*.whl .whl/async/datasets-5.2.0-*.whl .whl/async/dill-0.4.1-*.whl \
    .whl/async/multiprocess-0.70.19-*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
# .whl/common (when carried): the transformers release CI tests with (and its tokenizers / safetensors, its
# huggingface_hub, and `kernels` with tomlkit: transformers 5.25's from_pretrained swaps Hub kernels in by default and
# refuses to load a model without that package), ahead of the image's; .whl/hub what that huggingface_hub imports.
if compgen -G ".whl/common/*.whl" >/dev/null && [ ! -d /tmp/common/transformers ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/common \
    .whl/common/*.whl || exit 1
  # huggingface_hub 2.x imports httpx2 lazily (transformers imports without it, a download fails): always install it
  if compgen -G ".whl/hub/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/common \
      .whl/hub/*.whl || exit 1
  fi
fi
[ -d /tmp/common/transformers ] && export PYTHONPATH=/tmp/common:$PYTHONPATH
LOG="$KEEP/gpu_compile.log"
{
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
  python3 -c "import torch, transformers, trl, accelerate; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'trl', trl.__version__, 'accelerate', accelerate.__version__)"
  echo "commit ${HF_TREE_ATTN_COMMIT:-unknown} dirty ${HF_TREE_ATTN_DIRTY:-0}"
} 2>&1 | tee -a "$LOG"

step() {  # step <seconds> <name> <command...>: run with a limit, log it (Python's warnings dropped, pytest's summary
  # kept), print the elapsed time
  local limit=$1 name=$2 start=$SECONDS
  shift 2
  echo "=== $name (limit ${limit}s)" | tee -a "$LOG"
  timeout "$limit" "$@" 2>&1 | grep -v -E "Warning:|warnings\.warn|^\[transformers\]|Loading weights|Callback$|^:|^\{'" | tee -a "$LOG"
  echo "=== $name: rc ${PIPESTATUS[0]}, $((SECONDS - start)) s" | tee -a "$LOG"
}

read -r -a GRPO_SIDES <<< "${GRPO_SIDES:-reference trl tree trl_compiled tree_eager}"
ASYNC=(python3 benchmarks/bench_async_grpo.py --warmup 2 --steps 8 --resume)
SYNC=(python3 benchmarks/bench_sync_grpo.py --warmup 2 --steps 8 --resume)
BEYOND=(python3 benchmarks/bench_trees_beyond_grpo.py --models qwen3-1.7b --warmup 2 --steps 8 --resume
        --out "$KEEP/trees_beyond_grpo_h200_paired.json")
GENMODES=(python3 benchmarks/bench_generation_modes.py --models qwen3-0.6b --warmup 2 --steps 8 --resume
          --out "$KEEP/generation_modes_h200_paired.json")
for phase in ${PHASES:-tests}; do
  case $phase in
    tests)  # every GPU test of a trainer on the default fast path, against TRL (log: h200_gpu_tests_compile.log)
      LOG="$KEEP/h200_gpu_tests_compile.log" step 300 tests python3 -m pytest -q -rf -m gpu -p no:cacheprovider \
        tests/test_gpu_async_grpo.py tests/test_gpu_trees.py tests/test_grpo_trainer.py ;;
    gpu-tests)  # every gpu-marked test but the hybrid kernels' and DeepSpeed's (their own scripts), 8 workers on one
      # GPU, each test's outcome listed (log: h200_gpu_tests_all.log)
      LOG="$KEEP/h200_gpu_tests_all.log" step 540 "$phase" python3 -m pytest -v -rfEs -m gpu -p no:cacheprovider -n 8 \
        --timeout 300 tests --ignore tests/test_gpu_recurrent.py --ignore tests/test_gpu_deepspeed.py ;;
    async-1.7b-grpo)  # the float32 reference first (agreement), TRL's defaults, the tree, then the compiled sides
      step "${GRPO_LIMIT:-300}" "$phase" "${ASYNC[@]}" --models qwen3-1.7b --workloads grpo_mixed \
        --sides "${GRPO_SIDES[@]}" --out "$KEEP/async_grpo_h200_qwen3-1.7b_paired.json" ;;
    async-1.7b-profiled)  # both 1.7B rows, one more step per side under the torch profiler (where its time goes)
      step 270 "$phase-grpo" "${ASYNC[@]}" --profile --models qwen3-1.7b --workloads grpo_mixed \
        --sides reference trl tree trl_compiled --out "$KEEP/async_grpo_h200_qwen3-1.7b_profiled.json"
      step 240 "$phase-tau2" "${ASYNC[@]}" --profile --models qwen3-1.7b --workloads tau2_like \
        --sides reference trl tree --out "$KEEP/async_grpo_h200_qwen3-1.7b_profiled.json" ;;
    prefix-reuse-tests)  # prefix reuse on CUDA, both attention paths, 4 workers (log: h200_gpu_tests_prefix_reuse.log)
      LOG="$KEEP/h200_gpu_tests_prefix_reuse.log" step "${PREFIX_REUSE_LIMIT:-360}" "$phase" python3 -m pytest -v \
        -rfEs -m gpu -p no:cacheprovider -n 4 tests/test_gpu_prefix_reuse.py ;;
    tau2-tree)  # resumes async-1.7b-profiled's file (the committed one where $KEEP has none): its tau2_like row,
      # with TRL's regionally compiled side
      [ -f "$KEEP/async_grpo_h200_qwen3-1.7b_profiled.json" ] \
        || cp benchmarks/results/async_grpo_h200_qwen3-1.7b_profiled.json "$KEEP"/
      step 380 "$phase" "${ASYNC[@]}" --profile --models qwen3-1.7b --workloads tau2_like \
        --sides reference trl tree trl_compiled --out "$KEEP/async_grpo_h200_qwen3-1.7b_profiled.json" ;;
    gpu-tests-rest)  # the gpu tests the 8-worker run did not finish: the async hybrid and compile-once tests alone,
      # then GPT-OSS's precision cells (logs: h200_gpu_tests_async_rest.log, h200_gpu_tests_precision_gpt_oss.log);
      # prefix reuse on CUDA is the prefix-reuse-tests phase
      LOG="$KEEP/h200_gpu_tests_async_rest.log" step 150 "$phase-async" python3 -m pytest -v -rfEs -m gpu \
        -p no:cacheprovider tests/test_gpu_async_grpo.py::test_hybrid_log_probs_on_cuda \
        tests/test_gpu_async_grpo.py::test_default_compile_on_cuda_compiles_once_for_all_lengths
      LOG="$KEEP/h200_gpu_tests_precision_gpt_oss.log" step 100 "$phase-gpt-oss" python3 -m pytest -v -rfEs -m gpu \
        -p no:cacheprovider tests/test_precision.py -k "gpt_oss and cuda" ;;
    async-1.7b-tau2)  # resumes async-1.7b-grpo's file: the tau2_like row (TRL's compiled side compiles ~90 s)
      step "${TAU2_LIMIT:-340}" "$phase" "${ASYNC[@]}" --models qwen3-1.7b --workloads tau2_like \
        --sides reference trl tree trl_compiled --out "$KEEP/async_grpo_h200_qwen3-1.7b_paired.json" ;;
    async-8b-tau2)  # the agent rows at the Qwen3-8B shape, the float32 reference scoring one micro-batch and stopping
      step 480 "$phase" "${ASYNC[@]}" --models qwen3-8b --workloads tau2_like --sides reference trl tree \
        --out "$KEEP/async_grpo_h200_qwen3-8b_paired_tau2.json" ;;
    async-8b)
      step 480 "$phase" "${ASYNC[@]}" --models qwen3-8b --workloads grpo_mixed tau2_like --sides trl tree \
        --out "$KEEP/async_grpo_h200_qwen3-8b_paired.json" ;;
    sync-1.7b)
      step 220 "$phase" "${SYNC[@]}" --models qwen3-1.7b --workloads grpo_mixed --sides reference trl tree \
        --out "$KEEP/sync_grpo_h200_qwen3-1.7b_paired.json" ;;
    sync-1.7b-p4096)  # the fixed-length row: 4,096-token prompts, G=16 completions of 512 tokens, every side in one
      # call
      step 560 "$phase" "${SYNC[@]}" --models qwen3-1.7b --workloads grpo_P4096_C512 --sides reference trl tree \
        --out "$KEEP/sync_grpo_h200_qwen3-1.7b_P4096_paired.json" ;;
    sync-8b-p4096)  # the same row at the Qwen3-8B shape (the float32 reference scores one forward and stops)
      step 560 "$phase" "${SYNC[@]}" --models qwen3-8b --workloads grpo_P4096_C512 --sides reference trl tree \
        --out "$KEEP/sync_grpo_h200_qwen3-8b_P4096_paired.json" ;;
    sync-1.7b-tree)  # resumes sync-1.7b's file (its reference and TRL sides): the tree side
      step 190 "$phase" "${SYNC[@]}" --models qwen3-1.7b --workloads grpo_mixed --sides tree \
        --out "$KEEP/sync_grpo_h200_qwen3-1.7b_paired.json" ;;
    beyond-grpo)  # TreeSFTTrainer / TreeDPOTrainer vs TRL's trainers, sides reference trl tree (~5 min)
      step "${BEYOND_LIMIT:-400}" "$phase" "${BEYOND[@]}" --workloads sft_system_prompt dpo_long_prompt ;;
    beyond-grpo-more)  # resumes beyond-grpo's file: per-turn SFT, TreeRewardTrainer, TreeRLOOTrainer (~6 min)
      step 450 "$phase" "${BEYOND[@]}" --workloads sft_agent_turns reward_pairs rloo_groups ;;
    generation-modes)  # TreeGRPOTrainer vs trl.GRPOTrainer through HF generate: TRL's side alone (10 steps of ~16 s
      # and its load: ~280 s), then generation-modes-tree resumes the file in a second call
      step "${GENMODES_LIMIT:-450}" "$phase" "${GENMODES[@]}" --modes generate --sides trl ;;
    generation-modes-tree)  # the tree (~13 s a step, its compile ~90 s) and the float32 reference (replays the first
      # step's completions)
      step 420 "$phase" "${GENMODES[@]}" --modes generate --sides tree reference ;;
    generation-modes-static)  # resumes generation-modes' file: HF generate with the static cache (~11-13 s a step)
      step "${GENMODES_LIMIT:-450}" "$phase" "${GENMODES[@]}" --modes static_cache ;;
    generation-modes-cb)  # continuous batching (~50 s a step, so one warm-up step): TRL's side alone in one call,
      # then generation-modes-cb-tree resumes the file with the tree and the reference
      step 560 "$phase" "${GENMODES[@]}" --warmup 1 --modes continuous_batching --sides trl ;;
    generation-modes-cb-tree)
      step 560 "$phase" "${GENMODES[@]}" --warmup 1 --modes continuous_batching --sides tree reference ;;
    *) echo "unknown phase $phase" | tee -a "$LOG" ;;
  esac
done
cp "$KEEP"/*.json "$KEEP"/*.log "$OUT"/ 2>/dev/null
ls -la "$OUT"
