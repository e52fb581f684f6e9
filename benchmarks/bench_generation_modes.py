"""End-to-end GRPO steps per TRL generation mode, `TreeGRPOTrainer` vs `trl.GRPOTrainer`: what share of a step the
trainer phase is, each side in its own process, paired per step, agreement checked against a float32 run.

The tree only speeds up the trainer phase (the log-probability forwards and the backward); generation is TRL's own
code on both sides. So the end-to-end gain depends on the generation mode. Rows (`--modes`, one row per model and
mode):

- `generate`: HF `generate` with the dynamic cache (TRL's default);
- `static_cache`: HF `generate` with `cache_implementation="static"`;
- `compiled`: `torch_compile=True` (the Trainer compiles the model);
- `continuous_batching`: transformers' continuous batching (`use_transformers_continuous_batching=True`);
- `vllm_colocate`: vLLM in the training process (`use_vllm=True, vllm_mode="colocate"`); needs CUDA and vLLM, and
  is recorded as skipped (with the reason) where either is missing.

Workload (every length times `--scale`, for a CPU smoke run): per optimizer step `--prompts-per-step` 2 prompts x
`--generations` G=16 completions (`per_device_train_batch_size=G`, `gradient_accumulation_steps=2`: one generation
call of 32 rows per step, two micro-batches of one group each), each prompt a 2,048-token system prompt shared by
all + 64 tokens of its own, completions of up to 256 tokens (`max_completion_length`; random weights rarely emit
EOS). The model: random weights from a config shaped like Qwen3-0.6B (`tiny` for a CPU run), built once with a fixed
seed and saved in bf16 under the temporary directory (no download), loaded from that path by every side; a
word-level tokenizer over the vocabulary (`t0 .. t{V-1}`), built in code. Gradient checkpointing on both sides.

Sides (`--sides`), each in its own process (`harness.run_rows`):

- `trl`: `trl.GRPOTrainer` with `GRPOConfig` and the mode's settings, bf16 weights (bf16 autocast on CUDA);
- `tree`: `TreeGRPOTrainer` with `TreeGRPOConfig` and the same settings (on CUDA its decoder layers compiled);
- `reference`: `trl.GRPOTrainer` in float32, one optimizer step, whose generation replays the completions the `trl`
  (or `tree`) side generated on its first step (a float32 model would sample other tokens): the exact per-token
  values the agreement measures the other sides' errors against. It runs after them, whatever `--sides` says.

Both timed sides run `--warmup` + `--steps` optimizer steps with `seed=0` and `learning_rate=0`: the optimizer
step runs as ever, but the weights stay the ones both sides generate from, so each step samples the same completions
on both sides (with any other learning rate the two trainers' slightly different bf16 gradients give slightly
different weights, and sampling from them other completions from the next step on). Whether they did is checked,
not assumed: each side records a digest of every step's rows (prompt + completion tokens).

Per side and step (CUDA-synchronized): the step's wall time (`harness.StepClock`; the first from `train()`'s start,
so it holds set-up and compilation) and its phases — `generation` (`_generate_single_turn`, whatever the mode
uses), `logprob_forwards` (every `_get_per_token_logps_and_entropies` call: old-policy, reference and policy where
they run), `backward` (`accelerator.backward`) and `trainer_phase` (the last two together). Also peak memory after
the warm-up, the token ceiling (TRL's padded tokens, rows x padded width, over the distinct prefix-tree tokens of
each prompt's group, which the tree trains as one micro-batch), the FLOP ceiling (the same for forward FLOPs), and
`mfu`: 3x the forward FLOPs of the step's rows as those forests (`estimate_flops`' `tree_flops`; forward +
backward, recompute and generation not counted) per step second over 989 TFLOP/s, one formula for both sides
(`trainer_phase_mfu`: per trainer-phase second).

Per row, `paired["tree vs trl"]`: for each measured step TRL's seconds over the tree's on the same step index
(`harness.paired`: min / median / max, at least 8 steps), of whole steps, and under `trainer_phase` and `generation`
of those phases; `agreement["tree vs trl"]` (`harness.sides_agreement`): the first step's policy forwards' per-token
log-probabilities of the completion tokens (every micro-batch of the step, rows sorted by their tokens, as TRL
shuffles a step's rows and the tree keeps each group together), the tree's error to the `reference` side's at most
twice TRL's plus one bf16 rounding, on the same targets; it also needs the same batches on every step
(`same_batches`) and `tree_fallback == 0` on every step. A row that fails it is recorded `failed`: its ratio is not
a speed-up. `--perturb-tree EPS` adds noise of relative size EPS to the tree side's weights just before its first
log-probability forward (after the first step's generation): its agreement must then fail (the check's own check).

    python benchmarks/bench_generation_modes.py --modes generate --out benchmarks/results/generation_modes.json
    python benchmarks/bench_generation_modes.py --models tiny --scale 0.02 --warmup 1 --steps 8 \\
        --modes generate static_cache --out /tmp/generation_modes_cpu.json              # CPU smoke run

The earlier format of this benchmark (both trainers in one process, means; `results[mode]["tree" | "flat"]`) is
the one of the committed files `benchmarks/results/generation_modes_h200*.json`, which results_tables.py reads.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
import zlib
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
from bench_tree_vs_flat import PEAK_FLOPS  # noqa: E402
from harness import (  # noqa: E402
    StepClock,
    compile_report,
    pair_sides,
    paired,
    provenance,
    result_file,
    run_child,
    run_rows,
    side_arguments,
)

from hf_tree_attn.metrics import estimate_flops  # noqa: E402

SHAPES = {
    "qwen3-0.6b": dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
    ),
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=1000, tie_word_embeddings=True, max_position_embeddings=4096,
    ),
}  # fmt: skip

MODES = {
    "generate": {},
    "static_cache": {"cache_implementation": "static"},
    "compiled": {"torch_compile": True},
    "continuous_batching": {"use_transformers_continuous_batching": True},
    "vllm_colocate": {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3},
}
SIDES = ("trl", "tree", "reference")
PAIRS = [("tree", "trl")]
REPLAY = "BENCH_GENERATION_MODES_REPLAY"  # the reference side: the file of the first step's rows to replay
RECORD = "BENCH_GENERATION_MODES_RECORD"  # a timed side: where to write its first step's rows
SCRATCH = Path(tempfile.gettempdir()) / "bench_generation_modes"  # the models' weights, the first steps' rows
WORKLOAD = ("generations", "prompts_per_step", "shared_prompt", "own_prompt", "completion", "scale", "warmup", "steps")


def skipped(mode: str) -> str | None:
    """Why `mode` cannot run here, or None."""
    if mode == "vllm_colocate":
        if not torch.cuda.is_available():
            return "vLLM colocate needs CUDA"
        if importlib.util.find_spec("vllm") is None:
            return "vllm is not installed"
    return None


# ---- the model, tokenizer and data (the same in every process)


def build_tokenizer(vocab_size: int):
    """Word-level tokenizer over `t0 .. t{V-1}` (t0 = pad, t1 = eos): any id decodes, as in a real vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", padding_side="left")


def model_config(name: str):
    from transformers import Qwen3Config

    return Qwen3Config(**SHAPES[name], pad_token_id=0, eos_token_id=1, bos_token_id=None)


def model_dir(name: str) -> str:
    """A directory with `name`'s random weights (seed 0, saved in bf16) and the tokenizer, built by the first side
    that needs it and reused by the others (the same weights in every process; vLLM loads from a path)."""
    from transformers import AutoModelForCausalLM

    shape = hashlib.sha1(json.dumps(SHAPES[name], sort_keys=True).encode()).hexdigest()[:8]
    path = SCRATCH / f"{name}-{shape}"
    if (path / "config.json").exists():
        return str(path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(name), dtype=torch.bfloat16)
    partial = path.with_name(path.name + f".{os.getpid()}")
    model.save_pretrained(partial)
    build_tokenizer(SHAPES[name]["vocab_size"]).save_pretrained(partial)
    partial.rename(path)
    return str(path)


def scaled(n: int, scale: float, least: int = 1) -> int:
    return max(least, round(n * scale))


def build_dataset(num_prompts: int, shared: int, own: int, vocab: int, seed: int = 0):
    """Prompts of `shared` tokens common to all (a long system prompt) + `own` tokens of their own."""
    from datasets import Dataset

    rng = random.Random(seed)
    system = " ".join(f"t{rng.randrange(3, vocab)}" for _ in range(shared))
    prompts = [system + " " + " ".join(f"t{rng.randrange(3, vocab)}" for _ in range(own)) for _ in range(num_prompts)]
    return Dataset.from_dict({"prompt": prompts})


def even_token_reward(completions, completion_ids, **kwargs) -> list[float]:
    """A cheap reward that varies (the timing does not depend on it)."""
    return [sum(i % 2 == 0 for i in ids) / max(len(ids), 1) for ids in completion_ids]


# ---- what each side records


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class PhaseTimer:
    """CUDA-synchronized seconds per phase, per optimizer step (`steps[k][phase]`), and each generation call's
    `(prompt_ids, completion_ids)` (one call per optimizer step here)."""

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self.generations: list[tuple[list, list]] = []
        self._before: dict[str, float] = {}

    def wrap(self, owner, name: str, phase: str) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            _sync()
            start = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                _sync()
                self.totals[phase] += time.perf_counter() - start
            if phase == "generation":  # (prompt_ids, images, ...) -> (completion_ids, logprobs)
                self.generations.append(([list(p) for p in args[0]], [list(c) for c in out[0]]))
            return out

        setattr(owner, name, timed)

    def callback(self):
        from transformers import TrainerCallback

        timer = self

        class Steps(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                timer._before = dict(timer.totals)

            def on_step_end(self, args, state, control, **kwargs):
                phases = ("generation", "logprob_forwards", "backward")
                step = {p: timer.totals[p] - timer._before.get(p, 0.0) for p in phases}
                step["trainer_phase"] = step["logprob_forwards"] + step["backward"]
                timer.steps.append(step)

        return Steps()


class FirstStepScores:
    """The first optimizer step's policy forwards (`_get_per_token_logps_and_entropies` under grad, every micro-batch
    of the step): the completion tokens and their log-probabilities, rows sorted by their tokens (TRL shuffles a
    step's rows over its micro-batches, the tree keeps each group in one). With `perturb`, the model's weights get
    noise of that relative size just before the first log-probability forward (`--perturb-tree`)."""

    def __init__(self, perturb: float = 0.0):
        self.rows, self.perturb = [], perturb

    def install(self, trainer):
        hook = trainer._get_per_token_logps_and_entropies

        def recording(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
            if self.perturb:
                perturb(trainer.model, self.perturb)
                self.perturb = 0.0
            out = hook(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
            if trainer.state.global_step == 0 and torch.is_grad_enabled():
                whole, mask = attention_mask.bool().cpu(), attention_mask[:, -logits_to_keep:].bool().cpu()
                ids, logps = input_ids.cpu(), out[0].detach().float().cpu()
                for row, w, m, lp in zip(ids, whole, mask, logps):
                    self.rows.append((row[w].tolist(), row[-logits_to_keep:][m].tolist(), lp[m].tolist()))
            return out

        trainer._get_per_token_logps_and_entropies = recording

    def scores(self) -> dict:
        rows = sorted(self.rows)
        return {"targets": [t for _, ids, _ in rows for t in ids], "log_probs": [v for _, _, lps in rows for v in lps]}


def perturb(model: torch.nn.Module, eps: float) -> None:
    """Adds `eps` x each weight's RMS of seeded Gaussian noise to `model`'s weights."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=generator).to(p.device, p.dtype)
            p.add_(eps * p.float().pow(2).mean().sqrt().to(p.dtype) * noise)


def replay(path: str):
    """Stands in for `_generate_single_turn` on the reference side: the rows another side generated on its first
    step (the same prompts, checked)."""
    recorded = json.loads(Path(path).read_text())

    def generate(prompt_ids, images=None, multimodal_fields=None, num_generations=None, has_tool_images=False):
        if [list(p) for p in prompt_ids] != recorded["prompt_ids"]:
            raise RuntimeError(f"the reference's first prompts are not the ones {path} holds")
        return [list(c) for c in recorded["completion_ids"]], None

    return generate


def step_measures(config, prompt_ids: list, completion_ids: list) -> dict:
    """One step's rows: model FLOPs (3x the forward FLOPs of each prompt's group as one prefix forest), the token and
    FLOP ceilings (TRL's padded rows over those forests) and a digest of the rows (the same batch on both sides)."""
    rows = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids)]
    groups = defaultdict(list)
    for i, p in enumerate(prompt_ids):
        groups[tuple(p)].append(i)
    tree_tokens = tree_flops = 0.0
    for members in groups.values():
        group = [rows[i] for i in members]
        estimate = estimate_flops(config, group, prompt_lengths=[len(prompt_ids[i]) for i in members])
        tree_tokens += estimate["token_ratio"] * sum(map(len, group))
        tree_flops += estimate["tree_flops"]
    prompt_width, width = max(map(len, prompt_ids)), max(map(len, prompt_ids)) + max(map(len, completion_ids))
    padded = estimate_flops(config, [[0] * width] * len(rows), prompt_lengths=[prompt_width] * len(rows))
    return {"flops": 3 * tree_flops, "token_ceiling": len(rows) * width / tree_tokens,
            "flops_ceiling": padded["flat_flops"] / tree_flops,
            "digest": zlib.crc32(str(sorted(rows)).encode())}  # fmt: skip


# ---- one side of one row


def side_main(args) -> dict:
    """One side (`args.side`) of one row (`args.models[0]`, `args.modes[0]`), in this process."""
    from trl import GRPOConfig, GRPOTrainer

    from hf_tree_attn.trainer import TreeGRPOConfig, TreeGRPOTrainer

    name, mode, side = args.models[0], args.modes[0], args.side
    tree, reference = side == "tree", side == "reference"
    config_class, trainer_class = (TreeGRPOConfig, TreeGRPOTrainer) if tree else (GRPOConfig, GRPOTrainer)
    cuda = torch.cuda.is_available()
    path = model_dir(name)
    tokenizer = build_tokenizer(SHAPES[name]["vocab_size"])
    total = args.warmup + args.steps
    dataset = build_dataset(max(64, args.prompts_per_step * total), scaled(args.shared_prompt, args.scale),
                            scaled(args.own_prompt, args.scale), SHAPES[name]["vocab_size"])  # fmt: skip
    training_args = config_class(
        output_dir=tempfile.mkdtemp(prefix="bench_generation_modes_"), bf16=cuda and not reference, use_cpu=not cuda,
        seed=0, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
        per_device_train_batch_size=args.generations, num_generations=args.generations,
        gradient_accumulation_steps=args.prompts_per_step,
        max_completion_length=scaled(args.completion, args.scale, least=2),
        max_steps=1 if reference else total, learning_rate=0.0, gradient_checkpointing=True,
        model_init_kwargs={"dtype": torch.float32 if reference else torch.bfloat16},
        **({} if reference else MODES[mode]),
    )  # fmt: skip
    clock, timer, scores = StepClock(args.warmup), PhaseTimer(), FirstStepScores(args.perturb_tree if tree else 0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trainer_class(path, even_token_reward, training_args, train_dataset=dataset,
                                processing_class=tokenizer, callbacks=[clock, timer.callback()])  # fmt: skip
        if reference:
            trainer._generate_single_turn = replay(os.environ[REPLAY])
        timer.wrap(trainer, "_generate_single_turn", "generation")
        timer.wrap(trainer, "_get_per_token_logps_and_entropies", "logprob_forwards")
        timer.wrap(trainer.accelerator, "backward", "backward")
        scores.install(trainer)
        trainer.train()
    if reference:
        return {"first_scores": scores.scores(), "dtype": "float32"}
    if os.environ.get(RECORD) and timer.generations:  # the rows the reference side replays
        prompt_ids, completion_ids = timer.generations[0]
        Path(os.environ[RECORD]).write_text(json.dumps({"prompt_ids": prompt_ids, "completion_ids": completion_ids}))
    timing = clock.summary()
    times = timing["measured_step_s"]
    config = model_config(name)
    measures = [step_measures(config, p, c) for p, c in timer.generations[:total]]
    measured, phases = measures[args.warmup :], timer.steps[args.warmup :]
    logs = [e for e in trainer.state.log_history if "loss" in e]
    decision = getattr(trainer, "tree_compile", None)
    return {
        **timing,
        "mode": mode,
        "phase_s": {p: [s[p] for s in timer.steps] for p in timer.steps[0]},
        "trainer_phase_s": [s["trainer_phase"] for s in phases],
        "generation_s": [s["generation"] for s in phases],
        "median_trainer_phase_s": statistics.median(s["trainer_phase"] for s in phases),
        "median_generation_s": statistics.median(s["generation"] for s in phases),
        "trainer_share": statistics.median(s["trainer_phase"] / t for s, t in zip(phases, times)),
        "generation_share": statistics.median(s["generation"] / t for s, t in zip(phases, times)),
        "batch_digests": [m["digest"] for m in measures],
        "completion_tokens_per_step": [sum(map(len, c)) for _, c in timer.generations[:total]],
        "token_ceiling_per_step": [m["token_ceiling"] for m in measured],
        "token_ceiling": statistics.mean(m["token_ceiling"] for m in measured),
        "flops_ceiling": statistics.mean(m["flops_ceiling"] for m in measured),
        "mfu_per_step": [m["flops"] / t / PEAK_FLOPS for m, t in zip(measured, times)],
        "mfu": statistics.mean(m["flops"] / t / PEAK_FLOPS for m, t in zip(measured, times)),
        "trainer_phase_mfu": statistics.mean(
            m["flops"] / s["trainer_phase"] / PEAK_FLOPS for m, s in zip(measured, phases)
        ),
        "loss": [e["loss"] for e in logs],
        "tree_fallback": [e.get("tree_fallback") for e in logs] if tree else None,
        "tree_token_ratio": [e.get("tree_token_ratio") for e in logs] if tree else None,
        "tree_compile": None if decision is None else {"kwargs": decision.kwargs, "source": decision.source},
        "perturb_tree": args.perturb_tree if tree else None,
        "first_scores": scores.scores(),
        "dynamo": compile_report(trainer),
    }


# ---- the parent: rows, pairs


def _pair(row: dict) -> None:
    """`row["paired"]` and `row["agreement"]` for every pair of `PAIRS` whose two sides ran (`harness.pair_sides`:
    per-step ratios of whole steps, and the agreement: first-step scores against the float32 reference, the same
    batches on every step, no tree fallback; a pair that fails it is marked `failed`), with the trainer phase's and
    generation's own per-step ratios and the trainer phase's share of each ceiling."""
    for key in pair_sides(row, PAIRS, "bfloat16", lambda a, b: a["batch_digests"] == b["batch_digests"]):
        a, b = (row["sides"][side] for side in key.split(" vs "))
        pair = row["paired"][key]
        pair["same_batches"] = row["agreement"][key]["same_batches"]
        try:
            pair["trainer_phase"] = paired(b["trainer_phase_s"], a["trainer_phase_s"])
            pair["generation"] = paired(b["generation_s"], a["generation_s"])
        except (ValueError, ZeroDivisionError) as error:
            row["paired"][key] = {"error": str(error), "same_batches": pair["same_batches"], "failed": True}
            continue
        pair["trainer_phase"]["share_of_token_ceiling"] = pair["trainer_phase"]["median"] / a["token_ceiling"]
        pair["trainer_phase"]["share_of_flops_ceiling"] = pair["trainer_phase"]["median"] / a["flops_ceiling"]


def _summary(row: dict) -> str:
    parts = [f"{row['model']:<11} {row['workload']:<20}"]
    if "skipped" in row:
        return parts[0] + f" skipped: {row['skipped']}"
    for side, r in row["sides"].items():
        if "error" in r:
            parts.append(f"{side}: {r['error'][:90]} {r.get('output_tail', '')[-600:]}")
        elif "median_step_s" in r:
            peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
            parts.append(
                f"{side}: step {r['median_step_s']:.3f} s (first {r['first_step_s']:.1f} s), generation "
                f"{r['median_generation_s']:.3f} s ({100 * r['generation_share']:.0f}%), trainer phase "
                f"{r['median_trainer_phase_s']:.3f} s ({100 * r['trainer_share']:.0f}%)  mfu {100 * r['mfu']:.2f}%  "
                f"{peak} GiB  ceiling {r['token_ceiling']:.2f}x tokens, {r['flops_ceiling']:.2f}x FLOPs"
            )
        elif "first_scores" in r:
            parts.append(f"{side}: {len(r['first_scores']['targets'])} first-step tokens scored in float32")
    for key, pair in row["paired"].items():
        check = row["agreement"].get(key, {})
        errors = check.get("max_error", {})
        detail = f"max |diff| {check.get('max_abs')}"
        if errors:
            detail = f"max error tree {errors['candidate']:.3g} trl {errors['baseline']:.3g}"
        status = "FAILED agreement" if pair.get("failed") else "agrees"
        common = (f"{status} ({detail}, same targets {check.get('same_targets')}, same batches "
                  f"{check.get('same_batches')}, fallbacks {check.get('tree_fallback')})")  # fmt: skip
        if "median" in pair:
            phase, gen = pair["trainer_phase"], pair["generation"]
            parts.append(
                f"{key}: step {pair['median']:.2f}x [{pair['min']:.2f}, {pair['max']:.2f}], trainer phase "
                f"{phase['median']:.2f}x [{phase['min']:.2f}, {phase['max']:.2f}], generation {gen['median']:.2f}x "
                f"[{gen['min']:.2f}, {gen['max']:.2f}]; {common}"
            )
        else:
            parts.append(f"{key}: {pair['error']}; {common}")
    return "\n  ".join(parts)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b"], choices=list(SHAPES))
    parser.add_argument("--modes", "--workloads", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    parser.add_argument("--generations", type=int, default=16, help="G, completions per prompt")
    parser.add_argument("--prompts-per-step", type=int, default=2, help="prompts (groups) per optimizer step")
    parser.add_argument("--shared-prompt", type=int, default=2048, help="system-prompt tokens shared by all")
    parser.add_argument("--own-prompt", type=int, default=64, help="tokens of each prompt's own part")
    parser.add_argument("--completion", type=int, default=256, help="max_completion_length")
    parser.add_argument(
        "--perturb-tree",
        type=float,
        default=0.0,
        help="noise of this relative size on the tree side's weights (its agreement must fail)",
    )
    args = side_arguments(parser, SIDES, "benchmarks/results/generation_modes.json")
    if run_child(args, side_main):
        return
    results = {
        **provenance(),
        "sides": "trl: trl.GRPOTrainer, bf16 weights; tree: TreeGRPOTrainer, the same settings; reference: "
        "trl.GRPOTrainer in float32, one step, replaying the first step's completions (agreement)",
        "workload": {k: getattr(args, k) for k in WORKLOAD},
        "peak_flops": PEAK_FLOPS,
        "rows": [],
    }
    rows = [(m, w) for m in args.models for w in args.modes]
    out, earlier = result_file(args, results, rows)
    runnable = []
    for model, mode in rows:
        reason = skipped(mode)
        if reason is None:
            runnable.append((model, mode))
            continue
        row = {"model": model, "workload": mode, "skipped": reason, "sides": {}, "paired": {}, "agreement": {}}
        results["rows"].append(row)
        print(_summary(row), flush=True)
    out.write_text(json.dumps(results, indent=1))
    # Where the timed sides leave their first step's rows for the reference side (kept between calls of --resume).
    scratch = SCRATCH / hashlib.sha1(str(out.resolve()).encode()).hexdigest()[:12]
    scratch.mkdir(parents=True, exist_ok=True)

    def env(side: str) -> dict:
        row = results["rows"][-1]
        stem = f"{row['model']}-{row['workload']}"
        if side != "reference":
            return {RECORD: str(scratch / f"{stem}-{side}.json"), REPLAY: None}
        recorded = [scratch / f"{stem}-{s}.json" for s in ("trl", "tree")]
        return {REPLAY: str(next((p for p in recorded if p.exists()), recorded[0])), RECORD: None}

    child = [f"--steps={args.steps}", f"--warmup={args.warmup}", f"--scale={args.scale}",
             f"--generations={args.generations}", f"--prompts-per-step={args.prompts_per_step}",
             f"--shared-prompt={args.shared_prompt}", f"--own-prompt={args.own_prompt}",
             f"--completion={args.completion}", f"--perturb-tree={args.perturb_tree}"]  # fmt: skip
    sides = sorted(args.sides, key=lambda s: s == "reference")  # the reference replays a timed side's rows
    run_rows(Path(__file__), out, results, runnable, sides, {
        "argv": child, "env": env, "pair": _pair, "summary": _summary, "earlier": earlier})  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
