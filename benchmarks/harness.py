"""What every side-by-side benchmark shares: provenance, per-step clocks, sides in their own processes, paired
ratios and agreement checks that can fail.

- `provenance()`: the exact command, the git commit (and whether the work tree was dirty), the versions of the
  stack, the GPU and the time, for the top of every result file.
- `StepClock`: a `TrainerCallback` with the wall time of every optimizer step (CUDA-synchronized) and the first
  step's seconds from `train()`'s start (the compile cost), the peak memory after the warm-up.
- `run_side(script, side, argv, env)`: one side of a comparison in a process of its own (its own CUDA context,
  allocator, compile caches in memory and module state), which writes its result as JSON (`write_side`).
- `side_arguments(parser, sides, out)`, `run_child(args, side_main)`, `result_file(args, results, rows)`: the
  command line, child process and result file every side-by-side benchmark shares.
- `resume(out, results, planned)`: the rows and sides an earlier run of the same benchmark wrote (`--resume`).
- `run_rows(...)`: a benchmark's rows, side after side, each row's pairs and the result file re-written after every
  side (a call that runs out of time keeps the sides it finished).
- `paired(reference, candidate)`: per measured step, reference seconds / candidate seconds on the same step
  index (both sides trained the same data in the same order), at least `MIN_MEASURED_STEPS`, with min / median /
  max — never a ratio of two medians.
- `compile_report(trainer)`: what ran compiled in a side's process — decoder layers compiled by the tree trainer
  (`hf_tree_attn.compile`) or by accelerate (regional compilation wraps them in `OptimizedModule`), dynamo's graphs,
  frames and graph breaks, and the seconds its compile phases took (the first step's compile cost, by phase).
- `pair_sides(row, pairs, dtype, same_data)`: a benchmark row's paired ratios and agreement checks for each pair of
  its sides, a pair that disagrees (or trained other data, or fell back from the tree) marked failed.
- `agreement(candidate, baseline, exact)` (`sides_agreement` for two sides' result dicts): whether one side's
  per-token values are as close to a float32 run's on the same tokens as the other's (at most twice its error plus
  one bf16 rounding); a row that fails is recorded as failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from transformers import TrainerCallback

REPO = Path(__file__).resolve().parent.parent
MIN_MEASURED_STEPS = 8
# The largest |difference| two sides' per-token log-probabilities may have on the same tokens. bf16: each side is
# within 6e-2 of the float32 per-sequence forward in the GPU tests (tests/test_gpu.py's bf16 row), so two sides are
# within twice that. float32: each side within 1e-4 on CUDA (tests/test_grpo_trainer.py), twice that between them.
LOGPROB_BOUND = {"bfloat16": 2 * 6e-2, "float32": 2 * 1e-4}
PACKAGES = ("torch", "transformers", "trl", "accelerate", "peft", "triton", "hf_tree_attn")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def provenance(argv: list[str] | None = None, **versions_extra) -> dict:
    """The command, git commit and dirty flag, package versions (and `versions_extra`, e.g. cuDNN's), GPU and UTC
    time of a benchmark run: the top of every result file.

    Where the repository travels as a copy of the work tree (the GPU machine), `HF_TREE_ATTN_COMMIT` names the
    commit it was copied from (and `HF_TREE_ATTN_DIRTY=1` that it held uncommitted changes); set, they win over what
    git says there."""
    import importlib.metadata as metadata

    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:  # the GPU machine imports this package from the work tree
            module = sys.modules.get(name)
            versions[name] = getattr(module, "__version__", None)
    versions.update(versions_extra)
    # The variables win where set: the GPU machine's copy of the work tree can carry git metadata of an older
    # checkout (seen: it named a commit three behind, dirty), so only the sender knows what was sent.
    if os.environ.get("HF_TREE_ATTN_COMMIT"):
        commit, dirty = os.environ["HF_TREE_ATTN_COMMIT"], os.environ.get("HF_TREE_ATTN_DIRTY") == "1"
    else:
        commit = _git("rev-parse", "HEAD")
        status = _git("status", "--porcelain", "--untracked-files=no")
        dirty = bool(status) if status is not None else None
    cuda = torch.cuda.is_available()
    return {
        "command": "python " + " ".join(argv if argv is not None else sys.argv),
        "git_commit": commit,
        "git_dirty": dirty,
        "versions": versions,
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


class StepClock(TrainerCallback):
    """Optimizer-step ends (CUDA-synchronized), the first step's seconds and the peak memory after the warm-up.

    `step_s[k]` is step k's wall time (the gap between the ends of steps k - 1 and k; step 0 from `train()`'s start:
    set-up, the first compile, the first step); `peak_gib` the peak allocated from the first measured step on."""

    def __init__(self, warmup: int):
        self.warmup, self.ends, self._begin = warmup, [], None

    def _sync(self):
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_train_begin(self, args, state, control, **kwargs):
        self._sync()
        self._begin = time.perf_counter()

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.warmup and torch.cuda.is_available():
            self._sync()
            torch.cuda.reset_peak_memory_stats()

    def on_step_end(self, args, state, control, **kwargs):
        self._sync()
        self.ends.append(time.perf_counter())

    @property
    def step_s(self) -> list[float]:
        marks = [self._begin, *self.ends]
        return [b - a for a, b in zip(marks[:-1], marks[1:])]

    def measured(self) -> list[float]:
        return self.step_s[self.warmup :]

    def summary(self) -> dict:
        measured = self.measured()
        return {
            "step_s": self.step_s,
            "first_step_s": self.step_s[0] if self.step_s else None,
            "measured_step_s": measured,
            "median_step_s": statistics.median(measured) if measured else None,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        }


def paired(reference: list[float], candidate: list[float], min_steps: int = MIN_MEASURED_STEPS) -> dict:
    """Per-step ratios `reference[k] / candidate[k]` (> 1: the candidate is faster) of the measured steps.

    Raises `ValueError` when the two sides measured different numbers of steps or fewer than `min_steps`."""
    if len(reference) != len(candidate):
        raise ValueError(
            f"the sides measured {len(reference)} and {len(candidate)} steps: a pair needs the same steps"
        )
    if len(reference) < min_steps:
        raise ValueError(f"{len(reference)} measured steps; a paired ratio needs at least {min_steps} (--steps)")
    ratios = [r / c for r, c in zip(reference, candidate)]
    return {
        "per_step": ratios,
        "min": min(ratios),
        "median": statistics.median(ratios),
        "max": max(ratios),
        "steps": len(ratios),
    }


def agreement(
    candidate: list[float], baseline: list[float], exact: list[float] | None = None, bound: float | None = None
) -> dict:
    """Whether `candidate`'s per-token values are as right as `baseline`'s, on the same tokens.

    With `exact` (the same tokens from a float32 run): the candidate's largest and mean error to it are at most twice
    the baseline's plus one bf16 rounding (`u |exact|`), the rule of the GPU tests (tests/test_gpu_async_grpo.py).
    Without: the largest |candidate - baseline| is within `bound`."""
    if len(candidate) != len(baseline) or not candidate or (exact is not None and len(exact) != len(candidate)):
        return {"passed": False, "reason": "not the same tokens"}
    if exact is None:
        diffs = [abs(a - b) for a, b in zip(candidate, baseline)]
        return {"passed": max(diffs) <= bound, "max_abs": max(diffs), "mean_abs": statistics.fmean(diffs),
                "bound": bound, "tokens": len(diffs)}  # fmt: skip
    u = torch.finfo(torch.bfloat16).eps / 2
    errors = {name: [abs(a - e) for a, e in zip(values, exact)] for name, values in
              (("candidate", candidate), ("baseline", baseline))}  # fmt: skip
    worst, mean = ({k: f(v) for k, v in errors.items()} for f in (max, statistics.fmean))
    scale = max(abs(e) for e in exact)
    passed = worst["candidate"] <= 2 * worst["baseline"] + u * scale and mean["candidate"] <= 2 * mean["baseline"] + u
    return {"passed": passed, "max_error": worst, "mean_error": mean, "rule": "candidate <= 2 x baseline + u|exact|",
            "tokens": len(exact)}  # fmt: skip


def run_side(script: Path, side: str, argv: list[str], env: dict[str, str] | None = None, timeout: float = 3600):
    """Run `script --side SIDE --side-out FILE argv...` in a new Python process and return what it wrote, or
    `{"error": ...}` with the end of its output if it wrote nothing. `env` adds to (or, with a None value, removes
    from) the environment."""
    environment = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            environment.pop(key, None)
        else:
            environment[key] = value
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{side}.json"
        command = [sys.executable, str(script), "--side", side, "--side-out", str(out), *argv]
        start = time.perf_counter()
        try:
            proc = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as error:
            return {"error": f"timed out after {timeout:.0f} s", "output_tail": str(error.stdout or "")[-3000:]}
        sys.stderr.write(proc.stderr[-4000:] if proc.returncode else "")
        if out.exists():
            result = json.loads(out.read_text())
            result["process_s"] = time.perf_counter() - start
            return result
        return {"error": f"exit {proc.returncode}", "output_tail": (proc.stdout + proc.stderr)[-3000:]}


def compile_report(trainer) -> dict:
    """What ran compiled in this process (see the module docstring): `tree_layers` / `accelerate_layers` as
    "compiled / decoder layers", `unique_graphs`, `frames`, `graph_breaks` (dynamo's counters; reasons cut to 200
    characters) and `seconds` (dynamo's timed compile phases of 0.05 s or more, summed over the process, e.g.
    `_compile.compile_inner`, `compile_fx.<locals>.fw_compiler_base`)."""
    from torch._dynamo.eval_frame import OptimizedModule
    from torch._dynamo.utils import compile_times, counters

    from hf_tree_attn.compile import compiled_layers, decoder_layers

    layers = decoder_layers(trainer.model)
    wrapped = getattr(trainer, "model_wrapped", None) or trainer.model
    kinds = {type(layer) for layer in layers}
    by_accelerate = [m for m in wrapped.modules() if isinstance(m, OptimizedModule) and type(m._orig_mod) in kinds]
    names, values = compile_times(repr="csv", aggregate=True)
    return {
        "tree_layers": f"{len(compiled_layers(trainer.model))} / {len(layers)}",
        "accelerate_layers": f"{len(by_accelerate)} / {len(layers)}",
        "unique_graphs": counters["stats"]["unique_graphs"],
        "frames": dict(counters["frames"]),
        "graph_breaks": {reason[:200]: n for reason, n in counters["graph_break"].items()},
        "seconds": {name: round(float(value), 3) for name, value in zip(names, values) if float(value) >= 0.05},
    }


def write_side(path: str, result: dict) -> None:
    Path(path).write_text(json.dumps(result))


def side_arguments(parser: argparse.ArgumentParser, sides, out: str) -> argparse.Namespace:
    """The flags every side-by-side benchmark shares — `--steps`, `--warmup`, `--scale`, `--out`, `--resume`, and the
    hidden `--side` / `--side-out` a child process gets (`run_side`) — added to `parser`, the command line parsed,
    and `--warmup` / `--steps` checked (at least 1 each)."""
    parser.add_argument("--steps", type=int, default=8, help="measured optimizer steps (at least 8 for a ratio)")
    parser.add_argument("--warmup", type=int, default=2, help="optimizer steps before the measured ones")
    parser.add_argument("--scale", type=float, default=1.0, help="scale every length (CPU smoke runs)")
    parser.add_argument("--out", default=out)
    parser.add_argument("--resume", action="store_true", help="keep the sides --out already holds; run the others")
    parser.add_argument("--side", choices=list(sides), help=argparse.SUPPRESS)  # a child process: this side only
    parser.add_argument("--side-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.warmup < 1 or args.steps < 1:
        parser.error(f"--warmup {args.warmup} --steps {args.steps}: both need at least 1")
    return args


def run_child(args: argparse.Namespace, side_main) -> bool:
    """In a child process (`--side`): run that side (`side_main(args)`), write its result where the parent reads it,
    and return True; in the parent, False."""
    if args.side is None:
        return False
    write_side(args.side_out, side_main(args))
    return True


def result_file(args: argparse.Namespace, results: dict, rows: list[tuple[str, str]]) -> tuple[Path, dict]:
    """`--out` (its folder made) and, with `--resume`, the sides an earlier run wrote for `rows` (`resume`)."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return out, (resume(out, results, rows) if args.resume else {})


def earlier_runs(earlier: dict) -> list[dict]:
    """The provenance of the runs behind an earlier result file `earlier` (its own, after those it resumed)."""
    keys = ("command", "git_commit", "git_dirty", "time_utc")
    return [*earlier.get("earlier_runs", []), {k: earlier.get(k) for k in keys}]


def resume(out: Path, results: dict, planned: list[tuple[str, str]]) -> dict[tuple[str, str], dict]:
    """Into `results`, the rows of an earlier run's `out` that this run does not redo (`planned`: its (model,
    workload) rows), and that run's provenance under `earlier_runs`. Returns the sides the earlier run wrote without
    error for each planned row, read now: `out` is re-written as soon as this run starts (`run_rows`' `earlier`)."""
    if not out.exists():
        return {}
    earlier = json.loads(out.read_text())
    results["rows"], sides = [], {}
    for row in earlier.get("rows", []):
        key = (row["model"], row["workload"])
        if key not in planned:
            results["rows"].append(row)
            continue
        sides.setdefault(key, {}).update({n: side for n, side in row["sides"].items() if "error" not in side})
    results["earlier_runs"] = earlier_runs(earlier)
    return sides


def run_rows(
    script: Path, out: Path, results: dict, rows: list[tuple[str, str]], sides: list[str], args: dict
) -> None:
    """Run every (model, workload) row of `rows`, side after side, each side in its own process (`run_side`).

    `args`: `argv` (the child's flags), `env(side)` (what the side adds to the environment), `pair(row)` (fills
    `row["paired"]` and `row["agreement"]` from the sides that ran), `summary(row)` (a line to print), `earlier`
    (`resume`'s sides of an earlier run, paired with the ones run now). After every side the row's pairs are
    recomputed and `out` re-written, so a run cut off by a time limit keeps what it finished; `--resume` runs the
    rest later."""
    for model, workload in rows:
        row = {"model": model, "workload": workload, "sides": {}, "paired": {}, "agreement": {}}
        row["sides"].update(args.get("earlier", {}).get((model, workload), {}))
        results["rows"].append(row)
        for side in sides:
            argv = [*args["argv"], "--models", model, "--workloads", workload]
            row["sides"][side] = run_side(script, side, argv, args["env"](side))
            args["pair"](row)
            out.write_text(json.dumps(results, indent=1))
        print(args["summary"](row), flush=True)


def sides_agreement(candidate: dict, baseline: dict, reference: dict | None, dtype: str) -> dict:
    """`agreement` of two sides' first scores (`first_scores`: the first micro-batch's `targets` and `log_probs`):
    against the float32 `reference` side where it ran (and scored the same tokens), else directly within
    `LOGPROB_BOUND[dtype]`."""
    a, b = candidate["first_scores"], baseline["first_scores"]
    exact = (reference or {}).get("first_scores", {})
    same = a["targets"] == b["targets"] and (not exact or exact["targets"] == a["targets"])
    if exact:
        check = agreement(a["log_probs"], b["log_probs"], exact["log_probs"])
    else:
        check = agreement(a["log_probs"], b["log_probs"], bound=LOGPROB_BOUND.get(dtype, LOGPROB_BOUND["float32"]))
    check["same_targets"] = same
    check["passed"] = check["passed"] and same
    return check


def pair_sides(row: dict, pairs: list[tuple[str, str]], dtype: str, same_data) -> list[str]:
    """Fill `row["paired"]` and `row["agreement"]` for every (candidate, baseline) of `pairs` whose two sides ran,
    and return their keys ("candidate vs baseline").

    A pair agrees when `sides_agreement` passes (the float32 `reference` side where it ran), `same_data(a, b)` says
    the two sides trained the same data, and no step of either fell back from the tree (`tree_fallback`); a pair that
    does not is marked `failed`. Its `paired` entry: the per-step ratios (`paired`; baseline seconds over the
    candidate's), `peak_ratio` (candidate peak over the baseline's) where both recorded one, or `error` with too few
    steps. `row["spec"]`: the first side's `spec`."""
    sides = row["sides"]
    row["spec"] = next((side["spec"] for side in sides.values() if "spec" in side), None)
    keys = []
    for candidate, baseline in pairs:
        a, b = sides.get(candidate, {}), sides.get(baseline, {})
        if "median_step_s" not in a or "median_step_s" not in b:
            continue
        key = f"{candidate} vs {baseline}"
        same = same_data(a, b)
        check = sides_agreement(a, b, sides.get("reference"), dtype)
        fallbacks = [f for side in (a, b) for f in (side.get("tree_fallback") or []) if f]
        check.update(
            same_batches=same, tree_fallback=len(fallbacks), reference="first_scores" in sides.get("reference", {})
        )
        check["passed"] = check["passed"] and same and not fallbacks
        row["agreement"][key] = check
        try:
            row["paired"][key] = {**paired(b["measured_step_s"], a["measured_step_s"]), "failed": not check["passed"]}
        except ValueError as error:
            row["paired"][key] = {"error": str(error), "failed": True}
            continue
        if a.get("peak_gib") and b.get("peak_gib"):
            row["paired"][key]["peak_ratio"] = a["peak_gib"] / b["peak_gib"]
        keys.append(key)
    return keys
