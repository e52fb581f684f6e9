"""`TreeRewardTrainer`: TRL's reward-model trainer with each batch's chosen and rejected scores from prefix trees.

`trl.RewardTrainer` trains a sequence classifier on (chosen, rejected) pairs: its collator stacks a batch's chosen
rows, then its rejected rows, right-padded, and its loss runs the model once on them and reads one score per row,
so each pair's prompt runs twice (and twice more for every further pair of that prompt in the batch). Here, for the
duration of TRL's `compute_loss`, the classifier's forward packs the rows into prefix forests (one trie per prompt),
runs the backbone once per forest and applies the `score` head to the forest row of the token transformers reads,
the rightmost non-pad token (`reward.score_on_forests`). The scores are TRL's, so TRL's data handling, loss (with
margins and `center_rewards_coefficient`), metrics and PEFT run unchanged on them.

Which models: those the reward-model gate accepts (`reward.reward_model_error`: transformers' generic decoder-only
sequence classifier of a family trees run exactly, with a plain linear `score` head, PEFT's `modules_to_save` copy
of it included). A batch the tree cannot lay out, or one that shares too little (`tree_max_token_ratio`), runs TRL's
forward (`tree_fallback` logged).
"""

from __future__ import annotations

from trl import RewardTrainer

from ..attention import ATTN_IMPLEMENTATION
from ..support import rope_split_lengths
from . import trl_compat
from .core import TreeTrainerMixin, select_tree_attention, tree_args
from .reward import forest_scoring, reward_model_error, scoring_model
from .reward_config import TreeRewardConfig

__all__ = ["TreeRewardTrainer"]


class TreeRewardTrainer(TreeTrainerMixin, RewardTrainer):
    """`trl.RewardTrainer` whose chosen and rejected scores come from packed prefix trees (see the module docstring).

    Takes exactly `trl.RewardTrainer`'s arguments; `args` must be a `TreeRewardConfig`. A model given on `sdpa` /
    `eager`, or by path, is switched to `tree_flex`; under `tree_packing="auto"` a model the gate refuses trains on
    TRL's path with one warning naming the reason, under `tree_packing=True` that is an error. `self.tree_packing`
    holds the decision; per batch, `tree_fallback` and `tree_compute_ratio` (forest rows / rows x padded width) are
    logged.
    """

    _TREE_CARD_SCORED = (
        "each batch's chosen and rejected scores computed on packed prefix trees, so a prompt its pairs share is "
        "computed once. The scores and gradients are those of TRL's forward"
    )

    def __init__(self, model, args: TreeRewardConfig | None = None, *pos, **kwargs):
        args = tree_args(type(self).__name__, model, args, TreeRewardConfig)
        self.tree_packing, self.tree_compile, self._tree_reason = False, None, None
        if args.tree_packing is not False:
            model, self._tree_reason = _select_reward_attention(model, args)
        super().__init__(model, args, *pos, **kwargs)
        self._tree_setup()

    def _tree_model_error(self, models) -> str | None:
        return reward_model_error(self.model, fallback="")

    def _tree_refusal(self) -> str | None:
        """Why this run cannot score on trees beyond the model gate, or None."""
        parallelism = self.accelerator.parallelism_config
        if parallelism is not None and (parallelism.cp_enabled or parallelism.sp_enabled):
            return "context / sequence parallelism shards each sequence across ranks, which a forest does not."
        split = rope_split_lengths(scoring_model(self.model).config)
        if split and self._sharded_ranks():
            lengths = " / ".join(map(str, split))
            return (
                f"the model's longrope RoPE splits a batch into one forest per length class (at {lengths} tokens), "
                "and with sharded weights on several processes every rank must run the same number of forwards."
            )
        return None

    def _sharded_ranks(self) -> bool:
        """Weights sharded (FSDP / DeepSpeed) over several processes: every forward gathers them on all ranks."""
        return (self.is_fsdp_enabled or self.is_deepspeed_enabled) and self.accelerator.num_processes > 1

    def _tree_setup(self) -> None:
        """Decide trees or TRL's path on the model as TRL built it (loaded, PEFT-wrapped), once."""
        if self.args.tree_prefix_reuse:  # a shared field of the tree configs, not wired into reward scoring
            raise ValueError(
                "tree_prefix_reuse=True: TreeRewardTrainer scores its forests whole (a score reads a sequence's last "
                "hidden state, not chunked log-probabilities). Set tree_prefix_reuse=False."
            )
        self._tree_decide(stacklevel=4)
        if not self.tree_packing:
            return
        if self.args.max_tokens_per_mb is not None and self._sharded_ranks():
            raise ValueError(
                f"max_tokens_per_mb={self.args.max_tokens_per_mb} with sharded weights (FSDP / DeepSpeed) on "
                f"{self.accelerator.num_processes} processes: ranks could pack a batch into different numbers of "
                "forests, and every forward gathers the weights on all ranks together. Leave max_tokens_per_mb=None "
                "(one forest per batch, as TRL runs one forward)."
            )
        self._tree_compile_layers()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss and metrics, on scores the model computes from packed forests (see the module docstring)."""
        if not self.tree_packing:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        # TRL hands the model its whole batch, `margin` included, which the model's layers receive and never read.
        scoring = forest_scoring(
            scoring_model(model), self.args.max_tokens_per_mb, self.args.tree_max_token_ratio, self._record_tree,
            ignored=("margin",),
        )  # fmt: skip
        with scoring:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def _record_tree(self, name: str, value: float) -> None:
        trl_compat.metrics(self)["train" if self.model.training else "eval"][name].append(value)


def _select_reward_attention(model, args: TreeRewardConfig):
    """`(model, None)` with the reward model on `tree_flex` (a path: loaded so, through `args.model_init_kwargs`,
    when its config passes), or `(model, reason)` untouched when it cannot score on trees exactly."""
    if isinstance(model, str):
        return select_tree_attention(model, args)
    reason = reward_model_error(model, fallback="")
    if reason is None and scoring_model(model).config._attn_implementation != ATTN_IMPLEMENTATION:
        scoring_model(model).set_attn_implementation(ATTN_IMPLEMENTATION)
    return model, reason
