#!/usr/bin/env bash
# GRPO with a PEFT LoRA adapter through TreeGRPOTrainer (trainers/grpo_tree.py), on packed prefix trees.
#
#   bash examples/lora_grpo.sh                        # embedded default: tiny Qwen3 + copy-the-letter task, CPU
#   MAX_STEPS=300 bash examples/lora_grpo.sh          # a longer run; any extra flag is passed on, e.g.
#   bash examples/lora_grpo.sh --learning_rate 1e-2 --lora_r 32
#
# The embedded default needs no download: the model is built from a config, the tokenizer in code, the dataset
# is synthetic. Every micro-batch packs whole GRPO groups (2 prompts x 8 completions sharing a long system
# prompt), so the log shows tree_token_ratio around 0.09 and tree_fallback 0. The adapter (not the base model)
# is saved to OUTPUT_DIR. Keep `lm_head` out of --lora_target_modules: the tree LM head reads its weight directly
# and raises on a wrapped head.
set -euo pipefail
cd "$(dirname "$0")/.."

accelerate launch --num_processes 1 trainers/grpo_tree.py \
    --use_peft \
    --lora_r 16 \
    --lora_alpha 32 \
    --lora_target_modules q_proj k_proj v_proj o_proj gate_proj up_proj down_proj \
    --max_steps "${MAX_STEPS:-20}" \
    --logging_steps 5 \
    --output_dir "${OUTPUT_DIR:-outputs/lora_grpo}" \
    "$@"

# The same command for a real model (GPU: one process per GPU; add --config_file <accelerate FSDP config> to shard;
# accuracy_reward needs `pip install math-verify`). max_tokens_per_mb must hold the longest prompt plus
# max_completion_length, rounded up to a multiple of 128:
#
# accelerate launch trainers/grpo_tree.py \
#     --model_name_or_path Qwen/Qwen3-0.6B \
#     --dataset_name trl-lib/DeepMath-103K \
#     --reward_funcs accuracy_reward \
#     --use_peft \
#     --lora_r 16 \
#     --lora_alpha 32 \
#     --lora_target_modules q_proj k_proj v_proj o_proj gate_proj up_proj down_proj \
#     --learning_rate 1e-5 \
#     --bf16 \
#     --per_device_train_batch_size 8 \
#     --num_generations 8 \
#     --max_completion_length 1024 \
#     --max_tokens_per_mb 16384 \
#     --output_dir outputs/lora_grpo_qwen3
