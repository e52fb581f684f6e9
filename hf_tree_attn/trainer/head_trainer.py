"""What `TreeSFTTrainer` and `TreeDPOTrainer` share: trees or TRL's path, decided once, then the tree fused head.

Both trainers leave TRL's dataset handling, collators, losses and metrics alone: the only thing they change is the
forward TRL's fused LM head runs (`fused_head.TreeLMHead`). `TreeHeadTrainerMixin` (placed before TRL's class)
makes the decision the way `TreeGRPOTrainer` does: the policy (and a separate reference model) must pass the gate
(`hf_tree_attn.support`) on `attn_implementation="tree_flex"`; a model given by path or on `sdpa` / `eager` is
switched to it; under `tree_packing="auto"` a model that cannot run trees trains on TRL's path with one warning
naming the reason, under `tree_packing=True` that is an error.
"""

from __future__ import annotations

import os
import warnings

from ..attention import ATTN_IMPLEMENTATION
from ..support import rope_split_lengths, unwrap_model
from . import trl_compat
from .compile_setting import apply_compile, decide_compile
from .fused_head import TreeLMHead, fused_head_settings
from .grpo_trainer import _loaded_model_error, _select_tree_attention, restore_stock_attention

__all__ = ["TreeHeadTrainerMixin"]


class TreeHeadTrainerMixin:
    """Shared set-up of the trainers that run TRL's fused LM head on trees (see the module docstring).

    A subclass calls `_tree_before_init(model, args)` before TRL's `__init__` and `_tree_setup()` after it (or
    earlier, from a hook TRL's `__init__` calls that already scores sequences, such as DPO's reference precompute).
    `self.tree_packing` then holds the decision and `self.tree_lm_head` the head (None on TRL's path).
    """

    def _tree_before_init(self, model, args):
        """`model` switched to `tree_flex` where it can run trees (a path: through `args.model_init_kwargs`)."""
        self._tree_reason, self._tree_ready = None, False
        self.tree_packing, self.tree_lm_head, self.tree_compile = False, None, None
        if args.tree_packing is not False:
            model, self._tree_reason = _select_tree_attention(model, args)
        return model

    def _tree_refusal(self) -> str | None:
        """Why this run cannot use trees beyond the model gate (overridden per trainer), or None."""
        if trl_compat.is_vision_dataset(self):
            return "the dataset holds images, whose inputs the tree does not lay out."
        return None

    def _fused_head_models(self) -> list:
        """The modules TRL installed its fused LM head on: the policy (under PEFT its base model), the reference."""
        models = []
        for model in (self.model, getattr(self, "ref_model", None)):
            if model is None:
                continue
            inner = unwrap_model(model)
            models.append(inner.get_base_model() if hasattr(inner, "get_base_model") else inner)
        return models

    def _tree_setup(self) -> None:
        """Decide trees or TRL's path (once), and install the tree head on every model TRL scores with."""
        if self._tree_ready:
            return
        self._tree_ready = True
        args, reason = self.args, self._tree_reason
        models = [self.model, getattr(self, "ref_model", None)]
        sharded = self.is_fsdp_enabled or self.is_deepspeed_enabled
        if args.tree_packing is not False and reason is None:
            reason = _loaded_model_error(*models) or self._tree_refusal()
        split = rope_split_lengths(unwrap_model(self.model).config)
        if (
            args.tree_packing is not False
            and reason is None
            and split
            and sharded
            and self.accelerator.num_processes > 1
        ):
            # One forest per length class: ranks could run different numbers of forwards, each gathering weights.
            lengths = " / ".join(map(str, split))
            reason = (
                f"the model's longrope RoPE splits a batch into one forest per length class (at {lengths} tokens), "
                "and with sharded weights on several processes every rank must run the same number of forwards."
            )
        if args.tree_packing is not False and reason is None:
            try:
                for target in self._fused_head_models():
                    fused_head_settings(target)
            except ValueError as error:
                reason = str(error)
        if reason is not None and args.tree_packing is True:
            raise ValueError(f"tree_packing=True, but this run cannot use packed trees exactly: {reason}")
        if reason is not None and args.tree_packing == "auto":
            restore_stock_attention(models, reason)
            warnings.warn(f"tree_packing='auto': {reason} Training on TRL's path instead.", stacklevel=3)
        self.tree_packing = args.tree_packing is not False and reason is None
        if self.tree_packing and args.max_tokens_per_mb is not None and sharded and self.accelerator.num_processes > 1:
            raise ValueError(
                f"max_tokens_per_mb={args.max_tokens_per_mb} with sharded weights (FSDP / DeepSpeed) on "
                f"{self.accelerator.num_processes} processes: ranks could pack a batch into different numbers of "
                "forests, and every forward gathers the weights on all ranks together. Leave max_tokens_per_mb=None "
                "(one forest per batch, as TRL runs one forward)."
            )
        if self.tree_packing:
            self.tree_lm_head = TreeLMHead(args.max_tokens_per_mb, args.tree_max_token_ratio, self._record_tree)
            for target in self._fused_head_models():
                self.tree_lm_head.install(target)
            # Compiled decoder layers: the user's dynamo settings, or the CUDA default (`compile_setting.py`).
            self.tree_compile = decide_compile(args, self.accelerator, self.model)
            apply_compile(self.accelerator, self.tree_compile, models)

    def _record_tree(self, name: str, value: float) -> None:
        trl_compat.metrics(self)["train" if self.model.training else "eval"][name].append(value)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's model card (`README.md` in `output_dir`), plus a section with the tree-packing settings."""
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        path = os.path.join(self.args.output_dir, "README.md")
        if self.is_world_process_zero() and os.path.isfile(path):
            with open(path, "a", encoding="utf-8") as card:
                card.write(self._tree_card_section())

    def _tree_card_section(self) -> str:
        from .. import __version__

        args = self.args
        rows = [
            ("tree_packing", self.tree_packing),
            ("max_tokens_per_mb", args.max_tokens_per_mb),
            ("tree_max_token_ratio", args.tree_max_token_ratio),
            ("attn_implementation", ATTN_IMPLEMENTATION if self.tree_packing else "unchanged"),
        ]
        table = "\n".join(f"| `{name}` | `{value}` |" for name, value in rows)
        intro = (
            f"Trained with `hf_tree_attn.{type(self).__name__}` (hf_tree_attn {__version__}): TRL's "
            f"{trl_compat.trainer_name(self)}, "
            "with each batch's log-probabilities computed on packed prefix trees, so tokens its sequences share are "
            "computed once. The log-probabilities and gradients are those of TRL's forward; only the cost changes."
        )
        return f"\n## Tree training\n\n{intro}\n\n| setting | value |\n| --- | --- |\n{table}\n"
