"""The step the policy trainers share: forests in, per-row log-probabilities (and entropies, MoE aux loss) out.

The group trainers (`group_trainer.py`: GRPO, RLOO) scatter the per-row tables into TRL's `(B, C)` completion
layout; `TreeAsyncGRPOTrainer` gathers them at TRL's loss terms. All decide recompute the same way, from the same
config fields (`PolicyForwardOptions`): `plan_recompute` returns the plan and what to log of it, `recompute_plan`
runs it for a trainer and records that in TRL's metrics table. All score the same way (`score_forests`): one forward
per forest under the trainer's autocast, the checkpointed layers limited to what memory needs, the MoE
load-balancing loss weighted per sequence as in a flat forward.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..logprobs import forest_logprobs, tree_router_aux_loss
from ..prefix_attention import serves
from ..prefix_reuse import chunked_forest_logprobs
from ..recompute import (
    _checkpointed_layers,
    checkpoint_count,
    checkpoint_fits,
    keeps_attention,
    recompute_only,
    unpriced_reason,
)
from ..tree import PackedForest
from ..varlen_attention import path_serves
from . import trl_compat
from .core import ReuseChunks

__all__ = ["PolicyForwardOptions", "plan_recompute", "recompute_plan", "score_forests", "unpriced_layers"]

logger = logging.getLogger(__name__)


@functools.cache
def _log_once(level: int, message: str, name: str = __name__) -> None:
    """Log `message` at `level` on the logger `name`, once per process."""
    logging.getLogger(name).log(level, message)


@dataclass
class PolicyForwardOptions:
    """The fields of every config whose trainer runs the policy forward on trees (with gradients): how it
    recomputes activations. Placed before TRL's config in the bases; the temperature TRL samples with must divide
    the logits, as TRL's own forward divides them."""

    tree_recompute: str = field(
        default="auto",
        metadata={
            "help": "Activation recompute of tree policy forwards, with gradient_checkpointing on. 'all': every "
            "checkpointed layer recomputes (TRL's behaviour). 'auto': recompute only as many layers (evenly spaced) "
            "as keep the forests' estimated activations within what TRL's own trainer holds for the same sequences "
            "with every layer checkpointed: a tree shares its prefixes, so most layers need no recompute. Where the "
            "shared-prefix kernels serve a forest, the layers that do recompute keep their attention output "
            "(selective checkpointing; needs use_reentrant=False, TRL's default) and recompute only the rest, "
            "within the same memory bound. Layers whose activations the estimate does not bound (experts, latent "
            "attention, recurrent mixers, four norms) recompute every layer under 'auto' too.",
            "choices": ["auto", "all"],
        },
    )
    tree_activation_budget_gib: float | None = field(
        default=None,
        metadata={
            "help": "With tree_recompute='auto': GiB per device the layer activations of one tree policy forward "
            "may take (the same estimate, an upper bound), where that is more than TRL's trainer would hold. None "
            "(default) = TRL's, every layer checkpointed. A larger budget trades memory for speed: fewer layers "
            "recompute (logged as tree_checkpointed_layers); one that fits every layer recomputes none."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if self.tree_recompute not in ("auto", "all"):
            raise ValueError(f"tree_recompute={self.tree_recompute!r} must be 'auto' or 'all'.")
        budget = self.tree_activation_budget_gib
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int | float) or not budget > 0):
            raise ValueError(
                f"tree_activation_budget_gib={budget!r} must be a number of GiB > 0 (e.g. 40), or None for the "
                "activations of TRL's trainer with every layer checkpointed."
            )
        if budget is not None and self.tree_recompute != "auto":
            raise ValueError(
                f"tree_activation_budget_gib={budget} bounds tree_recompute='auto', but tree_recompute="
                f"{self.tree_recompute!r} recomputes every layer: set tree_recompute='auto' or leave the budget None."
            )
        if getattr(self, "tree_packing", True) and not 0 < self.temperature < float("inf"):  # async: always trees
            raise ValueError(
                f"temperature={self.temperature}: the tree log-probabilities divide the logits by the sampling "
                "temperature (as TRL does), so it must be a finite number > 0, e.g. temperature=1.0."
            )


def _plans(args, model: torch.nn.Module) -> bool:
    """Whether a policy forward of `model` gets a recompute plan: `tree_recompute="auto"` with gradient
    checkpointing, in training mode under grad (else the model's checkpointing is left as it is)."""
    return args.tree_recompute == "auto" and args.gradient_checkpointing and model.training and torch.is_grad_enabled()


def unpriced_layers(model: torch.nn.Module) -> str:
    """Why `tree_recompute="auto"` cannot bound `model`'s checkpointed layers' activations ("" when it can)."""
    config = model.config.get_text_config()
    layers = {type(m): m for m in _checkpointed_layers(model)}.values()
    reasons = [r for r in (unpriced_reason(config, m) for m in layers or [None]) if r is not None]
    if reasons:
        _log_once(
            logging.INFO,
            f"tree_recompute='auto' cannot bound this model's activations ({reasons[0]}): every checkpointed "
            "layer recomputes, as with tree_recompute='all' (logged as tree_checkpointed_layers=1).",
        )
    return reasons[0] if reasons else ""


def plan_recompute(
    args,
    model: torch.nn.Module,
    device_type: str,
    forests: Sequence[PackedForest],
    bound_tokens: int,
    *,
    unpriced: str,
    keep_within_bound: bool = False,
) -> tuple[int | None, bool, dict[str, float]]:
    """`(count, keep_attention, metrics)`: how many checkpointed decoder layers the policy forward of `forests`
    recomputes, whether those keep the shared-prefix kernels' outputs, and what to log of it.

    `args` holds `tree_recompute`, `tree_activation_budget_gib` and `gradient_checkpointing`; `model` is the
    unwrapped policy, `unpriced` its `unpriced_layers`.
    `tree_recompute="auto"`: as few layers as keep the forests' estimated activations within those of `bound_tokens`
    tokens with every layer checkpointed, or within `tree_activation_budget_gib` where that is more, and attention
    kept where the kernels serve a forest and the model's checkpoint allows it (`hf_tree_attn.recompute`) — with
    `keep_within_bound`, only where the kept outputs fit in the bound too. `(None, False, {})` = leave the model's
    checkpointing as it is ("all", or a forward without gradients). `metrics`: `tree_checkpointed_layers` (the
    fraction of layers that recompute) and `tree_kept_attention`.
    """
    if not _plans(args, model):
        return None, False, {}
    if unpriced:
        return None, False, {"tree_checkpointed_layers": 1.0}
    config = model.config.get_text_config()
    served = (serves(forest, device_type) or path_serves(forest, device_type) for forest in forests)
    keep = any(served) and keeps_attention(model)
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
    metrics = {"tree_checkpointed_layers": count / config.num_hidden_layers, "tree_kept_attention": float(keep)}
    return count, keep, metrics


def recompute_plan(
    trainer, forests: Sequence[PackedForest], bound_tokens: int, keep_within_bound: bool = False
) -> tuple[int | None, bool]:
    """`plan_recompute` for `trainer`'s policy forward: `(count, keep_attention)`, its metrics recorded in TRL's
    table (`trl_compat.metrics`). `trainer` gives `args`, `model`, `accelerator` and keeps the model's pricing in
    `_unpriced` (None until the layers were priced once: they do not change within a run)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    if trainer._unpriced is None and _plans(trainer.args, model):
        trainer._unpriced = unpriced_layers(model)
    count, keep, metrics = plan_recompute(
        trainer.args, model, trainer.accelerator.device.type, forests, bound_tokens,
        unpriced=trainer._unpriced or "", keep_within_bound=keep_within_bound,
    )  # fmt: skip
    logged = trl_compat.metrics(trainer)["train"]
    for name, value in metrics.items():
        logged[name].append(value)
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
    prefix_reuse_chunks: Sequence[ReuseChunks | None] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor | None], torch.Tensor | None]:
    """One forward per forest (or, with `prefix_reuse_chunks`, chunks of it): `(tables, entropy_tables, aux_loss)`.

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
        prefix_reuse_chunks: for each forest, the chunks it runs in, each shared prefix forwarded once
            (`hf_tree_attn.prefix_reuse.chunked_forest_logprobs`; every row with a parent is scored, `rows` aside),
            or None for one forward (`core.prefix_reuse_chunks` decides). No MoE aux loss with chunks.

    Returns:
        `tables[i]` `(S_i,)` float32 log-probs indexed by row of `forests[i]` (0 at unscored rows), differentiable;
        `entropy_tables[i]` likewise or None; `aux_loss` a scalar or None.
    """
    tables, entropy_tables, router_logits = [], [], []
    count, keep_attention = recompute
    chunks = list(prefix_reuse_chunks) if prefix_reuse_chunks is not None else [None] * len(forests)
    if compute_aux_loss and any(c is not None for c in chunks):
        raise NotImplementedError(
            "Prefix reuse returns no router logits, so no MoE load-balancing loss: use prefix_reuse_chunks=None."
        )
    with recompute_only(model, count, keep_attention=keep_attention):
        for forest, scored, reuse in zip(forests, rows, chunks, strict=True):
            if reuse is not None:
                with autocast():
                    table, entropy_table = chunked_forest_logprobs(
                        model, forest, reuse.rows, temperature=temperature, return_entropy=compute_entropy,
                        fp32_head=fp32_head, keep_graphs=reuse.keep_graphs,
                    )  # fmt: skip
                tables.append(table)
                entropy_tables.append(entropy_table)
                continue
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
