"""Whole GRPO runs: with one seed, `TreeGRPOTrainer` makes `trl.GRPOTrainer`'s run, in every generation mode.

Each test trains a tree trainer and TRL's flat trainer from the same saved tiny model and compares what a run is
made of: the completions of every generation (so the random stream was consumed alike), the logged losses and
the final weights. The reward depends on the sampled tokens, so a different sample changes the run. The optimizer
is SGD: Adam would turn a last-bit difference in a near-zero gradient into a full-size step, SGD keeps weight
differences at `learning_rate x gradient difference`.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import pytest
import torch
from helpers import TOLERANCES, token_reward
from trl import GRPOConfig, GRPOTrainer
from trl.generation.vllm_generation import VLLMGeneration

from hf_tree_attn.trainer import TreeGRPOConfig, TreeGRPOTrainer
from hf_tree_attn.trainer.grpo_trainer import micro_batch_order
from trainers import toy_task

NUM_GENERATIONS = 4
MODES = {
    "generate": {},
    "static_cache": {"cache_implementation": "static"},
    "continuous_batching": {
        "use_transformers_continuous_batching": True,
        # A cache sized for the test (the default reserves half of the machine's memory, slow to allocate on CPU).
        "transformers_continuous_batching_config": {"num_blocks": 512, "page_size": 16, "max_batch_tokens": 256},
    },
    "compiled": {"torch_compile": True, "torch_compile_backend": "aot_eager"},  # no C++ toolchain needed
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tokenizer = toy_task.build_tokenizer()
    path = tmp_path_factory.mktemp("tiny_qwen3")
    toy_task.build_model(tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), tokenizer


@dataclass
class Run:
    completions: list[torch.Tensor]
    losses: list[float]
    params: dict[str, torch.Tensor]
    trainer: GRPOTrainer


def _run(trainer_cls, tiny, tmp_path, setup=None, **overrides) -> Run:
    path, tokenizer = tiny
    config_cls = TreeGRPOConfig if trainer_cls is TreeGRPOTrainer else GRPOConfig
    kwargs = dict(
        output_dir=str(tmp_path / trainer_cls.__name__), use_cpu=True, bf16=False, seed=0,
        per_device_train_batch_size=2 * NUM_GENERATIONS, num_generations=NUM_GENERATIONS, max_completion_length=4,
        max_steps=2, logging_steps=1, learning_rate=0.05, optim="sgd", lr_scheduler_type="constant",
        report_to="none", save_strategy="no", model_init_kwargs={"dtype": torch.float32},
        gradient_checkpointing=False,  # a 2-layer model; the checkpointed tree forward is tested elsewhere
    )  # fmt: skip
    kwargs.update(overrides)
    dataset = toy_task.build_dataset(64, seed=1)
    trainer = trainer_cls(path, token_reward, config_cls(**kwargs), train_dataset=dataset, processing_class=tokenizer)
    if setup is not None:
        setup(trainer)
    completions = []
    generate = trainer._generate_and_score_completions

    def recording(batch):
        out = generate(batch)
        completions.append(out["completion_ids"].clone())
        return out

    trainer._generate_and_score_completions = recording
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    params = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    return Run(completions, losses, params, trainer)


def _assert_same_run(tree: Run, flat: Run, generations: int) -> None:
    assert len(tree.completions) == len(flat.completions) == generations
    for k, (a, b) in enumerate(zip(tree.completions, flat.completions)):
        assert torch.equal(a, b), f"generation {k} sampled other completions: the random streams parted"
    assert len(tree.losses) == len(flat.losses) > 0
    for step, (a, b) in enumerate(zip(tree.losses, flat.losses)):
        assert math.isclose(a, b, abs_tol=TOLERANCES["logps_atol"]), f"step {step}: loss {a} vs {b}"
    initial = toy_task.build_model(toy_task.build_tokenizer(), seed=0)
    moved = [not torch.allclose(p, q) for p, (_, q) in zip(flat.params.values(), initial.named_parameters())]
    assert any(moved), "the run did not train"
    for name, want in flat.params.items():
        torch.testing.assert_close(tree.params[name], want, atol=TOLERANCES["logps_atol"], rtol=0, msg=name)
    fallbacks = [entry["tree_fallback"] for entry in tree.trainer.state.log_history if "tree_fallback" in entry]
    assert fallbacks and set(fallbacks) == {0.0}  # every chunk took the tree path


# ----------------------------------------------------------------------------------------------------------------
# The random stream: TRL's row shuffle is drawn, and only orders whole micro-batches.


def test_micro_batch_order_follows_the_first_row_of_each_micro_batch():
    permutation = torch.tensor([5, 0, 7, 2, 1, 6, 3, 4])  # rows 0-1 | 2-3 | 4-5 | 6-7 in micro-batches of two
    assert micro_batch_order(permutation, 4) == [2, 0, 3, 1]
    assert micro_batch_order(permutation, 1) == [0]
    counts = {}
    gen = torch.Generator().manual_seed(0)
    for _ in range(600):
        order = tuple(micro_batch_order(torch.randperm(12, generator=gen), 3))
        counts[order] = counts.get(order, 0) + 1
    assert len(counts) == 6 and min(counts.values()) > 60  # all 3! orders, none rare (expected 100 each)


def test_same_seed_same_run_as_trl(tiny, tmp_path):
    """3 optimizer steps x 2 accumulated micro-batches (= steps_per_generation), each generation used twice."""
    overrides = dict(gradient_accumulation_steps=2, num_iterations=2, max_steps=3)
    tree = _run(TreeGRPOTrainer, tiny, tmp_path, **overrides)
    flat = _run(GRPOTrainer, tiny, tmp_path, **overrides)
    assert tree.trainer.args.steps_per_generation == 2
    _assert_same_run(tree, flat, generations=2)
    for micro_batch in tree.trainer._buffered_inputs:  # TRL shuffles rows; the tree keeps groups whole
        groups = micro_batch["prompt_ids"].view(-1, NUM_GENERATIONS, micro_batch["prompt_ids"].shape[1])
        assert (groups == groups[:, :1]).all()


# ----------------------------------------------------------------------------------------------------------------
# TRL's generation modes.


@pytest.mark.parametrize("mode", ["static_cache", "continuous_batching"])
def test_generation_mode_gives_trls_run(tiny, tmp_path, mode):
    tree = _run(TreeGRPOTrainer, tiny, tmp_path, **MODES[mode])
    flat = _run(GRPOTrainer, tiny, tmp_path, **MODES[mode])
    _assert_same_run(tree, flat, generations=2)
    assert tree.trainer.model.config._attn_implementation == "tree_flex"  # switched back after generating


def test_compiled_model_gives_trls_run(tiny, tmp_path):
    """`torch_compile=True` asks for a whole-model compile; the tree trainer compiles the decoder layers in place
    instead (said once), which every tree forward runs, and the Trainer compiles no copy. Compiling does not change
    the math, so TRL's plain run is the reference (compiling it too doubles the cost)."""
    from hf_tree_attn.compile import compiled_layers, decoder_layers

    with pytest.warns(UserWarning, match="whole-model compile"):
        tree = _run(TreeGRPOTrainer, tiny, tmp_path, **MODES["compiled"])
    assert compiled_layers(tree.trainer.model) == decoder_layers(tree.trainer.model_wrapped) != []
    assert tree.trainer.tree_compile.kwargs == {"backend": "aot_eager", "dynamic": True}
    flat = _run(GRPOTrainer, tiny, tmp_path)
    _assert_same_run(tree, flat, generations=2)


class _RecordingClient:
    """The vLLM server client as TRL's weight sync uses it: records every tensor it is sent."""

    def __init__(self):
        self.syncs: list[dict[str, torch.Tensor]] = []

    def update_named_params(self, metadata, named_params):
        received = {name: tensor.detach().clone() for name, tensor in named_params}
        assert [(n, list(t.shape)) for n, t in received.items()] == [(n, shape) for n, _, shape in metadata]
        self.syncs.append(received)

    def reset_prefix_cache(self):
        pass


class _FakeVLLM(VLLMGeneration):
    """TRL's vLLM backend in server mode without vLLM: TRL's own `sync_weights` streams into a recording client;
    `generate` returns seeded completions with injected sampling log-probabilities, the same for both trainers."""

    def __init__(self, trainer):
        self.calls = 0
        super().__init__(trainer.model, trainer.accelerator, trainer.processing_class, mode="server")

    def _init_vllm(self):
        self.vllm_client = _RecordingClient()

    def generate(self, prompts, images, num_generations, profiler=None):
        gen = torch.Generator().manual_seed(self.calls)
        self.calls += 1
        completions, logprobs = [], []
        for _ in prompts:
            ids = torch.randint(3, 30, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen).tolist()
            # Near the tiny model's own log-probs (about -log(vocab)), so the ratios stay inside the clip range.
            lps = (-math.log(40) + 0.2 * torch.randn(len(ids), generator=gen)).tolist()
            completions.append(ids)
            logprobs.append([[lp] for lp in lps])
        return prompts, completions, logprobs, None


def _use_fake_vllm(trainer):
    trainer.use_vllm, trainer.vllm_mode = True, "server"
    trainer.vllm_importance_sampling_correction = True
    trainer.vllm_importance_sampling_mode = "token_truncate"
    trainer.vllm_generation = _FakeVLLM(trainer)
    trainer._last_loaded_step = -1
    ratios = trainer.importance_ratios = []
    score = trainer._generate_and_score_completions

    def keep_ratios(batch):
        out = score(batch)
        ratios.append(out["importance_sampling_ratio"].clone())
        return out

    trainer._generate_and_score_completions = keep_ratios


def test_vllm_importance_sampling_with_tree_logprobs(tiny, tmp_path):
    """vLLM server mode, as far as it runs without vLLM: the tree's old-policy log-probs give TRL's importance
    sampling ratios and losses, and the weight sync streams exactly the flat trainer's tensors."""
    tree = _run(TreeGRPOTrainer, tiny, tmp_path, setup=_use_fake_vllm)
    flat = _run(GRPOTrainer, tiny, tmp_path, setup=_use_fake_vllm)
    _assert_same_run(tree, flat, generations=2)
    for a, b in zip(tree.trainer.importance_ratios, flat.trainer.importance_ratios):
        torch.testing.assert_close(a, b, atol=TOLERANCES["logps_atol"], rtol=0)
        assert (b != 1).any() and (b < b.max()).any()  # live ratios, not all clipped or neutral
    tree_syncs = tree.trainer.vllm_generation.vllm_client.syncs
    flat_syncs = flat.trainer.vllm_generation.vllm_client.syncs
    assert len(tree_syncs) == len(flat_syncs) == 2  # one per optimizer step that generates
    for a, b in zip(tree_syncs, flat_syncs):
        assert list(a) == list(b) and all(a[n].dtype == b[n].dtype for n in a)
        for name in b:
            torch.testing.assert_close(a[name], b[name], atol=TOLERANCES["logps_atol"], rtol=0, msg=name)


def test_generation_and_save_hooks_are_pinned_to_trl():
    """A TRL upgrade that changes these signatures, or the row shuffle whose random draw we repeat, fails here."""
    import hashlib

    from trl.trainer.utils import shuffle_sequence_dict

    def params(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    for name in ("_generate_single_turn", "create_model_card", "save_model"):
        assert params(getattr(TreeGRPOTrainer, name)) == params(getattr(GRPOTrainer, name)), name
    source = inspect.getsource(shuffle_sequence_dict)
    assert hashlib.sha256(source.encode()).hexdigest()[:16] == "bab038755e57ed2b", (
        "trl's shuffle_sequence_dict changed: make TreeGRPOTrainer._prepare_inputs draw what it draws, then update "
        "this hash."
    )
