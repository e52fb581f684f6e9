"""How large prefix reuse's chunks may be: the largest chunk whose estimated peak memory fits a budget.

`hf_tree_attn.prefix_reuse` runs a forest's DFS row in chunks (`hf_tree_attn.chunked`). Its memory peaks in the
backward, while one chunk is recomputed with autograd on and every kept key and value waits for its gradient:

    peak = the chunk's layer activations        one chunk recomputed whole, or what the model's own checkpointing
                                                keeps of it (priced by `hf_tree_attn.recompute`)
         + the chunk's context                  P_c rows of keys and values in the layers it does not checkpoint,
                                                one layer's worth 3 times and once at float32 width, 2 x K_c rows
         + kept_kv = kept rows x `kv_row_bytes`  every kept key and value, in their dtype, from the forward on
         + kv_grad = the same in float32         their gradients, on their way back to the chunks that made them

`P_c` is the chunk's context (the ancestors of its first row) and `K_c` its own rows later chunks read. A layer
gathers its context keys and values when it runs and lets them go with it (`hf_tree_attn.context_kv`): a layer
that is not checkpointed keeps their concatenation with its own keys for its backward; the layer running in the
backward holds them gathered, concatenated, their gradient and its float32 copy, and its own kept rows with the
gradients later chunks sent them. The largest chunk counts, padded to `block` rows.

Smaller chunks hold fewer activations but usually keep more rows: every chunk boundary keeps the root path above it,
so more boundaries keep more of the tries' prompts and long sequences. Usually, not always: which rows are kept
depends on where the boundaries fall, and one size can keep fewer rows than a smaller one. So the total is not
monotonic in the chunk size, and `plan_prefix_reuse` tries every size (multiples of `block`) from the largest down,
taking the first that fits: the fewest chunks, the least recompute overhead. A size is priced in `O(rows)` without
planning it: row `r` is kept iff the first boundary after it, `(r // s + 1) * s`, lies inside its subtree.

What the budget leaves beside that peak buys back recomputes: the last chunk's forward graph is kept for the backward
(the backward's first chunk, priced above), and as many chunks before it as fit keep theirs too (`ReusePlan.
keep_graphs`), each holding what its layers keep for the backward (`hf_tree_attn.recompute`'s price per row: with the
model's own checkpointing, the layers' inputs) from its forward until its backward. Each kept graph saves one forward
of its rows: with every layer checkpointed a recomputed chunk runs five forwards' worth (the forward, the chunk's
recompute, the layers' recompute, the backward's two), a kept one four, what the split into micro-batches costs per
forwarded row.

The tiny example of `hf_tree_attn.tree` (`[[5, 6, 7, 8], [5, 6, 9]]`)::

    row          0  1  2  3  4        s = 2: boundaries 2, 4        s = 3: boundary 3
    subtree_end  5  5  4  4  5        row 0: 2 < 5 kept             row 0: 3 < 5 kept
                                      row 1: 2 < 5 kept             row 1: 3 < 5 kept
                                      row 2: 4 < 4 no               row 2: 3 < 4 kept
                                      row 3: 4 < 4 no               row 3: 6 < 4 no
                                      row 4: 6 < 5 no               row 4: 6 < 5 no

    kept rows [0, 1] at s = 2, [0, 1, 2] at s = 3 (`plan_chunks(forest, s).kept_rows`): the larger chunk keeps more.

What it does not price, as `hf_tree_attn.recompute` does not: the LM head's logits (chunked by the head), the dense
`(S, P + S)` masks of the CPU path, fused kernels' smaller footprints (an upper bound there). Layers the recompute
formula does not price (experts, latent attention, four norms) are refused with the way out (`budget_error`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from .chunked import ChunkPlan, plan_chunks
from .prefix_reuse import kv_row_bytes
from .recompute import _kept_bytes, activation_bytes, unpriced_reason
from .support import unwrap_model
from .tree import PackedForest

__all__ = ["ReusePlan", "budget_error", "plan_prefix_reuse", "reuse_estimate"]

_FIX = (
    "Raise the budget, set prefix_reuse off (micro-batches that each repeat the prefix they need), or score fewer or "
    "shorter sequences per step."
)


@dataclass(frozen=True)
class ReusePlan:
    """Chunks of one forest and their estimated peak memory in bytes (see the module docstring).

    Attributes:
        chunks: the `ChunkPlan` of `chunk_rows`-row chunks.
        chunk_rows: rows of one chunk (a multiple of the block, at most the forest's rows rounded up to it).
        activations: the layer activations of the chunk at which the peak is reached.
        context: that chunk's context and own kept rows' keys and values during its backward.
        kept_kv: every kept row's keys and values (`kept_kv_bytes` of `chunks`).
        kv_grad: their float32 gradients.
        keep_graphs: the last chunks whose forward graphs the budget also holds (`chunked_forest_logprobs(...,
            keep_graphs=)`: each saves its recompute in the backward); 1 without a budget.
        graphs: the bytes the graphs of those before the last hold, on top of `total`.
    """

    chunks: ChunkPlan
    chunk_rows: int
    activations: int
    context: int
    kept_kv: int
    kv_grad: int
    keep_graphs: int = 1
    graphs: int = 0

    @property
    def total(self) -> int:
        return self.activations + self.context + self.kept_kv + self.kv_grad


def budget_error(model: torch.nn.Module) -> str | None:
    """Why `plan_prefix_reuse` cannot price `model`'s chunks (a message with the way out), or None."""
    inner = unwrap_model(model)
    config = inner.config.get_text_config()
    layer = next((m for m in inner.modules() if isinstance(m, GradientCheckpointingLayer)), None)
    reason = unpriced_reason(config, layer)
    if reason is None:
        return None
    return (
        f"the prefix reuse budget prices a chunk's activations with hf_tree_attn.recompute, which does not price "
        f"{type(inner).__name__}'s {reason}. Leave the budget unset: chunks of the token budget's rows."
    )


def reuse_estimate(
    model: torch.nn.Module, forest: PackedForest, chunk_rows: int, *, block: int = 1, dtype: torch.dtype | None = None
) -> tuple[int, int, int, int]:
    """`(activations, context, kept_kv, kv_grad)` in bytes for `forest` in chunks of `chunk_rows` rows, priced
    without planning them (module docstring). `dtype`: of the kept keys and values (default: the model's
    parameters')."""
    return _estimate(_arrays(forest), chunk_rows, block, _prices(model, dtype))


def plan_prefix_reuse(
    model: torch.nn.Module,
    forest: PackedForest,
    *,
    max_chunk_rows: int,
    memory_budget_bytes: int | None = None,
    block: int | None = None,
    dtype: torch.dtype | None = None,
) -> ReusePlan:
    """The largest chunks of `forest` whose estimated peak memory fits `memory_budget_bytes` (module docstring).

    Args:
        model: the causal LM that will run the chunks (its config prices them; its decoder layers' checkpointing,
            as it is now, decides what a chunk's recompute keeps).
        forest: the whole step as one forest (`pack_forest(sequences, two_level=False)`).
        max_chunk_rows: most rows of one chunk (the token budget of one forward).
        memory_budget_bytes: bytes the peak may take; None = chunks of `max_chunk_rows` rows, priced.
        block: chunk sizes are multiples of it, each chunk priced padded to it (`chunked_forest_logprobs`'s
            `pad_multiple`); default 128 on CUDA (FlexAttention's block), 1 elsewhere.
        dtype: of the kept keys and values (default: the model's parameters'; autocast stores its own dtype).

    Raises:
        ValueError: no chunk size fits the budget, naming the least any needs and the ways out.
        NotImplementedError: `budget_error(model)`.
    """
    if block is None:
        block = 128 if forest.input_ids.device.type == "cuda" else 1
    for name, value in (("max_chunk_rows", max_chunk_rows), ("block", block)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int.")
    if max_chunk_rows < block:
        raise ValueError(
            f"max_chunk_rows={max_chunk_rows} holds no chunk of block={block} rows: use at least {block}."
        )
    # Every size from the forest's rows up makes one chunk: the same plan.
    top = min(max_chunk_rows // block, max(1, -(-forest.num_tree_tokens // block)))
    arrays, prices = _arrays(forest), _prices(model, dtype)
    least = None
    for chunk_rows in range(top * block, 0, -block):
        estimate = (chunk_rows, *_estimate(arrays, chunk_rows, block, prices))
        if memory_budget_bytes is None:
            return ReusePlan(plan_chunks(forest, chunk_rows), *estimate)
        if sum(estimate[1:]) <= memory_budget_bytes:
            headroom = memory_budget_bytes - sum(estimate[1:])
            keep, graphs = _kept_graphs(arrays, chunk_rows, block, prices, headroom)
            return ReusePlan(plan_chunks(forest, chunk_rows), *estimate, keep_graphs=keep, graphs=graphs)
        if least is None or sum(estimate[1:]) < sum(least[1:]):
            least = estimate
    chunk_rows, activations, context, kept_kv, kv_grad = least
    raise ValueError(
        f"No chunk size up to {max_chunk_rows} rows fits prefix reuse in memory_budget_bytes={memory_budget_bytes} "
        f"({_gib(memory_budget_bytes)}) for this forest of {forest.num_tree_tokens} rows: the least any needs is "
        f"{sum(least[1:])} bytes ({_gib(sum(least[1:]))}), at chunks of {chunk_rows} rows (layer activations "
        f"{_gib(activations)}, context {_gib(context)}, kept keys / values {_gib(kept_kv)}, their float32 gradients "
        f"{_gib(kv_grad)}). " + _FIX
    )


def _gib(size: int) -> str:
    return f"{size / 2**30:.4g} GiB"


def _arrays(forest: PackedForest) -> tuple[np.ndarray, np.ndarray]:
    """`(subtree_end, depth)` of the forest's real rows, `(N,)` int64 each."""
    num_rows = forest.num_tree_tokens
    end = forest.subtree_end[:num_rows].cpu().numpy().astype(np.int64)
    depth = forest.position_ids[0, :num_rows].cpu().numpy().astype(np.int64)
    return end, depth


def _kept_graphs(arrays, chunk_rows: int, block: int, prices: tuple, headroom: int) -> tuple[int, int]:
    """`(keep_graphs, their bytes beyond the last chunk's)`: the last chunks whose forward graphs fit `headroom`
    beside the peak the estimate priced, which holds one chunk's (the backward's first is the last chunk's kept
    graph). A chunk's graph holds what its layers keep for the backward (the activations' price per padded row), what
    it keeps outside them (per row: the final norm's float32 input, the LM head's input hidden state and the RoPE
    cosine and sine in the weights' dtype, and a few scalars) and, in the layers not checkpointed, its context's keys
    and values concatenated with its own. All kept graphs are alive when the backward starts, each freed by its
    chunk's backward."""
    end, depth = arrays
    per_token, row, _, uncheckpointed, num_layers, outside = prices
    starts = np.arange(0, len(end), chunk_rows, dtype=np.int64)
    padded = -(-(np.minimum(starts + chunk_rows, len(end)) - starts) // block) * block
    graph = padded * (per_token + outside) + _context_rows(depth, starts, block) * row * uncheckpointed // num_layers
    held = np.cumsum(graph[:-1][::-1])  # the second-to-last chunk's graph, then the one before, ...
    extra = int(np.searchsorted(held, headroom, side="right"))
    return 1 + extra, int(held[extra - 1]) if extra else 0


def _estimate(arrays, chunk_rows: int, block: int, prices: tuple) -> tuple[int, int, int, int]:
    end, depth = arrays
    per_token, row, row_fp32, uncheckpointed, num_layers, _ = prices
    num_rows = len(end)
    rows = np.arange(num_rows, dtype=np.int64)
    kept = (rows // chunk_rows + 1) * chunk_rows < end  # the first boundary after the row is inside its subtree
    starts = np.arange(0, num_rows, chunk_rows, dtype=np.int64)
    padded = -(-(np.minimum(starts + chunk_rows, num_rows) - starts) // block) * block
    context = _context_rows(depth, starts, block)
    own = np.bincount(rows[kept] // chunk_rows, minlength=len(starts))
    layers = padded * per_token
    held = context * (row * uncheckpointed + 3 * row + row_fp32) // num_layers + 2 * own * row
    peak = int(np.argmax(layers + held))
    count = int(kept.sum())
    return int(layers[peak]), int(held[peak]), count * row, count * row_fp32


def _context_rows(depth: np.ndarray, starts: np.ndarray, block: int) -> np.ndarray:
    """The context rows each chunk attends over: its first row's ancestors (the rows above it in its sequence),
    padded as `prefix_reuse` pads them (to a multiple of `block`, at least 2 rows)."""
    return -(-np.maximum(depth[starts], 2) // block) * block


def _prices(model: torch.nn.Module, dtype: torch.dtype | None) -> tuple[int, int, int, int, int, int]:
    """`(bytes per chunk row of layer activations, kept bytes per row in dtype, and at float32 width, the layers
    not checkpointed, all layers, bytes per chunk row a kept graph holds outside the layers)`."""
    error = budget_error(model)
    if error is not None:
        raise NotImplementedError(error[0].upper() + error[1:])
    inner = unwrap_model(model)
    config = inner.config.get_text_config()
    layers = [m for m in inner.modules() if isinstance(m, GradientCheckpointingLayer)]
    # The residual stream and the checkpoints' inputs keep the weights' dtype; autocast lowers only the matmuls'
    # outputs (fp32 weights under bf16 autocast: 4 bytes, an upper bound for the bf16 parts).
    weights = next((p for p in model.parameters() if p.is_floating_point()), None)
    width = weights.element_size() if weights is not None else 4
    whole, checkpointed = activation_bytes(config, dtype_bytes=width)
    count = sum(layer.gradient_checkpointing and layer.training for layer in layers)
    per_token = _kept_bytes(config.num_hidden_layers, count, whole, checkpointed, 0)
    num_layers = config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    # the final norm's float32 input, the head's input, RoPE's cos / sin, the log-prob scalars
    outside = config.hidden_size * 4 + (config.hidden_size + 2 * head_dim) * width + 32
    rows = kv_row_bytes(model, dtype), kv_row_bytes(model, torch.float32)
    return per_token, *rows, num_layers - count, num_layers, outside
