"""Shared-prefix attention: a GRPO-shaped forest's causal attention as dense fused-kernel calls, without a mask.

In a forest where every branch hangs off a root (the G completions of one prompt; several prompts per micro-batch),
each tree is a prompt segment followed by its completion segments, and the ancestor-or-self mask is, per tree:

    prompt rows       the prompt's keys, causal                                   one call
    completion rows   all the prompt's keys  +  the own completion's keys, causal  two calls, merged

All completions of a tree ask the same prompt keys: one non-causal call with the tree's completion rows as a
single query block. Their own parts are one batched causal call (completions right-padded to the longest: a padded
query row is dropped, and causal order hides the padded keys from every real row). The two key sets are disjoint,
so their softmaxes merge by their log-sum-exps:

    lse = logaddexp(lse_1, lse_2)        out = exp(lse_1 - lse) * out_1 + exp(lse_2 - lse) * out_2

Backward: each call's attention backward, given the *merged* `out` and `lse`, gives its keys' exact dK, dV and its
exact share of dQ (`dS_ij = P_ij (dO_i . v_j - dO_i . O_i)` with the merged probabilities `P`: the identity ring
attention rests on); dQ is the sum of the shares. Padding rows (after the forest's tokens) attend to themselves
only, as in the tree mask: their output is their value.

The calls are cuDNN's fused attention on CUDA (bf16 / fp16, GQA heads as they are) and PyTorch's flash kernel on CPU
(float32 / float64 / bf16 / fp16), both through their ATen ops, which return the log-sum-exp and whose backward takes a
given one; a call with a single query or key (cuDNN refuses one over one) runs as plain matmuls.

`tree_flex_attention` uses this for layers whose mask is the plain causal tree mask of a forest with a
`prefix_plan`, with q, k and v heads equally wide: always on CPU (5-18x the dense-mask SDPA on forests of 3k-20k
tokens), and on CUDA where `fast_on_cuda` says the kernels beat FlexAttention (large trees, mostly prompt pairs) and
the forest's call shapes recur (`warm_on_cuda`: cuDNN builds a graph per new shape).
FlexAttention serves every other case (deeper trees, windows, softcap, sinks, latent attention, fp32 on CUDA).
`HF_TREE_ATTN_PREFIX_ATTENTION=never` (or `MODE`) turns it off, `always` uses it for every two-level forest.
`HF_TREE_ATTN_PREFIX_KERNEL=fa4` (or `KERNEL`) runs the CUDA calls on FlashAttention-4's varlen kernels instead, two
per forest whatever its lengths (`hf_tree_attn.varlen_attention`), for every two-level forest on CUDA (and every
deeper forest through its gathered paths, there).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import NamedTuple

import numpy as np
import torch
from transformers.integrations.sdpa_attention import repeat_kv

try:  # CUDA builds of PyTorch ship Triton; the CPU wheel does not
    import triton
    import triton.language as tl
except ImportError:
    triton = None

__all__ = [
    "MODE",
    "PrefixTree",
    "decode_plan",
    "fast_on_cuda",
    "prefix_attention",
    "prefix_plan",
    "prefix_trees",
    "serves",
    "supports",
    "warm_on_cuda",
]

_MODES = {"auto": "auto", "always": "always", "never": "never", "1": "always", "0": "never"}
# "auto": on CPU for every two-level forest, on CUDA for those `fast_on_cuda` picks; "always": every two-level forest;
# "never": FlexAttention / SDPA only. From HF_TREE_ATTN_PREFIX_ATTENTION at import; may be set at run time.
MODE = _MODES.get(os.environ.get("HF_TREE_ATTN_PREFIX_ATTENTION", "auto").strip().lower())
if MODE is None:
    raise ValueError(
        f"HF_TREE_ATTN_PREFIX_ATTENTION={os.environ['HF_TREE_ATTN_PREFIX_ATTENTION']!r}: use auto, always or never."
    )

_KERNELS = ("cudnn", "fa4")
# The CUDA kernels: "cudnn" (three calls per tree, `_forward`), or "fa4": FlashAttention-4's varlen kernels, two calls
# per forest whatever its lengths (`hf_tree_attn.varlen_attention`), taking every forest on CUDA. From
# HF_TREE_ATTN_PREFIX_KERNEL at import; may be set at run time.
KERNEL = os.environ.get("HF_TREE_ATTN_PREFIX_KERNEL", "cudnn").strip().lower()
if KERNEL not in _KERNELS:
    raise ValueError(
        f"HF_TREE_ATTN_PREFIX_KERNEL={os.environ['HF_TREE_ATTN_PREFIX_KERNEL']!r}: use cudnn (the default) or fa4 "
        "(FlashAttention-4's varlen kernels, `pip install flash-attn-4`)."
    )

# `fast_on_cuda`'s rule, from `benchmarks/results/prefix_attention_h200.json` and `..._repeat.json` (two runs; H200,
# torch 2.11, cuDNN 9.19; attention alone, forward twice + backward once as in a training step, Qwen3 heads). Each
# tree costs the kernels ~0.5 ms per forward whatever its size (the host's time to issue three cuDNN calls and a
# merge, `prefix_attention_parts_h200.json`), so they lose on small trees: 8 trees
# of 1,024 + 8 x 1,024 tokens (9,216 each) 0.82-0.86x, 8 of 1,024 + 32 x 128 (5,120) 0.45-0.52x; they win on larger
# ones: 4,096 + 16 x 512 (12,288) 1.16-1.21x at 16 q / 8 kv heads and 1.63-1.69x at 32 / 8, 1,024 + 16 x 1,024
# (17,408; prompt pairs 67% of all) 1.33-1.35x.
_MIN_PROMPT_SHARE = 0.65
_MIN_TREE_TOKENS = 10_000

_aten = torch.ops.aten


class PrefixTree(NamedTuple):
    """One tree of a two-level forest, as row ranges of the DFS row: the prompt `[start, stop)`, then its
    completions, completion `g` being `[bounds[g], bounds[g + 1])` (`bounds[0] == stop`; no completions: `(stop,)`)."""

    start: int
    stop: int
    bounds: tuple[int, ...]


def prefix_trees(segment_starts: torch.Tensor, segment_parent: torch.Tensor) -> tuple[PrefixTree, ...] | None:
    """A forest's trees, when every non-root segment is a root's child without children of its own, else None.

    Args:
        segment_starts: `(num_segments + 1,)` long (see `PackedForest`).
        segment_parent: `(num_segments,)` long, -1 for roots.
    """
    starts = segment_starts.cpu().numpy()
    parent = segment_parent.cpu().numpy()
    is_root = parent < 0
    if np.any(~is_root & ~is_root[np.maximum(parent, 0)]):  # a segment whose parent is not a root
        return None
    trees = []
    for k in np.flatnonzero(is_root):  # DFS order: a root, then its children, then the next root
        bounds = (int(starts[k + 1]),) + tuple(int(starts[c + 1]) for c in np.flatnonzero(parent == k))
        trees.append(PrefixTree(int(starts[k]), bounds[0], bounds))
    return tuple(trees)


def prefix_plan(num_tokens: int, trees: tuple[PrefixTree, ...]) -> torch.Tensor:
    """`trees` encoded for the kernels: `(n,)` int64 on the CPU, `[num_tokens, then per tree: start, G,
    bounds[0..G]]` (`num_tokens`: the forest's real rows; the rest are padding). A tensor, not a tuple, so that a
    compiled layer takes each new forest's as an input instead of recompiling for it (`decode_plan` reads it)."""
    values = [num_tokens]
    for tree in trees:
        values += [tree.start, len(tree.bounds) - 1, *tree.bounds]
    plan = torch.tensor(values, dtype=torch.int64)
    torch._dynamo.maybe_mark_dynamic(plan, 0)  # its length differs per forest: one graph for all
    return plan


def fast_on_cuda(trees: tuple[PrefixTree, ...]) -> bool:
    """Whether these trees' attention runs faster through the kernels here than through FlexAttention on CUDA:
    prompt pairs (the prompt's causal self-attention and every completion row over the prompt) at least 65% of all
    attention pairs, and at least 10,000 tokens per tree on average (measured, see `_MIN_PROMPT_SHARE`)."""
    prompt_pairs = own_pairs = tokens = 0
    for tree in trees:
        prompt, rows = tree.stop - tree.start, tree.bounds[-1] - tree.bounds[0]
        prompt_pairs += prompt * (prompt + 1) // 2 + rows * prompt
        own_pairs += sum((b - a) * (b - a + 1) // 2 for a, b in zip(tree.bounds, tree.bounds[1:]))
        tokens += tree.bounds[-1] - tree.start
    total = prompt_pairs + own_pairs
    return bool(trees) and prompt_pairs >= _MIN_PROMPT_SHARE * total and tokens >= _MIN_TREE_TOKENS * len(trees)


def decode_plan(plan: torch.Tensor) -> tuple[int, tuple[PrefixTree, ...]]:
    """`(num_tokens, trees)` of a `prefix_plan`."""
    values = plan.tolist()
    trees, k = [], 1
    while k < len(values):
        start, count = values[k], values[k + 1]
        bounds = tuple(values[k + 2 : k + 3 + count])
        trees.append(PrefixTree(start, bounds[0], bounds))
        k += 3 + count
    return values[0], tuple(trees)


# Call signatures (`_cuda_signature`) of the forests `serves` has been asked about on CUDA, least recent first.
_SEEN_ON_CUDA: OrderedDict[tuple, None] = OrderedDict()
_SEEN_LIMIT = 4096


def _cuda_signature(seq_len: int, trees: tuple[PrefixTree, ...]) -> tuple:
    """What PyTorch's cuDNN attention keys its execution graphs on for this forest's calls (`MHA.cpp`'s `MHAParams`:
    lengths and strides; a tree's prompt and completion rows are slices of the `(1, S, heads, dim)` projections, so
    `S` is in their strides), per tree: prompt length, completion rows, completion count, longest, all equal."""
    shapes = []
    for tree in trees:
        lengths = np.diff(tree.bounds)
        longest = int(lengths.max()) if len(lengths) else 0
        shapes.append((tree.stop - tree.start, tree.bounds[-1] - tree.bounds[0], len(lengths), longest,
                       bool((lengths == longest).all())))  # fmt: skip
    return (seq_len, tuple(shapes))


def warm_on_cuda(forest) -> bool:
    """Whether a forest of `forest`'s call signature was asked about before in this process (decided once per
    forest, kept with its masks; the first such forest records it).

    cuDNN builds an execution graph on the host for each new signature before its kernel runs: on an H200 a
    GRPO-shaped forest's first forward + backward through the kernels took 0.86 s (median of six), a repeat
    0.011 s, FlexAttention 0.012 s (`benchmarks/results/prefix_attention_new_shapes_h200.json`). With sampled
    completion lengths, mixed prompts or a planner's rows every forest is new, and the step waits on the host (GPU
    busy 44%, 1.9x slower than FlexAttention alone on TRL's async `grpo_mixed` rows,
    `async_grpo_h200_qwen3-1.7b_prefix_kernels.json`). `fast_on_cuda` was measured with the graphs built;
    FlexAttention, compiled for dynamic shapes, takes new lengths at no cost. So on CUDA the kernels take a forest
    whose signature recurs (a fixed-length workload, from its second forest on) and FlexAttention every other."""
    cache = forest._mask_cache
    if "prefix_warm_on_cuda" not in cache:
        if torch.compiler.is_compiling():  # a compiled layer sees the eager decision; none made: FlexAttention
            return False
        signature = _cuda_signature(forest.seq_len, decode_plan(forest.prefix_plan)[1])
        cache["prefix_warm_on_cuda"] = signature in _SEEN_ON_CUDA
        _SEEN_ON_CUDA[signature] = None
        _SEEN_ON_CUDA.move_to_end(signature)
        while len(_SEEN_ON_CUDA) > _SEEN_LIMIT:
            _SEEN_ON_CUDA.popitem(last=False)
    return cache["prefix_warm_on_cuda"]


def serves(forest, device_type: str) -> bool:
    """Whether the kernels take the plain causal layers of `forest` (a `PackedForest`) on `device_type`: it is
    two-level and, on CUDA, `fast_on_cuda` with a call signature seen before (`warm_on_cuda`), or `MODE` is
    "always". Each layer's tensors are checked again (`supports`).

    Decided once per forest, device type and `MODE`, eagerly (`PackedForest.attention_mask` asks before the layers
    run), and kept with the forest's masks. A compiled layer reads only that decision, so dynamo guards on it alone:
    one graph for the kernels and one for FlexAttention, whichever of the reasons above sent a forest to
    FlexAttention (guarding on each reason compiled the same FlexAttention layer once per reason, inside a run)."""
    cache = forest._mask_cache
    key = ("prefix_serves", device_type, MODE)
    if key not in cache:
        if torch.compiler.is_compiling():  # no eager decision was made: FlexAttention
            return False
        cache[key] = _serves(forest, device_type)
    return cache[key]


def _serves(forest, device_type: str) -> bool:
    if MODE == "never" or forest.prefix_plan is None:
        return False
    if device_type == "cuda" and KERNEL == "fa4":
        require_fa4()
        return True  # a varlen call takes every length: no shape to wait for
    if device_type != "cuda" or MODE == "always":
        return True
    return forest.prefix_fast_on_cuda and warm_on_cuda(forest)


def require_fa4() -> None:
    """Raise unless FlashAttention-4's kernels run on the current CUDA device (`KERNEL` "fa4" asked for them)."""
    from .varlen_attention import fa4_error

    error = fa4_error(torch.cuda.current_device())
    if error is not None:
        raise RuntimeError(
            f"HF_TREE_ATTN_PREFIX_KERNEL=fa4 asks for FlashAttention-4's kernels, but {error}. Unset it (cuDNN and "
            "FlexAttention then serve the forests) or install FlashAttention-4 on a GPU it supports."
        )


def _varlen_kernel(query: torch.Tensor):
    """The varlen kernel `prefix_attention` runs `query`'s forest through (`hf_tree_attn.varlen_attention`), or
    None for the per-tree calls of `_forward`: FlashAttention-4 on CUDA where `KERNEL` is "fa4"."""
    if KERNEL != "fa4" or not query.is_cuda:
        return None
    from .varlen_attention import FA4

    return FA4


def supports(query: torch.Tensor) -> bool:
    """Whether the kernels here serve `query` `(1, heads, S, head_dim)`: cuDNN attention on CUDA (bf16 / fp16, head
    dims multiple of 8 up to 128), PyTorch's flash attention on CPU (float32 / float64 / bf16 / fp16)."""
    if MODE == "never" or query.shape[0] != 1:
        return False
    if query.device.type == "cpu":
        return query.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    head_dim = query.shape[-1]
    return (
        query.device.type == "cuda"
        and query.dtype in (torch.bfloat16, torch.float16)
        and head_dim % 8 == 0
        and head_dim <= 128
    )


def _accumulate(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _math_inputs(q, k, v):
    """`q`, `k`, `v` in the accumulation dtype, k / v heads repeated for their query heads (GQA)."""
    acc, groups = _accumulate(q.dtype), q.shape[1] // k.shape[1]
    return q.to(acc), repeat_kv(k, groups).to(acc), repeat_kv(v, groups).to(acc)


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    """Scaled scores `(..., L_q, L_k)`; causal aligned to the bottom right (query `a` sees keys up to `L_k - L_q +
    a`: FlashAttention's varlen rule, which `varlen_attention`'s reference kernel keeps; the calls here that are
    causal have as many queries as keys, where it is the plain causal mask)."""
    scores = (q @ k.transpose(-1, -2)) * scale
    if causal:
        rows, cols = scores.shape[-2:]
        keep = torch.ones(rows, cols, dtype=torch.bool, device=q.device).tril(diagonal=cols - rows)
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores


def _math_forward(q, k, v, causal: bool, scale: float):
    """`_forward` by plain matmuls, for a single query or key on CUDA (cuDNN refuses one query over one key; a single
    row costs little either way)."""
    q_, k_, v_ = _math_inputs(q, k, v)
    scores = _scores(q_, k_, causal, scale)
    lse = scores.logsumexp(-1)
    return (torch.exp(scores - lse[..., None]) @ v_).to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """`_backward` by plain matmuls: `dS = P * (dO V^T - rowsum(dO * O))` with `P = exp(S - lse)`."""
    q_, k_, v_ = _math_inputs(q, k, v)
    probs = torch.exp(_scores(q_, k_, causal, scale) - lse[..., None].to(q_.dtype))
    dout, out = dout.to(q_.dtype), out.to(q_.dtype)
    dscores = probs * (dout @ v_.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True))
    dq = (dscores @ k_) * scale
    dk = (dscores.transpose(-1, -2) @ q_) * scale
    dv = probs.transpose(-1, -2) @ dout
    dk, dv = (x.unflatten(1, (k.shape[1], -1)).sum(2) for x in (dk, dv))  # per kv head: the sum over its q heads
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _forward(q, k, v, causal: bool, scale: float):
    """`(out, lse)`: attention of `q` `(B, H, Lq, D)` over `k`, `v` `(B, H, Lk, D)` (top-left causal if `causal`),
    `lse` `(B, H, Lq)` (float32; float64 for float64 inputs)."""
    if q.device.type == "cuda" and min(q.shape[2], k.shape[2]) == 1:
        return _math_forward(q, k, v, causal, scale)
    if q.device.type == "cpu":
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse.to(_accumulate(q.dtype))
    res = _aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return res[0], res[1].view(q.shape[:3])


def _backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """`(dq, dk, dv)` of a `_forward` call, given `out` `(B, H, Lq, D)` and `lse` `(B, H, Lq)`: the merged ones, so
    the result is this call's share of the merged attention's gradients."""
    if q.device.type == "cuda" and min(q.shape[2], k.shape[2]) == 1:
        return _math_backward(dout, q, k, v, out, lse, causal, scale)
    if q.device.type == "cpu":
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.to(_accumulate(q.dtype)), 0.0, causal, scale=scale
        )
    unused = torch.empty((), dtype=torch.long, device=q.device)  # the dropout RNG state: no dropout here
    return _aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse.float().unsqueeze(-1).contiguous(), unused, unused, None, None, None, q.shape[2],
        k.shape[2], 0.0, causal, scale=scale,
    )  # fmt: skip


class _Completions(NamedTuple):
    """Where one tree's completions sit, on the device: `index` `(G * C_max,)` the row of each slot of the padded
    `(G, C_max)` batch (a completion padded with its last row), `slots` `(M,)` the slot of each completion row in
    row order, `real` `(G, 1, C_max, 1)` which slots hold a completion row; `equal` when all G completions have
    `C_max` rows (the batch is then a view of the rows)."""

    count: int
    longest: int
    index: torch.Tensor
    slots: torch.Tensor
    real: torch.Tensor
    equal: bool


def _completions(plan: torch.Tensor, number: int, tree: PrefixTree, device) -> _Completions:
    """`_Completions` of tree `number` of `plan`, built once per plan, tree and device and kept on the plan tensor:
    copying them to the GPU at every layer would make the host wait for the GPU's queue."""
    cache = plan.__dict__.setdefault("_prefix_completions", {})
    key = (number, torch.device(device))
    if key not in cache:
        bounds = torch.tensor(tree.bounds)
        lengths = bounds.diff()
        longest = int(lengths.max())
        cols = torch.arange(longest)
        index = (bounds[:-1, None] + torch.minimum(cols, lengths[:, None] - 1)).flatten()
        real = cols < lengths[:, None]
        slots = torch.nonzero(real.flatten())[:, 0]
        tensors = (index, slots, real[:, None, :, None])
        if key[1].type == "cuda":
            tensors = tuple(x.pin_memory().to(device, non_blocking=True) for x in tensors)
        cache[key] = _Completions(len(lengths), longest, *tensors, bool((lengths == longest).all()))
    return cache[key]


def _batch(x: torch.Tensor, first: int, last: int, comp: _Completions) -> torch.Tensor:
    """Rows `[first, last)` of `x` `(1, H, S, ...)` as the padded completion batch `(G, H, C_max, ...)` (a view
    when the completions have equal lengths, else a gather)."""
    rows = x[:, :, first:last] if comp.equal else x.index_select(2, comp.index)
    return rows.unflatten(2, (comp.count, comp.longest)).transpose(1, 2)[0]


def _unbatch(x: torch.Tensor, comp: _Completions) -> torch.Tensor:
    """Inverse of `_batch`: `(G, H, C_max, ...)` → `(1, H, M, ...)` (the real rows, in row order)."""
    x = x.transpose(0, 1).flatten(1, 2)[None]
    return x if comp.equal else x.index_select(2, comp.slots)


def _merge(out, lse, shared, lse_shared, own, lse_own) -> None:
    """Writes into `out` `(H, M, D)` and `lse` `(H, M)` the softmax over both key sets of two attention calls over
    disjoint keys, `(shared, lse_shared)` and `(own, lse_own)`: `lse = logaddexp(lse_shared, lse_own)`, `out = w *
    shared + (1 - w) * own` with `w = exp(lse_shared - lse)`, in float32 (float64 for float64). One fused kernel on
    CUDA (Triton), where PyTorch's ops take five passes over the rows."""
    if _merge_kernel is not None and out.is_cuda and all(x.stride(-1) == 1 for x in (out, shared, own)):
        heads, rows, dim = out.shape
        block = max(1, 8192 // dim)
        _merge_kernel[(triton.cdiv(rows, block), heads)](
            out, lse, shared, lse_shared, own, lse_own, rows, *out.stride()[:2], *lse.stride(),
            *shared.stride()[:2], *lse_shared.stride(), *own.stride()[:2], *lse_own.stride(),
            DIM=dim, BLOCK=block,
        )  # fmt: skip
        return
    _merge_with_torch(out, lse, shared, lse_shared, own, lse_own)


def _merge_with_torch(out, lse, shared, lse_shared, own, lse_own) -> None:
    """`_merge` by PyTorch ops (CPU, or CUDA without Triton): `w = sigmoid(lse_shared - lse_own)`."""
    weight = torch.sigmoid(lse_shared - lse_own)[..., None]
    out.copy_(torch.lerp(own.to(weight.dtype), shared.to(weight.dtype), weight))
    lse.copy_(torch.logaddexp(lse_shared, lse_own))


if triton is not None:

    @triton.jit
    def _merge_kernel(
        out, lse, shared, lse_shared, own, lse_own, rows,
        out_h, out_m, lse_h, lse_m, shared_h, shared_m, lse_shared_h, lse_shared_m, own_h, own_m, lse_own_h, lse_own_m,
        DIM: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """`_merge` of `BLOCK` rows of one head; every row's `DIM` values contiguous."""
        head = tl.program_id(1)
        m = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        d = tl.arange(0, DIM)
        real = m < rows
        ls = tl.load(lse_shared + head * lse_shared_h + m * lse_shared_m, mask=real, other=0.0)
        lo = tl.load(lse_own + head * lse_own_h + m * lse_own_m, mask=real, other=0.0)
        top = tl.maximum(ls, lo)
        merged = top + tl.log(tl.exp(ls - top) + tl.exp(lo - top))
        w = tl.exp(ls - merged)[:, None]
        a = tl.load(shared + head * shared_h + m[:, None] * shared_m + d[None, :], mask=real[:, None])
        b = tl.load(own + head * own_h + m[:, None] * own_m + d[None, :], mask=real[:, None])
        b = b.to(tl.float32)
        mixed = (b + w * (a.to(tl.float32) - b)).to(out.dtype.element_ty)
        tl.store(out + head * out_h + m[:, None] * out_m + d[None, :], mixed, mask=real[:, None])
        tl.store(lse + head * lse_h + m * lse_m, merged, mask=real)

else:
    _merge_kernel = None


def _empty_output(query: torch.Tensor) -> torch.Tensor:
    """An uninitialised `(B, H, S, D)` like `query`, laid out as `(B, S, H, D)`: the layout of the model's
    projections, so that `out.transpose(1, 2)` before the output projection is contiguous without a copy, its
    gradient arrives in `out`'s layout, and `dq`, `dk`, `dv` flow back to the q / k / v projections as views."""
    batch, heads, rows, dim = query.shape
    return query.new_empty((batch, rows, heads, dim)).transpose(1, 2)


@torch.library.custom_op("hf_tree_attn::prefix_attention", mutates_args=())
def _prefix_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(out, lse)` of `prefix_attention` (an opaque op for torch.compile: its loops and shapes follow the plan)."""
    kernel = _varlen_kernel(query)
    if kernel is not None:
        from .varlen_attention import varlen_forward

        return varlen_forward(query, key, value, plan, scale, kernel)
    num_tokens, trees = decode_plan(plan)
    out = _empty_output(query)
    lse = torch.empty(query.shape[:3], dtype=_accumulate(query.dtype), device=query.device)
    for number, tree in enumerate(trees):
        prompt, first, last = slice(tree.start, tree.stop), tree.bounds[0], tree.bounds[-1]
        k, v = key[:, :, prompt], value[:, :, prompt]
        out[:, :, prompt], lse[..., prompt] = _forward(query[:, :, prompt], k, v, True, scale)
        if last == first:
            continue
        shared, lse_shared = _forward(query[:, :, first:last], k, v, False, scale)
        comp = _completions(plan, number, tree, query.device)
        own, lse_own = _forward(*(_batch(x, first, last, comp) for x in (query, key, value)), True, scale)
        own, lse_own = _unbatch(own, comp), _unbatch(lse_own[..., None], comp)[..., 0]
        _merge(out[0, :, first:last], lse[0, :, first:last], shared[0], lse_shared[0], own[0], lse_own[0])
    if num_tokens < query.shape[2]:  # padding rows: each attends only to itself
        groups = query.shape[1] // key.shape[1]
        pad_k, pad_v = (repeat_kv(x[:, :, num_tokens:], groups) for x in (key, value))
        out[:, :, num_tokens:] = pad_v
        lse[..., num_tokens:] = (query[:, :, num_tokens:].to(lse.dtype) * pad_k.to(lse.dtype)).sum(-1) * scale
    return out, lse


@_prefix_forward.register_fake
def _(query, key, value, plan, scale):
    return _empty_output(query), query.new_empty(query.shape[:3], dtype=_accumulate(query.dtype))


@torch.library.custom_op("hf_tree_attn::prefix_attention_backward", mutates_args=())
def _prefix_backward(
    dout: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    plan: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(dq, dk, dv)` of `prefix_attention`, from the forward's merged `out` and `lse`; laid out as `(B, S, H, D)`
    (`_empty_output`), as the projections' gradients flow back."""
    if dout.stride() != out.stride():  # the kernels' backward expects `out`'s layout
        dout = _empty_output(dout).copy_(dout)
    kernel = _varlen_kernel(query)
    if kernel is not None:
        from .varlen_attention import varlen_backward

        return varlen_backward(dout, query, key, value, out, lse, plan, scale, kernel)
    num_tokens, trees = decode_plan(plan)
    acc = _accumulate(query.dtype)
    dq, dk, dv = (_empty_output(x) for x in (query, key, value))
    for number, tree in enumerate(trees):
        prompt, first, last = slice(tree.start, tree.stop), tree.bounds[0], tree.bounds[-1]
        q, k, v = query[:, :, prompt], key[:, :, prompt], value[:, :, prompt]
        g_prompt = _backward(dout[:, :, prompt], q, k, v, out[:, :, prompt], lse[..., prompt], True, scale)
        dq[:, :, prompt] = g_prompt[0]
        if last == first:
            dk[:, :, prompt], dv[:, :, prompt] = g_prompt[1:]
            continue
        rows = slice(first, last)
        q_comp = query[:, :, rows]
        g_shared = _backward(dout[:, :, rows], q_comp, k, v, out[:, :, rows], lse[..., rows], False, scale)
        torch.add(g_prompt[1], g_shared[1], out=dk[:, :, prompt])  # summed in float32, rounded once
        torch.add(g_prompt[2], g_shared[2], out=dv[:, :, prompt])
        comp = _completions(plan, number, tree, query.device)
        own = [_batch(x, first, last, comp) for x in (dout, query, key, value, out, lse[..., None])]
        own[-1] = own[-1][..., 0]
        if not comp.equal:  # padding slots repeat their completion's last row: they must add no gradient
            own[0] = own[0] * comp.real
        g_own = _backward(*own, True, scale)
        torch.add(g_shared[0], _unbatch(g_own[0], comp), out=dq[:, :, rows])
        dk[:, :, rows], dv[:, :, rows] = _unbatch(g_own[1], comp), _unbatch(g_own[2], comp)
    if num_tokens < query.shape[2]:  # padding rows: out = v, so dv = dout (summed over a kv head's query heads)
        dq[:, :, num_tokens:] = 0
        dk[:, :, num_tokens:] = 0
        pad = dout[:, :, num_tokens:]
        dv[:, :, num_tokens:] = pad.unflatten(1, (key.shape[1], -1)).sum(2, dtype=acc)
    return dq, dk, dv


@_prefix_backward.register_fake
def _(dout, query, key, value, out, lse, plan, scale):
    return _empty_output(query), _empty_output(key), _empty_output(value)


def register_plan_autograd(forward_op, backward_op) -> None:
    """The autograd of an attention op `forward_op(query, key, value, plan, scale) -> (out, lse)` whose gradients
    `backward_op(dout, query, key, value, out, lse, plan, scale) -> (dq, dk, dv)` computes: it saves what
    FlexAttention saves, and the plan. Its `lse` never leaves the module that calls the op, so its gradient is None."""

    def setup_context(ctx, inputs, output):
        query, key, value, plan, scale = inputs
        ctx.save_for_backward(query, key, value, *output, plan)
        ctx.scale = scale

    def grad(ctx, dout, dlse):
        query, key, value, out, lse, plan = ctx.saved_tensors
        return (*backward_op(dout, query, key, value, out, lse, plan, ctx.scale), None, None)

    forward_op.register_autograd(grad, setup_context=setup_context)


register_plan_autograd(_prefix_forward, _prefix_backward)


def prefix_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: torch.Tensor, scale: float
) -> torch.Tensor:
    """Ancestor-or-self (tree causal) attention of a two-level forest, through dense kernels (module docstring).

    Args:
        query: `(1, q_heads, S, head_dim)`.
        key, value: `(1, kv_heads, S, head_dim)`, `q_heads` a multiple of `kv_heads` (GQA).
        plan: the forest's `prefix_plan` (`PackedForest.prefix_plan`); rows after its `num_tokens` are padding,
            each attending only to itself.
        scale: softmax scale.

    Returns:
        `(1, q_heads, S, head_dim)`, `query`'s dtype: what FlexAttention with the forest's tree mask returns, laid
        out as `(1, S, q_heads, head_dim)` (its `transpose(1, 2)`, what the output projection reads, is contiguous).
    """
    return _prefix_forward(query, key, value, plan, scale)[0]
