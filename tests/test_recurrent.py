"""State-carrying layers on a forest (`hf_tree_attn.recurrent`): segment scans against per-sequence oracles.

Kernel level: the tree versions of the causal conv, the (gated / Kimi) delta rule and Mamba-2's scan against each
sequence run alone — in float64 with a per-token recurrence as the kernel, so any decay is checked exactly.
Model level: tiny hybrids (`helpers.HYBRID_FAMILIES`) scored as a tree against `eager` flat forwards of the same
weights — log-probs, entropies, parameter gradients — and, without a tree, bit-identical to the stock model.
"""

from __future__ import annotations

import contextlib
import copy
import random
import re
import sys

import pytest
import torch
import torch.nn.functional as F
from accelerate.utils import compile_regions
from helpers import (
    FOREST_CASES,
    HYBRID_FAMILIES,
    TOLERANCES,
    flat_logprobs,
    forest_case,
    hybrid_twin_models,
    multiturn,
    oracle_segments,
    twin_models,
)
from transformers import AutoModelForCausalLM

import hf_tree_attn
from hf_tree_attn import check_tree_model, pack_forest, recurrent, sequence_logprobs, transformers_compat

ATOL = TOLERANCES["logps_atol"]
# One family per kind of state-carrying layer, for the tests that need not run on every family.
ONE_PER_KIND = ("qwen3_5", "kimi_linear", "lfm2", "nemotron_h")
# Kernel-level tolerances by dtype: float64 with the per-token oracle kernel is exact up to rounding; fp32 runs
# transformers' chunked kernels, whose chunk boundaries differ between a segment and the whole sequence.
KERNEL_TOL = {torch.float64: dict(atol=1e-12, rtol=0), torch.float32: dict(atol=2e-5, rtol=0)}


def _modeling(name: str):
    """The modeling module of `name`, its kernel functions replaced by the tree dispatchers."""
    transformers_compat.install()
    return sys.modules[f"transformers.models.{name}.modeling_{name}"]


@contextlib.contextmanager
def stock_kernels(model):
    """`model`'s modeling module with transformers' own kernel functions (the tree dispatchers taken out)."""
    transformers_compat.install()
    module = sys.modules[type(model).__module__]
    wrapped = {name: fn for name, fn in vars(module).items() if hasattr(fn, "tree_original")}
    assert wrapped, f"{module.__name__} has no tree dispatchers"
    try:
        for name, fn in wrapped.items():
            setattr(module, name, fn.tree_original)
        yield
    finally:
        for name, fn in wrapped.items():
            setattr(module, name, fn)


# ----------------------------------------------------------------------------------------------------------------
# Per-forest plans against the dict-trie oracle.


@pytest.mark.parametrize("case", FOREST_CASES)
def test_scan_plan_runs_every_row_once_after_its_parent_segment(case):
    sequences = forest_case(case, seed=1)
    (forest,) = pack_forest(sequences, pad_multiple=16)
    starts, parents, levels = oracle_segments(forest, sequences)
    plan = recurrent._scan_plan(forest, torch.device("cpu"))
    assert sorted(plan.rows.tolist()) == list(range(forest.num_tree_tokens))
    assert plan.pad_rows.tolist() == [r for level in plan.levels for r in level.pad_index.flatten().tolist()]
    assert len(plan.levels) == max(levels) + 1
    previous = None
    for lvl, level in enumerate(plan.levels):
        segments = [s for s, v in enumerate(levels) if v == lvl]  # DFS order inside a level
        want_rows = [r for s in segments for r in range(starts[s], starts[s + 1])]
        assert level.rows.tolist() == want_rows
        assert level.cu_seqlens.tolist() == [0, *torch.tensor([starts[s + 1] - starts[s] for s in segments]).cumsum(0)]
        assert level.cu_seqlens_cpu.device.type == "cpu" and level.cu_seqlens_cpu.tolist() == level.cu_seqlens.tolist()
        real = torch.zeros(level.pad_index.numel(), dtype=torch.bool).index_fill(0, level.valid_slots, True)
        assert level.pad_index.flatten()[level.valid_slots].tolist() == want_rows
        assert (level.pad_index.flatten()[~real] == forest.seq_len).all()
        if lvl == 0:
            assert level.parent_slot is None and all(parents[s] == -1 for s in segments)
        else:
            assert [previous[i] for i in level.parent_slot.tolist()] == [parents[s] for s in segments]
        previous = segments


@pytest.mark.parametrize("kernel_size", [2, 3, 4])
@pytest.mark.parametrize("case", ["mixed", "single_token", "prefix"])
def test_conv_plan_reads_the_ancestor_window(case, kernel_size):
    sequences = forest_case(case, seed=2)
    (forest,) = pack_forest(sequences, pad_multiple=16)
    rows, taps = recurrent._conv_plan(forest, kernel_size, torch.device("cpu"))
    parent = forest.parent.tolist()
    want_rows, want_taps = [], []
    for r in range(forest.num_tree_tokens):
        window, node = [], r
        for _ in range(kernel_size):  # r, its parent, grandparent, ...; -1 above a root
            window.append(node)
            node = parent[node] if node >= 0 else -1
        if window != [r - j if r - j >= 0 else -1 for j in range(kernel_size)]:
            want_rows.append(r)
            want_taps.append([forest.seq_len if n < 0 else n for n in reversed(window)])
    assert rows.tolist() == want_rows
    assert taps.T.tolist() == want_taps


# ----------------------------------------------------------------------------------------------------------------
# Kernels against each sequence alone.


def _forest(case="mixed", seed=3):
    sequences = forest_case(case, seed)
    (forest,) = pack_forest(sequences, pad_multiple=16)
    return forest


def _per_sequence(forest, run, tensors):
    """Run `run(*[t[:, positions] for t in tensors])` per packed sequence; returns `[(positions, output)]`."""
    out = []
    for k in range(len(forest.seq_ids)):
        pos = forest.positions(k)
        out.append((pos, run(*[t[:, pos] for t in tensors])))
    return out


def _first_visit_sum(results, weights, seq_dim):
    """Σ over rows of weights · output, each row counted once (at the first sequence that passes through it)."""
    seen, total = set(), 0.0
    for pos, value in results:
        keep = [i for i, p in enumerate(pos.tolist()) if p not in seen]
        seen.update(pos.tolist())
        picked = value.index_select(seq_dim, torch.tensor(keep, dtype=torch.long))
        total = total + (picked * weights.index_select(seq_dim, pos[keep])).sum()
    return total


@pytest.mark.parametrize("activation", [None, "silu"])
def test_tree_causal_conv1d_equals_each_sequence(activation):
    forest = _forest()
    original = _modeling("qwen3_5").causal_conv1d_fn.tree_original
    g = torch.Generator().manual_seed(0)
    channels, size = 6, forest.seq_len
    x = torch.randn(1, channels, size, generator=g, requires_grad=True)
    weight = torch.randn(channels, 4, generator=g, requires_grad=True)
    bias = torch.randn(channels, generator=g, requires_grad=True)
    got = recurrent.tree_causal_conv1d(original, forest, x, weight, bias, activation=activation)
    w = torch.randn(got.shape, generator=g)
    real = slice(0, forest.num_tree_tokens)
    grads = torch.autograd.grad((got * w)[..., real].sum(), [x, weight, bias])

    results = [(pos, original(x[..., pos], weight, bias, activation=activation)) for pos in _positions(forest)]
    for pos, want in results:
        torch.testing.assert_close(got[..., pos], want, atol=1e-6, rtol=0)
    want_grads = torch.autograd.grad(_first_visit_sum(results, w, seq_dim=2), [x, weight, bias])
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _positions(forest):
    return [forest.positions(k) for k in range(len(forest.seq_ids))]


def _delta_rule_oracle(query, key, value, g, beta, initial_state=None, output_final_state=False,
                       use_qk_l2norm_in_kernel=False, **kwargs):  # fmt: skip
    """The gated delta rule token by token, in the inputs' dtype: `S ← S·exp(g)`, `S ← S + k (β (v − kᵀS))ᵀ`,
    `o = Sᵀ q / √d`. `g` is per head `(B, T, H)` (GDN) or per key channel `(B, T, H, K)` (Kimi)."""
    if use_qk_l2norm_in_kernel:
        query = query / (query.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
        key = key / (key.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    query = query * query.shape[-1] ** -0.5
    decay = g.exp() if g.dim() == 4 else g.exp()[..., None].expand_as(key)
    batch, steps, heads, k_dim = key.shape
    state = initial_state if initial_state is not None else key.new_zeros(batch, heads, k_dim, value.shape[-1])
    outs = []
    for t in range(steps):
        state = state * decay[:, t, :, :, None]
        delta = (value[:, t] - (state * key[:, t, :, :, None]).sum(-2)) * beta[:, t, :, None]
        state = state + key[:, t, :, :, None] * delta[:, :, None, :]
        outs.append((state * query[:, t, :, :, None]).sum(-2))
    return torch.stack(outs, 1), (state if output_final_state else None)


def _delta_rule_inputs(forest, dtype, per_channel_decay, strong_decay=True):
    g = torch.Generator().manual_seed(1)
    size, heads, dim = forest.seq_len, 2, 8
    q, k, v = (torch.randn(1, size, heads, dim, generator=g, dtype=dtype) for _ in range(3))
    decay_shape = (1, size, heads, dim) if per_channel_decay else (1, size, heads)
    # A up to 16 as in transformers' init: some heads forget within a token, others remember.
    scale = 16.0 if strong_decay else 1.0
    log_decay = -F.softplus(torch.randn(decay_shape, generator=g, dtype=dtype)) * scale * torch.rand(1, dtype=dtype)
    beta = torch.rand(1, size, heads, generator=g, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v, log_decay, beta)]


def _varlen_oracle(q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
                   cu_seqlens=None, cu_seqlens_cpu=None):  # fmt: skip
    """A `cu_seqlens` kernel, as flash-linear-attention's, built from the oracle."""
    bounds = cu_seqlens.tolist()
    assert cu_seqlens_cpu.device.type == "cpu" and cu_seqlens_cpu.tolist() == bounds  # the host copy
    outs, finals = [], []
    for n, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        init = None if initial_state is None else initial_state[n : n + 1]
        piece = [t[:, a:b] for t in (q, k, v, g, beta)]
        o, s = _delta_rule_oracle(*piece, init, True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        outs.append(o)
        finals.append(s)
    return torch.cat(outs, 1), torch.cat(finals)


@pytest.mark.parametrize("per_channel_decay", [False, True], ids=["gdn", "kimi"])
@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
def test_tree_delta_rule_is_exact_in_float64(per_channel_decay, varlen, monkeypatch):
    """Outputs and gradients (through the handed-down states) equal each sequence's own scan, for any decay."""
    forest = _forest("multiturn", seed=4)
    tensors = _delta_rule_inputs(forest, torch.float64, per_channel_decay)
    kernel = _delta_rule_oracle
    if varlen:
        kernel = _varlen_oracle
        monkeypatch.setattr(recurrent, "_use_varlen", lambda original, device: True)
    q, k, v, g, beta = tensors
    got, _ = recurrent.tree_delta_rule(kernel, forest, q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    w = torch.randn(got.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    grads = torch.autograd.grad((got * w)[:, : forest.num_tree_tokens].sum(), tensors)

    def alone(q, k, v, g, beta):
        return _delta_rule_oracle(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]

    results = _per_sequence(forest, alone, tensors)
    for pos, want in results:
        torch.testing.assert_close(got[:, pos], want, **KERNEL_TOL[torch.float64])
    want_grads = torch.autograd.grad(_first_visit_sum(results, w, seq_dim=1), tensors)
    for name, a, b in zip(["q", "k", "v", "g", "beta"], grads, want_grads):
        torch.testing.assert_close(a, b, **KERNEL_TOL[torch.float64], msg=lambda m, name=name: f"d/d{name}: {m}")
    assert (got[:, forest.num_tree_tokens :] == 0).all(), "padding rows get zeros"


_TWO_PASS_CASES = [*FOREST_CASES, "agent_5_turns", "agent_45_turns"]


def _two_pass_forest(case: str):
    if case.startswith("agent_"):
        turns = int(case.split("_")[1])
        return pack_forest(multiturn(random.Random(turns), turns=turns), pad_multiple=16)[0]
    return _forest(case, seed=4)


@pytest.mark.parametrize("per_channel_decay", [False, True], ids=["gdn", "kimi"])
@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
@pytest.mark.parametrize("value_dim", [8, 5], ids=["v=k", "v<k"])
@pytest.mark.parametrize("case", _TWO_PASS_CASES)
def test_two_pass_delta_rule_equals_each_sequence(case, value_dim, varlen, per_channel_decay, monkeypatch):
    """The two-call delta rule (every forest, 1 to 40+ levels) gives each sequence's own outputs and gradients, in
    float64, with a value width equal to the key width (the identity's columns as a second copy of the segments) and
    unlike it (as extra value columns); and so does the level loop on the same inputs."""
    forest = _two_pass_forest(case)
    if case == "agent_45_turns":
        assert forest.num_levels >= 40
    q, k, _, g, beta = _delta_rule_inputs(forest, torch.float64, per_channel_decay)
    v = torch.randn(1, forest.seq_len, 2, value_dim, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    tensors = [q, k, v.requires_grad_(), g, beta]
    kernel = _delta_rule_oracle
    if varlen:
        kernel = _varlen_oracle
        monkeypatch.setattr(recurrent, "_use_varlen", lambda original, device: True)
    w = torch.randn(forest.seq_len, 2, value_dim, generator=torch.Generator().manual_seed(2), dtype=torch.float64)[
        None
    ]
    runs = {}
    for name, min_levels in (("two_pass", 1), ("level_loop", None)):
        monkeypatch.setitem(recurrent.TWO_PASS_MIN_LEVELS, "varlen" if varlen else "padded", min_levels)
        got, _ = recurrent.tree_delta_rule(kernel, forest, *tensors[:3], g=g, beta=beta, use_qk_l2norm_in_kernel=True)
        runs[name] = got, torch.autograd.grad((got * w)[:, : forest.num_tree_tokens].sum(), tensors)

    def alone(q, k, v, g, beta):
        return _delta_rule_oracle(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]

    results = _per_sequence(forest, alone, tensors)
    want_grads = torch.autograd.grad(_first_visit_sum(results, w, seq_dim=1), tensors)
    for got, grads in runs.values():
        for pos, want in results:
            torch.testing.assert_close(got[:, pos], want, **KERNEL_TOL[torch.float64])
        for name, a, b in zip(["q", "k", "v", "g", "beta"], grads, want_grads):
            torch.testing.assert_close(a, b, **KERNEL_TOL[torch.float64], msg=lambda m, name=name: f"d/d{name}: {m}")
        assert (got[:, forest.num_tree_tokens :] == 0).all(), "padding rows get zeros"


@pytest.mark.parametrize("given", [True, False], ids=["given_states", "zero_states"])
@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
def test_two_pass_starts_from_given_states_and_keeps_the_named_ones(varlen, given):
    """As a prefix-reuse chunk runs it: roots start from given states (or from zero: the first chunk), and the final
    states `keep` names (leaves among them) come back, equal to the level loop's, values and gradients."""
    forest = _two_pass_forest("agent_5_turns")
    tensors = _delta_rule_inputs(forest, torch.float64, per_channel_decay=False)
    plan = recurrent._scan_plan(forest, tensors[0].device)
    roots = plan.levels[0].cu_seqlens.numel() - 1
    initial = torch.randn(roots, 2, 8, 8, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    initial.requires_grad_()
    wrt = [*tensors, initial] if given else tensors
    keep = [torch.arange(len(level.cu_seqlens) - 1)[i % 2 :: 2] for i, level in enumerate(plan.levels)]
    kernel = _varlen_oracle if varlen else _delta_rule_oracle

    def run(level_inputs, start, level):
        q, k, v, g, beta = level_inputs
        bounds = {"cu_seqlens": level.cu_seqlens, "cu_seqlens_cpu": level.cu_seqlens_cpu} if varlen else {}
        return kernel(q, k, v, g, beta, start, True, use_qk_l2norm_in_kernel=True, **bounds)

    results = []
    for scan in (recurrent._scan_two_pass, recurrent._scan_levels):
        out, kept = scan(forest, tensors, varlen, run, initial=initial if given else None, keep=keep)
        loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum() + kept.pow(2).sum()
        results.append((out, kept, torch.autograd.grad(loss, wrt)))
    (out, kept, grads), (want_out, want_kept, want_grads) = results
    torch.testing.assert_close(out, want_out, **KERNEL_TOL[torch.float64])
    torch.testing.assert_close(kept, want_kept, **KERNEL_TOL[torch.float64])
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, **KERNEL_TOL[torch.float64])


@pytest.mark.parametrize("module, name", [("qwen3_5", "torch_chunk_gated_delta_rule"),
                                          ("kimi_linear", "chunk_kimi_delta_attention")])  # fmt: skip
def test_tree_delta_rule_with_transformers_kernel(module, name):
    """transformers' fp32 chunked kernel per level equals the kernel per sequence (weak decays: well conditioned)."""
    forest = _forest("grpo", seed=5)
    original = getattr(_modeling(module), name).tree_original
    tensors = _delta_rule_inputs(forest, torch.float32, name.endswith("attention"), strong_decay=False)
    q, k, v, g, beta = tensors
    got, _ = recurrent.tree_delta_rule(original, forest, q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    for pos in _positions(forest):
        want, _ = original(
            q[:, pos], k[:, pos], v[:, pos], g=g[:, pos], beta=beta[:, pos], use_qk_l2norm_in_kernel=True
        )
        torch.testing.assert_close(got[:, pos], want, **KERNEL_TOL[torch.float32])


def test_tree_mamba2_scan_equals_each_sequence():
    forest = _forest("multiturn", seed=6)
    original = _modeling("nemotron_h").mamba2_chunk_scan.tree_original
    g = torch.Generator().manual_seed(3)
    size, heads, head_dim, groups, state = forest.seq_len, 4, 8, 2, 8
    x = torch.randn(1, size, heads, head_dim, generator=g)
    dt = torch.randn(1, size, heads, generator=g)
    b, c = (torch.randn(1, size, groups, state, generator=g) for _ in range(2))
    tensors = [t.requires_grad_() for t in (x, dt, b, c)]
    params = dict(
        A=-torch.rand(heads, generator=g) * 4, D=torch.randn(heads, generator=g),
        dt_bias=torch.randn(heads, generator=g), dt_softplus=True, dt_limit=(0.001, 5.0), chunk_size=4,
    )  # fmt: skip

    got = recurrent.tree_mamba2_chunk_scan(original, forest, x, dt, B=b, C=c, **params)
    w = torch.randn(got.shape, generator=g)
    grads = torch.autograd.grad((got * w)[:, : forest.num_tree_tokens].sum(), tensors)
    results = _per_sequence(forest, lambda x, dt, b, c: original(x, dt, B=b, C=c, **params), tensors)
    for pos, want in results:
        torch.testing.assert_close(got[:, pos], want, atol=1e-5, rtol=0)
    want_grads = torch.autograd.grad(_first_visit_sum(results, w, seq_dim=1), tensors)
    for a, b_ in zip(grads, want_grads):
        torch.testing.assert_close(a, b_, atol=1e-5, rtol=1e-4)


def test_host_bounds_go_only_to_a_kernel_that_takes_them(monkeypatch):
    """transformers' wrapper passes on only the keyword arguments of the kernel it resolved: `_kernel_params` reads
    those (fla 0.6's `cu_seqlens_cpu` lets it plan chunks without a device read-back; a kernel without it gets
    none)."""
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    def torch_reference(query, key, value, g, beta, initial_state=None, output_final_state=False):
        raise AssertionError("not called")

    def kernel_with(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None,
                    cu_seqlens_cpu=None, **kwargs):  # fmt: skip
        raise AssertionError("not called")

    def kernel_without(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None, **kwargs):
        raise AssertionError("not called")

    for kernel, takes in [(kernel_with, True), (kernel_without, False)]:
        package = type(sys)("fake_gdn_package")
        package.fake_delta_rule = kernel
        monkeypatch.setitem(sys.modules, "fake_gdn_package", package)
        wrapped = use_kernel_func_from_hub_with_fallback("fake_delta_rule", "fake_gdn_package")(torch_reference)
        assert ("cu_seqlens_cpu" in recurrent._kernel_params(wrapped)) is takes
        assert "cu_seqlens" in recurrent._kernel_params(wrapped)
    assert "cu_seqlens_cpu" not in recurrent._kernel_params(torch_reference)


def test_tree_kernels_refuse_a_cache():
    forest = _forest()
    original = _modeling("qwen3_5").torch_chunk_gated_delta_rule.tree_original
    q, k, v, g, beta = _delta_rule_inputs(forest, torch.float32, False)
    with pytest.raises(ValueError, match="cannot continue a cache.*use_cache=False"):
        recurrent.tree_delta_rule(original, forest, q, k, v, g=g, beta=beta, output_final_state=True)
    with pytest.raises(ValueError, match="carries its own boundaries.*without cu_seq_lens"):
        recurrent.tree_delta_rule(original, forest, q, k, v, g=g, beta=beta, cu_seqlens=torch.tensor([0, 4]))


# ----------------------------------------------------------------------------------------------------------------
# Hybrid models: tree against flat, same weights.


def _assert_matches_flat(ref, sequences, logps, entropies):
    for i, seq in enumerate(sequences):
        want_logps, want_entropy = flat_logprobs(ref, seq)
        torch.testing.assert_close(logps[i], want_logps, atol=ATOL, rtol=0, msg=lambda m, i=i: f"sequence {i}: {m}")
        torch.testing.assert_close(
            entropies[i], want_entropy, atol=ATOL, rtol=0, msg=lambda m, i=i: f"entropy {i}: {m}"
        )


# Every forest case alone on Qwen3.5; on every family the mixed forest (all the cases at once, several tries).
_CASES = [("qwen3_5", c) for c in FOREST_CASES if c != "mixed"] + [(f, "mixed") for f in HYBRID_FAMILIES]


@pytest.mark.parametrize("family, case", _CASES)
def test_logprobs_and_entropies_match_flat(family, case):
    tree, ref = hybrid_twin_models(family)
    sequences = forest_case(case, seed=0)
    with torch.no_grad():
        logps, entropies = sequence_logprobs(tree, sequences, return_entropy=True)
        _assert_matches_flat(ref, sequences, logps, entropies)


@pytest.mark.parametrize(
    "family", (*ONE_PER_KIND, "qwen3_5_moe", "qwen3_next", "lara_mini", "bailing_hybrid", "lfm3", "zamba2")
)
def test_deep_multiturn_tree_matches_flat(family):
    """A 20-turn agent tree (20+ levels): the states are handed down through every branch point."""
    tree, ref = hybrid_twin_models(family)
    sequences = multiturn(random.Random(7), turns=20)
    assert pack_forest(sequences)[0].num_levels >= 20
    with torch.no_grad():
        logps, entropies = sequence_logprobs(tree, sequences, return_entropy=True)
        _assert_matches_flat(ref, sequences, logps, entropies)


def _float64_twin(model):
    """A float64 copy of `model` (experts looped in torch: grouped matmuls take no float64), its gradients cleared."""
    twin = copy.deepcopy(model).double()
    twin.zero_grad(set_to_none=True)
    if twin._can_set_experts_implementation():
        twin.set_experts_implementation("eager")
    return twin


def _param_grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_split_tries_logprobs_and_gradients_match_flat(family):
    """Several micro-batches (tries split by max_tokens_per_mb, several tries per micro-batch), in train mode."""
    _split_tries_match_flat(family)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "kimi_linear"])
def test_delta_rule_in_two_calls_matches_flat(family, monkeypatch):
    """The same with every delta rule in two kernel calls (`recurrent._scan_two_pass`, which the tree takes on varlen
    kernels), on transformers' torch kernels: Gated DeltaNet (twice as many value heads as key heads; Qwen3-Next's with
    MoE layers) and Kimi's per-channel decay."""
    monkeypatch.setitem(recurrent.TWO_PASS_MIN_LEVELS, "padded", 1)
    calls = []
    real = recurrent._scan_two_pass
    monkeypatch.setattr(recurrent, "_scan_two_pass", lambda *a, **k: calls.append(1) or real(*a, **k))
    _split_tries_match_flat(family)
    assert calls, "the two-call path did not run"


def _split_tries_match_flat(family):
    tree, ref = hybrid_twin_models(family)
    tree.train(), ref.train()
    sequences = forest_case("mixed", seed=3) + multiturn(random.Random(5), turns=12)
    forests = pack_forest(sequences, max_tokens_per_mb=128)
    micro_batches_of_trie = {}
    for i, forest in enumerate(forests):
        for seq_id in forest.seq_ids:
            micro_batches_of_trie.setdefault(sequences[seq_id][0], set()).add(i)
    assert any(len(where) > 1 for where in micro_batches_of_trie.values()), "no trie was split"
    assert any(len({sequences[s][0] for s in forest.seq_ids}) > 1 for forest in forests), "one trie per micro-batch"
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(len(s) - 1, generator=g) for s in sequences]

    logps, entropies = sequence_logprobs(tree, sequences, max_tokens_per_mb=128, return_entropy=True)
    with torch.no_grad():
        _assert_matches_flat(ref, sequences, logps, entropies)
    sum((w * lp).sum() + 0.1 * e.sum() for w, lp, e in zip(weights, logps, entropies)).backward()
    exact = _float64_twin(ref)
    for model, dtype in ((ref, torch.float32), (exact, torch.float64)):
        flat = [flat_logprobs(model, s) for s in sequences]
        sum((w.to(dtype) * lp).sum() + 0.1 * e.sum() for w, (lp, e) in zip(weights, flat)).backward()

    # Against the float64 flat gradient: the tree's error within the fp32 bound plus twice the fp32 flat forward's
    # own error. A decay parameter's gradient (`A_log`, `dt_bias`: one entry per head) sums every token of the
    # ~1,800 here through the chunked kernels, with cancellation, so the fp32 flat forward alone is off by up to
    # ~1e-5 of its largest entry on it (seen 6e-6 to 8e-6 on 1 and 2 threads, AVX-512), where a tree-vs-flat
    # comparison of two fp32 runs would see both errors.
    got, flat32, want = _param_grads(tree), _param_grads(ref), _param_grads(exact)
    assert got.keys() == want.keys() == flat32.keys() and len(got) > 0
    for name, value in want.items():
        worst = (got[name].double() - value).abs().max().item()
        own = (flat32[name].double() - value).abs().max().item()
        bound = TOLERANCES["grad_max_rel"] * value.abs().max().item() + 2 * own
        assert worst <= bound, f"{name}: max |tree - float64| {worst} > {bound} (fp32 flat's own error {own})"
    cosine = F.cosine_similarity(
        torch.cat([got[k].flatten() for k in sorted(got)]).double(),
        torch.cat([want[k].flatten() for k in sorted(want)]).double(),
        dim=0,
    ).item()
    assert cosine >= TOLERANCES["grad_cosine"], cosine


@pytest.mark.parametrize("family", ONE_PER_KIND)
def test_a_state_leaking_across_branches_fails_the_oracle(family):
    """With the stock kernels, the DFS row runs as one sequence: siblings see each other's states (the tests can
    fail)."""
    tree, ref = hybrid_twin_models(family)
    sequences = forest_case("grpo", seed=0)
    with torch.no_grad(), stock_kernels(tree):
        leaked = sequence_logprobs(tree, sequences)
    worst = max((leaked[i] - flat_logprobs(ref, s)[0]).abs().max().item() for i, s in enumerate(sequences))
    assert worst > 100 * ATOL


# ----------------------------------------------------------------------------------------------------------------
# Without a tree: bit-identical to the stock model.


def _stock_twin(tree):
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(tree.config), attn_implementation="sdpa").eval()
    ref.load_state_dict(tree.state_dict())
    return ref


@pytest.mark.parametrize("family", ONE_PER_KIND)
def test_padded_forward_and_generate_bit_identical_to_stock(family):
    tree, _ = hybrid_twin_models(family)
    stock = _stock_twin(tree)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4], mask[2, :7] = 0, 0  # left padding
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None,
                  return_dict_in_generate=True, output_logits=True)  # fmt: skip
    with torch.no_grad():
        got_logits = tree(input_ids=ids, attention_mask=mask).logits
        got = tree.generate(ids, **kwargs)
        with stock_kernels(stock):
            want_logits = stock(input_ids=ids, attention_mask=mask).logits
            want = stock.generate(ids, **kwargs)
    assert torch.equal(got_logits, want_logits)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))


def test_block_mask_forward_on_cpu_matches_dense(monkeypatch):
    """The CUDA input (a `BlockMask`) reaches the recurrent layers as no padding mask (FlexAttention's forward runs
    on CPU without grad; uncompiled here: what is tested is the recurrent layers' mask, and inductor's CPU flex
    kernel can fail to build after other shapes compiled it dynamically)."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(hf_tree_attn.attention, "_compiled_flex", lambda grad: flex_attention)
    tree, _ = hybrid_twin_models("qwen3_5")
    (forest,) = pack_forest(forest_case("grpo", seed=2))
    kwargs = hf_tree_attn.logprobs.forest_forward_kwargs(forest, "cpu")
    with torch.no_grad():
        dense = tree(**kwargs).logits
        block = tree(**{**kwargs, "attention_mask": forest.block_mask("cpu")}).logits
    real = slice(0, forest.num_tree_tokens)
    torch.testing.assert_close(block[0, real], dense[0, real], atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------------------------------------
# The gate: implemented kinds pass, everything else is refused with the layer and the reason.


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_gate_accepts_implemented_hybrids(family):
    tree, _ = hybrid_twin_models(family)
    assert recurrent.unsupported_recurrent_layers(tree) == {}
    assert recurrent.tree_layer_types(tree) & {"linear_attention", "conv"}
    check_tree_model(tree)


def _refused(model_type: str, **overrides):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(
        model_type, vocab_size=128, hidden_size=32, num_attention_heads=2, num_key_value_heads=2, **overrides
    )
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="tree_flex")


@pytest.mark.parametrize(
    "model_type, overrides, layer",
    [
        ("jamba", dict(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, num_experts=1,
                       intermediate_size=64, mamba_d_state=4), "JambaMambaMixer"),
        ("minimax", dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], head_dim=16,
                         intermediate_size=64, num_local_experts=2, block_size=16), "MiniMaxLightningAttention"),
    ],
    ids=["jamba-mamba1", "minimax-lightning"],
)  # fmt: skip
def test_gate_refuses_unimplemented_state_with_the_reason(model_type, overrides, layer, monkeypatch):
    """Refused by its family; and were the family listed as exact, by its layer class (the config's kind name,
    "linear_attention" for MiniMax as for Qwen3.5, proves nothing)."""
    import hf_tree_attn.support as support

    model = _refused(model_type, **overrides)
    with pytest.raises(NotImplementedError, match=rf"model_type '{model_type}': layers that carry state"):
        check_tree_model(model)
    monkeypatch.setitem(support.EXACT_FAMILIES, model_type, "")
    monkeypatch.delitem(support.REFUSED_FAMILIES, model_type)
    with pytest.raises(NotImplementedError, match=rf"{layer}: .*(Mamba-1|lightning).*tree_packing=False"):
        check_tree_model(model)


def test_gate_refuses_an_unknown_state_carrying_layer(monkeypatch):
    """A depthwise Conv1d in a layer the table does not list: refused, not run over the DFS row."""
    tree, _ = hybrid_twin_models("lfm2")
    monkeypatch.delitem(recurrent.TREE_LAYERS, "transformers.models.lfm2.modeling_lfm2.Lfm2ShortConv")
    with pytest.raises(NotImplementedError, match=r"Lfm2ShortConv: a state-carrying layer the tree does not know"):
        check_tree_model(tree)


@pytest.mark.parametrize("family", ["qwen3_5", "bamba"])
def test_a_hybrid_with_hub_kernels_in_its_state_layers_is_refused(family):
    """A Hugging Face Hub kernel swapped into a state-carrying layer (its forward: transformers maps
    Qwen3_5GatedDeltaNet to one on some GPUs; or the layer's copy of a kernel function) runs out of the tree's
    dispatch: refused with the reason and the way out, whatever the flag says. A Hub kernel outside the
    state-carrying layers (per token) is not refused. `use_kernels=True` — which `from_pretrained` sets by default
    from transformers 5.25 on — is refused even where nothing is swapped in yet (on the CPU): transformers'
    `train()`, which the Trainer calls every step, kernelizes the model again on the device it is on then. An
    attention-only model with the flag is not refused (its Hub kernels act per token)."""
    tree, _ = hybrid_twin_models(family)
    check_tree_model(tree)
    tree._use_kernels = True  # what PreTrainedModel.use_kernels reads
    assert tree.use_kernels
    with pytest.raises(
        NotImplementedError, match=r"use_kernels=True.*train\(\).*Load the model with use_kernels=False"
    ):
        check_tree_model(tree)
    tree._use_kernels = False
    if transformers_compat.hub_kernels_in(tree, set()) is not None:  # `kernels` says what it swapped in
        tree.get_output_embeddings().__dict__["_kernel_repo"] = "a Hub repository"  # how `kernels` marks a swap
        check_tree_model(tree)  # outside the state-carrying layers
        paths = recurrent.TREE_LAYERS
        name, layer = next((n, m) for n, m in tree.named_modules() if recurrent._class_path(type(m)) in paths)
        marked = [layer, *vars(layer).get("_kernel_funcs", {}).values()]  # the layer, its function copies (5.25)
        for module in marked:
            module.__dict__["_kernel_repo"] = "a Hub repository"
            refusal = rf"Hub kernels .* state-carrying layers \({re.escape(name)}"
            with pytest.raises(NotImplementedError, match=refusal):
                check_tree_model(tree)
            del module.__dict__["_kernel_repo"]
        if family == "qwen3_5":
            assert len(marked) > 1  # its layer lists its kernel functions for `kernels`
    dense, _ = twin_models("qwen3")
    dense._use_kernels = True
    check_tree_model(dense)


class _DropsKwargs(torch.nn.Module):
    """A layer whose conv call does not forward the model kwargs (a transformers version could do this)."""

    def forward(self, x, **kwargs):
        mixed = causal_conv1d_fn(x, self.weight, None, activation="silu")  # noqa: F821
        return torch_chunk_gated_delta_rule(mixed, mixed, mixed, g=x, beta=x, **kwargs)  # noqa: F821


def test_a_layer_that_does_not_pass_the_kwargs_on_is_refused(monkeypatch):
    assert not recurrent._passes_kwargs(_DropsKwargs, "causal_conv1d_fn")
    assert recurrent._passes_kwargs(_DropsKwargs, "torch_chunk_gated_delta_rule")
    tree, _ = hybrid_twin_models("qwen3_5")
    path = "transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5GatedDeltaNet"
    monkeypatch.setitem(recurrent._UNAVAILABLE, path, "does not pass the model kwargs to `causal_conv1d_fn`")
    with pytest.raises(NotImplementedError, match=r"Qwen3_5GatedDeltaNet: does not pass the model kwargs"):
        check_tree_model(tree)


def _layer_dropping_kwargs(layer_class: type) -> type:
    """A Qwen3.5 decoder layer that calls its Gated DeltaNet without the model kwargs (as a transformers version
    could): `tree_forest` stops there."""

    class DropsKwargs(layer_class):
        def forward(self, hidden_states, position_embeddings, attention_mask=None, position_ids=None, **kwargs):
            if self.block_type != "linear_attention":
                return super().forward(hidden_states, position_embeddings, attention_mask, position_ids, **kwargs)
            residual = hidden_states
            hidden_states = residual + self.linear_attn(hidden_states=self.input_layernorm(hidden_states))
            return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))

    return DropsKwargs


def test_a_model_whose_forwards_drop_the_kwargs_before_the_layer_is_refused(monkeypatch):
    """The gate reads every forward between the model and each state-carrying layer: where one does not pass the
    kwargs on, `tree_forest` never reaches the layer, which then runs over the DFS row — silently wrong (shown
    here with the gate bypassed), so it is refused."""
    tree, ref = hybrid_twin_models("qwen3_5")
    assert recurrent.kwargs_breaks(tree) == {}
    assert recurrent.kwargs_breaks(compile_regions(copy.deepcopy(tree))) == {}  # torch.compile passes them on
    layer = tree.model.layers[0]
    assert layer.block_type == "linear_attention"
    layer.__class__ = _layer_dropping_kwargs(type(layer))
    assert recurrent.kwargs_breaks(tree) == {
        "Qwen3_5GatedDeltaNet": "DropsKwargs.forward does not pass the model kwargs on to `model.layers.0.linear_attn`"
    }
    with pytest.raises(NotImplementedError, match=r"Qwen3_5GatedDeltaNet: DropsKwargs.forward does not pass"):
        check_tree_model(tree)
    monkeypatch.setattr(sys.modules["hf_tree_attn.logprobs"], "check_tree_model", lambda model: None)
    ref.model.layers[0].__class__ = tree.model.layers[0].__class__  # the same math, flat
    sequences = forest_case("grpo", seed=0)
    with torch.no_grad():
        leaked = sequence_logprobs(tree, sequences)
        worst = max((leaked[i] - flat_logprobs(ref, s)[0]).abs().max().item() for i, s in enumerate(sequences))
    assert worst > 100 * ATOL
