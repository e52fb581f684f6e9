"""The step the GRPO trainers share: forests in, per-row log-probabilities (and entropies, MoE aux loss) out.

`TreeGRPOTrainer` scatters the per-row tables into TRL's `(B, C)` completion layout; `TreeAsyncGRPOTrainer` gathers
them at TRL's loss terms. Both decide recompute the same way (`recompute_plan`) and score the same way
(`score_forests`): one forward per forest under the trainer's autocast, the checkpointed layers limited to what
memory needs, the MoE load-balancing loss weighted per sequence as in a flat forward.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

import torch

from ..logprobs import forest_logprobs, tree_router_aux_loss
from ..prefix_attention import serves
from ..recompute import (
    _checkpointed_layers,
    checkpoint_count,
    checkpoint_fits,
    keeps_attention,
    recompute_only,
    unpriced_reason,
)
from ..tree import PackedForest
from . import trl_compat

__all__ = ["recompute_plan", "score_forests"]

logger = logging.getLogger(__name__)


@functools.cache
def _log_once(level: int, message: str, name: str = __name__) -> None:
    """Log `message` at `level` on the logger `name`, once per process."""
    logging.getLogger(name).log(level, message)


def recompute_plan(
    trainer, forests: Sequence[PackedForest], bound_tokens: int, keep_within_bound: bool = False
) -> tuple[int | None, bool]:
    """`(count, keep_attention)`: how many checkpointed decoder layers the policy forward of `forests` recomputes,
    and whether those keep the shared-prefix kernels' outputs.

    `trainer` is the tree trainer (`args.tree_recompute`, `args.tree_activation_budget_gib`, `model`, `accelerator`,
    TRL's metrics table (`trl_compat.metrics`), and `_unpriced`: None until the layers were priced once).
    `tree_recompute="auto"`: as few layers as keep the forests' estimated activations within those of `bound_tokens`
    tokens with every layer checkpointed, or within `tree_activation_budget_gib` where that is more, and attention
    kept where the kernels serve a forest and the model's checkpoint allows it (`hf_tree_attn.recompute`) — with
    `keep_within_bound`, only where the kept outputs fit in the bound too. `(None, False)` = leave the model's
    checkpointing as it is ("all", or a forward without gradients). Logs `tree_checkpointed_layers` and
    `tree_kept_attention`.
    """
    args = trainer.args
    if args.tree_recompute == "all" or not args.gradient_checkpointing:
        return None, False
    if not (trainer.model.training and torch.is_grad_enabled()):
        return None, False
    model = trainer.accelerator.unwrap_model(trainer.model)
    config = model.config.get_text_config()
    if trainer._unpriced is None:  # once per run: the layers do not change
        layers = {type(m): m for m in _checkpointed_layers(model)}.values()
        reasons = [r for r in (unpriced_reason(config, m) for m in layers or [None]) if r is not None]
        trainer._unpriced = reasons[0] if reasons else ""
        if reasons:
            _log_once(
                logging.INFO,
                f"tree_recompute='auto' cannot bound this model's activations ({reasons[0]}): every checkpointed "
                "layer recomputes, as with tree_recompute='all' (logged as tree_checkpointed_layers=1).",
            )
    if trainer._unpriced:
        trl_compat.metrics(trainer)["train"]["tree_checkpointed_layers"].append(1.0)
        return None, False
    device = trainer.accelerator.device.type
    keep = any(serves(forest, device) for forest in forests) and keeps_attention(model)
    # The residual stream and the checkpoints' inputs keep the weights' dtype; autocast lowers only the matmuls'
    # outputs (fp32 weights with TRL's bf16=True: 4 bytes, an upper bound for the bf16 parts).
    weights = next((p for p in model.parameters() if p.is_floating_point()), None)
    dtype_bytes = weights.element_size() if weights is not None else 4
    tree_tokens = sum(forest.seq_len for forest in forests)
    sizing = dict(dtype_bytes=dtype_bytes, budget_gib=args.tree_activation_budget_gib)
    count = checkpoint_count(config, tree_tokens, bound_tokens, keep_attention=keep, **sizing)
    if (
        keep
        and keep_within_bound
        and not checkpoint_fits(config, tree_tokens, bound_tokens, count, keep_attention=True, **sizing)
    ):
        keep = False
        count = checkpoint_count(config, tree_tokens, bound_tokens, **sizing)
    logged = trl_compat.metrics(trainer)["train"]
    logged["tree_checkpointed_layers"].append(count / config.num_hidden_layers)
    logged["tree_kept_attention"].append(float(keep))
    return count, keep


def score_forests(
    model: torch.nn.Module,
    forests: Sequence[PackedForest],
    rows: Sequence[torch.Tensor | None],
    *,
    temperature: float,
    autocast: Callable,
    compute_entropy: bool = False,
    compute_aux_loss: bool = False,
    recompute: tuple[int | None, bool] = (None, False),
    fp32_head: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor | None], torch.Tensor | None]:
    """One forward per forest: `(tables, entropy_tables, aux_loss)`.

    Args:
        model: the (wrapped) tree_flex policy; its root module is called.
        forests: packed forests on the model's device.
        rows: for each forest, the rows `(R,)` whose token to score (None: every row with a parent).
        temperature: logits are divided by it.
        autocast: the trainer's autocast context factory (`accelerator.autocast`), entered around each forward and
            its LM head, as TRL's own forward runs under it.
        compute_entropy: also return the entropy of the distribution predicting each scored row.
        compute_aux_loss: also return the MoE load-balancing loss of all forests' sequences, each shared token
            weighted by the sequences that contain it (`tree_router_aux_loss`), as a flat forward counts it.
        recompute: `(count, keep_attention)` from `recompute_plan`.
        fp32_head: the LM head in float32, autocast off (TRL's `cast_lm_head_to_fp32`).

    Returns:
        `tables[i]` `(S_i,)` float32 log-probs indexed by row of `forests[i]` (0 at unscored rows), differentiable;
        `entropy_tables[i]` likewise or None; `aux_loss` a scalar or None.
    """
    tables, entropy_tables, router_logits = [], [], []
    count, keep_attention = recompute
    with recompute_only(model, count, keep_attention=keep_attention):
        for forest, scored in zip(forests, rows):
            with autocast():
                table, entropy_table, *router = forest_logprobs(
                    model, forest, rows=scored, temperature=temperature, return_entropy=compute_entropy,
                    return_router_logits=compute_aux_loss, fp32_head=fp32_head,
                )  # fmt: skip
            tables.append(table)
            entropy_tables.append(entropy_table)
            router_logits += router
    aux_loss = tree_router_aux_loss(model, forests, router_logits) if compute_aux_loss else None
    return tables, entropy_tables, aux_loss
