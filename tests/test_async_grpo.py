"""TreeAsyncGRPOTrainer against TRL's own AsyncGRPOTrainer, on the same replayed samples, in fp32 on the CPU.

TRL's trainer packs each rank's samples into its own trie and attends through FlashAttention-3's varlen kernel from
the Hub; here TRL's side runs `trl_varlen.varlen_attention`, a plain-torch function with FlashAttention's semantics
written for these tests. Both trainers get the same replayed rollouts (GRPO groups and multi-turn conversations whose
prompts are earlier samples' full text, `hf_tree_attn.trainer.replay`), through TRL's planner, dispatching, loss and
optimizer: every micro-batch's loss, every optimizer step's gradients, TRL's logged metrics and the weights after
the run must agree. Where TRL refuses the model (state-carrying layers, attention sinks), each scored log-probability
is checked against a per-sample `eager` forward instead, and the MoE load-balancing loss against the one of the
samples' flat forwards. With `tree_prefix_reuse=True` (each optimizer step's rows as one chunked forest) the same
agreement holds with a GRPO group split across rows, the rows forwarded are the step's unique tokens, and what
prefix reuse cannot run is refused at init.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import queue
import random
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from async_grpo_helpers import (
    VOCAB,
    build_tokenizer,
    check_against_eager,
    eager_logprobs,
    relative_error,
    replayed_samples,
    save_model,
    spy_on_forests,
    train,
)
from helpers import TOLERANCES, run_two_ranks
from helpers import tiny_config as tiny_family_config
from transformers import AutoModelForCausalLM

from hf_tree_attn import prefix_reuse

REPO = Path(__file__).resolve().parent.parent


def assert_gradients_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() and want
    for name, grad in want.items():
        worst = (got[name] - grad).abs().max().item()
        assert worst <= TOLERANCES["grad_max_rel"] * grad.abs().max().item() + 1e-9, f"{name}: {worst}"


# Attention-only families TRL's packing runs: plain, sliding windows (4 tokens, shorter than most samples) with
# attention and final softcaps (Gemma 2), logit and residual multipliers with a sampling temperature (Granite);
# several accumulated micro-batches each.
SAME_AS_TRL = {
    "qwen3": (tiny_family_config("qwen3"), dict(gradient_accumulation_steps=2)),
    "gemma2": (tiny_family_config("gemma2", sliding_window=4), dict(gradient_accumulation_steps=3)),
    "granite": (tiny_family_config("granite"), dict(gradient_accumulation_steps=2, temperature=0.7)),
}


@pytest.mark.parametrize("family", list(SAME_AS_TRL))
def test_same_as_trl_async(family, tmp_path):
    config, overrides = SAME_AS_TRL[family]
    path = save_model(config, tmp_path / "model")
    samples = replayed_samples(path)
    trl, trl_losses, trl_grads = train(False, path, samples, tmp_path, **overrides)
    tree, tree_losses, tree_grads = train(True, path, samples, tmp_path, **overrides)

    assert len(tree_losses) == len(trl_losses) == 2 * overrides["gradient_accumulation_steps"]
    assert any(abs(loss) > 1e-3 for loss in trl_losses)  # the comparison is not vacuous
    np.testing.assert_allclose(tree_losses, trl_losses, rtol=1e-5, atol=TOLERANCES["logps_atol"])
    assert len(tree_grads.steps) == len(trl_grads.steps) == 2
    for got, want in zip(tree_grads.steps, trl_grads.steps):
        assert_gradients_close(got, want)
    for name, param in trl.model.named_parameters():
        torch.testing.assert_close(dict(tree.model.named_parameters())[name], param, rtol=1e-5, atol=1e-6)

    # TRL's metrics, computed by TRL's code from each side's log-probs and batches. The packing metrics differ by
    # design: TRL's trie keys a node on (token, next token), so it forks one token earlier and forwards more.
    trl_logs, tree_logs = trl.state.log_history[:-1], tree.state.log_history[:-1]
    for key in ("loss", "grad_norm", "ratio", "kl", "entropy", "clip_ratio/region_mean", "batch/samples_per_step",
                "batch/trained_tokens_per_step", "batch/microbatches_per_step"):  # fmt: skip
        np.testing.assert_allclose([e[key] for e in tree_logs], [e[key] for e in trl_logs], rtol=1e-5, err_msg=key)
    for tree_entry, trl_entry in zip(tree_logs, trl_logs):
        assert tree_entry["batch/forwarded_tokens_per_step"] <= trl_entry["batch/forwarded_tokens_per_step"]
        assert tree_entry["batch/packing_ratio"] >= trl_entry["batch/packing_ratio"] > 1
        # tree_recompute="auto" within TRL's memory: every layer recomputes whole, as in TRL's trainer
        assert tree_entry["tree_checkpointed_layers"] == 1.0 and tree_entry.get("tree_kept_attention", 0.0) == 0.0


def _away_from_clip(samples: list, path: str, margin: float, epsilon: float = 0.2, later=None) -> list:
    """`samples` with each scored token's generator log-prob moved, where needed, so that its importance ratio under
    the saved model is at least `margin` (in log space) from both clip edges `log(1 -+ epsilon)`: still some tokens
    clipped and some not, but none that a bf16 rounding of its log-prob could carry across an edge. `later`: the
    weights of a later step (a state dict), under which every ratio keeps the same margin as well (a sample scored
    at that step meets those weights); each token's log-prob moves to the nearest value that keeps both."""
    edges = np.log([1 - epsilon, 1 + epsilon])
    eager = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    moved = None
    if later is not None:
        moved = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
        moved.load_state_dict(later)
    out = []
    with torch.no_grad():
        for sample in samples:
            ids = sample.input_ids.tolist()
            logps = eager_logprobs(eager, ids).numpy()
            # the later step's log ratio is this step's plus `shift`
            shift = np.zeros_like(logps) if moved is None else eager_logprobs(moved, ids).numpy() - logps
            old = sample.old_log_probs.copy()
            log_ratio = logps - old[1:]
            for i, (r, d) in enumerate(zip(log_ratio, shift)):
                bad = [(e - s - margin, e - s + margin) for e in edges for s in {0.0, float(d)}]
                if any(lo < r < hi for lo, hi in bad):
                    allowed = [x for lo, hi in bad for x in (lo, hi) if not any(a < x < b for a, b in bad)]
                    log_ratio[i] = min(allowed, key=lambda x: abs(x - r))
            old[1:] = (logps - log_ratio).astype(np.float32)
            out.append(dataclasses.replace(sample, old_log_probs=old))
    return out


def _weights_after_first_step(path: str, samples: list, out: Path) -> dict:
    """The float32 reference run's weights after its first optimizer step: those its second step scores with."""
    from transformers import TrainerCallback

    kept = {}

    class Keep(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 1:
                kept.update({n: t.detach().clone() for n, t in model.state_dict().items()})

    train(False, path, samples, out, prepare=lambda trainer: trainer.add_callback(Keep()))
    return kept


@pytest.mark.parametrize("weights", ["float32", "bfloat16"])
def test_as_close_to_float32_as_trl_under_bf16(weights, tmp_path):
    """TRL's mixed precision on the CPU (`bf16=True`: CPU autocast to bf16, fp32 or bf16 weights): the tree trainer
    is as close to the float32 run (TRL's trainer, plain-torch attention, no autocast, fp32 weights) as TRL's own
    packing is (on `trl_varlen.varlen_attention`, which computes as FlashAttention does on bf16 inputs): the
    micro-batch losses and every optimizer step's gradients within twice TRL's error plus one bf16 rounding, the bound
    of `test_gpu_async_grpo.test_same_as_trl_async_on_cuda`, with the losses taken as one vector as the gradients
    are. A loss is a signed sum of per-token errors of equal size on both sides (RMS ~1e-2 per log-prob, measured),
    so one loss alone can land near the float32 one on TRL's side by cancellation; over the four that luck averages.

    The clipped objective's gradient jumps where a token's ratio crosses a clip edge, and a bf16 log-prob moves by
    up to ~0.05 here: a token that one side's rounding carries across and the other's does not would change a step's
    gradient by a whole token's share, by chance. The replayed ratios keep 0.1 from both edges, under the saved
    weights and under the float32 run's weights after its first step (what the second step scores with)."""
    path = save_model(tiny_family_config("qwen3"), tmp_path / "model")
    samples = _away_from_clip(replayed_samples(path), path, margin=0.1)
    later = _weights_after_first_step(path, samples, tmp_path / "first")
    samples = _away_from_clip(samples, path, margin=0.1, later=later)
    _, ref_losses, ref_grads = train(False, path, samples, tmp_path / "fp32")
    mixed = dict(bf16=True, dtype=weights)
    trl, trl_losses, trl_grads = train(False, path, samples, tmp_path, **mixed)
    tree, tree_losses, tree_grads = train(True, path, samples, tmp_path, **mixed)

    assert len(tree_losses) == len(trl_losses) == len(ref_losses) == 4
    assert trl_losses != ref_losses  # autocast is on: the comparison is not vacuous
    u = torch.finfo(torch.bfloat16).eps / 2
    ref, trl_l, tree_l = (torch.tensor(x) for x in (ref_losses, trl_losses, tree_losses))
    tree_error, trl_error = (tree_l - ref).norm(), (trl_l - ref).norm()
    assert tree_error <= 2 * trl_error + u * ref.norm(), (tree_l, trl_l, ref)
    assert len(tree_grads.steps) == len(trl_grads.steps) == len(ref_grads.steps) == 2
    for step, (got, want, exact) in enumerate(zip(tree_grads.steps, trl_grads.steps, ref_grads.steps)):
        tree_error, trl_error = (relative_error(grads, exact) for grads in (got, want))
        assert tree_error <= 2 * trl_error + u, (step, tree_error, trl_error)


def test_recompute_stays_within_trl_memory_unless_given_a_budget():
    """The async trainer's recompute bound is TRL's own trainer on the same row (every layer checkpointed): the
    shared-prefix kernels' outputs are kept only where they fit, i.e. within `tree_activation_budget_gib`; fewer
    layers recompute under a budget that holds them."""
    from types import SimpleNamespace

    from hf_tree_attn import pack_forest
    from hf_tree_attn.trainer.forest_step import recompute_plan

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_family_config("qwen3"), attn_implementation="tree_flex").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    (forest,) = pack_forest([[5] * 200 + [6, 7], [5] * 200 + [8, 9, 10]])  # two-level: the kernels serve it

    def plan(budget, keep_within_bound=True):
        trainer = SimpleNamespace(
            args=SimpleNamespace(tree_recompute="auto", tree_activation_budget_gib=budget, gradient_checkpointing=True,
                                 bf16=False, fp16=False),
            model=model, accelerator=SimpleNamespace(unwrap_model=lambda m: m, device=torch.device("cpu")),
            _metrics={"train": defaultdict(list)}, _unpriced=None,
        )  # fmt: skip
        return recompute_plan(trainer, [forest], forest.num_tree_tokens, keep_within_bound=keep_within_bound)

    layers = model.config.num_hidden_layers
    assert plan(None) == (layers, False)
    count, keep = plan(1.0)  # 1 GiB holds every layer of this tiny forest whole
    assert count == 0 and keep


# What TRL's constructor refuses: state-carrying layers (Gated DeltaNet, short convolutions, Mamba-2 + MoE) and
# attention sinks (GPT-OSS: sinks, sliding windows, MoE).
REFUSED_BY_TRL = {
    "qwen3_5": "Tree packing only routes attention layers",
    "lfm2": "Tree packing only routes attention layers",
    "nemotron_h": "Tree packing only routes attention layers",
    "gpt_oss": "attention sinks",
}


@pytest.mark.parametrize("family", list(REFUSED_BY_TRL))
def test_trains_what_trl_refuses(family, tmp_path, monkeypatch):
    """TRL's AsyncGRPOTrainer refuses the model; TreeAsyncGRPOTrainer trains it, and every scored log-probability
    equals the per-sample `eager` forward's, the MoE load-balancing loss the samples' flat forwards'."""
    import test_coverage

    config = test_coverage.tiny_config(family)
    moe = hasattr(config.get_text_config(), "output_router_logits")
    path = save_model(config, tmp_path / "model")
    samples = replayed_samples(path)
    with pytest.raises(ValueError, match=REFUSED_BY_TRL[family]):
        train(False, path, samples, tmp_path)

    scored = spy_on_forests(monkeypatch)
    # MoE with the aux loss on (Nemotron-H's config declares no coefficient: TRL then leaves it off)
    extra = {"router_aux_loss_coef": 0.01} if moe else {}
    tree, losses, gradients = train(True, path, samples, tmp_path, max_steps=1, **extra)
    assert tree.aux_loss_enabled == moe
    assert len(scored) == 2 and all(math.isfinite(loss) for loss in losses)
    assert any(grad.abs().max() > 0 for grad in gradients.steps[0].values())
    for forest, rows, table, aux in scored:
        flat_aux = check_against_eager(path, samples, forest, rows, table, TOLERANCES["logps_atol"])
        if moe:
            torch.testing.assert_close(aux, flat_aux, rtol=1e-5, atol=1e-6)


def test_moe_aux_loss_counts_every_sample(tmp_path, monkeypatch):
    """Qwen3-MoE, which both trainers run: the load-balancing loss TRL's AsyncGRPOTrainer logs counts a token shared
    by several samples once (its forward sees the packed row as one sequence); TreeAsyncGRPOTrainer's counts it once
    per sample, as the samples' own flat forwards do."""
    import test_coverage

    path = save_model(test_coverage.tiny_config("qwen3_moe"), tmp_path / "model")
    samples = replayed_samples(path)
    trl, _, _ = train(False, path, samples, tmp_path, max_steps=1, router_aux_loss_coef=0.01)
    scored = spy_on_forests(monkeypatch)
    tree, _, _ = train(True, path, samples, tmp_path, max_steps=1, router_aux_loss_coef=0.01)
    atol = TOLERANCES["logps_atol"]
    flat = [check_against_eager(path, samples, forest, rows, table, atol) for forest, rows, table, _ in scored]
    for (*_, aux), want in zip(scored, flat):
        torch.testing.assert_close(aux, want, rtol=1e-5, atol=1e-6)
    mean_flat = float(torch.stack(flat).mean())
    assert tree.state.log_history[0]["aux_loss"] == pytest.approx(mean_flat, rel=1e-5)
    assert abs(trl.state.log_history[0]["aux_loss"] - mean_flat) > 1e-3


def test_collator_packs_trl_rows_with_trl_loss_terms():
    """On the same planner rows, `TreeDataCollatorForRollout`'s loss terms are TRL's collator's, term by term (its
    target token, generator log-prob, advantage, sample), and each rank's forest comes back whole."""
    from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout
    from trl.experimental.async_grpo.packing import TreeRow

    from hf_tree_attn import pack_forest
    from hf_tree_attn.trainer.replay import agent_samples, grpo_samples
    from hf_tree_attn.trainer.rollout_forest import TreeDataCollatorForRollout, rank_forest

    samples = grpo_samples(2, 3, (3, 9), (1, 6), VOCAB) + agent_samples(1, (2, 3), 5, (1, 3), (1, 4), VOCAB)
    dicts = [
        {"input_ids": s.input_ids, "completion_mask": s.completion_mask, "old_log_probs": s.old_log_probs,
         "advantage": s.advantage, "group_id": s.group_id, "metrics": s.metrics}
        for s in samples
    ]  # fmt: skip
    rng = random.Random(0)
    for d in dicts:
        d["old_log_probs"] = np.array([rng.uniform(-3, 0) for _ in d["input_ids"]], dtype=np.float32)
    rows = [TreeRow(), TreeRow()]
    for i, d in enumerate(dicts):
        rows[i % 2].add(d)
    trl_batch = DataCollatorForRollout(0, 2)([rows])
    tree_metrics = defaultdict(list)
    tree_batch = TreeDataCollatorForRollout(0, 2, metrics=tree_metrics)([rows])
    for r in range(2):
        keep = trl_batch["token_index"][r] >= 0
        trl_targets = trl_batch["shift_labels"][r][trl_batch["token_index"][r][keep]]
        rank = {key: value[r : r + 1] for key, value in tree_batch.items()}
        forest = rank_forest(rank, "cpu")
        index = rank["token_index"][0][rank["token_index"][0] >= 0]
        assert torch.equal(forest.input_ids[0, index], trl_targets)
        for key in ("old_log_probs", "advantages", "segment_id"):
            ours = rank[key][0][: len(index)]
            assert torch.equal(ours, trl_batch[key][r][keep]), key
        (packed,) = pack_forest([d["input_ids"] for d in rows[r].samples])
        for field in ("input_ids", "position_ids", "subtree_end", "parent", "seq_positions", "seq_offsets"):
            assert torch.equal(getattr(forest, field), getattr(packed, field)), field
    raw = sum(len(d["input_ids"]) for d in dicts)
    unique = int(tree_batch["tree_num_tokens"].sum())
    assert tree_metrics["batch/packing_ratio"] == [(raw, unique)]
    assert tree_batch["global_n_forward_tokens"].tolist() == [unique, unique]
    assert tree_batch["global_n_tokens"].tolist() == [float(trl_batch["global_n_tokens"][0])] * 2


def test_replay_worker():
    """Samples leave in order, stamped with the live policy version (never stale); a finished replay is an error
    naming the fix when the trainer asks for more; `cycle=True` starts over."""
    from hf_tree_attn.trainer.replay import ReplayRolloutWorker, grpo_samples

    samples = grpo_samples(1, 2, (2, 3), (1, 2), VOCAB)
    worker = ReplayRolloutWorker(samples)
    worker.start()
    worker.update_model_version(7)
    first = worker.rollout_buffer.get(timeout=0.1)
    assert first.model_version == 7 and np.array_equal(first.input_ids, samples[0].input_ids)
    worker.rollout_buffer.get(timeout=0.1)
    with pytest.raises(queue.Empty):
        worker.rollout_buffer.get(timeout=0.01)
    with pytest.raises(RuntimeError, match="served all 2 samples.*cycle=True"):
        worker.check_health(300.0)
    cycling = ReplayRolloutWorker(samples, cycle=True)
    cycling.start()
    served = [cycling.rollout_buffer.get(timeout=0.1).input_ids.tolist() for _ in range(5)]
    assert served == [s.input_ids.tolist() for s in samples * 3][:5]


def test_refused_model_names_the_way_out(tmp_path):
    """A model the gate refuses (Bloom: its attention bypasses transformers' interface), a longrope model (one row
    cannot hold both of its RoPE length classes), a model instance, an attention implementation of one's own, or a
    prompt-learning PEFT adapter (its virtual tokens go in front of the packed row): a clear error at init, naming
    what to use instead."""
    import test_coverage

    from hf_tree_attn.trainer import TreeAsyncGRPOConfig, TreeAsyncGRPOTrainer

    args = TreeAsyncGRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none")
    bloom = save_model(test_coverage.tiny_config("bloom"), tmp_path / "bloom")
    with pytest.raises(ValueError, match=r"cannot train .* on exact trees: .*bloom.*AsyncGRPOTrainer") as refused:
        TreeAsyncGRPOTrainer(bloom, args=args, processing_class=build_tokenizer())
    assert "tree_packing=False" not in str(refused.value)  # TreeGRPOTrainer's way out, not this trainer's
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 10, "factor": 4.0,
            "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}  # fmt: skip
    longrope = tiny_family_config("llama", rope_parameters=rope, max_position_embeddings=40)
    path = save_model(longrope, tmp_path / "longrope")
    with pytest.raises(
        ValueError, match="longrope RoPE rotates sequences of at most 10 tokens.*one packed row per rank"
    ):
        TreeAsyncGRPOTrainer(path, args=args, processing_class=build_tokenizer())
    with pytest.raises(TypeError, match="loads the model itself"):
        TreeAsyncGRPOTrainer(AutoModelForCausalLM.from_config(tiny_family_config("qwen3")), args=args)
    custom = TreeAsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), use_cpu=True, model_init_kwargs={"attn_implementation": "sdpa"}
    )
    with pytest.raises(ValueError, match="Drop the entry"):
        TreeAsyncGRPOTrainer(bloom, args=custom)
    from peft import PromptTuningConfig

    qwen3 = save_model(tiny_family_config("qwen3"), tmp_path / "qwen3")
    prompt_tuning = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    with pytest.raises(ValueError, match="PROMPT_TUNING.*only the first would see them.*LoraConfig") as refused:
        TreeAsyncGRPOTrainer(qwen3, args=args, processing_class=build_tokenizer(), peft_config=prompt_tuning)
    assert "tree_packing=False" not in str(refused.value)


def test_a_tree_flex_registered_over_ours_is_refused_before_loading(tmp_path, monkeypatch):
    """Another package's `tree_flex` in transformers' table: the model would run it, so the trainer refuses."""
    from transformers import AttentionInterface

    from hf_tree_attn.trainer import TreeAsyncGRPOConfig, TreeAsyncGRPOTrainer

    def other_attention(*args, **kwargs):
        raise AssertionError("never called")

    qwen3 = save_model(tiny_family_config("qwen3"), tmp_path / "qwen3")
    args = TreeAsyncGRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none")
    monkeypatch.setitem(AttentionInterface._global_mapping, "tree_flex", other_attention)
    with pytest.raises(ValueError, match=r"cannot train .* on exact trees: attn_implementation='tree_flex' runs .*"
                       r"other_attention.*register\(force=True\)"):  # fmt: skip
        TreeAsyncGRPOTrainer(qwen3, args=args, processing_class=build_tokenizer())


def test_parent_api_is_pinned():
    """What this trainer relies on in TRL's AsyncGRPOTrainer: its signatures, the module-level names each swapped
    method looks up, the order its constructor loads, refuses and patches the model in, and the batch keys its
    loss reads. A TRL upgrade that moves any of it fails here first."""
    import trl.experimental.async_grpo.async_grpo_trainer as trl_async
    from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer, DataCollatorForRollout

    init = inspect.signature(AsyncGRPOTrainer.__init__)
    assert list(init.parameters) == [
        "self", "model", "reward_funcs", "args", "train_dataset", "processing_class", "callbacks", "optimizers",
        "peft_config", "tools", "environment_factory", "rollout_worker", "weight_transfer",
    ]  # fmt: skip
    assert list(inspect.signature(AsyncGRPOTrainer.compute_loss).parameters) == [
        "self", "model", "inputs", "return_outputs", "num_items_in_batch"
    ]  # fmt: skip
    assert list(inspect.signature(DataCollatorForRollout._log_metrics).parameters) == [
        "self", "rows", "all_examples", "padded"
    ]  # fmt: skip
    assert [f.name for f in dataclasses.fields(DataCollatorForRollout)] == [
        "pad_token_id", "num_processes", "return_tensors", "groups_trained", "metrics", "token_budget"
    ]  # fmt: skip
    names = {
        AsyncGRPOTrainer.__init__: ("create_model_from_path", "add_fused_lm_head", "get_peak_flops_per_device"),
        AsyncGRPOTrainer.get_train_dataloader: ("DataCollatorForRollout",),
        AsyncGRPOTrainer._log_step_metrics: ("compute_flops_per_token",),
    }
    for method, looked_up in names.items():
        assert set(looked_up) <= set(method.__code__.co_names), method.__name__
        assert all(hasattr(trl_async, name) for name in looked_up)
    source = inspect.getsource(AsyncGRPOTrainer.__init__)
    order = [source.index(text) for text in (
        "create_model_from_path(", '"layer_types"', '.endswith(".sinks")', "add_fused_lm_head(", "get_peak_flops"
    )]  # fmt: skip
    assert order == sorted(order)
    loss = inspect.getsource(AsyncGRPOTrainer.compute_loss)
    for key in ("shift_labels", "tree_kv_index", "tree_max_seqlens", "token_index", "segment_id", "old_log_probs"):
        assert f'"{key}"' in loss, key
    for read in ("outputs.log_probs.flatten()[token_index]", "outputs.entropy.flatten()[token_index]",
                 "outputs.aux_loss"):  # fmt: skip
        assert read in loss, read
    metrics = inspect.getsource(DataCollatorForRollout._log_metrics)
    assert "len(row.tokens)" in metrics and "row.load" in metrics


def _run_rank() -> None:
    """The torchrun worker of `test_two_ranks_same_as_trl`: both trainers on two gloo ranks, results to JSON."""
    sys.path.insert(0, str(REPO))
    from helpers import exit_distributed_worker

    from hf_tree_attn.chunked import plan_chunks
    from hf_tree_attn.trainer import forest_step

    out = Path(os.environ["ASYNC_TEST_OUT"])
    path = str(out / "model")
    samples = replayed_samples(path)
    report, chunks, chunked = {}, [], forest_step.chunked_forest_logprobs

    def spy(model, forest, max_tokens_per_mb, **kwargs):
        chunks.append(plan_chunks(forest, max_tokens_per_mb).num_chunks)
        return chunked(model, forest, max_tokens_per_mb, **kwargs)

    forest_step.chunked_forest_logprobs = spy
    for run, tree, reuse in (("trl", False, False), ("tree", True, False), ("reuse", True, True)):
        options = dict(tree_prefix_reuse=True, output_dir=str(out / "reuse")) if reuse else {}
        trainer, losses, gradients = train(tree, path, samples, out, max_steps=2, token_budget=48, **options)
        report[run] = {
            "losses": losses,
            "grads": {n: g.tolist() for n, g in gradients.steps[-1].items()},
            "weights": {n: p.detach().tolist() for n, p in trainer.model.named_parameters()},
            "samples_per_row": [e.get("batch/samples_per_row") for e in trainer.state.log_history[:-1]],
            "world": trainer.accelerator.num_processes,
            "chunks": list(chunks),
        }
        chunks.clear()
    rank = int(os.environ["RANK"])
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    exit_distributed_worker()


def test_two_ranks_same_as_trl(tmp_path):
    """Two gloo ranks, TRL's planner splitting each micro-batch into one row per rank: per rank, every loss and the
    last step's gradients equal TRL's AsyncGRPOTrainer's, and DDP keeps both ranks' weights equal (to TRL's). The same
    holds with `tree_prefix_reuse=True`: each rank's step forest runs in chunks, backward in the step's last
    micro-batch, DDP's reducer kept out and the gradients averaged after it (`core.prefix_reuse_gradient_sync`; here
    both ranks cut their forests into as many chunks, `tests/test_prefix_reuse_ddp.py` into different numbers)."""
    save_model(tiny_family_config("qwen3"), tmp_path / "model")
    run_two_ranks(__file__, timeout=900, ASYNC_TEST_OUT=str(tmp_path))
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for report in reports:
        trl = report["trl"]
        assert not trl["chunks"] and not report["tree"]["chunks"]
        assert len(report["reuse"]["chunks"]) == 2 and min(report["reuse"]["chunks"]) >= 2  # one step forest a step
        for run in ("tree", "reuse"):
            tree = report[run]
            assert trl["world"] == tree["world"] == 2
            assert len(tree["losses"]) == len(trl["losses"]) == 4
            np.testing.assert_allclose(tree["losses"], trl["losses"], rtol=1e-5, atol=TOLERANCES["logps_atol"])
            assert_gradients_close(
                {n: torch.tensor(g) for n, g in tree["grads"].items()},
                {n: torch.tensor(g) for n, g in trl["grads"].items()},
            )
            for name, want in trl["weights"].items():
                torch.testing.assert_close(
                    torch.tensor(tree["weights"][name]), torch.tensor(want), rtol=1e-5, atol=1e-6, msg=run
                )
    for run in ("tree", "reuse"):
        assert reports[0][run]["weights"] == reports[1][run]["weights"]  # DDP: one model on both ranks
        assert reports[0][run]["losses"] != reports[1][run]["losses"]  # each rank trained its own row


if __name__ == "__main__":
    _run_rank()


@pytest.mark.parametrize("field", ["completion_mask", "old_log_probs"])
def test_a_sample_with_short_per_token_fields_is_refused(field):
    """A rollout whose completion mask or generator log-probs are shorter than its tokens would train only part of
    its completion (TRL's packing raises an IndexError only on a longer one): refused, naming the sample."""
    from hf_tree_attn.trainer.rollout_forest import _pack_row

    sample = dict(input_ids=[1, 2, 3, 4], completion_mask=[0, 0, 1, 1], old_log_probs=[0.0, 0.0, -1.0, -2.0],
                  advantage=1.0, group_id=7)  # fmt: skip
    _pack_row([sample, dict(sample)])  # well formed
    short = dict(sample, **{field: sample[field][:3]})
    with pytest.raises(ValueError, match=rf"sample 1 of this row \(group 7\).*'{field}': 3"):
        _pack_row([sample, short])


# ----------------------------------------------------------------------------------------------------------------
# tree_prefix_reuse=True: one forest per optimizer step

# GRPO groups larger than the token budget (so TRL's planner splits them over rows, each repeating the prompt) and
# multi-turn conversations; 3 micro-batches per optimizer step.
REUSE_BUDGET = 64


def _reuse_samples(path: str) -> list:
    from hf_tree_attn.trainer.replay import agent_samples, grpo_samples

    samples = grpo_samples(4, 4, (28, 36), (6, 12), VOCAB, seed=3)
    samples += agent_samples(2, (2, 3), 6, (1, 4), (1, 5), VOCAB, seed=4)
    return replayed_samples(path, samples=samples)


def _spy_on_rows(monkeypatch) -> list:
    """Record the samples (`(group_id, tokens)` each) of every micro-batch the tree trainer's collator packs."""
    from hf_tree_attn.trainer.rollout_forest import TreeDataCollatorForRollout

    rows, torch_call = [], TreeDataCollatorForRollout.torch_call

    def spy(self, examples):
        ((row,),) = examples  # one process: one row per micro-batch
        rows.append([(s["group_id"], tuple(np.asarray(s["input_ids"]).tolist())) for s in row.samples])
        return torch_call(self, examples)

    monkeypatch.setattr(TreeDataCollatorForRollout, "torch_call", spy)
    return rows


def _steps(rows: list, num_steps: int, accumulation: int = 3) -> list:
    """The micro-batches of each optimizer step, from the collator's record (the dataloader collates one more
    micro-batch ahead than it hands out)."""
    assert len(rows) >= num_steps * accumulation
    return [rows[i * accumulation : (i + 1) * accumulation] for i in range(num_steps)]


def _unique_tokens(sequences) -> int:
    """Tokens of `sequences` counted once per distinct prefix: the rows of their plain trie."""
    return len({seq[: i + 1] for seq in sequences for i in range(len(seq))})


REUSE_CASES = {
    "qwen3": (tiny_family_config("qwen3"), {}),
    "gemma2": (tiny_family_config("gemma2", sliding_window=4), {}),  # sliding windows and softcaps across chunks
    "granite": (tiny_family_config("granite"), dict(temperature=0.7)),
}


@pytest.mark.parametrize("family", list(REUSE_CASES))
def test_prefix_reuse_same_as_trl_async(family, tmp_path, monkeypatch):
    """`tree_prefix_reuse=True`: each optimizer step's 3 rows are one forest scored in chunks of `token_budget` rows.
    Every micro-batch's loss (TRL's, normalised by its own row's trained tokens and the accumulation steps), every
    step's gradients, the weights after 3 SGD steps and TRL's loss metrics equal TRL's AsyncGRPOTrainer on the same
    replayed samples, with a GRPO group split over two rows of one step."""
    from hf_tree_attn.trainer import forest_step

    config, overrides = REUSE_CASES[family]
    path = save_model(config, tmp_path / "model")
    samples = _reuse_samples(path)
    run = dict(max_steps=3, gradient_accumulation_steps=3, token_budget=REUSE_BUDGET, **overrides)
    trl, trl_losses, trl_grads = train(False, path, samples, tmp_path, **run)
    rows = _spy_on_rows(monkeypatch)
    chunked, scored = [], forest_step.chunked_forest_logprobs

    def spy(model, forest, max_tokens_per_mb, **kwargs):
        chunked.append((forest.num_tree_tokens, max_tokens_per_mb))
        return scored(model, forest, max_tokens_per_mb, **kwargs)

    monkeypatch.setattr(forest_step, "chunked_forest_logprobs", spy)
    tree, tree_losses, tree_grads = train(True, path, samples, tmp_path, tree_prefix_reuse=True, **run)

    steps = _steps(rows, 3)
    split = [g for step in steps for g in {g for row in step for g, _ in row} if sum(g in dict(r) for r in step) > 1]
    assert split  # some group's completions sit in two rows of one step
    # One chunked forest per optimizer step, of the step's unique tokens, larger than one chunk.
    want = [_unique_tokens([seq for row in step for _, seq in row]) for step in steps]
    assert chunked == [(n, REUSE_BUDGET) for n in want] and min(want) > REUSE_BUDGET

    assert len(tree_losses) == len(trl_losses) == 9
    assert any(abs(loss) > 1e-3 for loss in trl_losses)  # the comparison is not vacuous
    np.testing.assert_allclose(tree_losses, trl_losses, rtol=1e-5, atol=TOLERANCES["logps_atol"])
    assert len(tree_grads.steps) == len(trl_grads.steps) == 3
    for got, want_grads in zip(tree_grads.steps, trl_grads.steps):
        assert_gradients_close(got, want_grads)
    for name, param in trl.model.named_parameters():
        torch.testing.assert_close(dict(tree.model.named_parameters())[name], param, rtol=1e-5, atol=1e-6)
    trl_logs, tree_logs = trl.state.log_history[:-1], tree.state.log_history[:-1]
    for key in ("loss", "grad_norm", "ratio", "kl", "entropy", "clip_ratio/region_mean", "batch/samples_per_step",
                "batch/trained_tokens_per_step", "batch/microbatches_per_step"):  # fmt: skip
        np.testing.assert_allclose([e[key] for e in tree_logs], [e[key] for e in trl_logs], rtol=1e-5, err_msg=key)


@pytest.mark.parametrize("weights", ["float32", "bfloat16"])
def test_prefix_reuse_as_close_to_float32_as_trl_under_bf16(weights, tmp_path, monkeypatch):
    """`tree_prefix_reuse=True` under TRL's mixed precision on the CPU (`bf16=True`, fp32 or bf16 weights): each
    step's forest in chunks (kept keys and values in the compute dtype, their gradients in float32) is as close to
    the float32 run (TRL's trainer, plain-torch attention, fp32 weights) as TRL's own packing under the same
    precision, by `test_as_close_to_float32_as_trl_under_bf16`'s bound: the micro-batch losses as one vector and
    every optimizer step's gradients within twice TRL's error plus one bf16 rounding. Replayed ratios keep 0.1 from
    the clip edges (that test says why)."""
    path = save_model(tiny_family_config("qwen3"), tmp_path / "model")
    samples = _away_from_clip(_reuse_samples(path), path, margin=0.1)
    run = dict(max_steps=2, gradient_accumulation_steps=3, token_budget=REUSE_BUDGET)
    _, ref_losses, ref_grads = train(False, path, samples, tmp_path / "fp32", **run)
    mixed = dict(bf16=True, dtype=weights, **run)
    _, trl_losses, trl_grads = train(False, path, samples, tmp_path, **mixed)
    from hf_tree_attn.trainer import forest_step

    chunked, scored = [], forest_step.chunked_forest_logprobs

    def spy(model, forest, max_tokens_per_mb, **kwargs):
        chunked.append(forest.num_tree_tokens)
        return scored(model, forest, max_tokens_per_mb, **kwargs)

    monkeypatch.setattr(forest_step, "chunked_forest_logprobs", spy)
    _, tree_losses, tree_grads = train(True, path, samples, tmp_path, tree_prefix_reuse=True, **mixed)

    assert len(chunked) == 2 and min(chunked) > REUSE_BUDGET  # each step one forest, in more than one chunk
    assert len(tree_losses) == len(trl_losses) == len(ref_losses) == 6
    assert trl_losses != ref_losses  # autocast is on: the comparison is not vacuous
    u = torch.finfo(torch.bfloat16).eps / 2
    ref, trl_l, tree_l = (torch.tensor(x) for x in (ref_losses, trl_losses, tree_losses))
    tree_error, trl_error = (tree_l - ref).norm(), (trl_l - ref).norm()
    assert tree_error <= 2 * trl_error + u * ref.norm(), (tree_l, trl_l, ref)
    assert len(tree_grads.steps) == len(trl_grads.steps) == len(ref_grads.steps) == 2
    for step, (got, want, exact) in enumerate(zip(tree_grads.steps, trl_grads.steps, ref_grads.steps)):
        tree_error, trl_error = (relative_error(grads, exact) for grads in (got, want))
        assert tree_error <= 2 * trl_error + u, (step, tree_error, trl_error)


@pytest.mark.parametrize("family", ["qwen3_5", "lfm2"])
def test_prefix_reuse_on_hybrids_equals_one_forest_per_row(family, tmp_path):
    """Hybrids TRL refuses (Gated DeltaNet, short convolutions): with `tree_prefix_reuse=True` each step's rows are
    one forest in chunks that hand the recurrent and convolution states across chunk boundaries. Every micro-batch's
    loss equals the same trainer's without prefix reuse (fp32, 1e-5); each step's gradients are within the bound
    tests/test_recurrent.py sets for these layers of a float64 run without prefix reuse (1e-5 of the largest entry
    plus twice the fp32 run's own error): the chunked Gated DeltaNet scan rounds differently where a chunk boundary
    cuts it."""
    import test_coverage

    path = save_model(test_coverage.tiny_config(family), tmp_path / "model")
    samples = _reuse_samples(path)
    run = dict(max_steps=3, gradient_accumulation_steps=3, token_budget=REUSE_BUDGET)
    _, row_losses, row_grads = train(True, path, samples, tmp_path / "rows", **run)
    _, reuse_losses, reuse_grads = train(True, path, samples, tmp_path / "reuse", tree_prefix_reuse=True, **run)
    exact = train(True, path, samples, tmp_path / "f64", model_init_kwargs={"dtype": torch.float64}, **run)[2]
    assert len(reuse_losses) == len(row_losses) == 9
    assert any(abs(loss) > 1e-3 for loss in row_losses)  # the comparison is not vacuous
    np.testing.assert_allclose(reuse_losses, row_losses, rtol=1e-5, atol=TOLERANCES["logps_atol"])
    for step, (got, flat, want) in enumerate(zip(reuse_grads.steps, row_grads.steps, exact.steps, strict=True)):
        for name, grad in want.items():
            own = (flat[name].double() - grad).abs().max().item()
            bound = TOLERANCES["grad_max_rel"] * grad.abs().max().item() + 2 * own
            worst = (got[name].double() - grad).abs().max().item()
            assert worst <= bound, f"step {step}, {name}: {worst} > {bound}"


def test_prefix_reuse_forwards_each_step_token_once(tmp_path, monkeypatch):
    """The rows the model forwards in a step (counted at its embedding, outside the chunks' recompute) are the step's
    unique tokens, also what TRL's `batch/forwarded_tokens_per_step` logs: fewer than the rows' own tries hold where
    a step splits a prompt over rows (each row forwards it), and fewer than TRL's packing forwards."""
    path = save_model(tiny_family_config("qwen3"), tmp_path / "model")
    samples = _reuse_samples(path)
    rows = _spy_on_rows(monkeypatch)
    forwarded = defaultdict(int)
    # The chunked forward (its last chunk runs with grad, its graph kept for the backward) apart from the chunks'
    # recomputes in the backward
    in_forward = []
    chunked_forward = prefix_reuse._Step.forward

    def flagged(step, *args, **kwargs):
        in_forward.append(True)
        try:
            return chunked_forward(step, *args, **kwargs)
        finally:
            in_forward.pop()

    monkeypatch.setattr(prefix_reuse._Step, "forward", flagged)

    def count(trainer):
        def hook(module, args):
            if in_forward or not torch.is_grad_enabled():  # the forward pass, not a chunk's recompute
                forwarded[trainer.state.global_step] += args[0].shape[-1]

        trainer.model.get_input_embeddings().register_forward_pre_hook(hook)

    run = dict(max_steps=3, gradient_accumulation_steps=3, token_budget=REUSE_BUDGET)
    tree, _, _ = train(True, path, samples, tmp_path, prepare=count, tree_prefix_reuse=True, **run)
    steps = _steps(rows, 3)
    unique = [_unique_tokens([seq for row in step for _, seq in row]) for step in steps]
    per_row = [sum(_unique_tokens([seq for _, seq in row]) for row in step) for step in steps]
    assert [forwarded[s] for s in range(3)] == unique
    logged = [e["batch/forwarded_tokens_per_step"] for e in tree.state.log_history[:-1]]
    assert logged == unique
    assert all(u <= r for u, r in zip(unique, per_row)) and unique != per_row, (unique, per_row)

    trl, _, _ = train(False, path, samples, tmp_path, **run)
    trl_logged = [e["batch/forwarded_tokens_per_step"] for e in trl.state.log_history[:-1]]
    assert all(u < t for u, t in zip(unique, trl_logged))


def test_prefix_reuse_within_a_memory_budget_same_as_trl(tmp_path):
    """`tree_prefix_reuse_budget_gib`: the step's chunks sized by the planner (multiples of 128 rows, at most
    `token_budget`), its estimate logged; the losses and the weights after the run are TRL's."""
    path = save_model(tiny_family_config("qwen3"), tmp_path / "model")
    samples = _reuse_samples(path)
    run = dict(max_steps=2, gradient_accumulation_steps=3, token_budget=128)
    trl, trl_losses, _ = train(False, path, samples, tmp_path, **run)
    tree, tree_losses, _ = train(
        True, path, samples, tmp_path, tree_prefix_reuse=True, tree_prefix_reuse_budget_gib=1.0, **run
    )
    np.testing.assert_allclose(tree_losses, trl_losses, rtol=1e-5, atol=TOLERANCES["logps_atol"])
    for name, param in trl.model.named_parameters():
        torch.testing.assert_close(dict(tree.model.named_parameters())[name], param, rtol=1e-5, atol=1e-6)
    for entry in tree.state.log_history[:-1]:
        assert entry["tree_prefix_reuse_chunks"] >= 2 and entry["tree_prefix_reuse_kept_gib"] > 0
        assert entry["tree_prefix_reuse_peak_gib"] <= 1.0


def test_prefix_reuse_step_within_one_forward_same_as_trl(tmp_path, monkeypatch):
    """A step whose forest fits `token_budget` rows runs as one forward (no chunks), still one per optimizer step:
    the losses and the weights after the run are TRL's."""
    from hf_tree_attn.trainer import forest_step

    path = save_model(tiny_family_config("qwen3"), tmp_path / "model")
    samples = replayed_samples(path)
    run = dict(max_steps=2, gradient_accumulation_steps=2, token_budget=512)
    trl, trl_losses, _ = train(False, path, samples, tmp_path, **run)
    forests, forest_logprobs = [], forest_step.forest_logprobs

    def spy(model, forest, **kwargs):
        forests.append(forest.num_tree_tokens)
        return forest_logprobs(model, forest, **kwargs)

    monkeypatch.setattr(forest_step, "forest_logprobs", spy)
    tree, tree_losses, _ = train(True, path, samples, tmp_path, tree_prefix_reuse=True, **run)
    assert len(forests) == 2  # one forward per optimizer step
    np.testing.assert_allclose(tree_losses, trl_losses, rtol=1e-5, atol=TOLERANCES["logps_atol"])
    for name, param in trl.model.named_parameters():
        torch.testing.assert_close(dict(tree.model.named_parameters())[name], param, rtol=1e-5, atol=1e-6)
    assert [e["batch/forwarded_tokens_per_step"] for e in tree.state.log_history[:-1]] == forests


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(tree_prefix_reuse=1), r"tree_prefix_reuse=1 must be True or False"),
        (dict(tree_prefix_reuse=True, token_budget=0), r"token_budget=0 batches by sample count"),
        (dict(tree_prefix_reuse_budget_gib=2.0), r"tree_prefix_reuse_budget_gib=2.0 .*tree_prefix_reuse=False"),
        (dict(tree_prefix_reuse=True, tree_prefix_reuse_budget_gib=0), r"must be a number of GiB > 0"),
        (
            dict(tree_prefix_reuse=True, tree_prefix_reuse_budget_gib=2.0, token_budget=64),
            r"multiples of 128 rows of at most token_budget=64",
        ),
        (
            dict(tree_prefix_reuse=True, tree_activation_budget_gib=4.0),
            r"tree_activation_budget_gib=4.0 .*tree_prefix_reuse=True.*tree_prefix_reuse=False",
        ),
    ],
)
def test_prefix_reuse_config_refusals(tmp_path, overrides, match):
    from hf_tree_attn.trainer import TreeAsyncGRPOConfig

    with pytest.raises((ValueError, TypeError), match=match):
        TreeAsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **overrides)


@pytest.mark.parametrize(
    "family, extra, match",
    [
        ("qwen3_moe", dict(router_aux_loss_coef=0.01), r"MoE load-balancing loss.*router_aux_loss_coef=0.01"),
        ("qwen3", dict(gradient_checkpointing_kwargs={"use_reentrant": True}), r"'use_reentrant': True"),
    ],
)
def test_prefix_reuse_refused_at_init(family, extra, match, tmp_path):
    """What prefix reuse cannot run exactly is an error at init naming the reason and the way out, before any step."""
    import test_coverage

    from hf_tree_attn.trainer.replay import grpo_samples

    config = tiny_family_config("qwen3") if family == "qwen3" else test_coverage.tiny_config(family)
    path = save_model(config, tmp_path / "model")
    samples = grpo_samples(1, 2, (3, 5), (1, 3), VOCAB)
    with pytest.raises(ValueError, match=rf"tree_prefix_reuse=True, but .*{match}.*Set tree_prefix_reuse=False"):
        train(True, path, samples, tmp_path, token_budget=REUSE_BUDGET, tree_prefix_reuse=True, **extra)


def test_prefix_reuse_outside_the_training_loop_is_an_error(tmp_path):
    """The step's micro-batches are scored together as transformers' loop fetches them; a training-mode loss call
    outside that loop is an error naming the way out, never the per-row path in silence."""
    from hf_tree_attn.trainer.replay import grpo_samples

    path = save_model(tiny_family_config("qwen3"), tmp_path / "model")

    def loss_outside_the_loop(trainer):
        trainer.model.train()
        trainer.compute_loss(trainer.model, {})

    with pytest.raises(RuntimeError, match=r"tree_prefix_reuse=True scores .*get_batch_samples.*trainer\.train\(\)"):
        train(True, path, grpo_samples(1, 2, (3, 5), (1, 3), VOCAB), tmp_path, prepare=loss_outside_the_loop,
              token_budget=REUSE_BUDGET, tree_prefix_reuse=True)  # fmt: skip


def test_prefix_reuse_trains_a_sample_longer_than_the_budget(tmp_path, monkeypatch):
    """With `tree_prefix_reuse=True` the planner keeps a sample longer than `token_budget`, which TRL's drops: alone in
    a row, its step's forest run in chunks of the budget along it. Losses, gradients and weights equal TRL's
    AsyncGRPOTrainer given the same micro-batches (its planner on the same rows, each row one forward)."""
    import dataclasses

    from trl.experimental.async_grpo import async_grpo_trainer as trl_module

    from hf_tree_attn.trainer.replay import grpo_samples
    from hf_tree_attn.trainer.rollout_planner import with_planner_rows

    path = save_model(tiny_family_config("qwen3"), tmp_path / "model")
    short = grpo_samples(3, 4, (28, 36), (6, 12), VOCAB, seed=3)
    long = [dataclasses.replace(s, group_id=s.group_id + 10) for s in grpo_samples(1, 2, (150, 150), (20, 30), VOCAB)]
    samples = replayed_samples(path, samples=short[:4] + long + short[4:])
    assert min(len(s.input_ids) for s in long) > REUSE_BUDGET
    run = dict(max_steps=2, gradient_accumulation_steps=3, token_budget=REUSE_BUDGET)
    planned = with_planner_rows(trl_module.TokenBudgetBatcher, long_samples=True)
    with monkeypatch.context() as patch:  # TRL's trainer on the same micro-batches: nothing dropped
        patch.setattr(trl_module, "TokenBudgetBatcher", planned)
        trl, trl_losses, trl_grads = train(False, path, samples, tmp_path, **run)
    rows = _spy_on_rows(monkeypatch)
    tree, tree_losses, tree_grads = train(True, path, samples, tmp_path, tree_prefix_reuse=True, **run)

    lengths = {tuple(np.asarray(s.input_ids).tolist()) for s in long}
    alone = [row for step in _steps(rows, 2) for row in step if len(row) == 1 and row[0][1] in lengths]
    assert len(alone) == 2  # each long sample trained, alone in its row
    assert len(tree_losses) == len(trl_losses) == 6
    np.testing.assert_allclose(tree_losses, trl_losses, rtol=1e-5, atol=TOLERANCES["logps_atol"])
    for got, want in zip(tree_grads.steps, trl_grads.steps, strict=True):
        assert_gradients_close(got, want)
    for name, param in trl.model.named_parameters():
        torch.testing.assert_close(dict(tree.model.named_parameters())[name], param, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("weights", ["float32", "bfloat16"])
def test_prefix_reuse_long_samples_as_close_to_float32_as_trl_under_bf16(weights, tmp_path, monkeypatch):
    """The long-sample case above under TRL's mixed precision (`bf16=True`, fp32 or bf16 weights): the tree's losses
    and gradients as close to the float32 run (TRL's trainer on the same micro-batches) as TRL's own under the same
    precision, by `test_prefix_reuse_as_close_to_float32_as_trl_under_bf16`'s bound."""
    import dataclasses

    from trl.experimental.async_grpo import async_grpo_trainer as trl_module

    from hf_tree_attn.trainer.replay import grpo_samples
    from hf_tree_attn.trainer.rollout_planner import with_planner_rows

    path = save_model(tiny_family_config("qwen3"), tmp_path / "model")
    short = grpo_samples(3, 4, (28, 36), (6, 12), VOCAB, seed=3)
    long = [dataclasses.replace(s, group_id=s.group_id + 10) for s in grpo_samples(1, 2, (150, 150), (20, 30), VOCAB)]
    samples = _away_from_clip(replayed_samples(path, samples=short[:4] + long + short[4:]), path, margin=0.1)
    run = dict(max_steps=2, gradient_accumulation_steps=3, token_budget=REUSE_BUDGET)
    mixed = dict(bf16=True, dtype=weights, **run)
    planned = with_planner_rows(trl_module.TokenBudgetBatcher, long_samples=True)
    with monkeypatch.context() as patch:  # TRL's trainer on the tree's micro-batches: nothing dropped
        patch.setattr(trl_module, "TokenBudgetBatcher", planned)
        _, ref_losses, ref_grads = train(False, path, samples, tmp_path / "fp32", **run)
        _, trl_losses, trl_grads = train(False, path, samples, tmp_path, **mixed)
    rows = _spy_on_rows(monkeypatch)
    _, tree_losses, tree_grads = train(True, path, samples, tmp_path, tree_prefix_reuse=True, **mixed)

    lengths = {tuple(np.asarray(s.input_ids).tolist()) for s in long}
    assert sum(len(row) == 1 and row[0][1] in lengths for step in _steps(rows, 2) for row in step) == 2
    assert len(tree_losses) == len(trl_losses) == len(ref_losses) == 6
    assert trl_losses != ref_losses  # autocast is on: the comparison is not vacuous
    u = torch.finfo(torch.bfloat16).eps / 2
    ref, trl_l, tree_l = (torch.tensor(x) for x in (ref_losses, trl_losses, tree_losses))
    assert (tree_l - ref).norm() <= 2 * (trl_l - ref).norm() + u * ref.norm(), (tree_l, trl_l, ref)
    for step, (got, want, exact) in enumerate(zip(tree_grads.steps, trl_grads.steps, ref_grads.steps, strict=True)):
        tree_error, trl_error = (relative_error(grads, exact) for grads in (got, want))
        assert tree_error <= 2 * trl_error + u, (step, tree_error, trl_error)
