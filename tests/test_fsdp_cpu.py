"""FSDP2 on CPU: tree log-probs and gradients of a `fully_shard`-ed model equal the unsharded ones.

Accelerate never enables FSDP on CPU, so this shards by hand the way `accelerate`'s FSDP2 path does (each decoder
layer, then the root) over 2 gloo processes. Each rank packs *different* sequences, so the sharded gradient must be
the mean over ranks of the unsharded per-rank gradients (what data parallelism means); an LM head gradient that
skipped the cross-rank reduction would fail here. The dense-mask path is used (CPU has no FlexAttention backward).
"""

import copy
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import exit_distributed_worker
from transformers import AutoModelForCausalLM, Qwen3Config

import hf_tree_attn

WORLD_SIZE = 2
# Per rank: sequences sharing prefixes (and one identical pair), plus per-token loss weights.
RANK_SEQUENCES = [
    [[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 7, 8, 9, 10], [1, 2, 3, 4, 5]],
    [[4, 4, 5, 6], [4, 4, 5, 7, 7, 3], [9, 8], [4, 11, 12]],
]


def _model(seed: int = 0) -> torch.nn.Module:
    config = Qwen3Config(
        vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="tree_flex", dtype=torch.float32).train()


def _loss(model, sequences):
    """A loss touching every log-prob and entropy with distinct weights; returns (loss, logps, entropies)."""
    (forest,) = hf_tree_attn.pack_forest(sequences)
    logps, entropy = hf_tree_attn.forest_logprobs(model, forest, temperature=0.7, return_entropy=True)
    weights = torch.linspace(-1.0, 1.0, logps.shape[0])
    return (logps * weights).sum() + 0.1 * (entropy * weights.flip(0)).sum(), logps, entropy


def _shard_like_accelerate(model: torch.nn.Module) -> None:
    """`accelerate`'s FSDP2 wrapping: each decoder layer, the embedding, the `[norm, lm_head]` tail, then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, reshard_after_forward=True)
    fully_shard(model.model.embed_tokens, reshard_after_forward=True)
    fully_shard([model.model.norm, model.lm_head], reshard_after_forward=False)
    fully_shard(model, reshard_after_forward=True)


def _worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        from torch.distributed.tensor import DTensor

        reference = _model()
        expected_grads = {name: torch.zeros_like(p) for name, p in reference.named_parameters()}
        for sequences in RANK_SEQUENCES:  # data parallelism: the mean of the per-rank gradients
            reference.zero_grad()
            loss, _, _ = _loss(reference, sequences)
            loss.backward()
            for name, p in reference.named_parameters():
                expected_grads[name] += p.grad / WORLD_SIZE
        with torch.no_grad():
            _, expected_logps, expected_entropy = _loss(reference, RANK_SEQUENCES[rank])

        for gradient_checkpointing in (False, True):
            model = copy.deepcopy(_model())
            if gradient_checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            _shard_like_accelerate(model)
            assert all(isinstance(p, DTensor) for p in model.parameters())

            loss, logps, entropy = _loss(model, RANK_SEQUENCES[rank])
            torch.testing.assert_close(logps, expected_logps, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(entropy, expected_entropy, atol=1e-5, rtol=1e-5)
            loss.backward()
            for name, p in model.named_parameters():
                assert p.grad is not None, name
                grad = p.grad.full_tensor()
                torch.testing.assert_close(grad, expected_grads[name], atol=1e-5, rtol=1e-5, msg=name)
    finally:
        dist.destroy_process_group()
    # Passed: leave without the interpreter's teardown, where gloo's threads can abort the process ("terminate
    # called without an active exception", SIGABRT after every check passed). A failed check raised above.
    exit_distributed_worker()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp2_tree_logprobs_and_grads_equal_unsharded():
    """Both with and without gradient checkpointing (one spawn: starting the processes dominates the cost)."""
    mp.spawn(_worker, args=(_free_port(),), nprocs=WORLD_SIZE, join=True)
