"""Where the shared-prefix kernels' time goes on CUDA: each dense call of one tree, the merge, and the cost per tree.

One GRPO tree (a prompt of P tokens, G completions of C tokens; bf16, Qwen3 heads, q / k / v laid out as a model's
projections lay them out):
- the three cuDNN calls of `hf_tree_attn.prefix_attention` alone, forward and backward, with their TFLOPS;
- the log-sum-exp merge of the completions' two calls: the fused Triton kernel against the same formula in PyTorch
  ops (what the op ran before it was fused);
- the whole op over 1, 2, 4 and 8 equal trees, forward: GPU time (CUDA events) and the host's time to issue it
  (no synchronisation), to split the per-tree cost between the device and the launches.

    python benchmarks/prefix_attention_parts.py --out benchmarks/results/prefix_attention_parts_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from harness import provenance

import hf_tree_attn
from hf_tree_attn.prefix_attention import _backward, _forward, _merge, _merge_with_torch, prefix_attention


def _gpu_ms(fn, repeats: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _host_ms(fn, repeats: int = 20) -> float:
    """Time to issue `fn`'s work, the GPU idle before it (so the queue is not full)."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    torch.cuda.synchronize()
    return statistics.median(times)


def _heads(batch: int, heads: int, rows: int, dim: int) -> torch.Tensor:
    return torch.randn(batch, rows, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)


def parts(heads: int, kv_heads: int, dim: int, g: int, p: int, c: int) -> dict:
    scale, result = dim**-0.5, {}
    calls = {"prompt_causal": (1, p, p, True), "completions_over_prompt": (1, g * c, p, False), "own": (g, c, c, True)}
    for name, (batch, rows, keys, causal) in calls.items():
        q = _heads(batch, heads, rows, dim)
        k, v = _heads(batch, kv_heads, keys, dim), _heads(batch, kv_heads, keys, dim)
        out, lse = _forward(q, k, v, causal, scale)
        dout = torch.randn_like(out)
        pairs = batch * (rows * (rows + 1) / 2 if causal else rows * keys)
        flops = 4 * pairs * heads * dim
        fwd = _gpu_ms(lambda q=q, k=k, v=v, causal=causal: _forward(q, k, v, causal, scale))
        bwd = _gpu_ms(lambda q=q, k=k, v=v, o=out, lse=lse, do=dout, causal=causal: _backward(
            do, q, k, v, o, lse, causal, scale))  # fmt: skip
        result[name] = {"forward_ms": fwd, "backward_ms": bwd, "forward_tflops": flops / fwd / 1e9,
                        "backward_tflops": 2.5 * flops / bwd / 1e9}  # fmt: skip
    rows = g * c
    shared, own, out = (_heads(1, heads, rows, dim)[0] for _ in range(3))
    lse_shared, lse_own, lse = (torch.randn(heads, rows, device="cuda") for _ in range(3))
    args = (out, lse, shared, lse_shared, own, lse_own)
    result["merge"] = {"fused_ms": _gpu_ms(lambda: _merge(*args)),
                       "pytorch_ops_ms": _gpu_ms(lambda: _merge_with_torch(*args))}  # fmt: skip
    return result


def per_tree(heads: int, kv_heads: int, dim: int, g: int, p: int, c: int) -> dict:
    result = {}
    for trees in (1, 2, 4, 8):
        seqs = []
        for t in range(trees):
            prompt = [1 + (t * 7 + i) % 1000 for i in range(p)]
            seqs += [prompt + [1001 + j] + [2 + (i * j) % 999 for i in range(c - 1)] for j in range(g)]
        (forest,) = hf_tree_attn.pack_forest(seqs)
        forest = forest.to("cuda")
        assert forest.prefix_plan is not None
        q, k, v = (_heads(1, h, forest.seq_len, dim) for h in (heads, kv_heads, kv_heads))

        def forward(q=q, k=k, v=v, plan=forest.prefix_plan):
            with torch.no_grad():
                prefix_attention(q, k, v, plan, dim**-0.5)

        result[trees] = {"gpu_ms": _gpu_ms(forward), "host_ms": _host_ms(forward)}
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/prefix_attention_parts.json")
    args = parser.parse_args()
    shapes = {  # name: (q heads, kv heads, head dim, G, P, C)
        "qwen3-1.7b_G16_P4096_C512": (16, 8, 128, 16, 4096, 512),
        "qwen3-1.7b_G8_P1024_C1024": (16, 8, 128, 8, 1024, 1024),
    }
    results = {
        **provenance(cudnn=torch.backends.cudnn.version()),
        "parts": {name: parts(*shape) for name, shape in shapes.items()},
        "per_tree": {name: per_tree(*shape) for name, shape in shapes.items()},
    }
    print(json.dumps(results, indent=1))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
