"""`tree_prefix_reuse=True` under DDP: 2 gloo processes (torchrun, like `test_grpo_distributed.py`), fp32.

Each rank's forests run in chunks of 128 rows, rank 0's in more chunks than rank 1's, so the ranks run different
numbers of forwards and per-chunk backwards: DDP's reducer stays out of the step and the gradients are averaged once
per optimizer step (`core.prefix_reuse_gradient_sync`). SGD steps of two accumulated micro-batches each must give the
gradients and weights of the same 2-process run without prefix reuse (one forest per micro-batch, DDP's own
reduction), and the same weights on both ranks. `TreeSFTTrainer` (the fused head: one DDP forward per micro-batch,
the chunks inside it) also reaches the weights of one process trained on both ranks' data; `TreeGRPOTrainer` runs
each chunk through the DDP wrapper (forward, and recompute in the backward). Left to DDP's reducer, the SFT run's
gradients come out wrong without an error and the GRPO run hangs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from helpers import TOLERANCES, run_two_ranks, save_toy_model

REPO = Path(__file__).resolve().parent.parent
BUDGET = 128
ACCUMULATION = 2
SFT_STEPS, SFT_PER_RANK = 3, 2
SYSTEM = "you are a terse agent. tools: calc(x), look(k). answer in one line; cite the tool you used.\n"
# GRPO prompt lengths in dataset order: rank 0 generates for the first 4 prompts, rank 1 for the last 4
# (shuffle_dataset=False, 4 prompts x 4 completions per rank). A micro-batch holds 2 prompts' groups, the prompts
# prefixes of one text: rank 0's forests take 3 chunks; rank 1's first 2, its second fits one forward (the DDP
# wrapper's, while rank 0 runs chunks).
GRPO_LENGTHS = [250, 230, 200, 180, 90, 80, 40, 30]


def _sft_dataset():
    """Texts in sampler order. With a sequential sampler accelerate hands rank `r` the batches `r, r + 2, ...` of
    `SFT_PER_RANK` samples: rank 0's share a 3-system-prompt prefix (forests of 3 chunks), rank 1's a 1-prompt one
    (2 chunks)."""
    from datasets import Dataset

    texts = []
    for batch in range(2 * SFT_STEPS * ACCUMULATION):
        prefix = SYSTEM * (3 if batch % 2 == 0 else 1)
        texts += [prefix + f"note {batch}.{i}: " + "xyz " * (1 + (batch + i) % 4) + "done." for i in range(2)]
    return Dataset.from_dict({"text": texts})


class _Spy:
    """Within the block, the chunk count of every forest `module.name` scores in chunks with autograd on (the policy's:
    not the reference or old-policy forwards), in `self.chunks`."""

    def __init__(self, module, name: str):
        self.module, self.name, self.chunks = module, name, []

    def __enter__(self):
        from hf_tree_attn.chunked import plan_chunks

        self.original = original = getattr(self.module, self.name)

        def spy(model, forest, max_tokens_per_mb, *args, **kwargs):
            if torch.is_grad_enabled():
                self.chunks.append(plan_chunks(forest, max_tokens_per_mb).num_chunks)
            return original(model, forest, max_tokens_per_mb, *args, **kwargs)

        setattr(self.module, self.name, spy)
        return self

    def __exit__(self, *exc):
        setattr(self.module, self.name, self.original)


def _gradient_log():
    from transformers import TrainerCallback

    class GradientLog(TrainerCallback):
        """Every parameter gradient just before each optimizer step (no clipping: max_grad_norm=0)."""

        def __init__(self):
            self.steps = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.steps.append({n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None})

    return GradientLog()


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A detached copy of `tensor`, whole where FSDP2 shards it (a `DTensor`: gathered from every rank)."""
    tensor = tensor.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.clone()


COMMON = dict(
    use_cpu=True, bf16=False, seed=0, report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=1,
    gradient_accumulation_steps=ACCUMULATION, learning_rate=0.05, optim="sgd", lr_scheduler_type="constant",
    max_grad_norm=0.0, model_init_kwargs={"dtype": torch.float32}, tree_packing=True, tree_max_token_ratio=1.0,
)  # fmt: skip


def _train_sft(
    model_path: str, out_dir: Path, reuse: bool, per_device: int = SFT_PER_RANK, peft_config=None, **overrides
):
    """`(trainer, gradients at each optimizer step, chunk counts of the forests scored in chunks)`; `overrides`
    replace `COMMON`'s fields."""
    from transformers import AutoTokenizer

    from hf_tree_attn.trainer import TreeSFTConfig, TreeSFTTrainer, fused_head

    args = TreeSFTConfig(
        output_dir=str(out_dir), **(COMMON | overrides), per_device_train_batch_size=per_device, max_steps=SFT_STEPS,
        train_sampling_strategy="sequential", max_length=None, tree_prefix_reuse=reuse,
        max_tokens_per_mb=BUDGET if reuse else None,
    )  # fmt: skip
    gradients = _gradient_log()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    trainer = TreeSFTTrainer(
        model_path, args=args, train_dataset=_sft_dataset(), processing_class=tokenizer, callbacks=[gradients],
        peft_config=peft_config,
    )  # fmt: skip
    with _Spy(fused_head, "chunked_forest_scores") as spy:
        trainer.train()
    return trainer, gradients.steps, spy.chunks


def _train_grpo(model_path: str, out_dir: Path, reuse: bool, peft_config=None, **overrides):
    """`(trainer, gradients at each optimizer step, chunk counts of the policy forests scored in chunks)`: two
    optimizer steps on one generation (num_iterations=2), with reference and old-policy log-probs (the adapters off
    under `peft_config`); `overrides` replace `COMMON`'s fields."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from hf_tree_attn.trainer import TreeGRPOConfig, TreeGRPOTrainer, forest_step
    from trainers import toy_task

    prompts = [(toy_task.SYSTEM_PROMPT * 2)[:n] + f" letter: {x}" for n, x in zip(GRPO_LENGTHS, "abcdabcd")]
    args = TreeGRPOConfig(
        output_dir=str(out_dir), **(COMMON | overrides), per_device_train_batch_size=8, num_generations=4,
        max_steps=2, max_completion_length=6, temperature=0.7, shuffle_dataset=False, beta=0.04, num_iterations=2,
        tree_balance=False, tree_prefix_reuse=reuse, max_tokens_per_mb=BUDGET if reuse else None,
    )  # fmt: skip
    gradients = _gradient_log()
    trainer = TreeGRPOTrainer(
        model_path, toy_task.copy_letter_reward, args, callbacks=[gradients],
        train_dataset=Dataset.from_dict({"prompt": prompts, "target": list("abcdabcd")}),
        processing_class=AutoTokenizer.from_pretrained(model_path), peft_config=peft_config,
    )  # fmt: skip
    with _Spy(forest_step, "chunked_forest_logprobs") as spy:
        trainer.train()
    return trainer, gradients.steps, spy.chunks


class _Net(torch.nn.Module):
    """Three linear layers (`c` never used, `b` on rank 0 only) and a buffer each forward changes, differently on each
    rank."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (torch.nn.Linear(4, 4) for _ in range(3))
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        self.seen += x.sum()
        h = self.a(x)
        return self.b(h) if use_b else h


def _sync_against_ddp(rank: int) -> dict:
    """One optimizer step of 2 micro-batches on `_Net`: DDP (`find_unused_parameters=True`, `no_sync` on the first
    micro-batch) against `prefix_reuse_gradient_sync` on every micro-batch, rank 0's loss run as two backwards (as a
    prefix-reuse backward runs one per chunk). The gradients after the step, and DDP's buffers as its next forward
    reads them (rank 0's) against the ones the sync left."""
    import contextlib
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from hf_tree_attn.trainer.core import prefix_reuse_gradient_sync

    generator = torch.Generator().manual_seed(rank)
    batches, use_b = [torch.randn(3, 4, generator=generator) for _ in range(2)], rank == 0
    reference = DistributedDataParallel(_Net(), find_unused_parameters=True)
    for i, x in enumerate(batches):
        with reference.no_sync() if i == 0 else contextlib.nullcontext():
            reference(x, use_b).square().sum().backward()
    ours = DistributedDataParallel(_Net(), find_unused_parameters=True)
    trainer = SimpleNamespace(accelerator=SimpleNamespace(sync_gradients=False))
    for i, x in enumerate(batches):
        trainer.accelerator.sync_gradients = i == 1
        with prefix_reuse_gradient_sync(trainer, ours, True):
            out = ours(x, use_b)
            if rank == 0:
                out[:1].square().sum().backward(retain_graph=True)
                out[1:].square().sum().backward()
            else:
                out.square().sum().backward()
    local, buffer = reference.module.seen.clone(), reference.module.seen.clone()
    dist.broadcast(buffer, src=0)
    grads = [{n: p.grad for n, p in m.module.named_parameters()} for m in (reference, ours)]
    return {"reference": grads[0], "ours": grads[1], "buffers": (local, buffer, ours.module.seen.clone())}


def _run_rank(model_path: str, out_dir: str) -> None:
    """The torchrun worker: `_sync_against_ddp`, then each trainer with and without prefix reuse (gradients, weights
    and chunk counts); saved."""
    sys.path.insert(0, str(REPO))
    import torch.distributed as dist
    from helpers import exit_distributed_worker

    dist.init_process_group("gloo")  # the trainers' accelerator finds it initialised
    rank, trainers = int(os.environ["RANK"]), []
    report = {"sync": _sync_against_ddp(rank)}
    for name, train in (("sft", _train_sft), ("grpo", _train_grpo)):
        for reuse in (True, False):
            trainer, gradients, chunks = train(model_path, Path(out_dir) / f"{name}_{reuse}", reuse)
            trainers.append(trainer)  # never freed: see exit_distributed_worker
            report[name, reuse] = {
                "world": trainer.accelerator.num_processes,
                "gradients": gradients,
                "weights": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
                "chunks": chunks,
            }
    torch.save(report, Path(out_dir) / f"rank{rank}.pt")
    exit_distributed_worker()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """`(model path, work directory, the two ranks' reports)` of one torchrun of `_run_rank`."""
    out = tmp_path_factory.mktemp("prefix_reuse_ddp")
    model_path = save_toy_model(out / "model")
    run_two_ranks(__file__, model_path, out)
    return model_path, out, [torch.load(out / f"rank{r}.pt") for r in range(2)]


def _assert_close(got: dict, want: dict, what: str) -> None:
    """Per tensor: max |diff| <= 1e-5 x max |want| (fp32 sums of a few hundred terms, `TOLERANCES`)."""
    assert got.keys() == want.keys() and want, what
    for name, value in want.items():
        worst = (got[name] - value).abs().max().item()
        assert worst <= TOLERANCES["grad_max_rel"] * value.abs().max().item() + 1e-9, f"{what}, {name}: {worst}"


def _assert_same_as_ddp(reports, trainer: str, steps: int, forests: tuple[int, int]) -> None:
    """Per rank, every step's gradients and the final weights of the prefix-reuse run equal DDP's without it; rank `r`
    ran `forests[r]` forests in chunks, rank 0 more chunks each than rank 1; both ranks hold the same weights."""
    for rank, report in enumerate(reports):
        reuse, ddp = report[trainer, True], report[trainer, False]
        assert reuse["world"] == ddp["world"] == 2
        assert len(reuse["chunks"]) == forests[rank] and min(reuse["chunks"]) >= 2 and not ddp["chunks"]
        assert len(reuse["gradients"]) == len(ddp["gradients"]) == steps
        for step, (got, want) in enumerate(zip(reuse["gradients"], ddp["gradients"])):
            assert any(g.abs().max() > 0 for g in want.values())
            _assert_close(got, want, f"{trainer}, rank {rank}, step {step} gradients")
        _assert_close(reuse["weights"], ddp["weights"], f"{trainer}, rank {rank} weights")
    assert min(reports[0][trainer, True]["chunks"]) > max(reports[1][trainer, True]["chunks"])
    for name, weight in reports[0][trainer, True]["weights"].items():
        assert torch.equal(weight, reports[1][trainer, True]["weights"][name]), name


def test_gradient_sync_is_ddps(runs):
    """`prefix_reuse_gradient_sync` against DDP's reducer on a 3-layer net: the mean over ranks of the step's summed
    gradients, one rank's gradient counted as zeros where it has none (`b` on rank 1) and no gradient where no rank
    has one (`c`), whatever number of backwards each rank ran; rank 0's buffers on both ranks after the step."""
    for report in runs[2]:
        reference, ours = report["sync"]["reference"], report["sync"]["ours"]
        assert reference["c.weight"] is None and ours["c.weight"] is None
        assert ours["b.weight"] is not None and ours["b.weight"].abs().max() > 0
        for name, grad in reference.items():
            if grad is not None:
                torch.testing.assert_close(ours[name], grad, rtol=1e-6, atol=1e-7, msg=name)
        _, buffer, ours_buffer = report["sync"]["buffers"]
        assert torch.equal(ours_buffer, buffer)
    assert not torch.equal(*(report["sync"]["buffers"][0] for report in runs[2]))  # the ranks' own differ


def test_sft_equals_ddp_and_one_process(runs):
    """Three steps; then one process trains on both ranks' micro-batches (each the union of the ranks' in sampler
    order) with prefix reuse: the weights of the 2-process run."""
    model_path, out, reports = runs
    _assert_same_as_ddp(reports, "sft", SFT_STEPS, (SFT_STEPS * ACCUMULATION,) * 2)
    trainer, _, chunks = _train_sft(str(model_path), out / "one", True, per_device=2 * SFT_PER_RANK)
    assert trainer.accelerator.num_processes == 1 and min(chunks) >= 2
    weights = {n: p.detach() for n, p in trainer.model.named_parameters()}
    _assert_close(reports[0]["sft", True]["weights"], weights, "2 processes vs 1")


def test_grpo_equals_ddp(runs):
    """Two steps on one generation: rank 0's policy forward of each micro-batch (2 steps x 2 micro-batches) in chunks,
    rank 1's of one micro-batch per step (the other one forward)."""
    _, _, reports = runs
    _assert_same_as_ddp(reports, "grpo", 2, (2 * ACCUMULATION, 2))


if __name__ == "__main__":
    _run_rank(*sys.argv[1:3])
