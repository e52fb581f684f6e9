"""TreeDataCollator: every per-token field lands back on its original row; micro-batches feed `model(**mb)`."""

import copy

import pytest
import torch
from helpers import TOLERANCES
from transformers import AutoModelForCausalLM, Qwen3Config

import hf_tree_attn
from hf_tree_attn import TreeDataCollator, TreeMicroBatch

# The tiny example of hf_tree_attn.tree, with per-token fields that differ on the shared rows 0 and 1.
TINY = [
    {"input_ids": [5, 6, 7, 8], "completion_mask": [0, 0, 1, 1], "advantages": 1.5, "tag": "a"},
    {"input_ids": [5, 6, 9], "completion_mask": [0, 1, 1], "advantages": -0.5, "tag": "b"},
]


def test_tiny_example_layout():
    (mb,) = TreeDataCollator()(TINY)
    assert isinstance(mb, TreeMicroBatch)
    assert set(mb) == {"input_ids", "position_ids", "attention_mask", "tree_forest", "use_cache"}
    assert mb["input_ids"][0, :5].tolist() == [5, 6, 7, 8, 9]
    assert mb["position_ids"][0, :5].tolist() == [0, 1, 2, 3, 2]
    assert mb["attention_mask"] is mb.forest.attention_mask("cpu")  # the forest's (1, S) mask: per-layer tree masks
    assert mb["tree_forest"] is mb.forest and mb.forest.max_depth == 3 and mb["use_cache"] is False
    assert mb.seq_ids == [0, 1]
    assert mb.positions.tolist() == [0, 1, 2, 3, 0, 1, 4]
    assert mb.seq_index.tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert mb.token_index.tolist() == [0, 1, 2, 3, 0, 1, 2]
    # Rows 0 and 1 are shared, yet each sequence keeps its own values there.
    assert mb.fields["completion_mask"].tolist() == [0, 0, 1, 1, 0, 1, 1]
    assert mb.fields["advantages"].tolist() == [1.5] * 4 + [-0.5] * 3  # per-sequence numbers are broadcast
    assert mb.seq_fields == {"tag": ["a", "b"]}


def _random_features(num, seed, with_padding):
    """Groups of sequences sharing prompts (and some completion prefixes), with per-token and scalar fields."""
    gen = torch.Generator().manual_seed(seed)
    features = []
    for i in range(num):
        prompt = [1 + i % 3] * (3 + i % 3) + [7, 8]  # three prompt families
        completion = torch.randint(2, 6, (int(torch.randint(1, 7, (1,), generator=gen)),), generator=gen).tolist()
        ids = prompt + completion
        feature = {
            "input_ids": ids,
            "labels": [-100] * len(prompt) + completion,
            "completion_mask": [0] * len(prompt) + [1] * len(completion),
            "weights": torch.rand(len(ids), generator=gen).tolist(),
            "advantages": float(i) - num / 2,
            "row": i,
        }
        if with_padding:  # left-padded the HF way: padding dropped through attention_mask
            pad = i % 4
            feature = {
                k: ([0] * pad + v if isinstance(v, list) else v) for k, v in feature.items() if k != "attention_mask"
            }
            feature["attention_mask"] = [0] * pad + [1] * len(ids)
        features.append(feature)
    return features


@pytest.mark.parametrize("two_level", [None, True])
@pytest.mark.parametrize("max_tokens_per_mb", [None, 128])
@pytest.mark.parametrize("with_padding", [False, True])
def test_round_trip_every_field_lands_on_its_row(max_tokens_per_mb, with_padding, two_level):
    features = _random_features(60, seed=0, with_padding=with_padding)
    micro_batches = TreeDataCollator(max_tokens_per_mb=max_tokens_per_mb, two_level=two_level)(features)
    if max_tokens_per_mb is not None:
        assert len(micro_batches) > 1
    if two_level:  # every forest two-level, repeating what only some sequences share
        assert all(mb.forest.prefix_plan is not None for mb in micro_batches)
    assert sorted(i for mb in micro_batches for i in mb.seq_ids) == list(range(len(features)))

    for name in ("input_ids", "labels", "completion_mask", "weights", "advantages", "row"):
        # input_ids is read back from the trie rows; every other name is a field of the expanded layout.
        values = [mb.gather(mb["input_ids"][0]) for mb in micro_batches] if name == "input_ids" else name
        rows = TreeDataCollator.unpack(micro_batches, values)
        for i, feature in enumerate(features):
            keep = torch.tensor(feature.get("attention_mask", [1] * len(feature["input_ids"]))).bool()
            expected = feature[name]
            if isinstance(expected, list):
                expected = torch.tensor(expected)[keep]
            else:
                expected = torch.full((int(keep.sum()),), expected)
            torch.testing.assert_close(rows[i], expected.to(rows[i].dtype), rtol=0, atol=0)

    for mb in micro_batches:  # the per-token layout agrees with the trie: same token, depth = index in sequence
        assert torch.equal(mb.gather(mb["position_ids"][0]), mb.token_index)
        assert torch.equal(mb.unpack(mb.seq_index)[0], torch.full((mb.lengths[0],), mb.seq_ids[0]))


def test_model_forward_on_micro_batch_matches_per_sequence_forward():
    cfg = Qwen3Config(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="tree_flex").eval()
    features = _random_features(12, seed=1, with_padding=False)
    (mb,) = TreeDataCollator()(features)
    with torch.no_grad():
        logits = model(**mb).logits[0]  # (S, vocab)
        for k, i in enumerate(mb.seq_ids):
            ids = torch.tensor(features[i]["input_ids"])[None]
            expected = model(ids).logits[0]
            torch.testing.assert_close(logits[mb.forest.positions(k)], expected, rtol=1e-5, atol=1e-5)


def test_to_keeps_attributes_and_rebuilds_the_mask():
    (mb,) = TreeDataCollator()(TINY)
    moved = mb.to("cpu")
    assert moved.seq_ids == mb.seq_ids and moved.fields.keys() == mb.fields.keys()
    assert moved["attention_mask"] is moved.forest.attention_mask("cpu")


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="empty"):
        TreeDataCollator()([])
    with pytest.raises(KeyError, match="input_ids"):
        TreeDataCollator()([{"labels": [1, 2]}])
    with pytest.raises(ValueError, match="same fields"):
        TreeDataCollator()([{"input_ids": [1, 2]}, {"input_ids": [1, 3], "labels": [1, 3]}])
    with pytest.raises(ValueError, match="max_tokens_per_mb"):
        TreeDataCollator(max_tokens_per_mb=128)([{"input_ids": list(range(1, 200))}])
    (mb,) = TreeDataCollator()(TINY)
    with pytest.raises(ValueError, match="expanded layout"):
        mb.unpack(torch.zeros(3))


def test_package_import_needs_no_trl():
    assert "TreeDataCollator" in hf_tree_attn.__all__
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['trl'] = None; sys.modules['datasets'] = None\n"
        "import hf_tree_attn; hf_tree_attn.TreeDataCollator()([{'input_ids': [1, 2]}])"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------------------------------------------
# Bad inputs: refused with the value and the fix, never cast or reinterpreted silently.


@pytest.mark.parametrize(
    "features, error, match",
    [
        ([{"input_ids": [1.0, 2.0]}], TypeError, r"features\[0\]\['input_ids'\] has dtype torch\.float32"),
        (
            [{"input_ids": torch.tensor([151643, 7], dtype=torch.bfloat16)}],
            TypeError,
            r"dtype torch\.bfloat16; token ids must be integers.*151552",
        ),
        ([{"input_ids": [5, 6]}, {"input_ids": []}], ValueError, r"features\[1\]\['input_ids'\] is empty"),
        ([{"input_ids": [5, 6], "attention_mask": [0, 0]}], ValueError, r"features\[0\] is all padding"),
        (
            [{"input_ids": [5, 6, 7, 8], "advantages": [0.1, 0.2, 0.3]}],
            ValueError,
            r"features\[0\]\['advantages'\] has 3 numbers but input_ids has 4 tokens.*per_sequence_fields",
        ),
        (
            {"input_ids": [[5, 6], [5, 7]]},
            TypeError,
            r"features is a mapping of columns.*\[dataset\[i\] for i in range\(8\)\]",
        ),
        ([[5, 6, 7]], TypeError, r"features\[0\] is a list; each feature must be a mapping"),
    ],
    ids=["float-ids", "bf16-ids", "empty-ids", "all-padding", "per-token-one-short", "batched-dict", "bare-list"],
)
def test_bad_features_are_refused(features, error, match):
    with pytest.raises(error, match=match):
        TreeDataCollator()(features)


def test_a_declared_per_sequence_vector_is_kept_as_is():
    features = [{"input_ids": [5, 6, 7, 8], "scores": [0.1, 0.2]}, {"input_ids": [5, 6], "scores": [0.3, 0.4]}]
    (mb,) = TreeDataCollator(per_sequence_fields=["scores"])(features)
    assert mb.seq_fields == {"scores": [[0.1, 0.2], [0.3, 0.4]]} and mb.fields == {}


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(max_tokens_per_mb="256"), TypeError, r"max_tokens_per_mb='256' is a str; pass an int"),
        (dict(max_tokens_per_mb=256.0), TypeError, r"max_tokens_per_mb=256\.0 is a float"),
        (dict(max_tokens_per_mb=200), ValueError, r"use e\.g\. max_tokens_per_mb=256"),
    ],
)
def test_bad_budget_fails_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        TreeDataCollator(**kwargs)


# ----------------------------------------------------------------------------------------------------------------
# transformers.Trainer: `for_trainer=True` feeds the model's own loss; a few steps equal the hand-written loop.


def _lm_features(num, seed):
    """Prompt-sharing sequences with HF-style `labels` (-100 on the prompt), some left-padded."""
    gen = torch.Generator().manual_seed(seed)
    features = []
    for i in range(num):
        prompt = [1 + i % 2] * 6 + [7, 8, 9]
        completion = torch.randint(10, 30, (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen).tolist()
        pad = i % 3
        features.append(
            {
                "input_ids": [0] * pad + prompt + completion,
                "attention_mask": [0] * pad + [1] * (len(prompt) + len(completion)),
                "labels": [-100] * (pad + len(prompt)) + completion,
            }
        )
    return features


def _tiny_lm(seed=0):
    cfg = Qwen3Config(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="tree_flex")


def test_for_trainer_batch_is_the_models_own_loss_per_sequence():
    """`model(**mb).loss` = mean cross-entropy over the trained tokens of per-sequence forwards with `labels`."""
    model = _tiny_lm().eval()
    features = _lm_features(6, seed=0)
    mb = TreeDataCollator(for_trainer=True)(features)
    assert isinstance(mb, TreeMicroBatch)
    assert set(mb) == {"input_ids", "position_ids", "attention_mask", "tree_forest", "use_cache"} | {
        "logits_to_keep", "labels", "shift_labels",
    }  # fmt: skip
    with torch.no_grad():
        loss = model(**mb).loss
        total, count = 0.0, 0
        for f in features:
            keep = torch.tensor(f["attention_mask"]).bool()
            out = model(torch.tensor(f["input_ids"])[keep][None], labels=torch.tensor(f["labels"])[keep][None])
            n = int((torch.tensor(f["labels"])[keep][1:] != -100).sum())
            total, count = total + out.loss * n, count + n
    assert mb["labels"].shape == (1, count) and len(mb["logits_to_keep"]) == count
    torch.testing.assert_close(loss, total / count, atol=TOLERANCES["logps_atol"], rtol=0)


def test_for_trainer_refuses_more_than_one_micro_batch():
    features = [{"input_ids": [i + 1] * 100} for i in range(3)]
    with pytest.raises(ValueError, match=r"need 3 micro-batches of max_tokens_per_mb=128.*one model input per call"):
        TreeDataCollator(max_tokens_per_mb=128, for_trainer=True)(features)


class _Recording:
    """Wraps a collator and records the features of every batch (the order Trainer consumed them)."""

    def __init__(self, collator):
        self.collator, self.batches = collator, []

    def __call__(self, features):
        self.batches.append(features)
        return self.collator(features)


def test_trainer_steps_equal_the_hand_written_loop(tmp_path):
    """3 optimizer steps of `Trainer` (2 accumulated micro-batches each) = the README loop on the same batches."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    features = _lm_features(24, seed=1)
    model, reference = _tiny_lm(), _tiny_lm()
    reference.load_state_dict(model.state_dict())
    recorder = _Recording(TreeDataCollator(for_trainer=True))
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3,
        learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0,
        use_cpu=True, report_to="none", save_strategy="no", logging_steps=1, seed=0,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=Dataset.from_list(features), data_collator=recorder)
    trainer.train()
    assert len(recorder.batches) == 6

    # The loop of the README, on the batches Trainer drew: loss = -sum(logp of trained tokens) / trained tokens.
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    reference.train()
    collate = TreeDataCollator()
    for step in range(3):
        micro = [mb for batch in recorder.batches[2 * step : 2 * step + 2] for mb in collate(batch)]
        trained = [(mb.token_index >= 1) & (mb.fields["labels"] != -100) for mb in micro]
        num_trained = sum(int(t.sum()) for t in trained)
        for mb, mask in zip(micro, trained):
            table, _ = hf_tree_attn.forest_logprobs(reference, mb.forest)
            (-(mb.gather(table) * mask).sum() / num_trained).backward()
        optimizer.step()
        optimizer.zero_grad()
    for (name, got), (_, want) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(got, want, atol=TOLERANCES["logps_atol"], rtol=0, msg=name)
    initial = _tiny_lm()
    moved = any(not torch.allclose(p, q) for p, q in zip(model.parameters(), initial.parameters()))
    assert moved, "the Trainer did not train"
