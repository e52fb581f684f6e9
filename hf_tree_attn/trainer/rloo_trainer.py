"""`TreeRLOOTrainer`: TRL's RLOO trainer with its log-probability forwards on packed prefix trees.

RLOO samples `num_generations` completions per prompt as GRPO does and reaches its log-probabilities through the
same hooks, so the group trainers' code runs it (`group_trainer.py`): the old-policy, reference and policy
log-probabilities of a micro-batch of whole groups come from one forward over its prefix forest, each prompt
computed once. Generation, the leave-one-out baseline, the KL penalty in the reward, the clipped sequence-level
loss and every metric are TRL's own code on the same `(B, C)` tensors. RLOO's own here is only its generation
hook, whose parameters and result differ from GRPO's.
"""

from __future__ import annotations

from trl import RLOOTrainer

from . import trl_compat
from .group_trainer import TreeGroupTrainerMixin
from .rloo_config import TreeRLOOConfig
from .rollouts import check_rollouts

__all__ = ["TreeRLOOTrainer"]


class TreeRLOOTrainer(TreeGroupTrainerMixin, RLOOTrainer):
    """`trl.RLOOTrainer` whose log-probability forwards run on packed prefix trees (see the module docstring).

    Takes the same arguments as `trl.RLOOTrainer` (by keyword after `args`); `args` must be a `TreeRLOOConfig`. The
    model's attention and the fallback to TRL's flat path are as in `TreeGRPOTrainer`: `self.tree_packing` holds the
    decision, `tree_fallback` is logged per log-probability forward.
    """

    _TREE_CONFIG = TreeRLOOConfig

    # TRL's hooks, run by the group trainers' code under TRL's names and signatures (tests/test_trl_compat.py).
    _prepare_inputs = TreeGroupTrainerMixin._tree_prepare_inputs
    _calculate_rewards = TreeGroupTrainerMixin._tree_calculate_rewards
    _get_per_token_logps_and_entropies = TreeGroupTrainerMixin._tree_per_token_logps_and_entropies

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields):
        """TRL's generation under `_tree_generation` (continuous batching on a stock attention, layers eager); an
        empty prompt or completion is refused here, naming the sample (`check_rollouts`)."""
        with self._tree_generation():
            completion_ids = trl_compat.rloo_generate_single_turn(super(), prompt_ids, images, multimodal_fields)
        check_rollouts(prompt_ids, completion_ids, "generation", trl_compat.tokenizer(self).decode)
        return completion_ids
