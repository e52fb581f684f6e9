"""Token-balanced data parallelism: which rank trains which group, decided by what each group costs.

After generation, rank `r` holds the rows of the prompts it generated, split into micro-batches of `B` rows. A
*block* is `G` consecutive rows of one micro-batch (`G = num_generations`: one prompt's group, one prefix tree).
With trees, a block's cost is its tree tokens, attention pairs and scored rows — it varies far more than its row
count (a 500-token prompt group against a 6,000-token one). Under FSDP every rank waits for the slowest at every
layer of every micro-batch, so a step costs

    step = sum over micro-batches m of  max over ranks r of  C[r, m]      (C[r, m] = cost of rank r's micro-batch m)

against the ideal `sum_r sum_m C[r, m] / W`; their ratio is the *imbalance* (1.0 = perfect).

`assign_blocks` moves whole blocks (a tree is never split across ranks) between ranks and between the micro-batches
of one optimizer step (a *window*), never across windows, so every optimizer step trains on exactly the rows it
trained on before. Every rank keeps the same number of blocks per micro-batch (TRL's per-micro-batch row means stay
the same means), so only the place where each row is computed changes.

The plan ("tiers"): sort the window's `W * M * K` blocks by cost, cut them into tiers of `W` neighbours, give each
micro-batch `K` tiers (snake order, so heavy tiers spread over micro-batches), and hand each tier's blocks to the
ranks one each, heaviest block to the rank whose micro-batch is lightest so far (longest-processing-time first with
one block per rank per tier). A tier holds blocks of similar cost, so every micro-batch is balanced across ranks,
whatever order the micro-batches later run in.

Everything here is a pure function of cost tables; `exchange_orders` turns a plan into the send / receive orders of
one `all_to_all`, so the whole scheme is testable without processes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..metrics import estimate_flops
from ..tree import TokenSequence

__all__ = ["assign_blocks", "block_costs", "exchange_orders", "step_imbalance"]


def block_costs(
    config, sequences: Sequence[TokenSequence], prompt_lengths: Sequence[int], block_size: int
) -> np.ndarray:
    """Forward FLOPs of each block of `block_size` consecutive sequences as one prefix forest (`estimate_flops`).

    Args:
        config: the model's text config (see `estimate_flops`).
        sequences: token ids of every row (prompt + completion, padding stripped), `len % block_size == 0`.
        prompt_lengths: unscored leading tokens of each row (TRL's prompt).

    Returns:
        `(len(sequences) // block_size,)` float64 — tree tokens x per-token work + attention pairs + scored rows.
    """
    if block_size < 1 or len(sequences) % block_size:
        raise ValueError(
            f"{len(sequences)} sequences cannot be cut into blocks of block_size={block_size}; pass a multiple."
        )
    return np.array(
        [
            estimate_flops(config, sequences[i : i + block_size], prompt_lengths[i : i + block_size])["tree_flops"]
            for i in range(0, len(sequences), block_size)
        ],
        dtype=np.float64,
    )


def step_imbalance(costs: np.ndarray) -> float:
    """Step cost over the ideal for a `(W, M, K)` table (rank, micro-batch, block): 1.0 = perfectly balanced.

    `sum_m max_r C[r, m] / (sum C / W)` with `C[r, m] = sum_k costs[r, m, k]` — each micro-batch waits for its
    busiest rank (FSDP synchronises every layer). 1.0 for an all-zero table.
    """
    per_micro = costs.sum(axis=2)  # (W, M)
    ideal = per_micro.sum() / costs.shape[0]
    return float(per_micro.max(axis=0).sum() / ideal) if ideal > 0 else 1.0


def _snake(num_tiers: int, micro_batches: int) -> list[int]:
    """Micro-batch of each tier: 0, 1, .., M-1, M-1, .., 0, 0, 1, .. so heavy tiers spread over micro-batches."""
    out = []
    for t in range(num_tiers):
        round_, pos = divmod(t, micro_batches)
        out.append(pos if round_ % 2 == 0 else micro_batches - 1 - pos)
    return out


def assign_blocks(costs: np.ndarray, window: int = 1) -> np.ndarray:
    """Balanced placement of blocks: for every destination slot, the block that goes there.

    Args:
        costs: `(W, M, K)` — cost of block `k` of micro-batch `m` on rank `r`, as generated.
        window: micro-batches per optimizer step (`M % window == 0`); blocks move only within their window.

    Returns:
        `source` `(W, M, K, 3)` int64: destination slot `(r, m, k)` receives block `source[r, m, k] = (r', m', k')`
        (`m'` in the same window as `m`). Every block is placed exactly once; every rank keeps `K` blocks in each
        micro-batch.
    """
    costs = np.asarray(costs, dtype=np.float64)
    if costs.ndim != 3 or 0 in costs.shape:
        raise ValueError(f"costs has shape {costs.shape}; pass a non-empty (ranks, micro_batches, blocks) table.")
    world, micro, blocks = costs.shape
    if window < 1 or micro % window:
        raise ValueError(f"window={window} must divide the {micro} micro-batches; use 1 or a divisor of {micro}.")
    source = np.zeros((world, micro, blocks, 3), dtype=np.int64)
    for start in range(0, micro, window):
        # Blocks of this window as (rank, micro-batch, block), heaviest first; ties keep generation order.
        index = np.stack(
            np.meshgrid(np.arange(world), np.arange(start, start + window), np.arange(blocks), indexing="ij"), -1
        ).reshape(-1, 3)
        order = index[np.argsort(-costs[index[:, 0], index[:, 1], index[:, 2]], kind="stable")]
        tiers = order.reshape(window * blocks, world, 3)
        load = np.zeros((window, world))
        filled = np.zeros(window, dtype=np.int64)
        for tier, target in zip(tiers, _snake(len(tiers), window)):
            ranks = np.argsort(load[target], kind="stable")  # lightest rank first gets the heaviest block
            slot = filled[target]
            for (r, m, k), dest in zip(tier, ranks):
                source[dest, start + target, slot] = (r, m, k)
                load[target, dest] += costs[r, m, k]
            filled[target] += 1
    return source


def exchange_orders(source: np.ndarray, rank: int) -> dict:
    """What rank `rank` sends and receives to realise `source` (from `assign_blocks`) with one `all_to_all`.

    Returns a dict:
        `send`: `(S, 2)` int64 — `(micro_batch, block)` of this rank's blocks in send order: grouped by destination
            rank (0, 1, ...), each group in the destination's slot order;
        `send_counts`: `(W,)` — blocks sent to each rank; `recv_counts`: `(W,)` — blocks received from each rank;
        `recv_index`: `(M, K)` int64 — for each of this rank's destination slots, its position in the received
            stream (sources concatenated in rank order, each in this rank's slot order).
    """
    world, micro, blocks, _ = source.shape
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} is outside the plan's {world} ranks.")
    send, send_counts = [], np.zeros(world, dtype=np.int64)
    for dest in range(world):
        mine = source[dest].reshape(-1, 3)
        mine = mine[mine[:, 0] == rank, 1:]
        send.append(mine)
        send_counts[dest] = len(mine)
    src_rank = source[rank, :, :, 0].reshape(-1)  # (M * K,) source rank of each destination slot, slot order
    recv_counts = np.bincount(src_rank, minlength=world).astype(np.int64)
    # Stable sort by source rank = the received stream's order; invert it to find each slot's position.
    stream_order = np.argsort(src_rank, kind="stable")
    recv_index = np.empty(micro * blocks, dtype=np.int64)
    recv_index[stream_order] = np.arange(micro * blocks)
    return {
        "send": np.concatenate(send).reshape(-1, 2),
        "send_counts": send_counts,
        "recv_counts": recv_counts,
        "recv_index": recv_index.reshape(micro, blocks),
    }
