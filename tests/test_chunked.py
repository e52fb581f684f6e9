"""Prefix reuse: one forest per step, run in chunks of a token budget (`hf_tree_attn.chunked`,
`hf_tree_attn.prefix_reuse`), against per-sequence flat forwards and the unsplit forest."""

from __future__ import annotations

import copy
import random
import shutil
import weakref

import numpy as np
import pytest
import torch
from helpers import TOLERANCES, DictTrie, flat_logprobs, forest_case, hybrid_twin_models, trie_node_count, twin_models
from test_compile import CountingBackend
from test_coverage import tiny_config as coverage_config
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM

import hf_tree_attn.attention
from hf_tree_attn import context_kv, forest_logprobs, gather_sequences, pack_forest, sequence_logprobs
from hf_tree_attn import prefix_reuse as prefix_reuse_module
from hf_tree_attn.chunked import plan_chunks
from hf_tree_attn.compile import compile_decoder_layers, compiled_layers, decoder_layers
from hf_tree_attn.prefix_reuse import chunked_forest_logprobs, kept_kv_bytes, prefix_reuse_error

ATOL = TOLERANCES["logps_atol"]
BUDGET = 128  # the smallest budget sequence_logprobs takes (a multiple of 128)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 128) for _ in range(n)]


def _trie(num_chunks: int, seed: int, max_len: int = 250) -> list[list[int]]:
    """One trie (a prompt, completions, completions branching off completions) of more than `num_chunks - 1`
    and at most `num_chunks` budgets of unique tokens."""
    rng = random.Random(seed)
    target = BUDGET * (num_chunks - 1) + BUDGET // 2
    prompt = _tokens(rng, min(90, target // 3))
    sequences, rows = [], len(prompt)
    while rows < target:
        base = prompt
        if sequences and rng.random() < 0.4:
            other = rng.choice(sequences)
            base = other[: rng.randint(len(prompt), len(other))]
        n = min(rng.randint(5, 60), target - rows, max_len - len(base))
        if n <= 0:
            continue
        sequences.append(base + _tokens(rng, n))
        rows += n
    assert BUDGET * (num_chunks - 1) < trie_node_count(sequences) <= BUDGET * num_chunks
    return sequences


def _edge_cases() -> list[list[int]]:
    """Identical sequences, a sequence that is a prefix of another, 1-token sequences, several tries, behind a long
    shared prompt, over four chunks."""
    rng = random.Random(1)
    prompt = _tokens(rng, 150)
    sequences = [prompt + s for s in forest_case("identical", 0) + forest_case("prefix", 0)]
    sequences += [prompt, prompt[:1], prompt[:70]]  # a prefix of all of them, a 1-token one
    sequences += forest_case("single_token", 0) + forest_case("no_sharing", 0) + forest_case("mixed", 5)
    assert 3 * BUDGET < trie_node_count(sequences) <= 4 * BUDGET
    return sequences


def _param_grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_grads_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Per tensor: max |got - want| <= grad_max_rel * max |want| (tests/test_logprobs.py's bound)."""
    assert got.keys() == want.keys() and len(got) > 0
    for name, flat in want.items():
        worst = (got[name] - flat).abs().max().item()
        assert worst <= TOLERANCES["grad_max_rel"] * flat.abs().max().item() + 1e-9, f"{name}: max |diff| {worst}"


def _weights(sequences, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return (
        [torch.randn(len(s) - 1, generator=g) for s in sequences],
        [torch.randn(len(s) - 1, generator=g) for s in sequences],
    )


def _loss(logps, entropies, weights) -> torch.Tensor:
    return sum((w * lp).sum() + (v * e).sum() for w, v, lp, e in zip(*weights, logps, entropies))


def _check_against_flat(tree, ref, sequences, temperature: float = 1.0, loss=_loss) -> None:
    """Chunked log-probs, entropies and parameter gradients of `loss` equal per-sequence flat forwards."""
    weights = _weights(sequences, seed=0)
    logps, entropies = sequence_logprobs(
        tree, sequences, BUDGET, temperature=temperature, return_entropy=True, prefix_reuse=True
    )
    loss(logps, entropies, weights).backward()
    flat = [flat_logprobs(ref, s, temperature) for s in sequences]
    loss([f[0] for f in flat], [f[1] for f in flat], weights).backward()
    for i, (want_logps, want_entropy) in enumerate(flat):
        torch.testing.assert_close(logps[i], want_logps, atol=ATOL, rtol=0, msg=lambda m, i=i: f"sequence {i}: {m}")
        torch.testing.assert_close(
            entropies[i], want_entropy, atol=ATOL, rtol=0, msg=lambda m, i=i: f"entropy {i}: {m}"
        )
    _assert_grads_close(_param_grads(tree), _param_grads(ref))


def _num_chunks(sequences) -> int:
    (forest,) = pack_forest(sequences, two_level=False)
    return plan_chunks(forest, BUDGET).num_chunks


# ----------------------------------------------------------------------------------------------------------------
# The plan


def test_plan_of_the_docstring_example():
    (forest,) = pack_forest([[5, 6, 7, 8], [5, 6, 9]], pad_multiple=8)
    plan = plan_chunks(forest, 2)
    assert plan.bounds.tolist() == [0, 2, 4, 5]
    assert [c.tolist() for c in plan.context] == [[], [0, 1], [0, 1]]
    assert [s.tolist() for s in plan.scored] == [[1, 2, 4], [3], []]
    assert plan.kept_rows.tolist() == [0, 1] and plan.slot.tolist() == [0, 1, -1, -1, -1]
    assert plan.needed.tolist() == [True, True, False]
    assert plan.forwarded_rows == 4
    assert plan.kept_kv_bytes(layers=3, kv_heads=2, head_dim=16, bytes_per_value=2) == 2 * 3 * 2 * 2 * 16 * 2


@pytest.mark.parametrize("chunk_rows", [1, 3, 16, 1000])
@pytest.mark.parametrize("case", ["mixed", "multiturn", "prefix"])
def test_plan_matches_the_dict_trie(case, chunk_rows):
    """Each chunk's context is the set of rows of earlier chunks some row of it descends from (walked up the dict
    trie), every row with a parent is scored once, by the chunk of its parent, and the kept rows are the contexts."""
    sequences = forest_case(case, seed=2) + forest_case(case, seed=3)
    (forest,) = pack_forest(sequences, two_level=False)
    n = forest.num_tree_tokens
    plan = plan_chunks(forest, chunk_rows)
    trie, row_node = DictTrie(), {}
    for k, sid in enumerate(forest.seq_ids):
        row_node.update(zip(forest.positions(k).tolist(), trie.insert(sequences[sid])))
    node_row = {node: row for row, node in row_node.items()}
    assert plan.bounds[0] == 0 and plan.bounds[-1] == n and (np.diff(plan.bounds) <= chunk_rows).all()
    scored_by = {}
    for c in range(plan.num_chunks):
        a, b = plan.bounds[c], plan.bounds[c + 1]
        seen = {node_row[x] for g in range(a, b) for x in trie.ancestors_or_self(row_node[g]) if node_row[x] < a}
        assert plan.context[c].tolist() == sorted(seen), f"chunk {c}"
        for t in plan.scored[c].tolist():
            assert a <= node_row[trie.parent[row_node[t]]] < b
            scored_by[t] = c
    assert sorted(scored_by) == [r for r in range(n) if trie.parent[row_node[r]] != 0]
    kept = sorted(set().union(*[set(c.tolist()) for c in plan.context]))
    assert plan.kept_rows.tolist() == kept
    assert (plan.slot[plan.kept_rows] == np.arange(len(kept))).all() and (plan.slot >= 0).sum() == len(kept)
    holds = [bool((plan.slot[plan.bounds[c] : plan.bounds[c + 1]] >= 0).any()) for c in range(plan.num_chunks)]
    assert plan.needed.tolist() == [len(s) > 0 or h for s, h in zip(plan.scored, holds)]
    assert plan.needed.tolist() == [len(s) > 0 for s in plan.scored]  # a chunk holding a kept row scores its child


def test_plan_refuses_a_bad_chunk_size():
    (forest,) = pack_forest([[5, 6, 7]])
    with pytest.raises(ValueError, match=r"chunk_rows=0 must be a positive int"):
        plan_chunks(forest, 0)


# ----------------------------------------------------------------------------------------------------------------
# Exactness: against per-sequence flat forwards and the unsplit forest


@pytest.mark.parametrize("num_chunks", [2, 3, 8])
def test_split_trie_matches_flat_and_unsplit(num_chunks):
    tree, ref = twin_models("qwen3")
    sequences = _trie(num_chunks, seed=num_chunks)
    assert _num_chunks(sequences) == num_chunks
    _check_against_flat(tree, ref, sequences)

    # The unsplit forest: one forward over all of it, the same weights.
    chunked_grads = _param_grads(tree)
    tree.zero_grad()
    weights = _weights(sequences, seed=0)
    (forest,) = pack_forest(sequences, two_level=False)
    table, entropy_table = forest_logprobs(tree, forest, return_entropy=True)
    logps, entropies = gather_sequences(forest, table), gather_sequences(forest, entropy_table)
    _loss(logps, entropies, weights).backward()
    with torch.no_grad():
        got, got_entropy = sequence_logprobs(tree, sequences, BUDGET, return_entropy=True, prefix_reuse=True)
    for i in range(len(sequences)):
        torch.testing.assert_close(got[i], logps[i].detach(), atol=ATOL, rtol=0)
        torch.testing.assert_close(got_entropy[i], entropies[i].detach(), atol=ATOL, rtol=0)
    _assert_grads_close(chunked_grads, _param_grads(tree))


def test_sequence_four_times_the_budget_matches_flat():
    tree, ref = twin_models("llama")
    sequence = _tokens(random.Random(4), 4 * BUDGET)
    with pytest.raises(ValueError, match=r"more than max_tokens_per_mb=128.*prefix_reuse=True"):
        sequence_logprobs(tree, [sequence], BUDGET)
    assert _num_chunks([sequence]) == 4
    _check_against_flat(tree, ref, [sequence, sequence[:200]])


def test_edge_cases_match_flat():
    tree, ref = twin_models("gemma")  # MQA
    sequences = _edge_cases()
    assert _num_chunks(sequences) == 4
    _check_against_flat(tree, ref, sequences)


def test_loss_coupling_sequences_matches_flat():
    """A loss that is not a sum over tokens (normalised by the total token count, a square of a sum, entropies
    times log-probs) gets exact gradients: the reentrant backward is given the loss's own gradient per token."""
    tree, ref = twin_models("qwen3")
    sequences = _trie(3, seed=11)

    def coupled(logps, entropies, weights):
        tokens = sum(len(lp) for lp in logps)
        weighted = sum((w * lp).sum() for w, lp in zip(weights[0], logps)) / tokens
        total = torch.cat(list(logps)).sum() / tokens
        return weighted + total**2 + torch.cat(list(entropies)).mean() * total

    _check_against_flat(tree, ref, sequences, temperature=0.8, loss=coupled)


def _coverage_twins(model_type: str):
    """`(tree_flex model, eager model)` of the coverage matrix's tiny config (windows of 4 tokens), identical
    jittered fp32 weights (as test_coverage does: constant-initialised parameters must not hide a difference)."""
    config = coverage_config(model_type)
    torch.manual_seed(0)
    tree = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="tree_flex").float().eval()
    with torch.no_grad():
        for param in tree.parameters():
            param.add_(0.05 * torch.randn_like(param))
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager").float().eval()
    ref.load_state_dict(tree.state_dict())
    return tree, ref


@pytest.mark.parametrize(
    "model_type",
    [
        "mistral",  # sliding window of 4 on every layer (SDPA)
        "gemma2",  # alternating window and full layers, attention and final softcap (eager math)
        "gpt_oss",  # attention sinks, alternating windows, MoE
        "qwen3_moe",  # MoE
        "gemma3n_text",  # later layers reuse earlier layers' keys and values
        "deepseek_v3",  # multi-head latent attention: keys wider than values
    ],
)
def test_layer_kinds_match_flat(model_type):
    tree, ref = _coverage_twins(model_type)
    sequences = _trie(3, seed=20, max_len=200)
    assert _num_chunks(sequences) == 3
    _check_against_flat(tree, ref, sequences)


def _enable_checkpointing(model, use_reentrant: bool) -> None:
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.23 renamed it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def test_train_mode_with_non_reentrant_checkpointing_matches_flat():
    """transformers' non-reentrant activation checkpointing recomputes each layer inside the chunk's backward: the
    recompute must see the same context leaves."""
    tree, ref = twin_models("qwen3")
    tree.train()
    _enable_checkpointing(tree, use_reentrant=False)
    assert all(layer.gradient_checkpointing for layer in tree.model.layers)
    _check_against_flat(tree, ref, _trie(3, seed=30))


def _check_kept_graphs(tree, ref, sequences, keep_graphs: int) -> None:
    """`chunked_forest_logprobs(..., keep_graphs=keep_graphs)` against flat forwards (`_check_against_flat`'s
    loss), and the decoder's forwards: one per chunk, and a recompute for each chunk whose graph was not kept."""
    (forest,) = pack_forest(sequences, two_level=False)
    chunks = plan_chunks(forest, BUDGET).num_chunks
    calls = []
    hook = tree.model.register_forward_hook(lambda module, args, output: calls.append(1))
    try:
        table, entropy_table = chunked_forest_logprobs(
            tree, forest, BUDGET, return_entropy=True, keep_graphs=keep_graphs
        )
        weights = _weights(sequences, seed=0)
        logps, entropies = gather_sequences(forest, table), gather_sequences(forest, entropy_table)
        _loss(logps, entropies, weights).backward()
    finally:
        hook.remove()
    assert len(calls) == chunks + chunks - min(keep_graphs, chunks)
    flat = [flat_logprobs(ref, s) for s in sequences]
    _loss([f[0] for f in flat], [f[1] for f in flat], weights).backward()
    for i, (want_logps, want_entropy) in enumerate(flat):
        torch.testing.assert_close(logps[i], want_logps, atol=ATOL, rtol=0, msg=lambda m, i=i: f"sequence {i}: {m}")
        torch.testing.assert_close(entropies[i], want_entropy, atol=ATOL, rtol=0)
    _assert_grads_close(_param_grads(tree), _param_grads(ref))


@pytest.mark.parametrize("checkpointing", [False, True], ids=["whole layers", "checkpointed layers"])
@pytest.mark.parametrize("keep_graphs", [2, 8])
def test_kept_graphs_match_flat(keep_graphs, checkpointing):
    """The last `keep_graphs` of 8 chunks run with autograd in the forward and keep their graphs for the backward
    (8: every chunk, none recomputed), storing the keys and values later chunks read as they run: the flat
    forwards' log-probs, entropies and gradients, with whole layers and with transformers' non-reentrant
    checkpointing (whose recompute then runs inside a graph built in the forward)."""
    tree, ref = twin_models("qwen3")
    if checkpointing:
        tree.train()
        _enable_checkpointing(tree, use_reentrant=False)
    sequences = _trie(8, seed=8)
    assert _num_chunks(sequences) == 8
    _check_kept_graphs(tree, ref, sequences, keep_graphs)


@pytest.mark.parametrize("model_type", ["gpt_oss", "gemma3n_text"])
def test_kept_graphs_of_other_layer_kinds_match_flat(model_type):
    """Every chunk's graph kept, on sinks, windows and MoE (GPT-OSS) and layers reading earlier layers' keys and
    values (Gemma 3n)."""
    tree, ref = _coverage_twins(model_type)
    sequences = _trie(3, seed=20, max_len=200)
    _check_kept_graphs(tree, ref, sequences, keep_graphs=3)


@pytest.mark.parametrize("keep_graphs", [0, -1, 1.5, True])
def test_keep_graphs_must_be_a_positive_int(keep_graphs):
    tree, _ = twin_models("qwen3")
    (forest,) = pack_forest(_trie(2, seed=1), two_level=False)
    with pytest.raises(ValueError, match=rf"keep_graphs={keep_graphs!r} must be a positive int"):
        chunked_forest_logprobs(tree, forest, BUDGET, keep_graphs=keep_graphs)


def test_checkpointed_chunk_holds_one_layers_context_at_a_time(monkeypatch):
    """With every layer checkpointed, a chunk's backward gathers each layer's context keys and values when it needs
    them and lets them go with the layer: when one is gathered, no other layer's is alive (held until the chunk's
    backward ended, every layer's context would be), and the gradients still equal flat's."""
    tree, ref = twin_models("qwen3", num_hidden_layers=4, layer_types=["full_attention"] * 4)
    tree.train()
    _enable_checkpointing(tree, use_reentrant=False)
    gathered, alive_at_gather = [], []
    gather = prefix_reuse_module.ChunkContext.gather

    def recording(self, module, key, value, width):
        out = gather(self, module, key, value, width)
        if self.backward and len(self.context_slots):
            alive_at_gather.append({m for m, ref_ in gathered if ref_() is not None and m is not module})
            gathered.append((module, weakref.ref(out[0])))
        return out

    monkeypatch.setattr(prefix_reuse_module.ChunkContext, "gather", recording)
    _check_against_flat(tree, ref, _trie(3, seed=31))
    assert len({m for m, _ in gathered}) == 4 and len(alive_at_gather) >= 8  # 4 layers x 2 chunks x 2 runs
    assert all(not others for others in alive_at_gather), [len(o) for o in alive_at_gather]


def test_a_step_frees_its_stores_with_its_backward():
    """After the backward, a chunked step holds nothing: with layers checkpointed, each chunk's graph reached back to
    its context through the checkpoints' kept arguments, a cycle through autograd's nodes that Python's collector
    cannot free, and every step's kept keys and values stayed alive (on an H200 a 0.6B model's steps ran out of
    memory one after another). Nor when no backward comes. A second backward of one forward is refused."""
    import gc

    tree, _ = twin_models("qwen3")
    tree.train()
    _enable_checkpointing(tree, use_reentrant=False)
    steps = []
    init = prefix_reuse_module._Step.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        steps.append(weakref.ref(self))

    prefix_reuse_module._Step.__init__ = recording
    try:
        sequences = _trie(3, seed=32)
        for _ in range(2):
            logps = sequence_logprobs(tree, sequences, BUDGET, prefix_reuse=True)
            sum(lp.sum() for lp in logps).backward(retain_graph=True)
            with pytest.raises(RuntimeError, match="ran twice"):
                sum(lp.sum() for lp in logps).backward()
            del logps
            gc.collect()
        # with grad but no backward (the last chunk's graph kept for one, or every chunk's): dropping the outputs
        # frees it all
        for keep_graphs in (1, 3):
            logps = sequence_logprobs(tree, sequences, BUDGET, prefix_reuse=True, keep_graphs=keep_graphs)
            assert len(steps[-1]().kept) == keep_graphs
            del logps
            gc.collect()
    finally:
        prefix_reuse_module._Step.__init__ = init
    assert len(steps) == 4 and all(step() is None for step in steps), "a step outlived its outputs"


def test_recompute_repeats_the_forward_under_dropout_and_autocast():
    """Each chunk's recompute in the backward sees the dropout masks and the autocast its forward saw (the backward
    runs outside the caller's autocast block): its last MLP's outputs (bf16, after dropout) are bit-identical to the
    forward's. The last chunk is not recomputed."""
    config = coverage_config("gpt2")
    config.resid_pdrop = config.embd_pdrop = 0.1  # attention dropout must stay 0 on trees
    torch.manual_seed(0)
    tree = AutoModelForCausalLM.from_config(config, attn_implementation="tree_flex").train()
    sequences = _trie(3, seed=35, max_len=200)
    hidden = []
    mlp = tree.transformer.h[-1].mlp
    hook = mlp.register_forward_hook(lambda m, args, out: hidden.append(out.detach().clone()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logps = sequence_logprobs(tree, sequences, BUDGET, prefix_reuse=True)
    torch.cat(logps).sum().backward()
    hook.remove()
    # the last chunk's forward ran with autograd and its graph served the backward: the first two are recomputed
    forward, recompute = hidden[:3], hidden[3:][::-1]
    assert len(recompute) == 2 and all(h.dtype == torch.bfloat16 for h in hidden)
    for a, b in zip(forward[:2], recompute):
        assert torch.equal(a, b)
    assert not torch.equal(forward[0][:, :40], forward[1][:, :40]), "dropout must be on: chunks draw their own masks"


def test_padded_chunks_match_flat():
    """Chunks and their context padded to 128 rows (CUDA's layout): padding rows see neither context nor real rows."""
    tree, ref = twin_models("llama")
    sequences = _trie(3, seed=40)
    (forest,) = pack_forest(sequences, two_level=False)
    assert forest.num_tree_tokens % BUDGET and any(len(c) % BUDGET for c in plan_chunks(forest, BUDGET).context)
    with torch.no_grad():
        table, entropy = chunked_forest_logprobs(tree, forest, BUDGET, return_entropy=True, pad_multiple=BUDGET)
    for i, (lp, ent) in enumerate(zip(gather_sequences(forest, table), gather_sequences(forest, entropy))):
        want_logps, want_entropy = flat_logprobs(ref, sequences[forest.seq_ids[i]])
        torch.testing.assert_close(lp, want_logps, atol=ATOL, rtol=0)
        torch.testing.assert_close(ent, want_entropy, atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", [None, "FLASH"])
def test_block_mask_forward_equals_dense(backend, monkeypatch):
    """The CUDA path's BlockMask over [context; own] keys, in FlexAttention on CPU (inference only: it has no CPU
    backward), gives the dense path's log-probs and entropies; GPT-OSS: windows, and sinks folded in through the
    log-sum-exp. With FlexAttention's FLASH backend set, the masks read their tensors from buffers of static size
    and the model's window through a global (`masks.static_rows`): the same results, and FlexAttention compiled
    with dynamic shapes over the chunks' calls captures no symbolic size, which the FLASH lowering refuses."""
    monkeypatch.setattr(hf_tree_attn.attention, "FLEX_KERNEL_OPTIONS", backend and {"BACKEND": backend})
    tree, _ = _coverage_twins("gpt_oss")
    sequences = _trie(3, seed=50, max_len=200)
    (forest,) = pack_forest(sequences, two_level=False)
    plan = plan_chunks(forest, BUDGET)
    calls = []
    flex = hf_tree_attn.attention._flex_attention
    monkeypatch.setattr(
        hf_tree_attn.attention, "_flex_attention", lambda *a, **k: calls.append((*a, k)) or flex(*a, **k)
    )
    tables = {}
    with torch.no_grad():
        for dense in (True, False):
            step = prefix_reuse_module._Step(tree, forest, plan, 1.0, True, None, False, dense, BUDGET)
            tables[dense] = step.forward()
    assert len(calls) == plan.needed.sum() * tree.config.num_hidden_layers, "the BlockMasks must take FlexAttention"
    for got, want in zip(tables[False], tables[True]):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    if backend == "FLASH":
        captured = []

        def record(gm, example_inputs):
            for node in gm.graph.nodes:
                if node.target is torch.ops.higher_order.flex_attention:
                    captured.extend(
                        getattr(b, "meta", {}).get("example_value", b) for b in (*node.args[-2], *node.args[-1])
                    )
            return gm.forward

        flex = torch.compile(torch.nn.attention.flex_attention.flex_attention, backend=record, dynamic=True)
        with torch.no_grad():
            for query, key, value, kwargs in calls:
                flex(query, key, value, block_mask=kwargs["block_mask"], enable_gqa=kwargs.get("enable_gqa", False))
        torch._dynamo.reset()
        assert captured and not any(isinstance(v, (torch.SymInt, torch.SymFloat)) for v in captured), captured


def test_chunk_block_masks_compile_once_for_every_context_size_and_grad_mode():
    """The chunks' BlockMasks come from one compiled graph whatever their context size (none included) and grad
    mode: dynamo guards on the mask_mod's code, the ints it captures and the grad mode, and a function's graphs
    count against its recompile limit (8) for the whole process, past which it silently runs eagerly (a chunked
    step's forward runs without grad, its recomputes with; on an H200 the limit was passed and a step ran out of
    memory)."""
    from torch._dynamo.utils import counters

    from hf_tree_attn.masks import ContextMaskSource, causal_mask_mod

    def chunk_mask(context: int, size: int = 256) -> torch.Tensor:
        source = ContextMaskSource(
            subtree_end=torch.arange(1, size + 1, dtype=torch.int32),
            depth=torch.arange(size),
            seq_lengths=torch.tensor([size]),
            dense=False,
            context_end=torch.full((context,), 10**6, dtype=torch.int32),
            context_depth=torch.arange(context),
            query_rows=torch.arange(size, dtype=torch.int32) + context,
        )
        return source.mask(causal_mask_mod).to_dense()

    chunk_mask(384)  # the static graph, then the dynamic one
    chunk_mask(128, size=384)
    graphs = counters["stats"]["unique_graphs"]
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            for context in (0, 128, 512, 896):
                mask = chunk_mask(context)
                assert mask.shape == (1, 1, 2, (context + 256) // 128)
                assert bool(mask[0, 0, :, : context // 128].all()), "a context block every query sees is not full"
    assert counters["stats"]["unique_graphs"] == graphs, "a chunk's context size or grad mode compiled a new graph"


# ----------------------------------------------------------------------------------------------------------------
# Compiled decoder layers: the context keys and values through one operator (`hf_tree_attn.context_kv`)


@pytest.fixture
def compiled_chunks(monkeypatch):
    """Prefix reuse's chunks on the model's compiled layers (`HF_TREE_ATTN_PREFIX_REUSE_LAYERS=compiled`)."""
    monkeypatch.setattr(prefix_reuse_module, "LAYERS", "compiled")


def _compiled_twins(checkpointing: bool):
    """`(tree, ref, counting)`: 4-layer twins, the tree's decoder layers compiled in place (dynamic shapes, through
    AOTAutograd: the backward is a compiled graph too) on a fresh dynamo cache and counters."""
    tree, ref = twin_models("qwen3", num_hidden_layers=4, layer_types=["full_attention"] * 4)
    if checkpointing:
        tree.train()
        _enable_checkpointing(tree, use_reentrant=False)
    torch._dynamo.reset()
    counters.clear()
    counting = CountingBackend()
    compile_decoder_layers(tree, backend=counting.backend, dynamic=True)
    return tree, ref, counting


COMPILED_TRIES = ((3, 31), (4, 7))  # (chunks, seed): two plans, every context size new to the second


@pytest.mark.parametrize("setting", ["whole layers", "checkpointed layers", "every graph kept"])
def test_compiled_layers_run_every_chunk_without_a_graph_break(setting, compiled_chunks):
    """Decoder layers compiled in place run the chunks — forwards, recomputes, backwards — with no graph break: each
    layer's context keys and values come through `hf_tree_attn::chunk_context_kv`, opaque to the compiler. The
    results equal the flat forwards', every chunk's backward runs the compiled layers, and chunks of any context
    size (the first chunk's, of none, too) compile no more graphs than whole forests do in the same grad modes."""
    tree, ref, counting = _compiled_twins(setting == "checkpointed layers")
    chunks = 0
    for num_chunks, seed in COMPILED_TRIES:
        tree.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        sequences = _trie(num_chunks, seed=seed)
        chunks += _num_chunks(sequences)
        if setting == "every graph kept":
            _check_kept_graphs(tree, ref, sequences, keep_graphs=num_chunks)
        else:
            _check_against_flat(tree, ref, sequences)
    assert counting.calls["backward"] == 4 * chunks
    assert not counters["graph_break"], dict(counters["graph_break"])
    chunk_graphs = counters["stats"]["unique_graphs"]

    tree, _, _ = _compiled_twins(setting == "checkpointed layers")
    for num_chunks, seed in COMPILED_TRIES:
        (forest,) = pack_forest(_trie(num_chunks, seed=seed), two_level=False)
        if setting != "every graph kept":  # the chunks' forward without autograd
            with torch.no_grad():
                forest_logprobs(tree, forest)
        forest_logprobs(tree, forest)[0].sum().backward()
    assert chunk_graphs == counters["stats"]["unique_graphs"]


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor's CPU code needs a C++ compiler")
def test_inductor_compiled_checkpointed_layers_run_every_chunk(compiled_chunks):
    """The same with inductor's own code (the trainers' compile backend) instead of AOTAutograd's eager graphs, the
    layers checkpointed: the flat forwards' results, no graph break, and the layers still compiled after (a failure
    would have sent them back to eager)."""
    tree, ref, _ = _compiled_twins(checkpointing=True)
    compile_decoder_layers(tree, backend="inductor", dynamic=True)
    for num_chunks, seed in COMPILED_TRIES:
        tree.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        _check_against_flat(tree, ref, _trie(num_chunks, seed=seed))
    assert compiled_layers(tree) == decoder_layers(tree) != []
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"], dict(counters["graph_break"])


def test_by_default_the_chunks_run_the_compiled_layers():
    """`HF_TREE_ATTN_PREFIX_REUSE_LAYERS` unset: with the model's layers compiled, the chunks run them (every chunk's
    backward through the compiled graphs)."""
    assert prefix_reuse_module.LAYERS == "compiled"
    tree, ref, counting = _compiled_twins(checkpointing=False)
    sequences = _trie(3, seed=31)
    _check_against_flat(tree, ref, sequences)
    assert counting.calls["backward"] == 4 * _num_chunks(sequences)


def test_the_chunks_run_the_eager_layers_where_asked(monkeypatch):
    """`HF_TREE_ATTN_PREFIX_REUSE_LAYERS=eager`: with the model's layers compiled, the chunks run the eager ones (no
    compiled graph runs), still exactly, and the compiled layers are back after the step."""
    monkeypatch.setattr(prefix_reuse_module, "LAYERS", "eager")
    tree, ref, counting = _compiled_twins(checkpointing=False)
    _check_against_flat(tree, ref, _trie(3, seed=31))
    assert counting.calls == {"forward": 0, "backward": 0}
    assert compiled_layers(tree) == decoder_layers(tree)


def test_a_layers_setting_that_names_none_is_refused(monkeypatch):
    monkeypatch.setattr(prefix_reuse_module, "LAYERS", "inductor")
    tree, _ = twin_models("qwen3")
    (forest,) = pack_forest(_trie(2, seed=1), two_level=False)
    with pytest.raises(ValueError, match=r"HF_TREE_ATTN_PREFIX_REUSE_LAYERS='inductor' names no decoder layers"):
        chunked_forest_logprobs(tree, forest, BUDGET)


def test_a_module_token_lives_on_the_device_asked_and_names_its_module():
    """A module's token (`context_kv.module_token`) is made once, and anew where it is asked on another device (the
    keys': inductor takes a graph's CPU inputs as unaligned, and with them the operator's outputs); the operator
    finds its module by the token's data pointer, and a copy of a token names nothing."""
    tree, _ = twin_models("qwen3")
    first, second = tree.model.layers[0].self_attn, tree.model.layers[1].self_attn
    context_kv.tag_modules(tree, torch.device("cpu"))
    token = context_kv.module_token(first)
    assert token.device.type == "cpu" and token.dim() == 0
    assert context_kv.module_token(first, "cpu") is token and context_kv.module_token(second) is not token
    with context_kv.running("a chunk"):
        assert context_kv._context(token) == ("a chunk", first)
        assert context_kv._context(context_kv.module_token(second)) == ("a chunk", second)
        with pytest.raises(RuntimeError, match="names no live module: pass the one `module_token` made"):
            context_kv._context(token.clone())
    moved = context_kv.module_token(first, "meta")  # another device: a new token there
    assert moved.device.type == "meta" and context_kv.module_token(first) is moved
    with torch.inference_mode():  # a first chunked call under inference mode: later backwards still save the token
        assert not context_kv.module_token(first, "cpu").is_inference()


def test_the_context_operator_outside_a_chunk_says_how_to_run_it():
    tree, _ = twin_models("qwen3")
    key = torch.zeros(1, 2, 3, 4)
    token = context_kv.module_token(tree.model.layers[0].self_attn)
    with pytest.raises(RuntimeError, match="ran outside a prefix-reuse chunk: call the model through"):
        torch.ops.hf_tree_attn.chunk_context_kv(key, key, token, torch.empty(2, dtype=torch.uint8))


# ----------------------------------------------------------------------------------------------------------------
# Each row forwarded once; the kept keys and values as estimated


def test_forwarded_tokens_are_the_unique_tokens():
    tree, _ = twin_models("qwen3")
    sequences = _trie(3, seed=60, max_len=120) + _trie(2, seed=61, max_len=120)  # two tries, within the budget
    forwarded = []
    hook = tree.model.embed_tokens.register_forward_hook(lambda m, args, out: forwarded.append(args[0].numel()))
    with torch.no_grad():
        sequence_logprobs(tree, sequences, BUDGET, prefix_reuse=True)
    unique = trie_node_count(sequences)
    assert len(forwarded) == _num_chunks(sequences) and sum(forwarded) == unique
    forwarded.clear()
    logps = sequence_logprobs(tree, sequences, BUDGET, prefix_reuse=True)
    torch.cat(logps).sum().backward()
    hook.remove()
    # a forward, then one recompute per chunk but the last, whose forward ran with autograd and served the backward
    chunks = _num_chunks(sequences)
    assert len(forwarded) == 2 * chunks - 1 and sum(forwarded) == 2 * unique - forwarded[chunks - 1]
    repeated = sum(f.num_tree_tokens for f in pack_forest(sequences, max_tokens_per_mb=BUDGET))
    assert repeated > unique, "micro-batches repeat the prefix they share: the comparison is not vacuous"


@pytest.mark.parametrize("model_type", ["qwen3", "gpt_oss", "deepseek_v3"])
def test_kept_kv_bytes_is_what_is_stored(model_type):
    tree = twin_models("qwen3")[0] if model_type == "qwen3" else _coverage_twins(model_type)[0]
    sequences = _trie(3, seed=70, max_len=200)
    (forest,) = pack_forest(sequences, two_level=False)
    plan = plan_chunks(forest, BUDGET)
    step = prefix_reuse_module._Step(tree, forest, plan, 1.0, False, None, False, True, 1)
    with torch.no_grad():
        step.forward()
    stored = sum(t.numel() * t.element_size() for kv in step.kv.values() for t in kv)
    assert len(plan.kept_rows) > 0 and stored == kept_kv_bytes(tree, plan)


# ----------------------------------------------------------------------------------------------------------------
# Leakage


def test_changing_one_branch_moves_only_its_subtree():
    """A token changed inside one branch whose subtree spans chunks: every log-prob and entropy of a token outside
    that subtree is bit-identical, the rows after it in the last chunk included (they hold it as context)."""
    tree, _ = twin_models("llama")
    check_branch_change_moves_only_its_subtree(tree)


def check_branch_change_moves_only_its_subtree(tree) -> None:
    """Change one token of a row of an earlier chunk whose subtree ends inside the last chunk (branching rows first,
    the layout kept) and score both tries with prefix reuse on `tree`'s device: outside that subtree every log-prob
    and entropy is bit-identical; inside, some log-prob moved."""
    sequences = _trie(3, seed=80)
    (forest,) = pack_forest(sequences, two_level=False)
    plan = plan_chunks(forest, BUDGET)
    end = forest.subtree_end
    rows = [r for r in range(1, int(plan.bounds[2])) if plan.bounds[2] < end[r] < plan.bounds[3]]
    row = min(rows, key=lambda r: (int((forest.parent == r).sum()) < 2, r))
    assert row in plan.context[2]
    token = int(forest.input_ids[0, row])
    changed = None
    for new in (token + 1, token - 1, token + 2, token - 2):
        if not 3 <= new < 128:
            continue
        trial = [list(s) for s in sequences]
        for k, sid in enumerate(forest.seq_ids):
            positions = forest.positions(k).tolist()
            if row in positions:
                trial[sid][positions.index(row)] = new
        (after,) = pack_forest(trial, two_level=False)
        if torch.equal(after.subtree_end, end) and torch.equal(after.seq_positions, forest.seq_positions):
            changed = trial
            break
    assert changed is not None, "no change keeps the layout"
    with torch.no_grad():
        before, ent_before = sequence_logprobs(tree, sequences, BUDGET, return_entropy=True, prefix_reuse=True)
        after, ent_after = sequence_logprobs(tree, changed, BUDGET, return_entropy=True, prefix_reuse=True)
    moved = 0
    for k, sid in enumerate(forest.seq_ids):
        scored = forest.positions(k)[1:]
        device = before[sid].device
        inside = ((scored >= row) & (scored < end[row])).to(device)  # the changed token and what its subtree predicts
        assert torch.equal(before[sid][~inside], after[sid][~inside]), f"sequence {sid} saw the change"
        parents = forest.parent[scored]  # an entropy is of the distribution its parent row predicts
        outside = ((parents < row) | (parents >= end[row])).to(device)
        assert torch.equal(ent_before[sid][outside], ent_after[sid][outside])
        moved += int((before[sid][inside] != after[sid][inside]).sum())
    assert moved > 0, "the change must move the log-probs of its subtree"


# ----------------------------------------------------------------------------------------------------------------
# What is refused


def test_default_is_unchanged_and_long_sequence_refused_without_it():
    tree, _ = twin_models("llama")
    sequences = _trie(2, seed=90)
    with torch.no_grad():
        plain = sequence_logprobs(tree, sequences, BUDGET)
        reused = sequence_logprobs(tree, sequences, BUDGET, prefix_reuse=True)
        unlimited = sequence_logprobs(tree, sequences, prefix_reuse=True)  # no budget: one forward, as without it
    for a, b, c in zip(plain, reused, unlimited):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
        torch.testing.assert_close(a, c, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match=r"sequences\[0\] has 300 tokens.*prefix_reuse=True"):
        sequence_logprobs(tree, [list(range(3, 303))], BUDGET)
    with pytest.raises(ValueError, match=r"max_tokens_per_mb=100 must be a positive multiple of pad_multiple=128"):
        sequence_logprobs(tree, sequences, 100, prefix_reuse=True)


def test_a_state_it_does_not_carry_is_refused(monkeypatch):
    """Gated / Kimi delta-rule, Mamba-2 and short-convolution hybrids carry their states between chunks
    (tests/test_prefix_reuse_hybrid.py); a state-carrying kind that is not carried (here Mamba-2, taken out of the
    carried kinds) is refused with the reason and the way out."""
    from hf_tree_attn import recurrent

    monkeypatch.setattr(recurrent, "CHUNKED_KINDS", tuple(k for k in recurrent.CHUNKED_KINDS if k != "mamba2"))
    tree, _ = hybrid_twin_models("bamba")
    assert "state-carrying layers (BambaMixer)" in prefix_reuse_error(tree)
    with pytest.raises(NotImplementedError, match=r"BambaMixer.*prefix_reuse=False"):
        sequence_logprobs(tree, _trie(2, seed=0), BUDGET, prefix_reuse=True)


def test_chunked_attention_is_refused():
    torch.manual_seed(0)
    tree = AutoModelForCausalLM.from_config(coverage_config("llama4_text"), attn_implementation="tree_flex")
    with pytest.raises(NotImplementedError, match=r"chunked_attention.*full and sliding-window.*prefix_reuse=False"):
        sequence_logprobs(tree, _trie(2, seed=0), BUDGET, prefix_reuse=True)


def test_model_refused_by_the_tree_gate_is_refused():
    _, ref = twin_models("llama")  # sdpa, not tree_flex
    with pytest.raises(ValueError, match=r"attn_implementation='sdpa'; tree packing needs 'tree_flex'"):
        sequence_logprobs(ref, _trie(2, seed=0), BUDGET, prefix_reuse=True)


def test_reentrant_checkpointing_is_refused():
    tree, _ = twin_models("llama")
    tree.train()
    _enable_checkpointing(tree, use_reentrant=True)
    with pytest.raises(NotImplementedError, match=r"reentrant activation checkpointing.*use_reentrant': False"):
        logps = sequence_logprobs(tree, _trie(2, seed=0), BUDGET, prefix_reuse=True)  # its last chunk, with grad
        torch.cat(logps).sum().backward()


def test_autograd_grad_is_refused():
    tree, _ = twin_models("llama")
    logps = sequence_logprobs(tree, _trie(2, seed=0), BUDGET, prefix_reuse=True)
    with pytest.raises(RuntimeError, match=r"works with `loss.backward\(\)` but not with `torch.autograd.grad"):
        torch.autograd.grad(torch.cat(logps).sum(), [tree.lm_head.weight])


def test_chunk_mask_without_its_context_is_refused():
    """A layer that gets a chunk's mask but not its `tree_context` (a forward that drops the kwarg) raises rather
    than reading the chunk's mask against its own keys alone."""
    tree, _ = twin_models("llama")
    (forest,) = pack_forest(_trie(2, seed=0), two_level=False)
    step = prefix_reuse_module._Step(tree, forest, plan_chunks(forest, BUDGET), 1.0, False, None, False, True, 1)
    calls = []

    def drop_context(module, args, kwargs):
        calls.append(1)
        return args, {k: v for k, v in kwargs.items() if k != "tree_context"}

    hook = tree.model.layers[1].self_attn.register_forward_pre_hook(drop_context, with_kwargs=True)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"Layer 1 of LlamaAttention got the mask of a prefix"):
        step.forward()
    hook.remove()
    assert calls
