"""`TreeGRPOTrainer`: TRL's GRPO trainer with its log-probability forwards on packed prefix trees.

The old-policy, reference and policy log-probabilities (and entropies) of a chunk of TRL's padded rows come from
one forward over the chunk's prefix forest, each prompt's group kept in one micro-batch (`group_trainer.py`, which
`TreeRLOOTrainer` shares).
Everything else — generation, rewards, advantages, every `loss_type`, KL, clipping, metrics — is TRL's own code on
the same `(B, C)` tensors. What is GRPO's own here: `_generate_single_turn` (transformers' continuous batching with a
stock attention, empty prompts or completions refused, as a `rollout_func`'s output is checked, `rollouts.py`), and
the loss settings that keep groups from moving between ranks (`TreeGRPOConfig.tree_balance_refusal`).
"""

from __future__ import annotations

from trl import GRPOTrainer

from . import trl_compat
from .core import stock_attention
from .group_trainer import TreeGroupTrainerMixin, micro_batch_order
from .grpo_config import TreeGRPOConfig
from .rollouts import check_rollouts, checked_rollout_func

__all__ = ["TreeGRPOTrainer", "micro_batch_order", "stock_attention"]


class TreeGRPOTrainer(TreeGroupTrainerMixin, GRPOTrainer):
    """`trl.GRPOTrainer` whose log-probability forwards run on packed prefix trees (see the module docstring).

    Takes the same arguments as `trl.GRPOTrainer`; `args` must be a `TreeGRPOConfig`. Trees need a model the gate
    accepts (`hf_tree_attn.support`) with `attn_implementation="tree_flex"`: a model path gets it automatically, and
    a model instance loaded with `sdpa` / `eager` is switched to it (`tree_flex` runs plain forwards and `generate`
    as the stock implementation, so nothing else changes). A model that cannot run trees (another implementation,
    an unsupported family) trains on TRL's flat path with one warning under `tree_packing="auto"` (the default)
    and is an error at init under `tree_packing=True`. `self.tree_packing` holds the decision.
    """

    _TREE_CONFIG = TreeGRPOConfig

    # TRL's hooks, run by the group trainers' code under TRL's names and signatures (tests/test_trl_compat.py).
    _prepare_inputs = TreeGroupTrainerMixin._tree_prepare_inputs
    _calculate_rewards = TreeGroupTrainerMixin._tree_calculate_rewards
    _get_per_token_logps_and_entropies = TreeGroupTrainerMixin._tree_per_token_logps_and_entropies

    def __init__(self, model, reward_funcs=None, args: TreeGRPOConfig | None = None, **kwargs):
        super().__init__(model, reward_funcs, args, **kwargs)
        if self.rollout_func is not None:  # an empty prompt or completion is named before TRL's code trips on it
            self.rollout_func = checked_rollout_func(self.rollout_func, trl_compat.tokenizer(self).decode)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's generation under `_tree_generation` (continuous batching on a stock attention, layers eager); an
        empty prompt or completion is refused here, naming the sample (`check_rollouts`)."""
        args = (prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        with self._tree_generation():
            completion_ids, logprobs = trl_compat.generate_single_turn(super(), *args)
        check_rollouts(prompt_ids, completion_ids, "generation", trl_compat.tokenizer(self).decode)
        return completion_ids, logprobs
