"""benchmarks/bench_tree_vs_flat.py's pairing and agreement: on made-up runs, each way a run can be wrong (log-probs
apart, gradients apart, tokens missing, too few repeats) fails it and marks its paired ratios failed; on a tiny model
on CPU, every method scores the same tokens in the same order, the tree within the float32 bound and a tree scored
with perturbed weights outside it; results_tables.py shows a run's paired ratios and a failed agreement."""

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_tree_vs_flat as bench  # noqa: E402
import results_tables  # noqa: E402

REPEATS = bench.MIN_MEASURED_STEPS
LOGPROBS = [-random.Random(0).uniform(0.5, 9.0) for _ in range(300)]


def _run(repeats: int = REPEATS, tree_cos: float = 0.9995, packed_cos: float = 0.9997) -> dict:
    """A made-up run: flat padded 3 s a repeat, flat packed 2 s, the tree 1 s (each repeat a little slower)."""
    times = {"flat_padded": 3.0, "flat_packed": 2.0, "tree": 1.0}
    run = {m: {"times_s": [t * (1 + 0.01 * k) for k in range(repeats)]} for m, t in times.items()}
    run["tree"]["grad_cos_vs_flat_padded"] = tree_cos
    run["flat_packed"]["grad_cos_vs_flat_padded"] = packed_cos
    return run


def _scores(tree_error: float = 0.0, tree_tokens: int = len(LOGPROBS)) -> dict:
    rng = random.Random(1)
    return {
        "flat_padded": list(LOGPROBS),
        "flat_packed": [v + rng.gauss(0, 1e-3) for v in LOGPROBS],
        "tree": [v + rng.gauss(0, 1e-3) + tree_error for v in LOGPROBS][:tree_tokens],
    }


def test_an_agreeing_run_records_its_paired_ratios():
    run = _run()
    bench.check_run(run, _scores(), "bfloat16")
    assert not run["failed"]
    pair = run["paired"]["tree vs flat_padded"]
    assert pair["steps"] == REPEATS and not pair["failed"]
    assert pair["per_step"] == pytest.approx([3.0] * REPEATS)  # each repeat's flat over the tree's same repeat
    assert run["paired"]["tree vs flat_packed"]["median"] == pytest.approx(2.0)
    assert run["agreement"]["tree"]["passed"] and run["agreement"]["tree"]["bound"] == bench.LOGPROB_BOUND["bfloat16"]


@pytest.mark.parametrize(
    ("case", "dtype", "reason"),
    [
        ({"tree_error": 0.2}, "bfloat16", "log-probs differ"),  # over bf16's bound
        ({"tree_error": 1e-3}, "float32", "log-probs differ"),  # within bf16's, over float32's
        ({"tree_tokens": 299}, "bfloat16", "not the same tokens"),
        ({"tree_cos": 0.98}, "bfloat16", "gradient cosine"),
        ({"tree_cos": 0.9995}, "float32", "gradient cosine"),
    ],
)
def test_a_disagreeing_tree_fails_the_run(case, dtype, reason):
    run = _run(**{k: v for k, v in case.items() if k.endswith("_cos")})
    bench.check_run(run, _scores(**{k: v for k, v in case.items() if not k.endswith("_cos")}), dtype)
    assert run["failed"] and not run["agreement"]["tree"]["passed"]
    for key in ("tree vs flat_padded", "tree vs flat_packed"):
        assert run["paired"][key]["failed"] and reason in run["paired"][key]["reason"]
    assert "FAILED" in bench.paired_summary(run)


def test_a_disagreeing_baseline_fails_its_pair_only():
    run = _run(packed_cos=0.5)
    bench.check_run(run, _scores(), "bfloat16")
    assert not run["paired"]["tree vs flat_padded"]["failed"]
    assert run["paired"]["tree vs flat_packed"]["failed"] and run["failed"]


def test_too_few_repeats_are_not_paired():
    run = _run(repeats=REPEATS - 1)
    bench.check_run(run, _scores(), "bfloat16")
    pair = run["paired"]["tree vs flat_padded"]
    assert "median" not in pair and pair["failed"] and f"at least {REPEATS}" in pair["error"]


def test_results_tables_show_paired_ratios_and_failures():
    run = {**_run(), "speedup_vs_padded": 9.0, "speedup_vs_packed": 9.0}
    bench.check_run(run, _scores(), "bfloat16")
    assert results_tables.loop_ratio(run) == "3.00× [3.00×, 3.00×]"  # the paired median, not the stored 9.0
    assert "agree" in results_tables.loop_agreement(run, "0.9995")
    bench.check_run(run, _scores(tree_error=0.2), "bfloat16")
    assert results_tables.loop_ratio(run).endswith("**agreement failed**")
    assert "**agreement failed**" in results_tables.loop_agreement(run, "0.9995")
    old = {k: v for k, v in run.items() if k not in ("paired", "agreement", "failed")}  # a file from before
    assert results_tables.loop_ratio(old) == "9.00× (ratio of medians, unpaired)"  # said so, not a paired ratio
    assert results_tables.loop_agreement(old, "0.9995") == "0.9995"


def test_every_method_scores_the_same_tokens_on_cpu():
    """The tiny model, float32: flat padded, flat packed and the tree fill `scores` for every sequence, the same
    tokens in the same order (within the float32 bound), and the tree with perturbed weights falls outside it."""
    device = torch.device("cpu")
    model = bench.build_model("tiny", device, dtype=torch.float32)
    wl = bench.grpo_workload(random.Random(0), 2, 4, 48, 12, bench.MODELS["tiny"]["vocab_size"])
    scored = sum(len(s) - p for s, p in zip(wl.sequences, wl.prompt_lengths))

    def scores(step, eps: float = 0.0) -> list[float]:
        per = {}
        with bench.perturbed(model, eps):
            step(model, wl, 65536, device, scores=per)
        model.zero_grad(set_to_none=True)
        assert sorted(per) == list(range(len(wl.sequences)))
        return torch.cat([per[i] for i in range(len(wl.sequences))]).tolist()

    padded = scores(bench.flat_padded_step)
    assert len(padded) == scored
    for step in (bench.flat_packed_step, bench.tree_step):
        check = bench.agreement(scores(step), padded, bound=bench.LOGPROB_BOUND["float32"])
        assert check["passed"], check
    check = bench.agreement(scores(bench.tree_step, eps=0.01), padded, bound=bench.LOGPROB_BOUND["float32"])
    assert not check["passed"]
