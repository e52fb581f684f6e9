"""Every tree path under the mixed precision TRL and accelerate use, against the flat forward under the same precision.

The matrix: precision (fp32 weights under bf16 / fp16 autocast, bf16 weights with and without bf16 autocast) x
checkpointing (none; every layer, as `tree_recompute="all"`; one layer of two keeping the shared-prefix kernels'
attention, as `"auto"`) x attention path (the shared-prefix kernels on a two-level forest; the dense mask + SDPA on
a deep one; FlexAttention on CUDA) x models (Qwen3: q / k norms keep float32 under autocast beside bf16
projections; Gemma 2: softcap, eager math; GPT-OSS: sinks; the segment scans of a Gated DeltaNet hybrid, a Mamba-2
hybrid and a short-convolution hybrid).

Tolerance, from the dtype and the computation: tree and flat under precision P are two roundings of the same
float32 function, each off the float32 value by the precision's own error. So the tree must be no farther from
float32 than twice the flat forward under P is, plus one unit roundoff of P at the values' scale (a flat forward
that happens to round luckily must not make the bound vanish). A wrong mask, a state crossing branches or a
computation kept in the lower precision where flat keeps float32 move the values by far more.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from helpers import VOCAB, flat_logprobs, hybrid_twin_models, tiny_config
from transformers import AutoModelForCausalLM, GptOssConfig

import hf_tree_attn
from hf_tree_attn.recompute import recompute_only

PRECISIONS = {  # name: (weights dtype, autocast dtype or None)
    "fp32+bf16autocast": (torch.float32, torch.bfloat16),
    "fp32+fp16autocast": (torch.float32, torch.float16),
    "bf16": (torch.bfloat16, None),
    "bf16+bf16autocast": (torch.bfloat16, torch.bfloat16),
}
CHECKPOINTING = ("none", "all", "auto")
MODELS = ("qwen3", "gemma2", "gpt_oss", "qwen3_5", "nemotron_h", "lfm2")
HYBRIDS = ("qwen3_5", "nemotron_h", "lfm2")


def _unit_roundoff(precision: str) -> float:
    weights, autocast = PRECISIONS[precision]
    lowest = autocast or weights
    return torch.finfo(lowest).eps / 2


def _twins(name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """`(tree_model, flat_model)`, fp32, identical weights; the flat one on transformers' stock attention."""
    if name in HYBRIDS:
        return hybrid_twin_models(name)
    if name == "gpt_oss":  # attention sinks, alternating sliding windows, MoE
        # Every token routed to all 4 experts: top-2 of 4 is a step function of the router logits, which no rounding
        # argument bounds. With top-2, one prompt token's top-2 margin (0.020 in float32) was below the bf16 noise of
        # the router logits (0.022, flat and tree alike); FlexAttention's rounding of the sink layers, as accurate as
        # eager's (RMS 0.0021 vs 0.0022 off float32), flipped its experts, moving its log-prob by 0.12 (bf16 cells
        # on CUDA; `test_sink_folding_in_flex_attention_matches_flat_on_cpu`). Per-token routing is no tree matter.
        config = GptOssConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=4, sliding_window=256,
            initializer_range=0.1, pad_token_id=0, eos_token_id=2, bos_token_id=1,
        )  # fmt: skip
        reference = "eager"
    else:
        config = tiny_config(name)
        reference = "eager" if name == "gemma2" else "sdpa"
    torch.manual_seed(0)
    tree = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="tree_flex")
    flat = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=reference)
    flat.load_state_dict(tree.state_dict())
    return tree.eval(), flat.eval()


def _sequences(path: str) -> list[list[int]]:
    """A two-level forest (two prompts, their completions: the shared-prefix kernels) or a deep multi-turn one (each
    turn's sample extends the previous: the dense mask), with a 1-token completion and two identical sequences."""
    g = torch.Generator().manual_seed(7)

    def tokens(n):
        return torch.randint(3, VOCAB, (n,), generator=g).tolist()

    if path == "prefix":
        groups = []
        for prompt_len in (24, 9):
            prompt = tokens(prompt_len)
            groups += [prompt + tokens(n) for n in (7, 1, 12, 5)]
        return groups + [groups[0]]
    history, samples = tokens(10), []
    for _ in range(4):
        history = history + tokens(6)
        samples.append(history)
    return samples + [samples[1] + tokens(3), samples[1]]


def _setup(model: torch.nn.Module, precision: str, checkpointing: str, device: str) -> torch.nn.Module:
    model = model.to(device, PRECISIONS[precision][0])
    if checkpointing != "none":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    return model


def _weighted_sum(values: list[torch.Tensor]) -> torch.Tensor:
    """A loss that weighs every token differently, so a gradient sent to the wrong row cannot cancel out."""
    return sum((v * torch.linspace(0.5, 1.5, len(v), device=v.device)).sum() * (i + 1) for i, v in enumerate(values))


def _run(model, sequences, tree: bool, autocast: torch.dtype | None, checkpointing: str):
    """`(logps, entropies, grads)`: per-sequence float32 lists and the parameters' gradients (float32, on the CPU),
    the forward under `autocast` (None: off) on the model's device."""
    model.zero_grad(set_to_none=True)
    device = next(model.parameters()).device
    with torch.autocast(device.type, dtype=autocast) if autocast else contextlib.nullcontext():
        if tree:
            count = 1 if checkpointing == "auto" else None
            with recompute_only(model, count, keep_attention=checkpointing == "auto"):
                logps, entropies = hf_tree_attn.sequence_logprobs(model, sequences, return_entropy=True)
        else:
            logps, entropies = zip(*(flat_logprobs(model, seq) for seq in sequences))
        loss = _weighted_sum(logps) + 0.1 * _weighted_sum(entropies)
    loss.backward()
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return [lp.detach().float().cpu() for lp in logps], [e.detach().float().cpu() for e in entropies], grads


def _max_error(values, reference) -> float:
    return max(float((v - r).abs().max()) for v, r in zip(values, reference) if len(r))


def _grad_error(grads, reference) -> float:
    """Relative error of the whole gradient vector."""
    diff = sum(float((grads[n] - g).square().sum()) for n, g in reference.items())
    return (diff / sum(float(g.square().sum()) for g in reference.values())) ** 0.5


@pytest.fixture(scope="module")
def references():
    """Float32 flat results per (model, path), computed once."""
    cache = {}

    def get(name, path):
        if (name, path) not in cache:
            _, flat = _twins(name)
            cache[name, path] = _run(flat, _sequences(path), False, None, "none")
        return cache[name, path]

    return get


# (device, attention path): the shared-prefix kernels, the dense mask + SDPA, FlexAttention. "prefix" is a two-level
# forest with the kernels on; layers they do not serve (Gemma 2's softcap, GPT-OSS's sinks) run that forest on the
# dense mask (CPU) or FlexAttention (CUDA), so for those models the cell checks the two-level layout there.
PATHS = [
    ("cpu", "prefix"),
    ("cpu", "dense"),
    pytest.param("cuda", "prefix", marks=pytest.mark.gpu),
    pytest.param("cuda", "flex", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("device, path", PATHS)
@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", MODELS)
def test_tree_under_mixed_precision_matches_flat(
    name, precision, checkpointing, device, path, references, monkeypatch
):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    # The kernels wherever the forest is two-level ("always": on CUDA too, whatever their speed), else none.
    monkeypatch.setattr(hf_tree_attn.prefix_attention, "MODE", "always" if path == "prefix" else "never")
    sequences = _sequences("prefix" if path == "prefix" else "deep")
    if path == "prefix":
        (forest,) = hf_tree_attn.pack_forest(sequences)
        assert forest.prefix_plan is not None
    tree_model, flat_model = (_setup(m, precision, checkpointing, device) for m in _twins(name))
    ref_logps, ref_entropies, ref_grads = references(name, "prefix" if path == "prefix" else "deep")
    autocast = PRECISIONS[precision][1]
    flat = _run(flat_model, sequences, False, autocast, checkpointing)
    tree = _run(tree_model, sequences, True, autocast, checkpointing)

    u = _unit_roundoff(precision)
    for k, what in enumerate(("log-probs", "entropies")):
        ref = (ref_logps, ref_entropies)[k]
        scale = max(float(r.abs().max()) for r in ref if len(r))
        flat_error, tree_error = _max_error(flat[k], ref), _max_error(tree[k], ref)
        assert tree_error <= 2 * flat_error + u * scale, (what, tree_error, flat_error)
    flat_error, tree_error = _grad_error(flat[2], ref_grads), _grad_error(tree[2], ref_grads)
    assert set(tree[2]) == set(ref_grads)
    assert tree_error <= 2 * flat_error + u, ("gradients", tree_error, flat_error)


@pytest.mark.parametrize("forest", ("prefix", "deep"))
@pytest.mark.parametrize("precision", PRECISIONS)
def test_sink_folding_in_flex_attention_matches_flat_on_cpu(precision, forest, references, monkeypatch):
    """GPT-OSS's cells above as CUDA runs them: sink layers through FlexAttention (the sinks folded in by its
    log-sum-exp), which CPU otherwise never takes (there they run the dense mask and eager math, as flat does).
    Forward only (CPU FlexAttention has no backward), against the same bound."""
    monkeypatch.setattr(hf_tree_attn.prefix_attention, "MODE", "always" if forest == "prefix" else "never")
    masks = hf_tree_attn.PackedForest.attention_mask

    def block_masks(self, device=None, dense=None):  # as on CUDA
        return masks(self, device, dense=False)

    monkeypatch.setattr(hf_tree_attn.PackedForest, "attention_mask", block_masks)
    flex, calls = hf_tree_attn.attention._flex_attention, []
    monkeypatch.setattr(hf_tree_attn.attention, "_flex_attention", lambda *a, **k: calls.append(1) or flex(*a, **k))
    sequences = _sequences(forest)
    tree_model, flat_model = (_setup(m, precision, "none", "cpu") for m in _twins("gpt_oss"))
    ref = references("gpt_oss", forest)
    autocast = PRECISIONS[precision][1]
    with torch.no_grad(), torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext():
        flat = list(zip(*(flat_logprobs(flat_model, seq) for seq in sequences)))
        tree = hf_tree_attn.sequence_logprobs(tree_model, sequences, return_entropy=True)
    assert len(calls) == tree_model.config.num_hidden_layers, "the sink layers must take FlexAttention"
    u = _unit_roundoff(precision)
    for k, what in enumerate(("log-probs", "entropies")):
        values = [[v.float() for v in vs] for vs in (flat[k], tree[k])]
        scale = max(float(r.abs().max()) for r in ref[k] if len(r))
        flat_error, tree_error = _max_error(values[0], ref[k]), _max_error(values[1], ref[k])
        assert tree_error <= 2 * flat_error + u * scale, (what, tree_error, flat_error)


def test_autocast_casts_the_kernels_inputs_once():
    """The failure this file guards: under autocast Qwen3's q / k norms hand the attention float32 beside bf16 values;
    the shared-prefix kernels (ATen ops, not autocast-aware) then ran on mixed dtypes, in the forward and in a
    checkpointed layer's recompute."""
    tree_model, _ = _twins("qwen3")
    tree_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tree_model.train()
    sequences = _sequences("prefix")
    seen = []
    original = hf_tree_attn.prefix_attention._forward

    def spy(q, k, v, causal, scale):
        seen.append({q.dtype, k.dtype, v.dtype})
        return original(q, k, v, causal, scale)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hf_tree_attn.prefix_attention, "_forward", spy)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logps = hf_tree_attn.sequence_logprobs(tree_model, sequences)
        sum(lp.sum() for lp in logps).backward()
    assert seen and all(dtypes == {torch.bfloat16} for dtypes in seen)
    assert len(seen) > 2 * 3 * 2  # the forward and the recompute, every tree, both layers (MODE "auto": on CPU,
    # every two-level forest)
