"""The README works as written: its Python snippets run offline, and CI runs its test command exactly."""

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def test_python_snippets_run_offline_as_written(tmp_path):
    """Every ```python block of the README, in order, as one script (later blocks use earlier names)."""
    blocks = re.findall(r"^```python\n(.*?)^```", README, flags=re.M | re.S)
    assert len(blocks) >= 3, "the quick use, the loss recipe and the Trainer snippets"
    script = tmp_path / "readme.py"
    script.write_text("\n".join(blocks))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", TOKENIZERS_PARALLELISM="false")
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    printed = result.stdout.splitlines()
    assert "[(6,), (5,), (4,)]" in printed and "0.5" in printed  # what the snippet's comments promise


def test_ci_runs_the_readme_test_command():
    quick_start = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"^(make \w+)\s+#", quick_start, flags=re.M)
    assert commands == ["make train", "make test"]
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-1] == "make test"
    targets = re.findall(r"^(\w+):", (REPO / "Makefile").read_text(), flags=re.M)
    assert {"train", "test"} <= set(targets)
