"""End-to-end GRPO steps per TRL generation mode, tree vs TRL flat: what share of a step the trainer phase is.

The tree only speeds up the trainer phase (old-policy / reference / policy log-prob forwards and the backward);
generation is unchanged. So the end-to-end gain depends on the generation mode. For each mode this runs a few
real `trainer.train()` steps of `TreeGRPOTrainer` and of `trl.GRPOTrainer` on a random-weight Qwen3-shaped model
(bf16, no download; a word-level tokenizer with Qwen3's vocabulary size built in code) and times, per optimizer
step (CUDA-synchronized):

- generation: `_generate_single_turn` (HF generate, continuous batching or vLLM, whatever the mode uses);
- log-prob forwards: every `_get_per_token_logps_and_entropies` call (old-policy, reference, policy);
- backward: `accelerator.backward`;
- step: `on_step_begin` to `on_step_end` (also rewards, tokenization, the optimizer step).

The trainer phase is log-prob forwards + backward. The first step (warm-up, compilation) is reported apart.

    python benchmarks/bench_generation_modes.py --out benchmarks/results/generation_modes_h200.json
    python benchmarks/bench_generation_modes.py --modes generate continuous_batching --steps 3   # a subset

Modes: generate (HF, dynamic cache), static_cache, compiled (`torch_compile=True`), continuous_batching, and
vllm_colocate (only where vLLM is installed; reported as skipped otherwise).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import platform
import random
import statistics
import tempfile
import time
from collections import defaultdict

import torch
from harness import provenance
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config, TrainerCallback

SHAPES = {
    "qwen3-0.6b": dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
    ),
    # A smoke test of this script on a CPU: `--model tiny --shared-prompt 64 --completion 8 --generations 4`.
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


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Word-level tokenizer over `t0 .. t{V-1}` (t0 = pad, t1 = eos): any id decodes, as in a real vocabulary."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", padding_side="left")


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


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class PhaseTimer(TrainerCallback):
    """CUDA-synchronized time per phase, per optimizer step."""

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self._start: tuple[float, dict] | None = None

    def wrap(self, owner, name: str, phase: str) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            _sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _sync()
                self.totals[phase] += time.perf_counter() - start

        setattr(owner, name, timed)

    def on_step_begin(self, args, state, control, **kwargs):
        _sync()
        self._start = (time.perf_counter(), dict(self.totals))

    def on_step_end(self, args, state, control, **kwargs):
        _sync()
        start, before = self._start
        step = {phase: self.totals[phase] - before.get(phase, 0.0) for phase in self.totals}
        step["step"] = time.perf_counter() - start
        self.steps.append(step)
        # each step as it ends: a run stopped by a time limit still shows the steps it finished
        phases = ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in sorted(step.items()))
        print(f"  step {state.global_step}: {phases}", flush=True)


def run(mode: str, tree: bool, model_dir: str, tokenizer, dataset, args) -> dict:
    from trl import GRPOConfig, GRPOTrainer

    from hf_tree_attn.trainer import TreeGRPOConfig, TreeGRPOTrainer

    config_cls, trainer_cls = (TreeGRPOConfig, TreeGRPOTrainer) if tree else (GRPOConfig, GRPOTrainer)
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    config = config_cls(
        output_dir=tempfile.mkdtemp(), bf16=cuda, use_cpu=not cuda, seed=0, report_to="none", save_strategy="no",
        logging_steps=1,
        per_device_train_batch_size=args.generations, num_generations=args.generations,
        gradient_accumulation_steps=args.prompts_per_step, max_completion_length=args.completion,
        max_steps=args.steps, learning_rate=1e-6, gradient_checkpointing=True,
        model_init_kwargs={"dtype": dtype}, **MODES[mode],
    )  # fmt: skip
    trainer = trainer_cls(model_dir, even_token_reward, config, train_dataset=dataset, processing_class=tokenizer)
    timer = PhaseTimer()
    timer.wrap(trainer, "_generate_single_turn", "generation")
    timer.wrap(trainer, "_get_per_token_logps_and_entropies", "logprob_forwards")
    timer.wrap(trainer.accelerator, "backward", "backward")
    trainer.add_callback(timer)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    result = {
        "warmup_step": timer.steps[0],
        "steps": timer.steps[1:],
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "tree_token_ratio": [entry.get("tree_token_ratio") for entry in logs],
        "tree_fallback": [entry.get("tree_fallback") for entry in logs],
    }
    measured = timer.steps[1:] or timer.steps
    mean = {key: statistics.mean(step.get(key, 0.0) for step in measured) for key in measured[0]}
    mean["trainer_phase"] = mean.get("logprob_forwards", 0.0) + mean.get("backward", 0.0)
    mean["trainer_share"] = mean["trainer_phase"] / mean["step"]
    mean["generation_share"] = mean.get("generation", 0.0) / mean["step"]
    result["mean"] = mean
    del trainer
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def write_results(path: str | None, args: argparse.Namespace, results: dict) -> None:
    """The results so far, with the command, device and versions (rewritten after every run: a time limit that
    stops the script keeps what finished)."""
    if not path:
        return
    meta = {
        **provenance(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu",
        "model": f"random-weight {args.model} shape, bf16 on CUDA, gradient checkpointing",
        "workload": vars(args),
    }  # fmt: skip
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b", choices=list(SHAPES), help="random-weight model shape")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run; the first is warm-up")
    parser.add_argument("--generations", type=int, default=16, help="G, completions per prompt")
    parser.add_argument("--prompts-per-step", type=int, default=2, help="prompts (groups) per optimizer step")
    parser.add_argument("--shared-prompt", type=int, default=2048, help="system-prompt tokens shared by all")
    parser.add_argument("--own-prompt", type=int, default=64, help="tokens of each prompt's own part")
    parser.add_argument("--completion", type=int, default=256, help="max_completion_length")
    parser.add_argument(
        "--sides",
        nargs="+",
        default=["tree", "flat"],
        choices=["tree", "flat"],
        help="which trainers to run (a run cut short can be completed side by side in parts)",
    )
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args()
    shape = SHAPES[args.model]

    torch.manual_seed(0)
    tokenizer = build_tokenizer(shape["vocab_size"])
    model = AutoModelForCausalLM.from_config(Qwen3Config(**shape, pad_token_id=0, eos_token_id=1, bos_token_id=None))
    model_dir = tempfile.mkdtemp()
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    del model
    dataset = build_dataset(64, args.shared_prompt, args.own_prompt, shape["vocab_size"])

    results = {}
    for mode in args.modes:
        if mode == "vllm_colocate" and importlib.util.find_spec("vllm") is None:
            results[mode] = {"skipped": "vllm is not installed"}
            print(f"{mode}: skipped (vllm is not installed)", flush=True)
            continue
        results[mode] = {}
        for name in args.sides:
            try:
                results[mode][name] = run(mode, name == "tree", model_dir, tokenizer, dataset, args)
            except Exception as error:  # one mode failing must not lose the others' numbers
                results[mode][name] = {"error": f"{type(error).__name__}: {error}"[:2000]}
            mean = results[mode][name].get("mean")
            summary = results[mode][name].get("error") if mean is None else (
                f"step {mean['step']:.2f} s, generation {mean.get('generation', 0):.2f} s "
                f"({100 * mean['generation_share']:.0f}%), trainer phase {mean['trainer_phase']:.2f} s "
                f"({100 * mean['trainer_share']:.0f}%)"
            )  # fmt: skip
            print(f"{mode:20s} {name:5s} {summary}", flush=True)
            write_results(args.out, args, results)

    print("\n| mode | flat step (s) | trainer phase share, flat | tree step (s) | trainer phase share, tree | "
          "trainer phase tree vs flat | step tree vs flat |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for mode, pair in results.items():
        flat, tree = (pair.get(k, {}).get("mean") for k in ("flat", "tree"))
        if flat and tree:
            print(
                f"| {mode} | {flat['step']:.2f} | {100 * flat['trainer_share']:.0f}% | {tree['step']:.2f} | "
                f"{100 * tree['trainer_share']:.0f}% | {flat['trainer_phase'] / tree['trainer_phase']:.2f}x | "
                f"{flat['step'] / tree['step']:.2f}x |"
            )
        else:
            print(f"| {mode} | {json.dumps(pair)[:100]} |")

    write_results(args.out, args, results)
    if args.out:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
