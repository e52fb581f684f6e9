"""The seam to transformers' modeling modules: every function of theirs hf_tree_attn replaces, named once.

**What is replaced, and why.** transformers routes the sequence mixing of each state-carrying layer (gated delta
rule, Kimi delta rule, short convolution, Mamba-2) through module-level kernel functions of its modeling module,
which it resolves to flash-linear-attention, causal-conv1d, mamba-ssm or its own torch code
(`use_kernel_func_from_hub_with_fallback`), and it passes every model kwarg on to them, `tree_forest` included.
`install()` replaces those functions, in the modeling module of each layer class of `recurrent.TREE_LAYERS`, by a
dispatcher: without `tree_forest` it calls the function it replaced with the same arguments (ordinary forwards and
`generate` stay bit-identical, tested), with it the tree version runs (`hf_tree_attn.recurrent`). Per module:

- `causal_conv1d_fn` (every kind) → `recurrent.tree_causal_conv1d`;
- `torch_chunk_gated_delta_rule` (gated delta rule) and `chunk_kimi_delta_attention` (Kimi delta rule) →
  `recurrent.tree_delta_rule`;
- `mamba2_chunk_scan` (Mamba-2) → `recurrent.tree_mamba2_chunk_scan`, and `mamba2_split_conv1d_scan_combined` →
  None in a tree, which makes the mixer take its unfused path (the conv, then the scan);
- `create_recurrent_attention_mask` (imported there from `transformers.masking_utils`) → None for a FlexAttention
  `BlockMask`, from which transformers would read `.ndim` and fail (a tree holds no padding to zero).

`WRAPPED_FUNCTIONS` lists every target with the transformers versions its module and function were read in;
`tests/test_transformers_compat.py` pins the set against the installed transformers. The targets are explicit
names, not found by a pattern: a new family is a new `TREE_LAYERS` entry. The patterns of `hf_tree_attn.recurrent`
(a layer class's name, the source of a forward) belong to the gate; `install()` also records there
(`recurrent._UNAVAILABLE`) a layer whose forward does not pass the model kwargs to a function it would wrap, so
that the gate refuses the model rather than run that layer over the DFS row.

**When.** Not at `import hf_tree_attn`: `install()` (idempotent) runs when a model is checked for trees
(`support.tree_support_error`: `check_tree_model`, `sequence_logprobs`, every tree trainer) and when a
`PackedForest` is built. The second one is what makes every tree forward safe: the dispatchers act only on calls
that carry `tree_forest`, which is a `PackedForest`, so no such call can reach a function not yet replaced. And
none must: transformers' kernel wrapper passes on only the kwargs its implementation takes, so it would drop
`tree_forest` silently and the layer's state would run across branches. Neither the gate nor the attention code
alone would do: a forward of `TreeDataCollator`'s micro-batches need not pass the gate, a forest's ready-made
`dense_mask()` / `block_mask()` skips `tree_flex`'s mask function, and `tree_flex_attention` first runs after the
state-carrying layers placed before the first attention layer. Replacing the functions after a model is built is
enough because the layers look their kernels up as module globals at every call (no layer class keeps one on
`self`, in 5.17.0, 5.24.0 and 5.25.0; the per-layer copies of 5.25, below, are reached only through the module
global).

**What changed in 5.25.** Two things, both handled here:

- The layers no longer call `causal_conv1d_fn` and `mamba2_chunk_scan` from their forwards: they call the module's
  `causal_conv1d_forward` (the conv state of the cache, then `causal_conv1d_fn`) and `mamba2_scan_forward` (the
  recurrent state of the cache, then `mamba2_chunk_scan`), each passing the model kwargs on. `_REACHED_THROUGH`
  names these intermediate functions; `install()` checks that the layer passes the kwargs to the intermediate one and
  that it passes them to the target (a version whose chain breaks is refused by the gate, as before). The targets
  themselves, their arguments and what they compute are unchanged, so the tree versions are too.
- transformers now depends on the `kernels` package, whose `use_kernel_forward_from_hub` turns each decorated
  module-level function into a module instance (`Func`) that routes a call to a per-layer copy (which `kernelize`
  may swap for a Hub kernel). A module-level function may thus be such an instance; `kernel_function` gives the
  Python function behind it (transformers' own, with its resolved implementation), which the tree versions read and
  call. Without a tree the dispatchers call the instance itself, with the same arguments.

From 5.25 on `from_pretrained` also swaps Hub kernels in by default (`use_kernels` defaults to True there, so the flag
no longer says that the user asked for them): on devices `kernels`' mapping lists, a state-carrying layer's forward,
or the per-layer copy of a function its forward reaches, may be a Hub kernel the tree's dispatch does not see.
`hub_kernels_in` names the ones `kernels` swapped in (`kernels.get_kernelized_layers`, read in kernels 0.19.1), for
the gate to refuse. The flag alone refuses a hybrid too: `train()` and `eval()` kernelize the model again on the device
it is on then (the Trainer calls `train()` every step), so what is swapped in at the check does not bound what runs
later. A tree trainer turns them off on a hybrid it trains (`hub_kernels_off`), as it sets the attention.

One more change reaches compiled layers rather than these functions: the attention modules' `forward` is now
`kernels`' `use_kernelized_func` wrapper, whose Python side effect would break every checkpointed layer's graph under
`torch.compile` (`compile.checkpoint_side_effects_once`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.nn.attention.flex_attention import BlockMask

from . import recurrent

__all__ = [
    "TRANSFORMERS_CHECKED",
    "WRAPPED_FUNCTIONS",
    "WrappedFunction",
    "hub_kernels_in",
    "hub_kernels_off",
    "install",
    "kernel_function",
    "kernel_routing_kept",
]

TRANSFORMERS_CHECKED = "5.25.0"  # the release every target below was read in
_ALSO_READ = ("5.24.0",)  # releases every target was also read in
_GPU_IMAGE = "5.17.0"  # also read in, for the modules it has (from its wheel's source)
_NEWER_THAN_GPU_IMAGE = ("lfm3", "lara_mini", "bailing_hybrid")  # families added after 5.17.0

_RECURRENT_MASK = "create_recurrent_attention_mask"

# Target → the module-level function of the same modeling module through which the layers reach it, passing the
# model kwargs on (transformers 5.25; in 5.17 and 5.24 the layer forwards call the targets themselves).
_REACHED_THROUGH = {"causal_conv1d_fn": "causal_conv1d_forward", "mamba2_chunk_scan": "mamba2_scan_forward"}

# Function name → what its replacement does in a tree forward.
_DOES = {
    "causal_conv1d_fn": "the convolution over the DFS row, rows whose window crosses a branch redone from ancestors",
    "torch_chunk_gated_delta_rule": "the scan level by level, each segment from its parent segment's final state",
    "chunk_kimi_delta_attention": "the scan level by level, each segment from its parent segment's final state",
    "mamba2_chunk_scan": "the SSD scan level by level on zero-padded segments, each from its parent's final state",
    "mamba2_split_conv1d_scan_combined": "None, so that the mixer takes its unfused path (conv, then the scan)",
    _RECURRENT_MASK: "None for a BlockMask (a tree holds no padding to zero); the original otherwise",
}


@dataclass(frozen=True)
class WrappedFunction:
    """One transformers function `install()` replaces.

    module: the modeling module holding it (`transformers.models.<family>.modeling_<family>`).
    attribute: its module-level name there.
    layer: the layer class whose forward calls it with the model kwargs.
    does: what the replacement does when the call carries `tree_forest`.
    checked_on: the transformers releases in which the module and the function were read.
    tree_version: `tree_version(original, forest, *args, **kwargs)`, or None for `create_recurrent_attention_mask`.
    """

    module: str
    attribute: str
    layer: str
    does: str
    checked_on: tuple[str, ...]
    tree_version: Callable | None = field(default=None, repr=False, compare=False)


def _wrapped_functions() -> tuple[WrappedFunction, ...]:
    rows = []
    for path, kind in recurrent.TREE_LAYERS.items():
        module, layer = path.rsplit(".", 1)
        family = module.split(".")[2]
        checked = (*_ALSO_READ, TRANSFORMERS_CHECKED)
        if family not in _NEWER_THAN_GPU_IMAGE:
            checked = (_GPU_IMAGE, *checked)
        for attribute, tree_version in {**recurrent._TREE_KERNELS[kind], _RECURRENT_MASK: None}.items():
            rows.append(WrappedFunction(module, attribute, layer, _DOES[attribute], checked, tree_version))
    return tuple(rows)


WRAPPED_FUNCTIONS: tuple[WrappedFunction, ...] = _wrapped_functions()


@functools.cache
def kernel_function(function):
    """The Python function behind a module-level kernel function of a modeling module: `function` itself, or, for
    the module instance `kernels`' `use_kernel_forward_from_hub` makes of a decorated function (a dependency of
    transformers from 5.25 on), the function it calls when no Hub kernel was swapped in."""
    if isinstance(function, torch.nn.Module) and hasattr(function, "kernel_layer_name"):
        return inspect.getclosurevars(type(function).forward).nonlocals["func"]
    return function


def hub_kernels_in(model: torch.nn.Module, module_names: set[str]) -> list[str] | None:
    """Where `kernels` swapped a Hub kernel in (module names, `module:function` for a per-layer function copy) within
    the modules of `model` named in `module_names` or below them; None where this cannot be told (no `kernels`, or
    one without `get_kernelized_layers`)."""
    try:
        from kernels import get_kernelized_layers
    except ImportError:
        return None
    kernelized = get_kernelized_layers(model)
    found = [(name, name) for name in kernelized.layers]
    found += [(module, f"{module}:{function}") for module, function in kernelized.funcs]
    return [where for module, where in found if any(module == m or module.startswith(m + ".") for m in module_names)]


def hub_kernels_off(model: torch.nn.Module) -> bool:
    """Turn transformers' Hub kernels off for `model` (a PEFT model's base model): `use_kernels = False`, whose setter
    (`reset_kernels`, read in 5.25) puts transformers' own functions back wherever `kernels` swapped one in, and
    keeps `train()` / `eval()` from swapping them in again. True where they were on and are off now (without
    `kernels` transformers' reset leaves the flag on)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(base, "use_kernels", False):
        return False
    base.use_kernels = False
    return not base.use_kernels


@contextlib.contextmanager
def kernel_routing_kept():
    """Within the block, compiled forwards leave `kernels`' routing variable as they found it (read in kernels
    0.19.1; nothing to do without it).

    `use_kernelized_func`'s wrapper around an attention module's `forward` sets that variable (`_ACTIVE_KERNEL_FUNCS`,
    a global object's `global_var` and `uses_global_var` under compilation) and resets it in a `finally`. Dynamo
    (torch 2.13) replays the set and not the reset when the `try` block traces FlexAttention's higher-order
    operator: after the first compiled forward through a `BlockMask` the variable stays set, the layers' guard on it
    fails, and the second forward compiles every layer again. The state is put back as the eager wrapper leaves it."""
    try:
        from kernels._internals.layer.layer import _ACTIVE_KERNEL_FUNCS as routing
    except ImportError:
        routing = None
    fields = ("global_var", "uses_global_var")
    saved = (
        None
        if routing is None or not all(hasattr(routing, f) for f in fields)
        else [getattr(routing, f) for f in fields]
    )
    try:
        yield
    finally:
        for field, value in zip(fields, saved or ()):
            setattr(routing, field, value)


def _function_source(function) -> str:
    try:
        return inspect.getsource(inspect.unwrap(kernel_function(function)))
    except (OSError, TypeError):
        return ""


def _kwargs_break(module, entry: WrappedFunction) -> str | None:
    """Why the model kwargs do not reach `entry.attribute` from its layer's forward, or None when they do: called
    with `**kwargs` by the forward, or by the module function of `_REACHED_THROUGH` that the forward calls so."""
    cls = getattr(module, entry.layer, None)
    if cls is None:
        return f"this transformers' {entry.module} has no `{entry.layer}`"
    if recurrent._passes_kwargs(cls, entry.attribute):
        return None
    via = _REACHED_THROUGH.get(entry.attribute)
    if via is not None and recurrent._passes_kwargs(cls, via):
        if recurrent._calls_with_kwargs(_function_source(getattr(module, via, None)), rf"\b{entry.attribute}"):
            return None
        return (
            f"this transformers' `{via}` does not pass the model kwargs on to `{entry.attribute}`, so the tree cannot "
            "reach it"
        )
    return (
        f"this transformers' {entry.layer}.forward does not pass the model kwargs to `{entry.attribute}`, so the tree "
        "cannot reach it"
    )


def _tree_dispatch(original, tree_version):
    """`original` unless the call carries `tree_forest`; then `tree_version(original, forest, *args, **kwargs)`."""

    @functools.wraps(kernel_function(original))
    def dispatch(*args, **kwargs):
        forest = kwargs.pop("tree_forest", None)
        context = kwargs.pop("tree_context", None)
        if forest is None and context is not None:  # one chunk of a prefix-reuse forward
            forest = context.recurrent_rows(tree_version)
        if forest is None:
            return original(*args, **kwargs)
        return tree_version(original, forest, *args, **kwargs)

    dispatch.tree_original = original
    return dispatch


def _recurrent_mask_dispatch(original):
    """`create_recurrent_attention_mask` that returns None for a `BlockMask` (a tree: no padding to zero)."""

    @functools.wraps(original)
    def dispatch(*args, **kwargs):
        mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
        if isinstance(mask, BlockMask):
            return None
        return original(*args, **kwargs)

    dispatch.tree_original = original
    return dispatch


_installed = False


def install() -> None:
    """Replace every function of `WRAPPED_FUNCTIONS` by its dispatcher (idempotent; see the module docstring for
    when it runs). A module this transformers lacks, or a function its layer does not reach with the model kwargs,
    is recorded for the gate (`recurrent._UNAVAILABLE`) instead."""
    global _installed
    if _installed:
        return
    for entry in WRAPPED_FUNCTIONS:
        path = f"{entry.module}.{entry.layer}"
        try:
            module = importlib.import_module(entry.module)
        except ImportError as err:
            recurrent._UNAVAILABLE[path] = f"{entry.module} cannot be imported ({err})"
            continue
        current = getattr(module, entry.attribute, None)
        if current is None:
            if entry.tree_version is not None:
                recurrent._UNAVAILABLE[path] = (
                    f"this transformers' {entry.module} has no `{entry.attribute}` to run per segment"
                )
            continue
        if entry.tree_version is not None and (why := _kwargs_break(module, entry)) is not None:
            recurrent._UNAVAILABLE[path] = why
        if hasattr(current, "tree_original"):
            continue
        if entry.tree_version is None:
            setattr(module, entry.attribute, _recurrent_mask_dispatch(current))
        else:
            setattr(module, entry.attribute, _tree_dispatch(current, entry.tree_version))
    _installed = True
