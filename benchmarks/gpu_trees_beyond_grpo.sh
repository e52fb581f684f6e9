#!/usr/bin/env bash
# The whole GPU job of the SFT / DPO / reward-model trainers on trees, unattended, on one H200 (about 6 minutes once
# the machine is up): install the carried wheels, run the GPU tests, run the benchmark. Logs and the JSON results
# go to $OUT (the device tool's output folder; /tmp/trees_beyond_grpo_out elsewhere).
#
#   bash benchmarks/gpu_trees_beyond_grpo.sh        carry: .whl/trees_beyond_grpo
#   TESTS=0 WORKLOADS="sft_agent_turns grpo_reward_model" RESULT=trees_beyond_grpo_h200_more \
#     bash benchmarks/gpu_trees_beyond_grpo.sh      some workloads only, no GPU tests, into $OUT/RESULT.json
# These commands ran the one-process version of the benchmark (`git show 290af27:benchmarks/bench_trees_beyond_grpo.py`);
# the paired version (each side in its own process) runs in gpu_compile.sh's beyond-grpo phases. The commands:
#   python3 benchmarks/bench_trees_beyond_grpo.py --out $OUT/trees_beyond_grpo_h200.json
#   python3 benchmarks/bench_trees_beyond_grpo.py --workloads sft_agent_turns grpo_reward_model --out $OUT/trees_beyond_grpo_h200_more.json
#
# The H200 image has torch, transformers 5.17, accelerate, peft, pandas, pyarrow, fsspec, xxhash, huggingface-hub;
# it lacks trl and datasets and datasets' dill and multiprocess. Their Python 3.12 wheels travel in
# .whl/trees_beyond_grpo (git-ignored, 1.8 MB: trl-1.16.0, datasets-5.2.0, dill-0.4.1, multiprocess-0.70.19),
# filled with `pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
# --platform manylinux_2_28_x86_64 ... -d .whl/trees_beyond_grpo trl==1.16.0 datasets==5.2.0 dill==0.4.1
# multiprocess==0.70.19`.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false NCCL_NVLS_ENABLE=0
export USE_HUB_KERNELS=0  # no Hub to fetch the kernels transformers 5.25 swaps in by default
WHEELS=${WHEELS:-.whl/trees_beyond_grpo}
OUT=${OUT:-/tmp/trees_beyond_grpo_out}
SITE=/tmp/site_trees_beyond_grpo
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl \
  || { echo "wheel install failed (carry $WHEELS)"; exit 1; }
export PYTHONPATH=$SITE:$PWD
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, transformers, trl, datasets, peft, accelerate; print('torch', torch.__version__,
'transformers', transformers.__version__, 'trl', trl.__version__, 'datasets', datasets.__version__, 'peft',
peft.__version__, 'accelerate', accelerate.__version__)" || exit 1

RESULT=${RESULT:-trees_beyond_grpo_h200}
if [ "${TESTS:-1}" != 0 ]; then
  echo "=== GPU tests (tests/test_gpu_trees.py)"
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_trees.py 2>&1 \
    | tee "$OUT/gpu_trees_tests.log" | tail -15
fi

echo "=== benchmark (tree vs TRL through trainer.train())"
# shellcheck disable=SC2086
timeout "${BENCH_MAX:-270}" python3 benchmarks/bench_trees_beyond_grpo.py ${WORKLOADS:+--workloads $WORKLOADS} \
  --out "$OUT/$RESULT.json" 2>&1 | tee "$OUT/${RESULT}_bench.log" | grep -E "^(sft|dpo|grpo)_|Error|error:|Traceback" | tail -40
ls -la "$OUT"
