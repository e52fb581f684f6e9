"""Layers that carry a state from token to token (gated delta rule, Mamba-2, short convolutions) on a packed forest.

Such a layer cannot run over the DFS row as if it were one sequence: in the example of `hf_tree_attn.tree`, token 9
would start from the state token 8 left behind. It runs **segment by segment** instead (`PackedForest.segment_*`:
maximal unbranched runs of rows). A segment starts from the state its parent segment ends with; all segments of
one branching level run as one batched call with per-segment initial states; states are handed down level by
level::

    trie (2 completions of one prompt)          level 0:  [5 6]            state₀ = scan(5 6 | 0)
      5 ─ 6 ┬ 7 ─ 8                             level 1:  [7 8], [9]       scan(7 8 | state₀), scan(9 | state₀)
            └ 9

A delta rule (gated, Kimi) needs no more than two calls, however deep the forest: its state is linear in the state
it starts from, so one call over the segments whose final states are read (from zero, with `K` extra value columns
that start from the identity) gives each of them as a `K × K` map of its initial state plus a constant; the initial
states are then handed down with one small matrix product per level, and a second call runs every segment from its
own (`_scan_two_pass`, from `TWO_PASS_MIN_LEVELS` levels on, on varlen kernels: on flash-linear-attention's a call
costs milliseconds of launches however few its rows; transformers' torch reference keeps the level loop).

A short causal convolution of kernel `K` needs no levels: row `r` reads itself and its `K - 1` nearest ancestors.
The convolution runs over the whole DFS row, and only rows whose `K - 1` DFS predecessors are not their ancestors
(the first `K - 1` rows of a segment) are recomputed from their ancestor window. Attention layers keep using
`tree_flex`. Every sequence thus gets exactly the outputs of its own flat forward, and autograd carries the
gradients back through the handed-down states.

**How it is hooked in.** transformers routes these layers' sequence mixing through module-level kernel functions
(`causal_conv1d_fn`, `torch_chunk_gated_delta_rule`, `chunk_kimi_delta_attention`, `mamba2_chunk_scan`, …) and
forwards every model kwarg to them — `tree_forest` included. `hf_tree_attn.transformers_compat` replaces those
functions (the one table of what is replaced, and when) by dispatchers: without `tree_forest` they call the function
transformers resolved, with the same arguments; with it, the tree versions below run and call that same function
per level (varlen `cu_seqlens` with flash-linear-attention on CUDA, a zero-padded batch otherwise). No module
forward is replaced. `_TREE_KERNELS` says which functions each kind of layer runs through.

Kernel-level Hub swaps (`use_kernel_forward_from_hub`, `kernelize`) replace a whole layer forward for every call
and need the `kernels` package; they cannot tell a tree forward from an ordinary one, so they are not used here.

`TREE_LAYERS` (implemented, class → kind) and `REFUSED_LAYERS` (class → reason) are the declarative table the model
gate (`hf_tree_attn.support`) reads through `STATE_LAYER_TYPES` and `unsupported_recurrent_layers`.
"""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "CHUNKED_KINDS",
    "ChunkConv",
    "ChunkRows",
    "REFUSED_LAYERS",
    "STATE_LAYER_TYPES",
    "TREE_LAYERS",
    "kwargs_breaks",
    "tree_causal_conv1d",
    "tree_delta_rule",
    "tree_layer_types",
    "tree_mamba2_chunk_scan",
    "unsupported_recurrent_layers",
]

_TF = "transformers.models"

# Implemented state-carrying layer classes ("module.Class") → kind (a key of `_TREE_KERNELS`).
TREE_LAYERS: dict[str, str] = {
    f"{_TF}.qwen3_5.modeling_qwen3_5.Qwen3_5GatedDeltaNet": "gated_delta_rule",
    f"{_TF}.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeGatedDeltaNet": "gated_delta_rule",
    f"{_TF}.qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet": "gated_delta_rule",
    f"{_TF}.olmo_hybrid.modeling_olmo_hybrid.OlmoHybridGatedDeltaNet": "gated_delta_rule",
    f"{_TF}.kimi_linear.modeling_kimi_linear.KimiLinearDeltaAttention": "kimi_delta_rule",
    f"{_TF}.lfm2.modeling_lfm2.Lfm2ShortConv": "short_conv",
    f"{_TF}.lfm2_moe.modeling_lfm2_moe.Lfm2MoeShortConv": "short_conv",
    f"{_TF}.lfm3.modeling_lfm3.Lfm3ShortConv": "short_conv",
    f"{_TF}.lara_mini.modeling_lara_mini.LaraMiniGatedDeltaNet": "gated_delta_rule",
    f"{_TF}.bailing_hybrid.modeling_bailing_hybrid.BailingHybridDeltaAttention": "kimi_delta_rule",
    f"{_TF}.zamba2.modeling_zamba2.Zamba2MambaMixer": "mamba2",
    f"{_TF}.nemotron_h.modeling_nemotron_h.NemotronHMamba2Mixer": "mamba2",
    f"{_TF}.bamba.modeling_bamba.BambaMixer": "mamba2",
    f"{_TF}.granitemoehybrid.modeling_granitemoehybrid.GraniteMoeHybridMambaLayer": "mamba2",
    f"{_TF}.falcon_h1.modeling_falcon_h1.FalconH1Mixer": "mamba2",
}

# The `config.layer_types` names each kind appears under (the gate's layer-type check must not refuse them).
_KIND_LAYER_TYPES = {
    "gated_delta_rule": ("linear_attention",),
    "kimi_delta_rule": ("linear_attention",),
    "short_conv": ("conv",),
    "mamba2": ("linear_attention", "mamba", "hybrid"),
}

# A delta rule over a forest at least this many levels deep runs in two kernel calls (`_scan_two_pass`) instead of
# one per level, on a varlen kernel (flash-linear-attention's: a call costs milliseconds of launches however few its
# rows); "padded" (transformers' torch reference on a zero-padded batch, whose calls cost little beyond their work):
# None, never. The second call redoes the first's segments: below this depth, or where calls are cheap, the level loop
# does less work.
TWO_PASS_MIN_LEVELS = {"varlen": 3, "padded": None}

# The kinds whose state prefix reuse (`hf_tree_attn.prefix_reuse`) carries from one chunk to the next: their tree
# versions take a `ChunkRows` (a chunk whose segments may start from kept states and whose windows reach kept inputs).
CHUNKED_KINDS = ("gated_delta_rule", "kimi_delta_rule", "short_conv", "mamba2")

# Every `layer_types` name an implemented kind appears under (the config-level layer-kind check lets them through;
# `unsupported_recurrent_layers` then judges the classes).
STATE_LAYER_TYPES = tuple(sorted({name for names in _KIND_LAYER_TYPES.values() for name in names}))

_MAMBA1 = (
    "a Mamba-1 selective scan (`selective_scan_fn` / `mamba_inner_fn`), which the tree does not implement yet: its "
    "forward reaches no kernel function that takes `tree_forest`"
)
# State-carrying layer classes the tree knows but does not run, with the reason the gate reports.
REFUSED_LAYERS: dict[str, str] = {
    f"{_TF}.jamba.modeling_jamba.JambaMambaMixer": _MAMBA1,
    f"{_TF}.mamba.modeling_mamba.MambaMixer": _MAMBA1,
    f"{_TF}.falcon_mamba.modeling_falcon_mamba.FalconMambaMixer": _MAMBA1,
    f"{_TF}.mamba2.modeling_mamba2.Mamba2Mixer": (
        "a pure Mamba-2 model: Mamba2ForCausalLM.forward does not pass the model's keyword arguments on to its "
        "backbone, so `tree_forest` never reaches the mixers (the Mamba-2 hybrids, whose forwards pass them, are "
        "exact)"
    ),
    f"{_TF}.minimax.modeling_minimax.MiniMaxLightningAttention": (
        "lightning attention (linear attention with decay) computed by its own block loop, not through a kernel "
        "function that takes `tree_forest`"
    ),
}

# Class names of sequence mixers that carry a state; a module of an unlisted class that matches (or owns a
# depthwise Conv1d) is refused rather than silently run over the DFS row.
_STATEFUL_NAME = re.compile(
    r"Mamba|Mixer|DeltaNet|DeltaAttention|ShortConv|LightningAttention|Recurrent|SSM|Rwkv|RWKV|Retention|Hyena"
)
# ... except a normalization named after its model (`Mamba2RMSNorm`, `MambaRMSNormGated`): one token at a time.
_PER_TOKEN_NORM = re.compile(r"(RMS|Layer)Norm(Gated)?$")


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# ----------------------------------------------------------------------------------------------------------------
# Per-forest plans, built once per forest and device from its segment arrays and kept with it.


@dataclass
class _Level:
    """The segments of one branching level, as the kernels take them.

    rows: `(N,)` long — their DFS rows, segment after segment.
    cu_seqlens: `(n + 1,)` long — segment boundaries in `rows` (varlen kernels).
    cu_seqlens_cpu: `cu_seqlens` on the CPU: a kernel that takes it (flash-linear-attention 0.6's
        `cu_seqlens_cpu`) plans its chunks without reading the device copy back, a device sync per call.
    pad_index: `(n, T)` long — row of each slot of the zero-padded batch (`T` = longest segment); `S` (a zero
        row appended to the input) past a segment's end.
    valid_slots: `(N,)` long — the real slots' flat indices in `pad_index` (the rows of `rows`, in order).
    parent_slot: `(n,)` long — index of each segment's parent among the previous level's segments (None on level 0,
        whose segments are roots and start from a zero state).
    """

    rows: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    pad_index: torch.Tensor
    valid_slots: torch.Tensor
    parent_slot: torch.Tensor | None


@dataclass
class _ScanPlan:
    """A forest's levels in order, and where their outputs go back in the row.

    rows: `(num_tree_tokens,)` long — every level's `rows`, concatenated.
    pad_rows: `(sum n * T,)` long — every level's `pad_index`, flattened and concatenated (the padded path gathers
        every level's batch at once, so that the backward scatters each input's gradient once, not once per level).
    """

    levels: list[_Level]
    rows: torch.Tensor
    pad_rows: torch.Tensor


@dataclass(eq=False)
class ChunkConv:
    """A short convolution's view of one prefix-reuse chunk (kernel size `K`): the chunk's rows behind the context
    rows its windows reach.

    forest: the `P' + S` rows `[context rows; own rows]` as a forest (`parent`, `num_tree_tokens`, `seq_len`), for
        `_conv_plan`.
    context_slots: `(P',)` long — store slots of those context rows' inputs (ancestors of the chunk's first row
        within `K - 1` rows of one of its rows, ascending).
    own_rows: `(K_c,)` long — the chunk's rows whose inputs later chunks read (indices into the chunk).
    own_slots: `(K_c,)` long — their store slots; `total`: slots of the whole store.
    """

    forest: object
    context_slots: torch.Tensor
    own_rows: torch.Tensor
    own_slots: torch.Tensor
    total: int


@dataclass(eq=False)
class ChunkRows:
    """One chunk of a prefix-reuse forward (`hf_tree_attn.prefix_reuse`) as the state-carrying layers see it: its
    `S` rows as a forest of their own (`segment_*`, `parent`, `num_tree_tokens`, `seq_len` as in `PackedForest`,
    local indices, padding rows roots), whose root segments may continue rows of earlier chunks, and the stores
    those chunks' states are read from and this chunk's are written to (`exchange.read(key, slots)` /
    `exchange.write(key, values, slots, total)`, keyed by `(layer(), "scan" | "conv")`).

    Its segments end where a state is kept: at the chunk's last row and at every row branching in the whole forest.

    root_state: `(n_0,)` long — for each root segment (DFS order), the index into `[context states; a zero
        state]` it starts from.
    state_slots: `(m,)` long — store slots of the context states (each the state after a row of an earlier chunk
        whose child starts a root segment here).
    keep: per level, the indices `(k,)` long (or None) of the segments whose final states later chunks read.
    kept_slots: `(sum k,)` long — their store slots, level after level; `state_total`: slots of the whole store.
    conv: `conv(kernel_size) -> ChunkConv`.
    layer: `layer()` -> the state-carrying module now running (the stores' key).
    """

    segment_starts: torch.Tensor
    segment_parent: torch.Tensor
    segment_level: torch.Tensor
    parent: torch.Tensor
    num_tree_tokens: int
    seq_len: int
    root_state: torch.Tensor
    state_slots: torch.Tensor
    keep: list
    kept_slots: torch.Tensor
    state_total: int
    conv: object
    layer: object
    exchange: object
    _scan_cache: dict = field(default_factory=dict, repr=False)


def _ragged_arange(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """`concat(arange(s, s + n) for s, n in zip(starts, lengths))` without a Python loop."""
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()))


def _segments_level(starts: np.ndarray, lengths: np.ndarray, seq_len: int, device, parent_slot=None) -> _Level:
    """A `_Level` over the segments at DFS rows `starts` `(n,)` of lengths `lengths` `(n,)` (numpy), in that order."""

    def tensor(array):
        return torch.as_tensor(array, dtype=torch.long).to(device)

    width = np.arange(int(lengths.max()))
    valid = width[None] < lengths[:, None]
    bounds_cpu = torch.as_tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.long)
    return _Level(
        rows=tensor(_ragged_arange(starts, lengths)),
        cu_seqlens=bounds_cpu.to(device),
        cu_seqlens_cpu=bounds_cpu,
        pad_index=tensor(np.where(valid, starts[:, None] + width[None], seq_len)),
        valid_slots=tensor(np.flatnonzero(valid)),
        parent_slot=None if parent_slot is None else tensor(parent_slot),
    )


def _level_order(forest) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray], np.ndarray]:
    """`(starts, lengths, parent, per-level segment ids (DFS order inside a level), slot)`: `slot[s]` is segment
    `s`'s index inside its level."""
    bounds = forest.segment_starts.cpu().numpy()
    level = forest.segment_level.cpu().numpy()
    order = np.argsort(level, kind="stable")  # by level, DFS order inside a level
    counts = np.bincount(level)
    first = np.cumsum(counts) - counts
    slot = np.empty_like(order)
    slot[order] = np.arange(order.size) - np.repeat(first, counts)
    per_level = [order[first[lvl] : first[lvl] + counts[lvl]] for lvl in range(counts.size)]
    return bounds[:-1], np.diff(bounds), forest.segment_parent.cpu().numpy(), per_level, slot


def _scan_plan(forest, device: torch.device) -> _ScanPlan:
    key = ("levels", device)
    if key not in forest._scan_cache:
        starts, lengths, parent, per_level, slot = _level_order(forest)
        levels = [
            _segments_level(starts[segs], lengths[segs], forest.seq_len, device, slot[parent[segs]] if lvl else None)
            for lvl, segs in enumerate(per_level)
        ]
        forest._scan_cache[key] = _ScanPlan(
            levels, torch.cat([lv.rows for lv in levels]), torch.cat([lv.pad_index.flatten() for lv in levels])
        )
    return forest._scan_cache[key]


@dataclass
class _TwoPassPlan:
    """A forest's segments as `_scan_two_pass` runs them: two batches, and the hand-down between them.

    needed: the segments whose final state is read (a child continues it, or `keep` names it), level after level —
        the first call's batch (None if there are none).
    with_maps: `needed`, then again those of them whose start is not known to be zero (with `zero_roots`, the
        non-roots) — the first call's batch where the identity's columns run as a second copy.
    second: every segment, level after level, but with `zero_roots` the needed roots, whose first-call outputs are
        already theirs — the second call's batch.
    zero_roots: the roots start from zero (no `initial`).
    reused_rows: how many of `needed`'s first rows (the needed roots' with `zero_roots`, else none) take their
        outputs from the first call.
    level_sizes: per level, how many segments it holds.
    needed_counts / maps_counts: per level, how many of `needed`'s / of the second copy's segments are on it.
    needed_index: per level, `(m,)` long — the needed segments' indices among the level's segments.
    parent_needed: per level after the first, `(n,)` long — each segment's parent among the previous level's needed
        segments.
    keep_index: per level, `(k,)` long or None — the kept segments among the level's needed segments.
    """

    needed: _Level | None
    with_maps: _Level | None
    second: _Level | None
    zero_roots: bool
    reused_rows: int
    level_sizes: list[int]
    needed_counts: list[int]
    maps_counts: list[int]
    needed_index: list[torch.Tensor]
    parent_needed: list[torch.Tensor | None]
    keep_index: list[torch.Tensor | None]


def _two_pass_plan(forest, device: torch.device, keep, zero_roots: bool) -> _TwoPassPlan:
    key = ("two_pass", device, zero_roots)
    if key not in forest._scan_cache:
        starts, lengths, parent, per_level, slot = _level_order(forest)
        read = np.zeros(starts.size, dtype=bool)
        read[parent[parent >= 0]] = True
        for lvl, kept in enumerate(keep or ()):
            if kept is not None:
                read[per_level[lvl][kept.cpu().numpy()]] = True
        position = np.full(starts.size, -1)  # a needed segment's index among its level's needed segments
        needed_index, keep_index, parent_needed = [], [], []
        for lvl, segs in enumerate(per_level):
            inside = np.flatnonzero(read[segs])
            position[segs[inside]] = np.arange(inside.size)
            needed_index.append(torch.as_tensor(inside).to(device))
            kept = keep[lvl] if keep is not None and lvl < len(keep) else None
            keep_index.append(None if kept is None else torch.as_tensor(position[segs[kept.cpu().numpy()]]).to(device))
            parent_needed.append(torch.as_tensor(position[parent[segs]]).to(device) if lvl else None)
        needed = np.concatenate([segs[read[segs]] for segs in per_level])
        mapped = np.concatenate([needed[:0], *(segs[read[segs]] for segs in per_level[int(zero_roots) :])])
        reused = per_level[0][read[per_level[0]]] if zero_roots else needed[:0]
        second = np.concatenate([per_level[0][~read[per_level[0]]] if zero_roots else per_level[0], *per_level[1:]])

        def level(segs, twice=None):
            if twice is not None:
                segs = np.concatenate([segs, twice])
            return _segments_level(starts[segs], lengths[segs], forest.seq_len, device) if segs.size else None

        forest._scan_cache[key] = _TwoPassPlan(
            needed=level(needed),
            with_maps=level(needed, twice=mapped),
            second=level(second),
            zero_roots=zero_roots,
            reused_rows=int(lengths[reused].sum()),
            level_sizes=[segs.size for segs in per_level],
            needed_counts=[int(read[segs].sum()) for segs in per_level],
            maps_counts=[int(read[segs].sum()) if lvl or not zero_roots else 0 for lvl, segs in enumerate(per_level)],
            needed_index=needed_index,
            parent_needed=parent_needed,
            keep_index=keep_index,
        )
    return forest._scan_cache[key]


def _conv_plan(forest, kernel_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rows, taps)`: the real rows whose convolution window is not their DFS predecessors `(F,)` long, and the
    row each of the `kernel_size` taps reads for them `(kernel_size, F)` long (oldest first; `S` = zero)."""
    key = ("conv", kernel_size, device)
    if key not in forest._scan_cache:
        num_rows = forest.num_tree_tokens
        parent = forest.parent[:num_rows].cpu().numpy()
        rows = np.arange(num_rows)
        ancestors, mismatch = [rows], np.zeros(num_rows, dtype=bool)
        for back in range(1, kernel_size):
            up = ancestors[-1]
            up = np.where(up >= 0, parent[np.maximum(up, 0)], -1)
            ancestors.append(up)
            mismatch |= up != np.maximum(rows - back, -1)
        fix = np.flatnonzero(mismatch)
        taps = np.stack([ancestors[kernel_size - 1 - k][fix] for k in range(kernel_size)])
        taps = np.where(taps >= 0, taps, forest.seq_len)
        forest._scan_cache[key] = (torch.as_tensor(fix).to(device), torch.as_tensor(taps).to(device))
    return forest._scan_cache[key]


# ----------------------------------------------------------------------------------------------------------------
# Level-by-level scans.


def _with_zero_row(x: torch.Tensor) -> torch.Tensor:
    """`(S + 1, ...)`: row `S` is zeros — the padding slot of `_Level.pad_index`. `x` is `(1, S, ...)`."""
    return torch.cat([x[0], x.new_zeros((1, *x.shape[2:]))])


def _scan_levels(
    forest, inputs: list[torch.Tensor], varlen: bool, run, initial: torch.Tensor | None = None, keep=None
):
    """Run a state-carrying kernel over `forest` level by level; returns its output `(1, S, ...)` (zeros on padding
    rows), and with `keep` the final states it names.

    Args:
        inputs: `(1, S, ...)` tensors, per row (queries, decays, ...).
        varlen: gather each level's rows into `(1, N, ...)` for a `cu_seqlens` kernel; else a zero-padded batch
            `(n, T, ...)` (the kernel must leave a state unchanged over zero inputs).
        run: `run(level_inputs, initial_state, level) -> (output, final_state)`; `initial_state` is `initial` on
            level 0, `(n, ...)` after. `output` is `(1, N, ...)` (varlen) or `(n, T, ...)`.
        initial: `(n_0, ...)` — the states level 0's segments start from (None: zero states).
        keep: per level, the indices `(k,)` long (or None) of the segments whose final states to return; then the
            result is `(output, kept final states (sum k, ...))`, level after level.
    """
    plan = _scan_plan(forest, inputs[0].device)
    if not varlen:  # every level's padded batch, `(n * T, ...)` each, from one gather (one gradient scatter back)
        sizes = [level.pad_index.numel() for level in plan.levels]
        padded = [_with_zero_row(x).index_select(0, plan.pad_rows).split(sizes) for x in inputs]
    outputs, final, kept = [], None, []
    for i, level in enumerate(plan.levels):
        if level.parent_slot is not None:
            initial = final.index_select(0, level.parent_slot)
        if varlen:  # a gather per level: each level's inputs in a buffer of their own (kernels may need aligned data)
            out, final = run([x.index_select(1, level.rows) for x in inputs], initial, level)
            outputs.append(out[0])
        else:
            out, final = run([x[i].unflatten(0, level.pad_index.shape) for x in padded], initial, level)
            outputs.append(out.flatten(0, 1).index_select(0, level.valid_slots))  # no mask: no device sync
        if keep is not None and keep[i] is not None:
            kept.append(final.index_select(0, keep[i]))
    values = torch.cat(outputs)
    full = values.new_zeros((inputs[0].shape[1], *values.shape[1:])).index_copy(0, plan.rows, values)[None]
    if keep is None:
        return full
    return full, (torch.cat(kept) if kept else None)


def _gather(x: torch.Tensor, level: _Level, varlen: bool) -> torch.Tensor:
    """`x` `(1, S, ...)` at `level`'s rows: `(1, N, ...)` (varlen) or its zero-padded batch `(n, T, ...)`."""
    if varlen:
        return x.index_select(1, level.rows)
    return _with_zero_row(x).index_select(0, level.pad_index.flatten()).unflatten(0, level.pad_index.shape)


def _ungather(out: torch.Tensor, level: _Level, varlen: bool) -> torch.Tensor:
    """A kernel's output on `_gather`'s layout back to one row per real slot, `(N, ...)` in `level.rows` order."""
    return out[0] if varlen else out.flatten(0, 1).index_select(0, level.valid_slots)


def _scan_two_pass(
    forest, inputs: list[torch.Tensor], varlen: bool, run, initial: torch.Tensor | None = None, keep=None
):
    """`_scan_levels` for a delta rule in two kernel calls, whatever the depth; same arguments and result.

    A delta rule's state `h` `(heads, K, V)` is linear in the state it starts from, each of its `V` columns on its
    own: a segment that starts from `h0` ends in `M @ h0 + F`, where `F` is its final state from a zero start and
    `M` `(heads, K, K)` the final state of `K` extra value columns that start from the identity and read zero values.
    The first call runs every segment whose final state is read, from zero, with `[value, 0]` and `[0 | I]` (where
    `V = K`, the extra columns run as a second copy of those segments instead, in the level loop's kernel shapes); the
    initial states are then handed down level by level with one small matrix product each; the second call runs
    every segment from its own initial state. Roots that start from zero (no `initial`) need no map, and those the
    first call ran already have their outputs: neither runs again. Autograd carries the gradients back through both
    calls.
    """
    plan = _two_pass_plan(forest, inputs[0].device, keep, zero_roots=initial is None)
    value = inputs[2]
    heads, k_dim, v_dim = value.shape[-2], inputs[1].shape[-1], value.shape[-1]
    state = torch.promote_types(value.dtype, torch.float32)  # the kernels keep their states in float32 or wider
    finals, reused = [None] * len(plan.level_sizes), None
    if plan.needed is not None:
        n, m = sum(plan.needed_counts), sum(plan.maps_counts)
        eye = torch.eye(k_dim, dtype=state, device=value.device)
        if v_dim == k_dim:  # the identity's columns as a second copy of the segments that need them: the kernels'
            # shapes are the level loop's (no new compilation or autotuning)
            layout = plan.with_maps
            first = [_gather(x, layout, varlen) for x in inputs]
            v, dim = first[2], 1 if varlen else 0
            real = int(plan.needed.cu_seqlens_cpu[-1]) if varlen else n  # value rows (varlen) / segments (padded)
            first[2] = torch.cat([v.narrow(dim, 0, real), torch.zeros_like(v.narrow(dim, real, v.shape[dim] - real))],
                                 dim=dim)  # fmt: skip
            start = torch.cat([eye.new_zeros((n, heads, k_dim, v_dim)), eye.expand(m, heads, k_dim, k_dim)])
            out, end = run(first, start, layout)
            end, maps = end[:n], end[n:]
            maps = maps.split(plan.maps_counts)
        else:  # `K` more value columns
            layout = plan.needed
            first = [_gather(x, layout, varlen) for x in inputs]
            v = first[2]
            first[2] = torch.cat([v, v.new_zeros((*v.shape[:-1], k_dim))], dim=-1)
            start = torch.cat([eye.new_zeros((n, heads, k_dim, v_dim)), eye.expand(n, heads, k_dim, k_dim)], dim=-1)
            out, end = run(first, start, layout)
            out, end, maps = out[..., :v_dim], end[..., :v_dim], end[..., v_dim:]
            maps = maps.split(plan.needed_counts)
        if plan.reused_rows:  # the needed roots' outputs: they started from zero, as they should
            reused = _ungather(out, layout, varlen)[: plan.reused_rows]
        finals = list(zip(end.split(plan.needed_counts), maps))
    starts, kept, previous = [], [], None
    for lvl, count in enumerate(plan.needed_counts):
        if lvl:
            start = previous.index_select(0, plan.parent_needed[lvl])
        elif initial is not None:
            start = initial
        else:  # roots start from zero
            start = value.new_zeros((plan.level_sizes[0], heads, k_dim, v_dim), dtype=state)
        starts.append(start)
        if count:
            end, maps = finals[lvl]
            if lvl == 0 and plan.zero_roots:
                previous = end
            else:
                with torch.autocast(end.device.type, enabled=False):  # the hand-down in float32, as the kernels
                    previous = torch.baddbmm(
                        end.flatten(0, 1),
                        maps.flatten(0, 1),
                        start.index_select(0, plan.needed_index[lvl]).to(end.dtype).flatten(0, 1),
                    ).unflatten(0, end.shape[:2])
            if plan.keep_index[lvl] is not None:
                kept.append(previous.index_select(0, plan.keep_index[lvl]))
    if plan.zero_roots:  # the second call runs the roots no child reads, from zero
        starts[0] = starts[0][: plan.level_sizes[0] - plan.needed_counts[0]]
    parts, rows = [], []
    if plan.second is not None:
        out, _ = run([_gather(x, plan.second, varlen) for x in inputs], torch.cat([s.to(state) for s in starts]),
                     plan.second)  # fmt: skip
        parts.append(_ungather(out, plan.second, varlen))
        rows.append(plan.second.rows)
    if reused is not None:
        parts.append(reused)
        rows.append(plan.needed.rows[: plan.reused_rows])
    values = torch.cat(parts)
    full = values.new_zeros((inputs[0].shape[1], *values.shape[1:])).index_copy(0, torch.cat(rows), values)[None]
    if keep is None:
        return full
    return full, (torch.cat(kept) if kept else None)


def _kernel_function(original):
    """The Python function behind `original` (`transformers_compat.kernel_function`: transformers 5.25 makes the
    modeling modules' kernel functions module instances of `kernels`)."""
    from .transformers_compat import kernel_function  # imported here: transformers_compat imports this module

    return kernel_function(original)


def _scan(forest, inputs: list[torch.Tensor], varlen: bool, run, linear: bool = False) -> torch.Tensor:
    """`_scan_levels` over a forest, or over one prefix-reuse chunk (`ChunkRows`): there, its root segments that
    continue a row of an earlier chunk start from the state that chunk kept (`(m, ...)`, read from the exchange),
    and the final states of its segments later chunks continue go to the store. `linear`: the kernel is a delta rule
    (`_scan_two_pass` applies), which runs in two calls on forests `TWO_PASS_MIN_LEVELS` or more levels deep."""
    scan = _scan_levels
    min_levels = TWO_PASS_MIN_LEVELS["varlen" if varlen else "padded"]
    if linear and min_levels is not None and len(_scan_plan(forest, inputs[0].device).levels) >= min_levels:
        scan = _scan_two_pass
    if not isinstance(forest, ChunkRows):
        return scan(forest, inputs, varlen, run)
    key = (forest.layer(), "scan")
    states = forest.exchange.read(key, forest.state_slots)
    initial = None
    if states is not None:
        initial = torch.cat([states, states.new_zeros((1, *states.shape[1:]))]).index_select(0, forest.root_state)
    out, kept = scan(forest, inputs, varlen, run, initial=initial, keep=forest.keep)
    if kept is not None:
        forest.exchange.write(key, kept, forest.kept_slots, forest.state_total)
    return out


def _bound(original, args, kwargs) -> dict:
    """The call's arguments by parameter name (defaults filled), without the catch-all `**kwargs`."""
    signature = inspect.signature(original)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    named = dict(bound.arguments)
    for name, param in signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            named.pop(name, None)
    return named


def _no_cache(name: str, *states) -> None:
    """A tree forward starts every root from a zero state and keeps its own sequence boundaries."""
    if any(s is not None and s is not False for s in states):
        raise ValueError(
            f"{name} got a cached state or packed-sequence boundaries (cu_seq_lens / seq_idx) in a tree forward; a "
            "packed forest cannot continue a cache and carries its own boundaries. Call the model with "
            "use_cache=False and without cu_seq_lens_* (forest_forward_kwargs and TreeDataCollator do)."
        )


@functools.cache
def _hub_wrapper_state(original) -> dict:
    """The variables transformers' kernel wrapper (`use_kernel_func_from_hub_with_fallback`) closes over —
    `implementation`, `is_new_implementation`, `applicable_params` — or {} for any other function. Read once per
    function: the tree asks at every layer's forward."""
    try:
        return dict(inspect.getclosurevars(_kernel_function(original)).nonlocals)
    except TypeError:  # not a Python function
        return {}


def _use_varlen(original, device: torch.device) -> bool:
    """Whether to call `original` with `cu_seqlens`: on CUDA, when transformers resolved it to a package kernel
    (flash-linear-attention) rather than its torch reference, which cannot keep packed sequences apart."""
    return device.type == "cuda" and bool(_hub_wrapper_state(original).get("is_new_implementation", False))


def _kernel_params(original) -> set[str]:
    """The parameter names the kernel behind `original` takes (transformers' wrapper passes on only those of the
    implementation it resolved, `applicable_params`)."""
    params = _hub_wrapper_state(original).get("applicable_params")
    return set(params) if params is not None else set(inspect.signature(_kernel_function(original)).parameters)


def tree_causal_conv1d(original, forest, *args, **kwargs) -> torch.Tensor:
    """`causal_conv1d_fn(hidden_states (1, channels, S), weight (channels, K), bias, activation)` over a forest.

    `original` runs over the DFS row; the rows whose `K - 1` predecessors are not their ancestors are recomputed
    from their ancestor window (zeros above a root) and replace those outputs.
    """
    original = _kernel_function(original)
    call = _bound(original, args, kwargs)
    x, weight, bias, activation = call["hidden_states"], call["weight"], call["bias"], call["activation"]
    if isinstance(forest, ChunkRows):
        return _chunk_causal_conv1d(original, forest, x, weight, bias, activation)
    return _forest_conv1d(original, forest, x, weight, bias, activation)


def _chunk_causal_conv1d(original, chunk: ChunkRows, x, weight, bias, activation) -> torch.Tensor:
    """The convolution over one prefix-reuse chunk: the inputs of its context rows its windows reach (kept by the
    chunks that computed them) go in front of its own, as rows of a forest that holds both; their outputs are
    dropped. The own inputs later chunks' windows reach are handed to the store."""
    plan = chunk.conv(weight.shape[-1])
    key = (chunk.layer(), "conv")
    context = chunk.exchange.read(key, plan.context_slots)  # (P', channels) or None
    chunk.exchange.write(key, x[0].index_select(1, plan.own_rows).T, plan.own_slots, plan.total)
    if context is None:
        return _forest_conv1d(original, plan.forest, x, weight, bias, activation)
    rows = torch.cat([context.T[None].to(x.dtype), x], dim=2)
    return _forest_conv1d(original, plan.forest, rows, weight, bias, activation)[:, :, context.shape[0] :]


def _forest_conv1d(original, forest, x, weight, bias, activation) -> torch.Tensor:
    out = original(x, weight, bias, activation=activation)
    rows, taps = _conv_plan(forest, weight.shape[-1], x.device)
    if rows.numel() == 0:
        return out
    window = torch.cat([x[0], x.new_zeros(x.shape[1], 1)], dim=1)[:, taps].to(weight.dtype)  # (channels, K, F)
    fixed = (window * weight[:, :, None]).sum(1)
    if bias is not None:
        fixed = fixed + bias[:, None]
    if activation is not None:
        from transformers.activations import ACT2FN

        fixed = ACT2FN[activation](fixed)
    return out.index_copy(2, rows, fixed.to(out.dtype)[None])


def tree_delta_rule(original, forest, *args, **kwargs) -> tuple[torch.Tensor, None]:
    """Chunked (gated / Kimi) delta rule over a forest: `torch_chunk_gated_delta_rule` or `chunk_kimi_delta_attention`.

    Takes the kernel's arguments: query, key `(1, S, k_heads, k_dim)`, value `(1, S, v_heads, v_dim)`, `g` (log
    decay) `(1, S, v_heads)` or `(1, S, heads, k_dim)`, beta `(1, S, v_heads)`. Returns `(output (1, S, v_heads,
    v_dim), None)`. A zero-padded slot (`g = 0`, `beta = 0`) leaves the state unchanged.
    """
    original = _kernel_function(original)
    call = _bound(original, args, kwargs)
    _no_cache(original.__name__, call.get("initial_state"), call.get("output_final_state"), kwargs.get("cu_seqlens"))
    tensors = [call[name] for name in list(call)[:5]]  # query, key, value, g, beta (torch or fla names)
    extra = {k: call[k] for k in ("chunk_size", "use_qk_l2norm_in_kernel") if k in call}
    varlen = _use_varlen(original, tensors[0].device)
    cpu_bounds = varlen and "cu_seqlens_cpu" in _kernel_params(original)

    def run(level_inputs, initial, level):
        q, k, v, g, beta = level_inputs
        seqlens = {"cu_seqlens": level.cu_seqlens} if varlen else {}
        if cpu_bounds:
            seqlens["cu_seqlens_cpu"] = level.cu_seqlens_cpu
        return original(q, k, v, g=g, beta=beta, initial_state=initial, output_final_state=True, **extra, **seqlens)

    return _scan(forest, tensors, varlen, run, linear=True), None


def tree_mamba2_chunk_scan(original, forest, *args, **kwargs) -> torch.Tensor:
    """`mamba2_chunk_scan` (Mamba-2's SSD) over a forest, on a zero-padded batch per level.

    Takes the kernel's arguments: hidden_states `(1, S, heads, head_dim)`, dt `(1, S, heads)`, A `(heads,)`, B, C
    `(1, S, groups, state)`, D, dt_bias, dt_softplus, dt_limit. The time step is discretised here exactly as the
    kernel does, so that padded slots can get `dt = 0`: no decay, no input — the state passes unchanged.
    """
    original = _kernel_function(original)
    call = _bound(original, args, kwargs)
    _no_cache(original.__name__, call.get("initial_states"), call.get("return_final_states"), kwargs.get("seq_idx"))
    dt = call["dt"]
    if call["dt_bias"] is not None:
        dt = dt + call["dt_bias"].to(dt.dtype)
    if call["dt_softplus"]:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=call["dt_limit"][0], max=call["dt_limit"][1])

    def run(level_inputs, initial, level):
        x, dt_level, b, c = level_inputs
        return original(
            x, dt_level, call["A"], b, c, chunk_size=call["chunk_size"], D=call["D"], dt_bias=None,
            initial_states=initial, dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=True,
        )  # fmt: skip

    return _scan(forest, [call["hidden_states"], dt, call["B"], call["C"]], False, run)


def _unfused_in_tree(original, forest, *args, **kwargs) -> None:
    """`mamba2_split_conv1d_scan_combined`: None makes the mixer take its unfused path (conv, then the scan)."""
    return None


# kind → {kernel function in the modeling module: its tree version}
_TREE_KERNELS = {
    "gated_delta_rule": {"causal_conv1d_fn": tree_causal_conv1d, "torch_chunk_gated_delta_rule": tree_delta_rule},
    "kimi_delta_rule": {"causal_conv1d_fn": tree_causal_conv1d, "chunk_kimi_delta_attention": tree_delta_rule},
    "short_conv": {"causal_conv1d_fn": tree_causal_conv1d},
    "mamba2": {
        "causal_conv1d_fn": tree_causal_conv1d,
        "mamba2_chunk_scan": tree_mamba2_chunk_scan,
        "mamba2_split_conv1d_scan_combined": _unfused_in_tree,
    },
}


# ----------------------------------------------------------------------------------------------------------------
# The gate's questions.


# TREE_LAYERS entries this transformers cannot serve → why (filled by `transformers_compat.install`).
_UNAVAILABLE: dict[str, str] = {}


@functools.cache
def _forward_source(cls: type) -> str:
    try:
        return inspect.getsource(inspect.unwrap(cls.forward))
    except (OSError, TypeError):
        return ""


def _calls_with_kwargs(source: str, callee: str) -> bool:
    """Whether `source` calls `callee(...)` (a regex) with a `**...kwargs` argument."""
    return re.search(rf"{callee}\((?:[^()]|\((?:[^()]|\([^()]*\))*\))*\*\*\w*kwargs", source) is not None


def _passes_kwargs(cls: type, name: str) -> bool:
    """Whether `cls.forward` calls `name(...)` with the model's `**kwargs` (so `tree_forest` reaches it): a
    transformers version that stops forwarding them must make the gate refuse the layer, not run it silently."""
    return _calls_with_kwargs(_forward_source(cls), rf"\b{name}")


def _owns_state(module: torch.nn.Module) -> bool:
    """A listed state-carrying class, or a module owning a depthwise Conv1d (every conv-based mixer does)."""
    path = _class_path(type(module))
    if path in TREE_LAYERS or path in REFUSED_LAYERS:
        return True
    return any(
        isinstance(child, torch.nn.Conv1d) and child.groups == child.in_channels > 1 for child in module.children()
    )


def unsupported_recurrent_layers(model: torch.nn.Module) -> dict[str, str]:
    """`{layer class name: reason}` for every state-carrying layer of `model` a tree cannot run exactly (empty when
    there is none, or when all of them are implemented).

    A layer is state-carrying if its class is listed, if it owns a depthwise Conv1d, or if its class name says so
    (Mamba, DeltaNet, ShortConv, ...) and no module inside it is already one of the former (so a decoder layer
    named after its mixer is not reported twice).
    """
    reasons = {}
    for module in model.modules():
        cls = type(module)
        path = _class_path(cls)
        if path in TREE_LAYERS:
            if path in _UNAVAILABLE:
                reasons[cls.__name__] = _UNAVAILABLE[path]
            continue
        stateful = _owns_state(module) or (
            _STATEFUL_NAME.search(cls.__name__) is not None
            and _PER_TOKEN_NORM.search(cls.__name__) is None
            and not any(_owns_state(inner) for inner in module.modules() if inner is not module)
        )
        if stateful:
            reasons[cls.__name__] = REFUSED_LAYERS.get(
                path, "a state-carrying layer the tree does not know; its state would leak across tree branches"
            )
    return reasons


# Wrappers that hand every argument to the module they wrap (torch.compile, FSDP1, activation checkpointing).
_PASS_THROUGH = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def _kwargs_break(root: torch.nn.Module, path: str) -> str | None:
    """Where the model kwargs stop on their way from `root.forward` to the submodule at `path` (which then never
    sees `tree_forest`), or None when every forward on the way passes them on: `self.<child>(..., **kwargs)`, or,
    for a child in a ModuleList, `for <x> in self.<list>...` and `<x>(..., **kwargs)`."""
    parts = path.split(".")
    module = root
    for i, name in enumerate(parts):
        child = getattr(module, name)
        if isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)) or name in _PASS_THROUGH:
            module = child
            continue
        source = _forward_source(type(module))
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            loop = re.search(rf"for\s+(?:\w+\s*,\s*)?(\w+)\s+in\s+(?:enumerate\()?self\.{name}\b", source)
            ok = loop is not None and _calls_with_kwargs(source, rf"\b{loop.group(1)}")
        else:
            ok = _calls_with_kwargs(source, rf"self\.{name}")
        if not ok:
            return f"{type(module).__name__}.forward does not pass the model kwargs on to `{'.'.join(parts[: i + 1])}`"
        module = child
    return None


def kwargs_breaks(model: torch.nn.Module) -> dict[str, str]:
    """`{layer class name: where the kwargs stop}` for the implemented state-carrying layers of `model` that a
    forward's `tree_forest` would not reach (their state would then run over the DFS row: silently wrong). Checked
    on the source of each forward between the model and the layer, so a transformers version that stops passing
    the kwargs somewhere on the way makes the gate refuse the model rather than run it."""
    breaks = {}
    for path, module in model.named_modules():
        if _class_path(type(module)) in TREE_LAYERS and type(module).__name__ not in breaks:
            where = _kwargs_break(model, path)
            if where is not None:
                breaks[type(module).__name__] = where
    return breaks


def tree_layer_types(model: torch.nn.Module) -> set[str]:
    """The `config.layer_types` names under which `model`'s implemented state-carrying layers appear."""
    kinds = {TREE_LAYERS.get(_class_path(type(m))) for m in model.modules()}
    return {name for kind in kinds if kind is not None for name in _KIND_LAYER_TYPES[kind]}
