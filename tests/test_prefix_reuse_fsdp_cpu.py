"""Prefix reuse under FSDP2 on CPU: `sequence_logprobs(..., prefix_reuse=True)` of a `fully_shard`-ed model gives
each rank's log-probs and the mean over ranks of the gradients, as the unsharded model does without prefix reuse.

Two gloo processes shard the model as accelerate's FSDP2 path does (`test_fsdp_cpu._shard_like_accelerate`). FSDP2
gathers each module's parameters in its forward and backward and reduce-scatters its gradients: collectives every
rank must call alike, while ranks cut their forests into different numbers of chunks. Here the ranks run 2 and 3
chunks, then 1 (a forest within the budget) and 3; without the dummy chunks that even them out the ranks deadlock.
The same on a Qwen3.5 hybrid (Gated DeltaNet and short convolutions beside attention), whose chunks hand states on:
a dummy reruns the forest's first row, which chunk 0 keeps, after every real chunk, so it must keep nothing (a state
it kept would replace chunk 0's, which the backward's recompute of chunk 1 reads). Each with the last chunk's forward
graph kept and with every chunk's (`keep_graphs`: the parameters outside the decoder layers gathered again before
each kept graph's backward), with and without the model's own checkpointing; and the dense model's decoder layers
compiled, before sharding and after it, which the chunks then run.
"""

import copy
import datetime
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import TOLERANCES, exit_distributed_worker, hybrid_twin_models
from test_chunked import BUDGET, _num_chunks, _trie
from test_fsdp_cpu import _free_port, _model, _shard_like_accelerate
from torch._dynamo.utils import counters

from hf_tree_attn import prefix_reuse, sequence_logprobs
from hf_tree_attn.compile import compile_decoder_layers

WORLD_SIZE = 2
VOCAB = 16  # the test model's


def _sequences(chunks: int, seed: int) -> list[list[int]]:
    return [[t % VOCAB for t in s] for s in _trie(chunks, seed=seed, max_len=200)]


# (the model's checkpointing, keep_graphs, when the decoder layers are compiled): the last two compile them, so the
# chunks run them (the default `prefix_reuse.LAYERS`): before sharding, as a tree trainer's init does, and after, as
# accelerate does under FSDP2 (the layers' FSDP hooks inside the compiled call); on the dense model's second case.
SETTINGS = (
    (False, 1, None),
    (True, 1, None),
    (False, 8, None),
    (True, 8, None),
    (True, 1, "before"),
    (True, 1, "after"),
)
# Per case, per rank: (chunks, seed) of its sequences.
CASES = [((2, 10), (3, 11)), ((1, 12), (3, 13))]


def _fork_at_the_first_row() -> list[list[int]]:
    """Two sequences sharing only their first token, 2 chunks of rows (the longer first): chunk 1 starts the shorter
    one's segment from the state (and convolution window) after row 0, which chunk 0 keeps."""
    return [[5] + [3 + i % 13 for i in range(140)], [5] + [3 + (7 * i + 1) % 13 for i in range(60)]]


def _loss(logps: list[torch.Tensor]) -> torch.Tensor:
    return sum((lp * torch.linspace(-1.0, 1.0, lp.shape[0])).sum() for lp in logps)


def _hybrid() -> torch.nn.Module:
    """A tiny Qwen3.5 (linear attention, full attention, twice) in training mode, fp32."""
    model, _ = hybrid_twin_models("qwen3_5")
    return model.train()


def _worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # a deadlock (ranks calling different collectives) fails the test within a minute instead of hanging it
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=datetime.timedelta(seconds=60))
    try:
        runs = [(_model, [_sequences(*spec) for spec in case], [spec[0] for spec in case]) for case in CASES]
        # The hybrid: rank 0 in 2 chunks plus a dummy that reruns its kept first row, rank 1 in 3.
        runs.append((_hybrid, [_fork_at_the_first_row(), _sequences(3, 13)], [2, 3]))
        # What each chunk keeps for later chunks: a dummy must keep nothing (it runs after them all, and a state it
        # kept would replace the one chunk 0 kept, which the backward's recompute of chunk 1 reads).
        kept_by, write = [], prefix_reuse.ChunkContext.write
        prefix_reuse.ChunkContext.write = lambda ctx, key, values, slots, total: (
            kept_by.append((ctx.dummy, len(slots))) or write(ctx, key, values, slots, total)
        )
        for build, sequences, chunks in runs:
            assert [_num_chunks(s) for s in sequences] == chunks
            reference = build()
            expected = {name: torch.zeros_like(p) for name, p in reference.named_parameters()}
            for rank_sequences in sequences:  # the unsharded tree without prefix reuse, averaged over the ranks
                reference.zero_grad()
                _loss(sequence_logprobs(reference, rank_sequences)).backward()
                for name, p in reference.named_parameters():
                    expected[name] += p.grad / WORLD_SIZE
            with torch.no_grad():
                expected_logps = sequence_logprobs(reference, sequences[rank])
            for checkpointing, keep, compiled in SETTINGS:
                if compiled and chunks != [1, 3]:  # on one case: a forest within the budget beside one of 3 chunks
                    continue  # (a hybrid's chunks always run the eager layers)
                model = copy.deepcopy(build())
                if checkpointing:
                    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                if compiled:
                    torch._dynamo.reset()
                    counters.clear()
                if compiled == "before":
                    compile_decoder_layers(model, backend="aot_eager", dynamic=True)
                _shard_like_accelerate(model)
                if compiled == "after":
                    compile_decoder_layers(model, backend="aot_eager", dynamic=True)
                logps = sequence_logprobs(model, sequences[rank], BUDGET, prefix_reuse=True, keep_graphs=keep)
                for got, want in zip(logps, expected_logps, strict=True):
                    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
                _loss(logps).backward()
                for name, p in model.named_parameters():
                    got = p.grad.full_tensor()
                    if build is _model:
                        torch.testing.assert_close(got, expected[name], atol=1e-5, rtol=1e-5, msg=name)
                        continue
                    # The hybrid's gradients reach ~70 (sums over the scan): per tensor, relative to its largest.
                    worst = (got - expected[name]).abs().max().item()
                    bound = TOLERANCES["grad_max_rel"] * expected[name].abs().max().item() + 1e-7
                    assert worst <= bound, f"{name}: {worst} > {bound}"
                if compiled:  # the chunks ran the compiled layers (the default `prefix_reuse.LAYERS`)
                    assert prefix_reuse.LAYERS == "compiled" and counters["stats"]["unique_graphs"] >= 1
        if rank == 0:  # chunk 0 kept states and convolution inputs; its dummy ran, keeping nothing
            assert any(n for dummy, n in kept_by if not dummy) and any(dummy for dummy, _ in kept_by)
        assert not any(n for dummy, n in kept_by if dummy)
    finally:
        dist.destroy_process_group()
    exit_distributed_worker()  # as test_fsdp_cpu: gloo's threads can abort the interpreter's teardown


def test_prefix_reuse_under_fsdp2_equals_unsharded_with_unequal_chunk_counts():
    mp.spawn(_worker, args=(_free_port(),), nprocs=WORLD_SIZE, join=True)
