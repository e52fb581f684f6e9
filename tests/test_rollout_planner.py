"""`rollout_planner.PlannerRow` against TRL's own `packing.TreeRow` (the oracle): every number TRL's planner reads of a
row, and the micro-batches TRL's planners build from it, on samples that share, repeat and contain each other."""

import random

import numpy as np
import pytest

from hf_tree_attn.trainer import trl_compat
from hf_tree_attn.trainer.rollout_planner import PlannerRow, with_planner_rows


def _trl():
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    return async_grpo_trainer, packing


def _sample(ids, group, rng):
    ids = np.asarray(ids, dtype=np.int64)
    mask = np.zeros(len(ids), dtype=np.int64)
    mask[rng.randrange(len(ids)) :] = 1
    return {"input_ids": ids, "completion_mask": mask, "group_id": group}


def _samples(seed: int, vocab: int) -> list[dict]:
    """GRPO groups and branching conversations over a small vocabulary (chance prefixes across groups), with identical
    samples, 1-token samples and samples that are prefixes of others."""
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    system = tokens(rng.randrange(1, 30))
    out = []
    for group in range(rng.randrange(2, 7)):
        prompt = (system if rng.random() < 0.5 else []) + tokens(rng.randrange(1, 20))
        history = prompt
        for _ in range(rng.randrange(1, 6)):
            branch = history + tokens(rng.randrange(0, 12))
            out.append(_sample(branch or tokens(1), group, rng))
            kind = rng.random()
            if kind < 0.15:
                out.append(_sample(branch or tokens(1), group, rng))  # identical
            elif kind < 0.3 and len(branch) > 1:
                out.append(_sample(branch[: rng.randrange(1, len(branch))], group, rng))  # a prefix of it
            elif kind < 0.4:
                out.append(_sample(tokens(1), group, rng))  # one token
            history = branch if rng.random() < 0.7 else history
    rng.shuffle(out)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_a_row_prices_and_holds_samples_as_trl_s_row_does(seed):
    """Sample by sample into one row each: `fits` at budgets around the row's size, and after each `add` the row's
    tokens (in TRL's creation order), attention cost, trained tokens, groups and samples, all equal TRL's."""
    _, packing = _trl()
    samples = _samples(seed, vocab=2 + seed % 4)
    theirs, ours = packing.TreeRow(), PlannerRow()
    for sample in samples:
        size = len(theirs.tokens)
        for budget in {1, size, size + len(sample["input_ids"]) // 2, size + len(sample["input_ids"]), 10**6}:
            assert ours.fits(sample, budget) == theirs.fits(sample, budget), (budget, sample["input_ids"])
        theirs.add(sample)
        ours.add(sample)
        assert ours.tokens == theirs.tokens
        assert (ours.load, ours.trained, ours.groups) == (theirs.load, theirs.trained, theirs.groups)
        assert ours.samples == theirs.samples


def test_shared_counts_what_trl_s_trie_shares_at_the_edges():
    """TRL keys a node on its token and the next one: a sample shares one token less than its longest common prefix
    with the row, all of it where the row holds the same sequence."""
    row = PlannerRow()
    row.add({"input_ids": np.array([5, 6, 7, 8]), "completion_mask": np.array([0, 0, 1, 1]), "group_id": 0})
    assert row.shared([5, 6, 7, 8]) == 4  # the same sequence
    assert row.shared([5, 6, 7]) == 2  # a prefix of it
    assert row.shared([5, 6, 7, 8, 9]) == 3  # it extended
    assert row.shared([5, 6, 9]) == 1  # a branch after two tokens
    assert row.shared([5]) == 0 and row.shared([9, 6]) == 0
    row.add({"input_ids": np.array([5, 6]), "completion_mask": np.array([0, 1]), "group_id": 0})
    assert row.shared([5, 6]) == 2  # now held: a sample ends inside the first run


@pytest.mark.parametrize("num_processes", [1, 2, 3])
@pytest.mark.parametrize("planner", ["TokenBudgetBatcher", "FixedCountBatcher"])
def test_trl_s_planners_build_the_same_micro_batches_from_planner_rows(planner, num_processes):
    """TRL's planner, run whole over the same samples, with its rows and with `PlannerRow`s: the same samples in the
    same rows of the same micro-batches, the same row costs; TRL's module holds its own `TreeRow` between them."""
    module, packing = _trl()
    samples = [s for seed in range(6) for s in _samples(100 + seed, vocab=3)]
    for i, sample in enumerate(samples):
        sample["group_id"] = (i // 7, sample["group_id"])  # groups split across micro-batches
    if planner == "TokenBudgetBatcher":
        make = lambda cls: cls(samples, num_processes, token_budget=60, metrics={})  # noqa: E731
    else:
        make = lambda cls: cls(samples, num_processes, microbatch_size=5 * num_processes)  # noqa: E731
    batcher = getattr(module, planner)
    theirs = list(make(batcher))
    ours = []
    for rows in make(with_planner_rows(batcher)):
        assert module.TreeRow is packing.TreeRow  # swapped only while a micro-batch is planned
        ours.append(rows)
    assert len(ours) == len(theirs) > 3
    for a, b in zip(ours, theirs):
        assert all(isinstance(row, PlannerRow) for row in a)
        assert [[id(s) for s in row.samples] for row in a] == [[id(s) for s in row.samples] for row in b]
        assert [(row.load, len(row.tokens)) for row in a] == [(row.load, len(row.tokens)) for row in b]


def test_the_async_trainer_plans_with_planner_rows():
    """The names the tree trainer swaps into TRL's dataloader: TRL's planners, their rows `PlannerRow`s."""
    module, _ = _trl()
    for name in ("TokenBudgetBatcher", "FixedCountBatcher"):
        planned = with_planner_rows(trl_compat.async_module_name(name))
        assert issubclass(planned, getattr(module, name)) and planned.__name__ == name
        assert with_planner_rows(getattr(module, name)) is planned  # one class per planner
