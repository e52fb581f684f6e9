"""The tree trainers beyond GRPO against TRL's through `trainer.train()`: SFT, DPO, reward models, RLOO; each side in
its own process, paired per step, agreement checked against a float32 run.

Rows (workloads; lengths in tokens: the tokenizer is character-level, so a character is a token; `--scale` shrinks
every length for a CPU smoke run):

- `sft_system_prompt` (`TreeSFTTrainer` vs `trl.SFTTrainer`): `--batch` 8 samples per batch, each a 4,096-token system
  prompt + a 512-2,048-token conversation, every token trained (language modeling through a chat template);
- `sft_agent_turns` (the same trainers): per-turn samples of agent trajectories (a 2,048-token system prompt, a
  300-token user turn, then assistant and tool turns of 150-500 tokens; one sample per assistant turn holding the
  history before it), prompt-completion, completion-only loss, TRL's sequential sampler: a batch is one
  trajectory's 8 turns;
- `dpo_long_prompt` (`TreeDPOTrainer` vs `trl.DPOTrainer`): 8 pairs per batch, 2,048-4,096-token prompts,
  100-400-token chosen / rejected, a separate reference model (a copy of the policy);
- `reward_pairs` (`TreeRewardTrainer` vs `trl.RewardTrainer`): 8 pairs per batch as in `dpo_long_prompt` (other
  texts), chosen and rejected sharing their prompt, scored by a sequence classifier of the model's shape (one label);
- `rloo_groups` (`TreeRLOOTrainer` vs `trl.RLOOTrainer`): one prompt of U[1,000, 4,000] tokens and G=16 completions
  of U[64, 512] tokens per optimizer step, TRL's reference model and KL penalty (`beta=0.05`). Generation is a fixed
  rollout: both trainers' `_generate_single_turn` return the same random completions, seeded by the prompt's tokens
  and the completion's index in its group, so both train the same rows (generation itself costs nothing here).

Models: random weights from configs shaped like Qwen3-1.7B (or 0.6B / 8B; `tiny` for a CPU run), built in each
process with the same seed (no download); the DPO and RLOO reference models the same weights. Sides (`--sides`):

- `reference`: TRL's trainer in float32 (weights and compute, no autocast), one optimizer step: the exact per-token
  values the agreement measures the other sides' errors against;
- `trl`: TRL's trainer at its defaults (gradient checkpointing, AdamW, bf16 autocast on CUDA, SDPA), bf16 weights;
- `tree`: the tree trainer at its defaults (the same, on trees; on CUDA its decoder layers compiled).

Every side trains `--warmup` + `--steps` optimizer steps at `learning_rate=1e-6`, `seed=0`, on the same data in the
same order (`max_length=None`: nothing truncated). Per side: the wall time of every optimizer step
(CUDA-synchronized; the first from `train()`'s start, so it holds set-up and compilation), peak memory after the
warm-up, the token ceiling (tokens TRL's forward computes, rows x padded width, over the batch's distinct prefix-tree
tokens) and `mfu`: model FLOPs per step second over 989 TFLOP/s, one formula for both sides — 3x the forward FLOPs
of the step's trained sequences as one prefix forest (`estimate_flops`' `tree_flops`; forward + backward, recompute
not counted) plus 1x for the reference model's forward (DPO, RLOO). Per row, `paired["tree vs trl"]`: for each
measured step, TRL's seconds over the tree's on the same step index (`harness.paired`: min / median / max, at least 8
steps), and `agreement["tree vs trl"]` (`harness.sides_agreement`): the first micro-batch's per-token
log-probabilities of the trained tokens (the reward row: the chosen and rejected rows' scores), the tree's error to
the `reference` side's at most twice TRL's plus one bf16 rounding, on the same targets; it also needs the same
batches on every step (a digest of each step's rows) and `tree_fallback == 0` on every tree forward. A row that
fails it is recorded `failed`, its ratio is not a speed-up. `--perturb-tree EPS` adds noise of relative size EPS
to the tree side's weights: its agreement must then fail (the check's own check).

    python benchmarks/bench_trees_beyond_grpo.py --models qwen3-1.7b --warmup 2 --steps 8 \\
        --out benchmarks/results/trees_beyond_grpo_h200_paired.json                     # H200: every row
    python benchmarks/bench_trees_beyond_grpo.py --models tiny --scale 0.02 --warmup 1 --steps 8 \\
        --out /tmp/trees_beyond_grpo_cpu.json                                           # CPU smoke run
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import string
import sys
import tempfile
import warnings
import zlib
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks"), str(REPO / "tests")]
from bench_tree_vs_flat import MODELS, PEAK_FLOPS  # noqa: E402
from harness import StepClock, pair_sides, provenance, result_file, run_child, run_rows, side_arguments  # noqa: E402

from hf_tree_attn.metrics import estimate_flops  # noqa: E402

QWEN3 = [name for name in MODELS if name.startswith("qwen3-")]
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=512, tie_word_embeddings=True)  # fmt: skip
CHARS = string.ascii_lowercase + string.digits + " .,:;=>?!-'(){}\n"
TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] + ': ' + m['content'] }}{% if m['role'] == 'assistant' %}"
    "{{ eos_token }}{% endif %}{{ '\n' }}{% endfor %}{% if add_generation_prompt %}{{ 'a: ' }}{% endif %}"
)
WORKLOADS = ("sft_system_prompt", "sft_agent_turns", "dpo_long_prompt", "reward_pairs", "rloo_groups")
SIDES = ("reference", "trl", "tree")
PAIRS = [("tree", "trl")]
RLOO_G = 16


def tokenizer():
    """Character-level: `<pad>`, `<eos>`, `<unk>` and CHARS, a chat template (TRL's SFT and DPO want one)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = TEMPLATE
    return fast


def text(rng: random.Random, n: int, scale: float) -> str:
    """About `n` x `scale` characters (tokens) of random words, at least 8."""
    n = max(8, int(n * scale))
    words = []
    while sum(map(len, words)) + len(words) < n:
        words.append("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))))
    return " ".join(words)[:n]


def model_config(name: str, tok, **overrides):
    from transformers import Qwen3Config

    shape = TINY if name == "tiny" else MODELS[name]
    kwargs = dict(shape, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
                  max_position_embeddings=16384)  # fmt: skip
    return Qwen3Config(**{**kwargs, **overrides})


def build_model(config, dtype: torch.dtype, classifier: bool = False, attn_implementation: str = "sdpa"):
    """Random weights from `config`, seeded (every side and reference model the same), on the GPU where there is one;
    on SDPA, which the tree trainers switch to `tree_flex`."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    auto = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        return auto.from_config(copy.deepcopy(config), dtype=dtype, attn_implementation=attn_implementation)


# ---- the rows' data (the SFT and DPO rows: the one-process benchmark's definitions)


def sft_system_prompt_rows(n: int, scale: float) -> list[dict]:
    rng = random.Random(0)
    system, rows = text(rng, 4096 - 4, scale), []
    for _ in range(n):
        total, messages = rng.randint(512, 2048), [{"role": "system", "content": system}]
        while total > 0:
            k = min(total, rng.randint(100, 400))
            messages.append({"role": "user" if len(messages) % 2 else "assistant", "content": text(rng, k, scale)})
            total -= k
        rows.append({"messages": messages})
    return rows


def sft_agent_turns_rows(trajectories: int, turns: int, scale: float) -> list[dict]:
    rng, rows = random.Random(1), []
    for _ in range(trajectories):
        messages = [{"role": "system", "content": text(rng, 2048, scale)},
                    {"role": "user", "content": text(rng, 300, scale)}]  # fmt: skip
        for _ in range(turns):
            answer = {"role": "assistant", "content": text(rng, rng.randint(150, 500), scale)}
            rows.append({"prompt": list(messages), "completion": [answer]})
            messages += [answer, {"role": "tool", "content": text(rng, rng.randint(150, 500), scale)}]
    return rows


def pair_rows(n: int, scale: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": text(rng, rng.randint(2048, 4096), scale), "chosen": text(rng, rng.randint(100, 400), scale),
             "rejected": text(rng, rng.randint(100, 400), scale)} for _ in range(n)]  # fmt: skip


def rloo_prompts(n: int, scale: float) -> list[str]:
    rng = random.Random(3)
    return [text(rng, rng.randint(1000, 4000), scale) for _ in range(n)]


def fixed_completions(scale: float, calls: list):
    """Stands in for RLOO's `_generate_single_turn`: per prompt row, U[64, 512] x `scale` random character ids seeded
    by the prompt's tokens and its index among equal prompts (its place in the group); `calls` gets each call's
    `(prompt_ids, completion_ids)`, one call per optimizer step."""
    low, high = max(2, round(64 * scale)), max(4, round(512 * scale))

    def generate(prompt_ids, images=None, multimodal_fields=None):
        completions, seen = [], {}
        for ids in prompt_ids:
            key = zlib.crc32(str(list(ids)).encode())
            k = seen[key] = seen.get(key, -1) + 1
            rng = random.Random(key * 64 + k)
            completions.append([rng.randrange(3, 3 + len(CHARS) - 1) for _ in range(rng.randint(low, high))])
        calls.append(([list(p) for p in prompt_ids], completions))
        return completions

    return generate


def length_reward(completions: list[str], **kwargs) -> list[float]:
    return [(len(c) % 7) / 7 for c in completions]


# ---- what each side records


class ForwardLog:
    """A forward hook (with kwargs) on the trained model: each training forward under grad keeps its `input_ids`,
    `attention_mask` and `labels` (references: nothing is copied or synchronized inside the timed steps), the first
    one also its output — TRL's fused head's `log_probs` and `label_mask` (SFT, DPO) or the scores (`logits`, the
    reward model)."""

    def __init__(self, model: torch.nn.Module):
        self.calls, self.first = [], None
        self.handle = model.register_forward_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs, output):
        if not (module.training and torch.is_grad_enabled()):
            return
        inputs = {k: kwargs.get(k) for k in ("input_ids", "attention_mask", "labels")}
        if inputs["input_ids"] is None and args:
            inputs["input_ids"] = args[0]
        self.calls.append({k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})
        if self.first is None:
            fields = ("log_probs", "label_mask") if getattr(output, "log_probs", None) is not None else ("logits",)
            self.first = {**self.calls[-1], **{k: getattr(output, k).detach() for k in fields}}

    def first_scores(self) -> dict:
        """`{"targets", "log_probs"}` of the first forward: the trained tokens' log-probabilities in row order, or
        each row's score with a digest of its tokens as its target."""
        first = self.first
        if "logits" in first:
            rows = _rows(first["input_ids"], first["attention_mask"])
            return {"targets": [zlib.crc32(str(r).encode()) for r in rows],
                    "log_probs": first["logits"].float().flatten().tolist()}  # fmt: skip
        mask = first["label_mask"].bool()
        targets = first["labels"][:, -mask.shape[1] :][mask]
        return {"targets": targets.tolist(), "log_probs": first["log_probs"][mask].float().tolist()}

    def steps(self) -> list[dict]:
        """Per training forward: its unpadded rows, each row's first trained position, TRL's padded tokens."""
        out = []
        for call in self.calls:
            rows = _rows(call["input_ids"], call["attention_mask"])
            labels = call["labels"]
            if labels is None:  # the reward model: one score per row, read at its last token
                first = [len(r) - 1 for r in rows]
            else:
                trained = (labels != -100).cpu()
                first = [int(t.nonzero()[0]) if t.any() else len(r) for t, r in zip(trained, rows)]
            out.append({"rows": rows, "prompt_lengths": first, "padded": call["input_ids"].numel()})
        return out


def _rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[list[int]]:
    ids = input_ids.cpu()
    if attention_mask is None:
        return ids.tolist()
    return [row[m.bool()].tolist() for row, m in zip(ids, attention_mask.cpu())]


def rloo_steps(calls: list) -> list[dict]:
    """`ForwardLog.steps` of the fixed rollouts: prompt + completion rows, TRL's padded layout (prompts padded to the
    longest on the left, completions to the longest on the right)."""
    out = []
    for prompt_ids, completion_ids in calls:
        rows = [p + c for p, c in zip(prompt_ids, completion_ids)]
        width = max(map(len, prompt_ids)) + max(map(len, completion_ids))
        out.append({"rows": rows, "prompt_lengths": [len(p) for p in prompt_ids], "padded": len(rows) * width})
    return out


def step_measures(config, step: dict, passes: float) -> dict:
    """A step's model FLOPs (`passes` x the forward FLOPs of its rows as one prefix forest), its token ceiling
    (TRL's padded tokens over the forest's) and a digest of its rows (the same batch on every side)."""
    estimate = estimate_flops(config, step["rows"], prompt_lengths=step["prompt_lengths"])
    tree_tokens = estimate["token_ratio"] * sum(map(len, step["rows"]))
    return {"flops": passes * estimate["tree_flops"], "ceiling": step["padded"] / tree_tokens,
            "digest": zlib.crc32(str(sorted(step["rows"])).encode())}  # fmt: skip


def perturb(model: torch.nn.Module, eps: float) -> None:
    """Adds `eps` x each weight's RMS of seeded Gaussian noise to `model`'s weights (`--perturb-tree`)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=generator).to(p.device, p.dtype)
            p.add_(eps * p.float().pow(2).mean().sqrt().to(p.dtype) * noise)


# ---- one side of one row


def build_trainer(workload: str, side: str, args, tok, callbacks: list, rollout_calls: list):
    """The trainer of `side` for `workload`, and its model's config and reference passes (for the FLOPs)."""
    import trl
    from datasets import Dataset

    import hf_tree_attn.trainer as tree_trainers

    tree, reference = side == "tree", side == "reference"
    cuda = torch.cuda.is_available()
    dtype = torch.float32 if reference else torch.bfloat16
    total = args.warmup + args.steps  # the data of every side (the sampler's order depends on its size)
    kind = {"sft_system_prompt": "SFT", "sft_agent_turns": "SFT", "dpo_long_prompt": "DPO",
            "reward_pairs": "Reward", "rloo_groups": "RLOO"}[workload]  # fmt: skip
    trainer_class = getattr(tree_trainers, f"Tree{kind}Trainer") if tree else getattr(trl, f"{kind}Trainer")
    config_class = getattr(tree_trainers, f"Tree{kind}Config") if tree else getattr(trl, f"{kind}Config")
    options = dict(
        output_dir=tempfile.mkdtemp(prefix="bench_trees_beyond_grpo_"), bf16=cuda and not reference,
        use_cpu=not cuda, max_steps=1 if reference else total, logging_steps=1, report_to="none",
        save_strategy="no", seed=0, learning_rate=1e-6, disable_tqdm=True,
    )  # fmt: skip
    config = model_config(args.models[0], tok)
    batch, scale = args.batch, args.scale
    if kind == "RLOO":
        config_ = config
        from trl.trainer import rloo_trainer

        # TRL builds the reference model from the policy's path, in its dtype and attention (`tree_flex` on the tree
        # side): the same seeded random weights here.
        rloo_trainer.create_model_from_path = lambda path, **kw: build_model(
            config_, kw.get("dtype", dtype), attn_implementation=kw.get("attn_implementation", "sdpa")
        )
        options.update(per_device_train_batch_size=RLOO_G, num_generations=RLOO_G,
                       max_completion_length=max(4, round(512 * scale)))  # fmt: skip
        dataset = Dataset.from_dict({"prompt": rloo_prompts(total, scale)})
        trainer = trainer_class(
            build_model(config, dtype), reward_funcs=length_reward, args=config_class(**options),
            train_dataset=dataset, processing_class=tok, callbacks=callbacks,
        )  # fmt: skip
        trainer._generate_single_turn = fixed_completions(scale, rollout_calls)
        return trainer, config, 1.0 if trainer.beta else 0.0
    options.update(per_device_train_batch_size=batch, max_length=None)
    if workload == "sft_system_prompt":
        dataset = sft_system_prompt_rows(batch * total, scale)
    elif workload == "sft_agent_turns":
        dataset = sft_agent_turns_rows(total, batch, scale)
        options["train_sampling_strategy"] = "sequential"
    else:
        dataset = pair_rows(batch * total, scale, seed=2 if kind == "DPO" else 4)
    dataset = Dataset.from_list(dataset)
    if kind == "Reward":
        config = model_config(args.models[0], tok, num_labels=1)
        model = build_model(config, dtype, classifier=True)
        trainer = trainer_class(model, args=config_class(**options), train_dataset=dataset, processing_class=tok,
                                callbacks=callbacks)  # fmt: skip
        return trainer, config, 0.0
    policy = build_model(config, dtype)
    extra = {"ref_model": build_model(config, dtype)} if kind == "DPO" else {}
    trainer = trainer_class(policy, args=config_class(**options), train_dataset=dataset, processing_class=tok,
                            callbacks=callbacks, **extra)  # fmt: skip
    return trainer, config, 1.0 if kind == "DPO" else 0.0


def side_main(args) -> dict:
    """One side (`args.side`) of one row (`args.models[0]`, `args.workloads[0]`), in this process."""
    from bench_sync_grpo import FirstScores as GroupScores

    workload, side = args.workloads[0], args.side
    if args.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    tok = tokenizer()
    clock, rollout_calls = StepClock(args.warmup), []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer, config, reference_passes = build_trainer(workload, side, args, tok, [clock], rollout_calls)
        if side == "tree" and args.perturb_tree:
            perturb(trainer.model, args.perturb_tree)
        group = workload == "rloo_groups"
        log = GroupScores() if group else ForwardLog(trainer.model)
        if group:
            log.install(trainer)
        trainer.train()
    scores = {"targets": log.targets, "log_probs": log.log_probs} if group else log.first_scores()
    if side == "reference":
        return {"first_scores": scores, "dtype": "float32"}
    timing = clock.summary()
    times = timing["measured_step_s"]
    steps = rloo_steps(rollout_calls) if group else log.steps()
    measures = [step_measures(config, step, 3 + reference_passes) for step in steps[: args.warmup + len(times)]]
    measured = measures[args.warmup :]
    logs = [e for e in trainer.state.log_history if "loss" in e]
    fallbacks = [e.get("tree_fallback") for e in logs] if side == "tree" else None
    decision = getattr(trainer, "tree_compile", None)
    from hf_tree_attn.compile import compiled_layers, decoder_layers

    return {
        **timing,
        "spec": SPECS[workload](args),
        "batch_digests": [m["digest"] for m in measures],
        "token_ceiling_per_step": [m["ceiling"] for m in measured],
        "token_ceiling": statistics.mean(m["ceiling"] for m in measured),
        "mfu_per_step": [m["flops"] / t / PEAK_FLOPS for m, t in zip(measured, times)],
        "mfu": statistics.mean(m["flops"] / t / PEAK_FLOPS for m, t in zip(measured, times)),
        "loss": [e["loss"] for e in logs],
        "tree_fallback": fallbacks,
        "tree_compute_ratio": _mean(logs[args.warmup :], "tree_compute_ratio"),
        "tree_compile": None if decision is None else {"kwargs": decision.kwargs, "source": decision.source},
        "compiled_layers_after_run": f"{len(compiled_layers(trainer.model))} / {len(decoder_layers(trainer.model))}",
        "perturb_tree": args.perturb_tree if side == "tree" else None,
        "first_scores": scores,
    }


def _mean(entries: list[dict], key: str) -> float | None:
    values = [e[key] for e in entries if e.get(key) is not None]
    return statistics.mean(values) if values else None


SPECS = {
    "sft_system_prompt": lambda a: (
        f"{a.batch} samples per batch: 4096-token system prompt + 512-2048-token conversation, every token trained"
    ),
    "sft_agent_turns": lambda a: (
        f"per-turn samples of one {a.batch}-turn trajectory per batch (2048-token system "
        "prompt, 150-500-token turns), completion-only loss, sequential sampler"
    ),
    "dpo_long_prompt": lambda a: (
        f"{a.batch} pairs per batch, 2048-4096-token prompts, 100-400-token chosen / rejected, separate reference"
    ),
    "reward_pairs": lambda a: (
        f"{a.batch} pairs per batch, 2048-4096-token prompts, 100-400-token chosen / rejected, one score per row"
    ),
    "rloo_groups": lambda a: (
        f"one prompt per step, U[1000,4000] tokens, G={RLOO_G} fixed completions of U[64,512] "
        "tokens, reference model (beta=0.05)"
    ),
}


# ---- the parent: rows, pairs


def _pair(row: dict) -> None:
    """`row["paired"]` and `row["agreement"]` for every pair of `PAIRS` whose two sides ran (`harness.pair_sides`:
    first scores against the float32 reference, the same batches, no tree fallback; a pair that fails is marked
    `failed`), and each pair's median ratio over the token ceiling."""
    for key in pair_sides(row, PAIRS, "bfloat16", lambda a, b: a["batch_digests"] == b["batch_digests"]):
        candidate = row["sides"][key.split(" vs ")[0]]
        row["paired"][key]["share_of_token_ceiling"] = row["paired"][key]["median"] / candidate["token_ceiling"]


def _summary(row: dict) -> str:
    parts = [f"{row['model']:<11} {row['workload']:<18}"]
    for side, r in row["sides"].items():
        if "error" in r:
            parts.append(f"{side}: {r['error'][:90]} {r.get('output_tail', '')[-600:]}")
        elif "median_step_s" in r:
            peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
            parts.append(f"{side}: {r['median_step_s']:.3f} s (first {r['first_step_s']:.1f} s)  "
                         f"mfu {100 * r['mfu']:.1f}%  {peak} GiB  ceiling {r['token_ceiling']:.2f}x")  # fmt: skip
    for key, pair in row["paired"].items():
        check = row["agreement"].get(key, {})
        errors = check.get("max_error", {})
        detail = f"max |diff| {check.get('max_abs')}"
        if errors:
            detail = f"max error tree {errors['candidate']:.3g} trl {errors['baseline']:.3g}"
        status = "FAILED agreement" if pair.get("failed") else "agrees"
        if "median" in pair:
            parts.append(f"{key}: {pair['median']:.2f}x [{pair['min']:.2f}, {pair['max']:.2f}] {status} "
                         f"({detail}, same batches {check.get('same_batches')}, "
                         f"fallbacks {check.get('tree_fallback')})")  # fmt: skip
        else:
            parts.append(f"{key}: {pair['error']}")
    return "\n  ".join(parts)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen3-1.7b"], choices=[*QWEN3, "tiny"])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    parser.add_argument("--batch", type=int, default=8, help="samples (SFT) or pairs (DPO, reward) per batch")
    parser.add_argument("--no-cudnn-sdpa", action="store_true", help="SDPA without its cuDNN backend, every side")
    parser.add_argument(
        "--perturb-tree",
        type=float,
        default=0.0,
        help="noise of this relative size on the tree side's weights (its agreement must fail)",
    )
    args = side_arguments(parser, SIDES, "benchmarks/results/trees_beyond_grpo.json")
    if run_child(args, side_main):
        return
    results = {
        **provenance(),
        "sides": "reference: TRL's trainer in float32, one step (agreement); trl: TRL's trainer at its defaults, bf16 "
        "weights; tree: the tree trainer at its defaults",
        "batch": args.batch,
        "peak_flops": PEAK_FLOPS,
        "rows": [],
    }
    rows = [(m, w) for m in args.models for w in args.workloads]
    out, earlier = result_file(args, results, rows)
    child = [f"--steps={args.steps}", f"--warmup={args.warmup}", f"--scale={args.scale}", f"--batch={args.batch}",
             f"--perturb-tree={args.perturb_tree}", *(["--no-cudnn-sdpa"] if args.no_cudnn_sdpa else [])]  # fmt: skip
    run_rows(Path(__file__), out, results, rows, args.sides, {
        "argv": child, "env": lambda side: {}, "pair": _pair, "summary": _summary, "earlier": earlier})  # fmt: skip


if __name__ == "__main__":
    main()
