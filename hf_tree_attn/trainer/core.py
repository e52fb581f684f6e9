"""What every tree trainer adds to the TRL trainer it subclasses: trees or TRL's own path, decided once.

A tree trainer is TRL's trainer with some forwards run on packed prefix trees. Whatever those forwards are, the
trainer decides the same way whether it may run them, and this module is that decision:

- the options every tree config adds (`CompileOptions`, `TreeOptions`: `tree_packing`, `max_tokens_per_mb`,
  `tree_prefix_reuse`, `tree_max_token_ratio`, `tree_compile`), each normalised and checked with an error naming the
  value and the fix; what prefix reuse refuses of a run (`prefix_reuse_refusal`), the rows of its chunks
  (`prefix_reuse_chunks`, sized by `tree_prefix_reuse_budget_gib` where set) and, under DDP, its gradients averaged
  over the ranks once per optimizer step instead of by DDP's reducer (`prefix_reuse_gradient_sync`);
- the model's attention: a model path is loaded on `tree_flex` (through `model_init_kwargs`), a model given on
  `sdpa` / `eager` is switched to it (`select_tree_attention`), and a model that falls back to TRL's path goes back
  to the stock implementation `tree_flex` stood in for (`restore_stock_attention`, `stock_attention`);
- the decision itself (`TreeTrainerMixin`): the gate (`hf_tree_attn.support`) on the loaded policy and reference
  model plus the trainer's own refusals; under `tree_packing="auto"` a refusal trains on TRL's path with one warning
  naming the reason, under `tree_packing=True` it is an error; `self.tree_packing` and `self.tree_reason` hold it;
- the model card: TRL's, with a *Tree training* section listing the trainer's tree settings.

A new tree trainer subclasses `(TreeTrainerMixin, <TRL trainer>)` with a config `(TreeOptions, <TRL config>)`,
calls `_tree_before_init` before TRL's `__init__` and `_tree_decide` after it, and adds only its forwards: the
fused-head trainers (`head_trainer.py`) install the tree LM head, the group trainers (`group_trainer.py`) override
TRL's log-probability hook.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from dataclasses import dataclass, field, fields
from typing import NamedTuple

import torch
import torch.distributed as dist
from accelerate.utils import DDPCommunicationHookType, DistributedType
from transformers import AutoConfig

from .. import prefix_reuse
from ..attention import ATTN_IMPLEMENTATION
from ..reuse_planner import budget_error, plan_prefix_reuse
from ..support import (
    check_tree_model,
    config_support_error,
    fsdp2_sharded,
    release_hub_kernels,
    tree_support_error,
    unwrap_model,
)
from . import trl_compat
from .compile_setting import compile_tree_layers

__all__ = [
    "CompileOptions",
    "TreeOptions",
    "TreeTrainerMixin",
    "average_gradients",
    "block_budget",
    "check_prefix_reuse_fields",
    "prefix_reuse_gradient_sync",
    "prefix_reuse_refusal",
    "ReuseChunks",
    "prefix_reuse_chunks",
    "restore_stock_attention",
    "select_tree_attention",
    "stock_attention",
    "tree_args",
]

logger = logging.getLogger(__name__)

# FlexAttention's block: a packed row is padded to a multiple of it, so a token budget must be one.
BLOCK = 128
_CHOICES = {"auto": "auto", "true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
# Attention implementations whose non-tree behaviour `tree_flex` reproduces, so switching them is invisible.
_SWITCHABLE_ATTN = (None, "sdpa", "eager")


def block_budget(tokens: int) -> int:
    """The smallest token budget that holds `tokens` tokens: a positive multiple of FlexAttention's block."""
    return max(BLOCK, -(-tokens // BLOCK) * BLOCK)


def _choice(config, name: str, fix: str) -> None:
    """Normalise the "auto" / true / false field `name` of `config` (a str, as the command line gives it)."""
    choice = str(getattr(config, name)).strip().lower()
    if choice not in _CHOICES:
        raise ValueError(f"{name}={getattr(config, name)!r}; use {fix}")
    setattr(config, name, _CHOICES[choice])


# ------------------------------------------------------------------ the options


@dataclass
class CompileOptions:
    """`tree_compile`, which every tree config has (`compile_setting.py`). Placed before TRL's config in the bases,
    so TRL's fields keep their positions and its checks run first."""

    # A str field (not `bool | str`, which HfArgumentParser reads as a bool), normalised in __post_init__.
    tree_compile: str = field(
        default="auto",
        metadata={
            "help": "Compile the decoder layers the trees run (regional torch.compile in place: inductor, dynamic "
            "shapes, one graph for every forest length). 'auto': on CUDA, for models whose layers are attention and "
            "a dense MLP, unless accelerate's dynamo settings or torch_compile ask for a compile (then that one "
            "applies, to the decoder layers). 'true': on any device and model. 'false': only what accelerate or "
            "torch_compile ask for. A compile that fails falls back to eager with one warning naming why. Under "
            "FSDP / DeepSpeed accelerate's own settings decide.",
        },
    )

    def __post_init__(self):
        super().__post_init__()
        _choice(
            self,
            "tree_compile",
            "'auto' (compiled decoder layers on CUDA, the default), 'true' (on any device) or 'false' (only a "
            "compile accelerate or torch_compile asks for).",
        )


@dataclass
class TreeOptions(CompileOptions):
    """The fields of every tree config whose trainer can also run TRL's own path: whether to pack, how much one
    forward may hold, and when a batch shares too little to be worth a tree."""

    # A str field (not `bool | str`, which HfArgumentParser reads as a bool), normalised in __post_init__ to
    # "auto" / True / False, so `--tree_packing auto|true|false` works through TrlParser.
    tree_packing: str = field(
        default="auto",
        metadata={
            "help": "Run the trainer's log-probability forwards on packed prefix trees (one forward per forest; "
            "tokens the batch's sequences share, such as a group's prompt, are computed once). 'auto': trees when "
            "the model can run them exactly (hf_tree_attn.support), else TRL's path with one warning naming the "
            "reason. 'true': trees, and an error at init if the model cannot run them. 'false': exactly TRL's "
            "trainer."
        },
    )
    max_tokens_per_mb: int | None = field(
        default=None,
        metadata={
            "help": "Token budget of one packed forward (a multiple of 128, at least the longest sequence): a batch "
            "whose forest is larger runs as several forests. None = one forest per batch (per TRL chunk)."
        },
    )
    tree_prefix_reuse: bool = field(
        default=False,
        metadata={
            "help": "Where a batch's forest is larger than max_tokens_per_mb, score it as one forest in chunks of "
            "max_tokens_per_mb rows (hf_tree_attn.prefix_reuse) instead of several forests that each repeat the prefix"
            " they need: every shared prefix is forwarded once, and a sequence longer than max_tokens_per_mb trains. "
            "Costs one recompute per chunk in the backward (as activation checkpointing does) and holds the keys / "
            "values of the prefixes later chunks read, so it is faster only where the micro-batches repeat much (on an"
            " H200: 1.19x where they forwarded 1.74x the unique tokens, 0.86x where 1.29x; keeping graphs under "
            "tree_prefix_reuse_budget_gib saves the recompute). Exact; on several processes under DDP the ranks' "
            "gradients are averaged once per optimizer step (DDP's reducer kept out of the step); under FSDP2 every "
            "rank runs as many chunks. Refused at init for state-carrying layers whose state it does not carry between"
            " chunks, an MoE load-balancing loss, DeepSpeed, FSDP1, FSDP2 over accelerate's parallelism_config, "
            "several processes other than DDP or FSDP2 and reentrant gradient checkpointing. Needs max_tokens_per_mb."
        },
    )
    tree_prefix_reuse_budget_gib: float | None = field(
        default=None,
        metadata={
            "help": "With tree_prefix_reuse=True: GiB per device the chunked forest's estimated peak may take (one "
            "chunk's layer activations, priced as tree_recompute prices them, plus the kept keys / values and their "
            "float32 gradients; hf_tree_attn.reuse_planner). Each forest then runs in the largest chunks of at most "
            "max_tokens_per_mb rows (a multiple of 128) that fit, possibly smaller ones; an error names the numbers "
            "where none fits. What the budget leaves beside that keeps the forward graphs of as many of the last "
            "chunks as fit, each saving its recompute in the backward. Logged as tree_prefix_reuse_chunks, "
            "tree_prefix_reuse_kept_graphs, tree_prefix_reuse_kept_gib and tree_prefix_reuse_peak_gib. None "
            "(default) = chunks of max_tokens_per_mb rows, not priced, the last chunk's graph kept."
        },
    )
    tree_max_token_ratio: float = field(
        default=0.9,
        metadata={
            "help": "A batch whose forests would hold more than this fraction of the tokens TRL's forward computes "
            "(rows x padded width, or the padding-free packed row) runs TRL's own forward: where almost nothing is "
            "shared, a plain forward costs less than a tree. Logged per batch as tree_fallback (and "
            "tree_compute_ratio). 1.0 = always the tree."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        _choice(
            self,
            "tree_packing",
            "'auto' (trees when the model supports them, the default), 'true' (trees or an error) or 'false' "
            "(exactly TRL's trainer).",
        )
        ratio = self.tree_max_token_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0.0 < ratio <= 1.0:
            raise ValueError(f"tree_max_token_ratio={ratio!r} must be in (0, 1]; use 1.0 to always pack trees.")
        budget = self.max_tokens_per_mb
        check_prefix_reuse_fields(self.tree_prefix_reuse, self.tree_prefix_reuse_budget_gib, "max_tokens_per_mb")
        if self.tree_prefix_reuse and budget is None:
            raise ValueError(
                "tree_prefix_reuse=True scores a forest in chunks of max_tokens_per_mb rows, but max_tokens_per_mb="
                "None (one forest, one forward): set max_tokens_per_mb (e.g. 8192), or leave tree_prefix_reuse=False."
            )
        if budget is None:
            return
        if isinstance(budget, bool) or not isinstance(budget, int):
            raise TypeError(
                f"max_tokens_per_mb={budget!r} is a {type(budget).__name__}; pass an int multiple of {BLOCK} (e.g. "
                "8192) or None."
            )
        if budget <= 0 or budget % BLOCK:
            raise ValueError(
                f"max_tokens_per_mb={budget} must be a positive multiple of {BLOCK} (FlexAttention's block size); use "
                f"e.g. max_tokens_per_mb={block_budget(budget)}, or None for one forest per batch."
            )
        max_length = getattr(self, "max_length", None)  # SFT's and DPO's longest sequence
        if max_length is not None and max_length > budget and not self.tree_prefix_reuse:
            raise ValueError(
                f"max_tokens_per_mb={budget} cannot hold one sequence of max_length={max_length} tokens; use "
                f"max_tokens_per_mb={block_budget(max_length)} (or more), None, or tree_prefix_reuse=True (a "
                "sequence scored in chunks of the budget)."
            )


def tree_args(trainer: str, model, args, config_cls):
    """`args`, checked to be a `config_cls`, or (None) `config_cls`'s defaults with TRL's output directory for
    `model` (`<model name>-<config name without "Config">`); `trainer` is the class name the error gives."""
    if args is None:
        name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
        return config_cls(f"{name.split('/')[-1]}-{config_cls.__name__.removesuffix('Config')}")
    if not isinstance(args, config_cls):
        added = [f.name for f in fields(config_cls) if f.name.startswith("tree_") or f.name == "max_tokens_per_mb"]
        raise TypeError(
            f"args is a {type(args).__name__}; {trainer} needs a {config_cls.__name__} (the fields of TRL's config "
            f"plus {', '.join(added)}): `{config_cls.__name__}(**your_kwargs)`."
        )
    return args


# ------------------------------------------------------------------ the model's attention


def select_tree_attention(model, args):
    """`(model, None)` with `model` set to `tree_flex` (so is TRL's reference model, built with the policy's
    implementation), or `(model, reason)` untouched when it cannot run trees exactly: checked before loading for a
    model path (its config; `args.model_init_kwargs` then asks for `tree_flex`), on the whole model for an
    instance (one on `sdpa` / `eager` is switched)."""
    if isinstance(model, str):
        model_init_kwargs = dict(args.model_init_kwargs or {})
        impl = model_init_kwargs.get("attn_implementation")
        if impl not in (None, ATTN_IMPLEMENTATION):
            return model, (
                f"model_init_kwargs['attn_implementation']={impl!r}, but tree packing needs {ATTN_IMPLEMENTATION!r} "
                "(it runs ordinary forwards and generate like SDPA). Drop --attn_implementation / the "
                "model_init_kwargs entry to get it automatically, or set tree_packing=False."
            )
        config = AutoConfig.from_pretrained(
            model,
            revision=model_init_kwargs.get("revision"),
            # As TRL loads it: `trust_remote_code` from model_init_kwargs, else the config's own field.
            trust_remote_code=model_init_kwargs.get("trust_remote_code", getattr(args, "trust_remote_code", False)),
        )
        reason = config_support_error(config)
        if reason is not None:
            return model, reason
        model_init_kwargs["attn_implementation"] = ATTN_IMPLEMENTATION
        args.model_init_kwargs = model_init_kwargs
        return model, None
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in _SWITCHABLE_ATTN + (ATTN_IMPLEMENTATION,):
        return model, (
            f"The model uses attn_implementation={impl!r}, but tree packing needs {ATTN_IMPLEMENTATION!r}. Load it "
            f"with attn_implementation={ATTN_IMPLEMENTATION!r} (after `import hf_tree_attn`), or set "
            "tree_packing=False."
        )
    reason = tree_support_error(model)
    if release_hub_kernels(model, reason):
        reason = tree_support_error(model)
    if reason is not None:
        return model, reason
    if impl != ATTN_IMPLEMENTATION:
        logger.info(
            "Switching the model from attn_implementation=%r to %r for tree packing.", impl, ATTN_IMPLEMENTATION
        )
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model, None


def loaded_model_error(*models) -> str | None:
    """Why a loaded model (the policy first; None entries skipped) cannot run trees (`check_tree_model`'s message),
    or None."""
    for loaded in models:
        if loaded is None:
            continue
        try:
            check_tree_model(loaded)
        except (ValueError, NotImplementedError) as error:
            return str(error)
    # The attention modules copy the config's rate at init; TRL's disable_dropout zeroes nn.Dropout modules only.
    rates = {
        float(m.attention_dropout)
        for m in unwrap_model(models[0]).modules()
        if isinstance(getattr(m, "attention_dropout", None), (int, float)) and m.attention_dropout > 0
    }
    if rates:
        return (
            f"The model's attention layers have attention_dropout={max(rates)}: tree attention has no dropout (one "
            "mask per shared token would not be the flat forward's distribution anyway). Load the model with "
            "attention_dropout=0.0 (a from_pretrained / model_init_kwargs argument) to train on trees, or train "
            "with tree_packing=False."
        )
    return None


def _stock_implementation(model) -> str:
    """The stock implementation `tree_flex` computes as outside a tree: `eager` where SDPA would drop the attention
    logit softcap (Gemma 2) or is not supported, else `sdpa`."""
    softcap = getattr(model.config.get_text_config(), "attn_logit_softcapping", None) is not None
    return "eager" if softcap or not getattr(model, "_supports_sdpa", False) else "sdpa"


@contextlib.contextmanager
def stock_attention(model):
    """Run `model` with the stock attention `tree_flex` behaves as outside a tree, then restore `tree_flex`."""
    model.set_attn_implementation(_stock_implementation(model))
    try:
        yield model
    finally:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)


def restore_stock_attention(models, reason: str) -> None:
    """Back to the stock implementation `tree_flex` stood in for, on every model loaded on it (loaded by path, or
    given already on tree_flex), before TRL's own path runs them: a model whose attention bypasses the interface
    refuses ordinary forwards on `tree_flex`."""
    for loaded in models:
        inner = unwrap_model(loaded) if loaded is not None else None
        if inner is None or inner.config._attn_implementation != ATTN_IMPLEMENTATION:
            continue
        loaded.set_attn_implementation(_stock_implementation(inner))
        if inner.config._attn_implementation == ATTN_IMPLEMENTATION:  # transformers refused the switch
            raise ValueError(
                f"tree_packing='auto': {reason} The model was given on attn_implementation={ATTN_IMPLEMENTATION!r}, "
                f"and {type(inner).__name__} cannot switch implementation after loading, so TRL's path cannot run it "
                "either. Load it with attn_implementation='eager' (or 'sdpa')."
            )


def check_prefix_reuse_fields(reuse, budget_gib, rows: str) -> None:
    """Raise for a `tree_prefix_reuse` that is not a bool, or a `tree_prefix_reuse_budget_gib` that is not None or a
    number of GiB > 0, or is set without prefix reuse; `rows` names the field whose rows size the chunks."""
    if not isinstance(reuse, bool):
        raise TypeError(f"tree_prefix_reuse={reuse!r} must be True or False.")
    if budget_gib is None:
        return
    if isinstance(budget_gib, bool) or not isinstance(budget_gib, int | float) or not budget_gib > 0:
        raise ValueError(
            f"tree_prefix_reuse_budget_gib={budget_gib!r} must be a number of GiB > 0 (e.g. 40), or None for chunks "
            f"of {rows} rows."
        )
    if not reuse:
        raise ValueError(
            f"tree_prefix_reuse_budget_gib={budget_gib} sizes prefix reuse's chunks, but tree_prefix_reuse=False: set "
            f"tree_prefix_reuse=True (with {rows}), or leave the budget None."
        )


def prefix_reuse_refusal(trainer, models) -> str | None:
    """Why `trainer` (on trees, `tree_prefix_reuse=True`) cannot score its forests with prefix reuse exactly, or
    None. `models`: the loaded models its chunked forwards run (the policy first; None entries skipped).

    Prefix reuse runs each chunk's backward from inside the loss's backward (`hf_tree_attn.prefix_reuse`): one
    `torch.autograd.backward` per chunk, each accumulating every parameter's gradient. What that cannot honour is
    refused: DeepSpeed and FSDP1, whose gradient hooks and parameter gathering expect one gradient per parameter per
    backward and every rank to run the same forwards (ranks' forests cut into different numbers of chunks). FSDP2
    reduces each backward's gradients itself, and the ranks run as many chunks (dummies on the ranks with fewer,
    `hf_tree_attn.prefix_reuse`), as many forests, and the flat path or the tree together (`group_trainer`, the
    fused head's `_every_rank_plans`): accepted, for TRL's fused head too, whose chunks run inside the model's own
    forward, each chunk's backward an FSDP2 pass of its own (`hf_tree_attn.fsdp2_compat`). Several processes other
    than that or plain DDP on CPU or CUDA (`MULTI_CPU` / `MULTI_GPU`; under DDP the trainers keep
    DDP's reducer out of the step and average the gradients themselves, `prefix_reuse_gradient_sync`), and under DDP
    its static graph and communication hooks, which that average would not reproduce; reentrant activation
    checkpointing keeps no graph for a chunk's backward; a model without exact chunks (`prefix_reuse_error`); the
    MoE load-balancing loss, whose router statistics the chunked forward does not return; on CUDA, a
    `HF_TREE_ATTN_PREFIX_REUSE_CUDA` that names no path (`prefix_reuse.cuda_path_error`); a
    `HF_TREE_ATTN_PREFIX_REUSE_LAYERS` that names no layers (`prefix_reuse.layers_error`).
    """
    args = trainer.args
    for loaded in models:
        if loaded is not None and (error := prefix_reuse.prefix_reuse_error(loaded)) is not None:
            return error
    if trainer.is_deepspeed_enabled:
        return (
            "DeepSpeed wraps the model: its gradient buckets and parameter gathering expect one gradient per "
            "parameter per backward, where prefix reuse runs one backward per chunk. Run it under FSDP2 "
            "(fsdp_version: 2 in the accelerate config) or DDP."
        )
    if trainer.is_fsdp_enabled and (reason := _fsdp_refusal(trainer)) is not None:
        return reason
    several = trainer.accelerator.num_processes > 1
    if several and not trainer.is_fsdp_enabled and (reason := _ddp_refusal(trainer)) is not None:
        return reason
    if args.gradient_checkpointing and (args.gradient_checkpointing_kwargs or {}).get("use_reentrant"):
        return (
            "gradient_checkpointing_kwargs={'use_reentrant': True}: reentrant checkpointing keeps no graph for a "
            "chunk's backward to start from. Use {'use_reentrant': False} (TRL's default)."
        )
    config = unwrap_model(models[0]).config.get_text_config()
    if getattr(config, "output_router_logits", False):
        return (
            f"the MoE load-balancing loss is on (output_router_logits=True, router_aux_loss_coef="
            f"{getattr(config, 'router_aux_loss_coef', None)}): the chunked forward returns no router logits. Load "
            "the model with output_router_logits=False to train without it."
        )
    if trainer.accelerator.device.type == "cuda" and (error := prefix_reuse.cuda_path_error()) is not None:
        return error
    return prefix_reuse.layers_error()


def _fsdp_refusal(trainer) -> str | None:
    """Why a run under accelerate's FSDP cannot run prefix reuse exactly, or None: FSDP1; FSDP2 over a device mesh of
    accelerate's `parallelism_config`."""
    if not trainer.accelerator.is_fsdp2:
        return (
            "FSDP1 wraps the model (flat parameters whose gradient hooks expect one gradient per backward, where "
            "prefix reuse runs one per chunk). Use FSDP2: fsdp_version: 2 in the accelerate config (or "
            "fsdp_config={'fsdp_version': 2})."
        )
    if getattr(trainer.accelerator, "parallelism_config", None) is not None:
        return (
            "it runs FSDP2 over accelerate's parallelism_config (a device mesh for tensor, context or hybrid sharded "
            "parallelism): prefix reuse is verified under FSDP2 sharding over all ranks only."
        )
    return None


def _ddp_refusal(trainer) -> str | None:
    """Why a run on several processes is not the plain DDP whose gradients `prefix_reuse_gradient_sync` averages
    exactly, or None."""
    accelerator = trainer.accelerator
    processes = f"it runs on {accelerator.num_processes} processes"
    kind = accelerator.distributed_type
    if kind not in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        return (
            f"{processes} as {getattr(kind, 'value', kind)}: on several processes prefix reuse averages the ranks' "
            "gradients itself, verified under DDP on CPU or CUDA only (MULTI_CPU / MULTI_GPU)."
        )
    if getattr(accelerator, "parallelism_config", None) is not None or getattr(
        trainer, "is_distributed_loading_by_transformers", False
    ):
        return (
            f"{processes} with tensor, context or sharded data parallelism (accelerate's parallelism_config, or a "
            "model sharded at load time): prefix reuse averages the gradients of plain DDP only."
        )
    handler = getattr(accelerator, "ddp_handler", None)
    if handler is not None and handler.static_graph:
        return (
            "ddp_static_graph=True: DDP's static-graph mode reduces gradients from its own first backward, and prefix "
            "reuse keeps DDP out of the backward (ranks run different numbers of chunks) to average the gradients "
            "itself. Leave ddp_static_graph unset."
        )
    hooks = [h for h in (getattr(handler, "comm_hook", None), getattr(handler, "comm_wrapper", None)) if h]
    hooks = [str(h.value if isinstance(h, DDPCommunicationHookType) else h) for h in hooks]
    hooks = [h for h in hooks if h != DDPCommunicationHookType.NO.value]
    if hooks:
        return (
            f"a DDP communication hook is set ({', '.join(hooks)}): prefix reuse averages the gradients itself, in "
            "their own dtype, which the hook's compression would change. Drop the hook."
        )
    return None


def _ddp_of(model) -> torch.nn.parallel.DistributedDataParallel | None:
    """The `DistributedDataParallel` wrapper the training loop runs `model` as (itself, or under `torch.compile`), or
    None."""
    for candidate in (model, getattr(model, "_orig_mod", None)):
        if isinstance(candidate, torch.nn.parallel.DistributedDataParallel):
            return candidate
    return None


@contextlib.contextmanager
def prefix_reuse_gradient_sync(trainer, model, enabled: bool):
    """Around one micro-batch's forward and backward (transformers' `training_step`) of a run with prefix reuse:
    under DDP the step runs without DDP's reducer, and the ranks' gradients are averaged here once per optimizer step.

    A prefix-reuse backward runs one `torch.autograd.backward` per chunk, each accumulating every parameter's `.grad`,
    and ranks cut their forests into different numbers of chunks (so run different numbers of forwards), while DDP's
    reducer takes one gradient per parameter per backward, and DDP pairs its all-reduces and buffer broadcasts across
    ranks by call order. So where `model` is a `DistributedDataParallel` (and `enabled`: prefix reuse on trees) the
    step runs under the wrapper's `no_sync()` with its per-forward buffer broadcast off: no DDP collective runs in
    it, and each rank's gradients accumulate in `.grad` as in one process. After the micro-batch that ends an
    optimizer step (`accelerator.sync_gradients`, which transformers' loop sets before each micro-batch) the ranks
    average them (`average_gradients`) and take rank 0's buffers, as DDP's next forward would. That is DDP's result
    (the mean over ranks of each rank's gradient summed over the step's micro-batches; transformers' `no_sync` on the
    others changes nothing here), before clipping and the optimizer step. Without DDP, or not `enabled`, nothing.
    """
    ddp = _ddp_of(model) if enabled else None
    if ddp is None:
        yield
        return
    with ddp.no_sync():
        # DDP broadcasts rank 0's buffers in the first forward after a synced one, which ranks reach after different
        # numbers of forwards here: off, and done below with the gradients.
        ddp.require_forward_param_sync = False
        yield
    if trainer.accelerator.sync_gradients:
        average_gradients(ddp)
        _broadcast_buffers(ddp)


def average_gradients(ddp: torch.nn.parallel.DistributedDataParallel) -> None:
    """Average the gradients of `ddp`'s parameters over its process group, as its reducer does: each trainable
    parameter DDP reduces, in order, its `.grad` divided by the world size and summed over the ranks, flattened in
    buckets of DDP's size. A rank without a gradient for a parameter adds zeros; a parameter no rank has one for keeps
    `.grad = None` (as DDP leaves an unused one). Every rank runs the same collectives in the same order: one for
    which parameters have a gradient on some rank, then one per bucket."""
    group = ddp.process_group
    world = dist.get_world_size(group)
    params = [p for n, p in ddp.module.named_parameters() if p.requires_grad and n not in ddp.parameters_to_ignore]
    if not params:
        return
    if any(p.grad is not None and p.grad.is_sparse for p in params):
        raise NotImplementedError(
            "A sparse gradient (an embedding with sparse=True) under prefix reuse on several processes: averaging it "
            "is not implemented. Use a dense embedding, or tree_prefix_reuse=False."
        )
    has_grad = torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)
    dist.all_reduce(has_grad, group=group)
    params = [p for p, count in zip(params, has_grad.tolist()) if count > 0]
    cap = getattr(ddp, "bucket_bytes_cap", 25 * 2**20)
    bucket, size = [], 0
    for p, following in zip(params, params[1:] + [None]):
        bucket.append(p)
        size += p.numel() * p.element_size()
        if following is None or size >= cap or (following.dtype, following.device) != (p.dtype, p.device):
            _average_bucket(bucket, world, group)
            bucket, size = [], 0


def _average_bucket(params: list[torch.Tensor], world: int, group) -> None:
    """All-reduce the mean of `params`' gradients (one dtype and device; zeros where `.grad` is None) into `.grad`."""
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    flat.div_(world)
    dist.all_reduce(flat, group=group)
    for p, grad in zip(params, flat.split([p.numel() for p in params])):
        if p.grad is None:
            p.grad = grad.view(p.shape).clone()
        else:
            p.grad.copy_(grad.view(p.shape))


def _broadcast_buffers(ddp: torch.nn.parallel.DistributedDataParallel) -> None:
    """Rank 0's buffers on every rank, where DDP broadcasts them before a forward (`broadcast_buffers`, named
    `forward_sync_buffers` in newer torch)."""
    if not getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", True)):
        return
    source = dist.get_global_rank(ddp.process_group, 0)
    for buffer in ddp.modules_buffers:
        dist.broadcast(buffer, src=source, group=ddp.process_group)


class ReuseChunks(NamedTuple):
    """How a forest runs with prefix reuse: chunks of `rows` rows, the last `keep_graphs` of them with their forward
    graphs kept for the backward (`hf_tree_attn.prefix_reuse.chunked_forest_logprobs`)."""

    rows: int
    keep_graphs: int = 1


def prefix_reuse_chunks(model, forest, max_tokens_per_mb: int, budget_gib: float | None, record) -> ReuseChunks | None:
    """The chunks `forest` runs in with prefix reuse, or None for one forward of the whole forest.

    Without a budget: chunks of `max_tokens_per_mb` rows where the forest is larger, the last one's graph kept. With
    `budget_gib` (`tree_prefix_reuse_budget_gib`): the largest chunks, a multiple of the block and at most
    `max_tokens_per_mb` rows, whose estimated peak fits (`hf_tree_attn.reuse_planner.plan_prefix_reuse`, the kept
    keys and values priced in the weights' dtype: an upper bound under autocast), and as many of the last chunks'
    graphs kept as the rest of the budget holds (each saves its recompute); one chunk is one forward. Under FSDP2 a
    forest of one chunk runs chunked too: ranks agree on their chunk counts there, and one forward would not pair
    with another rank's chunks. Under grad the estimate goes to `record(name, value)`: `tree_prefix_reuse_chunks`,
    `tree_prefix_reuse_kept_graphs`, `tree_prefix_reuse_kept_gib` (the kept keys and values) and
    `tree_prefix_reuse_peak_gib` (with the kept graphs).
    """
    one_chunk_too = fsdp2_sharded(model)  # every rank runs the chunked call and its dummies (prefix_reuse)
    if budget_gib is None:
        chunked = forest.seq_len > max_tokens_per_mb or one_chunk_too
        return ReuseChunks(max_tokens_per_mb) if chunked else None
    plan = plan_prefix_reuse(
        model, forest, max_chunk_rows=max_tokens_per_mb, memory_budget_bytes=int(budget_gib * 2**30), block=BLOCK
    )
    keep, graphs = plan.keep_graphs, plan.graphs
    if torch.is_grad_enabled():
        record("tree_prefix_reuse_chunks", float(plan.chunks.num_chunks))
        record("tree_prefix_reuse_kept_graphs", float(min(keep, plan.chunks.num_chunks)))
        record("tree_prefix_reuse_kept_gib", plan.kept_kv / 2**30)
        record("tree_prefix_reuse_peak_gib", (plan.total + graphs) / 2**30)
    chunked = plan.chunks.num_chunks > 1 or one_chunk_too
    return ReuseChunks(plan.chunk_rows, keep) if chunked else None


# ------------------------------------------------------------------ the decision


class TreeTrainerMixin:
    """The decision every tree trainer makes (see the module docstring); placed before TRL's trainer in the bases.

    A subclass calls `_tree_before_init(args, model, ref_model)` before TRL's `__init__`, `_tree_decide()` once
    after it, then installs its tree forwards and calls `_tree_compile_layers()`. It overrides `_tree_refusal` for
    what else keeps its run off trees and `_tree_card_rows` for its own settings, and sets `_TREE_FALLBACK` (what
    the warning says runs instead) and `_TREE_CARD_SCORED` (what the card says runs on trees).
    """

    _TREE_FALLBACK = "TRL's path instead"
    _TREE_CARD_SCORED = (
        "each batch's log-probabilities computed on packed prefix trees, so tokens its sequences share are computed "
        "once. The log-probabilities and gradients are those of TRL's forward"
    )

    def _tree_before_init(self, args, model, ref_model=None):
        """`(model, ref_model)` switched to `tree_flex` where they can run trees (a path: through
        `args.model_init_kwargs`); the first refusal is kept for `_tree_decide`."""
        self._tree_reason = None
        if args.tree_packing is not False:
            model, self._tree_reason = select_tree_attention(model, args)
        if ref_model is not None and args.tree_packing is not False and self._tree_reason is None:
            ref_model, self._tree_reason = select_tree_attention(ref_model, args)
        return model, ref_model

    def _tree_model_error(self, models) -> str | None:
        """Why the loaded models cannot run trees exactly (the gate of `hf_tree_attn.support`), or None; a trainer
        whose trees run another kind of model (a sequence classifier) overrides it with that model's gate."""
        return loaded_model_error(*models)

    def _tree_refusal(self) -> str | None:
        """Why this run cannot use trees beyond the model gate (overridden per trainer), or None."""
        return None

    def _tree_decide(self, stacklevel: int = 3) -> None:
        """Trees or TRL's path, after TRL's `__init__` loaded the models: `self.tree_packing` (and
        `self.tree_reason`, None on trees), logged at INFO. Under `tree_packing="auto"` a refusal puts the models back
        on their stock attention and warns once, naming the reason; under `tree_packing=True` it is an error."""
        args, reason = self.args, self._tree_reason
        models = (self.model, getattr(self, "ref_model", None))
        if args.tree_packing is not False and reason is None:
            reason = self._tree_model_error(models)
            while any([release_hub_kernels(m, reason) for m in models if m is not None]):  # policy, then reference
                reason = self._tree_model_error(models)
            reason = reason or self._tree_refusal()
        if reason is not None and args.tree_packing is True:
            raise ValueError(f"tree_packing=True, but this run cannot use packed trees exactly: {reason}")
        if reason is not None and args.tree_packing == "auto":
            restore_stock_attention(models, reason)
            warnings.warn(f"tree_packing='auto': {reason} Training on {self._TREE_FALLBACK}.", stacklevel=stacklevel)
        self.tree_packing = args.tree_packing is not False and reason is None
        self.tree_reason = reason
        path = "packed trees" if self.tree_packing else f"TRL's path: {reason or 'tree_packing=False'}"
        logger.info("%s trains on %s", type(self).__name__, path)

    def _tree_compile_layers(self) -> None:
        """Compile the decoder layers the trees run (`self.tree_compile`, None on TRL's path): the user's dynamo
        settings, or the CUDA default (`compile_setting.py`)."""
        models = (self.model, getattr(self, "ref_model", None))
        self.tree_compile = compile_tree_layers(self.args, self.accelerator, models, self.tree_packing)

    def _tree_card_rows(self) -> list[tuple[str, object]]:
        """The trainer's own settings for the card, after the options every tree trainer has."""
        return []

    def _tree_check_prefix_reuse(self, models) -> None:
        """Refuse `tree_prefix_reuse=True` on trees where it cannot be exact (`prefix_reuse_refusal`)."""
        if not (self.tree_packing and self.args.tree_prefix_reuse):
            return
        reason = prefix_reuse_refusal(self, models)
        if reason is None and self.args.tree_prefix_reuse_budget_gib is not None:
            reason = next((e for m in models if m is not None and (e := budget_error(m)) is not None), None)
            if reason is not None:
                raise ValueError(
                    f"tree_prefix_reuse_budget_gib={self.args.tree_prefix_reuse_budget_gib}, but {reason} (Set "
                    "tree_prefix_reuse_budget_gib=None.)"
                )
        if reason is not None:
            raise ValueError(
                f"tree_prefix_reuse=True, but {reason} Set tree_prefix_reuse=False (forests of at most "
                f"max_tokens_per_mb={self.args.max_tokens_per_mb} tokens, each repeating the prefix it needs)."
            )

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Transformers' step (TRL's where it overrides it); with prefix reuse under DDP, without DDP's reducer and
        the gradients averaged once per optimizer step (`prefix_reuse_gradient_sync`)."""
        with prefix_reuse_gradient_sync(self, model, self.tree_packing and self.args.tree_prefix_reuse):
            return super().training_step(model, inputs, num_items_in_batch)

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
            ("tree_prefix_reuse", args.tree_prefix_reuse),
            ("tree_prefix_reuse_budget_gib", args.tree_prefix_reuse_budget_gib),
            ("tree_max_token_ratio", args.tree_max_token_ratio),
            *self._tree_card_rows(),
            ("attn_implementation", ATTN_IMPLEMENTATION if self.tree_packing else "unchanged"),
        ]
        table = "\n".join(f"| `{name}` | `{value}` |" for name, value in rows)
        intro = (
            f"Trained with `hf_tree_attn.{type(self).__name__}` (hf_tree_attn {__version__}): TRL's "
            f"{trl_compat.trainer_name(self)}, with {self._TREE_CARD_SCORED}; only the cost changes."
        )
        return f"\n## Tree training\n\n{intro}\n\n| setting | value |\n| --- | --- |\n{table}\n"
