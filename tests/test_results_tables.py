"""benchmarks/results/README.md and README.md's table are what benchmarks/results_tables.py writes from the committed
result files; every result file is registered and shown; every GPU file is what its stage of run_h200.sh runs."""

import copy
import re
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import results_registry  # noqa: E402
import results_tables  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"


def test_committed_readmes_are_the_scripts_output():
    assert (RESULTS / "README.md").read_text() == results_tables.results_readme(), (
        "benchmarks/results/README.md is stale: run `python benchmarks/results_tables.py`"
    )
    readme = (REPO / "README.md").read_text()
    assert results_tables.with_readme_table(readme) == readme, (
        "README.md's table is stale: run `python benchmarks/results_tables.py`"
    )


def test_every_result_file_is_registered_and_shown():
    files = {path.name for path in RESULTS.iterdir() if path.name != "README.md"}
    assert files == set(results_registry.SOURCES), "register new result files in results_registry.SOURCES"
    tables = results_tables.results_readme().split("## Result files")[0] + (REPO / "README.md").read_text()
    unshown = [name for name in results_registry.SOURCES if f"{name})" not in tables]
    assert not unshown, f"registered but in no table: {unshown}"


def stage_bodies() -> dict[str, str]:
    """run_h200.sh's stages: name -> its commands, continuation lines joined, quotes dropped; a stage that runs a job
    script of benchmarks/ (`bash benchmarks/X.sh`) also holds that script's commands."""

    def read(name: str) -> str:
        return (REPO / "benchmarks" / name).read_text().replace("\\\n", " ")

    cases = read("run_h200.sh").split("case $stage in", 1)[1].split("\n  esac", 1)[0]
    bodies = {}
    for match in re.finditer(r"^    ([\w.\-]+)\)(.*?);;", cases, flags=re.M | re.S):
        body = match.group(2) + "".join(
            read(name) for name in re.findall(r"\bbash benchmarks/(\w+\.sh)", match.group(2))
        )
        body = body.replace("python3 -m accelerate.commands.launch", "accelerate launch")
        bodies[match.group(1)] = " ".join(body.replace('"', "").replace("'", "").split())
    return bodies


def without_out(command: str) -> str:
    """A recorded command, `python` and the `--out PATH` dropped (the stage writes to $OUT)."""
    words = shlex.split(command.replace('"', '\\"'))
    if "--out" in words:
        del words[words.index("--out") : words.index("--out") + 2]
    while words and (words[0] in ("python", "python3", "timeout") or words[0].isdigit()):
        words.pop(0)
        if words[:1] == ["-s"]:  # timeout's signal
            del words[:2]
    return " ".join(words).replace('"', "")


def test_each_gpu_result_is_what_its_stage_runs():
    bodies = stage_bodies()
    assert {"trainer-phase-8b", "gpu-tests-kernels", "fsdp2-main-job"} <= set(bodies)  # the parser found the stages
    assert "benchmarks/bench_async_grpo.py" in bodies["async-grpo"]  # and read the job script a stage runs
    for name, stage in results_registry.SOURCES.items():
        if stage is None:
            continue
        assert stage in bodies, f"{name}: no stage {stage!r} in benchmarks/run_h200.sh"
        # Stages that may run on an H100 name their file after the card they ran on (`${card}`).
        card = "h100" if re.search(r"(^|_)h100(_|\.)", name) else "h200"
        body = bodies[stage].replace("${card}", card)
        assert f"$OUT/{name}" in body, f"{name}: stage {stage} does not write it"
        command = results_tables.command_of(name)
        if command is not None:
            assert without_out(command) in body, f"{name}: stage {stage} does not run {command!r}"


def test_a_changed_registry_or_number_changes_the_output(monkeypatch):
    """The READMEs follow the registry and the numbers (the first test cannot pass on a frozen text)."""
    monkeypatch.setattr(results_tables, "PENDING", {**results_registry.PENDING, "peers": []})
    assert results_tables.results_readme() != (RESULTS / "README.md").read_text()
    pair = results_tables.trainer_row("async_grpo_h100_qwen3-1.7b_default.json", "grpo_mixed")["paired"]["tree vs trl"]
    monkeypatch.setitem(pair, "median", pair["median"] / 2)
    readme = (REPO / "README.md").read_text()
    assert results_tables.with_readme_table(readme) != readme


def test_every_source_names_the_commit_it_measured():
    """A JSON's `git_commit`, a log's header line, `LOG_COMMITS` over a log's stale checkout line, or that the file
    records none; every source cell of the tables and every row of the file list says which."""
    assert results_tables.commit_of("async_grpo_h100_qwen3-1.7b_default.json") == "1f9235b"
    assert results_tables.commit_of("h200_gpu_tests_all.log") == "339207f"
    assert "commit 3b95163" in (RESULTS / "h100_gpu_tests_deepspeed.log").read_text()  # the stale checkout's line
    assert results_tables.commit_of("h100_gpu_tests_deepspeed.log") == "e112227"
    assert results_tables.commit_of("levels_h200.json") is None
    assert results_tables.commit_of("prefix_reuse_work_cpu.json") == "e6c77ed, dirty"
    readme = (RESULTS / "README.md").read_text()
    tables, files = readme.split("## Result files")
    for name in results_registry.SOURCES:
        expected = results_tables.commit_cell(name)
        for cell in re.findall(rf"\[{re.escape(name)}\]\({re.escape(name)}\)[^|]*", tables):
            if " · " in cell:  # a row's source cell (not a link in a note's text)
                assert expected in cell, f"{name}: its source cell {cell!r} does not name {expected}"
        if not name.endswith(".png"):
            (row,) = [line for line in files.splitlines() if line.startswith(f"| [{name}]")]
            assert row.rstrip(" |").endswith(expected), f"{name}: the file list does not name {expected}"


def test_compiled_against_eager_chunks_shows_once_a_file_holds_the_pair(monkeypatch):
    """The table of prefix reuse's chunks on compiled against eager layers (`paired_layers`) is absent while no
    registered bench_prefix_reuse_gpu.py file holds that pair, and then prints its paired ratios and agreement."""
    name = "prefix_reuse_gpu_h100_qwen3-1.7b_compiled_aligned.json"
    data = copy.deepcopy(results_tables.load(name))
    row = data["rows"][0]
    del row["paired_layers"]
    load = results_tables.load
    monkeypatch.setattr(results_tables, "load", lambda n: data if n == name else load(n))
    assert results_tables.prefix_reuse_layers() == []

    def run(seconds):
        return {"median_step_s": seconds, "measured_step_s": [seconds] * 8, "first_step_s": 60.0, "peak_gib": 39.0}

    def pair(median):
        return {"median": median, "min": median - 0.01, "max": median + 0.01, "failed": False}

    check = {"max_abs": 3e-3, "gradient_cosine": 0.9999, "passed": True}
    row["methods"] = {**row["methods"], "reuse": run(25.9), "reuse_eager": run(29.0)}
    row.update(paired_layers=pair(1.12), agreement_layers=check, paired_eager=pair(0.73), paired=pair(0.82))
    lines = results_tables.prefix_reuse_layers()
    (line,) = [line for line in lines if line.startswith("| Qwen3-1.7B")]
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    assert cells[3].startswith("29.0 s [29.00, 29.00 s], first step 60.0 s, 39.0 GiB")
    assert cells[4].startswith("25.9 s")
    assert cells[5:9] == ["**1.12×** [1.11×, 1.13×]", "max abs 3.0e-03, gradient cosine 0.999900",
                          "**0.73×** [0.72×, 0.74×]", "**0.82×** [0.81×, 0.83×]"]  # fmt: skip
    assert f"[{name}]({name})" in cells[9]
