"""Fused layer kernels and regional compilation on the tree path.

- CPU: regional compilation of the decoder layers (accelerate's `compile_regions`, what an accelerate config with
  `dynamo_use_regional_compilation: true` applies) with the `aot_eager` backend: the tree forward and backward equal
  the eager ones, the `tree_forest` kwarg breaks no graph, and forests of new sizes (with and without recompute)
  compile no new graphs once warm (Liger with compiled layers is refused: tests/test_compile.py).
- GPU (`-m gpu`): the same with inductor, and Liger's layer kernels (RMSNorm, SwiGLU, RoPE from the depth position
  ids) as `use_liger_kernel=True` applies them — bf16 results within bf16 tolerance of the flat forward.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from helpers import TOLERANCES
from test_grpo_trainer import tiny  # noqa: F401  (the saved tiny model fixture)
from transformers import AutoModelForCausalLM, Qwen3Config

import hf_tree_attn
from hf_tree_attn.logprobs import forest_logprobs
from hf_tree_attn.recompute import recompute_only

CONFIG = Qwen3Config(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=128, initializer_range=0.1,
)  # fmt: skip


def _model(config=CONFIG, attn_implementation="tree_flex"):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attn_implementation).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # TRL's default
    return model


def _groups(rng: random.Random, vocab: int, groups: int, prompt: int, completion: int) -> list[list[int]]:
    seqs = []
    for _ in range(groups):
        p = [rng.randrange(3, vocab) for _ in range(rng.randint(prompt // 2, prompt))]
        seqs += [p + [rng.randrange(3, vocab) for _ in range(rng.randint(1, completion))] for _ in range(4)]
    return seqs


def _logps_and_grads(model, forest, recompute):
    model.zero_grad(set_to_none=True)
    with recompute_only(model, recompute):
        table, _ = forest_logprobs(model, forest)
    (table * torch.linspace(-1, 1, forest.seq_len, device=table.device)).sum().backward()
    grads = {n.replace("._orig_mod", ""): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return table.detach(), grads


def test_regional_compile_matches_eager_without_graph_breaks_or_recompiles():
    from accelerate.utils import compile_regions
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager = _model()
    compiled = compile_regions(_model(), backend="aot_eager")
    assert type(compiled.model.layers[0]).__name__ == "OptimizedModule"
    rng = random.Random(0)
    graphs = []
    # Warm-up: two sizes x (every layer recomputes, none does); then new sizes, both modes again.
    for recompute in [None, None, 0, 0, None, 0, None, 0]:
        (forest,) = hf_tree_attn.pack_forest(_groups(rng, CONFIG.vocab_size, rng.randint(1, 3), 160, 60))
        expected = _logps_and_grads(eager, forest, recompute)
        table, grads = _logps_and_grads(compiled, forest, recompute)
        torch.testing.assert_close(table, expected[0], atol=TOLERANCES["logps_atol"], rtol=0)
        for name, grad in expected[1].items():  # per tensor, relative to its largest entry (helpers.TOLERANCES)
            worst = (grads[name] - grad).abs().max().item()
            assert worst <= TOLERANCES["grad_max_rel"] * grad.abs().max().item(), (name, worst)
        graphs.append(counters["stats"]["unique_graphs"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert graphs[0] > 0 and graphs[-1] == graphs[3], graphs  # new forest sizes after warm-up: no recompilation


# ------------------------------------------------------------------------------------------------------ GPU


# dtype -> (atol on per-token log-probs vs the fp32 flat forward, min gradient cosine), as tests/test_gpu.py
BF16 = (6e-2, 0.995)
GPU_CONFIG = Qwen3Config(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, vocab_size=256,
)  # fmt: skip


def _flat_reference(tree_model, seqs):
    """Per-sequence eager forwards in fp32 with the tree model's weights, and their log-probs."""
    flat = AutoModelForCausalLM.from_config(copy.deepcopy(GPU_CONFIG), attn_implementation="eager")
    flat.load_state_dict({k.replace("._orig_mod", ""): v.float() for k, v in tree_model.state_dict().items()})
    flat = flat.to("cuda").train()
    out = []
    for s in seqs:
        ids = torch.tensor([s], device="cuda")
        out.append(flat(ids).logits[0].float().log_softmax(-1)[:-1].gather(1, ids[0, 1:, None])[:, 0])
    return flat, out


def _assert_tree_matches_flat(tree_model, seqs):
    atol, min_cos = BF16
    weights = [torch.randn(len(s) - 1, device="cuda") for s in seqs]
    tree_lp = hf_tree_attn.sequence_logprobs(tree_model, seqs)
    flat_model, flat_lp = _flat_reference(tree_model, seqs)
    for t, f in zip(tree_lp, flat_lp):
        torch.testing.assert_close(t, f, atol=atol, rtol=0)
    sum((t * w).sum() for t, w in zip(tree_lp, weights)).backward()
    sum((f * w).sum() for f, w in zip(flat_lp, weights)).backward()
    flat_params = dict(flat_model.named_parameters())
    for name, p in tree_model.named_parameters():
        name = name.replace("._orig_mod", "")
        cos = torch.nn.functional.cosine_similarity(p.grad.float().flatten(), flat_params[name].grad.flatten(), dim=0)
        assert cos >= min_cos, f"{name}: gradient cosine {cos.item()}"


@pytest.mark.gpu
def test_liger_layer_kernels_on_the_tree_path(monkeypatch):
    """`use_liger_kernel=True` (transformers' `apply_liger_kernel` with TRL's config) patches RMSNorm, SwiGLU and RoPE
    (Liger's RoPE reads cos/sin per token, which the model computes from the depth position ids): the tree stays
    within bf16 tolerance of flat eager."""
    pytest.importorskip("liger_kernel")
    from transformers.integrations.liger import apply_liger_kernel
    from transformers.models.qwen3 import modeling_qwen3

    # Liger replaces the module's RoPE function for every Qwen3 model: put it back after this test.
    monkeypatch.setattr(modeling_qwen3, "apply_rotary_pos_emb", modeling_qwen3.apply_rotary_pos_emb)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(GPU_CONFIG), attn_implementation="tree_flex")
    model = model.to("cuda", torch.bfloat16).train()
    apply_liger_kernel(model, {"fused_linear_cross_entropy": False})  # what TRL passes
    assert modeling_qwen3.apply_rotary_pos_emb.__module__.startswith("liger_kernel")
    assert "Liger" in model.model.layers[0].mlp.forward.__qualname__
    rng = random.Random(1)
    _assert_tree_matches_flat(model, _groups(rng, GPU_CONFIG.vocab_size, 3, 300, 200))


@pytest.mark.gpu
def test_regional_inductor_compile_on_the_tree_path():
    """Inductor-compiled decoder layers (FlexAttention inlined into each layer's graph): within bf16 tolerance of
    flat eager, and no recompilation for new forest sizes once warm."""
    from accelerate.utils import compile_regions
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(GPU_CONFIG), attn_implementation="tree_flex")
    model = compile_regions(model.to("cuda", torch.bfloat16).train())
    rng = random.Random(2)
    graphs = []
    for _ in range(5):
        seqs = _groups(rng, GPU_CONFIG.vocab_size, rng.randint(2, 4), 400, 300)
        _assert_tree_matches_flat(model, seqs)
        model.zero_grad(set_to_none=True)
        graphs.append(counters["stats"]["unique_graphs"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert graphs[-1] == graphs[1], graphs


@pytest.mark.gpu
def test_tree_trainer_with_liger_kernels_matches_flat_trainer(tiny, tmp_path, monkeypatch):  # noqa: F811
    """`use_liger_kernel=True` on both trainers (TRL sets the Liger config, `Trainer.train` applies the layer kernels
    when training starts: done here the same way): TreeGRPOTrainer's loss and gradients equal TRL's flat ones on CUDA
    (fp32 weights, the CUDA tolerance of tests/test_grpo_trainer.py)."""
    pytest.importorskip("liger_kernel")
    from test_grpo_trainer import TOLERANCE_CUDA, _assert_same, _inputs, _loss_and_grads, _pair
    from transformers.integrations.liger import apply_liger_kernel
    from transformers.models.qwen3 import modeling_qwen3

    monkeypatch.setattr(modeling_qwen3, "apply_rotary_pos_emb", modeling_qwen3.apply_rotary_pos_emb)
    tree, flat = _pair(tiny, tmp_path, use_cpu=False, use_liger_kernel=True, beta=0.04, num_iterations=2)
    for trainer in (tree, flat):
        assert trainer.args.liger_kernel_config["fused_linear_cross_entropy"] is False
        apply_liger_kernel(trainer.model, trainer.args.liger_kernel_config)  # as `Trainer.train` does
    assert modeling_qwen3.apply_rotary_pos_emb.__module__.startswith("liger_kernel")
    inputs = _inputs(tree, flat, tiny[1], beta=0.04, num_iterations=2, device="cuda")
    _assert_same(_loss_and_grads(tree, inputs), _loss_and_grads(flat, inputs), TOLERANCE_CUDA[torch.float32])
    assert tree._metrics["train"]["tree_fallback"] == [0.0]
