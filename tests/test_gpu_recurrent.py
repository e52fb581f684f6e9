"""Hybrid models on CUDA: the tree (BlockMask attention, state-carrying layers level by level) against every
sequence's own flat forward.

Gated DeltaNet models (Qwen3.5, Qwen3-Next; K = V = 64 and Qwen3.5's real K = V = 128) run on each kernel route of
`benchmarks/gdn_kernels.py`: transformers' torch reference, FlashQLA, flash-linear-attention's Triton kernels with
TileLang's dqkwg backward, and fla's Triton kernels alone; a route this machine cannot run is skipped with the
reason. The oracle is the per-sequence flat forward in float32 on the torch kernels; every test also checks that
the route's own kernels ran, forward and backward (a silent fallback fails). Mamba-2 and short-conv hybrids run
transformers' torch kernels.

`pytest -m gpu tests/test_gpu_recurrent.py` — skipped without CUDA; `-k flash_qla` (a route's name) selects a route.
"""

import copy
import random
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, Lfm2Config, NemotronHConfig, Qwen3_5TextConfig, Qwen3NextConfig

import hf_tree_attn
from hf_tree_attn import recurrent, transformers_compat
from hf_tree_attn.support import tree_support_error

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gdn_kernels  # noqa: E402

pytestmark = pytest.mark.gpu

_LINEAR_FULL = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
_COMMON = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, vocab_size=256, linear_conv_kernel_dim=4,
               layer_types=_LINEAR_FULL)  # fmt: skip
# Gated DeltaNet models: name -> (config, K = V), Qwen3.5's real head size first. The K = 128 models have
# Qwen3.5-0.8B's 16 value heads of 128 (so the fla kernels autotune for the benchmark's shapes); Qwen3-Next's has
# twice as many value heads as key heads, as its checkpoints (the layer repeats q and k), and dense MLPs (a bf16
# router could pick other experts than the fp32 reference: not what is tested here).
GDN_CONFIGS = {
    "qwen3_5_k128": (Qwen3_5TextConfig(**_COMMON, linear_num_key_heads=16, linear_num_value_heads=16,
                                       linear_key_head_dim=128, linear_value_head_dim=128), 128),
    "qwen3_next_k128": (Qwen3NextConfig(**_COMMON, linear_num_key_heads=8, linear_num_value_heads=16,
                                        linear_key_head_dim=128, linear_value_head_dim=128,
                                        mlp_only_layers=[0, 1, 2, 3]), 128),
    "qwen3_5": (Qwen3_5TextConfig(**_COMMON, linear_num_key_heads=2, linear_num_value_heads=4,
                                  linear_key_head_dim=64, linear_value_head_dim=64), 64),
}  # fmt: skip
OTHER_CONFIGS = {
    "lfm2": Lfm2Config(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, layer_types=["conv", "full_attention", "conv", "full_attention"],
        block_auto_adjust_ff_dim=False,
    ),
    "nemotron_h": NemotronHConfig(
        hidden_size=256, intermediate_size=512, layers_block_type=["linear_attention", "full_attention", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=256, ssm_state_size=32,
        mamba_num_heads=8, mamba_head_dim=32, n_groups=2, conv_kernel=4, chunk_size=64,
    ),
}  # fmt: skip

# (dtype, kernel precision) -> (atol on per-token log-probs vs the fp32 flat forward on the torch kernels, min
# gradient cosine: all parameters as one vector, and each parameter of at least 1024 entries). fp32 on the torch
# kernels is fp32 throughout but for FlexAttention's and cuBLAS's summation order; fp32 on fla's Triton / TileLang
# kernels multiplies in TF32 (Triton's default for fp32 dots): an 11-bit significand, 8x bf16's precision, so the
# bf16 bounds divided by ~8. bf16: 8-bit significand, the same for every route. Where the kernels alone fall short of
# a gradient bound (the per-sequence flat model on the same kernels, against the same reference: on the H200 fla
# 0.6's fp32 kernels reach cosine 0.964 on Qwen3.5's `in_proj_a`, the decay gate's input, while bf16 reaches
# 0.9997), the tree may lose at most twice what they lose (`_assert_gradients_close`): the tree's own error is what is
# tested, not the kernel's.
TOLERANCES = {
    (torch.float32, "fp32"): (1e-3, 0.9999),
    (torch.float32, "tf32"): (1e-2, 0.999),
    (torch.bfloat16, "bf16"): (6e-2, 0.995),
}


def _tolerance(route: str, dtype: torch.dtype) -> tuple[float, float]:
    precision = "bf16" if dtype == torch.bfloat16 else "fp32" if route == "torch" else "tf32"
    return TOLERANCES[(dtype, precision)]


def _sequences(seed: int, turns: int = 20) -> list[list[int]]:
    """GRPO-like groups crossing 128-token blocks (duplicates, a prefix of another, 1-token sequences) and an
    agent tree of `turns` turns (~`turns + 1` levels)."""
    rng = random.Random(seed)
    seqs = []
    for _ in range(2):
        prompt = [rng.randrange(1, 256) for _ in range(rng.randrange(100, 300))]
        for _ in range(5):
            seqs.append(prompt + [rng.randrange(1, 256) for _ in range(rng.randrange(1, 200))])
        seqs += [list(seqs[-1]), prompt[: rng.randrange(1, len(prompt))]]
    history = [rng.randrange(1, 256) for _ in range(200)]
    for _ in range(turns):
        history = history + [rng.randrange(1, 256) for _ in range(rng.randrange(4, 30))]
        responses = [[rng.randrange(1, 256) for _ in range(rng.randrange(8, 60))] for _ in range(2)]
        seqs += [history + r for r in responses]
        history = history + responses[0]
    return seqs + [[7], [9]]


def _build(config, attn_implementation: str, dtype: torch.dtype, state_dict=None):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attn_implementation)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model.to("cuda", dtype)


def _flat_logprobs(model, seqs):
    out = []
    for s in seqs:
        ids = torch.tensor([s], device="cuda")
        logits = model(ids).logits[0].float().log_softmax(-1)
        out.append(logits[:-1].gather(1, ids[0, 1:, None])[:, 0])
    return out


def _max_error(got, want) -> float:
    """Largest |got - want| over per-sequence log-probs (a 1-token sequence has none)."""
    return torch.cat([(g - w).abs() for g, w in zip(got, want, strict=True)]).max().item()


def _weights(seqs):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(max(len(s) - 1, 0), generator=gen).cuda() for s in seqs]


def _backward(logps, weights):
    sum(((lp * w).sum() for lp, w in zip(logps, weights))).backward()


_REFERENCE: dict = {}


def _reference(name: str, config, seqs):
    """The model's weights, and its per-sequence flat forwards in float32 on transformers' torch kernels: log-probs
    and parameter gradients (computed once per model)."""
    if name not in _REFERENCE:
        flat = _build(config, "eager", torch.float32)
        with gdn_kernels.select("torch"):
            logps = _flat_logprobs(flat, seqs)
            _backward(logps, _weights(seqs))
        grads = {n: p.grad.detach().clone() for n, p in flat.named_parameters()}
        state = {n: t.detach().cpu() for n, t in flat.state_dict().items()}
        _REFERENCE[name] = (state, [lp.detach() for lp in logps], grads)
        del flat
    return _REFERENCE[name]


def _cosine(got: torch.Tensor, want: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(got.double().flatten(), want.double().flatten(), dim=0).item()


ALL = "all parameters"


def _gradient_cosines(model, ref_grads) -> dict[str, float]:
    """Each parameter's gradient cosine against `ref_grads`, for the parameters of >= 1024 entries, and (key
    `ALL`) of every parameter's gradient as one vector."""
    cosines = {n: _cosine(p.grad, ref_grads[n]) for n, p in model.named_parameters() if p.grad.numel() >= 1024}
    params = list(model.named_parameters())
    cosines[ALL] = _cosine(torch.cat([p.grad.float().flatten() for _, p in params]),
                           torch.cat([ref_grads[n].flatten() for n, _ in params]))  # fmt: skip
    return cosines


def _assert_gradients_close(model, ref_grads, min_cos, kernel_cosines=None):
    """Every gradient cosine of `_gradient_cosines` against `min_cos`, or where the same kernels without a tree
    (`kernel_cosines`, the per-sequence flat model's) fall short of it, against the cosine that loses twice what they
    lose; returns the worst."""
    cosines = _gradient_cosines(model, ref_grads)
    for pname, cos in cosines.items():
        bound = min_cos if kernel_cosines is None else min(min_cos, 1 - 2 * (1 - kernel_cosines[pname]))
        if bound < min_cos:
            print(f"  {pname}: tree {cos:.6f}, the kernels alone {kernel_cosines[pname]:.6f}, bound {bound:.6f}")
        assert cos >= bound, f"{pname}: grad cosine {cos} (bound {bound})"
    return min(cosines.values())


def test_gated_deltanet_uses_the_varlen_kernel_when_fla_is_installed():
    if (reason := gdn_kernels.unavailable("fla_triton", 128, lift_guard=True)) is not None:
        pytest.skip(reason)
    transformers_compat.install()
    module = sys.modules["transformers.models.qwen3_5.modeling_qwen3_5"]
    assert recurrent._use_varlen(module.torch_chunk_gated_delta_rule.tree_original, torch.device("cuda"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", list(GDN_CONFIGS))
@pytest.mark.parametrize("route", gdn_kernels.ROUTES)
def test_gated_deltanet_tree_matches_flat_on_each_kernel_route(route, name, dtype):
    """Tree on `route` in `dtype` vs per-sequence fp32 flat on the torch kernels: log-probs and parameter gradients
    (the gradient bound relaxed only where the per-sequence flat model on the same kernels misses it); the route's
    kernels ran in the tree's forward and backward. Prints the measured errors and the flat model's."""
    config, head_dim = GDN_CONFIGS[name]
    if (reason := gdn_kernels.unavailable(route, head_dim, dtype, lift_guard=True)) is not None:
        pytest.skip(reason)
    atol, min_cos = _tolerance(route, dtype)
    seqs = _sequences(seed=1)
    state, ref_logps, ref_grads = _reference(name, config, seqs)

    model, flat = _build(config, "tree_flex", dtype, state), _build(config, "tree_flex", dtype, state)
    with gdn_kernels.select(route, lift_guard=True):
        flat_logps = _flat_logprobs(flat, seqs)
        _backward(flat_logps, _weights(seqs))
        flat_err = _max_error([lp.detach() for lp in flat_logps], ref_logps)
        with gdn_kernels.KernelProbe() as probe:
            tree_logps = hf_tree_attn.sequence_logprobs(model, seqs, max_tokens_per_mb=2048)
            _backward(tree_logps, _weights(seqs))
    tree_err = _max_error(tree_logps, ref_logps)
    print(f"{route} {name} {dtype}: kernels {gdn_kernels.describe(probe.calls)}; max |logp - ref| tree {tree_err:.3g}"
          f", flat on the same kernels {flat_err:.3g}", flush=True)  # fmt: skip
    assert probe.calls["gdn_layer_tree"] > 0
    assert (problem := gdn_kernels.route_problem(route, probe.calls)) is None, problem
    for t, r in zip(tree_logps, ref_logps):
        torch.testing.assert_close(t, r, atol=atol, rtol=0)
    flat_cosines = _gradient_cosines(flat, ref_grads)
    flat_cos, flat_param = min((cos, n) for n, cos in flat_cosines.items())
    print(f"{route} {name} {dtype}: flat on the same kernels, worst gradient cosine {flat_cos:.6f} ({flat_param})",
          flush=True)  # fmt: skip
    worst = _assert_gradients_close(model, ref_grads, min_cos, kernel_cosines=flat_cosines)
    print(f"{route} {name} {dtype}: worst gradient cosine {worst:.6f}", flush=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(OTHER_CONFIGS))
def test_hybrid_tree_matches_flat_forward_and_backward(name, dtype):
    """Mamba-2 (Nemotron-H) and short-conv (LFM2) hybrids on transformers' torch kernels. A transformers whose layer
    the tree cannot reach (LFM2's short convolution before it passed the model's keyword arguments on) is refused by
    the gate (`test_recurrent.py` checks that refusal on the CPU): skipped here with the gate's reason."""
    atol, min_cos = _tolerance("torch", dtype)
    seqs = _sequences(seed=1)
    weights = _weights(seqs)
    flat_model = _build(OTHER_CONFIGS[name], "eager", torch.float32)
    tree_model = _build(OTHER_CONFIGS[name], "tree_flex", dtype, flat_model.state_dict())
    if (reason := tree_support_error(tree_model)) is not None:
        pytest.skip(f"transformers {transformers.__version__} is refused by the gate: {reason}")
    tree_lp = hf_tree_attn.sequence_logprobs(tree_model, seqs, max_tokens_per_mb=2048)
    flat_lp = _flat_logprobs(flat_model, seqs)
    for t, f in zip(tree_lp, flat_lp):
        torch.testing.assert_close(t, f, atol=atol, rtol=0)
    _backward(tree_lp, weights)
    _backward(flat_lp, weights)
    _assert_gradients_close(tree_model, {n: p.grad for n, p in flat_model.named_parameters()}, min_cos)


@pytest.mark.parametrize("name", list(GDN_CONFIGS))
@pytest.mark.parametrize("route", gdn_kernels.FLA_ROUTES)
def test_varlen_and_padded_level_batches_agree_on_gpu(route, name, monkeypatch):
    """The same forest through one varlen call per level and through a zero-padded batch per level, on the same
    kernels (bf16 for FlashQLA, which takes no fp32; fp32 otherwise)."""
    config, head_dim = GDN_CONFIGS[name]
    dtype = torch.bfloat16 if route == "flash_qla" else torch.float32
    if (reason := gdn_kernels.unavailable(route, head_dim, dtype, lift_guard=True)) is not None:
        pytest.skip(reason)
    model = _build(config, "tree_flex", dtype)
    forest = hf_tree_attn.pack_forest(_sequences(seed=2))[0].to("cuda")
    with gdn_kernels.select(route, lift_guard=True), torch.no_grad():
        with gdn_kernels.KernelProbe() as probe:
            varlen, _ = hf_tree_attn.forest_logprobs(model, forest, return_entropy=False)
        monkeypatch.setattr(recurrent, "_use_varlen", lambda original, device: False)
        padded, _ = hf_tree_attn.forest_logprobs(model, forest, return_entropy=False)
    assert (problem := gdn_kernels.route_problem(route, probe.calls, backward=False)) is None, problem
    torch.testing.assert_close(varlen, padded, atol=1e-3 if dtype == torch.float32 else 6e-2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("turns", [1, 4, 20, 39])
@pytest.mark.parametrize("name", ["qwen3_5_k128", "qwen3_next_k128"])
@pytest.mark.parametrize("route", gdn_kernels.FLA_ROUTES)
def test_two_calls_and_the_level_loop_agree_on_gpu(route, name, turns, dtype, monkeypatch):
    """The delta rule in two kernel calls (`recurrent._scan_two_pass`) and level by level, on the same forest (2 to
    40 levels), weights and kernels: log-probs within the route's bound, and parameter gradients as close as the
    route's bound asks of the tree against the float32 reference."""
    config, head_dim = GDN_CONFIGS[name]
    if (reason := gdn_kernels.unavailable(route, head_dim, dtype, lift_guard=True)) is not None:
        pytest.skip(reason)
    atol, min_cos = _tolerance(route, dtype)
    seqs = _sequences(seed=3, turns=turns)
    levels = hf_tree_attn.pack_forest(seqs)[0].num_levels
    weights, results = _weights(seqs), {}
    for path, min_levels in (("two calls", 1), ("level by level", None)):
        monkeypatch.setitem(recurrent.TWO_PASS_MIN_LEVELS, "varlen", min_levels)
        model = _build(config, "tree_flex", dtype)
        with gdn_kernels.select(route, lift_guard=True), gdn_kernels.KernelProbe() as probe:
            logps = hf_tree_attn.sequence_logprobs(model, seqs, max_tokens_per_mb=4096)
            _backward(logps, weights)
        assert (problem := gdn_kernels.route_problem(route, probe.calls)) is None, problem
        results[path] = [lp.detach() for lp in logps], {n: p.grad.float() for n, p in model.named_parameters()}
    (two, two_grads), (loop, loop_grads) = results["two calls"], results["level by level"]
    error = _max_error(two, loop)
    model.zero_grad()
    for n, p in model.named_parameters():
        p.grad = two_grads[n].to(p.dtype)
    worst = _assert_gradients_close(model, loop_grads, min_cos)
    print(f"{route} {name} {dtype} {levels} levels: max |logp two calls - level by level| {error:.3g}, worst "
          f"gradient cosine {worst:.6f}", flush=True)  # fmt: skip
    for a, b in zip(two, loop):
        torch.testing.assert_close(a, b, atol=atol, rtol=0)
