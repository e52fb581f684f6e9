"""benchmarks/harness.py's `--resume`: a benchmark split over several calls pairs the sides an earlier call wrote with
the ones it runs now, even though it re-writes its result file before its first side (rows it skips, and after every
side) — for every planned row, not only the first — and keeps the rows it does not redo. And the command line, child
process and result file the side-by-side benchmarks share."""

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import harness  # noqa: E402


def _write(out: Path, rows: list[dict]) -> None:
    out.write_text(json.dumps({"command": "earlier", "git_commit": "abc", "rows": rows}))


def test_a_resumed_run_pairs_every_planned_row_with_the_earlier_sides(tmp_path, monkeypatch):
    out = tmp_path / "result.json"
    earlier = [
        {"model": "m", "workload": w, "sides": {"trl": {"step": w}, "tree": {"error": "died"}}} for w in ("a", "b")
    ]
    _write(out, [*earlier, {"model": "m", "workload": "kept", "sides": {"trl": {}}}])
    results = {"rows": []}
    sides = harness.resume(out, results, [("m", "a"), ("m", "b")])
    out.write_text(json.dumps(results))  # what a benchmark writes before its first side (its skipped rows)
    assert [r["workload"] for r in results["rows"]] == ["kept"]
    assert results["earlier_runs"][-1]["git_commit"] == "abc"

    monkeypatch.setattr(harness, "run_side", lambda script, side, argv, env: {"ran": side, "workload": argv[-1]})
    seen = []
    harness.run_rows(Path("bench.py"), out, results, [("m", "a"), ("m", "b")], ["tree"], {
        "argv": [], "env": lambda side: {}, "pair": lambda row: seen.append(sorted(row["sides"])),
        "summary": lambda row: "", "earlier": sides})  # fmt: skip
    rows = {r["workload"]: r for r in json.loads(out.read_text())["rows"]}
    for workload in ("a", "b"):
        assert rows[workload]["sides"]["trl"] == {"step": workload}  # the earlier side, kept for this row
        assert rows[workload]["sides"]["tree"] == {"ran": "tree", "workload": workload}  # the failed one run again
    assert seen == [["tree", "trl"], ["tree", "trl"]]
    assert "kept" in rows


def test_without_an_earlier_file_nothing_is_resumed(tmp_path):
    results = {"rows": []}
    assert harness.resume(tmp_path / "none.json", results, [("m", "a")]) == {}
    assert results == {"rows": []}


def test_the_shared_command_line_refuses_no_warmup_and_a_child_writes_its_side(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench.py", "--warmup", "0"])
    with pytest.raises(SystemExit):
        harness.side_arguments(argparse.ArgumentParser(), ["trl", "tree"], "out.json")
    side_out = tmp_path / "side.json"
    monkeypatch.setattr(sys, "argv", ["bench.py", "--side", "tree", "--side-out", str(side_out)])
    args = harness.side_arguments(argparse.ArgumentParser(), ["trl", "tree"], "out.json")
    assert (args.steps, args.warmup, args.scale, args.out, args.resume) == (8, 2, 1.0, "out.json", False)
    assert harness.run_child(args, lambda a: {"side": a.side})
    assert json.loads(side_out.read_text()) == {"side": "tree"}
    args.side = None
    assert not harness.run_child(args, lambda a: pytest.fail("the parent runs no side itself"))


def test_the_result_file_is_made_where_asked_and_resumed_only_when_asked(tmp_path):
    out = tmp_path / "deep" / "result.json"
    _, earlier = harness.result_file(argparse.Namespace(out=str(out), resume=True), {"rows": []}, [("m", "a")])
    assert out.parent.is_dir() and earlier == {}
    _write(out, [{"model": "m", "workload": "a", "sides": {"trl": {"step": 1}}}])
    _, earlier = harness.result_file(argparse.Namespace(out=str(out), resume=False), {"rows": []}, [("m", "a")])
    assert earlier == {}
    _, earlier = harness.result_file(argparse.Namespace(out=str(out), resume=True), {"rows": []}, [("m", "a")])
    assert earlier == {("m", "a"): {"trl": {"step": 1}}}
