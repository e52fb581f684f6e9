"""TreeGRPOTrainer under 2-process CPU data parallelism (torchrun + gloo), with ranks that pack unequally.

With a token budget, one rank can split its chunk into more forests than another. DDP (buffer broadcasts) and FSDP
(all-gathers) need the same number of forwards on every rank, so the short rank runs idle forwards; without them
this run hangs. Here rank 1 gets a larger budget than rank 0 to force the mismatch.
"""

import json
import sys
from pathlib import Path

from helpers import run_two_ranks

REPO = Path(__file__).resolve().parent.parent


def _run_rank() -> None:
    """The torchrun worker: the main job with rank 1 packing each chunk into fewer forests than rank 0."""
    sys.path.insert(0, str(REPO))
    from helpers import exit_distributed_worker

    from trainers import grpo_tree

    missing_forwards = []
    original_missing, original_chunk = (
        grpo_tree.TreeGRPOTrainer._missing_forwards,
        grpo_tree.TreeGRPOTrainer._packed_chunk,
    )

    def missing(self, num_forwards):
        count = original_missing(self, num_forwards)
        missing_forwards.append(count)
        return count

    def chunk(self, *args, **kwargs):
        if self.accelerator.process_index == 1:
            self._tree_pack.keywords["max_tokens_per_mb"] = 2048
        return original_chunk(self, *args, **kwargs)

    grpo_tree.TreeGRPOTrainer._missing_forwards = missing
    grpo_tree.TreeGRPOTrainer._packed_chunk = chunk
    trainer = grpo_tree.main(*grpo_tree.parse_args())
    report = {"rank": trainer.accelerator.process_index, "missing": missing_forwards}
    report["world"] = trainer.accelerator.num_processes
    out = Path(trainer.args.output_dir) / f"rank{report['rank']}.json"
    out.write_text(json.dumps(report))
    exit_distributed_worker()  # while the trainer is alive (see there)


def test_unequal_forest_counts_across_ranks_do_not_hang(tmp_path):
    # 8-token completions: a chunk's trie (~315 shared prompt tokens + 16 completions) outgrows rank 0's 384-token
    # budget whatever is sampled, while rank 1's 2048 holds it whole.
    args = ["--max_steps", "3", "--max_tokens_per_mb", "384", "--beta", "0.04", "--num_iterations", "2"]
    args += ["--max_completion_length", "8"]
    args += ["--logging_steps", "1", "--disable_tqdm", "true", "--output_dir", str(tmp_path)]
    run_two_ranks(__file__, *args)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(report["world"] == 2 for report in reports)
    assert max(reports[1]["missing"]) > 0  # rank 1 did run idle forwards to match rank 0
    assert len(reports[0]["missing"]) == len(reports[1]["missing"])
    logs = json.loads((tmp_path / "trainer_state.json").read_text())["log_history"]
    assert [entry["step"] for entry in logs if "loss" in entry] == [1, 2, 3]


if __name__ == "__main__":
    _run_rank()
