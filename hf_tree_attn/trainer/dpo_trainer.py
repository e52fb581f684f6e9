"""`TreeDPOTrainer`: TRL's DPO trainer with each batch's chosen and rejected sequences scored on prefix trees.

A DPO batch holds each prompt twice (chosen and rejected) and TRL runs it twice in the policy forward and twice in
the reference forward. Here the batch's sequences are packed into prefix forests, one trie per prompt (a prompt
with several pairs in the batch is one trie too), so each prompt is computed once in the policy forward and once in
the reference forward; the reference forward reuses the policy forward's packing.

Nothing of TRL's DPO changes but the forward its fused LM head runs (`fused_head.TreeLMHead`), so the tensors
TRL's loss reads — per-token log-probabilities, entropies, mean logits, top-1 flags and `log(sum p^2)` — are laid
out exactly as TRL's forward lays them out. Every `loss_type` (alone or mixed with `loss_weights`), every
`f_divergence_type`, `use_weighting` (WPO), `ld_alpha`, `precompute_ref_log_probs`, PEFT (reference = adapters off)
and every metric are TRL's own code on them; none is refused.
"""

from __future__ import annotations

import logging

from trl import DPOTrainer

from . import trl_compat
from .core import tree_args
from .dpo_config import TreeDPOConfig
from .head_trainer import TreeHeadTrainerMixin

__all__ = ["TreeDPOTrainer"]

logger = logging.getLogger(__name__)


class TreeDPOTrainer(TreeHeadTrainerMixin, DPOTrainer):
    """`trl.DPOTrainer` whose policy and reference forwards run on packed prefix trees (see the module docstring).

    Takes exactly `trl.DPOTrainer`'s arguments; `args` must be a `TreeDPOConfig`. A `ref_model` instance given on
    `sdpa` / `eager` is switched to `tree_flex` like the policy. Per forward, `tree_fallback`, `tree_token_ratio` and
    `tree_compute_ratio` are logged (see `TreeSFTTrainer`).
    """

    def __init__(self, model, ref_model=None, args: TreeDPOConfig | None = None, *pos, **kwargs):
        args = tree_args(type(self).__name__, model, args, TreeDPOConfig)
        model, ref_model = self._tree_before_init(args, model, ref_model)
        super().__init__(model, ref_model, args, *pos, **kwargs)
        self._tree_setup()

    def _precompute_ref_logps(self, dataset, name, batch_size):
        """TRL's precompute of the reference log-probabilities (inside TRL's `__init__`), on trees too.

        Its forwards' tree metrics are taken out of the logged ones (they would weigh into the first log's
        averages) and summed up in one INFO log record instead."""
        self._tree_setup()
        logged = trl_compat.metrics(self)
        before = {mode: {key: len(values) for key, values in m.items()} for mode, m in logged.items()}
        try:
            return trl_compat.precompute_ref_logps(super(), dataset, name, batch_size)
        finally:
            fallbacks = []
            for mode, metrics in logged.items():
                for key in [k for k in metrics if k.startswith("tree_")]:
                    start = before.get(mode, {}).get(key, 0)
                    if key == "tree_fallback":
                        fallbacks += metrics[key][start:]
                    del metrics[key][start:]
            logger.info(
                "Reference log-probabilities of %s precomputed: %d of %d batches on trees.",
                name, fallbacks.count(0.0), len(fallbacks),
            )  # fmt: skip
