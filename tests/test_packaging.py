"""The repository stands alone: the installed package holds the trainer, imports lightly, has one version."""

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import hf_tree_attn

REPO = Path(__file__).resolve().parent.parent


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True)


def test_trainer_imports_from_the_installed_package_outside_the_repo(tmp_path):
    code = (
        "import importlib.util, hf_tree_attn\n"
        "from hf_tree_attn.trainer import TreeGRPOConfig, TreeGRPOTrainer\n"
        "assert hf_tree_attn.TreeGRPOTrainer is TreeGRPOTrainer and hf_tree_attn.TreeGRPOConfig is TreeGRPOConfig\n"
        "assert importlib.util.find_spec('trainers') is None, 'the repo is on sys.path: not a real install test'\n"
        "print(TreeGRPOTrainer.__module__)"
    )
    result = _python(code, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "hf_tree_attn.trainer.grpo_trainer"


def test_a_built_install_holds_the_trainer(tmp_path):
    """A regular (non-editable) install of the package, imported from outside the repository, has the trainer."""
    source, site = tmp_path / "source", tmp_path / "site"
    source.mkdir()  # a copy: setuptools builds inside the source tree
    for name in ("setup.cfg", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "hf_tree_attn", source / "hf_tree_attn", ignore=shutil.ignore_patterns("__pycache__"))
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target"]
    result = subprocess.run([*install, str(site), str(source)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (site / "hf_tree_attn" / "trainer" / "grpo_trainer.py").is_file()
    code = "import hf_tree_attn\nfrom hf_tree_attn.trainer import TreeGRPOTrainer\nprint(hf_tree_attn.__file__)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)  # ahead of the editable install of the repository
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().startswith(str(site))


def test_import_hf_tree_attn_does_not_import_trl_or_datasets(tmp_path):
    code = "import sys, hf_tree_attn\nprint(sorted(m for m in ('trl', 'datasets', 'peft') if m in sys.modules))"
    result = _python(code, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"


def test_version_lives_in_one_place_and_the_changelog_has_it():
    assert importlib.metadata.version("hf_tree_attn") == hf_tree_attn.__version__
    assert "version = attr: hf_tree_attn.__version__" in (REPO / "setup.cfg").read_text()
    changelog = (REPO / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[?{re.escape(hf_tree_attn.__version__)}\]?", changelog, flags=re.M)


def test_license_is_the_apache_2_text_setup_cfg_names():
    assert "Apache License\n                           Version 2.0, January 2004" in (REPO / "LICENSE").read_text()
    assert "license = Apache-2.0" in (REPO / "setup.cfg").read_text()


def test_no_reference_to_files_outside_the_repository():
    suffixes = {".py", ".md", ".yaml", ".yml", ".sh", ".cfg", ".toml", ".txt", ".json"}
    skip = {".venv", "outputs", ".git", "build", "dist", "hf_tree_attn.egg-info"}
    pattern = re.compile(r"reference/|peers\.md|\.\./shared|/work/shared|hf_trl_apis|measured_baselines")
    offenders = []
    for path in REPO.rglob("*"):
        parts = set(path.relative_to(REPO).parts)
        if path.suffix in suffixes and not skip & parts and path != Path(__file__) and path.is_file():
            offenders += [f"{path.relative_to(REPO)}: {m.group(0)}" for m in pattern.finditer(path.read_text())]
    assert offenders == [], offenders
