"""TreeRewardTrainer against trl.RewardTrainer: one batch's loss, gradients and metrics, whole runs, PEFT, fallbacks.

The oracle is TRL's own reward trainer on the same saved tiny sequence classifier and dataset (pairs sharing a long
system prompt, some prompts with two pairs). On a fixed collated batch the loss (plain, with margins, with
`center_rewards_coefficient`), every parameter gradient and TRL's metrics equal TRL's in fp32; whole runs (TRL's
defaults, gradient checkpointing on; PEFT LoRA with the score head in `modules_to_save`) give TRL's logged values,
evaluation and weights. SGD, as in the SFT and DPO tests.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from datasets import Dataset
from helpers import TOLERANCES, trie_node_count
from peft import LoraConfig
from transformers import AutoModelForSequenceClassification, GPT2Config
from trl import RewardConfig, RewardTrainer

from hf_tree_attn.trainer import TreeRewardConfig, TreeRewardTrainer
from trainers import toy_task

SYSTEM = "you judge answers. rules: short, exact, polite; no digits spelled out.\n"
METRICS = ("loss", "min_reward", "mean_reward", "max_reward", "accuracy", "margin", "num_tokens")
ATOL = TOLERANCES["logps_atol"]


def _pairs(n: int, margins: bool = False) -> list[dict]:
    """Pairs sharing a long system prompt; each prompt appears with two pairs, completions that start alike."""
    rows = []
    for i in range(n):
        prompt = SYSTEM + f"q{i // 2}: what is {i // 2} plus {i // 2}?\na:"
        row = {"prompt": prompt, "chosen": f" {i}.", "rejected": f" {i} or {i + 1}, maybe" + "!" * (i % 3)}
        if margins:
            row["margin"] = 0.25 * (i % 4)
        rows.append(row)
    return rows


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tokenizer = toy_task.build_tokenizer()
    path = tmp_path_factory.mktemp("tiny_reward")
    torch.manual_seed(0)
    config = toy_task.model_config(tokenizer, num_labels=1, initializer_range=0.1)
    AutoModelForSequenceClassification.from_config(copy.deepcopy(config)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), tokenizer


def _trainer(trainer_cls, tiny, tmp_path, model=None, peft_config=None, rows=16, margins=False, eval_rows=0, **kw):
    path, tokenizer = tiny
    config_cls = TreeRewardConfig if trainer_cls is TreeRewardTrainer else RewardConfig
    kwargs = dict(
        output_dir=str(tmp_path / trainer_cls.__name__), use_cpu=True, bf16=False, seed=0,
        per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=2, logging_steps=1,
        learning_rate=0.05, optim="sgd", lr_scheduler_type="constant", report_to="none", save_strategy="no",
        per_device_eval_batch_size=4,
    )  # fmt: skip
    if model is None:
        kwargs["model_init_kwargs"] = {"dtype": torch.float32}
    kwargs.update(kw)
    eval_dataset = Dataset.from_list(_pairs(rows + eval_rows, margins)[rows:]) if eval_rows else None
    return trainer_cls(
        model if model is not None else path, args=config_cls(**kwargs),
        train_dataset=Dataset.from_list(_pairs(rows, margins)), eval_dataset=eval_dataset, processing_class=tokenizer,
        peft_config=peft_config,
    )  # fmt: skip


def _step(trainer, batch, autocast=False):
    """Loss, gradients and metrics of one batch; the forward under the trainer's autocast where it trains with one
    (`bf16=True`: accelerate wraps a prepared model's forward in it)."""
    trainer._metrics["train"].clear()
    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    with trainer.accelerator.autocast() if autocast else torch.enable_grad():
        loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss.detach(), grads, metrics


def _assert_same_step(tree, flat, batch):
    tree_loss, tree_grads, tree_metrics = _step(tree, batch)
    flat_loss, flat_grads, flat_metrics = _step(flat, batch)
    assert math.isclose(tree_loss.item(), flat_loss.item(), abs_tol=ATOL), (tree_loss, flat_loss)
    assert tree_grads.keys() == flat_grads.keys() and tree_grads
    for name, want in flat_grads.items():
        assert (tree_grads[name] - want).abs().max() <= TOLERANCES["grad_max_rel"] * want.abs().max(), name
    assert flat_metrics.keys() <= tree_metrics.keys()
    for key in METRICS[1:]:
        assert math.isclose(tree_metrics[key], flat_metrics[key], rel_tol=1e-5, abs_tol=ATOL), key
    return tree_metrics


@pytest.fixture(scope="module")
def pair(tiny, tmp_path_factory):
    """A tree and a TRL trainer on data with margins, built once, and one collated batch of 6 pairs."""
    tmp = tmp_path_factory.mktemp("reward_pair")
    trainers = [_trainer(cls, tiny, tmp, margins=True) for cls in (TreeRewardTrainer, RewardTrainer)]
    assert trainers[0].tree_packing
    batch = trainers[1].data_collator([trainers[1].train_dataset[i] for i in range(6)])
    return trainers, batch


@pytest.mark.parametrize("case", ["plain", "margin", "center_rewards"])
def test_batch_equals_trl(pair, case):
    (tree, flat), batch = pair
    batch = dict(batch)
    if case != "margin":
        del batch["margin"]
    coefficient = 0.1 if case == "center_rewards" else None
    for trainer in (tree, flat):
        trainer.args.center_rewards_coefficient = coefficient
    metrics = _assert_same_step(tree, flat, batch)
    assert metrics["tree_fallback"] == 0.0
    # Each prompt computed once: the forest holds each distinct token of the batch's rows (per trie) once.
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]
    assert metrics["tree_compute_ratio"] == trie_node_count(rows) / batch["input_ids"].numel() < 0.5


def test_the_prompt_is_computed_once(pair):
    """The forest forwards fewer token rows than TRL's padded batch; its real rows are the batch's distinct
    prefixes, each prompt (shared by two pairs, four rows) once."""
    (tree, flat), batch = pair
    batch = {k: v for k, v in batch.items() if k != "margin"}
    seen = {}
    for name, trainer in (("tree", tree), ("flat", flat)):

        def count(module, args, output, name=name):
            seen[name] = seen.get(name, 0) + args[0].numel()  # returns None: the output stays as it is

        hook = trainer.model.get_input_embeddings().register_forward_hook(count)
        with torch.no_grad():
            trainer.compute_loss(trainer.model, dict(batch))
        hook.remove()
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]
    assert seen["flat"] == batch["input_ids"].numel()
    assert seen["tree"] < seen["flat"] / 2
    assert trie_node_count(rows) < sum(map(len, rows)) - 2 * len(SYSTEM)  # the system prompt alone repeats 5 times


def test_several_forests_per_batch_equal_trl(pair):
    """`max_tokens_per_mb=128`: the batch's tries go into several forests, one backbone forward each."""
    (tree, flat), batch = pair
    calls = []
    hook = tree.model.get_input_embeddings().register_forward_hook(lambda *args: calls.append(1))
    tree.args.max_tokens_per_mb = 128
    try:
        metrics = _assert_same_step(tree, flat, batch)
    finally:
        tree.args.max_tokens_per_mb = None
        hook.remove()
    assert metrics["tree_fallback"] == 0.0 and len(calls) >= 2


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16], ids=["fp32+bf16autocast", "bf16+bf16autocast"])
def test_bf16_is_as_close_to_float32_as_trls(tiny, tmp_path, weights):
    """As TRL trains with `bf16=True` (fp32 or bf16 weights under bf16 autocast), the tree's loss and gradients on a
    batch are as close to TRL's float32 ones as TRL's own under the same precision: within twice its error plus one
    bf16 rounding (tests/test_precision.py says why that bound)."""
    reference = _trainer(RewardTrainer, tiny, tmp_path / "fp32", margins=True)
    batch = reference.data_collator([reference.train_dataset[i] for i in range(6)])
    ref_loss, ref_grads, _ = _step(reference, batch)
    kwargs = dict(bf16=True, model_init_kwargs={"dtype": weights}, margins=True)
    tree, flat = (_trainer(cls, tiny, tmp_path / "bf16", **kwargs) for cls in (TreeRewardTrainer, RewardTrainer))
    assert tree.tree_packing and next(tree.model.parameters()).dtype == weights
    assert tree.accelerator.mixed_precision == "bf16"
    (tree_loss, tree_grads, tree_metrics), (flat_loss, flat_grads, _) = (
        _step(t, batch, autocast=True) for t in (tree, flat)
    )
    u = torch.finfo(torch.bfloat16).eps / 2

    def grad_error(grads):
        diff = sum(float((grads[n].float() - g).square().sum()) for n, g in ref_grads.items())
        return (diff / sum(float(g.square().sum()) for g in ref_grads.values())) ** 0.5

    tree_error, flat_error = float((tree_loss.float() - ref_loss).abs()), float((flat_loss.float() - ref_loss).abs())
    assert tree_error <= 2 * flat_error + u * float(ref_loss.abs()), (tree_error, flat_error)
    assert tree_grads.keys() == ref_grads.keys()
    assert grad_error(tree_grads) <= 2 * grad_error(flat_grads) + u, (grad_error(tree_grads), grad_error(flat_grads))
    assert tree_metrics["tree_fallback"] == 0.0


def _run(trainer):
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    params = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}
    return logs, params


def _assert_same_run(tree, flat):
    (tree_logs, tree_params), (flat_logs, flat_params) = _run(tree), _run(flat)
    assert tree.tree_packing and len(tree_logs) == len(flat_logs) == 2
    for step, (got, want) in enumerate(zip(tree_logs, flat_logs)):
        for key in METRICS:
            assert math.isclose(got[key], want[key], rel_tol=1e-5, abs_tol=ATOL), (step, key)
        assert got["tree_fallback"] == 0.0
    assert flat_logs[0]["loss"] != flat_logs[1]["loss"], "the model did not move"
    for name, want in flat_params.items():
        torch.testing.assert_close(tree_params[name], want, atol=ATOL, rtol=0, msg=name)
    return tree_logs


def test_run_equals_trl(tiny, tmp_path):
    """TRL's defaults (gradient checkpointing on), margins and centred rewards; then an evaluation."""
    options = dict(margins=True, eval_rows=8, center_rewards_coefficient=0.01)
    tree = _trainer(TreeRewardTrainer, tiny, tmp_path, **options)
    flat = _trainer(RewardTrainer, tiny, tmp_path, **options)
    assert tree.args.gradient_checkpointing and tree.model.config._attn_implementation == "tree_flex"
    _assert_same_run(tree, flat)
    got, want = tree.evaluate(), flat.evaluate()
    for key in ("eval_loss", *(f"eval_{k}" for k in METRICS[1:])):
        assert math.isclose(got[key], want[key], rel_tol=1e-5, abs_tol=ATOL), key
    assert got["eval_tree_fallback"] == 0.0


def test_lora_run_equals_trl(tiny, tmp_path):
    """PEFT's sequence-classification task wraps `score` in `modules_to_save`: trained, and exact on trees."""
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS")
    tree = _trainer(TreeRewardTrainer, tiny, tmp_path, peft_config=lora)
    flat = _trainer(RewardTrainer, tiny, tmp_path, peft_config=copy.deepcopy(lora))
    assert type(tree.model.base_model.model.score).__name__ == "ModulesToSaveWrapper"
    _assert_same_run(tree, flat)


def test_a_batch_sharing_too_little_runs_trls_forward(pair):
    (tree, flat), batch = pair
    tree.args.tree_max_token_ratio = 0.05
    try:
        metrics = _assert_same_step(tree, flat, {k: v for k, v in batch.items() if k != "margin"})
    finally:
        tree.args.tree_max_token_ratio = 0.9
    assert metrics["tree_fallback"] == 1.0


def _gpt2(tokenizer):
    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=len(tokenizer), num_labels=1, pad_token_id=0)
    return AutoModelForSequenceClassification.from_config(config)


def test_a_model_outside_the_gate_trains_on_trls_path_with_one_warning(tiny, tmp_path):
    _, tokenizer = tiny
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tree = _trainer(TreeRewardTrainer, tiny, tmp_path, model=_gpt2(tokenizer))
    said = [str(w.message) for w in caught if "TRL's path" in str(w.message)]
    assert len(said) == 1 and "GPT2ForSequenceClassification" in said[0], said
    assert not tree.tree_packing
    flat = _trainer(RewardTrainer, tiny, tmp_path, model=_gpt2(tokenizer))
    batch = flat.data_collator([flat.train_dataset[i] for i in range(4)])
    metrics = _assert_same_step(tree, flat, batch)
    assert "tree_fallback" not in metrics

    with pytest.raises(ValueError, match=r"tree_packing=True, but .*GPT2ForSequenceClassification"):
        _trainer(TreeRewardTrainer, tiny, tmp_path, model=_gpt2(tokenizer), tree_packing=True)


def test_config_refuses_bad_tree_options(tmp_path):
    with pytest.raises(ValueError, match="tree_packing='maybe'"):
        TreeRewardConfig(str(tmp_path), tree_packing="maybe", use_cpu=True)
    with pytest.raises(ValueError, match="max_tokens_per_mb=1024"):
        TreeRewardConfig(str(tmp_path), max_tokens_per_mb=1000, use_cpu=True)
    with pytest.raises(TypeError, match="needs a TreeRewardConfig"):
        TreeRewardTrainer("unused", args=RewardConfig(str(tmp_path), use_cpu=True))
