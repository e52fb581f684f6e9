"""The coverage matrix on CUDA: every accepted family's tree on its real GPU path (compiled FlexAttention with one
`BlockMask` per layer kind), against the same weights' per-sequence `eager` forward, fp32, forward and backward.

The CPU matrix (`tests/test_coverage.py`) proves each family exact on the dense-mask path; this one runs the
FlexAttention kernels with each family's shapes (Gemma 4's 512-wide global heads, MLA's unequal q / v widths,
sinks, softcaps, windows of 4 tokens on sequences crossing 128-token blocks), where a kernel limit or a mask built
for the wrong kind would show. Gradients: finite everywhere (padding rows included) and parallel to flat's.

`pytest -m gpu tests/test_gpu_coverage.py` — skipped without CUDA (CI).
"""

from __future__ import annotations

import random

import pytest
import torch
from test_coverage import FAMILIES, _models

import hf_tree_attn
from hf_tree_attn.support import EXACT_FAMILIES

pytestmark = pytest.mark.gpu

# fp32 FlexAttention on Hopper runs its dot products at reduced (tf32-like) precision: tests/test_gpu.py's bound.
ATOL, MIN_COS = 2e-4, 0.9999


@pytest.fixture(autouse=True)
def _fresh_compile():
    """A fresh Dynamo state per family: the compiled FlexAttention would otherwise reach Dynamo's recompile limit
    after a few families' shapes and run the eager (math) reference instead of the kernel under test."""
    torch._dynamo.reset()
    yield


def _sequences() -> list[list[int]]:
    """A prompt group crossing a 128-token block, a duplicate, a prefix of the others, a long chain, one token."""
    rng = random.Random(0)

    def tokens(n):
        return [rng.randrange(3, 128) for _ in range(n)]

    prompt = tokens(100)
    group = [prompt + tokens(rng.randrange(1, 60)) for _ in range(4)]
    return [*group, list(group[0]), prompt[:37], tokens(150), tokens(1)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model_type", [f for f in FAMILIES if f in EXACT_FAMILIES])
def test_family_on_the_gpu_path(model_type):
    tree, flat = (m.to("cuda") for m in _models(model_type, "eager"))
    seqs = _sequences()
    weights = [torch.randn(max(len(s) - 1, 0), device="cuda") for s in seqs]
    tree_lp = hf_tree_attn.sequence_logprobs(tree, seqs)
    flat_lp = []
    for s in seqs:
        ids = torch.tensor([s], device="cuda")
        logp = flat(ids, use_cache=False).logits[0, :-1].float().log_softmax(-1)
        flat_lp.append(logp.gather(-1, ids[0, 1:, None])[:, 0])
    for t, f in zip(tree_lp, flat_lp):
        torch.testing.assert_close(t, f, atol=ATOL, rtol=0)

    sum((t * w).sum() for t, w in zip(tree_lp, weights)).backward()
    sum((f * w).sum() for f, w in zip(flat_lp, weights)).backward()
    flat_grads = {n: p.grad for n, p in flat.named_parameters()}
    pairs = [(p.grad, flat_grads[n]) for n, p in tree.named_parameters() if flat_grads[n] is not None]
    assert all(torch.isfinite(g).all() for g, _ in pairs if g is not None), "non-finite tree gradients"
    got = torch.cat([(g if g is not None else torch.zeros_like(r)).flatten() for g, r in pairs])
    want = torch.cat([r.flatten() for _, r in pairs])
    assert torch.nn.functional.cosine_similarity(got.double(), want.double(), dim=0) >= MIN_COS
