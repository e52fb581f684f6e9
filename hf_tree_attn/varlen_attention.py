"""Tree attention in varlen calls: FlashAttention-4's kernels on CUDA, for the plain causal tree mask.

A varlen kernel runs many sequences in one call, each addressed in the rows by offset (`cu_seqlens`) and length
(`seqused`), causal aligned to the bottom right (query `a` of `L_q` sees keys up to `L_k - L_q + a`). It needs no
mask and takes every length at once: no graph per shape (cuDNN's), no blocks straddling branch ends (FlexAttention's).
Two routes reduce the tree mask to such calls.

**Shared prefix** (two-level forests: GRPO groups; `prefix_attention`'s op, `varlen_forward` / `varlen_backward`).
`hf_tree_attn.prefix_attention` splits the mask into the prompt part and the completions' own part, merged by their
log-sum-exps, and runs three cuDNN calls per tree. Here the same split is two calls for the whole forest. In DFS
order a two-level forest is, per tree, its prompt rows, then its completions one after another; padding rows follow
the forest's tokens. Each row's ancestor-or-self keys are the union of two disjoint sets:

    own      its segment's rows up to itself: every segment (a prompt, a completion, a padding row) is a sequence
             of the call, causal, its queries and keys the same rows (`cu_seqlens` = the segment bounds)
    shared   its tree's prompt, for a completion row only: one sequence per tree with completions, its queries the
             completion rows and its keys the prompt rows, no mask, both addressed by offset and length

so the two calls read the q / k / v projections as they lie, `(S, heads, dim)`. A padding row is its own segment:
its output is its value, as the tree mask gives. Rows with no shared part (prompts, padding) get a log-sum-exp of
-inf there and keep their own part exactly; the merge is `prefix_attention`'s. Backward: each call's backward given
the merged output and log-sum-exp gives its keys' exact dK, dV and its share of dQ (`prefix_attention`'s module
docstring); the shares add, the prompt rows' dK, dV getting the shared call's too.

**Gathered paths** (any forest; the op `path_attention`). Each segment's rows are one sequence whose keys are its
path: its ancestor segments' rows, root first, then its own, gathered into one `(sum of path lengths, kv_heads,
dim)` copy; causal aligned to the bottom right is then exactly the tree mask, in one call. The backward scatters the
gathered keys' gradients back, summed in float32 over the paths that share a row. The price is the copy (every
segment re-reads its ancestors: 6 to 16 gathered keys per forest row on GRPO groups and agent trees of 20-30k rows),
which the shared-prefix route does not pay where it applies.

The kernels: FlashAttention-4 (the `flash-attn-4` package, `flash_attn.cute`, CuTe DSL; compute capability 9.x and
10.x; bf16 / fp16) through the entry points PyTorch's own FA4 registration calls (`_flash_attn_fwd`,
`_flash_attn_bwd`; read in flash-attn-4 4.0.0b40). `HF_TREE_ATTN_PREFIX_KERNEL=fa4` turns both routes on for CUDA
(`prefix_attention.KERNEL`): two-level forests take the shared-prefix route, every other forest's plain causal
layers the gathered paths (windows, softcaps, sinks, latent attention keep FlexAttention). `REFERENCE` is the same
contract in plain PyTorch, one sequence at a time, for the tests on CPU (rows no sequence covers are left NaN there,
as the kernels leave them unwritten).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch

from . import prefix_attention
from .prefix_attention import (
    _accumulate,
    _empty_output,
    _math_backward,
    _math_forward,
    _merge,
    decode_plan,
    register_plan_autograd,
)

__all__ = [
    "FA4",
    "REFERENCE",
    "PathCalls",
    "VarlenCalls",
    "fa4_error",
    "path_attention",
    "path_calls",
    "path_plan",
    "path_serves",
    "varlen_backward",
    "varlen_calls",
    "varlen_forward",
]


class VarlenCalls(NamedTuple):
    """The two calls' sequences for a forest of `S` rows (int32 on the forest's device).

    `own_starts` `(n + 1,)`: the bounds of every segment (prompts, completions, one per padding row), `own_longest`
    the longest. `shared_q` / `shared_k` `(T + 1,)`: per tree with completions, the row of its first completion /
    of its prompt (then `S`); `shared_q_rows` / `shared_k_rows` `(T,)`: its completion rows / prompt rows, the
    longest `shared_q_longest` / `shared_k_longest`; `T == 0` skips the shared call. `completion` `(S,)` bool: the
    rows with a shared part; `prompt` `(S,)` bool: the rows the shared call reads as keys."""

    own_starts: torch.Tensor
    own_longest: int
    shared_q: torch.Tensor
    shared_k: torch.Tensor
    shared_q_rows: torch.Tensor
    shared_k_rows: torch.Tensor
    shared_q_longest: int
    shared_k_longest: int
    completion: torch.Tensor
    prompt: torch.Tensor


def varlen_calls(plan: torch.Tensor, seq_len: int, device) -> VarlenCalls:
    """`VarlenCalls` of a `prefix_plan` for `seq_len` rows, built once per plan, length and device and kept on the
    plan tensor (copying them to the GPU at every layer would make the host wait for the GPU's queue)."""
    cache = plan.__dict__.setdefault("_varlen_calls", {})
    key = (seq_len, torch.device(device))
    if key not in cache:
        cache[key] = _build(plan, seq_len, key[1])
    return cache[key]


def _build(plan: torch.Tensor, seq_len: int, device: torch.device) -> VarlenCalls:
    num_tokens, trees = decode_plan(plan)
    own, q_starts, k_starts, q_rows, k_rows = [0], [], [], [], []
    completion = torch.zeros(seq_len, dtype=torch.bool)
    prompt = torch.zeros(seq_len, dtype=torch.bool)
    for tree in trees:
        if tree.start != own[-1]:
            raise ValueError(f"prefix plan: a tree starts at row {tree.start}, the previous one ends at {own[-1]}.")
        own.extend(tree.bounds)
        first, last = tree.bounds[0], tree.bounds[-1]
        if last > first:
            q_starts.append(first)
            k_starts.append(tree.start)
            q_rows.append(last - first)
            k_rows.append(first - tree.start)
            completion[first:last] = True
            prompt[tree.start : first] = True
    if own[-1] != num_tokens or num_tokens > seq_len:
        raise ValueError(f"prefix plan: trees cover rows [0, {own[-1]}) of {num_tokens} tokens, {seq_len} rows.")
    own.extend(range(num_tokens + 1, seq_len + 1))  # each padding row its own segment
    lengths = [b - a for a, b in zip(own, own[1:])]

    def ints(values):
        tensor = torch.tensor(values, dtype=torch.int32)
        return tensor.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tensor

    def flags(mask):
        return mask.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else mask

    return VarlenCalls(
        ints(own), max(lengths, default=0), ints(q_starts + [seq_len]), ints(k_starts + [seq_len]), ints(q_rows),
        ints(k_rows), max(q_rows, default=0), max(k_rows, default=0), flags(completion), flags(prompt),
    )  # fmt: skip


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`(1, heads, S, dim)` → `(S, heads, dim)` (a view; contiguous where `x` is laid out as the projections are)."""
    return x[0].transpose(0, 1)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """`(S, heads, dim)` → `(1, heads, S, dim)` laid out as `(1, S, heads, dim)` (`prefix_attention`'s outputs)."""
    return x.contiguous()[None].transpose(1, 2)


def varlen_forward(query, key, value, plan: torch.Tensor, scale: float, kernel) -> tuple[torch.Tensor, torch.Tensor]:
    """`(out, lse)` of `prefix_attention.prefix_attention` through `kernel`'s varlen calls: `out` `(1, q_heads, S,
    dim)` laid out as `(1, S, q_heads, dim)`, `lse` `(1, q_heads, S)` float32 (float64 for float64 inputs).

    Args:
        query: `(1, q_heads, S, dim)`; key, value: `(1, kv_heads, S, dim)`.
        plan: the forest's `prefix_plan`.
        kernel: `FA4` or `REFERENCE`.
    """
    calls = varlen_calls(plan, query.shape[2], query.device)
    q, k, v = (_rows(x) for x in (query, key, value))
    longest = calls.own_longest
    out, lse = kernel.forward(q, k, v, calls.own_starts, calls.own_starts, None, None, longest, longest, True, scale)
    if calls.shared_q_longest:
        shared, lse_shared = kernel.forward(
            q, k, v, calls.shared_q, calls.shared_k, calls.shared_q_rows, calls.shared_k_rows,
            calls.shared_q_longest, calls.shared_k_longest, False, scale,
        )  # fmt: skip
        rows = calls.completion
        shared = torch.where(rows[:, None, None], shared, 0)  # rows the call did not write hold anything
        lse_shared = torch.where(rows, lse_shared, float("-inf"))
        _merge(out.transpose(0, 1), lse, shared.transpose(0, 1), lse_shared, out.transpose(0, 1), lse)
    return _heads_first(out), lse[None]


def varlen_backward(dout, query, key, value, out, lse, plan: torch.Tensor, scale: float, kernel):
    """`(dq, dk, dv)` of `varlen_forward`, given its (merged) `out` and `lse`, `dout` laid out as `out`; each
    `(1, heads, S, dim)` laid out as `(1, S, heads, dim)`."""
    calls = varlen_calls(plan, query.shape[2], query.device)
    do, q, k, v, o = (_rows(x) for x in (dout, query, key, value, out))
    lse, longest = lse[0], calls.own_longest
    own = calls.own_starts
    dq, dk, dv = kernel.backward(do, q, k, v, o, lse, own, own, None, None, longest, longest, True, scale)
    if calls.shared_q_longest:
        gq, gk, gv = kernel.backward(
            do, q, k, v, o, lse, calls.shared_q, calls.shared_k, calls.shared_q_rows, calls.shared_k_rows,
            calls.shared_q_longest, calls.shared_k_longest, False, scale,
        )  # fmt: skip
        # Each sum in float32, rounded once; rows the shared call did not write hold anything.
        dq = torch.where(calls.completion[:, None, None], dq + gq, dq)
        dk = torch.where(calls.prompt[:, None, None], dk + gk, dk)
        dv = torch.where(calls.prompt[:, None, None], dv + gv, dv)
    return tuple(_heads_first(x) for x in (dq, dk, dv))


# ------------------------------------------------------------------------------------------ gathered paths


def path_plan(segment_starts: torch.Tensor, segment_parent: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """A forest's segments for `path_attention` (`PackedForest.path_plan`): `(2 + 2 N + 1,)` int64 on the CPU,
    `[num_tokens, N, starts[0..N], parent[0..N-1]]`. A tensor, so that a compiled layer takes each forest's as an
    input instead of recompiling for it."""
    starts, parent = segment_starts.cpu().long(), segment_parent.cpu().long()
    plan = torch.cat([torch.tensor([num_tokens, parent.numel()]), starts, parent])
    torch._dynamo.maybe_mark_dynamic(plan, 0)
    return plan


class PathCalls(NamedTuple):
    """The one call of `path_attention` for a forest of `S` rows (on its device): `cu_q` `(n + 1,)` int32, the rows
    of each segment (each padding row one more); `keys` `(T_k,)` long, each segment's path rows (ancestor segments
    root first, then its own) one after another; `cu_k` `(n + 1,)` int32 their bounds; the longest of each."""

    cu_q: torch.Tensor
    keys: torch.Tensor
    cu_k: torch.Tensor
    longest_q: int
    longest_k: int


def path_calls(plan: torch.Tensor, seq_len: int, device) -> PathCalls:
    """`PathCalls` of a `path_plan` for `seq_len` rows, built once per plan, length and device, kept on the plan."""
    cache = plan.__dict__.setdefault("_path_calls", {})
    key = (seq_len, torch.device(device))
    if key not in cache:
        values = plan.tolist()
        num_tokens, count = values[0], values[1]
        starts, parent = values[2 : 3 + count], values[3 + count :]
        paths, cu_q, cu_k = [], list(starts), [0]
        for seg, up in enumerate(parent):
            paths.append((paths[up] if up >= 0 else []) + [(starts[seg], starts[seg + 1])])
            cu_k.append(cu_k[-1] + sum(b - a for a, b in paths[-1]))
        rows = [np.arange(a, b) for path in paths for a, b in path]
        rows.append(np.arange(num_tokens, seq_len))  # each padding row: itself
        cu_q += list(range(num_tokens + 1, seq_len + 1))
        cu_k += [cu_k[-1] + i for i in range(1, seq_len - num_tokens + 1)]
        lengths = np.diff(cu_q), np.diff(cu_k)
        tensors = [torch.tensor(cu_q, dtype=torch.int32), torch.from_numpy(np.concatenate(rows)).long(),
                   torch.tensor(cu_k, dtype=torch.int32)]  # fmt: skip
        if key[1].type == "cuda":
            tensors = [x.pin_memory().to(key[1], non_blocking=True) for x in tensors]
        cache[key] = PathCalls(tensors[0], tensors[1], tensors[2], int(lengths[0].max()), int(lengths[1].max()))
    return cache[key]


def path_serves(forest, device_type: str) -> bool:
    """Whether `path_attention` takes the plain causal layers of `forest` on `device_type`: CUDA with
    `prefix_attention.KERNEL` "fa4", a forest the shared-prefix route does not take (not two-level), the kernels not
    switched off (`MODE`). Decided once per forest eagerly (`PackedForest.attention_mask`) and kept with its masks:
    a compiled layer reads only the decision, as `prefix_attention.serves` (a forest never decided: FlexAttention)."""
    cache = forest._mask_cache
    key = ("path_serves", device_type, prefix_attention.KERNEL, prefix_attention.MODE)
    if key not in cache:
        if torch.compiler.is_compiling():
            return False
        serving = (
            device_type == "cuda"
            and prefix_attention.KERNEL == "fa4"
            and prefix_attention.MODE != "never"
            and forest.prefix_plan is None
        )
        if serving:
            prefix_attention.require_fa4()
            forest.path_plan  # noqa: B018 - built eagerly: a compiled layer only reads it
        cache[key] = serving
    return cache[key]


def _path_kernel(query: torch.Tensor):
    """The kernel `path_attention` runs on: FlashAttention-4 (the route serves CUDA only)."""
    return FA4


def _gathered(x: torch.Tensor, calls: PathCalls) -> torch.Tensor:
    """Rows `calls.keys` of `x` `(1, heads, S, dim)`, as `(T_k, heads, dim)`."""
    return _rows(x).index_select(0, calls.keys)


@torch.library.custom_op("hf_tree_attn::path_attention", mutates_args=())
def _path_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(out, lse)` of `path_attention` (an opaque op for torch.compile: its shapes follow the plan)."""
    calls = path_calls(plan, query.shape[2], query.device)
    out, lse = _path_kernel(query).forward(
        _rows(query), _gathered(key, calls), _gathered(value, calls), calls.cu_q, calls.cu_k, None, None,
        calls.longest_q, calls.longest_k, True, scale,
    )  # fmt: skip
    return _heads_first(out), lse[None]


@_path_forward.register_fake
def _(query, key, value, plan, scale):
    return _empty_output(query), query.new_empty(query.shape[:3], dtype=_accumulate(query.dtype))


@torch.library.custom_op("hf_tree_attn::path_attention_backward", mutates_args=())
def _path_backward(
    dout: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    plan: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(dq, dk, dv)` of `path_attention`, laid out as `(1, S, heads, dim)`; a row's dK / dV summed over the paths
    that read it, in float32, rounded once."""
    calls = path_calls(plan, query.shape[2], query.device)
    if dout.stride() != out.stride():  # the kernel's backward expects `out`'s layout
        dout = _empty_output(dout).copy_(dout)
    dq, dk, dv = _path_kernel(query).backward(
        _rows(dout), _rows(query), _gathered(key, calls), _gathered(value, calls), _rows(out), lse[0], calls.cu_q,
        calls.cu_k, None, None, calls.longest_q, calls.longest_k, True, scale,
    )  # fmt: skip
    acc = _accumulate(key.dtype)
    grads = [torch.zeros(_rows(x).shape, dtype=acc, device=x.device).index_add_(0, calls.keys, g.to(acc)).to(x.dtype)
             for x, g in ((key, dk), (value, dv))]  # fmt: skip
    return _heads_first(dq), _heads_first(grads[0]), _heads_first(grads[1])


@_path_backward.register_fake
def _(dout, query, key, value, out, lse, plan, scale):
    return _empty_output(query), _empty_output(key), _empty_output(value)


register_plan_autograd(_path_forward, _path_backward)  # the gathered copies are made again in the backward


def path_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: torch.Tensor, scale: float
) -> torch.Tensor:
    """Ancestor-or-self attention of any forest as one varlen call over each segment's gathered path.

    Args:
        query: `(1, q_heads, S, head_dim)`.
        key, value: `(1, kv_heads, S, head_dim)`, `q_heads` a multiple of `kv_heads` (GQA).
        plan: the forest's `path_plan`; rows after its `num_tokens` are padding, each attending only to itself.
        scale: softmax scale.

    Returns:
        `(1, q_heads, S, head_dim)`, `query`'s dtype, laid out as `(1, S, q_heads, head_dim)`.
    """
    return _path_forward(query, key, value, plan, scale)[0]


# ------------------------------------------------------------------------------------------------ kernels


class _Reference:
    """FlashAttention's varlen contract in plain PyTorch, one sequence at a time (the tests' CPU stand-in).

    Sequence `b` is query rows `[cu_q[b], cu_q[b] + n_q)` and key rows `[cu_k[b], cu_k[b] + n_k)` of `(T, heads,
    dim)` tensors, `n` from `used` where given, else `cu[b + 1] - cu[b]`; causal aligned to the bottom right (query
    `a` sees keys up to `n_k - n_q + a`); GQA heads; by `prefix_attention`'s plain-matmul kernels. `lse` `(heads,
    T_q)` in the accumulation dtype; the backward takes the output and log-sum-exp it is given. Rows no sequence
    covers stay NaN."""

    @staticmethod
    def _spans(cu_q, cu_k, used_q, used_k):
        cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
        used_q = None if used_q is None else used_q.tolist()
        used_k = None if used_k is None else used_k.tolist()
        for b in range(len(cu_q) - 1):
            n_q = used_q[b] if used_q is not None else cu_q[b + 1] - cu_q[b]
            n_k = used_k[b] if used_k is not None else cu_k[b + 1] - cu_k[b]
            yield slice(cu_q[b], cu_q[b] + n_q), slice(cu_k[b], cu_k[b] + n_k)

    @staticmethod
    def _heads(x):  # (L, heads, dim) → (1, heads, L, dim)
        return x.transpose(0, 1)[None]

    def forward(self, q, k, v, cu_q, cu_k, used_q, used_k, max_q, max_k, causal, scale):
        out = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[1::-1], float("nan"), dtype=_accumulate(q.dtype), device=q.device)
        for rows, keys in self._spans(cu_q, cu_k, used_q, used_k):
            part = _math_forward(self._heads(q[rows]), self._heads(k[keys]), self._heads(v[keys]), causal, scale)
            out[rows], lse[:, rows] = part[0][0].transpose(0, 1), part[1][0]
        return out, lse

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, used_q, used_k, max_q, max_k, causal, scale):
        grads = [torch.full_like(x, float("nan")) for x in (q, k, v)]
        for rows, keys in self._spans(cu_q, cu_k, used_q, used_k):
            parts = [self._heads(x[rows]) for x in (dout, q)] + [self._heads(x[keys]) for x in (k, v)]
            got = _math_backward(*parts, self._heads(out[rows]), lse[None, :, rows], causal, scale)
            for grad, part, span in zip(grads, got, (rows, keys, keys)):
                grad[span] = part[0].transpose(0, 1)
        return tuple(grads)


class _FlashAttention4:
    """FlashAttention-4's varlen forward and backward (`flash_attn.cute.interface`), `_Reference`'s contract."""

    def forward(self, q, k, v, cu_q, cu_k, used_q, used_k, max_q, max_k, causal, scale):
        out, lse, *_ = _fa4().interface._flash_attn_fwd(
            q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q, seqused_k=used_k, max_seqlen_q=max_q,
            max_seqlen_k=max_k, softmax_scale=scale, causal=causal, return_lse=True,
        )  # fmt: skip
        return out, lse

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, used_q, used_k, max_q, max_k, causal, scale):
        grads = _fa4().interface._flash_attn_bwd(
            q, k, v, out, dout, lse, scale, causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q,
            seqused_k=used_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
        )  # fmt: skip
        return tuple(grads[:3])


@functools.cache
def _fa4():
    import flash_attn.cute.interface

    return flash_attn.cute


@functools.cache
def fa4_error(device_index: int) -> str | None:
    """Why FlashAttention-4's kernels cannot run on CUDA device `device_index`, or None."""
    try:
        _fa4()
    except Exception as error:  # an ImportError, or the CuTe DSL failing to load its libraries
        return f"flash_attn.cute does not import ({type(error).__name__}: {error}); `pip install flash-attn-4`"
    major, minor = torch.cuda.get_device_capability(device_index)
    if major not in (9, 10):
        return f"its kernels run on compute capability 9.x and 10.x, this GPU is {major}.{minor}"
    return None


FA4 = _FlashAttention4()
REFERENCE = _Reference()
