"""Prefix reuse on hybrids (`hf_tree_attn.prefix_reuse`): a chunk's state-carrying layers start from the states
earlier chunks kept (the recurrent state at a fork or at a boundary inside a segment, the last inputs of a
convolution's ancestor window), with their gradients sent back; against per-sequence flat forwards, the float64 flat
gradient and the unchunked forest, in fp32."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from helpers import TOLERANCES, flat_logprobs, forest_case, hybrid_twin_models, multiturn

from hf_tree_attn import forest_logprobs, gather_sequences, pack_forest
from hf_tree_attn import prefix_reuse as prefix_reuse_module
from hf_tree_attn.chunked import plan_chunks
from hf_tree_attn.prefix_reuse import chunked_forest_logprobs, kept_state_bytes, prefix_reuse_error

ATOL = TOLERANCES["logps_atol"]
REL = TOLERANCES["grad_max_rel"]


def _sequences() -> list[list[int]]:
    """Identical sequences, prefixes of one another, 1-token sequences, GRPO groups branching at several depths, and
    a 10-turn agent tree (10+ branching levels)."""
    sequences = []
    for case in ("identical", "prefix", "single_token", "grpo"):
        sequences += forest_case(case, seed=2)
    return sequences + multiturn(random.Random(5), turns=10)


def _boundaries(forest, chunk_rows: int) -> tuple[int, int, int]:
    """`(boundaries inside a segment, boundaries at a fork, most context states one chunk starts from)`."""
    plan = plan_chunks(forest, chunk_rows)
    parent = forest.parent[: forest.num_tree_tokens].numpy()
    starts = set(forest.segment_starts.tolist())
    inside = sum(int(a) not in starts for a in plan.bounds[1:-1])
    forks = sum(int(a) in starts and parent[a] >= 0 for a in plan.bounds[1:-1])
    states = 0
    for a, b in zip(plan.bounds[:-1], plan.bounds[1:]):
        above = parent[a:b]
        states = max(states, len(np.unique(above[(above >= 0) & (above < a)])))
    return inside, forks, states


def _at_a_fork(forest) -> int:
    """A chunk size of about a quarter of the forest with a boundary at the first row of a segment branching off."""
    n = forest.num_tree_tokens
    for size in range(n // 4, n // 2):
        if _boundaries(forest, size)[1]:
            return size
    raise AssertionError("no chunk size puts a boundary at a fork")


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.detach().double() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


class _Reference:
    """A family's references on `_sequences()`: fp32 flat log-probs / entropies, the fp32 and float64 flat gradients
    and the unchunked forest's log-probs and gradients, of one loss."""

    def __init__(self, family: str):
        self.tree, ref = hybrid_twin_models(family)
        self.tree.train(), ref.train()
        self.sequences = _sequences()
        (self.forest,) = pack_forest(self.sequences, two_level=False)
        g = torch.Generator().manual_seed(0)
        self.weights = [
            (torch.randn(len(s) - 1, generator=g), torch.randn(len(s) - 1, generator=g)) for s in self.sequences
        ]
        flat = [flat_logprobs(ref, s) for s in self.sequences]
        self.loss(flat).backward()
        self.flat = [(lp.detach(), e.detach()) for lp, e in flat]
        self.flat32 = _grads(ref)
        exact = copy.deepcopy(ref).double()
        self.loss([flat_logprobs(exact, s) for s in self.sequences]).backward()
        self.flat64 = _grads(exact)
        self.table = self.run(None)
        self.whole = _grads(self.tree)

    def loss(self, per_sequence) -> torch.Tensor:
        return sum(
            (w.to(lp.dtype) * lp).sum() + 0.1 * (v.to(e.dtype) * e).sum()
            for (w, v), (lp, e) in zip(self.weights, per_sequence)
        )

    def run(self, chunk_rows: int | None, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropies of the forest (in chunks of `chunk_rows`, or whole), the loss's backward run."""
        if chunk_rows is None:
            logps, entropy = forest_logprobs(self.tree, self.forest, return_entropy=True)
        else:
            logps, entropy = chunked_forest_logprobs(self.tree, self.forest, chunk_rows, return_entropy=True, **kwargs)
        per_sequence = list(zip(gather_sequences(self.forest, logps), gather_sequences(self.forest, entropy)))
        self.loss(per_sequence).backward()
        return logps.detach(), entropy.detach()


@pytest.fixture(scope="module", params=["qwen3_5", "lfm2", "bamba", "falcon_h1", "zamba2"])
def reference(request):
    return _Reference(request.param)


@pytest.mark.parametrize("split", ["2", "3", "8", "fork"])
def test_chunks_match_flat_and_the_whole_forest(reference, split):
    """Log-probs, entropies and every parameter gradient, the forest in 2, 3 or 8 chunks or with a boundary at a
    fork: equal to flat forwards (gradients: to the float64 flat gradient within the fp32 bound plus the fp32 flat
    forward's own error, as tests/test_recurrent.py) and to the unchunked forest."""
    forest = reference.forest
    n = forest.num_tree_tokens
    chunk_rows = _at_a_fork(forest) if split == "fork" else -(-n // int(split))
    inside, forks, states = _boundaries(forest, chunk_rows)
    if split == "fork":
        assert forks >= 1
    if split == "8":  # boundaries inside segments and at forks, a chunk starting several segments from kept states
        assert inside >= 1 and forks >= 1 and states >= 2, (inside, forks, states)
    if split != "fork":
        assert plan_chunks(forest, chunk_rows).num_chunks == int(split)

    logps, entropy = reference.run(chunk_rows)
    _assert_matches(reference, logps, entropy, _grads(reference.tree))


@pytest.mark.parametrize("keep_graphs", [4, 8])
def test_kept_graphs_match_flat_and_the_whole_forest(reference, keep_graphs):
    """The forest in 8 chunks, the last 4 (or all 8) run with autograd in the forward and their graphs kept for the
    backward, storing the states and convolution inputs later chunks read as they run: as exact as recomputing."""
    chunk_rows = -(-reference.forest.num_tree_tokens // 8)
    assert plan_chunks(reference.forest, chunk_rows).num_chunks == 8
    logps, entropy = reference.run(chunk_rows, keep_graphs=keep_graphs)
    _assert_matches(reference, logps, entropy, _grads(reference.tree))


def _assert_matches(reference, logps, entropy, got) -> None:
    """Log-probs and entropies equal the unchunked forest's and the flat forwards', every parameter gradient the
    float64 flat gradient (within the fp32 bound plus the fp32 flat forward's own error) and the unchunked forest's."""
    forest = reference.forest
    torch.testing.assert_close(logps, reference.table[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(entropy, reference.table[1], atol=ATOL, rtol=0)
    for i, (want_logps, want_entropy) in enumerate(reference.flat):
        lp, e = gather_sequences(forest, logps)[i], gather_sequences(forest, entropy)[i]
        torch.testing.assert_close(lp, want_logps, atol=ATOL, rtol=0, msg=lambda m, i=i: f"sequence {i}: {m}")
        torch.testing.assert_close(e, want_entropy, atol=ATOL, rtol=0, msg=lambda m, i=i: f"entropy {i}: {m}")

    assert got.keys() == reference.flat64.keys() == reference.whole.keys() and len(got) > 0
    for name, want in reference.flat64.items():
        worst = (got[name] - want).abs().max().item()
        own = (reference.flat32[name] - want).abs().max().item()
        bound = REL * want.abs().max().item() + 2 * own
        assert worst <= bound, f"{name}: max |chunked - float64 flat| {worst} > {bound}"
        whole = reference.whole[name]
        worst = (got[name] - whole).abs().max().item()
        assert worst <= REL * whole.abs().max().item() + 1e-9, f"{name}: max |chunked - whole forest| {worst}"


def test_one_row_chunks_and_padded_chunks_match_the_whole_forest(reference):
    """Chunks of 1 row (every boundary, every state handed over) and chunks padded to 16 rows (CUDA's layout:
    padding rows are roots of their own): the unchunked forest's log-probs and entropies."""
    with torch.no_grad():
        for chunk_rows, pad in ((1, 1), (24, 16)):
            logps, entropy = chunked_forest_logprobs(
                reference.tree, reference.forest, chunk_rows, return_entropy=True, pad_multiple=pad
            )
            torch.testing.assert_close(logps, reference.table[0], atol=ATOL, rtol=0)
            torch.testing.assert_close(entropy, reference.table[1], atol=ATOL, rtol=0)


def test_non_reentrant_checkpointing_matches_the_whole_forest():
    """transformers' non-reentrant activation checkpointing recomputes a hybrid's layers inside each chunk's
    backward: the recompute reads the same kept states (the same leaves)."""
    reference = _Reference.__new__(_Reference)
    reference.tree, _ = hybrid_twin_models("qwen3_5")
    reference.sequences = _sequences()
    (reference.forest,) = pack_forest(reference.sequences, two_level=False)
    reference.weights = [(torch.ones(len(s) - 1), torch.ones(len(s) - 1)) for s in reference.sequences]
    reference.tree.train()
    table = reference.run(None)
    whole = _grads(reference.tree)
    reference.tree.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert all(layer.gradient_checkpointing for layer in reference.tree.model.layers)
    logps, _ = reference.run(-(-reference.forest.num_tree_tokens // 3))
    got = _grads(reference.tree)
    torch.testing.assert_close(logps, table[0], atol=ATOL, rtol=0)
    for name, want in whole.items():
        assert (got[name] - want).abs().max().item() <= REL * want.abs().max().item() + 1e-9, name


def test_kimi_delta_rule_matches_flat_and_the_whole_forest():
    """The Kimi delta rule (per-channel decay) runs through the same chunked scan: flat log-probs, and the unchunked
    forest's gradients."""
    tree, ref = hybrid_twin_models("kimi_linear")
    sequences = forest_case("grpo", seed=2) + multiturn(random.Random(5), turns=6)
    (forest,) = pack_forest(sequences, two_level=False)
    table, _ = forest_logprobs(tree, forest)
    table.sum().backward()
    whole = _grads(tree)
    logps, _ = chunked_forest_logprobs(tree, forest, -(-forest.num_tree_tokens // 5))
    logps.sum().backward()
    got = _grads(tree)
    torch.testing.assert_close(logps.detach(), table.detach(), atol=ATOL, rtol=0)
    with torch.no_grad():
        for i, seq in enumerate(sequences):
            want, _ = flat_logprobs(ref, seq)
            torch.testing.assert_close(gather_sequences(forest, logps.detach())[i], want, atol=ATOL, rtol=0)
    assert got.keys() == whole.keys() and len(got) > 0
    for name, want in whole.items():
        assert (got[name] - want).abs().max().item() <= REL * want.abs().max().item() + 1e-9, name


@pytest.mark.parametrize("family", ["qwen3_5", "lfm2", "kimi_linear", "bamba"])
def test_kept_state_bytes_is_what_is_stored(family, monkeypatch):
    """`kept_state_bytes` counts the recurrent states and convolution inputs the chunks keep, to the byte."""
    tree, _ = hybrid_twin_models(family)
    (forest,) = pack_forest(_sequences(), two_level=False)
    chunk_rows = -(-forest.num_tree_tokens // 3)
    stored, forward = [], prefix_reuse_module._Step.forward

    def spy(step):
        out = forward(step)
        stored.append(sum(t.numel() * t.element_size() for t in step.rec.values()))
        return out

    monkeypatch.setattr(prefix_reuse_module._Step, "forward", spy)
    with torch.no_grad():
        chunked_forest_logprobs(tree, forest, chunk_rows)
    assert stored[0] > 0 and stored == [kept_state_bytes(tree, forest, plan_chunks(forest, chunk_rows))]


@pytest.mark.parametrize("family", ["qwen3_5", "lfm2", "kimi_linear", "bamba", "nemotron_h", "falcon_h1"])
def test_supported_hybrids_are_accepted(family):
    assert prefix_reuse_error(hybrid_twin_models(family)[0]) is None
