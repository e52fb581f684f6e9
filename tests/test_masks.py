"""Tree masks: the dense mask, the `mask_mod` and the compiled `BlockMask` against the dict-trie oracle."""

from __future__ import annotations

import pytest
import torch
from helpers import FOREST_CASES, forest_case, oracle_mask
from torch.nn.attention.flex_attention import create_mask

import hf_tree_attn.masks
from hf_tree_attn import pack_forest
from hf_tree_attn.masks import dense_tree_mask, tree_mask_mod


@pytest.mark.parametrize("seed", [0, 1], ids=lambda s: f"seed{s}")
@pytest.mark.parametrize("case", FOREST_CASES)
def test_dense_mask_equals_brute_force(case, seed):
    sequences = forest_case(case, seed)
    for forest in pack_forest(sequences, max_tokens_per_mb=128, pad_multiple=16):
        dense = dense_tree_mask(forest.subtree_end)
        assert dense.shape == (1, 1, forest.seq_len, forest.seq_len) and dense.dtype == torch.bool
        assert torch.equal(dense[0, 0], oracle_mask(forest, sequences))
        assert dense[0, 0].any(-1).all(), "no row of the softmax may be empty"


@pytest.mark.parametrize("case", FOREST_CASES)
def test_mask_mod_on_every_pair_equals_dense(case):
    (forest,) = pack_forest(forest_case(case, 0), pad_multiple=16)
    size = forest.seq_len
    mask_mod = tree_mask_mod(forest.subtree_end)
    q, kv = torch.arange(size)[:, None], torch.arange(size)[None, :]
    every_pair = mask_mod(torch.tensor(0), torch.tensor(0), q, kv)
    assert torch.equal(every_pair, forest.dense_mask()[0, 0])
    # The same closure through FlexAttention's own (vmapped) evaluation.
    assert torch.equal(create_mask(mask_mod, 1, 1, size, size, device="cpu"), forest.dense_mask())


def test_block_mask_on_cpu_matches_dense_and_block_structure():
    """Builds one compiled `BlockMask` on CPU (a few seconds) and checks it token- and block-wise."""
    sequences = forest_case("mixed", 0) + forest_case("mixed", 1)
    (forest,) = pack_forest(sequences)  # pad_multiple=128
    size, block = forest.seq_len, 128
    assert size >= 3 * block, "needs several blocks to test the block structure"
    bm = forest.block_mask("cpu")
    assert bm.shape == (1, 1, size, size)
    dense = forest.dense_mask()[0, 0]
    assert torch.equal(create_mask(bm.mask_mod, 1, 1, size, size, device="cpu")[0, 0], dense)

    blocks = dense.view(size // block, block, size // block, block).permute(0, 2, 1, 3)  # (qb, kvb, block, block)
    any_true, all_true = blocks.any(-1).any(-1), blocks.all(-1).all(-1)
    for qb in range(size // block):
        partial = set(bm.kv_indices[0, 0, qb, : bm.kv_num_blocks[0, 0, qb]].tolist())
        full = set(bm.full_kv_indices[0, 0, qb, : bm.full_kv_num_blocks[0, 0, qb]].tolist())
        assert not partial & full
        assert partial | full == set(torch.nonzero(any_true[qb]).flatten().tolist()), f"q block {qb}"
        assert full == set(torch.nonzero(all_true[qb]).flatten().tolist()), f"q block {qb}: full blocks"
    assert bm.sparsity() > 0  # the tree skips blocks a causal mask would compute

    # Cached per device: the same object again, also through `.to()` (which keeps the cache).
    assert forest.block_mask(torch.device("cpu")) is bm
    assert forest.to("cpu").block_mask("cpu") is bm
    assert forest.attention_mask("cpu").dtype == torch.bool  # off CUDA the dense mask is used


def test_block_mask_is_built_once_per_device(monkeypatch):
    built = []

    def fake_tree_block_mask(subtree_end):
        built.append(subtree_end.device)
        return object()

    monkeypatch.setattr(hf_tree_attn.masks, "tree_block_mask", fake_tree_block_mask)
    (forest,) = pack_forest([[1, 2, 3], [1, 2, 4]], pad_multiple=8)
    cpu = forest.block_mask("cpu")
    assert forest.block_mask() is cpu and forest.block_mask(torch.device("cpu")) is cpu
    meta = forest.block_mask("meta")
    assert meta is not cpu and forest.block_mask("meta") is meta
    assert built == [torch.device("cpu"), torch.device("meta")]
