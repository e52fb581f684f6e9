"""`TreeDataCollator`: HF-style features → packed micro-batches that go straight into `model(**mb)`.

Each feature is one sequence (`input_ids`) plus any per-token fields (`completion_mask`, `labels`, advantages,
…). The collator strips padding, packs the sequences with `pack_forest` (no second packing implementation) and
returns one `TreeMicroBatch` per forest. A micro-batch is a `dict` holding *only* model inputs, so `model(**mb)`
works; everything needed to map results back to the original rows hangs off it as attributes.

Per-token values live in the **expanded layout**: one entry per token of every packed sequence, concatenated in
`mb.seq_ids` order — exactly the order of `mb.forest.seq_positions`, so entry `e` is the token at trie row
`mb.positions[e]` of sequence `mb.seq_index[e]`. Two sequences that share a trie row can carry different values at
that token (their advantages, their loss masks), which is why such values are never stored per row. For the tiny
example of `hf_tree_attn.tree` (`[[5, 6, 7, 8], [5, 6, 9]]`, no padding)::

    expanded entry e   0  1  2  3 | 4  5  6
    seq_index          0  0  0  0 | 1  1  1
    token_index        0  1  2  3 | 0  1  2
    positions (row)    0  1  2  3 | 0  1  4      rows 0 and 1 appear twice: shared prefix, computed once

Per-row model outputs come back per token with `mb.gather(table)` (`table[..., positions]`) and per original row
with `mb.unpack(values)` / `TreeDataCollator.unpack(micro_batches, values)`.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .logprobs import forest_forward_kwargs
from .targets import TargetPlan, expanded_index
from .tree import PackedForest, check_token_budget, pack_forest

__all__ = ["TreeDataCollator", "TreeMicroBatch"]


class TreeMicroBatch(dict):
    """Model inputs of one packed forest, plus the map back to the original rows.

    Keys (all `model(**mb)` inputs): `input_ids` `(1, S)` long, `position_ids` `(1, S)` long (depth),
    `attention_mask` (the forest's `(1, S)` mask; the model's mask functions turn it into per-layer tree masks, see
    `PackedForest.attention_mask`), `tree_forest` (the
    `PackedForest`, read by the attention layers) and `use_cache=False`. `labels` is never a key: the model's own
    shifted loss would read the DFS row as one sequence. Use `mb.fields["labels"]` with `mb.forest.parent` instead.

    Attributes:
        forest: the `PackedForest`.
        seq_ids: indices into the collated features of the sequences packed here, increasing.
        fields: name → `(N,)` tensor in the expanded layout (`N = forest.num_original_tokens`).
        seq_fields: name → list (one value per sequence, `seq_ids` order) of per-sequence values that are not
            numbers (strings, nested lists, …).

    The mask is built where the collator runs: a `BlockMask` is not a tensor, so `Trainer` / `accelerate` cannot move
    it. Move a micro-batch with `mb.to(device)`, which keeps the attributes and rebuilds the mask there.
    """

    def __init__(
        self,
        data: Mapping[str, Any] | None = None,
        *,
        forest: PackedForest | None = None,
        fields: dict[str, torch.Tensor] | None = None,
        seq_fields: dict[str, list] | None = None,
    ):
        super().__init__(data or {})
        self.forest = forest
        self.seq_ids = list(forest.seq_ids) if forest is not None else []
        self.fields = fields or {}
        self.seq_fields = seq_fields or {}

    @classmethod
    def from_forest(
        cls,
        forest: PackedForest,
        device: torch.device | str | None = None,
        fields: dict[str, torch.Tensor] | None = None,
        seq_fields: dict[str, list] | None = None,
    ) -> TreeMicroBatch:
        """The micro-batch of `forest` with its tensors and mask on `device` (default: the forest's device)."""
        device = torch.device(device) if device is not None else forest.input_ids.device
        forest = forest.to(device)
        inputs = forest_forward_kwargs(forest, device)
        fields = {name: value.to(device) for name, value in (fields or {}).items()}
        return cls(inputs, forest=forest, fields=fields, seq_fields=seq_fields)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TreeMicroBatch:
        """Copy on `device` (attributes and extra keys kept, mask rebuilt there). Accelerate's device placement
        (`transformers.Trainer`'s dataloader) calls this, so a micro-batch built on the CPU gets its `BlockMask`
        on CUDA."""
        moved = type(self).from_forest(self.forest, device, self.fields, self.seq_fields)
        for key, value in self.items():
            if key not in moved:
                moved[key] = value.to(device, non_blocking=non_blocking) if isinstance(value, torch.Tensor) else value
        return moved

    @property
    def positions(self) -> torch.Tensor:
        """`(N,)` long — trie row of every expanded entry."""
        return self.forest.seq_positions

    @property
    def lengths(self) -> list[int]:
        """Token count of each packed sequence, `seq_ids` order."""
        return self.forest.seq_offsets.diff().tolist()

    @property
    def seq_index(self) -> torch.Tensor:
        """`(N,)` long — original row (index into the collated features) of every expanded entry."""
        ids = torch.tensor(self.seq_ids, dtype=torch.long, device=self.positions.device)
        return ids.repeat_interleave(self.forest.seq_offsets.diff().to(ids.device))

    @property
    def token_index(self) -> torch.Tensor:
        """`(N,)` long — index of every expanded entry inside its own sequence (= its `position_ids` depth)."""
        return expanded_index(self.forest)[1]

    def gather(self, table: torch.Tensor) -> torch.Tensor:
        """Per-row values `(..., S)` → per-token values `(..., N)` in the expanded layout (differentiable)."""
        return table[..., self.positions.to(table.device)]

    def unpack(self, values: torch.Tensor | str) -> list[torch.Tensor]:
        """Expanded-layout values `(N, ...)` (or a field name) → one tensor per packed sequence, `seq_ids` order."""
        if isinstance(values, str):
            values = self.fields[values]
        if values.shape[0] != len(self.positions):
            raise ValueError(
                f"values has {values.shape[0]} entries but this micro-batch has {len(self.positions)} tokens; pass "
                "values in the expanded layout (e.g. `mb.gather(per_row_table)`)."
            )
        return list(torch.split(values, self.lengths))


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (numbers.Number, np.generic)) or (isinstance(value, torch.Tensor) and value.ndim == 0)


def _length(value: Any) -> int | None:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return value.shape[0] if value.ndim >= 1 else None
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return len(value)
    return None


def _is_number_vector(value: Any) -> bool:
    """A 1-D run of numbers (list, tuple, tensor or array) — what a per-token field looks like."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return value.ndim == 1 and value.dtype != object
    if isinstance(value, (list, tuple)):
        return len(value) > 0 and all(_is_scalar(v) for v in value)
    return False


def _token_ids(value: Any, where: str) -> torch.Tensor:
    """`input_ids` of one feature as a 1-D long tensor; non-integer ids are refused, never rounded."""
    ids = torch.as_tensor(value)
    if ids.numel() == 0:
        raise ValueError(f"{where} is empty; every sequence needs at least one token. Drop the feature first.")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(
            f"{where} has dtype {ids.dtype}; token ids must be integers (a cast is not exact: bf16 stores 151643 as "
            "151552). Keep them as int lists or torch.long tensors from the tokenizer."
        )
    if ids.ndim != 1:
        raise ValueError(f"{where} has shape {tuple(ids.shape)}; it must be 1-D.")
    return ids.long()


class TreeDataCollator:
    """Collate features into packed prefix-tree micro-batches (a list of `TreeMicroBatch`).

    Args:
        max_tokens_per_mb: most padded tokens in one micro-batch (a multiple of `pad_multiple`); `None` packs all
            features into one micro-batch.
        pad_multiple: each packed row is padded to a multiple of this (FlexAttention's block size, 128).
        device: where the tensors and the attention mask are built (`BlockMask` on CUDA, dense bool mask
            elsewhere); default CPU.
        split_lengths: length classes a forest must not mix (`pack_forest(split_lengths=...)`; longrope models).
        per_sequence_fields: names of fields kept per sequence as they are (`mb.seq_fields`) even when they are
            vectors of numbers, e.g. a per-sequence reward vector.
        for_trainer: return one `TreeMicroBatch` per call, with the model's own loss inputs added (see below), for
            `transformers.Trainer(data_collator=TreeDataCollator(for_trainer=True))`.
        two_level: `pack_forest(two_level=...)`: None (default) lays a trie that branches inside its completions
            out as its common prefix plus one branch per sequence where that pays (the shared-prefix kernels);
            True always; False never.

    A feature is a mapping with `input_ids` (list / 1-D integer tensor) and optionally:

    - `attention_mask` — tokens where it is 0 are padding and are dropped (with every per-token field);
    - per-token fields — any other key whose value has as many entries as `input_ids` (`labels`,
      `completion_mask`, per-token advantages, …): kept per token in the expanded layout (`mb.fields`);
    - per-sequence numbers (an advantage as a float, a reward): broadcast to every token of their sequence, so
      all numeric fields share the expanded layout;
    - anything else that is not a vector of numbers (strings, nested lists) and every field named in
      `per_sequence_fields`: kept per sequence in `mb.seq_fields`. A vector of numbers of another length than
      `input_ids` is refused: it is almost always a per-token field with a token missing.

    Every feature must carry the same keys. Micro-batches come in `pack_forest` order (largest first); each
    sequence lands in exactly one of them.

    With `for_trainer=True` every call must fit one micro-batch, and the micro-batch also holds the inputs of the
    model's own causal-LM loss in transformers' `shift_labels` convention (as its padding-free collators use it):
    `logits_to_keep` `(E,)` long — the trie row that predicts each trained token (a branching row once per child),
    so the model computes logits only there — and `labels` = `shift_labels` `(1, E)` long, the token each of those
    rows must predict. A trained token is token `t >= 1` of a sequence whose `labels[t]` (default: its own id) is
    not -100, exactly as in a per-sequence forward with those `labels`. `model(**mb).loss` is then the mean
    cross-entropy over the trained tokens, and `Trainer` counts `num_items_in_batch` from `shift_labels`.
    """

    def __init__(
        self,
        max_tokens_per_mb: int | None = None,
        pad_multiple: int = 128,
        device: torch.device | str | None = None,
        split_lengths: Sequence[int] = (),
        per_sequence_fields: Sequence[str] = (),
        for_trainer: bool = False,
        two_level: bool | None = None,
    ):
        check_token_budget(max_tokens_per_mb, pad_multiple)
        self.max_tokens_per_mb = max_tokens_per_mb
        self.pad_multiple = pad_multiple
        self.split_lengths = tuple(split_lengths)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.per_sequence_fields = frozenset(per_sequence_fields)
        self.for_trainer = for_trainer
        self.two_level = two_level

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> list[TreeMicroBatch] | TreeMicroBatch:
        if isinstance(features, Mapping):
            raise TypeError(
                f"features is a mapping of columns (keys {sorted(features)}), e.g. a batched slice like dataset[:8]; "
                "pass a list of rows instead: [dataset[i] for i in range(8)]."
            )
        if len(features) == 0:
            raise ValueError("features is empty; pass at least one feature with `input_ids`.")
        for i, feature in enumerate(features):
            if not isinstance(feature, Mapping):
                raise TypeError(
                    f"features[{i}] is a {type(feature).__name__}; each feature must be a mapping such as "
                    "{'input_ids': [...]}."
                )
        keys = list(features[0].keys())
        for i, feature in enumerate(features):
            if "input_ids" not in feature:
                raise KeyError(f"features[{i}] has no 'input_ids' (keys: {sorted(feature)}).")
            if set(feature) != set(keys):
                raise ValueError(
                    f"features[{i}] has keys {sorted(feature)}, features[0] has {sorted(keys)}; every feature needs "
                    "the same fields."
                )

        sequences, per_token, per_sequence = [], {}, {}
        for i, feature in enumerate(features):
            ids = _token_ids(feature["input_ids"], f"features[{i}]['input_ids']")
            full_len = ids.shape[0]
            keep = None
            if "attention_mask" in feature:
                keep = torch.as_tensor(feature["attention_mask"]).bool()
                if keep.shape != ids.shape:
                    raise ValueError(
                        f"features[{i}]['attention_mask'] has shape {tuple(keep.shape)}, input_ids "
                        f"{tuple(ids.shape)}; they must match."
                    )
                ids = ids[keep]
                if len(ids) == 0:
                    raise ValueError(f"features[{i}] is all padding (attention_mask is all 0); drop it first.")
            sequences.append(ids)
            for name in keys:
                if name in ("input_ids", "attention_mask"):
                    continue
                value = feature[name]
                if name in self.per_sequence_fields:
                    per_sequence.setdefault(name, []).append(value)
                elif _length(value) == full_len:
                    tensor = torch.as_tensor(value)
                    per_token.setdefault(name, []).append(tensor[keep] if keep is not None else tensor)
                elif _is_scalar(value):
                    per_token.setdefault(name, []).append(torch.as_tensor(value).expand(len(ids)))
                elif _is_number_vector(value):
                    raise ValueError(
                        f"features[{i}][{name!r}] has {_length(value)} numbers but input_ids has {full_len} tokens: "
                        "a per-token field needs one entry per token (padding included), a per-sequence value is "
                        f"one number. If it really is a per-sequence vector, pass per_sequence_fields=[{name!r}]."
                    )
                else:
                    per_sequence.setdefault(name, []).append(value)

        for name, values in per_token.items():
            if len(values) != len(sequences):
                raise ValueError(
                    f"Field {name!r} is per-token or numeric in some features and not in others; make it one or "
                    "the other in every feature."
                )
        forests = pack_forest(
            sequences,
            max_tokens_per_mb=self.max_tokens_per_mb,
            pad_multiple=self.pad_multiple,
            split_lengths=self.split_lengths,
            two_level=self.two_level,
        )
        if self.for_trainer and len(forests) > 1:
            raise ValueError(
                f"These {len(features)} features need {len(forests)} micro-batches of max_tokens_per_mb="
                f"{self.max_tokens_per_mb}, but for_trainer=True returns one model input per call. Lower "
                "per_device_train_batch_size, raise max_tokens_per_mb (None = no limit), or loop over the "
                "micro-batches of TreeDataCollator() yourself (README: 'The collator in your own loop')."
            )
        micro_batches = []
        for forest in forests:
            fields = {name: torch.cat([values[i] for i in forest.seq_ids]) for name, values in per_token.items()}
            seq_fields = {name: [values[i] for i in forest.seq_ids] for name, values in per_sequence.items()}
            mb = TreeMicroBatch.from_forest(forest, self.device, fields, seq_fields)
            if self.for_trainer:
                mb.update(_causal_lm_loss_inputs(mb))
                return mb
            micro_batches.append(mb)
        return micro_batches

    @staticmethod
    def unpack(micro_batches: Sequence[TreeMicroBatch], values: Sequence[torch.Tensor] | str) -> list[torch.Tensor]:
        """Expanded-layout values of every micro-batch (or a field name) → one tensor per original feature row.

        Args:
            micro_batches: what `__call__` returned, in its order.
            values: one `(N_mb, ...)` tensor per micro-batch (e.g. `mb.gather(table)`), or the name of a field.

        Returns:
            `out[i]` holds the values of feature `i`'s tokens (padding dropped), in token order.
        """
        if isinstance(values, str):
            values = [mb.fields[values] for mb in micro_batches]
        if len(values) != len(micro_batches):
            raise ValueError(f"Got {len(values)} value tensors for {len(micro_batches)} micro-batches.")
        out: dict[int, torch.Tensor] = {}
        for mb, mb_values in zip(micro_batches, values):
            out.update(zip(mb.seq_ids, mb.unpack(mb_values)))
        return [out[i] for i in range(len(out))]


def _causal_lm_loss_inputs(mb: TreeMicroBatch) -> dict[str, torch.Tensor]:
    """`logits_to_keep` `(E,)`, `labels` and `shift_labels` `(1, E)`: the model's own loss on the trained tokens,
    the rows and targets of the forest's `TargetPlan` (the feature's `labels`, else every token after the first)."""
    if "labels" in mb.fields:
        plan = TargetPlan.from_labels(mb.forest, mb.fields["labels"])
    else:
        plan = TargetPlan.next_tokens(mb.forest)
    labels = plan.targets[None]
    return {"logits_to_keep": plan.rows, "labels": labels, "shift_labels": labels.clone()}
