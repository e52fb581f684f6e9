"""The table of a run: each selected test's outcome with TRL's `GRPOTrainer` and with `TreeGRPOTrainer`.

    python summarize.py WORK_DIR            counts, then every test whose outcomes differ or that did not pass;
                                            exit status 1 if a test passes with TRL's trainer and not with the tree
    python summarize.py WORK_DIR -v         ... plus the tree run's error for each test that passes only with TRL
    python summarize.py WORK_DIR --markdown the same as a Markdown table (what results.md holds)
    python summarize.py WORK_DIR --todo T   the selected tests that run and have no outcome yet with trainer T

Also lists the warnings and log records (WARNING and above) the tree trainer emitted in a test where TRL's did not.
"""

from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path


def _lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open() as f:
        return [json.loads(line) for line in f]


def load(work: Path, trainer: str) -> dict[str, dict]:
    """The last result of each test in `runs/<trainer>/results.jsonl` (a re-run overrides)."""
    return {r["test"]: r for r in _lines(work / "runs" / trainer / "results.jsonl")}


def events(work: Path, trainer: str) -> dict[str, list[dict]]:
    out = collections.defaultdict(list)
    for event in _lines(work / "runs" / trainer / "events.jsonl"):
        out[event.get("test")].append(event)
    return out


def _norm(message: str) -> str:
    message = re.sub(r"0x[0-9a-f]+", "0x?", message)
    message = re.sub(r"\{'prompt'.*", "{...}", message, flags=re.S)
    return re.sub(r"\d+(\.\d+)?", "N", message)[:140]


def _event_key(event: dict) -> tuple:
    return event["kind"], event.get("category") or event.get("logger"), _norm(event["message"])


def table(work: Path) -> list[tuple[str, str, str]]:
    """`(test id, outcome with TRL, outcome with the tree)` for every selected test."""
    selected = set((work / "selected_ids.txt").read_text().split())
    with (work / "collected.json").open() as f:
        collected = [item for item in json.load(f) if item["id"] in selected]
    trl, tree = load(work, "trl"), load(work, "tree")
    rows = []
    for item in collected:
        test = item["id"]
        if item["skip"]:
            rows.append((test, "skipped", "skipped"))
        else:
            rows.append(
                (test, trl.get(test, {}).get("outcome", "not-run"), tree.get(test, {}).get("outcome", "not-run"))
            )
    return rows


def extra_warnings(work: Path) -> tuple[collections.Counter, dict[tuple, set[str]]]:
    """Warnings / log records seen with the tree trainer but not with TRL's in the same test, with their tests."""
    trl, tree = events(work, "trl"), events(work, "tree")
    seen = collections.defaultdict(set)
    for test, found in trl.items():
        seen[test] = {_event_key(e) for e in found}
    extra, where = collections.Counter(), collections.defaultdict(set)
    for test, found in tree.items():
        if test not in trl:
            continue
        for event in found:
            if event["kind"] == "tree_counts":  # the tree run's own tally, not a warning
                continue
            key = _event_key(event)
            if key not in seen[test]:
                extra[key] += 1
                where[key].add(test.split("::", 1)[1])
    return extra, where


def todo(work: Path, trainer: str) -> list[str]:
    """The selected tests that TRL's file does not skip here and that have no recorded outcome with `trainer`."""
    column = {"trl": 1, "tree": 2}[trainer]
    return [row[0] for row in table(work) if row[column] == "not-run"]


def tree_counts(work: Path) -> collections.Counter:
    """The tree run's tally summed over its tests: forwards on trees, and chunks that fell back to TRL's flat path."""
    total = collections.Counter()
    for found in events(work, "tree").values():
        for event in found:
            if event["kind"] == "tree_counts":
                total.update({k: v for k, v in event.items() if isinstance(v, int)})
    return total


def main() -> None:
    work = Path(sys.argv[1]).resolve()
    if "--todo" in sys.argv:
        sys.stdout.write("".join(f"{test}\n" for test in todo(work, sys.argv[sys.argv.index("--todo") + 1])))
        return
    rows = table(work)
    counts = collections.Counter((a, b) for _, a, b in rows)
    # listed: every test that did not pass with both, but for one that passed with the tree and was not run with TRL
    differing = [
        (t, a, b)
        for t, a, b in rows
        if not (a == b and a in ("passed", "skipped")) and (a, b) != ("not-run", "passed")
    ]
    if "--markdown" in sys.argv:
        print("| with trl.GRPOTrainer | with TreeGRPOTrainer | tests |\n|---|---|---:|")
        for (a, b), n in sorted(counts.items()):
            print(f"| {a} | {b} | {n} |")
        print(f"\nThe tree run's forwards: {dict(tree_counts(work))}")
        print("\nTests whose outcome differs, or that did not pass with both:\n")
        print("| test | trl.GRPOTrainer | TreeGRPOTrainer |\n|---|---|---|")
        for t, a, b in differing:
            print(f"| `{t.split('::', 1)[1]}` | {a} | {b} |")
        return
    print(f"selected: {len(rows)}")
    for (a, b), n in sorted(counts.items()):
        print(f"  TRL={a:8s} Tree={b:8s}: {n}")
    print(f"\nThe tree run's forwards: {dict(tree_counts(work))}")
    print("\nTests whose outcome differs or that did not pass:")
    for t, a, b in differing:
        print(f"  TRL={a:8s} Tree={b:8s} {t.split('::', 1)[1]}")
    if "-v" in sys.argv:
        tree = load(work, "tree")
        for t, a, b in differing:
            if a == "passed" and b != "passed":
                print("\n####", t)
                print(tree[t].get("longrepr", "")[-2500:])
    extra, where = extra_warnings(work)
    print("\nWarnings / log records emitted with the tree trainer but not with TRL's in the same test:")
    for key, n in extra.most_common():
        print(f"  {n:3d} {key}\n        tests: {sorted(where[key])[:6]}")
    regressions = [t for t, a, b in rows if a == "passed" and b != "passed"]
    print(f"\nPassed with TRL's trainer, not with the tree trainer: {len(regressions)}")
    if regressions:
        sys.exit(1)


if __name__ == "__main__":
    main()
