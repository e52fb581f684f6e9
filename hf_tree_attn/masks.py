"""The tree attention mask: token `q` sees token `kv` iff `kv <= q < subtree_end[kv]` (ancestor or self).

Metadata is one int per token (`subtree_end`, see `hf_tree_attn.tree`). Two materialisations:

- `tree_block_mask`: a FlexAttention `BlockMask` built by a *compiled* `create_block_mask` (the eager one
  materialises the dense S×S mask), made once per micro-batch and shared by every layer and the recompute pass;
- `dense_tree_mask`: a `(1, 1, S, S)` bool tensor for SDPA — the CPU path (FlexAttention has no CPU backward)
  and the oracle the block mask is tested against.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

__all__ = ["dense_tree_mask", "tree_block_mask", "tree_mask_mod"]

_compiled_create_block_mask = None


def tree_mask_mod(subtree_end: torch.Tensor):
    """FlexAttention `mask_mod(b, h, q_idx, kv_idx)` for the forest whose `subtree_end` is `(S,)` int."""

    def tree_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < subtree_end[kv_idx])

    return tree_mask


def dense_tree_mask(subtree_end: torch.Tensor) -> torch.Tensor:
    """Token-level mask `(1, 1, S, S)` bool from `subtree_end` `(S,)`; True where attention is allowed."""
    idx = torch.arange(subtree_end.shape[0], device=subtree_end.device)
    q, kv = idx[:, None], idx[None, :]
    return ((kv <= q) & (q < subtree_end[None, :].long()))[None, None]


def tree_block_mask(subtree_end: torch.Tensor, block_size: int = 128) -> BlockMask:
    """`BlockMask` `(1, 1, S, S)` for the forest whose `subtree_end` is `(S,)` int, on `subtree_end.device`."""
    global _compiled_create_block_mask
    if _compiled_create_block_mask is None:
        _compiled_create_block_mask = torch.compile(create_block_mask, dynamic=True)
    seq_len = subtree_end.shape[0]
    return _compiled_create_block_mask(
        tree_mask_mod(subtree_end), None, None, seq_len, seq_len, device=subtree_end.device, BLOCK_SIZE=block_size
    )
