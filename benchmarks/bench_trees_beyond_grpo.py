"""Tree vs TRL through `trainer.train()`: SFT on shared system prompts and agent turns, DPO on long prompts, GRPO
with a sequence-classification reward model. One GPU, random-weight bf16 Qwen3 shapes, no download.

Each workload trains TRL's trainer and the tree trainer on the same data, same seed, same model weights (random,
bf16, built from a config on the GPU), TRL's defaults otherwise (gradient checkpointing on, AdamW), and times the
optimizer steps after `--warmup` (a callback synchronises the GPU at each step's start and end). Reported per
workload: median step time of each, `speedup` = TRL / tree, the token ceiling (tokens TRL's forward computes /
forest rows, from the trainer's own `tree_compute_ratio` log) and the share of it reached, peak GPU memory of each
run (`torch.cuda.max_memory_allocated` over `train()`), and the logged losses of both (they must agree up to bf16
rounding: the same math in another order and other kernels).

Workloads (lengths in tokens: the tokenizer is character-level, so a character is a token):
  sft_system_prompt   8 samples per batch, each a 4k-token system prompt (tool schemas) + a 0.5-2k-token
                      conversation, trained on every token (language modeling through TRL's chat template).
  sft_agent_turns     per-turn samples of agent trajectories (a 2k-token system prompt, then user / tool turns and
                      assistant turns of 150-500 tokens; one sample per assistant turn holding the history before
                      it, 8 turns), prompt-completion, completion-only loss, TRL's sequential sampler (a batch is
                      one trajectory's 8 turns).
  dpo_long_prompt     8 pairs per batch, 2-4k-token prompts, 100-400-token chosen / rejected; a separate reference
                      model (a copy of the policy); the policy and the reference forward both run on trees.
  grpo_reward_model   a Qwen3-0.6B-shaped policy (float32 weights under bf16 autocast; its vocabulary is the
                      tokenizer's, 4,096 ids with `--policy-vocab`, so that every sampled id decodes) generating 64
                      tokens for 2 prompts x G=16 per step, 2k-token prompts, scored by a Qwen3-1.7B-shaped
                      sequence-classification reward model; `reward_time_s` is the time of TRL's `_calculate_rewards`
                      (the reward model's forward) per step, the ratio isolates the reward model. On the H200 (torch
                      2.11) run it with `--no-cudnn-sdpa`: PyTorch's cuDNN attention backward returned NaN in TRL's
                      flat policy update at its first step (`--detect-anomaly` names
                      `ScaledDotProductCudnnAttentionBackward0`); without cuDNN, SDPA takes its other kernels on both
                      sides.

    python benchmarks/bench_trees_beyond_grpo.py --out benchmarks/results/trees_beyond_grpo_h200.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import random
import statistics
import string
import time
import traceback

import torch
from datasets import Dataset
from harness import provenance
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedTokenizerFast,
    Qwen3Config,
    TrainerCallback,
)

import hf_tree_attn  # noqa: F401  (registers tree_flex)

SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    # For a CPU smoke run of this script (`--device cpu --model tiny --scale 0.05`), not for results.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True),
}  # fmt: skip
DEVICE = torch.device("cuda")
SCALE = 1.0
CHARS = string.ascii_lowercase + string.digits + " .,:;=>?!-'(){}\n"
TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] + ': ' + m['content'] }}{% if m['role'] == 'assistant' %}"
    "{{ eos_token }}{% endif %}{{ '\n' }}{% endfor %}{% if add_generation_prompt %}{{ 'a: ' }}{% endif %}"
)


def tokenizer(size: int = 0) -> PreTrainedTokenizerFast:
    """Character-level: `<pad>`, `<eos>`, `<unk>` and CHARS; with `size`, filled up to `size` ids with CJK characters
    (one token each, so that any id a policy samples decodes and encodes back to itself)."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    vocab.update({chr(0x4E00 + i): len(vocab) + i for i in range(max(0, size - len(vocab)))})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = TEMPLATE
    return fast


def text(rng: random.Random, n: int) -> str:
    """About `n` characters (tokens) of random words; `--scale` shrinks every length for smoke runs."""
    n = max(8, int(n * SCALE))
    words = []
    while sum(map(len, words)) + len(words) < n:
        words.append("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))))
    return " ".join(words)[:n]


def config(shape: str, tok, **overrides) -> Qwen3Config:
    kwargs = dict(SHAPES[shape], pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
                  max_position_embeddings=16384)  # fmt: skip
    return Qwen3Config(**{**kwargs, **overrides})


def causal_lm(cfg: Qwen3Config, seed: int = 0, dtype: torch.dtype = torch.bfloat16):
    torch.manual_seed(seed)
    with DEVICE:
        return AutoModelForCausalLM.from_config(copy.deepcopy(cfg), dtype=dtype, attn_implementation="sdpa")


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step, the GPU synchronised at its start and end."""

    def __init__(self):
        self.times = []

    def on_step_begin(self, args, state, control, **kwargs):
        sync()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        sync()
        self.times.append(time.perf_counter() - self._start)


class NonFiniteGradients(TrainerCallback):
    """Stops training after the first optimizer step whose gradients hold a NaN or an infinity, and records which
    parameters (a NaN written into the weights makes the next generation's sampling fail on a device-side assert,
    which ends the process's CUDA context and every workload after it)."""

    def __init__(self):
        self.found = None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        grads = {n: p.grad for n, p in kwargs["model"].named_parameters() if p.grad is not None}
        if self.found is not None or not grads:
            return
        finite = torch.stack([g.isfinite().all() for g in grads.values()]).tolist()  # one device sync per step
        bad = [n for n, ok in zip(grads, finite) if not ok]
        if bad:
            self.found = {"step": state.global_step + 1, "parameters": len(bad), "first": bad[:8]}
            control.should_training_stop = True


def common_args(steps: int) -> dict:
    return dict(
        output_dir="/tmp/bench_trees_beyond_grpo", bf16=DEVICE.type == "cuda", use_cpu=DEVICE.type == "cpu",
        max_steps=steps, logging_steps=1, report_to="none",
        save_strategy="no", seed=0, learning_rate=1e-6, disable_tqdm=True,
    )  # fmt: skip


def train(make_trainer, warmup: int, extra_timer=None) -> dict:
    """Build the trainer, train, and return its timings, peak memory and logs."""
    gc.collect()
    cuda = DEVICE.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
    trainer = make_trainer()
    timer, guard = StepTimer(), NonFiniteGradients()
    trainer.add_callback(timer)
    trainer.add_callback(guard)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    if guard.found is not None:
        raise FloatingPointError(f"non-finite gradients, training stopped: {guard.found}")
    timed = timer.times[warmup:]
    out = {
        "step_time_s": statistics.median(timed),
        "step_times_s": timer.times,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
        "losses": [e["loss"] for e in logs],
    }
    for key in ("tree_compute_ratio", "tree_token_ratio", "tree_fallback", "reward_tree_compute_ratio"):
        values = [e[key] for e in logs if key in e]
        if values:
            out[key] = statistics.mean(values)
    if extra_timer is not None:
        out["reward_time_s"] = statistics.median(extra_timer[warmup:]) if len(extra_timer) > warmup else None
        extra_timer.clear()
    del trainer
    return out


# ----------------------------------------------------------------------------------------------------------------
# Workloads: each returns (make_flat, make_tree, description)


def sft_system_prompt(args, tok):
    from trl import SFTConfig, SFTTrainer

    from hf_tree_attn.trainer import TreeSFTConfig, TreeSFTTrainer

    rng = random.Random(0)
    system = text(rng, 4096 - 4)
    rows = []
    for _ in range(args.batch * args.steps):
        total, messages = rng.randint(512, 2048), [{"role": "system", "content": system}]
        while total > 0:
            n = min(total, rng.randint(100, 400))
            messages.append({"role": "user" if len(messages) % 2 else "assistant", "content": text(rng, n)})
            total -= n
        rows.append({"messages": messages})
    dataset = Dataset.from_list(rows)
    cfg = config(args.model, tok)
    kwargs = dict(common_args(args.steps), per_device_train_batch_size=args.batch, max_length=None)
    return (
        lambda: SFTTrainer(causal_lm(cfg), SFTConfig(**kwargs), train_dataset=dataset, processing_class=tok),
        lambda: TreeSFTTrainer(causal_lm(cfg), TreeSFTConfig(**kwargs), train_dataset=dataset, processing_class=tok),
        f"{args.batch} samples per batch: 4096-token system prompt + 512-2048-token conversation, every token trained",
    )


def sft_agent_turns(args, tok):
    from trl import SFTConfig, SFTTrainer

    from hf_tree_attn.trainer import TreeSFTConfig, TreeSFTTrainer

    rng = random.Random(1)
    rows = []
    for _ in range(args.steps):
        messages = [{"role": "system", "content": text(rng, 2048)}, {"role": "user", "content": text(rng, 300)}]
        for _ in range(args.batch):
            answer = {"role": "assistant", "content": text(rng, rng.randint(150, 500))}
            rows.append({"prompt": list(messages), "completion": [answer]})
            messages += [answer, {"role": "tool", "content": text(rng, rng.randint(150, 500))}]
    dataset = Dataset.from_list(rows)
    cfg = config(args.model, tok)
    kwargs = dict(
        common_args(args.steps), per_device_train_batch_size=args.batch, max_length=None,
        train_sampling_strategy="sequential",
    )  # fmt: skip
    return (
        lambda: SFTTrainer(causal_lm(cfg), SFTConfig(**kwargs), train_dataset=dataset, processing_class=tok),
        lambda: TreeSFTTrainer(causal_lm(cfg), TreeSFTConfig(**kwargs), train_dataset=dataset, processing_class=tok),
        f"per-turn samples of one {args.batch}-turn trajectory per batch (2048-token system prompt, 150-500-token "
        "turns), completion-only loss, sequential sampler",
    )


def dpo_long_prompt(args, tok):
    from trl import DPOConfig, DPOTrainer

    from hf_tree_attn.trainer import TreeDPOConfig, TreeDPOTrainer

    rng = random.Random(2)
    rows = [
        {"prompt": text(rng, rng.randint(2048, 4096)), "chosen": text(rng, rng.randint(100, 400)),
         "rejected": text(rng, rng.randint(100, 400))}
        for _ in range(args.batch * args.steps)
    ]  # fmt: skip
    dataset = Dataset.from_list(rows)
    cfg = config(args.model, tok)
    kwargs = dict(common_args(args.steps), per_device_train_batch_size=args.batch, max_length=None)

    def make(trainer_cls, config_cls):
        policy = causal_lm(cfg)
        ref = causal_lm(cfg)
        ref.load_state_dict(policy.state_dict())
        return trainer_cls(policy, ref, config_cls(**kwargs), train_dataset=dataset, processing_class=tok)

    return (
        lambda: make(DPOTrainer, DPOConfig),
        lambda: make(TreeDPOTrainer, TreeDPOConfig),
        f"{args.batch} pairs per batch, 2048-4096-token prompts, 100-400-token chosen / rejected, separate reference",
    )


def grpo_reward_model(args, tok, timer: list):
    from trl import GRPOConfig, GRPOTrainer

    from hf_tree_attn.trainer import TreeGRPOConfig, TreeGRPOTrainer

    rng = random.Random(3)
    dataset = Dataset.from_dict({"prompt": [text(rng, 2048) for _ in range(2 * args.steps)]})
    small = args.model == "tiny"
    # The policy's vocabulary is the tokenizer's, args.policy_vocab ids: every id it samples decodes and encodes back.
    tok = tokenizer(args.policy_vocab)
    policy_cfg = config("tiny" if small else "qwen3-0.6b", tok, vocab_size=len(tok), tie_word_embeddings=False)
    reward_shape = "tiny" if small else "qwen3-1.7b"
    reward_cfg = config(reward_shape, tok, num_labels=1, vocab_size=max(SHAPES[reward_shape]["vocab_size"], len(tok)))
    kwargs = dict(
        common_args(args.steps), per_device_train_batch_size=32, num_generations=16, max_completion_length=64,
        temperature=1.0,
    )  # fmt: skip
    gen_tok = copy.deepcopy(tok)  # the policy's: prompts padded on the left for generation
    gen_tok.padding_side = "left"

    def make(trainer_cls, config_cls):
        torch.manual_seed(1)
        with DEVICE:
            reward = AutoModelForSequenceClassification.from_config(
                copy.deepcopy(reward_cfg), dtype=torch.bfloat16, attn_implementation="sdpa"
            ).eval()
        trainer = trainer_cls(
            causal_lm(policy_cfg, dtype=torch.float32), reward, config_cls(**kwargs), train_dataset=dataset,
            processing_class=gen_tok, reward_processing_classes=tok,
        )  # fmt: skip
        calculate = trainer._calculate_rewards

        def timed(*a):
            sync()
            start = time.perf_counter()
            out = calculate(*a)
            sync()
            timer.append(time.perf_counter() - start)
            return out

        trainer._calculate_rewards = timed
        return trainer

    return (
        lambda: make(GRPOTrainer, GRPOConfig),
        lambda: make(TreeGRPOTrainer, TreeGRPOConfig),
        "2 prompts x G=16 per step, 2048-token prompts, 64-token completions; Qwen3-0.6B-shaped policy (float32 "
        "weights, bf16 autocast), Qwen3-1.7B-shaped bf16 reward model",
    )


# The GRPO row last: it generates, and a device-side assert there (a NaN policy's sampling) ends the CUDA context.
WORKLOADS = ("sft_system_prompt", "dpo_long_prompt", "sft_agent_turns", "grpo_reward_model")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--model", default="qwen3-1.7b", choices=list(SHAPES), help="policy shape (SFT, DPO)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default="cuda", help="cpu only for a smoke run of this script")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every length (smoke runs)")
    parser.add_argument("--policy-vocab", type=int, default=4096, help="the GRPO policy's vocabulary size")
    parser.add_argument("--no-cudnn-sdpa", action="store_true", help="SDPA without its cuDNN backend, both sides")
    parser.add_argument("--detect-anomaly", action="store_true", help="autograd anomaly detection (diagnosis)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    global DEVICE, SCALE
    DEVICE, SCALE = torch.device(args.device), args.scale

    results = {
        **provenance(),
        "notes": "random-weight bf16 Qwen3 shapes; TRL defaults (gradient checkpointing on, AdamW); the tree "
        "trainers switch the model to tree_flex, TRL's keeps sdpa; step times are medians after the warmup steps",
        "runs": [],
    }
    tok = tokenizer()
    torch.autograd.set_detect_anomaly(args.detect_anomaly)
    if args.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    for name in args.workloads:
        reward_timer = []
        make_flat, make_tree, description = (
            grpo_reward_model(args, tok, reward_timer) if name == "grpo_reward_model" else globals()[name](args, tok)
        )
        start = time.perf_counter()
        try:
            flat = train(make_flat, args.warmup, reward_timer if name == "grpo_reward_model" else None)
            tree = train(make_tree, args.warmup, reward_timer if name == "grpo_reward_model" else None)
        except Exception as error:  # recorded with the workload; a CUDA error leaves no usable context: stop there
            results["runs"].append({"workload": name, "description": description, "model": args.model,
                                    "error": f"{type(error).__name__}: {error}"[:2000]})  # fmt: skip
            with open(args.out, "w") as f:
                json.dump(results, f, indent=2)
            print(f"{name:<18} failed: {type(error).__name__}: {str(error)[:300]}", flush=True)
            traceback.print_exc()
            if isinstance(error, torch.AcceleratorError):
                break
            continue
        run = {"workload": name, "description": description, "model": args.model, "trl": flat, "tree": tree}
        run["speedup"] = flat["step_time_s"] / tree["step_time_s"]
        run["peak_memory_ratio"] = tree["peak_gib"] / flat["peak_gib"]
        ratio_key = "reward_tree_compute_ratio" if name == "grpo_reward_model" else "tree_compute_ratio"
        if ratio_key in tree:
            run["token_ceiling"] = 1 / tree[ratio_key]
        if name == "grpo_reward_model" and flat.get("reward_time_s") and tree.get("reward_time_s"):
            run["reward_speedup"] = flat["reward_time_s"] / tree["reward_time_s"]
            run["share_of_token_ceiling"] = run["reward_speedup"] / run.get("token_ceiling", float("nan"))
        elif "token_ceiling" in run:
            run["share_of_token_ceiling"] = run["speedup"] / run["token_ceiling"]
        run["max_loss_diff"] = max((abs(a - b) for a, b in zip(flat["losses"], tree["losses"])), default=None)
        run["wall_s"] = time.perf_counter() - start
        results["runs"].append(run)
        print(
            f"{name:<18} trl {flat['step_time_s']:.3f}s  tree {tree['step_time_s']:.3f}s  speedup "
            f"{run['speedup']:.2f}x  ceiling {run.get('token_ceiling', float('nan')):.2f}x  "
            f"{100 * run.get('share_of_token_ceiling', float('nan')):.0f}%  peak {flat['peak_gib']:.1f} -> "
            f"{tree['peak_gib']:.1f} GiB"
            + (f"  reward {run.get('reward_speedup', float('nan')):.2f}x" if "reward_speedup" in run else "")
            + f"  max |loss diff| {run['max_loss_diff']}",
            flush=True,
        )
        with open(args.out, "w") as f:  # after every workload: a run cut short keeps what it measured
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
