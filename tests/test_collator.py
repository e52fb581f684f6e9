"""TreeDataCollator: every per-token field lands back on its original row; micro-batches feed `model(**mb)`."""

import copy

import pytest
import torch
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


@pytest.mark.parametrize("max_tokens_per_mb", [None, 128])
@pytest.mark.parametrize("with_padding", [False, True])
def test_round_trip_every_field_lands_on_its_row(max_tokens_per_mb, with_padding):
    features = _random_features(60, seed=0, with_padding=with_padding)
    micro_batches = TreeDataCollator(max_tokens_per_mb=max_tokens_per_mb)(features)
    if max_tokens_per_mb is not None:
        assert len(micro_batches) > 1
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
