"""DeepSpeed ZeRO-2 and ZeRO-3 on one CUDA GPU, bf16 as TRL runs it: `TreeGRPOTrainer` against `trl.GRPOTrainer`.

One process is enough for ZeRO to partition and gather (a world of one still runs every ZeRO-3 module hook and
gradient partition); `tests/test_deepspeed.py` runs two processes on CPU. Each launch is `accelerate launch
--config_file trainers/configs/deepspeed_zero{2,3}.yaml --num_processes 1` of this file, as a user launches TRL.

Both trainers train 4 optimizer steps on the same completions (a seeded stand-in generator, TRL's `rollout_func`,
so that a sample flipped by bf16 rounding cannot part the runs), with a reference model, two iterations per
generation and gradient checkpointing; then the same with a LoRA adapter. Tolerance, as in `test_precision.py`:
bf16 moves both trainers off their float32 run (TRL's, under ZeRO-3 without mixed precision), and the tree must be
no farther from it than twice TRL's bf16 run, plus one bf16 unit roundoff of the values' scale.

`pytest -m gpu tests/test_gpu_deepspeed.py` — skipped without CUDA or without deepspeed; the main job on 2 GPUs
(`multi_gpu`) skips with fewer.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import socket
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
RUNS = ("full", "lora")
STEPS = 4
U_BF16 = torch.finfo(torch.bfloat16).eps / 2

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed"),
]


# ------------------------------------------------------------------------------------------------------ the worker


def _rollout(prompts: list[str], trainer) -> dict:
    """TRL `rollout_func`: each prompt's tokens and 8-40 completion tokens of the toy vocabulary, seeded by the
    prompt and its index in the group — every run trains on the same completions."""
    prompt_ids = trainer.processing_class(prompts, add_special_tokens=False)["input_ids"]
    completion_ids, seen = [], {}
    for prompt in prompts:
        k = seen[prompt] = seen.get(prompt, -1) + 1
        rng = random.Random(zlib.crc32(prompt.encode()) * 64 + k)
        completion_ids.append([rng.randrange(3, 40) for _ in range(rng.randint(8, 40))])
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


def _token_reward(completions, completion_ids, **kwargs) -> list[float]:
    """A reward of every sampled token, so groups get non-zero advantages (as tests/helpers.token_reward)."""
    return [float(sum(ids) % 5) for ids in completion_ids]


def _train(trainer_cls, model_path: str, out_dir: str, name: str, bf16: bool) -> dict:
    """Losses and trainable weights (DeepSpeed's fp32 master copy) before and after `STEPS` optimizer steps."""
    from deepspeed.utils import safe_get_full_fp32_param
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig

    from hf_tree_attn.trainer import TreeGRPOConfig, TreeGRPOTrainer
    from trainers import toy_task

    tree = issubclass(trainer_cls, TreeGRPOTrainer)
    fields = dict(
        output_dir=os.path.join(out_dir, f"{trainer_cls.__name__}_{name}"), bf16=bf16, seed=0,
        use_cpu=not torch.cuda.is_available(),  # a dry run of this file on CPU
        per_device_train_batch_size=8, num_generations=4, gradient_accumulation_steps=2, max_completion_length=40,
        max_steps=STEPS, num_iterations=2, beta=0.04, learning_rate=5e-2 if name == "lora" else 1e-2, optim="sgd",
        lr_scheduler_type="constant", logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        gradient_checkpointing=True, tree_max_token_ratio=1.0,
    )  # fmt: skip
    config_cls = TreeGRPOConfig if tree else GRPOConfig
    args = config_cls(**{k: v for k, v in fields.items() if k in config_cls.__dataclass_fields__})
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")

    class Weights(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.initial = _weights(model)

    def _weights(model):
        return {n: safe_get_full_fp32_param(p).cpu() for n, p in model.named_parameters() if p.requires_grad}

    weights = Weights()
    trainer = trainer_cls(
        model_path, _token_reward, args, train_dataset=toy_task.build_dataset(64),
        processing_class=AutoTokenizer.from_pretrained(model_path), peft_config=lora if name == "lora" else None,
        rollout_func=_rollout, callbacks=[weights],
    )  # fmt: skip
    trainer.train()
    history = trainer.state.log_history
    final = _weights(trainer.model)
    return {
        "losses": [entry["loss"] for entry in history if "loss" in entry],
        "update": {n: (final[n] - weights.initial[n]).tolist() for n in final},
        "tree_fallback": [entry["tree_fallback"] for entry in history if "tree_fallback" in entry],
    }


def _worker(out_dir: str) -> None:
    """Under `accelerate launch`: TRL's trainer (and, in bf16, the tree trainer) on each run; writes `report.json`."""
    sys.path.insert(0, str(REPO))
    import deepspeed
    import transformers
    import trl
    from trl import GRPOTrainer

    from hf_tree_attn.trainer import TreeGRPOTrainer
    from trainers import toy_task

    bf16 = os.environ["ACCELERATE_MIXED_PRECISION"] == "bf16"
    model_path = os.path.join(out_dir, "model")
    tokenizer = toy_task.build_tokenizer()
    toy_task.build_model(tokenizer, seed=0).save_pretrained(model_path)
    tokenizer.save_pretrained(model_path)
    report = {
        "stage": int(os.environ["ACCELERATE_DEEPSPEED_ZERO_STAGE"]),
        "bf16": bf16,
        "versions": {m.__name__: m.__version__ for m in (torch, transformers, trl, deepspeed)},
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    for name in RUNS:
        for trainer_cls in (GRPOTrainer, TreeGRPOTrainer) if bf16 else (GRPOTrainer,):
            report[f"{name}_{trainer_cls.__name__}"] = _train(trainer_cls, model_path, out_dir, name, bf16)
    Path(out_dir, "report.json").write_text(json.dumps(report))
    # Leave without freeing the trainers (as tests/helpers.exit_distributed_worker, which this file does not import:
    # tests/helpers.py needs config classes newer than the GPU machine's transformers).
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


# ------------------------------------------------------------------------------------------------------- the tests


def _launch(stage: int, mixed_precision: str, out_dir: Path) -> dict:
    config = REPO / "trainers" / "configs" / f"deepspeed_zero{stage}.yaml"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes", "1",
        "--mixed_precision", mixed_precision, "--main_process_port", str(port), __file__, str(out_dir),
    ]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    errors = [line for line in result.stderr.splitlines() if "Error" in line]
    assert result.returncode == 0, "\n".join(errors[:20]) + result.stderr[-4000:]
    return json.loads((out_dir / "report.json").read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """TRL's trainer in float32 (ZeRO-3, no mixed precision): the runs bf16 is measured against."""
    return _launch(3, "no", tmp_path_factory.mktemp("fp32"))


def _update_error(run: dict, reference: dict) -> float:
    """Relative error of the whole weight update over the run."""
    diff = sum(float((torch.tensor(run[n]) - torch.tensor(r)).square().sum()) for n, r in reference.items())
    return (diff / sum(float(torch.tensor(r).square().sum()) for r in reference.values())) ** 0.5


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_bf16_tree_trains_as_trl(stage, reference, tmp_path):
    report = _launch(stage, "bf16", tmp_path)
    assert report["bf16"] and report["stage"] == stage
    summary = {"stage": stage, "versions": report["versions"], "device": report["device"]}
    for name in RUNS:
        ref, flat, tree = (
            reference[f"{name}_GRPOTrainer"],
            report[f"{name}_GRPOTrainer"],
            report[f"{name}_TreeGRPOTrainer"],
        )
        assert len(ref["losses"]) == len(flat["losses"]) == len(tree["losses"]) == STEPS
        assert tree["tree_fallback"] and set(tree["tree_fallback"]) == {0.0}
        scale = max(abs(x) for x in ref["losses"])
        flat_loss = max(abs(a - b) for a, b in zip(flat["losses"], ref["losses"]))
        tree_loss = max(abs(a - b) for a, b in zip(tree["losses"], ref["losses"]))
        flat_update, tree_update = (
            _update_error(flat["update"], ref["update"]),
            _update_error(tree["update"], ref["update"]),
        )
        summary[name] = {
            "loss_error": {"tree": tree_loss, "trl": flat_loss, "scale": scale},
            "update_error": {"tree": tree_update, "trl": flat_update},
            "losses": {"tree": tree["losses"], "trl": flat["losses"], "trl_fp32": ref["losses"]},
        }
        assert set(tree["update"]) == set(ref["update"]) and tree["update"]
        assert tree_loss <= 2 * flat_loss + U_BF16 * scale, (name, summary[name])
        assert tree_update <= 2 * flat_update + U_BF16, (name, summary[name])
    if os.environ.get("OUT"):  # the GPU script keeps the numbers
        Path(os.environ["OUT"], f"deepspeed_zero{stage}_bf16.json").write_text(json.dumps(summary, indent=1))


@pytest.mark.multi_gpu
@pytest.mark.parametrize("stage", [2, 3])
def test_main_job_on_two_gpus(stage, tmp_path):
    """`accelerate launch --config_file trainers/configs/deepspeed_zero{2,3}.yaml trainers/grpo_tree.py` on 2 GPUs."""
    from safetensors.torch import load_file

    config = REPO / "trainers" / "configs" / f"deepspeed_zero{stage}.yaml"
    args = ["--max_steps", "20", "--logging_steps", "5", "--output_dir", str(tmp_path)]
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes", "2",
        str(REPO / "trainers" / "grpo_tree.py"), *args,
    ]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", NCCL_NVLS_ENABLE="0")
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    logs = json.loads((tmp_path / "trainer_state.json").read_text())["log_history"]
    logs = [entry for entry in logs if "reward" in entry]
    assert logs and all(entry["tree_token_ratio"] < 0.6 and entry["tree_fallback"] == 0 for entry in logs)
    saved, built = (
        load_file(tmp_path / "model.safetensors"),
        load_file(tmp_path / "initial_model" / "model.safetensors"),
    )
    assert all(saved[k].shape == built[k].shape and built[k].numel() for k in built)  # saved whole


if __name__ == "__main__":
    _worker(sys.argv[1])
