"""benchmarks/bench_prefix_reuse_gpu.py on the CPU (float32, a tiny model): the split and the prefix-reuse step of
one workload agree (log-probabilities, gradients), reuse forwards every unique row once where the split repeats
prefixes, and a reuse step that is off fails the row's agreement and marks its ratio failed."""

import argparse
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_prefix_reuse_gpu as bench  # noqa: E402

from hf_tree_attn.compile import compile_decoder_layers  # noqa: E402

ARGS = dict(device="cpu", dtype="float32", warmup=1, steps=8, budget=None, optimizer=True, methods=["split", "reuse"],
            first_dir=None, checkpointing="all", profile=False, compile=False)  # fmt: skip


def _row() -> dict:
    return bench.measure("tiny", "smoke", argparse.Namespace(**ARGS), save=lambda row: None, earlier={})


def test_split_and_reuse_agree_and_reuse_forwards_each_row_once():
    row = _row()
    split, reuse = row["methods"]["split"], row["methods"]["reuse"]
    assert row["agreement"]["passed"], row["agreement"]
    assert row["agreement"]["max_abs"] < 1e-5 and row["agreement"]["gradient_cosine"] > 0.99999
    assert reuse["forwarded"] == row["unique"] and split["forwarded"] > row["unique"]
    assert split["forwards"] > 1 and row["paired"]["steps"] == 8 and not row["paired"]["failed"]


def test_reuse_with_every_graph_kept_agrees_and_is_paired_with_both():
    """`reuse_kept` (every chunk's forward graph kept): the split's log-probabilities and gradients, and a paired
    ratio against the split and against `reuse` (the recomputes it saves), each of the 8 measured steps."""
    row = bench.measure(
        "tiny", "smoke", argparse.Namespace(**{**ARGS, "methods": ["split", "reuse", "reuse_kept"]}),
        save=lambda row: None, earlier={},
    )  # fmt: skip
    assert row["agreement_kept"]["passed"] and row["agreement_kept"]["max_abs"] < 1e-5, row["agreement_kept"]
    assert row["methods"]["reuse_kept"]["forwarded"] == row["unique"]
    assert row["paired_kept"]["steps"] == row["paired_reuse_vs_kept"]["steps"] == 8
    assert not row["paired_kept"]["failed"] and row["paired_reuse_vs_kept"]["median"] > 0
    check = row["agreement_reuse_vs_kept"]
    assert check["passed"] and check["max_abs"] < 1e-5 and not row["paired_reuse_vs_kept"]["failed"], check


def _off(monkeypatch, off_method: str) -> None:
    """`bench.step` with `off_method`'s log-probabilities shifted by 0.01."""
    step = bench.step

    def off(model, sequences, budget, method, weights, scored):
        logps = step(model, sequences, budget, method, weights, scored)
        return [lp + 0.01 for lp in logps] if method == off_method else logps

    monkeypatch.setattr(bench, "step", off)


def test_a_kept_graph_step_that_is_off_fails_both_its_ratios(monkeypatch):
    _off(monkeypatch, "reuse_kept")
    args = argparse.Namespace(**{**ARGS, "methods": ["split", "reuse", "reuse_kept"]})
    row = bench.measure("tiny", "smoke", args, save=lambda row: None, earlier={})
    assert row["paired_kept"]["failed"] and row["paired_reuse_vs_kept"]["failed"] and not row["paired"]["failed"]


def test_a_reuse_step_that_is_off_fails_the_row(monkeypatch):
    _off(monkeypatch, "reuse")
    row = _row()
    assert not row["agreement"]["passed"] and row["paired"]["failed"]
    assert torch.isclose(torch.tensor(row["agreement"]["max_abs"]), torch.tensor(0.01), atol=1e-5)


def test_methods_run_in_their_own_processes_are_paired_on_resume(tmp_path, monkeypatch):
    """`--methods split` then `--methods reuse --resume`: the second run keeps the first's split, reads its first
    step from `--first-dir`, and pairs and checks the two as one run would; the first run's provenance is kept."""
    import json

    out = tmp_path / "out.json"
    common = ["--models", "tiny", "--workloads", "smoke", "--device", "cpu", "--dtype", "float32", "--warmup", "1",
              "--out", str(out), "--first-dir", str(tmp_path / "first")]  # fmt: skip
    for extra in (["--methods", "split"], ["--methods", "reuse", "--resume"]):
        monkeypatch.setattr(sys, "argv", ["bench_prefix_reuse_gpu.py", *common, *extra])
        bench.main()
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["methods"].keys() == {"split", "reuse"} and len(result["earlier_runs"]) == 1
    assert row["agreement"]["passed"] and row["agreement"]["gradient_cosine"] > 0.99999, row["agreement"]
    assert row["paired"]["steps"] == 8 and not row["paired"]["failed"]
    assert row["paired"]["median"] > 0


def test_a_resumed_run_without_the_earlier_first_step_reruns_it_for_the_check(tmp_path, monkeypatch):
    """Without `--first-dir` (the earlier process's first step gone), the resumed run re-runs one step of the earlier
    method on the same data for the agreement check, and says so; an off reuse step still fails the row."""
    import json

    out = tmp_path / "out.json"
    common = ["--models", "tiny", "--workloads", "smoke", "--device", "cpu", "--dtype", "float32", "--warmup", "1",
              "--out", str(out)]  # fmt: skip
    for extra in (["--methods", "split"], ["--methods", "reuse", "--resume"]):
        monkeypatch.setattr(sys, "argv", ["bench_prefix_reuse_gpu.py", *common, *extra])
        bench.main()
    (row,) = json.loads(out.read_text())["rows"]
    assert row["agreement_steps_rerun"] == ["split"] and row["agreement"]["passed"], row["agreement"]
    assert row["paired"]["steps"] == 8 and not row["paired"]["failed"]

    step = bench.step
    monkeypatch.setattr(bench, "step", lambda *a: [lp + 0.01 for lp in step(*a)] if a[3] == "reuse" else step(*a))
    monkeypatch.setattr(sys, "argv", ["bench_prefix_reuse_gpu.py", *common, "--methods", "reuse", "--resume"])
    bench.main()
    (row,) = json.loads(out.read_text())["rows"]
    assert not row["agreement"]["passed"] and row["paired"]["failed"]


def test_a_run_cut_off_keeps_the_steps_it_ran(monkeypatch):
    """A run stopped by a time limit in the middle of a method has written the steps that method finished."""
    saved, calls = [], []
    step = bench.step

    def cut_off(model, sequences, budget, method, weights, scored):
        calls.append(method)
        if calls.count("reuse") == 4:
            raise TimeoutError("the time limit")
        return step(model, sequences, budget, method, weights, scored)

    monkeypatch.setattr(bench, "step", cut_off)
    args = argparse.Namespace(**ARGS)
    try:
        bench.measure("tiny", "smoke", args, save=lambda row: saved.append(json_copy(row)), earlier={})
    except TimeoutError:
        pass
    else:
        raise AssertionError("the cut-off never came")
    last = saved[-1]["methods"]
    assert last["split"]["median_step_s"] > 0 and len(last["split"]["step_s"]) == 9
    assert (
        last["reuse"] == {"incomplete": True, "step_s": last["reuse"]["step_s"]} and len(last["reuse"]["step_s"]) == 3
    )


def json_copy(row: dict) -> dict:
    import json

    return json.loads(json.dumps(row))


def test_without_the_models_checkpointing_reuse_still_agrees():
    """`--checkpointing none`: the layers are not checkpointed (prefix reuse's chunk recompute the only one), and
    the two layouts still agree."""
    args = argparse.Namespace(**{**ARGS, "checkpointing": "none", "optimizer": False})
    row = bench.measure("tiny", "smoke", args, save=lambda row: None, earlier={})
    assert row["agreement"]["passed"] and row["agreement"]["gradient_cosine"] > 0.99999, row["agreement"]


def test_compiled_layers_run_both_layouts_and_they_agree(monkeypatch):
    """`--compile`: both layouts run the decoder layers compiled in place (here aot_eager: no C++ toolchain), the
    chunks of prefix reuse too (`prefix_reuse.LAYERS = "compiled"`), with no graph break, and still agree; each
    step's count of the graphs it compiled is recorded (a measured step that compiled would time the compiler), with
    dynamo's reason for each recompile."""
    from torch._dynamo.utils import counters

    compiled = []

    def compile_layers(model, **kwargs):
        compiled.append(kwargs)
        return compile_decoder_layers(model, **{**kwargs, "backend": "aot_eager"})

    monkeypatch.setattr(bench, "compile_decoder_layers", compile_layers)
    monkeypatch.setattr(bench.prefix_reuse, "LAYERS", "eager")  # what the flag sets, put back after the test
    torch._dynamo.reset()
    counters.clear()
    args = argparse.Namespace(**{**ARGS, "compile": True, "optimizer": False})
    row = bench.measure("tiny", "smoke", args, save=lambda row: None, earlier={})
    assert compiled == [{"backend": "inductor", "dynamic": True}] and bench.prefix_reuse.LAYERS == "compiled"
    assert counters["stats"]["unique_graphs"] >= 2 and not counters["graph_break"], dict(counters["graph_break"])
    assert row["agreement"]["passed"] and row["agreement"]["gradient_cosine"] > 0.99999, row["agreement"]
    # each step's count of graphs it compiled: every graph in the warm-up, none in a measured step
    per_step = {method: row["methods"][method]["graphs_compiled"] for method in ("split", "reuse")}
    assert sum(map(sum, per_step.values())) == counters["stats"]["unique_graphs"], per_step
    assert all(steps[0] >= 1 and not any(steps[1:]) for steps in per_step.values()), per_step
    # and the guards that failed for each recompile: prefix reuse's chunks run without and with grad, one graph each
    reasons = row["methods"]["reuse"]["recompile_reasons"]
    assert any("grad_mode" in message for message in reasons[0]) and not any(reasons[1:]), reasons


def test_eager_chunks_beside_compiled_ones_agree_and_are_paired(monkeypatch):
    """`reuse_eager` under `--compile`: prefix reuse with its chunks on the eager layers
    (`HF_TREE_ATTN_PREFIX_REUSE_LAYERS=eager`) while `reuse`'s run the compiled ones; it compiles no graph of its own,
    agrees with the split and with `reuse`, and `paired_layers` is its seconds over `reuse`'s per measured step. The
    model's layer setting is left as it was."""
    seen = []
    step = bench.step

    def spy(model, sequences, budget, method, weights, scored):
        seen.append((method, bench.prefix_reuse.LAYERS))
        return step(model, sequences, budget, method, weights, scored)

    monkeypatch.setattr(bench, "step", spy)
    monkeypatch.setattr(bench, "compile_decoder_layers", lambda model, **kw: compile_decoder_layers(
        model, **{**kw, "backend": "aot_eager"}))  # fmt: skip
    monkeypatch.setattr(bench.prefix_reuse, "LAYERS", "eager")  # what the flag sets, put back after the test
    layers_seen = []
    sequence_logprobs = bench.sequence_logprobs

    def layers_at_run(*args, **kwargs):  # what the chunks run, read where they run
        layers_seen.append(bench.prefix_reuse.LAYERS)
        return sequence_logprobs(*args, **kwargs)

    monkeypatch.setattr(bench, "sequence_logprobs", layers_at_run)
    torch._dynamo.reset()
    methods = ["split", "reuse", "reuse_eager"]
    args = argparse.Namespace(**{**ARGS, "compile": True, "optimizer": False, "methods": methods})
    row = bench.measure("tiny", "smoke", args, save=lambda row: None, earlier={})
    assert {m for m, _ in seen} == set(methods) and bench.prefix_reuse.LAYERS == "compiled"
    assert set(layers_seen) == {"compiled", "eager"} and layers_seen.count("eager") == 1 + 8  # warm-up + measured
    assert not any(row["methods"]["reuse_eager"]["graphs_compiled"]), row["methods"]["reuse_eager"]
    for key in ("eager", "layers"):
        check, pair = row["agreement_" + key], row["paired_" + key]
        assert check["passed"] and check["max_abs"] < 1e-5 and pair["steps"] == 8 and not pair["failed"], key
    eager, compiled = (row["methods"][m]["measured_step_s"] for m in ("reuse_eager", "reuse"))
    ratios = [e / c for e, c in zip(eager, compiled)]
    assert (row["paired_layers"]["min"], row["paired_layers"]["max"]) == pytest.approx((min(ratios), max(ratios)))


def test_eager_chunks_are_refused_without_compiled_layers_beside_them(monkeypatch, capsys):
    """Without `--compile` every method's chunks run the eager layers: `reuse_eager` would be `reuse` again."""
    monkeypatch.setattr(sys, "argv", ["bench", "--device", "cpu", "--methods", "split", "reuse_eager"])
    with pytest.raises(SystemExit):
        bench.main()
    err = capsys.readouterr().err
    assert "--methods reuse_eager" in err and "add --compile" in err, err


def _bf16_row(monkeypatch, off_method: str | None = None, shift: float = 0.0) -> dict:
    """A bf16 row of the split, prefix reuse and the float32 reference; `off_method`'s log-probs shifted."""
    if off_method is not None:
        step = bench.step
        monkeypatch.setattr(
            bench, "step", lambda *a: [lp + shift for lp in step(*a)] if a[3] == off_method else step(*a)
        )
    args = argparse.Namespace(**{**ARGS, "dtype": "bfloat16", "methods": ["split", "reuse", "reference"]})
    return bench.measure("tiny", "smoke", args, save=lambda row: None, earlier={})


def test_with_the_float32_reference_each_bf16_layout_is_judged_by_its_error_to_it(monkeypatch):
    """`reference`: the bf16 layouts' log-probs against float32 (the GPU tests' rule, `harness.agreement`): both are
    off float32 by bf16 rounding, prefix reuse within twice the split's error plus one rounding."""
    row = _bf16_row(monkeypatch)
    check = row["agreement"]
    assert check["rule"] == "candidate <= 2 x baseline + u|exact|" and check["passed"], check
    assert 0 < check["max_error"]["baseline"] < 0.5 and 0 < check["max_error"]["candidate"] < 0.5, check
    assert row["methods"]["reference"]["dtype"] == "float32" and not row["paired"]["failed"]


def test_with_the_float32_reference_a_reuse_step_that_is_off_fails(monkeypatch):
    """A reuse step off by more than twice the split's bf16 error (measured in the same row unshifted) fails."""
    error = _bf16_row(monkeypatch)["agreement"]["max_error"]["baseline"]
    row = _bf16_row(monkeypatch, "reuse", shift=4 * error + 0.1)
    assert not row["agreement"]["passed"] and row["paired"]["failed"], row["agreement"]


def test_a_reference_run_in_its_own_process_judges_the_earlier_methods(tmp_path, monkeypatch):
    """`--methods reference --resume` after the timed methods (no `--first-dir`): it reruns their first steps and
    judges them against float32; the timed methods' steps are kept."""
    import json

    out = tmp_path / "out.json"
    common = ["--models", "tiny", "--workloads", "smoke", "--device", "cpu", "--dtype", "bfloat16", "--warmup", "1",
              "--out", str(out)]  # fmt: skip
    for extra in (["--methods", "split", "reuse"], ["--methods", "reference", "--resume"]):
        monkeypatch.setattr(sys, "argv", ["bench_prefix_reuse_gpu.py", *common, *extra])
        bench.main()
    (row,) = json.loads(out.read_text())["rows"]
    assert row["methods"].keys() == {"split", "reuse", "reference"} and row["paired"]["steps"] == 8
    assert sorted(row["agreement_steps_rerun"]) == ["reuse", "split"]
    assert row["agreement"]["passed"] and "max_error" in row["agreement"], row["agreement"]


def test_profile_adds_one_untimed_step_per_method(monkeypatch):
    """`--profile`: each method runs one step more, under the profiler, outside its timed steps."""
    calls = []
    step = bench.step
    monkeypatch.setattr(bench, "step", lambda *a: calls.append(a[3]) or step(*a))
    args = argparse.Namespace(**{**ARGS, "steps": 1, "profile": True, "optimizer": False})
    row = bench.measure("tiny", "smoke", args, save=lambda row: None, earlier={})
    for method in ("split", "reuse"):
        run = row["methods"][method]
        assert calls.count(method) == 3 and len(run["step_s"]) == 2, (method, calls)
        assert run["profile"]["wall_profiled_s"] > 0 and run["profile"]["top_host_ops"], run["profile"]


def test_undeclared_lengths_turns_the_declaration_off_and_says_so(tmp_path, monkeypatch):
    """`--undeclared-lengths`: FlexAttention's lengths are not declared multiples of 128 (its kernels as generated
    before the declaration, the A side of an A/B), and the file records which side it is."""
    import json

    import hf_tree_attn.attention

    declare = hf_tree_attn.attention._declare_block_multiples
    monkeypatch.setattr(hf_tree_attn.attention, "_declare_block_multiples", declare)  # restored after the test
    for flag, declared in (([], True), (["--undeclared-lengths"], False)):
        out = tmp_path / f"{declared}.json"
        monkeypatch.setattr(sys, "argv", [
            "bench_prefix_reuse_gpu.py", "--models", "tiny", "--workloads", "smoke", "--device", "cpu", "--dtype",
            "float32", "--methods", "split", "--warmup", "1", "--steps", "1", "--out", str(out), *flag,
        ])  # fmt: skip
        bench.main()
        assert json.loads(out.read_text())["declared_lengths"] is declared
        assert (hf_tree_attn.attention._declare_block_multiples is declare) is declared
