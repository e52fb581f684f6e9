"""TRL's asynchronous GRPO rows as packed forests: the collator that packs them, and each rank's way back.

TRL's planner (`TokenBudgetBatcher` / `FixedCountBatcher`) hands the collator one micro-batch as `num_processes`
rows of rollout samples (`packing.TreeRow`, one row per data-parallel rank). TRL's `DataCollatorForRollout` packs
each row into its own trie (nodes keyed on a token *and* the next one, segments that gather their root path for
FlashAttention's varlen kernel). `TreeDataCollatorForRollout` packs the same rows with `pack_forest` instead: every
shared token once, a branching row predicting each of its children. Accelerate's dispatcher only broadcasts tensors,
so each rank's forest travels as its arrays, one row per rank, padded to the longest:

    input_ids, position_ids, tree_subtree_end, tree_parent   (P, S)   the forest's rows (`PackedForest`)
    attention_mask                                           (P, S)   1 on a rank's S_r forest rows
    tree_seq_lengths                                         (P, n)   each sample's length (0 = padding)
    tree_seq_positions                                       (P, N)   the row of every token of every sample
    tree_num_tokens                                          (P, 1)   the forest's unpadded rows
    token_index, old_log_probs, advantages, segment_id       (P, M)   TRL's loss terms; `token_index` is the row of
                                                                      the scored token (-1 = padding), the
                                                                      `token_rows` of the forest's `TargetPlan`

plus TRL's per-batch counts (`global_n_tokens`, `global_n_forward_tokens`, `mean_seq_len`, `(P,)`). TRL's loss
terms keep their meaning and order (sample by sample, position by position). `rank_forest` rebuilds a rank's
`PackedForest` from its slice; `step_forest` lays the micro-batches of one optimizer step out as one forest (prefix
reuse) and maps each micro-batch's rows into it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from ..targets import TargetPlan
from ..tree import PackedForest, pack_forest
from . import trl_compat
from .trl_compat import DataCollatorForRollout, pad

__all__ = ["FOREST_KEYS", "StepForest", "TreeDataCollatorForRollout", "rank_forest", "step_forest"]

FOREST_KEYS = ("tree_subtree_end", "tree_parent", "tree_seq_lengths", "tree_seq_positions", "tree_num_tokens")
_PADDING = {"token_index": -1, "tree_seq_positions": -1}


class _Forwarded(NamedTuple):
    """What TRL's packing metrics read of a row (`len(row.tokens)`, `row.load`), for the forest really forwarded:
    its unique tokens, and its attention cost as TRL prices it (each token attends to its depth + 1 ancestors)."""

    tokens: torch.Tensor
    load: int


@dataclass
class TreeDataCollatorForRollout(DataCollatorForRollout):
    """TRL's `DataCollatorForRollout` (same arguments, metrics and per-batch counts) with each rank's row packed by
    `pack_forest` (see the module docstring for the batch it returns)."""

    def torch_call(self, examples: list[Any]) -> dict[str, torch.Tensor]:
        (rows,) = examples  # one micro-batch from TRL's planner: one row of samples per rank
        packed = [_pack_row(row.samples) for row in rows]
        per_rank = [encoded for _, encoded in packed]
        batch = {key: pad([p[key] for p in per_rank], padding_value=_PADDING.get(key, 0)) for key in per_rank[0]}
        batch["input_ids"] = pad([p["input_ids"] for p in per_rank], padding_value=self.pad_token_id)
        batch["attention_mask"] = pad([torch.ones_like(p["input_ids"]) for p in per_rank], padding_value=0)

        all_examples = [example for row in rows for example in row.samples]
        self.groups_trained.update(example["group_id"] for example in all_examples)
        # Repeated per rank, as TRL does, so the dispatcher's slicing hands every rank the batch-wide counts.
        n_trained_tokens = sum(p["token_index"].numel() for p in per_rank)
        n_forward_tokens = sum(forest.num_tree_tokens for forest, _ in packed)
        batch["global_n_tokens"] = torch.full((self.num_processes,), float(n_trained_tokens))
        batch["global_n_forward_tokens"] = torch.full((self.num_processes,), float(n_forward_tokens))
        batch["mean_seq_len"] = torch.full((self.num_processes,), n_forward_tokens / len(all_examples))

        forwarded = [_forwarded(forest) for forest, _ in packed]
        trl_compat.collator_log_metrics(self, forwarded, all_examples, batch["attention_mask"])
        return batch


def _pack_row(samples: list[dict[str, Any]]) -> tuple[PackedForest, dict[str, torch.Tensor]]:
    """One rank's samples as one forest, and its arrays and loss terms (module docstring), each 1-D."""
    forests = pack_forest([sample["input_ids"] for sample in samples])
    if len(forests) != 1:  # no token budget and no RoPE length classes: one forest (the trainer refuses the latter)
        raise RuntimeError(f"pack_forest gave {len(forests)} forests for one row; expected one.")
    (forest,) = forests
    for k, sample in enumerate(samples):
        lengths = {key: len(sample[key]) for key in ("input_ids", "completion_mask", "old_log_probs")}
        if len(set(lengths.values())) != 1:  # TRL's own packing raises an IndexError on a longer one only
            raise ValueError(
                f"Rollout sample {k} of this row (group {sample.get('group_id')}) has per-token fields of different "
                f"lengths {lengths}: completion_mask and old_log_probs need one entry per token of input_ids."
            )
    # TRL scores position p >= 1 of a sample where its completion mask is 1, with the generator's log-prob
    # old_log_probs[p]. One forest packs every sample in order, so the expanded layout is the samples' tokens.
    scored = torch.cat([torch.as_tensor(np.asarray(sample["completion_mask"])).bool() for sample in samples])
    plan = TargetPlan.next_tokens(forest, scored)
    entries = forest.seq_offsets[plan.seq_index] + plan.position
    old_log_probs = np.concatenate([np.asarray(sample["old_log_probs"]) for sample in samples])[entries.numpy()]
    advantages = torch.tensor([float(sample["advantage"]) for sample in samples], dtype=torch.float32)
    encoded = {
        "input_ids": forest.input_ids[0],
        "position_ids": forest.position_ids[0],
        "tree_subtree_end": forest.subtree_end.long(),
        "tree_parent": forest.parent,
        "tree_seq_lengths": forest.seq_offsets.diff(),
        "tree_seq_positions": forest.seq_positions,
        "tree_num_tokens": torch.tensor([forest.num_tree_tokens]),
        "token_index": plan.token_rows,
        "old_log_probs": torch.as_tensor(old_log_probs, dtype=torch.float32),
        "advantages": advantages[plan.seq_index],
        "segment_id": plan.seq_index,
    }
    return forest, encoded


def _forwarded(forest: PackedForest) -> _Forwarded:
    real = forest.num_tree_tokens
    return _Forwarded(forest.input_ids[0, :real], int((forest.position_ids[0, :real] + 1).sum()))


def rank_forest(inputs: dict[str, torch.Tensor], device: torch.device | str) -> PackedForest:
    """This rank's `PackedForest` on `device`, from its slice of a `TreeDataCollatorForRollout` batch (each key
    `(1, ...)`)."""
    host = {key: inputs[key][0].cpu() for key in ("input_ids", "position_ids", "attention_mask", *FOREST_KEYS)}
    size = int(host["attention_mask"].sum())
    lengths = host["tree_seq_lengths"]
    lengths = lengths[lengths > 0]
    total = int(lengths.sum())
    forest = PackedForest(
        input_ids=host["input_ids"][None, :size],
        position_ids=host["position_ids"][None, :size],
        subtree_end=host["tree_subtree_end"][:size].to(torch.int32),
        parent=host["tree_parent"][:size],
        seq_ids=list(range(len(lengths))),
        num_tree_tokens=int(host["tree_num_tokens"][0]),
        num_original_tokens=total,
        seq_positions=host["tree_seq_positions"][:total],
        seq_offsets=torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
    )
    return forest.to(device)


class StepForest(NamedTuple):
    """The micro-batches of one optimizer step (this rank's rows) as one forest, every token their samples share
    once, and where each micro-batch's rows went.

    Attributes:
        forest: `PackedForest` on the CPU, the plain trie (`pack_forest(..., two_level=False)`) of every sample of the
            step, micro-batch by micro-batch, each in its row's order; `N` real rows (`num_tree_tokens`).
        row_maps: one `(S_k,)` long per micro-batch: the step-forest row of each row of the micro-batch's own forest
            (`rank_forest`), -1 at its padding.
        num_samples: the samples of each micro-batch.
    """

    forest: PackedForest
    row_maps: list[torch.Tensor]
    num_samples: list[int]

    def token_index(self, k: int, token_index: torch.Tensor) -> torch.Tensor:
        """`token_index` `(1, M)` of micro-batch `k` (rows of its own forest, -1 = padding) as step-forest rows, same
        shape and device."""
        row_map = self.row_maps[k].to(token_index.device)
        return torch.where(token_index >= 0, row_map[token_index.clamp(min=0)], token_index)


def step_forest(batches: Sequence[dict[str, torch.Tensor]]) -> StepForest:
    """One optimizer step's micro-batches, each this rank's slice of a `TreeDataCollatorForRollout` batch (each key
    `(1, ...)`), as one `StepForest`.

    A row of a micro-batch's forest is a prefix of every sample through it (a plain or two-level trie), so it is one
    row of the step's plain trie: the map is well defined, and a token the step's samples share, in one micro-batch or
    across several, is one row.
    """
    forests = [rank_forest(batch, "cpu") for batch in batches]
    sequences = [f.input_ids[0, f.positions(j)] for f in forests for j in range(len(f.seq_ids))]
    (forest,) = pack_forest(sequences, two_level=False)  # no budget, no length classes: one forest
    if forest.seq_ids != list(range(len(sequences))):
        raise RuntimeError(f"pack_forest reordered the step's {len(sequences)} samples; expected them in order.")
    row_maps, start = [], 0
    for f in forests:
        tokens = int(f.seq_offsets[-1])
        step_rows = forest.seq_positions[forest.seq_offsets[start] : forest.seq_offsets[start] + tokens]
        row_map = torch.full((f.seq_len,), -1, dtype=torch.long)
        row_map[f.seq_positions] = step_rows
        row_maps.append(row_map)
        start += len(f.seq_ids)
    return StepForest(forest, row_maps, [len(f.seq_ids) for f in forests])
