"""Shared-prefix attention in two varlen calls over the whole forest: FlashAttention-4's kernels on CUDA.

`hf_tree_attn.prefix_attention` splits a two-level forest's tree mask into the prompt part and the completions'
own part, merged by their log-sum-exps, and runs three cuDNN calls per tree. cuDNN builds an execution graph on the
host for every new shape, so there the kernels wait for a forest whose shapes recur. A varlen kernel takes every
length at once: the same split is two calls for the whole forest, whatever its lengths, nothing gathered or padded.

In DFS order a two-level forest is, per tree, its prompt rows, then its completions one after another; padding rows
follow the forest's tokens. Each row's ancestor-or-self keys are the union of two disjoint sets:

    own      its segment's rows up to itself: every segment (a prompt, a completion, a padding row) is a sequence
             of the call, causal, its queries and keys the same rows (`cu_seqlens` = the segment bounds)
    shared   its tree's prompt, for a completion row only: one sequence per tree with completions, its queries the
             completion rows and its keys the prompt rows, no mask; both addressed in the forest's rows by offset
             (`cu_seqlens`) and length (`seqused`), as FlashAttention reads them

so the two calls read the q / k / v projections as they lie, `(S, heads, dim)`. A padding row is its own segment:
its output is its value, as the tree mask gives. Rows with no shared part (prompts, padding) get a log-sum-exp of
-inf there and keep their own part exactly; the merge is `prefix_attention`'s. Backward: each call's backward given
the merged output and log-sum-exp gives its keys' exact dK, dV and its share of dQ (`prefix_attention`'s module
docstring); the shares add, the prompt rows' dK, dV getting the shared call's too.

The kernels: FlashAttention-4 (the `flash-attn-4` package, `flash_attn.cute`, CuTe DSL; compute capability 9.x and
10.x; bf16 / fp16) through the entry points PyTorch's own FA4 registration calls (`_flash_attn_fwd`,
`_flash_attn_bwd`; read in flash-attn-4 4.0.0b40). `HF_TREE_ATTN_PREFIX_KERNEL=fa4` turns them on
(`prefix_attention.KERNEL`); `REFERENCE` is the same contract in plain PyTorch, one sequence at a time, for the tests
on CPU (rows no sequence covers are left NaN there, as the kernels leave them unwritten).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from .prefix_attention import _accumulate, _math_backward, _math_forward, _merge, decode_plan

__all__ = ["FA4", "REFERENCE", "VarlenCalls", "fa4_error", "varlen_backward", "varlen_calls", "varlen_forward"]


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
    cache = plan.__dict__.setdefault("_prefix_varlen", {})
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


class _Reference:
    """FlashAttention's varlen contract in plain PyTorch, one sequence at a time (the tests' CPU stand-in).

    Sequence `b` is query rows `[cu_q[b], cu_q[b] + n_q)` and key rows `[cu_k[b], cu_k[b] + n_k)` of `(T, heads,
    dim)` tensors, `n` from `used` where given, else `cu[b + 1] - cu[b]`. Causal only for `n_q == n_k` (top-left and
    bottom-right alike). `lse` `(heads, T_q)`. Rows no sequence covers stay NaN."""

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
            if causal and rows.stop - rows.start != keys.stop - keys.start:
                raise ValueError("the reference kernel's causal sequences have as many queries as keys")
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
