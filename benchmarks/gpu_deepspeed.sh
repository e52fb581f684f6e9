#!/usr/bin/env bash
# DeepSpeed ZeRO-2 / ZeRO-3 on one GPU, unattended (at most ~9 minutes: the tests' 330 s and the main job's 180 s):
#   1. tests/test_gpu_deepspeed.py: TreeGRPOTrainer against trl.GRPOTrainer under each ZeRO stage in bf16, full
#      fine-tuning and LoRA, 4 optimizer steps each, measured against TRL's float32 run (one `accelerate launch`
#      per stage with trainers/configs/deepspeed_zero{2,3}.yaml, --num_processes 1);
#   2. the main job, trainers/grpo_tree.py on its embedded model, under trainers/configs/deepspeed_zero3.yaml.
# Writes to $OUT: versions.txt, gpu_deepspeed_tests.log, deepspeed_zero{2,3}_bf16.json (losses and errors per run),
# main_job_zero3.log, main_job_zero3_trainer_state.json.
#
# The machine has no trl, datasets or deepspeed and no network: their wheels travel in .whl/deepspeed/ (git-ignored),
# filled on a machine with PyPI by
#   pip wheel --no-deps deepspeed==0.19.8 -w .whl/deepspeed          (a source distribution: py3-none-any wheel)
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 -d .whl/deepspeed trl==1.16.0 datasets==5.2.0 dill==0.4.1 \
#       multiprocess==0.70.19 hjson==3.1.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated_types==0.8.0 \
#       typing_inspection==0.4.5 typing_extensions==4.16.0
# (deepspeed's other needs, einops, msgpack, ninja, numpy, packaging, psutil, py-cpuinfo and tqdm, are on the image).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false NCCL_NVLS_ENABLE=0
export USE_HUB_KERNELS=0  # no Hub to fetch the kernels transformers 5.25 swaps in by default
OUT=${OUT:-/tmp/gpu_deepspeed_out}
export OUT
mkdir -p "$OUT"
if [ -d .whl/deepspeed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/deepspeed/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import sys, torch, transformers, trl, peft, accelerate, deepspeed
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)
for m in (transformers, trl, peft, accelerate, deepspeed): print(m.__name__, m.__version__)"
  # The sender's commit where set (the machine's copy of the work tree can carry stale git metadata), else git's.
  if [ -n "${HF_TREE_ATTN_COMMIT:-}" ]; then
    echo "commit $HF_TREE_ATTN_COMMIT"
  else
    git log -1 --format='commit %H' 2>/dev/null || true
  fi
} 2>&1 | tee "$OUT/versions.txt"

echo "=== tests/test_gpu_deepspeed.py"
timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider -rA tests/test_gpu_deepspeed.py 2>&1 \
  | tee "$OUT/gpu_deepspeed_tests.log" | tail -15
tests_status=${PIPESTATUS[0]}

echo "=== main job under ZeRO-3"
rm -rf /tmp/ds_main_job
(  # a subshell: its exit status is the main job's
  cat "$OUT/versions.txt"
  echo "+ accelerate launch --config_file trainers/configs/deepspeed_zero3.yaml --num_processes 1 trainers/grpo_tree.py" \
    "--max_steps 20 --logging_steps 5 --output_dir /tmp/ds_main_job"
  timeout 180 python3 -m accelerate.commands.launch --config_file trainers/configs/deepspeed_zero3.yaml \
    --num_processes 1 trainers/grpo_tree.py --max_steps 20 --logging_steps 5 --output_dir /tmp/ds_main_job
  main_status=$?
  echo "exit status $main_status"
  exit "$main_status"
) > "$OUT/main_job_zero3.log" 2>&1
main_status=$?
grep -v -i warn "$OUT/main_job_zero3.log" | grep -E "'loss'|saved|exit status|Error" | cut -c1-300
cp /tmp/ds_main_job/trainer_state.json "$OUT/main_job_zero3_trainer_state.json" 2>/dev/null
ls -la "$OUT"
echo "tests: exit status $tests_status; main job: exit status $main_status"
[ "$tests_status" = 0 ] && [ "$main_status" = 0 ]
