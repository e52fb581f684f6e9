"""TreeSFTTrainer against trl.SFTTrainer: the same run, on shared system prompts and per-turn agent samples.

Each test trains the tree trainer and TRL's trainer from the same saved tiny model on the same dataset (TRL prepares
both: conversational, prompt-completion, chat template, packing) and compares every logged loss and metric and the
final weights. The optimizer is SGD (Adam would turn a last-bit difference in a near-zero gradient into a full-size
step), two accumulated micro-batches per step so the token-level normalisation spans micro-batches.
"""

from __future__ import annotations

import inspect
import math
import random

import pytest
import torch
from datasets import Dataset
from helpers import TOLERANCES
from peft import LoraConfig
from transformers import AutoModelForCausalLM, BloomConfig
from trl import SFTConfig, SFTTrainer

from hf_tree_attn.trainer import TreeSFTConfig, TreeSFTTrainer
from trainers import toy_task

# A chat template for the character tokenizer, with the generation markers `assistant_only_loss` needs.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ 'a: ' }}{% generation %}"
    "{{ m['content'] + eos_token }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ m['role'][0] + ': ' + m['content'] + '\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'a: ' }}{% endif %}"
)
SYSTEM = "you are a terse agent. tools: calc(x), look(k). answer in one line; cite the tool you used.\n"
LOGGED = ("loss", "entropy", "mean_token_accuracy", "num_tokens")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tokenizer = toy_task.build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    path = tmp_path_factory.mktemp("tiny_qwen3")
    toy_task.build_model(tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), tokenizer


def _conversations(n: int, seed: int = 0) -> list[list[dict]]:
    """Agent conversations: the shared system prompt, then user / assistant turns."""
    rng = random.Random(seed)
    out = []
    for c in range(n):
        messages = [{"role": "system", "content": SYSTEM}]
        for t in range(rng.randint(2, 3)):
            messages.append({"role": "user", "content": f"q{c}.{t}: {rng.randint(1, 99)} plus {rng.randint(1, 9)}?"})
            messages.append({"role": "assistant", "content": f"calc: {rng.randint(2, 108)}" + "." * rng.randint(0, 3)})
        out.append(messages)
    return out


def _per_turn(conversations) -> list[dict]:
    """One prompt-completion sample per assistant turn, each prompt the whole history before it."""
    samples = []
    for messages in conversations:
        for t, message in enumerate(messages):
            if message["role"] == "assistant":
                samples.append({"prompt": messages[:t], "completion": [message]})
    return samples


def _run(trainer_cls, tiny, tmp_path, dataset, peft_config=None, **overrides):
    path, tokenizer = tiny
    config_cls = TreeSFTConfig if trainer_cls is TreeSFTTrainer else SFTConfig
    kwargs = dict(
        output_dir=str(tmp_path / trainer_cls.__name__), use_cpu=True, bf16=False, seed=0,
        per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=2, logging_steps=1,
        learning_rate=0.05, optim="sgd", lr_scheduler_type="constant", report_to="none", save_strategy="no",
        model_init_kwargs={"dtype": torch.float32}, max_length=None,
    )  # fmt: skip
    kwargs.update(overrides)
    trainer = trainer_cls(
        path, args=config_cls(**kwargs), train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    params = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}
    return trainer, logs, params


def _assert_same_run(tiny, tmp_path, dataset, peft_config=None, max_ratio=0.9, **overrides):
    tree, tree_logs, tree_params = _run(TreeSFTTrainer, tiny, tmp_path, dataset, peft_config, **overrides)
    flat, flat_logs, flat_params = _run(SFTTrainer, tiny, tmp_path, dataset, peft_config, **overrides)
    assert tree.tree_packing and tree.model.config._attn_implementation == "tree_flex"
    assert len(tree_logs) == len(flat_logs) == overrides.get("max_steps", 2)
    for step, (got, want) in enumerate(zip(tree_logs, flat_logs)):
        for key in LOGGED:
            if key == "num_tokens" and not math.isclose(got[key], want[key]):
                pytest.fail(f"step {step}: {key} {got[key]} vs {want[key]}")
            assert math.isclose(got[key], want[key], abs_tol=TOLERANCES["logps_atol"]), f"step {step}: {key}"
        assert got["tree_fallback"] == 0.0 and got["tree_token_ratio"] < max_ratio
    for name, want in flat_params.items():
        torch.testing.assert_close(tree_params[name], want, atol=TOLERANCES["logps_atol"], rtol=0, msg=name)
    initial = AutoModelForCausalLM.from_pretrained(tiny[0]).state_dict()
    # A trained weight moved from where it started: a base weight from the checkpoint, a LoRA B from zero (PEFT's
    # default init; LoRA A starts random, so it is not a witness).
    moved = [
        name for name, want in flat_params.items()
        if (want.abs().amax() > 0 if "lora_B" in name else name in initial and not torch.allclose(want, initial[name]))
    ]  # fmt: skip
    assert moved, "the run did not train"
    return tree


def test_shared_system_prompt_conversations_assistant_only_loss(tiny, tmp_path):
    """Conversational language modeling through the chat template; only assistant tokens trained."""
    dataset = Dataset.from_dict({"messages": _conversations(16)})
    _assert_same_run(tiny, tmp_path, dataset, assistant_only_loss=True, max_ratio=0.7)


def test_per_turn_agent_samples_prompt_completion(tiny, tmp_path):
    """Per-turn samples of each conversation (prompt = history, completion = the turn), kept in dataset order so a
    conversation's turns share a batch; completion-only loss (TRL's default here) with DFT's reweighting."""
    dataset = Dataset.from_list(_per_turn(_conversations(6, seed=1)))
    tree = _assert_same_run(
        tiny, tmp_path, dataset, train_sampling_strategy="sequential", loss_type="dft", max_ratio=0.5
    )
    assert tree.completion_only_loss


def test_packed_padding_free_language_modeling(tiny, tmp_path):
    """TRL's BFD packing (padding-free rows, position ids restarting per document), plain text."""
    texts = [SYSTEM + f"note {i}: " + "xyz " * (i % 5) + "done." for i in range(24)]
    _assert_same_run(tiny, tmp_path, Dataset.from_dict({"text": texts}), packing=True, max_length=512, max_ratio=0.35)


def test_lora(tiny, tmp_path):
    """PEFT LoRA: only adapters train; TRL's flat path and the tree move them alike."""
    dataset = Dataset.from_list(
        [{"prompt": SYSTEM + f"q{i}: {i} plus 1?\n", "completion": f"a: {i + 1}."} for i in range(16)]
    )
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM")
    tree = _assert_same_run(tiny, tmp_path, dataset, peft_config=lora, max_ratio=0.5)
    assert all("lora_" in name for name, p in tree.model.named_parameters() if p.requires_grad)


def test_batches_sharing_nothing_run_trl_forward_with_one_warning(tiny, tmp_path):
    rng = random.Random(0)
    texts = ["".join(rng.choice("abcdefghij") for _ in range(30)) for _ in range(16)]  # no prefix, equal lengths
    dataset = Dataset.from_dict({"text": texts})
    with pytest.warns(UserWarning, match="shares too few tokens") as caught:
        tree, tree_logs, _ = _run(TreeSFTTrainer, tiny, tmp_path, dataset)
    assert sum("shares too few tokens" in str(w.message) for w in caught) == 1
    _, flat_logs, _ = _run(SFTTrainer, tiny, tmp_path, dataset)
    assert [e["tree_fallback"] for e in tree_logs] == [1.0, 1.0]
    assert [e["loss"] for e in tree_logs] == [e["loss"] for e in flat_logs]


def test_models_trees_cannot_run(tiny, tmp_path):
    _, tokenizer = tiny
    bloom = AutoModelForCausalLM.from_config(
        BloomConfig(vocab_size=len(tokenizer), hidden_size=32, n_layer=1, n_head=2), attn_implementation="eager"
    )
    dataset = Dataset.from_dict({"text": [SYSTEM + "a."] * 4})
    args = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", max_length=None)
    strict = TreeSFTConfig(**args, tree_packing="true")
    with pytest.raises(ValueError, match="tree_packing=True.*bloom"):
        TreeSFTTrainer(bloom, strict, train_dataset=dataset, processing_class=tokenizer)
    with pytest.warns(UserWarning, match="tree_packing='auto'.*bloom"):
        trainer = TreeSFTTrainer(bloom, TreeSFTConfig(**args), train_dataset=dataset, processing_class=tokenizer)
    assert not trainer.tree_packing and trainer.tree_lm_head is None
    with pytest.raises(TypeError, match="needs a TreeSFTConfig"):
        TreeSFTTrainer(bloom, SFTConfig(**args), train_dataset=dataset, processing_class=tokenizer)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tree_packing="maybe"), "tree_packing='maybe'"),
        (dict(tree_max_token_ratio=0.0), "tree_max_token_ratio=0.0"),
        (dict(max_tokens_per_mb=1000), "multiple of 128.*use e.g. max_tokens_per_mb=1024"),
        (dict(max_tokens_per_mb=512, max_length=1024), "cannot hold one sequence of max_length=1024"),
    ],
)
def test_config_errors_name_the_value(kwargs, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        TreeSFTConfig(output_dir=str(tmp_path), use_cpu=True, **kwargs)
    assert TreeSFTConfig(output_dir=str(tmp_path), use_cpu=True, tree_packing="FALSE").tree_packing is False


def test_parent_signatures_are_pinned():
    """The hooks the tree trainers rely on keep TRL 1.16's shape (a TRL upgrade that moves them fails here)."""
    from trl import DPOTrainer, GRPOTrainer

    assert list(inspect.signature(SFTTrainer.__init__).parameters)[1:3] == ["model", "args"]
    assert list(inspect.signature(DPOTrainer.__init__).parameters)[1:4] == ["model", "ref_model", "args"]
    assert list(inspect.signature(DPOTrainer._precompute_ref_logps).parameters) == [
        "self", "dataset", "name", "batch_size"
    ]  # fmt: skip
    assert list(inspect.signature(GRPOTrainer._calculate_rewards).parameters) == [
        "self", "inputs", "prompts", "completions", "completion_ids_list"
    ]  # fmt: skip


def test_longrope_with_sharded_weights_on_several_processes_takes_trls_path(tiny, tmp_path, monkeypatch):
    """A longrope model's batch packs into one forest per length class, so ranks could run different numbers of
    forwards; with sharded weights (FSDP / DeepSpeed) on several processes each forward gathers on all ranks, so the
    trainer takes TRL's path, with the reason. One process, or unsharded weights, keeps the trees."""
    from helpers import tiny_config

    _, tokenizer = tiny
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64, "factor": 4.0,
            "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}  # fmt: skip
    config = tiny_config("llama", vocab_size=len(tokenizer), rope_parameters=rope, max_position_embeddings=256)
    model = AutoModelForCausalLM.from_config(config)
    dataset = Dataset.from_dict({"text": [SYSTEM + "a."] * 4})
    args = TreeSFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", max_length=None)
    trainer = TreeSFTTrainer(model, args, train_dataset=dataset, processing_class=tokenizer)
    assert trainer.tree_packing  # one process
    monkeypatch.setattr(type(trainer.accelerator), "num_processes", property(lambda self: 2))
    trainer.is_fsdp_enabled, trainer._tree_ready = True, False
    with pytest.warns(UserWarning, match="longrope RoPE splits a batch .*at 64 tokens.*Training on TRL's path"):
        trainer._tree_setup()
    assert not trainer.tree_packing


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16], ids=["fp32-weights", "bf16-weights"])
def test_mixed_precision_loss_as_close_as_trls(tiny, tmp_path, weights):
    """TRL's `bf16=True` (autocast) with fp32 or bf16 weights: the tree's first-step loss is as close to the float32
    run's as TRL's own under the same precision, within twice its error plus one bf16 rounding."""
    dataset = Dataset.from_dict({"messages": _conversations(16)})
    common = dict(assistant_only_loss=True, max_steps=1)
    _, (reference, *_), _ = _run(SFTTrainer, tiny, tmp_path / "fp32", dataset, **common)
    mixed = dict(common, bf16=True, model_init_kwargs={"dtype": weights})
    tree, (tree_log, *_), _ = _run(TreeSFTTrainer, tiny, tmp_path, dataset, **mixed)
    _, (flat_log, *_), _ = _run(SFTTrainer, tiny, tmp_path, dataset, **mixed)
    assert tree.tree_packing and tree_log["tree_fallback"] == 0.0
    u = torch.finfo(torch.bfloat16).eps / 2
    tree_error, flat_error = abs(tree_log["loss"] - reference["loss"]), abs(flat_log["loss"] - reference["loss"])
    assert flat_error > 0  # the precision did change TRL's numbers
    assert tree_error <= 2 * flat_error + u * abs(reference["loss"]), (tree_error, flat_error)
