"""The FlexAttention path on CUDA against the dense path and the per-sequence flat forward (run on an H200).

Every layer-mask kind runs here on its real GPU path: full (Qwen3, Llama), sliding windows (Mistral; Gemma2 and
Gemma3 mixing windowed and full layers), chunks with NoPE temperature tuning (Llama 4), and attention sinks folded
in through FlexAttention's log-sum-exp (GPT-OSS: sinks + windows + MoE) — windows and chunks of 64 tokens, far
shorter than the 100-500-token sequences, in fp32 and bf16, forward and backward.

`pytest -m gpu tests/test_gpu.py` — skipped without CUDA (CI).
"""

import copy
import functools
import importlib.util
import random

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GptOssConfig,
    Llama4TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen3Config,
)

import hf_tree_attn
from hf_tree_attn import PackedForest
from hf_tree_attn.logprobs import forest_logprobs, gather_sequences
from hf_tree_attn.masks import TreeMaskSource

pytestmark = pytest.mark.gpu

CONFIGS = {
    "qwen3": Qwen3Config(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=256,
    ),
    "llama": LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, vocab_size=256,
    ),
    "gemma2": Gemma2Config(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=256, sliding_window=64,
    ),
    "mistral": MistralConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=256, sliding_window=64,
    ),
    "gemma3": Gemma3TextConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, vocab_size=256, sliding_window=64, query_pre_attn_scalar=32,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "llama4": Llama4TextConfig(
        hidden_size=128, intermediate_size=256, intermediate_size_mlp=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=256, attention_chunk_size=64,
        layer_types=["chunked_attention", "full_attention"], no_rope_layers=[1, 0], attn_temperature_tuning=True,
        floor_scale=32, num_local_experts=1, interleave_moe_layer_step=2,
    ),
    # All experts active: bf16 noise cannot flip a top-k routing decision between the tree and the flat forward.
    "gpt_oss": GptOssConfig(
        hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=256, sliding_window=64, num_local_experts=2,
        num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"],
    ),
}  # fmt: skip

# dtype -> (atol on per-token logprobs vs the fp32 flat forward, min grad cosine)
TOLERANCES = {
    torch.float32: (2e-4, 0.99999),  # flex fp32 on H100/H200 runs its dots in tf32-like precision
    torch.bfloat16: (6e-2, 0.995),
}


def _forest_sequences(seed: int, groups: int = 3, group_size: int = 5) -> list[list[int]]:
    """GRPO-like groups crossing 128-token blocks, plus duplicates, a prefix-of-another and 1-token sequences."""
    rng = random.Random(seed)
    seqs = []
    for _ in range(groups):
        prompt = [rng.randrange(1, 256) for _ in range(rng.randrange(100, 300))]
        for _ in range(group_size):
            seqs.append(prompt + [rng.randrange(1, 256) for _ in range(rng.randrange(1, 200))])
        seqs.append(list(seqs[-1]))  # identical
        seqs.append(prompt[: rng.randrange(1, len(prompt))])  # a prefix of the others
    seqs += [[7], [9]]
    return seqs


def _models(name: str, dtype: torch.dtype):
    torch.manual_seed(0)
    tree = AutoModelForCausalLM.from_config(copy.deepcopy(CONFIGS[name]), attn_implementation="tree_flex")
    flat = AutoModelForCausalLM.from_config(copy.deepcopy(CONFIGS[name]), attn_implementation="eager")
    flat.load_state_dict(tree.state_dict())
    return tree.to("cuda", dtype), flat.to("cuda", torch.float32)


def _flat_logprobs(model, seqs):
    out = []
    for s in seqs:
        ids = torch.tensor([s], device="cuda")
        logits = model(ids).logits[0].float().log_softmax(-1)
        out.append(logits[:-1].gather(1, ids[0, 1:, None])[:, 0])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_flex_tree_matches_flat_forward_and_backward(name, dtype):
    atol, min_cos = TOLERANCES[dtype]
    tree_model, flat_model = _models(name, dtype)
    seqs = _forest_sequences(seed=1)
    weights = [torch.randn(max(len(s) - 1, 0), device="cuda") for s in seqs]

    tree_lp = hf_tree_attn.sequence_logprobs(tree_model, seqs, max_tokens_per_mb=1024)
    flat_lp = _flat_logprobs(flat_model, seqs)
    for t, f in zip(tree_lp, flat_lp):
        torch.testing.assert_close(t, f, atol=atol, rtol=0)

    sum(((t * w).sum() for t, w in zip(tree_lp, weights))).backward()
    sum(((f * w).sum() for f, w in zip(flat_lp, weights))).backward()
    flat_params = dict(flat_model.named_parameters())
    for pname, p in tree_model.named_parameters():
        if flat_params[pname].grad is None:  # a parameter no forward uses (e.g. an idle router)
            assert p.grad is None or not p.grad.any(), pname
            continue
        g, ref = p.grad.float().flatten(), flat_params[pname].grad.flatten()
        if not ref.any():
            continue
        cos = torch.nn.functional.cosine_similarity(g, ref, dim=0).item()
        assert cos >= min_cos, f"{pname}: grad cosine {cos}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_flex_equals_dense_mask_path_on_gpu(name, monkeypatch):
    """Same forest, same GPU, per-layer BlockMasks + FlexAttention vs dense bool masks + SDPA/eager, fp32."""
    tree_model, _ = _models(name, torch.float32)
    forest = hf_tree_attn.pack_forest(_forest_sequences(seed=2))[0].to("cuda")
    flex_table, flex_ent = forest_logprobs(tree_model, forest, return_entropy=True)

    attention_mask = PackedForest.attention_mask
    monkeypatch.setattr(PackedForest, "attention_mask", lambda self, device=None: attention_mask(self, device, True))
    dense_table, dense_ent = forest_logprobs(tree_model, forest, return_entropy=True)
    torch.testing.assert_close(flex_table, dense_table, atol=2e-4, rtol=0)
    torch.testing.assert_close(flex_ent, dense_ent, atol=2e-4, rtol=0)
    assert len(gather_sequences(forest, flex_table)) == len(forest.seq_ids)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_mask_equals_dense_mask_token_level(seed):
    forest = hf_tree_attn.pack_forest(_forest_sequences(seed, groups=6, group_size=8))[0].to("cuda")
    bm = forest.block_mask("cuda")
    dense = forest.dense_mask("cuda")
    seq_len = forest.seq_len
    assert torch.equal(create_mask(bm.mask_mod, 1, 1, seq_len, seq_len, device="cuda"), dense)

    # Block structure: a block is listed iff it holds an allowed pair; "full" blocks hold only allowed pairs.
    blocks = seq_len // 128
    per_block = dense[0, 0].reshape(blocks, 128, blocks, 128)
    any_allowed, all_allowed = per_block.any(dim=(1, 3)), per_block.all(dim=(1, 3))
    listed = torch.zeros(blocks, blocks, dtype=torch.bool, device="cuda")
    full = torch.zeros_like(listed)
    for q in range(blocks):
        n = bm.kv_num_blocks[0, 0, q]
        listed[q, bm.kv_indices[0, 0, q, :n]] = True
        nf = bm.full_kv_num_blocks[0, 0, q]
        full[q, bm.full_kv_indices[0, 0, q, :nf]] = True
    assert torch.equal(listed | full, any_allowed)
    assert torch.equal(full, all_allowed)


@pytest.mark.parametrize("kind", ["window", "chunk"])
def test_layer_block_masks_equal_dense_token_level(kind):
    """The per-layer-kind BlockMask (window / chunk of 64 depths) holds exactly the dense mask's pairs, and skips
    blocks the plain tree mask computes."""
    from transformers.masking_utils import chunked_causal_mask_function, sliding_window_causal_mask_function

    forest = hf_tree_attn.pack_forest(_forest_sequences(3, groups=6, group_size=8))[0].to("cuda")
    flat_mask = (
        sliding_window_causal_mask_function(64)
        if kind == "window"
        else chunked_causal_mask_function(64, torch.zeros(1, dtype=torch.long, device="cuda"))
    )
    args = (forest.subtree_end, forest.position_ids[0], forest.seq_offsets.diff().cpu(), {})
    block = TreeMaskSource(*args, dense=False).mask(flat_mask)
    dense = TreeMaskSource(*args, dense=True).mask(flat_mask)
    seq_len = forest.seq_len
    assert torch.equal(create_mask(block.mask_mod, 1, 1, seq_len, seq_len, device="cuda"), dense)
    assert block.sparsity() > forest.block_mask("cuda").sparsity()


def _flash_attention_4_installed() -> bool:
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(not _flash_attention_4_installed(), reason="FlashAttention-4 (flash_attn.cute) not installed")
@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_flash_backend_matches_flat_forward_and_backward(name, monkeypatch):
    """`HF_TREE_ATTN_FLEX_KERNEL_OPTIONS={"BACKEND": "FLASH"}`: FlexAttention on FlashAttention-4's kernels behind
    the same block masks, bf16, against the float32 per-sequence flat forward within the bf16 bounds."""
    config = copy.deepcopy(CONFIGS[name])
    config.head_dim, config.hidden_size = 64, 256  # FlashAttention-4's head sizes
    monkeypatch.setitem(CONFIGS, name, config)
    monkeypatch.setattr(hf_tree_attn.attention, "FLEX_KERNEL_OPTIONS", {"BACKEND": "FLASH"})
    options = []
    flex = hf_tree_attn.attention._flex_attention
    monkeypatch.setattr(
        hf_tree_attn.attention, "_flex_attention", lambda *a, **k: options.append(k["kernel_options"]) or flex(*a, **k)
    )
    torch._dynamo.reset()
    try:
        test_flex_tree_matches_flat_forward_and_backward(name, torch.bfloat16)
    finally:
        torch._dynamo.reset()
    assert options and all(o == {"BACKEND": "FLASH"} for o in options), options


@pytest.mark.parametrize(
    "backend",
    [
        "TRITON",
        pytest.param(
            "FLASH",
            marks=pytest.mark.skipif(
                not _flash_attention_4_installed(), reason="FlashAttention-4 (flash_attn.cute) not installed"
            ),
        ),
    ],
)
def test_compiled_checkpointed_layers_match_flat_forward(backend, monkeypatch):
    """The trainers' CUDA path: decoder layers compiled in place with dynamic shapes (`compile_decoder_layers`) under
    non-reentrant activation checkpointing, FlexAttention on its Triton kernels or on FlashAttention-4's (the FLASH
    backend, its masks in buffers of static size), bf16: two forests of different lengths through one model give the
    float32 flat forward's log-probs and gradients within the bf16 bounds, and the layers stay compiled on the backend
    asked for (a compiler failure would have turned the FLASH backend off, or put the layers back to eager, with a
    warning)."""
    from hf_tree_attn.compile import call_compiled, compile_decoder_layers, compiled_layers

    if backend == "FLASH":
        config = copy.deepcopy(CONFIGS["qwen3"])
        config.head_dim, config.hidden_size = 64, 256  # FlashAttention-4's head sizes
        monkeypatch.setitem(CONFIGS, "qwen3", config)
        monkeypatch.setattr(hf_tree_attn.attention, "FLEX_KERNEL_OPTIONS", {"BACKEND": "FLASH"})
    layers = CONFIGS["qwen3"].num_hidden_layers
    atol, min_cos = TOLERANCES[torch.bfloat16]
    torch._dynamo.reset()
    try:
        tree_model, flat_model = _models("qwen3", torch.bfloat16)
        tree_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        tree_model.train()
        assert compile_decoder_layers(tree_model, backend="inductor", dynamic=True) == layers
        for seed in (1, 2):
            tree_model.zero_grad(set_to_none=True)
            flat_model.zero_grad(set_to_none=True)
            seqs = _forest_sequences(seed=seed, groups=2 + seed)
            weights = [torch.randn(max(len(s) - 1, 0), device="cuda") for s in seqs]
            forward = functools.partial(hf_tree_attn.sequence_logprobs, tree_model, seqs, max_tokens_per_mb=2048)
            tree_lp = call_compiled(tree_model, forward)
            flat_lp = _flat_logprobs(flat_model, seqs)
            for t, f in zip(tree_lp, flat_lp):
                torch.testing.assert_close(t.float(), f, atol=atol, rtol=0)
            sum(((t * w).sum() for t, w in zip(tree_lp, weights))).backward()
            sum(((f * w).sum() for f, w in zip(flat_lp, weights))).backward()
            assert len(compiled_layers(tree_model)) == layers, "the layers fell back to eager"
            if backend == "FLASH":
                assert hf_tree_attn.attention.FLEX_KERNEL_OPTIONS == {"BACKEND": "FLASH"}, "FLASH was turned off"
            flat_params = dict(flat_model.named_parameters())
            for pname, p in tree_model.named_parameters():
                g, ref = p.grad.float().flatten(), flat_params[pname].grad.flatten()
                cos = torch.nn.functional.cosine_similarity(g, ref, dim=0).item()
                assert cos >= min_cos, f"forest {seed}, {pname}: grad cosine {cos}"
    finally:
        torch._dynamo.reset()
