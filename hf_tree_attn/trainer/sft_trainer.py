"""`TreeSFTTrainer`: TRL's SFT trainer with each batch scored on packed prefix trees.

Agent and tool-use datasets open every sample with the same long system prompt, and multi-turn trajectories are
often stored one sample per assistant turn, each holding the whole history before it. TRL's padding and its
padding-free packing compute every copy of those tokens; here the sequences of a batch are packed into prefix
forests, so a shared prefix is computed once per batch.

Nothing of TRL's SFT changes but the forward its fused LM head runs (`fused_head.TreeLMHead`): dataset preparation
(language modeling and prompt-completion, conversational with chat templates, `packing`, `padding_free`), the
collator, `completion_only_loss` / `assistant_only_loss` (they are the labels), the token-level loss over
`num_items_in_batch`, DFT, the MoE auxiliary loss and every metric are TRL's own code on tensors laid out exactly as
TRL's forward lays them out. A batch that shares too little (`tree_max_token_ratio`) runs TRL's forward.
"""

from __future__ import annotations

from trl import SFTTrainer

from .core import tree_args
from .head_trainer import TreeHeadTrainerMixin
from .sft_config import TreeSFTConfig

__all__ = ["TreeSFTTrainer"]


class TreeSFTTrainer(TreeHeadTrainerMixin, SFTTrainer):
    """`trl.SFTTrainer` whose batches are scored on packed prefix trees (see the module docstring).

    Takes exactly `trl.SFTTrainer`'s arguments; `args` must be a `TreeSFTConfig`. `self.tree_packing` holds whether
    trees run (see `TreeHeadTrainerMixin`); per batch, `tree_fallback`, `tree_token_ratio` (forest rows / real
    tokens) and `tree_compute_ratio` (forest rows / tokens TRL's forward computes) are logged.
    """

    def __init__(self, model, args: TreeSFTConfig | None = None, *pos, **kwargs):
        args = tree_args(type(self).__name__, model, args, TreeSFTConfig)
        model, _ = self._tree_before_init(args, model)
        super().__init__(model, args, *pos, **kwargs)
        self._tree_setup()

    def _tree_refusal(self) -> str | None:
        parallelism = self.accelerator.parallelism_config
        if parallelism is not None and (parallelism.cp_enabled or parallelism.sp_enabled):
            return "context / sequence parallelism shards each sequence across ranks, which a forest does not."
        return super()._tree_refusal()
