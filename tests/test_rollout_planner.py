"""`rollout_planner.PlannerRow` against TRL's own `packing.TreeRow` (the oracle): every number TRL's planner reads of a
row, and the micro-batches TRL's planners build from it, on samples that share, repeat and contain each other."""

import random
from collections import defaultdict

import numpy as np
import pytest
import torch

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


def test_pack_is_trl_s_packing_of_the_row():
    """`PlannerRow.pack()`: what TRL's collator reads of a row, TRL's own packing of the same samples."""
    _, packing = _trl()
    samples = _samples(7, vocab=3)
    for sample in samples:
        sample["old_log_probs"] = np.linspace(-1, 0, len(sample["input_ids"]), dtype=np.float32)
        sample["advantage"] = 0.5
    theirs, ours = packing.TreeRow(), PlannerRow()
    for sample in samples:
        theirs.add(sample)
        ours.add(sample)
    want, got = theirs.pack(), ours.pack()
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_with_long_samples_a_sample_over_the_budget_gets_a_row_of_its_own():
    """`long_samples=True`: where TRL's planner drops a sample longer than the budget, it is kept alone in a row;
    without such samples the micro-batches are TRL's."""
    module, _ = _trl()
    from accelerate import PartialState

    PartialState()  # TRL's planner warns through accelerate's logger when it drops a sample
    batcher = module.TokenBudgetBatcher
    samples = [s for seed in range(4) for s in _samples(200 + seed, vocab=3)]
    budget = 60

    def plan(cls, stream):
        return [[[id(s) for s in row.samples] for row in rows] for rows in cls(stream, 2, budget, defaultdict(list))]

    assert plan(with_planner_rows(batcher, long_samples=True), samples) == plan(batcher, samples)
    rng = random.Random(0)
    long = [_sample([rng.randrange(3) for _ in range(n)], 99, rng) for n in (61, 150)]
    stream = samples[:9] + [long[0]] + samples[9:20] + [long[1]] + samples[20:]
    kept = plan(with_planner_rows(batcher, long_samples=True), stream)
    placed = [row for batch in kept for row in batch]
    count = sum(map(len, placed))  # the last micro-batch stays open: TRL's planner yields one when the next won't fit
    assert count > 21  # past the second long sample
    assert sorted(i for row in placed for i in row) == sorted(id(s) for s in stream[:count])  # nothing dropped
    for sample in long:
        assert [id(sample)] in placed  # alone in its row
    dropped = [i for batch in plan(batcher, stream) for row in batch for i in row]
    assert not {id(s) for s in long} & set(dropped) and len(dropped) > 20
