"""TreeGRPOTrainer against trl.GRPOTrainer's flat computation, on a fixed batch, in fp32.

The oracle is TRL itself: the same tiny model is loaded twice from disk (`tree_flex` for the tree trainer, `sdpa`
for the flat one), both trainers get the same hand-built `inputs` (shared prompts, groups, duplicate and
branching completions, a fully masked completion), and loss and every parameter gradient must agree.
"""

import contextlib
import dataclasses
import hashlib
import inspect
import re
import warnings

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from hf_tree_attn import check_tree_model
from hf_tree_attn.trainer import TreeGRPOConfig, TreeGRPOTrainer
from trainers import toy_task

# Tolerances by device and dtype: the tree and flat forwards are the same math in a different order (on CUDA also
# different kernels: compiled FlexAttention against SDPA, TRL's Triton LM head against its torch fallback).
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5)}
TOLERANCE_CUDA = {torch.float32: dict(atol=1e-4, rtol=1e-4)}
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
NUM_GENERATIONS, COMPLETION_LEN = 4, 6
PREFIX = "rules: answer with the last letter of the request.\n"
PROMPTS = [PREFIX + "id 1. letter: a", PREFIX + "id 22. letter: b"]
# Per prompt, NUM_GENERATIONS completions: (text, ends with eos, completion masked out). Duplicates, shared
# completion prefixes, a truncated one and one fully masked (mask_truncated_completions) on purpose.
COMPLETIONS = [
    ("aaa", True, False),
    ("aabab", False, False),
    ("aaa", True, False),
    ("b", True, False),
    ("bbbbbb", False, False),
    ("ba", True, False),
    ("cccccc", False, True),
    ("bbbbb", True, False),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A saved tiny Qwen3 + char tokenizer: TRL builds the (non-PEFT) reference model from the path."""
    tokenizer = toy_task.build_tokenizer()
    model = toy_task.build_model(tokenizer, seed=0)
    path = tmp_path_factory.mktemp("tiny_qwen3")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), tokenizer


def _config(cls, tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / cls.__name__),
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=len(COMPLETIONS),
        num_generations=NUM_GENERATIONS,
        max_completion_length=COMPLETION_LEN,
        temperature=0.7,  # logits are divided by the sampling temperature on both paths
        report_to="none",
        save_strategy="no",
        model_init_kwargs={"dtype": torch.float32},
    )
    kwargs.update(overrides)
    return cls(**kwargs)


@dataclasses.dataclass
class Evaluated:
    """One `compute_loss` and its backward: the loss `()`, every parameter's gradient (float32), the per-token
    log-probabilities `(B, C)` the loss read (float32) and the loss's gradient with respect to them `(B, C)`."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    logps: torch.Tensor
    logps_grad: torch.Tensor


def evaluate(trainer, inputs) -> Evaluated:
    """`compute_loss(inputs)` and its backward, the forward under the trainer's autocast as accelerate wraps a
    prepared model's forward in `train()` (`bf16=True`: `torch.autocast` to bf16, on the CPU too; otherwise none:
    accelerate's state is shared, so a float32 trainer's accelerator reports the last trainer's precision),
    catching the log-probabilities TRL's loss reads from `_get_per_token_logps_and_entropies` (one call)."""
    assert not trainer.args.bf16 or trainer.accelerator.mixed_precision == "bf16"
    autocast = trainer.accelerator.autocast() if trainer.args.bf16 else contextlib.nullcontext()
    caught, hook = [], trainer._get_per_token_logps_and_entropies

    def catching(*args, **kwargs):
        logps, *rest = hook(*args, **kwargs)
        logps.retain_grad()
        caught.append(logps)
        return (logps, *rest)

    trainer.model.zero_grad(set_to_none=True)
    trainer._get_per_token_logps_and_entropies = catching
    try:
        with autocast:
            loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
    finally:
        del trainer._get_per_token_logps_and_entropies
    (logps,) = caught
    grads = {name: p.grad.float() for name, p in trainer.model.named_parameters() if p.grad is not None}
    return Evaluated(loss.detach().float(), grads, logps.detach().float(), logps.grad.float())


def assert_as_close_to_fp32_as_trl(reference: Evaluated, tree: Evaluated, trl: Evaluated, mask) -> None:
    """Under bf16, the tree against the float32 `reference` as TRL's trainer is, with tests/test_precision.py's bound
    (twice TRL's error plus one bf16 rounding at the values' scale), on the completion tokens of `mask` `(B, C)`:

    - the per-token log-probabilities: largest error at most twice TRL's plus one rounding of the largest one;
    - the loss, which is TRL's code on both sides applied to those log-probabilities: to first order its error is
      theirs weighted by `d loss / d logps`, a signed sum that can cancel by luck on one side and not the other (on
      tests/test_tree_rloo.py's batch TRL's loss can land 20x closer to float32 than the tree's while its
      log-probabilities are no closer). So the bound takes TRL's error without the luck, `sum |d loss / d logps| *
      |TRL's log-prob errors|` (at least its actual loss error to first order), twice, plus one rounding of the loss;
    - the gradients: relative error at most twice TRL's plus one rounding."""
    u = torch.finfo(torch.bfloat16).eps / 2
    mask = mask.bool()
    tree_errors, flat_errors = ((side.logps - reference.logps)[mask].abs() for side in (tree, trl))
    scale = float(reference.logps[mask].abs().max())
    tree_error, flat_error = float(tree_errors.max()), float(flat_errors.max())
    assert tree_error <= 2 * flat_error + u * scale, ("log-probs", tree_error, flat_error)

    flat_unlucky = float((reference.logps_grad[mask].abs() * flat_errors).sum())
    tree_error, flat_error = (float((side.loss - reference.loss).abs()) for side in (tree, trl))
    bound = 2 * max(flat_error, flat_unlucky) + u * float(reference.loss.abs())
    assert tree_error <= bound, ("loss", tree_error, flat_error, flat_unlucky)

    def grad_error(grads):
        diff = sum(float((grads[n] - g).square().sum()) for n, g in reference.grads.items())
        return (diff / sum(float(g.square().sum()) for g in reference.grads.values())) ** 0.5

    assert tree.grads.keys() == reference.grads.keys()
    tree_error, flat_error = grad_error(tree.grads), grad_error(trl.grads)
    assert tree_error <= 2 * flat_error + u, ("gradients", tree_error, flat_error)


def ready_for_loss(trainer):
    """`trainer` as TRL's training step leaves it before `compute_loss`: its model checkpointed (non-reentrant) in
    train mode, one micro-batch per step."""
    model = trainer.model
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.19
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def _pair(tiny, tmp_path, **overrides):
    """(tree trainer, flat trainer) on two loads of the same weights, gradient checkpointing on, train mode."""
    path, tokenizer = tiny
    dataset = toy_task.build_dataset(8)
    trainers = []
    for trainer_cls, config_cls in ((TreeGRPOTrainer, TreeGRPOConfig), (GRPOTrainer, GRPOConfig)):
        fields = config_cls.__dataclass_fields__
        args = _config(config_cls, tmp_path, **{k: v for k, v in overrides.items() if k in fields})
        trainer = trainer_cls(
            path, toy_task.copy_letter_reward, args, train_dataset=dataset, processing_class=tokenizer
        )  # fmt: skip
        trainers.append(ready_for_loss(trainer))
    assert trainers[0].model.config._attn_implementation == "tree_flex"
    assert trainers[1].model.config._attn_implementation == "sdpa"
    return trainers


def _batch(tokenizer, texts=None):
    """TRL's padded layout: left-padded prompts `(B, P)` (each of `texts`, default `PROMPTS` as it is at the call,
    NUM_GENERATIONS times), right-padded completions `(B, C)`."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    texts = PROMPTS if texts is None else texts
    prompts = [tokenizer(p)["input_ids"] for p in texts for _ in range(NUM_GENERATIONS)]
    width = max(map(len, prompts))
    prompt_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    completion_ids = torch.full((len(COMPLETIONS), COMPLETION_LEN), pad)
    completion_mask = torch.zeros_like(completion_ids)
    for b, (text, ends, masked) in enumerate(COMPLETIONS):
        ids = tokenizer(text)["input_ids"] + ([eos] if ends else [])
        completion_ids[b, : len(ids)] = torch.tensor(ids)
        completion_mask[b, : len(ids)] = 0 if masked else 1
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def _inputs(tree, flat, tokenizer, beta, num_iterations, device="cpu"):
    prompt_ids, prompt_mask, completion_ids, completion_mask = (t.to(device) for t in _batch(tokenizer))
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.0, -0.5, 0.3, -0.8, 0.9, -1.2, 0.0, 0.4], device=device),
        "num_items_in_batch": completion_mask.sum(),
    }
    ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    with torch.no_grad():
        current, _, _ = flat._get_per_token_logps_and_entropies(flat.model, ids, mask, COMPLETION_LEN)
    gen = torch.Generator().manual_seed(0)
    noise = lambda scale: scale * torch.randn(current.shape, generator=gen).to(device) * completion_mask  # noqa: E731
    if num_iterations > 1:  # the policy moved since sampling: ratios away from 1, some clipped (epsilon=0.2)
        inputs["old_per_token_logps"] = current + noise(0.3)
    if beta:
        inputs["ref_per_token_logps"] = current + noise(0.1)
    return inputs


def _loss_and_grads(trainer, inputs):
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _assert_same(tree_result, flat_result, tolerance=TOLERANCE[torch.float32]):
    (tree_loss, tree_grads), (flat_loss, flat_grads) = tree_result, flat_result
    torch.testing.assert_close(tree_loss, flat_loss, **tolerance)
    assert tree_grads.keys() == flat_grads.keys() and len(flat_grads) > 0
    for name, grad in flat_grads.items():
        torch.testing.assert_close(tree_grads[name], grad, **tolerance, msg=name)
    assert any(g.abs().max() > 0 for g in flat_grads.values())


def test_loss_types_are_all_of_trls():
    """A TRL upgrade that adds a loss type must add it to the equality test."""
    help_text = GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    supported = re.search(r"Supported values are (.*?)\. ", help_text).group(1)
    assert set(re.findall(r"'(\w+)'", supported)) == set(LOSS_TYPES)


@pytest.mark.parametrize("num_iterations", [1, 2])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_and_grads_match_flat_trainer(tiny, tmp_path, loss_type, beta, num_iterations):
    overrides = dict(loss_type=loss_type, beta=beta, num_iterations=num_iterations)
    if loss_type == "luspo":
        overrides["importance_sampling_level"] = "sequence"  # LUSPO's intended setup (a GSPO variant)
    tree, flat = _pair(tiny, tmp_path, **overrides)
    inputs = _inputs(tree, flat, tiny[1], beta, num_iterations)
    _assert_same(_loss_and_grads(tree, inputs), _loss_and_grads(flat, inputs))
    assert tree._metrics["train"]["tree_fallback"] == [0.0]
    assert tree._metrics["train"]["tree_token_ratio"][0] < 0.6

    if num_iterations > 1:  # second pass over the same micro-batch after an update: the cached forest again
        with torch.no_grad():
            for (_, p_tree), (_, p_flat) in zip(tree.model.named_parameters(), flat.model.named_parameters()):
                step = 1e-2 * torch.sign(p_flat.grad) if p_flat.grad is not None else 0.0
                p_tree.add_(step)
                p_flat.add_(step)
        _assert_same(_loss_and_grads(tree, inputs), _loss_and_grads(flat, inputs))
        assert len(tree._metrics["train"]["tree_token_ratio"]) == 1  # the forest was built once


# TRL's precisions: (weights dtype, `bf16=` i.e. accelerate's bf16 autocast around the forward).
PRECISIONS = {"fp32+bf16autocast": (torch.float32, True), "bf16+bf16autocast": (torch.bfloat16, True)}
PRECISIONS["bf16"] = (torch.bfloat16, False)


@pytest.mark.parametrize("two_level", [True, False], ids=["prefix-kernels", "dense-mask"])
@pytest.mark.parametrize("loss_type, beta, num_iterations", [("dapo", 0.04, 2), ("grpo", 0.0, 1)])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_loss_and_grads_match_flat_trainer_under_mixed_precision(
    tiny, tmp_path, precision, loss_type, beta, num_iterations, two_level
):
    """As TRL trains (`bf16=True`: fp32 or bf16 weights under bf16 autocast; or bf16 weights alone), the tree's
    log-probabilities, loss and gradients are as close to the float32 ones as TRL's flat trainer's under the same
    precision: within twice its error plus one bf16 rounding (see tests/test_precision.py for why that bound, and
    `assert_as_close_to_fp32_as_trl` for the loss). The batch's forest laid out two-level (the shared-prefix kernels)
    or as its trie (the dense mask)."""
    weights, autocast = PRECISIONS[precision]
    overrides = dict(loss_type=loss_type, beta=beta, num_iterations=num_iterations)
    _, reference = _pair(tiny, tmp_path / "fp32", **overrides)
    tree, flat = _pair(tiny, tmp_path, **overrides, bf16=autocast, model_init_kwargs={"dtype": weights})
    assert next(tree.model.parameters()).dtype == weights
    tree._tree_pack.keywords["two_level"] = two_level
    inputs = _inputs(reference, reference, tiny[1], beta, num_iterations)
    ref = evaluate(reference, inputs)
    assert_as_close_to_fp32_as_trl(ref, evaluate(tree, inputs), evaluate(flat, inputs), inputs["completion_mask"])
    assert tree._metrics["train"]["tree_fallback"] == [0.0]
    (forest,) = (scored.forest for scored in next(iter(tree._tree_cache.values())))
    assert (forest.prefix_plan is not None) == two_level


def test_cast_lm_head_to_fp32_runs_the_tree_head_in_float32(tiny, tmp_path, monkeypatch):
    """`cast_lm_head_to_fp32=True` under TRL's `bf16=True` autocast: TRL's fused head takes float32 hidden states with
    autocast off; so does the tree head (it ran in bf16 under the trainer's autocast). The loss then stays within
    the mixed-precision bound of TRL's flat trainer with the same flag (log-probs, loss, gradients)."""
    import hf_tree_attn.logprobs as logprobs

    seen = []
    head = logprobs._head_logprobs

    def spy(hidden, weight, *args, **kwargs):
        out = head(hidden, weight, *args, **kwargs)
        seen.append((kwargs.get("fp32"), torch.is_autocast_enabled("cpu"), out[0].dtype))
        return out

    monkeypatch.setattr(logprobs, "_head_logprobs", spy)
    overrides = dict(loss_type="grpo", beta=0.0, num_iterations=1)
    _, reference = _pair(tiny, tmp_path / "fp32", **overrides)
    tree, flat = _pair(tiny, tmp_path, **overrides, bf16=True, cast_lm_head_to_fp32=True)
    assert tree.model.lm_head.weight.dtype == torch.float32
    inputs = _inputs(reference, reference, tiny[1], 0.0, 1)
    ref = evaluate(reference, inputs)
    seen.clear()
    tree_result, flat_result = evaluate(tree, inputs), evaluate(flat, inputs)
    assert seen and all(fp32 and not autocast for fp32, autocast, _ in seen), seen
    assert_as_close_to_fp32_as_trl(ref, tree_result, flat_result, inputs["completion_mask"])


def test_attention_dropout_trains_on_trls_path(tiny, tmp_path):
    """A model whose attention layers drop out (TRL's `disable_dropout` zeroes `nn.Dropout` modules, not the rate
    the attention layers pass to the kernel) met tree_flex's refusal at its first training forward; it now falls
    back at init with the reason and the way out, and trains on TRL's path."""
    from transformers import AutoModelForCausalLM

    path, tokenizer = tiny
    model = AutoModelForCausalLM.from_pretrained(path, attention_dropout=0.1)
    args = _config(TreeGRPOConfig, tmp_path, max_steps=1, logging_steps=1)
    with pytest.warns(UserWarning, match=r"attention_dropout=0.1.*Load the model with attention_dropout=0.0"):
        trainer = TreeGRPOTrainer(
            model, toy_task.copy_letter_reward, args, train_dataset=toy_task.build_dataset(8),
            processing_class=tokenizer,
        )  # fmt: skip
    assert not trainer.tree_packing and model.config._attn_implementation == "sdpa"
    trainer.train()
    assert trainer.state.log_history[0]["tree_fallback"] == 1


def test_token_budget_with_auto_recompute_is_refused_under_deepspeed_ranks(tiny, tmp_path, monkeypatch):
    """Under DeepSpeed with several processes (`_lockstep`), a rank with fewer forests in a chunk would run its idle
    forwards with every layer checkpointed beside ranks recomputing the agreed count: refused at init, naming both
    ways out; each way out is accepted."""
    monkeypatch.setattr(TreeGRPOTrainer, "_lockstep", lambda self: True)
    path, tokenizer = tiny
    dataset = toy_task.build_dataset(8)

    def build(**overrides):
        args = _config(TreeGRPOConfig, tmp_path, gradient_checkpointing=True, **overrides)
        return TreeGRPOTrainer(
            path, toy_task.copy_letter_reward, args, train_dataset=dataset, processing_class=tokenizer
        )

    with pytest.raises(ValueError, match="max_tokens_per_mb=1024 with tree_recompute='auto' under DeepSpeed"):
        build(max_tokens_per_mb=1024)
    assert build(max_tokens_per_mb=1024, tree_recompute="all").tree_packing
    assert build().tree_packing


@pytest.fixture(scope="module")
def tiny_hybrid(tmp_path_factory):
    """The embedded task's tiny Qwen3.5 (a Gated DeltaNet layer, then full attention) + char tokenizer, saved."""
    tokenizer = toy_task.build_tokenizer()
    model = toy_task.build_model(tokenizer, seed=0, model_type="qwen3_5")
    path = tmp_path_factory.mktemp("tiny_qwen3_5")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), tokenizer


def test_a_hybrid_loaded_with_hub_kernels_trains_on_trees_with_them_off(tiny_hybrid, tmp_path):
    """From transformers 5.25 on `from_pretrained` turns Hugging Face Hub kernels on by default (`use_kernels`), and
    the Trainer's `model.train()` kernelizes the model again on its device (on CUDA transformers maps the Gated
    DeltaNet's `chunk_gated_delta_rule` to fla's Hub kernel, which runs out of the tree's dispatch). The trainer turns
    them off with one warning naming why, as it switches the attention; `check_tree_model` refuses them."""
    from transformers import AutoModelForCausalLM, PreTrainedModel

    if not hasattr(PreTrainedModel, "set_use_kernels"):
        pytest.skip("transformers before 5.25 has no Hub kernels at load")
    path, tokenizer = tiny_hybrid
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="tree_flex")
    assert model.use_kernels  # transformers' default
    with pytest.raises(NotImplementedError, match=r"use_kernels=True.*Load the model with use_kernels=False"):
        check_tree_model(model)
    args = _config(TreeGRPOConfig, tmp_path, max_steps=1, logging_steps=1)
    with pytest.warns(UserWarning, match=r"turned Hugging Face Hub kernels off.*across branches"):
        trainer = TreeGRPOTrainer(
            model, toy_task.copy_letter_reward, args, train_dataset=toy_task.build_dataset(8),
            processing_class=tokenizer,
        )  # fmt: skip
    assert trainer.tree_packing and not model.use_kernels
    check_tree_model(model)
    trainer.train()
    assert not model.use_kernels and trainer.state.log_history[0]["tree_fallback"] == 0


@pytest.mark.parametrize("loss_type, beta, num_iterations", [("dapo", 0.04, 2), ("grpo", 0.0, 1), ("cispo", 0.04, 2)])
def test_hybrid_loss_and_grads_match_flat_trainer(tiny_hybrid, tmp_path, loss_type, beta, num_iterations):
    """Qwen3.5: the recurrent state is forked at the prompt / completion branch points, exactly as TRL's padded flat
    forward (which zeroes the left padding before the Gated DeltaNet) computes each row."""
    tree, flat = _pair(tiny_hybrid, tmp_path, loss_type=loss_type, beta=beta, num_iterations=num_iterations)
    assert type(tree.model).__name__ == "Qwen3_5ForCausalLM"
    inputs = _inputs(tree, flat, tiny_hybrid[1], beta, num_iterations)
    _assert_same(_loss_and_grads(tree, inputs), _loss_and_grads(flat, inputs))
    assert tree._metrics["train"]["tree_fallback"] == [0.0]
    assert tree._metrics["train"]["tree_token_ratio"][0] < 0.6


@pytest.mark.gpu
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "cispo"])
def test_loss_and_grads_match_flat_trainer_on_cuda(tiny, tmp_path, loss_type):
    """The CUDA default path: inductor-compiled decoder layers with a BlockMask and FlexAttention (+ TRL's Triton LM
    head), the reference model's too, against TRL's flat forward (eager)."""
    from torch.nn.attention.flex_attention import BlockMask

    from hf_tree_attn.compile import compiled_layers

    tree, flat = _pair(tiny, tmp_path, loss_type=loss_type, beta=0.04, num_iterations=2, use_cpu=False)
    assert tree.model.device.type == "cuda"
    assert tree.tree_compile.source == "default" and compiled_layers(tree.model) and compiled_layers(tree.ref_model)
    inputs = _inputs(tree, flat, tiny[1], beta=0.04, num_iterations=2, device="cuda")
    _assert_same(_loss_and_grads(tree, inputs), _loss_and_grads(flat, inputs), TOLERANCE_CUDA[torch.float32])
    (entry,) = tree._tree_cache.values()
    forest = entry[0].forest  # the model's causal mask builder asked the forest for its tree BlockMask
    assert any(key[:2] == ("layer", False) and isinstance(m, BlockMask) for key, m in forest._mask_cache.items())
    assert tree._metrics["train"]["tree_fallback"] == [0.0]


def test_entropy_bonus_gradient_matches(tiny, tmp_path):
    """The entropy bonus back-propagates through the tree entropies."""
    tree, flat = _pair(tiny, tmp_path, entropy_coef=0.05)
    inputs = _inputs(tree, flat, tiny[1], beta=0.0, num_iterations=1)
    _assert_same(_loss_and_grads(tree, inputs), _loss_and_grads(flat, inputs))


class _CountingPacker:
    def __init__(self, pack):
        self.pack, self.calls = pack, 0

    def __call__(self, sequences):
        self.calls += 1
        return self.pack(sequences)


def test_old_and_ref_logps_match_flat_and_reuse_the_forests(tiny, tmp_path):
    """TRL's no-grad calls (old policy, reference model) in chunks of `batch_size` rows, as in generation."""
    tree, flat = _pair(tiny, tmp_path, beta=0.04)
    tree._tree_pack = counter = _CountingPacker(tree._tree_pack)
    prompt_ids, prompt_mask, completion_ids, completion_mask = _batch(tiny[1])
    ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    with torch.no_grad():
        for which in ("model", "ref_model", "model"):
            kwargs = dict(batch_size=NUM_GENERATIONS, compute_entropy=which == "model")  # TRL's ref head: logps only
            tree_out = tree._get_per_token_logps_and_entropies(
                getattr(tree, which), ids, mask, COMPLETION_LEN, **kwargs
            )
            flat_out = flat._get_per_token_logps_and_entropies(
                getattr(flat, which), ids, mask, COMPLETION_LEN, **kwargs
            )
            for t, f in zip(tree_out[:2], flat_out[:2]):
                if f is None:
                    assert t is None
                else:
                    torch.testing.assert_close(t, f, **TOLERANCE[torch.float32])
            assert tree_out[2] is None
            assert (tree_out[0][completion_mask == 0] == 0).all()
    assert counter.calls == 2  # two chunks, packed once, reused by the reference and policy forwards
    assert set(tree._metrics["train"]["tree_fallback"]) == {0.0}


def test_fallback_decides_on_tree_tokens_against_flat_padded_tokens(tiny, tmp_path):
    """No sharing and equal lengths: the tree would run as many tokens as flat, so the default falls back; uneven
    lengths pad the flat rows, and the same sequences stay on the tree (padding-free packing)."""
    tree, _ = _pair(tiny, tmp_path)
    assert tree.args.tree_max_token_ratio == 0.9
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 40, (4, 12), generator=gen)
    full = torch.ones_like(ids)
    with torch.no_grad():
        tree._get_per_token_logps_and_entropies(tree.model, ids, full, 6)
        uneven = full.clone()
        uneven[1:, 8:] = 0  # three completions of 2 tokens instead of 6: flat still runs all 4 x 12 positions
        tree._get_per_token_logps_and_entropies(tree.model, ids, uneven, 6)
    metrics = tree._metrics["train"]
    assert metrics["tree_compute_ratio"] == [1.0, 36 / 48]
    assert metrics["tree_fallback"] == [1.0, 0.0]


def test_little_sharing_falls_back_to_the_flat_path(tiny, tmp_path):
    tree, flat = _pair(tiny, tmp_path, tree_max_token_ratio=0.05)
    inputs = _inputs(tree, flat, tiny[1], beta=0.0, num_iterations=1)
    _assert_same(_loss_and_grads(tree, inputs), _loss_and_grads(flat, inputs))
    assert tree._metrics["train"]["tree_fallback"] == [1.0]


def test_training_keeps_groups_together_and_builds_each_forest_once(tiny, tmp_path):
    """Through TRL's real loop: old + ref + 2 policy passes per micro-batch hit one forest; groups stay whole."""
    path, tokenizer = tiny
    args = _config(
        TreeGRPOConfig, tmp_path, beta=0.04, num_iterations=2, gradient_accumulation_steps=2,
        max_completion_length=4, max_steps=2, logging_steps=1, learning_rate=1e-3,
    )  # fmt: skip
    trainer = TreeGRPOTrainer(
        path, toy_task.copy_letter_reward, args, train_dataset=toy_task.build_dataset(64), processing_class=tokenizer
    )
    trainer._tree_pack = counter = _CountingPacker(trainer._tree_pack)
    trainer.train()
    # 2 optimizer steps x 2 accumulation = 4 micro-steps = one generation (steps_per_generation=2, 2 iterations).
    assert counter.calls == args.steps_per_generation == 2
    for micro_batch in trainer._buffered_inputs:
        groups = micro_batch["prompt_ids"].view(-1, NUM_GENERATIONS, micro_batch["prompt_ids"].shape[1])
        assert (groups == groups[:, :1]).all()
    logs = [entry for entry in trainer.state.log_history if "tree_token_ratio" in entry]
    assert logs and all(entry["tree_token_ratio"] < 0.6 and entry["tree_fallback"] == 0 for entry in logs)
    assert all("tree_flops_saved" in entry and "reward" in entry for entry in logs)


def test_overridden_hooks_are_pinned_to_trl():
    """Fail loudly on a TRL upgrade: same parameters, and `_prepare_inputs` (whose body we mirror) unchanged."""

    def params(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    for name in ("_get_per_token_logps_and_entropies", "_prepare_inputs"):
        assert params(getattr(TreeGRPOTrainer, name)) == params(getattr(GRPOTrainer, name)), name
    source = inspect.getsource(GRPOTrainer._prepare_inputs)
    assert hashlib.sha256(source.encode()).hexdigest()[:16] == "f824e7fb07147956", (
        "trl.GRPOTrainer._prepare_inputs changed: re-sync TreeGRPOTrainer._prepare_inputs with it, then update "
        "this hash."
    )


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        (dict(max_tokens_per_mb=100), ValueError, "multiple of 128"),
        (dict(max_tokens_per_mb=256, max_completion_length=256), ValueError, "cannot hold one sequence"),
        (dict(tree_max_token_ratio=1.5), ValueError, "tree_max_token_ratio=1.5"),
        (dict(max_tokens_per_mb="256"), TypeError, r"max_tokens_per_mb='256' is a str; pass an int"),
        (dict(temperature=0.0), ValueError, r"temperature=0.0: .*must be a finite number > 0"),
        (dict(temperature=-0.5), ValueError, r"temperature=-0.5"),
        (dict(tree_activation_budget_gib=0), ValueError, r"tree_activation_budget_gib=0 must be a number of GiB > 0"),
        (dict(tree_activation_budget_gib="40"), ValueError, r"tree_activation_budget_gib='40' must be a number"),
        (dict(tree_activation_budget_gib=40, tree_recompute="all"), ValueError, r"set tree_recompute='auto'"),
    ],
)
def test_bad_config_fails_with_the_value(tmp_path, overrides, error, match):
    with pytest.raises(error, match=match):
        _config(TreeGRPOConfig, tmp_path, **overrides)


def test_fsdp_activation_checkpointing_conflict_is_flagged(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "true")
    with pytest.raises(ValueError, match="--gradient_checkpointing false"):
        _config(TreeGRPOConfig, tmp_path, gradient_checkpointing=True)


def _tree_trainer(model, tmp_path, tokenizer, rollout_func=None, **overrides):
    args = _config(TreeGRPOConfig, tmp_path, **overrides)
    dataset = toy_task.build_dataset(8)
    return TreeGRPOTrainer(
        model, toy_task.copy_letter_reward, args, train_dataset=dataset, processing_class=tokenizer,
        rollout_func=rollout_func,
    )  # fmt: skip


def test_split_groups_are_warned_about_with_the_fix(tiny, tmp_path):
    with pytest.warns(UserWarning, match=r"per_device_train_batch_size=6 is not a multiple of num_generations=4"):
        _tree_trainer(tiny[0], tmp_path, tiny[1], per_device_train_batch_size=6, gradient_accumulation_steps=2)


def test_budget_too_small_for_the_prompts_fails_at_start(tiny, tmp_path):
    with pytest.raises(ValueError, match=r"max_tokens_per_mb=256 cannot hold one sequence.*max_tokens_per_mb=384"):
        _tree_trainer(tiny[0], tmp_path, tiny[1], max_tokens_per_mb=256)


def test_attention_implementation_is_selected_or_refused(tiny, tmp_path):
    path, tokenizer = tiny
    with pytest.raises(ValueError, match="tree_packing=True.*attn_implementation.*'sdpa'.*needs 'tree_flex'"):
        _tree_trainer(
            path, tmp_path, tokenizer, model_init_kwargs={"attn_implementation": "sdpa"}, tree_packing=True
        )  # fmt: skip
    model = toy_task.build_model(tokenizer)
    model.set_attn_implementation("eager")
    assert _tree_trainer(model, tmp_path, tokenizer).model.config._attn_implementation == "tree_flex"
    model.set_attn_implementation("flex_attention")
    with pytest.raises(ValueError, match="'flex_attention'"):
        _tree_trainer(model, tmp_path, tokenizer, tree_packing=True)
    with pytest.warns(UserWarning, match="tree_packing='auto'.*'flex_attention'.*flat path"):
        trainer = _tree_trainer(model, tmp_path, tokenizer)
    assert not trainer.tree_packing and model.config._attn_implementation == "flex_attention"
    with pytest.raises(TypeError, match="TreeGRPOConfig"):
        TreeGRPOTrainer(path, toy_task.copy_letter_reward, _config(GRPOConfig, tmp_path))


@pytest.mark.parametrize(
    "prompt_ids, completion_ids, match",
    [
        ([[5, 6], [5, 6]], [[7], []], r"returned an empty completion for sample 1 .*Return the EOS token"),
        ([[5, 6], []], [[7], [8]], r"rollout_func returned an empty prompt for sample 1 .*at least one token"),
    ],
    ids=["empty-completion", "empty-prompt"],
)
def test_empty_rollouts_are_refused_naming_the_sample(tiny, tmp_path, prompt_ids, completion_ids, match):
    """A `rollout_func` that returns an empty completion (TRL: IndexError in its metrics) or an empty prompt (TRL:
    the first completion token scored from a padding position) is stopped with the sample and the fix."""
    calls = []

    def rollout_func(prompts, trainer):
        calls.append(prompts)
        logprobs = [[0.0] * len(c) for c in completion_ids]
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}

    path, tokenizer = tiny
    trainer = _tree_trainer(path, tmp_path, tokenizer, rollout_func=rollout_func)
    with pytest.raises(ValueError, match=match):
        trainer._generate(["a", "b"])
    assert calls == [["a", "b"]] and trainer.rollout_func.__wrapped__ is rollout_func


@pytest.mark.parametrize(
    "config_field, init_kwargs, expected",
    [(True, {}, True), (False, {}, False), (False, {"trust_remote_code": True}, True)],
)
def test_trust_remote_code_reaches_the_config_check(tiny, tmp_path, monkeypatch, config_field, init_kwargs, expected):
    """The gate reads a model path's config as TRL then loads it: `trust_remote_code` from `model_init_kwargs`, else
    `GRPOConfig.trust_remote_code` (a remote-code model refused its config before TRL could load it)."""
    from hf_tree_attn.trainer import core

    seen = {}
    real = core.AutoConfig.from_pretrained

    def from_pretrained(path, **kwargs):
        seen.update(kwargs)
        return real(path, **{k: v for k, v in kwargs.items() if k != "trust_remote_code"})

    monkeypatch.setattr(core.AutoConfig, "from_pretrained", from_pretrained)
    args = _config(TreeGRPOConfig, tmp_path, trust_remote_code=config_field, model_init_kwargs=init_kwargs)
    core.select_tree_attention(tiny[0], args)
    assert seen["trust_remote_code"] is expected


def _tiny_family_model(model_type: str, tokenizer):
    """A tiny model of `model_type` (the coverage matrix's config: windows, sinks, MoE switched on) for the toy
    tokenizer."""
    from test_coverage import tiny_config
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    assert config.get_text_config().vocab_size >= len(tokenizer)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def test_unsupported_model_falls_back_with_one_warning_or_fails_when_trees_are_required(tmp_path):
    """tree_packing='auto' on a model trees cannot run (Jamba's Mamba-1 layers): TRL's flat path, one warning
    naming the reason, tree_fallback logged; tree_packing=True: an error at init."""
    tokenizer = toy_task.build_tokenizer()
    model = _tiny_family_model("jamba", tokenizer)
    with pytest.raises(ValueError, match=r"tree_packing=True, but .*'jamba'.*carry state"):
        _tree_trainer(model, tmp_path, tokenizer, tree_packing=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _tree_trainer(model, tmp_path, tokenizer)
    reasons = [str(w.message) for w in caught if "tree_packing='auto'" in str(w.message)]
    assert len(reasons) == 1 and "Mamba" in reasons[0], reasons
    assert not trainer.tree_packing and trainer.model.config._attn_implementation == "sdpa"
    prompt_ids, prompt_mask, completion_ids, completion_mask = _batch(tokenizer)
    ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    with torch.no_grad():
        got = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, COMPLETION_LEN)
        want = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, mask, COMPLETION_LEN)
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)
    assert trainer._metrics["train"]["tree_fallback"] == [1.0]


@pytest.mark.slow
@pytest.mark.parametrize("model_type, on_tree", [("gpt_oss", True), ("nemotron_h", True)])
def test_trl_matrix_models_train_a_step(tmp_path, model_type, on_tree):
    """Two models of TRL's own test matrix that used to break run on trees: GPT-OSS (attention sinks; generation
    included) and Nemotron-H (Mamba-2 layers, segment by segment). A model trees cannot run falls back instead of
    crashing: `test_unsupported_model_falls_back_with_one_warning_or_fails_when_trees_are_required`."""
    tokenizer = toy_task.build_tokenizer()
    model = _tiny_family_model(model_type, tokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = _tree_trainer(
            model, tmp_path, tokenizer, max_steps=1, per_device_train_batch_size=NUM_GENERATIONS, logging_steps=1,
            gradient_checkpointing=False,
        )  # fmt: skip
        trainer.train()
    assert trainer.tree_packing is on_tree
    assert set(trainer.state.log_history[0].get(k) for k in ["tree_fallback"]) == {0.0 if on_tree else 1.0}


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """A saved tiny Qwen3-MoE (router aux-loss coefficient 0.01) + the char tokenizer."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    tokenizer = toy_task.build_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        router_aux_loss_coef=0.01, initializer_range=0.2, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_qwen3_moe")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), tokenizer


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_moe_aux_loss_matches_flat_trainer_on_the_tree(tiny_moe, tmp_path, beta):
    """TRL turns the router load-balancing loss on for MoE policies; the tree computes it (each shared token routed
    once, weighted by its sequences) and loss, gradients and the logged aux_loss equal TRL's, with no fallback."""
    tree, flat = _pair(tiny_moe, tmp_path, beta=beta)
    assert tree.aux_loss_enabled and flat.aux_loss_enabled
    inputs = _inputs(tree, flat, tiny_moe[1], beta, num_iterations=1)
    _assert_same(_loss_and_grads(tree, inputs), _loss_and_grads(flat, inputs))
    torch.testing.assert_close(
        torch.tensor(tree._metrics["train"]["aux_loss"]), torch.tensor(flat._metrics["train"]["aux_loss"]),
        atol=1e-6, rtol=1e-6,
    )  # fmt: skip
    assert tree._metrics["train"]["tree_fallback"] == [0.0]


def test_tree_balance_true_refuses_the_moe_aux_loss(tiny_moe, tmp_path):
    """TRL adds the router load-balancing loss per micro-batch, from its router statistics: moving groups between
    ranks would change it, so `tree_balance=True` is refused for an MoE policy (and "auto" leaves it off)."""
    path, tokenizer = tiny_moe
    args = _config(TreeGRPOConfig, tmp_path, tree_balance=True)
    with pytest.raises(ValueError, match=r"tree_balance=True, but the MoE load-balancing loss \(router_aux_loss_coef"):
        TreeGRPOTrainer(path, toy_task.copy_letter_reward, args, train_dataset=toy_task.build_dataset(8),
                        processing_class=tokenizer)  # fmt: skip


@pytest.mark.parametrize("value, parsed", [("auto", "auto"), ("true", True), ("false", False), ("False", False)])
def test_tree_packing_from_the_command_line(tmp_path, value, parsed):
    from trl import TrlParser

    (args,) = TrlParser((TreeGRPOConfig,)).parse_args_and_config(
        ["--output_dir", str(tmp_path), "--tree_packing", value, "--report_to", "none", "--use_cpu", "--bf16", "false"]
    )
    assert args.tree_packing == parsed
    with pytest.raises(ValueError, match=r"tree_packing='maybe'.*'auto'"):
        _config(TreeGRPOConfig, tmp_path, tree_packing="maybe")
