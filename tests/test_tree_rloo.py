"""TreeRLOOTrainer against trl.RLOOTrainer: the same batch's loss and gradients, and the same seeded runs.

The oracle is TRL itself, as for GRPO (tests/test_grpo_trainer.py, tests/test_grpo_runs.py): the same tiny Qwen3 is
loaded twice from disk (`tree_flex` for the tree trainer, `sdpa` for TRL's), and
- on one hand-built batch (shared prompts, groups, duplicate and branching completions, a masked completion) the
  loss and every parameter gradient agree in float32, and under `bf16=True` the tree is as close to the float32
  run as TRL's own; the batch's forest holds each prompt once;
- whole seeded runs (a reference model and its KL penalty, two iterations per generation, accumulated
  micro-batches; transformers' continuous batching; a LoRA adapter) sample the same completions and end with the
  same losses and weights, every log-probability forward on the tree.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import TOLERANCES, token_reward
from peft import LoraConfig
from test_grpo_trainer import (
    COMPLETION_LEN,
    COMPLETIONS,
    NUM_GENERATIONS,
    PROMPTS,
    TOLERANCE,
    _batch,
    assert_as_close_to_fp32_as_trl,
    evaluate,
)
from trl import RLOOConfig, RLOOTrainer

from hf_tree_attn.trainer import TreeRLOOConfig, TreeRLOOTrainer
from trainers import toy_task

# tests/test_grpo_trainer.py's batch (shared prompts, groups, duplicate and branching completions, a masked one) in
# TRL's padded layout, and its fp32 tolerance.
FP32 = TOLERANCE[torch.float32]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A saved tiny Qwen3 + char tokenizer: TRL builds the reference model from the path."""
    tokenizer = toy_task.build_tokenizer()
    path = tmp_path_factory.mktemp("tiny_qwen3")
    toy_task.build_model(tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), tokenizer


def _config(cls, tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / cls.__name__), use_cpu=True, bf16=False,
        per_device_train_batch_size=len(COMPLETIONS), num_generations=NUM_GENERATIONS,
        max_completion_length=COMPLETION_LEN, temperature=0.7, report_to="none", save_strategy="no",
        model_init_kwargs={"dtype": torch.float32},
    )  # fmt: skip
    kwargs.update(overrides)
    return cls(**kwargs)


def _pair(tiny, tmp_path, **overrides):
    """(tree trainer, TRL's trainer) on two loads of the same weights, gradient checkpointing on, train mode."""
    path, tokenizer = tiny
    trainers = []
    for trainer_cls, config_cls in ((TreeRLOOTrainer, TreeRLOOConfig), (RLOOTrainer, RLOOConfig)):
        args = _config(config_cls, tmp_path, **overrides)
        trainer = trainer_cls(
            path, reward_funcs=toy_task.copy_letter_reward, args=args, train_dataset=toy_task.build_dataset(8),
            processing_class=tokenizer,
        )  # fmt: skip
        trainer.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        trainer.model.train()
        trainers.append(trainer)
    assert trainers[0].model.config._attn_implementation == "tree_flex"
    assert trainers[1].model.config._attn_implementation == "sdpa"
    return trainers


def _inputs(trainer, tokenizer, moved):
    """The micro-batch RLOO's loss reads; `old_logps` `(B,)` are the sampling policy's sequence log-probabilities:
    the current ones, or (`moved`) ones the policy has moved away from, so ratios leave 1 and some clip."""
    prompt_ids, prompt_mask, completion_ids, completion_mask = _batch(tokenizer)
    ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    with torch.no_grad():
        current, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, COMPLETION_LEN)
    old_logps = (current * completion_mask).sum(1)
    if moved:
        old_logps = old_logps + 0.3 * torch.randn(old_logps.shape, generator=torch.Generator().manual_seed(0))
    return {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
        "completion_mask": completion_mask, "old_logps": old_logps,
        "advantages": torch.tensor([1.0, -0.5, 0.3, -0.8, 0.9, -1.2, 0.0, 0.4]),
    }  # fmt: skip


def _loss_and_grads(trainer, inputs):
    """Loss and parameter gradients of `inputs` (float32: the precision tests use `evaluate`)."""
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {name: p.grad.float() for name, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach().float(), grads


def _trie_nodes(tokenizer) -> int:
    """Tokens of the batch's prefix trie: each distinct prefix of a row's unpadded sequence once (the oracle)."""
    prompt_ids, prompt_mask, completion_ids, completion_mask = _batch(tokenizer)
    rows = [
        torch.cat([p[pm.bool()], c[cm.bool()]]).tolist()
        for p, pm, c, cm in zip(prompt_ids, prompt_mask, completion_ids, completion_mask)
    ]
    return len({tuple(row[: k + 1]) for row in rows for k in range(len(row))})


def _forwarded_tokens(trainer) -> list[int]:
    """Per forward of `trainer`'s policy from now on, the token positions its embedding layer reads."""
    seen = []
    embedding = trainer.model.get_input_embeddings()
    embedding.register_forward_hook(lambda module, args, out: seen.append(args[0].numel()))
    return seen


@pytest.mark.parametrize("moved", [False, True], ids=["on-policy", "moved-policy"])
def test_loss_and_grads_match_trls(tiny, tmp_path, moved):
    tree, flat = _pair(tiny, tmp_path)
    inputs = _inputs(flat, tiny[1], moved)
    tree_forwarded, flat_forwarded = _forwarded_tokens(tree), _forwarded_tokens(flat)
    (tree_loss, tree_grads), (flat_loss, flat_grads) = _loss_and_grads(tree, inputs), _loss_and_grads(flat, inputs)
    torch.testing.assert_close(tree_loss, flat_loss, **FP32)
    assert tree_grads.keys() == flat_grads.keys() and any(g.abs().max() > 0 for g in flat_grads.values())
    for name, grad in flat_grads.items():
        torch.testing.assert_close(tree_grads[name], grad, **FP32, msg=name)
    for metric in ("entropy", "clip_ratio/region_mean"):  # TRL's metrics, from the tree's log-probs and entropies
        assert math.isclose(tree._metrics["train"][metric][-1], flat._metrics["train"][metric][-1], abs_tol=1e-5)
    if moved:
        assert flat._metrics["train"]["clip_ratio/region_mean"][-1] > 0  # the clipped branch is exercised
    assert tree._metrics["train"]["tree_fallback"] == [0.0]

    # One forward of one forest (TRL: of the padded rows), which holds each prompt once for its group: the batch's
    # trie, padded to FlexAttention's block.
    (forest,) = (scored.forest for scored in next(iter(tree._tree_cache.values())))
    rows = inputs["prompt_ids"].numel() + inputs["completion_ids"].numel()
    assert tree_forwarded == [forest.seq_len] and flat_forwarded == [rows] and forest.seq_len < rows
    assert forest.num_tree_tokens == _trie_nodes(tiny[1])
    prompt_tokens = [len(tiny[1](p)["input_ids"]) for p in PROMPTS]
    assert forest.num_original_tokens - forest.num_tree_tokens >= (NUM_GENERATIONS - 1) * sum(prompt_tokens)

    # A second pass over the micro-batch after an update (num_iterations): the cached forest again.
    with torch.no_grad():
        for (_, p_tree), (_, p_flat) in zip(tree.model.named_parameters(), flat.model.named_parameters()):
            step = 1e-2 * torch.sign(p_flat.grad) if p_flat.grad is not None else 0.0
            p_tree.add_(step)
            p_flat.add_(step)
    (tree_loss, _), (flat_loss, _) = _loss_and_grads(tree, inputs), _loss_and_grads(flat, inputs)
    torch.testing.assert_close(tree_loss, flat_loss, **FP32)
    assert len(tree._metrics["train"]["tree_token_ratio"]) == 1  # the forest was built once


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16], ids=["fp32+bf16autocast", "bf16+bf16autocast"])
def test_bf16_is_as_close_to_float32_as_trls(tiny, tmp_path, weights):
    """As TRL trains with `bf16=True` (fp32 or bf16 weights under bf16 autocast), the tree's log-probabilities, loss
    and gradients are as close to the float32 ones as TRL's under the same precision: within twice its error plus one
    bf16 rounding (tests/test_precision.py says why that bound; `assert_as_close_to_fp32_as_trl` how for the loss)."""
    _, reference = _pair(tiny, tmp_path / "fp32")
    inputs = _inputs(reference, tiny[1], moved=True)
    ref = evaluate(reference, inputs)
    tree, flat = _pair(tiny, tmp_path, bf16=True, model_init_kwargs={"dtype": weights})
    assert next(tree.model.parameters()).dtype == weights and tree.accelerator.mixed_precision == "bf16"
    assert_as_close_to_fp32_as_trl(ref, evaluate(tree, inputs), evaluate(flat, inputs), inputs["completion_mask"])
    assert tree._metrics["train"]["tree_fallback"] == [0.0]


# ----------------------------------------------------------------------------------------------------------------
# Whole runs: with one seed, TreeRLOOTrainer makes trl.RLOOTrainer's run (SGD keeps weight differences at
# learning_rate x gradient difference; a reward of the sampled tokens makes a different sample a different run).


def _run(trainer_cls, tiny, tmp_path, **overrides):
    path, tokenizer = tiny
    config_cls = TreeRLOOConfig if trainer_cls is TreeRLOOTrainer else RLOOConfig
    kwargs = dict(
        output_dir=str(tmp_path / trainer_cls.__name__), use_cpu=True, bf16=False, seed=0,
        per_device_train_batch_size=2 * NUM_GENERATIONS, num_generations=NUM_GENERATIONS, max_completion_length=4,
        max_steps=2, logging_steps=1, learning_rate=0.05, optim="sgd", lr_scheduler_type="constant",
        report_to="none", save_strategy="no", model_init_kwargs={"dtype": torch.float32}, beta=0.04,
        gradient_checkpointing=False,  # a 2-layer model; the checkpointed tree forward is tested above
    )  # fmt: skip
    kwargs.update(overrides)
    peft_config = kwargs.pop("peft_config", None)
    trainer = trainer_cls(
        path, reward_funcs=token_reward, args=config_cls(**kwargs), train_dataset=toy_task.build_dataset(64, seed=1),
        processing_class=tokenizer, peft_config=peft_config,
    )  # fmt: skip
    completions, generate = [], trainer._generate_and_score_completions

    def recording(batch):
        out = generate(batch)
        completions.append(out["completion_ids"].clone())
        return out

    trainer._generate_and_score_completions = recording
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    params = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    return completions, losses, params, trainer


def _assert_same_run(tree, flat, generations):
    (tree_completions, tree_losses, tree_params, trainer), (flat_completions, flat_losses, flat_params, _) = tree, flat
    assert len(tree_completions) == len(flat_completions) == generations
    for k, (a, b) in enumerate(zip(tree_completions, flat_completions)):
        assert torch.equal(a, b), f"generation {k} sampled other completions: the random streams parted"
    assert len(tree_losses) == len(flat_losses) > 0
    for step, (a, b) in enumerate(zip(tree_losses, flat_losses)):
        assert math.isclose(a, b, abs_tol=TOLERANCES["logps_atol"]), f"step {step}: loss {a} vs {b}"
    for name, want in flat_params.items():
        torch.testing.assert_close(tree_params[name], want, atol=TOLERANCES["logps_atol"], rtol=0, msg=name)
    logs = trainer.state.log_history
    fallbacks = [entry["tree_fallback"] for entry in logs if "tree_fallback" in entry]
    assert fallbacks and set(fallbacks) == {0.0}  # every old-policy, reference and policy forward on the tree
    assert all(0 < entry["tree_token_ratio"] < 1 for entry in logs if "tree_token_ratio" in entry)


def test_same_seed_same_run_as_trl(tiny, tmp_path):
    """3 optimizer steps x 2 accumulated micro-batches, each generation used twice, a reference model (beta > 0)."""
    overrides = dict(gradient_accumulation_steps=2, num_iterations=2, max_steps=3)
    tree = _run(TreeRLOOTrainer, tiny, tmp_path, **overrides)
    flat = _run(RLOOTrainer, tiny, tmp_path, **overrides)
    assert tree[3].ref_model is not None and tree[3].ref_model.config._attn_implementation == "tree_flex"
    _assert_same_run(tree, flat, generations=2)
    initial = dict(toy_task.build_model(toy_task.build_tokenizer(), seed=0).named_parameters())
    assert any(not torch.allclose(p, initial[n]) for n, p in flat[2].items()), "the run did not train"
    for micro_batch in tree[3]._buffered_inputs:  # TRL shuffles rows; the tree keeps groups whole
        groups = micro_batch["prompt_ids"].view(-1, NUM_GENERATIONS, micro_batch["prompt_ids"].shape[1])
        assert (groups == groups[:, :1]).all()


def test_continuous_batching_run_is_trls(tiny, tmp_path):
    """transformers' continuous batching refuses `tree_flex`: RLOO's generation hook runs it on the stock attention
    (`sdpa`, what `tree_flex` computes outside a tree) and switches back, so the run is TRL's."""
    from test_grpo_runs import MODES

    tree = _run(TreeRLOOTrainer, tiny, tmp_path, **MODES["continuous_batching"])
    flat = _run(RLOOTrainer, tiny, tmp_path, **MODES["continuous_batching"])
    _assert_same_run(tree, flat, generations=2)
    assert tree[3].model.config._attn_implementation == "tree_flex"


def test_lora_run_is_trls(tiny, tmp_path):
    """A LoRA adapter: the reference forward is the base model (adapters off) on the tree too; only adapters move,
    as in TRL's run."""
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    tree = _run(TreeRLOOTrainer, tiny, tmp_path, peft_config=lora, max_steps=3)
    flat = _run(RLOOTrainer, tiny, tmp_path, peft_config=lora, max_steps=3)
    assert tree[3].ref_model is None  # TRL disables the adapters for the reference forward
    _assert_same_run(tree, flat, generations=3)
    initial = dict(toy_task.build_model(toy_task.build_tokenizer(), seed=0).named_parameters())
    for name, value in tree[2].items():
        base = name.replace("base_model.model.", "").replace(".base_layer", "")
        if "lora_" not in name:
            assert torch.equal(value, initial[base]), f"base weight {name} changed"
    assert any(not torch.equal(value, torch.zeros_like(value)) for n, value in tree[2].items() if "lora_B" in n)


def test_config_and_fallback(tiny, tmp_path):
    """The group trainers' config checks apply, and a model trees cannot run trains on TRL's path with a warning
    (`tree_packing="auto"`), or is an error (`True`)."""
    with pytest.raises(ValueError, match="multiple of 128"):
        _config(TreeRLOOConfig, tmp_path, max_tokens_per_mb=100)
    with pytest.raises(ValueError, match="tree_balance=True, but per_device_train_batch_size=6"):
        _config(
            TreeRLOOConfig, tmp_path, per_device_train_batch_size=6, gradient_accumulation_steps=2, tree_balance=True
        )
    path, tokenizer = tiny
    with pytest.raises(TypeError, match="TreeRLOOTrainer needs a TreeRLOOConfig"):
        TreeRLOOTrainer(path, reward_funcs=token_reward, args=_config(RLOOConfig, tmp_path))
    model = toy_task.build_model(tokenizer, seed=0)
    model.set_attn_implementation("flex_attention")
    args = dict(reward_funcs=token_reward, train_dataset=toy_task.build_dataset(8), processing_class=tokenizer)
    with pytest.raises(ValueError, match="tree_packing=True, but .*'flex_attention'"):
        TreeRLOOTrainer(model, args=_config(TreeRLOOConfig, tmp_path, tree_packing=True, beta=0.0), **args)
    with pytest.warns(UserWarning, match="tree_packing='auto'.*'flex_attention'.*flat path"):
        trainer = TreeRLOOTrainer(model, args=_config(TreeRLOOConfig, tmp_path, beta=0.0), **args)
    assert not trainer.tree_packing and trainer.tree_reason
