"""Cut one forest's DFS row into consecutive chunks that run one after another: each shared prefix computed once.

`pack_forest` fits a step into micro-batches by cutting tries between sequences, and each part repeats the prefix it
still needs. Instead, the whole step can be laid out as one forest (N rows, possibly many times a forward's token
budget) and its DFS row cut into consecutive chunks of at most `chunk_rows` rows, `[a_c, b_c)`. A token of chunk
`c` attends to a row of an earlier chunk only if that row is its ancestor, and every such row is an ancestor of
`a_c` too: a subtree is a contiguous range of rows, so an ancestor `kv < a_c` of a row `g >= a_c` has `a_c` inside
its subtree as well. So chunk `c` needs, per attention layer, the keys and values of its **context rows**: the
ancestors of `a_c` (`kv < a_c` with `subtree_end[kv] > a_c`, the root path above the boundary, at most
`depth(a_c)` rows). A row `g` of the chunk sees context row `r` iff `subtree_end[r] > g` (and, in a sliding-window
layer, fewer than `window` depths up). The token at row `t` is scored by the chunk holding its parent row: the
parent's hidden state predicts it.

The tiny example of `hf_tree_attn.tree` (`[[5, 6, 7, 8], [5, 6, 9]]`) with `chunk_rows = 2`::

    row          0  1  2  3  4        chunk  rows    context  scores rows  runs
    token        5  6  7  8  9          0    [0, 2)     -      1 2 4        yes
    parent      -1  0  1  2  1          1    [2, 4)    0 1     3            yes
    subtree_end  5  5  4  4  5          2    [4, 5)    0 1     -            no: a leaf, nothing to score or keep

    kept rows (context of a later chunk): [0, 1]      slot = [0, 1, -1, -1, -1]

Every row is forwarded once (no prefix repeated), except the rows of chunks that score no token (only leaves: such a
chunk holds no row a later chunk reads either), which need no forward at all. What the chunks share costs memory
instead: the keys and values of the kept rows, per attention layer, from the chunk that computes them until the
last chunk that reads them (`ChunkPlan.kept_kv_bytes`). `hf_tree_attn.prefix_reuse` runs a plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .tree import PackedForest

__all__ = ["ChunkPlan", "plan_chunks"]


@dataclass(frozen=True)
class ChunkPlan:
    """How one forest's real rows run as consecutive chunks (see the module docstring).

    Attributes:
        bounds: `(C + 1,)` int64 — chunk `c` is rows `[bounds[c], bounds[c + 1])`; `bounds[-1]` is the forest's
            `num_tree_tokens`.
        context: `C` arrays `(P_c,)` int64 — the rows of earlier chunks that chunk `c` attends to (the ancestors of
            its first row), ascending.
        scored: `C` arrays `(E_c,)` int64 — the rows whose token chunk `c` scores (their parent row is in it),
            ascending.
        kept_rows: `(K,)` int64 — rows some later chunk attends to (the union of the contexts), ascending.
        slot: `(N,)` int64 — index of each row in `kept_rows`, -1 for a row no later chunk reads.
        needed: `(C,)` bool — whether chunk `c` scores a token (only such a chunk can hold a kept row); the others
            need no forward.
    """

    bounds: np.ndarray
    context: tuple[np.ndarray, ...]
    scored: tuple[np.ndarray, ...]
    kept_rows: np.ndarray
    slot: np.ndarray
    needed: np.ndarray

    @property
    def num_chunks(self) -> int:
        return len(self.bounds) - 1

    @property
    def num_rows(self) -> int:
        """Real rows of the forest (its unique tokens)."""
        return int(self.bounds[-1])

    @property
    def forwarded_rows(self) -> int:
        """Rows the chunks that run forward (padding excluded): the unique tokens, less the chunks not needed."""
        sizes = np.diff(self.bounds)
        return int(sizes[self.needed].sum())

    def kept_kv_bytes(self, layers: int, kv_heads: int, head_dim: int, bytes_per_value: int) -> int:
        """Bytes of the kept keys and values: `len(kept_rows) * layers * 2 * kv_heads * head_dim * bytes_per_value`.

        Held from the forward of the chunk that computes a row until the backward; the backward holds their
        gradients beside them, in float32 (`hf_tree_attn.prefix_reuse`).
        """
        return len(self.kept_rows) * layers * 2 * kv_heads * head_dim * bytes_per_value


def plan_chunks(forest: PackedForest, chunk_rows: int) -> ChunkPlan:
    """Cut the real rows of `forest` into consecutive chunks of at most `chunk_rows` rows (see the module docstring).

    Args:
        forest: the whole step as one forest (`pack_forest(sequences, two_level=False)`: a plain trie, every shared
            token once).
        chunk_rows: most rows of one chunk (one forward), >= 1.

    Returns:
        The `ChunkPlan`; the last chunk may be shorter.
    """
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, (int, np.integer)) or chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows!r} must be a positive int (the rows of one forward, e.g. 4096).")
    num_rows = forest.num_tree_tokens
    end = forest.subtree_end[:num_rows].cpu().numpy().astype(np.int64)
    parent = forest.parent[:num_rows].cpu().numpy().astype(np.int64)
    bounds = np.append(np.arange(0, num_rows, chunk_rows, dtype=np.int64), num_rows)
    num_chunks = len(bounds) - 1
    # Ancestors of each chunk's first row: the rows before it whose subtree reaches past it.
    context = tuple(np.flatnonzero(end[:a] > a).astype(np.int64) for a in bounds[:-1])
    kept_rows = np.unique(np.concatenate(context)) if num_chunks else np.zeros(0, dtype=np.int64)
    slot = np.full(num_rows, -1, dtype=np.int64)
    slot[kept_rows] = np.arange(len(kept_rows), dtype=np.int64)

    rows = np.flatnonzero(parent >= 0)
    scorer = np.searchsorted(bounds, parent[rows], side="right") - 1  # the chunk holding each parent
    order = np.argsort(scorer, kind="stable")  # rows stay ascending within a chunk
    cuts = np.searchsorted(scorer[order], np.arange(num_chunks + 1))
    scored = tuple(rows[order[cuts[c] : cuts[c + 1]]] for c in range(num_chunks))

    # A kept row is an ancestor of a later chunk's first row, so its child on that path is scored where it is: a
    # chunk that scores nothing holds no kept row either, and its forward would feed nothing.
    needed = np.array([len(s) > 0 for s in scored], dtype=bool)
    return ChunkPlan(bounds, context, scored, kept_rows, slot, needed)
