"""Accelerate's mixed-precision wrappers of a model's forward: see through them, and put them back around another.

Under `bf16=True` / `fp16=True`, `Accelerator.prepare_model` keeps the forward it found as `model._original_forward`
and replaces `model.forward` with two layers, outermost first::

    model.forward                  bound `convert_outputs_to_fp32.<locals>.forward`: calls its `__wrapped__`
      .__wrapped__                 `ConvertOutputsToFp32`: the outputs cast to float32, around `.model_forward`
        .model_forward             `torch.autocast(...)(f)`: `f` run inside that autocast (`__wrapped__` is `f`)
          .__wrapped__             `f`, the forward before `prepare` (unbound)

TRL's DPO trainer prepares a separate reference model inside its `__init__`, after `add_fused_lm_head` and before
the tree head can be installed, so TRL's fused forward is `f` there. `peel` finds `f` and the layers; `wrap` builds
the same layers (the same autocast instance) around another function, as `prepare` would have, so that function
runs under that autocast with its outputs cast to float32, like the forward it replaces.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["MixedPrecisionLayer", "peel", "wrap"]


@dataclass(frozen=True)
class MixedPrecisionLayer:
    """One of accelerate's layers: `autocast` set for an autocast decorator, None for the float32-output cast."""

    autocast: torch.autocast | None = None


def _autocast_of(func: Callable) -> torch.autocast | None:
    """The autocast instance a `torch.autocast(...)(f)` decorator runs `f` in (held in its closure), or None."""
    for cell in getattr(func, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, torch.autocast):
            return value
    return None


def peel(forward: Callable) -> tuple[Callable, tuple[MixedPrecisionLayer, ...]]:
    """`forward` (a model's bound forward, or a function) without accelerate's mixed-precision layers.

    Returns the innermost function (unbound: `self` is its first argument) and the layers peeled off it, outermost
    first; a forward accelerate did not wrap comes back as its function, with no layers. Nothing else is followed:
    TRL's fused forward and the tree head copy the model's `forward` with `functools.wraps`, so their `__wrapped__`
    is not a layer of accelerate's.
    """
    from accelerate.utils.operations import ConvertOutputsToFp32

    func, layers = getattr(forward, "__func__", forward), []
    while True:
        inner = getattr(func, "__wrapped__", None)
        if isinstance(inner, ConvertOutputsToFp32):
            layers.append(MixedPrecisionLayer())
            func = inner.model_forward
        elif inner is not None and (autocast := _autocast_of(func)) is not None:
            layers.append(MixedPrecisionLayer(autocast))
            func = inner
        else:
            return getattr(func, "__func__", func), tuple(layers)


def wrap(func: Callable, layers: tuple[MixedPrecisionLayer, ...]) -> Callable:
    """`func` inside `layers` (outermost first, as `peel` returns them), built as `Accelerator.prepare_model` builds
    them; bind the result to the model (`types.MethodType`)."""
    from accelerate.utils.operations import convert_outputs_to_fp32

    for layer in reversed(layers):
        func = convert_outputs_to_fp32(func) if layer.autocast is None else layer.autocast(func)
    return func
