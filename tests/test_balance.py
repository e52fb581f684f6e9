"""Token-balanced data parallelism: the plan (pure functions, against brute force) and the trainer under 2 gloo
processes, balanced against unbalanced: same loss and gradients for every loss type.

The distributed test runs this file under `torchrun` (like `test_grpo_distributed.py`): rank 0 generates for the
long prompts and rank 1 for the short ones, so balancing has to move groups.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import run_two_ranks

REPO = Path(__file__).resolve().parent.parent
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")


def _random_costs(seed: int, shape: tuple[int, int, int]) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.lognormal(mean=0.0, sigma=0.8, size=shape)


def _placed(costs: np.ndarray, source: np.ndarray) -> np.ndarray:
    return costs[source[..., 0], source[..., 1], source[..., 2]]


# ----------------------------------------------------------------------------------------------------- the plan


def test_step_imbalance_by_hand():
    from hf_tree_attn.trainer.balance import step_imbalance

    # 2 ranks, 2 micro-batches, 1 block: micro 0 costs (3, 1), micro 1 costs (2, 2) → step 3 + 2 = 5, ideal 8 / 2.
    costs = np.array([[[3.0], [2.0]], [[1.0], [2.0]]])
    assert step_imbalance(costs) == pytest.approx(5 / 4)
    assert step_imbalance(np.ones((4, 3, 2))) == 1.0
    assert step_imbalance(np.zeros((2, 1, 1))) == 1.0


@pytest.mark.parametrize("world, micro, blocks, window", [(2, 1, 1, 1), (3, 4, 2, 2), (4, 4, 3, 4), (5, 2, 4, 1)])
def test_assign_blocks_is_a_permutation_within_windows(world, micro, blocks, window):
    from hf_tree_attn.trainer.balance import assign_blocks

    costs = _random_costs(world * 100 + micro, (world, micro, blocks))
    source = assign_blocks(costs, window=window)
    assert source.shape == (world, micro, blocks, 3)
    placed = sorted(map(tuple, source.reshape(-1, 3).tolist()))
    assert placed == sorted(itertools.product(range(world), range(micro), range(blocks)))  # each block exactly once
    assert (source[..., 1] // window == np.arange(micro)[None, :, None] // window).all()  # never leaves its window
    assert np.array_equal(source, assign_blocks(costs, window=window))  # every rank computes the same plan


def _brute_force_best(costs: np.ndarray) -> float:
    """Smallest step imbalance over every placement of the blocks (one window, K blocks per rank per micro-batch)."""
    from hf_tree_attn.trainer.balance import step_imbalance

    world, micro, blocks = costs.shape
    flat = costs.reshape(-1)
    best = np.inf
    for perm in itertools.permutations(range(flat.size)):
        best = min(best, step_imbalance(flat[list(perm)].reshape(world, micro, blocks)))
    return best


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("world, micro", [(2, 3), (3, 2)])
def test_one_block_per_micro_batch_is_optimal(seed, world, micro):
    """With one block per rank per micro-batch the tiers are the best placement there is (checked exhaustively)."""
    from hf_tree_attn.trainer.balance import assign_blocks, step_imbalance

    costs = _random_costs(seed, (world, micro, 1))
    balanced = step_imbalance(_placed(costs, assign_blocks(costs, window=micro)))
    assert balanced == pytest.approx(_brute_force_best(costs), rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_busiest_rank_within_one_tier_spread_of_the_mean(seed):
    """Heaviest block of a tier to the lightest rank keeps max - min load within the widest tier's spread (induction:
    lighter ranks get heavier blocks), in every micro-batch."""
    from hf_tree_attn.trainer.balance import assign_blocks

    world, micro, blocks = 4, 2, 5
    costs = _random_costs(seed, (world, micro, blocks))
    source = assign_blocks(costs, window=micro)
    placed = _placed(costs, source)
    ranked = np.sort(costs.reshape(-1))[::-1].reshape(-1, world)  # the tiers
    spread = (ranked[:, 0] - ranked[:, -1]).max()
    loads = placed.sum(axis=2)  # (W, M)
    assert (loads.max(axis=0) - loads.min(axis=0) <= spread + 1e-12).all()


def test_balanced_beats_the_generation_order_on_skewed_ranks():
    from hf_tree_attn.trainer.balance import assign_blocks, step_imbalance

    costs = np.concatenate([np.full((1, 2, 2), 10.0), np.ones((1, 2, 2))])  # rank 0 drew the long prompts
    balanced = step_imbalance(_placed(costs, assign_blocks(costs, window=2)))
    assert step_imbalance(costs) == pytest.approx(20 / 11)
    assert balanced == pytest.approx(1.0)


def test_assign_blocks_errors():
    from hf_tree_attn.trainer.balance import assign_blocks

    with pytest.raises(ValueError, match="window=3 must divide the 4 micro-batches"):
        assign_blocks(np.ones((2, 4, 1)), window=3)
    with pytest.raises(ValueError, match="non-empty"):
        assign_blocks(np.ones((2, 0, 1)))


@pytest.mark.parametrize("world, micro, blocks", [(2, 2, 2), (3, 4, 1), (5, 2, 3)])
def test_exchange_orders_deliver_the_plan(world, micro, blocks):
    """Simulate the all_to_all of every rank: each destination slot receives the block the plan names."""
    from hf_tree_attn.trainer.balance import assign_blocks, exchange_orders

    source = assign_blocks(_random_costs(micro, (world, micro, blocks)), window=micro)
    orders = [exchange_orders(source, r) for r in range(world)]
    for dest in range(world):
        stream = []  # what dest receives: each source rank's send group to dest, in rank order
        for src in range(world):
            offset = int(orders[src]["send_counts"][:dest].sum())
            group = orders[src]["send"][offset : offset + orders[src]["send_counts"][dest]]
            assert len(group) == orders[dest]["recv_counts"][src]
            stream += [(src, m, k) for m, k in group.tolist()]
        received = [stream[i] for i in orders[dest]["recv_index"].reshape(-1)]
        assert received == [tuple(s) for s in source[dest].reshape(-1, 3).tolist()]


def test_block_costs_are_estimate_flops_per_block():
    from helpers import tiny_config

    from hf_tree_attn import estimate_flops
    from hf_tree_attn.trainer.balance import block_costs

    config = tiny_config("qwen3")
    sequences = [[5, 6, 7, 8], [5, 6, 9], [1, 2, 3, 4, 5, 6], [1, 2, 3]]
    prompt_lengths = [2, 2, 3, 3]
    costs = block_costs(config, sequences, prompt_lengths, block_size=2)
    expected = [estimate_flops(config, sequences[i : i + 2], prompt_lengths[i : i + 2])["tree_flops"] for i in (0, 2)]
    assert costs.tolist() == expected
    with pytest.raises(ValueError, match="blocks of block_size=3"):
        block_costs(config, sequences, prompt_lengths, block_size=3)


# -------------------------------------------------------------------------------------- batch layout helpers


def test_row_layout_pad_and_trim_helpers():
    from hf_tree_attn.trainer.balance import concat_micro_batches, pad_width, row_layout, split_micro_batches

    def micro_batch(offset):
        return {
            "prompt_ids": torch.arange(6).view(2, 3) + offset,
            "prompt_mask": torch.ones(2, 3, dtype=torch.long),
            "completion_ids": torch.ones(2, 4, dtype=torch.long),
            "completion_mask": torch.ones(2, 4, dtype=torch.long),
            "old_per_token_logps": torch.zeros(2, 4),
            "advantages": torch.tensor([1.0, -1.0]),
            "importance_sampling_ratio": torch.ones(2, 1),
            "num_images": [0, 0],
            "num_items_in_batch": torch.tensor(8.0),
        }

    batch, rows = concat_micro_batches([micro_batch(0), micro_batch(10)])
    assert rows == 4 and batch["prompt_ids"][2:].min() == 10 and batch["num_images"] == [0] * 4
    layout = row_layout(batch, rows)
    assert {k: v[0] for k, v in layout.items()} == {
        "prompt_ids": "prompt",
        "prompt_mask": "prompt",
        "completion_ids": "completion",
        "completion_mask": "completion",
        "old_per_token_logps": "completion",
        "advantages": "row",
        "importance_sampling_ratio": "row",
        "num_images": "list",
        "num_items_in_batch": "global",
    }
    assert row_layout({**batch, "pixel_values": torch.zeros(7, 3)}, rows) is None  # images: not per row
    split = split_micro_batches(batch, 2)
    for m in range(2):
        expected = micro_batch(10 * m)
        assert torch.equal(split[m]["prompt_ids"], expected["prompt_ids"]) and split[m]["num_images"] == [0, 0]
        assert split[m]["num_items_in_batch"] is batch["num_items_in_batch"]

    ids = torch.tensor([[7, 8]])
    assert pad_width(ids, 4, "prompt", 0).tolist() == [[0, 0, 7, 8]]  # prompts are left-padded
    assert pad_width(ids, 4, "completion", 1).tolist() == [[7, 8, 1, 1]]


# --------------------------------------------------------------------------------------- config and trainer


def test_tree_balance_true_refuses_losses_that_depend_on_micro_batch_composition(tmp_path):
    from hf_tree_attn.trainer import TreeGRPOConfig

    common = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=8)
    with pytest.raises(ValueError, match="tree_balance=True, but loss_type='bnpo'"):
        TreeGRPOConfig(**common, num_generations=4, loss_type="bnpo", tree_balance=True)
    with pytest.raises(ValueError, match="entropy bonus"):
        TreeGRPOConfig(**common, num_generations=4, entropy_coef=0.01, tree_balance=True)
    with pytest.raises(ValueError, match="per_device_train_batch_size=6 is not a multiple of num_generations=4"):
        TreeGRPOConfig(**{**common, "per_device_train_batch_size": 6}, num_generations=4, generation_batch_size=12,
                       tree_balance=True)  # fmt: skip
    assert TreeGRPOConfig(**common, num_generations=4, loss_type="bnpo").tree_balance is None  # auto: just off


def _run_rank(model_path: str, out_dir: str) -> None:
    """The torchrun worker: for every loss type, one optimizer step unbalanced and one balanced; record both."""
    sys.path.insert(0, str(REPO))
    from datasets import Dataset
    from helpers import exit_distributed_worker
    from transformers import AutoTokenizer, TrainerCallback

    from hf_tree_attn.trainer import TreeGRPOConfig, TreeGRPOTrainer
    from trainers import toy_task

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    # In dataset order (shuffle_dataset=False): rank 0 generates for the 4 long prompts, rank 1 for the 4 short ones.
    letters = "abcdabcd"
    lengths = [170, 140, 120, 100, 8, 12, 16, 20]
    prompts = [(toy_task.SYSTEM_PROMPT * 2)[:n] + f" letter: {x}" for n, x in zip(lengths, letters)]
    dataset = Dataset.from_dict({"prompt": prompts, "target": list(letters)})

    class Grads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    rank = int(os.environ["RANK"])
    report, trainers = {}, []
    for loss_type in LOSS_TYPES:
        for balance in (False, None):
            args = TreeGRPOConfig(
                output_dir=os.path.join(out_dir, f"{loss_type}_{balance}"),
                use_cpu=True,
                report_to="none",
                save_strategy="no",
                disable_tqdm=True,
                max_steps=1,
                logging_steps=1,
                learning_rate=1e-3,
                max_grad_norm=0.0,  # compare raw gradients
                per_device_train_batch_size=8,  # 2 groups of 4 per micro-batch
                gradient_accumulation_steps=2,  # 2 micro-batches per step, regrouped by the balancer
                num_generations=4,
                max_completion_length=6,
                temperature=0.7,
                shuffle_dataset=False,
                beta=0.04,  # reference log-probs travel with their rows
                num_iterations=2,  # so do old-policy log-probs
                loss_type=loss_type,
                importance_sampling_level="sequence" if loss_type == "luspo" else "token",
                tree_max_token_ratio=1.0,  # the same path (tree) however rows are grouped
                tree_balance=balance,
                seed=7,
                # float64: this random tiny model's backward sums terms ~1e4 times larger than the gradients, so in
                # float32 any regrouping of rows moves them by ~1e-3 relative (TRL's flat path alike); in float64 the
                # comparison sees the arithmetic, not the conditioning.
                model_init_kwargs={"dtype": torch.float64},
            )
            grads = Grads()
            trainer = TreeGRPOTrainer(
                model_path, toy_task.copy_letter_reward, args, train_dataset=dataset, processing_class=tokenizer,
                callbacks=[grads],
            )  # fmt: skip
            trainer.train()
            trainers.append(trainer)  # never freed: see exit_distributed_worker
            (loss,) = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
            metrics = [entry for entry in trainer.state.log_history if "balance/imbalance_before" in entry]
            report[f"{loss_type}_{balance}"] = {
                "loss": loss,
                "grads": grads.grads.tolist(),
                "imbalance": [metrics[0]["balance/imbalance_before"], metrics[0]["balance/imbalance_after"]]
                if metrics
                else None,
            }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    exit_distributed_worker()  # never free a trainer (see there)


def test_balanced_trainer_matches_unbalanced_for_every_loss_type(tmp_path):
    """2 gloo processes, TreeGRPOTrainer with and without tree balancing on the same generations: one optimizer step
    (2 micro-batches x 2 groups per rank, old and reference log-probs in the batch) — same loss, same gradients."""
    sys.path.insert(0, str(REPO))
    from trainers import toy_task

    tokenizer = toy_task.build_tokenizer()
    model_path = tmp_path / "model"
    toy_task.build_model(tokenizer, seed=0).save_pretrained(model_path)
    tokenizer.save_pretrained(model_path)
    run_two_ranks(__file__, model_path, tmp_path, timeout=900)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for loss_type in LOSS_TYPES:
        plain, balanced = (reports[0][f"{loss_type}_{b}"] for b in (False, None))
        assert plain["imbalance"] is None
        if loss_type == "bnpo":  # normalizes per micro-batch: auto leaves it unbalanced
            assert balanced["imbalance"] is None
        else:
            before, after = balanced["imbalance"]
            assert before > 1.2 and after < before  # groups did move
        for rank_report in reports:
            plain, balanced = (rank_report[f"{loss_type}_{b}"] for b in (False, None))
            # The log-probability tables and losses are float32 (as TRL's): 1e-6 is their resolution.
            torch.testing.assert_close(balanced["loss"], plain["loss"], atol=1e-6, rtol=1e-6, msg=loss_type)
            torch.testing.assert_close(
                torch.tensor(balanced["grads"]), torch.tensor(plain["grads"]), atol=1e-6, rtol=1e-6, msg=loss_type
            )
            assert any(g != 0 for g in plain["grads"])


if __name__ == "__main__":
    _run_rank(*sys.argv[1:3])
