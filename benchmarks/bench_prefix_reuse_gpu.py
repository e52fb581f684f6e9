"""Prefix reuse on a GPU: one optimizer step's log-prob forward and backward, split into micro-batches vs as one
forest in chunks (`tree_prefix_reuse`), step time, peak memory and agreement, on the workloads of
`bench_prefix_reuse_plan.py` (which counts their forwarded tokens without a model).

Methods, on the same sequences every step (weights fixed, so every step repeats one step's work: no optimizer step,
or with `--optimizer` an AdamW step at learning rate 0, which holds and updates its states as training does):

- `split`: what the trainers do without prefix reuse — `pack_forest(sequences, max_tokens_per_mb=budget)`, then per
  micro-batch `forest_logprobs` and its backward, each micro-batch repeating the prefix its sequences need; a
  sequence longer than the budget is refused (recorded as such);
- `reuse`: `sequence_logprobs(..., prefix_reuse=True)` and one backward: the step as one forest in chunks of `budget`
  rows, every row forwarded once (`hf_tree_attn.prefix_reuse`; on CUDA its FlexAttention path unless
  `HF_TREE_ATTN_PREFIX_REUSE_CUDA=dense`).
- `reuse_kept` (only where asked for): the same with every chunk's forward graph kept for the backward
  (`keep_graphs`), no chunk recomputed there; paired with `split` (`paired_kept`, `agreement_kept`) and with
  `reuse` (`paired_reuse_vs_kept`: reuse's seconds over reuse_kept's per step; `agreement_reuse_vs_kept`).
- `reuse_eager` (only where asked for, with `--compile`): `reuse` with its chunks on the eager decoder layers
  (`prefix_reuse.LAYERS = "eager"`, the trainers' default before these paired steps) while the split and `reuse` run
  the compiled ones; paired with `split` (`paired_eager`, `agreement_eager`) and with `reuse` (`paired_layers`:
  reuse_eager's seconds over reuse's per step, what compiled chunks gain; `agreement_layers`).
- `--profile`: one more step per method under the torch profiler, not timed (`profile`: kernel time by kind, the top
  kernels and host ops, as `profile_step.py` sorts them).
- `reference` (only where asked for; not timed): the first step's log-probabilities in float32, the model's weights
  upcast (the same values the timed methods use), the step's sequences as unsplit forests without gradients
  (`sequence_logprobs`, exact in float32 against per-sequence forwards in the GPU tests). With it every agreement
  check is the GPU tests' rule (`harness.agreement`): the candidate's largest and mean error to float32 within twice
  the baseline's plus one bf16 rounding, which holds at any model shape; without it, the two methods' log-probs
  directly within `harness.LOGPROB_BOUND`, a bound from small models that bf16 rounding alone can pass on larger ones.

The loss is the same for both: a fixed random weight per scored token times its log-probability, summed, over the
step's scored tokens. Random-weight bf16 models of the named shapes (no download), every decoder layer checkpointed
(non-reentrant), as the planner's estimates assume (`--checkpointing none`: no layer, so that prefix reuse recomputes
each chunk once and not each layer again, at the memory of every chunk's activations); eager decoder layers, or with
`--compile` both methods' compiled in place (inductor, dynamic shapes: the trainers' CUDA default; prefix reuse's
chunks run them as the split's forests do, `prefix_reuse.LAYERS = "compiled"`, which the trainers leave eager). Both
methods run in one process, one after the other, or each in its own (`--methods split`, then `--methods reuse
--resume`, both with `--first-dir`: the second run keeps the first's steps and reads its first step back for the
agreement check; where that first step is missing, it runs one unmeasured step of the first's method for it,
`agreement_steps_rerun`), each with `--warmup` unmeasured and `--steps` measured steps (CUDA-synchronized);
`paired["split vs reuse"]` is the split's seconds over reuse's per measured step (`harness.paired`: min / median /
max); peak memory after the warm-up. Agreement, on the first step: the per-token log-probabilities of the two methods
(against the `reference` where it ran, above), and the cosine of their parameter gradients (each tensor's, the least
reported; at least `GRAD_COSINE`); a row that fails is marked `failed`. MFU: 3x the forward FLOPs of the step's
sequences as one prefix forest (`estimate_flops`' `tree_flops`; recompute not counted) per step second over 989
TFLOP/s.

    python benchmarks/bench_prefix_reuse_gpu.py --models qwen3-1.7b --workloads agent_2x20x4 \\
        --out benchmarks/results/prefix_reuse_gpu_h200_qwen3-1.7b.json
    python benchmarks/bench_prefix_reuse_gpu.py --models qwen3-8b --workloads trajectory_96k --methods reuse \\
        --budget 2176 --optimizer --steps 2 \\
        --out benchmarks/results/prefix_reuse_gpu_h200_qwen3-8b_trajectory.json              # fits one H200?
    python benchmarks/bench_prefix_reuse_gpu.py --models tiny --workloads smoke --device cpu --dtype float32 \\
        --warmup 1 --steps 8                                                                 # CPU smoke run
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import random
import statistics
import sys
import time
from pathlib import Path

import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
from bench_prefix_reuse_plan import WORKLOADS as PLAN_WORKLOADS  # noqa: E402
from bench_tree_vs_flat import MODELS, PEAK_FLOPS, _sync, build_model  # noqa: E402
from harness import LOGPROB_BOUND, agreement, earlier_runs, paired, provenance  # noqa: E402

import hf_tree_attn.attention  # noqa: E402
from hf_tree_attn import forest_logprobs, gather_sequences, pack_forest, prefix_reuse, sequence_logprobs  # noqa: E402
from hf_tree_attn.chunked import plan_chunks  # noqa: E402
from hf_tree_attn.compile import compile_decoder_layers, eager_layers  # noqa: E402
from hf_tree_attn.metrics import estimate_flops  # noqa: E402
from hf_tree_attn.support import rope_split_lengths  # noqa: E402

GRAD_COSINE = 0.99
GIB = 2**30


def smoke() -> list[list[int]]:
    """Two small agent conversations (a CPU run): samples sharing a system prompt and their histories."""
    rng = random.Random(0)
    system = [rng.randrange(3, 500) for _ in range(64)]
    samples = []
    for _ in range(2):
        history = list(system)
        for _ in range(4):
            history += [rng.randrange(3, 500) for _ in range(24)]
            samples += [history + [rng.randrange(3, 500) for _ in range(16)] for _ in range(2)]
            history += samples[-1][len(history) :]
    return samples


WORKLOADS = {**PLAN_WORKLOADS, "smoke": (smoke, 256)}


def step(model, sequences, budget: int, method: str, weights: list[torch.Tensor], scored: int) -> list[torch.Tensor]:
    """One step's forward and backward by `method`; the per-sequence log-probabilities (detached)."""
    device = next(model.parameters()).device
    model.zero_grad(set_to_none=True)
    if method.startswith("reuse"):  # reuse_kept: every chunk's forward graph kept for the backward
        keep = len(sequences) * 10**6 if method == "reuse_kept" else 1
        layers = prefix_reuse.LAYERS
        if method == "reuse_eager":  # the chunks on the eager layers, whatever the model's are
            prefix_reuse.LAYERS = "eager"
        try:
            logps = sequence_logprobs(model, sequences, budget, prefix_reuse=True, keep_graphs=keep)
            (sum((w * lp).sum() for w, lp in zip(weights, logps)) / scored).backward()
        finally:
            prefix_reuse.LAYERS = layers
        return [lp.detach() for lp in logps]
    out: list[torch.Tensor | None] = [None] * len(sequences)
    splits = rope_split_lengths(model.config)
    for forest in pack_forest(sequences, max_tokens_per_mb=budget, split_lengths=splits):
        forest = forest.to(device)
        table, _ = forest_logprobs(model, forest)
        values = gather_sequences(forest, table)
        (sum((weights[i] * v).sum() for i, v in zip(forest.seq_ids, values)) / scored).backward()
        for i, v in zip(forest.seq_ids, values):
            out[i] = v.detach()
    return out


class Recompiles(logging.Handler):
    """Dynamo's recompile messages (the guards that failed), kept while the block runs. Turns dynamo's `recompiles`
    log on where it is off (as `TORCH_LOGS=recompiles`: the messages go to stderr too) until `close()`."""

    LOGGER = "torch._dynamo.guards.__recompiles"

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []
        self.turned_on = not torch._logging._internal.log_state.is_artifact_enabled("recompiles")
        if self.turned_on:
            torch._logging.set_logs(recompiles=True)

    def close(self) -> None:
        if self.turned_on:
            torch._logging.set_logs()
            self.turned_on = False
        super().close()

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage()[:600])

    def __enter__(self):
        logging.getLogger(self.LOGGER).addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger(self.LOGGER).removeHandler(self)


def run_method(model, sequences, budget, method, weights, scored, args, progress=None) -> tuple[dict, dict | None]:
    """`method`'s steps: its times and peak memory, and its first step's log-probs and gradients (None where the
    method refuses the workload: `({"refused": why}, None)`). `progress(seconds)` after every step."""
    device = args.device
    # AdamW at learning rate 0: its states held and updated as in training, the weights unchanged (every step the
    # same work); made per method, so its states count in each method's peak memory
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0) if args.optimizer else None
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    splits = rope_split_lengths(model.config)
    if method == "split":
        try:
            forests = pack_forest(sequences, max_tokens_per_mb=budget, split_lengths=splits)
        except ValueError as error:
            return {"refused": str(error).split(". ")[0]}, None
        forwarded = sum(f.num_tree_tokens for f in forests)
    else:  # the forests `sequence_logprobs` runs: one per length class, in chunks where larger than the budget
        forests = pack_forest(sequences, split_lengths=splits, two_level=False)
        forwarded = sum(plan_chunks(f, budget).forwarded_rows if f.seq_len > budget else f.num_tree_tokens
                        for f in forests)  # fmt: skip
    seconds, compiled, reasons, first = [], [], [], {}
    recompiles = Recompiles()
    for k in range(args.warmup + args.steps):
        graphs, logged = counters["stats"]["unique_graphs"], len(recompiles.messages)
        _sync()
        start = time.perf_counter()
        with recompiles:
            logps = step(model, sequences, budget, method, weights, scored)
            if optimizer is not None:
                optimizer.step()
            _sync()
        seconds.append(time.perf_counter() - start)
        compiled.append(counters["stats"]["unique_graphs"] - graphs)
        reasons.append(recompiles.messages[logged:])
        if progress is not None:
            progress(seconds)
        if k == 0 and (len(args.methods) > 1 or args.first_dir or args.resume):  # the agreement check's
            first = first_step(model, logps)
        if k == args.warmup - 1 and device == "cuda":  # the peak after the warm-up (compile and autotuning left out)
            torch.cuda.reset_peak_memory_stats()
    recompiles.close()
    result = {
        "step_s": seconds, "first_step_s": seconds[0], "measured_step_s": seconds[args.warmup:],
        "median_step_s": statistics.median(seconds[args.warmup:]),
        "graphs_compiled": compiled,  # torch.compile graphs each step compiled: a measured step's should be 0
        "recompile_reasons": reasons,  # per step, dynamo's message for each recompile (the guards that failed)
        "peak_gib": torch.cuda.max_memory_allocated() / GIB if device == "cuda" else None,
    }  # fmt: skip
    result["forwards" if method == "split" else "forests"] = len(forests)
    result["forwarded"] = forwarded
    if args.profile:
        result["profile"] = profiled_step(lambda: step(model, sequences, budget, method, weights, scored))
    return result, first


def profiled_step(run) -> dict:
    """One more step under the torch profiler, not timed: where its time goes (`profile_step.summarize`: kernel time
    by kind, the top kernels and host ops)."""
    from profile_step import summarize
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    _sync()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        run()
        _sync()
        wall = time.perf_counter() - start
    return summarize(prof, wall)


def reference(model, sequences) -> tuple[dict, dict]:
    """The `reference` method: `({"seconds", "dtype"}, {"logps"})`, the step's log-probabilities from a float32 copy
    of `model` (its weights upcast), unsplit forests, no gradients."""
    start = time.perf_counter()
    with eager_layers(model):  # a copy of the eager layers (`--compile` compiles them in place)
        exact = copy.deepcopy(model).float()
    with torch.no_grad():
        logps = sequence_logprobs(exact, sequences)
    first = {"logps": torch.cat(logps).cpu().tolist()}
    del exact, logps
    _sync()
    return {"seconds": time.perf_counter() - start, "dtype": "float32"}, first


def check_pair(firsts: dict, candidate: str, baseline: str, dtype: str) -> dict:
    """`candidate`'s first step against `baseline`'s: log-probs by `harness.agreement` (against the float32
    `reference` where it ran, else directly within `LOGPROB_BOUND`) and the least gradient cosine."""
    exact = firsts.get("reference", {}).get("logps")
    a, b = firsts[candidate]["logps"], firsts[baseline]["logps"]
    check = agreement(a, b, exact) if exact is not None else agreement(a, b, bound=LOGPROB_BOUND[dtype])
    check["gradient_cosine"] = gradient_cosine(firsts[candidate]["grads"], firsts[baseline]["grads"])
    check["passed"] = check["passed"] and check["gradient_cosine"] >= GRAD_COSINE
    return check


def described(check: dict) -> str:
    """One line of an agreement check for the log."""
    if "max_error" in check:
        worst = check["max_error"]
        return (f"largest error to float32 {worst['candidate']:.3g} against {worst['baseline']:.3g}, gradient cosine "
                f"{check['gradient_cosine']:.5f}")  # fmt: skip
    return f"max |dlogp| {check['max_abs']:.3g}, gradient cosine {check['gradient_cosine']:.5f}"


def first_step(model, logps: list[torch.Tensor]) -> dict:
    """A step's log-probs and parameter gradients, on the host (an 8B model's are 16 GB), for the agreement check."""
    return {
        "logps": torch.cat(logps).float().cpu().tolist(),
        "grads": {n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.grad is not None},
    }


def gradient_cosine(a: dict, b: dict) -> float:
    """The least cosine over parameter tensors of two gradient dicts (the same names)."""
    assert a.keys() == b.keys() and a
    return min(torch.nn.functional.cosine_similarity(a[n].float().flatten(), b[n].float().flatten(), dim=0).item()
               for n in a)  # fmt: skip


def measure(model_name: str, workload: str, args, save, earlier: dict) -> dict:
    """One (model, workload) row; `save(row)` after each method (a run cut off by a time limit keeps them).
    `earlier`: methods an earlier run measured for this row (`--resume`), kept and paired with the ones run now."""
    build, budget = WORKLOADS[workload]
    budget = args.budget or budget
    sequences = build()
    dtype = getattr(torch, args.dtype)
    model = build_model(model_name, torch.device(args.device), checkpointing=args.checkpointing, dtype=dtype)
    if args.compile:  # the trainers' CUDA default, for both methods; prefix reuse's chunks on them too
        compile_decoder_layers(model, backend="inductor", dynamic=True)
        prefix_reuse.LAYERS = "compiled"
    (forest,) = pack_forest(sequences, two_level=False)
    scored = sum(len(s) - 1 for s in sequences)
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(len(s) - 1, generator=g).to(args.device) for s in sequences]
    flops = 3 * estimate_flops(model.config, sequences)["tree_flops"]
    row = {"model": model_name, "workload": workload, "budget": budget, "sequences": len(sequences),
           "longest": max(map(len, sequences)), "unique": forest.num_tree_tokens, "methods": {}}  # fmt: skip
    firsts = {}
    for method, result in earlier.items():
        if method not in args.methods:
            row["methods"][method] = result
            path = first_path(args, model_name, workload, method)
            if path is not None and path.exists():
                firsts[method] = torch.load(path)
    for method in args.methods:
        if method == "reference":
            row["methods"][method], firsts[method] = reference(model, sequences)
            if (path := first_path(args, model_name, workload, method)) is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.save(firsts[method], path)
            save(row)
            print(f"  reference: float32 log-probs in {row['methods'][method]['seconds']:.1f} s", flush=True)
            continue

        def progress(seconds: list[float], method: str = method) -> None:  # a run cut off keeps the steps it ran
            row["methods"][method] = {"incomplete": True, "step_s": list(seconds)}
            save(row)

        result, first = run_method(model, sequences, budget, method, weights, scored, args, progress)
        row["methods"][method] = result
        if first is None:
            print(f"  {method}: {result['refused']}", flush=True)
            continue
        if (path := first_path(args, model_name, workload, method)) is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(first, path)
        firsts[method] = first
        result["mfu"] = flops / result["median_step_s"] / PEAK_FLOPS
        result["forwarded_over_unique"] = result["forwarded"] / row["unique"]
        save(row)
        print(f"  {method}: {result['median_step_s']:.3f} s (first {result['first_step_s']:.1f} s)  "
              f"mfu {100 * result['mfu']:.1f}%  peak {result['peak_gib'] or 0:.1f} GiB", flush=True)  # fmt: skip
        if any(late := result["graphs_compiled"][args.warmup :]):
            print(f"  {method}: measured steps compiled graphs {late}: their times include compiling", flush=True)
    measured = {m for m, r in row["methods"].items() if "refused" not in r}
    if "reference" in measured and "reference" not in firsts:  # run earlier, its first step not in --first-dir
        firsts["reference"] = reference(model, sequences)[1]
    for reuse_method, suffix in (("reuse", ""), ("reuse_kept", "_kept"), ("reuse_eager", "_eager")):
        if not {"split", reuse_method} <= measured:
            continue
        split, reuse = row["methods"]["split"], row["methods"][reuse_method]
        for method in sorted({"split", reuse_method} - firsts.keys()):
            # an earlier run's first step not in --first-dir (e.g. written on a machine since given back): one
            # unmeasured step of that method here, on the same data
            firsts[method] = first_step(model, step(model, sequences, budget, method, weights, scored))
            row.setdefault("agreement_steps_rerun", []).append(method)
        row["agreement" + suffix] = check = check_pair(firsts, reuse_method, "split", args.dtype)
        try:
            pair = paired(split["measured_step_s"], reuse["measured_step_s"])
        except ValueError as error:
            pair = {"error": str(error)}
        pair["failed"] = not check["passed"]
        row["paired" + suffix] = pair
        if "median" in pair:
            print(
                f"  split vs {reuse_method}: {pair['median']:.2f}x [{pair['min']:.2f}, {pair['max']:.2f}] "
                f"{'FAILED agreement' if pair['failed'] else 'agrees'} ({described(check)})",
                flush=True,
            )
    # the recomputes the kept graphs save, and what compiled chunks gain over eager ones, per step; each pair agrees
    # as each agrees with the split
    for baseline, other, key in (("reuse", "reuse_kept", "reuse_vs_kept"), ("reuse_eager", "reuse", "layers")):
        if not ({baseline, other} <= measured and {baseline, other} <= firsts.keys()):
            continue
        row["agreement_" + key] = check = check_pair(firsts, other, baseline, args.dtype)
        try:
            pair = paired(row["methods"][baseline]["measured_step_s"], row["methods"][other]["measured_step_s"])
        except ValueError as error:
            pair = {"error": str(error)}
        pair["failed"] = not check["passed"]
        row["paired_" + key] = pair
        if "median" in pair:
            print(
                f"  {baseline} vs {other}: {pair['median']:.2f}x [{pair['min']:.2f}, {pair['max']:.2f}] "
                f"{'FAILED agreement' if pair['failed'] else 'agrees'} ({described(check)})",
                flush=True,
            )
    del model, firsts
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return row


def first_path(args, model_name: str, workload: str, method: str) -> Path | None:
    """Where `--first-dir` holds a method's first-step log-probs and gradients for a row (None without it)."""
    return Path(args.first_dir) / f"{model_name}_{workload}_{method}.pt" if args.first_dir else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen3-1.7b"], choices=list(MODELS))
    parser.add_argument("--workloads", nargs="+", default=["agent_2x20x4"], choices=list(WORKLOADS))
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["split", "reuse"],
        choices=["split", "reuse", "reuse_kept", "reuse_eager", "reference"],
    )
    parser.add_argument("--budget", type=int, help="token budget (default: the workload's)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8, help="measured steps (at least 8 for a ratio)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--optimizer", action="store_true", help="an AdamW step (learning rate 0) after each step")
    parser.add_argument(
        "--checkpointing", default="all", choices=["all", "none"],
        help="the model's own activation checkpointing of its decoder layers (none: prefix reuse recomputes each "
             "chunk once, not each layer again in the backward; every chunk's activations held in its backward)",
    )  # fmt: skip
    parser.add_argument("--profile", action="store_true", help="one more step per method under the torch profiler")
    parser.add_argument(
        "--compile", action="store_true",
        help="compile the decoder layers in place (inductor, dynamic shapes: the trainers' CUDA default) for every "
             "method; prefix reuse's chunks run them too (HF_TREE_ATTN_PREFIX_REUSE_LAYERS=compiled)",
    )  # fmt: skip
    parser.add_argument(
        "--undeclared-lengths", action="store_true",
        help="leave FlexAttention's lengths undeclared where it is traced (`attention._declare_block_multiples` a "
             "no-op): its kernels as generated before the tree attention declared multiples of 128, for an A/B",
    )  # fmt: skip
    parser.add_argument("--out", default="benchmarks/results/prefix_reuse_gpu.json")
    parser.add_argument(
        "--resume", action="store_true",
        help="keep the methods an earlier run wrote to --out for the same rows and pair them with the ones run now "
             "(each method in its own process; the agreement check reads the earlier one's first step from "
             "--first-dir, or runs one step of it where it is not there)",
    )  # fmt: skip
    parser.add_argument("--first-dir", help="write each method's first-step log-probs and gradients there")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --device cpu for a smoke run)")
    if "reuse_eager" in args.methods and not args.compile:
        parser.error("--methods reuse_eager: its chunks run the eager layers where the others run compiled ones; "
                     "without --compile it is `reuse` (add --compile, or drop reuse_eager)")  # fmt: skip
    if args.undeclared_lengths:
        hf_tree_attn.attention._declare_block_multiples = lambda query, key: None
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = {**provenance(), "peak_flops": PEAK_FLOPS, "cuda_path": prefix_reuse.CUDA_PATH,
               "dtype": args.dtype, "warmup": args.warmup, "steps": args.steps, "optimizer": args.optimizer,
               "checkpointing": args.checkpointing, "compiled_layers": args.compile,
               "declared_lengths": not args.undeclared_lengths, "rows": []}  # fmt: skip
    earlier = {}
    if args.resume and out.exists():
        before = json.loads(out.read_text())
        results["earlier_runs"] = earlier_runs(before)
        for row in before["rows"]:
            methods = {m: r for m, r in row["methods"].items() if "refused" not in r and "incomplete" not in r}
            if (row["model"], row["workload"]) in {(m, w) for m in args.models for w in args.workloads}:
                earlier[row["model"], row["workload"]] = methods
            else:
                results["rows"].append(row)
    for model_name in args.models:
        for workload in args.workloads:
            print(f"{model_name:<12} {workload}", flush=True)
            done = list(results["rows"])

            def save(row: dict, done: list = done) -> None:
                results["rows"] = [*done, row]
                out.write_text(json.dumps(results, indent=1))

            save(measure(model_name, workload, args, save, earlier.get((model_name, workload), {})))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
