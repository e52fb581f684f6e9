"""Prefix reuse: a whole step as one forest, run in chunks of a token budget, each shared prefix computed once.

`hf_tree_attn.chunked` cuts the forest's DFS row into chunks and names each chunk's context rows (the ancestors of
its first row, computed by earlier chunks). This module runs such a plan with exact log-probs, entropies and
gradients for any loss of them, at the memory of one chunk's activations plus the kept keys and values:

- **forward** (no autograd; where a backward follows, the last `keep_graphs` chunks, 1 by default, with autograd, their
  graphs kept for the backward): the chunks in order. In every attention layer a chunk stores the post-RoPE keys and
  values of its rows that later chunks read (a per-layer store indexed by `ChunkPlan.slot`), and attends over `[its
  context rows' keys and values, gathered from the store; its own]` with the chunk's mask `(1, 1, S, P + S)`
  (`hf_tree_attn.masks.ContextMaskSource`). Each token is scored by the chunk holding its parent row.
- **backward**: the chunks in reverse, each recomputed with autograd on (those with a kept graph from it); one
  `torch.autograd.backward` per chunk from its log-probs / entropies (the incoming gradients; its final hidden states
  at zero where none has one and later chunks sent its rows gradients). Each layer's `[context; own]` keys and values
  come from one custom operator (`hf_tree_attn.context_kv`) whose backward, when autograd reaches that layer, adds
  the context rows' gradients into a float32 gradient store for the earlier chunks that computed them, and adds to
  the own rows' the gradients later chunks sent them: no layer's context is held until the chunk's backward ends,
  and where the model checkpoints its layers only the running layer's is alive. The operator is opaque to
  torch.compile, so decoder layers compiled by `hf_tree_attn.compile` can run the chunks with no graph break, one
  graph per grad mode for chunks of every context size (`LAYERS="compiled"`, the default; `LAYERS` says why); a
  hybrid's chunks always run the eager layers (their state-carrying kernels read and write the stores from Python).
  Parameter gradients accumulate in `.grad` as they would in one backward (the reentrant pattern of
  `torch.utils.checkpoint(..., use_reentrant=True)`, with its limits: `loss.backward()`, not `torch.autograd.grad`). So
  a data-parallel wrapper whose hooks expect one gradient per parameter per backward, and the same forwards on every
  rank, cannot reduce them: under DDP run the step under its `no_sync()` and average the `.grad`s over the ranks once
  per optimizer step, as the trainers do (`trainer.core.prefix_reuse_gradient_sync`). FSDP2 (`fully_shard`) reduces
  each backward's gradients itself, but gathers parameters and reduces gradients in collectives every rank must call
  alike: ranks whose forests cut into fewer chunks run dummy chunks until every rank runs as many, and every chunk
  gathers the LM head (or runs the caller's head) and runs a backward (`_fsdp_dummies`). Called from inside the model's
  own forward (TRL's fused head), FSDP2's backward of that forward is under way when the chunks' backwards run: each
  chunk's is made an FSDP2 pass of its own (`hf_tree_attn.fsdp2_compat.separate_backward`), or FSDP2 would leave its
  gradients unreduced. The trainers run every forest through here under FSDP2, one that fits one chunk too
  (`trainer.core.prefix_reuse_chunks`).

**State-carrying layers** (hybrids: gated and Kimi delta rule, Mamba-2, short convolutions;
`hf_tree_attn.recurrent`) are handled the same way. A chunk is a forest of its own rows (`recurrent.ChunkRows`)
whose segments end at its last row and at every row that branches in the whole forest. A root segment of the chunk
whose first row's parent lies in an earlier chunk (a boundary inside a segment, or a fork above the boundary) starts
from the recurrent state after that parent, which the earlier chunk kept; one chunk may start several segments from
several such states. A short convolution of kernel `K` reads the inputs of its rows' ancestors within `K - 1` rows
that lie before the chunk, kept by the chunks that computed them, in front of its own rows. Both live in per-layer
stores keyed by the layer (a forward pre-hook names the one running), written in the forward; in the backward the
context states / inputs are leaves whose gradients go into a float32 store for the earlier chunk, and the chunk's
own kept states / inputs receive the gradients later chunks sent them, as the keys and values do.

Cost: one forward, one recompute (none for a chunk whose graph is kept) and one backward per chunk, what full
activation checkpointing costs, with every row forwarded once; where the model checkpoints its own layers too, their
recompute in the backward comes on top, and a kept graph saves the chunk's own: with every graph kept the step costs
what one checkpointed forward and backward of the forest would, at the memory of every kept graph (with the model's
checkpointing, its layers' inputs) from the forward to the backward (`reuse_planner` keeps as many as a budget
holds). Memory beyond one chunk: `kept_kv_bytes` in the forward (the kept keys and
values of every attention layer, held until the backward), and as much again in float32 for their gradients during
the backward; on hybrids also the kept recurrent states (one per state-carrying layer and kept row, float32 for the
torch delta rule) and convolution inputs (`kept_state_bytes`), and their float32 gradients. RNG and autocast
states of each chunk's forward are restored for its recompute.

What it refuses, before any forward (`prefix_reuse_error`): models `check_tree_model` refuses; chunked attention,
layer kinds it does not know and attention temperature tuning (not verified with context rows). The way out is
`prefix_reuse=False`. Transformers' non-reentrant activation checkpointing inside the model works; the
reentrant one is refused (its forward keeps no graph).

Devices: on CPU the chunk masks are dense and attention runs through SDPA / HF's eager math (softcap, sinks). On CUDA
`HF_TREE_ATTN_PREFIX_REUSE_CUDA` (or `CUDA_PATH`) picks the path: `flex` (the default: FlexAttention with a
`BlockMask` over the concatenated keys) or `dense` (SDPA on dense masks: exact, `S * (P + S)` bytes of mask per layer
kind). Both passed their exactness tests on an H200 (`tests/test_gpu_prefix_reuse.py`), where a 168k-row agent step
ran 1.19x faster than the same step split into micro-batches (`benchmarks/results/README.md`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import weakref

import numpy as np
import torch

from .chunked import ChunkPlan, plan_chunks
from .compile import eager_layers
from .context_kv import module_token, running, tag_modules
from .fsdp2_compat import regather_outer_params, separate_backward
from .logprobs import _final_hidden_states, lm_head_logprobs
from .masks import ContextMaskSource
from .model_inputs import check_forest_inputs
from .support import check_tree_model, config_field, fsdp2_sharded, ranks_max, unwrap_model
from .tree import PackedForest

__all__ = [
    "CUDA_PATH",
    "LAYERS",
    "chunked_forest_logprobs",
    "chunked_forest_scores",
    "cuda_path_error",
    "kept_kv_bytes",
    "kept_state_bytes",
    "kv_row_bytes",
    "layers_error",
    "prefix_reuse_error",
]

# How prefix reuse attends on CUDA: "flex" (FlexAttention, the default) or "dense" (SDPA on dense masks). From
# HF_TREE_ATTN_PREFIX_REUSE_CUDA at import; may be set at run time (`cuda_path_error` checks it where it is read).
_CUDA_PATHS = ("flex", "dense")
CUDA_PATH = (os.environ.get("HF_TREE_ATTN_PREFIX_REUSE_CUDA") or "flex").strip().lower()

# Which decoder layers the chunks run where the model's are compiled (`hf_tree_attn.compile`): "compiled" (the
# default: through `hf_tree_attn.context_kv`'s operator, exact, no graph break) or "eager". On one H100, Qwen3-1.7B
# shape, a 188k-row agent step in 65,536-row chunks, each in its own process and paired per step: compiled chunks
# 25.9 s a step against the eager chunks' 29.0 s, 1.12x [1.12x, 1.13x] over 8 steps, 39.1 against 40.9 GiB at the
# peak; their first step, compiling into an empty inductor cache, 112 s against 50 s
# (benchmarks/results/prefix_reuse_gpu_h100_qwen3-1.7b_compiled_aligned.json). Their FlexAttention kernels, built
# inside the dynamic-shape layer graphs, run as fast as the eager chunks' only since the operator's layer token
# lives on the keys' device (`context_kv.module_token`): inductor takes an opaque operator's outputs as unaligned
# where any input is a CPU tensor, and without the keys' 16-byte alignment hint the calls took 1.4-1.8x the time.
# From HF_TREE_ATTN_PREFIX_REUSE_LAYERS at import; may be set at run time (`layers_error` checks it where it is read).
_LAYER_MODES = ("eager", "compiled")
LAYERS = (os.environ.get("HF_TREE_ATTN_PREFIX_REUSE_LAYERS") or "compiled").strip().lower()

_ATTENTION_KINDS = ("full_attention", "sliding_attention")
_PER_TOKEN_KINDS = ("mlp", "moe", "dense", "sparse")
_FIX = (
    "Score it with prefix_reuse=False (the default): micro-batches that repeat the prefix they share, each "
    "sequence within max_tokens_per_mb."
)


def prefix_reuse_error(model: torch.nn.Module) -> str | None:
    """Why `model` cannot run prefix reuse (a message with the reason and the way out), or None. Call
    `check_tree_model` first: this only adds what chunking needs beyond a tree."""
    from .recurrent import _KIND_LAYER_TYPES, CHUNKED_KINDS, STATE_LAYER_TYPES, TREE_LAYERS, _class_path

    inner = unwrap_model(model)
    config = inner.config.get_text_config()
    name = type(inner).__name__
    kinds = list(dict.fromkeys(config_field(config, "layer_types", default=()) or ()))
    paths = {type(m): _class_path(type(m)) for m in inner.modules()}
    layers = {cls: TREE_LAYERS[path] for cls, path in paths.items() if path in TREE_LAYERS}
    refused = sorted(cls.__name__ for cls, kind in layers.items() if kind not in CHUNKED_KINDS)
    if refused:
        return (
            f"{name} has state-carrying layers ({', '.join(refused)}) whose state prefix reuse does not carry from "
            f"one chunk to the next (it carries those of {', '.join(CHUNKED_KINDS)} layers). " + _FIX
        )
    state_types = {t for kind in layers.values() for t in _KIND_LAYER_TYPES[kind]}
    untracked = [k for k in kinds if k in STATE_LAYER_TYPES and k not in state_types]
    if untracked:
        return (
            f"{name} has layers that carry a state from token to token (layer types {untracked}) of no class "
            "prefix reuse knows: it could not start them from the state a chunk's first row inherits. " + _FIX
        )
    kinds = [k for k in kinds if k not in state_types]
    unknown = [k for k in kinds if k not in _ATTENTION_KINDS + _PER_TOKEN_KINDS]
    chunk = config_field(config, "attention_chunk_size")
    if unknown or chunk:
        what = f"layer types {unknown}" if unknown else f"attention_chunk_size={chunk}"
        return (
            f"{name} has {what}: prefix reuse is verified for full and sliding-window attention only "
            f"({list(_ATTENTION_KINDS)}). " + _FIX
        )
    if any(getattr(m, "attn_temperature_tuning", False) for m in inner.modules()):
        return (
            f"{name} scales its queries by position (attention temperature tuning), which prefix reuse does not "
            "verify. " + _FIX
        )
    return None


def kept_kv_bytes(model: torch.nn.Module, plan: ChunkPlan, dtype: torch.dtype | None = None) -> int:
    """`plan.kept_kv_bytes` for `model`'s attention layers: `len(plan.kept_rows) * kv_row_bytes(model, dtype)`."""
    return len(plan.kept_rows) * kv_row_bytes(model, dtype)


def kv_row_bytes(model: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of one row's keys and values over `model`'s attention layers, read from its config: layers of an
    attention kind (all when the config has no `layer_types`), `num_key_value_heads`, `head_dim` (or hidden size /
    heads), in `dtype` (default: the model's parameters'). Multi-head latent attention counts its key and value
    widths."""
    config = unwrap_model(model).config.get_text_config()
    dtype = dtype or next(model.parameters()).dtype
    kinds = config_field(config, "layer_types")
    layers = sum(k in _ATTENTION_KINDS for k in kinds) if kinds else config.num_hidden_layers
    heads = config.num_attention_heads
    if config_field(config, "kv_lora_rank"):  # keys qk_nope + qk_rope wide, values v_head_dim, one per query head
        width = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
        return layers * heads * width * dtype.itemsize
    kv_heads = config_field(config, "num_key_value_heads", default=heads)
    head_dim = config_field(config, "head_dim") or config.hidden_size // heads
    return layers * 2 * kv_heads * head_dim * dtype.itemsize


def kept_state_bytes(model: torch.nn.Module, forest: PackedForest, plan: ChunkPlan, dtype: torch.dtype | None = None):
    """Bytes a hybrid keeps beyond `kept_kv_bytes` for `plan` of `forest`: per state-carrying layer, the recurrent
    state after every row a later chunk continues (`heads x k_dim x v_dim` in float32, as the torch delta rule keeps
    it) and the convolution inputs of the rows later chunks' windows reach (`channels` in `dtype`, default the model's
    parameters'). 0 for a model without such layers. Their float32 gradients take as much again, at most."""
    from .recurrent import TREE_LAYERS, _class_path

    dtype = dtype or next(model.parameters()).dtype
    n = forest.num_tree_tokens
    parent = forest.parent[:n].cpu().numpy().astype(np.int64)
    states = len(_state_rows(parent, plan.bounds))
    total = 0
    for module in unwrap_model(model).modules():
        if _class_path(type(module)) not in TREE_LAYERS:
            continue
        conv = next(c for c in module.modules() if isinstance(c, torch.nn.Conv1d))
        total += len(_conv_rows(parent, plan.bounds, conv.kernel_size[0])) * conv.in_channels * dtype.itemsize
        heads = getattr(module, "num_v_heads", getattr(module, "num_heads", 0))
        k_dim = getattr(module, "head_k_dim", getattr(module, "head_dim", 0))
        v_dim = getattr(module, "head_v_dim", getattr(module, "head_dim", 0))
        kind = TREE_LAYERS[_class_path(type(module))]
        if kind == "mamba2":  # the SSD state: heads x head_dim x ssm_state_size, float32 in the torch scan
            k_dim, v_dim = module.head_dim, module.ssm_state_size
        if kind != "short_conv":
            total += states * heads * k_dim * v_dim * torch.float32.itemsize
    return total


def _state_rows(parent: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """The rows whose state (after them) a later chunk starts from: the parents of rows whose parent lies in an
    earlier chunk, ascending."""
    chunk = np.searchsorted(bounds, np.arange(len(parent)), side="right") - 1
    return np.unique(parent[(parent >= 0) & (parent < bounds[chunk])])


def _conv_rows(parent: np.ndarray, bounds: np.ndarray, kernel_size: int) -> np.ndarray:
    """The rows whose convolution input a later chunk's window reads: ancestors within `kernel_size - 1` rows of one
    of its rows, before its first row; ascending."""
    rows = np.arange(len(parent))
    first = bounds[np.searchsorted(bounds, rows, side="right") - 1]
    up, reached = rows, [np.zeros(0, dtype=np.int64)]
    for _ in range(kernel_size - 1):
        up = np.where(up >= 0, parent[np.maximum(up, 0)], -1)
        reached.append(up[(up >= 0) & (up < first)])
    return np.unique(np.concatenate(reached))


def chunked_forest_logprobs(
    model: torch.nn.Module,
    forest: PackedForest,
    max_tokens_per_mb: int,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_rows: int | None = None,
    fp32_head: bool = False,
    pad_multiple: int | None = None,
    keep_graphs: int = 1,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`forest_logprobs` of a forest larger than one forward: its DFS row in chunks of `max_tokens_per_mb` rows,
    each row forwarded once (see the module docstring).

    Args:
        model: a causal LM with `attn_implementation="tree_flex"` that `prefix_reuse_error` accepts.
        forest: the whole step as one forest on the model's device, best a plain trie (`pack_forest(sequences,
            two_level=False)`: every shared token once).
        max_tokens_per_mb: rows of one chunk (a forward's queries; its keys add the chunk's context rows).
        temperature, return_entropy, chunk_rows, fp32_head: as in `forest_logprobs`.
        pad_multiple: each chunk's rows and context rows are padded to a multiple of it; default 128 on CUDA
            (FlexAttention's block), 1 elsewhere.
        keep_graphs: under grad, the last chunks whose forward runs with autograd, the graph kept for the backward
            instead of recomputed there: each saves one forward of its rows and holds what its forward keeps for
            the backward (with the model's own checkpointing, its layers' inputs) until its backward runs
            (`reuse_planner.plan_prefix_reuse` picks how many fit a budget). At least 1.

    Returns:
        `(logps, entropy)`, each `(S,)` float32 indexed by the forest's rows (0 at unscored rows); `entropy` is None
        unless requested. Differentiable (through a reentrant backward: call `.backward()` on the loss).
    """
    dense, pad_multiple = _checked(model, forest, temperature, pad_multiple)
    plan = plan_chunks(forest, max_tokens_per_mb)
    step = _Step(
        model, forest, plan, temperature, return_entropy, chunk_rows, fp32_head, dense, pad_multiple,
        keep_graphs=_positive(keep_graphs),
    )  # fmt: skip
    tables = _run(model, step)
    return tables[0], (tables[1] if return_entropy else None)


def chunked_forest_scores(
    model: torch.nn.Module,
    forest: PackedForest,
    max_tokens_per_mb: int,
    sources: torch.Tensor,
    targets: torch.Tensor,
    head,
    pad_multiple: int | None = None,
    keep_graphs: int = 1,
) -> tuple[torch.Tensor | None, ...]:
    """`chunked_forest_logprobs` with the caller's LM head on the caller's (row, target) pairs: each pair is scored
    by `head` in the chunk holding its row, and the chunks that score nothing still run where later chunks read
    their rows (a prompt no pair is scored in).

    Args:
        model, forest, max_tokens_per_mb, pad_multiple, keep_graphs: as in `chunked_forest_logprobs`.
        sources: `(U,)` long — the forest row whose final hidden state scores each pair.
        targets: `(U,)` long — the token each pair scores.
        head: `head(hidden (E, hidden), targets (E,))` -> a tuple of `(E,)` tensors or None, the same length and
            dtypes for every call (TRL's fused head kernel: log-probs, entropies, metrics); it runs under the
            autocast the call runs under, and again in the backward.

    Returns:
        The head's outputs for every pair, `(U,)` each (None where the head gives None). Differentiable through the
        float outputs (a reentrant backward: call `.backward()` on the loss).
    """
    dense, pad_multiple = _checked(model, forest, 1.0, pad_multiple)
    plan = plan_chunks(forest, max_tokens_per_mb)
    pairs = (sources.to(forest.input_ids.device), targets.to(forest.input_ids.device), head)
    step = _Step(
        model, forest, plan, 1.0, False, None, False, dense, pad_multiple, pairs=pairs,
        keep_graphs=_positive(keep_graphs),
    )  # fmt: skip
    tables = iter(_run(model, step))
    return tuple(next(tables) if present else None for present in step.present)


def cuda_path_error() -> str | None:
    """Why `CUDA_PATH` names no path prefix reuse can take on CUDA, or None."""
    if CUDA_PATH in _CUDA_PATHS:
        return None
    return (
        f"HF_TREE_ATTN_PREFIX_REUSE_CUDA={CUDA_PATH!r} is not a path prefix reuse takes on CUDA: set it to flex "
        "(FlexAttention, the default) or dense (SDPA on dense masks), or unset it."
    )


def layers_error() -> str | None:
    """Why `LAYERS` names no decoder layers the chunks can run, or None."""
    if LAYERS in _LAYER_MODES:
        return None
    return (
        f"HF_TREE_ATTN_PREFIX_REUSE_LAYERS={LAYERS!r} names no decoder layers prefix reuse's chunks run: set it to "
        "compiled (the model's compiled layers where it has them, the default) or eager, or unset it."
    )


def _positive(keep_graphs: int) -> int:
    if isinstance(keep_graphs, bool) or not isinstance(keep_graphs, int | np.integer) or keep_graphs < 1:
        raise ValueError(f"keep_graphs={keep_graphs!r} must be a positive int (1: the last chunk's graph).")
    return int(keep_graphs)


def _checked(model, forest: PackedForest, temperature: float, pad_multiple: int | None) -> tuple[bool, int]:
    """Refuse what prefix reuse cannot run (see the module docstring); `(dense, pad_multiple)` for the device."""
    check_tree_model(model)
    error = prefix_reuse_error(model)
    if error is not None:
        raise NotImplementedError(error)
    check_forest_inputs(unwrap_model(model), forest, temperature)
    if (error := layers_error()) is not None:
        raise ValueError(error)
    device = forest.input_ids.device
    if device.type == "cuda" and (error := cuda_path_error()) is not None:
        raise ValueError(error)
    dense = device.type != "cuda" or CUDA_PATH == "dense"
    if pad_multiple is None:
        pad_multiple = 128 if device.type == "cuda" else 1
    return dense, pad_multiple


def _run(model, step: _Step) -> tuple[torch.Tensor, ...]:
    params = [p for p in model.parameters() if p.requires_grad]
    if not (torch.is_grad_enabled() and params):
        return step.forward()
    # The parameters are the node's inputs so that `torch.autograd.grad(loss, params)` reaches its backward, which
    # then refuses it, rather than returning no gradient without a word.
    return _PrefixReuse.apply(step, *params)


class _PrefixReuse(torch.autograd.Function):
    """The whole chunked forest as one autograd node: outputs the per-row tables, runs `_Step.backward`."""

    @staticmethod
    def forward(ctx, step: _Step, *params: torch.Tensor):
        ctx.step = step
        ctx.num_params = len(params)
        return step.forward(keep=True)

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "Prefix reuse accumulates parameter gradients in `.grad` from a backward of its own, so it works "
                "with `loss.backward()` but not with `torch.autograd.grad(...)` or `.backward(inputs=...)`."
            )
        ctx.step.backward(grads)
        return (None,) * (1 + ctx.num_params)  # the parameters' gradients are already in their `.grad`


class _Step:
    """One forest run as a `ChunkPlan`: its key/value store, the chunks' forwards and their backward."""

    def __init__(
        self,
        model,
        forest,
        plan,
        temperature,
        return_entropy,
        chunk_rows,
        fp32_head,
        dense,
        pad_multiple,
        pairs=None,
        keep_graphs: int = 1,
    ):
        self.model = model
        self.forest = forest
        self.plan = plan
        self.head = dict(
            temperature=temperature, return_entropy=return_entropy, chunk_rows=chunk_rows, fp32_head=fp32_head
        )
        self.dense = dense
        self.pad_multiple = pad_multiple
        self.device = forest.input_ids.device
        n = forest.num_tree_tokens
        self.ids = forest.input_ids[0, :n]
        self.depth = forest.position_ids[0, :n]
        self.end = forest.subtree_end[:n]
        self.parent = forest.parent[:n]
        self.seq_lengths = forest.seq_offsets.diff().cpu()
        self.np_parent = forest.parent[:n].cpu().numpy().astype(np.int64)
        self.np_end = forest.subtree_end[:n].cpu().numpy().astype(np.int64)
        self.slot = torch.from_numpy(plan.slot).to(self.device)
        self.kv: dict[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}  # (1, kv_heads, K, head_dim) each
        self.kv_grad: dict[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}  # float32, same shapes
        self.states: dict[int, tuple] = {}  # chunk -> RNG states at its forward
        # State-carrying layers: (module, "scan" | "conv") -> kept states / conv inputs `(slots, ...)`, and their
        # float32 gradients; `layer` is the state-carrying module now running (set by forward pre-hooks).
        self.rec: dict[tuple, torch.Tensor] = {}
        self.rec_grad: dict[tuple, torch.Tensor] = {}
        self.layer: torch.nn.Module | None = None
        self._state_plan: tuple | None = None
        self._conv_plans: dict[int, tuple] = {}
        self.autocast = _autocast_state(self.device.type)
        # The state-carrying modules (`_layer_hooks`), found once; a hybrid's layers run eagerly (`_layers`)
        self.stateful = _state_carrying(model)
        tag_modules(model, self.device)  # before a compiled layer is traced (`hf_tree_attn.context_kv`)
        # What each chunk scores: the rows whose parent it holds (`plan.scored`), or the caller's pairs whose row it
        # holds; then a chunk that scores nothing may still hold rows later chunks read, and must run.
        self.pairs = pairs
        if pairs is None:
            self.items = [torch.from_numpy(rows).to(self.device) for rows in plan.scored]
            self.runs = plan.needed
            self.size = forest.seq_len
        else:
            sources = pairs[0].cpu().numpy()
            chunk = np.searchsorted(plan.bounds, sources, side="right") - 1
            self.items = [torch.from_numpy(np.flatnonzero(chunk == c)).to(self.device) for c in range(plan.num_chunks)]
            holds = [bool((plan.slot[plan.bounds[c] : plan.bounds[c + 1]] >= 0).any()) for c in range(plan.num_chunks)]
            self.runs = np.array([len(i) > 0 or h for i, h in zip(self.items, holds)], dtype=bool)
            self.size = len(sources)
        self.present: list[bool] | None = None  # which of the head's outputs are tensors (known after a chunk)
        self.released = False  # the stores freed by the backward
        # The chunks in the order they run: their indices, then under FSDP the dummies (-1) that give every rank
        # the same number of chunks (`_fsdp_dummies`).
        self.fsdp = fsdp2_sharded(model)
        # The last chunks run with autograd in the forward, their graphs kept for the backward: position -> (context,
        # items, outputs). Under FSDP each kept graph's backward after the first gathers the parameters outside the
        # decoder layers first (`fsdp2_compat.regather_outer_params`), and every rank recomputes as many chunks as the
        # rank that recomputes the most (a kept chunk and a recomputed one call different collectives; dummies count
        # as kept).
        self.keep_graphs = keep_graphs
        self.kept: dict[int, tuple] = {}
        self.order = np.flatnonzero(self.runs).tolist()
        if self.fsdp:
            dummies, self.keep_graphs = _fsdp_dummies(model, len(self.order), self.device, keep_graphs)
            self.order += [-1] * dummies

    def forward(self, keep: bool = False) -> tuple[torch.Tensor, ...]:
        """The chunks in order, without autograd; with `keep` (a backward follows) the last `keep_graphs` chunks with
        autograd, their graphs kept for the backward, which would recompute them first (one forward of their rows
        saved each; the last at the memory the backward's first chunk takes anyway, the others at what their graphs
        hold until their backward: `reuse_planner` prices it). A kept chunk also stores the rows later chunks read."""
        tables: list[torch.Tensor | None] | None = None
        first_kept = len(self.order) - (min(self.keep_graphs, len(self.order)) if keep else 0)
        with torch.no_grad(), self._layers(), self._layer_hooks():
            for k, c in enumerate(self.order):
                self.states[k] = _rng_state(self.device)
                if k >= first_kept:
                    with torch.enable_grad():
                        self.kept[k] = self._run(c, backward=True, store=True)
                    _, items, outputs = self.kept[k]
                    outputs = None if outputs is None else tuple(o if o is None else o.detach() for o in outputs)
                else:
                    _, items, outputs = self._run(c, backward=False)
                if outputs is None:
                    continue
                if tables is None:
                    tables = [None if o is None else o.new_zeros(self.size) for o in outputs]
                for table, values in zip(tables, outputs):
                    if table is not None:
                        table[items] = values
        if self.pairs is None:  # log-probs, and entropies where asked for: float32 tables indexed by row
            zeros = torch.zeros(self.size, dtype=torch.float32, device=self.device)
            tables = [zeros, zeros.clone()] if tables is None else [t if t is not None else zeros for t in tables]
            return tuple(tables) if self.head["return_entropy"] else (tables[0],)
        if tables is None:
            raise ValueError("No chunk scored a pair: pass at least one (row, target) pair.")
        self.present = [t is not None for t in tables]
        return tuple(t for t in tables if t is not None)

    def backward(self, grads: tuple[torch.Tensor, ...]) -> None:
        if self.released:
            raise RuntimeError(
                "Prefix reuse's backward ran twice on one forward (retain_graph=True): its kept keys and values are "
                "freed by the first. Run the forward again for a second backward."
            )
        self.kv_grad, self.rec_grad = {}, {}
        for k in reversed(range(len(self.order))):
            c = self.order[k]
            kept = k in self.kept
            with contextlib.ExitStack() as stack:
                # the forward's RNG and autocast for the recompute (a kept graph's checkpoints hold theirs)
                if not kept:
                    stack.enter_context(_restored_rng(self.device, self.states[k]))
                    for autocast in _autocasts(self.autocast):
                        stack.enter_context(autocast)
                stack.enter_context(self._layers())
                stack.enter_context(self._layer_hooks())
                if self.fsdp:  # each chunk's backward an FSDP2 pass of its own, inside the model's forward too
                    stack.enter_context(separate_backward(self.model))
                stack.enter_context(torch.enable_grad())
                if kept:
                    context, items, values = self.kept.pop(k)
                    if self.fsdp and k < len(self.order) - 1:
                        regather_outer_params(self.model)
                else:
                    context, items, values = self._run(c, backward=True)
                # The outputs the loss reads: a zero gradient (an output only metrics read) adds nothing.
                values = [v for v in values or () if v is not None]
                outputs = [
                    (v, g[items])
                    for v, g in zip(values, grads)
                    if g is not None and v.is_floating_point() and g[items].any()
                ]
                if not outputs and self.kv_grad and len(context.own_local):
                    # The gradients later chunks sent the rows they read enter at each layer's keys and values
                    # (`ChunkContext.scatter`): with no output to start from, start from the hidden states at zero.
                    outputs.append((context.hidden, torch.zeros_like(context.hidden)))
                for key, (tensor, slots) in context.rec_own.items():  # kept states / conv inputs later chunks read
                    if key in self.rec_grad:
                        outputs.append((tensor, self.rec_grad[key][slots].to(tensor.dtype)))
                if context.probe is not None:  # under FSDP every chunk runs a backward through every layer
                    outputs.append((context.probe, torch.zeros_like(context.probe)))
                outputs = [(t, g) for t, g in outputs if t.requires_grad]
                if outputs:
                    with running(context):
                        torch.autograd.backward([t for t, _ in outputs], [g for _, g in outputs])
            for key, (leaf, slots) in context.rec_leaves.items():
                if leaf.grad is None:
                    continue
                if key not in self.rec_grad:
                    self.rec_grad[key] = torch.zeros_like(self.rec[key], dtype=torch.float32)
                self.rec_grad[key].index_add_(0, slots, leaf.grad.float())
            # The chunk's graph reaches back to its context through the layers' checkpoints (their recompute keeps
            # `tree_context`): a cycle through autograd's nodes that Python's collector cannot see, which kept every
            # step's stores alive. Cut it.
            context.release()
        # The stores are the step's largest tensors: free them now, not when the outputs' graph goes.
        self.kv, self.kv_grad, self.rec, self.rec_grad, self.states, self.kept = {}, {}, {}, {}, {}, {}
        self.released = True

    def _layers(self):
        """The decoder layers the chunks run: the model's own, compiled ones included (`hf_tree_attn.compile`; their
        context keys and values through `hf_tree_attn.context_kv`'s operator), or with `LAYERS="eager"` the eager
        ones; a hybrid's always eagerly: its state-carrying kernels read and write the step's stores from Python."""
        return eager_layers(self.model) if self.stateful or LAYERS != "compiled" else contextlib.nullcontext()

    @contextlib.contextmanager
    def _layer_hooks(self):
        """Forward pre-hooks on the model's state-carrying layers: `self.layer` is the one running (the key of its
        kept states; a checkpointed layer's recompute in the backward sets it again)."""

        def enter(module, args):
            self.layer = module

        handles = [m.register_forward_pre_hook(enter) for m in self.stateful]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self.layer = None

    def state_plan(self) -> tuple[np.ndarray, int, np.ndarray]:
        """`(state_slot (N,), slots, branching (N,) bool)`: the rows whose state (after them) a later chunk starts
        from — the parents of rows whose parent lies in an earlier chunk — indexed into a store; and the rows with
        two children or more (where a chunk's segments end, as the forest's do)."""
        if self._state_plan is None:
            parent = self.np_parent
            state_rows = _state_rows(parent, self.plan.bounds)
            slot = np.full(len(parent), -1, dtype=np.int64)
            slot[state_rows] = np.arange(len(state_rows))
            branching = np.bincount(parent[parent >= 0], minlength=len(parent)) >= 2
            self._state_plan = (slot, len(state_rows), branching)
        return self._state_plan

    def conv_plan(self, kernel_size: int) -> tuple[np.ndarray, int]:
        """`(conv_slot (N,), slots)`: the rows whose convolution input a later chunk's window reads (an ancestor
        within `kernel_size - 1` rows of one of its rows, before its first row), indexed into a store."""
        if kernel_size not in self._conv_plans:
            parent = self.np_parent
            conv_rows = _conv_rows(parent, self.plan.bounds, kernel_size)
            slot = np.full(len(parent), -1, dtype=np.int64)
            slot[conv_rows] = np.arange(len(conv_rows))
            self._conv_plans[kernel_size] = (slot, len(conv_rows))
        return self._conv_plans[kernel_size]

    def _run(self, c: int, backward: bool, store: bool = False):
        """Chunk `c` through the model and the LM head: `(context, scored items (E,), the head's outputs (E,) each)`,
        the outputs None where the chunk scores nothing. `backward`: with autograd (context rows as leaves whose
        gradients go back to the chunks that computed them); `store`: with it, also store the rows later chunks read
        (a chunk whose graph the forward keeps)."""
        plan, device, pad = self.plan, self.device, self.pad_multiple
        dummy = c < 0  # under FSDP: the forest's first row alone, keeping and scoring nothing (`_fsdp_dummies`)
        a, b = (0, 1) if dummy else (int(plan.bounds[c]), int(plan.bounds[c + 1]))
        n = b - a
        size = -(-n // pad) * pad
        fill = size - n
        context_rows = torch.from_numpy(plan.context[0 if dummy else c]).to(device)
        # At least 2 context rows, padding if need be: a compiled layer would specialize a width of 0 (or 1), and
        # compile the first chunk's graphs apart from the others'.
        context_fill = -(-max(len(context_rows), 2) // pad) * pad - len(context_rows)

        # Padding rows are fed the chunk's first token, for the reason `forest_forward_kwargs` gives.
        ids = torch.cat([self.ids[a:b], self.ids[a : a + 1].expand(fill)])
        depth = torch.cat([self.depth[a:b], self.depth.new_zeros(fill)])
        local_end = torch.cat([
            self.end[a:b].clamp(max=b) - a,
            torch.arange(n + 1, size + 1, dtype=self.end.dtype, device=device),  # padding sees itself only
        ])  # fmt: skip
        query_rows = torch.cat([
            torch.arange(a, b, dtype=self.end.dtype, device=device),
            self.end.new_full((fill,), self.forest.num_tree_tokens),  # past every context row's subtree
        ])  # fmt: skip
        source = ContextMaskSource(
            local_end,
            depth,
            self.seq_lengths,
            self.dense,
            context_end=torch.cat([self.end[context_rows], self.end.new_zeros(context_fill)]),
            context_depth=torch.cat([self.depth[context_rows], self.depth.new_zeros(context_fill)]),
            query_rows=query_rows,
        )
        own = torch.arange(a, b, device=device)
        kept = self.slot[a:b] >= 0
        if dummy:
            kept = torch.zeros_like(kept)
        context = ChunkContext(
            self,
            source,
            context_slots=self.slot[context_rows],
            context_fill=context_fill,
            own_local=(own[kept] - a),
            own_slots=self.slot[a:b][kept],
            backward=backward,
            rows=(a, b, size),
            dummy=dummy,
            store=store or not backward,
        )
        inputs = {
            "input_ids": ids[None],
            "position_ids": depth[None],
            "attention_mask": source.carrier,
            "tree_context": context,
            "use_cache": False,
        }
        with running(context):
            hidden, _ = _final_hidden_states(self.model, inputs)
        if backward and len(context.own_local):
            context.hidden = hidden
        items = self.items[0][:0] if dummy else self.items[c]
        if len(items) == 0 and not self.fsdp:
            return context, items, None
        if self.pairs is None:
            sources, targets = self.parent[items] - a, self.ids[items]
        else:
            sources, targets = self.pairs[0][items] - a, self.pairs[1][items]
        if self.fsdp:
            # The LM head gathers its shards (a collective) once in every chunk, scoring or not, with one extra row
            # (the chunk's first, its gradient zero) that the backward always starts from: every rank then runs the
            # same collectives, chunk for chunk.
            sources, targets = torch.cat([sources, sources.new_zeros(1)]), torch.cat([targets, self.ids[:1]])
        if self.pairs is None:
            outputs = tuple(lm_head_logprobs(self.model, hidden[0], sources, targets, **self.head))
        else:
            outputs = tuple(self.pairs[2](hidden[0, sources], targets))
        if self.fsdp:
            context.probe = outputs[0][-1:]
            outputs = tuple(o if o is None else o[:-1] for o in outputs)
        return context, items, (outputs if len(items) else None)


class ChunkContext:
    """What `tree_flex_attention` needs to run one chunk of a prefix-reuse forward (passed as `tree_context`).

    `attend(module, key, value)` returns `[context keys; padding; own keys]` and the same for values, `(1, kv_heads,
    P + fill + S, head_dim)`, through `hf_tree_attn::chunk_context_kv` (`hf_tree_attn.context_kv`), whose body is
    `gather` and whose backward's is `scatter`: in the forward, the own rows later chunks read go into the store; in
    the backward, the context rows' gradients go back to the chunks that computed them, and the own kept rows'
    receive the gradients later chunks sent them. A second call of one module in a backward pass is the recompute of
    non-reentrant activation checkpointing: it gathers again (the same operations as the first call).

    Attributes:
        mask_source: the chunk's `ContextMaskSource` (its masks must be the ones the layers get).
        context_slots: `(P,)` long — store slots of the context rows.
        own_local: `(K_c,)` long — the chunk's rows that later chunks read, as indices into the chunk.
        own_slots: `(K_c,)` long — their store slots.
    """

    def __init__(
        self, step, mask_source, context_slots, context_fill, own_local, own_slots, backward, rows, dummy, store
    ):
        # Weakly: the layers' checkpoints keep this context (their arguments) in the graph
        self._step = weakref.ref(step)
        self.dummy = dummy  # an FSDP dummy chunk (`_fsdp_dummies`): it keeps no state or input for later chunks
        self.probe: torch.Tensor | None = None  # under FSDP: a zero-weighted output every chunk's backward starts from
        self.rows = rows  # (first row, end row, padded size)
        self.rec_leaves: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # key -> (context states, slots)
        self.rec_own: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # key -> (own kept states, slots)
        self.stored: set[tuple] = set()  # keys whose states / conv inputs this chunk stored
        self._recurrent_rows = None
        self._convs: dict[int, object] = {}
        self.mask_source = mask_source
        self.context_slots = context_slots
        self.context_fill = context_fill
        self.own_local = own_local
        self.own_slots = own_slots
        self.backward = backward
        self.store = store  # write the rows later chunks read into the step's stores (a forward, or a kept graph)
        self.attended: set[torch.nn.Module] = set()
        self.hidden: torch.Tensor | None = None  # in a backward: the chunk's final hidden states (`_Step.backward`)
        # The operator's `width` (`hf_tree_attn.context_kv`): its length is the context rows' and padding's.
        self.width = torch.empty(len(context_slots) + context_fill, dtype=torch.uint8, device=step.device)

    def release(self) -> None:
        """Drop what ties the chunk's graph to it (after its backward)."""
        self.rec_own, self.rec_leaves, self._convs = {}, {}, {}
        self.mask_source = self.probe = self.hidden = None

    @property
    def step(self) -> _Step:
        return self._step()

    def attend(self, module, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        compiling = torch.compiler.is_compiling()
        if not compiling and self.backward and module not in self.attended and not torch.is_grad_enabled():
            raise NotImplementedError(
                "The model runs its decoder layers under reentrant activation checkpointing (use_reentrant="
                "True), whose forward keeps no graph for prefix reuse's backward to start from. Enable "
                "checkpointing with gradient_checkpointing_kwargs={'use_reentrant': False}, or use "
                "prefix_reuse=False."
            )
        return torch.ops.hf_tree_attn.chunk_context_kv(key, value, module_token(module), self.width)

    def gather(self, module, key: torch.Tensor, value: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`hf_tree_attn::chunk_context_kv`'s body: `[context; padding; own]` `(1, kv_heads, width + S, head_dim)`
        each; in a forward that stores, the own rows later chunks read go into the step's store first."""
        if width != len(self.context_slots) + self.context_fill:
            raise RuntimeError(
                f"chunk_context_kv got width {width} for a chunk of {len(self.context_slots)} "
                f"context rows and {self.context_fill} of padding."
            )
        if module in self.attended:
            if not self.backward:
                raise NotImplementedError(
                    f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) attends twice in one "
                    "forward (an attention block shared between layers): prefix reuse keeps one set of keys per "
                    "attention module. " + _FIX
                )
            # A checkpoint's recompute: the same operations as the first call, which stored what it had to.
        else:
            self.attended.add(module)
            store = self.step.kv.get(module)
            if store is None:
                slots = len(self.step.plan.kept_rows)
                store = self.step.kv[module] = tuple(
                    t.new_zeros(t.shape[0], t.shape[1], slots, t.shape[3]) for t in (key, value)
                )
            if self.store:
                for kept, own in zip(store, (key, value)):
                    kept.index_copy_(2, self.own_slots, own[:, :, self.own_local].to(kept.dtype))
        return tuple(
            torch.cat(
                [
                    kept.index_select(2, self.context_slots).to(own.dtype),
                    own.new_zeros(*own.shape[:2], self.context_fill, own.shape[3]),
                    own,
                ],
                dim=2,
            )
            for kept, own in zip(self.step.kv[module], (key, value))
        )

    def scatter(self, module, grad_key: torch.Tensor, grad_value: torch.Tensor, width: int):
        """`hf_tree_attn::chunk_context_kv_grad`'s body: the context rows' gradients added into the step's float32
        store (for the earlier chunks that computed them); returns the own rows' `(1, kv_heads, S, head_dim)` each,
        plus the gradients later chunks sent those they read."""
        step, p = self.step, len(self.context_slots)
        grads = step.kv_grad.get(module)
        if grads is None and p:  # the first chunk to send this module's context a gradient
            grads = step.kv_grad[module] = tuple(torch.zeros_like(t, dtype=torch.float32) for t in step.kv[module])
        own = []
        for i, grad in enumerate((grad_key, grad_value)):
            if p:
                grads[i].index_add_(2, self.context_slots, grad[:, :, :p].float())
            rows = grad[:, :, width:].clone()
            if grads is not None and len(self.own_local):
                rows[:, :, self.own_local] += grads[i][:, :, self.own_slots].to(rows.dtype)
            own.append(rows)
        return tuple(own)

    # -- state-carrying layers (`hf_tree_attn.recurrent.ChunkRows`)

    def recurrent_rows(self, tree_version):
        """The chunk as `tree_version` (a kernel's tree version, `hf_tree_attn.recurrent`) gets it: a `ChunkRows`."""
        from . import recurrent

        carried = {f for kind in recurrent.CHUNKED_KINDS for f in recurrent._TREE_KERNELS[kind].values()}
        if tree_version not in carried:
            raise NotImplementedError(
                f"Prefix reuse does not carry the state of {tree_version.__name__} between chunks. " + _FIX
            )
        if self._recurrent_rows is None:
            self._recurrent_rows = self._build_rows()
        return self._recurrent_rows

    def _build_rows(self):
        from .recurrent import ChunkRows
        from .tree import _segments

        step, device = self.step, self.step.device
        (a, b, size), n = self.rows, self.rows[1] - self.rows[0]
        state_slot, state_total, branching = step.state_plan()
        global_parent = step.np_parent[a:b]
        parent = np.full(size, -1, dtype=np.int64)
        parent[:n] = np.where(global_parent >= a, global_parent - a, -1)
        end = np.arange(1, size + 1, dtype=np.int64)  # padding rows: roots of their own
        end[:n] = np.minimum(step.np_end[a:b], b) - a
        breaks = np.zeros(size, dtype=bool)
        breaks[:n] = branching[a:b]
        starts, seg_parent, level = _segments(parent, end, breaks)
        # Root segments (level 0, DFS order): a zero state, or the state after their first row's parent.
        first = starts[:-1][seg_parent < 0]
        above = np.full(len(first), -1, dtype=np.int64)
        real = first < n
        above[real] = global_parent[first[real]]
        continues = above >= 0
        context_slots, index = np.unique(state_slot[above[continues]], return_inverse=True)
        root_state = np.full(len(first), len(context_slots), dtype=np.int64)
        root_state[continues] = index.reshape(-1)
        # Segments whose final state a later chunk starts from, by level, in each level's (DFS) order.
        last = starts[1:] - 1
        kept_slot = np.where(last < n, state_slot[a + np.minimum(last, n - 1)], -1)
        if self.dummy:  # it reruns rows chunk 0 keeps, after every chunk: the store keeps chunk 0's states
            kept_slot[:] = -1
        order = np.argsort(level, kind="stable")
        counts = np.bincount(level)
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order)) - np.repeat(np.cumsum(counts) - counts, counts)
        keep, kept_slots = [], []
        for lvl in range(len(counts)):
            segs = np.flatnonzero((level == lvl) & (kept_slot >= 0))
            keep.append(torch.from_numpy(rank[segs]).to(device) if len(segs) else None)
            kept_slots.append(kept_slot[segs])

        def tensor(array):
            return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(device)

        return ChunkRows(
            segment_starts=torch.from_numpy(starts),
            segment_parent=torch.from_numpy(seg_parent),
            segment_level=torch.from_numpy(level),
            parent=torch.from_numpy(parent),
            num_tree_tokens=size,
            seq_len=size,
            root_state=tensor(root_state),
            state_slots=tensor(context_slots),
            keep=keep,
            kept_slots=tensor(np.concatenate(kept_slots)),
            state_total=state_total,
            conv=self._conv,
            layer=self._layer,
            exchange=self,
        )

    def _layer(self) -> torch.nn.Module:
        if self.step.layer is None:
            raise RuntimeError("A state-carrying kernel ran outside a layer prefix reuse knows. " + _FIX)
        return self.step.layer

    def _conv(self, kernel_size: int):
        """The chunk's `ChunkConv` for a kernel of `kernel_size`."""
        from .recurrent import ChunkConv

        if kernel_size not in self._convs:
            step, device = self.step, self.step.device
            (a, b, size), n = self.rows, self.rows[1] - self.rows[0]
            conv_slot, total = step.conv_plan(kernel_size)
            global_parent = step.np_parent
            # The context rows the chunk's windows reach: its rows' ancestors within kernel_size - 1, before `a`.
            up, reached = np.arange(a, b), []
            for _ in range(kernel_size - 1):
                up = np.where(up >= 0, global_parent[np.maximum(up, 0)], -1)
                reached.append(up[(up >= 0) & (up < a)])
            context = np.unique(np.concatenate(reached)) if reached else np.zeros(0, dtype=np.int64)
            p = len(context)

            def local(rows):  # global rows -> indices into [context; own], -1 where neither
                at = np.searchsorted(context, rows)
                in_context = (rows >= 0) & (np.append(context, -1)[at] == rows)
                return np.where(rows >= a, rows - a + p, np.where(in_context, at, -1))

            parent = np.full(p + size, -1, dtype=np.int64)
            parent[:p] = local(global_parent[context])
            parent[p : p + n] = local(global_parent[a:b])
            own = np.flatnonzero(conv_slot[a:b] >= 0)[: 0 if self.dummy else None]  # dummies keep nothing

            @dataclasses.dataclass
            class Rows:
                parent: torch.Tensor
                num_tree_tokens: int
                seq_len: int
                _scan_cache: dict

            self._convs[kernel_size] = ChunkConv(
                forest=Rows(torch.from_numpy(parent), p + size, p + size, {}),
                context_slots=torch.from_numpy(conv_slot[context]).to(device),
                own_rows=torch.from_numpy(own).to(device),
                own_slots=torch.from_numpy(conv_slot[a + own]).to(device),
                total=total,
            )
        return self._convs[kernel_size]

    def read(self, key: tuple, slots: torch.Tensor) -> torch.Tensor | None:
        """The kept states / conv inputs of earlier chunks at `slots` (`(len(slots), ...)`; a leaf whose gradient
        goes back to them in the backward), or None where there are none."""
        if key in self.rec_leaves:
            if not self.backward:
                raise NotImplementedError(
                    f"{type(key[0]).__name__} runs its {key[1]} twice in one forward: prefix reuse keeps one state "
                    "per layer. " + _FIX
                )
            return self.rec_leaves[key][0]  # a checkpointed layer's recompute: the same leaves
        if len(slots) == 0:
            return None
        states = self.step.rec[key].index_select(0, slots)
        if self.backward:
            states.requires_grad_()
        self.rec_leaves[key] = (states, slots)
        return states

    def write(self, key: tuple, values: torch.Tensor, slots: torch.Tensor, total: int) -> None:
        """Keep this chunk's `values` (`(len(slots), ...)`) at `slots` for later chunks (forward); in the backward,
        record them as outputs the gradients later chunks sent them flow back from."""
        if self.backward and len(slots):
            self.rec_own.setdefault(key, (values, slots))  # a recompute's second call keeps the first's
        if not self.store or key in self.stored:
            return
        self.stored.add(key)
        store = self.step.rec.get(key)
        if store is None:
            store = self.step.rec[key] = values.new_zeros((total, *values.shape[1:]))
        store.index_copy_(0, slots, values.detach().to(store.dtype))


def _state_carrying(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of `model` that carry a state along the rows (`hf_tree_attn.recurrent.TREE_LAYERS`)."""
    from .recurrent import TREE_LAYERS, _class_path

    return [m for m in model.modules() if _class_path(type(m)) in TREE_LAYERS]


def _fsdp_dummies(model: torch.nn.Module, chunks: int, device: torch.device, keep_graphs: int) -> tuple[int, int]:
    """`(dummies, keep_graphs)`: how many dummy chunks this rank runs so that every rank runs as many chunks as the
    rank with the most, and how many of them keep their graphs on every rank: all but as many as the rank that
    recomputes the most recomputes (this rank asked to keep `keep_graphs` of its own `chunks`).

    FSDP2 gathers each sharded module's parameters in its forward (and its backward) and reduce-scatters their
    gradients in the backward: collectives every rank must call alike. Ranks cut their forests into different
    numbers of chunks, so the ones with fewer run dummy chunks (one row, keeping and scoring nothing, its gradient
    zero) until they match. A dummy keeps no key, value, state or convolution input: it reruns the forest's first row
    after every real chunk, and what it kept would replace what chunk 0 kept, which the backward's recomputes read."""
    total, recomputed = ranks_max([chunks, chunks - min(keep_graphs, chunks)], device)
    return total - chunks, max(1, total - recomputed)


def _rng_state(device: torch.device) -> tuple:
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


@contextlib.contextmanager
def _restored_rng(device: torch.device, state: tuple):
    """The RNG as it was at the chunk's forward (dropout draws the same masks), the caller's restored after."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


def _autocast_state(device_type: str) -> list[tuple[str, bool, torch.dtype]]:
    kinds = dict.fromkeys([device_type, "cpu"])
    return [(kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind in kinds]


def _autocasts(state) -> list:
    """Autocast as the chunk's forward ran under it (a backward runs outside the caller's autocast block)."""
    return [torch.autocast(kind, dtype=dtype, enabled=enabled) for kind, enabled, dtype in state]
