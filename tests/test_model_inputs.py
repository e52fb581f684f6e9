"""Inputs that do not fit the model are refused before the forward, and PEFT's trainable-token head is exact."""

import copy

import pytest
import torch
from helpers import TOLERANCES, VOCAB, flat_logprobs, forest_case, twin_models
from transformers import AutoModelForCausalLM, Qwen3Config

from hf_tree_attn import forest_logprobs, pack_forest, sequence_logprobs


@pytest.mark.parametrize("temperature", [0, 0.0, -1.0, float("nan"), float("inf"), "1.0"])
def test_temperature_must_be_a_positive_number(temperature):
    tree, _ = twin_models("llama")
    with pytest.raises(ValueError, match=r"temperature=.*must be a finite number > 0"):
        sequence_logprobs(tree, [[5, 6, 7]], temperature=temperature)


def test_token_id_beyond_the_vocabulary_names_it_and_the_fix():
    tree, _ = twin_models("llama")
    with pytest.raises(ValueError, match=rf"Token id {VOCAB} is out of range.*{VOCAB} rows.*resize_token_embeddings"):
        sequence_logprobs(tree, [[5, 6, 7], [5, VOCAB]])
    assert len(sequence_logprobs(tree, [[5, VOCAB - 1]])[0]) == 1  # the last valid id still scores


def test_forest_on_another_device_than_the_model():
    """The CPU stand-in for "forest on CPU, model on CUDA": a model on the meta device."""
    tree, _ = twin_models("llama")
    (forest,) = pack_forest([[5, 6, 7], [5, 6, 8]])
    with pytest.raises(
        ValueError, match=r"forest is on cpu but the model's embeddings are on meta.*forest\.to\('meta'\)"
    ):
        forest_logprobs(tree.to("meta"), forest)


def _tied_model(seed=0):
    cfg = Qwen3Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, vocab_size=VOCAB, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="tree_flex").eval()


def test_peft_trainable_tokens_on_a_tied_head_are_exact():
    """`trainable_token_indices` with tied embeddings wraps the LM head too; the tree reads its merged weight."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_tied_model(), LoraConfig(target_modules=["q_proj"], trainable_token_indices=[5, 9]))
    head = model.get_output_embeddings()
    assert type(head).__name__ == "TrainableTokensWrapper"
    with torch.no_grad():  # trained rows that differ from the original ones
        for delta in head.token_adapter.trainable_tokens_delta.values():
            delta.add_(0.1 * torch.randn_like(delta))  # the scale of trained rows, not of random ones
    sequences = forest_case("grpo", seed=0) + [[5, 9, 5, 9], [5, 9, 7]]

    logps = sequence_logprobs(model, sequences)
    for i, seq in enumerate(sequences):  # the PEFT model's own forward is the oracle
        torch.testing.assert_close(logps[i], flat_logprobs(model, seq)[0], atol=TOLERANCES["logps_atol"], rtol=0)
    sum(lp.sum() for lp in logps).backward()
    assert all(
        d.grad is not None and d.grad.abs().max() > 0 for d in head.token_adapter.trainable_tokens_delta.values()
    )

    with model.disable_adapter(), torch.no_grad():  # TRL's reference forward: the original rows
        reference = sequence_logprobs(model, sequences)
        for i, seq in enumerate(sequences):
            torch.testing.assert_close(
                reference[i], flat_logprobs(model, seq)[0], atol=TOLERANCES["logps_atol"], rtol=0
            )
    assert not torch.allclose(torch.cat(reference), torch.cat(logps).detach(), atol=1e-3)
