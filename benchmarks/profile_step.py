"""Where a trainer phase's GPU time goes: one `bench_tree_vs_flat.py` step under the torch profiler, by kernel kind.

Runs one method (tree, flat_padded or flat_packed) of one workload on one model shape, warm, then profiles one more
step and groups its CUDA kernels: matmuls, attention forward / backward, the LM head's log-softmax, Liger and other
Triton kernels, elementwise and reductions, copies. `busy` = the share of the step's wall time with a kernel running
(the rest is the host launching, synchronising or packing). `mfu` is the benchmark's definition (model FLOPs, no
recompute).

    python benchmarks/profile_step.py --model qwen3-1.7b --method tree --checkpointing auto \\
        --out benchmarks/results/profile_qwen3-1.7b_tree.json
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import time

import torch
from bench_tree_vs_flat import (
    METHODS,
    MODELS,
    PEAK_FLOPS,
    build_model,
    build_workloads,
    model_flops,
    set_flex_kernel_options,
    tree_step,
)
from harness import provenance
from torch.profiler import ProfilerActivity, profile

import hf_tree_attn

# First match wins; names as CUDA / Triton / inductor print them.
KINDS = [
    ("attention_backward", r"flex_attention_backward|flash_bwd|bprop|fmha.*bwd|attention_backward|_bwd_kernel"),
    ("attention_forward", r"flex_attention|flash_fwd|fprop|sdpa|fmha|efficient_attention|_fwd_kernel|attention"),
    ("matmul", r"gemm|cutlass|nvjet|xmma|cublas|splitk|sm90_|sm80_"),
    ("lm_head_softmax", r"softmax|logsumexp|cross_entropy|entropy|chunk"),
    ("liger", r"liger|_rms_norm|_swiglu|_rope|_geglu"),
    ("triton_other", r"^triton_|_kernel$"),
    ("copy_fill", r"copy|memcpy|memset|fill|cat|index|gather|scatter"),
    ("elementwise_reduce", r"elementwise|vectorized|reduce|unrolled|where|mul|add"),
]


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, pattern in KINDS if re.search(pattern, low)), "other")


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of `(start, end)` intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def summarize(prof, wall: float, top: int = 20) -> dict:
    """A profiled step's CUDA kernels: `busy` (share of `wall` with a kernel running), `kernel_s`, time `by_kind`
    (`KINDS`), the `top_kernels` by time and the `top_host_ops` by self CPU time (the host's share of the step)."""
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us() / 1e6)
    by_kind: dict[str, float] = {}
    for name, times in by_name.items():
        by_kind[kind_of(name)] = by_kind.get(kind_of(name), 0.0) + sum(times)
    kernel_s = sum(by_kind.values()) or math.nan
    busy = busy_time([(e.time_range.start / 1e6, e.time_range.end / 1e6) for e in kernels])
    host = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:top]
    return {
        "wall_profiled_s": wall,
        "busy": busy / wall,
        "kernel_s": kernel_s,
        "by_kind": {k: {"s": v, "share": v / kernel_s} for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top_kernels": [
            {"name": n[:160], "kind": kind_of(n), "calls": len(t), "s": sum(t), "share": sum(t) / kernel_s}
            for n, t in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
        ],
        "top_host_ops": [
            {"name": a.key[:120], "calls": a.count, "self_cpu_s": a.self_cpu_time_total / 1e6} for a in host
        ],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-1.7b")
    parser.add_argument("--workload", default="grpo_G16_P4096_C512")
    parser.add_argument("--scale", type=float, default=0.5)
    parser.add_argument("--method", choices=list(METHODS), default="tree")
    parser.add_argument("--max-tokens-per-mb", type=int, default=65536)
    parser.add_argument("--liger", action="store_true")
    parser.add_argument("--compile-layers", action="store_true")
    parser.add_argument("--checkpointing", choices=["all", "none", "auto"], default="auto")
    parser.add_argument("--flex-kernel-options", type=json.loads, default=None, help="as bench_tree_vs_flat.py's")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    device = torch.device("cuda")
    set_flex_kernel_options(args.flex_kernel_options)
    model = build_model(args.model, device, args.liger, args.compile_layers, args.checkpointing)
    wl = next(w for w in build_workloads(args.scale, MODELS["qwen3-0.6b"]["vocab_size"]) if w.name == args.workload)
    fn = METHODS[args.method]
    if args.method == "tree":
        fn = functools.partial(tree_step, recompute=args.checkpointing)
    step = functools.partial(fn, model, wl, args.max_tokens_per_mb, device)
    for _ in range(2):  # compile, autotune, allocator
        step()
        model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    wall_unprofiled = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernel_summary = summarize(prof, wall, args.top)
    flops = hf_tree_attn.estimate_flops(model.config, wl.sequences, prompt_lengths=wl.prompt_lengths)
    timing = {"micro_batches": 1}
    result = {
        **provenance(),
        "model": args.model,
        "workload": wl.name,
        "spec": wl.spec,
        "method": args.method,
        "kernels": {
            "liger": args.liger,
            "compile_layers": args.compile_layers,
            "checkpointing": args.checkpointing,
            "flex_kernel_options": args.flex_kernel_options,
        },
        "compiled_graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
        "wall_s": wall_unprofiled,
        "mfu": model_flops(args.method, timing, flops) / wall_unprofiled / PEAK_FLOPS,
        **kernel_summary,
    }
    print(f"{args.model} {wl.name} {args.method} liger={args.liger} compile={args.compile_layers} "
          f"ckpt={args.checkpointing}: wall {wall_unprofiled:.3f} s, mfu {100 * result['mfu']:.1f}%, "
          f"GPU busy {100 * result['busy']:.0f}%, {result['compiled_graphs']} compiled graphs")  # fmt: skip
    for k, v in result["by_kind"].items():
        print(f"  {k:<20} {v['s']:8.3f} s  {100 * v['share']:5.1f}%")
    for k in result["top_kernels"]:
        print(f"  {100 * k['share']:5.1f}% {k['calls']:>5}x {k['kind']:<18} {k['name'][:90]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
