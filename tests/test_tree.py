"""`pack_forest` / `PackedForest` / `tree_token_ratio` against the drawn example and a per-token dict trie."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch
from helpers import (
    FOREST_CASES,
    DictTrie,
    forest_case,
    grpo_groups,
    multiturn,
    oracle_mask,
    oracle_row_nodes,
    oracle_segments,
    trie_node_count,
)

from hf_tree_attn import PackedForest, pack_forest, tree_token_ratio
from hf_tree_attn import tree as tree_module

SEEDS = (0, 1, 2)

# ----------------------------------------------------------------------------------------------------------------
# The tiny example drawn in the `hf_tree_attn.tree` module docstring, written out literally.

DOC_SEQUENCES = [[5, 6, 7, 8], [5, 6, 9]]
DOC_INPUT_IDS = [5, 6, 7, 8, 9]
DOC_POSITION_IDS = [0, 1, 2, 3, 2]
DOC_PARENT = [-1, 0, 1, 2, 1]
DOC_SUBTREE_END = [5, 5, 4, 4, 5]
DOC_POSITIONS = [[0, 1, 2, 3], [0, 1, 4]]
DOC_SEGMENT_STARTS, DOC_SEGMENT_PARENT, DOC_SEGMENT_LEVEL = [0, 2, 4, 5], [-1, 0, 0], [0, 1, 1]
# fmt: off
DOC_MASK = [  # ■ = 1, ⬚ = 0; q rows, kv columns
    [1, 0, 0, 0, 0],
    [1, 1, 0, 0, 0],
    [1, 1, 1, 0, 0],
    [1, 1, 1, 1, 0],
    [1, 1, 0, 0, 1],
]
# fmt: on


def test_docstring_example_unpadded():
    (forest,) = pack_forest(DOC_SEQUENCES, pad_multiple=1)
    assert forest.seq_len == 5 and forest.num_tree_tokens == 5 and forest.num_original_tokens == 7
    assert forest.seq_ids == [0, 1]
    assert forest.input_ids.tolist() == [DOC_INPUT_IDS]
    assert forest.position_ids.tolist() == [DOC_POSITION_IDS]
    assert forest.parent.tolist() == DOC_PARENT
    assert forest.subtree_end.tolist() == DOC_SUBTREE_END
    assert [forest.positions(k).tolist() for k in range(2)] == DOC_POSITIONS
    assert forest.dense_mask().tolist() == [[[[bool(x) for x in row] for row in DOC_MASK]]]
    assert forest.max_depth == 3
    assert forest.segment_starts.tolist() == DOC_SEGMENT_STARTS
    assert forest.segment_parent.tolist() == DOC_SEGMENT_PARENT
    assert forest.segment_level.tolist() == DOC_SEGMENT_LEVEL
    assert forest.num_segments == 3 and forest.num_levels == 2


def test_docstring_example_padded_to_block():
    (forest,) = pack_forest(DOC_SEQUENCES)  # pad_multiple=128
    size = 128
    assert forest.seq_len == size and forest.num_tree_tokens == 5
    assert forest.input_ids.tolist() == [DOC_INPUT_IDS + [0] * (size - 5)]
    assert forest.position_ids.tolist() == [DOC_POSITION_IDS + [0] * (size - 5)]
    assert forest.parent.tolist() == DOC_PARENT + [-1] * (size - 5)
    assert forest.subtree_end.tolist() == DOC_SUBTREE_END + list(range(6, size + 1))
    expected = torch.eye(size, dtype=torch.bool)
    expected[:5, :5] = torch.tensor(DOC_MASK, dtype=torch.bool)
    assert torch.equal(forest.dense_mask()[0, 0], expected)
    assert forest.dense_mask().shape == (1, 1, size, size)
    assert forest.input_ids.dtype == forest.position_ids.dtype == forest.parent.dtype == torch.long
    # Padding rows belong to no segment.
    assert forest.segment_starts.tolist() == DOC_SEGMENT_STARTS
    assert forest.segment_starts.dtype == forest.segment_parent.dtype == forest.segment_level.dtype == torch.long


def test_accepts_tensors_and_arrays_like_lists():
    as_lists = pack_forest(DOC_SEQUENCES, pad_multiple=8)[0]
    mixed = pack_forest([torch.tensor(DOC_SEQUENCES[0]), np.array(DOC_SEQUENCES[1], dtype=np.int32)], pad_multiple=8)
    for name in ("input_ids", "position_ids", "subtree_end", "parent", "seq_positions", "seq_offsets"):
        assert torch.equal(getattr(mixed[0], name), getattr(as_lists, name)), name


def test_segments_are_derived_when_a_forest_is_built_by_hand():
    forest = pack_forest(DOC_SEQUENCES, pad_multiple=8)[0]
    fields = {f.name: getattr(forest, f.name) for f in dataclasses.fields(forest) if not f.name.startswith("seg")}
    by_hand = PackedForest(**{k: v for k, v in fields.items() if not k.startswith("_")})
    for name in ("segment_starts", "segment_parent", "segment_level"):
        assert torch.equal(getattr(by_hand, name), getattr(forest, name)), name


def test_to_moves_segments_and_shares_caches():
    forest = pack_forest(DOC_SEQUENCES, pad_multiple=8)[0]
    moved = forest.to("cpu")
    for name in ("segment_starts", "segment_parent", "segment_level"):
        assert torch.equal(getattr(moved, name), getattr(forest, name)), name
    assert moved._scan_cache is forest._scan_cache and moved._mask_cache is forest._mask_cache


# ----------------------------------------------------------------------------------------------------------------
# Random forests against the dict-trie oracle.


def _budget(sequences, pad_multiple: int, slack: int) -> int:
    """Smallest multiple of `pad_multiple` that fits the longest sequence, plus `slack` blocks."""
    longest = max(len(s) for s in sequences)
    return (-(-longest // pad_multiple) + slack) * pad_multiple


def _check_forests(sequences, forests: list[PackedForest], pad_multiple: int, budget: int | None) -> None:
    """Every invariant of a packing, checked against the raw sequences and the dict-trie oracle."""
    packed = sorted(sid for f in forests for sid in f.seq_ids)
    assert packed == list(range(len(sequences))), "each sequence must be packed exactly once"
    for forest in forests:
        size = forest.seq_len
        assert size % pad_multiple == 0 and size >= forest.num_tree_tokens > 0
        assert size - forest.num_tree_tokens < pad_multiple, "padding is less than one pad_multiple"
        if budget is not None:
            assert size <= budget
        assert forest.input_ids.shape == forest.position_ids.shape == (1, size)
        assert forest.subtree_end.shape == forest.parent.shape == (size,)
        assert forest.seq_ids == sorted(forest.seq_ids)
        members = [sequences[sid] for sid in forest.seq_ids]
        assert forest.num_original_tokens == sum(len(s) for s in members)
        assert forest.num_tree_tokens == trie_node_count(members), "a shared prefix was laid out twice"

        for k, sid in enumerate(forest.seq_ids):
            pos = forest.positions(k)
            assert forest.input_ids[0, pos].tolist() == list(sequences[sid])
            assert forest.position_ids[0, pos].tolist() == list(range(len(sequences[sid])))
            assert forest.parent[pos].tolist() == [-1] + pos[:-1].tolist()

        _, row_node = oracle_row_nodes(forest, sequences)
        assert sorted(row_node) == list(range(forest.num_tree_tokens)), "real rows must be exactly the trie nodes"
        pad = torch.arange(forest.num_tree_tokens, size)
        assert (forest.input_ids[0, pad] == 0).all() and (forest.position_ids[0, pad] == 0).all()
        assert (forest.parent[pad] == -1).all()
        assert torch.equal(forest.dense_mask()[0, 0], oracle_mask(forest, sequences))
        starts, parents, levels = oracle_segments(forest, sequences)
        assert forest.segment_starts.tolist() == starts
        assert forest.segment_parent.tolist() == parents
        assert forest.segment_level.tolist() == levels


def _tries(sequences) -> list[list[int]]:
    """Sequence indices grouped by trie (by first token), from the dict trie."""
    groups: dict[int, list[int]] = {}
    for i, seq in enumerate(sequences):
        groups.setdefault(int(seq[0]), []).append(i)
    return list(groups.values())


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s}")
@pytest.mark.parametrize("case", FOREST_CASES)
def test_one_microbatch_matches_dict_trie(case, seed):
    sequences = forest_case(case, seed)
    forests = pack_forest(sequences, pad_multiple=16)
    assert len(forests) == 1
    _check_forests(sequences, forests, 16, None)
    assert forests[0].num_tree_tokens == trie_node_count(sequences)
    assert forests[0].max_depth == max(len(s) for s in sequences) - 1


@pytest.mark.parametrize("pad_multiple, slack", [(8, 0), (8, 2), (16, 1)], ids=["tight8", "slack8", "slack16"])
@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s}")
@pytest.mark.parametrize("case", FOREST_CASES)
def test_budgeted_packing_matches_dict_trie(case, seed, pad_multiple, slack):
    sequences = forest_case(case, seed)
    budget = _budget(sequences, pad_multiple, slack)
    forests = pack_forest(sequences, max_tokens_per_mb=budget, pad_multiple=pad_multiple)
    _check_forests(sequences, forests, pad_multiple, budget)
    # A trie that fits the budget is never split: all of its sequences share one micro-batch.
    where = {sid: f for f, forest in enumerate(forests) for sid in forest.seq_ids}
    for trie in _tries(sequences):
        if trie_node_count([sequences[i] for i in trie]) <= budget:
            assert len({where[i] for i in trie}) == 1, f"trie {trie} fits {budget} tokens but was split"


def test_several_tries_share_a_microbatch():
    rng = random.Random(0)
    sequences = grpo_groups(rng, groups=6, max_prompt=8, max_completion=6)
    forests = pack_forest(sequences, max_tokens_per_mb=256, pad_multiple=16)
    _check_forests(sequences, forests, 16, 256)
    assert len(forests) < len(_tries(sequences)), "small tries must be bin-packed together"


def test_trie_larger_than_budget_is_split_and_each_piece_exact():
    rng = random.Random(3)
    prompt = [rng.randrange(1, 128) for _ in range(40)]
    sequences = [prompt + [rng.randrange(1, 128) for _ in range(30)] for _ in range(10)]  # 340 unique tokens
    forests = pack_forest(sequences, max_tokens_per_mb=128, pad_multiple=16)
    assert len(forests) >= 3
    _check_forests(sequences, forests, 16, 128)
    for forest in forests:  # every piece carries its own copy of the prompt, and shares it inside the piece
        assert forest.num_tree_tokens == 40 + 30 * len(forest.seq_ids)


def test_deep_multiturn_tree_has_one_level_per_branch_point():
    """A 20-turn agent tree: many levels, each segment's level one more than its parent's."""
    sequences = multiturn(random.Random(7), turns=20)
    (forest,) = pack_forest(sequences, pad_multiple=16)
    _check_forests(sequences, [forest], 16, None)
    parent, level = forest.segment_parent, forest.segment_level
    has_parent = parent >= 0
    assert torch.equal(level[has_parent], level[parent[has_parent]] + 1)
    assert (level[~has_parent] == 0).all()
    assert forest.num_levels >= 20


def test_heavy_subtree_first_keeps_the_history_contiguous():
    """At each branch the child with the most unique tokens comes first: an agent conversation whose sampled side
    branches sort before its continuing history (token 1 < 50) still lays the history out unbroken, so
    FlexAttention's 128-row blocks straddle fewer branch ends than in lexicographic order."""
    rng = random.Random(3)
    history, sequences = [rng.randrange(10, 99) for _ in range(300)], []
    for _ in range(12):
        side = [1] + [rng.randrange(10, 99) for _ in range(rng.randint(20, 60))]
        sequences.append(history + side)
        history = history + [50] + [rng.randrange(10, 99) for _ in range(rng.randint(70, 90))]
    sequences.append(history)
    (forest,) = pack_forest(sequences)
    _check_forests(sequences, [forest], 128, None)
    assert forest.positions(len(sequences) - 1).tolist() == list(range(len(history)))
    arrays = [np.array(s) for s in sequences]
    lexicographic = tree_module._layout(arrays, *tree_module._sorted_with_lcp(arrays), 128)
    assert lexicographic.positions(len(sequences) - 1).tolist() != list(range(len(history)))

    def partial_blocks(f: PackedForest) -> int:
        return int(f.block_mask("cpu").kv_num_blocks.sum())

    assert partial_blocks(forest) < partial_blocks(lexicographic)


def test_identical_sequences_share_every_row():
    seq = [3, 1, 4, 1, 5]
    (forest,) = pack_forest([seq] * 6, pad_multiple=8)
    assert forest.num_tree_tokens == 5 and forest.num_original_tokens == 30
    assert all(forest.positions(k).tolist() == [0, 1, 2, 3, 4] for k in range(6))


def test_dict_trie_oracle_detects_a_wrong_layout():
    """The oracle must reject a layout whose mask lets a branch see its sibling (the test can fail)."""
    sequences = [[5, 6, 7, 8], [5, 6, 9]]
    (forest,) = pack_forest(sequences, pad_multiple=1)
    broken = dataclasses.replace(forest, subtree_end=torch.tensor([5, 5, 5, 4, 5], dtype=torch.int32), _mask_cache={})
    assert not torch.equal(broken.dense_mask()[0, 0], oracle_mask(broken, sequences))
    assert torch.equal(forest.dense_mask()[0, 0], oracle_mask(forest, sequences))


# ----------------------------------------------------------------------------------------------------------------
# tree_token_ratio


@pytest.mark.parametrize("copies", [1, 2, 3, 7, 16])
def test_token_ratio_of_copies(copies):
    seq = list(range(1, 12))
    assert tree_token_ratio([seq] * copies) == pytest.approx(1 / copies, rel=1e-12)


def test_token_ratio_without_sharing():
    assert tree_token_ratio([[1, 2, 3], [2, 3], [3, 1, 2, 5]]) == 1.0


@pytest.mark.parametrize("case", FOREST_CASES)
def test_token_ratio_matches_dict_trie(case):
    sequences = forest_case(case, 0)
    expected = trie_node_count(sequences) / sum(len(s) for s in sequences)
    assert tree_token_ratio(sequences) == pytest.approx(expected, rel=1e-12)


def test_dict_trie_counts_nodes():
    trie = DictTrie()
    assert trie.insert([5, 6, 7]) == [1, 2, 3]
    assert trie.insert([5, 6, 9]) == [1, 2, 4]
    assert trie.insert([5]) == [1]
    assert trie.num_nodes == 4 and trie.ancestors_or_self(4) == [4, 2, 1]


# ----------------------------------------------------------------------------------------------------------------
# Bad inputs: the error names the problem, the value and the fix.


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            dict(max_tokens_per_mb=100),
            ValueError,
            r"max_tokens_per_mb=100 must be a positive multiple of pad_multiple=",
        ),
        (dict(max_tokens_per_mb=200, pad_multiple=64), ValueError, r"use e\.g\. max_tokens_per_mb=256"),
        (dict(max_tokens_per_mb=0), ValueError, r"max_tokens_per_mb=0 must be a positive multiple"),
        (dict(pad_multiple=0), ValueError, r"pad_multiple=0 must be a positive integer"),
        (dict(max_tokens_per_mb="256"), TypeError, r"max_tokens_per_mb='256' is a str; pass an int"),
        (dict(max_tokens_per_mb=True), TypeError, r"max_tokens_per_mb=True is a bool"),
    ],
    ids=["not-multiple", "suggests-fix", "zero-budget", "zero-pad", "string-budget", "bool-budget"],
)
def test_bad_budget(kwargs, error, match):
    with pytest.raises(error, match=match):
        pack_forest([[1, 2, 3]], **kwargs)


def test_sequence_longer_than_budget_names_index_and_length():
    match = r"sequences\[1\] has 300 tokens, more than max_tokens_per_mb=256.*at least 384"
    with pytest.raises(ValueError, match=match):
        pack_forest([[1] * 10, [2] * 300, [3] * 5], max_tokens_per_mb=256)


@pytest.mark.parametrize(
    "sequences, error, match",
    [
        ([], ValueError, r"sequences is empty"),
        ([[1, 2], []], ValueError, r"sequences\[1\] is empty"),
        ([[1, 2], torch.tensor([], dtype=torch.long)], ValueError, r"sequences\[1\] is empty"),
        ([[1.0, 2.0]], TypeError, r"sequences\[0\] holds float64 values.*must be integers"),
        ([[1, 2], [3, 4.5]], TypeError, r"sequences\[1\] holds float64"),
        ([torch.tensor([1.0, 2.0])], TypeError, r"sequences\[0\] has dtype torch\.float32.*must be integers"),
        ([torch.tensor([True, False])], TypeError, r"sequences\[0\] has dtype torch\.bool"),
        ([[1, -100, 3]], ValueError, r"sequences\[0\] holds a negative token id \(-100\)"),
        ([[[1, 2], [3, 4]]], ValueError, r"sequences\[0\] has shape \(2, 2\).*1-D"),
        (torch.tensor([[1, 2, 0], [3, 4, 5]]), TypeError, r"sequences is a tensor.*padded batch"),
        (np.array([[1, 2, 0], [3, 4, 5]]), TypeError, r"sequences is a numpy array of shape \(2, 3\).*padded batch"),
    ],
    ids=[
        "empty-list",
        "zero-length",
        "zero-length-tensor",
        "floats",
        "one-float",
        "float-tensor",
        "bool-tensor",
        "negative",
        "2d-element",
        "padded-2d-tensor",
        "padded-2d-numpy",
    ],
)
def test_bad_sequences(sequences, error, match):
    with pytest.raises(error, match=match):
        pack_forest(sequences)


@pytest.mark.parametrize(
    "sequences, error, match",
    [
        ([], ValueError, r"sequences is empty"),
        ([[1, 2], []], ValueError, r"sequences\[1\] is empty"),
        ([[0.5]], TypeError, r"must be integers"),
        (torch.tensor([[1, 2, 0], [3, 4, 5]]), TypeError, r"sequences is a tensor.*padded batch"),
    ],
    ids=["empty-list", "zero-length", "floats", "padded-2d-tensor"],
)
def test_bad_sequences_token_ratio(sequences, error, match):
    with pytest.raises(error, match=match):
        tree_token_ratio(sequences)


# ----------------------------------------------------------------------------------------------------------------
# The two-level layout (`pack_forest(two_level=...)`): each trie's common prefix once, one branch per sequence.

_TAG = 1 << 20  # above every test token id


def _two_level_sequences(sequences, forests) -> list[list[int]]:
    """The sequences as the two-level layout shares them: inside each forest's trie, tokens after the trie's common
    prefix made unique per sequence (so the dict trie of these is the expected layout)."""
    tagged = [list(s) for s in sequences]
    for forest in forests:
        tries: dict[int, list[int]] = {}
        for sid in forest.seq_ids:
            tries.setdefault(int(sequences[sid][0]), []).append(sid)
        for members in tries.values():
            common = min(len(sequences[m]) for m in members)
            for m in members[1:]:
                common = min(common, next((i for i, (a, b) in enumerate(zip(sequences[members[0]], sequences[m]))
                                           if a != b), common))  # fmt: skip
            for m in members:
                tagged[m] = list(sequences[m][:common]) + [t + (m + 1) * _TAG for t in sequences[m][common:]]
    return tagged


@pytest.mark.parametrize("budgeted", [False, True])
@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s}")
@pytest.mark.parametrize("case", FOREST_CASES)
def test_two_level_layout_matches_its_oracle(case, seed, budgeted):
    sequences = forest_case(case, seed)
    budget = _budget(sequences, 16, 1) if budgeted else None
    forests = pack_forest(sequences, max_tokens_per_mb=budget, pad_multiple=16, two_level=True)
    tagged = _two_level_sequences(sequences, forests)
    assert sorted(sid for f in forests for sid in f.seq_ids) == list(range(len(sequences)))
    for forest in forests:
        assert forest.prefix_plan is not None  # two-level, whatever the sharing
        assert budget is None or forest.seq_len <= budget
        members = [tagged[sid] for sid in forest.seq_ids]
        assert forest.num_tree_tokens == trie_node_count(members)
        for k, sid in enumerate(forest.seq_ids):
            pos = forest.positions(k)
            assert forest.input_ids[0, pos].tolist() == list(sequences[sid])
            assert forest.position_ids[0, pos].tolist() == list(range(len(sequences[sid])))
        assert torch.equal(forest.dense_mask()[0, 0], oracle_mask(forest, tagged))
        starts, parents, levels = oracle_segments(forest, tagged)
        assert forest.segment_starts.tolist() == starts and forest.segment_parent.tolist() == parents
        assert max(levels) <= 1


def _stemmed_groups(rng: random.Random, prompt: int, completions: int, stems: list[list[int]]) -> list[list[int]]:
    """One prompt, completions that start with one of a few short stems (as sampled completions often do)."""
    p = [rng.randrange(1, 1000) for _ in range(prompt)]
    return [p + rng.choice(stems) + [rng.randrange(1, 1000) for _ in range(200)] for _ in range(completions)]


def test_two_level_by_default_where_it_repeats_little_and_pays(monkeypatch):
    """Default (`two_level=None`): a long prompt whose completions share short stems is laid out two-level (0.2% of
    the tokens repeated, a forest the kernels run faster); a deep agent tree, a budget the repeats would break, and
    the kernels switched off keep the plain trie."""
    import hf_tree_attn.prefix_attention

    rng = random.Random(0)
    grpo = _stemmed_groups(rng, 8192, 16, [[1, 2], [1, 3], [4]])
    (plain,) = pack_forest(grpo, two_level=False)
    (default,) = pack_forest(grpo)
    assert plain.prefix_plan is None and default.prefix_plan is not None and default.prefix_fast_on_cuda
    assert plain.num_tree_tokens < default.num_tree_tokens <= 1.01 * plain.num_tree_tokens
    agent = multiturn(random.Random(1), turns=20)
    assert pack_forest(agent)[0].num_tree_tokens == pack_forest(agent, two_level=False)[0].num_tree_tokens
    (plain8,) = pack_forest(grpo, pad_multiple=8, two_level=False)
    assert default.num_tree_tokens - plain8.num_tree_tokens >= 8  # the repeats cross an 8-token block:
    tight = pack_forest(grpo, max_tokens_per_mb=plain8.seq_len, pad_multiple=8)  # a budget that fits only the trie
    assert len(tight) == 1 and tight[0].prefix_plan is None
    monkeypatch.setattr(hf_tree_attn.prefix_attention, "MODE", "never")
    assert pack_forest(grpo)[0].prefix_plan is None
