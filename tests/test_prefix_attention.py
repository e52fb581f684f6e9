"""Shared-prefix attention (`hf_tree_attn.prefix_attention`): two-level forests through dense kernel calls.

- The plan: which forests are two-level (every branch hangs off a root) and their row ranges, against the per-token
  dict trie oracle.
- The kernel, against SDPA with the brute-force dense tree mask: forward and gradients of q, k, v in float64
  (the merge and the backward identity are exact up to rounding) and float32, with GQA, padding rows, several trees,
  identical sequences, prefixes, 1-token sequences, trees without completions; bf16 within the dense bf16 path's
  own error; the plain-matmul fallback (single query or key) against the CPU kernels.
- The CUDA rule (`fast_on_cuda`) against the committed H200 measurement of both kernels.
- Models: which layers take it (the causal layers of a two-level forest; never a sliding-window layer, a deeper
  forest or latent attention), the same log-probs as per-sequence forwards (also for forests laid out two-level by
  `pack_forest(two_level=True)`), and a regionally compiled model taking it with `BlockMask`s (what CUDA builds)
  with no graph break and no recompilation for new forests.
- GPU (`-m gpu`): cuDNN as close to float32 as FlexAttention; the CUDA rule in a model.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
import torch
from helpers import TOLERANCES, flat_logprobs, forest_case, grpo_groups, multiturn, oracle_mask
from transformers import AutoModelForCausalLM, Qwen3Config

import hf_tree_attn
import hf_tree_attn.attention
from hf_tree_attn import pack_forest
from hf_tree_attn.logprobs import forest_forward_kwargs, forest_logprobs
from hf_tree_attn.prefix_attention import PrefixTree, decode_plan, fast_on_cuda, prefix_attention

CONFIG = Qwen3Config(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=128, initializer_range=0.1,
)  # fmt: skip


def _two_level_groups(rng: random.Random, groups: int, prompt: int = 40, completion: int = 20) -> list[list[int]]:
    """GRPO groups whose completions share nothing but the prompt (first tokens distinct): two-level tries."""
    seqs = []
    for _ in range(groups):
        p = [rng.randrange(1, 128) for _ in range(rng.randint(1, prompt))]
        firsts = rng.sample(range(1, 128), rng.randint(1, 6))
        seqs += [p + [f] + [rng.randrange(1, 128) for _ in range(rng.randint(0, completion))] for f in firsts]
    return seqs


CASES = {
    "grpo": lambda rng: _two_level_groups(rng, 3),
    "identical": lambda rng: [[5, 6, 7]] * 3 + [[5, 6, 7, 8], [5, 6, 9]],
    "prefix_of_another": lambda rng: [[3, 4, 5, 6], [3], [3, 4], [3, 4, 5, 6, 7], [3, 4, 9]],
    "single_tokens": lambda rng: [[1], [1], [2], [2, 3, 4], [5]],
    "no_completions": lambda rng: [[rng.randrange(1, 128) for _ in range(rng.randint(1, 9))] for _ in range(4)],
    "one_completion_each": lambda rng: [[9, 8, 7, 1], [9, 8, 7, 2, 2, 2], [4, 1]],
}


def _real_segments_are_two_level(forest) -> bool:
    parent = forest.segment_parent.tolist()
    return all(p < 0 or parent[p] < 0 for p in parent)


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_covers_the_forest_in_row_ranges(case):
    seqs = CASES[case](random.Random(case))
    (forest,) = pack_forest(seqs, pad_multiple=16)
    assert forest.prefix_plan is not None
    num_tokens, trees = decode_plan(forest.prefix_plan)
    assert num_tokens == forest.num_tree_tokens
    # The ranges tile [0, num_tokens) in order, and match the oracle mask: a prompt row sees its prompt causally,
    # a completion row its prompt and its own completion causally.
    mask = oracle_mask(forest, seqs)[:num_tokens, :num_tokens]
    expected = torch.zeros_like(mask)
    edge = 0
    for tree in trees:
        assert tree.start == edge and tree.bounds[0] == tree.stop
        expected[tree.start : tree.stop, tree.start : tree.stop] = (
            torch.ones(tree.stop - tree.start, tree.stop - tree.start).tril().bool()
        )
        for first, last in zip(tree.bounds, tree.bounds[1:]):
            assert last > first
            expected[first:last, tree.start : tree.stop] = True
            expected[first:last, first:last] = torch.ones(last - first, last - first).tril().bool()
        edge = tree.bounds[-1]
    assert edge == num_tokens
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("seed", range(4))
def test_deeper_forests_have_no_plan(seed):
    rng = random.Random(seed)
    for seqs in (multiturn(rng), [[1, 2, 3], [1, 2, 4], [1, 5]]):
        (forest,) = pack_forest(seqs)
        assert not _real_segments_are_two_level(forest)
        assert forest.prefix_plan is None
    (forest,) = pack_forest(grpo_groups(rng))  # completions branching off each other, at random
    assert (forest.prefix_plan is None) == (not _real_segments_are_two_level(forest))


def _dense_reference(q, k, v, mask, scale):
    groups = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(groups, 1) for x in (k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


# Per entry: a softmax-weighted sum over <= 64 keys of unit-scale values, and its gradient sums over as many rows:
# rounding errors of ~sqrt(64) * eps, x10 headroom for the log-sum-exp merge (float32: ~1e-5).
ATOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def _heads_view(heads: int, size: int, dim: int, dtype, generator, layout: str) -> torch.Tensor:
    """`(1, heads, size, dim)` leaf on `generator`'s device, laid out as such ("bhsd") or as a model's projections
    lay it out ("bshd")."""
    options = dict(dtype=dtype, generator=generator, device=generator.device)
    if layout == "bhsd":
        return torch.randn(1, heads, size, dim, **options).requires_grad_()
    return torch.randn(1, size, heads, dim, **options).requires_grad_().transpose(1, 2)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_the_dense_tree_mask(case, heads, dtype, layout):
    """Against SDPA with the dense tree mask. "bshd": inputs and output gradient as a model's projections lay them
    out (the output's own layout, read by the backward as it is); "bhsd": the backward first copies the gradient."""
    seqs = CASES[case](random.Random(case))
    (forest,) = pack_forest(seqs, pad_multiple=16)
    assert forest.num_tree_tokens < forest.seq_len or case == "grpo"  # padding rows are covered
    g = torch.Generator().manual_seed(0)
    size, dim = forest.seq_len, 16
    q = _heads_view(heads[0], size, dim, dtype, g, layout)
    k, v = (_heads_view(heads[1], size, dim, dtype, g, layout) for _ in "kv")
    out = prefix_attention(q, k, v, forest.prefix_plan, dim**-0.5)
    assert out.transpose(1, 2).is_contiguous()  # what o_proj reads, without a copy
    ref = _dense_reference(q, k, v, forest.dense_mask(), dim**-0.5)
    torch.testing.assert_close(out, ref, atol=ATOL[dtype], rtol=0)
    dout = torch.randn(out.shape, dtype=dtype, generator=g)
    if layout == "bshd":
        dout = dout.transpose(1, 2).contiguous().transpose(1, 2)
    assert (dout.stride() == out.stride()) == (layout == "bshd")
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, atol=ATOL[dtype], rtol=0, msg=f"d{name}")


@pytest.mark.parametrize(
    "lengths, causal",
    [((1, 1), False), ((1, 1), True), ((1, 9), False), ((6, 1), False), ((5, 9), False), ((7, 7), True)],
)
def test_math_kernels_match_cpu_flash_kernels(lengths, causal):
    """The plain-matmul forward / backward (CUDA's path for a single query or key; cuDNN refuses one over one), with
    GQA heads and given a merged `out` / `lse` like the kernels: equal to PyTorch's CPU flash kernels in float64."""
    from hf_tree_attn.prefix_attention import _backward, _forward, _math_backward, _math_forward

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, lengths[0], 8, dtype=torch.float64, generator=g)
    k, v = (torch.randn(2, 2, lengths[1], 8, dtype=torch.float64, generator=g) for _ in "kv")  # GQA: 3 q per kv
    out, lse = _forward(q, k, v, causal, 0.3)
    math_out, math_lse = _math_forward(q, k, v, causal, 0.3)
    torch.testing.assert_close(math_out, out, atol=1e-12, rtol=0)
    torch.testing.assert_close(math_lse, lse, atol=1e-12, rtol=0)
    merged_out, merged_lse = torch.randn(out.shape, dtype=torch.float64, generator=g), lse + 0.5  # another part's
    dout = torch.randn(out.shape, dtype=torch.float64, generator=g)
    for got, want in zip(
        _math_backward(dout, q, k, v, merged_out, merged_lse, causal, 0.3),
        _backward(dout, q, k, v, merged_out, merged_lse, causal, 0.3),
    ):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def _trees_of(shape: dict):
    """The trees of `groups` prompts of P tokens, each with G completions of C tokens (DFS layout)."""
    trees, start = [], 0
    for _ in range(shape["groups"]):
        stop = start + shape["P"]
        trees.append(PrefixTree(start, stop, tuple(stop + g * shape["C"] for g in range(shape["G"] + 1))))
        start = trees[-1].bounds[-1]
    return tuple(trees)


def test_cuda_rule_picks_the_faster_kernel_where_measured():
    """`fast_on_cuda` against the committed H200 measurements of both kernels on each shape (two runs of the current
    kernels): it chooses the shared-prefix kernels exactly where they were faster per training step (two forwards
    and one backward)."""
    results = Path(__file__).parents[1] / "benchmarks" / "results"
    for file in ("prefix_attention_h200.json", "prefix_attention_h200_repeat.json"):
        rows = json.loads((results / file).read_text())["rows"]
        assert len(rows) >= 5
        for name, row in rows.items():
            assert fast_on_cuda(_trees_of(row["shape"])) == (row["speedup_step"] > 1), (file, name)
    (forest,) = pack_forest(_two_level_groups(random.Random(0), 2))
    assert forest.prefix_plan is not None and not forest.prefix_fast_on_cuda  # small trees: FlexAttention on CUDA


class _DecisionOnly:
    """A forest as a compiled layer may read it: its mask cache only (any other attribute fails the test)."""

    def __init__(self, cache: dict):
        self._mask_cache = cache

    def __getattr__(self, name):
        raise AssertionError(f"a compiled layer read forest.{name}: dynamo would guard on it")


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_a_compiled_layer_reads_only_the_eager_decision(monkeypatch, device_type):
    """`serves` inside a compiled layer reads the one decision the forest's `attention_mask` made eagerly, none of
    the reasons behind it (a two-level plan, `fast_on_cuda`, a recurring call signature, `MODE`'s value aside), so
    dynamo compiles one layer graph per attention path, not one per reason; a forest never decided runs
    FlexAttention."""
    from hf_tree_attn import prefix_attention as pa

    (two_level,) = pack_forest(_two_level_groups(random.Random(0), 2))
    (deep,) = pack_forest(multiturn(random.Random(1), turns=3))
    assert two_level.prefix_plan is not None and deep.prefix_plan is None
    decided = {}
    for name, forest in (("two_level", two_level), ("deep", deep)):
        key = ("prefix_serves", device_type, pa.MODE)
        if device_type == "cpu":
            forest.attention_mask("cpu")  # the eager decision, as every tree forward makes it
        else:  # no CUDA here: the decision `attention_mask` would make on CUDA, made by the same call
            assert pa.serves(forest, "cuda") == pa._serves(forest, "cuda")
        decided[name] = forest._mask_cache[key]
    assert decided == {"two_level": device_type == "cpu", "deep": False}
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for name, forest in (("two_level", two_level), ("deep", deep)):
        assert pa.serves(_DecisionOnly(forest._mask_cache), device_type) is decided[name]
    (fresh,) = pack_forest(_two_level_groups(random.Random(2), 2))
    assert pa.serves(_DecisionOnly(fresh._mask_cache), device_type) is False


@pytest.mark.parametrize("case", ["grpo", "one_completion_each", "single_tokens"])
def test_bf16_on_cpu_as_close_as_the_dense_path(case):
    """bf16 on CPU (the flash kernel accumulates in float32, rounds its output to bf16): output and gradients as
    close to the float32 reference as bf16 SDPA with the dense tree mask is, within twice its error plus one bf16
    rounding of the largest entry (2^-8)."""
    seqs = CASES[case](random.Random(case))
    (forest,) = pack_forest(seqs, pad_multiple=16)
    g = torch.Generator().manual_seed(0)
    shapes = (1, 4, forest.seq_len, 16), (1, 2, forest.seq_len, 16)
    inputs = [torch.randn(shapes[i > 0], generator=g).bfloat16() for i in range(3)]
    dout = torch.randn(shapes[0], generator=g)
    results = {}
    for name, dtype in (("reference", torch.float32), ("dense", torch.bfloat16), ("prefix", torch.bfloat16)):
        x = [t.to(dtype).requires_grad_() for t in inputs]
        if name == "prefix":
            out = prefix_attention(*x, forest.prefix_plan, 0.25)
        else:
            out = _dense_reference(*x, forest.dense_mask(), 0.25)
        results[name] = [t.float() for t in (out, *torch.autograd.grad(out, x, dout.to(dtype)))]
    for ref, dense, prefix in zip(results["reference"], results["dense"], results["prefix"]):
        bound = 2 * (dense - ref).abs().max() + 2**-8 * ref.abs().max()
        assert (prefix - ref).abs().max() <= bound


def _count_calls(monkeypatch) -> list[int]:
    calls = [0]
    original = hf_tree_attn.attention.prefix_attention

    def counted(*args):
        calls[0] += 1
        return original(*args)

    monkeypatch.setattr(hf_tree_attn.attention, "prefix_attention", counted)
    return calls


def test_only_causal_layers_of_two_level_forests_take_it(monkeypatch):
    """A sliding-window layer keeps its own mask (FlexAttention / SDPA); a deeper forest too; log-probs equal the
    per-sequence forwards either way."""
    config = copy.deepcopy(CONFIG)
    config.layer_types, config.sliding_window, config.use_sliding_window = (
        ["sliding_attention", "full_attention"],
        5,
        True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="tree_flex").eval()
    calls = _count_calls(monkeypatch)
    rng = random.Random(0)
    for seqs, expected_calls in ((_two_level_groups(rng, 2), 1), (multiturn(rng), 0)):
        calls[0] = 0
        with torch.no_grad():
            got = hf_tree_attn.sequence_logprobs(model, seqs)
            for tree_lp, seq in zip(got, seqs):
                torch.testing.assert_close(
                    tree_lp, flat_logprobs(model, seq)[0], atol=TOLERANCES["logps_atol"], rtol=0
                )
        assert calls[0] == expected_calls


@pytest.mark.parametrize("case", ["multiturn", "grpo", "mixed", "prefix"])
def test_two_level_layout_gives_the_per_sequence_logprobs(case, monkeypatch):
    """Any forest laid out two-level (`pack_forest(two_level=True)`: tokens shared by only some sequences repeated)
    runs through the kernels, with the per-sequence forwards' log-probs (fp32, 1e-5)."""
    from hf_tree_attn.logprobs import gather_sequences

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(CONFIG), attn_implementation="tree_flex").eval()
    calls = _count_calls(monkeypatch)
    seqs = forest_case(case, 3)
    (forest,) = pack_forest(seqs, two_level=True)
    with torch.no_grad():
        table, _ = forest_logprobs(model, forest)
        for k, got in enumerate(gather_sequences(forest, table)):
            want = flat_logprobs(model, seqs[forest.seq_ids[k]])[0]
            torch.testing.assert_close(got, want, atol=TOLERANCES["logps_atol"], rtol=0)
    assert calls[0] == CONFIG.num_hidden_layers


def test_latent_attention_keeps_flex_or_sdpa(monkeypatch):
    """DeepSeek-V3's latent attention gives q / k wider heads than v: not a shape the kernels take (FlexAttention /
    SDPA run it), and the log-probs still equal the per-sequence forwards."""
    from test_coverage import tiny_config

    config = tiny_config("deepseek_v3")
    config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim = 16, 8, 16  # q / k heads 24 wide, v 16
    torch.manual_seed(0)
    tree = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="tree_flex").eval()
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    ref.load_state_dict(tree.state_dict())
    calls = _count_calls(monkeypatch)
    seqs = _two_level_groups(random.Random(0), 2)
    with torch.no_grad():
        for tree_lp, seq in zip(hf_tree_attn.sequence_logprobs(tree, seqs), seqs):
            torch.testing.assert_close(tree_lp, flat_logprobs(ref, seq)[0], atol=TOLERANCES["logps_atol"], rtol=0)
    assert calls[0] == 0


def test_switched_off_gives_the_same_results(monkeypatch):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(CONFIG), attn_implementation="tree_flex").train()
    (forest,) = pack_forest(forest_case("identical", 0) + _two_level_groups(random.Random(1), 2))
    results = []
    for enabled in (True, False):
        monkeypatch.setattr(hf_tree_attn.prefix_attention, "MODE", "auto" if enabled else "never")
        calls = _count_calls(monkeypatch)
        model.zero_grad(set_to_none=True)
        table, _ = forest_logprobs(model, forest)
        table.sum().backward()
        results.append((table.detach(), [p.grad.clone() for p in model.parameters()]))
        assert calls[0] == (CONFIG.num_hidden_layers if enabled else 0)
    torch.testing.assert_close(results[0][0], results[1][0], atol=TOLERANCES["logps_atol"], rtol=0)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, atol=TOLERANCES["grad_max_rel"] * float(b.abs().max()), rtol=0)


def test_cuda_decision_waits_for_a_recurring_call_signature(monkeypatch):
    """`serves` on CUDA (auto): a two-level forest the size rule picks takes the kernels only once a forest of the
    same call signature (row length, each tree's prompt, completion rows, count, longest) was asked about before,
    decided once per forest and shared with its device copies; a new row length or a new completion length is a
    new signature; CPU and `MODE="always"` never wait."""
    from collections import OrderedDict

    from hf_tree_attn.prefix_attention import serves, warm_on_cuda

    seen = OrderedDict()
    monkeypatch.setattr(hf_tree_attn.prefix_attention, "_SEEN_ON_CUDA", seen)
    rng = random.Random(0)
    prompt = [rng.randrange(1, 128) for _ in range(8192)]
    large = [prompt + [first] + [rng.randrange(1, 128) for _ in range(300)] for first in range(1, 9)]

    def fresh(seqs, **kwargs):
        (forest,) = pack_forest(seqs, **kwargs)
        assert forest.prefix_plan is not None and forest.prefix_fast_on_cuda
        return forest

    first = fresh(large)
    assert serves(first, "cpu") and not serves(first, "cuda")
    assert not serves(first.to("cpu"), "cuda")  # decided once per forest, copies included
    second = fresh(large)
    assert serves(second, "cuda") and warm_on_cuda(second)
    assert not serves(fresh(large, pad_multiple=256), "cuda")  # another row length: other strides
    longer = [*large[:-1], large[-1] + [5]]
    assert not serves(fresh(longer), "cuda")  # one completion a token longer
    assert len(seen) == 3
    monkeypatch.setattr(hf_tree_attn.prefix_attention, "MODE", "always")
    assert serves(fresh(large + [large[0] + [7]]), "cuda")


def compiled_layers_match_eager(forests) -> list[int]:
    """Each forest through a model and its regionally compiled twin (aot_eager) with `BlockMask`s, as CUDA builds
    them: the same logits and gradients, no graph break; returns dynamo's graph count after each forest."""
    from accelerate.utils import compile_regions
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    def build():
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(copy.deepcopy(CONFIG), attn_implementation="tree_flex").train()

    eager, compiled = build(), compile_regions(build(), backend="aot_eager")
    graphs = []
    for forest in forests:
        results = []
        for model in (eager, compiled):
            model.zero_grad(set_to_none=True)
            kwargs = forest_forward_kwargs(forest, "cpu") | {
                "attention_mask": forest.attention_mask("cpu", dense=False)
            }
            logits = model(**kwargs).logits.float()
            (logits * torch.linspace(-1, 1, logits.shape[1])[None, :, None]).sum().backward()
            grads = {n.replace("._orig_mod", ""): p.grad.clone() for n, p in model.named_parameters()}
            results.append((logits.detach(), grads))
        torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=1e-5)
        for name, grad in results[0][1].items():
            torch.testing.assert_close(results[1][1][name], grad, atol=1e-5, rtol=1e-5, msg=name)
        graphs.append(counters["stats"]["unique_graphs"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    return graphs


def test_regional_compile_with_block_masks_takes_it():
    """With `BlockMask`s (what CUDA builds), compiled decoder layers call the kernel as one opaque op: the same
    log-probs and gradients as eager, no graph break, no new graph for new forests once warm. On CPU FlexAttention
    has no backward, so a training forward that missed this path would raise."""
    rng = random.Random(0)
    forests = [pack_forest(_two_level_groups(rng, rng.randint(1, 3)))[0] for _ in range(5)]
    graphs = compiled_layers_match_eager(forests)
    assert graphs[0] > 0 and graphs[-1] == graphs[2], graphs


# ------------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernel", ["cudnn", "fa4"])
@pytest.mark.parametrize("heads, dim", [((16, 8), 128), ((32, 8), 128), ((4, 4), 64), ((6, 2), 32)])
def test_cuda_kernels_as_close_as_flex_attention(heads, dim, kernel, monkeypatch):
    """bf16 on CUDA (cuDNN per tree, or FlashAttention-4's varlen calls per forest, `KERNEL`): output and q / k / v
    gradients as close to the float32 dense-mask reference as FlexAttention's with the forest's `BlockMask` are
    (bf16 rounding of inputs, probabilities and outputs: both within 2% of the largest entry), on trees of varied
    lengths, a 1-token prompt and completion, padding rows."""
    from hf_tree_attn import prefix_attention as module
    from hf_tree_attn.varlen_attention import fa4_error

    if kernel == "fa4" and fa4_error(torch.cuda.current_device()) is not None:
        pytest.skip(fa4_error(torch.cuda.current_device()))
    monkeypatch.setattr(module, "KERNEL", kernel)
    rng = random.Random(0)
    (forest,) = pack_forest(_two_level_groups(rng, 3, prompt=700, completion=300) + [[5], [5, 6]])
    assert_as_close_as_flex_attention(forest.to("cuda"), heads, dim, lambda *x: prefix_attention(*x, dim**-0.5))


def assert_as_close_as_flex_attention(forest, heads, dim, attention, layout: str = "bhsd") -> None:
    """`attention(q, k, v, plan)` in bf16 on CUDA (`forest.prefix_plan`, else `forest.path_plan`): its output and q /
    k / v gradients as close to the float32 dense-mask reference as FlexAttention's with the forest's `BlockMask`
    (bf16 rounding of inputs, probabilities and outputs: both within 2% of the largest entry). "bshd": the inputs
    laid out as a model's projections."""
    from hf_tree_attn.attention import _flex_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    size = forest.seq_len
    q, k, v = (_heads_view(h, size, dim, torch.float32, g, layout).detach() for h in (heads[0], heads[1], heads[1]))
    dout = torch.randn(q.shape, device="cuda", generator=g)
    ref_inputs = [x.bfloat16().float().requires_grad_() for x in (q, k, v)]
    ref = _dense_reference(*ref_inputs, forest.dense_mask("cuda"), dim**-0.5)
    ref_grads = torch.autograd.grad(ref, ref_inputs, dout)
    plan = forest.prefix_plan if forest.prefix_plan is not None else forest.path_plan
    results = {}
    for name in ("kernel", "flex"):
        inputs = [x.bfloat16().requires_grad_() for x in (q, k, v)]
        if name == "kernel":
            out = attention(*inputs, plan)
        else:
            out = _flex_attention(*inputs, block_mask=forest.block_mask("cuda"), scale=dim**-0.5, enable_gqa=True)[0]
        grads = torch.autograd.grad(out, inputs, dout.bfloat16())
        results[name] = [(a.float() - b).abs().max() / b.abs().max() for a, b in zip((out, *grads), (ref, *ref_grads))]
    for name, errors in results.items():
        assert max(errors) < 2e-2, (name, [f"{e:.2e}" for e in errors])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_takes_the_kernels_only_where_they_are_faster(monkeypatch):
    """On CUDA, `MODE="auto"` runs FlexAttention for a forest of small trees, and for long prompts with short
    completions the kernels once a forest of the same call signature came before (the first pays no cuDNN graph
    build); `"always"` runs the kernels for both at once."""
    from collections import OrderedDict

    torch.manual_seed(0)
    monkeypatch.setattr(hf_tree_attn.prefix_attention, "_SEEN_ON_CUDA", OrderedDict())
    model = AutoModelForCausalLM.from_config(copy.deepcopy(CONFIG), attn_implementation="tree_flex")
    model = model.to("cuda", torch.bfloat16).eval()
    calls = _count_calls(monkeypatch)
    rng = random.Random(0)
    small = _two_level_groups(rng, 2)
    prompt = [rng.randrange(1, 128) for _ in range(8192)]
    large = [prompt + [first] + [rng.randrange(1, 128) for _ in range(300)] for first in range(1, 9)]
    cases = (("auto", small, 0), ("auto", large, 0), ("auto", large, 2), ("always", small, 2))
    for mode, seqs, expected in cases:
        monkeypatch.setattr(hf_tree_attn.prefix_attention, "MODE", mode)
        calls[0] = 0
        with torch.no_grad():
            hf_tree_attn.sequence_logprobs(model, seqs)
        assert calls[0] == expected, mode


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_fused_merge_matches_float64(layout):
    """The Triton merge on CUDA (views of the kernels' outputs, any row strides): the float64 merge of the same
    inputs, rounded once to bf16 (within one bf16 unit of the largest entry), and its log-sum-exp within float32
    rounding."""
    from hf_tree_attn import prefix_attention as module

    assert module._merge_kernel is not None  # CUDA builds of PyTorch ship Triton
    g = torch.Generator(device="cuda").manual_seed(0)
    heads, rows, dim = 16, 1000, 128

    def values():
        shape = (1, heads, rows, dim) if layout == "bhsd" else (1, rows, heads, dim)
        x = torch.randn(shape, device="cuda", generator=g).bfloat16()
        return (x if layout == "bhsd" else x.transpose(1, 2))[0, :, 3:-5]  # a row range, as the op passes

    shared, own = values(), values()
    lse_shared, lse_own = (20 * torch.randn(heads, rows - 8, device="cuda", generator=g) for _ in range(2))
    out, lse = values(), torch.empty(heads, rows + 10, device="cuda")[:, 4:-14]
    module._merge(out, lse, shared, lse_shared, own, lse_own)
    want_lse = torch.logaddexp(lse_shared.double(), lse_own.double())
    w = torch.exp(lse_shared.double() - want_lse)[..., None]
    want = w * shared.double() + (1 - w) * own.double()
    assert (out.double() - want).abs().max() <= 2**-8 * want.abs().max()
    torch.testing.assert_close(lse.double(), want_lse, rtol=2e-7, atol=2e-6)
