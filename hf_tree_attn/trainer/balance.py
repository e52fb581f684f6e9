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

The plan is a pure function of the cost table and `exchange_orders` turns it into the send / receive orders of one
`all_to_all`, so the scheme is testable without processes. The second half handles TRL's batch: which entries are
per row and how they are padded (`row_layout`), and the exchange itself (`move_rows`, `move_list`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from accelerate.utils import gather_object

from ..metrics import estimate_flops
from ..tree import TokenSequence

__all__ = ["assign_blocks", "block_costs", "exchange_orders", "move_rows", "row_layout", "step_imbalance"]


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


# ------------------------------------------------------------------ TRL's batch: layout, padding, the exchange

MIN_GAIN = 0.01  # move rows only if the estimated step cost drops by at least this fraction


def concat_micro_batches(micro_batches: list[dict]) -> tuple[dict, int]:
    """One dict of `M * B` rows from `M` micro-batches (per-row tensors and lists concatenated, the rest kept)."""
    batch = {}
    for key, value in micro_batches[0].items():
        if isinstance(value, torch.Tensor) and value.ndim >= 1:
            batch[key] = torch.cat([mb[key] for mb in micro_batches])
        elif isinstance(value, list):
            batch[key] = [item for mb in micro_batches for item in mb[key]]
        else:
            batch[key] = value
    return batch, len(batch["prompt_ids"])


def split_micro_batches(batch: dict, count: int) -> list[dict]:
    """Inverse of `concat_micro_batches`: `count` micro-batches of equal row counts."""
    rows = len(batch["prompt_ids"]) // count
    return [
        {
            key: value[m * rows : (m + 1) * rows]
            if isinstance(value, list) or (isinstance(value, torch.Tensor) and value.ndim >= 1)
            else value
            for key, value in batch.items()
        }
        for m in range(count)
    ]


def row_layout(batch: dict, rows: int) -> dict | None:
    """How each entry of TRL's batch travels with its rows, comparable across ranks (None: an entry whose rows are
    not its first dimension, e.g. images' pixel values — such a batch stays where it is).

    `prompt`: `(rows, width, ...)` left-padded to the prompt width; `completion`: `(rows, width, ...)` right-padded to
    the completion width (log-probs, masks, token-level advantages or importance ratios); `row`: other per-row
    tensors; `list`: per-row Python lists; `global`: 0-d tensors and None (e.g. `num_items_in_batch`).
    """
    completion_width = batch["completion_ids"].shape[1]
    layout = {}
    for key, value in batch.items():
        if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
            layout[key] = ("global",)
        elif isinstance(value, list) and len(value) == rows:
            layout[key] = ("list",)
        elif isinstance(value, torch.Tensor) and value.shape[0] == rows:
            if key in ("prompt_ids", "prompt_mask"):
                side = "prompt"
            elif value.ndim >= 2 and value.shape[1] == completion_width:
                side = "completion"
            else:
                side = "row"
            layout[key] = (side, str(value.dtype), tuple(value.shape[1 if side == "row" else 2 :]))
        else:
            return None
    return layout


def pad_value(key: str, pad_token_id: int) -> float:
    """What TRL pads each padded entry with (token ids: the pad token; `tool_mask`: 1; an importance ratio: 1)."""
    if key.endswith("_ids"):
        return pad_token_id
    return 1 if key in ("tool_mask", "importance_sampling_ratio") else 0


def pad_width(value: torch.Tensor, width: int, side: str, fill: float) -> torch.Tensor:
    """`(rows, w, ...)` → `(rows, width, ...)`: prompts padded on the left, completions on the right."""
    if value.shape[1] == width:
        return value
    pad = value.new_full((value.shape[0], width - value.shape[1], *value.shape[2:]), fill)
    return torch.cat([pad, value] if side == "prompt" else [value, pad], dim=1)


def round_up(n: int, multiple: int | None) -> int:
    return n if not multiple else -(-n // multiple) * multiple


def move_rows(value: torch.Tensor, orders: dict, per_micro: int, group: int) -> torch.Tensor:
    """One `all_to_all`: send this rank's blocks (`orders`, from `exchange_orders`) and return `(rows, ...)` of the
    blocks it receives, in its destination slot order."""
    send = (orders["send"][:, 0] * per_micro + orders["send"][:, 1] * group)[:, None] + np.arange(group)
    send = value[torch.as_tensor(send.reshape(-1), device=value.device)]
    is_bool = value.dtype == torch.bool
    if is_bool:  # not every backend reduces bool: move bytes
        send = send.to(torch.uint8)
    received = send.new_empty((int(orders["recv_counts"].sum()) * group, *value.shape[1:]))
    torch.distributed.all_to_all_single(
        received, send.contiguous(), (orders["recv_counts"] * group).tolist(), (orders["send_counts"] * group).tolist()
    )
    blocks = received.view(-1, group, *value.shape[1:])
    placed = blocks[torch.as_tensor(orders["recv_index"].reshape(-1), device=value.device)].flatten(0, 1)
    return placed.bool() if is_bool else placed


def move_list(values: list, source: np.ndarray, rank: int, per_micro: int, group: int) -> list:
    """A per-row Python list, moved like the tensors (every rank sees every list: lists are small)."""
    everyone = gather_object([values])
    out = []
    for src, micro, block in source[rank].reshape(-1, 3):
        start = micro * per_micro + block * group
        out.extend(everyone[src][start : start + group])
    return out
