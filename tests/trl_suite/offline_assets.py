"""Offline stand-ins for the Hub assets TRL's GRPO tests load.

Writes, under hub/ of the work dir:
  trl-internal-testing/<tiny model>/   config + random bf16 weights (same recipe as TRL's
                                        scripts/generate_tiny_models) + an offline tokenizer
  datasets/zen/<config>/               the zen dataset, built by TRL's own scripts/generate_zen_dataset.py

Tokenizers: byte-level BPE whose ids 0..255 are the GPT-2 byte alphabet (the same ids Qwen/Llama-3 use for
single bytes), the model family's special tokens at their real ids, a handful of Qwen multi-char tokens at their
real ids (the ids TRL's tests hard-code in fake `generate` outputs, so they decode to the same text), and
placeholder tokens elsewhere. Chat templates are the real ones TRL ships in trl/chat_templates/.
"""

import shutil
import sys
from pathlib import Path

import torch
import trl
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import GenerationConfig, PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parent
HUB = ROOT / "hub"
TEMPLATES = Path(trl.__file__).parent / "chat_templates"
ORG = "trl-internal-testing"


def bytes_to_unicode():
    bs = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


B2U = bytes_to_unicode()
# GPT-2 vocab order: printable bytes first (in `bs` order), then the remaining bytes in increasing order.
BYTE_TOKENS = list(B2U.values())


def bl(text: str) -> str:
    """Byte-level (GPT-2 alphabet) spelling of `text`."""
    return "".join(B2U[b] for b in text.encode("utf-8"))


# Qwen multi-char tokens hard-coded (as ids) in test_grpo_trainer.py's fake generate() outputs.
QWEN_WORDS = {
    4913: '{"',
    606: "name",
    788: '":',
    330: ' "',
    64648: "multiply",
    22785: "_tool",
    497: '",',
    16370: "arguments",
    5212: ' {"',
    11248: "}}\n",
    7692: "async",
    93054: "_multiply",
    1513: " don",
    944: "'t",
    1414: " know",
    894: " any",
    5392: " tool",
    17453: "Done",
    35744: "increment",
    9520: "step",
    450: "de",
    13477: "crement",
    2765: " won",
    16252: " increment",
    927: "sh",
    411: "out",
    1318: "text",
    6023: "hi",
    95642: '"}}\n',
    14172: "tool",
    6659: "call",
    397: ">\n",
    522: "</",
    314: " {",
    293: " b",
}

QWEN25_SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
]
QWEN3_EXTRA = ["<tool_response>", "</tool_response>", "<think>", "</think>"]
# Which of these are "special" (skipped by decode(skip_special_tokens=True)) in the real Qwen tokenizers
QWEN_NON_SPECIAL = {
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
} | set(QWEN3_EXTRA)


def build_tokenizer(
    vocab_size,
    specials: dict,
    words: dict,
    *,
    bos=None,
    eos=None,
    pad=None,
    unk=None,
    add_bos=False,
    chat_template=None,
    non_special=(),
    extra_kwargs=None,
):
    vocab = {}
    for i, tok in enumerate(BYTE_TOKENS):
        vocab[tok] = i
    for i, w in words.items():
        vocab[bl(w)] = i
    for tok, i in specials.items():
        vocab[tok] = i
    used = set(vocab.values())
    assert len(used) == len(vocab), "id collision"
    for i in range(vocab_size):
        if i not in used:
            vocab[f"{B2U[32]}t{i}"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, specials[bos])]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials if t not in non_special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in specials if t in non_special])
    kwargs = dict(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad, unk_token=unk)
    kwargs.update(extra_kwargs or {})
    fast = PreTrainedTokenizerFast(**kwargs)
    if chat_template is not None:
        fast.chat_template = (TEMPLATES / chat_template).read_text(encoding="utf-8")
    return fast


def qwen_tokenizer(qwen3: bool):
    names = QWEN25_SPECIAL + (QWEN3_EXTRA if qwen3 else [])
    specials = {name: 151643 + i for i, name in enumerate(names)}
    return build_tokenizer(
        151643 + len(names),
        specials,
        QWEN_WORDS,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        chat_template="qwen3.jinja" if qwen3 else "qwen2_5.jinja",
        non_special=QWEN_NON_SPECIAL,
    )


def llama32_tokenizer():
    specials = {
        "<|begin_of_text|>": 128000,
        "<|end_of_text|>": 128001,
        "<|finetune_right_pad_id|>": 128004,
        "<|start_header_id|>": 128006,
        "<|end_header_id|>": 128007,
        "<|eom_id|>": 128008,
        "<|eot_id|>": 128009,
        "<|python_tag|>": 128010,
    }
    return build_tokenizer(
        128256, specials, {}, bos="<|begin_of_text|>", eos="<|eot_id|>", add_bos=True, chat_template="llama3_2.jinja"
    )


def gemma2_tokenizer():
    # Gemma's first ids are specials; move the byte alphabet out of the way is not needed: ids 0..255 are bytes here,
    # and the specials take ids above 255 (only their ids differ from the real tokenizer).
    specials = {"<pad>": 256, "<eos>": 257, "<bos>": 258, "<unk>": 259, "<start_of_turn>": 260, "<end_of_turn>": 261}
    return build_tokenizer(
        256000,
        specials,
        {},
        bos="<bos>",
        eos="<eos>",
        pad="<pad>",
        unk="<unk>",
        add_bos=True,
        chat_template="gemma.jinja",
    )


def cohere2_tokenizer():
    names = [
        "<PAD>",
        "<UNK>",
        "<BOS_TOKEN>",
        "<|END_OF_TURN_TOKEN|>",
        "<|START_OF_TURN_TOKEN|>",
        "<|USER_TOKEN|>",
        "<|CHATBOT_TOKEN|>",
        "<|SYSTEM_TOKEN|>",
        "<|START_RESPONSE|>",
        "<|END_RESPONSE|>",
    ]
    specials = {n: 256 + i for i, n in enumerate(names)}
    return build_tokenizer(
        262144,
        specials,
        {},
        bos="<BOS_TOKEN>",
        eos="<|END_OF_TURN_TOKEN|>",
        pad="<PAD>",
        unk="<UNK>",
        add_bos=True,
        chat_template="cohere2.jinja",
    )


def gptoss_tokenizer():
    specials = {
        "<|startoftext|>": 199998,
        "<|endoftext|>": 199999,
        "<|return|>": 200002,
        "<|constrain|>": 200003,
        "<|channel|>": 200005,
        "<|start|>": 200006,
        "<|end|>": 200007,
        "<|message|>": 200008,
        "<|call|>": 200012,
    }
    return build_tokenizer(
        201088,
        specials,
        {},
        bos="<|startoftext|>",
        eos="<|return|>",
        pad="<|endoftext|>",
        chat_template="gptoss.jinja",
    )


def glm4moe_tokenizer():
    names = {
        "<|endoftext|>": 151329,
        "[MASK]": 151330,
        "[gMASK]": 151331,
        "[sMASK]": 151332,
        "<sop>": 151333,
        "<eop>": 151334,
        "<|system|>": 151335,
        "<|user|>": 151336,
        "<|assistant|>": 151337,
        "<|observation|>": 151338,
        "<think>": 151350,
        "</think>": 151351,
        "<tool_call>": 151352,
        "</tool_call>": 151353,
        "<tool_response>": 151354,
        "</tool_response>": 151355,
        "<arg_key>": 151356,
        "</arg_key>": 151357,
        "<arg_value>": 151358,
        "</arg_value>": 151359,
    }
    return build_tokenizer(
        151365,
        names,
        {},
        eos="<|endoftext|>",
        pad="<|endoftext|>",
        chat_template="glm4moe.jinja",
        non_special={
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
            "<tool_response>",
            "</tool_response>",
            "<arg_key>",
            "</arg_key>",
            "<arg_value>",
            "</arg_value>",
        },
    )


def nemotron_tokenizer():
    specials = {
        "<unk>": 256,
        "<s>": 257,
        "</s>": 258,
        "<|im_start|>": 259,
        "<|im_end|>": 260,
        "<think>": 261,
        "</think>": 262,
        "<tool_call>": 263,
        "</tool_call>": 264,
        "<tool_response>": 265,
        "</tool_response>": 266,
    }
    return build_tokenizer(
        131072,
        specials,
        {},
        bos="<s>",
        eos="<|im_end|>",
        unk="<unk>",
        chat_template="nemotron_3_nano.jinja",
        non_special={"<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"},
    )


def init_weights_tiny_model(model):  # TRL's scripts/generate_tiny_models/_common.py
    from torch import nn

    for module in model.modules():
        if isinstance(module, nn.Linear):
            if module.bias is not None:
                nn.init.zeros_(module.bias)
            nn.init.xavier_uniform_(module.weight)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Conv1d):
            if module.bias is not None:
                nn.init.zeros_(module.bias)
            nn.init.xavier_uniform_(module.weight)


def save(name, model, tokenizer, gen_kwargs, extra_files=()):
    out = HUB / ORG / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    torch.manual_seed(0)
    init_weights_tiny_model(model)
    model = model.to(dtype=torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    GenerationConfig(**gen_kwargs).save_pretrained(out)
    for src in extra_files:
        shutil.copy(src, out / Path(src).name)
    print("built", out)


def build_models(only=None):
    import transformers as T

    torch.manual_seed(0)
    q25 = qwen_tokenizer(qwen3=False)
    q3 = qwen_tokenizer(qwen3=True)
    qwen_gen = dict(bos_token_id=151643, eos_token_id=[151645, 151643], pad_token_id=151643)
    small = dict(
        hidden_size=8, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=32
    )
    specs = {
        "tiny-Qwen2ForCausalLM-2.5": lambda: (
            T.Qwen2ForCausalLM(
                T.Qwen2Config(vocab_size=len(q25), rope_theta=1000000.0, max_position_embeddings=32768, **small)
            ),
            q25,
            qwen_gen,
        ),
        "tiny-Qwen2ForSequenceClassification-2.5": lambda: (
            T.Qwen2ForSequenceClassification(
                T.Qwen2Config(
                    vocab_size=152064,
                    num_labels=1,
                    hidden_size=16,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    num_hidden_layers=2,
                    intermediate_size=32,
                    rope_theta=1000000.0,
                    pad_token_id=151643,
                )
            ),
            q25,
            qwen_gen,
        ),
        "tiny-Qwen3ForCausalLM": lambda: (
            T.Qwen3ForCausalLM(
                T.Qwen3Config(vocab_size=len(q3), rope_theta=1000000.0, max_position_embeddings=40960, **small)
            ),
            q3,
            qwen_gen,
        ),
        "tiny-Qwen3ForSequenceClassification": lambda: (
            T.Qwen3ForSequenceClassification(
                T.Qwen3Config(
                    vocab_size=151936,
                    num_labels=1,
                    hidden_size=16,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    num_hidden_layers=2,
                    intermediate_size=32,
                    pad_token_id=151643,
                )
            ),
            q3,
            qwen_gen,
        ),
        "tiny-Qwen3MoeForCausalLM": lambda: (
            T.Qwen3MoeForCausalLM(
                T.Qwen3MoeConfig(
                    vocab_size=151936,
                    hidden_size=8,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    num_hidden_layers=2,
                    intermediate_size=32,
                    num_experts=4,
                    num_experts_per_tok=2,
                    max_position_embeddings=40960,
                    rope_theta=1000000.0,
                    norm_topk_prob=True,
                    bos_token_id=151643,
                    eos_token_id=151645,
                    head_dim=128,
                    max_window_layers=48,
                )
            ),
            q3,
            qwen_gen,
        ),
        "tiny-LlamaForSequenceClassification-3.2": lambda: (
            T.LlamaForSequenceClassification(
                T.LlamaConfig(
                    vocab_size=128256,
                    num_labels=1,
                    hidden_size=16,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    num_hidden_layers=2,
                    intermediate_size=32,
                    bos_token_id=128000,
                    eos_token_id=[128001, 128008, 128009],
                )
            ),
            llama32_tokenizer(),
            dict(bos_token_id=128000, eos_token_id=[128001, 128008, 128009]),
        ),
        "tiny-Gemma2ForCausalLM": lambda: (
            T.Gemma2ForCausalLM(
                T.Gemma2Config(vocab_size=256000, pad_token_id=256, eos_token_id=257, bos_token_id=258, **small)
            ),
            gemma2_tokenizer(),
            dict(bos_token_id=258, eos_token_id=[257, 261], pad_token_id=256),
        ),
        "tiny-Cohere2ForCausalLM": lambda: (
            T.Cohere2ForCausalLM(
                T.Cohere2Config(
                    vocab_size=262144,
                    logit_scale=1.0,
                    rope_theta=50000,
                    bos_token_id=258,
                    eos_token_id=259,
                    pad_token_id=256,
                    **small,
                )
            ),
            cohere2_tokenizer(),
            dict(bos_token_id=258, eos_token_id=259, pad_token_id=256),
        ),
        "tiny-GptOssForCausalLM": lambda: (
            T.GptOssForCausalLM(
                T.GptOssConfig(vocab_size=201088, num_local_experts=4, num_experts_per_tok=2, **small)
            ),
            gptoss_tokenizer(),
            dict(bos_token_id=199998, eos_token_id=[200002, 199999, 200012], pad_token_id=199999),
        ),
        "tiny-Glm4MoeForCausalLM": lambda: (
            T.Glm4MoeForCausalLM(
                T.Glm4MoeConfig(
                    vocab_size=151365,
                    hidden_size=8,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    num_hidden_layers=2,
                    intermediate_size=32,
                    moe_intermediate_size=32,
                    head_dim=2,
                    n_routed_experts=4,
                    num_experts_per_tok=2,
                    attention_bias=True,
                    eos_token_id=[151329, 151336, 151338],
                    pad_token_id=151329,
                    rope_theta=1000000,
                    routed_scaling_factor=2.5,
                    use_qk_norm=True,
                    num_nextn_predict_layers=1,
                )
            ),
            glm4moe_tokenizer(),
            dict(eos_token_id=[151329, 151336, 151338], pad_token_id=151329),
        ),
        "tiny-NemotronHForCausalLM-nano": lambda: (
            T.NemotronHForCausalLM(
                T.NemotronHConfig(
                    vocab_size=131072,
                    hidden_size=16,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    intermediate_size=32,
                    layers_block_type=["mamba", "attention", "moe"],
                    mamba_num_heads=8,
                    mamba_head_dim=4,
                    mamba_n_groups=1,
                    ssm_state_size=16,
                    mamba_d_conv=4,
                    mamba_expand=2,
                    n_routed_experts=4,
                    num_experts_per_tok=2,
                    moe_intermediate_size=32,
                    moe_shared_expert_intermediate_size=32,
                    use_mamba_kernels=False,
                )
            ),
            nemotron_tokenizer(),
            dict(bos_token_id=257, eos_token_id=[260, 258]),
        ),
    }
    for name, make in specs.items():
        if only and name not in only:
            continue
        try:
            model, tok, gen = make()
            save(name, model, tok, gen)
        except Exception as e:  # report and go on: a missing stand-in shows up as a baseline failure
            print("FAILED", name, type(e).__name__, e)

    # Remote-code model: TRL's own _remote_code/ (a LlamaForCausalLM subclass under model_type="remote").
    if not only or "tiny-RemoteForCausalLM" in only:
        rc = ROOT / "gen_ref/scripts/generate_tiny_models/for_causal_lm/_remote_code"
        sys.path.insert(0, str(rc.parent))
        from _remote_code.configuration_remote import RemoteConfig
        from _remote_code.modeling_remote import RemoteForCausalLM, RemoteForSequenceClassification, RemoteModel

        RemoteConfig.register_for_auto_class()
        RemoteModel.register_for_auto_class("AutoModel")
        RemoteForCausalLM.register_for_auto_class("AutoModelForCausalLM")
        RemoteForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")
        config = RemoteConfig(vocab_size=128256, bos_token_id=128000, eos_token_id=[128001, 128008, 128009], **small)
        config.auto_map = {
            "AutoModel": "modeling_remote.RemoteModel",
            "AutoModelForSequenceClassification": "modeling_remote.RemoteForSequenceClassification",
        }
        model = RemoteForCausalLM(config)
        save(
            "tiny-RemoteForCausalLM",
            model,
            llama32_tokenizer(),
            dict(bos_token_id=128000, eos_token_id=[128001, 128008, 128009]),
        )


def build_zen():
    """Run TRL's own scripts/generate_zen_dataset.py with push_to_hub captured into save_to_disk."""
    import datasets

    captured = {}

    def fake_push(self, repo_id, config_name="default", **kwargs):
        captured[config_name] = self

    datasets.DatasetDict.push_to_hub = fake_push
    datasets.Dataset.push_to_hub = fake_push
    src = (ROOT / "gen_ref_zen.py").read_text()
    ns = {"__name__": "zen_gen"}
    exec(compile(src, "generate_zen_dataset.py", "exec"), ns)
    ns["main"](0.1, True, "trl-internal-testing/zen")
    out = HUB / "datasets" / "zen"
    if out.exists():
        shutil.rmtree(out)
    for name, ds in captured.items():
        ds.save_to_disk(str(out / name))
    print("zen configs:", sorted(captured))


if __name__ == "__main__":
    what = sys.argv[1:] or ["models", "zen"]
    if "zen" in what:
        build_zen()
    if "models" in what:
        build_models()
        if "zen" in what:  # run.sh rebuilds a work directory's assets until this marker says they were all built
            (HUB / ".complete").write_text("models and zen built\n")
    else:
        names = [w for w in what if w.startswith("tiny-")]
        if names:
            build_models(set(names))
