"""What a tree forward reads from the model, checked before it runs, and the LM head as the model applies it.

- `check_forest_inputs`: a forest's token ids must index the model's embedding table, the forest must sit on the
  model's device and the temperature must be positive. Each mistake would otherwise surface as a raw `IndexError`
  (a device-side assert on CUDA), an `index_select` device error or a `ZeroDivisionError` deep inside the model.
- `lm_head_weight_and_bias`: the weight and bias the model's own forward multiplies the hidden states with, also
  when PEFT wraps the head (`trainable_token_indices` on a tied head swaps rows of the weight in its forward).
"""

from __future__ import annotations

import math
import numbers

import torch

__all__ = ["check_forest_inputs", "lm_head_weight_and_bias"]


def check_forest_inputs(model: torch.nn.Module, forest, temperature: float) -> None:
    """Raise a clear error if `forest` cannot go through `model` (unwrapped: the transformers model or PEFT model).

    Args:
        model: the model whose `get_input_embeddings()` the forest's tokens index.
        forest: the `PackedForest` about to be scored.
        temperature: the logits are divided by it.
    """
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not 0 < temperature < math.inf:
        raise ValueError(
            f"temperature={temperature!r}: the logits are divided by it, so it must be a finite number > 0 (1.0 "
            "scores the model's own distribution; TRL passes the sampling temperature). Greedy decoding has no "
            "temperature-0 log-probabilities to train on."
        )
    embedding = model.get_input_embeddings()
    param = next(embedding.parameters(), None)
    if param is None:
        return
    device = forest.input_ids.device
    # Sharded (DTensor) or offloaded (accelerate hooks) weights live elsewhere until the forward gathers them.
    placed = not _is_dtensor(param) and not hasattr(embedding, "_hf_hook")
    if placed and param.device != device:
        raise ValueError(
            f"The forest is on {device} but the model's embeddings are on {param.device}. Move the forest first: "
            f"`forest = forest.to({str(param.device)!r})` (sequence_logprobs does this for you; TreeDataCollator "
            f"builds micro-batches there with `device={str(param.device)!r}`)."
        )
    vocab_size = getattr(embedding, "num_embeddings", None) or param.shape[0]
    largest = int(forest.input_ids.max())
    if largest >= vocab_size:
        raise ValueError(
            f"Token id {largest} is out of range for the model's embedding table of {vocab_size} rows. The tokenizer "
            "and the model disagree: use the model's own tokenizer, or grow the table with "
            "`model.resize_token_embeddings(len(tokenizer))`."
        )


def lm_head_weight_and_bias(head: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(weight (vocab, hidden), bias (vocab,) | None)` exactly as `head`'s own forward applies them.

    A plain `nn.Linear` (or PEFT's `modules_to_save` wrapper, which resolves `.weight` / `.bias` to the active copy)
    gives its attributes. PEFT's `TrainableTokensWrapper` (`trainable_token_indices` with tied embeddings) gives
    the base weight with the trained rows copied in and no bias while an adapter is active — what its forward
    computes, `F.linear(x, merged_weight)` — and the base layer's weight and bias when adapters are disabled or
    merged (TRL's reference forward).
    """
    adapter = getattr(head, "token_adapter", None)
    if adapter is None:
        return head.weight, head.bias
    base = adapter.base_layer
    if adapter.disable_adapters or not adapter.active_adapters or adapter.merged:
        return base.weight, base.bias
    return adapter.get_merged_weights(adapter.active_adapters), None


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(tensor, DTensor)
