"""benchmarks/bench_generation_modes.py's pairing on made-up sides: a tree side as close to the float32 reference as
TRL's passes, is paired per step on whole steps and on the trainer phase, and each way a row can be wrong fails it
and marks its ratio failed (a perturbed side, other batches, a tree fallback, other tokens, too few steps)."""

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_generation_modes as bench  # noqa: E402

STEPS = 8
EXACT = [-random.Random(0).uniform(0.5, 9.0) for _ in range(200)]


def _side(error: float, step: float, trainer: float, seed: int, **changes) -> dict:
    """A timed side whose first scores are the reference's plus noise of size `error`: steps of `step` seconds, of
    which `trainer` the trainer phase and 1 s generation."""
    rng = random.Random(seed)
    side = {
        "measured_step_s": [step * (1 + 0.01 * k) for k in range(STEPS)], "median_step_s": step,
        "trainer_phase_s": [trainer] * STEPS, "generation_s": [1.0] * STEPS, "first_step_s": 9.0, "peak_gib": 10.0,
        "median_trainer_phase_s": trainer, "median_generation_s": 1.0, "trainer_share": trainer / step,
        "generation_share": 1.0 / step, "mfu": 0.1,
        "token_ceiling": 8.0, "flops_ceiling": 16.0, "batch_digests": list(range(STEPS + 2)),
        "tree_fallback": [0.0] * (STEPS + 2),
        "first_scores": {"targets": list(range(len(EXACT))), "log_probs": [v + rng.gauss(0, error) for v in EXACT]},
    }  # fmt: skip
    side.update(changes)
    return side


def _row(**tree_changes) -> dict:
    error = tree_changes.pop("error", 0.02)
    row = {"model": "tiny", "workload": "generate", "paired": {}, "agreement": {}, "sides": {
        "trl": _side(0.02, 6.0, 4.0, seed=1),
        "tree": _side(error, 3.0, 1.0, seed=2, **tree_changes),
        "reference": {"first_scores": {"targets": list(range(len(EXACT))), "log_probs": EXACT}, "dtype": "float32"},
    }}  # fmt: skip
    bench._pair(row)
    return row


def test_a_tree_as_close_as_trl_agrees_and_is_paired_per_step_and_per_phase():
    row = _row()
    check, pair = row["agreement"]["tree vs trl"], row["paired"]["tree vs trl"]
    assert check["passed"] and check["same_targets"] and check["same_batches"] and check["reference"]
    assert not pair["failed"] and pair["same_batches"] and pair["steps"] == STEPS
    assert pair["min"] <= pair["median"] == 2.0 <= pair["max"]
    assert pair["trainer_phase"]["median"] == 4.0 and pair["generation"]["median"] == 1.0
    assert pair["trainer_phase"]["share_of_token_ceiling"] == 0.5
    assert pair["trainer_phase"]["share_of_flops_ceiling"] == 0.25
    assert pair["peak_ratio"] == 1.0
    summary = bench._summary(row)
    assert "trainer phase 4.00x" in summary and "agrees" in summary and "same batches True" in summary


@pytest.mark.parametrize(
    "changes",
    [
        {"error": 0.5},  # a perturbed side: ten times TRL's error
        {"batch_digests": [*range(STEPS + 1), -1]},  # other completions sampled on one step
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
    row = _row(measured_step_s=[1.0] * 4, trainer_phase_s=[1.0] * 4, generation_s=[1.0] * 4)
    assert row["paired"]["tree vs trl"]["failed"] and "error" in row["paired"]["tree vs trl"]


def test_a_row_without_its_reference_is_checked_within_the_bf16_bound():
    row = _row()
    del row["sides"]["reference"]
    row["paired"], row["agreement"] = {}, {}
    bench._pair(row)
    check = row["agreement"]["tree vs trl"]
    assert check["passed"] and not check["reference"] and "bound" in check


def test_step_measures_count_each_group_as_one_forest_and_the_padded_rows():
    config = bench.model_config("tiny")
    prompts, completions = [[5, 6, 7], [5, 6, 7], [5, 6, 8]], [[9], [10, 11], [12]]
    measures = bench.step_measures(config, prompts, completions)
    # groups: {567 + 9, 567 + 10 11} -> 3 + 1 + 2 = 6 tree tokens; {568 + 12} -> 4; padded 3 rows x (3 + 2)
    assert measures["token_ceiling"] == 15 / 10
    flops = sum(
        bench.estimate_flops(config, rows, prompt_lengths=[3] * len(rows))["tree_flops"]
        for rows in ([[5, 6, 7, 9], [5, 6, 7, 10, 11]], [[5, 6, 8, 12]])
    )
    assert measures["flops"] == 3 * flops and measures["flops_ceiling"] > 1
    reordered = bench.step_measures(config, prompts[::-1], completions[::-1])
    assert reordered["digest"] == measures["digest"]  # the same rows, in another order
    assert bench.step_measures(config, prompts, [[9], [10, 12], [12]])["digest"] != measures["digest"]


def test_modes_that_cannot_run_here_are_skipped_with_a_reason(monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    assert bench.skipped("vllm_colocate") == "vLLM colocate needs CUDA"
    assert bench.skipped("generate") is None
