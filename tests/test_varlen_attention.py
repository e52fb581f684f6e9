"""Tree attention in varlen calls (`hf_tree_attn.varlen_attention`, FlashAttention-4 on CUDA): the shared-prefix
split of two-level forests in two calls, and any forest's segments over their gathered paths in one.

On CPU the calls run through `varlen_attention.REFERENCE` (FlashAttention's varlen contract in plain PyTorch, rows no
sequence covers left NaN as the kernels leave them unwritten), so everything around the kernel is checked here:

- the calls' sequences: the mask they imply is the forest's tree mask, row for row, on every forest shape;
- the reference kernel against SDPA per sequence, with offsets, lengths that leave gaps, GQA, bottom-right causal;
- each route against SDPA with the dense tree mask (float64, float32; GQA; padding rows; the projections' layout;
  deep agent trees for the gathered paths), and through a model: the per-sequence log-probs and the dense route's
  gradients, eager and in regionally compiled layers;
- the setting: `HF_TREE_ATTN_PREFIX_KERNEL` checked at import, FlashAttention-4 missing or an unsupported GPU
  refused with the reason, every two-level forest taken on CUDA without waiting for a recurring shape.
- GPU (`-m gpu`, needs `flash_attn.cute`): a model's log-probs as close to float32 as FlexAttention's (the kernels
  alone: `test_prefix_attention.py::test_cuda_kernels_as_close_as_flex_attention`).
"""

from __future__ import annotations

import copy
import os
import random
import subprocess
import sys

import pytest
import torch
from helpers import TOLERANCES, flat_logprobs, forest_case
from test_prefix_attention import (
    ATOL,
    CASES,
    CONFIG,
    _dense_reference,
    _heads_view,
    _two_level_groups,
    assert_as_close_as_flex_attention,
    compiled_layers_match_eager,
)
from transformers import AutoModelForCausalLM

import hf_tree_attn
from hf_tree_attn import pack_forest
from hf_tree_attn import prefix_attention as pa
from hf_tree_attn import varlen_attention as pv
from hf_tree_attn.logprobs import forest_logprobs, gather_sequences


class _Counting:
    """`REFERENCE`, counting its forward calls."""

    def __init__(self):
        self.forwards = 0

    def forward(self, *args):
        self.forwards += 1
        return pv.REFERENCE.forward(*args)

    def backward(self, *args):
        return pv.REFERENCE.backward(*args)


@pytest.fixture
def varlen(monkeypatch):
    """Every `prefix_attention` call runs the varlen route, on the reference kernel: returns the counting kernel."""
    kernel = _Counting()
    monkeypatch.setattr(pa, "_varlen_kernel", lambda query: kernel)
    return kernel


def _mask_of_calls(calls: pv.VarlenCalls, size: int) -> torch.Tensor:
    """`(size, size)` bool: the (query, key) pairs the two calls attend, own causal and shared whole."""
    mask = torch.zeros(size, size, dtype=torch.bool)
    own = calls.own_starts.tolist()
    for a, b in zip(own, own[1:]):
        mask[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    q, k = calls.shared_q.tolist(), calls.shared_k.tolist()
    for t, (rows, keys) in enumerate(zip(calls.shared_q_rows.tolist(), calls.shared_k_rows.tolist())):
        assert not mask[q[t] : q[t] + rows, k[t] : k[t] + keys].any()  # the two key sets are disjoint
        mask[q[t] : q[t] + rows, k[t] : k[t] + keys] = True
    return mask


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_calls_attend_exactly_the_tree_mask(case):
    """The pairs the own and shared calls attend are the forest's ancestor-or-self mask (padding rows: themselves
    only), each pair once; the flags mark the rows with a shared part and the keys it reads."""
    (forest,) = pack_forest(CASES[case](random.Random(case)), pad_multiple=16)
    calls = pv.varlen_calls(forest.prefix_plan, forest.seq_len, "cpu")
    mask = _mask_of_calls(calls, forest.seq_len)
    assert torch.equal(mask, forest.dense_mask()[0, 0])
    q, k = calls.shared_q.tolist(), calls.shared_k.tolist()
    completion, prompt = torch.zeros_like(calls.completion), torch.zeros_like(calls.prompt)
    for t, (rows, keys) in enumerate(zip(calls.shared_q_rows.tolist(), calls.shared_k_rows.tolist())):
        completion[q[t] : q[t] + rows], prompt[k[t] : k[t] + keys] = True, True
    assert torch.equal(calls.completion, completion) and torch.equal(calls.prompt, prompt)
    own = calls.own_starts.diff()
    assert calls.own_longest == int(own.max()) and (own > 0).all()
    assert calls.shared_q_longest == max(calls.shared_q_rows.tolist(), default=0)
    assert pv.varlen_calls(forest.prefix_plan, forest.seq_len, "cpu") is calls  # built once per plan


def test_a_plan_that_does_not_tile_the_rows_is_refused():
    from hf_tree_attn.prefix_attention import PrefixTree, prefix_plan

    gap = prefix_plan(10, (PrefixTree(0, 3, (3, 5)), PrefixTree(6, 8, (8, 10))))
    with pytest.raises(ValueError, match="starts at row 6, the previous one ends at 5"):
        pv.varlen_calls(gap, 16, "cpu")
    short = prefix_plan(10, (PrefixTree(0, 3, (3, 5)),))
    with pytest.raises(ValueError, match=r"cover rows \[0, 5\) of 10 tokens"):
        pv.varlen_calls(short, 16, "cpu")


def test_reference_kernel_is_attention_per_sequence():
    """Sequence `b`: queries at `cu_q[b]`, keys at `cu_k[b]`, as many as `used` says (gaps between them), GQA heads;
    against SDPA on each sequence alone, forward (with its log-sum-exp) and backward given its output; rows no
    sequence covers stay NaN in every result."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(20, 6, 8, dtype=torch.float64, generator=g)
    k, v = (torch.randn(20, 2, 8, dtype=torch.float64, generator=g) for _ in "kv")
    cu_q, cu_k = torch.tensor([2, 9, 20]), torch.tensor([0, 12, 20])
    used_q, used_k = torch.tensor([4, 7]), torch.tensor([5, 8])
    out, lse = pv.REFERENCE.forward(q, k, v, cu_q, cu_k, used_q, used_k, 7, 8, False, 0.3)
    dout = torch.randn(q.shape, dtype=torch.float64, generator=g)
    grads = pv.REFERENCE.backward(dout, q, k, v, out, lse, cu_q, cu_k, used_q, used_k, 7, 8, False, 0.3)
    covered_q, covered_k = torch.zeros(20, dtype=torch.bool), torch.zeros(20, dtype=torch.bool)
    for rows, keys in ((slice(2, 6), slice(0, 5)), (slice(9, 16), slice(12, 20))):
        covered_q[rows], covered_k[keys] = True, True
        x = [t[span].transpose(0, 1)[None].clone().requires_grad_() for t, span in ((q, rows), (k, keys), (v, keys))]
        want = _dense_reference(*x, None, 0.3)
        torch.testing.assert_close(out[rows].transpose(0, 1)[None], want, atol=1e-12, rtol=0)
        scores = (x[0] @ x[1].repeat_interleave(3, 1).transpose(-1, -2)) * 0.3
        torch.testing.assert_close(lse[:, rows], scores.logsumexp(-1)[0], atol=1e-12, rtol=0)
        want_grads = torch.autograd.grad(want, x, dout[rows].transpose(0, 1)[None])
        for got, wanted, span in zip(grads, want_grads, (rows, keys, keys)):
            torch.testing.assert_close(got[span].transpose(0, 1)[None], wanted, atol=1e-12, rtol=0)
    assert out[~covered_q].isnan().all() and lse[:, ~covered_q].isnan().all() and grads[0][~covered_q].isnan().all()
    assert grads[1][~covered_k].isnan().all() and grads[2][~covered_k].isnan().all()


def test_reference_kernel_is_causal_to_the_bottom_right():
    """Causal with fewer queries than keys: query `a` of `n_q` sees keys up to `n_k - n_q + a` (FlashAttention's
    alignment, what a segment over its gathered path needs); against SDPA with that mask, forward and backward."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(5, 4, 8, dtype=torch.float64, generator=g)
    k, v = (torch.randn(12, 2, 8, dtype=torch.float64, generator=g) for _ in "kv")
    cu_q, cu_k = torch.tensor([0, 5]), torch.tensor([0, 12])
    out, lse = pv.REFERENCE.forward(q, k, v, cu_q, cu_k, None, None, 5, 12, True, 0.3)
    dout = torch.randn(q.shape, dtype=torch.float64, generator=g)
    grads = pv.REFERENCE.backward(dout, q, k, v, out, lse, cu_q, cu_k, None, None, 5, 12, True, 0.3)
    mask = torch.arange(12)[None, :] <= torch.arange(5)[:, None] + 7
    x = [t.transpose(0, 1)[None].clone().requires_grad_() for t in (q, k, v)]
    want = _dense_reference(*x, mask, 0.3)
    torch.testing.assert_close(out.transpose(0, 1)[None], want, atol=1e-12, rtol=0)
    for got, wanted in zip(grads, torch.autograd.grad(want, x, dout.transpose(0, 1)[None])):
        torch.testing.assert_close(got.transpose(0, 1)[None], wanted, atol=1e-12, rtol=0)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_route_matches_the_dense_tree_mask(case, heads, dtype, layout, varlen):
    """`prefix_attention` through the varlen route (two kernel calls; one where no tree has completions) against
    SDPA with the dense tree mask, forward and q / k / v gradients; its output laid out as the per-tree route's."""
    seqs = CASES[case](random.Random(case))
    (forest,) = pack_forest(seqs, pad_multiple=16)
    g = torch.Generator().manual_seed(0)
    size, dim = forest.seq_len, 16
    q = _heads_view(heads[0], size, dim, dtype, g, layout)
    k, v = (_heads_view(heads[1], size, dim, dtype, g, layout) for _ in "kv")
    out = pa.prefix_attention(q, k, v, forest.prefix_plan, dim**-0.5)
    assert out.transpose(1, 2).is_contiguous()
    completions = pv.varlen_calls(forest.prefix_plan, size, "cpu").shared_q_longest > 0
    assert varlen.forwards == 1 + completions and (completions or case in ("no_completions", "single_tokens"))
    ref = _dense_reference(q, k, v, forest.dense_mask(), dim**-0.5)
    torch.testing.assert_close(out, ref, atol=ATOL[dtype], rtol=0)
    dout = torch.randn(out.shape, dtype=dtype, generator=g)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, atol=ATOL[dtype], rtol=0, msg=f"d{name}")


def _step(model, forest) -> tuple[torch.Tensor, dict]:
    """`(log-prob table, parameter gradients)` of one forward of `forest` and the backward of a weighted sum."""
    model.zero_grad(set_to_none=True)
    table, _ = forest_logprobs(model, forest)
    (table * torch.linspace(-1, 1, table.numel()).view(table.shape)).sum().backward()
    return table.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_exact(model, forest, seqs, got: tuple, other_route: tuple) -> None:
    """`got` (a `_step`): the per-sequence forwards' log-probs (fp32, 1e-5), another route's gradients."""
    with torch.no_grad():
        for k, logps in enumerate(gather_sequences(forest, got[0])):
            want = flat_logprobs(model, seqs[forest.seq_ids[k]])[0]
            torch.testing.assert_close(logps, want, atol=TOLERANCES["logps_atol"], rtol=0)
    for name, grad in other_route[1].items():
        bound = TOLERANCES["grad_max_rel"] * float(grad.abs().max())
        torch.testing.assert_close(got[1][name], grad, atol=bound, rtol=0, msg=name)


@pytest.mark.parametrize("case", ["grpo", "identical", "prefix", "single_token"])
def test_model_through_the_route_is_the_per_sequence_forward(case, monkeypatch):
    """A model's every layer through the varlen route: the per-sequence forwards' log-probs (fp32, 1e-5) and the
    per-tree route's gradients, on forests of several trees laid out two-level."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(CONFIG), attn_implementation="tree_flex").train()
    seqs = forest_case(case, 3) + _two_level_groups(random.Random(1), 2)
    (forest,) = pack_forest(seqs, two_level=True)
    assert forest.prefix_plan is not None
    results = []
    for route in ("varlen", "per_tree"):
        kernel = _Counting() if route == "varlen" else None
        monkeypatch.setattr(pa, "_varlen_kernel", lambda query, kernel=kernel: kernel)
        results.append(_step(model, forest))
        assert kernel is None or kernel.forwards == 2 * CONFIG.num_hidden_layers
    _assert_exact(model, forest, seqs, *results)


# ------------------------------------------------------------------------------------------ gathered paths

PATH_CASES = {
    **CASES,
    "agent": lambda rng: forest_case("multiturn", 0),
    "branching_completions": lambda rng: forest_case("grpo", 1),
    "mixed": lambda rng: forest_case("mixed", 2),
}


@pytest.fixture
def paths(monkeypatch):
    """`path_attention` on the reference kernel."""
    monkeypatch.setattr(pv, "_path_kernel", lambda query: pv.REFERENCE)


def _mask_of_paths(calls: pv.PathCalls, size: int) -> torch.Tensor:
    """`(size, size)` bool: the pairs the gathered-path call attends (bottom-right causal over each path)."""
    mask = torch.zeros(size, size, dtype=torch.bool)
    cu_q, cu_k = calls.cu_q.tolist(), calls.cu_k.tolist()
    for b in range(len(cu_q) - 1):
        rows, keys = torch.arange(cu_q[b], cu_q[b + 1]), calls.keys[cu_k[b] : cu_k[b + 1]]
        allowed = torch.arange(len(keys))[None, :] <= torch.arange(len(rows))[:, None] + (len(keys) - len(rows))
        for a, row in enumerate(rows.tolist()):
            mask[row, keys[allowed[a]]] = True
    return mask


@pytest.mark.parametrize("case", sorted(PATH_CASES))
def test_the_gathered_paths_attend_exactly_the_tree_mask(case):
    """Every forest shape, deep agent trees and completions branching below the prompt among them: the pairs the
    call attends are the ancestor-or-self mask, padding rows themselves only; each path holds its segment's rows
    last, its ancestors' before them."""
    (forest,) = pack_forest(PATH_CASES[case](random.Random(case)), pad_multiple=16)
    calls = pv.path_calls(forest.path_plan, forest.seq_len, "cpu")
    assert torch.equal(_mask_of_paths(calls, forest.seq_len), forest.dense_mask()[0, 0])
    assert calls.longest_k == int(calls.cu_k.diff().max()) and calls.longest_q == int(calls.cu_q.diff().max())
    assert pv.path_calls(forest.path_plan, forest.seq_len, "cpu") is calls  # built once per plan


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
@pytest.mark.parametrize("case", ["agent", "branching_completions", "mixed", "grpo", "single_tokens"])
def test_path_route_matches_the_dense_tree_mask(case, heads, dtype, layout, paths):
    """`path_attention` against SDPA with the dense tree mask, forward and q / k / v gradients (a key row's
    gradient summed over every path that reads it)."""
    (forest,) = pack_forest(PATH_CASES[case](random.Random(case)), pad_multiple=16)
    g = torch.Generator().manual_seed(0)
    size, dim = forest.seq_len, 16
    q = _heads_view(heads[0], size, dim, dtype, g, layout)
    k, v = (_heads_view(heads[1], size, dim, dtype, g, layout) for _ in "kv")
    out = pv.path_attention(q, k, v, forest.path_plan, dim**-0.5)
    assert out.transpose(1, 2).is_contiguous()
    ref = _dense_reference(q, k, v, forest.dense_mask(), dim**-0.5)
    torch.testing.assert_close(out, ref, atol=ATOL[dtype], rtol=0)
    dout = torch.randn(out.shape, dtype=dtype, generator=g)
    for name, a, b in zip("qkv", torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(a, b, atol=ATOL[dtype], rtol=0, msg=f"d{name}")


def _force_paths(monkeypatch, count: bool = True):
    """Every forest's plain causal layers through `path_attention` on CPU (the route serves CUDA only; a forest's
    `path_plan`, which `path_serves` builds before the layers where it serves, is built by its first eager forward
    here); with `count`, the calls counted (a Python-side count: not inside compiled layers, where it would guard
    on its value)."""
    import hf_tree_attn.attention

    monkeypatch.setattr(pv, "_path_kernel", lambda query: pv.REFERENCE)
    monkeypatch.setattr(hf_tree_attn.attention, "prefix_serves", lambda forest, device_type: False)
    monkeypatch.setattr(hf_tree_attn.attention, "path_serves", lambda forest, device_type: True)
    calls = [0]
    if count:
        original = hf_tree_attn.attention.path_attention
        monkeypatch.setattr(hf_tree_attn.attention, "path_attention", lambda *a: calls.__setitem__(0, calls[0] + 1)
                            or original(*a))  # fmt: skip
    return calls


@pytest.mark.parametrize("case", ["multiturn", "grpo", "mixed"])
def test_model_through_the_paths_is_the_per_sequence_forward(case, monkeypatch):
    """A model's every layer through the gathered paths: the per-sequence forwards' log-probs (fp32, 1e-5) and the
    dense route's gradients."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(CONFIG), attn_implementation="tree_flex").train()
    seqs = forest_case(case, 3)
    (forest,) = pack_forest(seqs)
    results = []
    for route in ("paths", "dense"):
        if route == "paths":
            calls = _force_paths(monkeypatch)
        else:
            monkeypatch.undo()
        results.append(_step(model, forest))
    assert calls[0] == CONFIG.num_hidden_layers
    _assert_exact(model, forest, seqs, *results)


def test_compiled_layers_take_the_paths_as_one_op(monkeypatch):
    """With `BlockMask`s (what CUDA builds), regionally compiled decoder layers call `path_attention` as one opaque
    op: eager's log-probs and gradients, no graph break, no new graph for new forests once warm. On CPU FlexAttention
    has no backward, so a layer that missed the op would raise."""
    _force_paths(monkeypatch, count=False)
    graphs = compiled_layers_match_eager([pack_forest(forest_case("mixed", seed))[0] for seed in range(4)])
    assert graphs[0] > 0 and graphs[-1] == graphs[1], graphs


def test_the_setting_is_checked_at_import():
    """`HF_TREE_ATTN_PREFIX_KERNEL`: cudnn (the default) or fa4, any other value an error at import naming it."""
    code = "import hf_tree_attn.prefix_attention as m; print(m.KERNEL)"
    env = {**os.environ, "HF_TREE_ATTN_PREFIX_KERNEL": "FA4 "}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "fa4", run.stderr
    run = subprocess.run([sys.executable, "-c", code], env={**env, "HF_TREE_ATTN_PREFIX_KERNEL": "fa3"},
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode != 0 and "HF_TREE_ATTN_PREFIX_KERNEL='fa3': use cudnn (the default) or fa4" in run.stderr


def test_fa4_on_cuda_takes_every_forest_or_is_refused(monkeypatch):
    """With `KERNEL="fa4"` the CUDA decision takes a two-level forest at once (small trees, a shape never seen:
    cuDNN's rule would send it to FlexAttention) and lays out two-level a forest it would not otherwise, and sends a
    deeper forest through the gathered paths; without FlashAttention-4 (as here) or on a GPU it does not run on, the
    forest is refused with the reason and the way out; the CPU keeps its kernels (deeper forests: the dense mask);
    `MODE="never"` turns both routes off; a compiled layer reads only the eager decision; CUDA tensors only run
    through FA4."""
    from collections import OrderedDict

    monkeypatch.setattr(pa, "_SEEN_ON_CUDA", OrderedDict())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def fresh(seqs, **kwargs):
        (forest,) = pack_forest(seqs, **kwargs)
        return forest

    small = _two_level_groups(random.Random(0), 2)
    assert not pa._serves(fresh(small), "cuda")  # cuDNN: small trees, a new shape
    monkeypatch.setattr(pa, "KERNEL", "fa4")
    assert pv.fa4_error(0).startswith("flash_attn.cute does not import")  # no FlashAttention-4 on this machine
    with pytest.raises(RuntimeError, match=r"HF_TREE_ATTN_PREFIX_KERNEL=fa4 .* but flash_attn.cute does not import"):
        pa._serves(fresh(small), "cuda")
    monkeypatch.setattr(pv, "fa4_error", lambda index: None)
    assert pa._serves(fresh(small), "cuda") and pa._serves(fresh(small), "cpu")
    deep = [[1, 2, 3], [1, 2, 4], [1, 5]]
    assert not pa._serves(fresh(deep), "cuda") and pv.path_serves(fresh(deep), "cuda")  # deeper: gathered paths
    assert not pv.path_serves(fresh(small), "cuda")  # two-level: the shared-prefix route
    assert not pv.path_serves(fresh(deep), "cpu")
    monkeypatch.setattr(pv, "fa4_error", lambda index: "no FlashAttention-4 here")
    refused = fresh(deep)
    for _ in range(2):  # refused again, not decided by the first refusal
        with pytest.raises(RuntimeError, match="HF_TREE_ATTN_PREFIX_KERNEL=fa4 .* but no FlashAttention-4 here"):
            pv.path_serves(refused, "cuda")
    monkeypatch.setattr(pv, "fa4_error", lambda index: None)
    decided = fresh(deep)
    with pytest.raises((AssertionError, RuntimeError)):  # no CUDA here: the masks fail, after the eager decision
        decided.attention_mask("cuda")
    assert decided._mask_cache[("path_serves", "cuda", "fa4", pa.MODE)] is True  # what a compiled layer reads
    assert "path_plan" in vars(decided)  # built with the decision, not inside a compiled layer
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert pv.path_serves(decided, "cuda") and not pv.path_serves(fresh(deep), "cuda")  # never decided: Flex
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    monkeypatch.setattr(pa, "MODE", "never")
    assert not pv.path_serves(fresh(deep), "cuda") and not pa._serves(fresh(small), "cuda")
    monkeypatch.setattr(pa, "MODE", "auto")
    monkeypatch.setattr(pa, "KERNEL", "cudnn")
    assert not pv.path_serves(fresh(deep), "cuda")
    monkeypatch.setattr(pa, "KERNEL", "fa4")
    prompt = list(range(10, 110))
    branching = [prompt + [1, 2], prompt + [1, 3], prompt + [4]]  # two completions share a token below the prompt
    monkeypatch.setattr(pa, "KERNEL", "cudnn")
    assert fresh(branching).prefix_plan is None
    monkeypatch.setattr(pa, "KERNEL", "fa4")
    assert fresh(branching).prefix_plan is not None  # laid out two-level, the shared token repeated
    assert pa._varlen_kernel(torch.zeros(1)) is None


# ------------------------------------------------------------------------------------------------------ GPU


def _fa4_missing() -> bool:
    return not torch.cuda.is_available() or pv.fa4_error(torch.cuda.current_device()) is not None


@pytest.mark.gpu
@pytest.mark.skipif(_fa4_missing(), reason="needs CUDA and FlashAttention-4 (flash_attn.cute)")
@pytest.mark.parametrize("forest_shape, calls_per_layer", [("two_level", 2), ("agent", 1)])
def test_fa4_model_gives_the_per_sequence_logprobs(forest_shape, calls_per_layer, monkeypatch):
    """A bf16 model on CUDA with `KERNEL="fa4"`: every layer's attention through the kernels (a two-level forest's
    in two calls, an agent tree's over its gathered paths in one), its log-probs as close to the float32
    per-sequence forwards as FlexAttention's (`MODE="never"`) are, within twice their error plus one bf16
    rounding."""
    monkeypatch.setattr(pa, "KERNEL", "fa4")
    calls, forward = [0], pv.FA4.forward
    monkeypatch.setattr(pv.FA4, "forward", lambda *args: calls.__setitem__(0, calls[0] + 1) or forward(*args))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(CONFIG), attn_implementation="tree_flex").cuda().eval()
    rng = random.Random(0)
    if forest_shape == "two_level":
        seqs = _two_level_groups(rng, 3, prompt=400, completion=200)
    else:  # a 6-turn conversation, each turn's two sampled answers, the first continuing it
        history, seqs = [rng.randrange(1, 128) for _ in range(300)], []
        for _ in range(6):
            history = history + [rng.randrange(1, 128) for _ in range(40)]
            answers = [[rng.randrange(1, 128) for _ in range(rng.randint(20, 90))] for _ in range(2)]
            seqs += [history + answer for answer in answers]
            history = history + answers[0]
    with torch.no_grad():
        want = [flat_logprobs(model, seq)[0] for seq in seqs]
        model.bfloat16()
        errors = {}
        for mode in ("auto", "never"):
            monkeypatch.setattr(pa, "MODE", mode)
            got = hf_tree_attn.sequence_logprobs(model, seqs)
            errors[mode] = max(float((a.float() - b).abs().max()) for a, b in zip(got, want))
    assert calls[0] == calls_per_layer * CONFIG.num_hidden_layers  # one forest, every layer
    assert errors["auto"] <= 2 * errors["never"] + 2**-8 * max(float(w.abs().max()) for w in want), errors


@pytest.mark.gpu
@pytest.mark.skipif(_fa4_missing(), reason="needs CUDA and FlashAttention-4 (flash_attn.cute)")
@pytest.mark.parametrize("heads, dim", [((16, 8), 128), ((4, 4), 64)])
def test_fa4_paths_as_close_as_flex_attention(heads, dim):
    """bf16 on CUDA, the gathered paths of a deep forest (multi-turn conversations, padding rows) through
    FlashAttention-4: output and q / k / v gradients as close to the float32 dense-mask reference as FlexAttention's
    with the forest's `BlockMask` (both within 2% of the largest entry)."""
    (forest,) = pack_forest(forest_case("multiturn", 0) + forest_case("mixed", 1))
    assert forest.prefix_plan is None and forest.num_tree_tokens < forest.seq_len
    attention = lambda q, k, v, plan: pv.path_attention(q, k, v, plan, dim**-0.5)  # noqa: E731
    assert_as_close_as_flex_attention(forest.to("cuda"), heads, dim, attention, layout="bshd")
