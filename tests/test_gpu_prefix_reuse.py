"""Prefix reuse on CUDA (`hf_tree_attn.prefix_reuse`): both attention paths, `flex` (a `BlockMask` over the
concatenated context and own keys) and `dense` (SDPA on dense masks), forward and the reentrant per-chunk backward.

The CPU tests (`tests/test_chunked.py`) prove the plan and the chunked step exact on the dense path; here each CUDA
path runs the same forests on its real kernels: a trie split 2, 3 and 8 ways, a sequence four times the budget, edge
cases (identical sequences, a prefix of another, 1-token sequences, several tries), a branch changed inside one
chunk's context (no leakage into its siblings), a bf16 model against the float32 reference, the trie with the
last chunks' forward graphs kept for the backward (`keep_graphs`), and decoder layers compiled with inductor.

`pytest -m gpu tests/test_gpu_prefix_reuse.py` — skipped without CUDA (CI).
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers import TOLERANCES as CPU_TOLERANCES
from helpers import flat_logprobs, twin_models
from test_chunked import BUDGET, _edge_cases, _num_chunks, _tokens, _trie, check_branch_change_moves_only_its_subtree
from torch._dynamo.utils import counters

import hf_tree_attn.attention
from hf_tree_attn import context_kv, forest_logprobs, gather_sequences, pack_forest, sequence_logprobs
from hf_tree_attn import prefix_reuse as prefix_reuse_module
from hf_tree_attn.compile import compile_decoder_layers, compiled_layers, decoder_layers

pytestmark = pytest.mark.gpu

# fp32 on CUDA, against per-sequence flat forwards (SDPA, fp32), path -> (log-prob / entropy atol, per-tensor
# gradient max |diff| / max |flat grad| or None, cosine of each gradient tensor with flat's):
# - dense: SDPA on both sides, in fp32 arithmetic (TF32 off, torch's default, asserted below): the CPU derivation
#   holds unchanged (tests/helpers.py: ~sqrt(64) * EPS * |z| for |z| <~ 10, a gradient entry ~sqrt(200) * EPS).
# - flex: FlexAttention on Hopper runs its fp32 dots at reduced (tf32-like) precision: tests/test_gpu.py's bounds
#   (log-prob atol, gradient cosine) for the same kernel on an unsplit forest.
FP32_TOLERANCES = {
    "dense": (CPU_TOLERANCES["logps_atol"], CPU_TOLERANCES["grad_max_rel"], CPU_TOLERANCES["grad_cosine"]),
    "flex": (2e-4, None, 0.99999),
}
PATHS = list(FP32_TOLERANCES)
U_BF16 = torch.finfo(torch.bfloat16).eps / 2  # bf16 unit roundoff


@pytest.fixture(params=PATHS)
def cuda_path(request, monkeypatch):
    """The CUDA path under test, and a count of FlexAttention calls (the flex path must take it, dense must not)."""
    assert not torch.backends.cuda.matmul.allow_tf32, "the fp32 bounds assume TF32 off (torch's default)"
    monkeypatch.setattr(prefix_reuse_module, "CUDA_PATH", request.param)
    calls = []
    flex = hf_tree_attn.attention._flex_attention
    monkeypatch.setattr(hf_tree_attn.attention, "_flex_attention", lambda *a, **k: calls.append(1) or flex(*a, **k))
    torch._dynamo.reset()  # a fresh compile per path: shapes of the other path must not reach the recompile limit
    return request.param, calls


def _cuda_twins(family: str = "qwen3", dtype: torch.dtype = torch.float32):
    tree, ref = twin_models(family)
    return tree.to("cuda", dtype), ref.to("cuda")


def _weights(sequences, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return (
        [torch.randn(len(s) - 1, generator=g).cuda() for s in sequences],
        [torch.randn(len(s) - 1, generator=g).cuda() for s in sequences],
    )


def _loss(logps, entropies, weights) -> torch.Tensor:
    return sum((w * lp).sum() + (v * e).sum() for w, v, lp, e in zip(*weights, logps, entropies))


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().float().clone() for name, p in model.named_parameters() if p.grad is not None}


def _chunked(tree, sequences, keep_graphs: int = 1):
    """Chunked log-probs and entropies of `sequences` and the parameter gradients of `_loss` through them."""
    logps, entropies = sequence_logprobs(
        tree, sequences, BUDGET, return_entropy=True, prefix_reuse=True, keep_graphs=keep_graphs
    )
    _loss(logps, entropies, _weights(sequences, seed=0)).backward()
    return [x.detach() for x in logps], [x.detach() for x in entropies], _grads(tree)


def _flat(ref, sequences):
    flat = [flat_logprobs(ref, s) for s in sequences]
    _loss([f[0] for f in flat], [f[1] for f in flat], _weights(sequences, seed=0)).backward()
    return [f[0].detach() for f in flat], [f[1].detach() for f in flat], _grads(ref)


def _check_against_flat(cuda_path, sequences, family: str = "qwen3", keep_graphs: int = 1) -> None:
    path, calls = cuda_path
    atol, grad_rel, min_cos = FP32_TOLERANCES[path]
    tree, ref = _cuda_twins(family)
    got = _chunked(tree, sequences, keep_graphs)
    assert (len(calls) > 0) == (path == "flex"), f"{path}: FlexAttention called {len(calls)} times"
    _assert_close_to_flat(got, _flat(ref, sequences), atol, grad_rel, min_cos)


def _assert_close_to_flat(got, want, atol: float, grad_rel: float | None, min_cos: float) -> None:
    """`_chunked`'s log-probs, entropies and gradients against `_flat`'s, within the path's bounds."""
    (logps, entropies, grads), (want_logps, want_entropies, want_grads) = got, want
    for i in range(len(want_logps)):
        torch.testing.assert_close(logps[i], want_logps[i], atol=atol, rtol=0, msg=lambda m, i=i: f"logps {i}: {m}")
        torch.testing.assert_close(
            entropies[i], want_entropies[i], atol=atol, rtol=0, msg=lambda m, i=i: f"entropy {i}: {m}"
        )
    assert grads.keys() == want_grads.keys() and grads
    for name, want in want_grads.items():
        got = grads[name]
        if grad_rel is not None:
            worst = (got - want).abs().max().item()
            assert worst <= grad_rel * want.abs().max().item() + 1e-9, f"{name}: max |diff| {worst}"
        if want.any():
            cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
            assert cos >= min_cos, f"{name}: gradient cosine {cos}"


@pytest.mark.parametrize("num_chunks", [2, 3, 8])
def test_split_trie_matches_flat(cuda_path, num_chunks):
    sequences = _trie(num_chunks, seed=num_chunks)
    assert _num_chunks(sequences) == num_chunks
    _check_against_flat(cuda_path, sequences)


@pytest.mark.parametrize("keep_graphs", [2, 8])
def test_kept_graphs_match_flat(cuda_path, keep_graphs):
    """The last 2 of 8 chunks, or all 8, run with autograd in the forward and their graphs kept for the backward."""
    sequences = _trie(8, seed=8)
    assert _num_chunks(sequences) == 8
    _check_against_flat(cuda_path, sequences, keep_graphs=keep_graphs)


def test_sequence_four_times_the_budget_matches_flat(cuda_path):
    sequence = _tokens(random.Random(4), 4 * BUDGET)
    assert _num_chunks([sequence]) == 4
    _check_against_flat(cuda_path, [sequence, sequence[:200]], family="llama")


def test_edge_cases_match_flat(cuda_path):
    """Identical sequences, a prefix of another, 1-token sequences, several tries, over four chunks; MQA."""
    sequences = _edge_cases()
    assert _num_chunks(sequences) == 4 and any(len(s) == 1 for s in sequences)
    _check_against_flat(cuda_path, sequences, family="gemma")


def test_changing_one_branch_moves_only_its_subtree(cuda_path):
    """A token changed inside one branch whose subtree spans chunks (a context row of the last chunk): every
    log-prob and entropy outside that subtree is bit-identical, its siblings' included; the branch's did move."""
    tree, _ = _cuda_twins("llama")
    check_branch_change_moves_only_its_subtree(tree)


def _relative_error(got: dict, want: dict) -> float:
    """|got - want| / |want| over all parameters as one vector."""
    diff = sum(float((got[n] - w).square().sum()) for n, w in want.items())
    return (diff / sum(float(w.square().sum()) for w in want.values())) ** 0.5


def test_bf16_is_as_close_to_fp32_as_the_unsplit_forest(cuda_path):
    """A bf16 model, chunked over three budgets, against the float32 flat reference: its log-probs, entropies and
    gradients are no farther from it than twice the unsplit bf16 forest's (one forward, the path every other
    test establishes), plus one bf16 unit roundoff of the values' scale — chunking adds no error of its own beyond
    a reordering."""
    sequences = _trie(3, seed=3)
    tree, ref = _cuda_twins("qwen3", torch.bfloat16)
    logps, entropies, grads = _chunked(tree, sequences)
    want_logps, want_entropies, want_grads = _flat(ref, sequences)

    tree.zero_grad()
    (forest,) = pack_forest(sequences, two_level=False)
    forest = forest.to("cuda")
    table, entropy_table = forest_logprobs(tree, forest, return_entropy=True)
    one_logps = [None] * len(sequences)
    one_entropies = [None] * len(sequences)
    for sid, lp, ent in zip(
        forest.seq_ids, gather_sequences(forest, table), gather_sequences(forest, entropy_table), strict=True
    ):
        one_logps[sid], one_entropies[sid] = lp, ent
    _loss(one_logps, one_entropies, _weights(sequences, seed=0)).backward()
    one_grads = _grads(tree)

    for got, one, want in ((logps, one_logps, want_logps), (entropies, one_entropies, want_entropies)):
        got, one, want = (torch.cat(x).detach() for x in (got, one, want))
        error, one_error = (got - want).abs().max().item(), (one - want).abs().max().item()
        assert error <= 2 * one_error + U_BF16 * want.abs().max().item(), (error, one_error)
    error, one_error = _relative_error(grads, want_grads), _relative_error(one_grads, want_grads)
    assert error <= 2 * one_error + U_BF16, (error, one_error)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["whole layers", "checkpointed layers"])
def test_layers_compiled_with_inductor_run_the_chunks(checkpointing, monkeypatch):
    """Decoder layers compiled in place with inductor and dynamic shapes (the trainers' CUDA default) run the chunks
    (`HF_TREE_ATTN_PREFIX_REUSE_LAYERS=compiled`) on the flex path, their context keys and values through
    `hf_tree_attn::chunk_context_kv`: tries split 2, 3 and 8 ways give the flat forwards' results within the flex
    bounds, with no graph break and no compile past dynamo's recompile limit. Inductor takes the operator's outputs
    as 16-byte aligned (FlexAttention's alignment hint on the keys and values), which a CPU token lost them."""
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    unaligned = []  # per lowering of the operator: is either output in inductor's unaligned buffers?
    create = ir.FallbackKernel.create

    def recording(cls, kernel, *args, **kwargs):
        outputs = create(kernel, *args, **kwargs)
        if kernel is torch.ops.hf_tree_attn.chunk_context_kv.default:
            unaligned.append(any(out.get_name() in V.graph.unaligned_buffers for out in outputs))
        return outputs

    monkeypatch.setattr(ir.FallbackKernel, "create", classmethod(recording))
    monkeypatch.setattr(prefix_reuse_module, "LAYERS", "compiled")
    prefix_reuse_module.CUDA_PATH, path = "flex", prefix_reuse_module.CUDA_PATH
    torch._dynamo.reset()
    counters.clear()
    atol, grad_rel, min_cos = FP32_TOLERANCES["flex"]
    tree, ref = _cuda_twins("qwen3")
    if checkpointing:
        tree.train()
        tree.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compile_decoder_layers(tree, backend="inductor", dynamic=True)
    try:  # no cached graph: inductor lowers the operator here
        with (
            torch._dynamo.config.patch(fail_on_recompile_limit_hit=True),
            torch._inductor.config.patch(force_disable_caches=True),
        ):
            for num_chunks in (2, 3, 8):
                sequences = _trie(num_chunks, seed=200 + num_chunks)
                assert _num_chunks(sequences) == num_chunks
                tree.zero_grad(set_to_none=True)
                ref.zero_grad(set_to_none=True)
                _assert_close_to_flat(_chunked(tree, sequences), _flat(ref, sequences), atol, grad_rel, min_cos)
    finally:
        prefix_reuse_module.CUDA_PATH = path
    assert compiled_layers(tree) == decoder_layers(tree)  # no failure sent them back to eager
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"], dict(counters["graph_break"])
    assert unaligned and not any(unaligned), unaligned
    assert all(context_kv.module_token(layer.self_attn).is_cuda for layer in tree.model.layers)


def test_steps_of_changing_chunks_stay_compiled_and_free_their_memory():
    """Steps over forests cut into 2 to 8 chunks, with layers checkpointed, on the flex path: every FlexAttention
    and mask-builder call stays within dynamo's recompile limit (past it FlexAttention would run its eager reference,
    the full scores matrix: a 0.6B step at 65k-row chunks ran out of an H200's memory there), and after each step's
    backward the memory allocated is what it was before it (each step's kept keys and values once stayed alive)."""
    prefix_reuse_module.CUDA_PATH, path = "flex", prefix_reuse_module.CUDA_PATH
    torch._dynamo.reset()
    tree, _ = _cuda_twins("qwen3")
    tree.train()
    tree.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            for step, num_chunks in enumerate([2, 3, 8, 3, 2, 8]):
                sequences = _trie(num_chunks, seed=100 + step)
                tree.zero_grad(set_to_none=True)
                before = torch.cuda.memory_allocated()
                logps = sequence_logprobs(tree, sequences, BUDGET, prefix_reuse=True)
                sum(lp.sum() for lp in logps).backward()
                grads = sum(p.grad.numel() * p.grad.element_size() for p in tree.parameters() if p.grad is not None)
                del logps
                left = torch.cuda.memory_allocated() - before - grads
                assert left < 2**20, f"step {step} ({num_chunks} chunks) left {left} bytes allocated"
    finally:
        prefix_reuse_module.CUDA_PATH = path
