"""Shared-prefix attention in two varlen calls (`hf_tree_attn.prefix_varlen`, FlashAttention-4 on CUDA).

On CPU the calls run through `prefix_varlen.REFERENCE` (FlashAttention's varlen contract in plain PyTorch, rows no
sequence covers left NaN as the kernels leave them unwritten), so everything around the kernel is checked here:

- the calls' sequences: the mask they imply is the forest's tree mask, row for row, on every forest shape;
- the reference kernel against SDPA per sequence, with offsets, lengths that leave gaps, GQA;
- the route against SDPA with the dense tree mask (float64, float32; GQA; padding rows; the projections' layout),
  and through a model: the per-sequence log-probs and the per-tree route's gradients;
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
from test_prefix_attention import ATOL, CASES, CONFIG, _dense_reference, _heads_view, _two_level_groups
from transformers import AutoModelForCausalLM

import hf_tree_attn
from hf_tree_attn import pack_forest
from hf_tree_attn import prefix_attention as pa
from hf_tree_attn import prefix_varlen as pv
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
        model.zero_grad(set_to_none=True)
        table, _ = forest_logprobs(model, forest)
        (table * torch.linspace(-1, 1, table.numel()).view(table.shape)).sum().backward()
        results.append((table.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        assert kernel is None or kernel.forwards == 2 * CONFIG.num_hidden_layers
    with torch.no_grad():
        for k, got in enumerate(gather_sequences(forest, results[0][0])):
            want = flat_logprobs(model, seqs[forest.seq_ids[k]])[0]
            torch.testing.assert_close(got, want, atol=TOLERANCES["logps_atol"], rtol=0)
    for name, grad in results[1][1].items():
        bound = TOLERANCES["grad_max_rel"] * float(grad.abs().max())
        torch.testing.assert_close(results[0][1][name], grad, atol=bound, rtol=0, msg=name)


def test_the_setting_is_checked_at_import():
    """`HF_TREE_ATTN_PREFIX_KERNEL`: cudnn (the default) or fa4, any other value an error at import naming it."""
    code = "import hf_tree_attn.prefix_attention as m; print(m.KERNEL)"
    env = {**os.environ, "HF_TREE_ATTN_PREFIX_KERNEL": "FA4 "}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "fa4", run.stderr
    run = subprocess.run([sys.executable, "-c", code], env={**env, "HF_TREE_ATTN_PREFIX_KERNEL": "fa3"},
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode != 0 and "HF_TREE_ATTN_PREFIX_KERNEL='fa3': use cudnn (the default) or fa4" in run.stderr


def test_fa4_on_cuda_takes_every_two_level_forest_or_is_refused(monkeypatch):
    """With `KERNEL="fa4"` the CUDA decision takes a two-level forest at once (small trees, a shape never seen:
    cuDNN's rule would send it to FlexAttention) and lays out two-level a forest it would not otherwise; without
    FlashAttention-4 (as here) or on a GPU it does not run on, the forest is refused with the reason and the way
    out; the CPU keeps its kernels, a deeper forest FlexAttention; CUDA tensors only run through FA4."""
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
    assert not pa._serves(fresh([[1, 2, 3], [1, 2, 4], [1, 5]]), "cuda")  # deeper: FlexAttention
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
def test_fa4_model_gives_the_per_sequence_logprobs(monkeypatch):
    """A bf16 model on CUDA with `KERNEL="fa4"`: every layer's attention through the kernels, its log-probs as
    close to the float32 per-sequence forwards as FlexAttention's (`MODE="never"`) are, within twice their error
    plus one bf16 rounding."""
    monkeypatch.setattr(pa, "KERNEL", "fa4")
    calls, forward = [0], pv.FA4.forward
    monkeypatch.setattr(pv.FA4, "forward", lambda *args: calls.__setitem__(0, calls[0] + 1) or forward(*args))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(CONFIG), attn_implementation="tree_flex").cuda().eval()
    seqs = _two_level_groups(random.Random(0), 3, prompt=400, completion=200)
    with torch.no_grad():
        want = [flat_logprobs(model, seq)[0] for seq in seqs]
        model.bfloat16()
        errors = {}
        for mode in ("auto", "never"):
            monkeypatch.setattr(pa, "MODE", mode)
            got = hf_tree_attn.sequence_logprobs(model, seqs)
            errors[mode] = max(float((a.float() - b).abs().max()) for a, b in zip(got, want))
    assert calls[0] == 2 * CONFIG.num_hidden_layers  # one forest, every layer: its two calls
    assert errors["auto"] <= 2 * errors["never"] + 2**-8 * max(float(w.abs().max()) for w in want), errors
