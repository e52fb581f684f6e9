"""What a forest of new shapes costs the shared-prefix kernels (cuDNN) and FlexAttention: first call vs repeat.

`bench_prefix_attention.py` times each kernel after a warm-up call on the same forest, as a fixed-shape workload
sees it. A training run whose lengths vary (sampled completions, mixed prompts, a token-budget planner's rows)
hands the kernels a forest of new shapes at every step. PyTorch's cuDNN attention builds and caches one execution
graph per call signature (batch, heads, lengths, strides: `aten/src/ATen/native/cudnn/MHA.cpp`), and a tree's
prompt and completion rows are slices of the forest's `(1, S, heads, dim)` projections, so a new tree shape or a new
row length `S` is a new graph, built on the host before the kernel runs. FlexAttention, once compiled with dynamic
shapes, takes any length.

For each of `--forests` GRPO-shaped forests of random shapes (as `bench_async_grpo.py`'s `grpo_mixed` rows:
`--groups` prompts of U[1000, 6000] tokens, each with G=16 completions of U[64, 1024]), Qwen3-1.7B attention heads,
bf16: one forward + backward through each kernel on the new forest (`first_ms`), then the same again (`repeat_ms`),
wall time with the GPU synchronized. FlexAttention is compiled on two other forests first.

    python benchmarks/prefix_attention_new_shapes.py --out benchmarks/results/prefix_attention_new_shapes_h200.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from bench_prefix_attention import attention_kernels
from harness import provenance

import hf_tree_attn

HEADS, KV_HEADS, DIM = 16, 8, 128  # Qwen3-1.7B


def grpo_forest(rng: random.Random, groups: int):
    seqs = []
    for _ in range(groups):
        prompt = [rng.randrange(1, 1000) for _ in range(rng.randint(1000, 6000))]
        firsts = rng.sample(range(1, 1000), 16)  # completions share only their prompt: a two-level forest
        seqs += [prompt + [f] + [rng.randrange(1, 1000) for _ in range(rng.randint(64, 1024) - 1)] for f in firsts]
    (forest,) = hf_tree_attn.pack_forest(seqs)
    assert forest.prefix_plan is not None
    return forest.to("cuda")


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forests", type=int, default=6)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/prefix_attention_new_shapes.json")
    args = parser.parse_args()
    rng = random.Random(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = DIM**-0.5

    def tensors(forest):
        q = torch.randn(1, HEADS, forest.seq_len, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(1, KV_HEADS, forest.seq_len, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
                for _ in "kv")  # fmt: skip
        return [x.requires_grad_() for x in (q, k, v)]

    def kernels(forest, q, k, v):
        named = attention_kernels(forest, q, k, v, scale)
        return {"prefix_cudnn": named["prefix"], "flex": named["flex"]}

    for _ in range(2):  # FlexAttention compiles for the first length and again, length-generic, at the second
        forest = grpo_forest(rng, args.groups)
        timed(kernels(forest, *tensors(forest))["flex"])
    rows = []
    for _ in range(args.forests):
        forest = grpo_forest(rng, args.groups)
        qkv = tensors(forest)
        row = {"tree_tokens": forest.num_tree_tokens, "seq_len": forest.seq_len}
        for name, fn in kernels(forest, *qkv).items():
            row[name] = {"first_ms": timed(fn), "repeat_ms": timed(fn)}
        rows.append(row)
        print(f"{row['tree_tokens']:>6} tokens: " + "  ".join(
            f"{n} first {row[n]['first_ms']:.1f} ms, repeat {row[n]['repeat_ms']:.1f} ms"
            for n in ("prefix_cudnn", "flex")), flush=True)  # fmt: skip
    summary = {
        name: {when: statistics.median(r[name][when] for r in rows) for when in ("first_ms", "repeat_ms")}
        for name in ("prefix_cudnn", "flex")
    }
    print("median:", summary)
    results = {
        **provenance(cudnn=torch.backends.cudnn.version()),
        "heads": [HEADS, KV_HEADS, DIM],
        "groups_per_forest": args.groups,
        "rows": rows,
        "median": summary,
    }
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
