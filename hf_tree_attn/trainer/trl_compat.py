"""The seam between the tree trainers and TRL: every TRL internal they touch, each named once, checked on trl 1.16.0.

The tree trainers subclass TRL's and leave TRL's code running. To do so they override some of TRL's private hooks
(and call TRL's own implementation of each), read TRL's metrics table and generation buffer, read the settings
TRL's fused LM head keeps in its closure, and swap names TRL's asynchronous trainer module looks up. None of that is
TRL's public API, so it all lives here, each entry with what it is in TRL and the version it was checked against;
`tests/test_trl_compat.py` pins every entry (it exists, with the parameters or fields relied on), so a TRL that
moves one fails there, by name. Public TRL classes (`trl.GRPOTrainer`, `trl.GRPOConfig`, `trl.experimental.async_grpo.
AsyncGRPOTrainer`, ...) are imported where they are used.

The hooks the trainers override keep TRL's names and parameters (an override must); each is reached from here as
`<hook>(super(), ...)`, which calls TRL's implementation through the caller's MRO:

- `trl.GRPOTrainer` and `trl.RLOOTrainer`, alike: `_get_per_token_logps_and_entropies`, `_prepare_inputs`,
  `_calculate_rewards`, and `_generate_single_turn`, whose parameters and result differ between the two
  (`generate_single_turn`, `rloo_generate_single_turn`);
- `trl.DPOTrainer`: `_precompute_ref_logps`;
- `trl.experimental.async_grpo.AsyncGRPOTrainer`: `_log_step_metrics`;
- `transformers.Trainer`, under TRL's trainers: `get_batch_samples`, which its training loop calls once per optimizer
  step to fetch that step's micro-batches before their `training_step` calls (`TreeAsyncGRPOTrainer` scores them
  as one forest with `tree_prefix_reuse`); public in name, not documented as a hook, read in transformers 5.17.0,
  5.24.0 and 5.25.0.

TRL's trainers change between minor releases, so this module, and with it `hf_tree_attn.trainer`, imports only with
the TRL it is tested on (`TRL_REQUIREMENT`, pinned alike in `setup.cfg`): any other is an `ImportError` naming the
installed version and the fix, raised before any TRL internal is looked up. `trl.experimental` warns on import, so
its names (`DataCollatorForRollout`, `RolloutSample`, the async trainer module) load on first use.
"""

# The TRL imports follow the version check on purpose: an untested TRL fails with the fix, not on a moved name.
# ruff: noqa: E402

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace

import torch

__all__ = [
    "ASYNC_MODULE_LOOKUPS",
    "ASYNC_REFUSED_PARAMETER_SUFFIX",
    "ASYNC_ROUTED_LAYER_KINDS",
    "CHUNKED_LOGPROB_CHUNK_SIZE",
    "CHUNKED_LOGPROB_OUTPUTS",
    "FUSED_HEAD_SETTINGS",
    "TRL_REQUIREMENT",
    "FusedCausalLMOutput",
    "async_forward_only_inputs",
    "async_model_outputs",
    "async_module_name",
    "buffered_inputs",
    "calculate_rewards",
    "check_trl_version",
    "chunked_logprobs",
    "collator_log_metrics",
    "fused_forward_closure",
    "generate_and_score_completions",
    "generate_single_turn",
    "get_batch_samples",
    "generation_step",
    "get_per_token_logps_and_entropies",
    "is_trl_fused_forward",
    "is_vision_dataset",
    "is_vlm",
    "iterated_with_async_module_names",
    "log_step_metrics",
    "metrics",
    "pad",
    "precompute_ref_logps",
    "prepare_inputs",
    "profiling_decorator",
    "rloo_generate_single_turn",
    "set_buffered_inputs",
    "shuffle_permutation",
    "split_pixel_values_by_grid",
    "split_tensor_dict",
    "swapped_async_module_names",
    "tokenize_prompts",
    "tokenizer",
    "trainer_name",
    "unsplit_pixel_values_by_grid",
]

# The TRL releases hf_tree_attn.trainer is tested with (setup.cfg's `train` extra pins the same range).
TRL_REQUIREMENT = ">=1.16,<1.17"


def check_trl_version() -> None:
    """Raise `ImportError` unless the installed trl is within `TRL_REQUIREMENT` (its own pre-releases included)."""
    import trl
    from packaging.specifiers import SpecifierSet

    installed = trl.__version__
    if not SpecifierSet(TRL_REQUIREMENT).contains(installed, prereleases=True):
        raise ImportError(
            f"hf_tree_attn.trainer is tested with trl{TRL_REQUIREMENT}, but trl {installed} is installed: the tree "
            "trainers build on TRL internals that change between minor releases (hf_tree_attn/trainer/trl_compat.py "
            f'lists them). Install the tested range: pip install "trl{TRL_REQUIREMENT}". (`import hf_tree_attn` '
            "and its own training loop need no trl.)"
        )


check_trl_version()

from trl.extras.profiling import profiling_decorator  # TRL's per-method timing wrapper, on its own hooks (1.16.0)
from trl.kernels import ChunkedLogProbFunction  # the chunked log-prob autograd kernel of its fused head (1.16.0)
from trl.trainer.utils import (  # each as of 1.16.0
    _CHUNKED_LOGPROB_CHUNK_SIZE,  # the vocabulary tile the fused head runs that kernel with
    FusedCausalLMOutput,  # what a `fused_lm_head=True` forward returns
    add_fused_lm_head,  # installs the fused forward on a model (its module is where that forward is defined)
    maybe_gather_lm_head_ctx,  # gathers a ZeRO-3 LM head around the kernel, as the fused head does
    pad,  # stacks 1-D tensors into a padded batch, as the rollout collator pads its rows
    split_pixel_values_by_grid,  # these three: helpers of GRPOTrainer._prepare_inputs
    split_tensor_dict,
    unsplit_pixel_values_by_grid,
)

# ------------------------------------------------------------ trl.GRPOTrainer, RLOOTrainer, SFTTrainer, DPOTrainer


def metrics(trainer) -> dict:
    """TRL's metrics table, `trainer._metrics`: `{"train" | "eval": {name: [values]}}` (lists default to empty),
    averaged and logged by TRL's `log`; GRPO, SFT, DPO, reward and the async GRPO trainer alike (1.16.0)."""
    return trainer._metrics


def generation_step(trainer) -> int:
    """`GRPOTrainer._step` / `RLOOTrainer._step`: micro-batches trained so far, which `_prepare_inputs` reads to decide
    when to generate and which buffered micro-batch to return (1.16.0)."""
    return trainer._step


def buffered_inputs(trainer) -> list[dict] | None:
    """`GRPOTrainer._buffered_inputs` / `RLOOTrainer._buffered_inputs`: the micro-batches of the current generation
    batch (None before the first, or after resuming from a checkpoint) (1.16.0)."""
    return trainer._buffered_inputs


def set_buffered_inputs(trainer, micro_batches: list[dict]) -> None:
    """Store `micro_batches` where `GRPOTrainer._prepare_inputs` keeps its own (`_buffered_inputs`, 1.16.0)."""
    trainer._buffered_inputs = micro_batches


def shuffle_permutation(batch: dict) -> torch.Tensor:
    """The permutation `trl.trainer.utils.shuffle_sequence_dict` draws for `batch` in `GRPOTrainer._prepare_inputs`
    (and RLOO's): one `torch.randperm` of the rows of its first entry that is not None (1.16.0)."""
    rows = len(next(v for v in batch.values() if v is not None))
    return torch.randperm(rows)


def generate_and_score_completions(trainer, batch: list[dict]) -> dict:
    """`GRPOTrainer._generate_and_score_completions(batch)` (RLOO's alike): generation, rewards and advantages of a
    generation batch, as `(rows, ...)` tensors (1.16.0)."""
    return trainer._generate_and_score_completions(batch)


def tokenize_prompts(trainer, prompts: list) -> tuple[list[list[int]], object, object]:
    """`GRPOTrainer._tokenize_prompts(prompts)` (RLOO's alike): `(prompt_ids, images, multimodal_fields)`, token ids
    unpadded (1.16.0)."""
    return trainer._tokenize_prompts(prompts)


def is_vlm(trainer) -> bool:
    """`GRPOTrainer._is_vlm` / `RLOOTrainer._is_vlm`: whether the policy is a vision-language model (1.16.0)."""
    return trainer._is_vlm


def tokenizer(trainer):
    """`GRPOTrainer._tokenizer` / `RLOOTrainer._tokenizer`: the text tokenizer of `processing_class` (a processor's
    inner one) (1.16.0)."""
    return trainer._tokenizer


def is_vision_dataset(trainer) -> bool:
    """`SFTTrainer._is_vision_dataset` / `DPOTrainer._is_vision_dataset`: whether the dataset holds images; False
    where the trainer sets none (1.16.0)."""
    return getattr(trainer, "_is_vision_dataset", False)


def trainer_name(trainer) -> str:
    """`_name` of TRL's trainer classes ("SFT", "DPO", "GRPO", "RLOO"), as TRL's model cards name the method
    (1.16.0)."""
    return trainer._name


def get_per_token_logps_and_entropies(parent, *args, **kwargs):
    """TRL's `GRPOTrainer._get_per_token_logps_and_entropies` (RLOO's: the same parameters) through `parent`
    (`super()`): `(logps (B, C), entropies | None, aux_loss | None)` of padded rows (1.16.0)."""
    return parent._get_per_token_logps_and_entropies(*args, **kwargs)


def prepare_inputs(parent, generation_batch):
    """TRL's `GRPOTrainer._prepare_inputs(generation_batch)` (RLOO's alike) through `parent` (`super()`) (1.16.0)."""
    return parent._prepare_inputs(generation_batch)


def calculate_rewards(parent, inputs, prompts, completions, completion_ids_list):
    """TRL's `GRPOTrainer._calculate_rewards` (RLOO's alike) through `parent` (`super()`): `(rows, reward_funcs)`
    rewards (1.16.0)."""
    return parent._calculate_rewards(inputs, prompts, completions, completion_ids_list)


def generate_single_turn(parent, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
    """TRL's `GRPOTrainer._generate_single_turn` through `parent` (`super()`): `(completion_ids, logprobs)`
    (1.16.0)."""
    return parent._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)


def rloo_generate_single_turn(parent, prompt_ids, images, multimodal_fields) -> list[list[int]]:
    """TRL's `RLOOTrainer._generate_single_turn` through `parent` (`super()`): the completion ids alone (GRPO's
    returns sampling log-probabilities too, and takes the group size) (1.16.0)."""
    return parent._generate_single_turn(prompt_ids, images, multimodal_fields)


def precompute_ref_logps(parent, dataset, name: str, batch_size: int):
    """TRL's `DPOTrainer._precompute_ref_logps` through `parent` (`super()`): `dataset` with the reference
    log-probabilities added, computed inside TRL's `__init__` (1.16.0)."""
    return parent._precompute_ref_logps(dataset, name, batch_size)


# ------------------------------------------------------------------ the fused LM head (trl.trainer.utils)

# What `add_fused_lm_head` fixes when it installs its forward: free variables of that forward's closure (1.16.0).
FUSED_HEAD_SETTINGS = ("outputs", "temperature", "cast_lm_head_to_fp32", "final_logit_softcapping", "logit_scale")
# `ChunkedLogProbFunction`'s outputs in order, which are also `FusedCausalLMOutput`'s per-token fields (1.16.0).
CHUNKED_LOGPROB_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
# `_CHUNKED_LOGPROB_CHUNK_SIZE`: the vocabulary tile TRL's fused head runs its kernel with (32768 in 1.16.0).
CHUNKED_LOGPROB_CHUNK_SIZE = _CHUNKED_LOGPROB_CHUNK_SIZE


def fused_forward_closure(func) -> dict:
    """The closure of `func` (TRL's fused forward, unbound) by free-variable name; {} for a function without one."""
    code, closure = getattr(func, "__code__", None), getattr(func, "__closure__", None)
    return dict(zip(code.co_freevars, (c.cell_contents for c in closure))) if code and closure else {}


def is_trl_fused_forward(func) -> bool:
    """Whether `func` was defined in the module of `add_fused_lm_head` (`trl.trainer.utils` in 1.16.0), as its
    fused forward is: then a missing setting means another TRL, not another wrapper."""
    return getattr(func, "__globals__", {}).get("__name__") == add_fused_lm_head.__module__


def chunked_logprobs(hidden, weight, bias, targets, temperature, final_logit_softcapping, logit_scale, outputs):
    """TRL's chunked log-prob kernel as its fused head calls it, the LM head gathered as it gathers it there
    (`maybe_gather_lm_head_ctx`): one value per `CHUNKED_LOGPROB_OUTPUTS` entry (None where not in `outputs`)."""
    with maybe_gather_lm_head_ctx(weight, bias):
        return ChunkedLogProbFunction.apply(
            hidden, weight, bias, targets, temperature, CHUNKED_LOGPROB_CHUNK_SIZE, final_logit_softcapping,
            logit_scale, outputs,
        )  # fmt: skip


# ------------------------------------------------------------------ trl.experimental.async_grpo

# Names TRL's async trainer module (`trl.experimental.async_grpo.async_grpo_trainer`, 1.16.0) looks up when called,
# each with the methods of that module that look it up (`Class.method`); `swapped_async_module_names` replaces them
# for one call, `iterated_with_async_module_names` for each step of an iteration.
ASYNC_MODULE_LOOKUPS = {
    # loads the policy, with attn_implementation="tree_fa3"
    "create_model_from_path": ("AsyncGRPOTrainer.__init__",),
    # patches the fused LM head onto the loaded policy
    "add_fused_lm_head": ("AsyncGRPOTrainer.__init__",),
    # the device's peak FLOPs, by torch.cuda.get_device_name
    "get_peak_flops_per_device": ("AsyncGRPOTrainer.__init__",),
    # the collator class the dataloader builds
    "DataCollatorForRollout": ("AsyncGRPOTrainer.get_train_dataloader",),
    # the planner classes the dataloader builds: micro-batches of rows by token budget, or by sample count
    "TokenBudgetBatcher": ("AsyncGRPOTrainer.get_train_dataloader",),
    "FixedCountBatcher": ("AsyncGRPOTrainer.get_train_dataloader",),
    # the planner's row (`packing.TreeRow`: `fits`, `add`, `samples`, `groups`, `tokens`, `trained`, `load`), built
    # while the planner iterates
    "TreeRow": ("TokenBudgetBatcher.__iter__", "FixedCountBatcher.__iter__"),
    # the FLOP formula of the MFU metrics
    "compute_flops_per_token": ("AsyncGRPOTrainer._log_step_metrics",),
}
# What `AsyncGRPOTrainer.__init__` accepts of a loaded policy (1.16.0): `layer_types` of the text config within
# these, and no parameter named with this suffix (its FlashAttention-3 kernel has no attention sinks).
ASYNC_ROUTED_LAYER_KINDS = frozenset({"full_attention", "sliding_attention"})
ASYNC_REFUSED_PARAMETER_SUFFIX = ".sinks"

# The `trl.experimental` names, loaded on first use (module `__getattr__`, so not in `__all__`): module and name in
# it (1.16.0).
_LAZY = {
    # The collator of `AsyncGRPOTrainer`'s dataloader: one micro-batch of `packing.TreeRow`s in, a batch out; its
    # `_log_metrics(rows, all_examples, padded)` logs the packing metrics.
    "DataCollatorForRollout": ("trl.experimental.async_grpo.async_grpo_trainer", "DataCollatorForRollout"),
    # One scored rollout, as rollout workers queue them (a dataclass).
    "RolloutSample": ("trl.experimental.async_grpo.async_rollout_worker", "RolloutSample"),
    # One rank's row of a micro-batch as TRL's planner fills it: `fits(sample, budget)`, `add(sample)`, `samples`,
    # `groups`, `tokens`, `trained`, `load`, and `pack()`, the collator's batch of one row.
    "TreeRow": ("trl.experimental.async_grpo.packing", "TreeRow"),
}
_ASYNC_MODULE = "trl.experimental.async_grpo.async_grpo_trainer"


def __getattr__(name: str):
    if name in _LAZY:
        module, attribute = _LAZY[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _async_module() -> ModuleType:
    return importlib.import_module(_ASYNC_MODULE)


def async_module_name(name: str):
    """What TRL's async trainer module holds under `name` now (one of `ASYNC_MODULE_LOOKUPS`)."""
    if name not in ASYNC_MODULE_LOOKUPS:
        raise KeyError(f"{name!r} is not among the names swapped in {_ASYNC_MODULE}: {sorted(ASYNC_MODULE_LOOKUPS)}")
    return getattr(_async_module(), name)


@contextlib.contextmanager
def swapped_async_module_names(**replacements):
    """Within the block, TRL's async trainer module sees `replacements` under these names (`ASYNC_MODULE_LOOKUPS`),
    restored after."""
    saved = {name: async_module_name(name) for name in replacements}
    module = _async_module()
    for name, value in replacements.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def iterated_with_async_module_names(iterator: Iterator, **replacements) -> Iterator:
    """What `iterator` yields, each step of it run with TRL's async trainer module seeing `replacements`
    (`swapped_async_module_names`); between steps the module holds its own names again."""
    while True:
        with swapped_async_module_names(**replacements):
            try:
                item = next(iterator)
            except StopIteration:
                return
        yield item


def log_step_metrics(parent) -> None:
    """TRL's `AsyncGRPOTrainer._log_step_metrics()` through `parent` (`super()`): one optimizer step's timing,
    batch and throughput metrics (1.16.0)."""
    parent._log_step_metrics()


def get_batch_samples(parent, epoch_iterator, num_batches, device) -> tuple[list, torch.Tensor | int | None]:
    """`transformers.Trainer.get_batch_samples(epoch_iterator, num_batches, device)` through `parent` (`super()`):
    `(the optimizer step's micro-batches, num_items_in_batch)`, fetched before the step's first `training_step`
    (transformers 5.17.0 to 5.25.0)."""
    return parent.get_batch_samples(epoch_iterator, num_batches, device)


def collator_log_metrics(collator, rows, all_examples, padded) -> None:
    """`DataCollatorForRollout._log_metrics`: the packing metrics of one batch, reading `len(row.tokens)` and
    `row.load` of each row (1.16.0)."""
    collator._log_metrics(rows=rows, all_examples=all_examples, padded=padded)


def async_forward_only_inputs(inputs: dict) -> dict:
    """The batch entries `AsyncGRPOTrainer.compute_loss` reads only to hand them to its model forward (its packed
    row's labels and FlashAttention metadata, 1.16.0), filled with placeholders of the shapes it slices: a forward
    that does not need them can stand in for the model."""
    ids = inputs["input_ids"]
    none = ids.new_empty((1, 0))
    return {
        "shift_labels": torch.full_like(ids, -100),
        "tree_kv_index": none,
        "tree_cu_seqlens_q": none,
        "tree_cu_seqlens_k": none,
        "tree_max_seqlens": ids.new_zeros((1, 2)),
    }


def async_model_outputs(log_probs, entropy, aux_loss) -> SimpleNamespace:
    """What `AsyncGRPOTrainer.compute_loss` reads of its model's output (1.16.0): `log_probs` and `entropy`
    indexed by `token_index` once flattened, and `aux_loss`."""
    return SimpleNamespace(log_probs=log_probs, entropy=entropy, aux_loss=aux_loss)
