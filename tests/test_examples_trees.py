"""The trainer examples (SFT, DPO, GRPO with a reward model) run on CPU, and their own checks against TRL pass.

Each runs as a user runs it (a subprocess from the repository root) with `--compare`, which trains TRL's trainer on
the same data and exits 1 unless the logged values agree. The three share the shape of that check; an impossible
tolerance must make the SFT example's fail, so the check is live.
"""

from __future__ import annotations

import re

import pytest
from test_examples import run_example

pytest.importorskip("trl")

EXAMPLES = {
    "examples/sft_agent_turns.py": (["--conversations", "2", "--turns", "4", "--steps", "2"], r"loss", 0.6),
    "examples/dpo_shared_prompt.py": (["--pairs", "8", "--steps", "2"], r"loss / margin", 0.5),
    "examples/grpo_reward_model.py": (["--steps", "1"], r"reward", 0.5),
}


@pytest.mark.slow
@pytest.mark.parametrize("script", EXAMPLES)
def test_trainer_example_matches_trl(script):
    args, what, ratio = EXAMPLES[script]
    result = run_example(script, *args, "--compare", timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(rf"max \|tree - trl\.\w+\| {what} = \S+ \(atol 1e-04\): OK", result.stdout)
    ratios = [float(r) for r in re.findall(r"(?:tree_token_ratio|reward_tree_compute_ratio) ([\d.]+)", result.stdout)]
    assert ratios and max(ratios) < ratio  # the shared prompt was computed once per batch

    if script.endswith("sft_agent_turns.py"):
        failing = run_example(script, *args, "--compare", "--atol", "-1", timeout=300)
        assert failing.returncode == 1 and "FAIL" in failing.stdout
