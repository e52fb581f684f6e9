"""The seam to FSDP2's internals: the one thing prefix reuse needs from `fully_shard` that its public API lacks.

Prefix reuse runs one `torch.autograd.backward` per chunk from inside the loss's backward
(`hf_tree_attn.prefix_reuse`). Under FSDP2 each chunk's backward must be a backward pass of its own: FSDP2 gathers
a module's parameters in its pre-backward hook and reduce-scatters their gradients in its post-backward hook, and a
final callback, queued by the first pre-backward hook of a pass on that pass's autograd graph task, resets every
module's training state after it. Where the loss is an output of the FSDP2 root's own forward (TRL's fused LM head
computes it inside the model's `forward`), the root's pre-backward hook has already run when the chunks' backwards
start: it queued the callback on the outer graph task and marked the root as in its backward. FSDP2 then takes the
chunks' recomputes for activation checkpointing (it registers no hooks on them) and queues no callback for their
backwards, so after the first chunk no gradient is reduce-scattered; each rank keeps its own.

`separate_backward(model)` makes the enclosed backward a pass of its own: where an FSDP2 backward of `model` is under
way (its final callback queued), it marks every FSDP2 module idle and the callback unqueued, so the enclosed
backward's first pre-backward hook queues the callback on the enclosed graph task (which reduces every group's
gradients and resets every state when that backward ends); then it restores the outer pass's marks, and the outer
callback finds every gradient reduced already (FSDP2's `post_backward` is a no-op for a group without gradients).
Outside such a pass (the chunks called outside the model's forward, as GRPO does) it changes nothing.

`regather_outer_params(model)` gathers again, through FSDP2's public `unshard`, the parameters outside the decoder
layers before the backward of a chunk graph kept from the forward (a previous chunk's pass resharded them).

`FSDP2_INTERNALS` names every internal touched, with the torch versions it was read in; `tests/test_fsdp2_compat.py`
pins them against the installed torch, and a torch without them is refused with the reason.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["FSDP2_INTERNALS", "regather_outer_params", "separate_backward"]

# Internal -> the torch versions its module and meaning were read in.
FSDP2_INTERNALS = {
    "torch.distributed.fsdp.FSDPModule._get_fsdp_state": ("2.11", "2.13"),
    "FSDPState._state_ctx.all_states": ("2.11", "2.13"),
    "FSDPState._state_ctx.post_backward_final_callback_queued": ("2.11", "2.13"),
    "FSDPState._training_state": ("2.11", "2.13"),
    "torch.distributed.fsdp._fully_shard._fsdp_common.TrainingState.IDLE": ("2.11", "2.13"),
}


def _state_context(model: torch.nn.Module):
    """The state context every FSDP2 module of `model` shares, or None where none is sharded."""
    from torch.distributed.fsdp import FSDPModule

    module = next((m for m in model.modules() if isinstance(m, FSDPModule)), None)
    if module is None:
        return None
    try:
        context = module._get_fsdp_state()._state_ctx
        context.all_states, context.post_backward_final_callback_queued  # noqa: B018 - present, or refused below
    except AttributeError as error:
        versions = ", ".join(sorted({v for read_in in FSDP2_INTERNALS.values() for v in read_in}))
        raise NotImplementedError(
            f"Prefix reuse under FSDP2 needs FSDP2 internals that torch {torch.__version__} lacks ({error}); they "
            f"were read in torch {versions}. Use one of those, or train with tree_prefix_reuse=False."
        ) from error
    return context


@contextlib.contextmanager
def separate_backward(model: torch.nn.Module):
    """Run the enclosed forward and `torch.autograd.backward` as an FSDP2 pass of their own (see the module
    docstring); a no-op where `model` holds no FSDP2 module or no FSDP2 backward is under way."""
    context = _state_context(model)
    if context is None or not context.post_backward_final_callback_queued:
        yield
        return
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    saved = [(state, state._training_state) for state in context.all_states]
    for state, _ in saved:
        state._training_state = TrainingState.IDLE
    context.post_backward_final_callback_queued = False
    try:
        yield
    finally:
        context.post_backward_final_callback_queued = True
        for state, training_state in saved:
            state._training_state = training_state


def regather_outer_params(model: torch.nn.Module) -> None:
    """Gather again, before the backward of a graph kept from the forward, the parameters of the FSDP2 modules other
    than decoder layers (the embeddings, the final norm and LM head, the root), which the previous chunk's FSDP2 pass
    resharded at its end: the graph saved them in its forward, and the LM head's are read before any pre-backward
    hook of theirs runs. Each decoder layer's hook gathers its own. A collective every rank calls alike (the ranks
    run as many chunks, and keep the graphs of as many)."""
    from torch.distributed.fsdp import FSDPModule
    from transformers.modeling_layers import GradientCheckpointingLayer

    for module in model.modules():
        if isinstance(module, FSDPModule) and not isinstance(module, GradientCheckpointingLayer):
            module.unshard()
