"""`tree_prefix_reuse=True` in the trainers that split a step: one forest scored in chunks of `max_tokens_per_mb` rows
(`hf_tree_attn.prefix_reuse`) instead of several forests that repeat their prefix, against the same trainer with one
forest and TRL's own trainer on the same data, in fp32; a sequence longer than the budget trains; what cannot be
exact is refused at init.
"""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import test_tree_dpo
import test_tree_sft
import torch
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs, DistributedType
from datasets import Dataset
from helpers import TOLERANCES, hybrid_twin_models, twin_models
from peft import LoraConfig
from test_coverage import tiny_config as coverage_config
from test_grpo_trainer import (
    _assert_same,
    _batch,
    _config,
    _loss_and_grads,
    ready_for_loss,
    tiny,  # noqa: F401  (the fixture)
)
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
from trl import DPOTrainer, GRPOConfig, GRPOTrainer, SFTTrainer

from hf_tree_attn import pack_forest, prefix_reuse
from hf_tree_attn.chunked import plan_chunks
from hf_tree_attn.trainer import (
    TreeDPOTrainer,
    TreeGRPOConfig,
    TreeGRPOTrainer,
    TreeRewardConfig,
    TreeRewardTrainer,
    TreeSFTConfig,
    TreeSFTTrainer,
    forest_step,
    fused_head,
)
from hf_tree_attn.trainer.core import prefix_reuse_refusal
from trainers import toy_task

BUDGET = 128  # the smallest budget (a multiple of 128): a step's forest takes several chunks of it
SYSTEM = "rules: answer with the last letter of the request. be brief; no tools. think first, then answer.\n"


@pytest.fixture
def chunked_calls(monkeypatch):
    """The forests the group trainers scored in chunks, and each one's chunk count."""
    calls = []
    chunked = forest_step.chunked_forest_logprobs

    def spy(model, forest, max_tokens_per_mb, **kwargs):
        calls.append(plan_chunks(forest, max_tokens_per_mb).num_chunks)
        return chunked(model, forest, max_tokens_per_mb, **kwargs)

    monkeypatch.setattr(forest_step, "chunked_forest_logprobs", spy)
    return calls


def _prompts(system: str) -> list[str]:
    return [system + "id 1. letter: a", system + "id 22. letter: b"]


def _group_inputs(trainer, tokenizer, prompts, beta: float = 0.04):
    """TRL's padded layout (left-padded prompts, right-padded completions) with advantages and reference log-probs."""
    prompt_ids, prompt_mask, completion_ids, completion_mask = _batch(tokenizer, prompts)
    gen = torch.Generator().manual_seed(0)
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.0, -0.5, 0.3, -0.8, 0.9, -1.2, 0.0, 0.4]),
        "num_items_in_batch": completion_mask.sum(),
        "old_per_token_logps": -2.0 + 0.3 * torch.randn(completion_ids.shape, generator=gen),
    }
    if beta:
        inputs["ref_per_token_logps"] = -2.0 + 0.3 * torch.randn(completion_ids.shape, generator=gen)
    sequences = [
        torch.cat([p[m.bool()], c[cm.bool()]]).tolist()
        for p, m, c, cm in zip(prompt_ids, prompt_mask, completion_ids, completion_mask)
    ]
    return inputs, sequences


def _grpo(tiny, tmp_path, trainer_cls=TreeGRPOTrainer, config_cls=TreeGRPOConfig, **overrides):  # noqa: F811
    path, tokenizer = tiny
    options = dict(loss_type="dapo", beta=0.04, num_iterations=2)
    args = _config(config_cls, tmp_path, **{**options, **overrides})
    trainer = trainer_cls(
        path, toy_task.copy_letter_reward, args, train_dataset=toy_task.build_dataset(8), processing_class=tokenizer
    )
    return ready_for_loss(trainer)


# ----------------------------------------------------------------------------------------------------------------
# GRPO


@pytest.mark.parametrize("system", [SYSTEM, SYSTEM * 2], ids=["within-budget", "longer-than-budget"])
def test_grpo_chunked_equals_one_forest_and_trl(tiny, tmp_path, chunked_calls, system):  # noqa: F811
    """Loss and every parameter gradient of the chunked forest equal the one-forest trainer's and TRL's. The first
    case's sequences fit the budget (without prefix reuse they would be two forests); the second's prompts are longer
    than the budget (refused without prefix reuse, see below)."""
    reuse = _grpo(tiny, tmp_path, tree_prefix_reuse=True, max_tokens_per_mb=BUDGET)
    whole = _grpo(tiny, tmp_path / "whole")
    trl = _grpo(tiny, tmp_path, GRPOTrainer, GRPOConfig)
    inputs, sequences = _group_inputs(reuse, tiny[1], _prompts(system))
    (forest,) = pack_forest(sequences, two_level=False)
    assert forest.num_tree_tokens > BUDGET and (max(map(len, sequences)) > BUDGET) == (system != SYSTEM)

    got = _loss_and_grads(reuse, inputs)
    assert chunked_calls == [plan_chunks(forest, BUDGET).num_chunks] and chunked_calls[0] >= 2
    _assert_same(got, _loss_and_grads(whole, inputs))
    _assert_same(got, _loss_and_grads(trl, inputs))
    assert reuse._metrics["train"]["tree_fallback"] == [0.0]


def test_grpo_chunked_entropy_matches_trl(tiny, tmp_path, chunked_calls):  # noqa: F811
    """TRL's entropy-masked loss (top_entropy_quantile < 1) reads the chunked entropies: same loss and gradients."""
    options = dict(top_entropy_quantile=0.5, loss_type="grpo", beta=0.0, num_iterations=1)
    reuse = _grpo(tiny, tmp_path, tree_prefix_reuse=True, max_tokens_per_mb=BUDGET, **options)
    trl = _grpo(tiny, tmp_path, GRPOTrainer, GRPOConfig, **options)
    inputs, _ = _group_inputs(reuse, tiny[1], _prompts(SYSTEM), beta=0.0)
    del inputs["old_per_token_logps"]
    _assert_same(_loss_and_grads(reuse, inputs), _loss_and_grads(trl, inputs))
    assert chunked_calls


@pytest.fixture(scope="module")
def tiny_hybrid(tmp_path_factory):
    """A saved tiny Qwen3.5 (gated delta rule and full attention) with the char tokenizer."""
    tokenizer = toy_task.build_tokenizer()
    model = toy_task.build_model(tokenizer, seed=0, model_type="qwen3_5")
    path = tmp_path_factory.mktemp("tiny_qwen3_5")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), tokenizer


def test_grpo_chunked_hybrid_equals_one_forest(tiny_hybrid, tmp_path, chunked_calls):
    """A Qwen3.5 hybrid in chunks (its gated-delta-rule states and convolution inputs handed from chunk to chunk),
    checkpointed in train mode: the loss and every parameter gradient of the one-forest trainer, and of TRL's."""
    reuse = _grpo(tiny_hybrid, tmp_path, tree_prefix_reuse=True, max_tokens_per_mb=BUDGET)
    assert "GatedDeltaNet" in type(reuse.model.model.layers[0].linear_attn).__name__
    whole = _grpo(tiny_hybrid, tmp_path / "whole")
    trl = _grpo(tiny_hybrid, tmp_path, GRPOTrainer, GRPOConfig)
    inputs, sequences = _group_inputs(reuse, tiny_hybrid[1], _prompts(SYSTEM))
    (forest,) = pack_forest(sequences, two_level=False)

    got = _loss_and_grads(reuse, inputs)
    assert chunked_calls == [plan_chunks(forest, BUDGET).num_chunks] and chunked_calls[0] >= 2
    _assert_same(got, _loss_and_grads(whole, inputs))
    _assert_same(got, _loss_and_grads(trl, inputs))
    assert reuse._metrics["train"]["tree_fallback"] == [0.0]


def test_grpo_long_sequence_refused_without_prefix_reuse(tiny, tmp_path):  # noqa: F811
    """A completion as long as the budget: refused at config time without prefix reuse, accepted with it."""
    with pytest.raises(ValueError, match=r"max_tokens_per_mb=128 cannot hold one sequence.*tree_prefix_reuse=True"):
        _config(TreeGRPOConfig, tmp_path, max_tokens_per_mb=BUDGET, max_completion_length=BUDGET)
    args = _config(
        TreeGRPOConfig, tmp_path, max_tokens_per_mb=BUDGET, max_completion_length=BUDGET, tree_prefix_reuse=True
    )
    assert args.tree_prefix_reuse is True
    path, tokenizer = tiny
    long_prompt = [{"prompt": SYSTEM * 3 + "id 1. letter: a"}] * 8
    with pytest.raises(ValueError, match=r"max_tokens_per_mb=128 cannot hold one sequence: the longest"):
        TreeGRPOTrainer(
            path, toy_task.copy_letter_reward, _config(TreeGRPOConfig, tmp_path, max_tokens_per_mb=BUDGET),
            train_dataset=Dataset.from_list(long_prompt), processing_class=tokenizer,
        )  # fmt: skip
    trainer = TreeGRPOTrainer(
        path, toy_task.copy_letter_reward,
        _config(TreeGRPOConfig, tmp_path, max_tokens_per_mb=BUDGET, tree_prefix_reuse=True),
        train_dataset=Dataset.from_list(long_prompt), processing_class=tokenizer,
    )  # fmt: skip
    assert trainer.tree_packing and trainer._prefix_reuse_rows == BUDGET


# ----------------------------------------------------------------------------------------------------------------
# SFT (the fused-head path)


@pytest.fixture(scope="module")
def sft_tiny(tmp_path_factory):
    tokenizer = toy_task.build_tokenizer()
    tokenizer.chat_template = test_tree_sft.CHAT_TEMPLATE
    path = tmp_path_factory.mktemp("tiny_qwen3_sft")
    toy_task.build_model(tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), tokenizer


@pytest.fixture
def scored_chunks(monkeypatch):
    """The chunk count of every forest the fused head scored in chunks."""
    calls = []
    chunked = fused_head.chunked_forest_scores

    def spy(model, forest, max_tokens_per_mb, *args, **kwargs):
        calls.append(plan_chunks(forest, max_tokens_per_mb).num_chunks)
        return chunked(model, forest, max_tokens_per_mb, *args, **kwargs)

    monkeypatch.setattr(fused_head, "chunked_forest_scores", spy)
    return calls


def _assert_same_logs_and_weights(got, want) -> None:
    (_, got_logs, got_params), (_, want_logs, want_params) = got, want
    assert len(got_logs) == len(want_logs) == 2
    for step, (a, b) in enumerate(zip(got_logs, want_logs)):
        for key in test_tree_sft.LOGGED:
            assert math.isclose(a[key], b[key], abs_tol=TOLERANCES["logps_atol"]), f"step {step}: {key}"
    for name, want_param in want_params.items():
        torch.testing.assert_close(got_params[name], want_param, atol=TOLERANCES["logps_atol"], rtol=0, msg=name)


def test_sft_chunked_equals_one_forest_and_trl(sft_tiny, tmp_path, scored_chunks):
    """Per-turn agent samples (each prompt the whole history, longer than the budget by the last turns), completion-
    only loss: two SGD steps of the chunked trainer log the losses and metrics (entropy, token accuracy: TRL's
    kernel's outputs, from the chunks) and reach the weights of the one-forest trainer and of TRL's."""
    dataset = Dataset.from_list(test_tree_sft._per_turn(test_tree_sft._conversations(6, seed=1)))
    options = dict(train_sampling_strategy="sequential")
    reuse = test_tree_sft._run(
        TreeSFTTrainer, sft_tiny, tmp_path / "reuse", dataset, tree_prefix_reuse=True, max_tokens_per_mb=BUDGET,
        **options,
    )  # fmt: skip
    assert reuse[0].tree_packing and [e["tree_fallback"] for e in reuse[1]] == [0.0, 0.0]
    assert scored_chunks and max(scored_chunks) >= 2
    _assert_same_logs_and_weights(
        reuse, test_tree_sft._run(TreeSFTTrainer, sft_tiny, tmp_path / "one", dataset, **options)
    )
    _assert_same_logs_and_weights(
        reuse, test_tree_sft._run(SFTTrainer, sft_tiny, tmp_path / "trl", dataset, **options)
    )


def test_sft_with_a_memory_budget_equals_trl(sft_tiny, tmp_path, scored_chunks):
    """`tree_prefix_reuse_budget_gib` on the fused-head path: the chunk sizes the planner picks within it, its
    estimate logged per step, and the same losses, metrics and weights as TRL's."""
    dataset = Dataset.from_list(test_tree_sft._per_turn(test_tree_sft._conversations(6, seed=1)))
    options = dict(train_sampling_strategy="sequential")
    reuse = test_tree_sft._run(
        TreeSFTTrainer, sft_tiny, tmp_path / "reuse", dataset, tree_prefix_reuse=True, max_tokens_per_mb=BUDGET,
        tree_prefix_reuse_budget_gib=1.0, **options,
    )  # fmt: skip
    assert scored_chunks and max(scored_chunks) >= 2
    assert all(e["tree_prefix_reuse_chunks"] >= 2 and e["tree_prefix_reuse_peak_gib"] > 0 for e in reuse[1])
    _assert_same_logs_and_weights(
        reuse, test_tree_sft._run(SFTTrainer, sft_tiny, tmp_path / "trl", dataset, **options)
    )


@pytest.mark.parametrize("lora", [False, True], ids=["reference model", "lora"])
def test_dpo_chunked_equals_trl(sft_tiny, tmp_path, scored_chunks, lora):
    """`TreeDPOTrainer` with prefix reuse: each batch's pairs one forest in chunks, scored by the policy and the
    reference (a separate model; under LoRA the policy with its adapters off, the chunks run through the `PeftModel`
    TRL calls): TRL's losses, rewards and weights over two steps."""
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    peft_config = peft_config if lora else None
    tree = test_tree_dpo._trainer(
        TreeDPOTrainer, sft_tiny, tmp_path, peft_config, tree_prefix_reuse=True, max_tokens_per_mb=BUDGET
    )
    flat = test_tree_dpo._trainer(DPOTrainer, sft_tiny, tmp_path, peft_config)
    assert (tree.ref_model is None) == lora
    test_tree_dpo._assert_same_run(tree, flat)
    assert scored_chunks and min(scored_chunks) >= 2


def test_sft_sequence_longer_than_the_budget(sft_tiny, tmp_path, scored_chunks):
    """A dataset whose samples are longer than max_tokens_per_mb: refused at config time without prefix reuse (through
    max_length), and without max_length a batch would fall back to TRL's forward; with prefix reuse it trains on trees
    and matches TRL."""
    texts = [test_tree_sft.SYSTEM * 2 + f"note {i}: " + "xyz " * (i % 5) + "done." for i in range(8)]
    dataset = Dataset.from_dict({"text": texts})
    assert min(len(sft_tiny[1](t)["input_ids"]) for t in texts) > BUDGET
    with pytest.raises(ValueError, match=r"cannot hold one sequence of max_length=1024.*tree_prefix_reuse=True"):
        TreeSFTConfig(output_dir=str(tmp_path), use_cpu=True, max_tokens_per_mb=BUDGET, max_length=1024)
    options = dict(max_length=1024, per_device_train_batch_size=2)
    reuse = test_tree_sft._run(
        TreeSFTTrainer, sft_tiny, tmp_path / "reuse", dataset, tree_prefix_reuse=True, max_tokens_per_mb=BUDGET,
        **options,
    )  # fmt: skip
    assert [e["tree_fallback"] for e in reuse[1]] == [0.0, 0.0] and scored_chunks
    _assert_same_logs_and_weights(
        reuse, test_tree_sft._run(SFTTrainer, sft_tiny, tmp_path / "trl", dataset, **options)
    )


# ----------------------------------------------------------------------------------------------------------------
# What is refused


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(tree_prefix_reuse=True), r"tree_prefix_reuse=True scores a forest in chunks.*max_tokens_per_mb=None"),
        (dict(tree_prefix_reuse=1, max_tokens_per_mb=BUDGET), r"tree_prefix_reuse=1 must be True or False"),
        (
            dict(tree_prefix_reuse=True, max_tokens_per_mb=BUDGET, tree_activation_budget_gib=4.0),
            r"tree_activation_budget_gib=4.0 .*tree_prefix_reuse=True.*tree_prefix_reuse=False",
        ),
    ],
)
def test_config_refusals(tmp_path, overrides, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _config(TreeGRPOConfig, tmp_path, **overrides)


def _reuse_grpo(model, tmp_path, tokenizer, **overrides):
    args = _config(TreeGRPOConfig, tmp_path, tree_prefix_reuse=True, max_tokens_per_mb=BUDGET, **overrides)
    return TreeGRPOTrainer(
        model, toy_task.copy_letter_reward, args, train_dataset=toy_task.build_dataset(8), processing_class=tokenizer
    )


def test_grpo_chunked_mamba2_hybrid_equals_one_forest(tiny, tmp_path, chunked_calls):  # noqa: F811
    """A Mamba-2 hybrid (Bamba) in chunks, its SSD states and convolution inputs handed from chunk to chunk: the loss
    and every parameter gradient of the one-forest trainer, and of TRL's."""
    model, _ = hybrid_twin_models("bamba")
    model.save_pretrained(tmp_path / "bamba")
    bamba = (str(tmp_path / "bamba"), tiny[1])
    reuse = _grpo(bamba, tmp_path, tree_prefix_reuse=True, max_tokens_per_mb=BUDGET)
    assert type(reuse.model.model.layers[0].mamba).__name__ == "BambaMixer"
    whole = _grpo(bamba, tmp_path / "whole")
    trl = _grpo(bamba, tmp_path, GRPOTrainer, GRPOConfig)
    inputs, sequences = _group_inputs(reuse, tiny[1], _prompts(SYSTEM))
    (forest,) = pack_forest(sequences, two_level=False)
    got = _loss_and_grads(reuse, inputs)
    assert chunked_calls == [plan_chunks(forest, BUDGET).num_chunks] and chunked_calls[0] >= 2
    _assert_same(got, _loss_and_grads(whole, inputs))
    _assert_same(got, _loss_and_grads(trl, inputs))


def test_moe_aux_loss_refused(tiny, tmp_path):  # noqa: F811
    config = coverage_config("qwen3_moe")
    config.output_router_logits = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="tree_flex")
    with pytest.raises(ValueError, match=r"tree_prefix_reuse=True, but the MoE load-balancing loss.*=False"):
        _reuse_grpo(model, tmp_path, tiny[1])


def test_reentrant_checkpointing_refused(tiny, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match=r"tree_prefix_reuse=True, but .*'use_reentrant': True.*=False"):
        _reuse_grpo(tiny[0], tmp_path, tiny[1], gradient_checkpointing_kwargs={"use_reentrant": True})


def test_sft_refusal_goes_through_the_head_trainer(sft_tiny, tmp_path):
    config = coverage_config("qwen3_moe")
    config.output_router_logits = True  # the MoE load-balancing loss: refused with prefix reuse
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="tree_flex")
    args = TreeSFTConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", max_length=None, tree_prefix_reuse=True,
        max_tokens_per_mb=BUDGET,
    )  # fmt: skip
    dataset = Dataset.from_dict({"text": [test_tree_sft.SYSTEM + "a."] * 4})
    with pytest.raises(ValueError, match=r"tree_prefix_reuse=True, but the MoE load-balancing loss"):
        TreeSFTTrainer(model, args, train_dataset=dataset, processing_class=sft_tiny[1])


SEVERAL = dict(num_processes=2, distributed_type=DistributedType.MULTI_CPU)
FSDP2 = dict(SEVERAL, distributed_type=DistributedType.FSDP, is_fsdp_enabled=True, is_fsdp2=True)


@pytest.mark.parametrize(
    "setting, match",
    [
        (dict(is_deepspeed_enabled=True), r"DeepSpeed wraps the model.*FSDP2.*or DDP"),
        (dict(SEVERAL, is_deepspeed_enabled=True), r"DeepSpeed wraps the model"),
        (dict(is_fsdp_enabled=True), r"FSDP1 wraps the model.*fsdp_version: 2"),
        (dict(SEVERAL, is_fsdp_enabled=True), r"FSDP1 wraps the model"),
        (dict(FSDP2, hybrid=True), None),  # tests/test_prefix_reuse_fsdp_cpu.py, tests/test_fsdp_trainers.py
        (dict(FSDP2, parallelism_config=object()), r"runs FSDP2 over accelerate's parallelism_config"),
        (dict(FSDP2), None),  # tests/test_fsdp_trainers.py
        (dict(device="cuda"), None),  # the flex path by default (tests/test_gpu_prefix_reuse.py)
        (dict(device="cuda", cuda_path="flash"), r"HF_TREE_ATTN_PREFIX_REUSE_CUDA='flash' is not a path.*flex.*dense"),
        (dict(cuda_path="flash"), None),  # read on CUDA only
        (dict(layers="inductor"), r"HF_TREE_ATTN_PREFIX_REUSE_LAYERS='inductor' names no decoder layers.*compiled"),
        (dict(layers="compiled"), None),
        (dict(SEVERAL, distributed_type=DistributedType.XLA), r"2 processes as XLA.*MULTI_CPU / MULTI_GPU"),
        (dict(SEVERAL, parallelism_config=object()), r"2 processes with tensor, context or sharded"),
        (dict(SEVERAL, is_distributed_loading_by_transformers=True), r"2 processes with tensor, context or sharded"),
        (dict(SEVERAL, ddp_handler=DistributedDataParallelKwargs(static_graph=True)), r"ddp_static_graph=True"),
        (
            dict(SEVERAL, ddp_handler=DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)),
            r"communication hook is set \(fp16\)",
        ),
        (dict(SEVERAL), None),  # DDP: the trainers average the gradients (tests/test_prefix_reuse_ddp.py)
        (dict(SEVERAL, distributed_type=DistributedType.MULTI_GPU, ddp_handler=DistributedDataParallelKwargs()), None),
    ],
)
def test_run_refusals(setting, match, monkeypatch):
    """What the trainers ask `prefix_reuse_refusal` at init, for settings a CPU test cannot start: DeepSpeed, FSDP1,
    FSDP2 over a `parallelism_config` (FSDP2 otherwise, hybrids too: accepted, its DDP checks not asked), CUDA with
    a `HF_TREE_ATTN_PREFIX_REUSE_CUDA` that names no path (flex, the default, and dense: accepted), a
    `HF_TREE_ATTN_PREFIX_REUSE_LAYERS` that names no layers (compiled, the default, and eager: accepted), several
    processes other than plain DDP (DDP: accepted)."""
    monkeypatch.setattr(prefix_reuse, "CUDA_PATH", setting.get("cuda_path", "flex"))
    monkeypatch.setattr(prefix_reuse, "LAYERS", setting.get("layers", "compiled"))
    model, _ = hybrid_twin_models("qwen3_5") if setting.get("hybrid") else twin_models("qwen3")
    accelerator = SimpleNamespace(
        num_processes=setting.get("num_processes", 1),
        distributed_type=setting.get("distributed_type", DistributedType.NO),
        parallelism_config=setting.get("parallelism_config"),
        ddp_handler=setting.get("ddp_handler"),
        device=torch.device(setting.get("device", "cpu")),
        is_fsdp2=setting.get("is_fsdp2", False),
    )
    trainer = SimpleNamespace(
        args=SimpleNamespace(gradient_checkpointing=True, gradient_checkpointing_kwargs=None),
        accelerator=accelerator,
        is_fsdp_enabled=setting.get("is_fsdp_enabled", False),
        is_deepspeed_enabled=setting.get("is_deepspeed_enabled", False),
        is_distributed_loading_by_transformers=setting.get("is_distributed_loading_by_transformers", False),
    )
    reason = prefix_reuse_refusal(trainer, (model, None))
    assert reason is None if match is None else re.search(match, reason), reason
    if "device" in setting:
        monkeypatch.setattr(prefix_reuse, "CUDA_PATH", "dense")
        assert prefix_reuse_refusal(trainer, (model, None)) is None


def test_reward_trainer_refuses_it(tmp_path):
    """The reward trainer shares the config field but scores its forests whole: refused, not ignored."""
    tokenizer = toy_task.build_tokenizer()
    config = toy_task.model_config(tokenizer, num_labels=1, initializer_range=0.1)
    model = AutoModelForSequenceClassification.from_config(config)
    args = TreeRewardConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", tree_prefix_reuse=True, max_tokens_per_mb=BUDGET
    )
    dataset = Dataset.from_list([{"prompt": SYSTEM + "q: 1?", "chosen": " 1.", "rejected": " 2."}] * 4)
    with pytest.raises(ValueError, match=r"tree_prefix_reuse=True: TreeRewardTrainer.*tree_prefix_reuse=False"):
        TreeRewardTrainer(model, args=args, train_dataset=dataset, processing_class=tokenizer)
