"""TreeAsyncGRPOTrainer vs TRL's own AsyncGRPOTrainer through `trainer.train()`, on the same replayed samples.

Asynchronous GRPO (`trl.experimental.async_grpo`): a vLLM server generates while the trainer trains, so the trainer
step is the step. Both trainers here get the same rollouts from `hf_tree_attn.trainer.replay.ReplayRolloutWorker`
(no server; `NoWeightTransfer` syncs nothing) in the same order, through TRL's token-budget planner, so they train
the same micro-batches. TRL's trainer packs each rank's samples into its own trie and attends with FlashAttention-3
from the Hub, which the H200 cannot download: its side runs PyTorch's FlashAttention-2 varlen op instead
(`torch.ops.aten._flash_attention_forward`, `tests/trl_varlen.py`), checked against a plain-torch reference first.
The tree side runs `tree_flex` (FlexAttention, or the shared-prefix kernels where they are faster).

Each side runs in a process of its own (`harness.run_side`). Sides:

- `trl`: TRL's trainer at its defaults (`AsyncGRPOConfig`: gradient checkpointing, bf16 autocast, one micro-batch
  per step, its learning rate and optimizer), `dtype="bfloat16"` weights, an explicit `token_budget`;
- `trl_compiled`: the same with the fastest setting a TRL user can pick, accelerate's regional compilation of its
  decoder layers (`ACCELERATE_DYNAMO_BACKEND=INDUCTOR`, `..._USE_REGIONAL_COMPILATION=1`, `..._USE_DYNAMIC=1`);
- `tree`: `TreeAsyncGRPOTrainer` at its defaults (on CUDA its decoder layers compiled, `tree_compile="auto"`; with
  FlashAttention-4 installed, on a Hopper or Blackwell GPU, FlexAttention on its kernels);
- `tree_triton`: the same on FlexAttention's Triton kernels whatever is installed (`HF_TREE_ATTN_FLEX_KERNEL_OPTIONS=
  {}`);
- `tree_eager`: the same with `tree_compile=False`;
- `tree_budget`: the tree with `tree_activation_budget_gib=--activation-budget-gib` (fewer layers recompute);
- `tree_reuse`: the tree with `tree_prefix_reuse=True`: the rows of an optimizer step (`--accumulation` of them)
  scored as one forest in chunks of at most `token_budget` rows, each shared prefix forwarded once per step where
  TRL's rows (and `tree`'s) each forward the prefixes their samples need;
- `tree_flash`: the tree with FlexAttention on FlashAttention-4's kernels (`HF_TREE_ATTN_FLEX_KERNEL_OPTIONS=
  {"BACKEND": "FLASH"}`; needs `flash_attn.cute`, benchmarks/fa4_wheels.sh) in its compiled layers; where the
  compiler fails on that backend the trainer turns it off and goes on on the Triton kernels, and the side is then
  recorded as failed, with the trainer's warning, not as a speed-up;
- `tree_fa4`: the tree with its shared-prefix attention on FlashAttention-4's varlen kernels for every two-level
  forest (`HF_TREE_ATTN_PREFIX_KERNEL=fa4`; the same package).

Models: random bf16 weights from configs shaped like Qwen3-1.7B / 8B and Qwen3.5-0.8B / 2B (no download; TRL
refuses the Qwen3.5 hybrids, and its refusal is recorded). Workloads:

- `grpo_mixed`: groups of G=16 completions, prompts U[1000, 6000] tokens, completions U[64, 1024];
- `grpo_P4096_C512`: G=16, 4,096-token prompts, 512-token completions;
- `tau2_like`: conversations sharing a 4,800-token system prompt, U[10, 20] turns of a U[40, 200]-token message
  and two U[80, 400]-token responses, each response a sample holding the whole history before it;
- `agent_2x20x4`: long agent conversations, 2 per replay cycle, sharing a 4,096-token system prompt, 20 turns of a
  1,700-token tool + user message and 4 sampled 600-token answers (the first continues the conversation): a
  conversation (up to ~50k tokens, ~86k unique) spans several rows (`--token-budget 65536 --accumulation 4`).

Per side: the wall time of every optimizer step (CUDA-synchronized; planner, collator, forward, backward, optimizer
and weight sync included; the first from `train()`'s start, so it holds the compile), trained tokens per second,
MFU, peak memory after the warm-up, and the forwarded tokens against the step's unique tokens (its samples as one
prefix forest). `mfu` counts the same model FLOPs for both sides: 3x the forward FLOPs of the
step's samples as one prefix forest (`estimate_flops`' `tree_flops`; forward + backward, recompute not counted) per
step second over 989 TFLOP/s. Per row, `paired[candidate vs reference]`: for each measured step, the reference
side's seconds over the candidate's on the same step (the same samples), min / median / max (`harness.paired`), and
`agreement[...]`: the first micro-batch's per-token log-probabilities of the two sides on the same tokens (their
targets compared first), each side's error to the `reference` side's (TRL's trainer in float32) at most twice the
other's plus one bf16 rounding (`harness.agreement`; without a reference side, their difference within
`harness.LOGPROB_BOUND`); a pair that fails it is marked failed.

    python benchmarks/bench_async_grpo.py --models qwen3-1.7b --workloads grpo_mixed tau2_like \\
        --sides trl trl_compiled tree tree_eager --out benchmarks/results/async_grpo_h200_qwen3-1.7b.json
    python benchmarks/bench_async_grpo.py --models qwen3.5-0.8b --token-budget 16384 --sides tree
    python benchmarks/bench_async_grpo.py --workloads agent_2x20x4 --token-budget 65536 --accumulation 4 \
        --sides reference trl tree tree_reuse          # prefix reuse across a step's rows against TRL's packing
    python benchmarks/bench_async_grpo.py --models qwen3.5-2b --workloads tau2_like --sides tree --gdn-route fla_triton
    python benchmarks/bench_async_grpo.py --models tiny --scale 0.02 --token-budget 512 --warmup 1 --steps 8  # CPU
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3_5TextConfig, Qwen3Config, TrainerCallback

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks"), str(REPO / "tests")]
from bench_tree_vs_flat import CONFIG_CLASSES, MODELS, PEAK_FLOPS  # noqa: E402
from trl_varlen import flash_varlen_attention, use_kernel, varlen_attention  # noqa: E402

from hf_tree_attn import pack_forest  # noqa: E402
from hf_tree_attn.metrics import estimate_flops  # noqa: E402
from hf_tree_attn.trainer.replay import NoWeightTransfer, ReplayRolloutWorker, agent_samples, grpo_samples  # noqa: E402

# Shapes to try the script on a CPU (`--models tiny tiny-hybrid --scale 0.02`).
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=1024, tie_word_embeddings=True)  # fmt: skip
TINY_HYBRID = dict(TINY, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                   linear_value_head_dim=16, linear_conv_kernel_dim=4,
                   layer_types=["linear_attention", "full_attention"])  # fmt: skip
TRL_KERNEL = "torch.ops.aten._flash_attention_forward (PyTorch's FlashAttention-2 varlen op)"


def workload(name: str, scale: float, vocab: int, seed: int = 0) -> tuple[list, dict]:
    """The replayed samples of a workload (lengths times `scale`) and its spec."""
    s = lambda n: max(1, round(n * scale))  # noqa: E731
    if name == "grpo_mixed":
        spec = {"G": 16, "prompt": f"U[{s(1000)},{s(6000)}]", "completion": f"U[{s(64)},{s(1024)}]"}
        return grpo_samples(12, 16, (s(1000), s(6000)), (s(64), s(1024)), vocab, seed), spec
    if name == "grpo_P4096_C512":
        spec = {"G": 16, "prompt": s(4096), "completion": s(512)}
        return grpo_samples(12, 16, (s(4096), s(4096)), (s(512), s(512)), vocab, seed), spec
    if name == "tau2_like":
        spec = {"system": s(4800), "turns": "U[10,20]", "message": f"U[{s(40)},{s(200)}]",
                "response": f"U[{s(80)},{s(400)}]", "branches": 2}  # fmt: skip
        return agent_samples(8, (10, 20), s(4800), (s(40), s(200)), (s(80), s(400)), vocab, seed=seed), spec
    if name == "agent_2x20x4":
        spec = {"system": s(4096), "turns": 20, "message": s(1700), "response": s(600), "branches": 4}
        samples = agent_samples(2, (20, 20), s(4096), (s(1700), s(1700)), (s(600), s(600)), vocab, 4, seed)
        return samples, spec
    raise ValueError(f"unknown workload {name!r}")


def model_config(name: str):
    if name == "tiny":
        return Qwen3Config(**TINY)
    if name == "tiny-hybrid":
        return Qwen3_5TextConfig(**TINY_HYBRID)
    return CONFIG_CLASSES.get(name, Qwen3Config)(**MODELS[name])


def build_tokenizer(vocab_size: int):
    """Word-level `t0 .. t{V-1}` (t0 pad, t1 eos): TRL's constructor wants a tokenizer; nothing is decoded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", padding_side="left")


def build_from_config(model_id: str, **kwargs):
    """Stands in for TRL's `create_model_from_path` (both sides): random weights from the saved config, seeded,
    built on the GPU in the requested dtype (no weights are written or read)."""
    config = AutoConfig.from_pretrained(model_id)
    dtype = kwargs.get("dtype", "float32")
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        return AutoModelForCausalLM.from_config(
            copy.deepcopy(config), attn_implementation=kwargs["attn_implementation"], dtype=dtype
        )


class ProfileStep(TrainerCallback):
    """One optimizer step (`step`, counted from 0) under the torch profiler, after the timed ones: where its time
    goes (`profile_step.summarize`)."""

    def __init__(self, step: int):
        self.step, self.summary, self._prof = step, None, None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            from torch.profiler import ProfilerActivity, profile

            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self._prof.__enter__()
            self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self._prof is not None and self.summary is None:
            from profile_step import summarize

            if torch.cuda.is_available():
                torch.cuda.synchronize()
            wall = time.perf_counter() - self._t0
            self._prof.__exit__(None, None, None)
            self.summary = summarize(self._prof, wall, top=12)
            self._prof = None


class RowLog:
    """The planner rows each collator call packed, in order (one call per micro-batch; the dispatcher fetches one
    ahead), recorded on both sides' collator classes."""

    def __init__(self):
        self.calls: list[list[dict]] = []

    def __enter__(self):
        from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout

        from hf_tree_attn.trainer.rollout_forest import TreeDataCollatorForRollout

        self._saved = [(cls, cls.torch_call) for cls in (DataCollatorForRollout, TreeDataCollatorForRollout)]
        for cls, call in self._saved:
            cls.torch_call = self._recording(call)
        return self

    def _recording(self, call):
        def torch_call(collator, examples):
            self.calls.append([sample for row in examples[0] for sample in row.samples])
            return call(collator, examples)

        return torch_call

    def __exit__(self, *exc):
        for cls, call in self._saved:
            cls.torch_call = call


def step_flops(config, samples: list[dict]) -> float:
    """3x the forward FLOPs of `samples` as one prefix forest, the LM head on their trained tokens."""
    sequences = [sample["input_ids"] for sample in samples]
    prompts = [int(sample["completion_mask"].argmax()) for sample in samples]
    return 3 * estimate_flops(config.get_text_config(), sequences, prompt_lengths=prompts)["tree_flops"]


# What accelerate reads to compile the decoder layers regionally, with dynamic shapes (an accelerate config's
# `dynamo_config` sets the same through `accelerate launch`).
REGIONAL_COMPILE = {"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR", "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "1",
                    "ACCELERATE_DYNAMO_USE_DYNAMIC": "1"}  # fmt: skip
# What each side changes: its trainer (TRL's or the tree's), config fields, environment for accelerate.
SIDES = {
    "trl": (False, {}, {}),
    "trl_compiled": (False, {}, REGIONAL_COMPILE),
    "tree": (True, {}, {}),
    "tree_eager": (True, {"tree_compile": False}, {}),
    "tree_budget": (True, {"tree_activation_budget_gib": None}, {}),
    "tree_reuse": (True, {"tree_prefix_reuse": True}, {}),
    "tree_triton": (True, {}, {"HF_TREE_ATTN_FLEX_KERNEL_OPTIONS": "{}"}),
    "tree_flash": (True, {}, {"HF_TREE_ATTN_FLEX_KERNEL_OPTIONS": '{"BACKEND": "FLASH"}'}),
    "tree_fa4": (True, {}, {"HF_TREE_ATTN_PREFIX_KERNEL": "fa4"}),
    # TRL's trainer in float32 (weights, no autocast, plain-torch attention), one step: the exact per-token values the
    # agreement checks measure each side's error against.
    "reference": (False, {}, {}),
}  # fmt: skip
# (candidate, reference) pairs reported per row where both sides ran.
PAIRS = [("tree", "trl"), ("tree", "trl_compiled"), ("tree_eager", "trl"), ("tree", "tree_eager"),
         ("tree_budget", "trl"), ("tree_reuse", "trl"), ("tree_reuse", "tree"), ("tree_flash", "trl"),
         ("tree_flash", "tree"), ("tree_fa4", "trl"), ("tree_fa4", "tree"), ("tree_triton", "trl"),
         ("tree_flash", "tree_triton"), ("tree", "tree_triton")]  # fmt: skip


class ScoresTaken(Exception):
    """Raised by `FirstScores(stop=True)` once the first micro-batch is scored: the run needs nothing more."""


class FirstScores:
    """The first micro-batch's scored tokens: their targets and log-probabilities, in TRL's loss order (the same
    order on both sides, which the targets check). TRL's side: what its fused head returns at `token_index`; the
    tree's: the forest's table at the same rows (`_ForestForward`). `stop`: score that micro-batch without autograd
    and raise `ScoresTaken` (no backward, no optimizer state: the float32 reference of an 8B model fits)."""

    def __init__(self, stop: bool = False):
        self.targets, self.log_probs, self.stop = None, None, stop

    def install(self, trainer, tree: bool):
        compute_loss = trainer.compute_loss

        def recording(model, inputs, *args, **kwargs):
            if self.targets is not None:
                return compute_loss(model, inputs, *args, **kwargs)
            if self.stop:
                with torch.no_grad():
                    record(model, inputs, *args, **kwargs)
                raise ScoresTaken
            return record(model, inputs, *args, **kwargs)

        def record(model, inputs, *args, **kwargs):
            selected = inputs["token_index"] >= 0
            if tree:
                from hf_tree_attn.trainer import async_grpo_trainer

                def scored(forward, **kw):  # one row's forest: TRL's token_index is its rows
                    out = calls[type(forward)](forward, **kw)
                    self.targets = forward.forest.input_ids[0, forward.rows].tolist()
                    self.log_probs = out.log_probs[forward.rows].float().tolist()
                    return out

                def scored_step(forward, **kw):  # prefix reuse: the step forest's rows of micro-batch 0's tokens
                    out = calls[type(forward)](forward, **kw)
                    step = forward.step.step
                    rows = step.token_index(forward.k, inputs["token_index"])[selected]
                    self.targets = step.forest.input_ids[0, rows.cpu()].tolist()
                    self.log_probs = out.log_probs[rows].float().tolist()
                    return out

                classes = {async_grpo_trainer._ForestForward: scored, async_grpo_trainer._StepForward: scored_step}
                calls = {cls: cls.__call__ for cls in classes}
                for cls, wrapper in classes.items():
                    cls.__call__ = wrapper
                try:
                    return compute_loss(model, inputs, *args, **kwargs)
                finally:
                    for cls, call in calls.items():
                        cls.__call__ = call
            mask = inputs["attention_mask"].bool()
            index = inputs["token_index"][selected]

            def forward(**kw):
                out = model(**kw)
                self.targets = inputs["shift_labels"][mask].flatten()[index].tolist()
                self.log_probs = out.log_probs.flatten()[index].float().tolist()
                return out

            return compute_loss(forward, inputs, *args, **kwargs)

        trainer.compute_loss = recording


def side_main(args) -> dict:
    """One side (`args.side`) of one row (`args.models[0]`, `args.workloads[0]`), in this process."""
    import gdn_kernels
    from datasets import Dataset
    from harness import StepClock, compile_report
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl.experimental.async_grpo import async_grpo_trainer as trl_async

    from hf_tree_attn.trainer import TreeAsyncGRPOConfig, TreeAsyncGRPOTrainer

    trl_async.create_model_from_path = build_from_config
    tree, fields, _ = SIDES[args.side]
    fields = {k: (args.activation_budget_gib if v is None else v) for k, v in fields.items()}
    config_class, trainer_class = (TreeAsyncGRPOConfig, TreeAsyncGRPOTrainer) if tree else (
        AsyncGRPOConfig, AsyncGRPOTrainer)  # fmt: skip
    cuda = torch.cuda.is_available()
    config = model_config(args.models[0])
    samples, spec = workload(args.workloads[0], args.scale, config.vocab_size)
    profiled = args.profile
    clock = StepClock(args.warmup)
    callbacks = [clock, *([ProfileStep(args.warmup + args.steps)] if profiled else [])]
    kernel = flash_varlen_attention if cuda else varlen_attention
    reference = args.side == "reference"
    if reference:
        kernel, args.dtype, args.warmup, args.steps, profiled = varlen_attention, "float32", 1, 0, False
        callbacks = [clock]
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)  # the path TRL's constructor loads (its config only: build_from_config)
        options = dict(
            **fields, output_dir=str(Path(tmp) / trainer_class.__name__), dtype=args.dtype,
            max_steps=args.warmup + args.steps + (1 if profiled else 0), token_budget=args.token_budget,
            gradient_accumulation_steps=args.accumulation,
            logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=not cuda,
            bf16=cuda and not reference, seed=0,
        )  # fmt: skip
        scores = FirstScores(stop=reference)
        route = contextlib.nullcontext()
        if args.gdn_route != "installed":
            route = gdn_kernels.select(args.gdn_route, lift_guard=True)
        gdn_kernels.install_probes()
        with (
            warnings.catch_warnings(record=True) as caught,
            use_kernel(kernel),
            RowLog() as rows,
            route,
            gdn_kernels.KernelProbe() as probe,
        ):
            warnings.simplefilter("always")  # recorded, not printed
            trainer = trainer_class(
                tmp, args=config_class(**options), train_dataset=Dataset.from_dict({"prompt": ["unused"] * 8}),
                processing_class=build_tokenizer(config.vocab_size), callbacks=callbacks,
                rollout_worker=ReplayRolloutWorker(samples, cycle=True), weight_transfer=NoWeightTransfer(),
            )  # fmt: skip
            scores.install(trainer, tree)
            with contextlib.suppress(ScoresTaken):  # the reference: its first micro-batch scored, nothing more
                trainer.train()
    if reference:
        return {"first_scores": {"targets": scores.targets, "log_probs": scores.log_probs}, "dtype": "float32"}
    model_config_ = trainer.accelerator.unwrap_model(trainer.model).config
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    timing = clock.summary()
    times = timing["measured_step_s"][: args.steps]  # the profiled step, if any, is not timed
    measured = logs[args.warmup : args.warmup + args.steps]
    accumulation = trainer.args.gradient_accumulation_steps
    flops = [
        step_flops(model_config_, [s for call in rows.calls[k * accumulation : (k + 1) * accumulation] for s in call])
        for k in range(args.warmup, args.warmup + len(times))
    ]
    trained = [entry["batch/trained_tokens_per_step"] for entry in measured]
    unique = [
        unique_tokens([s for call in rows.calls[k * accumulation : (k + 1) * accumulation] for s in call])
        for k in range(args.warmup, args.warmup + len(times))
    ]
    compile_decision = getattr(trainer, "tree_compile", None)
    turned_off = flash_turned_off([str(w.message) for w in caught])
    return {
        **({"error": turned_off} if turned_off else {}),
        **timing,
        "measured_step_s": times,
        "median_step_s": statistics.median(times),
        "spec": spec,
        "trained_tokens_per_step": trained,
        "trained_tokens_per_s": statistics.mean(trained) / statistics.median(times),
        "forwarded_tokens_per_step": [entry["batch/forwarded_tokens_per_step"] for entry in measured],
        # the step's samples as one prefix forest: what prefix reuse forwards (`tree_reuse`); TRL's rows forward more
        # where a step's rows repeat a prefix
        "unique_tokens_per_step": unique,
        "samples_per_step": [round(entry["batch/samples_per_step"]) for entry in measured],
        "packing_ratio": statistics.mean(entry["batch/packing_ratio"] for entry in measured),
        "mfu_per_step": [f / t / PEAK_FLOPS for f, t in zip(flops, times)],
        "mfu": statistics.mean(f / t / PEAK_FLOPS for f, t in zip(flops, times)),
        "trl_mfu_wall_clock": _mean(measured, "perf/mfu_wall_clock"),
        "trl_fwd_bwd_s": _mean(measured, "perf/fwd_bwd_s"),
        "loss": [entry["loss"] for entry in measured],
        "tree_checkpointed_layers": _mean(measured, "tree_checkpointed_layers"),
        "tree_kept_attention": _mean(measured, "tree_kept_attention"),
        "tree_compile": None if compile_decision is None else {"kwargs": compile_decision.kwargs,
                                                               "source": compile_decision.source},
        # The FlexAttention kernel options tree attention ran with at the end ({"BACKEND": "FLASH"}: FlashAttention-4).
        "flex_kernel_options": flex_kernel_options(),
        "first_scores": {"targets": scores.targets, "log_probs": scores.log_probs},
        # What ran compiled (the tree trainer's layers or accelerate's, dynamo's graphs) and its compile seconds.
        "dynamo": compile_report(trainer),
        "gdn_kernels": gdn_kernels.describe(probe.calls),
        "profile": callbacks[-1].summary if profiled else None,
    }  # fmt: skip


def flex_kernel_options() -> dict | None:
    """The kernel options of tree FlexAttention calls in this process now (`attention.FLEX_KERNEL_OPTIONS`)."""
    from hf_tree_attn import attention

    return attention.FLEX_KERNEL_OPTIONS


def flash_turned_off(messages: list[str]) -> str | None:
    """Why a side whose tree attention was on FlexAttention's FLASH backend (asked through
    `HF_TREE_ATTN_FLEX_KERNEL_OPTIONS`, or the trainers' default where FlashAttention-4 is installed) did not run on
    it to the end: the trainer's warning, where it turned the backend off after a compiler failure; None if it ran
    on it, or never was on it."""
    from hf_tree_attn import attention

    said = [m for m in messages if "failed on FlexAttention's FLASH backend" in m]
    if said:
        return "FlexAttention's FLASH backend was turned off: " + said[0][:400]
    asked = json.loads(os.environ.get(attention.FLEX_KERNEL_OPTIONS_ENV) or "{}").get("BACKEND") == "FLASH"
    if asked and (attention.FLEX_KERNEL_OPTIONS or {}).get("BACKEND") != "FLASH":
        return "FlexAttention's FLASH backend was turned off: no warning recorded"
    return None


def unique_tokens(samples: list[dict]) -> int:
    """The tokens of `samples` as one prefix forest (each shared prefix counted once)."""
    sequences = [[int(t) for t in sample["input_ids"]] for sample in samples]
    return sum(forest.num_tree_tokens for forest in pack_forest(sequences, two_level=False))


def _mean(entries: list[dict], key: str) -> float | None:
    values = [e[key] for e in entries if e.get(key) is not None and not math.isnan(e[key])]
    return statistics.mean(values) if values else None


def kernel_check() -> float | None:
    """Max |flash - reference| (bf16 vs fp32) on random segments shaped as TRL calls it: the kernel's semantics."""
    if not torch.cuda.is_available():
        return None
    torch.manual_seed(0)
    lq, lk = [7, 300, 64], [900, 300, 200]
    cu = lambda n: torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device="cuda")  # noqa
    q = torch.randn(sum(lq), 16, 128, device="cuda")
    k, v = (torch.randn(sum(lk), 8, 128, device="cuda") for _ in range(2))
    want = varlen_attention(q, k, v, cu(lq), cu(lk), max(lq), max(lk))
    got = flash_varlen_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu(lq), cu(lk), max(lq), max(lk))
    return float((got.float() - want).abs().max())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen3-1.7b"], choices=[*MODELS, "tiny", "tiny-hybrid"])
    parser.add_argument("--workloads", nargs="+", default=["grpo_mixed"],
                        choices=["grpo_mixed", "grpo_P4096_C512", "tau2_like", "agent_2x20x4"])  # fmt: skip
    parser.add_argument("--sides", nargs="+", default=["trl", "tree"], choices=list(SIDES))
    parser.add_argument("--activation-budget-gib", type=float, default=40.0)
    parser.add_argument("--token-budget", type=int, default=32768, help="TRL's token_budget: unique tokens per row")
    parser.add_argument("--accumulation", type=int, default=1, help="gradient_accumulation_steps: rows per step")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="one more step per side under the torch profiler, after the timed ones: its kernel time by "
        "kind, the top kernels and host ops, under the side's `profile`",
    )
    parser.add_argument("--dtype", default="bfloat16", help="model weights (AsyncGRPOConfig.dtype)")
    parser.add_argument(
        "--gdn-route",
        default="installed",
        help="the hybrids' Gated DeltaNet kernels (a route of benchmarks/gdn_kernels.py; default: as resolved); each "
        "side records the kernels that ran",
    )
    from harness import provenance, result_file, run_child, run_rows, side_arguments

    args = side_arguments(parser, SIDES, "benchmarks/results/async_grpo.json")
    if run_child(args, side_main):
        return
    cuda = torch.cuda.is_available()
    import gdn_kernels

    results = {
        **provenance(**{k: v for k, v in gdn_kernels.versions().items() if k not in ("torch", "transformers", "gpu")}),
        "gdn_route": args.gdn_route,
        "trl_kernel": TRL_KERNEL if cuda else "trl_varlen.varlen_attention (plain torch)",
        "trl_kernel_max_abs_error_vs_reference": kernel_check(),
        "token_budget": args.token_budget,
        "gradient_accumulation_steps": args.accumulation,
        "dtype": args.dtype,
        "peak_flops": PEAK_FLOPS,
        "rows": [],
    }
    rows = [(m, w) for m in args.models for w in args.workloads]
    out, earlier = result_file(args, results, rows)
    child = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
             if k in ("activation_budget_gib", "token_budget", "accumulation", "steps", "warmup", "scale", "dtype",
                      "gdn_route")]  # fmt: skip
    child += ["--profile"] * args.profile
    run_rows(Path(__file__), out, results, rows, args.sides, {
        "argv": child, "env": lambda side: SIDES[side][2], "pair": lambda row: _pair(row, args.dtype),
        "summary": _summary, "earlier": earlier})  # fmt: skip


def _pair(row: dict, dtype: str) -> None:
    """`row["paired"]` and `row["agreement"]` for every pair of `PAIRS` whose two sides ran (`harness.pair_sides`;
    the same data: the same samples and trained tokens on every step)."""
    from harness import pair_sides

    keys = ("samples_per_step", "trained_tokens_per_step")
    pair_sides(row, PAIRS, dtype, lambda a, b: all(a[k] == b[k] for k in keys))


def _summary(row: dict) -> str:
    parts = [f"{row['model']:<13} {row['workload']:<16}"]
    for side, r in row["sides"].items():
        if "error" in r:
            parts.append(f"{side}: {r['error'][:90]}")
        elif "median_step_s" in r:
            peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
            parts.append(f"{side}: {r['median_step_s']:.3f} s (first {r['first_step_s']:.1f} s)  "
                         f"mfu {100 * r['mfu']:.1f}%  {peak} GiB")  # fmt: skip
    for key, pair in row["paired"].items():
        if "median" in pair:
            status = "FAILED agreement" if pair["failed"] else "agrees"
            parts.append(f"{key}: {pair['median']:.2f}x [{pair['min']:.2f}, {pair['max']:.2f}] {status}")
        else:
            parts.append(f"{key}: {pair['error']}")
    return "\n  ".join(parts)


if __name__ == "__main__":
    main()
