"""The docs point at files that exist, and the repository describes the system rather than how it was built: no dead
links or paths to repository files in the docs, no diary words, run stages or issue numbers in any tracked file."""

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = ["README.md", "CHANGELOG.md", "benchmarks/README.md", "benchmarks/results/README.md", *sorted(
    str(path.relative_to(REPO)) for folder in ("docs", "tests/trl_suite") for path in (REPO / folder).glob("*.md")
)]  # fmt: skip
TOP_LEVEL = ("hf_tree_attn", "benchmarks", "docs", "tests", "trainers", "examples")

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE_PATH = re.compile(rf"`((?:{'|'.join(TOP_LEVEL)})/[^`\s:]*)")
RESULT_FILE = re.compile(r"`([\w.\-]+\.(?:json|log|txt|png))`")

# How the repository must not speak: of work sessions, of the stages of a day's GPU run (s7b, s2-a, a `_s8.json`
# suffix), of issue numbers. What a tool names so (pytest's banner and hook argument) is not ours.
DIARY = {
    "a work session": re.compile(r"\b" + "sess" + r"ions?\b", re.I),
    "a run stage named by its day": re.compile(
        r"(?<![\w-])s\d{1,2}[a-e]?(?:-[a-f])?(?![\w-])|_s\d{1,2}[a-e]?(?=[_.])"
    ),
    "an issue number": re.compile(r"\b(?:issue|pull request|PR)s?\s+#?\d+", re.I),
}
# pytest's banner, and its hooks' `session` argument.
TOOL_OUTPUT = re.compile(r"=+ test " + "session" + r" starts =+|def pytest_\w+\(" + "session" + r"\b")


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a document's headings (lower case, punctuation dropped, spaces to hyphens)."""
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors |= {slug} | {f"{slug}-{i}" for i in range(1, 5)}
    return anchors


def dead_references(text: str, path: Path) -> list[str]:
    """Links, anchors and repository paths in `text` (the document at `path`) that lead nowhere."""
    dead = []
    for target in LINK.findall(text):
        if re.match(r"(https?|mailto):", target):
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve()
        if file and (not resolved.exists() or REPO not in resolved.parents):
            dead.append(f"link {target}")
        elif (
            anchor
            and (resolved.suffix == ".md" or not file)
            and anchor not in github_anchors(resolved.read_text() if file else text)
        ):
            dead.append(f"anchor {target}")
    for code in CODE_PATH.findall(text):
        if not (list(REPO.glob(code)) if "*" in code else (REPO / code).exists()):
            dead.append(f"path `{code}`")
    if path.parent.name == "results":  # the results README names its files bare (and, bare too, files they wrote)
        kinds = {file.name.split("_")[0] for file in path.parent.iterdir()}
        named = [name for name in RESULT_FILE.findall(text) if name.split("_")[0] in kinds]
        dead += [f"file `{name}`" for name in named if not (path.parent / name).exists()]
    return dead


@pytest.mark.parametrize("doc", DOCS)
def test_docs_point_at_files_that_exist(doc):
    assert dead_references((REPO / doc).read_text(), REPO / doc) == []


def test_benchmarks_readme_lists_every_script():
    """benchmarks/README.md groups the scripts by what they measure: a new script gets its line there."""
    listed = set(re.findall(r"\(([\w.]+\.(?:py|sh))\)", (REPO / "benchmarks" / "README.md").read_text()))
    scripts = {path.name for path in (REPO / "benchmarks").glob("*") if path.suffix in (".py", ".sh")}
    assert scripts - listed == set(), "benchmarks/README.md does not list these scripts"


def test_dead_references_are_found():
    """The checker sees a dead link, a dead anchor and a dead path (the test above cannot pass vacuously)."""
    probe = (
        "# Probe\n[a](missing.md) [b](how_it_works.md#no-such-heading) [c](#probe) [d](#nowhere) "
        "[e](how_it_works.md#the-layout) [f](../README.md) [g](../../outside.md)\n"
        "`benchmarks/results/no_such_file.json` `hf_tree_attn/tree.py` `benchmarks/results/*.json` `docs/*.xyz`\n"
    )
    assert dead_references(probe, REPO / "docs" / "probe.md") == [
        "link missing.md",
        "anchor how_it_works.md#no-such-heading",
        "anchor #nowhere",
        "link ../../outside.md",
        "path `benchmarks/results/no_such_file.json`",
        "path `docs/*.xyz`",
    ]
    results = "`tree_vs_flat_h200_qwen3-8b.json` `tree_vs_flat_h200_qwen3-8b_gone.json` `trainer_state.json`"
    assert dead_references(results, REPO / "benchmarks" / "results" / "probe.md") == [
        "file `tree_vs_flat_h200_qwen3-8b_gone.json`"
    ]


def tracked_text_files() -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = []
    for name in listed.splitlines():
        path = REPO / name
        if path.is_file() and path != Path(__file__) and b"\0" not in path.read_bytes()[:8192]:
            files.append(path)
    return files


def diary_lines(text: str) -> list[str]:
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        if TOOL_OUTPUT.search(line):
            continue
        found += [f"{number}: {what}: {line.strip()[:100]}" for what, pattern in DIARY.items() if pattern.search(line)]
    return found


def test_no_tracked_file_speaks_of_sessions_stages_or_issues():
    files = tracked_text_files()
    assert len(files) > 50
    offending = {str(path.relative_to(REPO)): lines for path in files if (lines := diary_lines(path.read_text()))}
    assert offending == {}


@pytest.mark.parametrize(
    "line, flagged",
    [
        ("## Session 8 (2026-12-01): the fused merge", True),
        ("Stages `s7`, `s7b`, `s7c` of the script", True),
        ("bash benchmarks/run_h200.sh s2-a", True),
        ("(`tree_vs_flat_h200_qwen3-8b_compile_keep_s8.json`)", True),
        ("`prefix_attention_h200_s6_unfused.json`", True),
        ("the FSDP2 run (issue 11)", True),
        ("issues 8-11 are still open", True),
        ("============================= test session starts ==============================", False),
        ("def pytest_collection_modifyitems(session, config, items):", False),
        ("the stage `kept-attention-8b`, 5.63× at s = 4096 tokens", False),
        ("sm90 kernels, fp8 / e4m3, qwen3.5-0.8b, 256-token completions, 0.9s", False),
        ("`tree_vs_flat_h200_qwen3-0.6b.json`, the s-th sequence, issue tracking systems", False),
    ],
)
def test_diary_patterns(line, flagged):
    assert bool(diary_lines(line)) == flagged
