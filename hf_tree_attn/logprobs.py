"""Per-token log-probabilities and entropies from one forward over a packed forest.

The token at row `r` is predicted by the hidden state of its parent row `parent[r]`. A branching row predicts
several children, and a row shared by many sequences is scored once: the LM head and log-softmax run only on
the scored tree rows, in chunks, so the `(tokens, vocab)` logits never exist at once (under autograd each chunk
is recomputed in backward rather than stored). With trl installed this is TRL's fused chunked kernel (one row
per scored token; a branching parent repeats once per child), else a torch head over the unique parent rows.
Per-sequence values are then gathered from the per-row table; autograd sums the gradients of shared rows —
exactly the flat gradient.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .compile import call_compiled
from .model_inputs import check_forest_inputs, lm_head_weight_and_bias
from .support import (
    check_tree_model,
    config_field,
    fsdp2_sharded,
    logit_scale,
    ranks_max,
    rope_split_lengths,
    unwrap_model,
)
from .tree import PackedForest, TokenSequence, check_token_budget, pack_forest

__all__ = [
    "check_tree_model",
    "forest_forward_kwargs",
    "forest_logprobs",
    "gather_sequences",
    "lm_head_logprobs",
    "pad_sequences",
    "sequence_logprobs",
    "tree_router_aux_loss",
    "unwrap_model",
]

_LOGITS_CHUNK_BYTES = 1 << 30  # fp32 logits held per chunk (torch fallback)
_FUSED_VOCAB_CHUNK = 32768  # vocab tile of TRL's kernel, as TRL's own fused LM head uses


def forest_forward_kwargs(forest: PackedForest, device: torch.device | str) -> dict:
    """`model(**kwargs)` inputs for one forest on `device`: ids, depth position ids, the forest's attention mask
    (which the model's own mask functions turn into one tree mask per layer kind, see `PackedForest.attention_mask`)
    and the forest itself as `tree_forest` (it reaches every attention call through transformers' kwargs, which
    check that they got the forest's masks).

    Padding rows (after `num_tree_tokens`) are fed the forest's first token, not the forest's 0: each padding row
    attends only to itself at depth 0, so it repeats the computation of a sequence's first position, which flat
    does too. Token 0 is often the embedding's `padding_idx` (a zero vector): a padding row would then stay zero
    through every layer, and a model that divides by a norm of it (Gemma 3n's `mean(h**2) ** 0.5`) gets 0 * inf =
    NaN in the backward, which its weight gradients sum over all rows. The padding rows' outputs are never read.
    """
    ids = forest.input_ids
    if 0 < forest.num_tree_tokens < ids.shape[1]:
        ids = ids.clone()
        ids[:, forest.num_tree_tokens :] = ids[:, :1]
    return {
        "input_ids": ids.to(device),
        "position_ids": forest.position_ids.to(device),
        "attention_mask": forest.attention_mask(device),
        "tree_forest": forest,
        "use_cache": False,
    }


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The backbone whose output is the final hidden state: `get_decoder()`, or the causal LM's only backbone
    child where `get_decoder()` gives the model itself (Llama 4) or its LM head (ModernBERT decoder)."""
    from transformers import PreTrainedModel

    model = unwrap_model(model)
    if hasattr(model, "get_base_model"):  # PEFT: the causal LM with its adapters injected
        model = model.get_base_model()
    decoder = model.get_decoder()
    if decoder is model or not isinstance(decoder, PreTrainedModel) or decoder.get_output_embeddings() is not None:
        backbones = [m for m in model.children() if isinstance(m, PreTrainedModel)]
        if len(backbones) != 1:
            raise NotImplementedError(
                f"Cannot find the backbone of {type(model).__name__} (get_decoder() gives "
                f"{type(decoder).__name__}, and it has {len(backbones)} PreTrainedModel children). Train it with "
                "tree_packing=False."
            )
        decoder = backbones[0]
    return decoder


def _final_hidden_states(
    model: torch.nn.Module, inputs: dict, router_logits: bool = False
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """Last hidden states `(batch, seq, hidden)` (after the final norm) through the *root* forward, and with
    `router_logits` the MoE router logits of every MoE layer (`(seq, num_experts)` each).

    The root module is called — not the backbone and `lm_head` — so FSDP2's root hooks, PEFT and TRL's forward
    patch all run. An empty `logits_to_keep` makes the model's own LM head a no-op. The root is told not to compute
    its own router loss (it would weigh the forest's rows as one flat sequence, padding included); the backbone
    alone is asked for the router logits.
    """
    captured = {}

    def grab(module, args, output):
        captured["hidden"] = output[0] if isinstance(output, tuple) else output.last_hidden_state
        if router_logits:
            captured["router"] = output.router_logits

    def ask_router_logits(module, args, kwargs):
        return args, {**kwargs, "output_router_logits": True}

    device = inputs["input_ids"].device
    decoder = _decoder(model)
    handles = [decoder.register_forward_hook(grab)]
    if router_logits:
        handles.append(decoder.register_forward_pre_hook(ask_router_logits, with_kwargs=True))
    extra = {}
    if hasattr(unwrap_model(model).config.get_text_config(), "output_router_logits"):
        extra["output_router_logits"] = False
    try:
        no_logits = torch.empty(0, dtype=torch.long, device=device)
        call_compiled(model, lambda: model(**inputs, **extra, logits_to_keep=no_logits))
    finally:
        for handle in handles:
            handle.remove()
    return captured["hidden"], captured.get("router")


def _lm_head_params(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(weight (vocab, hidden), bias (vocab,) | None)` of the LM head: FSDP2 shards gathered; DeepSpeed ZeRO-3
    parameters as they are (partitioned: read them inside `_in_forward_of`)."""
    head = unwrap_model(model).get_output_embeddings()
    weight, bias = lm_head_weight_and_bias(head)
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        DTensor = ()
    if isinstance(weight, DTensor):  # FSDP2 shard: gather (differentiably) as TRL's fused head does
        weight = weight.full_tensor()
        bias = bias.full_tensor() if isinstance(bias, DTensor) else bias
    return weight, bias


def _zero3_owner(model: torch.nn.Module, weight: torch.Tensor) -> torch.nn.Module | None:
    """The module holding the LM head `weight` when DeepSpeed ZeRO-3 partitions it, else None.

    ZeRO-3 marks the parameters it partitions with `ds_id`. A head whose weight is computed from partitioned
    parameters (PEFT `trainable_token_indices`) has no single owner to gather through and is refused.
    """
    head = unwrap_model(model).get_output_embeddings()
    if not hasattr(weight, "ds_id"):
        if any(hasattr(p, "ds_id") for p in head.parameters()):
            raise NotImplementedError(
                f"Under DeepSpeed ZeRO-3 the LM head {type(head).__name__} computes its weight from partitioned "
                "parameters (PEFT trainable_token_indices), which the tree head cannot gather. Use ZeRO-2 or FSDP2, "
                "or train this model with tree_packing=False."
            )
        return None
    return next(m for m in head.modules() if any(p is weight for p in m.parameters(recurse=False)))


def _in_forward_of(module: torch.nn.Module, fn, *args):
    """`fn(*args)`, run as `module`'s forward (through `module(*args)`) so that its hooks run around it.

    This is how the tree head reads a DeepSpeed ZeRO-3 partitioned LM head: ZeRO-3 holds a parameter as a
    0-element placeholder outside its module's forward, and its module hooks gather it for the forward and again,
    when the gradient reaches the module's outputs, for the backward, up to the accumulation of the parameter's own
    gradient. A `deepspeed.zero.GatheredParameters` block around the head alone is not enough: TRL's kernel gathers
    again in its backward, but releases the weight when it returns, before autograd accumulates the weight's
    gradient into the (then empty) parameter. TRL's fused head gets the same hooks by running inside the model's
    forward; the tree head runs after it (on the decoder's hidden states), so it runs inside the LM head's.
    """
    previous = module.__dict__.get("forward")  # an instance-level forward (accelerate's hooks) to restore
    module.forward = fn
    try:
        return module(*args)
    finally:
        if previous is None:
            del module.forward
        else:
            module.forward = previous


@functools.cache  # called for every forest built; resolved once (a failed import would search the path each time)
def _fused_lm_head():
    """TRL's chunked log-prob autograd function (the one its flat GRPO trainer uses), or None without trl.

    It imports `trl.trainer.utils` too, which the function's backward imports at call time (1.16.0). That module
    defines a `ModelOutput` subclass, and transformers registers each as a pytree node; dynamo guards every compiled
    graph on the number of pytree node types, so that registration in the first backward would fail the guards of
    every compiled layer and FlexAttention graph and compile each again in the next step. `PackedForest` calls this
    when it is built, before any compiled call can carry it.
    """
    try:
        import trl.trainer.utils  # noqa: F401  (registers its pytree nodes now, see above)
        from trl.kernels import ChunkedLogProbFunction
    except ImportError:
        return None
    return ChunkedLogProbFunction


def _head_chunk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    owner: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    scale: float,
    softcap: float | None,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs `(E,)` of `targets` under rows `owner` of `hidden` `(U, hidden)`, and entropies `(U,)`.

    Logits are transformed in TRL's kernel's order: the model's logit scale, its final softcap, the temperature.
    """
    logits = F.linear(hidden, weight, bias).float()  # (U, vocab)
    if scale != 1.0:
        logits = logits * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logps = logits[owner, targets] - lse[owner]
    if not with_entropy:
        return logps, lse.new_zeros(0)
    entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logps, entropy


def forest_logprobs(
    model: torch.nn.Module,
    forest: PackedForest,
    rows: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_rows: int | None = None,
    return_router_logits: bool = False,
    fp32_head: bool = False,
):
    """Score the tokens of one packed forest with one forward.

    Args:
        model: a causal LM loaded with `attn_implementation="tree_flex"`; PEFT, FSDP2 and DDP wrappers are fine
            (the wrapped root module is what gets called).
        forest: the micro-batch, on the model's device.
        rows: `(R,)` long — rows whose token to score; default all rows that have a parent. Rows without a
            parent (roots, padding) score 0.
        temperature: logits are divided by it (as TRL does for the sampling temperature).
        return_entropy: also return the entropy of the distribution that predicts each scored row.
        chunk_rows: rows per chunk of the plain-torch LM head; default (None) uses TRL's fused chunked kernel
            when trl is installed (see `lm_head_logprobs`).
        return_router_logits: also return the MoE router logits of this forward (for `tree_router_aux_loss`).
        fp32_head: run the LM head in float32 with autocast off (TRL's `cast_lm_head_to_fp32`).

    Returns:
        `(logps, entropy)`, each `(S,)` float32 indexed by row (0 at unscored rows); `entropy` is None unless
        requested. Differentiable. With `return_router_logits`, a third element: one `(S, num_experts)` tensor per
        MoE layer.
    """
    check_forest_inputs(unwrap_model(model), forest, temperature)
    device = forest.input_ids.device
    if rows is None:
        rows = torch.nonzero(forest.parent >= 0).squeeze(1)
    rows = rows.to(device)
    inputs = forest_forward_kwargs(forest, device)
    hidden, router_logits = _final_hidden_states(model, inputs, router_logits=return_router_logits)
    hidden = hidden[0]  # (S, hidden)

    parents = forest.parent.to(device)[rows]
    if (parents < 0).any():
        bad = rows[parents < 0][:5].tolist()
        raise ValueError(f"rows {bad} have no parent (a root or padding); only tokens after a first one are scored.")
    targets = forest.input_ids[0].to(device)[rows]
    values, entropy_values = lm_head_logprobs(
        model, hidden, parents, targets, temperature=temperature, return_entropy=return_entropy,
        chunk_rows=chunk_rows, fp32_head=fp32_head,
    )  # fmt: skip
    seq_len = forest.input_ids.shape[1]
    logps = torch.zeros(seq_len, dtype=torch.float32, device=device).index_put((rows,), values)
    entropy = None
    if return_entropy:
        entropy = torch.zeros(seq_len, dtype=torch.float32, device=device).index_put((rows,), entropy_values)
    if return_router_logits:
        return logps, entropy, router_logits
    return logps, entropy


def tree_router_aux_loss(
    model: torch.nn.Module, forests: Sequence[PackedForest], router_logits: Sequence
) -> torch.Tensor:
    """The MoE load-balancing loss of the sequences of `forests`, equal to the one of their flat padded batch.

    transformers' (Mixtral's) `load_balancing_loss_func` averages router statistics over the real tokens of a flat
    batch, each token of each row once. A tree routes a shared token once, so its statistics are weighted by the
    number of packed sequences that contain it (padding rows weigh 0); all forests of one flat batch are pooled.
    The expert count and top-k are read as TRL's fused LM head reads them (`num_experts`, `num_experts_per_tok`),
    or, where the config names them otherwise (Llama 4, Granite-MoE, PhiMoE: `num_local_experts`), as the model's
    own load-balancing loss does.

    Args:
        model: the MoE causal LM.
        forests: the forests of one flat batch.
        router_logits: for each forest, what `forest_logprobs(..., return_router_logits=True)` returned: one
            `(S, num_experts)` tensor per MoE layer.

    Returns:
        A scalar, differentiable w.r.t. the router logits.
    """
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    config = unwrap_model(model).config.get_text_config()
    weights = torch.cat(
        [
            torch.bincount(f.seq_positions.to(logits[0].device), minlength=f.seq_len).float()
            for f, logits in zip(forests, router_logits)
        ]
    )
    layers = tuple(torch.cat(per_layer, dim=0) for per_layer in zip(*router_logits))
    experts = config_field(config, "num_experts", "num_local_experts")
    return load_balancing_loss_func(layers, experts, config.num_experts_per_tok, weights)


def lm_head_logprobs(
    model: torch.nn.Module,
    hidden: torch.Tensor,
    sources: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_rows: int | None = None,
    fp32_head: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked LM head + log-softmax on the distinct rows of `hidden` that `sources` points at.

    Args:
        model: the causal LM whose output embedding, logit scale and final softcap to use (`support.logit_scale`).
        hidden: `(N, hidden)` final hidden states.
        sources: `(E,)` long — row of `hidden` that predicts each target (the torch head computes a repeated row
            once; TRL's kernel takes one row per target).
        targets: `(E,)` long — token ids to score.
        temperature, return_entropy: as in `forest_logprobs`.
        chunk_rows: rows per chunk of the plain-torch head. Default (None) uses TRL's fused chunked kernel when
            trl is installed (Triton on CUDA), else the torch head with chunks of at most 1 GiB of fp32 logits.
        fp32_head: hidden states and LM head in float32 with autocast off, as TRL's `cast_lm_head_to_fp32` runs its
            fused head (which TRL's trainers give an fp32 `lm_head`); else under the caller's autocast, if any.

    Returns:
        `(logps, entropy)`: `(E,)` float32 each (`entropy` None unless requested), differentiable w.r.t. `hidden`
        and the LM head.
    """
    weight, bias = _lm_head_params(model)
    config = unwrap_model(model).config.get_text_config()
    precision = torch.autocast(hidden.device.type, enabled=False) if fp32_head else contextlib.nullcontext()
    head = functools.partial(
        _head_logprobs,
        weight=weight,
        bias=bias,
        sources=sources,
        targets=targets,
        temperature=temperature,
        scale=logit_scale(config),
        softcap=getattr(config, "final_logit_softcapping", None),
        return_entropy=return_entropy,
        chunk_rows=chunk_rows,
        fp32=fp32_head,
    )
    owner = _zero3_owner(model, weight)
    with precision:
        return head(hidden) if owner is None else _in_forward_of(owner, head, hidden)


def _head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    sources: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    scale: float,
    softcap: float | None,
    return_entropy: bool,
    chunk_rows: int | None,
    fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`lm_head_logprobs` on an LM head `weight` `(vocab, hidden)` / `bias` `(vocab,)` the caller has made readable
    (`fp32`: all three cast to float32 here, where a ZeRO-3 weight is gathered; a no-op on TRL's cast head)."""
    if fp32:
        hidden, weight = hidden.float(), weight.float()
        bias = bias.float() if bias is not None else None
    fused = _fused_lm_head() if chunk_rows is None else None
    if fused is not None:
        # TRL's kernel scores one target per row: a branching parent row is repeated once per child (E rows, barely
        # more than the unique parents); its vocab-tiled, Triton-folded passes beat our fp32 chunks on CUDA.
        logps, entropy, *_ = fused.apply(
            hidden[sources], weight, bias, targets, temperature, _FUSED_VOCAB_CHUNK, softcap, scale,
            ("entropy",) if return_entropy else (),
        )  # fmt: skip
        return logps.float(), (entropy.float() if return_entropy else None)

    device = hidden.device
    uniq, owner = torch.unique(sources, return_inverse=True)  # uniq sorted: each chunk's owners are contiguous
    order = torch.argsort(owner, stable=True)
    owner_sorted, targets_sorted = owner[order], targets[order]
    chunk = chunk_rows or max(1, _LOGITS_CHUNK_BYTES // (4 * weight.shape[0]))
    bounds = torch.searchsorted(owner_sorted, torch.arange(0, len(uniq) + chunk, chunk, device=device)).tolist()

    logps_parts, entropy_parts = [], []
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    for c, start in enumerate(range(0, len(uniq), chunk)):
        lo, hi = bounds[c], bounds[c + 1]
        args = (
            hidden[uniq[start : start + chunk]],
            weight,
            bias,
            owner_sorted[lo:hi] - start,
            targets_sorted[lo:hi],
            temperature,
            scale,
            softcap,
            return_entropy,
        )
        # Under autograd each chunk's logits are recomputed in backward instead of being kept alive.
        lp, ent = checkpoint(_head_chunk, *args, use_reentrant=False) if needs_grad else _head_chunk(*args)
        logps_parts.append(lp)
        entropy_parts.append(ent)

    empty = torch.zeros(0, dtype=torch.float32, device=device)
    logps = torch.cat(logps_parts) if logps_parts else empty
    logps = torch.zeros_like(logps).index_put((order,), logps)  # back to the order of `sources`
    if not return_entropy:
        return logps, None
    return logps, (torch.cat(entropy_parts)[owner] if entropy_parts else empty)


def gather_sequences(forest: PackedForest, table: torch.Tensor) -> list[torch.Tensor]:
    """Per-sequence values `[table[positions(k)[1:]] for k]` from a per-row table `(S,)`; `L_k - 1` entries each."""
    positions = forest.seq_positions.to(table.device)
    offsets = forest.seq_offsets.tolist()
    return [table[positions[offsets[k] + 1 : offsets[k + 1]]] for k in range(len(forest.seq_ids))]


def pad_sequences(values: Sequence[torch.Tensor], padding_value: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad 1-D tensors into `(N, L_max)` plus a `(N, L_max)` bool mask of the real entries."""
    padded = torch.nn.utils.rnn.pad_sequence(list(values), batch_first=True, padding_value=padding_value)
    lengths = torch.tensor([len(v) for v in values], device=padded.device)
    mask = torch.arange(padded.shape[1], device=padded.device)[None] < lengths[:, None]
    return padded, mask


def _same_forest_count_under_fsdp(model: torch.nn.Module, forests: int, device: torch.device) -> bool:
    """Whether `model` is FSDP2-sharded; if so, refuse (on every rank alike) ranks with different forest counts."""
    if not fsdp2_sharded(model):
        return False
    most, least = ranks_max([forests, -forests], device)
    if most != -least:
        raise NotImplementedError(
            f"Prefix reuse under FSDP: ranks laid their sequences out as {-least} to {most} "
            "forests (RoPE length classes), and every rank must run the same forwards. Give every rank sequences of "
            "the same length classes, or use prefix_reuse=False."
        )
    return True


def sequence_logprobs(
    model: torch.nn.Module,
    sequences: Sequence[TokenSequence],
    max_tokens_per_mb: int | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    prefix_reuse: bool = False,
    keep_graphs: int = 1,
) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Log p(tok_t | tok_<t) for t = 1..L-1 of every sequence, computing each shared prefix once.

    Args:
        model: a causal LM with `attn_implementation="tree_flex"`, on CPU (dense mask + SDPA) or CUDA (compiled
            FlexAttention), in train or eval mode.
        sequences: token-id sequences (lists or 1-D tensors).
        max_tokens_per_mb: token budget of one forward (a multiple of 128); `None` = one forward for all.
        temperature: logits are divided by it.
        return_entropy: also return per-token entropies.
        prefix_reuse: where the sequences' forest exceeds `max_tokens_per_mb`, run it as one forest in chunks of
            that many rows (`hf_tree_attn.prefix_reuse`) instead of micro-batches that each repeat the prefix they
            need: every shared prefix computed once, and a sequence longer than the budget scored in chunks. Costs
            a recompute (as activation checkpointing does) and the kept keys / values of the prefixes chunks share;
            refuses what `prefix_reuse_error` names (chunked attention, states it does not carry). Off by default.
        keep_graphs: with `prefix_reuse`, the last chunks whose forward graphs are kept for the backward instead of
            recomputed there (`chunked_forest_logprobs`); 1 by default.

    Returns:
        `logps` — `logps[i]` is `(len(sequences[i]) - 1,)` float32, differentiable; with `return_entropy`,
        `(logps, entropies)` of the same shapes.
    """
    check_tree_model(model)
    device = next(model.parameters()).device
    logps: list[torch.Tensor | None] = [None] * len(sequences)
    entropies: list[torch.Tensor | None] = [None] * len(sequences)
    splits = rope_split_lengths(unwrap_model(model).config)
    chunked = prefix_reuse and max_tokens_per_mb is not None
    sharded = False
    if chunked:
        from .prefix_reuse import chunked_forest_logprobs, prefix_reuse_error

        check_token_budget(max_tokens_per_mb)
        error = prefix_reuse_error(model)
        if error is not None:
            raise NotImplementedError(error)
        forests = pack_forest(sequences, split_lengths=splits, two_level=False)  # one per length class
        # Under FSDP2 every rank must run the same forwards: each forest in chunks (dummies even out the ranks'
        # chunk counts, `prefix_reuse._fsdp_dummies`), and as many forests on every rank.
        sharded = _same_forest_count_under_fsdp(model, len(forests), device)
    else:
        forests = pack_forest(sequences, max_tokens_per_mb=max_tokens_per_mb, split_lengths=splits)
    for forest in forests:
        forest = forest.to(device)
        if chunked and (forest.seq_len > max_tokens_per_mb or sharded):
            table, entropy_table = chunked_forest_logprobs(
                model, forest, max_tokens_per_mb, temperature=temperature, return_entropy=return_entropy,
                keep_graphs=keep_graphs,
            )  # fmt: skip
        else:
            table, entropy_table = forest_logprobs(
                model, forest, temperature=temperature, return_entropy=return_entropy
            )
        for seq_id, values in zip(forest.seq_ids, gather_sequences(forest, table)):
            logps[seq_id] = values
        if return_entropy:
            for seq_id, values in zip(forest.seq_ids, gather_sequences(forest, entropy_table)):
                entropies[seq_id] = values
    return (logps, entropies) if return_entropy else logps
