"""Write benchmarks/results/README.md and the table in README.md's *Performance* from the committed result files.

    python benchmarks/results_tables.py          # rewrite both
    python benchmarks/results_tables.py --check  # exit 1 where a committed file differs from what this writes

One table per question, each row read from a result file and linking it with the stage of benchmarks/run_h200.sh
that made it. Which file answers which question is the registry, results_registry.py (its docstring says how to add a
result); this module only reads and formats.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import sys
from collections import Counter
from pathlib import Path

from results_registry import (
    ASYNC_ATTENTION_PATHS,
    ASYNC_PAIRED,
    ASYNC_PREFIX_REUSE,
    ASYNC_TREE_ONLY,
    ASYNC_TREE_ONLY_FLA,
    BEYOND_GRPO,
    BEYOND_PAIRED,
    DEEPSPEED_MAIN_JOB,
    DEEPSPEED_RUNS,
    FLASH_ASYNC,
    FLASH_ATTENTION,
    FLEX_KERNEL_SETTINGS,
    FLEX_OPTIONS,
    GATHERED_PATHS,
    GPU_TEST_LOGS,
    GRAD_CHECKS,
    HYBRID_ROWS,
    KERNEL_CHECKS,
    KERNEL_RUNS,
    LEVELS,
    LOG_COMMITS,
    LOOP_ROWS,
    MEMORY_ROWS,
    MFU_ROWS,
    NOTES,
    OPTION_COLUMNS,
    OPTION_GAINS,
    PENDING,
    PLANNER,
    PLOT,
    PREFIX_NEW_SHAPES,
    PREFIX_PARTS,
    PREFIX_REUSE_GPU,
    PREFIX_REUSE_KEPT,
    PREFIX_REUSE_PLAN,
    PREFIX_REUSE_PROFILED,
    PREFIX_REUSE_WORK,
    PREFIX_RUNS,
    PROBES_ON_GPU,
    PROFILES,
    README_ROWS,
    SOURCES,
    SUPERSEDED,
    SYNC_PAIRED,
    THROUGH_TRAINER,
    THROUGH_TRAINER_PAIRED,
    TILES,
    TRAINER_PROFILES,
)

RESULTS = Path(__file__).resolve().parent / "results"
REPO = RESULTS.parent.parent
SCRIPT = "benchmarks/run_h200.sh"
BEGIN, END = "<!-- benchmarks/results_tables.py writes this table -->", "<!-- end of the table -->"

MODELS = {"qwen3-0.6b": "Qwen3-0.6B", "qwen3-1.7b": "Qwen3-1.7B", "qwen3-8b": "Qwen3-8B", "gemma3-1b": "Gemma-3-1B",
          "qwen3.5-0.8b": "Qwen3.5-0.8B", "qwen3.5-2b": "Qwen3.5-2B"}  # fmt: skip
WORKLOADS = {"tau2_like_agent": "τ²-like agent", "agent_20_turns": "τ²-like agent, 20 turns",
             "no_sharing": "no sharing", "grpo_mixed_prompts": "GRPO, mixed prompt lengths",
             "grpo_P4096_C512": "P=4,096 + G=16 × C=512",
             "grpo_mixed": "G=16, P ~ U[1,000, 6,000], C ~ U[64, 1,024]"}  # fmt: skip
METHODS = {"tree": "", "tree_flex": ", FlexAttention", "tree_whole_recompute": ", whole-layer recompute",
           "tree_budget_40gib": ", budget 40 GiB", "tree_budget_80gib": ", budget 80 GiB"}  # fmt: skip
VARIANTS = {"compile": "compiled layers", "liger": "Liger", "liger_compile": "Liger + compiled layers"}

# ---- reading -----------------------------------------------------------------------------------------------------


@functools.cache
def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def text(name: str) -> str:
    return (RESULTS / name).read_text()


def run_of(name: str, workload: str | None = None) -> dict:
    """The bench_tree_vs_flat.py run of `workload` in `name` (None: the file's only run)."""
    runs = [r for r in load(name)["runs"] if workload in (None, r["workload"])]
    (run,) = runs
    return run


# A log's command line: environment settings, a time limit, then python, accelerate or a GPU job script of benchmarks/
# (not run_h200.sh itself: a line naming its stage is followed by the stage's command).
COMMAND_LINE = re.compile(
    r"^#?\s*(?:commands?:\s*)?((?:[A-Z_]+=\S+ )*(?:timeout (?:-s \w+ )?\d+ )?"
    r"(?:python|accelerate|bash (?!benchmarks/run_h200\.sh)\S+\.sh).*)"
)


def command_of(name: str) -> str | None:
    """The command a result file records: a JSON's `command` (or `meta.command`), a log's first command line."""
    if name.endswith(".json"):
        return load(name).get("command") or load(name).get("meta", {}).get("command")
    for line in text(name).splitlines()[:3] if name.endswith((".log", ".txt")) else []:
        if match := COMMAND_LINE.match(line):
            return match.group(1).split("   (")[0].rstrip(" \\")
    return None


def commit_of(name: str) -> str | None:
    """The commit of the code a result file measured, 7 digits (", dirty" where the work tree held changes): a JSON's
    `git_commit` (or `meta.git_commit`), a log's `commit <sha>` line (`LOG_COMMITS` where that line is the machine's
    stale checkout); None for a file from before the benchmarks recorded one."""
    if name in LOG_COMMITS:
        return LOG_COMMITS[name]
    if name.endswith(".json"):
        data = load(name)
        meta = data.get("meta", {})
        commit, dirty = data.get("git_commit") or meta.get("git_commit"), data.get("git_dirty", meta.get("git_dirty"))
    elif name.endswith((".log", ".txt")) and (match := re.search(r"\bcommit ([0-9a-f]{7,40})\b(.{0,12})", text(name))):
        commit, dirty = match.group(1), "dirty" in match.group(2) and "dirty 0" not in match.group(2)
    else:
        return None
    return commit and commit[:7] + ", dirty" * bool(dirty)


def commit_cell(name: str) -> str:
    """A source cell's commit: `` `abc1234` `` or that the file records none."""
    commit = commit_of(name)
    return f"`{commit}`" if commit else "no commit recorded"


def versions_of(name: str) -> str:
    data = load(name) if name.endswith(".json") else {}
    versions = data.get("versions") or data.get("meta", {}).get("versions") or {}
    return ", ".join(f"{k} {v}" for k, v in versions.items() if k in ("torch", "transformers", "trl"))


def printed_steps(name: str) -> list[dict]:
    """The `step N: phase X s, ...` lines a run printed before its time limit stopped it (up to the next comment)."""
    steps = []
    for line in text(name).splitlines():
        if line.startswith("#") and steps:
            break
        if match := re.match(r"\s+step \d+: (.*)", line):
            steps.append({k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+) s", match.group(1))})
    return steps


# ---- formatting --------------------------------------------------------------------------------------------------


def x(value: float) -> str:
    return f"{value:.1f}×" if value >= 10 else f"{value:.2f}×"


def pct(value: float, digits: int = 0) -> str:
    return f"{100 * value:.{digits}f}%"


def secs(value: float) -> str:
    return f"{value:.3f} s" if value < 10 else f"{value:.1f} s"


def step_range(median: float, measured: list[float]) -> str:
    """A median step with the range of the measured steps: `1.234 s [1.20, 1.30 s]`."""
    return f"{secs(median)} [{min(measured):.2f}, {max(measured):.2f} s]"


def steps(values: list[float]) -> str:
    """Each measured step's time, in order."""
    return " / ".join(f"{v:.2f}" for v in values) + " s"


def faster(ratio: float) -> str:
    """A speed ratio, bold, saying which side is slower where it is below 1."""
    return f"**{x(ratio)}**" + (" (tree slower)" if ratio < 1 else "")


def table(headers: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows] + [""]


def pending(key: str, width: int) -> list[list[str]]:
    return [[what, "*not yet measured*", *[""] * (width - 2)] for what in PENDING.get(key, [])]


class Notes:
    """A section's footnotes: a marker beside each row whose file has a note, the note once under the table."""

    DIGITS = "⁰¹²³⁴⁵⁶⁷⁸⁹"

    def mark(self, index: int) -> str:
        """The note marker of the `index`-th note (from 0): ⁽¹⁾, ⁽²⁾, ... ⁽¹⁰⁾."""
        return "⁽" + "".join(self.DIGITS[int(d)] for d in str(index + 1)) + "⁾"

    def __init__(self):
        self.names: list[str] = []

    def source(self, name: str) -> str:
        """A row's source: the file, linked, with its stage (and the note's marker)."""
        cell = f"[{name}]({name})" + (f" · `{SOURCES[name]}`" if SOURCES[name] else "") + f" · {commit_cell(name)}"
        if name in NOTES:
            self.names += [name] * (name not in self.names)
            cell += f" {self.mark(self.names.index(name))}"
        return cell

    def lines(self) -> list[str]:
        notes = [f"{self.mark(i)} `{name}` {NOTES[name]}  " for i, name in enumerate(self.names)]
        return notes + [""] * bool(notes)


def workload(run: dict) -> str:
    spec = run["spec"]
    if spec.get("kind") == "grpo":
        what = f"{spec['groups']} × (P={spec['prompt']:,} + G={spec['G']} × C={spec['completion']:,})"
    else:
        what = WORKLOADS[run["workload"]]
    return f"{what}: {run['num_sequences']} seqs, {run['total_tokens'] / 1000:.0f}k tokens"


def layers_of(name: str, method: str = "tree") -> str:
    """The layer kernels and the recompute of a method ("flat*" recomputes every layer whatever the file says)."""
    kernels = load(name).get("kernels") or {}
    layers = "Liger + compiled" if kernels.get("liger") else "compiled" if kernels.get("compile_layers") else "eager"
    recompute = "all" if method.startswith("flat") else kernels.get("checkpointing", "all")
    return f"{layers}, `{recompute}`{METHODS.get(method, '')}"


def recomputed(name: str, run: dict, method: str) -> str:
    share, layers = run[method].get("checkpointed_layers"), run["model_config"]["num_hidden_layers"]
    if share is None:  # files that do not record it recomputed every layer
        return "all"
    return f"{round(share * layers)} of {layers}"


def speedup(run: dict, method: str = "tree", over: str = "flat_padded") -> float:
    return run[over]["time_s"] / run[method]["time_s"]


def loop_ratio(run: dict, method: str = "tree", over: str = "flat_padded", bold: bool = False, link: str = "") -> str:
    """`method` vs `over` in a bench_tree_vs_flat.py run. Where the run records pairs (`paired`): the median of the
    per-repeat ratios with their range (a run of too few repeats to pair: the ratio of the medians, so marked), and
    whether the run's agreement check failed; older files: the ratio of the two medians."""
    pair = run.get("paired", {}).get(f"{method} vs {over}")
    stored = {"flat_padded": "speedup_vs_padded", "flat_packed": "speedup_vs_packed"}.get(over)
    medians = run[stored] if method == "tree" and stored in run else speedup(run, method, over)
    value = x(pair["median"] if pair and "median" in pair else medians)
    value = f"[{value}]({link})" if link else value
    value = f"**{value}**" if bold else value
    if not pair:
        return value + " (ratio of medians, unpaired)"
    if "median" in pair:
        value += f" [{x(pair['min'])}, {x(pair['max'])}]"
    else:
        value += f" (ratio of medians: {len(run[method]['times_s'])} repeats, too few to pair)"
    checks = [run.get("agreement", {}).get(m, {}) for m in (method, over) if m != "flat_padded"]
    return value + (" **agreement failed**" if not all(c.get("passed") for c in checks) else "")


def loop_agreement(run: dict, cos: str) -> str:
    """A bench_tree_vs_flat.py run's gradient cosine (`cos`, formatted), and where the run checked agreement, the
    tree's scored log-probabilities against flat padded's and whether the check passed."""
    check = run.get("agreement", {}).get("tree")
    if check is None:
        return cos
    if not check["passed"]:
        return f"{cos}, **agreement failed**: {check['reason']}"
    return f"{cos}, log-probs within {check['max_abs']:.1g} (bound {check['bound']:g}): agree"


def kernels_serve(spec: dict) -> bool:
    """Whether the CUDA rule (`fast_on_cuda`) sends a GRPO workload's forests to the shared-prefix kernels."""
    from hf_tree_attn.prefix_attention import PrefixTree, fast_on_cuda

    groups, g, p, c = (spec.get(k) for k in ("groups", "G", "prompt", "completion"))
    if spec.get("kind", "grpo") != "grpo":
        return False
    size = p + g * c
    return fast_on_cuda(tuple(PrefixTree(i * size, i * size + p, tuple(i * size + p + k * c for k in range(g + 1)))
                              for i in range(groups)))  # fmt: skip


# ---- the sections ------------------------------------------------------------------------------------------------


def trainer_row(name: str, wl: str) -> dict:
    """The bench_sync_grpo.py / bench_async_grpo.py row of `wl` in `name`."""
    (row,) = [r for r in load(name)["rows"] if r["workload"] == wl]
    return row


def sync_steps() -> list[str]:
    notes, rows = Notes(), []
    for name, wl in SYNC_PAIRED:
        row = trainer_row(name, wl)
        trl, tree = row["sides"]["trl"], row["sides"]["tree"]
        checks = row["agreement"].values()
        rows.append([
            MODELS[row["model"]], WORKLOADS[wl], f"{secs(trl['median_step_s'])} / {secs(tree['median_step_s'])}",
            f"{trl['first_step_s']:.1f} / {tree['first_step_s']:.1f} s", ranged(row["paired"].get("tree vs trl")),
            f"{pct(tree['mfu'], 1)} / {pct(trl['mfu'], 1)}", f"{tree['peak_gib']:.1f} / {trl['peak_gib']:.1f}",
            f"{sum(c['passed'] for c in checks)} of {len(checks)} pairs", notes.source(name),
        ])  # fmt: skip
    headers = ["model", "workload", "median step TRL / tree", "first step TRL / tree", "tree vs TRL",
               "MFU tree / TRL", "peak GiB tree / TRL", "agreement", "source"]  # fmt: skip
    return [PAIRED_INTRO, ""] + table(headers, rows + pending("sync", len(headers))) + notes.lines()


def generation_workload(spec: dict, model: str) -> str:
    """A bench_generation_modes.py workload: prompts, G, the shared and own prompt, the completion length."""
    return (f"{MODELS[model]}: {spec['prompts_per_step']} prompts × G={spec['generations']}, "
            f"P={spec['shared_prompt'] + spec['own_prompt']:,} ({spec['shared_prompt']:,} shared), "
            f"C={spec['completion']}")  # fmt: skip


def through_trainer() -> list[str]:
    notes, paired_rows, rows = Notes(), [], []
    for name, mode in THROUGH_TRAINER_PAIRED:
        row = trainer_row(name, mode)
        trl, tree = row["sides"]["trl"], row["sides"]["tree"]
        pair = row["paired"]["tree vs trl"]
        checks = row["agreement"].values()
        paired_rows.append([
            generation_workload(load(name)["workload"], row["model"]), f"`{mode}`",
            f"{secs(trl['median_step_s'])} / {secs(tree['median_step_s'])}",
            f"{secs(trl['median_trainer_phase_s'])} / {secs(tree['median_trainer_phase_s'])}", ranged(pair),
            ranged(pair.get("trainer_phase")), f"{x(tree['token_ceiling'])} / {x(tree['flops_ceiling'])}",
            f"{pct(tree['trainer_phase_mfu'], 1)} / {pct(trl['trainer_phase_mfu'], 1)}",
            f"{tree['peak_gib']:.1f} / {trl['peak_gib']:.1f}",
            f"{sum(c['passed'] for c in checks)} of {len(checks)} pairs", notes.source(name),
        ])  # fmt: skip
    paired_headers = ["workload", "generation", "median step TRL / tree", "median trainer phase TRL / tree",
                      "step, tree vs TRL", "trainer phase, tree vs TRL", "token / FLOP ceiling",
                      "trainer-phase MFU tree / TRL", "peak GiB tree / TRL", "agreement", "source"]  # fmt: skip
    for mode, tree_file, flat_file in THROUGH_TRAINER:
        tree = load(tree_file)["results"][mode]["tree"]
        spec = load(tree_file)["meta"]["workload"]
        what = generation_workload(spec, spec["model"])
        if flat_file.endswith(".log"):  # a run its time limit stopped: the steps it printed
            steps = printed_steps(flat_file)
            flat_phase = f"{secs(steps[-1]['logprob_forwards'] + steps[-1]['backward'])} in step {len(steps)}"
            speed, peak = "no steady step", "—"
        else:
            flat = load(flat_file)["results"][mode]["flat"]
            flat_phase = secs(flat["mean"]["trainer_phase"])
            speed = f"**{x(flat['mean']['trainer_phase'] / tree['mean']['trainer_phase'])}**"
            peak = x(tree["peak_memory_gib"] / flat["peak_memory_gib"])
        sources = notes.source(tree_file) + ("" if flat_file == tree_file else " + " + notes.source(flat_file))
        rows.append([what, f"`{mode}`", flat_phase, secs(tree["mean"]["trainer_phase"]), speed, peak, sources])
    headers = ["workload", "generation", "trainer phase, TRL", "trainer phase, tree", "tree vs TRL",
               "peak memory tree / TRL", "source"]  # fmt: skip
    return (
        [PAIRED_INTRO.replace("micro-batch", "step's policy forward"), ""]
        + table(paired_headers, paired_rows)
        + [
            "Earlier rows (older code: both trainers in one process, 2–3 measured steps, a ratio of mean trainer "
            "phases):",
            "",
        ]  # fmt: skip
        + table(headers, rows + pending("through_trainer", len(headers)))
        + notes.lines()
    )


def loop_rows() -> list[str]:
    notes, rows = Notes(), []
    for name, wl in LOOP_ROWS:
        run = run_of(name, wl)
        cos = run["tree"]["grad_cos_vs_flat_padded"]
        rows.append([
            MODELS[run["model"]], workload(run), f"{x(run['token_ceiling'])} / {x(run['flop_ceiling'])}",
            loop_ratio(run, bold=True), loop_ratio(run, over="flat_packed"),
            f"{run['pct_of_token_ceiling']:.0f}% / {run['pct_of_flop_ceiling']:.0f}%",
            pct(run["pack_and_mask_share"], 1), loop_agreement(run, f"{cos:.4f}" if cos <= 1 else "— ⁽ᶜ⁾"),
            "FlexAttention ⁽ᵏ⁾" if kernels_serve(run["spec"]) else "FlexAttention", notes.source(name),
        ])  # fmt: skip
    headers = ["model", "workload", "token / FLOP ceiling", "tree vs flat padded", "tree vs flat packed",
               "% of token / FLOP ceiling", "pack + mask", "gradient cosine", "tree attention", "source"]  # fmt: skip
    return table(headers, rows) + notes.lines() + [
        "⁽ᵏ⁾ On CUDA the library runs the plain causal layers of this forest with the shared-prefix kernels "
        "(`fast_on_cuda`); this row ran FlexAttention in every layer ([what the kernels buy](#what-each-tree-option-"
        "buys)).  ",
        "⁽ᶜ⁾ This file's cosines were summed in float32 on the CPU and come out above 1 (the benchmark sums in "
        "float64).",
        "",
    ]  # fmt: skip


def option_columns() -> list[str]:
    models = [model for model in MODELS if any(model in cells for _, cells in OPTION_COLUMNS)]
    rows = []
    for model in models:
        first = next(cells[model][0] for _, cells in OPTION_COLUMNS if model in cells)
        row = [MODELS[model], workload(run_of(first))]
        for _, cells in OPTION_COLUMNS:
            name, method = cells.get(model, (None, None))
            if name is None:
                row.append("—")
            elif name.startswith("grad_check_"):
                cos = min(p["cos"] for m in load(name)[method].values() for p in m.values())
                row.append(f"[wrong gradients]({name}): cosine {cos:.4f} to eager")
            else:
                row.append(loop_ratio(run_of(name), method, link=name))
        rows.append(row)
    return table(["model", "workload", *[header for header, _ in OPTION_COLUMNS]], rows)


def option_gains() -> list[str]:
    notes, rows = Notes(), []
    for option, (on_file, on_method), (off_file, off_method) in OPTION_GAINS:
        on_run, off_run = run_of(on_file), run_of(off_file)
        on, off = on_run[on_method], off_run[off_method]
        sources = notes.source(on_file) + ("" if on_file == off_file else " + " + notes.source(off_file))
        rows.append([
            option, MODELS[on_run["model"]], layers_of(on_file).split(",")[0],
            f"{secs(on['time_s'])}, {recomputed(on_file, on_run, on_method)} layers, {on['peak_gib']:.1f} GiB",
            f"{secs(off['time_s'])}, {recomputed(off_file, off_run, off_method)} layers, {off['peak_gib']:.1f} GiB",
            f"**{x(off['time_s'] / on['time_s'])}**", f"{pct(on['mfu'], 1)} / {pct(off['mfu'], 1)}", sources,
        ])  # fmt: skip
    headers = ["option", "model", "layers", "with it: step, recomputed, peak", "without it", "with vs without",
               "MFU with / without", "source"]  # fmt: skip
    return table(headers, rows) + notes.lines()


def memory() -> list[str]:
    rows = []
    for name, wl, method in MEMORY_ROWS:
        run = run_of(name, wl)
        tree, padded, packed = run[method]["peak_gib"], run["flat_padded"]["peak_gib"], run["flat_packed"]["peak_gib"]
        rows.append([
            MODELS[run["model"]], workload(run), layers_of(name, method), recomputed(name, run, method),
            f"{tree:.1f}", f"{padded:.1f}", f"{packed:.1f}", f"**{x(tree / padded)}**", x(tree / packed),
            Notes().source(name),
        ])  # fmt: skip
    headers = ["model", "workload", "layers, recompute", "tree recomputed", "tree GiB", "flat padded GiB",
               "flat packed GiB", "tree / flat padded", "tree / flat packed", "source"]  # fmt: skip
    left_out = ", ".join(f"`{name}`" for name in PROBES_ON_GPU)
    return table(headers, rows) + [
        f"Left out: {left_out}. Those runs kept each method's gradient probe (float32, on the GPU) while the next "
        "methods ran, so the tree's peak there includes the flat methods' probes.",
        "",
    ]


def prefix_reuse_plan() -> list[str]:
    """bench_prefix_reuse_plan.py: forwarded over unique tokens, split vs prefix reuse, and the reuse planner's
    memory estimates per model shape."""
    notes, rows = Notes(), []
    data = load(PREFIX_REUSE_PLAN)
    for name, row in data["rows"].items():
        split = row["split"]
        today = (f"{x(split['forwarded_over_unique'])} in {split['micro_batches']} forwards" if "refused" not in split
                 else "refused (a sequence longer than the budget)")  # fmt: skip
        for model, reuse in row["reuse"].items():
            gib = reuse["estimate_gib"]
            rows.append([
                f"`{name}`", f"{row['sequences']} / {row['longest']:,}", f"{row['unique']:,}", f"{row['budget']:,}",
                today, f"**{x(reuse['forwarded_over_unique'])}** in {reuse['chunks']} chunks", MODELS[model],
                f"{gib['total']:.1f} ({gib['activations']:.1f} / {gib['context']:.1f} / "
                f"{gib['kept_kv'] + gib['kv_grad']:.1f})",
                f"{reuse['least']['total_gib']:.1f} at {reuse['least']['chunk_rows']:,} rows",
                notes.source(PREFIX_REUSE_PLAN),
            ])  # fmt: skip
    headers = ["workload", "sequences / longest", "unique tokens", "budget", "forwarded / unique, split",
               "forwarded / unique, prefix reuse", "model shape",
               "reuse peak estimate GiB (activations / context / kept K/V + grads)", "least estimate GiB",
               "source"]  # fmt: skip
    return (
        table(headers, rows)
        + notes.lines()
        + prefix_reuse_gpu()
        + prefix_reuse_trainer()
        + prefix_reuse_work()
        + prefix_reuse_profiled()
        + flex_kernel_settings()
        + prefix_reuse_kept()
        + prefix_reuse_layers()
    )


def decoder_layers(data: dict) -> str:
    """How a bench_prefix_reuse_gpu.py file ran the decoder layers (`--compile` or not)."""
    return "compiled layers" if data.get("compiled_layers") else "eager layers"


def prefix_reuse_gpu() -> list[str]:
    """bench_prefix_reuse_gpu.py: each layout's step on the GPU, and the paired ratio where both ran."""
    notes, rows = Notes(), []
    for name in PREFIX_REUSE_GPU:
        data = load(name)
        for row in data["rows"]:
            cells = []
            for method in ("split", "reuse", "reuse_kept"):
                run = row["methods"].get(method)
                measured = run["step_s"][data["warmup"] :] if run is not None and "incomplete" in run else []
                if run is None and method == "split" and row["longest"] > row["budget"]:
                    cells.append("refused (a sequence longer than the budget)")
                elif measured:
                    cells.append(
                        f"cut off after {len(measured)} measured steps: "
                        f"{step_range(statistics.median(measured), measured)}"
                    )
                elif run is None or "incomplete" in run:
                    cells.append("*not yet timed*")
                elif "refused" in run:
                    cells.append("refused")
                else:
                    measured = run["measured_step_s"]
                    cells.append(
                        f"{step_range(run['median_step_s'], measured)}, "
                        f"{x(run['forwarded_over_unique'])} forwarded, MFU {pct(run['mfu'], 1)}, "
                        f"{run['peak_gib']:.1f} GiB"
                    )
            rows.append([
                f"{MODELS[row['model']]}, {data['gpu']}, {decoder_layers(data)}", f"`{row['workload']}`",
                f"{row['budget']:,}",
                *cells, ranged(row.get("paired")),
                ranged(row.get("paired_kept")), notes.source(name),
            ])  # fmt: skip
    headers = ["model shape, device, decoder layers", "workload", "budget",
               "split: median step [range], forwarded / unique, MFU, peak",
               "prefix reuse: the same", "prefix reuse, every chunk's graph kept: the same",
               "split over reuse, per step", "split over reuse with graphs kept, per step", "source"]  # fmt: skip
    return table(headers, rows) + notes.lines()


def prefix_reuse_trainer() -> list[str]:
    """bench_async_grpo.py `--sides reference trl tree tree_reuse` on conversations that span a step's rows: prefix
    reuse through `trainer.train()` against the same trainer's split and TRL's packing, paired per step."""
    notes, rows = Notes(), []
    for name in ASYNC_PREFIX_REUSE:
        data = load(name)
        for row in data["rows"]:
            sides, spec = row["sides"], row["spec"]
            cells = []
            for side in ("trl", "tree", "tree_reuse"):
                run = sides[side]
                forwarded = sum(run["forwarded_tokens_per_step"]) / sum(run["unique_tokens_per_step"])
                peak = "—" if run["peak_gib"] is None else f"{run['peak_gib']:.1f}"
                cells.append(
                    f"{step_range(run['median_step_s'], run['measured_step_s'])}, {x(forwarded)} forwarded, "
                    f"MFU {pct(run['mfu'], 1)}, {peak} GiB, first step {run['first_step_s']:.1f} s"
                )
            checks = row["agreement"].values()
            rows.append([
                f"{MODELS[row['model']]}, {data['gpu']}",
                f"{spec['system']:,}-token system prompt, {spec['turns']} turns × {spec['branches']} answers",
                f"{data['gradient_accumulation_steps']} × {data['token_budget']:,}", *cells,
                ranged(row["paired"].get("tree_reuse vs trl")), ranged(row["paired"].get("tree_reuse vs tree")),
                ranged(row["paired"].get("tree vs trl")),
                f"{sum(c['passed'] for c in checks)} of {len(checks)} pairs", notes.source(name),
            ])  # fmt: skip
    if not rows:
        return []
    headers = ["model shape, device", "agent conversations", "rows × budget",
               "TRL: median step [range], forwarded / unique, MFU, peak, first step", "tree, split: the same",
               "tree, prefix reuse: the same", "reuse vs TRL", "reuse vs split", "split vs TRL", "agreement",
               "source"]  # fmt: skip
    intro = (
        "Through `trainer.train()`: `TreeAsyncGRPOTrainer` with `tree_prefix_reuse=True` (a step's rows scored as one "
        "forest in chunks of the token budget) against the same trainer splitting the step into its rows and TRL's "
        "`AsyncGRPOTrainer` packing them, each side in its own process, at their CUDA defaults (the tree's decoder "
        "layers compiled in place, prefix reuse's chunks on them; TRL eager). A ratio is the baseline's step over "
        "the candidate's on the same step, median [min, max] of 8. Agreement as in the trainer rows: each side's "
        "first-micro-batch log-probabilities against TRL's trainer in float32."
    )
    return [intro, ""] + table(headers, rows) + notes.lines()


def prefix_reuse_work() -> list[str]:
    """prefix_reuse_work.py: the FLOPs each timed layout executed, the speed they predict against the split's and the
    speed measured, and the rate each layout ran its FLOPs at."""
    notes, rows = Notes(), []
    for row in load(PREFIX_REUSE_WORK)["rows"]:
        split = row["methods"]["split"]
        for method in ("reuse", "reuse_kept"):
            entry = row["methods"].get(method)
            if entry is None:
                continue
            measured = x(entry["measured"]) if "measured" in entry else "—"
            rows.append([
                MODELS[row["model"]], f"`{row['workload']}`",
                "prefix reuse" + (", every graph kept" * (method != "reuse")),
                f"{split['executed_pflop']:.2f} → {entry['executed_pflop']:.2f}", x(entry["predicted"]), measured,
                f"{pct(split['rate'], 1)} → {pct(entry['rate'], 1)}", notes.source(row["source"]),
            ])  # fmt: skip
    headers = ["model shape", "workload", "layout", "executed PFLOP per step, split → layout",
               "speed vs split its FLOPs predict", "measured, per step (median)",
               "executed FLOPs per second / 989 TFLOP/s, split → layout", "timed in"]  # fmt: skip
    return ["", f"The work each layout executed ([{PREFIX_REUSE_WORK}]({PREFIX_REUSE_WORK}), `prefix_reuse_work.py`, "
            "CPU: the FLOP model on the rows each forward ran, the split's repeated rows and prefix reuse's "
            "recomputed chunks included; forward and backward, every layer recomputed once in the backward) against "
            "the speed measured above. Where the measured speed falls short of the predicted one, the layout ran its "
            "FLOPs more slowly than the split ran its own (last column):", "",
            *table(headers, rows), *notes.lines()]  # fmt: skip


def prefix_reuse_profiled() -> list[str]:
    """bench_prefix_reuse_gpu.py --profile: one warm step of each layout, its kernel time by kind."""
    notes, rows = Notes(), []
    for name in PREFIX_REUSE_PROFILED:
        data = load(name)
        for row in data["rows"]:
            for method, run in row["methods"].items():
                profile, kinds = run["profile"], run["profile"]["by_kind"]
                flex = [  # inductor's FlexAttention kernels, a fused prologue's ops named within
                    k for k in profile["top_kernels"]
                    if k["kind"] == "attention_forward" and k["name"].startswith("triton_tem_fused_")
                    and "flex_attention" in k["name"]
                ]  # fmt: skip
                calls = sum(k["calls"] for k in flex)
                per_call = (f"{calls:,}, {1e3 * sum(k['s'] for k in flex) / calls:.1f} ms each" if calls
                            else "none named so in the top kernels")  # fmt: skip
                rows.append([
                    f"{MODELS[row['model']]}, {data['gpu']}, {decoder_layers(data)}", f"`{row['workload']}`", method,
                    secs(profile["wall_profiled_s"]), secs(profile["kernel_s"]),
                    *(f"{secs(kinds[k]['s'])} ({pct(kinds[k]['share'])})"
                      for k in ("attention_forward", "attention_backward", "matmul")),
                    f"{secs(kinds['elementwise_reduce']['s'] + kinds['copy_fill']['s'])}",
                    per_call,
                    notes.source(name),
                ])  # fmt: skip
    headers = ["model shape, device, decoder layers", "workload", "layout", "profiled step", "kernel time",
               "attention fwd", "attention bwd", "matmul", "elementwise + copies",
               "FlexAttention forward: calls, time each", "source"]  # fmt: skip
    return ["", "Where each layout's step goes: one warm step under the torch profiler (`bench_prefix_reuse_gpu.py "
            "--profile`), GPU seconds by kernel kind:", "", *table(headers, rows), *notes.lines()]  # fmt: skip


def kernel_settings(kernels: list[dict], backward: bool) -> str:
    """FlexAttention kernels of one direction: how many, each distinct tile / warps / stages, `IS_DIVISIBLE`."""
    chosen = [k for k in kernels if ("backward" in k["name"]) == backward]
    if not chosen:
        return "none"
    m, n = ("BLOCK_M1", "BLOCK_N1") if backward else ("BLOCK_M", "BLOCK_N")
    tiles = sorted({
        f"{k['constexprs'].get(m)}×{k['constexprs'].get(n)}, {k.get('num_warps')} warps, {k.get('num_stages')} stages"
        for k in chosen
    })  # fmt: skip
    divisible = sum(k["constexprs"].get("IS_DIVISIBLE") == "True" for k in chosen)
    return f"{len(chosen)}: {'; '.join(tiles)}; `IS_DIVISIBLE` in {divisible}"


def flex_kernel_settings() -> list[str]:
    """flex_kernel_configs.py over the inductor caches of bench_prefix_reuse_gpu.py runs: the settings each layout's
    FlexAttention kernels were generated with, beside the run's steps and compiles."""
    notes, rows, shared = Notes(), [], set()
    for name, runs in FLEX_KERNEL_SETTINGS.items():
        data = load(name)
        kernels_of = data.get("runs", data)  # the file's own runs; a file without provenance holds only them
        for label, bench in runs.items():
            run_data = load(bench)
            (row,) = run_data["rows"]
            given = kernels_by_method(row["methods"], kernels_of[label])
            for method, run, kernels in given:
                rows.append(kernel_settings_row(notes, name, bench, run_data, row, method, run, kernels))
            named = {k["name"] for _, _, kernels in given for k in kernels}
            shared |= {k["name"] for k in kernels_of[label]} - named  # a shared cache's kernels no layout alone ran
    shared_line = [
        "Where one inductor cache served two layouts, a kernel goes to the layout whose profiled step alone ran a "
        "kernel of its name; names both ran, or neither, are in neither row: "
        + ", ".join(f"`{k}`" for k in sorted(shared)) + ".", ""
    ] if shared else []  # fmt: skip
    headers = ["model shape, device", "workload", "layout, decoder layers", "timed step",
               "FlexAttention forward kernels: tiles, warps, stages", "backward kernels: the same",
               "arguments not provably multiples of 16", "sources: the run; the kernels"]  # fmt: skip
    return ["", "The settings inductor generated each layout's FlexAttention kernels with (`flex_kernel_configs.py` "
            "over each run's own inductor cache; tiles are query × key rows, the backward's of its key/value "
            "pass):", "", *table(headers, rows), *notes.lines(), *shared_line]  # fmt: skip


def _profiled_names(run: dict) -> set[str]:
    return {k["name"] for k in run.get("profile", {}).get("top_kernels", ())}


def kernels_by_method(methods: dict, kernels: list[dict]) -> list[tuple[str, dict, list[dict]]]:
    """`(method, run, its kernels)` for each method of one bench run: all the cache's kernels where the run had one
    method; else those whose name only that method's profiled step ran."""
    if len(methods) == 1:
        ((method, run),) = methods.items()
        return [(method, run, kernels)]
    names = {method: _profiled_names(run) for method, run in methods.items()}
    return [
        (method, run, [k for k in kernels if k["name"] in names[method]
                       and not any(k["name"] in n for m, n in names.items() if m != method)])
        for method, run in methods.items()
    ]  # fmt: skip


def kernel_settings_row(notes, name, bench, run_data, row, method, run, kernels) -> list[str]:
    """One row of `flex_kernel_settings`: a layout's steps and its FlexAttention kernels' settings."""
    if "incomplete" in run:
        steps_cell = f"cut off after its warm-up ({secs(run['step_s'][0])}, compiling included)"
    else:
        late = sum(run["graphs_compiled"][run_data["warmup"] :])
        steps_cell = f"{secs(run['median_step_s'])}, graphs compiled per step {run['graphs_compiled']}" + (
            f" (the timed step's {late} included)" if late else ""
        )
    hints = {arg for k in kernels for arg in k.get("not_divisible_by_16") or ()}
    recorded = any(k.get("not_divisible_by_16") is not None for k in kernels)
    return [
        f"{MODELS[row['model']]}, {run_data['gpu']}", f"`{row['workload']}`",
        f"{'prefix reuse' if method == 'reuse' else method}, {decoder_layers(run_data)}", steps_cell,
        kernel_settings(kernels, backward=False), kernel_settings(kernels, backward=True),
        ", ".join(f"`{a}`" for a in sorted(hints)) if recorded else "not recorded",
        f"{notes.source(bench)}; {notes.source(name)}",
    ]  # fmt: skip


def agreed(check: dict) -> str:
    """A prefix-reuse agreement check: against the float32 reference where it ran, else the direct difference."""
    if "max_error" in check:
        worst = check["max_error"]
        logps = f"largest error to float32 {worst['candidate']:.1e} against {worst['baseline']:.1e}"
    else:
        logps = f"max abs {check['max_abs']:.1e}"
    return f"{logps}, gradient cosine {check['gradient_cosine']:.6f}"


def prefix_reuse_kept() -> list[str]:
    """bench_prefix_reuse_gpu.py --methods reuse reuse_kept: recomputing each chunk in the backward against keeping
    every chunk's forward graph, paired per step."""
    notes, rows = Notes(), []
    for name in PREFIX_REUSE_KEPT:
        data = load(name)
        for row in data["rows"]:
            cells = []
            for method in ("reuse", "reuse_kept"):
                measured = row["methods"][method]["measured_step_s"]
                cells.append(step_range(statistics.median(measured), measured))
            check = row["agreement_reuse_vs_kept"]
            rows.append([
                f"{MODELS[row['model']]}, {data['gpu']} {data['dtype']}", f"`{row['workload']}`",
                f"{row['unique']:,} rows in chunks of {row['budget']:,}", *cells, ranged(row["paired_reuse_vs_kept"]),
                agreed(check),
                notes.source(name),
            ])  # fmt: skip
    headers = ["model shape, device", "workload", "forest", "recomputing: median step [range]",
               "every graph kept: the same", "recomputing over kept, per step", "agreement (log-probs, gradients)",
               "source"]  # fmt: skip
    return ["", "Prefix reuse keeping every chunk's forward graph for the backward, against recomputing each but the "
            "last there (`bench_prefix_reuse_gpu.py --methods reuse reuse_kept`, each layer checkpointed):", "",
            *table(headers, rows), *notes.lines()]  # fmt: skip


def prefix_reuse_layers() -> list[str]:
    """bench_prefix_reuse_gpu.py --compile --methods reuse reuse_eager: prefix reuse's chunks on the compiled decoder
    layers against the same chunks on the eager ones (`prefix_reuse.LAYERS`), paired per step, each against the
    split; nothing until a file of PREFIX_REUSE_GPU holds the pair."""
    notes, rows = Notes(), []
    for name in PREFIX_REUSE_GPU:
        data = load(name)
        for row in data["rows"]:
            if "paired_layers" not in row:
                continue
            cells = []
            for method in ("reuse_eager", "reuse"):
                run = row["methods"][method]
                cells.append(
                    f"{step_range(run['median_step_s'], run['measured_step_s'])}, first step "
                    f"{run['first_step_s']:.1f} s, {run['peak_gib']:.1f} GiB"
                )
            rows.append([
                f"{MODELS[row['model']]}, {data['gpu']}", f"`{row['workload']}`",
                f"{row['unique']:,} rows in chunks of {row['budget']:,}", *cells, ranged(row["paired_layers"]),
                agreed(row["agreement_layers"]), ranged(row.get("paired_eager")), ranged(row.get("paired")),
                notes.source(name),
            ])  # fmt: skip
    if not rows:
        return []
    headers = ["model shape, device", "workload", "forest", "eager chunks: median step [range], first step, peak",
               "compiled chunks: the same", "eager over compiled, per step", "agreement (log-probs, gradients)",
               "split over eager chunks, per step", "split over compiled chunks, per step", "source"]  # fmt: skip
    return ["", "Prefix reuse with the decoder layers compiled, its chunks run on the compiled layers against the "
            "eager ones (`bench_prefix_reuse_gpu.py --compile --methods reuse reuse_eager`, each in its own process; "
            "the split compiled):", "", *table(headers, rows), *notes.lines()]  # fmt: skip


def flop_ceiling_and_mfu() -> list[str]:
    rows = []
    for name, wl, method in MFU_ROWS:
        run = run_of(name, wl)
        best = max(speedup(run, method, "flat_padded"), speedup(run, method, "flat_packed"))
        rows.append([
            MODELS[run["model"]], workload(run), layers_of(name, method),
            f"{x(run['token_ceiling'])} / {x(run['flop_ceiling'])}",
            f"{100 * best / run['token_ceiling']:.0f}% / {100 * best / run['flop_ceiling']:.0f}%",
            f"**{pct(run[method]['mfu'], 1)}**", pct(run["flat_padded"]["mfu"], 1), pct(run["flat_packed"]["mfu"], 1),
            Notes().source(name),
        ])  # fmt: skip
    headers = ["model", "workload", "layers, recompute", "token / FLOP ceiling", "tree at % of token / FLOP ceiling",
               "MFU tree", "MFU flat padded", "MFU flat packed", "source"]  # fmt: skip
    return table(headers, rows)


def profiles() -> list[str]:
    notes, rows = Notes(), []
    for name in PROFILES:
        data = load(name)
        share = {kind: value["s"] / data["kernel_s"] for kind, value in data["by_kind"].items()}
        rows.append([
            data["method"].replace("_", " "), layers_of(name, data["method"]), secs(data["wall_s"]),
            pct(data["mfu"], 1), pct(data["busy"]), pct(share.get("matmul", 0)),
            f"{pct(share.get('attention_forward', 0), 1)} / {pct(share.get('attention_backward', 0), 1)}",
            pct(share.get("elementwise_reduce", 0) + share.get("copy_fill", 0)),
            pct(share.get("liger", 0) + share.get("triton_other", 0)), notes.source(name),
        ])  # fmt: skip
    headers = ["method", "layers, recompute", "step", "MFU", "GPU busy", "matmul", "attention fwd / bwd",
               "elementwise + copies", "Liger + other Triton", "source"]  # fmt: skip
    flex_rows = []
    for name in FLEX_OPTIONS:
        data, kinds = load(name), load(name)["by_kind"]
        options = command_of(name).split("--flex-kernel-options ")[1].split(" --out")[0]
        flex_rows.append([
            f"`{options}`", secs(data["kernel_s"]), secs(kinds["attention_forward"]["s"]),
            secs(kinds["attention_backward"]["s"]), secs(data["wall_profiled_s"]), Notes().source(name),
        ])  # fmt: skip
    flex_headers = ["FlexAttention `kernel_options`", "kernel time", "attention fwd", "attention bwd", "profiled step",
                    "source"]  # fmt: skip
    return (
        table(headers, rows)
        + notes.lines()
        + ["FlexAttention's kernel options, the same step, eager layers, FlexAttention in every layer:", ""]
        + table(flex_headers, flex_rows)
    )


def trainer_profiles() -> list[str]:
    """Each side's profiled step through `trainer.train()` (bench_async_grpo.py --profile): GPU seconds by kind."""
    notes, rows, gap = Notes(), [], []
    kinds = {
        "matmul": ("matmul",),
        "attention fwd": ("attention_forward",),
        "attention bwd": ("attention_backward",),
        "elementwise + copies": ("elementwise_reduce", "copy_fill"),
        "other Triton": ("triton_other", "liger"),
    }
    for name, wl in TRAINER_PROFILES:
        row = trainer_row(name, wl)
        for side, data in row["sides"].items():
            profile = data.get("profile")
            if not profile:
                continue
            seconds = profile["by_kind"]
            by_kind = {k: sum(seconds.get(n, {}).get("s", 0.0) for n in names) for k, names in kinds.items()}
            rows.append([
                f"{MODELS[row['model']]}, {load(name)['gpu']}", rollout_workload(row), side_label(side, data),
                secs(profile["wall_profiled_s"]), pct(profile["busy"]), secs(profile["kernel_s"]),
                *(f"{secs(v)} ({pct(v / profile['kernel_s'])})" for v in by_kind.values()), notes.source(name),
            ])  # fmt: skip
            if side == "tree" and "mfu" in data:
                attention = by_kind["attention fwd"] + by_kind["attention bwd"]
                gap.append(
                    f"`{wl}` at {MODELS[row['model']]}: the tree's median step {secs(data['median_step_s'])} at "
                    f"{pct(data['mfu'], 1)} MFU; 50% would be a {secs(data['median_step_s'] * data['mfu'] / 0.5)} "
                    f"step. Of the profiled step's {secs(profile['kernel_s'])} of kernels, matmuls take "
                    f"{secs(by_kind['matmul'])} (every layer's forward twice: the recompute "
                    f"`tree_checkpointed_layers` = {data.get('tree_checkpointed_layers')} keeps the peak within "
                    f"TRL's), FlexAttention {secs(attention)} ({pct(attention / profile['kernel_s'])}), elementwise "
                    f"and copies {secs(by_kind['elementwise + copies'])}; the GPU is busy {pct(profile['busy'])} of "
                    "the step."
                )
    headers = ["model", "workload", "side", "profiled step", "GPU busy", "kernel time", *kinds, "source"]
    return table(headers, rows) + notes.lines() + [line + "  " for line in gap] + [""] * bool(gap)


def planner() -> list[str]:
    """TRL's planner on its own rows and on `PlannerRow` (bench_planner.py): seconds per micro-batch, paired."""
    notes, rows = Notes(), []
    for run in load(PLANNER)["rows"]:
        pair, median = run["paired"], run["median_s"]
        rows.append([
            run["workload"], f"{statistics.median(run['samples_per_micro_batch']):.0f}",
            secs(median["trl_tree_row"]), secs(median["planner_row"]),
            f"**{x(pair['median'])}** [{x(pair['min'])}, {x(pair['max'])}]" + " (FAILED)" * pair["failed"],
            "yes" if run["same_micro_batches"] else "**no**", notes.source(PLANNER),
        ])  # fmt: skip
    headers = ["workload", "samples per micro-batch", "TRL's `TreeRow`", "`PlannerRow`", "paired, TRL's / ours",
               "same micro-batches", "source"]  # fmt: skip
    return table(headers, rows) + notes.lines()


def side_label(side: str, data: dict) -> str:
    """A side of bench_async_grpo.py as the tables name it: TRL's trainer at its defaults or regionally compiled,
    the tree with the FlexAttention backend it ran on where that was FlashAttention-4's."""
    if side.startswith("trl"):
        return "TRL compiled" if side == "trl_compiled" else "TRL"
    flash = (data.get("flex_kernel_options") or {}).get("BACKEND") == "FLASH"
    return "tree" + " (FlexAttention on FlashAttention-4)" * flash


def generation_modes() -> list[str]:
    notes, rows = Notes(), []

    def row(mode: str, side: str, step: float, generation: float, phase: float, steps: str, name: str) -> list[str]:
        return [f"`{mode}`", side, secs(step), f"{secs(generation)} ({pct(generation / step)})",
                f"{secs(phase)} ({pct(phase / step)})", steps, notes.source(name)]  # fmt: skip

    for name, mode in THROUGH_TRAINER_PAIRED:
        sides = trainer_row(name, mode)["sides"]
        for side, key in (("tree", "tree"), ("TRL", "trl")):
            r = sides[key]
            rows.append(row(mode, side, r["median_step_s"], r["median_generation_s"], r["median_trainer_phase_s"],
                            f"{len(r['measured_step_s'])} (median)", name))  # fmt: skip
    for mode, tree_file, flat_file in THROUGH_TRAINER:
        for side, name in (("tree", tree_file), ("TRL", flat_file)):
            if name.endswith(".log"):
                for i, s in enumerate(printed_steps(name), 1):
                    rows.append(row(mode, f"TRL, step {i}", s["step"], s["generation"],
                                    s["logprob_forwards"] + s["backward"], "—", name))  # fmt: skip
                continue
            result = load(name)["results"][mode]["tree" if side == "tree" else "flat"]
            mean = result["mean"]
            rows.append(row(mode, side, mean["step"], mean["generation"], mean["trainer_phase"],
                            f"{len(result['steps'])} (mean)", name))  # fmt: skip
    headers = ["generation", "trainer", "step", "generation (share)", "trainer phase (share)", "steps measured",
               "source"]  # fmt: skip
    e2e = load("tree_vs_flat_h200_qwen3-0.6b.json")["e2e"]["qwen3-0.6b"]
    spec = e2e["spec"]
    return table(headers, rows) + notes.lines() + [
        f"With HF `generate` and the benchmark loop's trainer phase at G={spec['G']}, P={spec['prompt']:,}, "
        f"C={spec['completion']} (Qwen3-0.6B shape, one group): generation {secs(e2e['generate_s'])}, trainer phase "
        f"{secs(e2e['trainer_phase_s'])}, {pct(e2e['trainer_share'], 1)} of the step "
        f"({Notes().source('tree_vs_flat_h200_qwen3-0.6b.json')}).",
        "",
    ]  # fmt: skip


def gdn_kernels(described: str | None) -> str:
    """The Gated DeltaNet kernels a run recorded (`gdn_kernels.describe`); older runs ran the torch ones."""
    if not described or described.startswith("torch") or described.endswith(".torch_chunk_gated_delta_rule"):
        return "transformers' torch reference"
    return re.sub(r" \(fwd .*?(, dqkwg on (\w+) in .*)?\)$", lambda m: f", dqkwg on {m[2]}" if m[2] else "", described)


def hybrids() -> list[str]:
    notes, rows = Notes(), []
    for name in HYBRID_ROWS:
        run = run_of(name)
        rows.append([
            MODELS[run["model"]], workload(run), gdn_kernels(run["tree"].get("gdn_kernels")),
            str(int(run["tree"]["levels"])),
            f"{x(run['token_ceiling'])} / {x(run['flop_ceiling'])}", loop_ratio(run, bold=True),
            loop_ratio(run, over="flat_packed"), f"{run['pct_of_flop_ceiling']:.0f}%",
            f"{pct(run['tree']['mfu'], 1)} / {pct(run['flat_padded']['mfu'], 1)}",
            x(run["tree"]["peak_gib"] / run["flat_padded"]["peak_gib"]), notes.source(name),
        ])  # fmt: skip
    headers = ["model", "workload", "Gated DeltaNet kernels", "levels", "token / FLOP ceiling", "tree vs flat padded",
               "tree vs flat packed",
               "% of FLOP ceiling", "MFU tree / flat padded", "peak tree / flat padded", "source"]  # fmt: skip
    level_rows, level_notes = [], Notes()
    for name in LEVELS:
        data = load(name)
        for wl, r in data["runs"].items():
            extra = r["by_level_over_one_call"]
            level_rows.append([
                data["device"], f"{data['heads']} heads × {data['dim']}, {data['dtype'].removeprefix('torch.')}",
                gdn_kernels(r.get("kernels")),
                WORKLOADS.get(wl, wl.replace("_", " ")), str(r["levels"]), f"{r['tree_tokens']:,}",
                secs(r["by_level_s"]), secs(r["one_call_s"]), f"{extra:+.1%}",
                f"{r['per_level_ms']:.2f} ms" if extra > 0 else "—",
                f"{r['per_level_ms_device_bounds']:.2f} ms" if "per_level_ms_device_bounds" in r else "—",
                f"{secs(r['two_pass_s'])} ({r['two_pass_over_one_call']:+.1%})" if "two_pass_s" in r else "—",
                level_notes.source(name),
            ])  # fmt: skip
    level_headers = ["device", "scan", "kernels", "tree", "levels", "tree tokens", "level by level",
                     "one call, same tokens", "extra", "per level", "per level, bounds read back per call",
                     "two calls (extra)", "source"]  # fmt: skip
    return (
        table(headers, rows + pending("hybrids", len(headers)))
        + notes.lines()
        + [
            "Going level by level, one Gated DeltaNet scan alone (forward + backward), against one call over as many "
            "tokens (where the kernel takes each level's boundaries on the host, fla 0.6's `cu_seqlens_cpu`, the tree "
            "passes them; the last column times the same scan with them withheld, the kernel reading them back from "
            "the device at each call), and in two calls whatever the depth (a delta rule's state is linear in the "
            "state it starts from: one call over the segments whose final states are read, a small matrix product per "
            "level, one call over every segment; the tree takes it from 3 levels on):",
            "",
        ]  # fmt: skip
        + table(level_headers, level_rows)
        + level_notes.lines()
    )


PACKAGES = {"flash-qla": "FlashQLA", "flash-linear-attention": "fla", "tilelang": "TileLang"}
# A step line of gpu_hybrid_kernels.sh: `NAME: rc=N in|at T s ...` or `NAME: skipped, out of time ...`.
STEP_LINE = re.compile(r"^(?!check )(\S.*?): (rc=\d+ (?:in|at) \d+ s.*|skipped, out of time.*)$")


def kernel_checks() -> list[str]:
    """The Gated DeltaNet kernel routes against the torch reference (gdn_kernel_check.py), then what the calls of
    gpu_hybrid_kernels.sh ran on them (parity tests, benchmark rows) and how each step ended."""
    rows, notes = [], Notes()
    for name in KERNEL_CHECKS:
        rows += check_rows(load(name), notes.source(name))
    headers = ["route", "packages", "kernels that ran", "case", "fla's Hopper refusal lifted",
               "worst rms(diff) / rms(reference)", "NaN", "first / second call", "result", "the check",
               "source"]  # fmt: skip
    run_rows = []
    for name in KERNEL_RUNS:
        for line in text(name).splitlines():
            if match := STEP_LINE.match(line):
                run_rows.append([match.group(1), match.group(2), Notes().source(name)])
    return (
        ["Each route's kernel check: the gate case first, the others as time allowed:", ""]
        + table(headers, rows)
        + notes.lines()
        + ["What ran on the routes after their checks, step by step (exit 124: the step's time limit; pytest's "
           "exit 5: no test selected):", ""]
        + table(["step", "how it ended", "source"], run_rows)
    )  # fmt: skip


def check_rows(data: dict, source: str) -> list[list[str]]:
    """The rows of one kernel-check file: gpu_hybrid_kernels.sh's (every route's check, with its steps) or one
    gdn_kernel_check.py run (every case it ran was written)."""
    if "checks" in data:
        checks = data["checks"]
        exits = dict(re.findall(r"^check (\S+): rc=(\d+)", "\n".join(data["steps"]), flags=re.M))
    else:
        checks = {data["label"]: data}
        exits = {data["label"]: "0"}
    rows = []
    for label, check in checks.items():
        versions = check["versions"]
        packages = ", ".join(f"{PACKAGES[k]} {versions[k]}" for k in PACKAGES if versions.get(k))
        dims = re.search(r"--head-dims ([\d ]+)", check.get("command", ""))
        every = f"its cases of K = {dims[1].strip()}" if dims else "all its cases"
        ran = {"0": every, "124": f"its time limit stopped it after {len(check['cases'])} case(s)"}
        for case in check["cases"]:
            nan = [k for k, e in case.get("errors", {}).items() if e["nan"]]
            calls = (
                f"{case['first_call_s']:.0f} s / {1000 * case['second_call_s']:.0f} ms"
                if "second_call_s" in case
                else "—"
            )
            rows.append([
                f"`{label}`", packages, case.get("kernels") or case.get("reason", "—"),
                f"K = V = {case['K']}, {case['heads']} heads, {case['dtype']}",
                "yes" if case["guard_lifted"] else "no",
                f"{case['worst_rms_ratio']:.1e} (≤ {case['tolerance']:.0e})" if "worst_rms_ratio" in case else "—",
                ", ".join(nan) or "none",
                calls,
                f"**{case['status']}**", ran.get(exits.get(label), f"exit {exits.get(label)}"), source,
            ])  # fmt: skip
    return rows


def prefix_kernels() -> list[str]:
    first, second = (load(name)["rows"] for name in PREFIX_RUNS)
    rows = []
    for key, row in first.items():
        s = row["shape"]
        spec = {"groups": s["groups"], "G": s["G"], "prompt": s["P"], "completion": s["C"]}
        rows.append([
            f"{s['heads']} / {s['kv_heads']}", f"{s['groups']} × ({s['P']:,} + {s['G']} × {s['C']:,})",
            f"{row['tree_tokens']:,}", f"{row['flex']['forward_ms']:.2f} → {row['prefix']['forward_ms']:.2f} ms",
            f"{row['flex']['forward_backward_ms']:.2f} → {row['prefix']['forward_backward_ms']:.2f} ms",
            f"**{x(row['speedup_step'])}**", x(second[key]["speedup_step"]),
            "kernels" if kernels_serve(spec) else "FlexAttention",
        ])  # fmt: skip
    headers = ["q / kv heads", "groups × (P + G × C)", "tokens", "forward, FlexAttention → kernels",
               "forward + backward", "per step", "per step, second run", "the CUDA rule picks"]  # fmt: skip
    parts, part_rows = load(PREFIX_PARTS), []
    for key, calls in parts["parts"].items():
        cells = [f"{int(key.split('_P')[1].split('_')[0]):,} + {key.split('_G')[1].split('_')[0]} × "
                 f"{int(key.split('_C')[1]):,}"]  # fmt: skip
        for call in ("prompt_causal", "completions_over_prompt", "own"):
            cells.append(f"{calls[call]['forward_ms']:.3f} ms ({calls[call]['forward_tflops']:.0f} TFLOPS)")
        cells.append(f"{calls['merge']['fused_ms']:.3f} ms (as PyTorch ops: {calls['merge']['pytorch_ops_ms']:.3f})")
        trees = max(parts["per_tree"][key], key=int)
        many = parts["per_tree"][key][trees]
        cells.append(f"{trees} trees: {many['gpu_ms']:.2f} / {many['host_ms']:.2f} ms")
        part_rows.append(cells)
    part_headers = ["tree (P + G × C), 16 / 8 heads", "prompt, causal", "completions over the prompt",
                    "completions' own parts", "merge (Triton)", "whole op, GPU / host time to issue"]  # fmt: skip
    sources = " and ".join(Notes().source(name) for name in PREFIX_RUNS)
    return (
        table(headers, rows)
        + [f"Sources: {sources}, two runs of the same command.", ""]
        + [
            "Where a tree's forward goes: each cuDNN call and the merge, one tree; then the whole op on several "
            "trees, its GPU time against the host's time to issue it:",
            "",
        ]  # fmt: skip
        + table(part_headers, part_rows)
        + [f"Source: {Notes().source(PREFIX_PARTS)}.", ""]
        + gathered_paths()
        + flash_attention()
    )


def gathered_paths() -> list[str]:
    """FlexAttention's tree mask against one varlen flash call over each segment's gathered path."""
    rows = []
    for name in GATHERED_PATHS:
        run = load(name)
        forests = run["rows"]
        cells = [WORKLOADS.get(run["workload"], run["workload"]), str(len(forests))]
        for kernel in ("flex", "flash_gathered", "cudnn_gathered"):
            good = [r[kernel] for r in forests if "error" not in r[kernel]]
            cells.append(f"{statistics.median(r['repeat_ms'] for r in good):.1f} ms "
                         f"({statistics.median(r['tflops'] for r in good):.0f})" if good else "refused")  # fmt: skip
        ratios = [r["flex"]["repeat_ms"] / r["flash_gathered"]["repeat_ms"] for r in forests]
        cells.append(f"{x(statistics.median(ratios))} [{x(min(ratios))}, {x(max(ratios))}]")
        keys = statistics.median(r["gathered_keys"] / r["tree_tokens"] for r in forests)
        cells.append(f"{keys:.1f}×")
        useful = [r["tiles"]["useful"] for r in load(TILES)["workloads"][run["workload"]]]
        cells.append(f"{pct(statistics.median(useful))} [{pct(min(useful))}, {pct(max(useful))}]")
        worst = {k: max(r[k].get("max_abs_vs_flex", 0) for r in forests) for k in ("flash_gathered", "cudnn_gathered")}
        cells.append(f"{worst['flash_gathered']:.3g} / {worst['cudnn_gathered']:.3g}")
        cells.append(Notes().source(name))
        rows.append(cells)
    headers = ["workload", "forests", "FlexAttention, ms (TFLOP/s)", "flash varlen, gathered paths",
               "cuDNN ragged, gathered paths", "FlexAttention's time over flash's, median [min, max]",
               "gathered keys / forest rows", "FlexAttention's blocks: pairs that attend",
               "max |out - FlexAttention|, flash / cuDNN", "source"]  # fmt: skip
    return [
        "Tree attention without a mask: each segment's rows as one varlen sequence whose keys are its gathered path "
        "(ancestor segments, then its own rows), causal aligned to the bottom right, in one call of PyTorch's "
        "FlashAttention-2 varlen op or cuDNN's ragged attention, against FlexAttention's tree mask "
        "(`attention_gathered_paths.py`): forward + backward on forests new to each kernel, Qwen3-1.7B heads, "
        "bf16, median over the forests of the repeated call. The flash route is exact (its outputs agree with "
        "FlexAttention's to bf16 rounding) and slower on both workloads; cuDNN's ragged op as PyTorch calls it "
        "does not give the tree mask (its causal alignment differs) and is slower still. FlexAttention wastes little "
        "on these masks: of the pairs in the 128 x 128 blocks it computes, the share that attend (median [min, max] "
        f"over the same seeded forests, counted on CPU: {Notes().source(TILES)}):",
        "",
    ] + table(headers, rows)


def flash_attention() -> list[str]:
    """FlexAttention on FlashAttention-4's kernels against its Triton kernels: attention alone, then through
    trainer.train()."""
    notes, rows = Notes(), []
    for name in FLASH_ATTENTION:
        run = load(name)
        forests = run["rows"]
        for kernel in run["kernels"]:
            good = [r[kernel] for r in forests if "error" not in r[kernel]]
            if not good:
                rows.append([f"`{kernel}`", "refused", "", "", "", "", notes.source(name)])
                continue
            ratios = [r["flex"]["repeat_ms"] / r[kernel]["repeat_ms"] for r in forests]
            rows.append([
                f"`{kernel}`", f"{statistics.median(r['repeat_ms'] for r in good):.1f} ms",
                f"{statistics.median(r['tflops'] for r in good):.0f}",
                f"{statistics.median(r['first_ms'] for r in good):.1f} ms",
                "—" if kernel == "flex" else f"{x(statistics.median(ratios))} [{x(min(ratios))}, {x(max(ratios))}]",
                "—" if kernel == "flex" else f"{max(r['max_abs_vs_flex'] for r in good):.3g} / "
                f"{max(r['max_grad_abs_vs_flex'] for r in good):.3g}",
                notes.source(name),
            ])  # fmt: skip
    headers = ["kernel", "forward + backward, median", "TFLOP/s", "first call (new forest)",
               "FlexAttention (Triton) over it, per forest", "max abs out / grad vs FlexAttention (Triton)",
               "source"]  # fmt: skip
    trainer_rows = []
    for name in FLASH_ASYNC:
        data = load(name)
        for row in data["rows"]:
            base = "tree_triton" if "tree_triton" in row["sides"] else "tree"  # the tree on the Triton kernels
            for side, run in row["sides"].items():
                if side == "reference":
                    continue
                if "error" in run:
                    errors = [line for line in run.get("output_tail", "").splitlines() if "Error: " in line]
                    cells = [f"failed: {errors[-1].split(': ', 1)[-1] if errors else run['error']}"] + [""] * 5
                else:
                    cells = [secs(run["median_step_s"]), pct(run["mfu"], 1), f"{run['peak_gib']:.1f} GiB",
                             "—" if side == base else ranged(row["paired"].get(f"{side} vs {base}")),
                             "—" if side == "trl" else ranged(row["paired"].get(f"{side} vs trl")),
                             float32_error(row["agreement"], side)]  # fmt: skip
                trainer_rows.append([f"{MODELS[row['model']]}, {data['gpu']}", f"`{row['workload']}`", f"`{side}`",
                                     *cells, notes.source(name)])  # fmt: skip
    trainer_headers = ["model shape, device", "workload", "side", "median step", "MFU", "peak",
                       "over the tree on Triton kernels, per step", "over TRL, per step",
                       "log-probs: max / mean error to float32 (checks passed)", "source"]  # fmt: skip
    return (
        [
            "FlashAttention-4's kernels on the same GRPO forests (`attention_gathered_paths.py --kernels flex "
            "flex_flash fa4_gathered prefix_fa4 prefix_cudnn`): FlexAttention's FLASH backend behind the same tree "
            "block mask (`flex_flash`), one FlashAttention-4 varlen call over gathered paths (`fa4_gathered`), the "
            "shared-prefix attention on FlashAttention-4's and on cuDNN's varlen kernels (`prefix_fa4`, "
            "`prefix_cudnn`), forward + backward, bf16, Qwen3-1.7B heads:",
            "",
        ]
        + table(headers, rows)
        + [
            "The same kernels in `TreeAsyncGRPOTrainer` through `trainer.train()` (`bench_async_grpo.py --sides "
            "reference tree tree_flash tree_fa4 trl`), each side in its own process, 2 warm-up and 8 measured steps "
            "on the same replayed samples, compiled layers: `tree` at its defaults, which were FlexAttention's "
            "Triton kernels when these rows ran (`tree_triton` names that side now that the trainers default to "
            "FlashAttention-4 where it is installed), "
            '`tree_flash` with `HF_TREE_ATTN_FLEX_KERNEL_OPTIONS={"BACKEND": "FLASH"}` (FlexAttention on '
            "FlashAttention-4's kernels, the tree masks in buffers of static size), `tree_fa4` with "
            "`HF_TREE_ATTN_PREFIX_KERNEL=fa4` (the shared-prefix attention on FlashAttention-4's varlen kernels), "
            "`trl` TRL's `AsyncGRPOTrainer` at its defaults. A ratio is the other side's step over this side's on the "
            "same step, median [min, max] of the 8. Each side's per-token log-probabilities on the first micro-batch "
            "against a float32 run of TRL's trainer (`reference`); a check passes when a side's error is at most "
            "twice the other's plus one bf16 rounding:",
            "",
        ]
        + table(trainer_headers, trainer_rows)
        + notes.lines()
    )


def float32_error(agreement: dict, side: str) -> str:
    """A side's largest and mean log-prob error to the float32 run, read from the checks it takes part in, and how
    many of those passed."""
    checks = [(check, role) for pair, check in agreement.items() for role, name in zip(("candidate", "baseline"),
              pair.split(" vs ")) if name == side and "max_error" in check]  # fmt: skip
    if not checks:
        return "—"
    check, role = checks[0]
    passed = sum(c["passed"] for c, _ in checks)
    failed = "" if passed == len(checks) else " **failed**"
    return f"{check['max_error'][role]:.3g} / {check['mean_error'][role]:.3g} ({passed} of {len(checks)}){failed}"


def balance() -> list[str]:
    sim = load("balance_simulation.json")
    rows, ranks = [], list(sim["workloads"]["grpo_mixed_prompts"]["settings"][0]["by_ranks"])
    for wl, spec in sim["workloads"].items():
        (setting,) = [s for s in spec["settings"] if (s["groups_per_micro_batch"], s["micro_batches"]) == (2, 4)]
        by = setting["by_ranks"]
        rows.append([WORKLOADS[wl]] + [f"{by[r]['imbalance_trl']:.3f} → **{by[r]['imbalance_balanced']:.3f}**"
                                       for r in ranks])  # fmt: skip
    cpu_rows = []
    for config, result in load("balance_cpu_2proc.json")["configs"].items():
        before, after = result["balance/imbalance_before"], result["balance/imbalance_after"]
        cpu_rows.append([
            config.replace("_", " "), f"{result['loss']:.7f}",
            "—" if before is None else f"{before:.3f} → {after:.3f}",
            secs(max(rank["median_step_s"] for rank in result["per_rank"])),
        ])  # fmt: skip
    return (
        [
            "Simulated step cost over the ideal (1.0), TRL's assignment → `tree_balance`, 2 groups per rank per "
            f"micro-batch, 4 micro-batches per step, mean of {sim['trials']} draws; Qwen3-1.7B-shaped costs "
            f"(the file also has 1–4 groups, 1–8 micro-batches, p90 and a lower bound): "
            f"{Notes().source('balance_simulation.json')}",
            "",
        ]  # fmt: skip
        + table(["workload", *[f"{r} ranks" for r in ranks]], rows)
        + [f"Two gloo processes on CPU, a 2-layer Qwen3 shape, DDP: {Notes().source('balance_cpu_2proc.json')}", ""]
        + table(["configuration", "loss", "estimated imbalance", "median step"], cpu_rows)
        + table(["on GPUs", "result"], pending("balance", 2))
    )


def rollout_workload(row: dict) -> str:
    """A bench_async_grpo.py row's workload from its spec."""
    spec = row["spec"]
    if "system" in spec:
        return (f"τ²-like agent: {spec['system']:,}-token system prompt, {spec['turns']} turns, "
                f"{spec['branches']} responses per turn")  # fmt: skip
    return f"G={spec['G']}, P ~ {spec['prompt']}, C ~ {spec['completion']}"


PAIRED_INTRO = (
    "Each side in its own process (`harness.run_side`), 2 warm-up and 8 measured optimizer steps on the same data; a "
    "ratio is TRL's step over the tree's on the same step, median [min, max] of the 8. Agreement: on the first "
    "micro-batch, each side's per-token log-probabilities against a float32 run of TRL's trainer on the same tokens, "
    "at most twice the other side's error plus one bf16 rounding (and the same batches, no tree fallback); a pair "
    "that fails is marked failed. Peak memory: each process's own, after the warm-up."
)


FLA_ASYNC_HEADERS = [
    "model", "workload", "token budget", "median step, tree", "first step", "packing", "MFU", "peak GiB", "source"
]  # fmt: skip


def ranged(pair: dict | None) -> str:
    """A paired ratio: the median per-step ratio with its range, and whether the row's agreement check failed."""
    if not pair or "median" not in pair:
        return "—" if not pair else pair.get("error", "—")
    failed = " **agreement failed**" if pair.get("failed") else ""
    return f"**{x(pair['median'])}** [{x(pair['min'])}, {x(pair['max'])}]{failed}"


def peers_paired(notes: Notes) -> list[str]:
    """The paired rows (bench_async_grpo.py on the harness): every side in its own process, per-step ratios."""
    rows = []
    for name, wl in ASYNC_PAIRED:
        row = trainer_row(name, wl)
        sides, pairs = row["sides"], row["paired"]
        # TRL's side: at its defaults, or compiled where a run measured only that one (as the 8B default rows)
        trl = sides["trl"] if "trl" in sides else sides["trl_compiled"]
        tree = sides["tree"]
        medians = " / ".join(
            secs(sides[s]["median_step_s"]) if "median_step_s" in sides.get(s, {}) else "—"
            for s in ("trl", "trl_compiled", "tree", "tree_eager")
        )
        firsts = " / ".join(f"{sides[s]['first_step_s']:.1f}" if s in sides else "—" for s in ("trl", "tree"))
        checks = row["agreement"].values()
        agreed = f"{sum(c['passed'] for c in checks)} of {len(checks)} pairs"
        rows.append([
            MODELS[row["model"]], rollout_workload(row), medians, firsts + " s", ranged(pairs.get("tree vs trl")),
            ranged(pairs.get("tree vs trl_compiled")), ranged(pairs.get("tree_eager vs trl")),
            f"{pct(tree['mfu'], 1)} / {pct(trl['mfu'], 1)}", f"{tree['peak_gib']:.1f} / {trl['peak_gib']:.1f}",
            agreed, notes.source(name),
        ])  # fmt: skip
    headers = ["model", "workload", "median step: TRL / TRL compiled / tree / tree eager", "first step TRL / tree",
               "tree vs TRL", "tree vs TRL compiled", "tree eager vs TRL", "MFU tree / TRL (TRL compiled where "
               "TRL's defaults did not run)", "peak GiB tree / TRL (the same)", "agreement", "source"]  # fmt: skip
    return [
        "Each side in its own process (`harness.run_side`), 2 warm-up and 8 measured optimizer steps on the same "
        "replayed samples; a ratio is TRL's step over the tree's on the same step, median [min, max] of the 8. "
        "`tree`: the defaults (decoder layers compiled in place, inductor, dynamic shapes); `tree eager`: "
        "`tree_compile=False`; `TRL compiled`: accelerate's regional compilation "
        "(`ACCELERATE_DYNAMO_BACKEND=INDUCTOR`, `..._USE_REGIONAL_COMPILATION=1`, `..._USE_DYNAMIC=1`). Agreement: on "
        "the first micro-batch, each side's per-token log-probabilities against a float32 run of TRL's trainer on the "
        "same tokens, at most twice the other side's error plus one bf16 rounding. Peak memory: each process's own, "
        "after the warm-up.",
        "",
    ] + table(headers, rows)


def peers() -> list[str]:
    notes = Notes()
    paired_rows = peers_paired(notes)
    alone = []
    for name in ASYNC_TREE_ONLY:
        (row,) = load(name)["rows"]
        trl, tree = row["sides"]["trl"], row["sides"]["tree"]
        alone.append([
            MODELS[row["model"]], rollout_workload(row), f"{load(name)['token_budget']:,}", steps(tree["step_s"]),
            pct(tree["mfu"], 1), f"{tree['peak_gib']:.1f}", trl["error"].split(". ")[0], notes.source(name),
        ])  # fmt: skip
    on_fla = []
    for name in ASYNC_TREE_ONLY_FLA:
        for row in load(name)["rows"]:
            tree = row["sides"]["tree"]
            measured = tree["measured_step_s"]
            on_fla.append([
                MODELS[row["model"]], rollout_workload(row), f"{load(name)['token_budget']:,}",
                step_range(tree["median_step_s"], measured),
                f"{tree['first_step_s']:.1f} s", x(tree["packing_ratio"]), pct(tree["mfu"], 1),
                f"{tree['peak_gib']:.1f}", notes.source(name),
            ])  # fmt: skip
    paths = []
    for what, name in ASYNC_ATTENTION_PATHS.items():
        tree = next(r for r in load(name)["rows"] if r["workload"] == "grpo_mixed")["sides"]["tree"]
        busy = f"{pct(tree['profile']['busy'])}" if tree.get("profile") else "—"
        paths.append([what, steps(tree["step_s"]), secs(tree["median_step_s"]), busy, notes.source(name)])
    shapes = load(PREFIX_NEW_SHAPES)
    medians = shapes["median"]
    first, repeat = (secs(medians["prefix_cudnn"][when] / 1e3) for when in ("first_ms", "repeat_ms"))
    flex_first, flex_repeat = (secs(medians["flex"][when] / 1e3) for when in ("first_ms", "repeat_ms"))
    return (
        paired_rows
        + [
            "Where TRL's async trainer refuses the model (the tree alone, Gated DeltaNet on transformers' torch "
            "kernels):",
            "",
        ]
        + table(
            ["model", "workload", "token budget", "step, tree", "MFU", "peak GiB", "TRL's trainer", "source"], alone
        )  # fmt: skip
        + [
            "The same trainer on fla's Triton kernels (`--gdn-route fla_triton`: on forests of 3 or more levels the "
            "delta rule in two kernel calls, see [Hybrid models](#hybrid-models)), 2 warm-up and 8 measured optimizer "
            "steps through `trainer.train()`, the tree alone (TRL's trainer refuses these models). Median step of the "
            "8 [min, max]; packing: TRL's `batch/packing_ratio` metric, the step's samples' tokens over the tokens "
            "forwarded:",
            "",
        ]
        + table(FLA_ASYNC_HEADERS, on_fla)
        + [
            "The tree side of the Qwen3-1.7B `grpo_mixed` rows per attention path. Each of TRL's rows packs a few "
            "prompts' groups; their lengths differ from row to row, so every forest is new to cuDNN, which builds "
            "an execution graph on the host for each new call signature (lengths and strides) before its kernel "
            "runs. With the kernels on every forest the GPU sat idle half of the step:",
            "",
        ]
        + table(
            ["tree attention", "step (each measured step)", "median step", "GPU busy (profiled step)", "source"], paths
        )  # fmt: skip
        + notes.lines()
        + [
            f"Attention alone on {len(shapes['rows'])} such forests (Qwen3-1.7B heads, forward + backward, bf16): "
            f"the shared-prefix kernels' first call on a forest takes {first} (median), a repeat {repeat}; "
            f"FlexAttention {flex_first} and {flex_repeat} {Notes().source(PREFIX_NEW_SHAPES)}. So on CUDA the "
            "kernels take a forest only once its call "
            "signature came before (`warm_on_cuda`): a fixed-length workload from its second forest on.",
            "",
        ]
        + table(["measurement", "result"], pending("peers", 2))
    )


def beyond_grpo() -> list[str]:
    notes, rows, paired_rows = Notes(), [], []
    for name in BEYOND_PAIRED:
        for row in load(name)["rows"]:
            trl, tree = row["sides"]["trl"], row["sides"]["tree"]
            checks = row["agreement"].values()
            paired_rows.append([
                f"`{row['workload']}`", row["spec"], MODELS[row["model"]],
                f"{secs(trl['median_step_s'])} / {secs(tree['median_step_s'])}",
                f"{trl['first_step_s']:.1f} / {tree['first_step_s']:.1f} s", ranged(row["paired"].get("tree vs trl")),
                x(tree["token_ceiling"]), f"{pct(tree['mfu'], 1)} / {pct(trl['mfu'], 1)}",
                f"{tree['peak_gib']:.1f} / {trl['peak_gib']:.1f}",
                f"{sum(c['passed'] for c in checks)} of {len(checks)} pairs", notes.source(name),
            ])  # fmt: skip
    for name in BEYOND_GRPO:
        for run in load(name)["runs"]:
            if "error" in run:  # a workload that failed: the file's note says what happened
                notes.source(name)
                continue
            trl, tree = run["trl"], run["tree"]
            reward = (
                f"{secs(trl['reward_time_s'])} / {secs(tree['reward_time_s'])} (**{x(run['reward_speedup'])}**)"
                if "reward_speedup" in run
                else "—"
            )
            rows.append([
                f"`{run['workload']}`", run["description"], MODELS[run["model"]], steps(trl["step_times_s"]),
                steps(tree["step_times_s"]), f"**{x(run['speedup'])}**", reward, x(run["token_ceiling"]),
                pct(run["share_of_token_ceiling"]), f"{tree['peak_gib']:.1f} / {trl['peak_gib']:.1f}",
                f"{run['max_loss_diff']:.4f}", notes.source(name),
            ])  # fmt: skip
    headers = ["workload", "batch", "model", "step, TRL (each step)", "step, tree", "tree vs TRL (median measured)",
               "reward model per step, TRL / tree", "token ceiling", "% of ceiling", "peak GiB tree / TRL",
               "max loss diff", "source"]  # fmt: skip
    paired_headers = ["workload", "batch", "model", "median step TRL / tree", "first step TRL / tree", "tree vs TRL",
                      "token ceiling", "MFU tree / TRL", "peak GiB tree / TRL", "agreement", "source"]  # fmt: skip
    left = pending("beyond_grpo", 2)
    return (
        [PAIRED_INTRO, ""]
        + table(paired_headers, paired_rows)
        + ["Earlier rows (older code: both sides in one process, a ratio of the median steps):", ""]
        + table(headers, rows)
        + notes.lines()
        + (table(["measurement", "result"], left) if left else [])
    )


def test_outcome(name: str) -> str:
    """What a pytest log says: its summary line, else the outcomes it printed (`-v` lines or `-q` progress marks);
    the failures by name, with the first assertion's text; the test a time limit stopped a `-v` run in."""
    lines = [line for line in text(name).splitlines() if line.strip()]
    marks = {".": "passed", "F": "failed", "s": "skipped", "E": "error", "x": "xfailed"}
    outcomes, current, failed = [], None, []
    for line in lines:
        if match := re.match(r"tests/\S+::(\S+)", line):
            current = match.group(1)
        if (match := re.search(r"\b(PASSED|FAILED|SKIPPED|ERROR)(\s+\[\s*\d+%\])?$", line.strip())) and current:  # -v
            outcomes.append(match.group(1).lower())
            failed += [current] * (match.group(1) == "FAILED")
            current = None
        if match := re.match(r"^\[gw\d+\] \[\s*\d+%\] (PASSED|FAILED|SKIPPED|ERROR) tests/\S+::(\S+)", line):  # -v -n
            outcomes.append(match.group(1).lower())
            failed += [match.group(2)] * (match.group(1) == "FAILED" and match.group(2) not in failed)
        if match := re.match(r"^([.FEsx]+)\s+\[\s*\d+%\]$", line):  # -q
            outcomes += [marks[mark] for mark in match.group(1)]
        if match := re.match(r"^FAILED tests/\S+::(\S+)", line):
            failed += [match.group(1)] * (match.group(1) not in failed)
    summary = [line for line in lines if re.search(r"\d+ (passed|failed)", line)]
    runs = re.split(r"collected \d+ items?", text(name))[1:]
    if len(runs) > 1:  # one pytest process per test, their logs one after another
        counts = Counter()
        for run in runs:
            ends = re.findall(r"^=+ (.*\d+ (?:passed|failed|skipped|error).*) in [\d.]+s", run, flags=re.M)
            counts.update(dict((o, int(n)) for n, o in re.findall(r"(\d+) (\w+)", ends[-1])) if ends else {})
            counts["without a result (killed)"] += not ends
        order = ["passed", "failed", "error", "skipped", "without a result (killed)"]
        ranked = sorted(counts, key=lambda o: order.index(o) if o in order else len(order))
        result = ", ".join(f"{counts[o]} {o}" for o in ranked if counts[o]) + f" ({len(runs)} pytest processes)"
    elif summary:
        result = re.sub(r"=+", "", summary[-1]).strip()
    else:
        result = ", ".join(f"{outcomes.count(o)} {o}" for o in marks.values() if o in outcomes)
    if failed:
        error = next((line.split(maxsplit=1)[1] for line in lines if re.match(r"^E\s+AssertionError", line)), None)
        result += "; failed: " + ", ".join(f"`{test}`" for test in failed) + (f" (`{error}`)" if error else "")
    if match := re.match(r"tests/\S+::(\S+)$", lines[-1].strip()):  # a -v run that ended inside a test
        result += f"; stopped by its time limit in `{match.group(1)}`"
    elif "KeyboardInterrupt" in text(name):
        result += "; stopped by its time limit"
    return result


def correctness() -> list[str]:
    rows = []
    for name in GRAD_CHECKS:
        data = load(name)
        layers = re.search(r"--layers (\d+)", data["command"])
        for variant, methods in data.items():
            for method, params in methods.items() if variant not in ("command", "eager") else ():
                cos, norm = [p["cos"] for p in params.values()], [p["norm_ratio"] for p in params.values()]
                verdict = "**wrong**" if min(cos) < 0.9 else "agrees" if min(cos) > 0.99 else "differs"
                rows.append([
                    VARIANTS[variant], layers.group(1) if layers else "36", method.replace("_", " "),
                    f"{min(cos):.4f}", f"{min(norm):.3f}–{max(norm):.3f}", verdict, Notes().source(name),
                ])  # fmt: skip
    headers = ["layer kernels", "layers of the Qwen3-8B shape", "method", "gradient cosine to eager (min)",
               "norm ratio", "", "source"]  # fmt: skip
    notes, test_rows = Notes(), []
    for name, tests in GPU_TEST_LOGS.items():
        test_rows.append([tests, test_outcome(name), notes.source(name)])
    return (
        [
            "Each method's gradients with fused layer kernels against the same method with eager layers, same "
            "weights, three parameter groups (`grad_check.py`):",
            "",
        ]  # fmt: skip
        + table(headers, rows + pending("gradients", len(headers)))
        + ["GPU tests (`pytest -m gpu`):", ""]
        + table(["tests", "result", "source"], test_rows + pending("gpu_tests", 3))
        + notes.lines()
    )


def fsdp2_summary() -> str:
    log = text("fsdp2_2gpu_h200.log")
    rewards = re.findall(r"'reward': '([\d.]+)'", log)
    runtime = re.search(r"'train_runtime': '([\d.]+)'", log)[1]
    saved = "model, tokenizer and `trainer_state.json` saved" if "trainer_state.json saved" in log else "not saved"
    return f"reward {rewards[0]} → {rewards[-1]} in {runtime} s; {saved}"


def recompile_summary() -> str:
    log = text("generation_modes_cpu_tiny_compiled_recompiles.log")
    sizes, steps = len(re.findall(r"size mismatch", log)), re.search(r"--steps (\d+)", log)[1]
    return f"TRL's compiled forward recompiles {sizes} times for new padded lengths (`size mismatch`) in {steps} steps"


def deepspeed_summary() -> str:
    log = text("deepspeed_cpu_2proc.log")
    weights = max(float(v) for v in re.findall(r"max \|weight diff\| ([\d.e+-]+)", log))
    passed = re.search(r"^(\d+ passed)", log, flags=re.M)[1]
    return (
        f"{passed}: tree log-probs and gradients equal the unsharded model's; `TreeGRPOTrainer` makes "
        f"`trl.GRPOTrainer`'s run (full, LoRA, MoE, moved groups, ranks on different paths), weights within "
        f"{weights:.0e}"
    )


def deepspeed_gpu_summary() -> str:
    """Each ZeRO stage's bf16 runs on one GPU: both trainers' errors against TRL's float32 run."""
    parts = []
    for name in DEEPSPEED_RUNS:
        data = load(name)
        runs = "; ".join(
            f"{run}: loss {data[run]['loss_error']['tree']:.1e} / {data[run]['loss_error']['trl']:.1e}, update "
            f"{data[run]['update_error']['tree']:.1e} / {data[run]['update_error']['trl']:.1e}"
            for run in ("full", "lora")
        )
        parts.append(f"ZeRO-{data['stage']} ({runs})")
    return "error against TRL's float32 run, tree / TRL: " + "; ".join(parts)


def deepspeed_main_job_summary() -> str:
    log = text(DEEPSPEED_MAIN_JOB)
    runtime = re.search(r"'train_runtime': '([\d.]+)'", log)[1]
    status = re.search(r"^exit status (\d+)", log, flags=re.M)[1]
    saved = "; model, tokenizer and `trainer_state.json` saved" if "trainer_state.json saved" in log else ""
    return f"exit status {status}, 20 steps in {runtime} s{saved}"


def other_runs() -> list[str]:
    pack = load("pack_forest_cpu.json")
    wl = pack["workload"]
    rows = [[
        f"CPU: `pack_forest` vs a per-token Python dict trie, {wl['groups']} groups × {wl['completions_per_group']} "
        f"completions ({wl['total_tokens']:,} tokens)",
        f"**{x(pack['speedup_median'])}** faster from lists, the same layout", Notes().source("pack_forest_cpu.json"),
    ]]  # fmt: skip
    for name in ("main_job_cpu.txt", "main_job_cpu_qwen3_5.txt"):
        log = text(name)
        first, last = (re.search(rf"reward mean, {q} quarter of logs:\s+([\d.]+)", log)[1] for q in ("first", "last"))
        ratio = re.search(r"tree_token_ratio: mean ([\d.]+)", log)[1]
        rows.append(
            [log.splitlines()[0], f"reward {first} → {last}, `tree_token_ratio` {ratio}", Notes().source(name)]
        )
    rows.append(["CPU, 2 gloo processes: DeepSpeed ZeRO-2 and ZeRO-3 through `trainers/configs/deepspeed_zero*.yaml`",
                 deepspeed_summary(), Notes().source("deepspeed_cpu_2proc.log")])  # fmt: skip
    gpu = load(DEEPSPEED_RUNS[0])["device"]
    rows.append([
        f"One {gpu}, one process: DeepSpeed ZeRO-2 and ZeRO-3 in bf16, `TreeGRPOTrainer` and `trl.GRPOTrainer`, 4 "
        "steps, full and LoRA (`test_gpu_deepspeed.py`)",
        deepspeed_gpu_summary(), " ".join(Notes().source(name) for name in DEEPSPEED_RUNS),
    ])  # fmt: skip
    rows.append([f"One {gpu}: the main job under `trainers/configs/deepspeed_zero3.yaml`",
                 deepspeed_main_job_summary(), Notes().source(DEEPSPEED_MAIN_JOB)])  # fmt: skip
    check = load("tree_vs_flat_h200_qwen3-0.6b.json")["recompile_check"]
    rows += [
        ["H200: six tree steps of random shapes, compiled graphs after each step",
         f"{check['unique_graphs_after_each_step']}, {check['new_graphs_after_step_2']} new after step 2",
         Notes().source("tree_vs_flat_h200_qwen3-0.6b.json")],
        ["Two H200s, FSDP2: the main job, 60 steps", fsdp2_summary(), Notes().source("fsdp2_2gpu_h200.log")],
        ["CPU: TRL flat with `torch_compile=True`, tiny shape, `TORCH_LOGS=recompiles`", recompile_summary(),
         Notes().source("generation_modes_cpu_tiny_compiled_recompiles.log")],
    ]  # fmt: skip
    return table(["measurement", "result", "source"], rows)


def superseded() -> list[str]:
    rows = [[f"[{name}]({name})", what, f"[{by}]({by})"] for name, (by, what) in SUPERSEDED.items()]
    return table(["file", "what it held", "replaced by"], rows)


def result_files() -> list[str]:
    rows = []
    for name, stage in SOURCES.items():
        if name.endswith(".png"):
            files = " ".join(f"benchmarks/results/{f}" for f in PLOT)
            command = f"python benchmarks/plot_results.py {files} --out benchmarks/results/{name}"
        else:
            command = command_of(name)
        where = f"`{stage}`" if stage else "plot" if name.endswith(".png") else "CPU"
        commit = commit_cell(name) if not name.endswith(".png") else "—"
        rows.append([f"[{name}]({name})", where, f"`{command}`" if command else "—", versions_of(name), commit])
    return table(["file", "stage", "command it records", "versions", "commit"], rows)


SECTIONS = [  # (heading level, title, section, what it measures)
    (2, "Trainer phase", None, None),
    (3, "Through the trainer, generation stubbed", sync_steps,
     "`TreeGRPOTrainer` against `trl.GRPOTrainer`, each through `trainer.train()` at TRL's defaults (padded rows, "
     "SDPA, gradient checkpointing, bf16; the tree's own defaults at theirs: on CUDA its decoder layers compiled). "
     "Generation is TRL's `rollout_func` returning the prompt's tokens and random completions seeded by the prompt, "
     "so both trainers train the same rows and generation costs nothing: the step is the trainer's work (log-prob "
     "forwards, backward, optimizer). One prompt with G=16 completions per optimizer step. MFU counts the same model "
     "FLOPs for both sides: 3x the forward FLOPs of the step's sequences as one prefix forest (recompute not counted) "
     "per second, over 989 TFLOP/s (`bench_sync_grpo.py`)."),
    (3, "Through the trainer at TRL's defaults", through_trainer,
     "`TreeGRPOTrainer` against `trl.GRPOTrainer`, each through `trainer.train()` with the same config: TRL's "
     "defaults (gradient checkpointing and bf16 among them; the tree's own at theirs), one prompt's G completions "
     "per micro-batch, one micro-batch per prompt of a step; the earlier rows the mean of the steps after a "
     "warm-up step. Trainer phase = every log-prob forward (old-policy, reference, policy) and the backward "
     "(`bench_generation_modes.py`)."),
    (3, "Benchmark loop, per model and workload", loop_rows,
     "`bench_tree_vs_flat.py` writes the trainer phase out by hand (old-log-prob forward without grad, policy "
     "forward and backward, gradient checkpointing, LM head on the scored tokens only) and runs it on the same batch "
     "for each method in one process, in micro-batches of at most 65,536 tokens: flat padded (right-padded rows, "
     "SDPA: what TRL's trainer runs), flat packed (one padding-free row, FlexAttention document mask) and the tree. "
     "Here at the benchmark's defaults: eager decoder layers, every layer recomputed. The token ceiling is total / "
     "unique tokens; the FLOP ceiling also counts attention pairs and the LM head, which sharing cannot remove "
     "([the FLOP model](../../docs/how_it_works.md#the-flop-model)); % of a ceiling = the speed-up over the faster "
     "flat method / the ceiling. Workloads: groups of G completions of C tokens sharing a P-token prompt; the "
     "τ²-like agent is one conversation with a 4,800-token system prompt and 10–20 turns, two sampled responses per "
     "turn, each sample the whole history + one response, only the response scored; no sharing = 16 random "
     "sequences of 1k–3k tokens."),
    (3, "Benchmark loop, one column per option", option_columns,
     "The same loop, tree vs flat padded, each option applied to every method alike (flat recomputes every layer "
     "throughout). Compiled layers = regional `torch.compile` of the decoder layers. The compiled-layer runs ran the "
     "tree on the shared-prefix kernels, its recomputed layers keeping their attention, as the library does by "
     "default on CUDA; the eager-layer and Liger runs ran it on FlexAttention in every layer."),
    (3, "What each tree option buys", option_gains,
     "The tree with an option against the same tree without it, one process, same batch, GRPO G=16, P=4,096, C=512."),
    (2, "Memory", memory,
     "Peak GPU memory of the trainer phase in the benchmark loop, same batch. Through the trainer the peak includes "
     "generation's: [first table](#through-the-trainer-at-trls-defaults)."),
    (2, "Prefix reuse across micro-batches", prefix_reuse_plan,
     "One optimizer step's sequences laid out two ways, no model run (`bench_prefix_reuse_plan.py`, CPU): split into "
     "micro-batches of whole tries within the token budget, each repeating the prefix its sequences need (the "
     "trainers without `tree_prefix_reuse`), or as one forest in chunks of the budget that keep the keys and values "
     "later chunks read (`tree_prefix_reuse=True`). Forwarded counts the forward passes' rows (both then recompute "
     "each checkpointed layer once). The estimate is `hf_tree_attn.reuse_planner`'s, bf16, every layer "
     "checkpointed: the backward's peak beyond weights, gradients and optimizer state, at chunks of the budget; the "
     "least over chunk sizes beside it. The second table: the two layouts timed on the H200 "
     "(`bench_prefix_reuse_gpu.py`, stages `prefix-reuse-gpu-split` then `prefix-reuse-gpu`, each layout in its own "
     "process, the log-prob loss's forward and backward of one step, 8 measured steps after the warm-up). Prefix "
     "reuse's first runs there found two faults, both fixed and covered by CPU tests since: its forward without "
     "grad and its recomputes with grad, over chunks whose context size changes, compiled FlexAttention past "
     "dynamo's recompile limit, after which FlexAttention runs its eager reference (the full scores matrix: out of "
     "memory); and each step's kept keys and values stayed alive after its backward (a reference cycle through the "
     "layers' checkpoints), so the third step ran out of memory. With both fixed, its steps ran to the end: with the "
     "last chunk's graph kept (recomputing the others in the backward) and with every chunk's kept "
     "(`--methods reuse_kept`), each paired with the split's steps."),
    (2, "FLOP ceiling and MFU", flop_ceiling_and_mfu,
     "MFU = model FLOPs of the trainer phase (`estimate_flops` × 4: old-log-prob forward, policy forward, backward; "
     "recompute not counted) / time / 989 TFLOPS (the H200's dense bf16 peak). A tree that recomputes fewer layers "
     "than flat can pass 100% of the FLOP ceiling, which counts no recompute."),
    (2, "Where a step's time goes", profiles,
     "One warm trainer-phase step under the torch profiler (`profile_step.py`), Qwen3-1.7B shape, 2 × (P=4,096 + "
     "G=16 × C=512); shares of the GPU kernel time."),
    (3, "Through trainer.train()", trainer_profiles,
     "One more optimizer step per side under the torch profiler after the timed ones (`bench_async_grpo.py "
     "--profile`), each side in its own process: `TreeAsyncGRPOTrainer` at its defaults (compiled layers) and TRL's "
     "`AsyncGRPOTrainer` at its own; GPU kernel seconds by kind (share of the kernel time)."),
    (3, "Planning a step's rows", planner,
     "TRL's asynchronous GRPO planner (`TokenBudgetBatcher`, token budget 32,768, one row per micro-batch) over the "
     "replayed samples of the rows above, run whole with its own rows (`packing.TreeRow`, a dict lookup per token) "
     "and with `PlannerRow` (a radix trie; what `TreeAsyncGRPOTrainer` plans with), on one core of a 2-core CPU "
     "(`bench_planner.py`): seconds to plan each micro-batch, median of 8 after one, paired per micro-batch. The "
     "training loop plans a step's rows before its first forward, with the GPU idle, so these seconds add to each "
     "step. Both must build the same micro-batches (the same samples in the same rows)."),
    (2, "Generation modes: the share of a step", generation_modes,
     "Whole GRPO steps through `trainer.train()`, the workload of the [first table](#through-the-trainer-at-trls-"
     "defaults). The tree speeds up the trainer phase only, so its end-to-end gain is bounded by that phase's share."),
    (2, "Hybrid models", hybrids,
     "Qwen3.5 shape, 18 Gated DeltaNet and 6 attention layers: the recurrent layers run segment by segment, level by "
     "level, on the same Gated DeltaNet kernels in the tree and in flat (the benchmark loop; flat packed is a forest "
     "without sharing): transformers' torch reference, flash-linear-attention 0.6's Triton kernels with the gated "
     "`chunk_bwd_dqkwg` on TileLang (`--gdn-route fla_tilelang`, fla's default on Hopper with Triton 3.6) or "
     "FlashQLA (`--gdn-route flash_qla`, fla's default for bf16 K = V = 128 once installed; "
     "`benchmarks/gpu_hybrid_rows.sh`), each row saying which."),
    (3, "Gated DeltaNet kernels on the H200", kernel_checks,
     "The varlen kernels a tree level calls (`benchmarks/gdn_kernels.py` routes: FlashQLA; fla's Triton kernels "
     "with TileLang's dqkwg backward; fla's Triton kernels with fla 0.6's Hopper refusal lifted where the tile is "
     "BK = 128; fla 0.4.2), each checked by `gdn_kernel_check.py`: one varlen forward + backward over segments of "
     "4,096, 257, 1, 64 and 700 tokens with initial states, against transformers' torch reference run per segment "
     "in float32. The gate case is Qwen3.5's heads (K = V = 128) in bf16; the other cases (fp32, K = 64) show the "
     "route elsewhere, K = 64 also with fla's Hopper refusal lifted. The model-level parity tests on each route are "
     "in the GPU tests table (`h200_gpu_tests_hybrid_rows.log`, `h200_gpu_tests_hybrid_routes.log`); fla + TileLang "
     "and FlashQLA gave the benchmark rows above."),
    (2, "Shared-prefix attention kernels", prefix_kernels,
     "Attention alone (`bench_prefix_attention.py`), bf16, Qwen3 heads of 128, one GRPO forest: FlexAttention's tree "
     "mask against the shared-prefix kernels, median of 10 after a warm-up; a step is two forwards and one backward, "
     "as in training. *The CUDA rule picks* is `fast_on_cuda` on the shape; `tests/test_prefix_attention.py` checks "
     "it against both runs."),
    (2, "Data-parallel balance", balance, None),
    (2, "Peers side by side", peers,
     "TRL 1.16's own tree packing, `trl.experimental.async_grpo.AsyncGRPOTrainer` (each rank's samples in one "
     "prefix trie, `TreeRow`), against `TreeAsyncGRPOTrainer`, both through `trainer.train()` on the same replayed "
     "samples in the same order, so both train the same micro-batches (`bench_async_grpo.py`). TRL's attention "
     "kernel, FlashAttention-3, is downloaded from the Hub at run time, which the offline H200 cannot do: its side "
     "ran PyTorch's FlashAttention-2 varlen op (`aten._flash_attention_forward`) instead. bf16 weights, TRL's "
     "defaults otherwise (gradient checkpointing, one micro-batch per step), a token budget of 32,768 per step. Both "
     "sides forward about the same tokens: TRL's packing already computes each shared prefix once, so what differs is "
     "the kernels and the recompute. MFU counts the same model FLOPs for both sides: 3x the forward FLOPs of the "
     "step's samples as one forest (recompute not counted) per second, over 989 TFLOP/s."),
    (2, "SFT, DPO and reward models on trees", beyond_grpo,
     "`TreeSFTTrainer` and `TreeDPOTrainer` against TRL's `SFTTrainer` and `DPOTrainer` (and `TreeRewardTrainer`, "
     "`TreeRLOOTrainer` against TRL's), each through `trainer.train()` on the same data at TRL's defaults (gradient "
     "checkpointing, AdamW, bf16; the tree's own defaults at theirs), random-weight bf16 Qwen3 shapes "
     "(`bench_trees_beyond_grpo.py`). The token ceiling is the batch's tokens over its unique tokens; TRL pads each "
     "batch to its longest sequence, so the tree can pass it. MFU: 3x the forward FLOPs of the batch as one prefix "
     "forest (plus one forward for a reference model) per second over 989 TFLOP/s, both sides. The earlier rows "
     "ran both trainers one after the other in one process, and report the largest loss difference over the steps, "
     "bf16 against bf16 (the float32 equality is tested on CPU)."),
    (2, "Correctness on the GPU", correctness, None),
    (2, "Other runs", other_runs, None),
    (2, "Superseded results", superseded,
     "Files a later measurement of the same model and workload replaced (paired per step, each side in its own "
     "process, the current code). Their numbers are shown nowhere; the files stay for their history."),
    (2, "Result files", result_files,
     f"Each GPU file is made by `bash {SCRIPT} STAGE` on one H200 (`fsdp2-main-job`: two), which runs the command "
     "the file records."),
]  # fmt: skip


def slug(title: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def results_readme() -> str:
    import results_registry

    lines = [
        "# Benchmark results",
        "",
        "<!-- Written by benchmarks/results_tables.py: edit benchmarks/results_registry.py, not this file. -->",
        "",
        "Every number below is read from a result file in this folder; each row links its file, the stage of "
        f"[`{SCRIPT}`](../run_h200.sh) that made it and the commit of the code it measured ([Result files]"
        "(#result-files) lists each file's command, versions and commit). A row that says *no commit recorded* comes "
        "from a file written before the benchmarks recorded their commit: older code, kept until it is measured "
        "again. GPU: one NVIDIA H200 (files named `_h100_`: one H100 80GB, the same 989 TFLOP/s dense bf16 peak "
        "with less and slower memory), torch 2.11.0+cu130, trl 1.16.0. Models: random-weight bf16 models with the "
        "named shapes (no download). Ratios are measured side by side in one process unless a row says otherwise.",
        "",
    ]
    lines += ["  " * (level - 2) + f"- [{title}](#{slug(title)})" for level, title, _, _ in SECTIONS]
    lines += ["- [Adding a result](#adding-a-result)", ""]
    for level, title, section, intro in SECTIONS:
        lines += ["#" * level + " " + title, ""] + [intro, ""] * bool(intro) + (section() if section else [])
    steps = results_registry.__doc__.split("Adding a result file:\n", 1)[1].strip()
    lines += ["## Adding a result", "", "In `benchmarks/results_registry.py`:", "", steps]
    return "\n".join(lines).rstrip() + "\n"


def readme_table() -> str:
    """The table in README.md's *Performance*: each trainer against TRL's own through `trainer.train()`, paired."""
    rows = []
    for trainer, model, wl, name, key in README_ROWS:
        data, row = load(name), trainer_row(name, key)
        sides, pairs = row["sides"], row["paired"]
        tree, trl = sides["tree"], sides["trl"]
        pair, compiled = pairs["tree vs trl"], pairs.get("tree vs trl_compiled")
        ratio = f"**[{x(pair['median'])}](benchmarks/results/{name})** [{x(pair['min'])}, {x(pair['max'])}]"
        ratio += " **agreement failed**" if pair.get("failed") else ""
        compiled = ranged(compiled).replace("**", "", 2) if "trl_compiled" in sides else "not measured"
        gpu = "H100" if "H100" in data["gpu"] else "H200"
        rows.append([
            trainer, model, wl, ratio, compiled, f"{secs(tree['median_step_s'])} / {secs(trl['median_step_s'])}",
            f"{pct(tree['mfu'], 1)} / {pct(trl['mfu'], 1)}", x(tree["peak_gib"] / trl["peak_gib"]),
            f"{gpu}, `{data['git_commit'][:7]}`",
        ])  # fmt: skip
    headers = ["trainer", "model shape", "workload", "tree vs TRL at its defaults", "tree vs TRL compiled",
               "median step tree / TRL", "MFU tree / TRL", "peak memory tree / TRL", "GPU, commit"]  # fmt: skip
    return "\n".join([BEGIN, *table(headers, rows)[:-1], END])


def with_readme_table(readme: str) -> str:
    start, end = readme.index(BEGIN), readme.index(END) + len(END)
    return readme[:start] + readme_table() + readme[end:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 where a committed file differs")
    args = parser.parse_args()
    written = {
        RESULTS / "README.md": results_readme(),
        REPO / "README.md": with_readme_table((REPO / "README.md").read_text()),
    }
    stale = [path for path, content in written.items() if path.read_text() != content]
    for path in stale:
        if args.check:
            print(f"{path.relative_to(REPO)} is not what `python benchmarks/results_tables.py` writes")
        else:
            path.write_text(written[path])
            print(f"wrote {path.relative_to(REPO)}")
    sys.exit(1 if args.check and stale else 0)


if __name__ == "__main__":
    main()
