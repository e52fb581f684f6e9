"""The main job's result file: what a finished `trainers/grpo_tree.py` run logged, summed up as text.

    accelerate launch trainers/grpo_tree.py --output_dir outputs/main      # the README's `make train`
    python benchmarks/main_job_summary.py outputs/main --title "Main job, embedded default, CPU" \
        --command "make train" --out benchmarks/results/main_job_cpu.txt

It reads the run's `trainer_state.json` (`log_history`) and writes the command, the commit and versions
(`harness.provenance`), the reward's mean over the first and the last quarter of the logged steps (what
`tests/test_main_job.py` holds the default job to: a rise of at least 0.2), `tree_token_ratio` and `tree_fallback`, and
every tenth logged step. `benchmarks/results_tables.py` reads the first line and the three summary lines.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from harness import provenance

COLUMNS = ("reward", "reward_std", "tree_token_ratio", "tree_flops_saved", "entropy", "loss")


def summary(output_dir: Path, title: str, command: str) -> str:
    """The text of the result file for the run in `output_dir` (see the module docstring)."""
    state = json.loads((output_dir / "trainer_state.json").read_text())
    logs = [entry for entry in state["log_history"] if "reward" in entry]
    if len(logs) < 4:
        raise ValueError(f"{output_dir}/trainer_state.json holds {len(logs)} logged rewards; a summary needs 4")
    quarter = len(logs) // 4
    first, last = (statistics.fmean(e["reward"] for e in part) for part in (logs[:quarter], logs[-quarter:]))
    ratios = [e["tree_token_ratio"] for e in logs]
    runtime = next((e["train_runtime"] for e in state["log_history"] if "train_runtime" in e), None)
    meta = provenance()
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v)
    lines = [
        title,
        f"command: {command}",
        f"commit {meta['git_commit']}, {'dirty' if meta['git_dirty'] else 'clean'}; {meta['gpu']}; {versions}",
        "",
        f"train_runtime {runtime:.1f} s, {state['global_step']} steps" if runtime is not None else "",
        f"logged rewards: {len(logs)} (every {state.get('logging_steps', '?')} steps)",
        f"reward mean, first quarter of logs: {first:.4f}",
        f"reward mean, last quarter of logs:  {last:.4f}   (rise {last - first:+.4f})",
        f"tree_token_ratio: mean {statistics.fmean(ratios):.4f}, max {max(ratios):.4f}",
        f"tree_fallback: max {max(e.get('tree_fallback', 0.0) for e in logs)}",
        "",
        " step " + " ".join(f"{c:>16}" for c in COLUMNS if c in logs[0]),
    ]
    for entry in logs[:: max(1, len(logs) // 12)]:
        lines.append(f"{entry['step']:5d} " + " ".join(f"{entry[c]:16.4f}" for c in COLUMNS if c in logs[0]))
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output_dir", type=Path, help="the finished run's output_dir (its trainer_state.json)")
    parser.add_argument("--title", required=True, help="the file's first line: which job, on what")
    parser.add_argument("--command", required=True, help="the command that ran the job")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.write_text(summary(args.output_dir, args.title, args.command))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
