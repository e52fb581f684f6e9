"""benchmarks/bench_trees_beyond_grpo.py's pairing on made-up sides: a tree side as close to the float32 reference as
TRL's passes, and each way a row can be wrong fails it and marks its ratio failed (a perturbed side, other batches,
a tree fallback, too few steps), so a failed row is never reported as a speed-up."""

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_trees_beyond_grpo as bench  # noqa: E402

STEPS = 8
EXACT = [-random.Random(0).uniform(0.5, 9.0) for _ in range(200)]


def _side(error: float, seconds: float, seed: int, **changes) -> dict:
    """A timed side whose first scores are the reference's plus noise of size `error`."""
    rng = random.Random(seed)
    side = {
        "spec": "made up", "measured_step_s": [seconds * (1 + 0.01 * k) for k in range(STEPS)],
        "median_step_s": seconds, "first_step_s": 9.0, "mfu": 0.3, "peak_gib": 10.0, "token_ceiling": 3.0,
        "batch_digests": list(range(STEPS + 2)),
        "tree_fallback": [0.0] * (STEPS + 2),
        "first_scores": {"targets": list(range(len(EXACT))), "log_probs": [v + rng.gauss(0, error) for v in EXACT]},
    }  # fmt: skip
    side.update(changes)
    return side


def _row(**tree_changes) -> dict:
    error = tree_changes.pop("error", 0.02)
    row = {"model": "tiny", "workload": "sft_system_prompt", "paired": {}, "agreement": {}, "sides": {
        "reference": {"first_scores": {"targets": list(range(len(EXACT))), "log_probs": EXACT}, "dtype": "float32"},
        "trl": _side(0.02, 2.0, seed=1),
        "tree": _side(error, 1.0, seed=2, **tree_changes),
    }}  # fmt: skip
    bench._pair(row)
    return row


def test_a_tree_as_close_as_trl_agrees_and_is_paired_per_step():
    row = _row()
    check, pair = row["agreement"]["tree vs trl"], row["paired"]["tree vs trl"]
    assert check["passed"] and check["same_targets"] and check["same_batches"] and check["reference"]
    assert not pair["failed"] and pair["steps"] == STEPS and pair["min"] <= pair["median"] == 2.0 <= pair["max"]
    assert pair["peak_ratio"] == 1.0 and pair["share_of_token_ceiling"] == pytest.approx(2.0 / 3.0)
    assert "tree vs trl" in bench._summary(row) and "agrees" in bench._summary(row)


@pytest.mark.parametrize(
    "changes",
    [
        {"error": 0.5},  # a perturbed side: ten times TRL's error
        {"batch_digests": [*range(STEPS + 1), -1]},  # another batch on one step
        {"tree_fallback": [0.0] * (STEPS + 1) + [1.0]},  # one step on TRL's path
        {"first_scores": {"targets": [0] * len(EXACT), "log_probs": EXACT}},  # other tokens
    ],
    ids=["perturbed", "other-batches", "fallback", "other-targets"],
)
def test_each_way_a_row_can_be_wrong_fails_it(changes):
    row = _row(**changes)
    assert not row["agreement"]["tree vs trl"]["passed"]
    assert row["paired"]["tree vs trl"]["failed"]
    assert "FAILED agreement" in bench._summary(row)


def test_too_few_steps_give_no_ratio():
    row = _row(measured_step_s=[1.0] * 4)
    assert row["paired"]["tree vs trl"]["failed"] and "error" in row["paired"]["tree vs trl"]


def test_step_measures_count_one_forest_and_the_padded_rows():
    from transformers import Qwen3Config

    config = Qwen3Config(**bench.TINY)
    step = {"rows": [[5, 6, 7, 8], [5, 6, 7, 9, 10]], "prompt_lengths": [3, 3], "padded": 10}
    measures = bench.step_measures(config, step, passes=3)
    assert measures["ceiling"] == 10 / 6  # 6 distinct prefix-tree tokens
    flops = bench.estimate_flops(config, step["rows"], prompt_lengths=[3, 3])["tree_flops"]
    assert measures["flops"] == 3 * flops
    reordered = bench.step_measures(config, {**step, "rows": step["rows"][::-1]}, passes=3)
    assert reordered["digest"] == measures["digest"]  # the same rows, in another order
