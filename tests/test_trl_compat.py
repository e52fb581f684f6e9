"""The seam to TRL (`hf_tree_attn.trainer.trl_compat`): every TRL internal it names is pinned here against the
installed TRL, so a TRL that renames, moves or re-signs one fails here, naming it; the trainers reach TRL's
internals through the seam only; and `hf_tree_attn.trainer` refuses a TRL outside the tested range."""

from __future__ import annotations

import ast
import collections
import configparser
import dataclasses
import dis
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import trl
from helpers import tiny_model
from trl import DPOTrainer, GRPOTrainer, RewardTrainer, RLOOTrainer, SFTTrainer
from trl.trainer import utils as trl_utils

from hf_tree_attn import logprobs
from hf_tree_attn.trainer import TreeDPOTrainer, TreeGRPOTrainer, TreeRLOOTrainer, trl_compat

REPO = Path(__file__).resolve().parent.parent
TRAINER_DIR = REPO / "hf_tree_attn" / "trainer"
TESTED = "1.16.0"  # the TRL release every entry below was read from


def _params(func) -> list[str]:
    return list(inspect.signature(func, follow_wrapped=False).parameters)


def _unwrapped_params(func) -> list[str]:
    """Parameters of the def under TRL's decorators (`profiling_decorator` keeps `__wrapped__`)."""
    return list(inspect.signature(inspect.unwrap(func)).parameters)


def _code_names(func) -> set[str]:
    """Global and attribute names the def under `func`'s decorators looks up, nested comprehensions included."""
    names, codes = set(), [inspect.unwrap(func).__code__]
    while codes:
        code = codes.pop()
        codes += [c for c in code.co_consts if inspect.iscode(c)]
        names |= set(code.co_names)
    return names


def _stored_attributes(cls) -> set[str]:
    """The attribute names the methods `cls` defines itself assign (`obj.<name> = ...`, `+=` included)."""
    names, codes = set(), []
    for value in vars(cls).values():
        code = getattr(inspect.unwrap(getattr(value, "__func__", value)), "__code__", None)
        if code is not None:
            codes.append(code)
    while codes:
        code = codes.pop()
        codes += [c for c in code.co_consts if inspect.iscode(c)]
        names |= {ins.argval for ins in dis.get_instructions(code) if ins.opname == "STORE_ATTR"}
    return names


def _async():
    pytest.importorskip("trl.experimental.async_grpo")
    import trl.experimental.async_grpo.async_grpo_trainer as module

    return module


# ------------------------------------------------------------------ the version gate


def test_installed_trl_is_the_tested_one():
    trl_compat.check_trl_version()
    assert trl.__version__ == TESTED, (
        f"trl {trl.__version__} is installed; tests/test_trl_compat.py was read against trl {TESTED}. Re-check every "
        "entry of hf_tree_attn/trainer/trl_compat.py against it, then update TESTED and the versions named there."
    )


@pytest.mark.parametrize("version", ["1.17.0", "1.15.2", "1.17.0.dev0", "2.0.0", "1.16.0.dev0"])
def test_another_trl_is_refused_naming_version_range_and_fix(version, monkeypatch):
    monkeypatch.setattr(trl, "__version__", version)
    with pytest.raises(ImportError) as refused:
        trl_compat.check_trl_version()
    message = str(refused.value)
    assert f"trl {version} is installed" in message
    assert "tested with trl>=1.16,<1.17" in message
    assert 'pip install "trl>=1.16,<1.17"' in message


@pytest.mark.parametrize("version", ["1.16.0", "1.16.3", "1.16.1.dev0", "1.16.2rc1"])
def test_the_tested_range_is_accepted(version, monkeypatch):
    monkeypatch.setattr(trl, "__version__", version)
    trl_compat.check_trl_version()


def test_setup_cfg_pins_the_tested_range():
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    train = [line.strip() for line in config["options.extras_require"]["train"].splitlines()]
    assert f"trl{trl_compat.TRL_REQUIREMENT}" in train, train


def test_import_of_the_trainers_refuses_another_trl_and_hf_tree_attn_still_imports():
    """At `import hf_tree_attn.trainer`, before any trainer module reads a TRL internal; `import hf_tree_attn`
    (which needs no trl) is unaffected."""
    code = (
        "import trl\n"
        "trl.__version__ = '1.17.0'\n"
        "import hf_tree_attn\n"
        "print('core', hf_tree_attn.__file__, flush=True)\n"
        "import hf_tree_attn.trainer\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert result.stdout.startswith(f"core {REPO / 'hf_tree_attn'}"), result.stdout + result.stderr[-2000:]
    assert "ImportError: hf_tree_attn.trainer is tested with trl>=1.16,<1.17, but trl 1.17.0" in result.stderr
    assert 'pip install "trl>=1.16,<1.17"' in result.stderr


# ------------------------------------------------------------------ trl.GRPOTrainer, SFTTrainer, DPOTrainer

# TRL's private hooks the tree trainers override: (TRL class, tree class, hook, TRL's parameters in 1.16.0).
HOOKS = [
    (GRPOTrainer, TreeGRPOTrainer, "_get_per_token_logps_and_entropies", [
        "self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy",
        "compute_aux_loss", "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
        "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
    ]),
    (GRPOTrainer, TreeGRPOTrainer, "_prepare_inputs", ["self", "generation_batch"]),
    (GRPOTrainer, TreeGRPOTrainer, "_calculate_rewards", [
        "self", "inputs", "prompts", "completions", "completion_ids_list"
    ]),
    (GRPOTrainer, TreeGRPOTrainer, "_generate_single_turn", [
        "self", "prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"
    ]),
    (DPOTrainer, TreeDPOTrainer, "_precompute_ref_logps", ["self", "dataset", "name", "batch_size"]),
]  # fmt: skip
# The seam's way to TRL's implementation of each hook (`<function>(super(), ...)`).
CALLERS = {
    "_get_per_token_logps_and_entropies": trl_compat.get_per_token_logps_and_entropies,
    "_prepare_inputs": trl_compat.prepare_inputs,
    "_calculate_rewards": trl_compat.calculate_rewards,
    "_generate_single_turn": trl_compat.generate_single_turn,
    "_precompute_ref_logps": trl_compat.precompute_ref_logps,
    "_log_step_metrics": trl_compat.log_step_metrics,
}


@pytest.mark.parametrize("trl_class, tree_class, hook, params", HOOKS, ids=[h[2] for h in HOOKS])
def test_overridden_hooks_keep_trl_signatures(trl_class, tree_class, hook, params):
    assert hook in vars(trl_class), f"trl.{trl_class.__name__} has no {hook} (the tree trainer overrides it)"
    assert _unwrapped_params(getattr(trl_class, hook)) == params, f"trl.{trl_class.__name__}.{hook} was re-signed"
    assert hook in vars(tree_class), f"{tree_class.__name__} no longer overrides {hook}"
    assert _unwrapped_params(getattr(tree_class, hook)) == params, f"{tree_class.__name__}.{hook} differs from TRL's"
    caller = CALLERS[hook]
    assert hook in caller.__code__.co_names
    fixed = _params(caller)
    if "args" not in fixed:  # a caller spelling TRL's parameters: the same, `parent` for `self`
        assert fixed == ["parent", *params[1:]], caller.__name__


# RLOO's hooks, run by the group trainers' code as GRPO's are: the same parameters but for generation's.
RLOO_HOOKS = [(RLOOTrainer, TreeRLOOTrainer, hook, params) for _, _, hook, params in HOOKS[:3]] + [
    (RLOOTrainer, TreeRLOOTrainer, "_generate_single_turn", ["self", "prompt_ids", "images", "multimodal_fields"]),
]


@pytest.mark.parametrize("trl_class, tree_class, hook, params", RLOO_HOOKS, ids=[h[2] for h in RLOO_HOOKS])
def test_rloo_hooks_keep_trl_signatures(trl_class, tree_class, hook, params):
    assert hook in vars(trl_class), f"trl.RLOOTrainer has no {hook} (the tree trainer overrides it)"
    assert _unwrapped_params(getattr(trl_class, hook)) == params, f"trl.RLOOTrainer.{hook} was re-signed"
    assert hook in vars(tree_class), f"TreeRLOOTrainer no longer overrides {hook}"
    assert _unwrapped_params(getattr(tree_class, hook)) == params, f"TreeRLOOTrainer.{hook} differs from TRL's"
    caller = trl_compat.rloo_generate_single_turn if hook == "_generate_single_turn" else CALLERS[hook]
    assert hook in caller.__code__.co_names
    fixed = _params(caller)
    if "args" not in fixed:
        assert fixed == ["parent", *params[1:]], caller.__name__


def test_rloo_hooks_the_group_trainers_share_are_grpos():
    """The group trainers' `_prepare_inputs` mirrors TRL's for both (RLOO's is GRPO's, word for word), and RLOO
    tokenizes, generates-and-scores and returns one generation's completion ids as the seam says."""
    assert inspect.getsource(RLOOTrainer._prepare_inputs) == inspect.getsource(GRPOTrainer._prepare_inputs)
    assert _unwrapped_params(RLOOTrainer._generate_and_score_completions) == ["self", "inputs"]
    assert _unwrapped_params(RLOOTrainer._tokenize_prompts) == ["self", "prompts"]
    assert "return prompt_ids, images, multimodal_fields" in inspect.getsource(RLOOTrainer._tokenize_prompts)
    generate = inspect.getsource(RLOOTrainer._generate)
    assert "completion_ids = self._generate_single_turn(prompt_ids, images, multimodal_fields)" in generate
    assert "return completion_ids\n" in inspect.getsource(RLOOTrainer._generate_single_turn)
    assert trl_compat.trainer_name(RLOOTrainer) == "RLOO"


def test_trl_hooks_the_seam_calls_exist_with_their_parameters():
    assert _unwrapped_params(GRPOTrainer._generate_and_score_completions) == ["self", "inputs"]
    assert _unwrapped_params(GRPOTrainer._tokenize_prompts) == ["self", "prompts"]
    assert "_generate_and_score_completions" in trl_compat.generate_and_score_completions.__code__.co_names
    assert "_tokenize_prompts" in trl_compat.tokenize_prompts.__code__.co_names
    tokenize = inspect.getsource(GRPOTrainer._tokenize_prompts)
    assert "return prompt_ids, images, multimodal_fields" in tokenize  # the triple the trainer unpacks


@pytest.mark.parametrize(
    "trl_class, attributes",
    [
        (GRPOTrainer, {"_metrics", "_step", "_buffered_inputs", "_is_vlm", "_tokenizer"}),
        (SFTTrainer, {"_metrics", "_is_vision_dataset"}),
        (DPOTrainer, {"_metrics", "_is_vision_dataset"}),
        (RewardTrainer, {"_metrics"}),
        (RLOOTrainer, {"_metrics", "_step", "_buffered_inputs", "_is_vlm", "_tokenizer"}),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_private_attributes_the_seam_reads_are_set_by_trl(trl_class, attributes):
    missing = attributes - _stored_attributes(trl_class)
    assert not missing, f"trl.{trl_class.__name__} no longer sets {sorted(missing)}"
    source = inspect.getsource(trl_class.__init__)
    assert 'self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}' in source


def test_accessors_read_and_write_the_trl_attributes():
    trainer = type("Trainer", (), {})()
    trainer._metrics = {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}
    trainer._step, trainer._buffered_inputs, trainer._is_vlm, trainer._tokenizer = 3, None, False, "tokenizer"
    trl_compat.metrics(trainer)["train"]["x"].append(1.0)
    assert trainer._metrics["train"]["x"] == [1.0]
    assert (trl_compat.generation_step(trainer), trl_compat.buffered_inputs(trainer)) == (3, None)
    trl_compat.set_buffered_inputs(trainer, [{"a": 1}])
    assert trainer._buffered_inputs == [{"a": 1}]
    assert (trl_compat.is_vlm(trainer), trl_compat.tokenizer(trainer)) == (False, "tokenizer")
    assert trl_compat.is_vision_dataset(trainer) is False
    trainer._is_vision_dataset = True
    assert trl_compat.is_vision_dataset(trainer) is True


def test_reward_trainer_scores_the_whole_batch_in_one_model_call():
    """`TreeRewardTrainer` overrides only the public `compute_loss` and, inside TRL's, swaps the classifier's forward:
    TRL's must score every row with one `model(**inputs)` call (its batch, `margin` included, which the tree's
    forward ignores as the model's layers do) and split the logits into chosen and rejected halves."""
    assert _unwrapped_params(RewardTrainer.compute_loss) == [
        "self", "model", "inputs", "return_outputs", "num_items_in_batch"
    ]  # fmt: skip
    source = inspect.getsource(RewardTrainer.compute_loss)
    assert source.count("model(") == 1 and "outputs = model(**inputs)" in source
    assert "torch.chunk(outputs.logits.squeeze(-1), chunks=2)" in source


def test_trainer_names_are_trls():
    assert [trl_compat.trainer_name(c) for c in (SFTTrainer, DPOTrainer, GRPOTrainer)] == ["SFT", "DPO", "GRPO"]


def test_prepare_inputs_still_does_what_the_tree_override_mirrors():
    """TreeGRPOTrainer._prepare_inputs re-implements TRL's (groups kept whole): the same buffer, step counter,
    helpers and shuffle."""
    names = _code_names(GRPOTrainer._prepare_inputs)
    expected = {
        "_step", "_buffered_inputs", "_generate_and_score_completions", "split_pixel_values_by_grid",
        "shuffle_sequence_dict", "split_tensor_dict", "unsplit_pixel_values_by_grid", "steps_per_generation",
        "num_iterations",
    }  # fmt: skip
    assert expected <= names, sorted(expected - names)
    for helper in ("split_pixel_values_by_grid", "split_tensor_dict", "unsplit_pixel_values_by_grid"):
        assert getattr(trl_compat, helper) is getattr(trl_utils, helper)
    assert _params(trl_utils.split_tensor_dict) == ["tensor_dict", "num_chunks"]
    assert trl_compat.pad is trl_utils.pad  # the rollout collator's
    assert _params(trl_utils.pad)[:2] == ["tensors", "padding_value"]


def test_shuffle_permutation_is_the_draw_of_trls_shuffle():
    batch = {"none": None, "ids": torch.arange(12).view(6, 2), "names": list("abcdef"), "scalar": torch.tensor(1.0)}
    torch.manual_seed(5)
    shuffled = trl_utils.shuffle_sequence_dict(batch)
    after_trl = torch.rand(1)
    torch.manual_seed(5)
    permutation = trl_compat.shuffle_permutation(batch)
    assert torch.equal(shuffled["ids"], batch["ids"][permutation])
    assert shuffled["names"] == [batch["names"][i] for i in permutation]
    assert torch.equal(torch.rand(1), after_trl)  # the random stream advanced alike


def test_profiling_decorator_is_trls():
    from trl.extras import profiling

    assert trl_compat.profiling_decorator is profiling.profiling_decorator
    assert _params(profiling.profiling_decorator) == ["func"]


# ------------------------------------------------------------------ the fused LM head


def test_fused_head_closure_holds_the_settings():
    model = tiny_model("qwen3")
    trl_utils.add_fused_lm_head(model, temperature=0.7, cast_lm_head_to_fp32=True, outputs=("log_probs", "entropy"))
    func = model.forward.__func__
    assert trl_compat.is_trl_fused_forward(func)
    cells = trl_compat.fused_forward_closure(func)
    assert set(trl_compat.FUSED_HEAD_SETTINGS) <= set(cells), sorted(set(trl_compat.FUSED_HEAD_SETTINGS) - set(cells))
    assert (cells["temperature"], cells["cast_lm_head_to_fp32"]) == (0.7, True)
    assert cells["outputs"] == ("log_probs", "entropy")
    assert (cells["final_logit_softcapping"], cells["logit_scale"]) == (None, 1.0)
    # The keywords the tree head's wrapper takes and hands on (`TreeLMHead.install`).
    assert _params(func) == ["self", "args", "fused_lm_head", "labels", "shift_labels", "num_items_in_batch", "kwargs"]
    assert not trl_compat.is_trl_fused_forward(type(model).forward)
    assert trl_compat.fused_forward_closure(_params) == {}


def test_fused_head_output_and_kernel():
    fields = [f.name for f in dataclasses.fields(trl_compat.FusedCausalLMOutput)]
    assert set(trl_compat.CHUNKED_LOGPROB_OUTPUTS) | {"loss", "label_mask", "aux_loss"} <= set(fields), fields
    assert trl_compat.CHUNKED_LOGPROB_CHUNK_SIZE == trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE
    # The core's own call of TRL's kernel (`hf_tree_attn.logprobs`, which imports without the trainers) uses the
    # same vocabulary tile.
    assert logprobs._FUSED_VOCAB_CHUNK == trl_compat.CHUNKED_LOGPROB_CHUNK_SIZE
    from trl.kernels import ChunkedLogProbFunction

    assert logprobs._fused_lm_head() is ChunkedLogProbFunction
    assert _params(ChunkedLogProbFunction.forward) == [
        "ctx", "hidden", "weight", "bias", "targets", "temperature", "chunk_size", "final_logit_softcapping",
        "logit_scale", "outputs",
    ]  # fmt: skip
    assert _params(trl_utils.maybe_gather_lm_head_ctx) == ["params"]


def test_chunked_logprobs_returns_the_outputs_in_the_named_order():
    torch.manual_seed(0)
    hidden, weight = torch.randn(5, 8), torch.randn(11, 8)
    targets = torch.randint(0, 11, (5,))
    names = trl_compat.CHUNKED_LOGPROB_OUTPUTS
    values = trl_compat.chunked_logprobs(hidden, weight, None, targets, 0.5, None, 1.0, names)
    assert len(values) == len(names)
    out = dict(zip(names, values))
    logits = hidden @ weight.T / 0.5
    log_p = logits.log_softmax(-1)
    torch.testing.assert_close(out["log_probs"], log_p.gather(1, targets[:, None])[:, 0])
    torch.testing.assert_close(out["entropy"], -(log_p.exp() * log_p).sum(-1))
    torch.testing.assert_close(out["log_sum_sq_probs"], (2 * log_p).logsumexp(-1))
    torch.testing.assert_close(out["mean_logits"], logits.mean(-1))
    assert torch.equal(out["is_top1"].bool(), logits.argmax(-1) == targets)
    only = trl_compat.chunked_logprobs(hidden, weight, None, targets, 0.5, None, 1.0, ("log_probs",))
    assert all(v is None for v in only[1:])


# ------------------------------------------------------------------ trl.experimental.async_grpo


def test_async_module_names_are_looked_up_where_the_seam_says():
    module = _async()
    for name, methods in trl_compat.ASYNC_MODULE_LOOKUPS.items():
        assert hasattr(module, name), f"{module.__name__} has no {name}"
        for method in methods:
            cls, attribute = method.split(".")
            looked_up = _code_names(getattr(getattr(module, cls), attribute))
            assert name in looked_up, f"{method} no longer looks up {name}"
    assert _params(module.create_model_from_path)[0] == "model_id"
    assert _params(module.get_peak_flops_per_device) == ["accelerator", "dtype"]
    assert _params(module.compute_flops_per_token) == ["config", "seq_len"]
    # What `rollout_planner` relies on: the planners' constructors and the row interface they use
    assert _params(module.TokenBudgetBatcher.__init__) == [
        "self",
        "dataset",
        "num_processes",
        "token_budget",
        "metrics",
    ]
    assert _params(module.TokenBudgetBatcher._place) == ["self", "rows", "sample"]
    row = trl_compat.TreeRow()
    assert {"samples", "groups", "tokens", "trained", "load"} <= set(vars(row))
    assert _params(type(row).fits) == ["self", "sample", "budget"] and _params(type(row).add) == ["self", "sample"]


def test_async_constructor_refusals_are_the_ones_hidden():
    module = _async()
    source = inspect.getsource(module.AsyncGRPOTrainer.__init__)
    kinds = " - {" + ", ".join(f'"{k}"' for k in ("full_attention", "sliding_attention")) + "}"
    assert set(trl_compat.ASYNC_ROUTED_LAYER_KINDS) == {"full_attention", "sliding_attention"}
    assert 'getattr(text_config, "layer_types", None)' in source and kinds in source
    assert f'.endswith("{trl_compat.ASYNC_REFUSED_PARAMETER_SUFFIX}")' in source
    steps = ("create_model_from_path(", '"layer_types"', ".endswith(", "add_fused_lm_head(")
    order = [source.index(text) for text in steps]
    assert order == sorted(order)


def test_swapped_async_module_names_are_restored_even_on_error():
    module = _async()
    original = module.compute_flops_per_token
    swapped = trl_compat.swapped_async_module_names(compute_flops_per_token=len)
    with pytest.raises(RuntimeError, match="inside"), swapped:
        assert module.compute_flops_per_token is len
        assert trl_compat.async_module_name("compute_flops_per_token") is len
        raise RuntimeError("inside")
    assert module.compute_flops_per_token is original
    with (
        pytest.raises(KeyError, match="'pad' is not among the names swapped"),
        trl_compat.swapped_async_module_names(pad=len),
    ):
        pass
    assert module.pad is trl_utils.pad


def test_iterated_with_async_module_names_swaps_each_step_only():
    """Each step of the iteration sees the replacement; between steps, and after an error, TRL's own name."""
    module = _async()
    original = module.compute_flops_per_token

    def seen():
        while True:
            yield module.compute_flops_per_token

    steps = trl_compat.iterated_with_async_module_names(seen(), compute_flops_per_token=len)
    assert next(steps) is len and module.compute_flops_per_token is original
    assert next(steps) is len and module.compute_flops_per_token is original
    assert list(trl_compat.iterated_with_async_module_names(iter([1, 2]), compute_flops_per_token=len)) == [1, 2]

    def failing():
        yield 1
        raise RuntimeError("inside")

    steps = trl_compat.iterated_with_async_module_names(failing(), compute_flops_per_token=len)
    assert next(steps) == 1
    with pytest.raises(RuntimeError, match="inside"):
        next(steps)
    assert module.compute_flops_per_token is original


def test_async_collator_rollout_sample_and_loss_contract():
    module = _async()
    from trl.experimental.async_grpo import async_rollout_worker

    assert trl_compat.DataCollatorForRollout is module.DataCollatorForRollout
    assert trl_compat.RolloutSample is async_rollout_worker.RolloutSample
    assert _unwrapped_params(module.DataCollatorForRollout._log_metrics) == ["self", "rows", "all_examples", "padded"]
    assert "_log_metrics" in trl_compat.collator_log_metrics.__code__.co_names
    fields = {f.name for f in dataclasses.fields(module.DataCollatorForRollout)}
    assert {"pad_token_id", "num_processes", "groups_trained"} <= fields, fields
    sample_fields = [f.name for f in dataclasses.fields(trl_compat.RolloutSample)]
    assert sample_fields[:9] == [
        "prompt", "completion", "input_ids", "completion_mask", "old_log_probs", "advantage", "model_version",
        "group_id", "metrics",
    ]  # fmt: skip
    assert "enqueued_at" in sample_fields  # the replay worker stamps it
    assert "_log_step_metrics" in vars(module.AsyncGRPOTrainer)
    assert _unwrapped_params(module.AsyncGRPOTrainer._log_step_metrics) == ["self"]
    loss = inspect.getsource(module.AsyncGRPOTrainer.compute_loss)
    placeholders = trl_compat.async_forward_only_inputs({"input_ids": torch.ones(2, 5, dtype=torch.long)})
    for key in placeholders:
        assert f'"{key}"' in loss, key
    outputs = trl_compat.async_model_outputs(log_probs=1, entropy=2, aux_loss=3)
    for field in ("log_probs", "entropy", "aux_loss"):
        assert f"outputs.{field}" in loss, field
        assert getattr(outputs, field) is not None


def test_trainer_loop_fetches_each_steps_micro_batches_before_training_on_them():
    """`transformers.Trainer.get_batch_samples`, which `TreeAsyncGRPOTrainer` overrides (prefix reuse scores a
    step's micro-batches together): its parameters and result, and the training loop calling it for each optimizer
    step before that step's `training_step` calls, on the installed transformers."""
    import transformers

    module = pytest.importorskip("trl.experimental.async_grpo")
    hook = transformers.Trainer.get_batch_samples
    assert _unwrapped_params(hook) == ["self", "epoch_iterator", "num_batches", "device"]
    assert "return batch_samples, num_items_in_batch" in inspect.getsource(hook)
    assert "get_batch_samples" not in vars(module.AsyncGRPOTrainer)  # TRL's class leaves transformers' in place
    from hf_tree_attn.trainer import TreeAsyncGRPOTrainer

    assert _unwrapped_params(TreeAsyncGRPOTrainer.get_batch_samples) == _unwrapped_params(hook)
    assert "get_batch_samples" in trl_compat.get_batch_samples.__code__.co_names
    loops = [  # `_run_epoch` in 5.17.0, 5.24.0 and 5.25.0
        source
        for name, function in vars(transformers.Trainer).items()
        if callable(function) and name != "get_batch_samples"
        and "self.get_batch_samples(" in (source := inspect.getsource(function))
    ]  # fmt: skip
    assert len(loops) == 1, "transformers' training loop no longer fetches a step's micro-batches in one place"
    (loop,) = loops
    fetch = loop.index("batch_samples, num_items_in_batch = self.get_batch_samples(epoch_iterator, num_batches,")
    assert fetch < loop.index("for i, inputs in enumerate(batch_samples):") < loop.index("self.training_step(model")


def test_trainer_loop_marks_the_micro_batch_that_ends_an_optimizer_step():
    """With prefix reuse under DDP the tree trainers average the gradients in the `training_step` of the micro-batch
    that ends an optimizer step (`core.prefix_reuse_gradient_sync`), read as `accelerator.sync_gradients`: the
    installed transformers' loop sets it before each micro-batch's `training_step`, then clips and steps the
    optimizer on that micro-batch, after its `training_step`."""
    import transformers

    loops = [
        source
        for name, function in vars(transformers.Trainer).items()
        if callable(function) and "self.training_step(model" in (source := inspect.getsource(function))
    ]
    assert len(loops) == 1, "transformers' training loop no longer calls training_step in one place"
    (loop,) = loops
    order = [
        loop.index(text)
        for text in (
            "for i, inputs in enumerate(batch_samples):",
            "self.accelerator.gradient_state._set_sync_gradients(do_sync_step)",
            "self.training_step(model, inputs, num_items_in_batch)",
            "if do_sync_step:",
            "self._clip_grad_norm(model)",
            "self.optimizer.step()",
        )
    ]
    assert order == sorted(order)


def test_experimental_names_load_on_first_use():
    code = (
        "import sys\n"
        "from hf_tree_attn.trainer import trl_compat\n"
        "assert 'trl.experimental.async_grpo' not in sys.modules\n"
        "trl_compat.RolloutSample\n"
        "assert 'trl.experimental.async_grpo' in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    with pytest.raises(AttributeError, match="no attribute 'Missing'"):
        trl_compat.Missing  # noqa: B018


# ------------------------------------------------------------------ one seam


def _trl_private_names() -> set[str]:
    """Private names TRL's own classes define or assign (not transformers' `Trainer`'s)."""
    classes = [GRPOTrainer, RLOOTrainer, SFTTrainer, DPOTrainer, RewardTrainer]
    try:
        module = _async()
        classes += [module.AsyncGRPOTrainer, module.DataCollatorForRollout]
    except pytest.skip.Exception:
        pass
    names = set()
    for cls in classes:
        names |= {n for n in vars(cls) if n.startswith("_") and not n.startswith("__")}
        names |= {n for n in _stored_attributes(cls) if n.startswith("_") and not n.startswith("__")}
    return names


def test_the_trainers_reach_trl_internals_through_the_seam_only():
    """Outside `trl_compat.py`, the trainer package imports only public TRL modules and reads no private name of
    TRL's classes (an override's `def` keeps TRL's name; calling TRL's goes through the seam)."""
    public_modules = {"trl", "trl.experimental.async_grpo"}
    private = _trl_private_names()
    offences = []
    for path in sorted(TRAINER_DIR.glob("*.py")):
        if path.name == "trl_compat.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] == "trl":
                if node.module not in public_modules:
                    offences.append(f"{path.name}:{node.lineno}: from {node.module} import ...")
            elif isinstance(node, ast.Import):
                offences += [f"{path.name}:{node.lineno}: import {a.name}" for a in node.names if a.name[:4] == "trl."]
            elif isinstance(node, ast.Attribute) and node.attr in private:
                offences.append(f"{path.name}:{node.lineno}: .{node.attr}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in private:
                offences.append(f"{path.name}:{node.lineno}: {node.value!r}")
    assert offences == [], "TRL internals outside hf_tree_attn/trainer/trl_compat.py:\n" + "\n".join(offences)
