"""The main job, `accelerate launch trainers/grpo_tree.py`, exactly as the README runs it (embedded default)."""

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "trainers" / "grpo_tree.py"


def _launch(*args: str, timeout: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", TOKENIZERS_PARALLELISM="false")
    command = [sys.executable, "-m", "accelerate.commands.launch", str(SCRIPT), *args]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _log_history(output_dir: Path) -> list[dict]:
    return json.loads((output_dir / "trainer_state.json").read_text())["log_history"]


def test_short_run_saves_everything_and_logs_tree_metrics(tmp_path):
    result = _launch("--max_steps", "4", "--logging_steps", "2", "--output_dir", str(tmp_path), timeout=600)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "trainer_state.json"):
        assert (tmp_path / name).is_file(), name
    assert "4/4" in result.stderr  # the Trainer progress bar
    card = (tmp_path / "README.md").read_text()  # TRL's model card, with the tree settings
    assert "This model was trained with GRPO" in card and "## Tree training" in card
    assert "| `tree_packing` | `True` |" in card and "| `tree_max_token_ratio` | `0.9` |" in card
    logs = [entry for entry in _log_history(tmp_path) if "reward" in entry]
    assert len(logs) == 2
    assert all(entry["tree_token_ratio"] < 0.6 and entry["tree_fallback"] == 0 for entry in logs)
    assert all(0 < entry["tree_flops_saved"] < 1 for entry in logs)


def test_yaml_config_and_lora_adapter(tmp_path):
    config = REPO / "trainers" / "configs" / "grpo_toy.yaml"
    args = ["--config", str(config), "--use_peft", "--lora_target_modules", "q_proj", "v_proj"]
    _launch(*args, "--max_steps", "2", "--logging_steps", "1", "--output_dir", str(tmp_path), timeout=600)
    assert (tmp_path / "adapter_model.safetensors").is_file() and (tmp_path / "adapter_config.json").is_file()
    assert not (tmp_path / "model.safetensors").exists()
    assert (tmp_path / "tokenizer.json").is_file() and (tmp_path / "trainer_state.json").is_file()
    assert json.loads((tmp_path / "trainer_state.json").read_text())["max_steps"] == 2  # the flag beat the YAML


def test_real_run_flags_model_dataset_and_reward(tmp_path):
    """`--model_name_or_path`, `--dataset_name` and `--reward_funcs <dotted path>` as in TRL's own grpo script."""
    sys.path.insert(0, str(REPO))
    from trainers import toy_task

    model_dir, data_dir = tmp_path / "model", tmp_path / "data"
    tokenizer = toy_task.build_tokenizer()
    toy_task.build_model(tokenizer, seed=1).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data_dir.mkdir()
    toy_task.build_dataset(64, seed=1).to_json(data_dir / "train.jsonl")
    args = ["--model_name_or_path", str(model_dir), "--dataset_name", str(data_dir)]
    args += ["--reward_funcs", "trainers.toy_task.copy_letter_reward", "--per_device_train_batch_size", "8"]
    args += ["--num_generations", "4", "--max_completion_length", "4", "--max_steps", "2", "--logging_steps", "1"]
    args += ["--report_to", "none", "--output_dir", str(tmp_path / "out")]  # machine defaults: fp32 on a CPU
    _launch(*args, timeout=600)
    logs = [entry for entry in _log_history(tmp_path / "out") if "reward" in entry]
    assert len(logs) == 2 and all(entry["tree_fallback"] == 0 for entry in logs)
    assert "rewards/copy_letter_reward/mean" in logs[0]
    assert not (tmp_path / "out" / "initial_model").exists()  # a real model is not rebuilt


def test_help_prints_every_tree_field():
    result = subprocess.run([sys.executable, str(SCRIPT), "--help"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    for flag in ("--tree_packing", "--max_tokens_per_mb", "--tree_max_token_ratio", "--model_name_or_path"):
        assert flag in result.stdout


def _parse(*argv):
    from trainers import grpo_tree

    return grpo_tree, grpo_tree.parse_args(list(argv))


def test_a_model_keeps_the_machine_defaults_but_not_the_embedded_task(tmp_path):
    import torch

    _, (_, training_args, model_args, _, _) = _parse("--model_name_or_path", "m", "--dataset_name", "d")
    assert training_args.use_cpu == (not torch.cuda.is_available())
    assert training_args.bf16 == torch.cuda.is_available()
    assert model_args.model_name_or_path == "m" and training_args.max_steps == -1  # TRL's default, not the toy's
    _, (_, training_args, _, _, _) = _parse("--output_dir", str(tmp_path))
    assert training_args.max_steps == 600 and training_args.num_generations == 8  # the embedded task


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--model_name_or_path", "m"], r"--model_name_or_path m is given but no dataset: pass --dataset_name"),
        (["--dataset_name", "d"], r"A dataset is given but no model: pass --model_name_or_path"),
    ],
    ids=["model-without-dataset", "dataset-without-model"],
)
def test_a_real_run_needs_a_model_and_a_dataset(tmp_path, argv, match):
    grpo_tree, args = _parse(*argv, "--output_dir", str(tmp_path))
    with pytest.raises(ValueError, match=match):
        grpo_tree.main(*args)
    assert not any(tmp_path.iterdir())  # nothing trained, nothing written


def test_unknown_yaml_key_is_an_error(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("model_name_or_path: m\ndataset_nme: trl-lib/DeepMath-103K\n")
    with pytest.raises(ValueError, match=r"Unknown arguments from config file: \['--dataset_nme'"):
        _parse("--config", str(config), "--output_dir", str(tmp_path))


def test_embedded_hybrid_model_runs_on_the_tree(tmp_path):
    """`--embedded_model qwen3_5`: the embedded task on a tiny Qwen3.5 (Gated DeltaNet + full attention)."""
    _launch("--embedded_model", "qwen3_5", "--max_steps", "2", "--logging_steps", "1", "--output_dir", str(tmp_path),
            timeout=600)  # fmt: skip
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen3_5ForCausalLM"]
    logs = [entry for entry in _log_history(tmp_path) if "reward" in entry]
    assert len(logs) == 2 and all(entry["tree_token_ratio"] < 0.6 and entry["tree_fallback"] == 0 for entry in logs)


@pytest.mark.slow
def test_default_job_learns_within_ten_minutes(tmp_path):
    """The full default job: reward rises by >= 0.2 (last quarter of logs vs first) with tree_token_ratio < 0.6."""
    start = time.monotonic()
    _launch("--output_dir", str(tmp_path), timeout=600)
    elapsed = time.monotonic() - start
    logs = [entry for entry in _log_history(tmp_path) if "reward" in entry]
    rewards = [entry["reward"] for entry in logs]
    quarter = len(rewards) // 4
    first, last = statistics.mean(rewards[:quarter]), statistics.mean(rewards[-quarter:])
    assert last >= first + 0.2, f"reward did not rise: first quarter {first:.3f}, last quarter {last:.3f}"
    assert max(entry["tree_token_ratio"] for entry in logs) < 0.6
    assert elapsed < 600


@pytest.mark.multi_gpu
def test_fsdp2_on_two_gpus(tmp_path):
    """`accelerate launch --config_file trainers/configs/fsdp2.yaml trainers/grpo_tree.py` on 2 GPUs, shortened."""
    config = REPO / "trainers" / "configs" / "fsdp2.yaml"
    args = ["--max_steps", "20", "--logging_steps", "5", "--output_dir", str(tmp_path)]
    env_args = ["--config_file", str(config), "--num_processes", "2"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", NCCL_NVLS_ENABLE="0")
    command = [sys.executable, "-m", "accelerate.commands.launch", *env_args, str(SCRIPT), *args]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "trainer_state.json").is_file()
    logs = [entry for entry in _log_history(tmp_path) if "reward" in entry]
    assert logs and all(entry["tree_token_ratio"] < 0.6 and entry["tree_fallback"] == 0 for entry in logs)


@pytest.mark.multi_gpu
def test_fsdp2_with_prefix_reuse_on_two_gpus(tmp_path):
    """The same with `--tree_prefix_reuse true` in chunks of 128 rows (FlexAttention's block, its default CUDA path):
    every rank runs as many chunks (its exactness: `tests/test_fsdp_trainers.py`, on CPU)."""
    config = REPO / "trainers" / "configs" / "fsdp2.yaml"
    args = ["--max_steps", "10", "--logging_steps", "5", "--output_dir", str(tmp_path), "--tree_prefix_reuse", "true",
            "--max_tokens_per_mb", "128"]  # fmt: skip
    env_args = ["--config_file", str(config), "--num_processes", "2"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", NCCL_NVLS_ENABLE="0")
    command = [sys.executable, "-m", "accelerate.commands.launch", *env_args, str(SCRIPT), *args]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    logs = [entry for entry in _log_history(tmp_path) if "reward" in entry]
    assert logs and all(entry["tree_fallback"] == 0 for entry in logs)
