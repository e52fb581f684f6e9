"""The examples and the docs figure run, on CPU, and what they print is checked — so they never rot.

Each example runs as a user would run it (a subprocess from the repository root) with short settings; each
takes a few seconds on 2 CPU cores. The docs figure's arrays are checked against a token-by-token trie.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_example(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def load_figure_script():
    spec = importlib.util.spec_from_file_location("make_tree_figure", ROOT / "docs" / "make_tree_figure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def trie_oracle(sequences: list[list[str]]) -> tuple[dict, int]:
    """Node id of every prefix (a tuple of tokens), built one token at a time; and the node count."""
    nodes: dict[tuple, int] = {}
    for seq in sequences:
        for t in range(1, len(seq) + 1):
            nodes.setdefault(tuple(seq[:t]), len(nodes))
    return nodes, len(nodes)


def test_tree_figure_matches_trie_oracle():
    fig = load_figure_script()
    data = fig.figure_data()
    sequences = fig.SEQUENCES
    nodes, num_nodes = trie_oracle(sequences)
    n, s = data["num_tree_tokens"], len(data["tokens"])

    assert n == num_nodes
    assert data["num_original_tokens"] == sum(map(len, sequences))
    assert s % fig.PAD_MULTIPLE == 0 and s - n < fig.PAD_MULTIPLE
    assert data["tree_token_ratio"] == pytest.approx(n / data["num_original_tokens"])

    prefix_of_row = {}
    for seq, rows in zip(sequences, data["positions"]):
        assert data["tokens"][rows].tolist() == seq
        assert data["position_ids"][rows].tolist() == list(range(len(seq)))
        assert data["parent"][rows].tolist() == [-1, *rows[:-1].tolist()]
        for t, row in enumerate(rows):
            assert prefix_of_row.setdefault(int(row), tuple(seq[: t + 1])) == tuple(seq[: t + 1])
    assert sorted(prefix_of_row) == list(range(n))  # every unique row is one trie node, and vice versa
    assert {prefix_of_row[r] for r in range(n)} == set(nodes)

    # The mask, by loops: q sees kv iff kv is q itself or one of its ancestors (following `parent`).
    expected = np.zeros((s, s), dtype=bool)
    for q in range(s):
        kv = q
        while kv >= 0:
            expected[q, kv] = True
            kv = data["parent"][kv] if q < n else -1
    np.testing.assert_array_equal(data["mask"], expected)
    assert (data["trie"][n:] == -1).all() and (data["trie"][:n] >= 0).all()


def test_tree_figure_facts_quoted_in_docs():
    """docs/how_it_works.md quotes these values from the picture."""
    data = load_figure_script().figure_data()
    tokens = data["tokens"].tolist()
    assert (data["num_tree_tokens"], data["num_original_tokens"], len(tokens)) == (17, 26, 20)
    assert f"{data['tree_token_ratio']:.3f}" == "0.654"
    assert tokens[2] == "=" and data["subtree_end"][2] == 9
    assert tokens[3] == "5" and tokens[7] == "4"
    assert data["position_ids"][7] == data["position_ids"][3] == 3 and data["parent"][7] == 2
    assert tokens[7:9] == ["4", "<e>"] and data["subtree_end"][3] == 7  # rows 3..6: the `5 ...` branch
    assert not data["mask"][7:9, 3:7].any()
    assert tokens[9:11] == ["sys", "hi"] and not data["mask"][:9, 9:].any() and not data["mask"][9:17, :9].any()


def test_tree_figure_renders(tmp_path):
    pytest.importorskip("matplotlib")
    assert (ROOT / "docs" / "tree_forest.png").is_file()  # the committed picture the docs show
    out = tmp_path / "tree.png"
    result = run_example("docs/make_tree_figure.py", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000


@pytest.mark.slow
def test_score_shared_prefix():
    args = ("--num_completions", "4", "--prompt_length", "32", "--max_new_tokens", "8")
    result = run_example("examples/score_shared_prefix.py", *args)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+(-?\d+\.\d+)\s+(-?\d+\.\d+)$", out, flags=re.M)
    assert len(rows) == 4
    for _, completion_tokens, tree_total, plain_total in rows:
        assert int(completion_tokens) == 8
        assert float(tree_total) == pytest.approx(float(plain_total), abs=1e-3) and float(tree_total) < 0
    # 4 sequences of 32 + 8 tokens sharing (at least) the 32-token prompt.
    unique, total = map(int, re.search(r"\((\d+) unique of (\d+) tokens", out).groups())
    assert total == 4 * 40 and 32 + 4 <= unique <= 32 + 4 * 8
    assert float(re.search(r"tree_token_ratio = ([\d.]+)", out).group(1)) == pytest.approx(unique / total, abs=1e-3)
    assert re.search(r"max \|tree - plain\| per-token logprob = \S+ \(atol 1e-04\): OK", out)

    # The check is live: an impossible tolerance must fail the run.
    failing = run_example("examples/score_shared_prefix.py", *args, "--atol", "-1")
    assert failing.returncode == 1 and "FAIL" in failing.stdout


@pytest.mark.slow
def test_multi_turn_agent():
    args = ("--conversations", "2", "--turns", "3", "--steps", "3", "--max_tokens_per_mb", "1024")
    result = run_example("examples/multi_turn_agent.py", *args)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "12 samples (2 conversations x 3 turns x 2 responses)" in out
    flat_tokens, flat_rows = map(int, re.search(r"flat: (\d+) tokens in (\d+) rows", out).groups())
    tree_tokens, num_mbs, tree_padded = map(
        int, re.search(r"tree: (\d+) unique tokens in (\d+) micro-batches \((\d+) padded", out).groups()
    )
    assert flat_rows == 12 and tree_tokens < flat_tokens / 2  # the system prompt and histories are shared
    assert tree_padded % 128 == 0 and tree_padded <= num_mbs * 1024 and tree_padded - tree_tokens < num_mbs * 128
    ratio_all, ratio_packed = map(
        float, re.search(r"ratio = ([\d.]+) over all samples, ([\d.]+) as packed", out).groups()
    )
    assert ratio_all <= ratio_packed == pytest.approx(tree_tokens / flat_tokens, abs=1e-3)
    losses = [float(v) for v in re.findall(r"^step \d+: loss ([\d.]+)$", out, flags=re.M)]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert re.search(r"step 0 vs plain per-sample forwards: .*: OK", out)


@pytest.mark.slow
def test_lora_grpo(tmp_path):
    pytest.importorskip("trl")
    from safetensors.torch import load_file

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MAX_STEPS": "4", "OUTPUT_DIR": str(tmp_path)}
    result = subprocess.run(
        ["bash", "examples/lora_grpo.sh", "--logging_steps", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 16 and "lm_head" not in config["target_modules"]
    assert not (tmp_path / "model.safetensors").exists()  # only the adapter is saved: the base stays frozen
    adapter = load_file(tmp_path / "adapter_model.safetensors")
    assert adapter and all("lora_" in name for name in adapter)
    # lora_B starts at zero: a non-zero one means the adapter was trained through the tree forward.
    assert any(t.abs().max() > 0 for name, t in adapter.items() if "lora_B" in name)

    logs = [
        entry for entry in json.loads((tmp_path / "trainer_state.json").read_text())["log_history"] if "loss" in entry
    ]
    assert len(logs) == 4
    assert all(entry["tree_fallback"] == 0 and 0 < entry["tree_token_ratio"] < 0.5 for entry in logs)


def test_docs_config_fields_match_tree_grpo_config():
    pytest.importorskip("trl")
    import dataclasses

    from trl import GRPOConfig

    from hf_tree_attn.trainer import TreeGRPOConfig

    text = (ROOT / "docs" / "how_it_works.md").read_text()
    section = text.split("## Config fields", 1)[1].split("\n## ", 1)[0]
    documented = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", section, flags=re.M))
    inherited = {f.name for f in dataclasses.fields(GRPOConfig)}
    new = {f.name: repr(f.default) for f in dataclasses.fields(TreeGRPOConfig) if f.name not in inherited}
    assert documented == new
