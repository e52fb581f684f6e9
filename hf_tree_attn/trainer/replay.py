"""Replayed rollouts for TRL's asynchronous GRPO trainers: no vLLM server, the same samples every run.

TRL's `AsyncGRPOTrainer` (and `TreeAsyncGRPOTrainer`) take a `rollout_worker=` (TRL's `RolloutWorkerProtocol`: a
queue of scored `RolloutSample`s) and a `weight_transfer=` (TRL's `WeightTransferProtocol`). `ReplayRolloutWorker`
serves a fixed list of samples — recorded from a real run, or built by `grpo_samples` / `agent_samples` — and
`NoWeightTransfer` syncs nothing. Together they run both trainers offline on identical data: the tests compare them
on it, the benchmarks time them on it.

Samples follow TRL's layout: `input_ids` `(L,)` the whole sequence, `completion_mask` `(L,)` 1 on the tokens the
loss is taken over, `old_log_probs` `(L,)` the generator's log-probability of each token (read where the mask is 1),
one `advantage` per sample and a `group_id` shared by the samples of one prompt (or one conversation).
"""

from __future__ import annotations

import dataclasses
import math
import queue
import random
import time
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from .trl_compat import RolloutSample

__all__ = ["NoWeightTransfer", "ReplayRolloutWorker", "agent_samples", "grpo_samples"]


class _FreshQueue(queue.Queue):
    """A queue whose samples leave stamped with the policy version of the moment: a replayed sample is never stale,
    however long the run (TRL drops samples more than `max_staleness` versions old)."""

    def __init__(self, worker: ReplayRolloutWorker):
        super().__init__()
        self._worker = worker

    def get(self, block: bool = True, timeout: float | None = None) -> RolloutSample:
        sample = super().get(block, timeout)
        if self._worker.cycle:
            self.put_nowait(sample)
        return dataclasses.replace(sample, model_version=self._worker.model_version, enqueued_at=time.time())


class ReplayRolloutWorker:
    """A `RolloutWorkerProtocol` that serves `samples` in order (and again from the start with `cycle=True`).

    Args:
        samples: the rollouts to serve, in the order the trainer's planner receives them.
        cycle: start over once every sample was served; otherwise the worker reports itself exhausted (an error
            naming the fix) when the trainer asks for more.
    """

    def __init__(self, samples: Sequence[RolloutSample], cycle: bool = False):
        if not samples:
            raise ValueError("ReplayRolloutWorker needs at least one RolloutSample to serve.")
        self.samples = list(samples)
        self.cycle = cycle
        self.model_version = 0
        self.rollout_buffer = _FreshQueue(self)
        self.metrics_queue: queue.Queue = queue.Queue()

    def start(self) -> None:
        for sample in self.samples:
            self.rollout_buffer.put_nowait(sample)

    def stop(self) -> None:
        with self.rollout_buffer.mutex:
            self.rollout_buffer.queue.clear()

    def update_model_version(self, model_version: int) -> None:
        self.model_version = model_version

    def check_health(self, stale_after_s: float) -> None:
        """Called by TRL when the queue stays empty: the replay is over."""
        if self.rollout_buffer.qsize() == 0:
            raise RuntimeError(
                f"ReplayRolloutWorker served all {len(self.samples)} samples and the trainer asked for more. Give "
                "it more samples, set max_steps so the run ends before, or pass cycle=True."
            )


class NoWeightTransfer:
    """A `WeightTransferProtocol` that sends nothing (no inference server). It still walks the weights it is handed:
    under FSDP2 each one is an all-gather every rank must join."""

    def init_weight_transfer(self) -> None:
        pass

    def pause(self) -> None:
        pass

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        for _ in iterator:
            pass

    def resume(self) -> None:
        pass

    def destroy(self) -> None:
        pass


def _sample(
    context: list[int], completion: list[int], group_id: int, advantage: float, old_log_prob: float
) -> RolloutSample:
    ids = np.asarray(context + completion, dtype=np.int64)
    mask = np.concatenate([np.zeros(len(context), np.int64), np.ones(len(completion), np.int64)])
    return RolloutSample(
        prompt=[],
        completion=[],
        input_ids=ids,
        completion_mask=mask,
        old_log_probs=np.where(mask == 1, old_log_prob, 0.0).astype(np.float32),
        advantage=float(advantage),
        model_version=0,
        group_id=group_id,
        metrics={"reward": float(advantage)},
    )


def _advantages(rng: random.Random, n: int) -> list[float]:
    """Group-normalised random rewards, as GRPO's advantages: mean 0, std 1 within the group."""
    rewards = [rng.random() for _ in range(n)]
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n) or 1.0
    return [(r - mean) / std for r in rewards]


def grpo_samples(
    groups: int,
    num_generations: int,
    prompt_lengths: tuple[int, int],
    completion_lengths: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
) -> list[RolloutSample]:
    """GRPO groups: `groups` prompts of U[prompt_lengths] random tokens, `num_generations` completions each of
    U[completion_lengths] tokens, group-normalised advantages; `old_log_probs = -log(vocab_size)` (a random model's
    log-probabilities: the importance ratio starts near 1). Samples of a group are consecutive."""
    rng = random.Random(seed)
    samples = []
    for group in range(groups):
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_lengths))]
        for advantage in _advantages(rng, num_generations):
            completion = [rng.randrange(vocab_size) for _ in range(rng.randint(*completion_lengths))]
            samples.append(_sample(prompt, completion, group, advantage, -math.log(vocab_size)))
    return samples


def agent_samples(
    conversations: int,
    turns: tuple[int, int],
    system_length: int,
    message_lengths: tuple[int, int],
    response_lengths: tuple[int, int],
    vocab_size: int,
    branches: int = 2,
    seed: int = 0,
) -> list[RolloutSample]:
    """tau2-like multi-turn samples: every conversation opens with the same `system_length`-token system prompt,
    then U[turns] turns, each a user / tool message of U[message_lengths] tokens and `branches` sampled responses of
    U[response_lengths] tokens; each response is one sample holding the whole history, and the conversation goes on
    from the first response, so each turn's prompt is an earlier sample's full text. Only the response is trained;
    a conversation is one group (`group_id`)."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab_size) for _ in range(system_length)]
    samples = []
    for conversation in range(conversations):
        history = list(system)
        for _ in range(rng.randint(*turns)):
            history += [rng.randrange(vocab_size) for _ in range(rng.randint(*message_lengths))]
            responses = [
                [rng.randrange(vocab_size) for _ in range(rng.randint(*response_lengths))] for _ in range(branches)
            ]
            for response, advantage in zip(responses, _advantages(rng, branches)):
                samples.append(_sample(history, response, conversation, advantage, -math.log(vocab_size)))
            history += responses[0]
    return samples
