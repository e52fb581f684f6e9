"""TreeGRPOTrainer with a PEFT LoRA adapter: only adapters move; the reference is the base model, on the tree path."""

import pytest
import torch
from helpers import token_reward
from peft import LoraConfig
from peft.tuners.lora import LoraLayer
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import use_adapter

from hf_tree_attn.trainer import TreeGRPOConfig, TreeGRPOTrainer
from trainers import toy_task


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tokenizer = toy_task.build_tokenizer()
    path = tmp_path_factory.mktemp("tiny_qwen3")
    toy_task.build_model(tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), tokenizer


def _args(cls, tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / cls.__name__),
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=4,
        report_to="none",
        save_strategy="no",
        model_init_kwargs={"dtype": torch.float32},
    )
    kwargs.update(overrides)
    return cls(**kwargs)


def test_lora_moves_only_adapters_and_the_reference_is_the_base_model(tiny, tmp_path):
    path, tokenizer = tiny
    args = _args(TreeGRPOConfig, tmp_path, beta=0.04, max_steps=3, learning_rate=5e-2, logging_steps=1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    dataset = toy_task.build_dataset(32)
    trainer = TreeGRPOTrainer(
        path, token_reward, args, train_dataset=dataset, processing_class=tokenizer, peft_config=lora
    )
    assert trainer.ref_model is None  # TRL disables the adapters for the reference forward
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}

    adapters_disabled = []  # per tree forward: were the adapters off (the reference forward)?
    tree_logps = trainer._tree_logps

    def spy(model, *a, **kw):
        lora_layers = [m for m in trainer.model.modules() if isinstance(m, LoraLayer)]
        adapters_disabled.append(all(layer.disable_adapters for layer in lora_layers))
        return tree_logps(model, *a, **kw)

    trainer._tree_logps = spy
    trainer.train()

    after = dict(trainer.model.named_parameters())
    base = [name for name in before if "lora_" not in name]
    adapters = [name for name in before if "lora_" in name]
    assert base and adapters
    for name in base:
        assert torch.equal(before[name], after[name]), f"base weight {name} changed"
    assert all(not after[name].requires_grad for name in base)
    assert any(not torch.equal(before[name], after[name]) for name in adapters)
    # Each step: one reference forward (adapters off) and one policy forward (on), both on the packed tree.
    assert adapters_disabled.count(True) == 3 and adapters_disabled.count(False) == 3
    logs = [entry for entry in trainer.state.log_history if "tree_fallback" in entry]
    assert len(logs) == 3 and all(entry["tree_fallback"] == 0 and "kl" in entry for entry in logs)

    # Adapters off through the tree == the untouched base model through TRL's flat forward.
    flat = GRPOTrainer(
        path, toy_task.copy_letter_reward, _args(GRPOConfig, tmp_path), train_dataset=dataset,
        processing_class=tokenizer,
    )  # fmt: skip
    prompt = tokenizer([dataset[0]["prompt"]] * 2)["input_ids"]
    ids = torch.tensor([prompt[0] + tokenizer("aab")["input_ids"], prompt[1] + tokenizer("ab")["input_ids"] + [0]])
    mask = (torch.arange(ids.shape[1]) < torch.tensor([[ids.shape[1]], [ids.shape[1] - 1]])).long()
    with torch.no_grad(), use_adapter(trainer.model, adapter_name=None):
        ref_tree, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 3)
    with torch.no_grad():
        ref_flat, _, _ = flat._get_per_token_logps_and_entropies(flat.model, ids, mask, 3)
        policy_tree, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 3)
    torch.testing.assert_close(ref_tree, ref_flat, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(policy_tree, ref_flat, atol=1e-4)  # the adapter did change the policy


@pytest.mark.parametrize("model_type", ["mllama", "llama4_text", "qwen3"])
def test_trees_through_a_peft_model(model_type):
    """The tree finds the backbone behind a `PeftModel` too: Mllama's and Llama 4's `get_decoder()` is the causal LM
    itself, and through PEFT the tree found no backbone and refused mid-run. Log-probs (adapters initialised
    non-zero, so they count) equal the PEFT model's own per-sequence forward."""
    from helpers import TOLERANCES
    from peft import get_peft_model
    from test_coverage import tiny_config
    from transformers import AutoModelForCausalLM

    import hf_tree_attn

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config(model_type), attn_implementation="tree_flex").eval()
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    sequences = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 11], [5, 12]]
    with torch.no_grad():
        for seq, logps in zip(sequences, hf_tree_attn.sequence_logprobs(model, sequences)):
            logits = model(input_ids=torch.tensor([seq])).logits[0, :-1].float()
            expected = logits.log_softmax(-1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
            torch.testing.assert_close(logps, expected, atol=TOLERANCES["logps_atol"], rtol=0)


@pytest.mark.parametrize(
    "adapter",
    ["PromptTuningConfig", "PrefixTuningConfig", "PromptEncoderConfig", "AdaptionPromptConfig", "LoraConfig"],
)
def test_the_gate_refuses_prompt_learning_adapters(adapter):
    """Prompt learning puts virtual tokens (or past key values) in front of each row inside `PeftModel.forward`;
    on a packed tree the first sequence alone would see them, and the tree forward crashed on the missing mask.
    The gate names the adapter and the way out; LoRA stays accepted."""
    import peft
    from peft import get_peft_model
    from test_coverage import tiny_config
    from transformers import AutoModelForCausalLM

    from hf_tree_attn.support import tree_support_error

    base = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="tree_flex")
    config = {
        "LoraConfig": dict(r=4, target_modules=["q_proj", "v_proj"]),
        "AdaptionPromptConfig": dict(adapter_len=2, adapter_layers=1),
    }.get(adapter, dict(num_virtual_tokens=3))
    model = get_peft_model(base, getattr(peft, adapter)(task_type="CAUSAL_LM", **config))
    reason = tree_support_error(model)
    if adapter == "LoraConfig":
        assert reason is None
    else:
        assert model.active_peft_config.peft_type.value in reason
        assert "tree_packing=False" in reason and "LoraConfig" in reason


def test_prompt_tuning_trains_on_trls_flat_path(tiny, tmp_path):
    """`peft_config=PromptTuningConfig(...)`: under `tree_packing="auto"` one warning with the reason and TRL's flat
    path (tree_fallback=1), the virtual tokens trained; under `tree_packing=True` an error at init."""
    from peft import PromptTuningConfig

    path, tokenizer = tiny
    dataset = toy_task.build_dataset(16)
    prompt_tuning = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    args = _args(TreeGRPOConfig, tmp_path, max_steps=2, learning_rate=5e-2, logging_steps=1)
    with pytest.warns(UserWarning, match="PROMPT_TUNING.*Training on TRL's flat path"):
        trainer = TreeGRPOTrainer(
            path, token_reward, args, train_dataset=dataset, processing_class=tokenizer, peft_config=prompt_tuning
        )
    assert not trainer.tree_packing
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert before and all("prompt_encoder" in n for n in before)
    trainer.train()
    assert all(entry["tree_fallback"] == 1 for entry in trainer.state.log_history if "tree_fallback" in entry)
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before)
    strict = _args(TreeGRPOConfig, tmp_path, tree_packing=True)
    with pytest.raises(ValueError, match="tree_packing=True, but .*PROMPT_TUNING"):
        TreeGRPOTrainer(path, token_reward, strict, train_dataset=dataset, processing_class=tokenizer,
                        peft_config=prompt_tuning)  # fmt: skip


@pytest.mark.parametrize("model_type, expected", [("gemma2", "eager"), ("qwen3", "sdpa")])
def test_fallback_restores_the_implementation_tree_flex_stood_in_for(model_type, expected):
    """A model that falls back to TRL's path after it was put on `tree_flex` (here: a prompt-tuning adapter) goes
    back to the implementation `tree_flex` computes outside a tree: `eager` for Gemma 2's attention softcap, which
    SDPA would drop, `sdpa` otherwise."""
    from peft import PromptTuningConfig, get_peft_model
    from test_coverage import tiny_config
    from transformers import AutoModelForCausalLM

    from hf_tree_attn.support import tree_support_error
    from hf_tree_attn.trainer.core import restore_stock_attention

    base = AutoModelForCausalLM.from_config(tiny_config(model_type), attn_implementation="tree_flex")
    model = get_peft_model(base, PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    reason = tree_support_error(model)
    restore_stock_attention([model, None], reason)
    assert base.config._attn_implementation == expected
