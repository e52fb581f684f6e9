"""Forest hidden states under a linear value head against per-sequence flat forwards of the same weights.

The oracle is the backbone's own unpacked forward of each sequence (`model.model(ids).last_hidden_state`) under the
same value head: per-token values to the log-prob tolerance, and the gradients of a loss over the values (backbone
and head) to the suite's gradient tolerance. A change inside one branch must leave every row outside its subtree
bit-identical.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import FAMILIES, TOLERANCES, forest_case, tiny_config, twin_models
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification, Qwen3MoeConfig

from hf_tree_attn import forest_hidden_states, gather_hidden_states, pack_forest

ATOL = TOLERANCES["logps_atol"]
CASES = ("identical", "prefix", "single_token", "mixed")  # "mixed": several tries in one forest


def _value_head(hidden_size: int, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(hidden_size, 1)


def _tree_values(model, head, sequences, max_tokens_per_mb=None) -> list[torch.Tensor]:
    """Per-token values `(L_i,)` of every sequence, in the input order, from the forests' hidden states."""
    values = [None] * len(sequences)
    for forest in pack_forest(sequences, max_tokens_per_mb=max_tokens_per_mb):
        table = head(forest_hidden_states(model, forest)).squeeze(-1)  # (S,)
        for seq_id, seq_values in zip(forest.seq_ids, gather_hidden_states(forest, table)):
            values[seq_id] = seq_values
    return values


def _flat_values(model, head, sequences) -> list[torch.Tensor]:
    out = []
    for seq in sequences:
        hidden = model.model(torch.tensor([seq])).last_hidden_state[0]  # (L, hidden)
        out.append(head(hidden).squeeze(-1))
    return out


def _assert_values_match(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, (i, g.shape, w.shape)
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0, msg=lambda m, i=i: f"sequence {i}: {m}")


def _grads(*modules) -> dict[str, torch.Tensor]:
    return {
        f"{i}.{name}": p.grad.detach().clone()
        for i, module in enumerate(modules)
        for name, p in module.named_parameters()
        if p.grad is not None
    }


def _assert_grads_close(got, want):
    """Per tensor: max |got - want| <= grad_max_rel * max |want|."""
    assert got.keys() == want.keys() and len(want) > 0
    for name, flat in want.items():
        worst = (got[name] - flat).abs().max().item()
        assert worst <= TOLERANCES["grad_max_rel"] * flat.abs().max().item(), f"{name}: max |diff| {worst}"


def _check_values_and_grads(tree, ref, sequences, max_tokens_per_mb=None):
    head = _value_head(tree.config.hidden_size)
    ref_head = copy.deepcopy(head)
    got = _tree_values(tree, head, sequences, max_tokens_per_mb)
    want = _flat_values(ref, ref_head, sequences)
    with torch.no_grad():
        _assert_values_match(got, want)
    # Positive weights: the head's bias gradient is their sum, which signed weights could cancel to far below the
    # size of its terms (and of their rounding).
    g = torch.Generator().manual_seed(1)
    weights = [torch.rand(len(s), generator=g) + 0.5 for s in sequences]
    sum((w * v).sum() for w, v in zip(weights, got)).backward()
    sum((w * v).sum() for w, v in zip(weights, want)).backward()
    _assert_grads_close(_grads(tree, head), _grads(ref, ref_head))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("family", FAMILIES)
def test_value_head_matches_flat(family, case):
    tree, ref = twin_models(family)
    _check_values_and_grads(tree, ref, forest_case(case, seed=0))


def test_several_forests_match_flat():
    tree, ref = twin_models("qwen3")
    sequences = forest_case("mixed", seed=1) + forest_case("mixed", seed=2)
    assert len(pack_forest(sequences, max_tokens_per_mb=128)) >= 3
    _check_values_and_grads(tree, ref, sequences, max_tokens_per_mb=128)


def test_sliding_window_matches_flat():
    """Gemma 2 with a 4-token window on every other layer: sequences far longer than the window."""
    tree, ref = twin_models("gemma2", sliding_window=4)
    sequences = forest_case("multiturn", seed=0) + forest_case("grpo", seed=1)
    assert max(map(len, sequences)) > 4 * 4
    _check_values_and_grads(tree, ref, sequences)


def test_moe_matches_flat():
    config = Qwen3MoeConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, initializer_range=0.1, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    tree = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="tree_flex").eval()
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    ref.load_state_dict(tree.state_dict())
    _check_values_and_grads(tree, ref, forest_case("grpo", seed=2) + forest_case("identical", seed=0))


def test_backbone_and_sequence_classifier_give_the_causal_lms_hidden_states():
    """The same backbone weights reached through a causal LM, a sequence classifier and the bare backbone."""
    config = tiny_config("qwen3", num_labels=1)
    torch.manual_seed(0)
    causal = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="tree_flex").eval()
    classifier = AutoModelForSequenceClassification.from_config(copy.deepcopy(config), attn_implementation="tree_flex")
    classifier.eval()
    backbone = AutoModel.from_config(copy.deepcopy(config), attn_implementation="tree_flex").eval()
    classifier.model.load_state_dict(causal.model.state_dict())
    backbone.load_state_dict(causal.model.state_dict())
    (forest,) = pack_forest(forest_case("grpo", seed=0))
    with torch.no_grad():
        want = forest_hidden_states(causal, forest)
        assert want.shape == (forest.seq_len, config.hidden_size)
        for model in (classifier, backbone):
            torch.testing.assert_close(forest_hidden_states(model, forest), want, atol=0, rtol=0)


def test_gather_shapes_follow_the_packed_order():
    sequences = forest_case("prefix", seed=3)
    (forest,) = pack_forest(sequences)
    table = torch.arange(forest.seq_len)[:, None].expand(-1, 3)  # (S, 3): each row holds its own index
    parts = gather_hidden_states(forest, table)
    assert len(parts) == len(sequences)
    for k, (seq_id, part) in enumerate(zip(forest.seq_ids, parts)):
        assert part.shape == (len(sequences[seq_id]), 3)
        assert torch.equal(part[:, 0], forest.positions(k))
        assert torch.equal(forest.input_ids[0, part[:, 0]], torch.tensor(sequences[seq_id]))


def _branch_change(sequences):
    """`(row, changed_forest, forest)`: one token inside a branch changed (a row with descendants where there is
    one) such that the packing layout is unchanged."""
    (before,) = pack_forest(sequences)
    candidates = []
    for i, seq in enumerate(sequences):
        for pos in range(1, len(seq)):
            for token in (seq[pos] + 1, seq[pos] - 1):
                if not 1 <= token < 128:
                    continue
                changed = [list(s) for s in sequences]
                changed[i][pos] = token
                (after,) = pack_forest(changed)
                same_layout = (
                    after.seq_ids == before.seq_ids
                    and torch.equal(after.seq_positions, before.seq_positions)
                    and torch.equal(after.subtree_end, before.subtree_end)
                )
                moved = torch.nonzero(after.input_ids[0] != before.input_ids[0]).flatten()
                if same_layout and len(moved) == 1:
                    row = int(moved[0])
                    candidates.append((int(before.subtree_end[row]) - row, row, after))
    size, row, after = max(candidates, key=lambda c: c[0])
    assert size > 1, "the test needs a changed row with descendants"
    return row, after, before


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_a_change_in_one_branch_moves_only_its_subtree(family):
    tree, _ = twin_models(family, sliding_window=4) if family == "gemma2" else twin_models(family)
    head = _value_head(tree.config.hidden_size)
    row, after, before = _branch_change(forest_case("grpo", seed=0))
    with torch.no_grad():
        values_before = head(forest_hidden_states(tree, before)).squeeze(-1)
        values_after = head(forest_hidden_states(tree, after)).squeeze(-1)
    inside = torch.zeros(before.seq_len, dtype=torch.bool)
    inside[row : int(before.subtree_end[row])] = True
    inside[before.num_tree_tokens :] = False  # padding rows repeat the first token: never read
    outside = ~inside
    outside[before.num_tree_tokens :] = False
    assert torch.equal(values_before[outside], values_after[outside]), "a row outside the subtree saw the change"
    assert not torch.equal(values_before[row], values_after[row])
