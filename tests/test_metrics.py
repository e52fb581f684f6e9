"""`estimate_flops` against explicit counts over a per-token dict trie and per-unit costs read off a real model."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import FOREST_CASES, DictTrie, forest_case, tiny_model

from hf_tree_attn import estimate_flops


def _unit_costs(model) -> dict[str, int]:
    """Forward FLOPs per token (every nn.Linear in the decoder layers), per (query, key) pair, per scored row."""
    cfg = model.config
    layers = model.model.layers
    linear = sum(
        2 * m.weight.numel() for layer in layers for m in layer.modules() if type(m).__name__ == "Linear"
    )  # 2 FLOPs per multiply-add
    head_dim = layers[0].self_attn.head_dim
    pair = len(layers) * cfg.num_attention_heads * (2 * head_dim + 2 * head_dim)  # q·k and p·v
    head = 2 * model.get_output_embeddings().weight.numel()
    return {"linear": linear, "pair": pair, "head": head}


def _oracle(model, sequences, prompt_lengths=None) -> dict[str, float]:
    """Counts by explicit loops: flat rows, and the dict trie's unique nodes / ancestor pairs / scored nodes."""
    costs = _unit_costs(model)
    flat_tokens = flat_pairs = flat_scored = 0
    trie = DictTrie()
    scored_nodes: set[int] = set()
    for i, seq in enumerate(sequences):
        first = max(1, prompt_lengths[i]) if prompt_lengths is not None else 1
        path = trie.insert(seq)
        for t in range(len(seq)):
            flat_tokens += 1
            flat_pairs += t + 1  # causal: the token and every earlier one
            if t >= first:
                flat_scored += 1
                scored_nodes.add(path[t])  # a token shared by several sequences is scored once
    tree_pairs = sum(len(trie.ancestors_or_self(node)) for node in range(1, trie.num_nodes + 1))
    flat = flat_tokens * costs["linear"] + flat_pairs * costs["pair"] + flat_scored * costs["head"]
    tree = trie.num_nodes * costs["linear"] + tree_pairs * costs["pair"] + len(scored_nodes) * costs["head"]
    return {
        "flat_flops": float(flat),
        "tree_flops": float(tree),
        "flops_ratio": tree / flat,
        "flops_saved": 1 - tree / flat,
        "token_ratio": trie.num_nodes / flat_tokens,
    }


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma"])
def model(request):
    """Llama (head_dim = hidden / heads), Qwen3 (explicit head_dim), Gemma (MQA)."""
    return tiny_model(request.param, **({"head_dim": 24} if request.param == "qwen3" else {}))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", FOREST_CASES)
def test_matches_brute_force(model, case, seed):
    sequences = forest_case(case, seed)
    got = estimate_flops(model.config, sequences)
    assert got == pytest.approx(_oracle(model, sequences), rel=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", ["grpo", "multiturn", "mixed"])
def test_matches_brute_force_with_prompt_lengths(model, case, seed):
    sequences = forest_case(case, seed)
    rng = random.Random(seed)
    prompt_lengths = [rng.randint(0, len(s) + 1) for s in sequences]  # 0, inside, at and past the end
    got = estimate_flops(model.config, sequences, prompt_lengths=prompt_lengths)
    assert got == pytest.approx(_oracle(model, sequences, prompt_lengths), rel=1e-12)


def test_grpo_group_by_hand(model):
    """G completions of C tokens after one prompt of P: the closed forms of docs/how_it_works.md ("The FLOP model")."""
    p, g, c = 8, 4, 5
    prompt = list(range(1, p + 1))
    sequences = [prompt + [10 + i] * c for i in range(g)]
    got = estimate_flops(model.config, sequences, prompt_lengths=[p] * g)
    cost = _unit_costs(model)
    pairs_flat = g * (p + c) * (p + c + 1) // 2
    pairs_tree = p * (p + 1) // 2 + g * sum(t + 1 for t in range(p, p + c))
    flat = g * (p + c) * cost["linear"] + pairs_flat * cost["pair"] + g * c * cost["head"]
    tree = (p + g * c) * cost["linear"] + pairs_tree * cost["pair"] + g * c * cost["head"]  # LM head: no saving
    assert got["flat_flops"] == flat and got["tree_flops"] == tree
    assert got["token_ratio"] == pytest.approx((p + g * c) / (g * (p + c)), rel=1e-12)


def test_shared_tokens_scored_by_any_sequence_count_once(model):
    """Two sequences share 6 tokens; one scores from depth 2, the other only from depth 5."""
    a, b = [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 8]
    for prompt_lengths in ([2, 5], [5, 2]):  # the sorted-first sequence may score less or more of the prefix
        got = estimate_flops(model.config, [a, b], prompt_lengths=prompt_lengths)
        cost = _unit_costs(model)
        head_rows = (7 - 2) + 1  # depths 2..6 of one sequence, plus the other's own last token
        tree = 8 * cost["linear"] + (28 + 7) * cost["pair"] + head_rows * cost["head"]
        assert got["tree_flops"] == tree, prompt_lengths


@pytest.mark.parametrize("copies", [1, 2, 4, 16])
def test_copies_token_ratio(model, copies):
    got = estimate_flops(model.config, [[3, 1, 4, 1, 5, 9, 2, 6]] * copies)
    assert got["token_ratio"] == pytest.approx(1 / copies, rel=1e-12)
    assert got["flops_ratio"] == pytest.approx(1 / copies, rel=1e-12)  # every cost is shared, even the LM head
    assert got["flops_saved"] == pytest.approx(1 - 1 / copies, rel=1e-12, abs=1e-15)


def test_no_sharing_saves_nothing(model):
    got = estimate_flops(model.config, [[1, 2, 3], [2, 3], [3, 4, 5, 6]])
    assert got["tree_flops"] == got["flat_flops"] and got["token_ratio"] == 1.0 and got["flops_saved"] == 0.0


def test_prompt_lengths_of_wrong_length_raise(model):
    with pytest.raises(ValueError, match=r"prompt_lengths has 1 entries for 2 sequences"):
        estimate_flops(model.config, [[1, 2, 3], [1, 2, 4]], prompt_lengths=[1])


def test_padded_tensor_raises(model):
    with pytest.raises(TypeError, match=r"sequences is a tensor.*padded batch"):
        estimate_flops(model.config, torch.tensor([[1, 2, 0], [1, 2, 4]]))


def test_estimate_flops_rejects_empty_sequences():
    from transformers import Qwen3Config

    with pytest.raises(ValueError, match="sequences is empty"):
        estimate_flops(Qwen3Config(), [])


@pytest.mark.parametrize("case", ["grpo", "multiturn", "mixed"])
def test_windowed_and_chunked_layers_count_only_the_keys_they_see(case):
    """Per layer kind, pairs by explicit loops over the dict trie: a window of W sees the last W ancestors-or-self
    (by depth), a chunk of C those in its own chunk of depths."""
    from transformers import Gemma3TextConfig, Llama4TextConfig

    sequences = forest_case(case, 0)
    common = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=128)  # fmt: skip
    window = Gemma3TextConfig(**common, num_hidden_layers=3, sliding_window=3,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention"])  # fmt: skip
    chunk = Llama4TextConfig(**common, num_hidden_layers=2, attention_chunk_size=4,
                             layer_types=["chunked_attention", "full_attention"])  # fmt: skip
    trie = DictTrie()
    for seq in sequences:
        trie.insert(seq)
    for config, sees in ((window, lambda dq, dk: dq - dk < 3), (chunk, lambda dq, dk: dq // 4 == dk // 4)):
        full = estimate_flops(config, sequences)
        plain = estimate_flops(type(config)(**{**config.to_dict(), "layer_types": None, "sliding_window": None,
                                                "attention_chunk_size": None}), sequences)  # fmt: skip
        pair = 4 * config.num_attention_heads * config.head_dim
        layers_cut = sum(t != "full_attention" for t in config.layer_types)
        # Pairs the window / chunk removes, in the flat rows and in the trie, by loops.
        flat_cut = sum(not sees(q, k) for s in sequences for q in range(len(s)) for k in range(q + 1))
        tree_cut = sum(
            not sees(trie.depth[node], trie.depth[anc])
            for node in range(1, trie.num_nodes + 1)
            for anc in trie.ancestors_or_self(node)
        )
        assert plain["flat_flops"] - full["flat_flops"] == layers_cut * flat_cut * pair
        assert plain["tree_flops"] - full["tree_flops"] == layers_cut * tree_cut * pair


def test_gated_deltanet_hybrid_counts_pairs_in_attention_layers_only():
    """Qwen3.5: every nn.Linear of every layer and the depthwise conv per token; the delta-rule scan per token by
    the kernel's chunked form; (query, key) pairs only in the full-attention layers."""
    from helpers import tiny_hybrid_config
    from transformers import AutoModelForCausalLM

    cfg = tiny_hybrid_config("qwen3_5")
    hybrid = AutoModelForCausalLM.from_config(cfg)
    layers = hybrid.model.layers
    linear = sum(2 * m.weight.numel() for layer in layers for m in layer.modules() if type(m).__name__ == "Linear")
    linear += sum(2 * m.weight.numel() for layer in layers for m in layer.modules() if type(m).__name__ == "Conv1d")
    gdn = [layer.linear_attn for layer in layers if hasattr(layer, "linear_attn")]
    full = [layer.self_attn for layer in layers if hasattr(layer, "self_attn")]
    assert len(gdn) == 2 and len(full) == 2
    k_dim, v_dim, chunk = gdn[0].head_k_dim, gdn[0].head_v_dim, 64
    scan = gdn[0].num_v_heads * (chunk * (2 * k_dim + v_dim) + chunk * (k_dim + v_dim) // 2 + 3 * k_dim * v_dim)
    per_token = linear + 2 * len(gdn) * scan
    per_pair = len(full) * cfg.num_attention_heads * 4 * full[0].head_dim
    head = 2 * hybrid.get_output_embeddings().weight.numel()

    p, g, c = 8, 4, 5
    sequences = [list(range(1, p + 1)) + [10 + i] * c for i in range(g)]
    got = estimate_flops(cfg, sequences, prompt_lengths=[p] * g)
    pairs_flat = g * (p + c) * (p + c + 1) // 2
    pairs_tree = p * (p + 1) // 2 + g * sum(t + 1 for t in range(p, p + c))
    assert got["flat_flops"] == g * (p + c) * per_token + pairs_flat * per_pair + g * c * head
    assert got["tree_flops"] == (p + g * c) * per_token + pairs_tree * per_pair + g * c * head
