"""Pack token sequences that share prefixes into prefix tries laid out in depth-first preorder.

The tiny example used throughout the package (and as a test fixture) — two completions of one prompt::

    sequences = [[5, 6, 7, 8], [5, 6, 9]]

    trie            DFS row (S = 5, no padding)        ancestor-or-self mask (q rows, kv columns)
                    row        0  1  2  3  4                  kv 0 1 2 3 4
      5             token      5  6  7  8  9               q 0  ■ ⬚ ⬚ ⬚ ⬚
      |             depth      0  1  2  3  2                 1  ■ ■ ⬚ ⬚ ⬚
      6             parent    -1  0  1  2  1                 2  ■ ■ ■ ⬚ ⬚
     / \\            subtree_end 5  5  4  4  5                 3  ■ ■ ■ ■ ⬚
    7   9                                                    4  ■ ■ ⬚ ⬚ ■
    |
    8               positions(0) = [0, 1, 2, 3]   positions(1) = [0, 1, 4]

Token ``q`` may attend to token ``kv`` iff ``kv <= q < subtree_end[kv]``. ``position_ids`` is the depth, so
RoPE sees exactly the positions of the unpacked sequence.

For layers that carry a state from token to token (gated delta rule, Mamba-2, short convolutions) the rows also
split into **segments**: maximal runs of DFS rows without a branch. A segment starts at a root or at a child of a
branching row, so it is a contiguous range of rows; it continues the state its parent segment ends with. Its
**level** is the number of branch points above it: all segments of one level can run at once. In the example::

    segment   rows     parent segment   level
       0      [0, 2)        -1            0        tokens 5 6
       1      [2, 4)         0            1        tokens 7 8
       2      [4, 5)         0            1        token  9

    segment_starts = [0, 2, 4, 5]   segment_parent = [-1, 0, 0]   segment_level = [0, 1, 1]

Building is vectorised per sequence, never per token: sort the sequences (``memcmp`` on big-endian bytes),
take the longest common prefix (LCP) of sorted neighbours, and append each sequence's tokens after that LCP.
A trie is a run of sorted sequences whose neighbours share at least one token; whole tries are bin-packed
into micro-batches (first-fit decreasing by unique tokens), and a trie larger than a micro-batch is cut into
runs of consecutive sequences — each run repeats only the prefix it still shares with the rest. Within a
micro-batch, the tries and, at every branch, the child subtrees are then laid out heaviest first (most unique
tokens; ties in sorted order), which keeps each heavy path, such as a conversation's history, contiguous.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

__all__ = ["PackedForest", "pack_forest", "tree_token_ratio"]

TokenSequence = Sequence[int] | torch.Tensor | np.ndarray


@dataclass
class PackedForest:
    """One micro-batch: a forest of tries in one padded row.

    Attributes:
        input_ids: `(1, S)` long — tokens in DFS preorder, then padding (token 0; `forest_forward_kwargs` feeds the
            model the first token there instead).
        position_ids: `(1, S)` long — depth of each token inside its own sequence; 0 for padding.
        subtree_end: `(S,)` int32 — one past the last row of each token's subtree; `r + 1` for padding row `r`.
        parent: `(S,)` long — row whose hidden state predicts this token; -1 for roots and padding.
        seq_ids: indices into the packed `sequences` of the sequences in this micro-batch.
        num_tree_tokens: unique (unpadded) tokens in the row.
        num_original_tokens: total tokens of the sequences in `seq_ids`.
        seq_positions: `(num_original_tokens,)` long — row of every token of every sequence, concatenated in
            `seq_ids` order; `seq_offsets` `(len(seq_ids) + 1,)` long delimits them.
        segment_starts: `(num_segments + 1,)` long — first row of each segment in DFS order, then
            `num_tree_tokens`; segment `k` is rows `[segment_starts[k], segment_starts[k + 1])`. Padding rows
            belong to no segment.
        segment_parent: `(num_segments,)` long — the segment whose last row is the parent of segment `k`'s first
            row (its recurrent state seeds segment `k`); -1 for a root segment.
        segment_level: `(num_segments,)` long — branch points above segment `k` (0 for roots; a segment's level is
            its parent's plus one).
        The three segment arrays are derived from `parent` and `subtree_end` when not given (`pack_forest` computes
        them with the layout).
        prefix_plan: (set from the segments, not a constructor argument) `(n,)` int64 on the CPU when every branch
            hangs off a root (a GRPO group: a prompt and its completions; several per forest), else None: the row
            ranges `hf_tree_attn.prefix_attention` computes such a forest's attention from.
        prefix_fast_on_cuda: (set likewise) whether those kernels beat FlexAttention on CUDA for this forest
            (`hf_tree_attn.prefix_attention.fast_on_cuda`).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    subtree_end: torch.Tensor
    parent: torch.Tensor
    seq_ids: list[int]
    num_tree_tokens: int
    num_original_tokens: int
    seq_positions: torch.Tensor
    seq_offsets: torch.Tensor
    segment_starts: torch.Tensor | None = None
    segment_parent: torch.Tensor | None = None
    segment_level: torch.Tensor | None = None
    _mask_cache: dict = field(default_factory=dict, repr=False, compare=False)
    _scan_cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        from .logprobs import _fused_lm_head
        from .transformers_compat import install

        install()  # before any call can carry this forest as `tree_forest` (see hf_tree_attn.transformers_compat)
        _fused_lm_head()  # its imports register pytree nodes: before any compiled call, not in its first backward
        if self.segment_starts is None or self.segment_parent is None or self.segment_level is None:
            real = slice(0, self.num_tree_tokens)
            arrays = _segments(self.parent[real].cpu().numpy(), self.subtree_end[real].cpu().numpy().astype(np.int64))
            device = self.parent.device
            self.segment_starts, self.segment_parent, self.segment_level = (
                torch.from_numpy(a).to(device) for a in arrays
            )
        if "prefix_plan" not in self._mask_cache:  # shared with `.to()` copies: computed once per forest
            from .prefix_attention import fast_on_cuda, prefix_plan, prefix_trees

            trees = prefix_trees(self.segment_starts, self.segment_parent)
            self._mask_cache["prefix_plan"] = (
                (None, False) if trees is None else (prefix_plan(self.num_tree_tokens, trees), fast_on_cuda(trees))
            )
        self.prefix_plan, self.prefix_fast_on_cuda = self._mask_cache["prefix_plan"]

    @cached_property
    def path_plan(self) -> torch.Tensor:
        """`(2 + 2 * num_segments + 1,)` int64 on the CPU: the segments, from which
        `hf_tree_attn.varlen_attention.path_attention` gathers each segment's path (FlashAttention-4 on CUDA; built
        where that route serves the forest, before the layers run)."""
        from .varlen_attention import path_plan

        return path_plan(self.segment_starts, self.segment_parent, self.num_tree_tokens)

    @property
    def seq_len(self) -> int:
        """Padded row length `S`."""
        return self.input_ids.shape[1]

    @cached_property
    def max_depth(self) -> int:
        """Largest depth of a real token (the longest sequence length minus one)."""
        return int(self.position_ids[0, : self.num_tree_tokens].max())

    @property
    def num_segments(self) -> int:
        """Maximal unbranched runs of real rows (see the module docstring)."""
        return self.segment_parent.shape[0]

    @cached_property
    def num_levels(self) -> int:
        """Branching levels: a state-carrying layer runs one batched call per level."""
        return int(self.segment_level.max()) + 1

    def positions(self, k: int) -> torch.Tensor:
        """Row positions `(len(sequences[seq_ids[k]]),)` long of the tokens of the `k`-th packed sequence."""
        start, end = self.seq_offsets[k], self.seq_offsets[k + 1]
        return self.seq_positions[start:end]

    def dense_mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The ancestor-or-self mask `(1, 1, S, S)` bool (True = attend), built once per device and kept with the
        forest (S² bytes). It has no window: a model's per-layer masks come from `attention_mask()`."""
        from .masks import dense_tree_mask

        return self._cached_mask("dense", device, dense_tree_mask)

    def block_mask(self, device: torch.device | str | None = None):
        """FlexAttention `BlockMask` of the ancestor-or-self mask (no window), built once per device (and backend:
        `masks.needs_static_rows`)."""
        from .masks import needs_static_rows, tree_block_mask

        return self._cached_mask("block_static" if needs_static_rows() else "block", device, tree_block_mask)

    def _cached_mask(self, kind: str, device: torch.device | str | None, build):
        device = _mask_device(device or self.subtree_end.device)
        if (kind, device) not in self._mask_cache:
            self._mask_cache[kind, device] = build(self.subtree_end.to(device))
        return self._mask_cache[kind, device]

    def attention_mask(self, device: torch.device | str | None = None, dense: bool | None = None) -> torch.Tensor:
        """What to pass as `attention_mask=` (with `position_ids` and `tree_forest=self`, see
        `hf_tree_attn.logprobs.forest_forward_kwargs`): a `(1, S)` all-ones bool tensor that stands for this forest.

        A `tree_flex` model hands it to its own mask functions, and `tree_flex`'s registered mask function turns
        each layer kind's mask (causal, sliding window, chunked, …) into the tree version of it: `BlockMask`s on
        CUDA, dense bool masks elsewhere (`dense=True` forces those). Built once per device and kept with the
        forest. Views of it keep its meaning; a copy, or the tensor moved to another device, is an ordinary padding
        mask: call this again with the other device.
        """
        from .masks import TreeMaskSource
        from .prefix_attention import serves
        from .varlen_attention import path_serves

        device = _mask_device(device or self.subtree_end.device)
        dense = device.type != "cuda" if dense is None else dense
        serves(self, device.type)  # the attention path, decided before the layers (a compiled layer only reads it)
        path_serves(self, device.type)
        key = ("carrier", dense, device)
        if key not in self._mask_cache:
            self._mask_cache[key] = TreeMaskSource(
                self.subtree_end.to(device),
                self.position_ids[0].to(device),
                self.seq_offsets.diff().cpu(),
                self._mask_cache,
                dense=dense,
            )
        return self._mask_cache[key].carrier

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedForest:
        """Copy of the forest with its tensors on `device` (mask caches are kept per device)."""
        moved = {name: getattr(self, name).to(device, non_blocking=non_blocking) for name in _TENSOR_FIELDS}
        return PackedForest(
            **moved,
            seq_ids=self.seq_ids,
            num_tree_tokens=self.num_tree_tokens,
            num_original_tokens=self.num_original_tokens,
            _mask_cache=self._mask_cache,
            _scan_cache=self._scan_cache,
        )


def _mask_device(device: torch.device | str) -> torch.device:
    """`device` as the key of a forest's mask cache: "cuda" and "cuda:0" must share one cached mask."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


_TENSOR_FIELDS = (
    "input_ids",
    "position_ids",
    "subtree_end",
    "parent",
    "seq_positions",
    "seq_offsets",
    "segment_starts",
    "segment_parent",
    "segment_level",
)


def _check_not_tensor(sequences) -> None:
    """A 2-D tensor or array would be read row by row, padding included: make the caller strip it."""
    if isinstance(sequences, torch.Tensor) or (isinstance(sequences, np.ndarray) and sequences.dtype != object):
        kind = "tensor" if isinstance(sequences, torch.Tensor) else "numpy array"
        raise TypeError(
            f"sequences is a {kind} of shape {tuple(sequences.shape)}; pass a list of 1-D sequences (a padded batch "
            "must be stripped of padding first, e.g. [row[mask.bool()] for row, mask in zip(input_ids, "
            "attention_mask)])."
        )


def check_token_budget(max_tokens_per_mb, pad_multiple: int = 128) -> None:
    """Raise a clear error unless `max_tokens_per_mb` is None or a positive int multiple of `pad_multiple`."""
    for name, value in (("pad_multiple", pad_multiple), ("max_tokens_per_mb", max_tokens_per_mb)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
            raise TypeError(
                f"{name}={value!r} is a {type(value).__name__}; pass an int (e.g. {name}=256)"
                + (" or None." if name == "max_tokens_per_mb" else ".")
            )
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple={pad_multiple} must be a positive integer (use 128, FlexAttention's block).")
    if max_tokens_per_mb is not None and (max_tokens_per_mb <= 0 or max_tokens_per_mb % pad_multiple):
        fix = max(pad_multiple, -(-max(max_tokens_per_mb, 1) // pad_multiple) * pad_multiple)
        raise ValueError(
            f"max_tokens_per_mb={max_tokens_per_mb} must be a positive multiple of pad_multiple={pad_multiple}; "
            f"use e.g. max_tokens_per_mb={fix}."
        )


def _as_array(seq: TokenSequence, index: int) -> np.ndarray:
    """One sequence as a 1-D int64 array, with the errors a user can act on."""
    if isinstance(seq, torch.Tensor):
        if seq.is_floating_point() or seq.is_complex() or seq.dtype == torch.bool:
            raise TypeError(f"sequences[{index}] has dtype {seq.dtype}; token ids must be integers (torch.long).")
        arr = seq.detach().cpu().numpy()
    else:
        arr = np.asarray(seq)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(
                f"sequences[{index}] holds {arr.dtype} values (first: {arr.flat[0]!r}); token ids must be integers."
            )
    if arr.ndim != 1:
        raise ValueError(f"sequences[{index}] has shape {tuple(arr.shape)}; each sequence must be 1-D token ids.")
    if arr.size == 0:
        raise ValueError(f"sequences[{index}] is empty; every sequence needs at least one token. Drop it first.")
    if arr.min() < 0:
        raise ValueError(f"sequences[{index}] holds a negative token id ({int(arr.min())}); strip padding first.")
    return arr.astype(np.int64, copy=False)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def _sorted_with_lcp(arrays: list[np.ndarray]) -> tuple[list[int], np.ndarray]:
    """Lexicographic order of `arrays` and the LCP of each sorted sequence with its predecessor (0 for the first)."""
    # Big-endian fixed-width bytes compare exactly like the token lists, and a prefix sorts before its extensions.
    keys = [a.astype(">u4").tobytes() for a in arrays]
    order = sorted(range(len(arrays)), key=keys.__getitem__)
    lcp = np.zeros(len(order), dtype=np.int64)
    for k in range(1, len(order)):
        lcp[k] = _common_prefix(arrays[order[k - 1]], arrays[order[k]])
    return order, lcp


def _unique_tokens(lengths: np.ndarray, lcp: np.ndarray) -> int:
    """Unique trie tokens of a run of sorted sequences (the first one contributes all of its tokens)."""
    return int(lengths[0] + (lengths[1:] - lcp[1:]).sum())


def _split_trie(start: int, stop: int, lengths: np.ndarray, lcp: np.ndarray, budget: int) -> list[tuple[int, int]]:
    """Cut sorted sequences `[start, stop)` of one trie into consecutive runs of at most `budget` unique tokens."""
    runs, run_start, used = [], start, int(lengths[start])
    for k in range(start + 1, stop):
        extra = int(lengths[k] - lcp[k])
        if used + extra > budget:
            runs.append((run_start, k))
            run_start, used = k, int(lengths[k])  # a new run repeats the shared prefix of sequence k
        else:
            used += extra
    runs.append((run_start, stop))
    return runs


def _first_fit_decreasing(sizes: list[int], budget: int | None) -> list[list[int]]:
    """Bins of item indices; each bin's size sum stays within `budget` (one bin when `budget` is None)."""
    if budget is None:
        return [list(range(len(sizes)))]
    bins: list[list[int]] = []
    free: list[int] = []
    for item in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        for b, room in enumerate(free):
            if sizes[item] <= room:
                bins[b].append(item)
                free[b] -= sizes[item]
                break
        else:
            bins.append([item])
            free.append(budget - sizes[item])
    return bins


def _segments(
    parent: np.ndarray, subtree_end: np.ndarray, branching: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(segment_starts, segment_parent, segment_level)` of the real rows whose `parent` and `subtree_end` are
    given (`(N,)` each, DFS preorder; see `PackedForest`). `branching`: `(N,)` bool — the rows whose children start
    segments of their own (default: the rows with two children or more; a prefix-reuse chunk also ends its segments
    at rows branching in the whole forest, whose states later chunks start from)."""
    num_rows = parent.shape[0]
    has_parent = parent >= 0
    if branching is None:
        branching = np.bincount(parent[has_parent], minlength=num_rows) >= 2
    # A row starts a segment unless it is the only child of its parent (which then sits right before it).
    is_start = ~has_parent | branching[np.where(has_parent, parent, 0)]
    starts = np.flatnonzero(is_start)
    segment_of_row = np.cumsum(is_start) - 1
    start_parent = parent[starts]
    segment_parent = np.where(start_parent >= 0, segment_of_row[start_parent], -1)
    # Branching ancestors-or-self of each row: +1 over the subtree of every branching row (a difference array in
    # DFS order, where a subtree is the row range [r, subtree_end[r])). A segment's level is that count at the
    # branching row its parent segment ends with.
    branch_rows = np.flatnonzero(branching)
    delta = np.bincount(branch_rows, minlength=num_rows + 1) - np.bincount(
        subtree_end[branch_rows], minlength=num_rows + 1
    )
    branches_above = np.cumsum(delta)[:num_rows]
    segment_level = np.where(start_parent >= 0, branches_above[np.maximum(start_parent, 0)], 0)
    return np.append(starts, num_rows), segment_parent, segment_level


def _heavy_first(arrays: list[np.ndarray], members: list[int], lcp: np.ndarray) -> tuple[list[int], np.ndarray]:
    """`members` (indices into `arrays`, each trie's sequences contiguous and in trie order, `lcp[j]` their true LCP
    with `members[j - 1]`, 0 where a trie starts) reordered so that wherever the trie branches, the child subtree
    with the most unique tokens comes first (ties keep their order), and the LCPs of the new order.

    Any such order lays the same trie out in depth-first preorder; this one keeps every heavy path contiguous (an
    agent conversation's history runs unbroken, each sampled side branch after it), so a branch's ancestors span
    few row ranges and FlexAttention's 128-row blocks straddle fewer branch ends: on τ²-like agent trees the blocks
    it computes fall from 1.12x to 1.03x the ancestor pairs (GRPO groups: unchanged)."""
    if len(members) <= 2:
        return members, lcp
    lengths = np.array([len(arrays[m]) for m in members], dtype=np.int64)
    new_tokens = lengths - lcp
    picked: list[int] = []
    picked_lcp: list[int] = []
    # (range, LCP of its first sequence with the one laid out before it): a subtree's first child inherits it, each
    # later child shares exactly the subtree's common prefix with the last sequence of the sibling before it.
    stack = [(0, len(members), 0)]
    while stack:
        start, stop, first_lcp = stack.pop()
        if stop - start == 1:
            picked.append(start)
            picked_lcp.append(first_lcp)
            continue
        shared = int(lcp[start + 1 : stop].min())  # the tokens all of this subtree's sequences share
        cuts = [start, *(start + 1 + np.flatnonzero(lcp[start + 1 : stop] == shared)).tolist(), stop]
        children = sorted(
            zip(cuts[:-1], cuts[1:]), key=lambda c: -int(lengths[c[0]] - shared + new_tokens[c[0] + 1 : c[1]].sum())
        )
        entries = [(a, b, first_lcp if k == 0 else shared) for k, (a, b) in enumerate(children)]
        stack.extend(reversed(entries))  # the heaviest child is popped first
    order = [members[j] for j in picked]
    new_lcp = np.array(picked_lcp, dtype=np.int64)
    return order, new_lcp


def _layout(arrays: list[np.ndarray], order: list[int], lcp: np.ndarray, pad_multiple: int) -> PackedForest:
    """DFS layout of the sequences `order` (each trie's sequences contiguous, in trie order) as one padded row.
    `lcp[k]`: how many leading rows `order[k]` shares with `order[k-1]` (0 for the first): their LCP, or less to
    repeat tokens they share (`_two_level_lcp`)."""
    seqs = [arrays[i] for i in order]
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    new = lengths - lcp
    offsets = np.concatenate([[0], np.cumsum(new)])
    num_tree = int(offsets[-1])
    padded = -(-num_tree // pad_multiple) * pad_multiple

    tokens = np.zeros(padded, dtype=np.int64)
    depth = np.zeros(padded, dtype=np.int64)
    parent = np.full(padded, -1, dtype=np.int64)
    subtree_end = np.arange(1, padded + 1, dtype=np.int64)
    positions = []

    path = np.zeros(0, dtype=np.int64)  # rows of the previous sequence, root to leaf: the open subtrees
    for k, seq in enumerate(seqs):
        keep, off = int(lcp[k]), int(offsets[k])
        subtree_end[path[keep:]] = off  # subtrees deeper than the shared prefix end where this sequence starts
        rows = np.arange(off, offsets[k + 1], dtype=np.int64)
        if rows.size:  # a sequence identical to its predecessor adds no rows
            tokens[rows] = seq[keep:]
            depth[rows] = np.arange(keep, len(seq))
            parent[rows] = np.concatenate([path[keep - 1 : keep] if keep else [-1], rows[:-1]])
        path = np.concatenate([path[:keep], rows])
        positions.append(path)
    subtree_end[path] = num_tree

    seq_positions = np.concatenate(positions)
    inverse = np.argsort(order, kind="stable")  # report sequences in increasing seq_id order
    seq_offsets_sorted = np.concatenate([[0], np.cumsum(lengths)])
    seq_positions = np.concatenate([seq_positions[seq_offsets_sorted[k] : seq_offsets_sorted[k + 1]] for k in inverse])
    seq_ids = [order[k] for k in inverse]
    seq_offsets = np.concatenate([[0], np.cumsum(lengths[inverse])])
    segment_starts, segment_parent, segment_level = _segments(parent[:num_tree], subtree_end[:num_tree])
    return PackedForest(
        input_ids=torch.from_numpy(tokens)[None],
        position_ids=torch.from_numpy(depth)[None],
        subtree_end=torch.from_numpy(subtree_end).to(torch.int32),
        parent=torch.from_numpy(parent),
        seq_ids=seq_ids,
        num_tree_tokens=num_tree,
        num_original_tokens=int(lengths.sum()),
        seq_positions=torch.from_numpy(seq_positions),
        seq_offsets=torch.from_numpy(seq_offsets),
        segment_starts=torch.from_numpy(segment_starts),
        segment_parent=torch.from_numpy(segment_parent),
        segment_level=torch.from_numpy(segment_level),
    )


def pack_forest(
    sequences: Sequence[TokenSequence],
    max_tokens_per_mb: int | None = None,
    pad_multiple: int = 128,
    split_lengths: Sequence[int] = (),
    two_level: bool | None = None,
) -> list[PackedForest]:
    """Pack `sequences` into prefix-trie forests, one `PackedForest` per micro-batch.

    Args:
        sequences: token-id sequences (lists of ints or 1-D integer tensors/arrays), each non-empty.
        max_tokens_per_mb: most padded tokens in one micro-batch (a multiple of `pad_multiple`); `None` packs
            everything into one micro-batch (per length class).
        pad_multiple: each row is padded to a multiple of this (FlexAttention's block size, 128).
        split_lengths: length classes: a sequence of at most `t` tokens never shares a forest with one of more than
            `t` tokens, for every `t` here. For models whose RoPE frequencies depend on the longest position of a
            forward (`longrope`): each forest then gets the frequencies its sequences' own forwards use (see
            `hf_tree_attn.support.rope_split_lengths`).
        two_level: lay each trie out as its common prefix plus one branch per sequence, repeating tokens that only
            some sequences share (completions of one prompt that start alike), so that the shared-prefix kernels
            (`hf_tree_attn.prefix_attention`) can run the forest. None (default): where that repeats at most 1% of
            the forest's tokens and gives a forest those kernels run faster than FlexAttention on CUDA; True:
            always; False: never (the plain trie: every shared token once).

    Returns:
        Micro-batches; every sequence index appears in exactly one `seq_ids`. Micro-batches hold whole tries
        (several per row) and are ordered by decreasing size. A trie larger than the budget is cut into runs of
        consecutive DFS-ordered sequences, each repeating only the prefix it needs.
    """
    _check_not_tensor(sequences)
    if len(sequences) == 0:
        raise ValueError("sequences is empty; pass at least one token sequence.")
    check_token_budget(max_tokens_per_mb, pad_multiple)
    arrays = [_as_array(s, i) for i, s in enumerate(sequences)]
    lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    if max_tokens_per_mb is not None and lengths.max() > max_tokens_per_mb:
        i = int(lengths.argmax())
        raise ValueError(
            f"sequences[{i}] has {lengths[i]} tokens, more than max_tokens_per_mb={max_tokens_per_mb}; raise "
            f"max_tokens_per_mb to at least {-(-int(lengths[i]) // pad_multiple) * pad_multiple}, truncate it, or "
            "score it in chunks of the budget with `sequence_logprobs(..., prefix_reuse=True)`."
        )
    length_class = sum((lengths > int(t)).astype(np.int64) for t in split_lengths) if len(split_lengths) else None
    if length_class is None or (length_class == length_class[0]).all():
        return _pack(arrays, lengths, max_tokens_per_mb, pad_multiple, two_level)
    forests = []
    for c in np.unique(length_class):
        members = np.flatnonzero(length_class == c)
        packed = _pack([arrays[i] for i in members], lengths[members], max_tokens_per_mb, pad_multiple, two_level)
        for forest in packed:
            forests.append(dataclasses.replace(forest, seq_ids=[int(members[k]) for k in forest.seq_ids]))
    return sorted(forests, key=lambda f: -f.seq_len)


def _pack(
    arrays: list[np.ndarray],
    lengths: np.ndarray,
    max_tokens_per_mb: int | None,
    pad_multiple: int,
    two_level: bool | None = None,
) -> list[PackedForest]:
    """`pack_forest` on validated sequences."""
    order, lcp = _sorted_with_lcp(arrays)
    # Sizes for the bins: with `two_level=True` they count the repeats of the whole trie's layout, an upper bound
    # on those of any of its runs (a run's sequences share at least the trie's common prefix).
    sizing = _two_level_lcp(lcp) if two_level is True else lcp
    sorted_lengths = lengths[order]
    trie_starts = np.flatnonzero(lcp == 0).tolist() + [len(order)]
    runs: list[tuple[int, int]] = []
    for start, stop in zip(trie_starts[:-1], trie_starts[1:]):
        size = _unique_tokens(sorted_lengths[start:stop], sizing[start:stop])
        if max_tokens_per_mb is None or size <= max_tokens_per_mb:
            runs.append((start, stop))
        else:
            runs.extend(_split_trie(start, stop, sorted_lengths, sizing, max_tokens_per_mb))
    sizes = [int(sorted_lengths[a] + (sorted_lengths[a + 1 : b] - sizing[a + 1 : b]).sum()) for a, b in runs]

    forests = []
    for bin_runs in _first_fit_decreasing(sizes, max_tokens_per_mb):
        # Runs keep their lexicographic order so runs of one split trie that share a bin merge their prefix again.
        members = [k for r in sorted(bin_runs) for k in range(*runs[r])]
        # Neighbours in the global sorted order reuse its LCP; only a bin's run boundaries need a fresh one (0
        # between tries, the shared prefix again where two runs of one split trie meet).
        bin_lcp = np.array(
            [
                0 if j == 0
                else lcp[k] if k == members[j - 1] + 1
                else _common_prefix(arrays[order[members[j - 1]]], arrays[order[k]])
                for j, k in enumerate(members)
            ],
            dtype=np.int64,
        )  # fmt: skip
        members = [order[k] for k in members]
        if two_level is not True:
            members, bin_lcp = _heavy_first(arrays, members, bin_lcp)
        if two_level is True:
            forests.append(_layout(arrays, members, _two_level_lcp(bin_lcp), pad_multiple))
            continue
        forest = _layout(arrays, members, bin_lcp, pad_multiple)
        if two_level is None and forest.prefix_plan is None:
            forest = _two_level_if_faster(arrays, members, bin_lcp, pad_multiple, forest, max_tokens_per_mb)
        forests.append(forest)
    return forests


def _two_level_lcp(lcp: np.ndarray) -> np.ndarray:
    """`lcp` (DFS order, 0 where a trie starts) with each trie's entries cut to the trie's common prefix: laid out,
    each trie becomes that prefix plus one branch per sequence."""
    capped = lcp.copy()
    starts = np.flatnonzero(lcp == 0).tolist() + [len(lcp)]
    for start, stop in zip(starts[:-1], starts[1:]):
        if stop - start > 1:  # in sorted order the LCP of all is the least LCP of neighbours
            capped[start + 1 : stop] = lcp[start + 1 : stop].min()
    return capped


# A two-level layout may repeat at most this share of a forest's tokens. The kernels it enables run attention alone
# 1.16-1.69x faster per step than FlexAttention on an H200 where `fast_on_cuda` picks them
# (benchmarks/results/prefix_attention_h200.json); 1% more tokens costs at most ~1% more time.
_MAX_REPEATED_SHARE = 0.01


def _two_level_if_faster(
    arrays: list[np.ndarray],
    members: list[int],
    lcp: np.ndarray,
    pad_multiple: int,
    forest: PackedForest,
    max_tokens_per_mb: int | None,
) -> PackedForest:
    """`forest` laid out two-level (`_two_level_lcp`) where that repeats at most `_MAX_REPEATED_SHARE` of its
    tokens, stays within the token budget, and gives a forest the shared-prefix kernels run faster than
    FlexAttention on CUDA (`prefix_fast_on_cuda`, or any with FlashAttention-4's kernels; the kernels not switched
    off); else `forest` itself."""
    from . import prefix_attention

    capped = _two_level_lcp(lcp)
    repeated = int((lcp - capped).sum())  # each sequence's rows start that much earlier
    if prefix_attention.MODE == "never" or repeated > _MAX_REPEATED_SHARE * forest.num_tree_tokens:
        return forest  # checked before laying it out: deep trees (agents) repeat far more
    flat = _layout(arrays, members, capped, pad_multiple)
    fits = max_tokens_per_mb is None or flat.seq_len <= max_tokens_per_mb
    faster = flat.prefix_fast_on_cuda or prefix_attention.KERNEL == "fa4"  # FA4 takes every two-level forest
    return flat if fits and faster else forest


def tree_token_ratio(sequences: Sequence[TokenSequence]) -> float:
    """Unique trie tokens over total tokens of `sequences` (1.0 = no sharing; 1/G for G copies of one sequence)."""
    _check_not_tensor(sequences)
    arrays = [_as_array(s, i) for i, s in enumerate(sequences)]
    if not arrays:
        raise ValueError("sequences is empty; pass at least one token sequence.")
    order, lcp = _sorted_with_lcp(arrays)
    lengths = np.array([len(arrays[i]) for i in order], dtype=np.int64)
    return _unique_tokens(lengths, lcp) / int(lengths.sum())
