"""A prefix-reuse chunk's keys and values as one operator: compiled decoder layers run chunks without a graph break.

One chunk of a prefix-reuse forward (`hf_tree_attn.prefix_reuse`) attends over `[the keys of its context rows, kept
by earlier chunks; padding; its own keys]` (values alike). Where the context comes from is Python-side state of the
step: per-layer stores, the chunk that runs, the rows it keeps for later chunks, the gradients later chunks sent its
rows. A compiled graph must not freeze that state, and a graph break at every attention layer costs what compiling
gains (a checkpointed layer with a break runs wholly eager). So the attention function calls one custom operator,
opaque to the compiler, that reads the state when it runs:

    key, value = torch.ops.hf_tree_attn.chunk_context_kv(key, value, token, width)

- `key`, `value`: the chunk's own `(1, kv_heads, S, head_dim)`, after RoPE.
- `token`: a 0-dim int64 tensor naming the attention module (`module_token`): a tensor, so one graph serves every
  layer (a Python int would be a constant of the graph, compiled once per layer). It lives on the keys' device:
  inductor takes a graph's CPU tensor inputs as unaligned, and an opaque operator with an unaligned input as
  returning unaligned outputs, so a CPU token left FlexAttention reading the keys and values without its 16-byte
  alignment hint. The operator finds the module by the token's data pointer, so it never copies the token to the
  host.
- `width`: a `(P + fill,)` tensor, its length the chunk's context rows plus padding: the output's shape follows from
  the inputs', as the compiler's shape propagation needs, and varies with dynamic shapes rather than recompiling.
- returns `(1, kv_heads, P + fill + S, head_dim)` each: `ChunkContext.gather` (the chunk running, `running`).

Its backward is a second operator, `chunk_context_kv_grad`, which adds the context rows' gradients into the step's
float32 gradient store for the earlier chunks that computed them, and returns the own rows' gradients plus those
later chunks sent them (`ChunkContext.scatter`): a chunk's backward then starts from its outputs alone. Both run when
autograd reaches the layer, so where the model checkpoints its layers only the running layer's context is alive.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

__all__ = ["chunk_context_kv", "module_token", "running", "tag_modules"]

_TOKEN_ATTRIBUTE = "_tree_context_token"
_MODULES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # token's data pointer -> attention module
_RUNNING: list = []  # the ChunkContext of the chunk whose forward or backward runs (innermost last)


def module_token(module: torch.nn.Module, device: torch.device | str | None = None) -> torch.Tensor:
    """The 0-dim int64 tensor naming `module` to the operator, kept as a plain attribute; made anew on `device` where
    that is given and the token is elsewhere (CPU where none was made)."""
    token = getattr(module, _TOKEN_ATTRIBUTE, None)
    if token is None or (device is not None and token.device != torch.device(device)):
        with torch.inference_mode(False):  # made under inference mode, autograd could not save it later
            token = torch.zeros((), dtype=torch.int64, device=device)
        module.__dict__[_TOKEN_ATTRIBUTE] = token  # a plain attribute: not a buffer, not in a state dict
        _MODULES[token.data_ptr()] = module
    return token


def tag_modules(model: torch.nn.Module, device: torch.device | str | None = None) -> None:
    """Give every module of `model` its token on `device` (the keys') before a compiled layer is traced (a token made
    while tracing would be a side effect of the graph)."""
    for module in model.modules():
        module_token(module, device)


@contextlib.contextmanager
def running(context):
    """Within the block, the operator serves `context` (a `prefix_reuse.ChunkContext`)."""
    _RUNNING.append(context)
    try:
        yield
    finally:
        _RUNNING.pop()


def _context(token: torch.Tensor):
    if not _RUNNING:
        raise RuntimeError(
            "hf_tree_attn::chunk_context_kv ran outside a prefix-reuse chunk: call the model through "
            "`hf_tree_attn.prefix_reuse.chunked_forest_logprobs`, which runs each chunk."
        )
    module = _MODULES.get(token.data_ptr())
    if module is None:
        raise RuntimeError(
            f"hf_tree_attn::chunk_context_kv got a token (data pointer {token.data_ptr():#x}) that names no live "
            "module: pass the one `module_token` made (a copy of it names nothing)."
        )
    return _RUNNING[-1], module


@torch.library.custom_op("hf_tree_attn::chunk_context_kv", mutates_args=())
def chunk_context_kv(
    key: torch.Tensor, value: torch.Tensor, token: torch.Tensor, width: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[context; padding; own]` keys and values of the running chunk for the module `token` names (module
    docstring)."""
    context, module = _context(token)
    return context.gather(module, key, value, width.shape[0])


@chunk_context_kv.register_fake
def _(key, value, token, width):
    return tuple(t.new_empty(t.shape[0], t.shape[1], width.shape[0] + t.shape[2], t.shape[3]) for t in (key, value))


@torch.library.custom_op("hf_tree_attn::chunk_context_kv_grad", mutates_args=())
def chunk_context_kv_grad(
    grad_key: torch.Tensor, grad_value: torch.Tensor, token: torch.Tensor, width: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of the chunk's own keys and values `(1, kv_heads, S, head_dim)` from those of the operator's
    outputs; the context rows' go into the step's gradient store (module docstring)."""
    context, module = _context(token)
    return context.scatter(module, grad_key, grad_value, width.shape[0])


@chunk_context_kv_grad.register_fake
def _(grad_key, grad_value, token, width):
    return tuple(
        t.new_empty(t.shape[0], t.shape[1], t.shape[2] - width.shape[0], t.shape[3]) for t in (grad_key, grad_value)
    )


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[2], inputs[3])


def _backward(ctx, grad_key, grad_value):
    token, width = ctx.saved_tensors
    own_key, own_value = chunk_context_kv_grad(grad_key, grad_value, token, width)
    return own_key, own_value, None, None


chunk_context_kv.register_autograd(_backward, setup_context=_setup_context)
