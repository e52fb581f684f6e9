"""Sequence-classification reward models on packed trees: equal to transformers' own padded forward and to TRL.

The oracle is the model's own forward on TRL's right-padded batch (transformers reads the score at the rightmost
token that is not the pad token), and `trl.GRPOTrainer`'s rewards for the same completions.
"""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from helpers import TOLERANCES, token_reward
from transformers import AutoModelForSequenceClassification, GPT2Config, Qwen3Config
from trl import GRPOConfig, GRPOTrainer

from hf_tree_attn.trainer import TreeGRPOConfig, TreeGRPOTrainer
from hf_tree_attn.trainer.reward import reward_model_error, score_on_forests, tree_reward_models
from trainers import toy_task

PAD = 0


def _reward_model(num_labels=1, seed=0, attn="sdpa", **overrides):
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, initializer_range=0.1, pad_token_id=PAD, num_labels=num_labels,
        **overrides,
    )  # fmt: skip
    return AutoModelForSequenceClassification.from_config(copy.deepcopy(config), attn_implementation=attn).eval()


def _right_padded(rows):
    width = max(map(len, rows))
    ids = torch.tensor([r + [PAD] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return ids, mask


# Two prompts with their groups: a duplicate, a completion that is a prefix of another, one ending in the pad
# token (transformers then scores the token before it), one with the pad token inside, a 1-token completion.
PROMPT_A, PROMPT_B = [5, 9, 11, 3, 7, 21, 8, 8, 30], [5, 9, 11, 4, 40]
ROWS = [
    PROMPT_A + [12, 13, 14],
    PROMPT_A + [12, 13, 14],
    PROMPT_A + [12, 13],
    PROMPT_A + [15, 16, 17, 18, 19],
    PROMPT_A + [22, PAD],
    PROMPT_B + [23, PAD, 24, 25],
    PROMPT_B + [26],
    PROMPT_B + [27, 28],
]


@pytest.mark.parametrize("num_labels", [1, 3])
def test_forest_scores_equal_the_padded_forward(num_labels):
    model = _reward_model(num_labels)
    ids, mask = _right_padded(ROWS)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        model.set_attn_implementation("tree_flex")
        got, reason, ratio = score_on_forests(model, ids, mask)
    assert reason is None and ratio < 0.5
    torch.testing.assert_close(got, want, atol=TOLERANCES["logps_atol"], rtol=0)
    # The pad-ending row is scored at its token before the pad: a read of the pad position would differ.
    with torch.no_grad():
        last_token = model(input_ids=ids[4:5, :10], attention_mask=mask[4:5, :10]).logits
    torch.testing.assert_close(got[4:5], last_token, atol=TOLERANCES["logps_atol"], rtol=0)


def test_context_swaps_the_forward_and_restores_it():
    model = _reward_model()
    ids, mask = _right_padded(ROWS)
    records = []
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        with tree_reward_models([model, token_reward], record=lambda name, value: records.append((name, value))):
            assert model.config._attn_implementation == "tree_flex"
            got = model(input_ids=ids, attention_mask=mask).logits
    assert "forward" not in model.__dict__ and model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(got, want, atol=TOLERANCES["logps_atol"], rtol=0)
    assert ("reward_tree_fallback", 0.0) in records


def test_batches_the_tree_cannot_reproduce_score_flat():
    model = _reward_model()
    ids, mask = _right_padded([[5, 9, 11], [5, 9, PAD]])  # a row that is all pad after its first tokens
    left = torch.tensor([[0, 1, 1], [1, 1, 1]])
    records = []
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=left).logits
        with tree_reward_models([model], record=lambda name, value: records.append((name, value))):
            got = model(input_ids=ids, attention_mask=left).logits  # left padding: TRL's own forward
    torch.testing.assert_close(got, want)
    assert records == [("reward_tree_fallback", 1.0)]
    model.config.pad_token_id = None  # transformers refuses several rows without a pad token; so does the tree
    with torch.no_grad(), tree_reward_models([model]), pytest.raises(ValueError, match="no padding token"):
        model(input_ids=ids, attention_mask=mask)


def test_refused_reward_model_scores_flat_with_the_reason_logged(caplog):
    torch.manual_seed(0)
    gpt2 = AutoModelForSequenceClassification.from_config(
        GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, num_labels=1, pad_token_id=PAD)
    ).eval()
    assert "GenericForSequenceClassification" in reward_model_error(gpt2)
    assert reward_model_error(_reward_model()) is None
    ids, mask = _right_padded(ROWS)
    with torch.no_grad():
        want = gpt2(input_ids=ids, attention_mask=mask).logits
        with caplog.at_level(logging.WARNING), tree_reward_models([gpt2]):
            assert "forward" not in gpt2.__dict__
            got = gpt2(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want)
    assert "GPT2ForSequenceClassification" in caplog.text and "scores flat" in caplog.text


def test_a_tree_flex_registered_over_ours_scores_flat(monkeypatch):
    """Another package's `tree_flex` in transformers' table: the reward model would run it, so it scores flat."""
    from transformers import AttentionInterface

    def other_attention(*args, **kwargs):
        raise AssertionError("never called")

    monkeypatch.setitem(AttentionInterface._global_mapping, "tree_flex", other_attention)
    reason = reward_model_error(_reward_model())
    assert "runs test_tree_rewards.test_a_tree_flex_registered_over_ours_scores_flat.<locals>.other_attention" in (
        reason
    )
    assert reason.endswith("It scores flat, as in trl.GRPOTrainer.")


def test_peft_gate_accepts_a_modules_to_save_head_and_refuses_a_lora_on_it():
    """PEFT's sequence-classification task copies `score` into `modules_to_save` (row by row, like the original):
    exact, and the PEFT model scores equal its own padded forward. A LoRA on `score` and prompt learning are
    refused, naming the way out."""
    from peft import LoraConfig, PromptTuningConfig, get_peft_model

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS")
    peft_model = get_peft_model(_reward_model(), lora).eval()
    assert type(peft_model.base_model.model.score).__name__ == "ModulesToSaveWrapper"
    assert reward_model_error(peft_model) is None
    ids, mask = _right_padded(ROWS)
    with torch.no_grad():
        torch.nn.init.normal_(peft_model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight)
        want = peft_model(input_ids=ids, attention_mask=mask).logits
        records = []
        with tree_reward_models([peft_model], record=lambda name, value: records.append((name, value))):
            got = peft_model(input_ids=ids, attention_mask=mask).logits
    assert ("reward_tree_fallback", 0.0) in records
    torch.testing.assert_close(got, want, atol=TOLERANCES["logps_atol"], rtol=0)

    on_score = get_peft_model(_reward_model(), LoraConfig(r=4, target_modules=["q_proj", "score"]))
    assert "leave it out of target_modules" in reward_model_error(on_score, fallback="")
    prompt = get_peft_model(_reward_model(), PromptTuningConfig(num_virtual_tokens=2, task_type="SEQ_CLS"))
    assert "prompt learning" in reward_model_error(prompt)


# ----------------------------------------------------------------------------------------------------------------
# Inside TreeGRPOTrainer: the rewards of a run equal trl.GRPOTrainer's.


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    tokenizer = toy_task.build_tokenizer()
    policy = tmp_path_factory.mktemp("policy")
    toy_task.build_model(tokenizer, seed=0).save_pretrained(policy)
    tokenizer.save_pretrained(policy)
    torch.manual_seed(1)
    config = toy_task.model_config(tokenizer, num_labels=1)
    reward = tmp_path_factory.mktemp("reward")
    AutoModelForSequenceClassification.from_config(config).save_pretrained(reward)
    tokenizer.save_pretrained(reward)
    return str(policy), str(reward), tokenizer


def _grpo_run(trainer_cls, paths, tmp_path):
    policy, reward, tokenizer = paths
    config_cls = TreeGRPOConfig if trainer_cls is TreeGRPOTrainer else GRPOConfig
    args = config_cls(
        output_dir=str(tmp_path / trainer_cls.__name__), use_cpu=True, bf16=False, seed=0,
        per_device_train_batch_size=8, num_generations=4, max_completion_length=4, max_steps=2, logging_steps=1,
        learning_rate=0.05, optim="sgd", lr_scheduler_type="constant", report_to="none", save_strategy="no",
        model_init_kwargs={"dtype": torch.float32}, gradient_checkpointing=False,
    )  # fmt: skip
    trainer = trainer_cls(
        policy, [reward, token_reward], args, train_dataset=toy_task.build_dataset(32, seed=1),
        processing_class=tokenizer, reward_processing_classes=[tokenizer, None],
    )  # fmt: skip
    scored = []
    calculate = trainer._calculate_rewards

    def recording(*a):
        out = calculate(*a)
        scored.append(out.clone())
        return out

    trainer._calculate_rewards = recording
    trainer.train()
    return trainer, scored


def test_grpo_reward_model_scores_equal_trl(paths, tmp_path):
    tree, tree_scores = _grpo_run(TreeGRPOTrainer, paths, tmp_path)
    flat, flat_scores = _grpo_run(GRPOTrainer, paths, tmp_path)
    assert tree.reward_funcs[0].config._attn_implementation == "tree_flex"  # loaded with the policy's kwargs
    assert len(tree_scores) == len(flat_scores) == 2
    for got, want in zip(tree_scores, flat_scores):
        assert torch.equal(got[:, 1], want[:, 1])  # same completions (the token reward reads every token)
        torch.testing.assert_close(got, want, atol=TOLERANCES["logps_atol"], rtol=0)
        assert want[:, 0].std() > 0  # the reward model tells the completions apart
    tree_logs = [e for e in tree.state.log_history if "loss" in e]
    flat_logs = [e for e in flat.state.log_history if "loss" in e]
    for a, b in zip(tree_logs, flat_logs):
        assert math.isclose(a["loss"], b["loss"], abs_tol=TOLERANCES["logps_atol"])
        assert a["reward_tree_fallback"] == 0.0 and a["reward_tree_compute_ratio"] < 0.7
