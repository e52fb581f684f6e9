"""DeepSpeed ZeRO-2 and ZeRO-3 on CPU: 2 gloo processes launched with the repository's accelerate configs.

DeepSpeed's CPU accelerator (`DS_ACCELERATOR=cpu`) trains under ZeRO with gloo, so this runs what a GPU run does,
partitioning and gathering included, on float64 models. Per ZeRO stage, one `accelerate launch --config_file
trainers/configs/deepspeed_zero{2,3}.yaml --num_processes 2 --mixed_precision no` of this file (`_worker`):

- tree log-probs, entropies and gradients through `deepspeed.initialize` equal the unsharded ones, with ranks
  packing different sequences (the gradient is the mean of the per-rank ones): TRL's fused head and the torch head,
  untied and tied embeddings. Under ZeRO-3 the LM head weight is a 0-element placeholder outside its module's
  forward;
- `TreeGRPOTrainer` makes `trl.GRPOTrainer`'s run under the same engine — the same completions, logged losses and
  final weights — over 4 optimizer steps with a reference model (beta > 0), two iterations per generation, every
  layer recomputed, and groups moved between ranks (`tree_balance`); with a LoRA adapter (`tree_recompute="auto"`);
  on a tiny MoE with its load-balancing loss (not balanced: it would change that loss); and with rank 1 forced onto
  TRL's flat path for some chunks and planning to recompute more layers than rank 0 (every rank follows,
  `TreeGRPOTrainer._lockstep`; ZeRO-3 hung without either);
- the main job, `trainers/grpo_tree.py` on its embedded model, trains on trees and saves the model whole.

Skipped without deepspeed (a source distribution on PyPI, in the `test` extra). The first run in a fresh
environment JIT-compiles DeepSpeed's CPU shared-memory op (about a minute on 2 cores).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
WORLD_SIZE = 2
# Per rank: sequences sharing prefixes (an identical pair, a 2-token one), different on each rank.
RANK_SEQUENCES = [
    [[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 7, 8, 9, 10], [1, 2, 3, 4, 5], [11, 12]],
    [[4, 4, 5, 6], [4, 4, 5, 7, 7, 3], [9, 8], [4, 11, 12], [4, 4, 13]],
]
# Tolerances. The models run in float64, so tree and flat forwards differ by float64 rounding (~1e-15 relative; the
# log-probs came out bit-identical). Two things are float32, whatever the model's dtype: the log-probability tables and
# the losses (TRL's, and the tree head's, `.float()`), and ZeRO's master copy of the weights and of their gradients.
EPS32 = torch.finfo(torch.float32).eps
# Log-probs and entropies (|x| < 8) come from float64 forwards that agree to ~1e-15, into float32 tables: a value on
# a rounding boundary may land one float32 step apart, 8 * EPS32 at most; a wrong term costs far more.
LOGPS_ATOL = 8 * EPS32
# Gradients through ZeRO's float32 buffers: one float32 rounding of each entry and of the cross-rank mean, relative to
# the largest entry (seen: 8.5e-8 of it).
GRAD_RTOL = 8 * EPS32
# Losses are float32 sums of ~64 per-token terms of magnitude <= 0.1 (as in tests/test_balance.py): 64 * EPS32 * 0.1.
LOSS_TOL = dict(atol=1e-6, rtol=0)
# Final weights: each of the 4 SGD updates rounds the float32 master weights (|w| <~ 0.5: one rounding 3e-8) and moves
# them by learning_rate * the float32 gradients' resolution (5e-2 * GRAD_RTOL * |g| <= 2: 1e-7). 4 * 1.3e-7 ~ 5e-7,
# rounded up; a wrong term in a gradient moves a weight by learning_rate * O(|g|) ~ 1e-3. (Seen: 7.5e-9.)
WEIGHT_TOL = dict(atol=1e-6, rtol=0)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")


# ------------------------------------------------------------------------------------------------------ the worker


def _tiny_model(tied: bool = False):
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=tied, initializer_range=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="tree_flex", dtype=torch.float64).train()


def _forest_loss(model, sequences, chunk_rows):
    """A loss touching every log-prob and entropy with distinct weights; `(loss, logps, entropies)`."""
    import hf_tree_attn
    from hf_tree_attn.logprobs import forest_logprobs

    (forest,) = hf_tree_attn.pack_forest(sequences)
    logps, entropy = forest_logprobs(model, forest, temperature=0.7, return_entropy=True, chunk_rows=chunk_rows)
    weights = torch.linspace(-1.0, 1.0, logps.shape[0], dtype=torch.float64)
    return (logps * weights).sum() + 0.1 * (entropy * weights.flip(0)).sum(), logps, entropy


def _check_logprobs(stage: int, rank: int) -> dict:
    """Tree log-probs and gradients through `deepspeed.initialize` against the unsharded model: the largest errors."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad
    from transformers.integrations import HfDeepSpeedConfig, unset_hf_deepspeed_config

    errors = {}
    for tied in (False, True):
        for chunk_rows in (None, 3):  # TRL's fused head, the torch head (several chunks)
            reference = _tiny_model(tied)
            expected = {name: torch.zeros_like(p) for name, p in reference.named_parameters()}
            for sequences in RANK_SEQUENCES:  # data parallelism: the mean of the per-rank gradients
                reference.zero_grad()
                _forest_loss(reference, sequences, chunk_rows)[0].backward()
                for name, p in reference.named_parameters():
                    expected[name] += p.grad / WORLD_SIZE
            with torch.no_grad():
                _, expected_logps, expected_entropy = _forest_loss(reference, RANK_SEQUENCES[rank], chunk_rows)

            config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}}
            config["zero_allow_untested_optimizer"] = True
            # Under ZeRO-3 transformers builds the model partitioned (`zero.Init`) while a DeepSpeed config is set,
            # as `from_pretrained` does under a trainer's: DeepSpeed cannot partition a whole float64 model itself.
            ds_config = HfDeepSpeedConfig(config) if stage == 3 else None
            model = _tiny_model(tied)
            optimizer = torch.optim.SGD(model.parameters())
            engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
            if ds_config is not None:
                unset_hf_deepspeed_config()  # the next reference model is built whole
                # `zero.Init` draws the initial weights in its own order: the reference's, copied in
                params = dict(engine.module.named_parameters())
                with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0):
                    if torch.distributed.get_rank() == 0:
                        for name, p in reference.named_parameters():
                            params[name].data.copy_(p.data)
            if stage == 3:  # partitioned: nothing readable outside a forward
                assert engine.module.lm_head.weight.numel() == 0
            loss, logps, entropy = _forest_loss(engine, RANK_SEQUENCES[rank], chunk_rows)
            engine.backward(loss)
            grads = {name: safe_get_full_grad(p) for name, p in engine.module.named_parameters()}
            assert all(g is not None for g in grads.values())
            key = f"tied={tied},chunk_rows={chunk_rows}"
            errors[key] = {
                "logps": (logps - expected_logps).abs().max().item(),
                "entropy": (entropy - expected_entropy).abs().max().item(),
                "grads": max((grads[n] - expected[n]).abs().max().item() for n in expected),
                "grad_scale": max(g.abs().max().item() for g in expected.values()),
            }
            engine.destroy()
    return errors


def _balance_dataset():
    """Prompts in dataset order (shuffle_dataset=False): per generation rank 0 samples the 4 long prompts and rank 1
    the 4 short ones, so `tree_balance` moves groups."""
    from datasets import Dataset

    from trainers import toy_task

    lengths = [170, 140, 120, 100, 8, 12, 16, 20] * 2
    letters = "abcdabcddcbadcba"
    prompts = [(toy_task.SYSTEM_PROMPT * 2)[:n] + f" letter: {x}" for n, x in zip(lengths, letters)]
    return Dataset.from_dict({"prompt": prompts, "target": list(letters)})


def _moe_model(tokenizer):
    """A tiny Qwen3-MoE (4 experts, top-2, router aux-loss coefficient 0.01), float64."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        router_aux_loss_coef=0.01, initializer_range=0.2, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float64)


def _train(trainer_cls, model_path: str, out_dir: str, name: str, **overrides) -> dict:
    """One run of `trainer_cls`; its completions, losses, final weights (DeepSpeed's fp32 master copy, gathered)
    and metrics. `overrides`: config fields, and `peft=True` for a LoRA adapter."""
    from deepspeed.utils import safe_get_full_fp32_param
    from helpers import token_reward
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import GRPOConfig

    from hf_tree_attn.trainer import TreeGRPOConfig, TreeGRPOTrainer

    tree = issubclass(trainer_cls, TreeGRPOTrainer)
    peft = overrides.pop("peft", False)
    fields = dict(
        output_dir=os.path.join(out_dir, f"{trainer_cls.__name__}_{name}"), use_cpu=True, bf16=False, seed=0,
        per_device_train_batch_size=8, num_generations=4, gradient_accumulation_steps=2, max_completion_length=4,
        max_steps=4, num_iterations=2, beta=0.04, temperature=0.7, learning_rate=1e-2, optim="sgd",
        lr_scheduler_type="constant", logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        shuffle_dataset=False, gradient_checkpointing=True, model_init_kwargs={"dtype": torch.float64},
        tree_max_token_ratio=1.0,
    )  # fmt: skip
    fields.update(overrides)
    config_cls = TreeGRPOConfig if tree else GRPOConfig
    args = config_cls(**{k: v for k, v in fields.items() if k in config_cls.__dataclass_fields__})
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM") if peft else None
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    trainer = trainer_cls(
        model_path, token_reward, args, train_dataset=_balance_dataset(), processing_class=tokenizer, peft_config=lora
    )
    lm_head_numel = trainer.model.get_output_embeddings().weight.numel()  # 0: partitioned (ZeRO-3 from loading on)
    completions = []
    generate = trainer._generate_and_score_completions

    def recording(batch):
        out = generate(batch)
        completions.append(out["completion_ids"].tolist())
        return out

    trainer._generate_and_score_completions = recording
    trainer.train()
    history = trainer.state.log_history

    def logged(key):
        return [entry[key] for entry in history if key in entry]

    params = {
        name: safe_get_full_fp32_param(p).tolist() for name, p in trainer.model.named_parameters() if p.requires_grad
    }
    return {
        "completions": completions,
        "losses": logged("loss"),
        "aux_loss": logged("aux_loss"),
        "params": params,
        "lm_head_numel": lm_head_numel,
        "tree_fallback": logged("tree_fallback"),
        "imbalance": logged("balance/imbalance_before"),
        "moved": logged("balance/imbalance_after"),
    }


MOE_INIT = {"dtype": torch.float64, "experts_implementation": "eager"}


def _flat_on_rank_1(trainer_cls):
    """`trainer_cls` whose rank 1 takes TRL's flat path on every third chunk (as too little sharing would make it):
    under DeepSpeed every rank must then take it (`TreeGRPOTrainer._lockstep`); ZeRO-3 hung without."""

    class FlatOnRank1(trainer_cls):
        calls = 0

        def _packed_chunk(self, *args, **kwargs):
            FlatOnRank1.calls += 1
            if self.accelerator.process_index == 1 and FlatOnRank1.calls % 3 == 1:
                return None
            return super()._packed_chunk(*args, **kwargs)

    return FlatOnRank1


@contextlib.contextmanager
def _recompute_all_on_rank_1():
    """Within: rank 1 plans to recompute every layer of a tree forward, rank 0 none (as forests of different sizes
    would make `tree_recompute="auto"` plan): every rank must recompute the same layers; ZeRO-3 hung without."""
    from hf_tree_attn.trainer import group_trainer

    plan = group_trainer.recompute_plan

    def diverging(trainer, forests, bound_tokens, **kwargs):
        count, keep = plan(trainer, forests, bound_tokens, **kwargs)
        if count is None:
            return count, keep
        layers = trainer.accelerator.unwrap_model(trainer.model).config.num_hidden_layers
        return (layers if trainer.accelerator.process_index == 1 else 0), False

    group_trainer.recompute_plan = diverging
    try:
        yield
    finally:
        group_trainer.recompute_plan = plan


def _keep_deepspeed_configs_alive() -> None:
    """Keep every `HfDeepSpeedConfig` transformers is pointed at alive for the rest of the process.

    transformers finds the ZeRO-3 config through a weak reference (`set_hf_deepspeed_config`); its owners here are
    TrainingArguments and accelerate plugins of trainers this worker is done with. Once the cyclic garbage collector
    frees one, the next model loads without `zero.Init`, whole and in float64, and DeepSpeed's conversion of it
    refuses float64 ("Invalid data type torch.float64"): a failure that came and went with the collector's timing.
    The configs are the trainers' own; only their lifetime changes."""
    from transformers.integrations import deepspeed as hf_deepspeed

    kept, original = [], hf_deepspeed.set_hf_deepspeed_config

    def set_and_keep(config):
        kept.append(config)
        original(config)

    hf_deepspeed.set_hf_deepspeed_config = set_and_keep


def _worker(out_dir: str) -> None:
    """Runs under `accelerate launch` with a DeepSpeed config: writes `rank{r}.json` into `out_dir`."""
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "tests"))
    import deepspeed
    from helpers import exit_distributed_worker
    from trl import GRPOTrainer

    from hf_tree_attn.trainer import TreeGRPOTrainer
    from trainers import toy_task

    torch.set_num_threads(1)
    _keep_deepspeed_configs_alive()
    stage = int(os.environ["ACCELERATE_DEEPSPEED_ZERO_STAGE"])
    rank = int(os.environ["RANK"])
    report = {"stage": stage, "world": int(os.environ["WORLD_SIZE"]), "logprobs": _check_logprobs(stage, rank)}
    dense, moe = os.path.join(out_dir, "dense"), os.path.join(out_dir, "moe")
    if rank == 0:
        tokenizer = toy_task.build_tokenizer()
        toy_task.build_model(tokenizer, seed=0).to(torch.float64).save_pretrained(dense)
        _moe_model(tokenizer).save_pretrained(moe)
        for path in (dense, moe):
            tokenizer.save_pretrained(path)
    deepspeed.comm.barrier()
    runs = {
        # every layer checkpointed and recomputed (the model's own gradient checkpointing)
        "full": (dense, dict(tree_recompute="all")),
        "lora": (dense, dict(peft=True, learning_rate=5e-2)),  # tree_recompute="auto"
        # The load-balancing loss is a statistic of each micro-batch, which TRL fills with shuffled rows and the tree
        # with whole groups: one micro-batch per step, where both hold the same rows. transformers' grouped_mm
        # experts take no float64: its per-expert loop does.
        "moe": (moe, dict(max_steps=2, beta=0.0, gradient_accumulation_steps=1, model_init_kwargs=MOE_INIT)),
    }
    for name, (path, overrides) in runs.items():
        for trainer_cls in (GRPOTrainer, TreeGRPOTrainer):
            report[f"{name}_{trainer_cls.__name__}"] = _train(trainer_cls, path, out_dir, name, **overrides)
    with _recompute_all_on_rank_1():
        report["lockstep_TreeGRPOTrainer"] = _train(_flat_on_rank_1(TreeGRPOTrainer), dense, out_dir, "lockstep")
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))

    # Last (it ends the process group): the main job on its embedded model, which one process builds whole.
    from trainers import grpo_tree

    main_args = ["--max_steps", "2", "--logging_steps", "1", "--disable_tqdm", "true", "--report_to", "none"]
    grpo_tree.main(*grpo_tree.parse_args([*main_args, "--output_dir", os.path.join(out_dir, "main_job")]))
    exit_distributed_worker()  # never free a trainer (see there)


# ------------------------------------------------------------------------------------------------------- the tests


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(stage: int, out_dir: Path) -> list[dict]:
    """`accelerate launch` of `_worker` with `trainers/configs/deepspeed_zero{stage}.yaml` on 2 CPU processes."""
    config = REPO / "trainers" / "configs" / f"deepspeed_zero{stage}.yaml"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="0")
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes",
        str(WORLD_SIZE), "--mixed_precision", "no", "--main_process_port", str(_free_port()), __file__, str(out_dir),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    errors = [line for line in result.stderr.splitlines() if "Error" in line or "assert" in line]
    assert result.returncode == 0, "\n".join(errors[:20]) + result.stdout[-2000:] + result.stderr[-3000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]


def _assert_same_run(tree: dict, flat: dict, steps: int) -> None:
    assert tree["completions"] == flat["completions"], "the runs sampled other completions: the random streams parted"
    assert len(tree["losses"]) == len(flat["losses"]) == steps
    torch.testing.assert_close(torch.tensor(tree["losses"]), torch.tensor(flat["losses"]), **LOSS_TOL)
    torch.testing.assert_close(torch.tensor(tree["aux_loss"]), torch.tensor(flat["aux_loss"]), **LOSS_TOL)
    assert tree["params"].keys() == flat["params"].keys() and flat["params"]
    for name, want in flat["params"].items():
        torch.testing.assert_close(torch.tensor(tree["params"][name]), torch.tensor(want), **WEIGHT_TOL, msg=name)
    assert tree["lm_head_numel"] == flat["lm_head_numel"]


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_tree_equals_unsharded_and_trl(stage, tmp_path):
    from safetensors.torch import load_file

    reports = _launch(stage, tmp_path)
    initial = load_file(tmp_path / "dense" / "model.safetensors")
    for rank, report in enumerate(reports):
        assert report["stage"] == stage and report["world"] == WORLD_SIZE
        for case, errors in report["logprobs"].items():
            assert errors["logps"] <= LOGPS_ATOL and errors["entropy"] <= LOGPS_ATOL, (rank, case, errors)
            assert errors["grads"] <= GRAD_RTOL * errors["grad_scale"], (rank, case, errors)

        full, lora, moe = (report[f"{run}_TreeGRPOTrainer"] for run in ("full", "lora", "moe"))
        _assert_same_run(full, report["full_GRPOTrainer"], steps=4)
        _assert_same_run(lora, report["lora_GRPOTrainer"], steps=4)
        _assert_same_run(moe, report["moe_GRPOTrainer"], steps=2)
        for run in (full, lora, moe):
            assert run["tree_fallback"] and set(run["tree_fallback"]) == {0.0}  # every chunk on trees
        assert moe["aux_loss"] and all(a > 0 for a in moe["aux_loss"])
        assert moe["imbalance"] == []  # moving groups would change each rank's load-balancing loss: not balanced
        assert len(lora["params"]) == 8 and all("lora_" in name for name in lora["params"])  # only adapters train
        # ZeRO-3 holds the LM head partitioned (a 0-element placeholder) outside its forward, ZeRO-2 whole.
        assert (full["lm_head_numel"] == 0) == (stage == 3)
        # Rank 0 sampled the long prompts: groups moved to rank 1 before each step.
        assert min(full["imbalance"]) > 1.2 and max(full["moved"]) < min(full["imbalance"])

        lockstep = report["lockstep_TreeGRPOTrainer"]  # rank 1 flat on some chunks, recomputing more: all follow
        _assert_same_run(lockstep, report["full_GRPOTrainer"], steps=4)
        assert min(lockstep["tree_fallback"]) > 0 and max(lockstep["tree_fallback"]) < 1

    # The main job (`trainers/grpo_tree.py`, embedded model) under this config: trained on trees, saved whole.
    main_job = tmp_path / "main_job"
    logs = json.loads((main_job / "trainer_state.json").read_text())["log_history"]
    assert [entry["step"] for entry in logs if "loss" in entry] == [1, 2]
    assert all(entry["tree_fallback"] == 0 for entry in logs if "tree_fallback" in entry)
    saved, built = (
        load_file(main_job / "model.safetensors"),
        load_file(main_job / "initial_model" / "model.safetensors"),
    )
    assert saved.keys() == built.keys() and all(saved[k].shape == built[k].shape and built[k].numel() for k in built)

    # The run trained: weights moved by far more than the float32 rounding of the master copy.
    moved = [(torch.tensor(w, dtype=torch.float64) - initial[n]).abs().max() > 1e-5 for n, w in full["params"].items()]
    assert any(moved), "the run did not train"


if __name__ == "__main__":
    _worker(sys.argv[1])
