"""Compiled decoder layers for tree forwards: regional `torch.compile` in place, a way back to eager, and a fallback.

Regional compilation compiles each repeated decoder layer once for all of them (and with dynamic shapes once for
every forest length): the elementwise work between the matmuls — norms, RoPE, SwiGLU, casts — fuses into a few
kernels. accelerate's `compile_regions` does it on a *copy* of the model's module tree, and the copy does not reach
tree forwards: TRL's trainers patch the model's `forward` (`trl.trainer.utils.add_fused_lm_head`) with a closure
that calls the original module's bound `forward` unless `fused_lm_head=True`, so a forward of the copy's root
without that flag runs the original, eager layers. Compiling each layer in place (`nn.Module.compile`, what
accelerate itself does under FSDP2 and DeepSpeed) reaches the layers whichever wrapper or patch a call comes
through, PEFT, FSDP2 and TRL's included, and keeps module identity (hooks, parameter names, state dicts unchanged).

    compile_decoder_layers(model, backend="inductor", dynamic=True)   # every decoder layer, in place
    with eager_layers(model): model.generate(...)                     # the same layers, uncompiled, inside
    call_compiled(model, lambda: model(**inputs))                     # compiled, or eager once it failed

A compiled layer that fails (a backend error, an op the compiler cannot trace) surfaces at the first forward that
compiles it; the backward is compiled at the same time (`force_non_lazy_backward_lowering`), so its failures surface
there too, before any gradient exists. `call_compiled` then runs the same forward eagerly: if that succeeds the
failure was the compiler's, the model's layers go back to eager for good and one warning names the error; if it
fails too, the eager error is raised (it is the model's, not the compiler's). With FlexAttention's FLASH backend on
(`HF_TREE_ATTN_FLEX_KERNEL_OPTIONS`), whose lowering is the likeliest to fail, a failure first turns that backend off
with one warning and runs the forward compiled again, on the Triton kernels. The eager forward runs once the failed
one's frames are gone: a failure inside a checkpointed layer can leave the checkpoint's saved-tensor hooks
pushed until then (torch 2.11), and the eager forward would save into them.

Checkpointed layers are traced with `checkpoint_side_effects_once()`: from transformers 5.25 on (which depends on the
`kernels` package) an attention module's `forward` is `kernels`' `use_kernelized_func` wrapper, which sets a
module-level routing variable before the layer's own `forward` and resets it after (under compilation an attribute
store on a global object). Dynamo refuses any such store inside a traced checkpoint, because eager checkpointing
replays a forward's side effects in the recompute, and breaks the layer's graph there: every checkpointed layer,
flat models' too. With torch's `skip_fwd_side_effects_in_bwd_under_checkpoint` the forward's side effects are kept
once and not replayed (accelerate sets it for its regional compilation under FSDP2). That is exact here: the
recompute is the traced graph (the same operations on the same inputs), and the wrapper's set and reset leave the
variable as they found it, so a replay would change nothing. The flag acts when a layer is traced, so it is set
around the package's forwards (`call_compiled`) and checkpoint settings (`recompute.recompute_only`) only, not for
the process. `call_compiled` also puts the variable back as it found it (`transformers_compat.kernel_routing_kept`):
where a layer's `try` block traces FlexAttention, dynamo replays the wrapper's set and not its reset, and the next
forward would compile every layer again.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
import weakref
from collections.abc import Callable
from typing import TypeVar

import torch

from .transformers_compat import kernel_routing_kept

__all__ = [
    "call_compiled",
    "checkpoint_side_effects_once",
    "compile_decoder_layers",
    "compiled_layers",
    "decoder_layers",
    "eager_layers",
]

T = TypeVar("T")

# Layer -> the torch.compile arguments it was compiled with (only layers this module compiled are tracked).
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Root module -> its decoder layers: looked up at every forward, found once (wrapping a model makes a new root).
_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The outermost decoder layers of `model` (transformers' `GradientCheckpointingLayer`s), through any wrapper
    (PEFT, DDP, FSDP2, DeepSpeed's engine), in module order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    if model not in _LAYERS:
        layers, stack = [], [model]
        while stack:
            module = stack.pop()
            if isinstance(module, GradientCheckpointingLayer):
                layers.append(module)
            else:
                stack.extend(reversed(list(module.children())))
        _LAYERS[model] = layers
    return _LAYERS[model]


def compile_decoder_layers(model: torch.nn.Module, **compile_kwargs) -> int:
    """Compile every decoder layer of `model` in place with `torch.compile(**compile_kwargs)`; returns how many.

    `nn.Module.compile` compiles the layer's call (its hooks and `forward`, gradient checkpointing included), so the
    layers keep their identity; with `inline_inbuilt_nn_modules` (torch's default) one graph serves every layer of a
    kind. Raises `ValueError` if `model` has no decoder layers."""
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no transformers decoder layers (GradientCheckpointingLayer) to compile."
        )
    for layer in layers:
        layer.compile(**compile_kwargs)
        _COMPILED[layer] = dict(compile_kwargs)
    return len(layers)


def compiled_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of `model` that `compile_decoder_layers` compiled and that still are."""
    return [layer for layer in decoder_layers(model) if layer in _COMPILED and layer._compiled_call_impl is not None]


@contextlib.contextmanager
def eager_layers(model: torch.nn.Module):
    """Within the block, the compiled decoder layers of `model` run eagerly (their compiled call is restored after).

    For forwards the compiled graphs are not made for: `generate` with its cache and one-token steps would compile
    graphs of their own (accelerate's regional compilation leaves generation eager too: it generates with the
    uncompiled original)."""
    layers = compiled_layers(model)
    saved = [layer._compiled_call_impl for layer in layers]
    for layer in layers:
        layer._compiled_call_impl = None
    try:
        yield
    finally:
        for layer, call in zip(layers, saved):
            layer._compiled_call_impl = call


def checkpoint_side_effects_once():
    """A context in which layers traced by torch.compile keep the Python side effects of a checkpointed forward once,
    not replayed in the backward (`skip_fwd_side_effects_in_bwd_under_checkpoint`): transformers' attention modules
    from 5.25 on set and reset `kernels`' routing variable, which would otherwise break every checkpointed layer's
    graph (module docstring)."""
    return torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)


def call_compiled(model: torch.nn.Module, forward: Callable[[], T]) -> T:
    """`forward()` (a forward of `model`), through its compiled layers; eagerly from the first compiler failure on.

    See the module docstring: a failure that the same forward run eagerly does not repeat turns the model's compiled
    layers off for good, with one warning naming the error; an error the eager forward repeats is raised. With
    FlexAttention's FLASH backend on, a failure first turns that backend off (one warning) and runs the forward
    compiled again, on the Triton kernels. Layers
    compiled by others (accelerate's `compile_regions`, a whole-model `torch.compile`) are traced with
    `checkpoint_side_effects_once()` too."""
    if not compiled_layers(model):
        with checkpoint_side_effects_once(), kernel_routing_kept():
            return forward()
    hooks = _saved_tensors_hooks()
    try:
        with (
            checkpoint_side_effects_once(),
            kernel_routing_kept(),
            torch._functorch.config.patch(force_non_lazy_backward_lowering=True),
        ):
            return forward()
    except Exception as error:
        cause = _root_cause(error)
    _release_failed_forward(hooks)
    if _drop_flash_backend():
        warnings.warn(
            f"The compiled decoder layers of {type(model).__name__} failed on FlexAttention's FLASH backend ({cause}, "
            f"{_attention().FLEX_KERNEL_OPTIONS_ENV}); tree attention runs on FlexAttention's Triton kernels "
            "from now on, in the same compiled layers. Unset the variable to start there.",
            stacklevel=2,
        )
        return call_compiled(model, forward)  # compiled again without it; eager from its own failure on
    with eager_layers(model):
        result = forward()  # raises if the model itself fails: then it was not the compiler
    for layer in compiled_layers(model):
        layer._compiled_call_impl = None
        _COMPILED.pop(layer, None)
    warnings.warn(
        f"The compiled decoder layers of {type(model).__name__} failed ({cause}); they run eagerly "
        "from now on. The results are the same, only slower. To start eager, set tree_compile=False (and no "
        "accelerate dynamo backend); to see the compiler's error in full, run with TORCH_LOGS=dynamo.",
        stacklevel=2,
    )
    return result


def _attention():
    """`hf_tree_attn.attention` (imported here: it is not needed to compile layers)."""
    from . import attention

    return attention


def _drop_flash_backend() -> bool:
    """Turn FlexAttention's FLASH backend off for tree attention if it is on (`attention.FLEX_KERNEL_OPTIONS`);
    whether it was. Its lowering is the compiled layers' likeliest failure, and without it they stay compiled on
    the Triton kernels, faster than eager layers on either."""
    attention = _attention()
    options = attention.FLEX_KERNEL_OPTIONS or {}
    if options.get("BACKEND") != "FLASH":
        return False
    kept = {key: value for key, value in options.items() if key != "BACKEND"}
    attention.FLEX_KERNEL_OPTIONS = kept or None
    return True


def _saved_tensors_hooks() -> tuple | None:
    """The innermost saved-tensor hooks autograd packs a forward's saved tensors with (None where there are none)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


def _release_failed_forward(hooks: tuple | None) -> None:
    """Let the failed forward's frames go before the eager forward runs, and check that the saved-tensor hooks are
    the ones the failed forward started with.

    A compiler failure inside a checkpointed layer raises out of `torch.utils.checkpoint.checkpoint`, whose
    non-reentrant path pushes its saved-tensor hooks from a generator; torch 2.11 does not close that generator
    when the forward raises (2.13 does), so its hooks stay pushed while the exception's frames hold the generator.
    The eager forward would then save its tensors into the dead checkpoint, and the backward fail with "A different
    number of tensors was saved during the original forward and recomputation". Collecting the frames closes the
    generator, which pops its hooks."""
    gc.collect()
    if _saved_tensors_hooks() != hooks:  # the same pack / unpack functions, or None both
        raise RuntimeError(
            "The compiled decoder layers failed inside an activation checkpoint that left its saved-tensor hooks "
            "installed, so an eager forward cannot run in their place. Set tree_compile=False (and no accelerate "
            "dynamo backend) to train with eager layers, and run with TORCH_LOGS=dynamo to see the compiler's error."
        )


def _root_cause(error: BaseException) -> str:
    """`Type: first line` of the innermost exception behind `error` (dynamo wraps a backend's own error)."""
    while (inner := getattr(error, "inner_exception", None) or error.__cause__) is not None:
        error = inner
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
