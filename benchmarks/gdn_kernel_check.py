"""One Gated DeltaNet call per case on a kernel route, forward and backward, against transformers' torch reference.

The checked call is the one the tree makes per level (`hf_tree_attn.recurrent.tree_delta_rule`): the function
transformers resolved for Qwen3.5's layers, varlen (`cu_seqlens`, segments of 4096, 257, 1, 64 and 700 tokens),
per-segment initial states in, final states out, q / k L2-normalised in the kernel, q / k / v / beta in the case's
dtype and the log decay g in float32 (as Qwen3.5's layer computes it). The reference runs each segment alone through
transformers' torch reference in float32 on float32 copies of the same inputs. Reported for the output, the final
states and every gradient (q, k, v, g, beta, initial state): rms(diff) / rms(reference), max|diff| / max|reference|
and NaNs; the kernels that ran (`gdn_kernels.KernelProbe`); the first call's time (compilation, autotuning) and the
second's. The first case is the gate (K = V = 128 in bf16: Qwen3.5's heads, the benchmark's dtype): the exit status
is 0 when it passes, 1 when it fails, 2 when the route is unavailable. The other cases show what the route does
elsewhere (fp32, K = 64: the tile fla#640 found miscompiled on Hopper with 3.4 <= Triton < 3.7.1).

    python benchmarks/gdn_kernel_check.py --route fla_tilelang --out /tmp/check_fla_tilelang.json
    python benchmarks/gdn_kernel_check.py --route fla_triton --head-dims 64 --out /tmp/check_fla_triton_k64.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
import traceback

import gdn_kernels
import torch
import torch.nn.functional as F
import transformers.models.qwen3_5.modeling_qwen3_5 as qwen3_5
from harness import provenance

from hf_tree_attn import transformers_compat

transformers_compat.install()  # the tree's dispatchers in the modeling module: each keeps the kernel it calls

SEGMENTS = (4096, 257, 1, 64, 700)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# (K = V, heads, dtype, lift fla's Hopper guard): heads as Qwen3.5-0.8B's linear layers (16 of 128) and the K = 64
# test model's (4 of 64).
CASES = {
    "flash_qla": [(128, 16, "bf16", False)],
    "fla_tilelang": [(128, 16, "bf16", False), (128, 16, "fp32", False), (64, 4, "bf16", False),
                     (64, 4, "fp32", False)],
    "fla_triton": [(128, 16, "bf16", True), (128, 16, "fp32", True), (64, 4, "bf16", False), (64, 4, "bf16", True),
                   (64, 4, "fp32", True)],
}  # fmt: skip
# rms(diff) / rms(reference) each output and gradient may reach: bf16 inputs (8-bit mantissa); fp32 inputs run the
# Triton / TileLang dots in TF32 (11-bit). A miscompiled tile is off by O(1).
TOLERANCE = {"bf16": 2e-2, "fp32": 5e-3}


def _inputs(heads: int, dim: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    total, n = sum(SEGMENTS), len(SEGMENTS)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(dt)

    q, k, v = randn(1, total, heads, dim), randn(1, total, heads, dim), randn(1, total, heads, dim)
    decay = F.logsigmoid(randn(1, total, heads, dt=torch.float32))
    beta = randn(1, total, heads).float().sigmoid().to(dtype)
    h0 = randn(n, heads, dim, dim, dt=torch.float32)
    w_out, w_state = randn(1, total, heads, dim, dt=torch.float32), randn(n, heads, dim, dim, dt=torch.float32)
    return [q, k, v, decay, beta, h0], (w_out, w_state)


def _leaves(tensors, dtype=None):
    return [t.detach().to(dtype or t.dtype).clone().requires_grad_() for t in tensors]


def _loss(out, state, weights):
    return (out.float() * weights[0]).sum() + (state.float() * weights[1]).sum()


def _route_call(fn, leaves, weights):
    q, k, v, decay, beta, h0 = leaves
    cu = torch.tensor([0, *torch.tensor(SEGMENTS).cumsum(0).tolist()], device="cuda")
    out, state = fn(q, k, v, g=decay, beta=beta, initial_state=h0, output_final_state=True,
                    use_qk_l2norm_in_kernel=True, cu_seqlens=cu)  # fmt: skip
    _loss(out, state, weights).backward()
    return out.detach().float(), state.detach().float()


def _reference(leaves, weights):
    reference = inspect.unwrap(qwen3_5.torch_chunk_gated_delta_rule)  # transformers' torch function
    q, k, v, decay, beta, h0 = leaves
    outs, states, start = [], [], 0
    for i, n in enumerate(SEGMENTS):
        part = [t[:, start : start + n] for t in (q, k, v, decay, beta)]
        out, state = reference(*part[:3], g=part[3], beta=part[4], initial_state=h0[i : i + 1],
                               output_final_state=True, use_qk_l2norm_in_kernel=True)  # fmt: skip
        outs.append(out)
        states.append(state)
        start += n
    out, state = torch.cat(outs, 1), torch.cat(states)
    _loss(out, state, weights).backward()
    return out.detach().float(), state.detach().float()


def _compare(got: torch.Tensor, want: torch.Tensor) -> dict:
    got, want = got.double(), want.double()
    diff = got - want
    rms = want.pow(2).mean().sqrt().item()
    return {
        "rms_ratio": diff.pow(2).mean().sqrt().item() / max(rms, 1e-30),
        "max_ratio": diff.abs().max().item() / max(want.abs().max().item(), 1e-30),
        "nan": bool(torch.isnan(got).any()),
    }


def run_case(route: str, dim: int, heads: int, dtype_name: str, lift: bool) -> dict:
    dtype = DTYPES[dtype_name]
    case = {"K": dim, "heads": heads, "dtype": dtype_name, "guard_lifted": lift}
    reason = gdn_kernels.unavailable(route, dim, dtype, lift_guard="always" if lift else False)
    if reason is not None:
        return {**case, "status": "unavailable", "reason": reason}
    tensors, weights = _inputs(heads, dim, dtype)
    ref_leaves = _leaves(tensors, torch.float32)
    ref_out, ref_state = _reference(ref_leaves, weights)
    try:
        with gdn_kernels.select(route, lift_guard=lift):
            fn = qwen3_5.torch_chunk_gated_delta_rule.tree_original  # what the tree calls per level
            leaves = _leaves(tensors)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with gdn_kernels.KernelProbe() as probe:
                out, state = _route_call(fn, leaves, weights)
            case["first_call_s"] = time.perf_counter() - t0
            again = _leaves(tensors)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            _route_call(fn, again, weights)
            torch.cuda.synchronize()
            case["second_call_s"] = time.perf_counter() - t0
    except Exception as err:
        return {**case, "status": "error", "error": f"{type(err).__name__}: {err}",
                "traceback": traceback.format_exc()[-3000:]}  # fmt: skip
    case["kernels"] = gdn_kernels.describe(probe.calls)
    case["calls"] = dict(probe.calls)
    names = ["q", "k", "v", "g", "beta", "initial_state"]
    errors = {"out": _compare(out, ref_out), "final_state": _compare(state, ref_state)}
    errors |= {f"d{n}": _compare(a.grad, b.grad) for n, a, b in zip(names, leaves, ref_leaves)}
    case["errors"] = errors
    worst = max(e["rms_ratio"] for e in errors.values())
    nan = any(e["nan"] for e in errors.values())
    problem = gdn_kernels.route_problem(route, probe.calls)
    case["worst_rms_ratio"] = worst
    case["tolerance"] = TOLERANCE[dtype_name]
    case["status"] = "pass" if (problem is None and not nan and worst <= TOLERANCE[dtype_name]) else "fail"
    if problem is not None:
        case["route_problem"] = problem
    return case


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--route", required=True, choices=list(CASES))
    parser.add_argument("--label", default=None, help="name of this run in the JSON (default: the route)")
    parser.add_argument(
        "--head-dims",
        type=int,
        nargs="+",
        default=None,
        help="run only the route's cases of these K = V (default: all; the first run is the gate)",
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    gdn_kernels.install_probes()
    result = {
        **provenance(**gdn_kernels.provenance_versions()),
        "label": args.label or args.route,
        "route": args.route,
        "resolved": gdn_kernels.resolved_kernels(),
        "segments": SEGMENTS,
        "cases": [],
    }
    guard, seen = gdn_kernels._fla_guard(), set()
    for dim, heads, dtype_name, lift in CASES[args.route]:
        if args.head_dims is not None and dim not in args.head_dims:
            continue
        lift = lift and guard  # no refusal to lift (fla 0.4, or not Hopper): the plain case
        if (dim, dtype_name, lift) in seen:
            continue
        seen.add((dim, dtype_name, lift))
        t0 = time.perf_counter()
        case = run_case(args.route, dim, heads, dtype_name, lift)
        case["wall_s"] = time.perf_counter() - t0
        result["cases"].append(case)
        result["fla_log"] = gdn_kernels.fla_log()
        result["probe_errors"] = gdn_kernels.PROBE_ERRORS
        print(json.dumps({k: v for k, v in case.items() if k not in ("errors", "traceback")}), flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    gate = result["cases"][0]
    sys.exit({"pass": 0, "unavailable": 2}.get(gate["status"], 1))


if __name__ == "__main__":
    main()
