"""The rows TRL's asynchronous GRPO planner fills, priced on a radix trie: TRL's placements, without its token loop.

TRL's planner (`TokenBudgetBatcher`, `FixedCountBatcher`) drops each rollout sample into a row (`packing.TreeRow`)
and prices it there: `fits` walks the sample through the row's prefix trie to count the tokens it would add, `add`
walks it again to insert it. TRL's trie holds one Python dict entry per token, keyed on the token and the next one,
so each walk costs a dict lookup per token of the sample: on τ²-like agent conversations (10k-token samples, ~100 per
step) that is ~0.2 s of every optimizer step on one CPU core (`benchmarks/bench_planner.py`), spent in the training
loop's `get_batch_samples` before the step's first forward, while the GPU waits.

`PlannerRow` answers the planner's questions the same way from a radix trie over the samples' token arrays (an
edge is a run of tokens compared in one numpy call), so a walk costs a step per branch point, not per token. TRL's
key (token, next token) only changes where a walk stops: TRL's trie shares the first `L - 1` tokens of a sample whose
longest common prefix with the row's samples is `L` tokens (it forks one token before they diverge), and all of
them when the row already holds the same sequence. Every number the planner reads (`fits`, `len(tokens)`, `load`,
`trained`, `groups`, `samples`) is TRL's; `tests/test_rollout_planner.py` checks them against `packing.TreeRow` and
the planner's micro-batches against TRL's. The tree trainer's collator packs the row's samples with `pack_forest`
(`rollout_forest`); `PlannerRow.pack` gives TRL's own packing of them, so TRL's collator takes these rows too.

Samples longer than the budget. TRL's planner drops a sample longer than `token_budget` (a row is one forward, and
the budget bounds its memory). With `tree_prefix_reuse=True` a row is no longer one forward: the step's rows run as
one forest in chunks of `token_budget` rows, a long sample along its length. So there the planner keeps such a
sample, alone in a row of its own (`with_planner_rows(..., long_samples=True)`): an empty row takes any sample, and
a row is otherwise priced against the budget as TRL prices it, which for samples within the budget places every one
as TRL does.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import numpy as np

from . import trl_compat

__all__ = ["PlannerRow", "with_planner_rows"]


class _Edge:
    """A node of the radix trie and the run of tokens that leads to it from its parent: `tokens` (a view into one
    sample's `input_ids`), `children` by their first token, `ends` where a sample ends on the run's last token."""

    __slots__ = ("tokens", "children", "ends")

    def __init__(self, tokens: np.ndarray, children: dict[int, _Edge] | None = None, ends: bool = False):
        self.tokens, self.children, self.ends = tokens, children if children is not None else {}, ends


def _matched(tokens: np.ndarray, ids: np.ndarray, pos: int) -> int:
    """How many of `tokens` equal `ids[pos:]` from their start."""
    m = min(len(tokens), len(ids) - pos)
    differ = np.flatnonzero(tokens[:m] != ids[pos : pos + m])
    return int(differ[0]) if differ.size else m


class PlannerRow:
    """One rank's row of a micro-batch, as TRL's planner fills it: the interface of TRL's `packing.TreeRow` that the
    planner, the collator's metrics and TRL's collator read (`fits`, `add`, `samples`, `groups`, `tokens`, `trained`,
    `load`, `pack`).

    `tokens` holds the tokens TRL's trie would hold, in the order it creates them; `load` is TRL's attention cost
    (each trie node priced at its depth + 1); `trained` the row's trained tokens (`completion_mask`)."""

    def __init__(self):
        self.samples: list[dict[str, Any]] = []
        self.groups: set[Any] = set()
        self.tokens: list[int] = []
        self.trained = 0
        self.load = 0
        self._root = _Edge(np.empty(0, dtype=np.int64))

    def shared(self, input_ids) -> int:
        """The tokens of `input_ids` TRL's trie would share with this row's samples: `L - 1` for a longest common
        prefix of `L` tokens, all of them where the row holds the same sequence."""
        ids = np.asarray(input_ids)
        node, pos, n = self._root, 0, len(ids)
        while pos < n:
            child = node.children.get(int(ids[pos]))
            if child is None:
                break
            k = _matched(child.tokens, ids, pos)
            pos += k
            if k < len(child.tokens):
                break
            node = child
        else:
            if node.ends:
                return n
        return max(pos - 1, 0)

    def fits(self, sample: dict[str, Any], budget: int) -> bool:
        """Whether the row stays within `budget` unique tokens and `budget` trained tokens with `sample` added."""
        novel = len(sample["input_ids"]) - self.shared(sample["input_ids"])
        return len(self.tokens) + novel <= budget and self.trained + int(sample["completion_mask"].sum()) <= budget

    def add(self, sample: dict[str, Any]) -> None:
        """Place `sample` in the row."""
        ids = np.asarray(sample["input_ids"])
        n, shared = len(ids), self.shared(ids)
        self.tokens.extend(ids[shared:].tolist())
        self.load += (n * (n + 1) - shared * (shared + 1)) // 2  # new trie nodes at depths shared .. n - 1
        self._insert(ids)
        self.samples.append(sample)
        self.groups.add(sample["group_id"])
        self.trained += int(sample["completion_mask"].sum())

    def pack(self) -> dict:
        """TRL's packing of the row's samples (`packing.TreeRow.pack`: its trie in DFS order, its loss terms), for
        TRL's own collator."""
        row = trl_compat.TreeRow()
        for sample in self.samples:
            row.add(sample)
        return row.pack()

    def _insert(self, ids: np.ndarray) -> None:
        node, pos, n = self._root, 0, len(ids)
        while pos < n:
            child = node.children.get(int(ids[pos]))
            if child is None:
                node.children[int(ids[pos])] = _Edge(ids[pos:], ends=True)
                return
            k = _matched(child.tokens, ids, pos)
            if k < len(child.tokens):  # the sample leaves (or ends inside) the run: split it at k
                tail = _Edge(child.tokens[k:], child.children, child.ends)
                child.tokens, child.children, child.ends = child.tokens[:k], {int(tail.tokens[0]): tail}, False
            pos += k
            node = child
        node.ends = True


class _LongSampleRow(PlannerRow):
    """A `PlannerRow` that takes any sample while empty (so a sample longer than the budget gets a row of its own)
    and otherwise fits samples within `budget`, the planner's own (the planner itself is handed no bound)."""

    budget: int = 0

    def fits(self, sample: dict[str, Any], budget: int) -> bool:
        return not self.samples or super().fits(sample, self.budget)


@functools.cache
def with_planner_rows(batcher: type, long_samples: bool = False) -> type:
    """TRL's planner class `batcher` (`TokenBudgetBatcher` or `FixedCountBatcher`), run whole, its rows
    `PlannerRow`s: the name `TreeRow` its `__iter__` looks up is swapped while each micro-batch is planned.

    `long_samples` (a `TokenBudgetBatcher`): a sample longer than its `token_budget` is kept, alone in a row, where
    TRL's planner drops it (for `tree_prefix_reuse=True`, whose rows run in chunks of the budget)."""

    class Planned(batcher):
        if long_samples:

            def __init__(self, dataset, num_processes: int, token_budget: int, metrics: dict):
                super().__init__(dataset, num_processes, sys.maxsize, metrics)  # TRL drops nothing
                # A class, not a partial: TRL's `_place` evaluates `TreeRow | None` in a nested annotation
                self.row = type("PlannerRow", (_LongSampleRow,), {"budget": token_budget})

        def __iter__(self):
            row = self.row if long_samples else PlannerRow
            return trl_compat.iterated_with_async_module_names(super().__iter__(), TreeRow=row)

    Planned.__name__ = Planned.__qualname__ = batcher.__name__
    return Planned
