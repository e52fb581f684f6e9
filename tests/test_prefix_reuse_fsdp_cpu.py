"""Prefix reuse under FSDP2 on CPU: `sequence_logprobs(..., prefix_reuse=True)` of a `fully_shard`-ed model gives
each rank's log-probs and the mean over ranks of the gradients, as the unsharded model does without prefix reuse.

Two gloo processes shard the model as accelerate's FSDP2 path does (`test_fsdp_cpu._shard_like_accelerate`). FSDP2
gathers each module's parameters in its forward and backward and reduce-scatters its gradients: collectives every
rank must call alike, while ranks cut their forests into different numbers of chunks. Here the ranks run 2 and 3
chunks, then 1 (a forest within the budget) and 3; without the dummy chunks that even them out the ranks deadlock.
"""

import copy
import datetime
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import exit_distributed_worker
from test_chunked import BUDGET, _num_chunks, _trie
from test_fsdp_cpu import _free_port, _model, _shard_like_accelerate

from hf_tree_attn import sequence_logprobs

WORLD_SIZE = 2
VOCAB = 16  # the test model's


def _sequences(chunks: int, seed: int) -> list[list[int]]:
    return [[t % VOCAB for t in s] for s in _trie(chunks, seed=seed, max_len=200)]


# Per case, per rank: (chunks, seed) of its sequences.
CASES = [((2, 10), (3, 11)), ((1, 12), (3, 13))]


def _loss(logps: list[torch.Tensor]) -> torch.Tensor:
    return sum((lp * torch.linspace(-1.0, 1.0, lp.shape[0])).sum() for lp in logps)


def _worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # a deadlock (ranks calling different collectives) fails the test within a minute instead of hanging it
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=datetime.timedelta(seconds=60))
    try:
        for case in CASES:
            sequences = [_sequences(*spec) for spec in case]
            assert [_num_chunks(s) for s in sequences] == [spec[0] for spec in case]
            reference = _model()
            expected = {name: torch.zeros_like(p) for name, p in reference.named_parameters()}
            for rank_sequences in sequences:  # the unsharded tree without prefix reuse, averaged over the ranks
                reference.zero_grad()
                _loss(sequence_logprobs(reference, rank_sequences)).backward()
                for name, p in reference.named_parameters():
                    expected[name] += p.grad / WORLD_SIZE
            with torch.no_grad():
                expected_logps = sequence_logprobs(reference, sequences[rank])
            for checkpointing in (False, True):
                model = copy.deepcopy(_model())
                if checkpointing:
                    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                _shard_like_accelerate(model)
                logps = sequence_logprobs(model, sequences[rank], BUDGET, prefix_reuse=True)
                for got, want in zip(logps, expected_logps, strict=True):
                    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
                _loss(logps).backward()
                for name, p in model.named_parameters():
                    torch.testing.assert_close(p.grad.full_tensor(), expected[name], atol=1e-5, rtol=1e-5, msg=name)
    finally:
        dist.destroy_process_group()
    exit_distributed_worker()  # as test_fsdp_cpu: gloo's threads can abort the interpreter's teardown


def test_prefix_reuse_under_fsdp2_equals_unsharded_with_unequal_chunk_counts():
    mp.spawn(_worker, args=(_free_port(),), nprocs=WORLD_SIZE, join=True)
