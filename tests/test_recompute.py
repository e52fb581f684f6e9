"""Recompute only what memory needs: the activation model against what autograd really saves, the layer count
rule against its inequality, and exactness — gradients identical whichever layers recompute."""

from __future__ import annotations

import copy

import pytest
import torch
from test_coverage import FAMILIES, tiny_config
from test_grpo_trainer import _inputs, _loss_and_grads, _pair, tiny  # noqa: F401  (tiny: the model fixture)
from transformers import AutoModelForCausalLM, Qwen3Config
from transformers.modeling_layers import GradientCheckpointingLayer

import hf_tree_attn
from hf_tree_attn.logprobs import _final_hidden_states, forest_forward_kwargs, forest_logprobs
from hf_tree_attn.recompute import (
    activation_bytes,
    attention_output_bytes,
    checkpoint_count,
    checkpoint_fits,
    keeps_attention,
    layers_to_checkpoint,
    recompute_only,
    spread,
    unpriced_reason,
)
from hf_tree_attn.support import EXACT_FAMILIES


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


@pytest.mark.parametrize("prefix_kernels", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_bytes_match_what_autograd_saves(dtype, prefix_kernels, monkeypatch):
    """One more decoder layer (eager HF Qwen3, no GQA so SDPA keeps k and v unrepeated, as the GPU kernel does) keeps
    what `activation_bytes` says per token, less the contiguous copy of the attention output the formula also prices
    (FlexAttention returns `(1, heads, S, head_dim)` laid out as such, and `o_proj` reads a copy). The forest is
    two-level, so its attention runs through the shared-prefix kernels, which return the layout `o_proj` reads, as
    CPU's SDPA does with them off: neither keeps that copy."""
    monkeypatch.setattr(hf_tree_attn.prefix_attention, "MODE", "auto" if prefix_kernels else "never")
    sequences = [[3 + i % 120 for i in range(200)], [3 + i % 120 for i in range(90)] + [9] * 60]
    (forest,) = hf_tree_attn.pack_forest(sequences)
    assert forest.prefix_plan is not None
    one, two = (_saved_bytes(_qwen3(n).to(dtype), forest) for n in (1, 2))
    per_layer = (two - one) / forest.seq_len
    whole, checkpointed = activation_bytes(_qwen3(1).config, dtype_bytes=dtype.itemsize)
    attention_output_copy = dtype.itemsize * 4 * 16
    assert per_layer == pytest.approx(whole - attention_output_copy, rel=0.01)
    assert checkpointed == dtype.itemsize * 64


@pytest.mark.parametrize("attention", [0, 3])
def test_layers_to_checkpoint_is_the_fewest_that_fit(attention):
    whole, kept, layers = 100, 4, 10

    def tree_memory(tokens, count):  # the tree's checkpointed layers keep `attention` more than flat's
        return tokens * (count * (kept + attention) + (layers - count) * whole + (whole if count else 0))

    budget = lambda flat: flat * (layers * kept + whole)  # noqa: E731
    for tree, flat in [(100, 100), (10, 100), (30, 100), (60, 100), (1, 1000), (500, 100), (20, 100)]:
        count = layers_to_checkpoint(layers, tree, flat, whole, kept, attention)
        fits = [c for c in range(layers + 1) if tree_memory(tree, c) <= budget(flat)]
        assert count == (fits[0] if fits else layers)
    assert layers_to_checkpoint(layers, 100, 100, whole, kept) == layers  # no sharing: recompute as flat does
    assert layers_to_checkpoint(layers, 1, 1000, whole, kept) == 0  # much sharing: no recompute at all
    counts = [layers_to_checkpoint(layers, t, 100, whole, kept) for t in range(1, 101)]
    assert counts == sorted(counts)  # more tree tokens, never fewer checkpointed layers


@pytest.mark.parametrize("attention", [0, 3])
def test_activation_budget_only_lowers_the_count(attention):
    """`budget_bytes` (`tree_activation_budget_gib`): the fewest checkpointed layers whose activations fit in it, where
    it is more than flat's; below flat's it changes nothing."""
    whole, kept, layers, tree, flat = 100, 4, 10, 100, 100  # no sharing: flat's bound recomputes every layer
    default = layers_to_checkpoint(layers, tree, flat, whole, kept, attention)
    assert default == layers
    assert layers_to_checkpoint(layers, tree, flat, whole, kept, attention, budget_bytes=1) == default
    memory = [tree * (c * (kept + attention) + (layers - c) * whole + (whole if c else 0)) for c in range(layers + 1)]
    for budget in range(0, tree * (layers + 1) * whole + 1, 997):
        count = layers_to_checkpoint(layers, tree, flat, whole, kept, attention, budget_bytes=budget)
        fits = [c for c in range(layers + 1) if memory[c] <= max(budget, flat * (layers * kept + whole))]
        assert count == (fits[0] if fits else layers)
    assert layers_to_checkpoint(layers, tree, flat, whole, kept, attention, budget_bytes=tree * layers * whole) == 0


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


def _kernel_calls(monkeypatch) -> list[int]:
    """A counter of the shared-prefix kernels' dense calls (forward only)."""
    calls, original = [0], hf_tree_attn.prefix_attention._forward

    def counted(*args):
        calls[0] += 1
        return original(*args)

    monkeypatch.setattr(hf_tree_attn.prefix_attention, "_forward", counted)
    return calls


def _path_calls(monkeypatch) -> list[int]:
    """Every forest's plain causal layers through the gathered paths (`varlen_attention.path_attention`, on its CPU
    stand-in kernel): returns the count of its kernel's forward calls."""
    import hf_tree_attn.attention
    from hf_tree_attn import varlen_attention

    calls = [0]

    class Counting:
        def forward(self, *args):
            calls[0] += 1
            return varlen_attention.REFERENCE.forward(*args)

        def backward(self, *args):
            return varlen_attention.REFERENCE.backward(*args)

    monkeypatch.setattr(varlen_attention, "_path_kernel", lambda query: Counting())
    monkeypatch.setattr(hf_tree_attn.attention, "prefix_serves", lambda forest, device_type: False)
    monkeypatch.setattr(hf_tree_attn.attention, "path_serves", lambda forest, device_type: True)
    return calls


@pytest.mark.parametrize("route", ["shared_prefix", "gathered_paths"])
@pytest.mark.parametrize("compiled", [False, True])
def test_keep_attention_is_exact_and_runs_no_attention_twice(compiled, route, monkeypatch):
    """Checkpointed layers that keep the kernels' outputs (the shared-prefix kernels', or the gathered paths') give
    the gradients of no checkpointing, bit for bit (what they keep is what the forward computed), and their backward
    runs no attention again; recomputed whole, each checkpointed layer's attention runs twice. Compiled: regional
    compile (aot_eager) with `BlockMask`s, as CUDA builds them, where the checkpoint and its `context_fn` are traced
    into the layer's graph, unbroken."""
    from accelerate.utils import compile_regions
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    sequences = [[3 + i % 120 for i in range(60)] + [7, 8, 9, i] for i in range(4)]
    if route == "gathered_paths":  # a deeper forest: the two-level kernels do not take it
        sequences += [[3 + i % 120 for i in range(60)] + [7, 8, 10, 11, i] for i in range(2)]
    (forest,) = hf_tree_attn.pack_forest(sequences)
    assert (forest.prefix_plan is not None) == (route == "shared_prefix")
    assert forest.path_plan is not None  # built before the layers, as `path_serves` does where the route serves
    kwargs = forest_forward_kwargs(forest, "cpu")
    if compiled:
        kwargs["attention_mask"] = forest.attention_mask("cpu", dense=False)
    calls = _kernel_calls(monkeypatch) if route == "shared_prefix" else _path_calls(monkeypatch)
    weights = torch.linspace(-1, 1, forest.seq_len)[None, :, None]

    def run(model, count, keep):
        model.zero_grad(set_to_none=True)
        calls[0] = 0
        with recompute_only(model, count, keep_attention=keep):
            logits = model(**kwargs).logits
        (logits * weights).sum().backward()
        return calls[0], {n: p.grad.clone() for n, p in model.named_parameters()}

    model = _qwen3(4)
    model = compile_regions(model, backend="aot_eager") if compiled else model
    per_forward, reference = run(model, None, False)  # no gradient checkpointing
    assert per_forward > 0
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert keeps_attention(model)
    for count, keep, expected in [(2, True, per_forward), (4, True, per_forward), (2, False, per_forward * 3 // 2)]:
        runs, grads = run(model, count, keep)
        assert runs == expected, (count, keep)
        for name, grad in reference.items():
            torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compiled", [False, True])
def test_keep_attention_on_cuda(compiled, monkeypatch):
    """On CUDA (cuDNN kernels, bf16; compiled: regional inductor), checkpointed layers that keep the kernels' outputs
    run no attention in the backward and give the gradients of no checkpointing within bf16 rounding, as close as
    whole-layer recompute does. cuDNN's attention backward sums dQ in float32 in no fixed order, so two runs without
    checkpointing already differ: by 2 bf16 units of the largest gradient (8 at 956) on 16,554 entries, measured on
    the H200. The bound is twice the larger of that run-to-run spread and whole-layer recompute's error, or 4 units
    of the largest entry (2^-6); anything kept wrongly is off by the gradients' own size."""
    from accelerate.utils import compile_regions

    monkeypatch.setattr(hf_tree_attn.prefix_attention, "MODE", "always")
    sequences = [[3 + i % 120 for i in range(300)] + [7, 8, 9, i] * 5 for i in range(4)]
    (forest,) = hf_tree_attn.pack_forest(sequences)
    kwargs = forest_forward_kwargs(forest, "cuda")
    calls = _kernel_calls(monkeypatch)
    weights = torch.linspace(-1, 1, forest.seq_len, device="cuda")[None, :, None]
    model = _qwen3(4).to("cuda", torch.bfloat16)
    model = compile_regions(model) if compiled else model

    def run(count, keep):
        model.zero_grad(set_to_none=True)
        calls[0] = 0
        with recompute_only(model, count, keep_attention=keep):
            logits = model(**kwargs).logits.float()
        (logits * weights).sum().backward()
        return calls[0], torch.cat([p.grad.float().flatten() for p in model.parameters()])

    (per_forward, reference), (_, again) = run(None, False), run(None, False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    (kept_calls, kept), (whole_calls, whole) = run(4, True), run(4, False)
    assert (kept_calls, whole_calls) == (per_forward, 2 * per_forward)
    spread = max((again - reference).abs().max(), (whole - reference).abs().max())
    assert (kept - reference).abs().max() <= max(2 * spread, 2**-6 * reference.abs().max())


def test_keeps_attention_only_with_a_plain_non_reentrant_checkpoint():
    """Attention is kept only through transformers' own non-reentrant checkpoint (`context_fn` needs it); the
    function the layers get is the same object every time (compiled layers guard on it) and is given back after."""
    model = _qwen3(2)
    assert not keeps_attention(model)  # no gradient checkpointing
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert not keeps_attention(model)
    with pytest.raises(ValueError, match="non-reentrant checkpoint"), recompute_only(model, 1, keep_attention=True):
        pass
    own = {"use_reentrant": False, "context_fn": torch.utils.checkpoint.noop_context_fn}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=own)
    assert not keeps_attention(model)  # the user's own context_fn wins
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert keeps_attention(model)
    original = [layer._gradient_checkpointing_func for layer in model.model.layers]
    seen = []
    for _ in range(2):
        with recompute_only(model, 2, keep_attention=True):
            seen.append([layer._gradient_checkpointing_func for layer in model.model.layers])
    assert seen[0][0] is seen[1][0] and seen[0][0] is not original[0]
    assert seen[0][0].keywords["use_reentrant"] is False and "context_fn" in seen[0][0].keywords
    assert [layer._gradient_checkpointing_func for layer in model.model.layers] == original


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_attention_priced_as_the_kernels_output(dtype):
    """What a checkpointed layer that keeps its attention keeps more per token (`attention_output_bytes`) is the
    size of the kernels' op output (the attention output and its log-sum-exp) per row, at Qwen3-1.7B's heads."""
    config = Qwen3Config(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8,
                         head_dim=128)  # fmt: skip
    (forest,) = hf_tree_attn.pack_forest([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7]])
    size = forest.seq_len
    q = torch.randn(1, 16, size, 128, dtype=dtype)
    k, v = (torch.randn(1, 8, size, 128, dtype=dtype) for _ in range(2))
    outputs = torch.ops.hf_tree_attn.prefix_attention(q, k, v, forest.prefix_plan, 128**-0.5)
    assert attention_output_bytes(config, dtype.itemsize) * size == sum(t.nbytes for t in outputs)


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


@pytest.mark.parametrize("served", [False, True])
def test_the_policy_forward_keeps_attention_where_the_gathered_paths_serve(served, monkeypatch):
    """The trainers' recompute plan keeps attention for a forest the two-level kernels do not take (a deeper one) just
    where the gathered paths serve it (FlashAttention-4 on CUDA: `varlen_attention.path_serves`)."""
    from types import SimpleNamespace

    from hf_tree_attn.trainer import forest_step

    model = _qwen3(2)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    (forest,) = hf_tree_attn.pack_forest([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6]])
    assert forest.prefix_plan is None
    monkeypatch.setattr(forest_step, "path_serves", lambda forest, device_type: served)
    args = SimpleNamespace(tree_recompute="auto", tree_activation_budget_gib=None, gradient_checkpointing=True)
    _, keep, metrics = forest_step.plan_recompute(args, model, "cuda", [forest], 4 * forest.seq_len, unpriced="")
    assert keep is served and metrics["tree_kept_attention"] == float(served)


def test_trainer_keeps_attention_exactly(tiny, tmp_path, monkeypatch):  # noqa: F811
    """`TreeGRPOTrainer`, `tree_recompute="auto"`, on a two-level batch (prompts and completions that start apart):
    the kernels serve it, so the layers `auto` recomputes (one, forced: the tiny batch needs none) keep their
    attention and run no kernel again in the backward; loss and gradients are exactly those of "all"."""
    import test_grpo_trainer

    from hf_tree_attn.trainer import forest_step

    monkeypatch.setattr(test_grpo_trainer, "PROMPTS", ["id 1. letter: a", "xy 22. letter: b"])
    completions = ["abc", "bca", "cab", "dd", "ab", "ba", "c", "d"]
    monkeypatch.setattr(test_grpo_trainer, "COMPLETIONS", [(text, True, False) for text in completions])
    monkeypatch.setattr(forest_step, "checkpoint_count", lambda *args, **kwargs: 1)
    calls = _kernel_calls(monkeypatch)
    results = {}
    for mode in ("all", "auto"):
        tree, flat = _pair(tiny, tmp_path, tree_recompute=mode)
        inputs = _inputs(tree, flat, tiny[1], beta=0.0, num_iterations=1)
        calls[0] = 0
        results[mode] = _loss_and_grads(tree, inputs)
        results[mode + " calls"] = calls[0]
        metrics = tree._metrics["train"]
        assert metrics["tree_kept_attention"] == ([] if mode == "all" else [1.0])
    assert results["auto calls"] * 2 == results["all calls"] > 0  # "all": each of the 2 layers runs its kernel twice
    torch.testing.assert_close(results["auto"][0], results["all"][0], rtol=0, atol=0)
    for name, grad in results["all"][1].items():
        torch.testing.assert_close(results["auto"][1][name], grad, rtol=0, atol=0, msg=name)


def _saved_bytes_per_layer(model, forest) -> list[float]:
    """Bytes per tree token each decoder layer saves for the backward in a tree forward: storages first saved inside
    that layer, without the parameters, without what the layer was handed (its input, the rotary tables, the masks:
    counted once per forward, not per layer) and without the dense `(S, S)` masks SDPA copies on the CPU."""
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    seen = {p.untyped_storage().data_ptr() for p in model.parameters()}
    square, current, totals = forest.seq_len**2, [], dict.fromkeys(layers, 0)

    def handed(args, kwargs):
        for value in [*args, *kwargs.values()]:
            for t in value if isinstance(value, (tuple, list)) else [value]:
                if isinstance(t, torch.Tensor):
                    seen.add(t.untyped_storage().data_ptr())

    def pack(tensor):
        storage = tensor.untyped_storage()
        if current and storage.data_ptr() not in seen and tensor.numel() % square:
            seen.add(storage.data_ptr())
            totals[current[-1]] += storage.nbytes()
        return tensor

    def enter(module, args, kwargs):
        handed(args, kwargs)
        current.append(module)

    hooks = [m.register_forward_pre_hook(enter, with_kwargs=True) for m in layers]

    def leave(*_):
        current.pop()

    hooks += [m.register_forward_hook(leave) for m in layers]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            _final_hidden_states(model, forest_forward_kwargs(forest, "cpu"))
    finally:
        for hook in hooks:
            hook.remove()
    return [totals[m] / forest.seq_len for m in layers]


@pytest.mark.parametrize("model_type", [f for f in FAMILIES if f in EXACT_FAMILIES])
def test_activation_bytes_bound_every_layer_it_prices(model_type):
    """For every family trees accept (tiny bf16 configs of the coverage matrix): where `activation_bytes` prices the
    layers, no layer saves more per token than its `whole`; where it does not (experts, latent attention, recurrent
    mixers, four norms), it raises and the trainer recomputes every layer. Before the check existed, Gemma 3,
    the MLA and MoE families and the hybrids saved up to 15x the formula."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        tiny_config(model_type), attn_implementation="tree_flex", dtype=torch.bfloat16
    ).train()
    text_config = model.config.get_text_config()
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    unpriced = [m for m in layers or [None] if unpriced_reason(text_config, m) is not None]
    if unpriced:
        with pytest.raises(NotImplementedError, match="does not price"):
            activation_bytes(text_config, decoder_layer=unpriced[0])
        return
    vocab = text_config.vocab_size
    sequences = [[3 + i % 50 for i in range(96)], [3 + i % 50 for i in range(40)] + [9 % vocab] * 30]
    (forest,) = hf_tree_attn.pack_forest(sequences)
    whole, _ = activation_bytes(text_config, dtype_bytes=2)
    saved = _saved_bytes_per_layer(model, forest)
    assert max(saved) <= whole, f"{model_type}: a layer saves {max(saved):.0f} B/token, activation_bytes says {whole}"


@pytest.mark.parametrize("model_type, priced", [("qwen3", True), ("gpt2", False), ("qwen3_moe", False)])
def test_trainer_auto_recompute_on_unpriced_layers_recomputes_all(model_type, priced):
    """`TreeGRPOTrainer`'s `tree_recompute="auto"` on a model whose layers `activation_bytes` does not price (GPT-2
    has no `intermediate_size`: this crashed at the first policy forward; Qwen3-MoE's experts keep more than the
    formula) leaves every layer checkpointed and logs `tree_checkpointed_layers` = 1; priced layers get a count."""
    from collections import defaultdict
    from types import SimpleNamespace

    from hf_tree_attn.trainer import TreeGRPOTrainer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type), attn_implementation="tree_flex").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    (forest,) = hf_tree_attn.pack_forest([[1, 2, 3, 4] * 8 + [5], [1, 2, 3, 4] * 8 + [6, 7]])
    trainer = SimpleNamespace(
        args=SimpleNamespace(
            tree_recompute="auto", tree_activation_budget_gib=None, gradient_checkpointing=True, bf16=False, fp16=False
        ),
        model=model,
        accelerator=SimpleNamespace(unwrap_model=lambda m: m, device=torch.device("cpu")),
        _metrics={"train": defaultdict(list)},
        _unpriced=None,
        _lockstep=lambda: False,  # one process: no rank to agree with
        _prefix_reuse_rows=None,  # tree_prefix_reuse off
    )
    count, keep = TreeGRPOTrainer._layers_to_checkpoint(trainer, [SimpleNamespace(forest=forest)])
    logged = trainer._metrics["train"]["tree_checkpointed_layers"]
    if priced:  # a two-level forest on the CPU: the kernels serve it, so checkpointed layers keep their outputs
        assert isinstance(count, int) and logged == [count / model.config.num_hidden_layers] and keep
    else:
        assert count is None and logged == [1.0] and trainer._unpriced and not keep


def test_trainer_activation_budget_lowers_the_count():
    """`tree_activation_budget_gib`: a forest that shares nothing recomputes every layer under flat's bound, none
    under a budget that holds all its layers, and as under flat's bound with a budget below flat's."""
    from collections import defaultdict
    from types import SimpleNamespace

    from hf_tree_attn.trainer import TreeGRPOTrainer

    model = _qwen3(4)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    (forest,) = hf_tree_attn.pack_forest([[1, 2, 3, 4] * 8, [5, 6, 7] * 9])
    whole, _ = activation_bytes(model.config, dtype_bytes=4)
    all_layers = forest.seq_len * whole * model.config.num_hidden_layers / 2**30

    def count(budget):
        trainer = SimpleNamespace(
            args=SimpleNamespace(tree_recompute="auto", tree_activation_budget_gib=budget, gradient_checkpointing=True,
                                 bf16=False, fp16=False),
            model=model,
            accelerator=SimpleNamespace(unwrap_model=lambda m: m, device=torch.device("cpu")),
            _metrics={"train": defaultdict(list)},
            _unpriced=None,
            _lockstep=lambda: False,  # one process: no rank to agree with
            _prefix_reuse_rows=None,  # tree_prefix_reuse off
        )  # fmt: skip
        return TreeGRPOTrainer._layers_to_checkpoint(trainer, [SimpleNamespace(forest=forest)])[0]

    assert count(None) == 4
    assert count(all_layers / 1000) == 4
    assert count(all_layers) == 0
    assert 0 < count(all_layers * 0.6) < 4  # a checkpointed layer keeps far less than a whole one


def test_checkpoint_fits_tells_a_fit_from_no_fit():
    """`checkpoint_count` answers every layer both when all of them fit and when nothing does; `checkpoint_fits`
    tells the two apart, and agrees with the count wherever the count is below every layer."""
    config = _qwen3(4).config
    whole, _ = activation_bytes(config, dtype_bytes=2)
    for tree_tokens, flat_tokens in [(100, 100), (100, 400), (400, 100), (128, 1000), (1000, 1000)]:
        for keep in (False, True):
            count = checkpoint_count(config, tree_tokens, flat_tokens, keep_attention=keep)
            fits = checkpoint_fits(config, tree_tokens, flat_tokens, count, keep_attention=keep)
            if count < config.num_hidden_layers:
                assert fits
            if count > 0:
                assert not checkpoint_fits(config, tree_tokens, flat_tokens, count - 1, keep_attention=keep)
    # Every layer checkpointed, each keeping its attention output: never within the same tokens' every-layer bound,
    # within a budget that holds it.
    layers = config.num_hidden_layers
    assert not checkpoint_fits(config, 1000, 1000, layers, keep_attention=True)
    assert checkpoint_fits(config, 1000, 1000, layers, keep_attention=True, budget_gib=1000 * layers * whole / 2**30)
