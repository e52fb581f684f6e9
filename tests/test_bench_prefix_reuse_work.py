"""`benchmarks/prefix_reuse_work.py`: the FLOPs each layout executes, against row-by-row sums of
`hf_tree_attn.metrics.estimate_row_flops` over what each layout forwards."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from transformers import Qwen3Config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import prefix_reuse_work as work  # noqa: E402

from hf_tree_attn.metrics import estimate_row_flops  # noqa: E402

CONFIG = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=256)  # fmt: skip


def _tries(alone: int = 1):
    """Two sequences of 100 tokens sharing 60 (140 unique rows), and `alone` tries of 90 tokens on their own."""
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 200, 60).tolist()
    pair = [shared + rng.integers(3, 200, 40).tolist() for _ in range(2)]
    return pair + [[1 + i] + rng.integers(3, 200, 89).tolist() for i in range(alone)]


def _forward(depths) -> float:
    return sum(estimate_row_flops(CONFIG, np.asarray(depths)))


def test_split_repeats_the_shared_prefix_in_each_micro_batch():
    # budget 128: the two 100-token sequences (140 unique rows) go to two micro-batches, each forwarding the 60 shared
    # rows; the third fits beside neither
    result = work.executed_flops(CONFIG, _tries(), 128, checkpointing="none")
    assert result["split"]["forwarded_rows"] == 100 + 100 + 90
    assert result["split"]["flops"] == pytest.approx(3 * (2 * _forward(range(100)) + _forward(range(90))))
    assert result["reuse_kept"]["forwarded_rows"] == 140 + 90


@pytest.mark.parametrize(("alone", "budget"), [(1, 256), (1, 128), (3, 128)])  # 1, 2 and 4 chunks
def test_chunks_forward_every_row_once_and_recompute_all_but_the_last(alone, budget):
    depths = [*range(100), *range(60, 100)] + [*range(90)] * alone  # the forest's rows, in DFS order
    for checkpointing, extra in (("none", 0), ("all", 1)):
        result = work.executed_flops(CONFIG, _tries(alone), budget, checkpointing=checkpointing)
        layers, head = estimate_row_flops(CONFIG, np.asarray(depths))
        # every row once, forward and backward, each layer once more where it is checkpointed
        assert result["reuse_kept"]["flops"] == pytest.approx(layers * (3 + extra) + head * 3)
        # the chunks before the last are forwarded once more (head included) in the backward
        last = len(depths) - (len(depths) - 1) // budget * budget
        assert result["reuse"]["flops"] - result["reuse_kept"]["flops"] == pytest.approx(_forward(depths[:-last]))
