"""The LM head on parent rows: TRL's fused chunked kernel and the plain-torch chunks agree (values and grads)."""

import copy
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM, CohereConfig, Gemma2Config, GraniteConfig, Qwen3Config

from hf_tree_attn.logprobs import _fused_lm_head, lm_head_logprobs
from hf_tree_attn.support import logit_scale

pytest.importorskip("trl")

CONFIGS = {
    "qwen3": Qwen3Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, vocab_size=97,
    ),
    "gemma2_final_softcap": Gemma2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, vocab_size=97, final_logit_softcapping=3.0,
    ),
    "cohere_logit_scale": CohereConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=97, logit_scale=0.25,
    ),
    "granite_logits_scaling": GraniteConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=97, logits_scaling=4.0,
    ),
}  # fmt: skip


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_and_torch_heads_agree(name, temperature):
    assert _fused_lm_head() is not None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(CONFIGS[name]), attn_implementation="tree_flex").float()
    hidden = torch.randn(11, 32, requires_grad=True)
    sources = torch.tensor([0, 0, 0, 3, 4, 4, 7, 10, 2])  # row 0 branches three ways, row 4 two ways
    targets = torch.randint(0, 97, (9,))
    grads_out = torch.randn(9), torch.randn(9)

    results = []
    for chunk_rows in (None, 2):  # None: TRL's fused kernel; 2: torch chunks of two parent rows
        hidden.grad = None
        model.zero_grad()
        logps, entropy = lm_head_logprobs(
            model, hidden, sources, targets, temperature=temperature, return_entropy=True, chunk_rows=chunk_rows
        )
        ((logps * grads_out[0]).sum() + (entropy * grads_out[1]).sum()).backward()
        results.append((logps, entropy, hidden.grad.clone(), model.get_output_embeddings().weight.grad.clone()))

    for fused, plain in zip(*results):
        torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)

    # Oracle: full logits, log_softmax, gather.
    logits = model.get_output_embeddings()(hidden.detach()).float() * logit_scale(model.config)
    if name == "gemma2_final_softcap":
        logits = 3.0 * torch.tanh(logits / 3.0)
    ref = (logits / temperature).log_softmax(-1)
    torch.testing.assert_close(results[0][0], ref[sources, targets], atol=1e-5, rtol=1e-5)


def test_peft_modules_to_save_lm_head_is_exact_and_lora_on_lm_head_raises():
    from peft import LoraConfig, get_peft_model

    import hf_tree_attn

    torch.manual_seed(0)
    config = CONFIGS["qwen3"]
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="tree_flex").float()
    peft_model = get_peft_model(model, LoraConfig(target_modules=["q_proj"], modules_to_save=["lm_head"]))
    with torch.no_grad():  # make the trained copy differ from the original head
        peft_model.get_output_embeddings().modules_to_save["default"].weight.mul_(1.5)
    seqs = [[1, 2, 3, 4], [1, 2, 5], [6, 7]]

    def flat(m):
        out = []
        for s in seqs:
            lp = m(input_ids=torch.tensor([s])).logits[0].float().log_softmax(-1)
            out.append(lp[:-1].gather(1, torch.tensor(s[1:])[:, None])[:, 0])
        return out

    for tree, ref in zip(hf_tree_attn.sequence_logprobs(peft_model, seqs), flat(peft_model)):
        torch.testing.assert_close(tree, ref, atol=1e-5, rtol=0)
    with peft_model.disable_adapter():  # TRL's reference forward: the original head
        for tree, ref in zip(hf_tree_attn.sequence_logprobs(peft_model, seqs), flat(peft_model)):
            torch.testing.assert_close(tree, ref, atol=1e-5, rtol=0)

    lora_head = get_peft_model(
        AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="tree_flex"),
        LoraConfig(target_modules=["q_proj", "lm_head"]),
    )
    with pytest.raises(NotImplementedError, match="modules_to_save"):
        hf_tree_attn.check_tree_model(lora_head)


def test_compiled_lm_head_is_accepted_and_exact():
    """`torch.compile` of the LM head (accelerate's `compile_regions` compiles it as a whole region): the tree LM head
    reads the same weight, so the model is accepted and gives the uncompiled model's log-probs."""
    import hf_tree_attn

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(CONFIGS["qwen3"]), attn_implementation="tree_flex").float()
    seqs = [[1, 2, 3, 4], [1, 2, 5], [6, 7]]
    expected = hf_tree_attn.sequence_logprobs(model, seqs)
    model.lm_head = torch.compile(model.lm_head)
    assert type(model.get_output_embeddings()).__name__ == "OptimizedModule"
    hf_tree_attn.check_tree_model(model)
    for got, ref in zip(hf_tree_attn.sequence_logprobs(model, seqs), expected):
        torch.testing.assert_close(got, ref, atol=0, rtol=0)


def test_the_fused_head_registers_its_pytree_nodes_before_the_first_model_call():
    """TRL's kernel imports `trl.trainer.utils` in its backward, a module whose `ModelOutput` subclass transformers
    registers as a pytree node. Dynamo guards compiled graphs on the number of pytree node types, so a registration
    there fails every compiled graph's guards once (each layer compiled again in the second step). A fresh
    interpreter: in this one the module is imported already."""
    script = textwrap.dedent(
        """
        import torch
        import torch.utils._pytree as pytree
        from transformers import AutoModelForCausalLM, Qwen3Config
        from hf_tree_attn import sequence_logprobs
        config = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=16, vocab_size=97)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="tree_flex")
        counts = []
        model.model.register_forward_pre_hook(lambda *_: counts.append(len(pytree.SUPPORTED_NODES)))
        torch.cat(sequence_logprobs(model, [[5, 6, 7, 8], [5, 6, 9]])).sum().backward()
        counts.append(len(pytree.SUPPORTED_NODES))
        import json, sys
        print(json.dumps({"counts": counts, "imported": "trl.trainer.utils" in sys.modules}))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    first_call, after_backward = result["counts"]
    assert result["imported"]  # the backward ran TRL's kernel (the module it imports is loaded)
    assert after_backward == first_call, "a pytree node was registered between the first model call and its backward"
