"""`attn_implementation="tree_flex"`: registration, sdpa/eager equivalence without a tree, and its guard rails."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from helpers import TOLERANCES, flat_logprobs, forest_case, tiny_config, tiny_model, twin_models
from transformers import AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM

import hf_tree_attn
import hf_tree_attn.attention
from hf_tree_attn import check_tree_model, pack_forest, sequence_logprobs

ATOL = TOLERANCES["sdpa_atol"]


def test_registered_in_both_interfaces():
    assert "tree_flex" in AttentionInterface().valid_keys()
    assert "tree_flex" in AttentionMaskInterface().valid_keys()
    assert AttentionInterface._global_mapping["tree_flex"] is hf_tree_attn.attention.tree_flex_attention
    assert AttentionMaskInterface._global_mapping["tree_flex"] is hf_tree_attn.attention.tree_flex_mask


def test_import_twice_is_idempotent():
    keys = (set(AttentionInterface().valid_keys()), set(AttentionMaskInterface().valid_keys()))
    importlib.reload(hf_tree_attn)
    hf_tree_attn.register()
    assert (set(AttentionInterface().valid_keys()), set(AttentionMaskInterface().valid_keys())) == keys
    assert AttentionInterface._global_mapping["tree_flex"] is hf_tree_attn.attention.tree_flex_attention
    assert AttentionMaskInterface._global_mapping["tree_flex"] is hf_tree_attn.attention.tree_flex_mask


def test_from_config_with_tree_flex():
    cfg = tiny_config("llama")
    model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="tree_flex")
    assert model.config._attn_implementation == "tree_flex"
    assert cfg._attn_implementation != "tree_flex", "the deep copy keeps the caller's config untouched"
    check_tree_model(model)
    with pytest.raises(ValueError, match=r"attn_implementation='sdpa'.*needs 'tree_flex'"):
        check_tree_model(AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa"))


# ----------------------------------------------------------------------------------------------------------------
# No tree: tree_flex must behave exactly like the stock implementation.


def _left_padded_batch(seed: int = 0):
    """`(input_ids, attention_mask)` `(3, 9)`: rows of 9, 5 and 2 real tokens, left-padded with 0."""
    g = torch.Generator().manual_seed(seed)
    lengths = [9, 5, 2]
    ids = torch.zeros(3, 9, dtype=torch.long)
    mask = torch.zeros(3, 9, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, 9 - n :] = torch.randint(3, 128, (n,), generator=g)
        mask[row, 9 - n :] = 1
    return ids, mask


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma", "gemma2"])
def test_padded_forward_equals_stock(family):
    tree, ref = twin_models(family)  # sdpa, or eager for Gemma2 (softcap: no sdpa)
    ids, mask = _left_padded_batch()
    with torch.no_grad():
        got = tree(input_ids=ids, attention_mask=mask).logits
        want = ref(input_ids=ids, attention_mask=mask).logits
        unpadded = ref(input_ids=ids[1:2, 4:]).logits  # row 1 alone, without padding
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=ATOL, rtol=0)
    # The padding mask really is applied (a forward that attended to padding would differ here).
    torch.testing.assert_close(got[1, 4:], unpadded[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_greedy_generate_with_left_padding_equals_stock(family):
    tree, ref = twin_models(family)
    ids, mask = _left_padded_batch(seed=1)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    got = tree.generate(ids, **kwargs)
    want = ref.generate(ids, **kwargs)
    assert torch.equal(got, want)
    # Left padding must not change a row's continuation.
    alone = ref.generate(ids[2:3, 7:], max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(got[2, 9:], alone[0, 2:])


def test_plain_forward_without_mask_equals_stock():
    tree, ref = twin_models("qwen3")
    ids = torch.randint(1, 128, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(tree(ids).logits, ref(ids).logits, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------------------------------------------
# Guard rails.


def test_dropout_raises_in_train_mode():
    model = tiny_model("llama", attention_dropout=0.1)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        model(ids)  # eval mode: the model passes dropout=0
    model.train()
    with pytest.raises(
        ValueError, match=r"does not support attention dropout \(got dropout=0\.1\).*attention_dropout=0\.0"
    ):
        model(ids)


@pytest.fixture(scope="module")
def tree_inputs():
    """A packed forest of mixed edge cases and its compiled CPU `BlockMask` (built once: compiling takes seconds)."""
    sequences = forest_case("mixed", 0)
    (forest,) = pack_forest(sequences)
    return sequences, forest, forest.block_mask("cpu")


def _forest_kwargs(forest, mask):
    return dict(
        input_ids=forest.input_ids,
        position_ids=forest.position_ids,
        attention_mask=mask,
        tree_forest=forest,
        use_cache=False,
    )


def test_block_mask_on_cpu_with_grad_raises(tree_inputs):
    _, forest, block_mask = tree_inputs
    model = tiny_model("llama").train()
    with pytest.raises(RuntimeError, match=r"no backward on CPU.*attention_mask=forest\.dense_mask\(\)"):
        model(**_forest_kwargs(forest, block_mask))


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # GQA via enable_gqa; softcap as a score_mod
def test_block_mask_no_grad_forward_equals_dense(tree_inputs, family, monkeypatch):
    """Compiled FlexAttention on CPU (inference only) gives the dense-mask SDPA / eager result."""
    _, forest, block_mask = tree_inputs
    model = tiny_model(family)
    calls = []
    flex = hf_tree_attn.attention._flex_attention
    monkeypatch.setattr(hf_tree_attn.attention, "_flex_attention", lambda *a, **k: calls.append(1) or flex(*a, **k))
    with torch.no_grad():
        got = model(**_forest_kwargs(forest, block_mask)).logits
        assert len(calls) == model.config.num_hidden_layers, "the BlockMask must take the FlexAttention path"
        want = model(**_forest_kwargs(forest, forest.dense_mask())).logits
    n = forest.num_tree_tokens
    torch.testing.assert_close(got[0, :n], want[0, :n], atol=TOLERANCES["logps_atol"], rtol=0)


def test_block_mask_with_sliding_window_needs_tree_depth(tree_inputs):
    _, forest, block_mask = tree_inputs
    model = tiny_model("gemma2")
    kwargs = _forest_kwargs(forest, block_mask)
    del kwargs["tree_forest"]
    with torch.no_grad(), pytest.raises(ValueError, match=r"sliding_window=256, but the tree depth is unknown"):
        model(**kwargs)


def _deep_sequences(length: int) -> list[list[int]]:
    """Two branches of a `length`-token sequence (max depth `length - 1`) and a short one."""
    g = torch.Generator().manual_seed(5)
    base = torch.randint(1, 128, (length,), generator=g).tolist()
    return [base, base[: length // 2] + [7, 8, 9], base[:-1] + [(base[-1] % 127) + 1], [3, 4]]


def test_sliding_window_shorter_than_tree_raises():
    sequences = _deep_sequences(12)
    model = tiny_model("gemma2", sliding_window=11)
    with pytest.raises(ValueError, match=r"sliding_window=11, but the packed tree holds a sequence 12 tokens long"):
        sequence_logprobs(model, sequences)


def test_sliding_window_as_long_as_tree_is_exact():
    sequences = _deep_sequences(12)  # depth 11 < window 12: the window cuts nothing
    tree, ref = twin_models("gemma2", sliding_window=12)
    with torch.no_grad():
        got = sequence_logprobs(tree, sequences)
        for seq, logps in zip(sequences, got):
            torch.testing.assert_close(logps, flat_logprobs(ref, seq)[0], atol=TOLERANCES["logps_atol"], rtol=0)


def test_attention_sinks_raise():
    """GPT-OSS passes `s_aux` (attention sinks); SDPA ignores it, so tree_flex must refuse rather than drop it."""
    from transformers import GptOssConfig

    cfg = GptOssConfig(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        num_local_experts=2,
        num_experts_per_tok=1,
        layer_types=["sliding_attention", "full_attention"],
    )
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="tree_flex").eval()
    with torch.no_grad(), pytest.raises(NotImplementedError, match=r"attention sinks \(`s_aux`, e\.g\. GPT-OSS\)"):
        model(torch.tensor([[5, 6, 7]]))


# ----------------------------------------------------------------------------------------------------------------
# check_tree_model


# Hybrids whose state-carrying layers are implemented (Qwen3-Next, LFM2, ...) are tested in test_recurrent.py.
_HYBRIDS = {
    "jamba-mamba": (
        "JambaConfig",
        dict(attn_layer_period=2, attn_layer_offset=1, num_experts=1),
        r"JambaMambaMixer: a Mamba-1 selective scan",
    ),
}


@pytest.mark.parametrize("name", list(_HYBRIDS))
def test_unsupported_layer_types_raise(name):
    import transformers

    config_name, kwargs, reason = _HYBRIDS[name]
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128)
    cfg = getattr(transformers, config_name)(**common, num_key_value_heads=2, **kwargs)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="tree_flex")
    with pytest.raises(NotImplementedError, match=rf"state-carrying layers a tree cannot run exactly \({reason}"):
        check_tree_model(model)


@pytest.mark.parametrize(
    "config_name, field, value",
    [("GraniteConfig", "logits_scaling", 8.0), ("CohereConfig", "logit_scale", 0.0625)],
    ids=["granite-logits_scaling", "cohere-logit_scale"],
)
def test_scaled_logits_raise(config_name, field, value):
    """The tree LM head reads `lm_head.weight` directly: a model-level logit scale would be silently skipped."""
    import transformers

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128)
    cfg = getattr(transformers, config_name)(**common, num_key_value_heads=2, **{field: value})
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="tree_flex")
    with pytest.raises(NotImplementedError, match=rf"scales its logits \({field}={value}\)"):
        check_tree_model(model)
    setattr(model.config, field, 1.0)
    check_tree_model(model)


def test_lora_on_lm_head_raises():
    peft = pytest.importorskip("peft")
    model = tiny_model("llama")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(NotImplementedError, match=r"not a plain nn\.Linear \(a LoRA on `lm_head`\?\).*target_modules"):
        check_tree_model(lora)
    ok = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    check_tree_model(ok)
