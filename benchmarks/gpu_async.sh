#!/usr/bin/env bash
# The GPU job of the asynchronous GRPO trainer, unattended on one H200 (the limits below; SKIP some to fit one call):
# the shared-prefix kernels on new shapes, the GPU tests of TreeAsyncGRPOTrainer, then the through-train()
# benchmarks side by side with TRL's own trainers, most wanted first, each side with one more step under the torch profiler (--profile: where the step's time goes). Each
# step has its own time limit and writes its JSON row by row, so a step that runs out of time keeps the rows it
# finished.
#
#   bash benchmarks/gpu_async.sh            (repository root, .whl/async carried; results and logs under $OUT)
#   SKIP="async-qwen3.5 tests" bash benchmarks/gpu_async.sh     leaves those steps out
#
# The limits are sized for bench_async_grpo.py's defaults (2 warm-up and 4 measured steps per side: FlexAttention
# compiles again at the second row length) plus the profiled step; the steps after the first four do not fit in one
# call with them: SKIP those four to run the others.
#
# The H200 image has no trl or datasets. TRL 1.16's async trainer imports trl (pandas, pyarrow, jinja2, requests,
# pyyaml, psutil: all on the image) and datasets (dill, multiprocess, xxhash, fsspec, pyarrow: the first two are
# not), so four pure-Python wheels travel in .whl/async (1.8 MB, git-ignored), filled with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl/async \
#     trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
export USE_HUB_KERNELS=0  # no Hub to fetch the kernels transformers 5.25 swaps in by default
export NCCL_NVLS_ENABLE=0 TRL_EXPERIMENTAL_SILENCE=1
OUT=${OUT:-/tmp/gpu_async_out}
mkdir -p "$OUT"
if ! python3 -c "import trl, datasets" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/async/trl-1.16.0-*.whl .whl/async/datasets-5.2.0-*.whl .whl/async/dill-0.4.1-*.whl \
    .whl/async/multiprocess-0.70.19-*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
LOG="$OUT/gpu_async.log"
{
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
  python3 -c "import torch, transformers, trl, accelerate; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'trl', trl.__version__, 'accelerate', accelerate.__version__)"
} 2>&1 | tee "$LOG"

step() {  # step <seconds> <name> <command...>: run with a limit, log it, print the elapsed time; SKIP="name ..."
  local limit=$1 name=$2 start=$SECONDS
  shift 2
  if [[ " ${SKIP:-} " == *" $name "* ]]; then echo "=== $name: skipped (SKIP)" | tee -a "$LOG"; return; fi
  echo "=== $name (limit ${limit}s)" | tee -a "$LOG"
  timeout "$limit" "$@" 2>&1 | grep -v -i -E "warn|^\[transformers\]|Loading weights|Callback$|^StepClock$|^:|^\{'" | tee -a "$LOG"
  echo "=== $name: rc ${PIPESTATUS[0]}, $((SECONDS - start)) s" | tee -a "$LOG"
}

# what a forest of new shapes costs the shared-prefix kernels (cuDNN graphs) and FlexAttention, and the CUDA rule
step 60 prefix-new-shapes python3 benchmarks/prefix_attention_new_shapes.py \
  --out "$OUT/prefix_attention_new_shapes_h200.json"
step 60 prefix-rule python3 -m pytest -q -rf -m gpu -p no:cacheprovider tests/test_prefix_attention.py \
  -k kernels_only_where
step 100 tests python3 -m pytest -q -rf -m gpu -p no:cacheprovider tests/test_gpu_async_grpo.py
step 200 async-qwen3-1.7b python3 benchmarks/bench_async_grpo.py --models qwen3-1.7b \
  --workloads grpo_mixed tau2_like --profile --out "$OUT/async_grpo_h200_qwen3-1.7b.json"
# the tree side again with FlexAttention alone (the shared-prefix kernels off): what each attention path costs
HF_TREE_ATTN_PREFIX_ATTENTION=never step 75 async-qwen3-1.7b-flex python3 benchmarks/bench_async_grpo.py \
  --models qwen3-1.7b --workloads grpo_mixed --sides tree --profile \
  --out "$OUT/async_grpo_h200_qwen3-1.7b_flex_only.json"
step 200 async-qwen3-8b python3 benchmarks/bench_async_grpo.py --models qwen3-8b --workloads grpo_mixed \
  --profile --out "$OUT/async_grpo_h200_qwen3-8b.json"
step 80 sync-qwen3-1.7b python3 benchmarks/bench_sync_grpo.py --models qwen3-1.7b \
  --workloads grpo_P4096_C512 grpo_mixed --out "$OUT/sync_grpo_h200_qwen3-1.7b.json"
step 90 async-qwen3.5 python3 benchmarks/bench_async_grpo.py --models qwen3.5-0.8b qwen3.5-2b \
  --workloads grpo_mixed --token-budget 16384 --out "$OUT/async_grpo_h200_qwen3.5.json"
step 60 async-qwen3-1.7b-budget python3 benchmarks/bench_async_grpo.py --models qwen3-1.7b --workloads grpo_mixed \
  --sides tree_budget --activation-budget-gib 60 --out "$OUT/async_grpo_h200_qwen3-1.7b_budget.json"
echo "=== total $SECONDS s" | tee -a "$LOG"
