"""`attn_implementation="tree_flex"`: registration, sdpa/eager equivalence without a tree, and its guard rails."""

from __future__ import annotations

import copy
import importlib
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from helpers import TOLERANCES, flat_logprobs, forest_case, tiny_config, tiny_model, twin_models
from test_coverage import tiny_config as tiny_config_of
from transformers import AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM

import hf_tree_attn
import hf_tree_attn.attention
from hf_tree_attn import check_tree_model, pack_forest
from hf_tree_attn.logprobs import forest_forward_kwargs

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


def _foreign(*args, **kwargs):
    """Another package's function registered under "tree_flex"."""
    raise AssertionError("never called")


# The two registrations: transformers' interface, and the name of hf_tree_attn's function in it.
INTERFACES = {
    "attention": (AttentionInterface, "tree_flex_attention"),
    "mask": (AttentionMaskInterface, "tree_flex_mask"),
}


@pytest.mark.parametrize("kind", INTERFACES)
def test_a_foreign_tree_flex_is_not_replaced(kind, monkeypatch):
    interface, ours = INTERFACES[kind]
    monkeypatch.delenv(hf_tree_attn.attention.FORCE_REGISTER_ENV, raising=False)
    monkeypatch.setitem(interface._global_mapping, "tree_flex", _foreign)
    with pytest.raises(RuntimeError) as refused:
        hf_tree_attn.register()
    message = str(refused.value)
    assert (
        f"{interface.__name__} already holds 'tree_flex': test_attention._foreign, not hf_tree_attn's {ours}"
        in message
    )
    assert "Uninstall the package that registers it, or leave it unimported" in message
    assert "HF_TREE_ATTN_FORCE_REGISTER=1" in message and "hf_tree_attn.register(force=True)" in message
    for table, name in INTERFACES.values():  # refused whole: neither table was touched
        expected = _foreign if table is interface else getattr(hf_tree_attn.attention, name)
        assert table._global_mapping["tree_flex"] is expected


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_force_replaces_a_foreign_tree_flex(how, monkeypatch):
    monkeypatch.setitem(AttentionInterface._global_mapping, "tree_flex", _foreign)
    monkeypatch.setitem(AttentionMaskInterface._global_mapping, "tree_flex", _foreign)
    if how == "environment":
        monkeypatch.setenv(hf_tree_attn.attention.FORCE_REGISTER_ENV, "1")
    hf_tree_attn.register(force=how == "argument")
    assert AttentionInterface._global_mapping["tree_flex"] is hf_tree_attn.attention.tree_flex_attention
    assert AttentionMaskInterface._global_mapping["tree_flex"] is hf_tree_attn.attention.tree_flex_mask
    assert hf_tree_attn.attention.registration_error() is None


def test_our_function_from_an_earlier_load_is_replaced_quietly(monkeypatch):
    """What `importlib.reload(hf_tree_attn.attention)` leaves registered: the same code, another function object."""
    ours = hf_tree_attn.attention.tree_flex_attention
    earlier = types.FunctionType(ours.__code__, ours.__globals__, ours.__name__, ours.__defaults__, ours.__closure__)
    earlier.__qualname__, earlier.__module__ = ours.__qualname__, ours.__module__
    monkeypatch.setitem(AttentionInterface._global_mapping, "tree_flex", earlier)
    assert hf_tree_attn.attention.registration_error() is None
    hf_tree_attn.register()
    assert AttentionInterface._global_mapping["tree_flex"] is ours
    impostor = types.FunctionType(_foreign.__code__, ours.__globals__, ours.__name__)
    impostor.__qualname__, impostor.__module__ = ours.__qualname__, ours.__module__
    monkeypatch.setitem(AttentionInterface._global_mapping, "tree_flex", impostor)  # another file's code
    with pytest.raises(RuntimeError, match="already holds 'tree_flex'"):
        hf_tree_attn.register()


@pytest.mark.parametrize("kind", INTERFACES)
def test_a_tree_flex_registered_over_ours_is_not_taken_for_it(kind, monkeypatch):
    """Registered after `import hf_tree_attn`: a model on "tree_flex" would run the other function, so the gate
    refuses it, naming it."""
    interface, ours = INTERFACES[kind]
    model = tiny_model("llama")
    check_tree_model(model)
    monkeypatch.setitem(interface._global_mapping, "tree_flex", _foreign)
    error = hf_tree_attn.attention.registration_error()
    assert f"runs test_attention._foreign (registered in transformers' {interface.__name__}" in error
    assert f"not hf_tree_attn's {ours}" in error and "hf_tree_attn.register(force=True)" in error
    with pytest.raises(ValueError, match="runs test_attention._foreign"):
        check_tree_model(model)


def _python(code: str, **env) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "HF_TREE_ATTN_FORCE_REGISTER"} | env
    repo = Path(__file__).resolve().parent.parent
    return subprocess.run(
        [sys.executable, "-c", code], cwd=repo, env=environment, capture_output=True, text=True, timeout=300
    )


def test_import_refuses_a_foreign_tree_flex_registered_first():
    code = (
        "from transformers import AttentionMaskInterface\n"
        "def other_mask(**kwargs): pass\n"
        "AttentionMaskInterface.register('tree_flex', other_mask)\n"
        "import hf_tree_attn\n"
        "print(AttentionMaskInterface._global_mapping['tree_flex'].__module__)\n"
    )
    refused = _python(code)
    assert refused.returncode != 0
    assert "RuntimeError: transformers' AttentionMaskInterface already holds 'tree_flex': __main__.other_mask" in (
        refused.stderr
    )
    forced = _python(code, HF_TREE_ATTN_FORCE_REGISTER="1")
    assert forced.returncode == 0, forced.stderr[-2000:]
    assert forced.stdout.strip() == "hf_tree_attn.attention"


def test_reloading_the_module_keeps_the_registration_ours():
    code = (
        "import importlib, hf_tree_attn, hf_tree_attn.attention as attention\n"
        "from transformers import AttentionInterface\n"
        "importlib.reload(attention)\n"
        "assert attention.registration_error() is None  # the earlier load's functions: still ours\n"
        "importlib.reload(hf_tree_attn)\n"
        "assert AttentionInterface._global_mapping['tree_flex'] is attention.tree_flex_attention\n"
        "assert attention.registration_error() is None\n"
    )
    result = _python(code)
    assert result.returncode == 0, result.stderr[-2000:]


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
    _, forest, _ = tree_inputs
    model = tiny_model("llama").train()
    kwargs = forest_forward_kwargs(forest, "cpu")
    kwargs["attention_mask"] = forest.attention_mask("cpu", dense=False)  # BlockMasks, as on CUDA
    with pytest.raises(RuntimeError, match=r"no backward on CPU.*forest\.attention_mask\(device\)"):
        model(**kwargs)


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


def test_compiled_flex_attention_is_one_graph_with_and_without_autocast(tree_inputs):
    """A forward under autocast and one without reuse the compiled FlexAttention's graph. Dynamo guards on the
    autocast state; each graph of `flex_attention` counts against its recompile limit for the whole process, past
    which every call silently ran the eager reference (float32 scores matrix: slow, and other rounding than the
    kernel: GPT-OSS's bf16 cells of test_precision on an H200 failed there)."""
    from torch._dynamo.utils import counters

    _, _, block_mask = tree_inputs
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, block_mask.shape[-2], 16, dtype=torch.bfloat16) for _ in range(3))
    with torch.no_grad():
        want, _ = hf_tree_attn.attention._flex_attention(q, k, v, block_mask=block_mask, scale=0.25)
        graphs = counters["stats"]["unique_graphs"]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, _ = hf_tree_attn.attention._flex_attention(q, k, v, block_mask=block_mask, scale=0.25)
        again, _ = hf_tree_attn.attention._flex_attention(q, k, v, block_mask=block_mask, scale=0.25)
    assert counters["stats"]["unique_graphs"] == graphs, "autocast compiled FlexAttention again"
    assert torch.equal(got, want) and torch.equal(again, want)


def _attend_in_layer(q, k, v, mask):  # the tree attention inside a compiled decoder layer
    return hf_tree_attn.attention.tree_flex_attention(torch.nn.Module(), q, k, v, mask, scaling=0.25)[0]


def _attend_alone(q, k, v, mask):  # FlexAttention compiled on its own, as eager layers run it
    return hf_tree_attn.attention._flex_without_grad(q, k, v, block_mask=mask, scale=0.25, enable_gqa=True)


@pytest.mark.parametrize("attend", [_attend_in_layer, _attend_alone])
@pytest.mark.parametrize("q_len, kv_len", [(256, 384), (200, 384)])
def test_traced_flex_attention_declares_lengths_that_are_block_multiples(q_len, kv_len, attend):
    """In a dynamic-shape graph inductor gives FlexAttention's kernels `IS_DIVISIBLE` only where it can prove both
    lengths multiples of 128 (`statically_known_true(Mod(len, 128) == 0)`), so the tree attention declares the
    lengths that are, in compiled layers and where FlexAttention is compiled on its own: the graph's shape
    environment proves it for those and for no other, and the output is the uncompiled one's."""
    import sympy
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.utils._sympy.functions import Mod

    proven = {}

    def backend(gm, example_inputs):  # what the traced graph's shapes are known to be, then runs it as traced
        env = torch._guards.TracingContext.try_get().fake_mode.shape_env
        for node in gm.graph.nodes:
            value = node.meta.get("example_value")
            if node.op == "placeholder" and isinstance(value, torch.Tensor) and value.shape[-1] == 16:  # q, k, v
                length = value.shape[-2].node.expr
                proven[env.optimization_hint(length)] = env._maybe_evaluate_static(sympy.Eq(Mod(length, 128), 0))
        return gm.forward

    mask = create_block_mask(lambda b, h, q, kv: kv <= q + kv_len - q_len, None, None, q_len, kv_len, device="cpu")
    torch.manual_seed(0)
    q = torch.randn(1, 4, q_len, 16)
    k, v = (torch.randn(1, 2, kv_len, 16) for _ in range(2))
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(attend, backend=backend, dynamic=True)(q, k, v, mask)
        want = attend(q, k, v, mask)
    assert set(proven) == {q_len, kv_len}  # both lengths are symbols of the graph
    assert proven[kv_len] is sympy.true and (proven[q_len] is sympy.true) == (q_len % 128 == 0)
    torch.testing.assert_close(got, want)  # float32: the compiled graph's FlexAttention against the eager call's


def test_a_data_dependent_length_is_left_undeclared():
    """A length the graph computes from data has no value to guard on: it is not claimed, and the trace goes on."""

    def declare(x):
        q = x.new_zeros(1, 1, x.nonzero().shape[0], 4)  # a length of 256 nonzero elements, unknown when traced
        hf_tree_attn.attention._declare_block_multiples(q, q)
        return q.shape[2]

    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        assert torch.compile(declare, backend="eager", fullgraph=True)(torch.ones(256)) == 256


@pytest.mark.parametrize(
    "family", ["gpt_oss", pytest.param("llama4_text", marks=pytest.mark.slow)]
)  # sliding window + sinks; chunks + NoPE temperature tuning
def test_flex_layer_masks_equal_dense_on_cpu(family, monkeypatch):
    """The per-layer-kind BlockMasks (window, chunk) and the sink folding through the log-sum-exp, in FlexAttention
    on CPU (inference only), against the dense masks and eager math of the same forest."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config_of(family), attn_implementation="tree_flex").eval()
    sequences = forest_case("mixed", 3)
    (forest,) = pack_forest(sequences)
    calls = []
    flex = hf_tree_attn.attention._flex_attention
    monkeypatch.setattr(hf_tree_attn.attention, "_flex_attention", lambda *a, **k: calls.append(1) or flex(*a, **k))
    with torch.no_grad():
        kwargs = forest_forward_kwargs(forest, "cpu")
        kwargs["attention_mask"] = forest.attention_mask("cpu", dense=False)
        got = model(**kwargs).logits
        assert calls, "the BlockMasks must take the FlexAttention path"
        want = model(**forest_forward_kwargs(forest, "cpu")).logits
    n = forest.num_tree_tokens
    torch.testing.assert_close(got[0, :n], want[0, :n], atol=TOLERANCES["logps_atol"], rtol=0)


def _window_model_and_forest():
    """A Mistral with a window of 4 and a forest of sequences deeper than it."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config_of("mistral"), attn_implementation="tree_flex").eval()
    sequences = forest_case("grpo", 1)
    assert max(map(len, sequences)) > model.config.sliding_window
    (forest,) = pack_forest(sequences, pad_multiple=8)
    return model, sequences, forest


def test_hand_fed_forest_attention_mask_is_exact():
    """`model(input_ids, position_ids, attention_mask=forest.attention_mask())` gives each layer kind its tree mask."""
    model, sequences, forest = _window_model_and_forest()
    with torch.no_grad():
        logits = model(forest.input_ids, position_ids=forest.position_ids, attention_mask=forest.attention_mask())
        logps = logits.logits[0].log_softmax(-1)
        for k, seq in enumerate(sequences):
            rows = forest.positions(k)
            got = logps[rows[:-1]].gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
            torch.testing.assert_close(got, flat_logprobs(model, seq)[0], atol=TOLERANCES["logps_atol"], rtol=0)


def test_whole_model_compile_keeps_the_tree_masks():
    """`torch.compile(model)` traces the mask builders with fake tensors: the forest's masks must survive it (they
    were silently replaced by a causal mask over the DFS row, 3.7 nats off, before `tree_flex_mask` ran eagerly)."""
    model, _, forest = _window_model_and_forest()
    kwargs = forest_forward_kwargs(forest, "cpu")
    torch._dynamo.reset()
    with torch.no_grad():
        want = model(**kwargs).logits
        got = torch.compile(model, backend="aot_eager")(**kwargs).logits
    torch._dynamo.reset()
    rows = forest.num_tree_tokens
    torch.testing.assert_close(got[0, :rows], want[0, :rows], atol=TOLERANCES["logps_atol"], rtol=0)


@pytest.mark.parametrize("with_forest", [False, True])
def test_plain_tree_mask_in_a_window_model_raises(with_forest):
    """`forest.dense_mask()` has no window; handed to every layer it would silently drop it."""
    model, _, forest = _window_model_and_forest()
    kwargs = dict(position_ids=forest.position_ids, attention_mask=forest.dense_mask(), use_cache=False)
    if with_forest:
        kwargs["tree_forest"] = forest
    with torch.no_grad(), pytest.raises(ValueError, match=r"plain ancestor-or-self mask.*sliding_window=4"):
        model(forest.input_ids, **kwargs)


def test_copied_forest_mask_with_tree_forest_raises():
    """A copy of the forest's attention_mask is an ordinary padding mask: a tree forward must not run on it."""
    model, _, forest = _window_model_and_forest()
    kwargs = forest_forward_kwargs(forest, "cpu")
    kwargs["attention_mask"] = kwargs["attention_mask"].clone()
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"instead of a tree mask of the `tree_forest`"):
        model(**kwargs)
    kwargs["attention_mask"] = forest.attention_mask().view(1, -1)  # a view keeps its meaning
    with torch.no_grad():
        model(**kwargs)


# ----------------------------------------------------------------------------------------------------------------
# The gate (hf_tree_attn.support)


def test_state_carrying_layers_are_refused_unless_implemented(monkeypatch):
    """Jamba (Mamba-1 mixers) is refused by its family; listed as exact it is still refused by its layer class (a
    kind name such as "mamba" or "linear_attention" proves nothing); a layer kind trees do not know is refused by
    the config check. Implemented hybrids (Qwen3.5, LFM2, Nemotron-H, ...) are tested in test_recurrent.py."""
    import transformers

    import hf_tree_attn.support as support

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128)
    config = transformers.JambaConfig(
        **common, num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, num_experts=1
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="tree_flex")
    with pytest.raises(NotImplementedError, match=r"model_type 'jamba': layers that carry state"):
        check_tree_model(model)
    monkeypatch.setitem(support.EXACT_FAMILIES, "jamba", "")
    monkeypatch.delitem(support.REFUSED_FAMILIES, "jamba")
    with pytest.raises(NotImplementedError, match=r"state-carrying layers .*\(JambaMambaMixer: a Mamba-1 selective"):
        check_tree_model(model)

    qwen3 = tiny_config_of("qwen3")
    qwen3.layer_types = ["full_attention", "retention"]
    assert "has layer types ['retention'], which trees do not implement" in support.config_support_error(qwen3)


def test_unverified_family_is_refused(monkeypatch):
    import hf_tree_attn.support as support

    model = tiny_model("llama")
    monkeypatch.delitem(support.EXACT_FAMILIES, "llama")
    with pytest.raises(NotImplementedError, match=r"model_type 'llama' is not among the families.*tree_packing=False"):
        check_tree_model(model)
    assert "verified exact" in support.tree_support_error(model)


def test_logit_scale_of_each_field():
    from transformers import CohereConfig, GraniteConfig, HyperCLOVAXConfig

    from hf_tree_attn.support import logit_scale

    assert logit_scale(tiny_config("llama")) == 1.0
    assert logit_scale(GraniteConfig(logits_scaling=8.0)) == 1 / 8.0  # Granite divides
    assert logit_scale(HyperCLOVAXConfig(logits_scaling=8.0)) == 8.0  # HyperCLOVA X multiplies
    assert logit_scale(CohereConfig(logit_scale=0.0625)) == 0.0625


def test_lora_on_lm_head_raises():
    peft = pytest.importorskip("peft")
    model = tiny_model("llama")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(NotImplementedError, match=r"a LoRA on `lm_head`.*target_modules"):
        check_tree_model(lora)
    ok = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    check_tree_model(ok)


def test_flex_kernel_options_from_the_environment(monkeypatch):
    """`HF_TREE_ATTN_FLEX_KERNEL_OPTIONS`: a JSON object, else an error naming the variable and the form."""
    read = hf_tree_attn.attention._kernel_options_from_env
    monkeypatch.delenv("HF_TREE_ATTN_FLEX_KERNEL_OPTIONS", raising=False)
    assert read() is None
    monkeypatch.setenv("HF_TREE_ATTN_FLEX_KERNEL_OPTIONS", '{"BACKEND": "FLASH"}')
    assert read() == {"BACKEND": "FLASH"}
    for bad, match in (("BACKEND=FLASH", "is not JSON"), ('["FLASH"]', "must be a JSON object")):
        monkeypatch.setenv("HF_TREE_ATTN_FLEX_KERNEL_OPTIONS", bad)
        with pytest.raises(ValueError, match=rf"HF_TREE_ATTN_FLEX_KERNEL_OPTIONS=.*{match}"):
            read()


def test_flex_kernel_options_reach_cuda_calls_without_their_own(monkeypatch):
    """The options apply on CUDA to calls that bring none and have no softcap; a caller's own win; a copy each time."""
    options = hf_tree_attn.attention._kernel_options
    cuda = types.SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16)
    cpu = types.SimpleNamespace(device=torch.device("cpu"), dtype=torch.bfloat16)
    monkeypatch.setattr(hf_tree_attn.attention, "FLEX_KERNEL_OPTIONS", None)
    assert options(None, cuda, None) is None
    monkeypatch.setattr(hf_tree_attn.attention, "FLEX_KERNEL_OPTIONS", {"BACKEND": "FLASH"})
    got = options(None, cuda, None)
    assert got == {"BACKEND": "FLASH"} and got is not hf_tree_attn.attention.FLEX_KERNEL_OPTIONS
    assert options({"BLOCK_M": 64}, cuda, None) == {"BLOCK_M": 64}
    assert options(None, cpu, None) is None and options(None, cuda, 30.0) is None
