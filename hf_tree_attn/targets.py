"""Which forest row predicts which target token: the one plan every scorer of a packed forest reads.

A decoder's output at a row predicts the token that follows it in every sequence passing through that row. A
scored token of a packed sequence is therefore an *entry* of a `TargetPlan`: the row whose output predicts it, the
token id it must be, the sequence it belongs to and its position there. For the tiny example of
`hf_tree_attn.tree` (`[[5, 6, 7, 8], [5, 6, 9]]`, rows `positions(0) = [0, 1, 2, 3]`, `positions(1) = [0, 1, 4]`),
every token after the first scored (`TargetPlan.next_tokens`)::

    entry          0  1  2 | 3  4
    seq_index      0  0  0 | 1  1
    position       1  2  3 | 1  2       the target's index inside its sequence
    rows           0  1  2 | 0  1       the predicting row: positions(k)[position - 1]
    targets        6  7  8 | 6  9
    token_rows     1  2  3 | 1  4       the target's own row: positions(k)[position]

Entries 0 and 3 are one (row, target) pair, scored once (`pairs`); row 1 predicts 7 and 9, two pairs. A per-row
table (`forest_logprobs`, indexed by the scored token's own row) is read per entry with `read`; per-pair values come
back per entry through `pairs`' `pair_of_entry`; per-entry values go back to their sequences with `split`.

The *expanded layout* is the one of `TreeDataCollator`: one value per token of every packed sequence, concatenated
in `forest.seq_ids` order (`(num_original_tokens,)`, the order of `forest.seq_positions`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from .tree import PackedForest

__all__ = ["IGNORE_INDEX", "TargetPlan", "expanded_index"]

IGNORE_INDEX = -100  # a label that scores nothing, as in transformers' and TRL's losses


def expanded_index(forest: PackedForest) -> tuple[torch.Tensor, torch.Tensor]:
    """`(seq_of, token_index)`, each `(num_original_tokens,)` long on the forest's device: for every entry of the
    expanded layout, its packed sequence `k` (an index into `forest.seq_ids`) and its index inside that sequence."""
    offsets = forest.seq_offsets
    lengths = offsets.diff()
    seq_of = torch.repeat_interleave(torch.arange(len(lengths), device=offsets.device), lengths)
    token_index = torch.arange(int(offsets[-1]), device=offsets.device) - offsets[:-1][seq_of]
    return seq_of, token_index


@dataclass(frozen=True, eq=False)
class TargetPlan:
    """The scored tokens of one forest (see the module docstring); entries ordered by sequence, then position.

    Attributes:
        rows: `(T,)` long — the forest row whose final hidden state predicts each target.
        targets: `(T,)` long — the token id each entry scores.
        seq_index: `(T,)` long — the entry's sequence, as an index into the sequences given to `pack_forest` (one of
            `forest.seq_ids`).
        position: `(T,)` long — the target's index inside its sequence (>= 1; the length of the sequence for a
            label past its last token).
        token_rows: `(T,)` long — the forest row of the target token itself, where the target is the sequence's
            own next token (always, for `next_tokens` and `completions`); -1 elsewhere.
        offsets: `(K + 1,)` long — entries `offsets[k]:offsets[k + 1]` belong to the `k`-th packed sequence
            (`forest.seq_ids` order; `K = len(forest.seq_ids)`).
    """

    rows: torch.Tensor
    targets: torch.Tensor
    seq_index: torch.Tensor
    position: torch.Tensor
    token_rows: torch.Tensor
    offsets: torch.Tensor

    @classmethod
    def from_shift_labels(cls, forest: PackedForest, shift_labels: torch.Tensor) -> TargetPlan:
        """Entries where `shift_labels` `(num_original_tokens,)` (expanded layout, transformers' `shift_labels`
        convention) is not `IGNORE_INDEX`: token `p` of a sequence predicts `shift_labels` there, its next token or
        any other id (TRL's fused head scores whatever the label says, also past a sequence's last token)."""
        positions = forest.seq_positions
        shift = torch.as_tensor(shift_labels, device=positions.device).long()
        if shift.shape != positions.shape:
            raise ValueError(
                f"shift_labels has shape {tuple(shift.shape)} but the forest packs {positions.shape[0]} tokens: pass "
                "one label per token in the expanded layout (forest.seq_ids order, each sequence's tokens in order)."
            )
        seq_of, token_index = expanded_index(forest)
        entries = torch.nonzero(shift != IGNORE_INDEX).squeeze(1)
        local, position = seq_of[entries], token_index[entries] + 1
        targets = shift[entries]
        in_sequence = position < forest.seq_offsets.diff()[local]
        following = positions[(entries + 1).clamp(max=max(len(positions) - 1, 0))]  # the next token's row
        is_next = in_sequence & (forest.input_ids[0].to(positions.device)[following] == targets)
        seq_ids = torch.tensor(forest.seq_ids, dtype=torch.long, device=positions.device)
        counts = torch.bincount(local, minlength=len(forest.seq_ids))
        return cls(
            rows=positions[entries],
            targets=targets,
            seq_index=seq_ids[local],
            position=position,
            token_rows=torch.where(is_next, following, -1),
            offsets=torch.cat([counts.new_zeros(1), counts.cumsum(0)]),
        )

    @classmethod
    def from_labels(cls, forest: PackedForest, labels: torch.Tensor) -> TargetPlan:
        """Entries where `labels` `(num_original_tokens,)` (expanded layout, transformers' unshifted `labels`) is
        not `IGNORE_INDEX`: token `t >= 1` of a sequence is scored as `labels` there, predicted from token `t - 1`
        (the label of a sequence's first token is never read, as in a per-sequence forward)."""
        labels = torch.as_tensor(labels, device=forest.seq_positions.device).long()
        shift = torch.full_like(labels, IGNORE_INDEX)
        shift[:-1] = labels[1:]
        shift[forest.seq_offsets[1:].to(labels.device) - 1] = IGNORE_INDEX  # a last token predicts nothing here
        return cls.from_shift_labels(forest, shift)

    @classmethod
    def next_tokens(cls, forest: PackedForest, scored: torch.Tensor | None = None) -> TargetPlan:
        """Every token after the first of each sequence, or those where `scored` `(num_original_tokens,)` bool
        (expanded layout: a loss or completion mask) is True. Without `scored` the plan is built once per forest
        and device and kept with the forest."""
        key = ("targets", forest.seq_positions.device)
        if scored is None and key in forest._mask_cache:
            return forest._mask_cache[key]
        device = forest.seq_positions.device
        tokens = forest.input_ids[0].to(device)[forest.seq_positions]
        if scored is not None:
            tokens = torch.where(torch.as_tensor(scored, device=device).bool(), tokens, IGNORE_INDEX)
        plan = cls.from_labels(forest, tokens)
        if scored is None:
            forest._mask_cache[key] = plan
        return plan

    @classmethod
    def completions(cls, forest: PackedForest, prompt_lengths: torch.Tensor) -> TargetPlan:
        """The tokens after each sequence's prompt: `prompt_lengths` is indexed by sequence id (the indices
        `forest.seq_ids` holds); a prompt of length 0 still leaves the first token unscored."""
        seq_of, token_index = expanded_index(forest)
        device = token_index.device
        seq_ids = torch.tensor(forest.seq_ids, dtype=torch.long, device=device)
        prompt = torch.as_tensor(prompt_lengths, device=device).long()[seq_ids]
        return cls.next_tokens(forest, token_index >= prompt[seq_of])

    def __len__(self) -> int:
        return self.rows.shape[0]

    def to(self, device: torch.device | str) -> TargetPlan:
        """The plan with its tensors on `device`."""
        fields = ("rows", "targets", "seq_index", "position", "token_rows", "offsets")
        return TargetPlan(**{name: getattr(self, name).to(device) for name in fields})

    @cached_property
    def scored_rows(self) -> torch.Tensor:
        """`(R,)` long, sorted — the distinct `token_rows`: the `rows=` of `forest_logprobs` for this plan."""
        self._check_token_rows()
        return torch.unique(self.token_rows)

    @cached_property
    def pairs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(pair_rows (U,), pair_targets (U,), pair_of_entry (T,))`: the distinct (row, target) pairs, sorted by
        row then target, and each entry's pair. A row shared by several sequences is scored once per distinct
        target."""
        keys, pair_of_entry = torch.unique(self.rows << 32 | self.targets, return_inverse=True)
        return keys >> 32, keys & 0xFFFFFFFF, pair_of_entry.reshape(-1)

    def read(self, table: torch.Tensor) -> torch.Tensor:
        """Per-entry values `(T, ...)` of a per-row table `(S, ...)` indexed by the scored token's own row
        (`forest_logprobs`' log-probs and entropies). Differentiable."""
        self._check_token_rows()
        return table[self.token_rows.to(table.device)]

    def split(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Per-entry values `(T, ...)` → one tensor per packed sequence (`forest.seq_ids` order), `(T_k, ...)`."""
        if values.shape[0] != len(self):
            raise ValueError(f"values has {values.shape[0]} entries but the plan has {len(self)}.")
        return list(torch.split(values, self.offsets.diff().tolist()))

    def _check_token_rows(self) -> None:
        if "_token_rows_checked" not in self.__dict__:
            missing = torch.nonzero(self.token_rows < 0).squeeze(1)
            if len(missing):
                raise ValueError(
                    f"Entries {missing[:5].tolist()} score a label that is not their sequence's next token, so no "
                    "forest row holds it: score this plan by its pairs (`plan.pairs`), not a per-row table."
                )
            self.__dict__["_token_rows_checked"] = True
