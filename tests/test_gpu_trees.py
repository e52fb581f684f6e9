"""On CUDA: TreeSFTTrainer, TreeDPOTrainer and tree-scored reward models equal TRL's, in fp32.

On the GPU the tree runs its default fast path — compiled decoder layers (`tree_compile="auto"`) with FlexAttention
or the shared-prefix kernels — and TRL's LM head its Triton kernel; TRL runs SDPA, eager. Same math, other
kernels: fp32 tolerances of 1e-4 (as tests/test_grpo_trainer.py's CUDA test).
Self-contained fixtures (no tests/helpers.py, which imports configs newer than the GPU machine's transformers).
"""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset

from hf_tree_attn.compile import compiled_layers
from trainers import toy_task

pytestmark = pytest.mark.gpu
ATOL = 1e-4
SYSTEM = "you are a terse agent. tools: calc(x), look(k). answer in one line; cite the tool you used.\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tokenizer = toy_task.build_tokenizer()
    path = tmp_path_factory.mktemp("tiny_qwen3_gpu")
    toy_task.build_model(tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), tokenizer


def _args(config_cls, tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / config_cls.__name__), bf16=False, seed=0, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, max_steps=2, logging_steps=1, learning_rate=0.05, optim="sgd",
        lr_scheduler_type="constant", report_to="none", save_strategy="no", model_init_kwargs={"dtype": torch.float32},
        max_length=None,
    )  # fmt: skip
    kwargs.update(overrides)
    return config_cls(**kwargs)


def _same_run(tree, flat, keys):
    tree.train()
    flat.train()
    assert tree.model.device.type == "cuda" and tree.tree_packing
    assert tree.tree_compile.source == "default" and compiled_layers(tree.model)  # the CUDA default: compiled
    tree_logs = [e for e in tree.state.log_history if "loss" in e]
    flat_logs = [e for e in flat.state.log_history if "loss" in e]
    assert len(tree_logs) == len(flat_logs) == 2
    for got, want in zip(tree_logs, flat_logs):
        for key in keys:
            assert math.isclose(got[key], want[key], rel_tol=ATOL, abs_tol=ATOL), (key, got[key], want[key])
        assert got["tree_fallback"] == 0.0
    flat_params = dict(flat.model.named_parameters())
    for name, p in tree.model.named_parameters():
        torch.testing.assert_close(p, flat_params[name], atol=ATOL, rtol=ATOL, msg=name)


def test_sft_run_equals_trl_on_cuda(tiny, tmp_path):
    from trl import SFTConfig, SFTTrainer

    from hf_tree_attn.trainer import TreeSFTConfig, TreeSFTTrainer

    path, tokenizer = tiny
    rows = [{"prompt": SYSTEM + f"q{i}: {i} plus {i % 7}?\n", "completion": f"a: calc {2 * i}."} for i in range(16)]
    dataset = Dataset.from_list(rows)
    tree = TreeSFTTrainer(path, _args(TreeSFTConfig, tmp_path), train_dataset=dataset, processing_class=tokenizer)
    flat = SFTTrainer(path, _args(SFTConfig, tmp_path), train_dataset=dataset, processing_class=tokenizer)
    _same_run(tree, flat, ("loss", "entropy", "mean_token_accuracy"))


def test_dpo_run_equals_trl_on_cuda(tiny, tmp_path):
    from trl import DPOConfig, DPOTrainer

    from hf_tree_attn.trainer import TreeDPOConfig, TreeDPOTrainer

    path, tokenizer = tiny
    rows = [
        {"prompt": SYSTEM + f"q{i}: {i} plus {i}?\n", "chosen": f"a: {2 * i}.", "rejected": f"a: {2 * i + 1}, maybe."}
        for i in range(16)
    ]
    dataset = Dataset.from_list(rows)
    overrides = dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5], beta=0.5)
    tree = TreeDPOTrainer(path, args=_args(TreeDPOConfig, tmp_path, **overrides), train_dataset=dataset,
                          processing_class=tokenizer)  # fmt: skip
    flat = DPOTrainer(path, args=_args(DPOConfig, tmp_path, **overrides), train_dataset=dataset,
                      processing_class=tokenizer)  # fmt: skip
    _same_run(tree, flat, ("loss", "rewards/margins", "logps/chosen", "logps/rejected", "entropy"))


def test_reward_model_scores_equal_the_padded_forward_on_cuda():
    from transformers import AutoModelForSequenceClassification

    from hf_tree_attn.trainer.reward import tree_reward_models

    tokenizer = toy_task.build_tokenizer()
    torch.manual_seed(0)
    config = toy_task.model_config(tokenizer, num_labels=1)
    model = AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa").cuda().eval()
    prompts = [SYSTEM * 4 + "q: 3 plus 4?\n", SYSTEM * 4 + "q: 9 plus 1?\n"]
    texts = [p + c for p in prompts for c in ("a: 7.", "a: calc 7.", "a: 8, sure.", "a:")]
    batch = tokenizer(texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    batch = {k: v.cuda() for k, v in batch.items()}
    records = []
    with torch.inference_mode():
        want = model(**batch).logits
        with tree_reward_models([model], record=lambda name, value: records.append((name, value))):
            got = model(**batch).logits
    torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)
    assert ("reward_tree_fallback", 0.0) in records
