"""Tree masks: the dense mask, the `mask_mod` and the compiled `BlockMask` against the dict-trie oracle."""

from __future__ import annotations

import pytest
import torch
from helpers import FOREST_CASES, forest_case, oracle_mask
from torch.nn.attention.flex_attention import create_mask
from transformers.masking_utils import chunked_causal_mask_function, sliding_window_causal_mask_function

import hf_tree_attn.masks
from hf_tree_attn import pack_forest
from hf_tree_attn.masks import MaskTag, dense_tree_mask, mask_function_key, mask_tag, tree_mask_mod


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


# ----------------------------------------------------------------------------------------------------------------
# Layer-kind masks: the model's own flat mask function read at depths, on top of ancestor-or-self.


def _depth_oracle(forest, sequences, allowed) -> torch.Tensor:
    """The dict-trie mask, keeping a pair only if `allowed(depth_q, depth_kv)`; padding rows see themselves."""
    mask = oracle_mask(forest, sequences)
    depth = forest.position_ids[0].tolist()
    for q, kv in torch.nonzero(mask).tolist():
        if q != kv and not allowed(depth[q], depth[kv]):
            mask[q, kv] = False
    return mask


@pytest.mark.parametrize("window", [1, 3, 8])
@pytest.mark.parametrize("case", FOREST_CASES)
def test_sliding_window_mask_equals_brute_force(case, window):
    """q sees kv iff kv is an ancestor-or-self fewer than `window` depths up (transformers' `kv > q - window`)."""
    sequences = forest_case(case, 0)
    (forest,) = pack_forest(sequences, pad_multiple=16)
    source = hf_tree_attn.masks.TreeMaskSource(
        forest.subtree_end, forest.position_ids[0], forest.seq_offsets.diff(), {}, dense=True
    )
    got = source.mask(sliding_window_causal_mask_function(window))[0, 0]
    assert torch.equal(got, _depth_oracle(forest, sequences, lambda dq, dkv: dq - dkv < window))
    assert got.any(-1).all(), "no row of the softmax may be empty"


@pytest.mark.parametrize("chunk", [1, 4])
@pytest.mark.parametrize("case", ["grpo", "multiturn", "mixed"])
def test_chunked_mask_equals_brute_force(case, chunk):
    """Llama 4's chunked attention on a tree: ancestors-or-self in the same chunk of depths."""
    sequences = forest_case(case, 1)
    (forest,) = pack_forest(sequences, pad_multiple=16)
    source = hf_tree_attn.masks.TreeMaskSource(
        forest.subtree_end, forest.position_ids[0], forest.seq_offsets.diff(), {}, dense=True
    )
    got = source.mask(chunked_causal_mask_function(chunk, torch.zeros(1, dtype=torch.long)))[0, 0]
    assert torch.equal(got, _depth_oracle(forest, sequences, lambda dq, dkv: dq // chunk == dkv // chunk))


def test_window_block_mask_on_cpu_equals_dense():
    long_chain = [(7 * i) % 120 + 3 for i in range(400)]  # a window of 5 skips whole 128-blocks of it
    sequences = forest_case("mixed", 0) + [long_chain, long_chain[:300] + [5, 6]]
    (forest,) = pack_forest(sequences)
    window = sliding_window_causal_mask_function(5)
    args = (forest.subtree_end, forest.position_ids[0], forest.seq_offsets.diff(), {})
    dense = hf_tree_attn.masks.TreeMaskSource(*args, dense=True).mask(window)
    block = hf_tree_attn.masks.TreeMaskSource(*args, dense=False).mask(window)
    size = forest.seq_len
    assert torch.equal(create_mask(block.mask_mod, 1, 1, size, size, device="cpu"), dense)
    assert block.sparsity() > forest.block_mask("cpu").sparsity(), "the window skips blocks the tree mask computes"


def test_layer_masks_are_cached_per_kind_and_tagged():
    (forest,) = pack_forest(forest_case("grpo", 0), pad_multiple=8)
    carrier = forest.attention_mask("cpu")
    source = mask_tag(carrier).source
    # Models build fresh closures every forward: the same window is one cached mask, another window another one.
    first = source.mask(sliding_window_causal_mask_function(4))
    assert source.mask(sliding_window_causal_mask_function(4)) is first
    assert source.mask(sliding_window_causal_mask_function(5)) is not first
    assert mask_function_key(sliding_window_causal_mask_function(4)) != mask_function_key(
        sliding_window_causal_mask_function(5)
    )
    assert mask_tag(first) == MaskTag("layer", source)
    # The plain tree mask of a causal layer is tagged as a layer mask, not shared with the hand-fed `dense_mask()`.
    causal = source.mask(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx)
    assert torch.equal(causal, forest.dense_mask()) and causal is not forest.dense_mask()
    assert mask_tag(forest.dense_mask()).role == "full"


def test_forest_attention_mask_is_recognised_through_views_only():
    (forest,) = pack_forest([[1, 2, 3], [1, 2, 4]], pad_multiple=8)
    carrier = forest.attention_mask("cpu")
    assert carrier.shape == (1, forest.seq_len) and carrier.dtype == torch.bool and bool(carrier.all())
    assert forest.attention_mask() is carrier and forest.to("cpu").attention_mask("cpu") is carrier
    tag = mask_tag(carrier)
    assert tag.role == "carrier" and mask_tag(carrier.view(1, -1)) == tag
    assert mask_tag(carrier.clone()) is None, "a copy is an ordinary padding mask"
    assert mask_tag(torch.ones(1, forest.seq_len, dtype=torch.bool)) is None
    assert forest.attention_mask("cpu", dense=False) is not carrier  # BlockMasks on request, another source
