"""Tree log-probs, entropies and gradients against per-sequence flat forwards of the same weights."""

from __future__ import annotations

import pytest
import torch
from helpers import FAMILIES, FOREST_CASES, TOLERANCES, flat_logprobs, forest_case, twin_models

import hf_tree_attn.masks
from hf_tree_attn import forest_logprobs, gather_sequences, pack_forest, pad_sequences, sequence_logprobs
from hf_tree_attn.logprobs import tree_router_aux_loss
from hf_tree_attn.support import rope_split_lengths

ATOL = TOLERANCES["logps_atol"]


def _assert_matches_flat(ref, sequences, logps, entropies=None, temperature=1.0):
    assert len(logps) == len(sequences)
    for i, seq in enumerate(sequences):
        want_logps, want_entropy = flat_logprobs(ref, seq, temperature)
        assert logps[i].shape == (len(seq) - 1,) and logps[i].dtype == torch.float32
        torch.testing.assert_close(logps[i], want_logps, atol=ATOL, rtol=0, msg=lambda m, i=i: f"sequence {i}: {m}")
        if entropies is not None:
            assert entropies[i].shape == (len(seq) - 1,)
            torch.testing.assert_close(
                entropies[i], want_entropy, atol=ATOL, rtol=0, msg=lambda m, i=i: f"entropy {i}: {m}"
            )


@pytest.mark.parametrize("case", FOREST_CASES)
@pytest.mark.parametrize("family", FAMILIES)
def test_logprobs_and_entropies_match_flat(family, case):
    tree, ref = twin_models(family)
    sequences = forest_case(case, seed=0)
    with torch.no_grad():
        logps, entropies = sequence_logprobs(tree, sequences, return_entropy=True)
        _assert_matches_flat(ref, sequences, logps, entropies)


@pytest.mark.parametrize("family", FAMILIES)
def test_several_micro_batches_match_flat(family):
    tree, ref = twin_models(family)
    sequences = forest_case("mixed", seed=1) + forest_case("mixed", seed=2)
    assert len(pack_forest(sequences, max_tokens_per_mb=128)) >= 3
    with torch.no_grad():
        logps, entropies = sequence_logprobs(tree, sequences, max_tokens_per_mb=128, return_entropy=True)
        _assert_matches_flat(ref, sequences, logps, entropies)


@pytest.mark.parametrize("temperature", [0.7, 1.6])
@pytest.mark.parametrize("family", ["llama", "gemma2"])  # Gemma2: final softcap first, then the temperature
def test_temperature_matches_flat(family, temperature):
    tree, ref = twin_models(family)
    sequences = forest_case("grpo", seed=1)
    with torch.no_grad():
        logps, entropies = sequence_logprobs(tree, sequences, temperature=temperature, return_entropy=True)
        _assert_matches_flat(ref, sequences, logps, entropies, temperature)
        plain = sequence_logprobs(tree, sequences)
    assert not torch.allclose(torch.cat(logps), torch.cat(plain), atol=1e-3), "temperature must change the logps"


def test_granite_multipliers_match_flat():
    """Granite's embedding / residual / attention multipliers live inside the decoder: the tree stays exact."""
    tree, ref = twin_models("granite")
    sequences = forest_case("mixed", seed=4)
    with torch.no_grad():
        logps, entropies = sequence_logprobs(tree, sequences, return_entropy=True)
        _assert_matches_flat(ref, sequences, logps, entropies)


def test_flat_oracle_detects_a_leaking_mask(monkeypatch):
    """Scoring the packed row with a plain causal mask (siblings see each other) must fail the comparison."""
    tree, ref = twin_models("llama")
    sequences = forest_case("grpo", seed=0)

    def causal_rows(subtree_end):
        return lambda b, h, q_idx, kv_idx: kv_idx <= q_idx

    monkeypatch.setattr(hf_tree_attn.masks, "tree_mask_mod", causal_rows)
    with torch.no_grad():
        leaked = sequence_logprobs(tree, sequences)
        worst = max((leaked[i] - flat_logprobs(ref, s)[0]).abs().max().item() for i, s in enumerate(sequences))
    assert worst > 100 * ATOL


# ----------------------------------------------------------------------------------------------------------------
# Gradients


def _param_grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_grads_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], max_rel: float) -> None:
    """Per tensor: max |got - want| <= max_rel * max |want|."""
    assert got.keys() == want.keys() and len(got) > 0
    for name, flat in want.items():
        worst = (got[name] - flat).abs().max().item()
        assert worst <= max_rel * flat.abs().max().item(), f"{name}: max |diff| {worst}"


def _token_weights(sequences, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(len(s) - 1, generator=g) for s in sequences]


@pytest.mark.parametrize("family", FAMILIES)
def test_parameter_gradients_match_flat(family):
    tree, ref = twin_models(family)
    sequences = forest_case("mixed", seed=3)
    weights = _token_weights(sequences, seed=0)

    logps = sequence_logprobs(tree, sequences, max_tokens_per_mb=128)
    assert len(pack_forest(sequences, max_tokens_per_mb=128)) >= 2
    sum((w * lp).sum() for w, lp in zip(weights, logps)).backward()
    sum((w * flat_logprobs(ref, s)[0]).sum() for w, s in zip(weights, sequences)).backward()

    got, want = _param_grads(tree), _param_grads(ref)
    _assert_grads_close(got, want, TOLERANCES["grad_max_rel"])
    flat_got = torch.cat([got[k].flatten() for k in sorted(got)])
    flat_want = torch.cat([want[k].flatten() for k in sorted(want)])
    cosine = torch.nn.functional.cosine_similarity(flat_got, flat_want, dim=0).item()
    assert cosine >= TOLERANCES["grad_cosine"], cosine


# ----------------------------------------------------------------------------------------------------------------
# Leakage: a change inside one branch moves that branch only.


def _leaf_change(sequences, max_tokens_per_mb):
    """`(index, new_sequences)`: one sequence's last token changed such that the packing layout is unchanged."""
    before = pack_forest(sequences, max_tokens_per_mb=max_tokens_per_mb)
    for i, seq in enumerate(sequences):
        for token in (seq[-1] + 1, seq[-1] - 1, seq[-1] + 2, seq[-1] - 2):  # near neighbours keep the sort order
            if not 1 <= token < 128:
                continue
            changed = [list(s) for s in sequences]
            changed[i][-1] = token
            after = pack_forest(changed, max_tokens_per_mb=max_tokens_per_mb)
            same_layout = len(after) == len(before) and all(
                a.seq_ids == b.seq_ids
                and torch.equal(a.seq_positions, b.seq_positions)
                and torch.equal(a.subtree_end, b.subtree_end)
                for a, b in zip(after, before)
            )
            moved = sum(int((a.input_ids != b.input_ids).sum()) for a, b in zip(after, before))
            if same_layout and moved == 1 and len(seq) >= 2:
                return i, changed
    raise AssertionError("no leaf change keeps the layout")


@pytest.mark.parametrize(
    "case, mb", [("grpo", None), ("multiturn", None), ("mixed", 128)], ids=["grpo", "multiturn", "mixed-mb128"]
)
@pytest.mark.parametrize("family", ["llama", "gemma", "gemma2"])
def test_changing_one_leaf_moves_only_its_sequence(family, case, mb):
    tree, _ = twin_models(family)
    sequences = forest_case(case, seed=0)
    index, changed = _leaf_change(sequences, mb)
    with torch.no_grad():
        before, ent_before = sequence_logprobs(tree, sequences, max_tokens_per_mb=mb, return_entropy=True)
        after, ent_after = sequence_logprobs(tree, changed, max_tokens_per_mb=mb, return_entropy=True)
    for i in range(len(sequences)):
        if i == index:
            assert not torch.equal(before[i][-1], after[i][-1]), "the changed token's logp must move"
            assert torch.equal(before[i][:-1], after[i][:-1]), "tokens before the change cannot see it"
        else:
            assert torch.equal(before[i], after[i]), f"sequence {i} saw sequence {index}'s change"
            assert torch.equal(ent_before[i], ent_after[i])


# ----------------------------------------------------------------------------------------------------------------
# Train mode, chunked LM head, wrappers


def test_train_mode_with_gradient_checkpointing_matches_flat():
    tree, ref = twin_models("qwen3")
    tree.train()
    if hasattr(tree, "activation_checkpointing_enable"):  # transformers >= 5.23 renamed it
        tree.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        tree.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert all(layer.gradient_checkpointing for layer in tree.model.layers)
    sequences = forest_case("multiturn", seed=2)
    logps, entropies = sequence_logprobs(tree, sequences, return_entropy=True)
    assert all(lp.requires_grad for lp in logps if lp.numel())
    with torch.no_grad():
        _assert_matches_flat(ref, sequences, logps, entropies)
    weights = _token_weights(sequences, seed=1)
    sum((w * lp).sum() for w, lp in zip(weights, logps)).backward()
    sum((w * flat_logprobs(ref, s)[0]).sum() for w, s in zip(weights, sequences)).backward()
    _assert_grads_close(_param_grads(tree), _param_grads(ref), TOLERANCES["grad_max_rel"])


def test_eval_and_train_mode_agree():
    tree, _ = twin_models("gemma")
    sequences = forest_case("grpo", seed=2)
    with torch.no_grad():
        eval_logps = sequence_logprobs(tree.eval(), sequences)
        train_logps = sequence_logprobs(tree.train(), sequences)
    for a, b in zip(eval_logps, train_logps):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_chunked_lm_head_equals_default(family):
    tree, _ = twin_models(family)
    (forest,) = pack_forest(forest_case("mixed", seed=0))
    results = {}
    for chunk_rows in (None, 3):
        tree.zero_grad()
        logps, entropy = forest_logprobs(tree, forest, temperature=0.9, return_entropy=True, chunk_rows=chunk_rows)
        (logps * torch.linspace(-1, 1, len(logps))).sum().add(entropy.sum()).backward()
        results[chunk_rows] = (logps.detach(), entropy.detach(), _param_grads(tree))
    (lp, ent, grads), (lp3, ent3, grads3) = results[None], results[3]
    assert (forest.parent >= 0).sum() > 3 * 3, "needs several chunks"
    torch.testing.assert_close(lp3, lp, atol=TOLERANCES["chunk_atol"], rtol=0)
    torch.testing.assert_close(ent3, ent, atol=TOLERANCES["chunk_atol"], rtol=0)
    _assert_grads_close(grads3, grads, TOLERANCES["chunk_max_rel"])
    assert torch.equal(lp[forest.parent < 0], torch.zeros(int((forest.parent < 0).sum())))


def test_forest_logprobs_on_chosen_rows():
    tree, ref = twin_models("llama")
    sequences = forest_case("grpo", seed=0)
    (forest,) = pack_forest(sequences)
    rows = forest.positions(0)[1:]
    with torch.no_grad():
        logps, entropy = forest_logprobs(tree, forest, rows=rows)
        torch.testing.assert_close(logps[rows], flat_logprobs(ref, sequences[0])[0], atol=ATOL, rtol=0)
    assert entropy is None
    unscored = torch.ones(forest.seq_len, dtype=torch.bool)
    unscored[rows] = False
    assert (logps[unscored] == 0).all()
    with pytest.raises(ValueError, match=r"rows \[0\] have no parent"):
        forest_logprobs(tree, forest, rows=forest.positions(0)[:2])


class _DDPLike(torch.nn.Module):
    """The minimal shape of DDP: the model under `.module`, the root called with the inputs."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.calls = 0

    def forward(self, **kwargs):
        self.calls += 1
        return self.module(**kwargs)


def test_wrapped_model_is_unwrapped_and_root_called():
    tree, ref = twin_models("qwen2")
    wrapped = _DDPLike(tree)
    sequences = forest_case("prefix", seed=0)
    with torch.no_grad():
        logps = sequence_logprobs(wrapped, sequences)
        _assert_matches_flat(ref, sequences, logps)
    assert wrapped.calls == 1


def test_peft_lora_model_matches_flat():
    peft = pytest.importorskip("peft")
    tree, _ = twin_models("llama")
    model = peft.get_peft_model(
        tree, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    sequences = forest_case("grpo", seed=3)
    with torch.no_grad():
        logps = sequence_logprobs(model, sequences)
        # tree_flex without a tree is plain sdpa (tests/test_attention.py), so the LoRA model itself is the oracle.
        _assert_matches_flat(model, sequences, logps)


def test_only_one_token_sequences_score_nothing():
    tree, _ = twin_models("llama")
    logps, entropies = sequence_logprobs(tree, [[5], [6], [5]], return_entropy=True)
    assert [(t.shape, t.dtype) for t in logps + entropies] == [(torch.Size([0]), torch.float32)] * 6


# ----------------------------------------------------------------------------------------------------------------
# Shapes of the helpers


def test_gather_and_pad_shapes():
    sequences = [[5, 6, 7, 8], [5, 6, 9], [4]]
    (forest,) = pack_forest(sequences, pad_multiple=8)
    table = torch.arange(forest.seq_len, dtype=torch.float32) * 10
    values = gather_sequences(forest, table)
    # Heaviest trie and child first: rows 0-3 = 5 6 7 8, row 4 = 9, row 5 = [4].
    assert [v.tolist() for v in values] == [[10.0, 20.0, 30.0], [10.0, 40.0], []]
    padded, mask = pad_sequences(values, padding_value=-1.0)
    assert padded.shape == mask.shape == (3, 3) and mask.dtype == torch.bool
    assert padded.tolist() == [[10.0, 20.0, 30.0], [10.0, 40.0, -1.0], [-1.0, -1.0, -1.0]]
    assert mask.tolist() == [[True, True, True], [True, True, False], [False, False, False]]


# ----------------------------------------------------------------------------------------------------------------
# RoPE whose frequencies depend on the forward's longest position


def _rope_sequences(rng_seed: int, short: int, long: int) -> list[list[int]]:
    """A prompt shared by completions that end below and above a RoPE threshold, plus an unrelated chain."""
    g = torch.Generator().manual_seed(rng_seed)
    prompt = torch.randint(3, 128, (short - 3,), generator=g).tolist()
    return [
        prompt + torch.randint(3, 128, (2,), generator=g).tolist(),  # short
        prompt + torch.randint(3, 128, (long - short + 3,), generator=g).tolist(),  # long
        prompt + torch.randint(3, 128, (3,), generator=g).tolist(),  # exactly `short` tokens
        torch.randint(3, 128, (long + 4,), generator=g).tolist(),
    ]


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
    ],
    ids=["linear", "llama3", "yarn"],
)  # fmt: skip
def test_static_rope_scalings_match_flat(rope):
    tree, ref = twin_models("llama", rope_parameters={"rope_theta": 10000.0, **rope})
    sequences = _rope_sequences(0, short=8, long=20)
    with torch.no_grad():
        _assert_matches_flat(ref, sequences, sequence_logprobs(tree, sequences))


def test_longrope_packs_each_length_class_apart_and_matches_flat():
    """Phi-3-style longrope uses its long factors for a forward longer than original_max_position_embeddings: the
    short and long sequences of one prompt go to different forests, each computed as its own forward would."""
    head_half = 8  # head_dim 16: 8 frequencies
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 10, "factor": 4.0,
            "short_factor": [1.0 + 0.1 * i for i in range(head_half)],
            "long_factor": [2.0 + 0.5 * i for i in range(head_half)]}  # fmt: skip
    tree, ref = twin_models("llama", rope_parameters=rope, max_position_embeddings=40)
    sequences = _rope_sequences(1, short=10, long=25)
    assert rope_split_lengths(tree.config) == (10,)
    forests = pack_forest(sequences, split_lengths=(10,))
    assert len(forests) == 2 and all(len({len(sequences[i]) > 10 for i in f.seq_ids}) == 1 for f in forests)
    with torch.no_grad():
        _assert_matches_flat(ref, sequences, sequence_logprobs(tree, sequences))
        (mixed,) = pack_forest(sequences)
        with pytest.raises(ValueError, match=r"mixes sequences of at most and of more than 10 tokens.*longrope"):
            forest_logprobs(tree, mixed)


def test_dynamic_rope_is_exact_below_its_limit_and_refused_above():
    tree, ref = twin_models(
        "llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        max_position_embeddings=16,
    )  # fmt: skip
    short = _rope_sequences(2, short=6, long=10)  # all below max_position_embeddings=16
    with torch.no_grad():
        _assert_matches_flat(ref, short, sequence_logprobs(tree, short))
        with pytest.raises(ValueError, match=r"has 16 tokens.*dynamic RoPE.*at most 15 tokens"):
            sequence_logprobs(tree, short + [list(range(3, 19))])


# ----------------------------------------------------------------------------------------------------------------
# MoE router load-balancing loss


def _moe_model(family: str):
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    common = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, num_experts_per_tok=2, router_aux_loss_coef=0.01,
                  initializer_range=0.1, pad_token_id=0)  # fmt: skip
    if family == "qwen3_moe":
        cfg = Qwen3MoeConfig(**common, head_dim=16, num_experts=4, moe_intermediate_size=32, norm_topk_prob=True)
    else:
        cfg = MixtralConfig(**common, num_local_experts=4)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="tree_flex").eval()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_router_aux_loss_equals_flat_padded_batch(family):
    """Each shared token is routed once but weighs as many sequences as contain it: the tree's load-balancing loss
    (values and router gradients) equals the model's own on the flat padded batch, over several forests."""
    model = _moe_model(family)
    sequences = forest_case("grpo", 2) + forest_case("identical", 0)
    forests = pack_forest(sequences, max_tokens_per_mb=48, pad_multiple=16)
    assert len(forests) >= 2
    router_logits = [forest_logprobs(model, f, return_router_logits=True)[2] for f in forests]
    tree_loss = tree_router_aux_loss(model, forests, router_logits)
    (tree_grad,) = torch.autograd.grad(tree_loss, model.model.layers[0].mlp.gate.weight)

    ids, mask = pad_sequences([torch.tensor(s) for s in sequences])
    flat_loss = model(input_ids=ids.long(), attention_mask=mask.long(), output_router_logits=True).aux_loss
    (flat_grad,) = torch.autograd.grad(flat_loss, model.model.layers[0].mlp.gate.weight)
    torch.testing.assert_close(tree_loss, flat_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(tree_grad, flat_grad, atol=1e-6, rtol=1e-5)
    unweighted = _unweighted_aux(model, router_logits)
    assert not torch.allclose(unweighted, flat_loss, atol=1e-4), "the test needs shared tokens that change the loss"


def _unweighted_aux(model, router_logits):
    """The loss over the forests' rows as they are (shared tokens once, padding included): what must not be used."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    layers = tuple(torch.cat(per_layer) for per_layer in zip(*router_logits))
    return load_balancing_loss_func(layers, model.config.num_experts, model.config.num_experts_per_tok)
