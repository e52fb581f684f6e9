"""Shared by the CPU and GPU tests of TreeAsyncGRPOTrainer: both trainers on replayed samples, and the eager oracle.

Imports only what the GPU machine's transformers (5.17) has: `tests/helpers.py` imports configs of newer families.

- `save_model`: a seeded, jittered model saved where TRL's constructor loads it from;
- `replayed_samples`: GRPO groups and multi-turn samples with the model's own generator log-probs;
- `train`: TRL's AsyncGRPOTrainer (its FlashAttention call swapped, `trl_varlen`) or TreeAsyncGRPOTrainer, through
  `train()` on those samples;
- `spy_on_forests` / `check_against_eager`: what the tree trainer scored, against per-sample `eager` forwards;
- `relative_error`: one step's gradients against a reference run's, as one vector.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
from trl_varlen import use_kernel, varlen_attention

VOCAB = 128


def eager_logprobs(model, seq) -> torch.Tensor:
    """Log p(tok_t | tok_<t), t = 1..L-1, `(L - 1,)` fp32, from one plain forward of `seq` alone."""
    ids = torch.as_tensor(seq, dtype=torch.long)[None]
    return model(ids).logits[0, :-1].float().log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level `t0 .. t127` (t0 = pad, t1 = eos): TRL's constructor needs a tokenizer with a pad token."""
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", padding_side="left")


def save_model(config, path: Path, seed: int = 0) -> str:
    """A seeded fp32 model of `config`, jittered as training would move it (parameters initialised to constants —
    sinks at 0, norms at 1 — must not hide a difference), saved where TRL's constructor loads it from."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.add_(0.05 * torch.randn_like(param))
            if name.endswith("A_log"):  # decay rates in [0.01, 2], as tests/helpers.hybrid_twin_models
                param.copy_(torch.empty_like(param).uniform_(0.01, 2.0).log())
    model.save_pretrained(path)
    return str(path)


def replayed_samples(path: str, seed: int = 0, samples: list | None = None) -> list:
    """`samples` (default: small GRPO groups and multi-turn samples) with the model's own generator log-probs plus
    noise: importance ratios near 1, some clipped, so the loss has gradients on both sides of the clip."""
    from hf_tree_attn.trainer.replay import agent_samples, grpo_samples

    if samples is None:
        samples = grpo_samples(3, 4, (5, 12), (1, 7), VOCAB, seed=seed)
        samples += agent_samples(2, (2, 3), 6, (1, 4), (1, 5), VOCAB, seed=seed + 1)
    eager = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        out = []
        for sample in samples:
            logps = eager_logprobs(eager, sample.input_ids.tolist())
            old = np.concatenate([[0.0], logps.numpy() + rng.normal(0, 0.15, len(logps))]).astype(np.float32)
            out.append(dataclasses.replace(sample, old_log_probs=old))
    return out


class GradientLog(TrainerCallback):
    """Every parameter gradient just before each optimizer step (after TRL's clipping)."""

    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


def train(tree: bool, path: str, samples: list, out: Path, kernel=varlen_attention, prepare=None, **overrides):
    """Run TRL's AsyncGRPOTrainer (its kernel: `kernel`) or TreeAsyncGRPOTrainer on replayed `samples`:
    `(trainer, micro-batch losses, GradientLog)`. SGD, so the weights after the run compare as the gradients do.
    `prepare(trainer)`, if given, runs after the constructor, before `train()`."""
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from hf_tree_attn.trainer import TreeAsyncGRPOConfig, TreeAsyncGRPOTrainer
    from hf_tree_attn.trainer.replay import NoWeightTransfer, ReplayRolloutWorker

    config_class, trainer_class = (
        (TreeAsyncGRPOConfig, TreeAsyncGRPOTrainer) if tree else (AsyncGRPOConfig, AsyncGRPOTrainer)
    )
    kwargs = dict(
        output_dir=str(out / trainer_class.__name__), use_cpu=True, bf16=False, max_steps=2,
        gradient_accumulation_steps=2, token_budget=64, optim="sgd", learning_rate=0.05, logging_steps=1,
        report_to="none", save_strategy="no", disable_tqdm=True, seed=0,
    )  # fmt: skip
    kwargs.update(overrides)
    gradients, losses = GradientLog(), []
    with warnings.catch_warnings(), use_kernel(kernel):
        warnings.simplefilter("ignore")
        trainer = trainer_class(
            path, args=config_class(**kwargs), train_dataset=Dataset.from_dict({"prompt": ["unused"] * 4}),
            processing_class=build_tokenizer(), callbacks=[gradients],
            rollout_worker=ReplayRolloutWorker(samples, cycle=True), weight_transfer=NoWeightTransfer(),
        )  # fmt: skip
        compute_loss = trainer.compute_loss
        trainer.compute_loss = lambda *a, **k: losses.append(compute_loss(*a, **k)) or losses[-1]
        if prepare is not None:
            prepare(trainer)
        trainer.train()
    return trainer, [float(loss.detach()) for loss in losses], gradients


def relative_error(grads: dict, exact: dict) -> float:
    """|grads - exact| / |exact| over all parameters as one vector."""
    diff = sum(float((grads[n].float() - g.float()).square().sum()) for n, g in exact.items())
    return (diff / sum(float(g.float().square().sum()) for g in exact.values())) ** 0.5


def spy_on_forests(monkeypatch) -> list:
    """Record `(forest, scored rows, log-prob table, aux loss)` of every forward TreeAsyncGRPOTrainer runs."""
    from hf_tree_attn.trainer import async_grpo_trainer

    score_forests, scored = async_grpo_trainer.score_forests, []

    def spy(model, forests, rows, **kwargs):
        tables, entropies, aux = score_forests(model, forests, rows, **kwargs)
        scored.append((forests[0], rows[0], tables[0].detach(), None if aux is None else aux.detach()))
        return tables, entropies, aux

    monkeypatch.setattr(async_grpo_trainer, "score_forests", spy)
    return scored


def check_against_eager(path: str, samples: list, forest, rows, table, atol: float):
    """Assert every scored row of `forest` holds the log-prob its samples' own `eager` forwards give; return the
    MoE load-balancing loss of those forwards (each token of each sample counted), or None for a dense model. The
    oracle runs on the CPU in fp32."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from hf_tree_attn.support import config_field

    eager = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    text = eager.config.get_text_config()
    moe = hasattr(text, "output_router_logits")
    replayed = {tuple(sample.input_ids.tolist()) for sample in samples}
    forest, rows, table = forest.to("cpu"), rows.cpu(), table.cpu()
    want, router_logits = torch.full_like(table, math.nan), []
    with torch.no_grad():
        for k in range(len(forest.seq_ids)):
            seq = forest.input_ids[0, forest.positions(k)].tolist()
            assert tuple(seq) in replayed
            want[forest.positions(k)[1:]] = eager_logprobs(eager, seq)
            if moe:
                router_logits.append(eager(torch.tensor([seq]), output_router_logits=True).router_logits)
    assert not want[rows].isnan().any()
    torch.testing.assert_close(table[rows], want[rows], rtol=0, atol=atol)
    if not moe:
        return None
    layers = tuple(torch.cat(per_layer) for per_layer in zip(*router_logits))
    experts = config_field(text, "num_experts", "num_local_experts", "n_routed_experts")
    return load_balancing_loss_func(layers, experts, text.num_experts_per_tok)
