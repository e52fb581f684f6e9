"""benchmarks/main_job_summary.py: the main job's result file from a finished run's `trainer_state.json`, which
benchmarks/results_tables.py reads (its first line, the reward's quarters, `tree_token_ratio`, the commit)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import main_job_summary  # noqa: E402
import results_tables  # noqa: E402


def _run(tmp_path: Path, rewards: list[float]) -> Path:
    history = [{"step": 5 * (i + 1), "reward": r, "tree_token_ratio": 0.07 + i / 1000, "tree_fallback": 0.0,
                "entropy": 3.0 - i / 10, "loss": 0.0} for i, r in enumerate(rewards)]  # fmt: skip
    history.append({"step": 5 * len(rewards), "train_runtime": 12.5})
    state = {"log_history": history, "global_step": 5 * len(rewards), "logging_steps": 5}
    (tmp_path / "trainer_state.json").write_text(json.dumps(state))
    return tmp_path


def test_the_summary_is_what_the_results_tables_read(tmp_path, monkeypatch):
    rewards = [0.0, 0.1, 0.2, 0.3, 0.6, 0.7, 0.8, 0.9]  # quarters: first (0.0, 0.1), last (0.8, 0.9)
    monkeypatch.setenv("HF_TREE_ATTN_COMMIT", "0123456789abcdef")
    text = main_job_summary.summary(_run(tmp_path, rewards), "Main job, a test", "accelerate launch x.py")
    assert text.splitlines()[0] == "Main job, a test"
    assert "reward mean, first quarter of logs: 0.0500" in text
    assert "reward mean, last quarter of logs:  0.8500" in text
    assert "tree_token_ratio: mean 0.0735, max 0.0770" in text
    assert "train_runtime 12.5 s, 40 steps" in text
    (tmp_path / "main_job.txt").write_text(text)
    monkeypatch.setattr(results_tables, "RESULTS", tmp_path)
    assert results_tables.commit_of("main_job.txt") == "0123456"
    assert results_tables.command_of("main_job.txt") == "accelerate launch x.py"


def test_too_few_logged_rewards_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="holds 3 logged rewards; a summary needs 4"):
        main_job_summary.summary(_run(tmp_path, [0.1, 0.2, 0.3]), "t", "c")
