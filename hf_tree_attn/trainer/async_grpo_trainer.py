"""`TreeAsyncGRPOTrainer`: TRL's asynchronous GRPO trainer, its rows packed by `pack_forest`, attended by `tree_flex`.

TRL's `trl.experimental.async_grpo.AsyncGRPOTrainer` already folds each rank's rollout samples into a prefix trie
(`packing.TreeRow`) and runs it through FlashAttention-3's varlen kernel from the Hub (`tree_fa3`). That kernel
routes attention only, so the trainer refuses every layer that carries a state (Gated DeltaNet, Mamba-2, short
convolutions: Qwen3.5, Qwen3-Next, LFM2, Nemotron-H, Falcon-H1, Granite-4 hybrids) and attention sinks (GPT-OSS),
and needs a GPU and the Hub. This subclass keeps all of TRL's trainer — constructor, config, rollout-worker and
weight-transfer protocols, weight sync, the token-budget planner's placements, the loss, metrics — and swaps three
things:

- the model is loaded with `attn_implementation="tree_flex"` behind hf_tree_attn's gate (`support.py`): every family
  the gate accepts trains, hybrids through the segment scans, on CUDA (FlexAttention, the shared-prefix kernels) and
  on CPU; a refused model is an error naming the way out;
- each rank's row is packed by `pack_forest` (`rollout_forest.TreeDataCollatorForRollout`) and scored by the step
  `TreeGRPOTrainer` uses (`forest_step`): recompute limited to what memory needs, the MoE load-balancing loss
  weighted per sample as a flat forward weighs it (TRL's counts a shared token once);
- the planner's rows are priced by `rollout_planner.PlannerRow`: TRL's placements and packing metrics, from a radix
  trie instead of TRL's dict lookup per token, which on long agent samples held the GPU idle for a large part of each
  step.

With `tree_prefix_reuse=True` the rows of one optimizer step (its `gradient_accumulation_steps` micro-batches, as
transformers' loop fetches them together, `get_batch_samples`) are one forest (`rollout_forest.step_forest`), scored
by `forest_step.score_forests` in chunks of at most `token_budget` rows (`core.prefix_reuse_chunks`) at the step's
first micro-batch: a prefix the planner split across rows is forwarded once per step. Each micro-batch still runs
TRL's loss on its own terms (so its normalisation by the row's trained tokens and by the accumulation steps is
TRL's) and TRL's backward; those backwards stop at the step's log-probability table (`_ReuseStep`), and the last
micro-batch's carries their sum into one backward through the chunks. On several processes (DDP) the step runs
without DDP's reducer, and the ranks' gradients are averaged after its last micro-batch
(`core.prefix_reuse_gradient_sync`).

TRL's methods run whole; each swap replaces one name TRL's trainer module looks up, for the duration of one call
(`trl_compat.swapped_async_module_names`): its model loader, `add_fused_lm_head` and peak-FLOPs lookup inside the
constructor, its collator and planner classes inside `get_train_dataloader` (the planner's row class while it plans),
its FLOP formula inside `_log_step_metrics`.
`compute_loss` is TRL's, handed a stand-in for the model (`_ForestForward`) whose log-probabilities are the forest's.
`tests/test_trl_compat.py` and `tests/test_async_grpo.py` pin each name and the order TRL's constructor uses them in.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import torch
from transformers import AutoConfig
from trl.experimental.async_grpo import AsyncGRPOTrainer

from ..attention import ATTN_IMPLEMENTATION, registration_error
from ..chunked import plan_chunks
from ..reuse_planner import budget_error
from ..support import (
    config_support_error,
    peft_config_error,
    release_hub_kernels,
    rope_split_lengths,
    tree_support_error,
)
from ..tree import PackedForest
from . import trl_compat
from .async_grpo_config import TreeAsyncGRPOConfig
from .compile_setting import compile_tree_layers
from .core import prefix_reuse_chunks, prefix_reuse_gradient_sync, prefix_reuse_refusal, tree_args
from .forest_step import recompute_plan, score_forests
from .rollout_forest import StepForest, TreeDataCollatorForRollout, rank_forest, step_forest
from .rollout_planner import with_planner_rows

__all__ = ["TreeAsyncGRPOTrainer"]


def _refusal(model_id: str, reason: str, way_out: str | None = None) -> ValueError:
    # The gate's reasons end with the way out of TreeGRPOTrainer (tree_packing=False, its flat fallback); this
    # trainer has no flat path, so that sentence goes.
    reason = re.sub(r"\s*Train (this|it)\b[^.]*?tree_packing=False.*$", "", reason, flags=re.S).strip()
    way_out = way_out or (
        "Train this model with TRL's own AsyncGRPOTrainer (trl.experimental.async_grpo) where its FlashAttention-3 "
        "tree packing supports it, or synchronously with trl.GRPOTrainer (TreeGRPOTrainer's tree_packing='auto' "
        "falls back to it by itself)."
    )
    return ValueError(
        f"TreeAsyncGRPOTrainer cannot train {model_id!r} on exact trees: {reason} It always packs trees (it has no "
        f"flat path). {way_out}"
    )


class _TreeConstruction:
    """TRL's constructor with the policy loaded on `tree_flex` behind the gate, on any device.

    TRL's constructor loads the model (`create_model_from_path`, with `attn_implementation="tree_fa3"`), refuses
    `layer_types` other than full / sliding attention and `.sinks` parameters (its kernel's limits), then patches its
    fused LM head onto the model (`add_fused_lm_head`). Here the loader asks for `tree_flex` and runs the gate, and
    the two things TRL refuses but trees run exactly are out of its sight between the load and the LM head: the text
    config's layer kinds and the sink parameters' names. Both are back before anything else sees the model. TRL
    also reads the device's peak FLOPs with `torch.cuda.get_device_name`, which raises off CUDA: there the peak is
    unknown, which TRL's metrics already handle (no MFU logged).
    """

    def __enter__(self):
        self._load = trl_compat.async_module_name("create_model_from_path")
        self._add_fused_lm_head = trl_compat.async_module_name("add_fused_lm_head")
        self._peak_flops = trl_compat.async_module_name("get_peak_flops_per_device")
        self._restore: list[Callable[[], None]] = []
        self._names = trl_compat.swapped_async_module_names(
            create_model_from_path=self.load,
            add_fused_lm_head=self.add_fused_lm_head,
            get_peak_flops_per_device=self.peak_flops_per_device,
        )
        self._names.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            self._reveal()
        finally:  # TRL's module names come back even if a restore fails
            self._names.__exit__(*exc)
        return False

    def load(self, model_id: str, **kwargs):
        # Read with the loader's own options (a gated, private, offline or sub-folder checkpoint), before any weight.
        options = ("revision", "trust_remote_code", "token", "cache_dir", "subfolder", "local_files_only")
        config = AutoConfig.from_pretrained(model_id, **{key: kwargs[key] for key in options if key in kwargs})
        reason = registration_error() or config_support_error(config)  # before reading any weights
        if reason is None and rope_split_lengths(config):
            limit = " / ".join(str(n) for n in rope_split_lengths(config))
            reason = (
                f"its longrope RoPE rotates sequences of at most {limit} tokens and longer ones with different "
                "factors, and one packed row per rank cannot hold both exactly (TRL's own packing rotates them all "
                "with the row's longest)."
            )
        if reason is not None:
            raise _refusal(model_id, reason)
        model = self._load(model_id, **{**kwargs, "attn_implementation": ATTN_IMPLEMENTATION})
        reason = tree_support_error(model)
        if release_hub_kernels(model, reason):
            reason = tree_support_error(model)
        if reason is not None:
            raise _refusal(model_id, reason)
        self._hide_from_trl(model)
        return model

    def _hide_from_trl(self, model) -> None:
        text_config = model.config.get_text_config()
        kinds = set(getattr(text_config, "layer_types", None) or ())
        # Some configs store the layer kinds under another name (`attribute_map`, e.g. Nemotron-H's
        # `layers_block_type`); the instance attribute goes, the class default (None) answers TRL's check.
        field = getattr(text_config, "attribute_map", {}).get("layer_types", "layer_types")
        if kinds - trl_compat.ASYNC_ROUTED_LAYER_KINDS and field in vars(text_config):
            kept = vars(text_config).pop(field)
            self._restore.append(lambda: vars(text_config).__setitem__(field, kept))
        suffix = trl_compat.ASYNC_REFUSED_PARAMETER_SUFFIX
        if any(name.endswith(suffix) for name, _ in model.named_parameters()):
            named_parameters = model.named_parameters

            def without_sinks(*args, **kwargs):
                return ((n, p) for n, p in named_parameters(*args, **kwargs) if not n.endswith(suffix))

            model.named_parameters = without_sinks
            self._restore.append(lambda: delattr(model, "named_parameters"))

    def add_fused_lm_head(self, model, *args, **kwargs):
        self._reveal()
        return self._add_fused_lm_head(model, *args, **kwargs)

    def peak_flops_per_device(self, accelerator, dtype: str) -> float | None:
        return self._peak_flops(accelerator, dtype) if accelerator.device.type == "cuda" else None

    def _reveal(self) -> None:
        while self._restore:
            self._restore.pop()()


class _ForestForward:
    """What TRL's `compute_loss` calls as the model: one forward over this rank's forest.

    TRL's loss reads `outputs.log_probs.flatten()[token_index]`, `outputs.entropy` likewise and `outputs.aux_loss`;
    `token_index` here is the forest row of each scored token, so the per-row tables are the outputs. TRL's forward
    arguments (its packed row and FlashAttention metadata) are not needed.
    """

    def __init__(self, trainer: TreeAsyncGRPOTrainer, model: torch.nn.Module, forest: PackedForest, rows):
        self.trainer, self.model, self.forest, self.rows = trainer, model, forest, rows

    def __call__(self, **trl_forward_kwargs):
        trainer, forest = self.trainer, self.forest
        # The recompute bound is TRL's own async trainer on the same row: its unique tokens, every layer checkpointed
        # (so attention outputs are kept only within tree_activation_budget_gib).
        plan = recompute_plan(trainer, [forest], bound_tokens=forest.num_tree_tokens, keep_within_bound=True)
        (table,), (entropy,), aux_loss = score_forests(
            self.model, [forest], [torch.unique(self.rows)], temperature=trainer.temperature,
            autocast=trainer.accelerator.autocast, compute_entropy=True, compute_aux_loss=trainer.aux_loss_enabled,
            recompute=plan,
        )  # fmt: skip
        return trl_compat.async_model_outputs(log_probs=table, entropy=entropy, aux_loss=aux_loss)


class _ReuseStep:
    """One optimizer step scored as one forest with prefix reuse, handed out micro-batch by micro-batch.

    `batches` are the step's micro-batches as transformers' loop fetched them (`get_batch_samples`), `step` their
    `StepForest`. At micro-batch 0, `score` runs the step forest's forward (`forest_step.score_forests`, chunks of
    `chunk_rows` rows, or one forward where the forest fits): `table` `(S,)` float32, the log-probability of each row's
    token, differentiable; `entropy` `(S,)` likewise, detached (TRL reads entropies for its metrics only). Each
    micro-batch then runs TRL's loss on the rows of its terms, and TRL's backward of it:

    - micro-batches `0 .. K - 2` read `leaf` (the table, detached, requiring grad): their backwards only add their
      gradient with respect to the table into `leaf.grad`;
    - micro-batch `K - 1` reads the table itself through `_WithEarlierGradient`, which adds `leaf.grad` to its own
      gradient: its backward runs the chunks' backward once, with the gradient of the whole step's loss.

    Parameter gradients are those of TRL's `K` backwards (gradients are linear in the losses), the losses TRL's.
    """

    def __init__(self, batches: list[dict], step: StepForest):
        self.batches, self.step = batches, step
        self.taken = 0
        self.chunk_rows: int | None = None
        self.forwarded = 0
        self.table: torch.Tensor | None = None
        self.entropy: torch.Tensor | None = None
        self.leaf: torch.Tensor | None = None

    def take(self, inputs: dict[str, torch.Tensor]) -> int:
        """The index `k` of the micro-batch `inputs` is (transformers' loop hands them in order), checked."""
        k = self.taken
        if k >= len(self.batches) or not torch.equal(
            inputs["token_index"].cpu(), self.batches[k]["token_index"].cpu()
        ):
            raise RuntimeError(
                f"tree_prefix_reuse: compute_loss got a batch other than micro-batch {k} of the {len(self.batches)} "
                "that get_batch_samples fetched for this optimizer step."
            )
        self.taken += 1
        return k

    @property
    def last(self) -> bool:
        """Whether the micro-batch last taken is the step's last."""
        return self.taken == len(self.batches)

    def plan(self, trainer: TreeAsyncGRPOTrainer, model: torch.nn.Module) -> None:
        """The chunks of the step's forest (`core.prefix_reuse_chunks`: `token_budget` rows, or what
        `tree_prefix_reuse_budget_gib` allows; its estimate logged) and the rows its forward runs."""
        forest, args = self.step.forest, trainer.args
        logged = trl_compat.metrics(trainer)["train"]
        self.chunks = prefix_reuse_chunks(
            model, forest, args.token_budget, args.tree_prefix_reuse_budget_gib, lambda k, v: logged[k].append(v)
        )
        chunks = plan_chunks(forest, self.chunks.rows) if self.chunks is not None else None
        self.forwarded = chunks.forwarded_rows if chunks is not None else forest.num_tree_tokens

    def forward_counts(self, k: int, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """TRL's per-batch counts for micro-batch `k`, the step's forward counted once: micro-batch 0 forwarded the
        step's rows for all its samples; the others forwarded nothing (their `mean_seq_len` stays, so TRL's
        `samples = forwarded / mean_seq_len` adds 0)."""
        forwarded = inputs["global_n_forward_tokens"]
        if k > 0:
            return {"global_n_forward_tokens": torch.zeros_like(forwarded)}
        return {
            "global_n_forward_tokens": torch.full_like(forwarded, float(self.forwarded)),
            "mean_seq_len": torch.full_like(inputs["mean_seq_len"], self.forwarded / sum(self.step.num_samples)),
        }

    def score(self, trainer: TreeAsyncGRPOTrainer, model: torch.nn.Module) -> None:
        """The step forest's forward: `table`, `entropy` and `leaf` (see the class docstring)."""
        forest = self.step.forest.to(trainer.accelerator.device)
        (table,), (entropy,), _ = score_forests(
            model, [forest], [None], temperature=trainer.temperature, autocast=trainer.accelerator.autocast,
            compute_entropy=True, prefix_reuse_chunks=[self.chunks],
        )  # fmt: skip
        self.table, self.entropy = table, entropy.detach()
        self.leaf = table.detach().requires_grad_()

    def log_probs(self) -> torch.Tensor:
        """What the micro-batch last taken reads as its log-probabilities `(S,)` (see the class docstring)."""
        if not self.last:
            return self.leaf
        table, earlier = self.table, self.leaf.grad
        self.table = self.leaf = None  # the loss's graph holds the chunks until its backward, not this object
        return table if earlier is None else _WithEarlierGradient.apply(table, earlier)


class _WithEarlierGradient(torch.autograd.Function):
    """`table` `(S,)` unchanged; its backward adds `earlier` `(S,)`, the gradient the step's earlier micro-batches'
    losses sent the table, to the incoming gradient."""

    @staticmethod
    def forward(ctx, table: torch.Tensor, earlier: torch.Tensor) -> torch.Tensor:
        ctx.earlier = earlier
        return table.view_as(table)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad + ctx.earlier.to(grad.dtype), None


class _StepForward:
    """What TRL's `compute_loss` calls as the model under prefix reuse: micro-batch `k`'s share of the step forest's
    tables (`_ReuseStep`), the forward itself run at micro-batch 0. No MoE aux loss (refused at init)."""

    def __init__(self, trainer: TreeAsyncGRPOTrainer, model: torch.nn.Module, step: _ReuseStep, k: int):
        self.trainer, self.model, self.step, self.k = trainer, model, step, k

    def __call__(self, **trl_forward_kwargs):
        if self.k == 0:
            self.step.score(self.trainer, self.model)
        log_probs = self.step.log_probs()
        return trl_compat.async_model_outputs(log_probs=log_probs, entropy=self.step.entropy, aux_loss=None)


def _flops_or_nan(flops_per_token: Callable) -> Callable:
    """TRL's FLOP formula, or NaN (MFU not logged) for configs it misreads: it takes MoE sizes from fields that
    GPT-OSS, Qwen3.5-MoE and Nemotron-H name otherwise, and would raise after the first step."""

    def safe(config, seq_len: int):
        try:
            return flops_per_token(config, seq_len)
        except AttributeError:
            return math.nan

    return safe


class TreeAsyncGRPOTrainer(AsyncGRPOTrainer):
    """`trl.experimental.async_grpo.AsyncGRPOTrainer` on hf_tree_attn's exact trees (see the module docstring).

    Takes exactly TRL's arguments (`model` is a model id or path, loaded by TRL's constructor on `tree_flex`);
    `args` must be a `TreeAsyncGRPOConfig`. Runs without a vLLM server given a `rollout_worker` and a
    `weight_transfer` (e.g. `replay.ReplayRolloutWorker`, `replay.NoWeightTransfer`) and an explicit `token_budget`.
    `tree_prefix_reuse=True` scores each optimizer step as one forest (see the module docstring); what it cannot run
    exactly is an error at init (`core.prefix_reuse_refusal`).
    """

    def __init__(self, model: str, reward_funcs=None, args: TreeAsyncGRPOConfig | None = None, **kwargs):
        if not isinstance(model, str):
            raise TypeError(
                f"model is a {type(model).__name__}; TreeAsyncGRPOTrainer, like TRL's AsyncGRPOTrainer, loads the "
                "model itself: pass its Hub id or local path (save_pretrained a model built in code)."
            )
        args = tree_args(type(self).__name__, model, args, TreeAsyncGRPOConfig)
        impl = (args.model_init_kwargs or {}).get("attn_implementation")
        if impl is not None:
            raise ValueError(
                f"model_init_kwargs['attn_implementation']={impl!r}: TreeAsyncGRPOTrainer loads the model with "
                f"{ATTN_IMPLEMENTATION!r} itself (as TRL's trainer loads it with its own). Drop the entry."
            )
        reason = peft_config_error(kwargs.get("peft_config"))  # TRL wraps the model after loading it
        if reason is not None:
            way_out = (
                "Use a LoRA-style adapter (LoraConfig), or train synchronously with TreeGRPOTrainer, which runs "
                "this adapter on TRL's flat path."
            )
            raise _refusal(model, reason, way_out)
        self._unpriced: str | None = None  # read by forest_step.recompute_plan
        self._reuse_step: _ReuseStep | None = None  # the optimizer step being scored with prefix reuse
        with _TreeConstruction():
            super().__init__(model, reward_funcs, args, **kwargs)
        if args.tree_prefix_reuse:
            self._check_prefix_reuse()
        # Compiled decoder layers: the user's dynamo settings, or the CUDA default (`compile_setting.py`).
        self.tree_compile = compile_tree_layers(args, self.accelerator, (self.model,))

    def _check_prefix_reuse(self) -> None:
        """Refuse `tree_prefix_reuse=True` where it cannot be exact (`core.prefix_reuse_refusal`, and TRL's MoE
        load-balancing loss, which TRL turns on by `router_aux_loss_coef`, not the config)."""
        reason = prefix_reuse_refusal(self, (self.model,))
        if reason is None and self.aux_loss_enabled:
            reason = (
                f"the MoE load-balancing loss is on (router_aux_loss_coef={self.router_aux_loss_coef}): the chunked "
                "forward returns no router logits. Set router_aux_loss_coef=0.0 to train without it."
            )
        if reason is None and self.args.tree_prefix_reuse_budget_gib is not None:
            error = budget_error(self.model)
            if error is not None:
                raise ValueError(
                    f"tree_prefix_reuse_budget_gib={self.args.tree_prefix_reuse_budget_gib}, but {error} (Set "
                    "tree_prefix_reuse_budget_gib=None.)"
                )
        if reason is not None:
            raise ValueError(
                f"tree_prefix_reuse=True, but {reason} Set tree_prefix_reuse=False (each of TRL's rows forwarded on "
                "its own, repeating a prefix the planner split across rows)."
            )

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Transformers' fetch of one optimizer step's micro-batches; with prefix reuse, they become one forest
        (`_ReuseStep`), scored at the first micro-batch."""
        batch_samples, num_items_in_batch = trl_compat.get_batch_samples(super(), epoch_iterator, num_batches, device)
        self._reuse_step = None
        if self.args.tree_prefix_reuse and batch_samples:
            self._reuse_step = _ReuseStep(batch_samples, step_forest(batch_samples))
        return batch_samples, num_items_in_batch

    def training_step(self, model, inputs, num_items_in_batch=None):
        """TRL's step; with prefix reuse under DDP, without DDP's reducer and the gradients averaged once per
        optimizer step (`core.prefix_reuse_gradient_sync`): the step's chunks run backward in its last micro-batch."""
        with prefix_reuse_gradient_sync(self, model, self.args.tree_prefix_reuse):
            return super().training_step(model, inputs, num_items_in_batch)

    def get_train_dataloader(self):
        """TRL's dataloader (its planner, dispatching), its rows priced by `rollout_planner.PlannerRow` (TRL's
        placements, without a dict lookup per token) and packed by `TreeDataCollatorForRollout`. With prefix reuse
        the planner keeps a sample longer than `token_budget` (alone in a row; its step's forest runs in chunks of
        the budget), where TRL's drops it."""
        reuse = bool(self.args.tree_prefix_reuse)
        planners = {
            "TokenBudgetBatcher": with_planner_rows(trl_compat.async_module_name("TokenBudgetBatcher"), reuse),
            "FixedCountBatcher": with_planner_rows(trl_compat.async_module_name("FixedCountBatcher")),
        }
        with trl_compat.swapped_async_module_names(DataCollatorForRollout=TreeDataCollatorForRollout, **planners):
            return super().get_train_dataloader()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss and metrics, on this rank's forest (`rollout_forest.rank_forest`), or with prefix reuse on the
        step's forest (`_ReuseStep`)."""
        if self.args.tree_prefix_reuse and model.training and torch.is_grad_enabled():
            if self._reuse_step is None:  # never the per-row path in silence
                raise RuntimeError(
                    "tree_prefix_reuse=True scores the micro-batches of an optimizer step together, as transformers' "
                    "training loop fetches them (get_batch_samples), but compute_loss ran outside that loop or past "
                    "the step's micro-batches. Call trainer.train(), or set tree_prefix_reuse=False."
                )
            return self._reuse_loss(model, inputs, return_outputs, num_items_in_batch)
        forest = rank_forest(inputs, self.accelerator.device)
        rows = inputs["token_index"][inputs["token_index"] >= 0]
        forward = _ForestForward(self, model, forest, rows)
        inputs = {**inputs, **trl_compat.async_forward_only_inputs(inputs)}
        return super().compute_loss(forward, inputs, return_outputs, num_items_in_batch)

    def _reuse_loss(self, model, inputs, return_outputs, num_items_in_batch):
        """TRL's loss and metrics of one micro-batch of the step `_ReuseStep` scores: its terms read at their
        step-forest rows, the step's forward counted once (`_ReuseStep.forward_counts`)."""
        step = self._reuse_step
        k = step.take(inputs)
        if k == 0:
            step.plan(self, model)
        if step.last:
            self._reuse_step = None
        inputs = {
            **inputs,
            **trl_compat.async_forward_only_inputs(inputs),
            **step.forward_counts(k, inputs),
            "token_index": step.step.token_index(k, inputs["token_index"]),
        }
        forward = _StepForward(self, model, step, k)
        return super().compute_loss(forward, inputs, return_outputs, num_items_in_batch)

    def _log_step_metrics(self) -> None:
        flops_per_token = _flops_or_nan(trl_compat.async_module_name("compute_flops_per_token"))
        with trl_compat.swapped_async_module_names(compute_flops_per_token=flops_per_token):
            trl_compat.log_step_metrics(super())
