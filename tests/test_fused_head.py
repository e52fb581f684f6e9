"""`TreeLMHead`: TRL's fused LM head computed on packed forests equals TRL's own fused forward, field by field.

The oracle is TRL's `add_fused_lm_head` forward on the same weights (`sdpa`), on the flat batch layouts TRL's
collators build: right-padded rows and padding-free packed rows. Every per-token output (log-probs, entropy,
`log(sum p^2)`, mean logit, top-1 flag), the loss, the MoE auxiliary loss and the parameter gradients must agree.
"""

from __future__ import annotations

import copy
import inspect
import types
import warnings

import pytest
import torch
from helpers import TOLERANCES, tiny_model
from transformers import AutoModelForCausalLM, Qwen3MoeConfig
from trl.trainer.utils import add_fused_lm_head

from hf_tree_attn.trainer.fused_head import TreeLMHead, fused_head_settings, plan_fused_batch

ALL_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")
SYSTEM = [5, 9, 11, 3, 7, 21, 8, 8, 30, 31]


def _sequences():
    """A shared system prompt, per-turn samples of one conversation (each the history of the next), a duplicate,
    a 1-token sequence and one sharing nothing."""
    turn1 = SYSTEM + [40, 41, 42]
    turn2 = turn1 + [43, 44, 45, 46]
    return [turn1, turn2, turn2 + [47, 48], SYSTEM + [50, 51], SYSTEM + [50, 51], [60], [61, 62, 63, 64]]


def _labels(seqs, trained):
    """`trained(i, t)` decides whether token t of sequence i is a label (else -100)."""
    return [[tok if trained(i, t) else -100 for t, tok in enumerate(s)] for i, s in enumerate(seqs)]


def _padded(seqs, labels):
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    lab = torch.tensor([lb + [-100] * (width - len(lb)) for lb in labels])
    return dict(input_ids=ids, attention_mask=mask), lab


def _padding_free(seqs, labels, pad_to=None):
    """As TRL's padding-free collator: one row, position ids restarting at 0, the first label of each -100."""
    ids = [t for s in seqs for t in s]
    pos = [t for s in seqs for t in range(len(s))]
    lab = [(-100 if t == 0 else v) for lb in labels for t, v in enumerate(lb)]
    if pad_to:
        extra = -len(ids) % pad_to
        ids, pos, lab = ids + [0] * extra, pos + [0] * extra, lab + [-100] * extra
    return dict(input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos])), torch.tensor([lab])


def _twins(family="qwen3", outputs=ALL_OUTPUTS, **overrides):
    tree = tiny_model(family, "tree_flex", **overrides).train()
    flat = tiny_model(family, "sdpa", seed=1, **overrides).train()
    flat.load_state_dict(tree.state_dict())
    for model in (tree, flat):
        add_fused_lm_head(model, outputs=outputs)
    return tree, flat


def _run(model, inputs, labels, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs, labels=labels, fused_lm_head=True, use_cache=False, **kwargs)
    (out.loss + out.entropy.sum() * 0.1 if out.entropy is not None else out.loss).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def _assert_same(tree_out, flat_out, tree_grads, flat_grads):
    atol = TOLERANCES["logps_atol"]
    for name in FIELDS:
        got, want = getattr(tree_out, name), getattr(flat_out, name)
        if want is None:
            assert got is None, name
        elif want.dtype == torch.bool:
            assert torch.equal(got, want), name
        else:
            torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=name)
    torch.testing.assert_close(tree_out.loss, flat_out.loss, atol=atol, rtol=0)
    assert tree_grads.keys() == flat_grads.keys()
    for name, want in flat_grads.items():
        got = tree_grads[name]
        assert (got - want).abs().max() <= TOLERANCES["grad_max_rel"] * want.abs().max(), name


LAYOUTS = {
    "padded": lambda seqs, labels: _padded(seqs, labels),
    "padding_free": lambda seqs, labels: _padding_free(seqs, labels),
    "padding_free_pad_to_multiple": lambda seqs, labels: _padding_free(seqs, labels, pad_to=16),
}
LOSS_MASKS = {
    "every_token": lambda i, t: True,
    "completion_only": lambda i, t: t >= len(SYSTEM),  # the shared prompt is not trained (shared rows unscored)
    "some_turns": lambda i, t: (i + t) % 3 != 0,  # sequences sharing a row train it differently
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("loss_mask", LOSS_MASKS)
def test_tree_head_equals_trl_fused_head(layout, loss_mask):
    tree, flat = _twins()
    head = TreeLMHead(max_token_ratio=1.0)
    head.install(tree)
    seqs = _sequences()
    inputs, labels = LAYOUTS[layout](seqs, _labels(seqs, LOSS_MASKS[loss_mask]))
    records = []
    head.record = lambda name, value: records.append((name, value))
    tree_out, tree_grads = _run(tree, inputs, labels, num_items_in_batch=torch.tensor(37))
    flat_out, flat_grads = _run(flat, inputs, labels, num_items_in_batch=torch.tensor(37))
    assert ("tree_fallback", 0.0) in records
    _assert_same(tree_out, flat_out, tree_grads, flat_grads)


def test_trained_shared_rows_are_scored_once():
    seqs = _sequences()
    inputs, labels = _padded(seqs, _labels(seqs, LOSS_MASKS["every_token"]))
    plan = plan_fused_batch(inputs["input_ids"], inputs["attention_mask"], None, labels)
    pairs = sum(len(t.pairs[0]) for t in plan.plans)
    scored = int((labels[:, 1:] != -100).sum())
    assert sum(len(t) for t in plan.plans) == len(plan.entry_row) == scored
    # Distinct (prefix, next token) pairs of the trie: each shared prefix is scored once per distinct next token.
    distinct = {tuple(s[: t + 2]) for s in seqs for t in range(len(s) - 1)}
    assert pairs == len(distinct) < scored
    assert plan.tree_tokens == len({tuple(s[:t]) for s in seqs for t in range(1, len(s) + 1)})


def test_layouts_the_tree_cannot_reproduce_run_trl_forward():
    seqs = [[5, 6, 7], [5, 6]]
    labels = torch.tensor([[-100, 6, 7], [-100, 6, 9]])
    after_pad = torch.tensor([[-100, 6, 7, -100], [-100, 6, -100, 9]])  # row 1 scores its padding position's state
    inputs = dict(
        input_ids=torch.tensor([[5, 6, 7, 0], [5, 6, 0, 0]]), attention_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    )
    assert "padding position" in plan_fused_batch(**inputs, position_ids=None, labels=after_pad)
    left = dict(input_ids=torch.tensor([[5, 6, 7], [0, 5, 6]]), attention_mask=torch.tensor([[1, 1, 1], [0, 1, 1]]))
    assert "right-padded" in plan_fused_batch(**left, position_ids=None, labels=labels)
    skewed = dict(input_ids=torch.tensor([[5, 6, 7, 5, 6]]), position_ids=torch.tensor([[0, 1, 2, 1, 2]]))
    assert "position_ids" in plan_fused_batch(**skewed, attention_mask=None, labels=torch.tensor([[-100] * 5]))
    no_share = plan_fused_batch(torch.tensor(seqs[:1]), None, None, torch.tensor([[-100, 6, 7]]), None, (), 0.5)
    assert no_share.startswith("ratio 1.000")
    long = plan_fused_batch(torch.tensor([[5] * 200]), None, None, torch.tensor([[-100] + [5] * 199]), 128, (), 1.0)
    assert long == "a sequence of 200 tokens is longer than max_tokens_per_mb=128"  # TRL's path, not a crash

    tree, flat = _twins(outputs=("log_probs",))
    head = TreeLMHead()
    head.install(tree)
    records = []
    head.record = lambda name, value: records.append((name, value))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = tree(**left, labels=labels, fused_lm_head=True)
        tree(**left, labels=labels, fused_lm_head=True)
    want = flat(**left, labels=labels, fused_lm_head=True)
    torch.testing.assert_close(out.log_probs, want.log_probs)
    assert records == [("tree_fallback", 1.0)] * 2
    assert sum("right-padded" in str(w.message) for w in caught) == 1  # said once


def test_moe_auxiliary_loss_equals_trl():
    config = Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.5, initializer_range=0.1, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    tree = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="tree_flex").train()
    flat = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa").train()
    flat.load_state_dict(tree.state_dict())
    for model in (tree, flat):
        add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    TreeLMHead(max_token_ratio=1.0).install(tree)
    seqs = _sequences()
    for layout in ("padded", "padding_free"):
        inputs, labels = LAYOUTS[layout](seqs, _labels(seqs, LOSS_MASKS["completion_only"]))
        tree_out, tree_grads = _run(tree, inputs, labels)
        flat_out, flat_grads = _run(flat, inputs, labels)
        assert flat_out.aux_loss is not None
        torch.testing.assert_close(tree_out.aux_loss, flat_out.aux_loss, atol=TOLERANCES["logps_atol"], rtol=0)
        _assert_same(tree_out, flat_out, tree_grads, flat_grads)


def test_fused_head_settings_are_readable():
    """TRL's fused head keeps its settings in its forward's closure: a TRL upgrade that changes them fails here."""
    model = tiny_model("qwen3")
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "is_top1"))
    settings = fused_head_settings(model)
    assert settings == {
        "outputs": ("log_probs", "is_top1"), "temperature": 0.7, "cast_lm_head_to_fp32": False,
        "final_logit_softcapping": None, "logit_scale": 1.0,
    }  # fmt: skip
    with pytest.raises(ValueError, match="not the fused LM head"):
        fused_head_settings(tiny_model("qwen3"))
    params = list(inspect.signature(model.forward.__func__, follow_wrapped=False).parameters)
    assert params[:2] == ["self", "args"] and {"fused_lm_head", "labels", "shift_labels"} <= set(params)
    # The tree head keeps the model's signature, which `generate` checks its keyword arguments against.
    TreeLMHead().install(model)
    assert inspect.signature(model.forward) == inspect.signature(tiny_model("qwen3").forward)


def test_installing_twice_wraps_trl_forward_once():
    tree, flat = _twins(outputs=("log_probs",))
    first, second = TreeLMHead(max_token_ratio=1.0), TreeLMHead(max_token_ratio=1.0)
    first.install(tree)
    first.install(tree)
    second.install(tree)
    assert tree.forward._tree_lm_head is second
    seqs = _sequences()
    inputs, labels = _padded(seqs, _labels(seqs, LOSS_MASKS["every_token"]))
    torch.testing.assert_close(
        tree(**inputs, labels=labels, fused_lm_head=True).log_probs,
        flat(**inputs, labels=labels, fused_lm_head=True).log_probs,
        atol=TOLERANCES["logps_atol"], rtol=0,
    )  # fmt: skip


def _prepared_as_accelerate(model, dtype=torch.bfloat16):
    """`model.forward` wrapped as `Accelerator.prepare_model` wraps it under mixed precision (autocast, then the
    float32-output cast outside it), its forward before that kept as `_original_forward`; the autocast returned."""
    from accelerate.utils.operations import convert_outputs_to_fp32

    autocast = torch.autocast("cpu", dtype=dtype)
    model._original_forward = model.forward
    model.forward = types.MethodType(autocast(model.forward.__func__), model)
    model.forward = types.MethodType(convert_outputs_to_fp32(model.forward.__func__), model)
    return autocast


def test_tree_head_goes_inside_accelerates_mixed_precision_wrappers():
    """A model accelerate prepared for mixed precision after TRL installed its head (TRL's DPO reference model):
    the settings are read through accelerate's layers, and the tree head is installed inside them, so a call
    outside any autocast still runs under accelerate's autocast with its outputs cast to float32; a second head
    replaces the first there, never stacks."""
    from accelerate.utils.operations import ConvertOutputsToFp32

    from hf_tree_attn.trainer.mixed_precision_forward import peel

    tree, flat = _twins(outputs=("log_probs",))
    float32 = copy.deepcopy(flat)  # TRL's head, unprepared: the float32 values
    settings = fused_head_settings(tree)
    autocasts = [_prepared_as_accelerate(model) for model in (tree, flat)]
    assert fused_head_settings(tree) == settings
    first, second = TreeLMHead(max_token_ratio=1.0), TreeLMHead(max_token_ratio=1.0)
    for head in (first, first, second):
        head.install(tree)
    func, layers = peel(tree.forward)
    assert func._tree_lm_head is second and [layer.autocast for layer in layers] == [None, autocasts[0]]
    assert isinstance(tree.forward.__wrapped__, ConvertOutputsToFp32)
    assert tree._original_forward.__func__ is func  # accelerate's record of the forward under its layers
    seen = []
    hooks = [
        m.get_decoder().register_forward_pre_hook(lambda *_: seen.append(torch.is_autocast_enabled("cpu")))
        for m in (tree, flat)
    ]
    seqs = _sequences()
    inputs, labels = _padded(seqs, _labels(seqs, LOSS_MASKS["every_token"]))
    with torch.no_grad():
        got, flat_out, want = (
            m(**inputs, labels=labels, fused_lm_head=True, use_cache=False).log_probs for m in (tree, flat, float32)
        )
    for hook in hooks:
        hook.remove()
    assert seen == [True, True] and got.dtype == flat_out.dtype == torch.float32
    # As close to float32 as TRL's head under the same autocast (the bound of tests/test_precision.py).
    tree_error, flat_error = (got - want).abs().max(), (flat_out - want).abs().max()
    assert flat_error > 0  # the autocast did run
    u = torch.finfo(torch.bfloat16).eps / 2
    assert tree_error <= 2 * flat_error + u * want.abs().max(), (tree_error, flat_error)


def test_fused_head_settings_errors_name_what_was_found(monkeypatch):
    """Only a TRL fused head lacking a setting blames the trl version; a model TRL did not patch, or a forward some
    other wrapper hides, is named as such."""
    import functools

    from hf_tree_attn.trainer import fused_head

    plain = tiny_model("qwen3")
    with pytest.raises(ValueError, match="Qwen3ForCausalLM.forward.*not the fused LM head") as error:
        fused_head_settings(plain)
    assert "trl version" not in str(error.value)
    model = tiny_model("qwen3")
    add_fused_lm_head(model)
    inner = model.forward.__func__

    def other_wrapper(self, *args, **kwargs):
        return inner(self, *args, **kwargs)

    model.forward = types.MethodType(functools.update_wrapper(other_wrapper, inner, updated=()), model)
    with pytest.raises(ValueError, match="other_wrapper at .*something else wraps that head") as error:
        fused_head_settings(model)
    assert "trl version" not in str(error.value)
    trl_model = tiny_model("qwen3")
    add_fused_lm_head(trl_model)
    monkeypatch.setattr(fused_head, "_SETTINGS", (*fused_head._SETTINGS, "top_k"))
    with pytest.raises(ValueError, match=r"TRL's fused LM head .* keeps no \['top_k'\].*this trl version"):
        fused_head_settings(trl_model)
