"""benchmarks/bench_planner.py on small lengths: both planners build the same micro-batches, timed per micro-batch."""

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import bench_planner  # noqa: E402


def test_the_planners_are_paired_on_the_same_micro_batches(tmp_path, monkeypatch):
    out = tmp_path / "planner.json"
    argv = ["bench_planner.py", "--scale", "0.05", "--token-budget", "2048", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    bench_planner.main()
    rows = json.loads(out.read_text())["rows"]
    assert [row["workload"] for row in rows] == ["grpo_mixed", "tau2_like"]
    for row in rows:
        assert row["same_micro_batches"] and not row["paired"]["failed"]
        assert row["paired"]["steps"] == 8 == len(row["trl_tree_row_s"]) == len(row["planner_row_s"])
        assert all(n > 1 for n in row["samples_per_micro_batch"])
