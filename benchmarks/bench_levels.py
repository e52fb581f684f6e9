"""The cost of running a recurrent layer level by level, kernel only, on CPU or CUDA.

A 20-turn agent tree (one branch point per turn, so ~21 levels) and a GRPO group (2 levels) go through one Gated
DeltaNet scan (`hf_tree_attn.recurrent.tree_delta_rule` with transformers' kernel — its torch reference, or
flash-linear-attention's varlen kernel on CUDA where installed), forward + backward, level by level (`by_level`),
against

  one_call   the same number of tokens as ONE sequence in one kernel call: the floor for these tokens;
  two_pass   the tree in two kernel calls whatever its depth (`recurrent._scan_two_pass`, which the tree takes from
             `recurrent.TWO_PASS_MIN_LEVELS` levels on), with its agreement to the level loop on the same inputs;
  one_level  (CUDA varlen only) the forest's segments all as roots in one varlen call: the same segments without
             the hand-down (wrong states, timing only).

`by_level / one_call - 1` is what going level by level costs on top of the unavoidable scan work (per-call launch,
gathers and scatters, and on the padded CPU path the padding of each level's batch to its longest segment). Where the
kernel takes the boundaries on the host too (fla 0.6's `cu_seqlens_cpu`, which the tree passes), the scan is also
timed with them withheld (the kernel reads them back from the device, one sync per call); and each run records when
the host returned, before waiting for the device (close to the total: kernel launches set the pace).
The log decay is float32, as Qwen3.5's layers compute it. On CUDA, `--gdn-route` picks the kernels
(`benchmarks/gdn_kernels.py`) and each run records the ones that really ran.

    python benchmarks/bench_levels.py --device cpu --out benchmarks/results/levels_cpu.json
    python benchmarks/bench_levels.py --device cuda --heads 16 --dim 128 --scale 1 --out ...levels_h200.json
    python benchmarks/bench_levels.py --device cuda --heads 16 --dim 128 --scale 1 --gdn-route flash_qla --out ...
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import time
from unittest import mock

import gdn_kernels
import torch
import transformers.models.qwen3_5.modeling_qwen3_5 as qwen3_5
from harness import provenance

import hf_tree_attn
from hf_tree_attn import recurrent


def agent_tree(rng: random.Random, scale: float, turns: int = 20) -> list[list[int]]:
    """As benchmarks/bench_tree_vs_flat.py's agent workload (lengths times `scale`): per turn a user message, two
    sampled responses (two samples), the conversation continuing from the first."""

    def tokens(lo, hi):
        return [
            rng.randrange(1, 1000) for _ in range(rng.randint(max(1, round(lo * scale)), max(1, round(hi * scale))))
        ]

    history, samples = tokens(4800, 4800), []
    for _ in range(turns):
        history += tokens(40, 200)
        responses = [tokens(80, 400) for _ in range(2)]
        samples += [history + r for r in responses]
        history += responses[0]
    return samples


def grpo_group(rng: random.Random, scale: float, g: int = 16) -> list[list[int]]:
    prompt = [rng.randrange(1, 1000) for _ in range(round(4096 * scale))]
    return [prompt + [rng.randrange(1, 1000) for _ in range(round(512 * scale))] for _ in range(g)]


def _time(fn, repeats: int, device, host: bool = False):
    """Seconds of the least disturbed of `repeats` runs (other jobs share the machine); with `host`, also the
    seconds until `fn` returned in that run, before waiting for the device (close to the total: the host's kernel
    launches set the pace)."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0, t1 - t0))
    total, returned = min(times)
    return (total, returned) if host else total


def agreement(by_level, two_pass, inputs, rows: int) -> dict:
    """The two paths on the same inputs: the largest output difference over the largest output, and the least
    cosine between their input gradients (q, k, v, decay, beta)."""
    results = []
    for fn in (by_level, two_pass):
        for t in inputs:
            t.grad = None
        out = fn(keep=True)[:, :rows].float()
        results.append((out, [t.grad.float().flatten() for t in inputs]))
    (a, grads_a), (b, grads_b) = results
    cosines = [
        torch.nn.functional.cosine_similarity(x.double(), y.double(), dim=0).item() for x, y in zip(grads_a, grads_b)
    ]
    return {"output_max_diff_rel": ((a - b).abs().max() / a.abs().max()).item(), "grad_cosine_min": min(cosines)}


def measure(sequences, heads: int, dim: int, device, dtype, repeats: int, route: str | None = None) -> dict:
    (forest,) = hf_tree_attn.pack_forest(sequences)
    forest = forest.to(device)
    kernel = qwen3_5.torch_chunk_gated_delta_rule.tree_original  # what the tree calls per level
    g = torch.Generator(device=device).manual_seed(0)
    size = forest.seq_len

    def inputs(length):
        q, k, v = (torch.randn(1, length, heads, dim, generator=g, device=device, dtype=dtype) for _ in range(3))
        decay = -torch.rand(1, length, heads, generator=g, device=device)
        beta = torch.rand(1, length, heads, generator=g, device=device, dtype=dtype)
        return [t.requires_grad_() for t in (q, k, v, decay, beta)]

    tree_inputs, flat_inputs = inputs(size), inputs(forest.num_tree_tokens)

    def by_level(f=forest, keep=False):
        q, k, v, decay, beta = tree_inputs
        out, _ = recurrent.tree_delta_rule(kernel, f, q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)
        out.float().sum().backward()
        return out.detach() if keep else None

    def one_call():
        q, k, v, decay, beta = flat_inputs
        out, _ = kernel(q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)
        out.float().sum().backward()

    def with_path(two_pass: bool, fn):
        """`fn` with the delta rule in two calls (`recurrent._scan_two_pass`) or level by level, whatever the depth."""
        return mock.patch.dict(
            recurrent.TWO_PASS_MIN_LEVELS, {"varlen": 1 if two_pass else None, "padded": 1 if two_pass else None}
        )(fn)

    by_level, two_pass = with_path(False, by_level), with_path(True, by_level)
    varlen = recurrent._use_varlen(kernel, device)
    with gdn_kernels.KernelProbe() as probe:
        by_level_s, by_level_host_s = _time(by_level, repeats, device, host=True)
    two_pass_s, two_pass_host_s = _time(two_pass, repeats, device, host=True)
    result = {
        "sequences": len(sequences),
        "total_tokens": sum(map(len, sequences)),
        "tree_tokens": forest.num_tree_tokens,
        "levels": forest.num_levels,
        "segments": forest.num_segments,
        "varlen": varlen,
        "host_bounds": varlen and "cu_seqlens_cpu" in recurrent._kernel_params(kernel),
        "by_level_s": by_level_s,
        "by_level_host_s": by_level_host_s,
        "one_call_s": _time(one_call, repeats, device),
        "kernels": gdn_kernels.describe(probe.calls),
    }
    if not any(probe.calls.values()):  # no route selected (a CPU run): the kernel this measures, uncounted
        result["kernels"] = f"uncounted kernel: {gdn_kernels.resolved_kernels()[qwen3_5.__name__]}"
    if route is not None and (problem := gdn_kernels.route_problem(route, probe.calls)) is not None:
        result["route_problem"] = problem
    result["two_pass_s"], result["two_pass_host_s"] = two_pass_s, two_pass_host_s
    result["two_pass_over_one_call"] = two_pass_s / result["one_call_s"] - 1
    result["two_pass_agreement"] = agreement(by_level, two_pass, tree_inputs, forest.num_tree_tokens)
    result["by_level_over_one_call"] = result["by_level_s"] / result["one_call_s"] - 1
    result["per_level_ms"] = 1e3 * (result["by_level_s"] - result["one_call_s"]) / forest.num_levels
    if result["host_bounds"]:  # the same scan with the kernel reading its boundaries back from the device per call
        with mock.patch.object(recurrent, "_kernel_params", lambda original: {"cu_seqlens"}):
            result["by_level_device_bounds_s"], result["by_level_device_bounds_host_s"] = _time(
                by_level, repeats, device, host=True
            )
        result["per_level_ms_device_bounds"] = (
            1e3 * (result["by_level_device_bounds_s"] - result["one_call_s"]) / forest.num_levels
        )
    if result["varlen"]:
        roots = torch.full_like(forest.segment_parent, -1)
        flat_forest = dataclasses.replace(
            forest, segment_parent=roots, segment_level=torch.zeros_like(roots), _scan_cache={}
        )
        result["one_level_s"] = _time(lambda: by_level(flat_forest), repeats, device)
        result["by_level_over_one_level"] = result["by_level_s"] / result["one_level_s"] - 1
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--scale", type=float, default=0.1, help="multiply every length of the workloads")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--gdn-route",
        choices=gdn_kernels.ROUTES,
        default=None,
        help="Gated DeltaNet kernels on CUDA (benchmarks/gdn_kernels.py; default: as resolved)",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    route = contextlib.nullcontext()
    if args.gdn_route is not None:
        if (reason := gdn_kernels.unavailable(args.gdn_route, args.dim, torch.bfloat16, lift_guard=True)) is not None:
            raise SystemExit(f"--gdn-route {args.gdn_route}: {reason}")
        route = gdn_kernels.select(args.gdn_route, lift_guard=True)
    gdn_kernels.install_probes()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rng = random.Random(0)
    cpu = f"cpu ({torch.get_num_threads()} threads)"
    workloads = {"agent_20_turns": agent_tree(rng, args.scale), "grpo_G16_P4096_C512": grpo_group(rng, args.scale)}
    with route:
        runs = {name: measure(seqs, args.heads, args.dim, device, dtype, args.repeats, args.gdn_route)
                for name, seqs in workloads.items()}  # fmt: skip
    results = {
        **provenance(**gdn_kernels.provenance_versions()),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else cpu,
        "gdn_route": args.gdn_route, "heads": args.heads, "dim": args.dim, "dtype": str(dtype), "scale": args.scale,
        "runs": runs,
    }  # fmt: skip
    for name, run in results["runs"].items():
        line = f"{name:<22} levels {run['levels']:>3}  tree tokens {run['tree_tokens']:>6}"
        line += f"  by level {run['by_level_s']:.4f}s  one call {run['one_call_s']:.4f}s"
        line += f"  (+{100 * run['by_level_over_one_call']:.1f}%, {run['per_level_ms']:.2f} ms/level)"
        if "by_level_device_bounds_s" in run:
            line += f"  (bounds read back per call: {run['by_level_device_bounds_s']:.4f}s,"
            line += f" {run['per_level_ms_device_bounds']:.2f} ms/level)"
        line += f"  host returned at {run['by_level_host_s']:.4f}s"
        line += f"  two calls {run['two_pass_s']:.4f}s (+{100 * run['two_pass_over_one_call']:.1f}%,"
        line += f" vs level by level: {run['two_pass_agreement']})"
        if "one_level_s" in run:
            line += f"  one level {run['one_level_s']:.4f}s (+{100 * run['by_level_over_one_level']:.1f}%)"
        print(line + f"  [{run['kernels']}]" + ("  KERNEL MISMATCH" if "route_problem" in run else ""), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
