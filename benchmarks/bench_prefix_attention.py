"""Attention alone on a GRPO forest: the shared-prefix kernels (cuDNN) vs FlexAttention with the tree mask.

Both on the same bf16 q / k / v of one packed forest (`groups` prompts of `P` tokens, each with `G` completions of
`C` tokens, DFS layout), GQA heads as Qwen3's; forward alone and forward + backward, median of `--repeats` after a
warm-up. TFLOPS by the unmasked pairs (4 * pairs * heads * head_dim per forward, 2.5x that for the backward).

    python benchmarks/bench_prefix_attention.py --out benchmarks/results/prefix_attention_h200.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from harness import provenance

import hf_tree_attn
from hf_tree_attn.attention import _flex_attention
from hf_tree_attn.prefix_attention import prefix_attention

SHAPES = {  # name: (q heads, kv heads, head dim, groups, G, P, C)
    "qwen3-1.7b_G16_P4096_C512": (16, 8, 128, 2, 16, 4096, 512),
    "qwen3-8b_G16_P4096_C512": (32, 8, 128, 1, 16, 4096, 512),
    "qwen3-1.7b_G16_P1024_C1024": (16, 8, 128, 4, 16, 1024, 1024),
    "qwen3-1.7b_G8_P1024_C1024": (16, 8, 128, 8, 8, 1024, 1024),
    "qwen3-0.6b_G32_P1024_C128": (16, 8, 128, 8, 32, 1024, 128),
}


def attention_kernels(forest, q, k, v, scale: float, block_mask=None) -> dict:
    """`{"prefix": ..., "flex": ...}`: calls of the shared-prefix kernels and of FlexAttention with the forest's tree
    mask on `q` `(1, heads, S, dim)`, `k`, `v` `(1, kv_heads, S, dim)`, each returning `(1, heads, S, dim)`."""
    block_mask = forest.block_mask(q.device.type) if block_mask is None else block_mask
    return {
        "prefix": lambda: prefix_attention(q, k, v, forest.prefix_plan, scale),
        "flex": lambda: _flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)[0],
    }


def _time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(name: str, repeats: int) -> dict:
    heads, kv_heads, dim, groups, g, p, c = SHAPES[name]
    rng = random.Random(0)
    seqs = []
    for _ in range(groups):
        prompt = [rng.randrange(1, 1000) for _ in range(p)]
        firsts = rng.sample(range(1, 1000), g)  # completions share only their prompt: a two-level forest
        seqs += [prompt + [first] + [rng.randrange(1, 1000) for _ in range(c - 1)] for first in firsts]
    (forest,) = hf_tree_attn.pack_forest(seqs)
    forest = forest.to("cuda")
    assert forest.prefix_plan is not None
    block_mask, scale = forest.block_mask("cuda"), dim**-0.5
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, heads, forest.seq_len, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (
        torch.randn(1, kv_heads, forest.seq_len, dim, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in "kv"
    )
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    kernels = attention_kernels(forest, q, k, v, scale, block_mask)
    pairs = groups * (p * (p + 1) / 2 + g * (c * p + c * (c + 1) / 2))
    flops = 4 * pairs * heads * dim
    row = {"shape": dict(zip(("heads", "kv_heads", "head_dim", "groups", "G", "P", "C"), SHAPES[name])),
           "tree_tokens": forest.num_tree_tokens, "forward_tflop": flops / 1e12}  # fmt: skip
    for kernel, fn in kernels.items():

        def forward(fn=fn):
            with torch.no_grad():
                fn()

        def forward_backward(fn=fn):
            out = fn()
            out.backward(torch.ones_like(out))

        fwd, both = _time(forward, repeats), _time(forward_backward, repeats)
        row[kernel] = {"forward_ms": 1e3 * fwd, "forward_backward_ms": 1e3 * both,
                       "forward_tflops": flops / fwd / 1e12,
                       "forward_backward_tflops": 3.5 * flops / both / 1e12}  # fmt: skip
    # A training step runs the attention forward 2-3 times (old log-probs, policy, recompute) and its backward once.
    for kernel in kernels:
        r = row[kernel]
        r["step_ms"] = 2 * r["forward_ms"] + r["forward_backward_ms"]  # old log-probs + policy fwd/bwd + recompute
    row["speedup_forward"] = row["flex"]["forward_ms"] / row["prefix"]["forward_ms"]
    row["speedup_forward_backward"] = row["flex"]["forward_backward_ms"] / row["prefix"]["forward_backward_ms"]
    row["speedup_step"] = row["flex"]["step_ms"] / row["prefix"]["step_ms"]
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results/prefix_attention.json")
    args = parser.parse_args()
    results = {
        **provenance(cudnn=torch.backends.cudnn.version()),
        "rows": {},
    }
    print(f"{'shape':<28} {'flex fwd':>9} {'prefix fwd':>10} {'x':>5} {'flex f+b':>9} {'prefix f+b':>10} {'x':>5} "
          f"{'step x':>6}")  # fmt: skip
    for name in args.shapes:
        row = measure(name, args.repeats)
        results["rows"][name] = row
        f, p = row["flex"], row["prefix"]
        print(f"{name:<28} {f['forward_ms']:>7.2f}ms {p['forward_ms']:>8.2f}ms {row['speedup_forward']:>5.2f} "
              f"{f['forward_backward_ms']:>7.2f}ms {p['forward_backward_ms']:>8.2f}ms "
              f"{row['speedup_forward_backward']:>5.2f} {row['speedup_step']:>6.2f}"
              f"   TFLOPS fwd {f['forward_tflops']:.0f} -> {p['forward_tflops']:.0f}, "
              f"f+b {f['forward_backward_tflops']:.0f} -> {p['forward_backward_tflops']:.0f}", flush=True)  # fmt: skip
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
