"""The trainers that sample a group of completions per prompt (TRL's GRPO, RLOO) on packed prefix trees.

TRL's `GRPOTrainer` and `RLOOTrainer` share their shape: a generation batch of `num_generations` completions per
prompt, padded into `(B, P)` left-padded prompts and `(B, C)` right-padded completions, whose old-policy, reference
and policy log-probabilities come from one hook, `_get_per_token_logps_and_entropies`, and whose micro-batches come
from `_prepare_inputs`. `TreeGroupTrainerMixin` implements those two (and `_calculate_rewards`) as `_tree_*`
methods, which each trainer binds under TRL's names (those names are TRL's private ones, so outside `trl_compat.py`
they appear only where a trainer binds them). The log-probabilities (and entropies, MoE aux loss) of a chunk of
TRL's rows come from one forward over the chunk's prefix forest instead of one padded row per completion, and each
prompt's group stays in one micro-batch (drawing TRL's own shuffle, so a seed gives TRL's run). The forest of a
micro-batch is built once per generation batch and reused by the old-policy, reference and every policy forward
(`num_iterations`). Everything else — generation, rewards, advantages, the loss, KL, clipping, metrics — is TRL's
own code on the same `(B, C)` tensors.

Two additions leave the math unchanged: with several processes, whole groups move between ranks after generation
so each rank's micro-batch costs about the same (`tree_balance`, `balance.py`), and a tree policy forward recomputes
only the layers its memory needs (`tree_recompute`, `forest_step.recompute_plan`). A trainer of this kind adds its
config (`GroupTreeOptions` before TRL's config), `_TREE_CONFIG`, the three bindings, and its
`_generate_single_turn` (whose parameters and result are TRL's per trainer) run under `_tree_generation`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from accelerate.utils import gather_object

from ..compile import eager_layers
from ..metrics import estimate_flops
from ..support import ranks_max, rope_length_limit, rope_split_lengths, unwrap_model
from ..targets import TargetPlan
from ..tree import PackedForest, pack_forest
from . import trl_compat
from .balance import (
    MIN_GAIN,
    assign_blocks,
    block_costs,
    concat_micro_batches,
    exchange_orders,
    move_list,
    move_rows,
    pad_value,
    pad_width,
    round_up,
    row_layout,
    split_micro_batches,
    step_imbalance,
)
from .core import TreeOptions, TreeTrainerMixin, block_budget, prefix_reuse_chunks, stock_attention, tree_args
from .forest_step import PolicyForwardOptions, _log_once, recompute_plan, score_forests
from .reward import tree_reward_models
from .trl_compat import (
    profiling_decorator,
    split_pixel_values_by_grid,
    split_tensor_dict,
    unsplit_pixel_values_by_grid,
)

__all__ = ["GroupTreeOptions", "TreeGroupTrainerMixin", "micro_batch_order"]


@dataclass
class GroupTreeOptions(PolicyForwardOptions, TreeOptions):
    """The tree fields of a group trainer's config: `TreeOptions`, the policy forward's recompute, and
    `tree_balance`. Placed before TRL's config in the bases."""

    tree_balance: bool | None = field(
        default=None,
        metadata={
            "help": "Token-balanced data parallelism: after generation, move whole groups (num_generations rows) "
            "between ranks and between the micro-batches of one optimizer step, so every rank's micro-batch costs "
            "about the same estimated FLOPs (tree tokens, attention pairs, scored rows). Same rows per optimizer "
            "step, so the same loss and gradients. None (default) = on with several processes wherever the loss "
            "does not depend on which rows share a micro-batch (GRPO: off for loss_type='bnpo', an entropy bonus, "
            "top_entropy_quantile < 1; any: off with an MoE load-balancing loss); True = on (an error where the "
            "loss depends on it); False = off."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if self.tree_balance:
            reason = self.tree_balance_refusal()
            if reason:
                raise ValueError(f"tree_balance=True, but {reason} Set tree_balance=None (auto) or False.")
        budget, completion = self.max_tokens_per_mb, self.max_completion_length
        if budget is not None and completion is not None and budget <= completion and not self.tree_prefix_reuse:
            raise ValueError(
                f"max_tokens_per_mb={budget} cannot hold one sequence: a completion alone can be "
                f"max_completion_length={completion} tokens, plus its prompt. Use at least "
                f"{block_budget(completion + 1)} plus your longest prompt (rounded up to 128), None, or "
                "tree_prefix_reuse=True (a sequence scored in chunks of the budget)."
            )
        if self.tree_prefix_reuse and self.tree_activation_budget_gib is not None:
            raise ValueError(
                f"tree_activation_budget_gib={self.tree_activation_budget_gib} plans which layers a forest's forward "
                "recomputes, but with tree_prefix_reuse=True each chunk's backward recomputes the chunk whole (the "
                "model's own checkpointing applies inside it): leave tree_activation_budget_gib=None, or set "
                "tree_prefix_reuse=False."
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

    def tree_balance_refusal(self) -> str | None:
        """Why moving rows between ranks would change this config's loss (None if it cannot); a trainer whose loss
        works within a micro-batch adds its reasons."""
        if self.per_device_train_batch_size % self.num_generations:
            return (
                f"per_device_train_batch_size={self.per_device_train_batch_size} is not a multiple of num_generations="
                f"{self.num_generations}, so whole groups cannot move: use a multiple."
            )
        return None


class TreeGroupTrainerMixin(TreeTrainerMixin):
    """TRL's group trainer (GRPO, RLOO) whose log-probability forwards run on packed prefix trees (see the module
    docstring); placed before TRL's trainer in the bases.

    Takes the same arguments as TRL's trainer; `args` must be the trainer's tree config (`_TREE_CONFIG`). Trees need
    a model the gate accepts (`hf_tree_attn.support`) with `attn_implementation="tree_flex"`: a model path gets it
    automatically, and a model instance loaded with `sdpa` / `eager` is switched to it (`tree_flex` runs plain
    forwards and `generate` as the stock implementation, so nothing else changes). A model that cannot run trees
    (another implementation, an unsupported family) trains on TRL's flat path with one warning under
    `tree_packing="auto"` (the default) and is an error at init under `tree_packing=True`. `self.tree_packing` holds
    the decision.
    """

    _TREE_CONFIG: type
    _TREE_FALLBACK = "TRL's flat path instead (logged as tree_fallback=1)"
    _TREE_CARD_SCORED = (
        "the old-policy, reference and policy log-probabilities computed on packed prefix trees, so each prompt "
        "shared by a group of completions is computed once. The log-probabilities and gradients are those of TRL's "
        "per-sequence forward"
    )

    def __init__(self, model, reward_funcs=None, args=None, **kwargs):
        args = tree_args(type(self).__name__, model, args, self._TREE_CONFIG)
        model, _ = self._tree_before_init(args, model)
        super().__init__(model, reward_funcs, args, **kwargs)
        self._tree_decide()
        self._tree_check_prefix_reuse((self.model, getattr(self, "ref_model", None)))
        if (
            self.tree_packing
            and args.max_tokens_per_mb is not None
            and args.tree_recompute == "auto"
            and args.gradient_checkpointing
            and not args.tree_prefix_reuse  # prefix reuse plans no recompute
            and self._lockstep()
        ):
            # A rank with fewer forests runs idle forwards with every layer checkpointed, beside ranks recomputing
            # the agreed count: under DeepSpeed their gathers and reductions would not pair up.
            raise ValueError(
                f"max_tokens_per_mb={args.max_tokens_per_mb} with tree_recompute='auto' under DeepSpeed on "
                f"{self.accelerator.num_processes} processes: ranks can pack a chunk into different numbers of "
                "forests, and the ranks with fewer would recompute other layers than the rest. Leave "
                "max_tokens_per_mb=None (one forest per chunk, as TRL runs one forward), or set tree_recompute='all'."
            )
        balance_refusal = self._run_balance_refusal()  # beyond the config's own, which the config refused
        if args.tree_balance and balance_refusal:
            raise ValueError(f"tree_balance=True, but {balance_refusal} Set tree_balance=None (auto) or False.")
        self._tree_compile_layers()
        self._tree_cache: dict[str, list | None] = {}
        self._unpriced: str | None = None  # the model's pricing for tree_recompute='auto' (`recompute_plan`)
        # With prefix reuse a chunk of rows is one forest (per length class), every shared token once, run in chunks
        # of max_tokens_per_mb rows (`_tree_logps`).
        self._prefix_reuse_rows = args.max_tokens_per_mb if args.tree_prefix_reuse else None
        self._tree_pack = functools.partial(
            pack_forest,
            max_tokens_per_mb=None if args.tree_prefix_reuse else args.max_tokens_per_mb,
            split_lengths=rope_split_lengths(unwrap_model(self.model).config),  # longrope: one length class a forest
            two_level=False if args.tree_prefix_reuse else None,
        )
        if self.tree_packing:
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
        budget = None if self.args.tree_prefix_reuse else self.args.max_tokens_per_mb  # chunks: any length
        dataset = self.train_dataset
        # Tool environments (GRPO's; RLOO has none) grow the prompt during generation: no bound from the dataset.
        if budget is None or trl_compat.is_vlm(self) or getattr(self, "environment_factories", None) is not None:
            return
        if not hasattr(dataset, "select") or "prompt" not in (dataset.column_names or []):
            return
        sample = dataset.select(range(min(len(dataset), 256)))["prompt"]
        prompt_ids, _, _ = trl_compat.tokenize_prompts(self, list(sample))
        longest = max(len(ids) for ids in prompt_ids) + self.max_completion_length
        if longest > budget:
            raise ValueError(
                f"max_tokens_per_mb={budget} cannot hold one sequence: the longest of the first {len(sample)} "
                f"prompts plus max_completion_length={self.max_completion_length} is {longest} tokens. Use "
                f"max_tokens_per_mb={block_budget(longest)} (or more), or None for one forest per chunk."
            )

    @profiling_decorator
    def _tree_prepare_inputs(self, generation_batch):
        """TRL's `_prepare_inputs`, except that each prompt's group of completions stays in one micro-batch.

        TRL shuffles the rows of a generation batch (`shuffle_sequence_dict`: one `torch.randperm(rows)`) before
        cutting it into `steps_per_generation` micro-batches, which scatters every group over several of them.
        Here the very same permutation is drawn, so the global random stream advances exactly as in TRL (the next
        generation samples the same tokens), but it only orders whole micro-batches, cut in sampler order where a
        group's rows are consecutive (see `micro_batch_order`). When `steps_per_generation ==
        gradient_accumulation_steps` every optimizer step sums over all micro-batches, so the update is TRL's for
        every loss normalized by the whole batch (all but `bnpo`, the entropy bonus and `top_entropy_quantile`,
        which work within a micro-batch); where the split matters, whole groups are this trainer's split by design.
        """
        if not self.tree_packing:
            return trl_compat.prepare_inputs(super(), generation_batch)
        mode = "train" if self.model.training else "eval"
        if mode == "train":
            generate_every = self.args.steps_per_generation * self.num_iterations
            if trl_compat.generation_step(self) % generate_every == 0 or trl_compat.buffered_inputs(self) is None:
                self._tree_cache.clear()
                generation_batch = trl_compat.generate_and_score_completions(self, generation_batch)
                generation_batch = split_pixel_values_by_grid(generation_batch)
                permutation = trl_compat.shuffle_permutation(generation_batch)  # TRL's draw, so TRL's random stream
                batches = split_tensor_dict(generation_batch, self.args.steps_per_generation)
                order = micro_batch_order(permutation, len(batches))
                micro_batches = [unsplit_pixel_values_by_grid(batches[i]) for i in order]
                trl_compat.set_buffered_inputs(self, self._balance_across_ranks(micro_batches))
            step = trl_compat.generation_step(self)
            return trl_compat.buffered_inputs(self)[step % self.args.steps_per_generation]
        self._tree_cache.clear()
        return trl_compat.generate_and_score_completions(self, generation_batch)

    def _balance_active(self) -> bool:
        """Whether `_balance_across_ranks` moves groups (`tree_balance`; None = wherever the loss allows it)."""
        if self.args.tree_balance is False or not self.tree_packing or self.accelerator.num_processes == 1:
            return False
        reason = self._run_balance_refusal()
        if reason:
            _log_once(logging.INFO, f"Token balancing across ranks is off: {reason}")
        return reason is None

    def _run_balance_refusal(self) -> str | None:
        """Why moving rows between ranks would change this run's loss: the config's reasons, and the model's."""
        if self.aux_loss_enabled:  # TRL adds it per micro-batch, as the mean of its chunks' losses
            return (
                f"the MoE load-balancing loss (router_aux_loss_coef={self.router_aux_loss_coef}) is computed from "
                "each micro-batch's router statistics, which moved rows change."
            )
        return self.args.tree_balance_refusal()

    @profiling_decorator
    def _balance_across_ranks(self, micro_batches: list[dict]) -> list[dict]:
        """Move whole groups between ranks so each micro-batch costs every rank about the same (`balance.py`).

        `micro_batches` are this rank's buffered micro-batches of one generation (`B` rows each, `B % G == 0`);
        micro-batch `m` runs on every rank at the same time. Each block of `G` rows is priced by `block_costs`, the
        table is gathered, and every rank computes the same plan (`assign_blocks`, within each optimizer step's
        micro-batches), then one `all_to_all` per per-row tensor moves the rows — ids, masks, advantages, old / ref /
        sampled log-probs, whatever TRL's batch holds. Widths are re-padded as TRL pads a rank's own rows. Every
        optimizer step keeps its rows and every rank `B` rows per micro-batch, so the loss and gradients are those of
        the unbalanced run (see `tree_balance`). Logs `balance/imbalance_before` / `_after` (`step_imbalance`).
        """
        if not self._balance_active():
            return micro_batches
        batch, rows = concat_micro_batches(micro_batches)
        group, per_micro = self.num_generations, len(micro_batches[0]["prompt_ids"])
        layout = row_layout(batch, rows)
        # All ranks must agree to move (one collective each): a batch with entries of unknown layout stays put.
        layouts = gather_object([layout])
        if any(entry is None for entry in layouts) or any(entry != layouts[0] for entry in layouts):
            _log_once(
                logging.WARNING,
                "Token balancing skipped: the batch holds entries whose rows cannot be moved (e.g. images) or whose "
                "layout differs between ranks.",
            )
            return micro_batches

        prompt_mask, completion_mask = batch["prompt_mask"].bool(), batch["completion_mask"].bool()
        sequences = [
            torch.cat([p[pm], c[cm]]).cpu().numpy()
            for p, pm, c, cm in zip(batch["prompt_ids"], prompt_mask, batch["completion_ids"], completion_mask)
        ]
        prompt_lengths = prompt_mask.sum(1)
        config = self.accelerator.unwrap_model(self.model).config.get_text_config()
        costs = block_costs(config, sequences, prompt_lengths.tolist(), group)
        widths = [batch["prompt_ids"].shape[1], batch["completion_ids"].shape[1]]
        device = self.accelerator.device
        table = self.accelerator.gather(torch.tensor([*costs, *widths], dtype=torch.float64, device=device)).cpu()
        world = self.accelerator.num_processes
        table = table.view(world, -1).numpy()
        costs = table[:, :-2].reshape(world, len(micro_batches), per_micro // group)
        prompt_width, completion_width = (int(w) for w in table[:, -2:].max(axis=0))

        steps, accumulation = self.args.steps_per_generation, self.args.gradient_accumulation_steps
        source = assign_blocks(costs, window=accumulation if steps % accumulation == 0 else 1)
        before = step_imbalance(costs)
        after = step_imbalance(costs[source[..., 0], source[..., 1], source[..., 2]])
        trl_compat.metrics(self)["train"]["balance/imbalance_before"].append(before)
        if after > before * (1 - MIN_GAIN):  # not worth an all_to_all of the batch
            trl_compat.metrics(self)["train"]["balance/imbalance_after"].append(before)
            return micro_batches
        trl_compat.metrics(self)["train"]["balance/imbalance_after"].append(after)

        # What each row needs of the widths after the move, as TRL pads a rank's own rows: its prompt length and
        # its completion length (a completion that mask_truncated_completions zeroed keeps its source width).
        completion_lengths = completion_mask.sum(1)
        needs = torch.stack([prompt_lengths, torch.where(completion_lengths > 0, completion_lengths, widths[1])], 1)
        rank = self.accelerator.process_index
        orders = exchange_orders(source, rank)
        moved = {}
        for key, value in batch.items():
            side = layout[key][0]
            if side == "list":
                moved[key] = move_list(value, source, rank, per_micro, group)
            elif side == "global":
                moved[key] = value
            else:
                if side in ("prompt", "completion"):
                    fill = pad_value(key, trl_compat.tokenizer(self).pad_token_id)
                    value = pad_width(value, prompt_width if side == "prompt" else completion_width, side, fill)
                moved[key] = move_rows(value, orders, per_micro, group)
        needs = move_rows(needs, orders, per_micro, group).max(0).values.tolist()
        prompt_keep, completion_keep = (round_up(n, self.pad_to_multiple_of) for n in needs)
        for key, (side, *_) in layout.items():
            if side == "prompt":
                moved[key] = moved[key][:, prompt_width - prompt_keep :]
            elif side == "completion":
                moved[key] = moved[key][:, :completion_keep]
        return split_micro_batches(moved, len(micro_batches))

    def _tree_calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's reward computation; sequence-classification reward models score the batch on packed trees (each
        prompt once for its group's completions; `reward.py`), equal to TRL's per-completion forwards."""
        args = (inputs, prompts, completions, completion_ids_list)
        if self.args.tree_packing is False:
            return trl_compat.calculate_rewards(super(), *args)
        mode = "train" if self.model.training else "eval"
        record = lambda name, value: trl_compat.metrics(self)[mode][name].append(value)  # noqa: E731
        # One forest (no token budget): never larger than TRL's padded batch, and one forward per rank as in TRL.
        with tree_reward_models(self.reward_funcs, None, self.args.tree_max_token_ratio, record):
            return trl_compat.calculate_rewards(super(), *args)

    @contextlib.contextmanager
    def _tree_generation(self):
        """What TRL's generation (`_generate_single_turn`) runs in: the decoder layers eager, and transformers'
        continuous batching on `tree_flex`'s stock twin, switched back after.

        Continuous batching accepts only its own kernels (`sdpa`, `paged|eager`, flash) and refuses `tree_flex`.
        Outside a tree `tree_flex` computes exactly what `sdpa` does (`eager` for attention-softcapping models),
        so generating with that implementation changes nothing. HF `generate` (static cache included) and vLLM need
        no switch: the former runs `tree_flex` as `sdpa`, the latter never sees the training model's attention.
        Compiled decoder layers (`tree_compile`) run eagerly here, as accelerate's compiled copy leaves generation
        with the eager original.
        """
        with contextlib.ExitStack() as stack:
            stack.enter_context(eager_layers(self.model))  # the compiled layers are the tree forward's
            if self.tree_packing and self.use_transformers_continuous_batching:
                stack.enter_context(stock_attention(self.accelerator.unwrap_model(self.model)))
            yield

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save as `Trainer` does, plus TRL's model card with the tree settings (checkpoints get it from TRL)."""
        super().save_model(output_dir, _internal_call)
        if _internal_call or not self.is_world_process_zero():
            return
        output_dir = output_dir or self.args.output_dir
        self.create_model_card(model_name=Path(output_dir).name)
        card = os.path.join(self.args.output_dir, "README.md")
        if os.path.abspath(output_dir) != os.path.abspath(self.args.output_dir) and os.path.isfile(card):
            shutil.copyfile(card, os.path.join(output_dir, "README.md"))

    def _tree_card_rows(self) -> list[tuple[str, object]]:
        args = self.args
        return [
            ("tree_balance", args.tree_balance),
            ("tree_recompute", args.tree_recompute),
            ("tree_activation_budget_gib", args.tree_activation_budget_gib),
            ("num_generations", args.num_generations),
            ("per_device_train_batch_size", args.per_device_train_batch_size),
            ("steps_per_generation", args.steps_per_generation),
        ]

    @profiling_decorator
    def _tree_per_token_logps_and_entropies(
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
        forests, and its MoE load-balancing loss (`compute_aux_loss`) pools the chunk's forests as TRL's flat forward
        pools its rows (`tree_router_aux_loss`); TRL averages the chunks' losses, so does this. Multimodal inputs,
        an unusual padding layout, sequences beyond a dynamic-RoPE limit, or too little sharing
        (`tree_max_token_ratio`) take TRL's flat path for that chunk, logged as tree_fallback.
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
        if not self.tree_packing or any(v is not None for v in multimodal.values()):
            if self.args.tree_packing is not False:
                trl_compat.metrics(self)[mode]["tree_fallback"].append(1.0)
            return trl_compat.get_per_token_logps_and_entropies(
                super(), model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                compute_aux_loss, **multimodal,
            )  # fmt: skip

        limit = rope_length_limit(unwrap_model(self.model).config)
        batch_size = batch_size or input_ids.size(0)
        all_logps, all_entropies, all_aux = [], [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids, mask = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
            too_long = limit is not None and int(mask.sum(1).max()) > limit
            packed = None if too_long else self._packed_chunk(ids, mask, logits_to_keep, mode)
            if self._lockstep() and self._flat_on_any_rank(packed is None):
                packed = None  # every rank takes TRL's flat path for this chunk
            trl_compat.metrics(self)[mode]["tree_fallback"].append(float(packed is None))
            missing = self._missing_forwards(1 if packed is None else len(packed))  # agree before any forward
            if packed is None:
                logps, entropies, aux = trl_compat.get_per_token_logps_and_entropies(
                    super(),
                    model,
                    ids,
                    mask,
                    logits_to_keep,
                    compute_entropy=compute_entropy,
                    compute_aux_loss=compute_aux_loss,
                )
            else:
                logps, entropies, aux = self._tree_logps(
                    model, packed, ids.size(0), logits_to_keep, compute_entropy, compute_aux_loss
                )
            if missing:
                logps = logps + self._idle_forwards(model, missing)
            all_logps.append(logps)
            all_entropies.append(entropies)
            all_aux.append(aux)
        logps = torch.cat(all_logps, dim=0)
        entropies = torch.cat(all_entropies, dim=0) if compute_entropy else None
        aux_loss = torch.stack(all_aux).mean() if compute_aux_loss else None
        return logps, entropies, aux_loss

    def _packed_chunk(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, mode: str):
        """Cached forests of one chunk of padded rows, or None when the chunk must take the flat path.

        Returns one `_ScoredForest` per forest, on the trainer's device.
        """
        ids = input_ids.detach().cpu()
        mask = attention_mask.detach().cpu().bool()
        key = hashlib.blake2b(
            ids.numpy().tobytes() + mask.numpy().tobytes() + repr((tuple(ids.shape), logits_to_keep)).encode(),
            digest_size=16,
        ).hexdigest()
        if key in self._tree_cache:
            return self._tree_cache[key]

        width = ids.shape[1]
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
        kept = torch.nonzero(mask.any(1)).squeeze(1)  # a fully padded row scores nothing (TRL gives it zeros too)
        if len(kept) == 0:
            self._tree_cache[key] = None
            return None
        sequences = [ids[b][mask[b]] for b in kept.tolist()]
        scored_prompt_lengths = prompt_lengths[kept]  # indexed like `sequences`
        total = sum(len(s) for s in sequences)
        forests = self._tree_pack(sequences)
        tree_tokens = sum(forest.num_tree_tokens for forest in forests)
        ratio = tree_tokens / total
        # What the tree computes against what TRL's flat forward computes (every padded position of every row).
        compute_ratio = tree_tokens / ids.numel()
        config = self.accelerator.unwrap_model(self.model).config.get_text_config()
        flops = estimate_flops(config, sequences, prompt_lengths=scored_prompt_lengths.tolist())
        trl_compat.metrics(self)[mode]["tree_token_ratio"].append(ratio)
        trl_compat.metrics(self)[mode]["tree_compute_ratio"].append(compute_ratio)
        trl_compat.metrics(self)[mode]["tree_flops_saved"].append(flops["flops_saved"])

        if compute_ratio > self.args.tree_max_token_ratio:
            self._tree_cache[key] = None
            return None
        device = self.accelerator.device
        packed = []
        for forest in forests:
            plan = TargetPlan.completions(forest, scored_prompt_lengths)
            row, column = kept[plan.seq_index], plan.position - scored_prompt_lengths[plan.seq_index]
            packed.append(_ScoredForest(forest.to(device), plan.to(device), row.to(device), column.to(device)))
        self._tree_cache[key] = packed
        return packed

    def _lockstep(self) -> bool:
        """Whether every rank must run the same modules in the same order: DeepSpeed, or FSDP with prefix reuse, on
        several processes.

        ZeRO-3 gathers each module's parameters, and ZeRO-1/2 reduce gradients in buckets filled in the order they
        arrive, with collectives that pair up across ranks in call order. A rank on TRL's flat path (which reads the
        LM head inside the model's forward) beside a rank on trees (which runs the LM head module after it), or a
        rank recomputing a layer another keeps, pairs different collectives: ZeRO-3 hung on both (2 CPU processes).
        So under DeepSpeed the path of each chunk, and the layers a tree forward recomputes, are agreed on by all
        ranks. Under FSDP2 a forest scored with prefix reuse runs a forward and a backward per chunk, which one flat
        forward on another rank does not pair with: the path is agreed on there too (prefix reuse plans no recompute).
        """
        several = self.accelerator.num_processes > 1
        return several and (self.is_deepspeed_enabled or (self.is_fsdp_enabled and self.args.tree_prefix_reuse))

    def _flat_on_any_rank(self, flat: bool) -> bool:
        """Whether some rank takes TRL's flat path for the current chunk (`flat`: whether this one does)."""
        return ranks_max([int(flat)], self.accelerator.device)[0] > 0

    def _missing_forwards(self, num_forwards: int) -> int:
        """How many forwards this rank is short of the busiest rank for the current chunk.

        FSDP (all-gathers per forward) and DDP (buffer broadcasts) need every rank to run the same number of
        forwards. Without a token budget a chunk is always one forward (one forest, or TRL's flat call); with one,
        ranks can pack their chunk into different numbers of forests.
        """
        if self.accelerator.num_processes == 1 or self.args.max_tokens_per_mb is None:
            return 0
        return ranks_max([num_forwards], self.accelerator.device)[0] - num_forwards

    def _idle_forwards(self, model, count: int) -> torch.Tensor:
        """`count` forwards of a 2-token forest whose result enters the graph with weight 0 (a scalar 0). With prefix
        reuse each is scored as the real forests are (`core.prefix_reuse_chunks`: under FSDP2 chunked, with as many
        chunks as the other ranks' forest in the same place)."""
        pad = trl_compat.tokenizer(self).pad_token_id or 0
        (forest,) = pack_forest([[pad, pad]])
        forest = forest.to(self.accelerator.device)
        reuse = None
        if self._prefix_reuse_rows is not None:
            reuse = [prefix_reuse_chunks(model, forest, self._prefix_reuse_rows, None, lambda k, v: None)]
        total = torch.zeros((), device=self.accelerator.device)
        for _ in range(count):
            tables, _, _ = score_forests(
                model, [forest], [None], temperature=self.temperature, autocast=self.accelerator.autocast,
                prefix_reuse_chunks=reuse,
            )  # fmt: skip
            total = total + tables[0].sum()
        return 0.0 * total

    def _tree_logps(
        self,
        model,
        packed: list[_ScoredForest],
        num_rows: int,
        logits_to_keep: int,
        compute_entropy: bool,
        compute_aux_loss: bool,
    ):
        """Score the forests of one chunk: `(logps, entropies | None, aux_loss | None)`, the per-token values
        scattered into `(num_rows, logits_to_keep)` (0 at padding)."""
        device = self.accelerator.device
        logps = torch.zeros(num_rows, logits_to_keep, dtype=torch.float32, device=device)
        entropies = torch.zeros_like(logps) if compute_entropy else None
        fp32_head = getattr(self.args, "cast_lm_head_to_fp32", False)  # GRPO's setting; RLOO's head has none
        reuse = None
        if self._prefix_reuse_rows is not None:
            budget = self.args.tree_prefix_reuse_budget_gib
            record = trl_compat.metrics(self)["train"]
            reuse = [
                prefix_reuse_chunks(model, f.forest, self._prefix_reuse_rows, budget, lambda k, v: record[k].append(v))
                for f in packed
            ]
        tables, entropy_tables, aux_loss = score_forests(
            model, [f.forest for f in packed], [f.plan.scored_rows for f in packed], temperature=self.temperature,
            autocast=self.accelerator.autocast, compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss,
            recompute=self._layers_to_checkpoint(packed), fp32_head=fp32_head,
            prefix_reuse_chunks=reuse,
        )  # fmt: skip
        for f, table, entropy_table in zip(packed, tables, entropy_tables):
            logps = logps.index_put((f.row, f.column), f.plan.read(table))
            if compute_entropy:
                entropies = entropies.index_put((f.row, f.column), f.plan.read(entropy_table))
        return logps, entropies, aux_loss

    def _layers_to_checkpoint(self, packed: list[_ScoredForest]) -> tuple[int | None, bool]:
        """`(count, keep_attention)` for the policy forward of one chunk's forests (`forest_step.recompute_plan`),
        bounded by the flat forward of the same sequences (unpadded, so stricter than TRL's padded rows) with every
        layer checkpointed, or by `tree_activation_budget_gib` where that is more. With prefix reuse the model's
        checkpointing stays as it is: a chunk's backward recomputes it anyway, outside any plan's scope."""
        if self._prefix_reuse_rows is not None:
            return None, False
        flat_tokens = sum(f.forest.num_original_tokens for f in packed)
        count, keep = recompute_plan(self, [f.forest for f in packed], flat_tokens)
        if count is not None and self._lockstep():  # the same layers recompute on every rank: the most any needs
            (count,) = ranks_max([count], self.accelerator.device)
            layers = self.accelerator.unwrap_model(self.model).config.get_text_config().num_hidden_layers
            # What ran, not this rank's plan.
            trl_compat.metrics(self)["train"]["tree_checkpointed_layers"][-1] = count / layers
        return count, keep


class _ScoredForest(NamedTuple):
    """One forest of a chunk of TRL's rows and where its scored completion tokens go in TRL's `(B, C)` layout."""

    forest: PackedForest
    plan: TargetPlan  # the completion tokens of the forest's sequences (`TargetPlan.completions`)
    row: torch.Tensor  # (T,) long: the chunk row of each plan entry
    column: torch.Tensor  # (T,) long: its completion column


def micro_batch_order(permutation: torch.Tensor, num_batches: int) -> list[int]:
    """Micro-batches in the order their first row appears in `permutation` (TRL's row shuffle).

    Args:
        permutation: `(rows,)` long, a permutation of the generation batch's rows (`torch.randperm(rows)`).
        num_batches: micro-batches of `rows // num_batches` consecutive rows each.

    Every order of the micro-batches is equally likely, as under TRL's shuffle, and each keeps its rows together.
    """
    size = len(permutation) // num_batches
    owners = (permutation // size).tolist()
    return [b for b in dict.fromkeys(owners) if b < num_batches]
