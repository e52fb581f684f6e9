"""Slow, obvious oracles and tiny seeded fixtures shared by the CPU tests.

- `tiny_config` / `twin_models`: offline 2-layer models of each supported family, built from configs.
- `tiny_hybrid_config` / `hybrid_twin_models`: offline 2–4-layer hybrids (attention + state-carrying layers).
- `forest_case`: seeded random token sequences that exercise every packing edge case.
- `DictTrie`: a per-token Python dict trie — the independent oracle for packing and masks.
- `flat_logprobs`: per-sequence unpacked forwards — the oracle for tree log-probs.
- `run_two_ranks` / `exit_distributed_worker` / `accelerate_fsdp_on_cpu`: tests on 2 gloo processes.
"""

from __future__ import annotations

import copy
import os
import random
import sys

import torch
from transformers import (
    AutoModelForCausalLM,
    BambaConfig,
    FalconH1Config,
    Gemma2Config,
    GemmaConfig,
    GraniteConfig,
    GraniteMoeHybridConfig,
    KimiLinearConfig,
    Lfm2Config,
    Lfm2MoeConfig,
    LlamaConfig,
    NemotronHConfig,
    OlmoHybridConfig,
    Qwen2Config,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3NextConfig,
    Zamba2Config,
)

import hf_tree_attn  # noqa: F401  (registers "tree_flex")


def _newer_config(name: str):
    """A config class of a family newer than some transformers releases (5.17, the GPU machines' image, has none of
    LaraMini, BailingHybrid and Lfm3): the class where the installed release has it, else the calling test is
    skipped with the reason. Imported by name so that this module, which every test imports, loads on any release."""
    import pytest
    import transformers

    config = getattr(transformers, name, None)
    if config is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    return config


VOCAB = 128

# Tolerances, fp32 on CPU, derived from the dtype and the computation — never from what one machine happens to
# produce. Tree and flat (or two kernels) compute the same float expression in a different order; how they round
# depends on the kernel, the SIMD width (AVX2, AVX-512, NEON) and the thread count, so only a bound holds
# everywhere. fp32's spacing at 1.0 is EPS = 2**-23 ≈ 1.19e-7; a sum of n terms of magnitude <= m carries an
# error of at most n * EPS * m (worst case) and about sqrt(n) * EPS * m (random rounding). Masks, packing, layouts
# and leakage are compared exactly (torch.equal) instead: there the math is exact.
EPS = torch.finfo(torch.float32).eps
TOLERANCES = {
    # The package's promise (README): tree log-probs and entropies equal per-sequence forwards to 1e-5 in fp32.
    # A log-prob is z_t - logsumexp(z) over V = 128 logits; in the tiny test models |z| <~ 10, so one rounding of
    # a logit is EPS * 10 ≈ 1.2e-6 and the attention / dot-product sums behind it (64-128 terms) add a few more in
    # random order: ~sqrt(64) * EPS * 10 ≈ 1e-5 at worst. (Seen: <= 3.8e-6 with 1 and 2 threads, AVX-512.)
    "logps_atol": 1e-5,
    # Tree vs flat parameter gradient, per tensor: max |diff| <= this * max |flat grad|. An entry sums the
    # contributions of up to T ≈ 200 tokens (shared rows pre-summed in the tree, per sequence in flat), so the
    # random-rounding error is ~sqrt(T) * EPS ≈ 1.7e-6 of the summed magnitude, per layer; 1e-5 is the same level
    # as the log-prob promise. (Seen: <= 1.3e-6.)
    "grad_max_rel": 1e-5,
    # Cosine of the whole flat gradient vector: a relative error d gives 1 - cos <= d**2 / 2 ≈ 5e-11 at d = 1e-5,
    # so this only catches a wrong direction that per-tensor maxima could hide.
    "grad_cosine": 0.99999,
    # TRL's fused LM head (vocab-tiled online logsumexp) vs the torch head (one logsumexp per row): two
    # algorithms for the same log-softmax, so the log-prob promise applies. With Gemma2's final softcap (30) over
    # temperature 0.9 the logits reach |z| ≈ 33: one rounding is EPS * 33 ≈ 4e-6. (Seen: 1.4e-6 on AVX-512, which
    # failed the former 1e-6.)
    "chunk_atol": 1e-5,
    # The same two heads' parameter gradients, per tensor relative to the largest entry, as grad_max_rel.
    "chunk_max_rel": 1e-5,
    # tree_flex without a tree vs sdpa / eager: the same kernels on the same inputs, identical in practice (seen:
    # 0); the promise still bounds it should an equivalent but reordered path replace one of them.
    "sdpa_atol": 1e-5,
}

FAMILIES = ("llama", "qwen2", "qwen3", "gemma", "gemma2")

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    attention_dropout=0.0,
    initializer_range=0.1,  # sharper than the default 0.02, so a wrong mask moves log-probs far beyond tolerance
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def token_reward(completions, completion_ids, **kwargs) -> list[float]:
    """A GRPO reward that depends on every sampled token: groups get non-zero advantages and gradients (a random
    tiny model almost never copies the letter, so `copy_letter_reward` is 0 for whole runs), and two runs that
    sample differently log different rewards."""
    return [float(sum(ids) % 5) for ids in completion_ids]


def tiny_config(family: str, **overrides):
    """A 2-layer, hidden-64, vocab-128 config of `family` (one of `FAMILIES`)."""
    if family == "llama":
        cfg = LlamaConfig(**_COMMON)
    elif family == "qwen2":
        cfg = Qwen2Config(**_COMMON)
    elif family == "qwen3":
        cfg = Qwen3Config(**_COMMON, head_dim=16)  # Qwen3's default head_dim is 128
    elif family == "gemma":
        cfg = GemmaConfig(**{**_COMMON, "num_key_value_heads": 1}, head_dim=16)  # MQA
    elif family == "gemma2":
        # Softcapping on both attention and final logits; the sliding window is wider than any test sequence.
        cfg = Gemma2Config(**_COMMON, head_dim=16, query_pre_attn_scalar=16, sliding_window=256)
    elif family == "granite":  # multipliers inside the decoder (`logits_scaling` must stay 1 for trees)
        cfg = GraniteConfig(**_COMMON, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2)
    else:
        raise ValueError(f"unknown family {family!r}; use one of {FAMILIES} or 'granite'")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def reference_attn(family: str) -> str:
    """The stock implementation a tree_flex model is compared with (Gemma2 has no SDPA: softcap)."""
    return "eager" if family == "gemma2" else "sdpa"


def tiny_model(family: str, attn_implementation: str = "tree_flex", seed: int = 0, **overrides):
    """Seeded fp32 model in eval mode; the config is deep-copied because `from_config` mutates it."""
    torch.manual_seed(seed)
    cfg = tiny_config(family, **overrides)
    return AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=attn_implementation).eval()


def twin_models(family: str, reference: str | None = None, seed: int = 0, **overrides):
    """`(tree_model, reference_model)` with identical weights: tree_flex vs `reference_attn(family)`."""
    tree = tiny_model(family, "tree_flex", seed, **overrides)
    ref = tiny_model(family, reference or reference_attn(family), seed + 1, **overrides)
    ref.load_state_dict(tree.state_dict())
    return tree, ref


# ----------------------------------------------------------------------------------------------------------------
# Hybrid models: attention layers mixed with layers that carry a state from token to token.

HYBRID_FAMILIES = (
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
    "olmo_hybrid",
    "kimi_linear",
    "lfm2",
    "lfm2_moe",
    "nemotron_h",
    "bamba",
    "granitemoehybrid",
    "falcon_h1",
    "lara_mini",
    "bailing_hybrid",
    "lfm3",
    "zamba2",
)

_HYBRID_COMMON = {**_COMMON, "initializer_range": 0.05, "tie_word_embeddings": False}
_HYBRID_COMMON.pop("num_hidden_layers")
_HYBRID_COMMON.pop("intermediate_size")
_GDN = dict(
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)  # fmt: skip
_LINEAR_FULL = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
_CONV_FULL = ["conv", "full_attention", "conv", "full_attention"]
_MOE = dict(num_experts=4, num_experts_per_tok=2)
_MAMBA2 = dict(
    mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=16
)


def tiny_hybrid_config(family: str):
    """A hidden-64, vocab-128 hybrid of `family` (one of `HYBRID_FAMILIES`): its state-carrying layers (gated delta
    rule, Kimi delta rule, short conv or Mamba-2) before and after full attention; MoE MLPs where the family has them.

    `initializer_range` is 0.05: at 0.1 the 4-layer gated-delta-rule models' fp32 flat forward alone is 1e-5 off its
    float64 value, too close to the tolerance to tell the tree apart from rounding.
    """
    c = _HYBRID_COMMON
    if family == "qwen3_5":
        return Qwen3_5TextConfig(
            **c, **_GDN, intermediate_size=128, num_hidden_layers=4, head_dim=16, layer_types=_LINEAR_FULL
        )
    if family == "qwen3_5_moe":
        return Qwen3_5MoeTextConfig(
            **c, **_GDN, **_MOE, num_hidden_layers=4, head_dim=16, layer_types=_LINEAR_FULL, moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        )  # fmt: skip
    if family == "qwen3_next":
        return Qwen3NextConfig(
            **c, **_GDN, **_MOE, intermediate_size=128, num_hidden_layers=4, head_dim=16, layer_types=_LINEAR_FULL,
            moe_intermediate_size=32, shared_expert_intermediate_size=32,
        )  # fmt: skip
    if family == "olmo_hybrid":
        return OlmoHybridConfig(**c, **_GDN, intermediate_size=128, num_hidden_layers=4, layer_types=_LINEAR_FULL)
    if family == "kimi_linear":  # MLA full attention (kv heads = heads, as in Kimi's checkpoints) + KDA
        return KimiLinearConfig(
            **{**c, "num_key_value_heads": 4}, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            mlp_layer_types=["dense", "sparse", "dense"], num_experts=4, num_experts_per_token=2, kv_lora_rank=16,
            q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, linear_head_dim=16,
            linear_num_heads=4, linear_conv_kernel_dim=4,
        )  # fmt: skip
    if family == "lfm2":
        return Lfm2Config(
            **c, intermediate_size=128, num_hidden_layers=4, layer_types=_CONV_FULL, conv_L_cache=3,
            block_auto_adjust_ff_dim=False,
        )  # fmt: skip
    if family == "lfm2_moe":
        return Lfm2MoeConfig(
            **c, **_MOE, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4, layer_types=_CONV_FULL,
            conv_L_cache=3, num_dense_layers=1,
        )  # fmt: skip
    if family == "nemotron_h":
        return NemotronHConfig(
            **c, intermediate_size=128, layers_block_type=["linear_attention", "full_attention", "mlp", "moe"],
            head_dim=16, ssm_state_size=16, mamba_num_heads=4, mamba_head_dim=16, n_groups=2, conv_kernel=4,
            chunk_size=16, n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=32, num_experts_per_tok=2,
        )  # fmt: skip
    if family == "bamba":
        return BambaConfig(**c, **_MAMBA2, intermediate_size=128, num_hidden_layers=3, attn_layer_indices=[1])
    if family == "granitemoehybrid":  # with Granite's multipliers (logits_scaling must stay 1 for trees)
        return GraniteMoeHybridConfig(
            **c, **_MAMBA2, intermediate_size=128, num_hidden_layers=3,
            layer_types=["linear_attention", "attention", "linear_attention"], num_local_experts=4,
            num_experts_per_tok=2, shared_intermediate_size=64, embedding_multiplier=2.0, residual_multiplier=0.5,
            attention_multiplier=0.2,
        )  # fmt: skip
    if family == "falcon_h1":  # attention and Mamba-2 side by side in every layer
        return FalconH1Config(**c, **_MAMBA2, intermediate_size=128, num_hidden_layers=2, head_dim=16, mamba_d_ssm=128)
    if family == "lara_mini":  # gated delta rule, sliding and full attention, MoE MLPs
        return _newer_config("LaraMiniConfig")(
            **c, **_GDN, **_MOE, num_hidden_layers=4, head_dim=16, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, sliding_window=4,
            layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"],
        )  # fmt: skip
    if family == "bailing_hybrid":  # Kimi delta rule + MLA full attention, a dense then an MoE MLP
        return _newer_config("BailingHybridConfig")(
            **{**c, "num_key_value_heads": 4}, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            mlp_layer_types=["dense", "sparse", "dense"], num_local_experts=4, num_experts_per_tok=2, n_group=1,
            topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=16, head_dim=16,
        )  # fmt: skip
    if family == "lfm3":  # short convs, full and sliding attention
        return _newer_config("Lfm3Config")(
            **c, intermediate_size=128, num_hidden_layers=4, head_dim=16, conv_L_cache=3, sliding_window=4,
            layer_types=["conv", "full_attention", "conv", "sliding_attention"],
        )  # fmt: skip
    if family == "zamba2":  # Mamba-2 layers and a hybrid layer (the shared attention block, then Mamba-2)
        return Zamba2Config(
            **c, intermediate_size=128, num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "mamba"],
            mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=2, n_mamba_heads=4, chunk_size=16,
            attention_head_dim=16, use_mem_rope=True,
        )  # fmt: skip
    raise ValueError(f"unknown hybrid family {family!r}; use one of {HYBRID_FAMILIES}")


def hybrid_twin_models(family: str, seed: int = 0):
    """`(tree_model, eager_model)` of `tiny_hybrid_config(family)` with identical weights, fp32, eval mode.

    Decay rates `A` are re-drawn from [0.01, 2]: transformers' random init reaches A = 16, where a head forgets its
    state within a token and the gradient of `A_log` / `dt_bias` is fp32 rounding in the *flat* forward too (changing
    the flat kernel's chunk size moves it by ~1e-3). The exactness of the scans for any decay is tested at kernel
    level, in float64, in test_recurrent.py.
    """
    torch.manual_seed(seed)
    cfg = tiny_hybrid_config(family)
    tree = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="tree_flex").eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in tree.named_parameters():
            if name.endswith("A_log"):
                decay = torch.empty(param.shape).uniform_(0.01, 2.0, generator=generator)
                param.copy_(decay.log())
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    ref.load_state_dict(tree.state_dict())
    return tree, ref


# ----------------------------------------------------------------------------------------------------------------
# Random forests. Every generator is seeded and returns list[list[int]] with tokens in [1, VOCAB).


def _tokens(rng: random.Random, n: int, vocab: int = VOCAB) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]


def grpo_groups(
    rng: random.Random, groups: int = 2, max_prompt: int = 12, max_completion: int = 10
) -> list[list[int]]:
    """Groups of completions of one prompt; completions also branch off each other at random depths."""
    out = []
    for _ in range(groups):
        prompt = _tokens(rng, rng.randint(1, max_prompt))
        completions: list[list[int]] = []
        for _ in range(rng.randint(2, 5)):
            if completions and rng.random() < 0.5:
                base = rng.choice(completions)
                comp = base[: rng.randint(0, len(base))] + _tokens(rng, rng.randint(1, max_completion))
            else:
                comp = _tokens(rng, rng.randint(1, max_completion))
            completions.append(comp)
        out += [prompt + c for c in completions]
    return out


def identical_copies(rng: random.Random, copies: int = 4) -> list[list[int]]:
    seq = _tokens(rng, rng.randint(2, 15))
    return [list(seq) for _ in range(copies)] + [_tokens(rng, rng.randint(2, 10))]


def prefix_of_another(rng: random.Random) -> list[list[int]]:
    """A sequence, several of its prefixes (incl. length 1 and the full sequence twice), and an extension."""
    seq = _tokens(rng, rng.randint(6, 20))
    cut = rng.randint(2, len(seq) - 2)
    return [seq, seq[:1], seq[:cut], seq + _tokens(rng, 3), list(seq), seq[:cut] + _tokens(rng, 2)]


def single_tokens(rng: random.Random) -> list[list[int]]:
    """1-token sequences: duplicates, and one equal to the first token of a longer sequence."""
    long = _tokens(rng, rng.randint(3, 9))
    t = rng.randrange(1, VOCAB)
    return [[t], [t], [long[0]], long, [rng.randrange(1, VOCAB)]]


def multiturn(rng: random.Random, turns: int = 5, system: int = 10) -> list[list[int]]:
    """Agent samples: each is the whole history up to a turn plus one of several branching responses.

    The history keeps a *shortened* response (like a dropped `<think>` block), so each turn also branches away
    from the previous turn's sample.
    """
    history = _tokens(rng, rng.randint(1, system))
    samples = []
    for _ in range(turns):
        history = history + _tokens(rng, rng.randint(1, 4))  # user / tool message
        responses = [_tokens(rng, rng.randint(1, 6)) for _ in range(rng.randint(1, 3))]
        samples += [history + r for r in responses]
        kept = rng.choice(responses)
        history = history + kept[rng.randint(0, len(kept) - 1) :]
    return samples


def no_sharing(rng: random.Random, n: int = 5) -> list[list[int]]:
    firsts = rng.sample(range(1, VOCAB), n)
    return [[f] + _tokens(rng, rng.randint(0, 12)) for f in firsts]


FOREST_CASES = ("grpo", "identical", "prefix", "single_token", "multiturn", "no_sharing", "mixed")


def forest_case(name: str, seed: int) -> list[list[int]]:
    """Seeded sequences for one named edge case; `"mixed"` is all of them shuffled together (several tries)."""
    rng = random.Random(f"{name}-{seed}")
    makers = {
        "grpo": lambda: grpo_groups(rng),
        "identical": lambda: identical_copies(rng),
        "prefix": lambda: prefix_of_another(rng),
        "single_token": lambda: single_tokens(rng),
        "multiturn": lambda: multiturn(rng),
        "no_sharing": lambda: no_sharing(rng),
    }
    if name == "mixed":
        seqs = [s for make in makers.values() for s in make()]
        rng.shuffle(seqs)
        return seqs
    return makers[name]()


# ----------------------------------------------------------------------------------------------------------------
# The per-token dict trie oracle.


class DictTrie:
    """A prefix trie with one node per token, built by plain Python dict lookups (node 0 is the empty root)."""

    def __init__(self):
        self.children: list[dict[int, int]] = [{}]
        self.parent: list[int] = [-1]
        self.token: list[int] = [-1]
        self.depth: list[int] = [-1]

    def insert(self, seq) -> list[int]:
        """Node ids of the tokens of `seq`, root to leaf; new nodes are created as needed."""
        node, path = 0, []
        for tok in seq:
            tok = int(tok)
            child = self.children[node].get(tok)
            if child is None:
                child = len(self.token)
                self.children[node][tok] = child
                self.children.append({})
                self.parent.append(node)
                self.token.append(tok)
                self.depth.append(self.depth[node] + 1)
            node = child
            path.append(node)
        return path

    @property
    def num_nodes(self) -> int:
        """Token nodes (the empty root excluded) = unique trie tokens."""
        return len(self.token) - 1

    def ancestors_or_self(self, node: int) -> list[int]:
        out = []
        while node > 0:
            out.append(node)
            node = self.parent[node]
        return out


def trie_node_count(sequences) -> int:
    trie = DictTrie()
    for seq in sequences:
        trie.insert(seq)
    return trie.num_nodes


def oracle_row_nodes(forest, sequences) -> tuple[DictTrie, dict[int, int]]:
    """Map each real row of `forest` to its dict-trie node, asserting the map is a bijection onto the trie.

    Uses only `forest.positions(k)` and the raw sequences: a row must hold the same trie node for every sequence
    that passes through it, and no trie node may occupy two rows.
    """
    trie = DictTrie()
    row_node: dict[int, int] = {}
    node_row: dict[int, int] = {}
    for k, sid in enumerate(forest.seq_ids):
        nodes = trie.insert(sequences[sid])
        rows = forest.positions(k).tolist()
        assert len(rows) == len(nodes), f"sequence {sid}: {len(rows)} positions for {len(nodes)} tokens"
        for row, node in zip(rows, nodes):
            assert row_node.setdefault(row, node) == node, f"row {row} holds two different trie nodes"
            assert node_row.setdefault(node, row) == row, f"trie node {node} laid out in two rows"
    return trie, row_node


def oracle_segments(forest, sequences) -> tuple[list[int], list[int], list[int]]:
    """`(segment_starts, segment_parent, segment_level)` by walking the dict trie row by row.

    A row starts a segment iff its trie parent is the empty root or has two or more children; a segment's level
    counts the strict trie ancestors of its first row that have two or more children.
    """
    trie, row_node = oracle_row_nodes(forest, sequences)
    node_row = {n: r for r, n in row_node.items()}
    starts, parents, levels = [], [], []
    segment_of_row = {}
    for row in range(forest.num_tree_tokens):
        up = trie.parent[row_node[row]]
        if up == 0 or len(trie.children[up]) >= 2:
            starts.append(row)
            parents.append(-1 if up == 0 else segment_of_row[node_row[up]])
            levels.append(sum(len(trie.children[a]) >= 2 for a in trie.ancestors_or_self(up)))
        segment_of_row[row] = len(starts) - 1
    return starts + [forest.num_tree_tokens], parents, levels


def oracle_mask(forest, sequences) -> torch.Tensor:
    """`(S, S)` bool ancestor-or-self mask built by Python loops over the dict trie; padding rows see themselves."""
    trie, row_node = oracle_row_nodes(forest, sequences)
    node_row = {n: r for r, n in row_node.items()}
    size = forest.seq_len
    mask = torch.zeros(size, size, dtype=torch.bool)
    for q in range(size):
        if q in row_node:
            for node in trie.ancestors_or_self(row_node[q]):
                mask[q, node_row[node]] = True
        else:
            mask[q, q] = True
    return mask


# ----------------------------------------------------------------------------------------------------------------
# The flat per-sequence log-prob oracle.


def flat_logprobs(model, seq, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`(logps, entropies)`, each `(L - 1,)` fp32 (float64 for a float64 model), from one plain unpacked forward of
    `seq`."""
    ids = torch.as_tensor(seq, dtype=torch.long, device=next(model.parameters()).device)[None]
    logits = model(ids).logits[0, :-1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    logp = logits.log_softmax(-1)
    logps = logp.gather(-1, ids[0, 1:, None])[:, 0]
    entropy = -(logp.exp() * logp).sum(-1)
    return logps, entropy


def save_toy_model(path, model_type: str = "qwen3"):
    """The toy task's `model_type` model (seed 0) and tokenizer saved at `path`, where a trainer loads them from;
    returns `path`."""
    from trainers import toy_task

    tokenizer = toy_task.build_tokenizer()
    toy_task.build_model(tokenizer, seed=0, model_type=model_type).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def run_two_ranks(script: str, *args, timeout: int = 600, **env: str) -> None:
    """Run `script` (a test file whose `__main__` is the worker) under `torch.distributed.run` on 2 local processes,
    from the repository root, offline, one thread each, the repository and `tests/` importable, `env` added; fail
    with the tail of its output."""
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    environ = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", OMP_NUM_THREADS="1", **env)
    environ["PYTHONPATH"] = os.pathsep.join([str(repo), str(repo / "tests")])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script]
    result = subprocess.run(
        [*command, *map(str, args)], cwd=repo, env=environ, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def exit_distributed_worker() -> None:
    """End a CPU (gloo) DDP worker once its results are written, without freeing its trainers.

    Freeing DDP's reducer joins gloo's worker thread while holding the GIL, and that thread may still need the GIL
    to free its last allgather's tensors: an intermittent deadlock in PyTorch's CPU teardown, after every result is
    written.
    """
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


def accelerate_fsdp_on_cpu() -> None:
    """Let accelerate run FSDP in this CPU (gloo) process, as it does on GPUs.

    Accelerate turns an FSDP plugin into `DistributedType.FSDP` only on GPU-like devices; on CPU it stays
    `MULTI_CPU` and wraps the model in DDP. After its state initialises with a plugin on CPU, this sets the type it
    records (and the one `PartialState` shares) to FSDP, so `Accelerator.prepare` runs its own FSDP preparation
    (FSDP2: `fully_shard` of each decoder layer, then the root) and transformers' trainer its FSDP paths. Call it
    in the worker before any trainer is built.
    """
    from accelerate import state
    from accelerate.utils import DistributedType

    init = state.AcceleratorState.__init__

    def fsdp_init(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    state.AcceleratorState.__init__ = fsdp_init
