"""Tree attention as one varlen flash call over gathered paths, against FlexAttention's tree mask, on new shapes.

FlexAttention computes a forest's ancestor-or-self attention from a block mask: 128-row blocks that straddle a
branch end are computed whole and masked. A varlen flash kernel needs no mask: cut the forest's rows into its
segments (maximal unbranched runs, DFS order), give each segment as keys its path (its ancestor segments' rows, root
first, then its own), and one call with causal attention aligned to the bottom right (FlashAttention's rule where a
sequence has fewer queries than keys) is exactly the tree mask. The queries and outputs stay in the forest's row
order (a segment's rows are contiguous); the keys and values are gathered, `(sum of path lengths, kv_heads, dim)`,
and their gradients scatter back through the gather. The price is the gathered copy (every segment re-reads its
ancestors), which deep trees of short segments make large.

For each of `--forests` forests of random shapes, new to every kernel (GRPO groups as `bench_async_grpo.py`'s
`grpo_mixed`: `--groups` prompts of U[1000, 6000] tokens with G=16 completions of U[64, 1024]; or its `tau2_like`
agent: a 4,800-token system prompt, U[10, 20] turns of a U[40, 200]-token message and 2 sampled U[80, 400]-token
responses, the first continuing the conversation), bf16, Qwen3-1.7B heads: one forward + backward through each
kernel (`first_ms`), the same again (`repeat_ms`), wall time with the GPU synchronized; each kernel's output and
its q / k / v gradients (for one random upstream gradient) against FlexAttention's, and the host time to build the
gather (`plan_ms`, once per forest, shared by every layer). TFLOP/s count each row's ancestor-or-self pairs
(4 * pairs * heads * dim per forward, 2.5x that for the backward).

`--kernels flex flex_flash`: FlexAttention on its FlashAttention-4 backend instead (`kernel_options={"BACKEND":
"FLASH"}`, the same block mask; needs `flash_attn.cute`, which benchmarks/fa4_wheels.sh packs for the H200).
`fa4_gathered`: the library's gathered paths on FlashAttention-4's varlen kernels
(`hf_tree_attn.varlen_attention.path_attention`, what `HF_TREE_ATTN_PREFIX_KERNEL=fa4` runs for forests that are not
two-level), its own plan and gather.
`prefix_fa4` / `prefix_cudnn`: the library's shared-prefix attention (`hf_tree_attn.prefix_attention`, GRPO forests
only: two-level) on FlashAttention-4's varlen kernels (two calls per forest, `hf_tree_attn.varlen_attention`) / on
cuDNN (three calls per tree; its first call on a new shape builds cuDNN's graph). q, k and v are laid out as a
model's projections lay them out, `(1, S, heads, dim)` seen as `(1, heads, S, dim)`.

    python benchmarks/attention_gathered_paths.py --workload tau2_like --out benchmarks/results/attention.json
    python benchmarks/attention_gathered_paths.py --device cpu --forests 2 --scale 0.05   # the gather checked on CPU

Every row also records how much of FlexAttention's work on the tree mask is wasted (`tiles`): the 128 x 128 blocks
it computes (`full` ones without a mask, `partial` ones masked inside) and the share of their pairs that are
ancestor-or-self pairs (`useful`), from the forest's DFS intervals. `--tiles` counts only that, on CPU, for the same
seeded forests of both workloads as the GPU runs (`--forests` of each after the two warm-up ones):

    python benchmarks/attention_gathered_paths.py --tiles --out benchmarks/results/attention_tiles_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import time

import numpy as np
import torch
from harness import provenance
from prefix_attention_new_shapes import timed

import hf_tree_attn
from hf_tree_attn import prefix_attention
from hf_tree_attn.attention import _flex_attention
from hf_tree_attn.varlen_attention import path_attention, path_calls

HEADS, KV_HEADS, DIM = 16, 8, 128  # Qwen3-1.7B
KERNELS = ("flex", "flash_gathered", "cudnn_gathered")
# FlexAttention on FlashAttention-4's CuTeDSL kernels (`kernel_options={"BACKEND": "FLASH"}`, the same block mask;
# needs the `flash_attn.cute` package: benchmarks/fa4_wheels.sh), only where `--kernels` names it.
OPTIONAL_KERNELS = ("flex_flash", "fa4_gathered", "prefix_fa4", "prefix_cudnn")


def grpo_forest(rng: random.Random, groups: int, scale: float) -> list[list[int]]:
    seqs = []
    for _ in range(groups):
        prompt = [rng.randrange(1, 1000) for _ in range(max(2, int(rng.randint(1000, 6000) * scale)))]
        firsts = rng.sample(range(1, 1000), 16)
        seqs += [
            prompt + [f] + [rng.randrange(1, 1000) for _ in range(max(1, int(rng.randint(64, 1024) * scale)) - 1)]
            for f in firsts
        ]
    return seqs


def agent_forest(rng: random.Random, scale: float, budget: int = 32768) -> list[list[int]]:
    """One τ²-like conversation: each sample is the history + one response; the first response continues it. Turns
    stop before the forest's unique tokens would pass `budget`."""

    def tokens(lo, hi):
        return [rng.randrange(1, 1000) for _ in range(max(1, int(rng.randint(lo, hi) * scale)))]

    history, seqs, side_branches = tokens(4800, 4800), [], 0
    for _ in range(rng.randint(10, 20)):
        message, responses = tokens(40, 200), [tokens(80, 400) for _ in range(2)]
        if len(history) + len(message) + side_branches + sum(map(len, responses)) > budget * max(scale, 1e-9):
            break
        history = history + message
        seqs += [history + r for r in responses]
        side_branches += len(responses[1])
        history = history + responses[0]
    return seqs


def tile_use(forest, block: int = 128) -> dict:
    """The blocks FlexAttention computes on `forest`'s tree mask: `full` (every pair attends), `partial` (some do),
    and `useful`, the share of their pairs that attend. Row `k` is an ancestor-or-self of row `q` iff `k <= q <
    subtree_end[k]` (DFS intervals), so a block's count is a sum over its keys."""
    rows = forest.num_tree_tokens
    end = forest.subtree_end.reshape(-1)[:rows].cpu().numpy()
    full = partial = useful = 0
    for q0 in range(0, rows, block):
        q1 = min(rows, q0 + block)
        for k0 in range(0, q1, block):
            k1 = min(rows, k0 + block)
            keys = np.arange(k0, k1)
            count = int(np.clip(np.minimum(end[k0:k1], q1) - np.maximum(keys, q0), 0, None).sum())
            if count:
                useful += count
                full += count == (q1 - q0) * (k1 - k0)
                partial += count < (q1 - q0) * (k1 - k0)
    return {"block": block, "full": full, "partial": partial, "useful": useful / ((full + partial) * block * block)}


def gather_plan(forest, device) -> dict:
    """The forest's rows as segments with their paths (`hf_tree_attn.varlen_attention.path_calls`, the padding rows
    one segment each, attending to themselves): `cu_q` `(N + 1,)` int32 (segment row offsets), `key_index` `(T_k,)`
    int64 (each segment's path rows, root first), `cu_k` `(N + 1,)` int32, `max_q`, `max_k`."""
    calls = path_calls(forest.path_plan, forest.seq_len, device)
    return {"cu_q": calls.cu_q, "cu_k": calls.cu_k, "key_index": calls.keys, "max_q": calls.longest_q,
            "max_k": calls.longest_k}  # fmt: skip


def flash_gathered(q, k, v, plan, scale):
    """`q` `(1, heads, S, dim)`, `k`, `v` `(1, kv_heads, S, dim)` -> `(1, heads, S, dim)` through PyTorch's
    FlashAttention-2 varlen op on the gathered paths."""
    qs = q[0].transpose(0, 1)  # (S, heads, dim)
    ks, vs = (x[0].transpose(0, 1).index_select(0, plan["key_index"]) for x in (k, v))
    out = torch.ops.aten._flash_attention_forward(
        qs, ks, vs, plan["cu_q"], plan["cu_k"], plan["max_q"], plan["max_k"], 0.0, True, False, scale=scale
    )[0]
    return out.transpose(0, 1).unsqueeze(0)


def cudnn_gathered(q, k, v, plan, scale):
    """The same through cuDNN's fused attention on ragged sequences (PyTorch's nested-tensor op), GQA heads
    repeated."""
    group = q.shape[1] // k.shape[1]
    qs = q[0].transpose(0, 1)
    ks, vs = (x[0].transpose(0, 1).index_select(0, plan["key_index"]).repeat_interleave(group, 1) for x in (k, v))
    out = torch.ops.aten._cudnn_attention_forward(
        qs, ks, vs, None, plan["cu_q"], plan["cu_k"], plan["max_q"], plan["max_k"], True, 0.0, True, False, scale=scale
    )[0]
    return out.transpose(0, 1).unsqueeze(0)


def reference_gathered(q, k, v, plan, scale):
    """The same gather through one masked softmax per segment (CPU check of the plan): bottom-right causal."""
    out = torch.empty_like(q)
    index, cu_q, cu_k = plan["key_index"], plan["cu_q"].tolist(), plan["cu_k"].tolist()
    group = q.shape[1] // k.shape[1]
    for s in range(len(cu_q) - 1):
        rows = torch.arange(cu_q[s], cu_q[s + 1])
        keys = index[cu_k[s] : cu_k[s + 1]]
        qq = q[0][:, rows]
        kk, vv = (x[0][:, keys].repeat_interleave(group, 0) for x in (k, v))
        lq, lk = len(rows), len(keys)
        allowed = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        out[0][:, rows] = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=allowed, scale=scale)
    return out


@contextlib.contextmanager
def kernel_setting(name: str):
    """`prefix_attention.KERNEL` for kernel `name` (`prefix_fa4`, `prefix_cudnn`) while its forward and backward run:
    the op reads it in both."""
    saved = prefix_attention.KERNEL
    prefix_attention.KERNEL = {"prefix_fa4": "fa4", "prefix_cudnn": "cudnn"}.get(name, saved)
    try:
        yield
    finally:
        prefix_attention.KERNEL = saved


def shared_prefix(q, k, v, forest, scale):
    """The library's shared-prefix attention op on a two-level forest (the kernel `kernel_setting` chose)."""
    if forest.prefix_plan is None:
        raise ValueError(f"a forest of {forest.num_levels} levels is not two-level: no shared-prefix kernels")
    return prefix_attention.prefix_attention(q, k, v, forest.prefix_plan, scale)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=["grpo_mixed", "tau2_like"], default="grpo_mixed")
    parser.add_argument("--forests", type=int, default=6)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--scale", type=float, default=1.0, help="scale every length (CPU checks)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiles", action="store_true", help="only FlexAttention's tile use, both workloads, on CPU")
    parser.add_argument("--out", default="benchmarks/results/attention_gathered_paths.json")
    parser.add_argument(
        "--kernels", nargs="+", default=list(KERNELS), choices=KERNELS + OPTIONAL_KERNELS,
        help="the kernels to run; FlexAttention's (flex) always runs, the others are checked against it",
    )  # fmt: skip
    args = parser.parse_args()
    if args.tiles:
        args.device = "cpu"
    chosen = ["flex", *(k for k in args.kernels if k != "flex")]
    device, rng = torch.device(args.device), random.Random(0)
    gen = torch.Generator(device=device).manual_seed(0)
    scale = DIM**-0.5
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def forest_of():
        seqs = (
            grpo_forest(rng, args.groups, args.scale)
            if args.workload == "grpo_mixed"
            else agent_forest(rng, args.scale)
        )
        (forest,) = hf_tree_attn.pack_forest(seqs)
        return forest.to(device)

    def tensors(forest):  # laid out as the projections: (1, S, heads, dim) seen as (1, heads, S, dim)
        q = torch.randn(1, forest.seq_len, HEADS, DIM, device=device, dtype=dtype, generator=gen)
        k, v = (torch.randn(1, forest.seq_len, KV_HEADS, DIM, device=device, dtype=dtype, generator=gen)
                for _ in "kv")  # fmt: skip
        return [x.transpose(1, 2).requires_grad_() for x in (q, k, v)]

    if args.tiles:
        runs = {}
        for workload in ("grpo_mixed", "tau2_like"):
            args.workload, rng = workload, random.Random(0)  # the GPU runs' forests: two warm-up ones, then the rest
            forests = [forest_of() for _ in range(2 + args.forests)][2:]
            runs[workload] = [{"tree_tokens": f.num_tree_tokens, "tiles": tile_use(f)} for f in forests]
            shares = [r["tiles"]["useful"] for r in runs[workload]]
            print(f"{workload}: useful share of FlexAttention's blocks {min(shares):.3f} to {max(shares):.3f}")
        with open(args.out, "w") as fh:
            json.dump({**provenance(), "groups_per_forest": args.groups, "workloads": runs}, fh, indent=1)
        return

    if device.type == "cpu":  # check the plan: gathered paths == the tree's dense mask
        for _ in range(args.forests):
            forest = forest_of()
            q, k, v = (x.detach().double() for x in tensors(forest))
            plan = gather_plan(forest, device)
            got = reference_gathered(q, k, v, plan, scale)
            mask = forest.dense_mask(device)
            want = torch.nn.functional.scaled_dot_product_attention(
                q, k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1),
                attn_mask=mask.reshape(1, 1, *mask.shape[-2:]), scale=scale,
            )  # fmt: skip
            err = (got - want)[..., : forest.num_tree_tokens, :].abs().max().item()
            print(f"{forest.num_tree_tokens} rows, {forest.num_segments} segments: max |gathered - dense| {err:.2e}")
            assert err < 1e-10, err
        return

    def kernels(forest, q, k, v, plan):
        block_mask = forest.block_mask(device)
        flex = dict(block_mask=block_mask, scale=scale, enable_gqa=True)
        every = {
            "flex": lambda: _flex_attention(q, k, v, **flex)[0],
            "flash_gathered": lambda: flash_gathered(q, k, v, plan, scale),
            "cudnn_gathered": lambda: cudnn_gathered(q, k, v, plan, scale),
            "flex_flash": lambda: _flex_attention(q, k, v, **flex, kernel_options={"BACKEND": "FLASH"})[0],
            "fa4_gathered": lambda: path_attention(q, k, v, forest.path_plan, scale),
            "prefix_fa4": lambda: shared_prefix(q, k, v, forest, scale),
            "prefix_cudnn": lambda: shared_prefix(q, k, v, forest, scale),
        }
        return {name: every[name] for name in chosen}

    for _ in range(2):  # FlexAttention compiles for the first length and again, length-generic, at the second
        forest = forest_of()
        q, k, v = tensors(forest)
        for name, fn in kernels(forest, q, k, v, gather_plan(forest, device)).items():
            if name.startswith(("flex", "fa4", "prefix_fa4")):  # FlashAttention-4 compiles its kernels at first
                try:
                    with kernel_setting(name):
                        timed(fn)
                except Exception as error:  # noqa: BLE001 - recorded per forest below
                    print(f"  {name} warm-up: {type(error).__name__}: {str(error)[:300]}", flush=True)
    rows = []
    for _ in range(args.forests):
        forest = forest_of()
        qkv = tensors(forest)
        start = time.perf_counter()
        plan = gather_plan(forest, device)
        plan_ms = 1e3 * (time.perf_counter() - start)
        real = forest.num_tree_tokens
        pairs = float((forest.position_ids[0, :real].double() + 1).sum())
        flops = 4 * pairs * HEADS * DIM
        row = {"tree_tokens": real, "seq_len": forest.seq_len, "segments": forest.num_segments,
               "levels": forest.num_levels, "gathered_keys": int(plan["key_index"].numel()), "plan_ms": plan_ms,
               "forward_tflop": flops / 1e12, "tiles": tile_use(forest)}  # fmt: skip
        outputs, grads = {}, {}
        upstream = torch.randn(1, HEADS, forest.seq_len, DIM, device=device, dtype=dtype, generator=gen)
        upstream[:, :, real:] = 0  # padding rows' outputs are not the tree's
        for name, fn in kernels(forest, *qkv, plan).items():
            try:
                with kernel_setting(name):
                    first, repeat = timed(fn), timed(fn)
                    grads[name] = torch.autograd.grad(out := fn(), qkv, upstream)
                outputs[name] = out.detach()[:, :, :real].float()
                grads[name] = [g[:, :, :real].float() for g in grads[name]]
            except Exception as error:  # noqa: BLE001 - a kernel that refuses these inputs is a result
                row[name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
                continue
            row[name] = {"first_ms": first, "repeat_ms": repeat, "tflops": 3.5 * flops / repeat / 1e9}
            if name != "flex":
                row[name]["max_abs_vs_flex"] = (outputs[name] - outputs["flex"]).abs().max().item()
                row[name]["max_grad_abs_vs_flex"] = max(
                    (a - b).abs().max().item() for a, b in zip(grads[name], grads["flex"])
                )
        print(f"{real:>6} rows {row['segments']:>3} segments, gathered keys {row['gathered_keys']:>7}, plan "
              f"{plan_ms:.1f} ms", flush=True)  # fmt: skip
        for name in chosen:
            r = row[name]
            print(f"  {name:<15} " + (r["error"] if "error" in r else
                  f"first {r['first_ms']:.1f} ms, repeat {r['repeat_ms']:.1f} ms ({r['tflops']:.0f} TFLOP/s), "
                  f"max |out - flex| {r.get('max_abs_vs_flex', 0):.3g}, "
                  f"max |grad - flex| {r.get('max_grad_abs_vs_flex', 0):.3g}"), flush=True)  # fmt: skip
        rows.append(row)
    ran = [n for n in chosen if all("error" not in r[n] for r in rows)]
    summary = {
        name: {when: statistics.median(r[name][when] for r in rows) for when in ("first_ms", "repeat_ms", "tflops")}
        for name in ran
    }
    for name in ran[1:]:  # FlexAttention's repeat time over the kernel's, per forest
        summary[f"repeat_ratio_flex_over_{name}"] = statistics.median(
            r["flex"]["repeat_ms"] / r[name]["repeat_ms"] for r in rows
        )
    print("median:", summary)
    results = {
        **provenance(),
        "heads": [HEADS, KV_HEADS, DIM],
        "workload": args.workload,
        "groups_per_forest": args.groups,
        "kernels": chosen,
        "rows": rows,
        "median": summary,
    }
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
