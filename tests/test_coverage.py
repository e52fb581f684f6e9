"""The coverage matrix: every causal-LM family of the installed transformers is exact on trees or refused.

For each entry of transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`:

- listed in `hf_tree_attn.support.EXACT_FAMILIES`: a tiny fp32 model of the family (1-6 layers, hidden 64, vocab 128,
  windows and chunks of 4 tokens, MoE, MLA, softcaps, sinks and logit multipliers switched on where the family has
  them) scores a packed forest with `tree_flex`; every sequence's log-probs and entropies equal a per-sequence
  `eager` forward of the same weights to 1e-5, the features its table entry names are really exercised, and an
  ordinary left-padded forward and greedy `generate` of the `tree_flex` model equal the stock implementation;
- listed in `REFUSED_FAMILIES`: the gate refuses it with that reason, and a `tree_flex` model of a family whose
  attention bypasses `AttentionInterface` refuses ordinary forwards instead of silently misreading the mask;
- listed nowhere: the test fails (a transformers upgrade that adds a family must decide its row).

`docs/coverage.md` carries the same table; `test_docs_table_is_current` checks it and
`python -c "import hf_tree_attn.support as s; s.write_coverage_table('docs/coverage.md')"` regenerates it.
"""

from __future__ import annotations

import copy
import os
import random
import traceback
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from helpers import HYBRID_FAMILIES, TOLERANCES, tiny_hybrid_config, token_reward
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import hf_tree_attn.masks
import hf_tree_attn.support
from hf_tree_attn import sequence_logprobs
from hf_tree_attn.logprobs import lm_head_logprobs
from hf_tree_attn.recurrent import TREE_LAYERS
from hf_tree_attn.support import (
    EXACT_FAMILIES,
    REFUSED_FAMILIES,
    config_support_error,
    coverage_markdown,
    logit_scale,
    tree_support_error,
)
from hf_tree_attn.transformers_compat import TRANSFORMERS_CHECKED

ATOL = TOLERANCES["logps_atol"]
FAMILIES = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
WINDOW = 4  # sliding windows and chunks, shorter than most test sequences

# ----------------------------------------------------------------------------------------------------------------
# Tiny configs, built from each family's default config.

_SIZES = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    vocab_size=128, max_position_embeddings=256, moe_intermediate_size=32, num_experts=4, num_local_experts=4,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, shared_expert_intermediate_size=32,
    moe_topk=2, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1,
    topk_group=1, first_k_dense_replace=1, index_head_dim=16, index_n_heads=2, index_topk=8, rotary_dim=8,
    n_embd=64, n_head=4, n_positions=256, n_inner=128, num_heads=4, d_model=64, ffn_dim=128, emb_dim=64, d_head=16,
    vocab_size_per_layer_input=128, hidden_size_per_layer_input=16, expert_ffn_hidden_size=32, zero_expert_num=2,
    ffn_hidden_size=128, encoder_hash_byte_group_vocab=64,
    initializer_range=0.1, router_aux_loss_coef=0.01, tie_word_embeddings=False,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
_NO_DROPOUT = ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
               "hidden_dropout_prob", "attention_probs_dropout_prob", "residual_dropout")  # fmt: skip
# Switched on with values that bite, where the family's default config has the field set.
_FEATURES = dict(
    sliding_window=WINDOW, attention_chunk_size=WINDOW, logit_scale=0.7, logits_scaling=3.0,
    final_logit_softcapping=2.0, attn_logit_softcapping=5.0, lm_head_multiplier=0.6, output_multiplier=0.8,
)  # fmt: skip
_LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_LAYER_INDEX_LISTS = ("moe_layers", "mlp_only_layers", "full_attn_idxs")
_OPAQUE_SUBCONFIGS = ("per_layer_config", "attn_config", "ffn_config")

_GEMMA3N_TEXT = dict(
    num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
    activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0], vocab_size_per_layer_input=128, hidden_size_per_layer_input=16,
)  # fmt: skip
# Gemma 4 drafters: their default config does not validate; every layer reads the target model's cache.
_DRAFTERS = ("gemma4_assistant", "gemma4_unified_assistant")
_DRAFTER_TEXT = dict(
    hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, enable_moe_block=False, use_double_wide_mlp=False,
    num_hidden_layers=2, num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention"],
)  # fmt: skip
# Where the generic shrinking is not enough (each family's validators, or a feature to switch on).
OVERRIDES = {
    "dbrx": dict(
        d_model=64, n_heads=4, n_layers=2, max_seq_len=256,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},  # its default config does not build
        ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
    ),
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "hrm_text": dict(num_layers_per_stack=1, H_cycles=1, L_cycles=1, L_bp_cycles=[1], num_hidden_layers=2),
    "gemma3n_text": _GEMMA3N_TEXT,
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "llama4_text": dict(no_rope_layers=[1, 0], attn_temperature_tuning=True, floor_scale=2),
    "llama4": dict(text_config=dict(no_rope_layers=[1, 0], attn_temperature_tuning=True, floor_scale=2)),
    "dory": dict(
        n_input_layers=2, n_recurrent_layers=2, n_output_layers=2, num_hidden_layers=6, n_recurrent_loops=2,
        layer_types=["sliding_attention", "mlp", "full_attention", "mlp", "sliding_attention", "full_attention"],
    ),
    "dots3_note": dict(head_dim=16),
    "dots3_note_text": dict(head_dim=16),
    **dict.fromkeys(_DRAFTERS, dict(text_config=_DRAFTER_TEXT)),
    "reformer": dict(is_decoder=True, axial_pos_shape=[16, 16], axial_pos_embds_dim=[32, 32]),
    "zaya": dict(num_experts_per_tok=1),
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=1),  # hidden 64 x expand 2 = heads x head_dim
}  # fmt: skip


def _pick_layers(config: dict) -> tuple[int | None, list[int]]:
    """The first layer of each distinct per-layer pattern (layer type, MLP type, …), at least two, at most four."""
    count = next((config[k] for k in _LAYER_COUNT_KEYS if isinstance(config.get(k), int)), None)
    if not count:
        return None, []
    per_layer = [
        k for k, v in config.items() if isinstance(v, list) and len(v) == count and k not in _LAYER_INDEX_LISTS
    ]
    seen, keep = set(), []
    for i in range(count):
        signature = tuple(repr(config[k][i]) for k in per_layer) + tuple(
            i in config[k] for k in _LAYER_INDEX_LISTS if isinstance(config.get(k), list)
        )
        if signature not in seen:
            seen.add(signature)
            keep.append(i)
    if len(keep) < 2 <= count:
        keep = sorted(set(keep) | {0, 1})
    return count, keep[:4]


def _shrink(config: dict) -> dict:
    count, keep = _pick_layers(config)
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and key.endswith("config") and key not in _OPAQUE_SUBCONFIGS:
            value = _shrink(value)
        elif key in _SIZES:
            value = _SIZES[key]
        elif key in _NO_DROPOUT and isinstance(value, float):
            value = 0.0
        elif key in _FEATURES and (value is not None or key == "sliding_window"):
            value = _FEATURES[key]  # a window also where the default has none: some families apply it when set
        elif count and key in _LAYER_COUNT_KEYS:
            value = len(keep)
        elif count and isinstance(value, list) and len(value) == count and key not in _LAYER_INDEX_LISTS:
            value = [value[i] for i in keep]
        elif count and key in _LAYER_INDEX_LISTS and isinstance(value, list):
            value = [keep.index(i) for i in value if i in keep]
        elif count and isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
            value = {keep.index(int(k)): v for k, v in value.items() if int(k) in keep}
        out[key] = value
    if config.get("use_sliding_window") is not None:  # Qwen2-style: a window on the layers from max_window_layers on
        out.update(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
        out.pop("layer_types", None)
    if "qk_rope_head_dim" in out:  # MLA: RoPE on qk_rope_head_dim dims, one KV head per query head
        out.update(head_dim=out["qk_rope_head_dim"], num_key_value_heads=out.get("num_attention_heads", 4))
        if "qk_head_dim" in out:
            out["qk_head_dim"] = out["qk_rope_head_dim"] + out["qk_nope_head_dim"]
    return out


def _merge(config: dict, overrides: dict) -> None:
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict) and key.endswith("config"):
            _merge(config[key], value)
        else:
            config[key] = value


# Hybrids (state-carrying layers before and after attention): the configs of tests/helpers.py, which
# test_recurrent.py checks in depth; a multimodal family wraps its text config.
_HYBRID_OF = {**{f: f for f in HYBRID_FAMILIES}, "qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}


def tiny_config(model_type: str):
    """A small, seeded-init config of `model_type` with its special features switched on (see the module doc)."""
    config_class = CONFIG_MAPPING[model_type]
    if model_type in _HYBRID_OF:
        text = tiny_hybrid_config(_HYBRID_OF[model_type])
        for key, value in _FEATURES.items():  # logit multipliers (Falcon-H1) and windows, where the family has them
            if getattr(text, key, None) is not None:
                setattr(text, key, value)
        return text if type(text) is config_class else config_class(text_config=text.to_dict())
    base = {"text_config": _DRAFTER_TEXT} if model_type in _DRAFTERS else {}  # their defaults do not validate
    values = _shrink(config_class(**base).to_dict())
    _merge(values, copy.deepcopy(OVERRIDES.get(model_type, {})))
    for key in ("model_type", "transformers_version", "architectures"):
        values.pop(key, None)
    return config_class(**values)


def _models(model_type: str, reference: str, config=None, dtype: torch.dtype | None = None):
    """`(tree_flex model, `reference` model)` with identical fp32 weights, in eval mode.

    Every parameter is jittered after init, as training would move it: parameters initialised to a constant (sinks
    at 0, norms and learned logit scales at 1) must not hide a difference. `config` (default: `tiny_config`) and
    `dtype` (default: float32; another keeps the modules the family keeps in float32) change what is built.
    """
    config = tiny_config(model_type) if config is None else config
    torch.manual_seed(0)
    tree = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="tree_flex", dtype=dtype)
    tree = (tree if dtype else tree.float()).eval()
    with torch.no_grad():
        for name, param in tree.named_parameters():
            param.add_(0.05 * torch.randn_like(param))
            if name.endswith("A_log"):  # decay rates as in tests/helpers.hybrid_twin_models (A in [0.01, 2])
                param.copy_(torch.empty_like(param).uniform_(0.01, 2.0).log())
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=reference, dtype=dtype)
    ref = (ref if dtype else ref.float()).eval()
    ref.load_state_dict(tree.state_dict())
    return tree, ref


def _stock(model) -> str:
    """The implementation a `tree_flex` model must match on ordinary inputs: sdpa, or eager where there is none."""
    return "sdpa" if model._supports_sdpa else "eager"


# ----------------------------------------------------------------------------------------------------------------
# Inputs


def _sequences() -> list[list[int]]:
    """Two tries (a branching prompt group, a chain with its prefix), deeper than WINDOW, plus a 1-token sequence."""
    rng = random.Random(0)

    def tokens(n):
        return [rng.randrange(3, 128) for _ in range(n)]

    prompt = tokens(7)
    seqs = [prompt + tokens(6), prompt + tokens(3), prompt[:1] + tokens(2)]
    seqs += [seqs[0][:9] + tokens(4), list(seqs[1])]
    chain = tokens(11)
    return seqs + [chain, chain[:5], tokens(1)]


def _flat(model, seq) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([seq])
    logp = model(ids, use_cache=False).logits[0, :-1].float().log_softmax(-1)
    return logp.gather(-1, ids[0, 1:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def _left_padded() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :4], mask[2, :7] = 0, 0
    return ids.masked_fill(mask == 0, 0), mask


# ----------------------------------------------------------------------------------------------------------------
# What an EXACT_FAMILIES note claims, checked on the tiny model.


class _MaskRecorder:
    """Records the kinds of layer masks a tree forward built that cut the tree: "window" or "chunk"."""

    def __init__(self, monkeypatch):
        self.kinds = set()
        original = hf_tree_attn.masks.TreeMaskSource.mask

        def mask(source, mask_function, use_vmap=False):
            built = original(source, mask_function, use_vmap)
            if source.dense and not torch.equal(built, hf_tree_attn.masks.dense_tree_mask(source.subtree_end)):
                # Positions 3 and 4 share a window of 4 but not a chunk of 4.
                adjacent = bool(mask_function(torch.tensor(0), torch.tensor(0), torch.tensor(4), torch.tensor(3)))
                self.kinds.add("window" if adjacent else "chunk")
            return built

        monkeypatch.setattr(hf_tree_attn.masks.TreeMaskSource, "mask", mask)


def _has_state_kind(model, kind: str) -> bool:
    """The model holds a state-carrying layer of `kind` that `hf_tree_attn.recurrent` runs segment by segment."""
    return any(TREE_LAYERS.get(f"{type(m).__module__}.{type(m).__qualname__}") == kind for m in model.modules())


def _has_moe(model) -> bool:
    return any("expert" in name.lower() for name, _ in model.named_modules())


_CLAIMS = {
    "sliding window": lambda cfg, model, rec: "window" in rec.kinds,
    "chunked attention": lambda cfg, model, rec: "chunk" in rec.kinds,
    "MoE": lambda cfg, model, rec: _has_moe(model),
    "MLA": lambda cfg, model, rec: getattr(cfg.get_text_config(), "kv_lora_rank", None) is not None,
    "attention sinks": lambda cfg, model, rec: any(n.endswith("sinks") for n, _ in model.named_parameters()),
    "attention softcap": lambda cfg, model, rec: getattr(cfg.get_text_config(), "attn_logit_softcapping", None),
    "final softcap": lambda cfg, model, rec: getattr(cfg.get_text_config(), "final_logit_softcapping", None),
    "logit scale": lambda cfg, model, rec: logit_scale(cfg) != 1.0,
    "gated delta rule": lambda cfg, model, rec: _has_state_kind(model, "gated_delta_rule"),
    "Kimi delta rule": lambda cfg, model, rec: _has_state_kind(model, "kimi_delta_rule"),
    "Mamba-2": lambda cfg, model, rec: _has_state_kind(model, "mamba2"),
    "short conv": lambda cfg, model, rec: _has_state_kind(model, "short_conv"),
}


def _claims(model_type: str) -> list[str]:
    return [c for c in EXACT_FAMILIES[model_type].split(", ") if c in _CLAIMS]


# ----------------------------------------------------------------------------------------------------------------
# The matrix


def test_every_family_is_listed_once():
    listed = set(EXACT_FAMILIES) | set(REFUSED_FAMILIES)
    assert not set(EXACT_FAMILIES) & set(REFUSED_FAMILIES)
    unlisted = sorted(set(FAMILIES) - listed)
    assert not unlisted, f"families of transformers {transformers.__version__} listed nowhere: {unlisted}"
    assert not listed - set(FAMILIES), (
        f"listed families transformers {transformers.__version__} does not have: {sorted(listed - set(FAMILIES))}"
    )


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one thread is several times faster than two on a busy 2-core machine (no spinning)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("model_type", [f for f in FAMILIES if f in EXACT_FAMILIES])
def test_exact_family(model_type, monkeypatch):
    recorder = _MaskRecorder(monkeypatch)
    tree, ref = _models(model_type, "eager")
    assert tree_support_error(tree) is None
    sequences = _sequences()
    with torch.no_grad():
        logps, entropies = sequence_logprobs(tree, sequences, return_entropy=True)
        for i, seq in enumerate(sequences):
            want_logps, want_entropy = _flat(ref, seq)
            torch.testing.assert_close(logps[i], want_logps, atol=ATOL, rtol=0, msg=lambda m, i=i: f"seq {i}: {m}")
            torch.testing.assert_close(entropies[i], want_entropy, atol=ATOL, rtol=0, msg=lambda m, i=i: f"{i}: {m}")
    for claim in _claims(model_type):
        assert _CLAIMS[claim](tree.config, tree, recorder), f"{model_type}: the tiny model does not exercise {claim!r}"

    # Ordinary inputs: tree_flex is the stock implementation (sdpa, or eager where the family has none).
    ref.set_attn_implementation(_stock(ref))
    ids, mask = _left_padded()
    with torch.no_grad():
        got, want = tree(input_ids=ids, attention_mask=mask).logits, ref(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=ATOL, rtol=0)
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(tree.generate(ids, **kwargs), ref.generate(ids, **kwargs))


# One family per feature: sliding window (+ full layers), chunks + NoPE temperature, MoE, MLA, sinks, softcaps,
# logit scale, Granite's multipliers.
GRADIENT_FAMILIES = ["mistral", "gemma3_text", "llama4_text", "qwen3_moe", "deepseek_v3", "gpt_oss", "vaultgemma",
                     "cohere2", "granite"]  # fmt: skip


@pytest.mark.parametrize("model_type", GRADIENT_FAMILIES)
def test_gradients_match_flat(model_type):
    """Every parameter's gradient of a weighted sum of tree log-probs equals the per-sequence flat one."""
    tree, ref = _models(model_type, "eager")
    tree.train(), ref.train()  # dropout is 0: train mode only switches the models' training code paths
    sequences = _sequences()
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(len(s) - 1, generator=g) for s in sequences]
    logps = sequence_logprobs(tree, sequences)
    sum((w * lp).sum() for w, lp in zip(weights, logps)).backward()
    sum((w * _flat(ref, s)[0]).sum() for w, s in zip(weights, sequences)).backward()
    flat_grads = {name: p.grad for name, p in ref.named_parameters() if p.grad is not None}
    tree_grads = {name: p.grad for name, p in tree.named_parameters() if p.grad is not None}
    assert tree_grads.keys() == flat_grads.keys() and flat_grads
    for name, want in flat_grads.items():
        worst = (tree_grads[name] - want).abs().max().item()
        assert worst <= TOLERANCES["grad_max_rel"] * want.abs().max().item() + 1e-9, f"{name}: {worst}"


def _one_grpo_step(model_type: str, tmp_path: Path, tree_packing) -> tuple[dict, bool]:
    """One `TreeGRPOTrainer` step with TRL's defaults (gradient checkpointing where the model supports it,
    `tree_recompute="auto"`) on the family's tiny model, seeded: `(logged metrics, gradient checkpointing on)`."""
    from datasets import Dataset

    from hf_tree_attn.trainer import TreeGRPOConfig, TreeGRPOTrainer
    from trainers import toy_task

    tokenizer = toy_task.build_tokenizer()
    dataset = Dataset.from_dict({"prompt": ["a shared prefix, letter: a", "a shared prefix, letter: b"] * 2,
                                 "target": ["a", "b"] * 2})  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type), attn_implementation="tree_flex")
    args = TreeGRPOConfig(
        output_dir=str(tmp_path / str(tree_packing)), use_cpu=True, bf16=False, per_device_train_batch_size=4,
        num_generations=4, max_completion_length=4, max_steps=1, logging_steps=1, report_to="none",
        save_strategy="no", disable_tqdm=True, gradient_checkpointing=model.supports_gradient_checkpointing,
        tree_packing=tree_packing, seed=0,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = TreeGRPOTrainer(model, token_reward, args, train_dataset=dataset,
                                  processing_class=tokenizer)  # fmt: skip
        trainer.train()
    return trainer.state.log_history[0], model.supports_gradient_checkpointing


@pytest.mark.parametrize("model_type", [f for f in FAMILIES if f in EXACT_FAMILIES])
def test_tree_trainer_step_matches_flat(model_type, tmp_path):
    """Every accepted family trains one GRPO step on the tree (`tree_fallback` 0) with TRL's flat step's loss and
    gradient norm (`tree_packing=False`, same seed, same completions). 24 accepted families crashed here before
    (the FLOP estimate read `intermediate_size` — GPT-2, OPT, DBRX, Qwen3.5-MoE, … — and a global `head_dim` —
    Gemma 4 —, the MoE loss `num_experts` — Llama 4, Granite-MoE), and Gemma 3n's gradients were NaN (zero
    padding rows)."""
    tree, checkpointing = _one_grpo_step(model_type, tmp_path, True)
    assert tree["tree_fallback"] == 0, tree
    assert torch.isfinite(torch.tensor([tree["loss"], tree["grad_norm"]])).all(), tree
    assert tree["grad_norm"] > 0, tree  # the comparison below is not vacuous
    if checkpointing:
        assert 0 <= tree["tree_checkpointed_layers"] <= 1, tree
    try:
        flat, _ = _one_grpo_step(model_type, tmp_path, False)
    except AttributeError as error:  # TRL's own flat path cannot run the family: nothing to compare with (its
        # fused LM head reads `num_experts`, which Llama 4 / Granite-MoE / PhiMoE call `num_local_experts`, and a
        # backbone's `last_hidden_state`, which Llama 4's and Mllama's `get_decoder()` does not return)
        trl, ours = f"{os.sep}trl{os.sep}", f"{os.sep}hf_tree_attn{os.sep}"
        frames = [
            f.filename for f in traceback.extract_tb(error.__traceback__) if trl in f.filename or ours in f.filename
        ]
        assert trl in frames[-1], error  # raised under TRL's code, not ours
        return
    assert tree["loss"] == pytest.approx(flat["loss"], abs=TOLERANCES["logps_atol"])
    assert tree["grad_norm"] == pytest.approx(flat["grad_norm"], rel=TOLERANCES["grad_max_rel"])


def test_refused_model_given_on_tree_flex_falls_back_or_fails_at_init(tmp_path):
    """`tree_packing="auto"` with a refused model already loaded on `tree_flex`: one that can switch back trains on
    TRL's flat path (its stock attention); one that cannot (Bloom: its attention bypasses the interface, so its
    ordinary forwards refuse `tree_flex`) fails at init with the way out, not at the first generation."""
    logged, _ = _one_grpo_step("bart", tmp_path, "auto")
    assert logged["tree_fallback"] == 1, logged
    with pytest.raises(ValueError, match="cannot switch implementation after loading.*attn_implementation='eager'"):
        _one_grpo_step("bloom", tmp_path, "auto")


def _forced_tree_error(tree, ref, monkeypatch) -> float:
    """Worst |tree - flat| log-prob of the tree forward with the gate switched off (inf if it raises)."""
    monkeypatch.setattr(hf_tree_attn.support, "config_support_error", lambda *args, **kwargs: None)
    monkeypatch.setattr(hf_tree_attn.support, "tree_support_error", lambda *args, **kwargs: None)
    sequences = _sequences()
    try:
        with torch.no_grad():
            logps = sequence_logprobs(tree, sequences)
            return max((logps[i] - _flat(ref, s)[0]).abs().max().item() for i, s in enumerate(sequences) if len(s) > 1)
    except Exception:  # noqa: BLE001 - any failure is a refusal too; the point is that it is not silently exact
        return float("inf")


def _bf16_head_error(model_type: str) -> float:
    """Worst |tree head - model head| log-prob of a bfloat16 model on the same final hidden states (inf if the tree
    head raises)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = _models(model_type, "eager", dtype=torch.bfloat16)
    norm = model.get_decoder().norm.weight  # the dtype the final hidden states come in (kept float32 or not)
    g = torch.Generator().manual_seed(0)
    hidden = (8 * torch.randn(6, norm.shape[-1], generator=g)).to(norm.dtype)  # logits of a trained model's size
    targets = torch.randint(0, model.config.vocab_size, (6,), generator=g)
    with torch.no_grad():
        want = model.lm_head(hidden).float().log_softmax(-1).gather(-1, targets[:, None])[:, 0]
        try:
            got, _ = lm_head_logprobs(model, hidden, torch.arange(6), targets)
        except Exception:  # noqa: BLE001 - a head that cannot run is not exact either
            return float("inf")
    return (got - want).abs().max().item()


def _config_or_default(model_type: str):
    try:
        return tiny_config(model_type)
    except Exception:  # noqa: BLE001 - some refused families' validators reject the generic shrinking
        return CONFIG_MAPPING[model_type]()


@pytest.mark.parametrize("model_type", [f for f in FAMILIES if f in REFUSED_FAMILIES])
def test_refused_family(model_type, monkeypatch):
    """The gate refuses with the listed reason, and the reason is real: an encoder-decoder config, layer kinds trees do
    not implement, a model that does not build or load with tree_flex, or — the gate switched off — a tree forward
    that is wrong or fails."""
    reason = REFUSED_FAMILIES[model_type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = _config_or_default(model_type)
    assert reason in (config_support_error(config, model_type) or "")
    if reason == hf_tree_attn.support._ENCODER_DECODER:
        assert config.is_encoder_decoder
        return
    kinds = set(getattr(config.get_text_config(), "layer_types", None) or ())
    if kinds - set(hf_tree_attn.support.IMPLEMENTED_LAYER_KINDS):
        return  # the gate refuses these layer kinds whatever the family table says
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree, ref = _models(model_type, "eager")
    except Exception as error:  # noqa: BLE001
        # Families that cannot run here are refused for exactly that; they must not build silently one day.
        assert model_type in _UNBUILDABLE, f"{model_type} does not build: {error!r}"
        return
    assert model_type not in _UNBUILDABLE, f"{model_type} builds now: verify it and move it to EXACT_FAMILIES"
    assert reason in (tree_support_error(tree) or "")
    if reason == hf_tree_attn.support._BYPASS:  # ordinary forwards: an error, or exactly the stock result
        ids, mask = _left_padded()
        try:
            with torch.no_grad():
                got = tree(input_ids=ids, attention_mask=mask).logits
        except NotImplementedError as error:
            assert "does not run its attention through transformers' AttentionInterface" in str(error)
        else:
            with torch.no_grad():
                torch.testing.assert_close(got, ref(input_ids=ids, attention_mask=mask).logits, atol=1e-5, rtol=0)
    if reason == hf_tree_attn.support._FP32_LOGITS_HEAD:  # a plain linear map in float32: the difference is in bf16
        assert _bf16_head_error(model_type) > 1e-3, f"{model_type}: the tree LM head reproduces its head in bf16"
        return
    assert _forced_tree_error(tree, ref, monkeypatch) > 1e-3, f"{model_type} is exact on trees: list it as exact"


def test_bf16_head_check_sees_a_plain_head_exact():
    """`_bf16_head_error`, which shows Ergo's refusal is real, finds no difference beyond float32 summation order for
    a plain nn.Linear head."""
    assert _bf16_head_error("llama") < ATOL


def test_alibi_config_is_refused(monkeypatch):
    """Falcon with ALiBi (Falcon-RW checkpoints) is refused by its config, for a real reason: with the gate switched
    off its tree forward is wrong."""
    if "falcon" not in EXACT_FAMILIES:
        pytest.skip(f"Falcon is refused as a family in transformers {transformers.__version__}")
    config = tiny_config("falcon")
    config.alibi = True
    assert "alibi=True" in (config_support_error(config) or "")
    tree, ref = _models("falcon", "eager", config=config)
    assert "alibi=True" in (tree_support_error(tree) or "")
    assert _forced_tree_error(tree, ref, monkeypatch) > 1e-3


# Families whose tiny model cannot be built, or loaded with tree_flex, in this environment (Falcon before
# transformers 5.25).
_UNBUILDABLE = {"falcon", "git", "gpt_neo", "gemma3n"}


def test_docs_table_is_current():
    """docs/coverage.md shows the table of the newest transformers release tested (`TRANSFORMERS_CHECKED`). Under
    that release it is the generated table; under an older release of the tested range every family's row is the
    documented one, except the rows `support._VERSION_ROWS` lets depend on the release (and those of the families the
    older release does not have, `support._ADDED_IN`)."""
    text = (Path(__file__).parents[1] / "docs" / "coverage.md").read_text()
    stale = (
        'docs/coverage.md is stale: python -c "import hf_tree_attn.support as s; '
        "s.write_coverage_table('docs/coverage.md')\""
    )
    if transformers.__version__ == TRANSFORMERS_CHECKED:
        assert coverage_markdown() in text, stale
        return
    assert f"transformers {TRANSFORMERS_CHECKED}: " in text, stale + f" (under transformers {TRANSFORMERS_CHECKED})"
    documented = set(text.splitlines())
    version_rows = tuple(f"| `{family}` |" for family in hf_tree_attn.support._VERSION_ROWS)
    rows = [row for row in coverage_markdown().splitlines() if row.startswith("| `")]
    assert len(rows) == len(FAMILIES)
    differ = [row for row in rows if row not in documented and not row.startswith(version_rows)]
    assert differ == [], stale + f" (under transformers {TRANSFORMERS_CHECKED})"
