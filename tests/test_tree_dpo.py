"""TreeDPOTrainer against trl.DPOTrainer: every loss type on one batch, and whole runs with a reference and PEFT.

The oracle is TRL's own DPO trainer on the same saved tiny model and dataset. On a fixed collated batch, each loss
type (and the options that read per-token values: WPO weighting, `ld_alpha`, the f-divergences, the SFT term)
gives TRL's loss, gradients and metrics; whole runs (a reference model TRL builds, PEFT with the adapters off as
the reference, precomputed reference log-probabilities) give TRL's logged values and weights. SGD, as in the SFT
tests.
"""

from __future__ import annotations

import logging
import math
import re
import warnings

import pytest
import torch
from datasets import Dataset
from helpers import TOLERANCES
from peft import LoraConfig
from trl import DPOConfig, DPOTrainer

from hf_tree_attn.trainer import TreeDPOConfig, TreeDPOTrainer
from hf_tree_attn.trainer import fused_head as fused_head_module
from trainers import toy_task

SYSTEM = "you judge answers. rules: short, exact, polite; no digits spelled out.\n"
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
           "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy")  # fmt: skip


def _pairs(n: int) -> list[dict]:
    """Pairs sharing a long system prompt; some prompts appear with two pairs, completions that start alike."""
    rows = []
    for i in range(n):
        prompt = SYSTEM + f"q{i // 2}: what is {i // 2} plus {i // 2}?\na:"
        rows.append({"prompt": prompt, "chosen": f" {i}.", "rejected": f" {i} or {i + 1}, maybe" + "!" * (i % 3)})
    return rows


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tokenizer = toy_task.build_tokenizer()
    path = tmp_path_factory.mktemp("tiny_qwen3")
    toy_task.build_model(tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), tokenizer


def _trainer(trainer_cls, tiny, tmp_path, peft_config=None, rows=16, **overrides):
    path, tokenizer = tiny
    config_cls = TreeDPOConfig if trainer_cls is TreeDPOTrainer else DPOConfig
    kwargs = dict(
        output_dir=str(tmp_path / trainer_cls.__name__), use_cpu=True, bf16=False, seed=0,
        per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=2, logging_steps=1,
        learning_rate=0.05, optim="sgd", lr_scheduler_type="constant", report_to="none", save_strategy="no",
        model_init_kwargs={"dtype": torch.float32}, max_length=None, beta=0.5,
    )  # fmt: skip
    kwargs.update(overrides)
    dataset = Dataset.from_list(_pairs(rows))
    return trainer_cls(
        path, args=config_cls(**kwargs), train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config
    )


# ----------------------------------------------------------------------------------------------------------------
# Every loss type on one batch: loss, gradients and metrics.

LOSSES = {
    "sigmoid": dict(loss_types=["sigmoid"]),
    "hinge": dict(loss_types=["hinge"]),
    "ipo": dict(loss_types=["ipo"]),
    "exo_pair": dict(loss_types=["exo_pair"], label_smoothing=0.1),
    "nca_pair": dict(loss_types=["nca_pair"]),
    "robust": dict(loss_types=["robust"], label_smoothing=0.2),
    "bco_pair": dict(loss_types=["bco_pair"]),
    "sppo_hard": dict(loss_types=["sppo_hard"]),
    "aot": dict(loss_types=["aot"]),
    "aot_unpaired": dict(loss_types=["aot_unpaired"]),
    "apo_zero": dict(loss_types=["apo_zero"]),
    "apo_down": dict(loss_types=["apo_down"]),
    "discopop": dict(loss_types=["discopop"]),
    "sigmoid_norm": dict(loss_types=["sigmoid_norm"]),
    "sigmoid+sft (RPO mix)": dict(loss_types=["sigmoid", "sft"], loss_weights=[1.0, 0.5]),
    "wpo weighting": dict(loss_types=["sigmoid"], use_weighting=True),
    "ld_alpha": dict(loss_types=["sigmoid"], ld_alpha=0.3),
    "alpha divergence": dict(
        loss_types=["sigmoid"], f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.5
    ),
    "js divergence": dict(loss_types=["hinge"], f_divergence_type="js_divergence"),
}
_DEFAULTS = dict(loss_weights=None, label_smoothing=0.0, use_weighting=False, ld_alpha=None,
                 f_divergence_type="reverse_kl", f_alpha_divergence_coef=1.0)  # fmt: skip


@pytest.fixture(scope="module")
def pair(tiny, tmp_path_factory):
    """A tree and a TRL trainer (each with its reference model), built once; WPO's extra kernel output on."""
    tmp = tmp_path_factory.mktemp("dpo_pair")
    trainers = [_trainer(cls, tiny, tmp, use_weighting=True) for cls in (TreeDPOTrainer, DPOTrainer)]
    batch = trainers[1].data_collator([trainers[1].train_dataset[i] for i in range(6)])
    return trainers, batch


def _step(trainer, batch, settings):
    for name, value in {**_DEFAULTS, **settings}.items():
        setattr(trainer, name, value)
    trainer.loss_weights = trainer.loss_weights or [1.0] * len(trainer.loss_types)
    trainer._metrics["train"].clear()
    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss.detach(), grads, metrics


@pytest.mark.parametrize("case", LOSSES)
def test_loss_type_equals_trl(pair, case):
    (tree, flat), batch = pair
    tree_loss, tree_grads, tree_metrics = _step(tree, batch, LOSSES[case])
    flat_loss, flat_grads, flat_metrics = _step(flat, batch, LOSSES[case])
    atol = TOLERANCES["logps_atol"]
    assert math.isclose(tree_loss.item(), flat_loss.item(), abs_tol=atol), (tree_loss, flat_loss)
    assert tree_grads.keys() == flat_grads.keys()
    for name, want in flat_grads.items():
        assert (tree_grads[name] - want).abs().max() <= TOLERANCES["grad_max_rel"] * want.abs().max(), name
    for key in METRICS[1:]:
        assert math.isclose(tree_metrics[key], flat_metrics[key], rel_tol=1e-5, abs_tol=atol), key
    # Both forwards (policy, reference) ran on the tree, the second from the first's packing.
    assert tree_metrics["tree_fallback"] == 0.0 and tree_metrics["tree_token_ratio"] < 0.6


# ----------------------------------------------------------------------------------------------------------------
# Whole runs.


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
            assert math.isclose(got[key], want[key], rel_tol=1e-5, abs_tol=TOLERANCES["logps_atol"]), (step, key)
        assert got["tree_fallback"] == 0.0
    assert any(abs(entry["rewards/margins"]) > 1e-3 for entry in flat_logs), "the policy did not move"
    for name, want in flat_params.items():
        torch.testing.assert_close(tree_params[name], want, atol=TOLERANCES["logps_atol"], rtol=0, msg=name)


def test_run_with_reference_model_equals_trl(tiny, tmp_path, monkeypatch):
    tree = _trainer(TreeDPOTrainer, tiny, tmp_path)
    flat = _trainer(DPOTrainer, tiny, tmp_path)
    assert tree.ref_model.config._attn_implementation == "tree_flex"  # TRL builds it like the policy
    plans = []
    plan = fused_head_module.plan_fused_batch
    monkeypatch.setattr(fused_head_module, "plan_fused_batch", lambda *a, **k: plans.append(1) or plan(*a, **k))
    _assert_same_run(tree, flat)
    assert len(plans) == 4  # 2 steps x 2 micro-batches: the reference forward reuses the policy forward's packing


def test_lora_run_equals_trl(tiny, tmp_path):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    tree = _trainer(TreeDPOTrainer, tiny, tmp_path, lora, loss_type=["ipo"])
    flat = _trainer(DPOTrainer, tiny, tmp_path, lora, loss_type=["ipo"])
    assert tree.ref_model is None  # the reference is the policy with its adapters off
    _assert_same_run(tree, flat)


def test_precomputed_reference_equals_trl(tiny, tmp_path, caplog):
    """TRL's precompute (inside its `__init__`) runs on trees, said in one INFO record, its tree metrics kept out of
    the logged averages; the oracle is TRL's reference forward, uncached."""
    with caplog.at_level(logging.INFO, logger="hf_tree_attn.trainer.dpo_trainer"):
        tree = _trainer(TreeDPOTrainer, tiny, tmp_path, rows=8, precompute_ref_log_probs=True)
    flat = _trainer(DPOTrainer, tiny, tmp_path, rows=8)
    batch = flat.data_collator([flat.train_dataset[i] for i in range(8)])
    want = flat.compute_ref_log_probs(flat.ref_model, batch)
    for column, expected in zip(("ref_chosen_logps", "ref_rejected_logps"), want):
        got = torch.tensor(tree.train_dataset[column])
        torch.testing.assert_close(got, expected, atol=TOLERANCES["logps_atol"], rtol=0)
    said = [r.getMessage() for r in caplog.records if "precomputed" in r.getMessage()]
    assert said and all(re.search(r": (\d+) of \1 batches on trees", m) for m in said), said
    assert not any(k.startswith("tree_") and v for m in tree._metrics.values() for k, v in m.items())


# ----------------------------------------------------------------------------------------------------------------
# A separate reference model under TRL's mixed precision.


def _ref_logps(trainer, batch) -> torch.Tensor:
    """`(2 * pairs,)` float: TRL's reference log-probabilities of the batch, chosen then rejected."""
    return torch.cat(trainer.compute_ref_log_probs(trainer.ref_model, dict(batch))).float()


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16], ids=["fp32-weights", "bf16-weights"])
def test_reference_model_under_mixed_precision_runs_on_trees(tiny, tmp_path, weights):
    """TRL's `bf16=True` (autocast) with a separate reference model, fp32 or bf16 weights. Accelerate wraps the
    reference's forward (autocast, outputs to float32) inside TRL's `__init__`, before the tree head is installed;
    the tree head goes inside those wrappers. So the reference runs on trees, with autocast on and float32 outputs
    even when called outside the trainer's autocast, as TRL's; its log-probabilities, and a two-step run's logged
    values and weights, are as close to the float32 run's as TRL's own under the same precision: within twice its
    error plus one bf16 rounding at the values' scale (see tests/test_precision.py for why that bound)."""
    mixed = dict(bf16=True, model_init_kwargs={"dtype": weights})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tree = _trainer(TreeDPOTrainer, tiny, tmp_path / "tree", **mixed)
    assert not [str(w.message) for w in caught if "TRL's path" in str(w.message)]
    assert tree.tree_packing and tree.ref_model is not None
    flat = _trainer(DPOTrainer, tiny, tmp_path / "flat", **mixed)
    reference = _trainer(DPOTrainer, tiny, tmp_path / "fp32")
    assert next(tree.ref_model.parameters()).dtype == weights
    u = torch.finfo(torch.bfloat16).eps / 2

    def bound(got, flat_value, want, scale=None):
        """max |got - want| <= 2 max |flat - want| + u * scale, `scale` the size of the values rounded (default
        max |want|)."""
        got, flat_value, want = (torch.as_tensor(t, dtype=torch.float64) for t in (got, flat_value, want))
        tree_error, flat_error = (got - want).abs().max(), (flat_value - want).abs().max()
        scale = want.abs().max() if scale is None else scale
        return tree_error <= 2 * flat_error + u * scale, (float(tree_error), float(flat_error))

    # The reference forward on one batch, under the trainer's autocast as TRL calls it.
    batch = flat.data_collator([flat.train_dataset[i] for i in range(8)])
    for metrics in tree._metrics.values():
        metrics.clear()
    want, got, flat_logps = (_ref_logps(t, batch) for t in (reference, tree, flat))
    assert [v for m in tree._metrics.values() for v in m["tree_fallback"]] == [0.0]
    assert not torch.equal(flat_logps, want)  # the precision did change TRL's numbers
    ok, errors = bound(got, flat_logps, want)
    assert ok, errors

    # Called directly, outside any autocast: accelerate's wrappers still run autocast and convert the outputs.
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    inputs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    seen = {}
    for name, trainer in (("tree", tree), ("flat", flat)):

        def record(module, args, name=name):
            seen[name] = torch.is_autocast_enabled("cpu")  # returns None: the decoder's inputs stay as they are

        hook = trainer.ref_model.get_decoder().register_forward_pre_hook(record)
        with torch.no_grad():
            out = trainer.ref_model(**inputs, labels=labels, fused_lm_head=True)
        hook.remove()
        seen[name] = (seen[name], out.log_probs.dtype)
    assert seen["tree"] == seen["flat"] == (True, torch.float32), seen

    # Two steps: every logged value and the trained weights. A reward is beta times the difference of a policy and
    # a reference log-probability, each rounded at its own size (about the logged logps'), so its rounding term is
    # at that size, not at the (cancelled) reward's; the margin sums the two rewards, and the loss, -logsigmoid of
    # the margin, moves by at most as much as the margin does.
    (tree_logs, tree_params), (flat_logs, flat_params), (want_logs, want_params) = (
        _run(t) for t in (tree, flat, reference)
    )
    assert len(tree_logs) == len(flat_logs) == len(want_logs) == 2
    beta = tree.args.beta
    for step, (got_log, flat_log, want_log) in enumerate(zip(tree_logs, flat_logs, want_logs)):
        assert got_log["tree_fallback"] == 0.0, step
        chosen, rejected = (2 * beta * abs(want_log[f"logps/{side}"]) for side in ("chosen", "rejected"))
        scales = {"rewards/chosen": chosen, "rewards/rejected": rejected, "rewards/margins": chosen + rejected}
        scales["loss"] = scales["rewards/margins"]
        for key in METRICS:
            ok, errors = bound(got_log[key], flat_log[key], want_log[key], scales.get(key))
            assert ok, (step, key, errors)
    # At the first step the policy is the reference: TRL's run scores both alike, rewards exactly 0; so must the tree.
    assert [tree_logs[0][f"rewards/{side}"] for side in ("chosen", "rejected")] == [0.0, 0.0]
    assert [flat_logs[0][f"rewards/{side}"] for side in ("chosen", "rejected")] == [0.0, 0.0]
    for name, want_param in want_params.items():
        ok, errors = bound(tree_params[name].float(), flat_params[name].float(), want_param)
        assert ok, (name, errors)


def test_an_earlier_trainers_flash_default_is_undone_at_init(tiny, tmp_path, monkeypatch):
    """Tree attention's FLASH default (FlashAttention-4 on CUDA) is process-wide: a tree trainer built after one that
    turned it on decides for itself at init, here on CPU where nothing is compiled, and leaves it off."""
    from hf_tree_attn import attention
    from hf_tree_attn.trainer import compile_setting

    earlier = {"BACKEND": "FLASH"}  # what an earlier trainer's default set
    monkeypatch.setattr(attention, "FLEX_KERNEL_OPTIONS", earlier)
    monkeypatch.setattr(compile_setting, "_FLASH_BY_DEFAULT", earlier)
    _trainer(TreeDPOTrainer, tiny, tmp_path)
    assert attention.FLEX_KERNEL_OPTIONS is None
