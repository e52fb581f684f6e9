"""TRL GRPO on packed prefix trees: `TreeGRPOConfig`, `TreeGRPOTrainer` and the main job.

    accelerate launch trainers/grpo_tree.py                                   # embedded default, CPU, no download
    accelerate launch --config_file trainers/configs/fsdp2.yaml trainers/grpo_tree.py
    accelerate launch trainers/grpo_tree.py --model_name_or_path Qwen/Qwen3-0.6B --dataset_name <ds> \\
        --reward_funcs accuracy_reward --config trainers/configs/grpo_qwen3.yaml

The trainer overrides one hook, `_get_per_token_logps_and_entropies`: the old-policy, reference and policy
log-probabilities (and entropies) of a chunk of TRL's padded rows come from one forward over the chunk's prefix
forest instead of one padded row per completion. Everything else — generation, rewards, advantages, every
`loss_type`, KL, clipping, metrics — is TRL's own code on the same `(B, C)` tensors. The forest of a micro-batch is
built once per generation batch and reused by the old-policy, reference and every policy forward
(`num_iterations`). `_prepare_inputs` is overridden only to keep each prompt's completions in one micro-batch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from trl import GRPOConfig, GRPOTrainer
from trl.extras.profiling import profiling_decorator
from trl.trainer.utils import split_pixel_values_by_grid, split_tensor_dict, unsplit_pixel_values_by_grid

from hf_tree_attn import (
    ATTN_IMPLEMENTATION,
    TreeDataCollator,
    check_tree_model,
    estimate_flops,
    forest_logprobs,
    pack_forest,
)

__all__ = ["TreeGRPOConfig", "TreeGRPOTrainer", "main"]

logger = logging.getLogger(__name__)

# Attention implementations whose non-tree behaviour `tree_flex` reproduces, so switching them is invisible.
_SWITCHABLE_ATTN = (None, "sdpa", "eager")


@dataclass
class TreeGRPOConfig(GRPOConfig):
    """`trl.GRPOConfig` plus the tree-packing knobs (all other fields, defaults and checks are TRL's)."""

    tree_packing: bool = field(
        default=True,
        metadata={
            "help": "Compute the old-policy, reference and policy log-probabilities on packed prefix trees (one "
            "forward per forest; a shared prompt is computed once). False = exactly trl.GRPOTrainer."
        },
    )
    max_tokens_per_mb: int | None = field(
        default=None,
        metadata={
            "help": "Token budget of one packed forward (a multiple of 128, at least the longest prompt + "
            "max_completion_length). None = one forest per TRL chunk of per_device_train_batch_size rows."
        },
    )
    tree_max_token_ratio: float = field(
        default=0.9,
        metadata={
            "help": "Fall back to TRL's flat forward for a chunk whose packed forests hold more than this fraction of "
            "the tokens TRL's flat forward would run (rows x padded width; logged as "
            "tree_compute_ratio). Flat SDPA on full rows is ~5-15% faster per token than the FlexAttention tree, so "
            "0.9 keeps the tree only where it pays; fallbacks are logged as tree_fallback. 1.0 = always the tree."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 < self.tree_max_token_ratio <= 1.0:
            raise ValueError(
                f"tree_max_token_ratio={self.tree_max_token_ratio} must be in (0, 1]; use 1.0 to always pack trees."
            )
        if self.max_tokens_per_mb is not None:
            if self.max_tokens_per_mb <= 0 or self.max_tokens_per_mb % 128:
                fix = max(128, -(-self.max_tokens_per_mb // 128) * 128)
                raise ValueError(
                    f"max_tokens_per_mb={self.max_tokens_per_mb} must be a positive multiple of 128 (FlexAttention's "
                    f"block size); use e.g. max_tokens_per_mb={fix}, or None for one forest per chunk."
                )
            if self.max_completion_length is not None and self.max_tokens_per_mb <= self.max_completion_length:
                fix = -(-(self.max_completion_length + 1) // 128) * 128
                raise ValueError(
                    f"max_tokens_per_mb={self.max_tokens_per_mb} cannot hold one sequence: a completion alone can be "
                    f"max_completion_length={self.max_completion_length} tokens, plus its prompt. Use at least "
                    f"{fix} plus your longest prompt (rounded up to 128), or None."
                )
        fsdp_ac = bool(self.fsdp) and str((self.fsdp_config or {}).get("activation_checkpointing")).lower() == "true"
        if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
            fsdp_ac |= os.environ.get("FSDP_ACTIVATION_CHECKPOINTING", "false").lower() == "true"
        if fsdp_ac and self.gradient_checkpointing:
            raise ValueError(
                "FSDP activation checkpointing is on (fsdp_activation_checkpointing in the accelerate config / "
                "fsdp_config) and so is gradient_checkpointing=True (TRL's default); transformers refuses both. Pass "
                "`--gradient_checkpointing false` (FSDP's checkpointing replaces it) or turn FSDP's off."
            )


class TreeGRPOTrainer(GRPOTrainer):
    """`trl.GRPOTrainer` whose log-probability forwards run on packed prefix trees (see the module docstring).

    Takes the same arguments as `trl.GRPOTrainer`; `args` must be a `TreeGRPOConfig`. With `tree_packing=True` the
    model must use `attn_implementation="tree_flex"`: a model path gets it automatically (unless
    `model_init_kwargs` names another implementation, which is an error), and a model instance loaded with `sdpa`
    / `eager` is switched to it (`tree_flex` runs plain forwards and `generate` through SDPA, so nothing else
    changes). Other implementations (flash attention, …) raise.
    """

    def __init__(self, model, reward_funcs=None, args: TreeGRPOConfig | None = None, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
            args = TreeGRPOConfig(f"{name.split('/')[-1]}-TreeGRPO")
        if not isinstance(args, TreeGRPOConfig):
            raise TypeError(
                f"args is a {type(args).__name__}; TreeGRPOTrainer needs a TreeGRPOConfig (same fields plus "
                "tree_packing, max_tokens_per_mb, tree_max_token_ratio): `TreeGRPOConfig(**your_kwargs)`."
            )
        if args.tree_packing:
            model = _select_tree_attention(model, args)
        super().__init__(model, reward_funcs, args, **kwargs)
        self._tree_cache: dict[str, list | None] = {}
        self._tree_collator = TreeDataCollator(args.max_tokens_per_mb, device=self.accelerator.device)
        if args.tree_packing:
            check_tree_model(self.model)
            if self.ref_model is not None:
                check_tree_model(self.ref_model)
            self._check_sequence_budget()
            if args.per_device_train_batch_size % self.num_generations:
                warnings.warn(
                    f"per_device_train_batch_size={args.per_device_train_batch_size} is not a multiple of "
                    f"num_generations={self.num_generations}: some prompts' completions are split across "
                    "micro-batches. Still exact, but those prompts are computed once per micro-batch. Use "
                    f"per_device_train_batch_size={self.num_generations} (or a multiple) and raise "
                    "gradient_accumulation_steps to keep the effective batch.",
                    stacklevel=2,
                )

    def _check_sequence_budget(self) -> None:
        """Fail at start, not mid-run, if `max_tokens_per_mb` cannot hold a prompt plus a full completion."""
        budget = self.args.max_tokens_per_mb
        dataset = self.train_dataset
        if budget is None or self._is_vlm or self.environment_factories is not None:
            return
        if not hasattr(dataset, "select") or "prompt" not in (dataset.column_names or []):
            return
        sample = dataset.select(range(min(len(dataset), 256)))["prompt"]
        prompt_ids, _, _ = self._tokenize_prompts(list(sample))
        longest = max(len(ids) for ids in prompt_ids) + self.max_completion_length
        if longest > budget:
            fix = -(-longest // 128) * 128
            raise ValueError(
                f"max_tokens_per_mb={budget} cannot hold one sequence: the longest of the first {len(sample)} "
                f"prompts plus max_completion_length={self.max_completion_length} is {longest} tokens. Use "
                f"max_tokens_per_mb={fix} (or more), or None for one forest per chunk."
            )

    @profiling_decorator
    def _prepare_inputs(self, generation_batch):
        """TRL's `_prepare_inputs`, except that the generation batch is split in sampler order.

        TRL shuffles the rows before splitting them into `steps_per_generation` micro-batches, which scatters each
        prompt's completions (consecutive in `RepeatSampler` order) over different micro-batches; here only the
        order of the micro-batches is shuffled, so a prompt's group stays in one forest. Prompts are already
        shuffled by the sampler.
        """
        if not self.args.tree_packing:
            return super()._prepare_inputs(generation_batch)
        mode = "train" if self.model.training else "eval"
        if mode == "train":
            generate_every = self.args.steps_per_generation * self.num_iterations
            if self._step % generate_every == 0 or self._buffered_inputs is None:
                self._tree_cache.clear()
                generation_batch = self._generate_and_score_completions(generation_batch)
                generation_batch = split_pixel_values_by_grid(generation_batch)
                batches = split_tensor_dict(generation_batch, self.args.steps_per_generation)
                order = torch.randperm(len(batches)).tolist()
                self._buffered_inputs = [unsplit_pixel_values_by_grid(batches[i]) for i in order]
            return self._buffered_inputs[self._step % self.args.steps_per_generation]
        self._tree_cache.clear()
        return self._generate_and_score_completions(generation_batch)

    @profiling_decorator
    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        pixel_values=None,
        image_grid_thw=None,
        num_images=None,
        pixel_attention_mask=None,
        spatial_shapes=None,
        num_tiles=None,
        image_sizes=None,
        token_type_ids=None,
        mm_token_type_ids=None,
        image_position_ids=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """TRL's hook, on packed trees: `(logps (B, C), entropies (B, C) | None, aux_loss | None)`, 0 at padding.

        `input_ids` / `attention_mask` are `(B, P + C)`: left-padded prompts then right-padded completions, `C =
        logits_to_keep`. Rows are chunked by `batch_size` exactly as TRL does; each chunk is one cached set of
        forests. Multimodal inputs, the MoE aux loss, an unusual padding layout, or too little sharing
        (`tree_max_token_ratio`) take TRL's flat path.
        """
        multimodal = dict(
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
            num_images=num_images,
            pixel_attention_mask=pixel_attention_mask,
            spatial_shapes=spatial_shapes,
            num_tiles=num_tiles,
            image_sizes=image_sizes,
            token_type_ids=token_type_ids,
            mm_token_type_ids=mm_token_type_ids,
            image_position_ids=image_position_ids,
        )
        mode = "train" if self.model.training else "eval"
        if not self.args.tree_packing or compute_aux_loss or any(v is not None for v in multimodal.values()):
            if self.args.tree_packing:
                self._metrics[mode]["tree_fallback"].append(1.0)
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **multimodal,
            )  # fmt: skip

        batch_size = batch_size or input_ids.size(0)
        all_logps, all_entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids, mask = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
            packed = self._packed_chunk(ids, mask, logits_to_keep, mode)
            self._metrics[mode]["tree_fallback"].append(float(packed is None))
            missing = self._missing_forwards(1 if packed is None else len(packed))  # agree before any forward
            if packed is None:
                logps, entropies, _ = super()._get_per_token_logps_and_entropies(
                    model, ids, mask, logits_to_keep, compute_entropy=compute_entropy
                )
            else:
                logps, entropies = self._tree_logps(model, packed, ids.size(0), logits_to_keep, compute_entropy)
            if missing:
                logps = logps + self._idle_forwards(model, missing)
            all_logps.append(logps)
            all_entropies.append(entropies)
        logps = torch.cat(all_logps, dim=0)
        entropies = torch.cat(all_entropies, dim=0) if compute_entropy else None
        return logps, entropies, None

    def _packed_chunk(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, mode: str):
        """Cached forests of one chunk of padded rows, or None when the chunk must take the flat path.

        Returns a list of `(micro_batch, rows, row_of, col_of, source_rows)`: forest rows to score `(R,)` unique, and
        for every scored completion token its chunk row `(E,)`, completion column `(E,)` and forest row `(E,)`.
        """
        ids = input_ids.detach().cpu()
        mask = attention_mask.detach().cpu().bool()
        key = hashlib.blake2b(
            ids.numpy().tobytes() + mask.numpy().tobytes() + repr((tuple(ids.shape), logits_to_keep)).encode(),
            digest_size=16,
        ).hexdigest()
        if key in self._tree_cache:
            return self._tree_cache[key]

        num_rows, width = ids.shape
        prompt_width = width - logits_to_keep
        prompt_mask, completion_mask = mask[:, :prompt_width], mask[:, prompt_width:]
        prompt_lengths, completion_lengths = prompt_mask.sum(1), completion_mask.sum(1)
        # The tree holds each row's tokens back to back, so they must be exactly TRL's layout: a left-padded prompt
        # (a suffix of ones) then a right-padded completion (a prefix of ones), and a scored token needs a parent.
        left_padded = (prompt_mask == (torch.arange(prompt_width) >= prompt_width - prompt_lengths[:, None])).all()
        right_padded = (completion_mask == (torch.arange(logits_to_keep) < completion_lengths[:, None])).all()
        orphan = ((prompt_lengths == 0) & (completion_lengths > 0)).any()
        if not (left_padded and right_padded) or orphan:
            self._tree_cache[key] = None
            return None

        if len(self._tree_cache) >= max(16, 2 * self.args.steps_per_generation):
            self._tree_cache.pop(next(iter(self._tree_cache)))  # callers outside the training loop: stay bounded
        features, sequences, scored_prompt_lengths = [], [], []
        for b in range(num_rows):
            seq = ids[b][mask[b]]
            if len(seq) == 0:
                continue  # a fully padded row scores nothing (TRL returns zeros for it too)
            p, c = int(prompt_lengths[b]), int(completion_lengths[b])
            column = torch.cat([torch.full((p,), -1), torch.arange(c)])
            features.append({"input_ids": seq, "row": b, "column": column})
            sequences.append(seq)
            scored_prompt_lengths.append(p)
        if not features:
            self._tree_cache[key] = None
            return None
        total = sum(len(s) for s in sequences)
        micro_batches = self._tree_collator(features)
        tree_tokens = sum(mb.forest.num_tree_tokens for mb in micro_batches)
        ratio = tree_tokens / total
        # What the tree computes against what TRL's flat forward computes (every padded position of every row).
        compute_ratio = tree_tokens / ids.numel()
        config = self.accelerator.unwrap_model(self.model).config.get_text_config()
        flops = estimate_flops(config, sequences, prompt_lengths=scored_prompt_lengths)
        self._metrics[mode]["tree_token_ratio"].append(ratio)
        self._metrics[mode]["tree_compute_ratio"].append(compute_ratio)
        self._metrics[mode]["tree_flops_saved"].append(flops["flops_saved"])

        if compute_ratio > self.args.tree_max_token_ratio:
            self._tree_cache[key] = None
            return None
        packed = []
        for mb in micro_batches:
            scored = mb.fields["column"] >= 0
            source_rows = mb.positions.to(scored.device)[scored]
            row_of, col_of = mb.fields["row"][scored], mb.fields["column"][scored]
            packed.append((mb, torch.unique(source_rows), row_of, col_of, source_rows))
        self._tree_cache[key] = packed
        return packed

    def _missing_forwards(self, num_forwards: int) -> int:
        """How many forwards this rank is short of the busiest rank for the current chunk.

        FSDP (all-gathers per forward) and DDP (buffer broadcasts) need every rank to run the same number of
        forwards. Without a token budget a chunk is always one forward (one forest, or TRL's flat call); with one,
        ranks can pack their chunk into different numbers of forests.
        """
        if self.accelerator.num_processes == 1 or self.args.max_tokens_per_mb is None:
            return 0
        counts = self.accelerator.gather(torch.tensor([num_forwards], device=self.accelerator.device))
        return int(counts.max()) - num_forwards

    def _idle_forwards(self, model, count: int) -> torch.Tensor:
        """`count` forwards of a 2-token forest whose result enters the graph with weight 0 (a scalar 0)."""
        pad = self._tokenizer.pad_token_id or 0
        (forest,) = pack_forest([[pad, pad]])
        forest = forest.to(self.accelerator.device)
        total = torch.zeros((), device=self.accelerator.device)
        for _ in range(count):
            with self.accelerator.autocast():
                table, _ = forest_logprobs(model, forest, temperature=self.temperature)
            total = total + table.sum()
        return 0.0 * total

    def _tree_logps(self, model, packed: list, num_rows: int, logits_to_keep: int, compute_entropy: bool):
        """Score the forests of one chunk and scatter into `(num_rows, logits_to_keep)` (0 at padding)."""
        device = self.accelerator.device
        logps = torch.zeros(num_rows, logits_to_keep, dtype=torch.float32, device=device)
        entropies = torch.zeros_like(logps) if compute_entropy else None
        for mb, rows, row_of, col_of, source_rows in packed:
            with self.accelerator.autocast():
                table, entropy_table = forest_logprobs(
                    model, mb.forest, rows=rows, temperature=self.temperature, return_entropy=compute_entropy
                )
            logps = logps.index_put((row_of, col_of), table[source_rows])
            if compute_entropy:
                entropies = entropies.index_put((row_of, col_of), entropy_table[source_rows])
        return logps, entropies


def _select_tree_attention(model, args: TreeGRPOConfig):
    """Make the policy (and so TRL's reference model, built with the policy's implementation) use `tree_flex`."""
    if isinstance(model, str):
        model_init_kwargs = dict(args.model_init_kwargs or {})
        impl = model_init_kwargs.get("attn_implementation")
        if impl not in (None, ATTN_IMPLEMENTATION):
            raise ValueError(
                f"model_init_kwargs['attn_implementation']={impl!r}, but tree_packing needs {ATTN_IMPLEMENTATION!r} "
                "(it runs ordinary forwards and generate through SDPA). Drop --attn_implementation / the "
                "model_init_kwargs entry to get it automatically, or set tree_packing=False."
            )
        model_init_kwargs["attn_implementation"] = ATTN_IMPLEMENTATION
        args.model_init_kwargs = model_init_kwargs
        return model
    impl = getattr(model.config, "_attn_implementation", None)
    if impl == ATTN_IMPLEMENTATION:
        return model
    if impl not in _SWITCHABLE_ATTN:
        raise ValueError(
            f"The model uses attn_implementation={impl!r}, but tree_packing needs {ATTN_IMPLEMENTATION!r}. Load it "
            f"with attn_implementation={ATTN_IMPLEMENTATION!r} (after `import hf_tree_attn`), or set "
            "tree_packing=False."
        )
    logger.info("Switching the model from attn_implementation=%r to %r for tree packing.", impl, ATTN_IMPLEMENTATION)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


# ----------------------------------------------------------------------------------------------------------------
# The main job: `trl/scripts/grpo.py` with TreeGRPOConfig, plus an embedded default (no model / dataset given).
# ----------------------------------------------------------------------------------------------------------------


def embedded_defaults() -> dict:
    """Training defaults of the embedded task (the tiny model learns it in about a minute on 2 CPU cores).

    Used only when no `--model_name_or_path` is given; the command line and `--config` still override them.
    """
    cuda = torch.cuda.is_available()
    return dict(
        output_dir="outputs/grpo_tree",
        use_cpu=not cuda,
        bf16=cuda,
        per_device_train_batch_size=16,  # 2 prompts x 8 completions: each micro-batch holds whole groups
        num_generations=8,
        max_completion_length=4,
        learning_rate=1e-3,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=10,
        max_steps=600,
        logging_steps=5,
        gradient_checkpointing=False,  # a 2-layer model: recompute costs more than it saves
        save_strategy="no",
        report_to="none",
        seed=42,
    )


def parse_args(argv: list[str] | None = None):
    """`(script_args, training_args, model_args, dataset_args)`, parsed like `trl/scripts/grpo.py` does."""
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser
    from trl.scripts.grpo import GRPOScriptArguments

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = TrlParser((GRPOScriptArguments, TreeGRPOConfig, ModelConfig, DatasetMixtureConfig))
    if not {"-h", "--help"} & set(argv):
        # Peek at the model (command line or --config) to know whether the embedded defaults apply.
        (model_args, _) = TrlParser((ModelConfig,)).parse_args_and_config(argv, return_remaining_strings=True)
        if model_args.model_name_or_path is None:
            parser.set_defaults_with_config(**embedded_defaults())
    return parser.parse_args_and_config(argv, fail_with_unknown_args=False)


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


def main(script_args, training_args: TreeGRPOConfig, model_args, dataset_args) -> TreeGRPOTrainer:
    """Train, then save the model (or adapter), the tokenizer and `trainer_state.json` to `output_dir`."""
    from trl import get_dataset, get_peft_config, get_quantization_config

    from trainers import toy_task

    reward_funcs = _reward_funcs(script_args)
    if model_args.model_name_or_path is None:
        # The embedded model goes through the same path as a real one (TRL also rebuilds the reference model from
        # it when beta > 0): written once per machine, then loaded by every process.
        model_args.model_name_or_path = os.path.join(training_args.output_dir, "initial_model")
        with training_args.main_process_first(desc="writing the embedded model"):
            if training_args.local_process_index == 0:
                tokenizer = toy_task.build_tokenizer()
                toy_task.build_model(tokenizer, seed=training_args.seed).save_pretrained(model_args.model_name_or_path)
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
