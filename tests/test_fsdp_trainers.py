"""The tree trainers under FSDP2, `tree_prefix_reuse=True` among them: 2 gloo processes (torchrun), fp32.

Accelerate enables FSDP on GPUs only; `helpers.accelerate_fsdp_on_cpu` lets its state report FSDP on CPU, so the
trainers run accelerate's own FSDP2 preparation (`fully_shard` of each decoder layer, then the root) and their FSDP
paths as on GPUs.

- `TreeSFTTrainer` and `TreeDPOTrainer` (TRL's fused head on trees) against TRL's trainers: every step's gradients
  (SFT) and the weights, the LM head's among them (read before the backbone ran, the head's weight was FSDP2's
  sharded DTensor, whose gathered copy gave each rank's shard that rank's own gradient, never averaged over the
  ranks); `TreeRewardTrainer` against TRL's `RewardTrainer`.
- The same with prefix reuse, whose chunks the fused head runs inside the model's own forward (FSDP2's backward of
  that forward is under way when the chunks' backwards run; each is made a pass of its own,
  `hf_tree_attn.fsdp2_compat`): SFT with rank 0's forests in 3 chunks and rank 1's in 2, with every chunk's graph
  kept from the forward, with LoRA, on a Qwen3.5 hybrid, and with one rank's micro-batch on TRL's forward (the other
  rank's follows); DPO, its policy and reference forests in chunks.

With prefix reuse the ranks must run as many chunks (dummies on the ranks with fewer), as many forests (idle ones on
the ranks with fewer) and the same path (tree or TRL's flat forward) for every micro-batch, since FSDP2 gathers
parameters and reduce-scatters gradients in collectives every rank calls alike; a mismatch deadlocks, which the
process group's timeout turns into a failure.

- `TreeGRPOTrainer` (data of `tests/test_prefix_reuse_ddp.py`): rank 0's forests cut into 3 chunks, rank 1's into 2
  or fitting one (run as one chunk, padded with dummies): every step's gradients and the weights equal the same
  FSDP2 run without prefix reuse (micro-batches each one forest, FSDP2's own reduction), whose gradients equal
  TRL's `GRPOTrainer`'s; so too with a micro-batch on TRL's flat path, and on a Qwen3.5 hybrid; with LoRA adapters,
  prefix reuse gives TRL's adapter gradients and weights.
- `TreeAsyncGRPOTrainer`: each step's rows one forest in chunks; losses, gradients and weights equal TRL's
  `AsyncGRPOTrainer` under FSDP2.
- The idle forest a rank with fewer forests runs (`_idle_forwards`) pairs with another rank's chunked forest and adds
  nothing: the reduced gradient is half the other rank's alone.
"""

from __future__ import annotations

import datetime
import importlib
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import TOLERANCES, run_two_ranks, save_toy_model

REPO = Path(__file__).resolve().parent.parent
FSDP2 = dict(fsdp="full_shard", fsdp_config={"fsdp_version": 2})


def _idle_pairs_with_chunks(trainer) -> dict:
    """Rank 0 scores an idle forest (`_idle_forwards`), rank 1 a forest of 3 chunks, both backward; the reduced
    gradients, and rank 1's forest (to score it alone)."""
    import torch.distributed as dist
    from test_prefix_reuse_ddp import _full

    from hf_tree_attn import pack_forest
    from hf_tree_attn.trainer.core import ReuseChunks
    from hf_tree_attn.trainer.forest_step import score_forests

    model = trainer.model
    sequence = [3 + i % 20 for i in range(2 * trainer._prefix_reuse_rows + 5)]  # 3 chunks of the budget
    (forest,) = pack_forest([sequence, sequence[:-3] + [4, 5]])
    model.zero_grad()
    if dist.get_rank() == 0:
        loss = trainer._idle_forwards(model, 1)
    else:
        rows = trainer._prefix_reuse_rows
        tables, _, _ = score_forests(
            model, [forest], [None], temperature=trainer.temperature, autocast=trainer.accelerator.autocast,
            prefix_reuse_chunks=[ReuseChunks(rows)],
        )  # fmt: skip
        loss = (tables[0] * torch.linspace(-1.0, 1.0, tables[0].numel())).sum()
    loss.backward()
    return {
        "grads": {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None},
        "weights": {n: _full(p) for n, p in model.named_parameters()},
        "sequences": [sequence, sequence[:-3] + [4, 5]],
        "temperature": trainer.temperature,
    }


def _run_rank(model_path: str, async_path: str, out_dir: str) -> None:
    """The torchrun worker: the GRPO trainer with and without prefix reuse, the idle forest, the SFT trainers, the
    async trainers."""
    sys.path.insert(0, str(REPO))
    import torch.distributed as dist
    from async_grpo_helpers import replayed_samples, train
    from helpers import accelerate_fsdp_on_cpu, exit_distributed_worker
    from peft import LoraConfig
    from test_prefix_reuse_ddp import _full, _Spy, _train_grpo, _train_sft
    from transformers import AutoTokenizer

    from hf_tree_attn import prefix_reuse
    from hf_tree_attn.trainer import forest_step, fused_head

    # A collective one rank never joins fails after this long instead of hanging until the subprocess timeout.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    accelerate_fsdp_on_cpu()
    out, rank, trainers, report = Path(out_dir), int(os.environ["RANK"]), [], {}
    # (name, prefix reuse, tree_max_token_ratio, tree_packing, peft_config). "fallback" lets trees cost at most
    # 0.15 of TRL's padded rows: one of rank 1's micro-batches costs more, so it takes TRL's flat path there, and with
    # it rank 0 (`_lockstep`).
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    grpo_runs = [
        ("reuse", True, 1.0, True, None),
        ("plain", False, 1.0, True, None),
        ("fallback", True, 0.15, True, None),
        ("trl", False, 1.0, False, None),
        ("lora reuse", True, 1.0, True, lora),
        ("lora trl", False, 1.0, False, lora),
        ("hybrid reuse", True, 1.0, True, None),  # a Qwen3.5 (Gated DeltaNet and attention)
        ("hybrid plain", False, 1.0, True, None),
    ]
    for run, reuse, ratio, packing, peft_config in grpo_runs:
        path = str(Path(model_path).parent / "hybrid_model") if run.startswith("hybrid") else model_path
        trainer, gradients, chunks = _train_grpo(
            path, out / f"grpo_{run}", reuse, peft_config, tree_max_token_ratio=ratio, tree_packing=packing, **FSDP2
        )
        trainers.append(trainer)  # never freed: see exit_distributed_worker
        report["grpo", run] = {
            "world": trainer.accelerator.num_processes,
            "sharded": type(trainer.model).__name__.startswith("FSDP"),
            "gradients": gradients,
            "weights": {n: _full(p) for n, p in trainer.model.named_parameters()},
            "chunks": chunks,
            "fallback": [e["tree_fallback"] for e in trainer.state.log_history if "tree_fallback" in e],
        }
    report["idle"] = _idle_pairs_with_chunks(trainers[0])
    # (name, prefix reuse, tree_packing, tree_max_token_ratio, peft_config). At ratio 0.56 rank 1's first
    # micro-batch of each step (0.57 of TRL's padded rows) takes TRL's forward, and with it rank 0's (0.52).
    # "reuse kept": a budget that keeps every chunk's forward graph for the backward.
    kept = {"tree_prefix_reuse_budget_gib": 1.0}
    sft_runs = [
        ("tree", False, True, 1.0, None, {}),
        ("trl", False, False, 1.0, None, {}),
        ("reuse", True, True, 1.0, None, {}),
        ("reuse kept", True, True, 1.0, None, kept),
        ("reuse fallback", True, True, 0.56, None, {}),
        ("lora reuse", True, True, 1.0, lora, {}),
        ("lora trl", False, False, 1.0, lora, {}),
        ("hybrid reuse", True, True, 1.0, None, {}),  # a Qwen3.5: recurrent states and convolution inputs kept too
        ("hybrid tree", False, True, 1.0, None, {}),  # each micro-batch one forest, no chunks
    ]
    backward, kept_at_backward = prefix_reuse._Step.backward, []

    def counting(step, grads):  # the graphs a step kept from its forward, as its backward starts
        kept_at_backward.append(len(step.kept))
        return backward(step, grads)

    prefix_reuse._Step.backward = counting
    for run, reuse, packing, ratio, peft_config, extra in sft_runs:
        path = str(Path(model_path).parent / "hybrid_model") if run.startswith("hybrid") else model_path
        kept_at_backward.clear()
        trainer, gradients, chunks = _train_sft(
            path, out / f"sft_{run}", reuse, peft_config=peft_config, tree_packing=packing,
            tree_max_token_ratio=ratio, **extra, **FSDP2,
        )  # fmt: skip
        trainers.append(trainer)
        report["sft", run] = {
            "sharded": type(trainer.model).__name__.startswith("FSDP"),
            "gradients": gradients,
            "weights": {n: _full(p) for n, p in trainer.model.named_parameters()},
            "fallback": [e["tree_fallback"] for e in trainer.state.log_history if "tree_fallback" in e],
            "chunks": chunks,
            "kept graphs": [
                e["tree_prefix_reuse_kept_graphs"] for e in trainer.state.log_history if extra and "loss" in e
            ],
            "kept at backward": list(kept_at_backward),
        }
    prefix_reuse._Step.backward = backward

    for name, module in (("dpo", "test_tree_dpo"), ("reward", "test_tree_reward_trainer")):
        test = importlib.import_module(module)
        path = model_path if name == "dpo" else str(Path(model_path).parent / "reward_model")
        tree_cls, trl_cls = (
            (test.TreeDPOTrainer, test.DPOTrainer) if name == "dpo" else (test.TreeRewardTrainer, test.RewardTrainer)
        )
        runs = [("tree", tree_cls, {}), ("trl", trl_cls, {})]
        if name == "dpo":  # every batch one forest, in chunks of 128 rows
            runs.append(("reuse", tree_cls, dict(tree_prefix_reuse=True, max_tokens_per_mb=128)))
        for run, cls, options in runs:
            tiny = (path, AutoTokenizer.from_pretrained(path))
            trainer = test._trainer(cls, tiny, out / f"{name}_{run}", **options, **FSDP2)
            with _Spy(fused_head, "chunked_forest_scores") as spy:
                trainer.train()
            trainers.append(trainer)
            report[name, run] = {
                "sharded": type(trainer.model).__name__.startswith("FSDP"),
                "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
                "fallback": [e.get("tree_fallback") for e in trainer.state.log_history if "loss" in e],
                "weights": {n: _full(p) for n, p in trainer.model.named_parameters()},
                "chunks": spy.chunks,
            }

    samples = replayed_samples(async_path)
    for run, tree, reuse in (("trl", False, False), ("reuse", True, True)):
        options = dict(tree_prefix_reuse=True, output_dir=str(out / "async_reuse")) if reuse else {}
        with _Spy(forest_step, "chunked_forest_logprobs") as spy:
            trainer, losses, gradients = train(
                tree, async_path, samples, out, max_steps=2, token_budget=48, **options, **FSDP2
            )
        trainers.append(trainer)
        report["async", run] = {
            "sharded": type(trainer.model).__name__.startswith("FSDP"),
            "losses": losses,
            "grads": {n: _full(g) for n, g in gradients.steps[-1].items()},
            "weights": {n: _full(p) for n, p in trainer.model.named_parameters()},
            "chunks": spy.chunks,
        }
    torch.save(report, out / f"rank{rank}.pt")
    exit_distributed_worker()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """`(GRPO model path, the two ranks' reports)` of one torchrun of `_run_rank`."""
    from async_grpo_helpers import save_model
    from helpers import tiny_config
    from transformers import AutoModelForSequenceClassification

    from trainers import toy_task

    out = tmp_path_factory.mktemp("fsdp_trainers")
    model_path = save_toy_model(out / "model")
    save_toy_model(out / "hybrid_model", "qwen3_5")
    tokenizer = toy_task.build_tokenizer()
    async_path = save_model(tiny_config("qwen3"), out / "async_model")
    torch.manual_seed(0)
    reward = toy_task.model_config(tokenizer, num_labels=1, initializer_range=0.1)
    AutoModelForSequenceClassification.from_config(reward).save_pretrained(out / "reward_model")
    tokenizer.save_pretrained(out / "reward_model")
    run_two_ranks(__file__, model_path, async_path, out, timeout=900)
    return model_path, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_sft_equals_trl_under_fsdp2(runs):
    """Three steps of 2 accumulated micro-batches on trees (no fallback): TRL's gradients at every step, the LM head's
    included, and its weights."""
    from test_prefix_reuse_ddp import SFT_STEPS, _assert_close

    _, reports = runs
    for rank, report in enumerate(reports):
        tree, trl = report["sft", "tree"], report["sft", "trl"]
        assert tree["sharded"] and trl["sharded"] and tree["fallback"] == [0.0] * SFT_STEPS
        assert len(tree["gradients"]) == len(trl["gradients"]) == SFT_STEPS
        for step, (got, want) in enumerate(zip(tree["gradients"], trl["gradients"])):
            assert "lm_head.weight" in want
            _assert_close(got, want, f"SFT, rank {rank}, step {step} gradients")
        _assert_close(tree["weights"], trl["weights"], f"SFT, rank {rank} weights")


@pytest.mark.parametrize(
    "run, want",
    [
        ("reuse", "trl"),
        ("reuse kept", "trl"),
        ("reuse fallback", "trl"),
        ("lora reuse", "lora trl"),
        ("hybrid reuse", "hybrid tree"),
    ],
)
def test_sft_with_prefix_reuse_equals_trl_under_fsdp2(runs, run, want):
    """Prefix reuse in TRL's fused head, whose chunks run inside the model's own forward (each chunk's backward an
    FSDP2 pass of its own): every batch one forest, rank 0's in 3 chunks, rank 1's in 2 and a dummy; TRL's gradients
    at every step and its weights. Where rank 1's micro-batch takes TRL's forward, rank 0's takes it too (no
    deadlock, both log the same fallbacks). With a budget that keeps every chunk's forward graph for the backward
    (rank 1's dummy's too), no chunk recomputed on either rank. With LoRA, TRL's adapter gradients and weights; on a
    Qwen3.5 hybrid (its recurrent states and convolution inputs kept between chunks), those of each micro-batch as
    one forest (the same tree kernels: against TRL's flat delta rule fp32 differs in the last digits of near-zero
    gradients, which the one-process tests bound against a float64 reference)."""
    from test_prefix_reuse_ddp import SFT_STEPS, _assert_close

    fallback = [0.5] * SFT_STEPS if run == "reuse fallback" else [0.0] * SFT_STEPS
    for rank, report in enumerate(runs[1]):
        tree, trl = report["sft", run], report["sft", want]
        assert tree["sharded"] and trl["sharded"] and tree["fallback"] == fallback
        chunks = {0: 3, 1: 2}[rank]
        assert tree["chunks"] == [chunks] * SFT_STEPS * (1 if run == "reuse fallback" else 2)
        if run == "reuse kept":  # every chunk's graph kept, rank 1's dummy's too: no chunk recomputed on either rank
            assert tree["kept graphs"] == [float(chunks)] * SFT_STEPS, tree["kept graphs"]
            assert tree["kept at backward"] == [3] * SFT_STEPS * 2, tree["kept at backward"]
        elif run == "reuse":
            assert tree["kept at backward"] == [1] * SFT_STEPS * 2, tree["kept at backward"]
        assert len(tree["gradients"]) == len(trl["gradients"]) == SFT_STEPS
        for step, (got, want_step) in enumerate(zip(tree["gradients"], trl["gradients"])):
            _assert_close(got, want_step, f"SFT {run}, rank {rank}, step {step} gradients")
        _assert_close(tree["weights"], trl["weights"], f"SFT {run}, rank {rank} weights")


@pytest.mark.parametrize("trainer, run", [("dpo", "tree"), ("dpo", "reuse"), ("reward", "tree")])
def test_dpo_and_reward_model_equal_trl_under_fsdp2(runs, trainer, run):
    """`TreeDPOTrainer` (TRL's fused head on trees, policy and reference; with prefix reuse every batch one forest
    in chunks) and `TreeRewardTrainer`, 2 steps of 2 micro-batches on trees: TRL's losses and weights."""
    from test_prefix_reuse_ddp import _assert_close

    _, reports = runs
    if run == "reuse":
        assert min(c for report in reports for c in report[trainer, run]["chunks"]) > 1
    for rank, report in enumerate(reports):
        tree, trl = report[trainer, run], report[trainer, "trl"]
        assert tree["sharded"] and trl["sharded"] and tree["fallback"] == [0.0, 0.0]
        np.testing.assert_allclose(tree["losses"], trl["losses"], rtol=1e-5, atol=TOLERANCES["logps_atol"])
        assert trl["losses"][0] != trl["losses"][1], "the model did not move"
        _assert_close(tree["weights"], trl["weights"], f"{trainer}, rank {rank} weights")


def test_grpo_equals_fsdp2_without_prefix_reuse(runs):
    """Two steps on one generation, 2 micro-batches each: rank 0's policy forests in 3 chunks each, rank 1's in 2 or
    1 (run chunked all the same, with dummies up to rank 0's count): the gradients of every step and the weights of
    the FSDP2 run that forwards each micro-batch as one forest (whose gradients are TRL's). So too where one rank's
    micro-batch takes TRL's flat path: every rank takes it. And with LoRA adapters: TRL's gradients and weights."""
    from test_prefix_reuse_ddp import _assert_close

    _, reports = runs
    for rank, report in enumerate(reports):
        plain = report["grpo", "plain"]
        assert plain["world"] == 2 and plain["sharded"] and not plain["chunks"]
        assert plain["fallback"] == [0.0, 0.0]
        for step, (got, want) in enumerate(zip(plain["gradients"], report["grpo", "trl"]["gradients"], strict=True)):
            _assert_close(got, want, f"trees against TRL, rank {rank}, step {step} gradients")
        for run in ("reuse", "fallback"):
            reuse = report["grpo", run]
            assert reuse["world"] == 2 and reuse["sharded"]
            assert len(reuse["gradients"]) == len(plain["gradients"]) == 2
            for step, (got, want) in enumerate(zip(reuse["gradients"], plain["gradients"])):
                assert any(g.abs().max() > 0 for g in want.values())
                _assert_close(got, want, f"{run}, rank {rank}, step {step} gradients")
            _assert_close(reuse["weights"], plain["weights"], f"{run}, rank {rank} weights")
    for rank, report in enumerate(reports):  # LoRA: the adapters' gradients and weights of TRL's run
        reuse, trl = report["grpo", "lora reuse"], report["grpo", "lora trl"]
        assert len(reuse["chunks"]) == 4 and reuse["fallback"] == [0.0, 0.0] and len(reuse["gradients"]) == 2
        assert all(".lora_" in name for step in trl["gradients"] for name in step) and trl["gradients"][1]
        for step, (got, want) in enumerate(zip(reuse["gradients"], trl["gradients"], strict=True)):
            _assert_close(got, want, f"LoRA, rank {rank}, step {step} gradients")
        _assert_close(reuse["weights"], trl["weights"], f"LoRA, rank {rank} weights")
    for rank, report in enumerate(reports):  # the hybrid: chunks hand on Gated DeltaNet states and conv inputs
        reuse, plain = report["grpo", "hybrid reuse"], report["grpo", "hybrid plain"]
        assert len(reuse["chunks"]) == 4 and reuse["fallback"] == [0.0, 0.0] and len(reuse["gradients"]) == 2
        for step, (got, want) in enumerate(zip(reuse["gradients"], plain["gradients"], strict=True)):
            _assert_close(got, want, f"hybrid, rank {rank}, step {step} gradients")
        _assert_close(reuse["weights"], plain["weights"], f"hybrid, rank {rank} weights")
    reuse, fallback = ([report["grpo", run] for report in reports] for run in ("reuse", "fallback"))
    assert reuse[0]["chunks"] == [3] * 4 and sorted(set(reuse[1]["chunks"])) == [1, 2]  # 1: chunked all the same
    assert reuse[0]["fallback"] == reuse[1]["fallback"] == [0.0, 0.0]
    # One micro-batch of each step flat on both ranks (its forward and the old policy's), the other chunked.
    assert fallback[0]["fallback"] == fallback[1]["fallback"] == [0.5, 0.5]
    assert len(fallback[0]["chunks"]) == len(fallback[1]["chunks"]) == 2


def test_async_equals_trl_under_fsdp2(runs):
    """Each rank's step forest in chunks of `token_budget` rows: TRL's losses per micro-batch, its last step's
    gradients and its weights, on both ranks."""
    from test_prefix_reuse_ddp import _assert_close

    _, reports = runs
    for report in reports:
        trl, reuse = report["async", "trl"], report["async", "reuse"]
        assert trl["sharded"] and reuse["sharded"]
        assert not trl["chunks"] and len(reuse["chunks"]) == 2 and max(reuse["chunks"]) >= 2
        assert len(reuse["losses"]) == len(trl["losses"]) == 4
        np.testing.assert_allclose(reuse["losses"], trl["losses"], rtol=1e-5, atol=TOLERANCES["logps_atol"])
        _assert_close(reuse["grads"], trl["grads"], "async gradients")
        for name, want in trl["weights"].items():
            torch.testing.assert_close(reuse["weights"][name], want, rtol=1e-5, atol=1e-6, msg=name)
    assert reports[0]["async", "reuse"]["losses"] != reports[1]["async", "reuse"]["losses"]


def test_idle_forest_pairs_with_chunks_and_adds_nothing(runs):
    """Rank 0's idle forest (one chunk, dummies up to rank 1's three) against rank 1's forest: FSDP2's reduced
    gradient is half that of rank 1's forest scored alone in one process (rank 0 contributes zero)."""
    from test_prefix_reuse_ddp import _assert_close
    from transformers import AutoModelForCausalLM

    from hf_tree_attn import forest_logprobs, pack_forest

    model_path, reports = runs
    idle = reports[1]["idle"]
    model = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="tree_flex", dtype=torch.float32)
    model.load_state_dict(idle["weights"])
    (forest,) = pack_forest(idle["sequences"])
    table, _ = forest_logprobs(model.train(), forest, temperature=idle["temperature"])
    (table * torch.linspace(-1.0, 1.0, table.numel())).sum().backward()
    want = {n: p.grad / 2 for n, p in model.named_parameters() if p.grad is not None}
    for report in reports:
        _assert_close(report["idle"]["grads"], want, "idle forest against the chunked one")


if __name__ == "__main__":
    _run_rank(*sys.argv[1:4])
