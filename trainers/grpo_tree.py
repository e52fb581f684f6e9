"""The main job: `trl/scripts/grpo.py` with `TreeGRPOTrainer`, plus an embedded default (no model / dataset given).

    accelerate launch trainers/grpo_tree.py                                   # embedded default, CPU, no download
    accelerate launch trainers/grpo_tree.py --embedded_model qwen3_5          # ... on a tiny hybrid (Qwen3.5)
    accelerate launch --config_file trainers/configs/fsdp2.yaml trainers/grpo_tree.py
    accelerate launch --config_file trainers/configs/deepspeed_zero3.yaml trainers/grpo_tree.py
    accelerate launch trainers/grpo_tree.py --model_name_or_path Qwen/Qwen3-0.6B --dataset_name <ds> \\
        --reward_funcs accuracy_reward --config trainers/configs/grpo_qwen3.yaml

The trainer classes live in the package (`hf_tree_attn.trainer`), as TRL keeps its trainers in the library and its
scripts thin.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import torch

from hf_tree_attn.trainer import TreeGRPOConfig, TreeGRPOTrainer

__all__ = ["embedded_defaults", "machine_defaults", "main", "make_parser", "parse_args"]


def machine_defaults() -> dict:
    """Defaults about the machine, for every run: bf16 on a GPU, fp32 on the CPU (TRL's bf16 default fails there)."""
    cuda = torch.cuda.is_available()
    return dict(use_cpu=not cuda, bf16=cuda)


def embedded_defaults() -> dict:
    """Training defaults of the embedded task (the tiny model learns it in about a minute on 2 CPU cores).

    Used only when neither a model nor a dataset is given; the command line and `--config` still override them.
    """
    return dict(
        output_dir="outputs/grpo_tree",
        per_device_train_batch_size=16,  # 2 prompts x 8 completions: each micro-batch holds whole groups
        num_generations=8,
        max_completion_length=4,
        learning_rate=5e-4,  # 1e-3 learns faster but can collapse the entropy before the task is learned
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=10,
        max_steps=600,
        logging_steps=5,
        gradient_checkpointing=False,  # a 2-layer model: recompute costs more than it saves
        save_strategy="no",
        report_to="none",
        seed=42,
    )


def make_parser():
    """The parser of `trl/scripts/grpo.py`, with `TreeGRPOConfig` in place of `GRPOConfig`, plus the embedded task's
    options."""
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser
    from trl.scripts.grpo import GRPOScriptArguments

    from trainers.toy_task import EmbeddedTaskArguments

    return TrlParser((GRPOScriptArguments, TreeGRPOConfig, ModelConfig, DatasetMixtureConfig, EmbeddedTaskArguments))


def parse_args(argv: list[str] | None = None):
    """`(script_args, training_args, model_args, dataset_args, task_args)` from the command line and `--config` YAML
    (`task_args`: the embedded task's options).

    Unknown keys in the YAML are an error (a misspelled `dataset_name` must not fall back to the embedded task).
    """
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser
    from trl.scripts.grpo import GRPOScriptArguments

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = make_parser()
    parser.set_defaults_with_config(**machine_defaults())
    if not {"-h", "--help"} & set(argv):
        # Peek at the model and the dataset (command line or --config) to know whether the embedded task applies.
        peek = TrlParser((GRPOScriptArguments, ModelConfig, DatasetMixtureConfig))
        script_args, model_args, dataset_args, _ = peek.parse_args_and_config(argv, return_remaining_strings=True)
        if model_args.model_name_or_path is None and not script_args.dataset_name and not dataset_args.datasets:
            parser.set_defaults_with_config(**embedded_defaults())
    return parser.parse_args_and_config(argv, fail_with_unknown_args=True)


def _reward_funcs(script_args) -> list:
    """Reward models / functions named on the command line, resolved as `trl/scripts/grpo.py` does."""
    import importlib

    from trl.rewards import (
        accuracy_reward,
        get_soft_overlong_punishment,
        reasoning_accuracy_reward,
        think_format_reward,
    )

    registry = {
        "accuracy_reward": accuracy_reward,
        "reasoning_accuracy_reward": reasoning_accuracy_reward,
        "think_format_reward": think_format_reward,
        "get_soft_overlong_punishment": get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256),
    }
    funcs = [script_args.reward_model_name_or_path] if script_args.reward_model_name_or_path else []
    for name in script_args.reward_funcs or []:
        if name in registry:
            funcs.append(registry[name])
        elif "." in name:
            module, attr = name.rsplit(".", 1)
            sys.path.insert(0, os.getcwd())
            funcs.append(getattr(importlib.import_module(module), attr))
        else:
            raise ValueError(f"Unknown reward function {name!r}: use one of {sorted(registry)} or a dotted path.")
    return funcs


@contextlib.contextmanager
def _built_whole(training_args):
    """Models built inside are whole, also in a DeepSpeed ZeRO-3 run.

    While transformers knows the run is ZeRO-3 it builds every model partitioned across the processes
    (`deepspeed.zero.Init`, a collective). The embedded model is built by one process, saved whole, and loaded
    (partitioned) by every process like a downloaded one, so transformers' view of the DeepSpeed config is lifted
    meanwhile and put back as accelerate installs it (`DeepSpeedPlugin.set_deepspeed_weakref`).
    """
    from transformers.integrations import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

    plugin = getattr(training_args, "deepspeed_plugin", None)
    if plugin is None or not is_deepspeed_zero3_enabled():
        yield
        return
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()


def main(script_args, training_args: TreeGRPOConfig, model_args, dataset_args, task_args=None) -> TreeGRPOTrainer:
    """Train, then save the model (or adapter), the tokenizer and `trainer_state.json` to `output_dir`."""
    from trl import get_dataset, get_peft_config, get_quantization_config

    from trainers import toy_task

    has_dataset = bool(script_args.dataset_name or dataset_args.datasets)
    if model_args.model_name_or_path is not None and not has_dataset:
        raise ValueError(
            f"--model_name_or_path {model_args.model_name_or_path} is given but no dataset: pass --dataset_name (or "
            "`datasets:` in --config), as trl/scripts/grpo.py requires. The embedded task runs only when neither a "
            "model nor a dataset is given."
        )
    if model_args.model_name_or_path is None and has_dataset:
        raise ValueError(
            "A dataset is given but no model: pass --model_name_or_path. The embedded task runs only when neither a "
            "model nor a dataset is given."
        )
    reward_funcs = _reward_funcs(script_args)
    if model_args.model_name_or_path is None:
        # The embedded model goes through the same path as a real one (TRL also rebuilds the reference model from
        # it when beta > 0): written once per machine, then loaded by every process.
        model_args.model_name_or_path = os.path.join(training_args.output_dir, "initial_model")
        with training_args.main_process_first(desc="writing the embedded model"), _built_whole(training_args):
            if training_args.local_process_index == 0:
                tokenizer = toy_task.build_tokenizer()
                model_type = task_args.embedded_model if task_args is not None else "qwen3"
                model = toy_task.build_model(tokenizer, seed=training_args.seed, model_type=model_type)
                model.save_pretrained(model_args.model_name_or_path)
                tokenizer.save_pretrained(model_args.model_name_or_path)
    model_init_kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = model_init_kwargs

    if dataset_args.datasets:
        dataset = get_dataset(dataset_args)
    elif script_args.dataset_name:
        from datasets import load_dataset

        dataset = load_dataset(
            script_args.dataset_name, name=script_args.dataset_config, streaming=script_args.dataset_streaming
        )
    else:
        from datasets import DatasetDict

        dataset = DatasetDict(train=toy_task.build_dataset(seed=training_args.seed))
        reward_funcs = reward_funcs or [toy_task.copy_letter_reward]
    if not reward_funcs:
        raise ValueError("No reward: pass --reward_funcs (e.g. accuracy_reward) or --reward_model_name_or_path.")

    trainer = TreeGRPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)  # the model or adapter, and the tokenizer
    trainer.save_state()
    trainer.accelerator.print(f"Model, tokenizer and trainer_state.json saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    if hasattr(trainer, "end"):  # transformers >= 5.18: finish trackers, destroy the process group
        trainer.end()
    return trainer


if __name__ == "__main__":
    # `accelerate launch trainers/grpo_tree.py` runs this file as a script: make the `trainers` package importable.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main(*parse_args())
