"""TRL's fused LM head on packed prefix forests: the one call TRL's SFT and DPO trainers score sequences with.

TRL's trainers compute log-probabilities with one call, `model(input_ids, attention_mask, labels=labels,
fused_lm_head=True)`, which `trl.trainer.utils.add_fused_lm_head` installs on the model: the backbone runs on the
padded rows (or the padding-free packed row), then TRL's chunked log-prob kernel scores every position whose next
label is not -100, and a `FusedCausalLMOutput` of `(rows, width - 1)` tensors comes back. `TreeLMHead.install`
wraps that forward. The same call packs the batch's sequences into prefix forests (`pack_forest`), runs the backbone
once per forest, scores each distinct (trie row, target) pair once with TRL's kernel and TRL's settings (read from
the head TRL installed), and scatters the values into exactly the tensors TRL's forward returns::

    rows (right-padded)        forest (DFS row)            FusedCausalLMOutput.log_probs (2, 4)
    [s s s a b]                s s s a b c                  [lp(a|sss) lp(b|sssa)   ...      ]
    [s s s c . ]  -- pack -->        └── c                  [lp(c|sss)   0   ...             ]
                               the prompt `s s s` once      0 where the next label is -100

Every loss, normalisation and metric TRL computes from those tensors is then TRL's own code: SFT's token-level
loss over `num_items_in_batch`, `completion_only_loss` / `assistant_only_loss` (they are the labels), DFT, DPO's
loss types, WPO weights, `ld_alpha`, the entropy, accuracy and logit metrics. A batch the tree cannot reproduce
(another padding layout, a label after a padding position, extra model inputs such as images) or one where
sharing saves too little (`max_token_ratio`) runs TRL's own forward unchanged.

With prefix reuse (`TreeLMHead(prefix_reuse=True)`) the batch is one forest (per RoPE length class), every shared
token once, and a forest larger than `max_tokens_per_mb` runs in chunks of that many rows (or the largest that fit a
memory budget, `hf_tree_attn.reuse_planner`), each pair scored by TRL's kernel in the chunk holding its row
(`hf_tree_attn.prefix_reuse.chunked_forest_scores`); a sequence longer than the budget is then scored too.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import types
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..compile import call_compiled
from ..logprobs import _decoder, _lm_head_params, forest_forward_kwargs, tree_router_aux_loss
from ..prefix_reuse import chunked_forest_scores
from ..support import fsdp2_sharded, ranks_max, rope_length_limit, rope_split_lengths, unwrap_model
from ..targets import TargetPlan, expanded_index
from ..tree import PackedForest, pack_forest
from .core import prefix_reuse_chunks
from .mixed_precision_forward import MixedPrecisionLayer, peel, wrap
from .trl_compat import (
    CHUNKED_LOGPROB_OUTPUTS,
    FUSED_HEAD_SETTINGS,
    TRL_REQUIREMENT,
    FusedCausalLMOutput,
    chunked_logprobs,
    fused_forward_closure,
    is_trl_fused_forward,
)

__all__ = ["FusedPlan", "TreeLMHead", "fused_head_settings", "plan_fused_batch"]


# What `add_fused_lm_head` fixes when it installs its forward, read back from that forward's closure so the tree
# scores with TRL's exact settings; looked up here at call time (a test asks for one TRL does not keep).
_SETTINGS = FUSED_HEAD_SETTINGS
# Keys of TRL's batches that describe the flat layout only: the forest replaces them.
_LAYOUT_KEYS = frozenset(
    {"input_ids", "attention_mask", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
     "seq_idx", "use_cache", "return_dict"}
)  # fmt: skip
_PLAN_CACHE = 8  # DPO scores one batch with the policy and the reference: plan once, use twice


def _every_rank_plans(model: torch.nn.Module, planned: bool) -> bool:
    """Whether every process runs its call on trees, where `model` is sharded by FSDP2 (else `planned`).

    With prefix reuse under FSDP2 the tree runs its chunks (and dummies up to the other processes' count) with
    collectives TRL's one forward does not call: a process whose batch runs TRL's forward takes every process there."""
    if not fsdp2_sharded(model):
        return planned
    (not_planned_somewhere,) = ranks_max([int(not planned)], next(model.parameters()).device)
    return not not_planned_somewhere


def fused_head_settings(forward) -> dict:
    """The settings of the fused LM head TRL installed (`outputs`, `temperature`, `cast_lm_head_to_fp32`,
    `final_logit_softcapping`, `logit_scale`), read from its forward (a model or its bound `forward`), through
    accelerate's mixed-precision wrappers and a tree head already installed; raises `ValueError` naming what was
    found instead of TRL's fused forward."""
    forward = forward.forward if isinstance(forward, torch.nn.Module) else forward
    return _settings_of(_trl_fused_forward(forward)[0])


def _trl_fused_forward(forward) -> tuple[Callable, tuple[MixedPrecisionLayer, ...], TreeLMHead | None]:
    """What lies under a model's `forward`: the function TRL's fused head should be (unbound), accelerate's
    mixed-precision layers around it (outermost first, `mixed_precision_forward.peel`) and the tree head installed
    between them and it (None if none is)."""
    func, layers = peel(forward)
    head = getattr(func, "_tree_lm_head", None)
    if head is not None:
        func = func._trl_forward
    return func, layers, head


def _settings_of(func: Callable) -> dict:
    """The settings in the closure of TRL's fused forward `func` (unbound); `ValueError` if `func` is not it."""
    code = getattr(func, "__code__", None)
    cells = fused_forward_closure(func)
    missing = [name for name in _SETTINGS if name not in cells]
    if not missing:
        return {name: cells[name] for name in _SETTINGS}
    where = f"{code.co_filename}:{code.co_firstlineno}" if code else type(func).__name__
    if is_trl_fused_forward(func):
        raise ValueError(
            f"TRL's fused LM head ({code.co_name} at {where}) keeps no {missing} in its closure: this trl version is "
            f'not the one hf_tree_attn reads (trl{TRL_REQUIREMENT}). pip install "trl{TRL_REQUIREMENT}", or set '
            "tree_packing=False."
        )
    # What `functools.wraps` calls it (the model's `forward`), and the def that really runs.
    wrapped_name = getattr(func, "__qualname__", repr(func))
    def_name = getattr(code, "co_qualname", getattr(code, "co_name", "?"))
    raise ValueError(
        f"The model's forward (seen through accelerate's mixed-precision wrappers) is {wrapped_name} ({def_name} at "
        f"{where}), not the fused LM head trl.trainer.utils.add_fused_lm_head installs (its closure lacks {missing}): "
        "TRL did not install its head on this model, or something else wraps that head. Let the tree trainer install "
        "its head before that wrapper, or set tree_packing=False."
    )


@dataclass
class FusedPlan:
    """Where one flat batch's scored positions live in its forests.

    Attributes:
        forests: the packed forests (CPU), one backbone forward each.
        plans: per forest, its scored positions (`TargetPlan.from_shift_labels` of the batch's labels); TRL's
            kernel scores each distinct (row, target) pair once (`TargetPlan.pairs`).
        entry_row, entry_col: `(E,)` long — the flat position of every entry of `plans`, forest after forest, as
            `(row, column)` of `labels[:, 1:]`.
        tree_tokens: real rows of all forests; flat_tokens: tokens TRL's forward computes (rows x width);
            original_tokens: real tokens of the batch's sequences.
    """

    forests: list[PackedForest]
    plans: list[TargetPlan]
    entry_row: torch.Tensor
    entry_col: torch.Tensor
    tree_tokens: int
    flat_tokens: int
    original_tokens: int


def _segments(mask: np.ndarray | None, pos: np.ndarray | None, shape: tuple[int, int]) -> np.ndarray | str:
    """`(B, L)` int64: the sequence each flat position belongs to (-1 at padding), numbered in row-major order; or
    why the layout is not one the tree reproduces.

    Three layouts, as TRL's collators build them: right-padded rows (`attention_mask`, optionally `position_ids`
    counting from 0), padding-free packed rows (no mask; a sequence starts wherever `position_ids` is 0, so each
    padding token of `pad_to_multiple_of` is a 1-token sequence, as the flat forward treats it), or full rows.
    """
    rows, width = shape
    cols = np.broadcast_to(np.arange(width), shape)
    if mask is not None:
        real = mask.astype(bool)
        lengths = real.sum(1)
        if not (real == (cols < lengths[:, None])).all():
            return "the rows are not right-padded (attention_mask is not a run of ones then zeros)"
        if pos is not None and not (pos[real] == cols[real]).all():
            return "position_ids do not count 0, 1, 2, ... along each row"
        seq = np.cumsum(lengths > 0) - 1
        return np.where(real, seq[:, None], -1)
    if pos is None:
        return np.broadcast_to(np.arange(rows)[:, None], shape).copy()
    starts = pos == 0
    if not starts[:, 0].all():
        return "a packed row does not start a sequence (position_ids[:, 0] != 0)"
    seq = np.cumsum(starts.ravel()).reshape(shape) - 1
    first = np.flatnonzero(starts.ravel())
    offset = np.arange(rows * width) - first[seq.ravel()]
    if not (offset.reshape(shape) == pos).all():
        return "position_ids do not count 0, 1, 2, ... within each packed sequence"
    return seq


def plan_fused_batch(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    labels: torch.Tensor,
    max_tokens_per_mb: int | None = None,
    split_lengths: tuple[int, ...] = (),
    max_token_ratio: float = 1.0,
    prefix_reuse: bool = False,
) -> FusedPlan | str:
    """The forests of one flat batch and where its scored positions go, or why it must run flat.

    Args:
        input_ids: `(B, L)` long; attention_mask: `(B, L)` or None; position_ids: `(B, L)` or None (see
            `_segments` for the layouts); labels: `(B, L)` long, -100 where nothing is scored. Position `p` of row
            `r` is scored when `labels[r, p + 1] != -100`: the hidden state at `p` predicts that label, exactly as
            TRL's fused head reads it.
        max_tokens_per_mb: token budget of one forest (None: one forest).
        split_lengths: `rope_split_lengths` of the model.
        max_token_ratio: run flat when the forests hold more than this fraction of `B * L`.
        prefix_reuse: one forest (per length class) as a plain trie, for `max_tokens_per_mb`-row chunks; a sequence
            longer than the budget is then planned too.
    """
    ids = input_ids.detach().cpu().numpy()
    shape = ids.shape
    mask = None if attention_mask is None else attention_mask.detach().cpu().numpy()
    pos = None if position_ids is None else position_ids.detach().cpu().numpy()
    if mask is not None and mask.shape != shape or pos is not None and pos.shape != shape or labels.shape != shape:
        return "attention_mask, position_ids and labels are not all of input_ids' shape"
    seq = _segments(mask, pos, shape)
    if isinstance(seq, str):
        return seq
    real = seq >= 0
    if not real.any():
        return "the batch has no tokens"
    lengths = np.bincount(seq[real], minlength=int(seq.max()) + 1)
    sequences = np.split(ids[real], np.cumsum(lengths)[:-1])

    # transformers' `shift_labels`: the label flat position `p` predicts (none after a row's last column).
    shift = np.full(shape, -100, dtype=np.int64)
    shift[:, :-1] = labels[:, 1:].detach().cpu().numpy()
    if (shift[~real] != -100).any():
        return "a label follows a padding position (the flat forward scores a padding token's hidden state there)"
    if prefix_reuse:
        forests = pack_forest(sequences, split_lengths=split_lengths, two_level=False)
    elif max_tokens_per_mb is not None and lengths.max() > max_tokens_per_mb:
        return f"a sequence of {int(lengths.max())} tokens is longer than max_tokens_per_mb={max_tokens_per_mb}"
    else:
        forests = pack_forest(sequences, max_tokens_per_mb=max_tokens_per_mb, split_lengths=split_lengths)
    tree_tokens = sum(f.num_tree_tokens for f in forests)
    if tree_tokens > max_token_ratio * ids.size:
        return f"ratio {tree_tokens / ids.size:.3f} > max_token_ratio {max_token_ratio}"

    # Sequences are numbered in row-major order, so the real positions in that order run through them one by one.
    flat_of_token = torch.from_numpy(np.flatnonzero(real))
    first_token = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)[:-1]]))
    shift = torch.from_numpy(shift.reshape(-1))
    plans, entries = [], []
    for forest in forests:
        seq_of, token_index = expanded_index(forest)
        tokens = first_token[torch.tensor(forest.seq_ids)][seq_of] + token_index  # (N,) into the sequences' tokens
        plan = TargetPlan.from_shift_labels(forest, shift[flat_of_token[tokens]])
        plans.append(plan)
        entries.append(flat_of_token[first_token[plan.seq_index] + plan.position - 1])
    entry = torch.cat(entries)
    return FusedPlan(forests, plans, entry // shape[1], entry % shape[1], tree_tokens, ids.size, int(real.sum()))


class TreeLMHead:
    """Runs a TRL-fused-head model's `fused_lm_head=True` calls on packed forests (see the module docstring).

    Args:
        max_tokens_per_mb: token budget of one forest; None = one forest per call.
        max_token_ratio: a call whose forests would hold more than this fraction of the tokens TRL's forward
            computes (rows x width) runs TRL's forward instead, with one warning the first time.
        record: `record(name, value)` receives the per-call metrics `tree_fallback` (0 / 1), `tree_token_ratio`
            (forest rows / real tokens) and `tree_compute_ratio` (forest rows / tokens TRL's forward computes).
        prefix_reuse: one forest per call, run in chunks of `max_tokens_per_mb` rows (see the module docstring).
        prefix_reuse_budget_gib: with `prefix_reuse`, the chunks are the largest whose estimated peak fits this
            many GiB (`core.prefix_reuse_chunks`, which also records the estimate, and keeps as many of the last
            chunks' graphs as the rest of it holds); None = `max_tokens_per_mb` rows.
    """

    def __init__(
        self,
        max_tokens_per_mb: int | None = None,
        max_token_ratio: float = 0.9,
        record: Callable[[str, float], None] | None = None,
        prefix_reuse: bool = False,
        prefix_reuse_budget_gib: float | None = None,
    ):
        self.max_tokens_per_mb = max_tokens_per_mb
        self.prefix_reuse = prefix_reuse and max_tokens_per_mb is not None
        self.prefix_reuse_budget_gib = prefix_reuse_budget_gib
        self.max_token_ratio = max_token_ratio
        self.record = record or (lambda name, value: None)
        self._plans: OrderedDict[str, FusedPlan | str] = OrderedDict()
        self._warned: set[str] = set()

    def install(self, model: torch.nn.Module, caller: torch.nn.Module | None = None) -> None:
        """Wrap the fused forward TRL installed on `model` (the causal LM itself, under PEFT its base model).

        `caller`: the module TRL calls (under PEFT the `PeftModel`; default `model`), through which prefix reuse
        runs its chunks: under FSDP2 it is the root whose forward gathers the parameters the chunks read.
        Where accelerate already wrapped that forward for mixed precision (TRL's DPO prepares a separate reference
        model in its `__init__`), the tree head goes inside accelerate's layers: it runs under the same autocast,
        and its outputs are cast to float32, as TRL's forward there."""
        target = unwrap_model(model)
        caller = target if caller is None else caller
        trl_func, layers, installed = _trl_fused_forward(target.forward)
        if installed is self:
            return
        # Another head's wrapper (a second trainer on the same model) is replaced, never stacked.
        settings = _settings_of(trl_func)
        trl_forward = types.MethodType(trl_func, target)
        head = self

        def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kw):
            plan = None
            if fused_lm_head and not args and shift_labels is None and labels is not None:
                plan = head._plan(self, labels, kw)
            planned = isinstance(plan, FusedPlan)
            if fused_lm_head and head.prefix_reuse and not _every_rank_plans(self, planned) and planned:
                plan = "another process runs TRL's forward on its batch (under FSDP2 every process takes one path)"
            if not isinstance(plan, FusedPlan):
                if fused_lm_head:
                    head.record("tree_fallback", 1.0)
                    if plan is not None:
                        head._warn_once(plan)
                return trl_forward(
                    *args, fused_lm_head=fused_lm_head, labels=labels, shift_labels=shift_labels,
                    num_items_in_batch=num_items_in_batch, **kw,
                )  # fmt: skip
            head.record("tree_fallback", 0.0)
            head.record("tree_token_ratio", plan.tree_tokens / plan.original_tokens)
            head.record("tree_compute_ratio", plan.tree_tokens / plan.flat_tokens)
            return head._forward(self, plan, settings, labels, num_items_in_batch, kw, caller)

        functools.update_wrapper(forward, trl_func)  # the model's signature, which `generate` checks
        forward._tree_lm_head, forward._trl_forward = self, trl_func
        target.forward = types.MethodType(wrap(forward, layers), target)
        if "_original_forward" in vars(target):  # accelerate's record of the forward under its layers
            target._original_forward = types.MethodType(forward, target)

    def _warn_once(self, reason: str) -> None:
        kind = "ratio" if reason.startswith("ratio") else reason
        if kind in self._warned:
            return
        self._warned.add(kind)
        if kind == "ratio":
            message = (
                f"This batch shares too few tokens for a tree ({reason}): it runs TRL's own forward, as will every "
                "such batch (logged as tree_fallback=1; this is said once). Raise tree_max_token_ratio (1.0 = "
                "always the tree) to change that."
            )
        else:
            message = f"A batch runs TRL's own forward instead of a tree: {reason} (logged as tree_fallback=1)."
        warnings.warn(message, stacklevel=3)

    def _plan(self, model: torch.nn.Module, labels: torch.Tensor, kwargs: dict) -> FusedPlan | str:
        allowed = _LAYOUT_KEYS | {"output_router_logits"}
        extra = sorted(k for k, v in kwargs.items() if k not in allowed and v is not None)
        if extra:
            return f"the call passes inputs the tree does not lay out ({extra})"
        input_ids = kwargs.get("input_ids")
        if input_ids is None or input_ids.ndim != 2:
            return "the call passes no 2-D input_ids"
        mask, pos = kwargs.get("attention_mask"), kwargs.get("position_ids")
        if mask is not None and mask.ndim != 2:
            return "the attention_mask is not a 2-D padding mask"
        config = unwrap_model(model).config
        split, limit = rope_split_lengths(config), rope_length_limit(config)
        tensors = {"ids": input_ids, "mask": mask, "pos": pos, "labels": labels}
        digest = hashlib.blake2b(digest_size=16)
        digest.update(repr((split, limit)).encode())  # a DPO reference with another RoPE plans its own batches
        for slot, t in tensors.items():
            if t is None:
                continue
            digest.update(repr((slot, tuple(t.shape), str(t.dtype))).encode())
            digest.update(t.detach().cpu().numpy().tobytes())
        key = digest.hexdigest()
        if key not in self._plans:
            plan = plan_fused_batch(
                input_ids, mask, pos, labels, self.max_tokens_per_mb, split, self.max_token_ratio, self.prefix_reuse
            )
            if isinstance(plan, FusedPlan) and limit is not None and max(f.max_depth for f in plan.forests) >= limit:
                plan = f"a sequence is longer than the {limit} tokens this model's dynamic RoPE keeps exact"
            self._plans[key] = plan
            while len(self._plans) > _PLAN_CACHE:
                self._plans.popitem(last=False)
        return self._plans[key]

    def _forward(self, model, plan: FusedPlan, settings: dict, labels, num_items_in_batch, kwargs: dict, caller):
        """Backbone once per forest, TRL's kernel once per distinct pair; TRL's output layout. With prefix reuse the
        chunks run through `caller` (see `install`)."""
        text_config = model.config.get_text_config()
        router = bool(kwargs.get("output_router_logits", getattr(text_config, "output_router_logits", False)))
        decoder = _decoder(model)
        outputs = tuple(settings["outputs"])
        embeddings = model.get_input_embeddings().weight.device  # the backbone's first device (device_map)
        pair_values, forests, router_logits = [], [], []

        def head(hidden, targets):
            # Read after the backbone ran, as TRL's forward reads it: before, under accelerate's FSDP2 the weight is
            # still the sharded DTensor, whose gathered copy gives each rank's shard that rank's own gradient,
            # never averaged over the ranks (`tests/test_fsdp_trainers.py`).
            weight, bias = _lm_head_params(model)
            hidden = hidden.to(weight.device)
            autocast = contextlib.nullcontext()
            if settings["cast_lm_head_to_fp32"]:
                hidden = hidden.float()
                autocast = torch.autocast(hidden.device.type, enabled=False)
            with autocast:
                return chunked_logprobs(
                    hidden, weight, bias, targets.to(weight.device), settings["temperature"],
                    settings["final_logit_softcapping"], settings["logit_scale"], outputs,
                )  # fmt: skip

        for forest, scored in zip(plan.forests, plan.plans):
            sources, targets, _ = scored.pairs
            forest = forest.to(embeddings)
            forests.append(forest)
            reuse = None
            if self.prefix_reuse:
                reuse = prefix_reuse_chunks(
                    caller, forest, self.max_tokens_per_mb, self.prefix_reuse_budget_gib, self.record
                )
            if reuse is not None:
                pair_values.append(
                    chunked_forest_scores(
                        caller, forest, reuse.rows, sources, targets, head, keep_graphs=reuse.keep_graphs
                    )
                )
                continue
            inputs = forest_forward_kwargs(forest, embeddings)
            router_kwargs = {"output_router_logits": True} if router else {}
            backbone = call_compiled(decoder, lambda: decoder(**inputs, **router_kwargs))  # noqa: B023
            if router:
                router_logits.append(backbone.router_logits)
            pair_values.append(head(backbone.last_hidden_state[0, sources.to(forest.input_ids.device)], targets))
        device = model.get_output_embeddings().weight.device
        label_mask = labels[:, 1:].to(device) != -100
        rows, cols = plan.entry_row.to(device), plan.entry_col.to(device)
        fields = {}
        for i, name in enumerate(CHUNKED_LOGPROB_OUTPUTS):
            if pair_values[0][i] is None:
                fields[name] = None
                continue
            values = torch.cat([v[i][t.pairs[2].to(device)] for v, t in zip(pair_values, plan.plans)])
            fields[name] = values.new_zeros(label_mask.shape).index_put((rows, cols), values)
        log_probs = fields["log_probs"]
        count = label_mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        loss = -log_probs.sum() / count
        aux_loss = None
        if router:
            aux_loss = tree_router_aux_loss(model, forests, router_logits)
            loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
        return FusedCausalLMOutput(loss=loss, label_mask=label_mask, aux_loss=aux_loss, **fields)
