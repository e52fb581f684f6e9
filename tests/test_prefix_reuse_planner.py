"""The prefix-reuse planner (`hf_tree_attn.reuse_planner`): its estimate against a hand count of the kept rows and
against what the chunked run really stores, the chosen chunk size against a brute force over every size, the error
when nothing fits, and a trainer whose chunks it sizes against the same trainer on one forest."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from test_chunked import _edge_cases, _trie
from test_grpo_trainer import _assert_same, _config, _loss_and_grads, tiny  # noqa: F401  (tiny: the model fixture)
from test_prefix_reuse_trainers import SYSTEM, _group_inputs, _grpo, _prompts, chunked_calls  # noqa: F401
from transformers import AutoModelForCausalLM, Qwen3Config
from transformers.modeling_layers import GradientCheckpointingLayer

from hf_tree_attn import pack_forest
from hf_tree_attn import prefix_reuse as prefix_reuse_module
from hf_tree_attn.chunked import plan_chunks
from hf_tree_attn.prefix_reuse import kept_kv_bytes
from hf_tree_attn.recompute import activation_bytes
from hf_tree_attn.reuse_planner import budget_error, plan_prefix_reuse, reuse_estimate
from hf_tree_attn.trainer import TreeGRPOConfig

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16


def _model(dtype=torch.float32, checkpointing: bool = False, num_key_value_heads: int = KV_HEADS) -> torch.nn.Module:
    config = Qwen3Config(
        hidden_size=64, intermediate_size=160, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=num_key_value_heads, head_dim=HEAD_DIM, vocab_size=128, initializer_range=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="tree_flex").to(dtype)
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def _forest(sequences):
    (forest,) = pack_forest(sequences, two_level=False)
    return forest


TINY = [[5, 6, 7, 8], [5, 6, 9]]  # the picture of hf_tree_attn.tree and the planner's docstring
FORESTS = {"tiny": TINY, "trie": _trie(4, seed=3), "edge": _edge_cases()}


def _oracle(model, forest, chunk_rows: int, block: int, kv_dtype: torch.dtype):
    """The estimate from the plan itself: kept rows counted by hand (rows x layers x 2 x kv_heads x head_dim x
    bytes), each chunk's context and own kept rows from `plan_chunks`, its rows and its context (at least 2 rows)
    padded to the block by hand."""
    plan = plan_chunks(forest, chunk_rows)
    row = LAYERS * 2 * KV_HEADS * HEAD_DIM
    kept = len(plan.kept_rows)
    weights = next(model.parameters()).element_size()
    whole, checkpointed = activation_bytes(model.config, dtype_bytes=weights)
    checkpointing = any(m.gradient_checkpointing for m in model.modules() if isinstance(m, GradientCheckpointingLayer))
    per_token = LAYERS * checkpointed + whole if checkpointing else LAYERS * whole
    peaks = []
    for c in range(plan.num_chunks):
        a, b = plan.bounds[c], plan.bounds[c + 1]
        padded = -(-(b - a) // block) * block
        own = int((plan.slot[a:b] >= 0).sum())
        # Context: the layers not checkpointed keep it (concatenated with their own keys), the one running in the
        # backward holds it gathered, concatenated, its gradient (in the keys' dtype) and that at float32 width.
        per_layer = row // LAYERS
        kept_by_layers = (0 if checkpointing else LAYERS) * per_layer * kv_dtype.itemsize
        running = 3 * per_layer * kv_dtype.itemsize + per_layer * 4
        width = -(-max(len(plan.context[c]), 2) // block) * block  # padded as the run pads it
        context = width * (kept_by_layers + running) + 2 * own * row * kv_dtype.itemsize
        peaks.append((padded * per_token, context))
    activations, context = max(peaks, key=sum)
    return activations, context, kept * row * kv_dtype.itemsize, kept * row * 4


# ----------------------------------------------------------------------------------------------------------------
# The estimate


def test_docstring_example():
    """Chunks of 2 keep rows 0 and 1; chunks of 3 keep rows 0, 1 and 2: the larger chunk keeps more."""
    model, forest = _model(), _forest(TINY)
    row = LAYERS * 2 * KV_HEADS * HEAD_DIM * 4
    assert plan_chunks(forest, 2).kept_rows.tolist() == [0, 1]
    assert plan_chunks(forest, 3).kept_rows.tolist() == [0, 1, 2]
    assert reuse_estimate(model, forest, 2)[2] == 2 * row
    assert reuse_estimate(model, forest, 3)[2] == 3 * row
    # one chunk: nothing kept; its context is the 2 padding rows the run attends over, which every layer keeps
    # (none is checkpointed) and the layer running in the backward holds 3 times and once at float32 width
    assert reuse_estimate(model, forest, 5)[1:] == (2 * (LAYERS + 3 + 1) * row // LAYERS, 0, 0)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["whole", "checkpointed"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [1, 16])
@pytest.mark.parametrize("case", FORESTS)
def test_estimate_equals_the_plans_hand_count(case, block, kv_dtype, checkpointing):
    """At every chunk size, the `O(rows)` estimate equals the count from `plan_chunks`; its kept keys / values are
    `kept_kv_bytes` of that plan."""
    model, forest = _model(checkpointing=checkpointing), _forest(FORESTS[case])
    sizes = range(block, forest.num_tree_tokens + block, block)
    for chunk_rows in sizes:
        got = reuse_estimate(model, forest, chunk_rows, block=block, dtype=kv_dtype)
        assert got == _oracle(model, forest, chunk_rows, block, kv_dtype), chunk_rows
        assert got[2] == kept_kv_bytes(model, plan_chunks(forest, chunk_rows), kv_dtype)
    if forest.num_tree_tokens > block:  # else every size is one chunk
        assert any(reuse_estimate(model, forest, s, block=block)[2] > 0 for s in sizes), "nothing kept: vacuous"


@pytest.mark.parametrize("keep", [1, 3], ids=["last graph kept", "every graph kept"])
@pytest.mark.parametrize("kv_heads", [4, KV_HEADS], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_estimate_bounds_what_the_run_stores(dtype, kv_heads, keep, monkeypatch):
    """A chunked forward and backward stores exactly the estimated kept keys / values and their gradients, and each
    chunk's recompute saves for autograd at most the estimated activations and context, and more than half of them;
    with every chunk's graph kept, the graphs alive when the backward starts hold at most the planner's price for
    them and more than half of it:
    parameters aside, and (as `tests/test_recompute.py` measures) the dense `(S, P + S)` mask SDPA copies per layer on
    the CPU and, with grouped heads, the key / value heads CPU's SDPA repeats (the GPU path reads one BlockMask and
    the grouped keys as they are)."""
    model, forest = _model(dtype, num_key_value_heads=kv_heads), _forest(_trie(3, seed=70, max_len=200))
    plan = plan_prefix_reuse(model, forest, max_chunk_rows=128)
    assert plan.chunks.num_chunks == 3 and plan.kept_kv > 0
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    grad_store, saved = [], []
    run = prefix_reuse_module._Step._run

    def measured(step, c, backward, store=False):
        rows = int(plan.chunks.bounds[c + 1] - plan.chunks.bounds[c])
        keys = rows + max(len(plan.chunks.context[c]), 2)  # the context padded to 2 rows at least
        storages = {}

        def pack(tensor):
            storage = tensor.untyped_storage()
            mask = tensor.shape[-2:] == (rows, keys)
            repeated = kv_heads != 4 and tensor.shape == (1, 4, keys, HEAD_DIM)
            if storage.data_ptr() not in params and not mask and not repeated:
                storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = run(step, c, backward, store)
        if backward:
            grad_store.append(sum(t.numel() * t.element_size() for kv in step.kv_grad.values() for t in kv))
            saved.append(sum(storages.values()))
        return out

    monkeypatch.setattr(prefix_reuse_module._Step, "_run", measured)
    step = prefix_reuse_module._Step(model, forest, plan.chunks, 1.0, False, None, False, True, 1, keep_graphs=keep)
    tables = prefix_reuse_module._PrefixReuse.apply(step, *model.parameters())
    stored = sum(t.numel() * t.element_size() for kv in step.kv.values() for t in kv)
    assert stored == plan.kept_kv
    kept = saved[:-1]  # the graphs of the chunks before the last, all alive when the backward starts
    assert len(saved) == keep
    tables[0].sum().backward()
    assert plan.activations // 2 < max(saved) <= plan.activations + plan.context, (saved, plan)
    if keep == 1:  # recorded as the backward recomputes a chunk (kept graphs run no recompute)
        assert max(grad_store) == plan.kv_grad  # the last chunk to run backward holds every gradient sent
    else:
        priced = plan_prefix_reuse(model, forest, max_chunk_rows=128, memory_budget_bytes=10**12)
        assert priced.keep_graphs == 3 and priced.chunk_rows == 128
        assert priced.graphs // 2 < sum(kept) <= priced.graphs, (kept, priced.graphs)


# ----------------------------------------------------------------------------------------------------------------
# The search


def _brute_force(model, forest, max_chunk_rows, budget, block):
    top = min(max_chunk_rows // block, -(-forest.num_tree_tokens // block))
    fits = [
        s
        for s in range(block, top * block + 1, block)
        if sum(_oracle(model, forest, s, block, torch.float32)) <= budget
    ]
    return max(fits) if fits else None


@pytest.mark.parametrize("block", [1, 8])
def test_chosen_chunk_is_the_largest_that_fits(block):
    """Over budgets from the least any chunk size needs to more than the largest needs, the chosen size is the
    largest that fits by brute force; the totals are not monotonic in the size (a bisection would miss)."""
    model = _model()
    rng = random.Random(0)
    non_monotonic = 0
    for case in [*FORESTS.values(), _trie(2, seed=11)]:
        forest = _forest(case)
        top = -(-forest.num_tree_tokens // block) * block
        totals = {s: sum(_oracle(model, forest, s, block, torch.float32)) for s in range(block, top + 1, block)}
        sizes = sorted(totals)
        non_monotonic += sum(totals[a] > totals[b] for a, b in zip(sizes, sizes[1:]))
        budgets = {min(totals.values()), max(totals.values())} | {rng.choice(list(totals.values())) for _ in range(8)}
        for budget in sorted(budgets) + [rng.randint(min(totals.values()), max(totals.values())) for _ in range(8)]:
            max_rows = rng.choice([block, top // 2 // block * block or block, top, top * 2])
            want = _brute_force(model, forest, max_rows, budget, block)
            if want is None:
                with pytest.raises(ValueError, match="No chunk size"):
                    plan_prefix_reuse(model, forest, max_chunk_rows=max_rows, memory_budget_bytes=budget, block=block)
                continue
            plan = plan_prefix_reuse(model, forest, max_chunk_rows=max_rows, memory_budget_bytes=budget, block=block)
            assert plan.chunk_rows == want and plan.total <= budget, (budget, max_rows)
            assert np.array_equal(plan.chunks.bounds, plan_chunks(forest, want).bounds)
    assert non_monotonic > 0, "every total grows with the chunk size here: the brute force proves nothing"


def test_no_budget_takes_the_largest_chunk():
    model, forest = _model(), _forest(FORESTS["trie"])
    plan = plan_prefix_reuse(model, forest, max_chunk_rows=128)
    assert plan.chunk_rows == 128 and plan.chunks.num_chunks == 4
    assert (plan.activations, plan.context, plan.kept_kv, plan.kv_grad) == _oracle(
        model, forest, 128, 1, torch.float32
    )
    whole = plan_prefix_reuse(model, forest, max_chunk_rows=10_000, block=128)
    assert whole.chunk_rows == 512 and whole.chunks.num_chunks == 1 and whole.kept_kv == 0


@pytest.mark.parametrize("checkpointing", [False, True], ids=["whole", "checkpointed"])
def test_kept_graphs_fill_the_rest_of_the_budget(checkpointing):
    """Beside the chosen chunks' peak, the budget keeps the forward graphs of as many of the last chunks as fit, each
    priced as what its layers keep for the backward (the oracle's per-row activations, by hand), the last chunk's
    counted in the peak already; without a budget only the last chunk's."""
    model, forest = _model(checkpointing=checkpointing), _forest(FORESTS["trie"])
    base = plan_prefix_reuse(model, forest, max_chunk_rows=128)
    assert base.chunks.num_chunks == 4 and (base.keep_graphs, base.graphs) == (1, 0)
    bounds = base.chunks.bounds
    # Graphs of the chunks before the last, from the second-to-last back: rows x per-row activations, and where the
    # layers are not checkpointed their context's keys and values (rows, at least 2 with the padding, x layers x 2 x
    # kv_heads x head_dim x bytes).
    context = [
        0 if checkpointing else max(len(base.chunks.context[c]), 2) * LAYERS * 2 * KV_HEADS * HEAD_DIM * 4
        for c in (2, 1, 0)
    ]
    outside = 64 * 4 + (64 + 2 * HEAD_DIM) * 4 + 32  # the final norm's and the head's inputs, RoPE, scalars
    rows = [bounds[c + 1] - bounds[c] for c in (2, 1, 0)]
    graphs = [r * (base.activations // 128 + outside) + k for r, k in zip(rows, context)]
    assert base.activations % 128 == 0 and bounds[-1] - bounds[-2] <= 128
    total = base.total
    for budget, keep in [
        (total, 1),
        (total + graphs[0] - 1, 1),
        (total + graphs[0], 2),
        (total + graphs[0] + graphs[1], 3),
        (total + sum(graphs), 4),
        (10 * (total + sum(graphs)), 4),
    ]:
        plan = plan_prefix_reuse(model, forest, max_chunk_rows=128, memory_budget_bytes=budget)
        assert plan.chunk_rows == 128 and plan.total == total
        assert plan.keep_graphs == keep and plan.graphs == sum(graphs[: keep - 1]), budget
        assert plan.total + plan.graphs <= budget


def test_budget_too_small_names_the_numbers_and_the_ways_out():
    model, forest = _model(), _forest(FORESTS["edge"])
    least = min(sum(reuse_estimate(model, forest, s)) for s in range(1, 129))
    with pytest.raises(ValueError) as error:
        plan_prefix_reuse(model, forest, max_chunk_rows=128, memory_budget_bytes=least - 1)
    message = str(error.value)
    assert f"memory_budget_bytes={least - 1}" in message and f"the least any needs is {least} bytes" in message
    for part in ("kept keys / values", "float32 gradients", "Raise the budget", "prefix_reuse off", "fewer"):
        assert part in message
    assert plan_prefix_reuse(model, forest, max_chunk_rows=128, memory_budget_bytes=least).total == least


def test_bad_arguments_and_unpriced_layers_are_refused():
    model, forest = _model(), _forest(TINY)
    with pytest.raises(ValueError, match="max_chunk_rows=0 must be a positive int"):
        plan_prefix_reuse(model, forest, max_chunk_rows=0)
    with pytest.raises(ValueError, match="max_chunk_rows=64 holds no chunk of block=128 rows"):
        plan_prefix_reuse(model, forest, max_chunk_rows=64, block=128)
    assert budget_error(model) is None
    from test_coverage import tiny_config

    moe = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"), attn_implementation="tree_flex")
    assert "mixture-of-experts" in budget_error(moe)
    with pytest.raises(NotImplementedError, match="does not price .*mixture-of-experts.* Leave the budget unset"):
        plan_prefix_reuse(moe, forest, max_chunk_rows=8, memory_budget_bytes=2**30)


# ----------------------------------------------------------------------------------------------------------------
# The trainers


def test_config_checks_the_budget(tmp_path):
    args = dict(max_tokens_per_mb=128, tree_prefix_reuse=True)
    assert _config(TreeGRPOConfig, tmp_path, tree_prefix_reuse_budget_gib=0.5, **args).tree_prefix_reuse_budget_gib
    for bad in (0, -1.0, True, "1"):
        with pytest.raises(ValueError, match=f"tree_prefix_reuse_budget_gib={bad!r} must be a number of GiB > 0"):
            _config(TreeGRPOConfig, tmp_path, tree_prefix_reuse_budget_gib=bad, **args)
    with pytest.raises(ValueError, match="tree_prefix_reuse_budget_gib=1 sizes .* set tree_prefix_reuse=True"):
        _config(TreeGRPOConfig, tmp_path, tree_prefix_reuse_budget_gib=1, max_tokens_per_mb=128)


def test_grpo_budget_chunks_equal_one_forest(tiny, tmp_path, chunked_calls):  # noqa: F811
    """A budget that fits chunks of 128 rows but not of 256 cuts the step's forest (one chunk of the 1,024-row token
    budget) into 3 or more: the loss and every gradient equal the one-forest trainer's, and the estimate is logged."""
    probe = _grpo(tiny, tmp_path / "probe", tree_prefix_reuse=True, max_tokens_per_mb=1024)
    inputs, sequences = _group_inputs(probe, tiny[1], _prompts(SYSTEM * 3))
    forest = _forest(sequences)
    small, large = (sum(reuse_estimate(probe.model, forest, s, block=128)) for s in (128, 256))
    assert small < large and forest.num_tree_tokens > 2 * 128
    budget_gib = (small + large) / 2 / 2**30
    reuse = _grpo(
        tiny, tmp_path, tree_prefix_reuse=True, max_tokens_per_mb=1024, tree_prefix_reuse_budget_gib=budget_gib
    )
    whole = _grpo(tiny, tmp_path / "whole")
    got = _loss_and_grads(reuse, inputs)
    assert chunked_calls == [plan_chunks(forest, 128).num_chunks] and chunked_calls[0] >= 3
    _assert_same(got, _loss_and_grads(whole, inputs), dict(atol=1e-5, rtol=1e-5))
    logged = reuse._metrics["train"]
    assert logged["tree_prefix_reuse_chunks"] == [float(chunked_calls[0])]
    plan = plan_prefix_reuse(
        reuse.model, forest, max_chunk_rows=1024, memory_budget_bytes=int(budget_gib * 2**30), block=128
    )
    assert plan.chunk_rows == 128
    assert logged["tree_prefix_reuse_kept_gib"] == [plan.kept_kv / 2**30] and plan.kept_kv > 0
    assert logged["tree_prefix_reuse_kept_graphs"] == [float(plan.keep_graphs)]
    peak = plan.total + plan.graphs
    assert logged["tree_prefix_reuse_peak_gib"] == [peak / 2**30] and peak <= budget_gib * 2**30


def test_grpo_budget_keeping_every_graph_equals_one_forest(tiny, tmp_path, chunked_calls):  # noqa: F811
    """Chunks of 128 rows and a budget that holds every chunk's forward graph: no chunk recomputed in the backward,
    and the loss and every gradient still the one-forest trainer's."""
    reuse = _grpo(tiny, tmp_path, tree_prefix_reuse=True, max_tokens_per_mb=128, tree_prefix_reuse_budget_gib=1.0)
    inputs, sequences = _group_inputs(reuse, tiny[1], _prompts(SYSTEM * 3))
    forwards = []
    hook = reuse.model.model.register_forward_hook(lambda module, args, output: forwards.append(1))
    try:
        got = _loss_and_grads(reuse, inputs)
    finally:
        hook.remove()
    chunks = plan_chunks(_forest(sequences), 128).num_chunks
    assert chunked_calls == [chunks] and chunks >= 3 and len(forwards) == chunks  # none recomputed
    assert reuse._metrics["train"]["tree_prefix_reuse_kept_graphs"] == [float(chunks)]
    _assert_same(got, _loss_and_grads(_grpo(tiny, tmp_path / "whole"), inputs), dict(atol=1e-5, rtol=1e-5))
