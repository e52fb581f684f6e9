"""TargetPlan against a brute-force construction from the per-sequence token lists."""

import pytest
import torch

from hf_tree_attn.targets import IGNORE_INDEX, TargetPlan, expanded_index
from hf_tree_attn.tree import pack_forest

# The tiny example of hf_tree_attn.tree and hf_tree_attn.targets.
TINY = [[5, 6, 7, 8], [5, 6, 9]]

CASES = {
    "tiny": TINY,
    "identical": [[3, 4, 5], [3, 4, 5], [3, 4, 5, 6]],
    "prefix_of_another": [[7, 8], [7, 8, 9, 10], [7, 8, 9]],
    "one_token": [[4], [4, 5], [9], [9]],
    "several_trees": [[1, 2, 3], [1, 2, 4], [5, 6], [5, 7, 8], [9, 10, 11, 12], [1, 2, 3, 3]],
}


def _oracle(sequences, forest, scored):
    """Entries `(seq_index, position, row, target, token_row)` by loops over each sequence's own tokens: token `t` of
    sequence `i` is predicted by the row of token `t - 1` (found by walking the forest's rows, not its positions)."""
    entries = []
    for i in forest.seq_ids:
        seq = sequences[i]
        rows = _walk(forest, seq)
        for t in range(1, len(seq)):
            if scored(i, t):
                entries.append((i, t, rows[t - 1], seq[t], rows[t]))
    return entries


def _walk(forest, seq):
    """The forest rows of `seq`'s tokens, found from the root by `parent` and the tokens alone (a plain trie holds
    one row per distinct prefix)."""
    parent, tokens = forest.parent.tolist(), forest.input_ids[0].tolist()
    rows, previous = [], -1
    for token in seq:
        (row,) = [r for r in range(forest.num_tree_tokens) if parent[r] == previous and tokens[r] == token]
        rows.append(row)
        previous = row
    return rows


def _as_tuples(plan):
    return list(
        zip(
            plan.seq_index.tolist(),
            plan.position.tolist(),
            plan.rows.tolist(),
            plan.targets.tolist(),
            plan.token_rows.tolist(),
        )
    )


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("budget", [None, 8], ids=["one-forest", "several-forests"])
def test_next_tokens_match_the_per_sequence_oracle(name, budget):
    sequences = CASES[name]
    for forest in pack_forest(sequences, max_tokens_per_mb=budget, pad_multiple=4, two_level=False):
        plan = TargetPlan.next_tokens(forest)
        assert _as_tuples(plan) == _oracle(sequences, forest, lambda i, t: True)
        assert plan.split(plan.targets)[0].tolist() == sequences[forest.seq_ids[0]][1:]
        assert [len(v) for v in plan.split(plan.position)] == [len(sequences[i]) - 1 for i in forest.seq_ids]
        assert TargetPlan.next_tokens(forest) is plan  # built once per forest
        assert TargetPlan.next_tokens(forest.to("cpu")) is plan  # and shared by its copies


def test_a_two_level_layout_reads_each_sequences_own_rows():
    """Completions that start alike, laid out as prompt + one branch each: a repeated token predicts from the
    sequence's own copy of the row before it."""
    sequences = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6]]
    (forest,) = pack_forest(sequences, two_level=True)
    assert forest.num_tree_tokens > len({tuple(s[:t]) for s in sequences for t in range(1, len(s) + 1)})
    plan = TargetPlan.next_tokens(forest)
    want = [
        (i, t, int(forest.positions(k)[t - 1]), sequences[i][t], int(forest.positions(k)[t]))
        for k, i in enumerate(forest.seq_ids)
        for t in range(1, len(sequences[i]))
    ]
    assert _as_tuples(plan) == want
    assert (forest.parent[plan.token_rows] == plan.rows).all()


def test_tiny_example_of_the_docstring():
    (forest,) = pack_forest(TINY)
    plan = TargetPlan.next_tokens(forest)
    assert plan.seq_index.tolist() == [0, 0, 0, 1, 1]
    assert plan.position.tolist() == [1, 2, 3, 1, 2]
    assert plan.rows.tolist() == [0, 1, 2, 0, 1]
    assert plan.targets.tolist() == [6, 7, 8, 6, 9]
    assert plan.token_rows.tolist() == [1, 2, 3, 1, 4]
    pair_rows, pair_targets, pair_of_entry = plan.pairs
    assert list(zip(pair_rows.tolist(), pair_targets.tolist())) == [(0, 6), (1, 7), (1, 9), (2, 8)]
    assert pair_of_entry.tolist() == [0, 1, 3, 0, 2]
    assert plan.scored_rows.tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize("name", CASES)
def test_completions_score_the_tokens_after_each_prompt(name):
    sequences = CASES[name]
    prompt_lengths = torch.tensor([min(2, len(s)) for s in sequences])
    prompt_lengths[0] = 0  # an empty prompt still leaves the first token unscored
    (forest,) = pack_forest(sequences, two_level=False)
    plan = TargetPlan.completions(forest, prompt_lengths)
    assert _as_tuples(plan) == _oracle(sequences, forest, lambda i, t: t >= prompt_lengths[i])


@pytest.mark.parametrize("name", CASES)
def test_a_mask_and_labels_select_and_rename_targets(name):
    sequences = CASES[name]
    (forest,) = pack_forest(sequences, two_level=False)
    seq_of, token_index = expanded_index(forest)
    scored = (token_index % 2 == 1).tolist()
    masked = TargetPlan.next_tokens(forest, torch.tensor(scored))
    assert _as_tuples(masked) == _oracle(sequences, forest, lambda i, t: t % 2 == 1)

    # Labels that differ from the tokens: no row holds such a target, so it is read by pairs only.
    tokens = forest.input_ids[0, forest.seq_positions]
    labels = torch.where(token_index % 2 == 1, tokens + 100, IGNORE_INDEX)
    renamed = TargetPlan.from_labels(forest, labels)
    want = [(i, t, row, target + 100, -1) for i, t, row, target, _ in _oracle(sequences, forest, lambda i, t: t % 2)]
    assert _as_tuples(renamed) == want
    if len(renamed):
        with pytest.raises(ValueError, match="not their sequence's next token"):
            renamed.read(torch.zeros(forest.seq_len))


def test_shift_labels_may_score_past_a_sequences_end():
    (forest,) = pack_forest(TINY)
    shift = torch.full((7,), IGNORE_INDEX)
    shift[3], shift[5] = 42, 9  # after token 8 (the end of sequence 0), and token 6 of sequence 1 -> its own 9
    plan = TargetPlan.from_shift_labels(forest, shift)
    assert _as_tuples(plan) == [(0, 4, 3, 42, -1), (1, 2, 1, 9, 4)]
    with pytest.raises(ValueError, match="expanded layout"):
        TargetPlan.from_shift_labels(forest, shift[:-1])


def test_read_and_split_scatter_a_per_row_table_to_each_sequence():
    sequences = CASES["several_trees"]
    (forest,) = pack_forest(sequences, two_level=False)
    table = torch.arange(forest.seq_len, dtype=torch.float32) * 10
    plan = TargetPlan.next_tokens(forest)
    per_sequence = plan.split(plan.read(table))
    for k, i in enumerate(forest.seq_ids):
        assert per_sequence[k].tolist() == (table[forest.positions(k)[1:]]).tolist(), i
    with pytest.raises(ValueError, match="entries"):
        plan.split(table)
