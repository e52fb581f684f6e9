"""What `TreeSFTTrainer` and `TreeDPOTrainer` add to the core: TRL's fused LM head run on packed forests.

Both trainers leave TRL's dataset handling, collators, losses and metrics alone: the only thing they change is the
forward TRL's fused LM head runs (`fused_head.TreeLMHead`). The choice between trees and TRL's path is the core's
(`core.TreeTrainerMixin`); this mixin adds what keeps a fused-head run off trees (images, a longrope model sharded
over several processes, a head whose settings the tree cannot read) and installs the tree head.
"""

from __future__ import annotations

from ..support import rope_split_lengths, unwrap_model
from . import trl_compat
from .core import TreeOptions, TreeTrainerMixin
from .fused_head import TreeLMHead, fused_head_settings

__all__ = ["TreeHeadTrainerMixin"]


class TreeHeadTrainerMixin(TreeTrainerMixin):
    """Shared set-up of the trainers that run TRL's fused LM head on trees (see the module docstring).

    A subclass calls `_tree_before_init(args, model, ref_model)` before TRL's `__init__` and `_tree_setup()` after
    it (or earlier, from a hook TRL's `__init__` calls that already scores sequences, such as DPO's reference
    precompute). `self.tree_packing` then holds the decision and `self.tree_lm_head` the head (None on TRL's path).
    """

    def _tree_before_init(self, args: TreeOptions, model, ref_model=None):
        self._tree_ready = False
        self.tree_packing, self.tree_lm_head, self.tree_compile = False, None, None
        return super()._tree_before_init(args, model, ref_model)

    def _tree_refusal(self) -> str | None:
        if trl_compat.is_vision_dataset(self):
            return "the dataset holds images, whose inputs the tree does not lay out."
        split = rope_split_lengths(unwrap_model(self.model).config)
        if split and (self.is_fsdp_enabled or self.is_deepspeed_enabled) and self.accelerator.num_processes > 1:
            # One forest per length class: ranks could run different numbers of forwards, each gathering weights.
            lengths = " / ".join(map(str, split))
            return (
                f"the model's longrope RoPE splits a batch into one forest per length class (at {lengths} tokens), "
                "and with sharded weights on several processes every rank must run the same number of forwards."
            )
        try:
            for _, target in self._fused_head_models():
                fused_head_settings(target)
        except ValueError as error:
            return str(error)
        return None

    def _fused_head_models(self) -> list[tuple]:
        """`(the model TRL calls, the module TRL installed its fused LM head on)` for the policy (under PEFT the
        `PeftModel` and its base model) and the reference."""
        models = []
        for model in (self.model, getattr(self, "ref_model", None)):
            if model is None:
                continue
            inner = unwrap_model(model)
            models.append((inner, inner.get_base_model() if hasattr(inner, "get_base_model") else inner))
        return models

    def _tree_setup(self) -> None:
        """Decide trees or TRL's path (once), and install the tree head on every model TRL scores with."""
        if self._tree_ready:
            return
        self._tree_ready = True
        args = self.args
        sharded = self.is_fsdp_enabled or self.is_deepspeed_enabled
        self._tree_decide(stacklevel=4)
        self._tree_check_prefix_reuse((self.model, getattr(self, "ref_model", None)))
        several = sharded and self.accelerator.num_processes > 1
        # With prefix reuse a batch is one forest (in chunks, as many on every rank: `hf_tree_attn.prefix_reuse`).
        if self.tree_packing and args.max_tokens_per_mb is not None and several and not args.tree_prefix_reuse:
            raise ValueError(
                f"max_tokens_per_mb={args.max_tokens_per_mb} with sharded weights (FSDP / DeepSpeed) on "
                f"{self.accelerator.num_processes} processes: ranks could pack a batch into different numbers of "
                "forests, and every forward gathers the weights on all ranks together. Leave max_tokens_per_mb=None "
                "(one forest per batch, as TRL runs one forward), or set tree_prefix_reuse=True (one forest per batch "
                "in chunks of max_tokens_per_mb rows, as many on every rank)."
            )
        if self.tree_packing:
            self.tree_lm_head = TreeLMHead(
                args.max_tokens_per_mb, args.tree_max_token_ratio, self._record_tree, args.tree_prefix_reuse,
                args.tree_prefix_reuse_budget_gib,
            )  # fmt: skip
            for caller, target in self._fused_head_models():
                self.tree_lm_head.install(target, caller)
            self._tree_compile_layers()

    def _record_tree(self, name: str, value: float) -> None:
        trl_compat.metrics(self)["train" if self.model.training else "eval"][name].append(value)
