"""benchmarks/harness.py's `--resume`: a benchmark split over several calls pairs the sides an earlier call wrote with
the ones it runs now, even though it re-writes its result file before its first side (rows it skips, and after every
side) — for every planned row, not only the first — and keeps the rows it does not redo."""

import json
import sys
from pathlib import Path

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
