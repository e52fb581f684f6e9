"""Prefix reuse: one forest per step, run in chunks of a token budget (`hf_tree_attn.chunked`)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import DictTrie, forest_case

from hf_tree_attn import pack_forest
from hf_tree_attn.chunked import plan_chunks

# ----------------------------------------------------------------------------------------------------------------
# The plan


def test_plan_of_the_docstring_example():
    (forest,) = pack_forest([[5, 6, 7, 8], [5, 6, 9]], pad_multiple=8)
    plan = plan_chunks(forest, 2)
    assert plan.bounds.tolist() == [0, 2, 4, 5]
    assert [c.tolist() for c in plan.context] == [[], [0, 1], [0, 1]]
    assert [s.tolist() for s in plan.scored] == [[1, 2, 4], [3], []]
    assert plan.kept_rows.tolist() == [0, 1] and plan.slot.tolist() == [0, 1, -1, -1, -1]
    assert plan.needed.tolist() == [True, True, False]
    assert plan.forwarded_rows == 4
    assert plan.kept_kv_bytes(layers=3, kv_heads=2, head_dim=16, bytes_per_value=2) == 2 * 3 * 2 * 2 * 16 * 2


@pytest.mark.parametrize("chunk_rows", [1, 3, 16, 1000])
@pytest.mark.parametrize("case", ["mixed", "multiturn", "prefix"])
def test_plan_matches_the_dict_trie(case, chunk_rows):
    """Each chunk's context is the set of rows of earlier chunks some row of it descends from (walked up the dict
    trie), every row with a parent is scored once, by the chunk of its parent, and the kept rows are the contexts."""
    sequences = forest_case(case, seed=2) + forest_case(case, seed=3)
    (forest,) = pack_forest(sequences, two_level=False)
    n = forest.num_tree_tokens
    plan = plan_chunks(forest, chunk_rows)
    trie, row_node = DictTrie(), {}
    for k, sid in enumerate(forest.seq_ids):
        row_node.update(zip(forest.positions(k).tolist(), trie.insert(sequences[sid])))
    node_row = {node: row for row, node in row_node.items()}
    assert plan.bounds[0] == 0 and plan.bounds[-1] == n and (np.diff(plan.bounds) <= chunk_rows).all()
    scored_by = {}
    for c in range(plan.num_chunks):
        a, b = plan.bounds[c], plan.bounds[c + 1]
        seen = {node_row[x] for g in range(a, b) for x in trie.ancestors_or_self(row_node[g]) if node_row[x] < a}
        assert plan.context[c].tolist() == sorted(seen), f"chunk {c}"
        for t in plan.scored[c].tolist():
            assert a <= node_row[trie.parent[row_node[t]]] < b
            scored_by[t] = c
    assert sorted(scored_by) == [r for r in range(n) if trie.parent[row_node[r]] != 0]
    kept = sorted(set().union(*[set(c.tolist()) for c in plan.context]))
    assert plan.kept_rows.tolist() == kept
    assert (plan.slot[plan.kept_rows] == np.arange(len(kept))).all() and (plan.slot >= 0).sum() == len(kept)
    holds = [bool((plan.slot[plan.bounds[c] : plan.bounds[c + 1]] >= 0).any()) for c in range(plan.num_chunks)]
    assert plan.needed.tolist() == [len(s) > 0 or h for s, h in zip(plan.scored, holds)]


def test_plan_refuses_a_bad_chunk_size():
    (forest,) = pack_forest([[5, 6, 7]])
    with pytest.raises(ValueError, match=r"chunk_rows=0 must be a positive int"):
        plan_chunks(forest, 0)
