"""benchmarks/bench_async_grpo.py on the CPU (a tiny model, lengths scaled down): prefix reuse through
`trainer.train()` against TRL's AsyncGRPOTrainer on conversations that span a step's rows."""

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import bench_async_grpo as bench  # noqa: E402


def test_prefix_reuse_forwards_each_step_s_unique_tokens_once_where_trl_repeats_them(tmp_path, monkeypatch):
    """`tree_reuse` forwards the step's samples as one forest (its unique tokens), TRL's rows and the tree's without
    reuse forward more (a conversation's history in several rows); all three score the same first tokens, within
    the bound, and every pair is timed on the same steps."""
    out = tmp_path / "out.json"
    # A budget that holds the longest sample (~1k tokens): TRL's planner drops a longer one, prefix reuse keeps it,
    # and the sides would no longer train the same steps.
    argv = ["bench_async_grpo.py", "--models", "tiny", "--scale", "0.02", "--token-budget", "1024", "--accumulation",
            "3", "--warmup", "1", "--steps", "8", "--workloads", "agent_2x20x4", "--sides", "trl", "tree",
            "tree_reuse", "--out", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    (row,) = json.loads(out.read_text())["rows"]
    sides = row["sides"]
    unique = sides["trl"]["unique_tokens_per_step"]
    assert unique == sides["tree"]["unique_tokens_per_step"] == sides["tree_reuse"]["unique_tokens_per_step"]
    assert sides["tree_reuse"]["forwarded_tokens_per_step"] == unique
    for side in ("trl", "tree"):
        assert all(f > u for f, u in zip(sides[side]["forwarded_tokens_per_step"], unique)), side
    for key in ("tree_reuse vs trl", "tree_reuse vs tree"):
        check, pair = row["agreement"][key], row["paired"][key]
        assert check["passed"] and check["same_batches"] and check["tokens"] > 0, (key, check)
        assert pair["steps"] == 8 and not pair["failed"], (key, pair)

    # The results table prints this file's row: each side's forwarded / unique tokens and the three paired ratios.
    import results_tables

    data = json.loads(out.read_text())
    monkeypatch.setattr(results_tables, "load", lambda name: data)
    monkeypatch.setattr(results_tables, "ASYNC_PREFIX_REUSE", ["run.json"])
    monkeypatch.setitem(results_tables.SOURCES, "run.json", None)
    monkeypatch.setitem(results_tables.MODELS, "tiny", "tiny")
    (line,) = [line for line in results_tables.prefix_reuse_trainer() if line.startswith("| tiny, cpu")]
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    assert cells[2] == "3 × 1,024"
    for cell, side in zip(cells[3:6], ("trl", "tree", "tree_reuse")):
        forwarded = sum(sides[side]["forwarded_tokens_per_step"]) / sum(unique)
        assert f"{results_tables.x(forwarded)} forwarded" in cell, (side, cell)
    assert "1.00× forwarded" in cells[5]
    for cell, key in zip(cells[6:9], ("tree_reuse vs trl", "tree_reuse vs tree", "tree vs trl")):
        assert cell == results_tables.ranged(row["paired"][key]), (key, cell)
    assert cells[9] == "3 of 3 pairs"


def test_a_flash_side_whose_backend_was_turned_off_is_a_failure(monkeypatch):
    """`tree_flash` asks for FlexAttention's FLASH backend (`tree` gets it by default where FlashAttention-4 is
    installed); where the trainer turned it off after a compiler failure the side ran on the Triton kernels, and is
    recorded as failed with the trainer's warning, not as a speed-up."""
    import hf_tree_attn.attention as attention

    warning = "The compiled decoder layers of Qwen3ForCausalLM failed on FlexAttention's FLASH backend (RuntimeError)"
    monkeypatch.setenv(attention.FLEX_KERNEL_OPTIONS_ENV, '{"BACKEND": "FLASH"}')
    monkeypatch.setattr(attention, "FLEX_KERNEL_OPTIONS", None)  # turned off during the run
    said = bench.flash_turned_off(["another warning", warning])
    assert said.startswith("FlexAttention's FLASH backend was turned off") and warning in said
    monkeypatch.setattr(attention, "FLEX_KERNEL_OPTIONS", {"BACKEND": "FLASH"})  # ran on it to the end
    assert bench.flash_turned_off([]) is None
    monkeypatch.delenv(attention.FLEX_KERNEL_OPTIONS_ENV)  # did not ask: the trainer's default put it on
    monkeypatch.setattr(attention, "FLEX_KERNEL_OPTIONS", None)
    assert warning in bench.flash_turned_off([warning])
    assert bench.flash_turned_off(["another warning"]) is None  # never on it
