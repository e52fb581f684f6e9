"""`benchmarks/attention_gathered_paths.py`: FlexAttention's tile use on a forest (`tile_use`), against the blocks
of the dense tree mask counted one by one."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import attention_gathered_paths as bench  # noqa: E402

import hf_tree_attn  # noqa: E402


def _blocks_of_the_dense_mask(forest, block: int) -> dict:
    rows = forest.num_tree_tokens
    mask = forest.dense_mask()[0, 0, :rows, :rows]
    full = partial = useful = 0
    for q0 in range(0, rows, block):
        for k0 in range(0, rows, block):
            tile = mask[q0 : q0 + block, k0 : k0 + block]
            count = int(tile.sum())
            useful += count
            full += count == tile.numel()
            partial += 0 < count < tile.numel()
    return {"block": block, "full": full, "partial": partial, "useful": useful / ((full + partial) * block * block)}


@pytest.mark.parametrize("workload", ["grpo", "agent", "deep"])
@pytest.mark.parametrize("block", [16, 128])
def test_tile_use_counts_the_dense_masks_blocks(workload, block):
    rng = random.Random(workload)
    seqs = {
        "grpo": lambda: bench.grpo_forest(rng, 2, 0.05),
        "agent": lambda: bench.agent_forest(rng, 0.05),
        "deep": lambda: [[1, 2, 3], [1, 2, 4], [1, 5], [1, 2, 3, 6, 7], [8]],
    }[workload]()
    (forest,) = hf_tree_attn.pack_forest(seqs)
    got = bench.tile_use(forest, block)
    want = _blocks_of_the_dense_mask(forest, block)
    assert got == pytest.approx(want)
    assert got["partial"] > 0 and 0 < got["useful"] < 1
