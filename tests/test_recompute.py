"""Recompute only what memory needs: the activation model against what autograd really saves, the layer count
rule against its inequality, and exactness — gradients identical whichever layers recompute."""

from __future__ import annotations

import copy

import pytest
import torch
from test_grpo_trainer import _inputs, _loss_and_grads, _pair, tiny  # noqa: F401  (tiny: the model fixture)
from transformers import AutoModelForCausalLM, Qwen3Config

import hf_tree_attn
from hf_tree_attn.logprobs import _final_hidden_states, forest_forward_kwargs, forest_logprobs
from hf_tree_attn.recompute import activation_bytes, layers_to_checkpoint, recompute_only, spread


def _qwen3(layers: int, **overrides) -> torch.nn.Module:
    config = Qwen3Config(
        hidden_size=64, intermediate_size=160, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
        head_dim=16, vocab_size=128, initializer_range=0.1, **overrides,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="tree_flex").train()


def _saved_bytes(model, forest) -> int:
    """Bytes autograd keeps for the backward of one forward: each storage once, without the parameters and without
    the dense `(S, S)` mask SDPA copies per layer on the CPU (the GPU path reads one BlockMask)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    square = forest.seq_len**2
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params and tensor.numel() != square:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        _final_hidden_states(model, forest_forward_kwargs(forest, "cpu"))
    return sum(storages.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_bytes_match_what_autograd_saves(dtype):
    """One more decoder layer (eager HF Qwen3, no GQA so SDPA keeps k and v unrepeated, as the GPU kernel does) keeps
    what `activation_bytes` says per token, less the attention output's contiguous copy: the CPU kernel already
    returns it in the layout `o_proj` reads (FlexAttention does not)."""
    sequences = [[3 + i % 120 for i in range(200)], [3 + i % 120 for i in range(90)] + [9] * 60]
    (forest,) = hf_tree_attn.pack_forest(sequences)
    one, two = (_saved_bytes(_qwen3(n).to(dtype), forest) for n in (1, 2))
    per_layer = (two - one) / forest.seq_len
    whole, checkpointed = activation_bytes(_qwen3(1).config, dtype_bytes=dtype.itemsize)
    attention_output_copy = dtype.itemsize * 4 * 16
    assert per_layer == pytest.approx(whole - attention_output_copy, rel=0.01)
    assert checkpointed == dtype.itemsize * 64


def test_layers_to_checkpoint_is_the_fewest_that_fit():
    whole, kept, layers = 100, 4, 10

    def tree_memory(tokens, count):
        return tokens * (count * kept + (layers - count) * whole + (whole if count else 0))

    budget = lambda flat: flat * (layers * kept + whole)  # noqa: E731
    for tree, flat in [(100, 100), (10, 100), (30, 100), (60, 100), (1, 1000), (500, 100)]:
        count = layers_to_checkpoint(layers, tree, flat, whole, kept)
        fits = [c for c in range(layers + 1) if tree_memory(tree, c) <= budget(flat)]
        assert count == (fits[0] if fits else layers)
    assert layers_to_checkpoint(layers, 100, 100, whole, kept) == layers  # no sharing: recompute as flat does
    assert layers_to_checkpoint(layers, 1, 1000, whole, kept) == 0  # much sharing: no recompute at all
    counts = [layers_to_checkpoint(layers, t, 100, whole, kept) for t in range(1, 101)]
    assert counts == sorted(counts)  # more tree tokens, never fewer checkpointed layers


def test_spread():
    assert spread(6, 2) == [False, False, True, False, False, True]
    assert spread(4, 0) == [False] * 4 and spread(4, 4) == [True] * 4
    for n, k in [(28, 5), (36, 17), (7, 3)]:
        flags = spread(n, k)
        positions = [i for i, f in enumerate(flags) if f]
        assert len(positions) == k and max(b - a for a, b in zip([-1, *positions], positions)) <= -(-n // k)
    with pytest.raises(ValueError, match="count=5 must be between 0 and num_layers=4"):
        spread(4, 5)


def _grads_and_calls(model, forest, count):
    """Gradients of a weighted log-prob sum and how often each decoder layer ran, with `count` layers recomputing."""
    calls = [0] * len(model.model.layers)
    hooks = [
        layer.mlp.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
        for i, layer in enumerate(model.model.layers)
    ]
    model.zero_grad(set_to_none=True)
    weights = torch.linspace(-1, 1, forest.seq_len)
    with recompute_only(model, count):
        table, _ = forest_logprobs(model, forest)
    (table * weights).sum().backward()
    for hook in hooks:
        hook.remove()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, calls


def test_recompute_only_is_exact_and_recomputes_those_layers():
    sequences = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 11, 12], [5, 6, 13], [20, 21, 22, 23]]
    (forest,) = hf_tree_attn.pack_forest(sequences)
    model = _qwen3(4)
    reference, calls = _grads_and_calls(model, forest, None)  # no gradient checkpointing
    assert calls == [1, 1, 1, 1]
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for count, expected_calls in [(None, [2, 2, 2, 2]), (0, [1, 1, 1, 1]), (1, [1, 1, 1, 2]), (2, [1, 2, 1, 2])]:
        grads, calls = _grads_and_calls(model, forest, count)
        assert calls == expected_calls, count  # a checkpointed layer runs again in the backward
        for name, grad in reference.items():
            torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)  # same operations, same inputs
        assert all(layer.gradient_checkpointing for layer in model.model.layers)  # restored after the block


def test_trainer_auto_recompute_matches_all(tiny, tmp_path):  # noqa: F811
    """TreeGRPOTrainer with tree_recompute='auto' (no layer recomputes: the batch shares its prompts) gives exactly
    the loss and gradients of 'all' (every layer recomputes)."""
    results = {}
    for mode in ("all", "auto"):
        tree, flat = _pair(tiny, tmp_path, tree_recompute=mode)
        results[mode] = _loss_and_grads(tree, _inputs(tree, flat, tiny[1], beta=0.0, num_iterations=1))
        assert tree._metrics["train"]["tree_checkpointed_layers"] == ([] if mode == "all" else [0.0])
    torch.testing.assert_close(results["auto"][0], results["all"][0], rtol=0, atol=0)
    for name, grad in results["all"][1].items():
        torch.testing.assert_close(results["auto"][1][name], grad, rtol=0, atol=0, msg=name)
