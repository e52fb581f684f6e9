"""Kernels for TRL's own tree packing (`trl.experimental.async_grpo`, `attn_implementation="tree_fa3"`) off the Hub.

TRL's `packing.tree_attention` gathers each segment's root path and calls FlashAttention-3's varlen function, which
it downloads from the Hub (`kernels-community/flash-attn3`) on first use. Its semantics: query segment `i` is rows
`cu_seqlens_q[i]:cu_seqlens_q[i+1]` of `q` `(total_q, heads, head_dim)`, its keys and values rows
`cu_seqlens_k[i]:cu_seqlens_k[i+1]` of `k` / `v` `(total_k, kv_heads, head_dim)`; with `causal=True` the mask is
aligned bottom-right (the last query sees every key: query `a` of `L_q` sits at key position `L_k - L_q + a`),
`window_size=(left, right)` keeps keys at most `left` positions back, `softcap` squashes the scores with `tanh`.

- `varlen_attention`: those semantics in plain torch, one segment at a time (the tests' CPU stand-in);
- `flash_varlen_attention`: PyTorch's own FlashAttention-2 varlen op (`torch.ops.aten._flash_attention_forward`,
  differentiable, CUDA; no softcap) — the fastest varlen kernel the H200 image runs without a download;
- `use_kernel(fn)`: TRL's trainer module then calls `fn` instead of the Hub kernel (and reads no CUDA peak FLOPs on
  the CPU, where TRL's constructor would raise).
"""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import torch


def varlen_attention(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=True,
    window_size=(-1, -1), softcap=0.0,
):  # fmt: skip
    """FlashAttention's `flash_attn_varlen_func` in plain torch: `(total_q, heads, head_dim)` in `q`'s dtype.

    With its precision: inputs in bf16 (TRL casts them to the autocast dtype) are multiplied exactly and summed in
    float32, the scores and their softmax stay float32, the probabilities are rounded to the input dtype for the
    product with the values (as FlashAttention feeds them to its second matmul), which is summed in float32 and
    rounded once to the input dtype. Autocast is off inside: under it a CPU `einsum` would round the scores to bf16
    before the softmax, which no FlashAttention kernel does. Float32 / float64 inputs keep their dtype."""
    dtype = q.dtype
    groups = q.shape[1] // k.shape[1]
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    outputs = []
    with torch.autocast(q.device.type, enabled=False):
        acc = torch.promote_types(dtype, torch.float32)  # float64 inputs stay float64
        q, k, v = q.to(acc), k.to(acc), v.to(acc)
        for i in range(len(cu_seqlens_q) - 1):
            qi = q[cu_seqlens_q[i] : cu_seqlens_q[i + 1]]
            ki = k[cu_seqlens_k[i] : cu_seqlens_k[i + 1]].repeat_interleave(groups, dim=1)
            vi = v[cu_seqlens_k[i] : cu_seqlens_k[i + 1]].repeat_interleave(groups, dim=1)
            scores = torch.einsum("qhd,khd->hqk", qi, ki) * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            query_at = torch.arange(len(qi), device=q.device)[:, None] + (len(ki) - len(qi))
            key_at = torch.arange(len(ki), device=q.device)[None]
            allowed = key_at <= query_at if causal else torch.ones_like(key_at <= query_at)
            if window_size[0] >= 0:
                allowed &= key_at >= query_at - window_size[0]
            probs = scores.masked_fill(~allowed, -math.inf).softmax(-1).to(dtype).to(acc)
            outputs.append(torch.einsum("hqk,khd->qhd", probs, vi).to(dtype))
    return torch.cat(outputs)


def flash_varlen_attention(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=True,
    window_size=(-1, -1), softcap=0.0,
):  # fmt: skip
    """The same through PyTorch's FlashAttention-2 varlen op (CUDA, fp16 / bf16, bottom-right causal)."""
    if softcap:
        raise NotImplementedError("PyTorch's flash varlen op has no softcap; use varlen_attention.")
    left, right = window_size
    window = {} if left < 0 else {"window_size_left": int(left), "window_size_right": max(int(right), 0)}
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens_q.int(), cu_seqlens_k.int(), int(max_seqlen_q), int(max_seqlen_k), 0.0, causal, False,
        scale=softmax_scale, **window,
    )  # fmt: skip
    return out[0]


@contextlib.contextmanager
def use_kernel(fn):
    """Within the block, TRL's `tree_fa3` attention calls `fn`; TRL's peak-FLOPs lookup answers None off CUDA."""
    import trl.experimental.async_grpo.async_grpo_trainer as trl_async
    import trl.experimental.async_grpo.packing as packing

    saved = packing._flash_attn, trl_async.get_peak_flops_per_device
    lookup = saved[1]
    # One namespace, built here: TRL calls `_flash_attn()` inside every attention layer, and a `SimpleNamespace` built
    # in that call is a graph break for dynamo (accelerate's regional compile of TRL's layers would split each layer
    # at its attention); returning a prebuilt object traces.
    kernel = SimpleNamespace(flash_attn_varlen_func=fn)
    packing._flash_attn = lambda: kernel
    trl_async.get_peak_flops_per_device = lambda acc, dtype: lookup(acc, dtype) if acc.device.type == "cuda" else None
    try:
        yield
    finally:
        packing._flash_attn, trl_async.get_peak_flops_per_device = saved
