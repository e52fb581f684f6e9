"""Tree attention masks: token `q` sees token `kv` iff `kv` is an ancestor-or-self of `q` AND the model's own mask
lets position `depth[q]` see position `depth[kv]`.

The tree part is one int per token (`subtree_end`, see `hf_tree_attn.tree`): `kv <= q < subtree_end[kv]`. The
model part is whatever `mask_function(batch, head, q_idx, kv_idx)` the model builds for an ordinary sequence —
causal, a sliding window (`kv_idx > q_idx - W`), a chunk (`q_idx // C == kv_idx // C`), … — read at the two
tokens' *depths* (their positions inside their own sequence) instead of their rows. So a sliding-window layer's
tree mask is "ancestor-or-self, fewer than W depths up", with exactly the model's own window convention, and
every layer kind of a model gets its mask from the model itself. Two sequences sharing a prefix, window 2::

    sequences [5, 6, 7, 8] and [5, 6, 9]  →  DFS row 5 6 7 8 9, depth 0 1 2 3 2

    full (causal)            sliding window 2
        5 6 7 8 9                5 6 7 8 9
    5   ■ ⬚ ⬚ ⬚ ⬚            5   ■ ⬚ ⬚ ⬚ ⬚
    6   ■ ■ ⬚ ⬚ ⬚            6   ■ ■ ⬚ ⬚ ⬚
    7   ■ ■ ■ ⬚ ⬚            7   ⬚ ■ ■ ⬚ ⬚
    8   ■ ■ ■ ■ ⬚            8   ⬚ ⬚ ■ ■ ⬚
    9   ■ ■ ⬚ ⬚ ■            9   ⬚ ■ ⬚ ⬚ ■

Masks are small named `mask_mod(b, h, q_idx, kv_idx)` factories composed with `and_masks`. Two
materialisations: a FlexAttention `BlockMask` built by a *compiled* `create_block_mask` (the eager one
materialises the dense S×S mask) for CUDA, and a `(1, 1, S, S)` bool tensor for SDPA / eager — the CPU path
(FlexAttention has no CPU backward) and the oracle the block mask is tested against. Each is built once per
forest, device and layer kind (`TreeMaskSource.mask`) and shared by the layers of that kind and every later
forward over the same forest.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.nn.attention.flex_attention import BlockMask, and_masks, create_block_mask, create_mask
from transformers.masking_utils import causal_mask_function

__all__ = [
    "ContextMaskSource",
    "MaskTag",
    "TreeMaskSource",
    "at_depth",
    "at_depths",
    "causal_mask_mod",
    "context_tree_mask_mod",
    "dense_mask",
    "dense_tree_mask",
    "is_tree_mask_mod",
    "mask_function_key",
    "mask_tag",
    "static_rows",
    "tag_mask",
    "tree_block_mask",
    "tree_mask_mod",
]

_compiled_create_block_mask = None


# The least capacity of a `static_rows` buffer: every forest of up to 65,536 rows shares one buffer size (and so one
# compiled graph); larger ones take the next power of two.
STATIC_ROWS_MIN = 1 << 16


def static_rows(rows: torch.Tensor, fill: int = 0) -> torch.Tensor:
    """`rows` `(S,)` at the front of a buffer `(C,)` whose size dynamo holds static (`torch._dynamo.mark_static`):
    `C` the least power of two at least `max(S, STATIC_ROWS_MIN)`, the rest `fill`.

    For the tensors a mask_mod captures when FlexAttention runs on its FLASH backend (FlashAttention-4's kernels).
    Under dynamic shapes (layers compiled with `dynamic=True`, or FlexAttention's own compile turning dynamic at the
    second forest length) a captured tensor as long as the forest brings its length into the mask as a symbolic
    size, which torch's FLASH lowering refuses ("mask_mod captures a dynamic scalar"); a buffer of static size
    brings the tensor alone. A mask_mod reads it at the forest's rows only, so the padding is never read."""
    size = rows.shape[0]
    capacity = max(STATIC_ROWS_MIN, 1 << max(size - 1, 0).bit_length())
    buffer = rows.new_full((capacity,), fill)
    buffer[:size] = rows
    torch._dynamo.mark_static(buffer, 0)
    return buffer


# A model's mask functions (a window, a chunk) under the FLASH backend, reached from a mask_mod by name through this
# module global: dynamo holds the ints such a function captures (the window's size) as constants when it reads them
# through a global, where through a mask_mod's closure, under dynamic shapes, they become symbolic sizes as well. One
# entry per mask (`mask_function_key`) and device.
_STATIC_FUNCTIONS: dict[str, Callable] = {}
_STATIC_NAMES: dict[tuple, str] = {}


def _through_global(mask_function: Callable, device: torch.device) -> Callable:
    """`mask_function` called through `_STATIC_FUNCTIONS` (as it is, if it has no `mask_function_key`)."""
    try:
        key = (mask_function_key(mask_function), str(device))
    except _NoKey:
        return mask_function
    name = _STATIC_NAMES.setdefault(key, f"mask_function_{len(_STATIC_NAMES)}")
    _STATIC_FUNCTIONS.setdefault(name, mask_function)

    def static_mask_function(b, h, q_idx, kv_idx):
        return _STATIC_FUNCTIONS[name](b, h, q_idx, kv_idx)

    return static_mask_function


def needs_static_rows() -> bool:
    """Whether block masks capture `static_rows` buffers: tree FlexAttention calls run on the FLASH backend
    (`attention.FLEX_KERNEL_OPTIONS`)."""
    from . import attention  # imported here: it imports this module

    return (attention.FLEX_KERNEL_OPTIONS or {}).get("BACKEND") == "FLASH"


def tree_mask_mod(subtree_end: torch.Tensor):
    """`mask_mod`: `kv` is an ancestor-or-self of `q` in the forest whose `subtree_end` is `(S,)` int."""

    def tree_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < subtree_end[kv_idx])

    return tree_mask


def is_tree_mask_mod(mask_mod) -> bool:
    """Whether `mask_mod` is a `tree_mask_mod` closure, the plain ancestor-or-self mask (by its name, which a
    compiled region can read)."""
    return getattr(mask_mod, "__name__", None) == "tree_mask"


def causal_mask_mod(b, h, q_idx, kv_idx):
    """`mask_mod` of an ordinary causal layer (the same rule as transformers' `causal_mask_function`)."""
    return kv_idx <= q_idx


def context_tree_mask_mod(
    subtree_end: torch.Tensor, context_end: torch.Tensor, query_rows: torch.Tensor, static: bool = False
):
    """`mask_mod` over keys `[context rows (P); own rows (S)]` for the queries of one chunk of a forest's DFS row
    (`hf_tree_attn.chunked`): own rows by the ancestor-or-self test on the chunk's local `subtree_end` `(S,)` int;
    context row `r` (an ancestor of the chunk's first row) seen by query `q` iff `context_end[r] > query_rows[q]`
    (`(P,)` and `(S,)` int, global rows: `q`'s subtree is inside `r`'s). `static`: the three captured in
    `static_rows` buffers (for the FLASH backend)."""
    # One code object, and no Python int, for every chunk: the compiled mask builder and FlexAttention guard on the
    # mask_mod's code and on the ints it captures (each new context size would compile again); dummy rows where
    # there is no context.
    count = torch.tensor(context_end.shape[0], device=context_end.device)
    last = (count - 1).clamp(min=0)
    if context_end.shape[0] == 0:
        context_end = context_end.new_zeros(2)  # not 1: dynamo specializes sizes 0 and 1
    if static:
        subtree_end, context_end, query_rows = map(static_rows, (subtree_end, context_end, query_rows))

    def own_mask(q_idx, own_idx):
        return (own_idx <= q_idx) & (q_idx < subtree_end[own_idx.clamp(min=0)])

    def context_tree_mask(b, h, q_idx, kv_idx):
        sees_context = context_end[torch.minimum(kv_idx, last)] > query_rows[q_idx]
        return torch.where(kv_idx < count, sees_context, own_mask(q_idx, kv_idx - count))

    return context_tree_mask


def at_depth(mask_function: Callable, depth: torch.Tensor):
    """`mask_function` (a model's mask for one flat sequence) read at the depths `(S,)` long of `q` and `kv`."""
    return at_depths(mask_function, depth, depth)


def at_depths(mask_function: Callable, q_depth: torch.Tensor, kv_depth: torch.Tensor):
    """`mask_function` read at the depths of the queries `(Q,)` long and of the keys `(KV,)` long."""

    def depth_mask(b, h, q_idx, kv_idx):
        return mask_function(b, h, q_depth[q_idx], kv_depth[kv_idx])

    return depth_mask


def dense_mask(
    mask_mod: Callable, size: int, device: torch.device | str, use_vmap: bool = False, kv_size: int | None = None
) -> torch.Tensor:
    """`(1, 1, size, kv_size)` bool tensor of `mask_mod` (True = attend); `kv_size` defaults to `size`.

    Index-based mask functions (all of transformers' own) broadcast over an index grid; others (`use_vmap`, as
    transformers flags custom `or_mask_function` / `and_mask_function`) are evaluated pair by pair with `vmap`.
    """
    kv_size = size if kv_size is None else kv_size
    if use_vmap:
        return create_mask(mask_mod, 1, 1, size, kv_size, device=device)
    q_idx = torch.arange(size, device=device)
    kv_idx = torch.arange(kv_size, device=device)
    zero = torch.zeros((), dtype=torch.long, device=device)
    return mask_mod(zero, zero, q_idx[:, None], kv_idx[None, :]).expand(size, kv_size)[None, None]


class MaskTag(NamedTuple):
    """What a mask built here stands for.

    `role`: "carrier" (a forest's `(1, S)` `attention_mask`, see `TreeMaskSource`), "layer" (the tree mask of one
    layer kind, built from the model's own mask function) or "full" (the plain ancestor-or-self mask of
    `PackedForest.dense_mask()` / `block_mask()`, without any window). `causal`: a "layer" mask built from the plain
    causal mask function, i.e. exactly the ancestor-or-self mask (`hf_tree_attn.prefix_attention` may then serve it).
    """

    role: str
    source: TreeMaskSource | None
    causal: bool = False


# Tensors keep their tag through views (`mask.view(batch, -1)`, `mask[..., :kv_len]`), which models make before
# handing a mask on, and Python attributes do not survive: tensors are looked up by device and data pointer. An
# entry lives as long as the tensor it was made for.
_TENSOR_TAGS: dict[tuple[torch.device, int], tuple[weakref.ref, MaskTag]] = {}


def tag_mask(mask: torch.Tensor | BlockMask, tag: MaskTag) -> None:
    """Remember what `mask` (a tensor, or a `BlockMask`) stands for; see `mask_tag`."""
    if isinstance(mask, BlockMask):
        mask.tree_mask_tag = tag
        return
    key = (mask.device, mask.data_ptr())

    def forget(ref, key=key, tags=_TENSOR_TAGS):  # bound now: module globals are gone at interpreter exit
        if tags.get(key, (None,))[0] is ref:
            del tags[key]

    _TENSOR_TAGS[key] = (weakref.ref(mask, forget), tag)


def mask_tag(mask) -> MaskTag | None:
    """The tag of a mask built here (or of a same-shaped view of it), else None (an ordinary mask)."""
    if isinstance(mask, BlockMask):
        return getattr(mask, "tree_mask_tag", None)
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        return None
    entry = _TENSOR_TAGS.get((mask.device, mask.data_ptr()))
    if entry is None:
        return None
    owner = entry[0]()
    if owner is None or owner.shape != mask.shape:
        return None
    return entry[1]


def dense_tree_mask(subtree_end: torch.Tensor) -> torch.Tensor:
    """Ancestor-or-self mask `(1, 1, S, S)` bool from `subtree_end` `(S,)`; True where attention is allowed."""
    mask = dense_mask(tree_mask_mod(subtree_end), subtree_end.shape[0], subtree_end.device).contiguous()
    tag_mask(mask, MaskTag("full", None))
    return mask


def _block_mask(
    mask_mod: Callable, size: int, device: torch.device, block_size: int = 128, kv_size: int | None = None
) -> BlockMask:
    global _compiled_create_block_mask
    if _compiled_create_block_mask is None:
        _compiled_create_block_mask = torch.compile(create_block_mask, dynamic=True)
    kv_size = size if kv_size is None else kv_size
    # Without grad whatever the caller's mode (a mask has none): dynamo guards on it, one graph serves both
    with torch.no_grad():
        return _compiled_create_block_mask(mask_mod, None, None, size, kv_size, device=device, BLOCK_SIZE=block_size)


def tree_block_mask(subtree_end: torch.Tensor, block_size: int = 128) -> BlockMask:
    """`BlockMask` `(1, 1, S, S)` for the forest whose `subtree_end` is `(S,)` int, on `subtree_end.device` (its
    mask_mod reads a `static_rows` copy on the FLASH backend)."""
    captured = static_rows(subtree_end) if needs_static_rows() else subtree_end
    mask = _block_mask(tree_mask_mod(captured), subtree_end.shape[0], subtree_end.device, block_size)
    tag_mask(mask, MaskTag("full", None))
    return mask


class _NoKey(Exception):
    """A mask function whose behaviour cannot be summarised as a hashable key (it is then never cached)."""


def mask_function_key(mask_function: Callable) -> tuple:
    """A hashable key equal for two mask functions that compute the same mask.

    Models build fresh closures every forward (`sliding_window_overlay(W)`, `and_masks(...)`); two closures with
    the same code and the same captured values (window sizes, small index tensors by value) mask alike, so a
    forest's layer masks can be cached across forwards. Raises `_NoKey` for anything else.
    """
    return _key(mask_function, depth=0)


def _key(value, depth: int):
    if depth > 32:
        raise _NoKey
    if value is None or isinstance(value, (bool, int, float, str)):
        return (type(value).__name__, value)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_key(v, depth + 1) for v in value))
    if isinstance(value, torch.Tensor):
        if value.numel() > 4096:
            raise _NoKey
        return ("tensor", value.dtype, tuple(value.shape), tuple(value.detach().cpu().flatten().tolist()))
    if isinstance(value, types.FunctionType):
        cells = tuple(_key(cell.cell_contents, depth + 1) for cell in value.__closure__ or ())
        defaults = _key(value.__defaults__, depth + 1)
        return ("function", value.__code__, cells, defaults)
    if isinstance(value, types.BuiltinFunctionType):
        return ("builtin", value)
    raise _NoKey


_CAUSAL_KEYS = (mask_function_key(causal_mask_mod), mask_function_key(causal_mask_function))


class TreeMaskSource:
    """The tree masks of one forest on one device: what a forest's `attention_mask` stands for.

    `.carrier` is the forest's `attention_mask`: a `(1, S)` all-ones bool tensor tagged with this source. The
    model hands it (or a view of it) to its mask builders (`create_causal_mask`, `create_sliding_window_causal_mask`,
    `create_chunked_causal_mask`, …), which call `tree_flex`'s registered mask function with each layer kind's flat
    mask function; that function asks `mask()` for the tree version.

    Args:
        subtree_end: `(S,)` int on the device.
        depth: `(S,)` long on the device — each row's position id.
        seq_lengths: `(N,)` long on the CPU — token count of each packed sequence (RoPE length checks).
        cache: the forest's mask cache (shared by its `.to()` copies).
        dense: build dense bool masks (SDPA / eager) instead of `BlockMask`s (FlexAttention).
    """

    def __init__(
        self, subtree_end: torch.Tensor, depth: torch.Tensor, seq_lengths: torch.Tensor, cache: dict, dense: bool
    ):
        self.subtree_end = subtree_end
        self.depth = depth
        self.seq_lengths = seq_lengths
        self.cache = cache
        self.dense = dense
        self.carrier = torch.ones(1, self.size, dtype=torch.bool, device=subtree_end.device)
        tag_mask(self.carrier, MaskTag("carrier", self))

    @property
    def size(self) -> int:
        return self.subtree_end.shape[0]

    def mask(self, mask_function: Callable, use_vmap: bool = False) -> torch.Tensor | BlockMask:
        """The tree mask `(1, 1, S, S + extra keys)` of a layer kind whose flat mask is `mask_function` (tagged
        "layer"), built once per layer kind and kept in `cache`."""
        device = self.subtree_end.device
        try:
            key = mask_function_key(mask_function)
        except _NoKey:
            key = None
        causal = key in _CAUSAL_KEYS
        static = not self.dense and needs_static_rows()
        cache_key = self._cache_key(("causal" if causal else key, static), device)
        if key is not None and cache_key in self.cache:
            return self.cache[cache_key]
        mask_mod, kv_size = self._mask_mod(mask_function, causal, static), self.size + self.context_size
        if self.dense:
            built = dense_mask(mask_mod, self.size, device, use_vmap=use_vmap, kv_size=kv_size).contiguous()
        else:
            built = _block_mask(mask_mod, self.size, device, kv_size=kv_size)
        tag_mask(built, MaskTag("layer", self, causal))
        if key is not None:
            self.cache[cache_key] = built
        return built

    @property
    def context_size(self) -> int:
        """Keys before the rows' own (none here; a chunk's context rows in `ContextMaskSource`)."""
        return 0

    def _cache_key(self, kind, device: torch.device) -> tuple:
        # Not the entries of `PackedForest.dense_mask()` / `block_mask()`: those are tagged "full" (hand-fed to
        # every layer), these are built for one layer kind.
        return ("layer", self.dense, kind, device)

    def _mask_mod(self, mask_function: Callable, causal: bool, static: bool) -> Callable:
        """The layer kind's mask_mod; `static`: reading `static_rows` copies of the forest's tensors, and the model's
        mask function through a global (`_through_global`)."""
        subtree_end, depth = self.subtree_end, self.depth
        if static:
            subtree_end, depth = static_rows(subtree_end), static_rows(depth)
            mask_function = _through_global(mask_function, depth.device)
        tree = tree_mask_mod(subtree_end)
        return tree if causal else and_masks(tree, at_depth(mask_function, depth))


class ContextMaskSource(TreeMaskSource):
    """The tree masks of one chunk of a forest's DFS row whose queries also see context rows: ancestors computed by
    earlier chunks (`hf_tree_attn.chunked`, `hf_tree_attn.prefix_reuse`).

    The chunk runs as a forest of its own rows (`.carrier` stands for it, as `TreeMaskSource`'s does), but each layer
    kind's mask is `(1, 1, S, P + S)`: its keys are the `P` context rows, then the chunk's `S` own rows, as
    `tree_flex_attention` concatenates them. A context row is seen where `context_tree_mask_mod` says so and the
    model's own mask function, read at the two depths, agrees (a sliding window counts depths across the boundary
    as within a chunk).

    Args:
        subtree_end: `(S,)` int — the chunk's own rows' subtree ends, local and cut at the chunk's end; `r + 1` for
            padding row `r`.
        depth: `(S,)` long — the own rows' depths (0 for padding).
        seq_lengths: `(N,)` long on the CPU — token count of each sequence of the whole forest (RoPE length checks).
        dense: dense bool masks (SDPA / eager) instead of `BlockMask`s (FlexAttention).
        context_end: `(P,)` int — global subtree end of each context row; 0 for padding (never seen).
        context_depth: `(P,)` long — depth of each context row.
        query_rows: `(S,)` int — global row of each own row; for padding rows one past the forest's last row.
    """

    def __init__(
        self,
        subtree_end: torch.Tensor,
        depth: torch.Tensor,
        seq_lengths: torch.Tensor,
        dense: bool,
        context_end: torch.Tensor,
        context_depth: torch.Tensor,
        query_rows: torch.Tensor,
    ):
        super().__init__(subtree_end, depth, seq_lengths, {}, dense)
        self.context_end = context_end
        self.context_depth = context_depth
        self.query_rows = query_rows

    @property
    def context_size(self) -> int:
        return self.context_end.shape[0]

    def _cache_key(self, kind, device: torch.device) -> tuple:
        return (kind,)  # a chunk's own cache: one dense flag, one device

    def _mask_mod(self, mask_function: Callable, causal: bool, static: bool) -> Callable:
        tree = context_tree_mask_mod(self.subtree_end, self.context_end, self.query_rows, static)
        if causal:
            return tree
        q_depth, kv_depth = self.depth, torch.cat([self.context_depth, self.depth])
        if static:
            q_depth, kv_depth = static_rows(q_depth), static_rows(kv_depth)
            mask_function = _through_global(mask_function, kv_depth.device)
        return and_masks(tree, at_depths(mask_function, q_depth, kv_depth))
