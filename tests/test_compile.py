"""Compiled decoder layers in the tree trainers: the user's compile setting reaches tree forwards, exactly.

- `hf_tree_attn.compile`: layers compiled in place run the compiled graphs (counted by a backend that counts its
  calls), forward and backward; `eager_layers` runs them eagerly; a compiler failure — in the forward or in the
  backward — falls back to eager with one warning and the eager results, once a checkpoint the failure left open
  has let go of its saved-tensor hooks (refused while they stay); an error the eager forward repeats is raised, the
  layers staying compiled.
- `compile_setting.decide_compile`: which compile runs for every source of a setting (accelerate's dynamo plugin,
  `torch_compile`, `tree_compile`), device, engine and Liger; a setting is applied or refused, never dropped.
- The four trainers, a compile asked for through accelerate's environment (aot_eager, no C++ toolchain): every
  tree forward runs the compiled layers (accelerate compiles no copy), and the run is TRL's (losses, gradients,
  weights), which compiling must not change; no recompilation once warm while forest lengths vary.
"""

from __future__ import annotations

import functools
import json
import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType, DynamoBackend, TorchDynamoPlugin
from helpers import TOLERANCES, forest_case, hybrid_twin_models, tiny_config, tiny_model
from test_coverage import tiny_config as tiny_config_of
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch._functorch.aot_autograd import make_boxed_func
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

import hf_tree_attn
from hf_tree_attn.compile import call_compiled, compile_decoder_layers, compiled_layers, decoder_layers, eager_layers
from hf_tree_attn.logprobs import forest_forward_kwargs
from hf_tree_attn.trainer import compile_setting
from hf_tree_attn.trainer.compile_setting import decide_compile

SEQUENCES = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 9], [10, 11, 12, 13]]
COMPILE_ENV = {"ACCELERATE_DYNAMO_BACKEND": "AOT_EAGER", "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "1"}


class CountingBackend:
    """A torch.compile backend (through AOTAutograd, so the backward is a compiled graph too) that counts how often
    its forward and backward graphs run; `fail` = "forward" / "backward" makes that graph's compilation raise, "flash"
    the forward's while tree attention asks for FlexAttention's FLASH backend."""

    def __init__(self, fail: str | None = None):
        self.calls = {"forward": 0, "backward": 0}
        self.fail = fail
        self.backend = aot_autograd(fw_compiler=self._compiler("forward"), bw_compiler=self._compiler("backward"))

    def _compiler(self, kind):
        def compile_graph(gm, example_inputs):
            if self.fail == kind:
                raise RuntimeError(f"no {kind} for you")
            flash = (hf_tree_attn.attention.FLEX_KERNEL_OPTIONS or {}).get("BACKEND") == "FLASH"
            if self.fail == "flash" and kind == "forward" and flash:
                raise RuntimeError("BACKEND='FLASH' but flash attention cannot be used")

            def run(*args):
                self.calls[kind] += 1
                return gm(*args)

            return make_boxed_func(run)

        return compile_graph


def _scores(model):
    """Per-row log-probs of SEQUENCES' forest and every parameter's gradient of their sum."""
    model.zero_grad(set_to_none=True)
    (forest,) = hf_tree_attn.pack_forest(SEQUENCES)
    table, _ = hf_tree_attn.forest_logprobs(model, forest)
    table.sum().backward()
    return table.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_compiled_layers_run_the_compiled_graphs_and_match_eager():
    torch._dynamo.reset()
    eager, compiled = tiny_model("qwen3"), tiny_model("qwen3")
    counting = CountingBackend()
    assert compile_decoder_layers(compiled, backend=counting.backend, dynamic=True) == 2
    assert compiled_layers(compiled) == decoder_layers(compiled) == list(compiled.model.layers)
    want, want_grads = _scores(eager)
    got, got_grads = _scores(compiled)
    assert counting.calls["forward"] >= 2 and counting.calls["backward"] >= 2  # each layer, both directions
    torch.testing.assert_close(got, want, atol=TOLERANCES["logps_atol"], rtol=0)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    before = dict(counting.calls)
    with eager_layers(compiled):
        _scores(compiled)
    assert counting.calls == before  # inside, the same layers ran eagerly
    assert compiled_layers(compiled) == list(compiled.model.layers)  # and are compiled again after


@pytest.mark.parametrize("fail", ["forward", "backward"])
def test_compiler_failure_falls_back_to_eager_once(fail):
    torch._dynamo.reset()
    eager, compiled = tiny_model("qwen3"), tiny_model("qwen3")
    compile_decoder_layers(compiled, backend=CountingBackend(fail=fail).backend, dynamic=True)
    want, want_grads = _scores(eager)
    with pytest.warns(UserWarning, match=rf"compiled decoder layers of Qwen3ForCausalLM failed .*no {fail} for you"):
        got, got_grads = _scores(compiled)
    assert compiled_layers(compiled) == []  # eager from now on
    torch.testing.assert_close(got, want, atol=TOLERANCES["logps_atol"], rtol=0)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _scores(compiled)  # said once


def test_a_flash_backend_failure_turns_the_backend_off_and_stays_compiled(monkeypatch):
    """With FlexAttention's FLASH backend on, a compiler failure turns that backend off (one warning naming it and
    the error; the other kernel options kept) and the forward runs compiled again, on the Triton kernels: the layers
    stay compiled and the results are eager's."""
    monkeypatch.setattr(hf_tree_attn.attention, "FLEX_KERNEL_OPTIONS", {"BACKEND": "FLASH", "BLOCK_M": 64})
    torch._dynamo.reset()
    eager, compiled = tiny_model("qwen3"), tiny_model("qwen3")
    counting = CountingBackend(fail="flash")
    compile_decoder_layers(compiled, backend=counting.backend, dynamic=True)
    want, want_grads = _scores(eager)
    with pytest.warns(
        UserWarning, match=r"failed on FlexAttention's FLASH backend \(RuntimeError: BACKEND='FLASH'"
    ) as said:
        got, got_grads = _scores(compiled)
    assert len(said) == 1, [str(w.message) for w in said]
    assert hf_tree_attn.attention.FLEX_KERNEL_OPTIONS == {"BLOCK_M": 64}
    assert compiled_layers(compiled) == list(compiled.model.layers)  # still compiled
    assert counting.calls["forward"] >= 2 and counting.calls["backward"] >= 2
    torch.testing.assert_close(got, want, atol=TOLERANCES["logps_atol"], rtol=0)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_an_error_the_eager_forward_repeats_is_raised():
    torch._dynamo.reset()
    model = tiny_model("qwen3")
    compile_decoder_layers(model, backend=CountingBackend().backend)

    def broken():
        raise ValueError("the model's own error")

    with pytest.raises(ValueError, match="the model's own error"):
        call_compiled(model, broken)
    assert compiled_layers(model) == list(model.model.layers)  # not the compiler's fault: still compiled


def test_checkpointed_layers_are_traced_whole_through_call_compiled():
    """transformers' attention modules from 5.25 on (`kernels`' `use_kernelized_func` wrapper) set and reset a routing
    variable around their forward, which breaks the graph of every checkpointed compiled layer; the package's
    forwards (`call_compiled`) trace them whole, and leave torch's setting as they found it."""
    from hf_tree_attn.logprobs import forest_forward_kwargs

    (forest,) = hf_tree_attn.pack_forest(SEQUENCES)
    setting = torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint
    breaks = {}
    for through_package in [False, True]:
        torch._dynamo.reset()
        counters.clear()
        model = tiny_model("qwen3").train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        compile_decoder_layers(model, backend="aot_eager", dynamic=True)
        if through_package:
            hf_tree_attn.forest_logprobs(model, forest)[0].sum().backward()
            assert counters["stats"]["unique_graphs"] >= 1
        else:
            model(**forest_forward_kwargs(forest, "cpu")).logits.sum().backward()
        breaks[through_package] = sum(counters["graph_break"].values())
    assert torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint == setting
    wrapped = "_kernel_funcs" in vars(model.model.layers[0].self_attn)  # kernels' wrapper around the forward
    assert breaks == {False: breaks[False], True: 0} and bool(breaks[False]) == wrapped, (breaks, wrapped)


def test_a_model_without_decoder_layers_is_refused():
    with pytest.raises(ValueError, match="no transformers decoder layers"):
        compile_decoder_layers(torch.nn.Linear(2, 2))


# ----------------------------------------------------------------------------------------------------------------
# Which compile a trainer runs.


def _accelerator(backend="no", regional=False, dynamic=None, device="cpu", distributed=DistributedType.NO, **extra):
    plugin = TorchDynamoPlugin(backend=backend, use_regional_compilation=regional, dynamic=dynamic, **extra)
    return SimpleNamespace(state=SimpleNamespace(dynamo_plugin=plugin), device=torch.device(device),
                           distributed_type=distributed)  # fmt: skip


def _args(tree_compile="auto", liger=False, torch_compile=False):
    return SimpleNamespace(tree_compile=tree_compile, use_liger_kernel=liger, torch_compile=torch_compile)


def _model(kind: str):
    if kind == "hybrid":
        return hybrid_twin_models("qwen3_5")[0]
    if kind == "moe":
        config = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16)  # fmt: skip
        return AutoModelForCausalLM.from_config(config)
    return tiny_model("qwen3")


DENSE = "dense"
DECISIONS = {
    # name: (args, accelerator, model) -> (kwargs, source)
    "cpu default: eager": (_args(), _accelerator(), DENSE, None, "none"),
    "cuda default: inductor, dynamic": (_args(), _accelerator(device="cuda"), DENSE, compile_setting.DEFAULT_COMPILE,
                                        "default"),
    "tree_compile=True on cpu": (_args(True), _accelerator(), DENSE, compile_setting.DEFAULT_COMPILE, "default"),
    "tree_compile=False": (_args(False), _accelerator(device="cuda"), DENSE, None, "none"),
    "asked: regional, dynamic filled in": (_args(False), _accelerator("aot_eager", True), DENSE,
                                           {"backend": "aot_eager", "dynamic": True}, "accelerate"),
    "asked: mode and dynamic kept": (_args(), _accelerator("inductor", True, dynamic=False, mode="max-autotune"),
                                     DENSE, {"backend": "inductor", "dynamic": False, "mode": "max-autotune"},
                                     "accelerate"),
    "asked under FSDP: accelerate compiles in place": (
        _args(), _accelerator("inductor", True, device="cuda", distributed=DistributedType.FSDP), DENSE, None,
        "accelerate"),
    "FSDP default: eager": (_args(), _accelerator(device="cuda", distributed=DistributedType.FSDP), DENSE, None,
                            "none"),
    "liger default: eager": (_args(liger=True), _accelerator(device="cuda"), DENSE, None, "none"),
    "hybrid default: eager": (_args(), _accelerator(device="cuda"), "hybrid", None, "none"),
    "moe default: eager": (_args(), _accelerator(device="cuda"), "moe", None, "none"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(DECISIONS))
def test_decide_compile(case):
    args, accelerator, model, kwargs, source = DECISIONS[case]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a regional request is applied as asked, without a word
        decision = decide_compile(args, accelerator, _model(model))
    assert (decision.kwargs, decision.source) == (kwargs, source), decision.note


def test_a_whole_model_request_compiles_the_layers_and_says_so():
    with pytest.warns(UserWarning, match="whole-model compile .* compile the decoder layers instead"):
        decision = decide_compile(_args(torch_compile=True), _accelerator("inductor", regional=False), _model(DENSE))
    assert decision.kwargs == {"backend": "inductor", "dynamic": True}


def test_liger_with_an_asked_compile_is_refused():
    with pytest.raises(ValueError, match=r"use_liger_kernel=True with compiled decoder layers gave wrong gradients"):
        decide_compile(_args(liger=True), _accelerator("inductor", True), _model(DENSE))


PREFIX_REUSE_NOTES = {  # case: (tree_prefix_reuse, decision, warned, logged)
    "asked": (True, compile_setting.CompileDecision({"backend": "aot_eager", "dynamic": True}, "accelerate", ""),
              True, True),
    "asked under FSDP": (True, compile_setting.CompileDecision(None, "accelerate", ""), True, True),
    "the CUDA default": (True, compile_setting.CompileDecision(dict(compile_setting.DEFAULT_COMPILE), "default", ""),
                         False, True),
    "layers eager": (True, compile_setting.CompileDecision(None, "none", ""), False, False),
    "TRL's path": (True, None, False, False),
    "no prefix reuse": (False, compile_setting.CompileDecision(dict(compile_setting.DEFAULT_COMPILE), "default", ""),
                        False, False),
}  # fmt: skip


@pytest.mark.parametrize("case", list(PREFIX_REUSE_NOTES))
def test_prefix_reuse_says_when_its_chunks_run_eager_layers(case, caplog, monkeypatch):
    """A hybrid's prefix-reuse chunks always run the eager layers, and any model's with
    `HF_TREE_ATTN_PREFIX_REUSE_LAYERS=eager`: a compile the user asked for is then not applied everywhere, and the
    trainer says so with a warning; the CUDA default says it at INFO; nothing without both, and nothing where the
    chunks run the compiled layers (the default `compiled`, a model whose layers are attention alone)."""
    from hf_tree_attn import prefix_reuse

    reuse, decision, warned, logged = PREFIX_REUSE_NOTES[case]
    models = {"dense": _model(DENSE), "hybrid": _model("hybrid")}
    for kind, layers in [("dense", "eager"), ("hybrid", "eager"), ("hybrid", "compiled"), ("dense", "compiled")]:
        monkeypatch.setattr(prefix_reuse, "LAYERS", layers)
        says = logged and (kind == "hybrid" or layers == "eager")
        caplog.clear()
        with warnings.catch_warnings(record=True) as seen, caplog.at_level("INFO", logger=compile_setting.__name__):
            warnings.simplefilter("always")
            note = compile_setting.prefix_reuse_note(SimpleNamespace(tree_prefix_reuse=reuse), decision, models[kind])
        said = "runs its chunks on the eager decoder layers"
        why = "carry a state along the rows" if kind == "hybrid" else "HF_TREE_ATTN_PREFIX_REUSE_LAYERS=eager asks"
        assert (note is not None and said in note and why in note) == says, (kind, layers)
        assert any(said in str(w.message) for w in seen) == (says and warned) and len(seen) == (says and warned)
        assert (said in caplog.text) == (says and not warned), (kind, layers)


def test_a_tree_trainers_init_warns_of_a_hybrids_eager_chunks():
    """The trainers' compile step (`TreeTrainerMixin._tree_compile_layers`) says it, after compiling the layers."""
    from hf_tree_attn.trainer.core import TreeTrainerMixin

    args = SimpleNamespace(**vars(_args()), tree_prefix_reuse=True)
    trainer = SimpleNamespace(tree_packing=True, args=args, accelerator=_accelerator("aot_eager", True),
                              model=_model("hybrid"))  # fmt: skip
    with pytest.warns(UserWarning, match="tree_prefix_reuse=True: a forest larger than one chunk.* carry a state"):
        TreeTrainerMixin._tree_compile_layers(trainer)
    assert trainer.tree_compile.source == "accelerate"
    assert compiled_layers(trainer.model) == decoder_layers(trainer.model) != []


@pytest.mark.parametrize("value, want", [("auto", "auto"), ("True", True), ("no", False), (False, False)])
def test_tree_compile_values(value, want, tmp_path):
    from hf_tree_attn.trainer import TreeSFTConfig

    assert TreeSFTConfig(str(tmp_path), tree_compile=value, report_to="none", use_cpu=True).tree_compile == want


def test_tree_compile_bad_value_is_named(tmp_path):
    from hf_tree_attn.trainer import TreeGRPOConfig

    with pytest.raises(ValueError, match="tree_compile='sometimes'"):
        TreeGRPOConfig(str(tmp_path), tree_compile="sometimes", report_to="none", use_cpu=True)


# ----------------------------------------------------------------------------------------------------------------
# The trainers, a compile asked for through accelerate.


@pytest.fixture
def ask_compile(monkeypatch):
    """Call to ask for a compile as an accelerate config does (regional, aot_eager): the next trainer reads it."""

    def ask():
        for key, value in COMPILE_ENV.items():
            monkeypatch.setenv(key, value)
        torch._dynamo.reset()
        counters.clear()

    return ask


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from trainers import toy_task

    tokenizer = toy_task.build_tokenizer()
    path = tmp_path_factory.mktemp("tiny_qwen3")
    toy_task.build_model(tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), tokenizer


def _assert_compiled(trainer):
    """The policy's layers were compiled in place by the tree trainer, accelerate compiled no copy of them, and
    dynamo captured graphs during the run."""
    assert trainer.tree_compile.source == "accelerate" and trainer.tree_compile.kwargs["backend"] == "aot_eager"
    assert compiled_layers(trainer.model) == decoder_layers(trainer.model) != []
    assert decoder_layers(trainer.model_wrapped) == decoder_layers(trainer.model)  # the same modules, no copy
    assert trainer.accelerator.state.dynamo_plugin.backend == DynamoBackend.NO
    assert counters["stats"]["unique_graphs"] >= 1


def test_async_grpo_compiled_run_is_trls_without_recompiling(ask_compile, tmp_path, monkeypatch):
    """TreeAsyncGRPOTrainer under an accelerate compile setting against TRL's own run at its defaults (eager: the
    compiled math is the same), 4 optimizer steps x 2 micro-batches of forests of different lengths, gradient
    checkpointing and recompute as TRL's defaults set them: the graphs compiled at the first forward serve all."""
    from async_grpo_helpers import VOCAB, replayed_samples, save_model, train
    from test_async_grpo import assert_gradients_close

    from hf_tree_attn.trainer import async_grpo_trainer
    from hf_tree_attn.trainer.replay import agent_samples, grpo_samples

    path = save_model(tiny_config("qwen3"), tmp_path / "model")
    # Rows of 1 to 3 blocks of 128 tokens: forests of several lengths.
    samples = grpo_samples(4, 4, (20, 200), (5, 60), VOCAB, seed=3) + agent_samples(
        2, (2, 3), 40, (5, 20), (5, 30), VOCAB, seed=4
    )
    samples = replayed_samples(path, samples=samples)
    run = dict(max_steps=4, token_budget=384)
    trl, trl_losses, trl_grads = train(False, path, samples, tmp_path, **run)
    ask_compile()
    score_forests, seen = async_grpo_trainer.score_forests, []

    def counting(model, forests, *args, **kwargs):
        out = score_forests(model, forests, *args, **kwargs)
        seen.append((forests[0].seq_len, counters["stats"]["unique_graphs"]))
        return out

    monkeypatch.setattr(async_grpo_trainer, "score_forests", counting)
    tree, tree_losses, tree_grads = train(True, path, samples, tmp_path, **run)
    _assert_compiled(tree)
    assert len(tree_losses) == len(trl_losses) == 8
    for step, (got, want) in enumerate(zip(tree_losses, trl_losses)):
        assert math.isclose(got, want, abs_tol=TOLERANCES["logps_atol"]), (step, got, want)
    for got, want in zip(tree_grads.steps, trl_grads.steps):
        assert_gradients_close(got, want)
    lengths, graphs = zip(*seen)
    assert len(set(lengths)) > 1 and set(graphs) == {graphs[0]}, seen  # new lengths compiled nothing new


def test_async_grpo_compiled_prefix_reuse_is_trls_without_a_graph_break(ask_compile, tmp_path, monkeypatch):
    """`tree_prefix_reuse=True` under an accelerate compile setting, `HF_TREE_ATTN_PREFIX_REUSE_LAYERS=compiled`:
    each optimizer step's rows, one forest larger than the token budget, run in chunks through the compiled layers
    (their context keys and values through `hf_tree_attn::chunk_context_kv`), with no graph break, and the run is
    TRL's at its defaults."""
    from async_grpo_helpers import save_model, train
    from test_async_grpo import REUSE_BUDGET, _reuse_samples, assert_gradients_close

    from hf_tree_attn import prefix_reuse
    from hf_tree_attn.prefix_reuse import ChunkContext

    monkeypatch.setattr(prefix_reuse, "LAYERS", "compiled")
    path = save_model(tiny_config("qwen3"), tmp_path / "model")
    samples = _reuse_samples(path)
    run = dict(max_steps=2, gradient_accumulation_steps=3, token_budget=REUSE_BUDGET)
    trl, trl_losses, trl_grads = train(False, path, samples, tmp_path, **run)
    ask_compile()
    gather, gathered = ChunkContext.gather, []

    def counting(self, module, key, value, width):
        gathered.append(len(compiled_layers(self.step.model)))  # none while `eager_layers` holds them back
        return gather(self, module, key, value, width)

    monkeypatch.setattr(ChunkContext, "gather", counting)
    tree, tree_losses, tree_grads = train(True, path, samples, tmp_path, tree_prefix_reuse=True, **run)
    _assert_compiled(tree)
    assert gathered and set(gathered) == {len(decoder_layers(tree.model))}  # every chunk, through compiled layers
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert len(tree_losses) == len(trl_losses) == 6
    for step, (got, want) in enumerate(zip(tree_losses, trl_losses)):
        assert math.isclose(got, want, abs_tol=TOLERANCES["logps_atol"]), (step, got, want)
    for got, want in zip(tree_grads.steps, trl_grads.steps):
        assert_gradients_close(got, want)


def test_grpo_compiled_run_is_trls_and_generates_eagerly(ask_compile, tiny, tmp_path, monkeypatch):
    """TreeGRPOTrainer with HF generate: the tree forwards run the compiled layers, generation the eager ones (as
    accelerate's compiled copy leaves it), and the run is TRL's at its defaults."""
    from test_grpo_runs import TreeGRPOTrainer, _assert_same_run, _run
    from trl import GRPOTrainer

    flat = _run(GRPOTrainer, tiny, tmp_path, gradient_checkpointing=True)
    ask_compile()
    generate, compiled_while_generating = GRPOTrainer._generate_single_turn, []

    def recording(self, *args, **kwargs):
        compiled_while_generating.append(len(compiled_layers(self.model)))
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", recording)
    tree = _run(TreeGRPOTrainer, tiny, tmp_path, gradient_checkpointing=True)
    _assert_compiled(tree.trainer)
    assert compiled_while_generating == [0, 0]
    _assert_same_run(tree, flat, generations=2)


@pytest.mark.parametrize("trainer", ["sft", "dpo"])
def test_fused_head_trainers_compiled_run_is_trls(trainer, ask_compile, tiny, tmp_path):
    """TreeSFTTrainer and TreeDPOTrainer (a reference model too) under an accelerate compile setting against TRL's
    runs at its defaults."""
    if trainer == "sft":
        from datasets import Dataset
        from test_tree_sft import LOGGED, SYSTEM, _run
        from trl import SFTTrainer

        from hf_tree_attn.trainer import TreeSFTTrainer

        dataset = Dataset.from_list(
            [{"prompt": SYSTEM + f"q{i}: {i}?\n", "completion": f"a: {i}."} for i in range(16)]
        )
        _, flat_logs, flat_params = _run(SFTTrainer, tiny, tmp_path, dataset)
        ask_compile()
        tree, tree_logs, tree_params = _run(TreeSFTTrainer, tiny, tmp_path, dataset)
        keys = LOGGED
    else:
        from test_tree_dpo import METRICS, _trainer
        from test_tree_dpo import _run as _dpo_run
        from trl import DPOTrainer

        from hf_tree_attn.trainer import TreeDPOTrainer

        flat_logs, flat_params = _dpo_run(_trainer(DPOTrainer, tiny, tmp_path))
        ask_compile()
        tree = _trainer(TreeDPOTrainer, tiny, tmp_path)
        tree_logs, tree_params = _dpo_run(tree)
        # TRL prepared the reference in its __init__, so accelerate compiled a copy, which the tree head runs.
        assert all(layer._compiled_call_impl is not None for layer in decoder_layers(tree.ref_model))
        keys = METRICS
    _assert_compiled(tree)
    assert len(tree_logs) == len(flat_logs) == 2
    for step, (got, want) in enumerate(zip(tree_logs, flat_logs)):
        assert got["tree_fallback"] == 0.0
        for key in keys:
            assert math.isclose(got[key], want[key], rel_tol=1e-5, abs_tol=TOLERANCES["logps_atol"]), (step, key)
    for name, want in flat_params.items():
        torch.testing.assert_close(tree_params[name], want, atol=TOLERANCES["logps_atol"], rtol=0, msg=name)


def test_cpu_default_is_eager(tiny, tmp_path):
    """No compile asked, on the CPU: the tree trainers' layers stay eager (CPU runs are unchanged)."""
    from test_grpo_runs import TreeGRPOTrainer, _run

    run = _run(TreeGRPOTrainer, tiny, tmp_path, max_steps=1)
    assert run.trainer.tree_compile.source == "none" and compiled_layers(run.trainer.model) == []


def test_fallback_runs_once_a_failed_checkpoint_let_go_of_its_hooks():
    """torch 2.11's non-reentrant checkpoint does not close its generator when the checkpointed forward raises: its
    saved-tensor hooks stay pushed while the exception's frames live. A compiler failure inside a checkpointed layer
    then left them in place for the eager forward, whose tensors went into the dead checkpoint (its backward failed
    with "A different number of tensors was saved"). The same leak, made here by a checkpoint-like generator: the
    eager forward saves nothing into it, and its results and gradients are eager's."""
    torch._dynamo.reset()
    eager, compiled = tiny_model("qwen3"), tiny_model("qwen3")
    compile_decoder_layers(compiled, backend=CountingBackend(fail="forward").backend, dynamic=True)
    leaked = []

    def pushed_hooks():
        with torch.autograd.graph.saved_tensors_hooks(lambda t: leaked.append(t) or t, lambda t: t):
            yield
            yield

    def leaky_checkpoint(forward):
        hooks = pushed_hooks()
        next(hooks)
        return forward()  # raises with `hooks` still pushed, as torch 2.11's checkpoint does

    ids = torch.tensor([SEQUENCES[0]])
    attempts = []

    def forward():
        attempts.append(len(leaked))
        run = functools.partial(compiled, ids)
        return leaky_checkpoint(run) if len(attempts) == 1 else run()

    want = eager(ids).logits
    want.sum().backward()
    with pytest.warns(UserWarning, match="compiled decoder layers of Qwen3ForCausalLM failed .*no forward for you"):
        logits = call_compiled(compiled, forward).logits
    logits.sum().backward()
    assert len(attempts) == 2 and len(leaked) == attempts[1]  # the eager forward saved nothing into the dead hooks
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
    torch.testing.assert_close(logits, want, atol=1e-6, rtol=1e-5)
    eager_params = dict(eager.named_parameters())
    for name, param in compiled.named_parameters():
        torch.testing.assert_close(param.grad, eager_params[name].grad, atol=1e-6, rtol=1e-5, msg=name)


def test_fallback_refuses_while_a_failed_checkpoint_keeps_its_hooks():
    """Where something still holds the failed checkpoint (its hooks stay pushed after the frames are collected), the
    eager forward would save into them: refused, with the way out."""
    torch._dynamo.reset()
    compiled = tiny_model("qwen3")
    compile_decoder_layers(compiled, backend=CountingBackend(fail="forward").backend, dynamic=True)
    held = []

    def pushed_hooks():
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            yield
            yield

    def forward():
        held.append(pushed_hooks())
        next(held[-1])
        return compiled(torch.tensor([SEQUENCES[0]]))

    try:
        with pytest.raises(RuntimeError, match="left its saved-tensor hooks installed.*tree_compile=False"):
            call_compiled(compiled, forward)
    finally:
        held.clear()  # closes the generator, popping its hooks
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None


def _mask_captures(model, forests) -> list[list]:
    """What the FlexAttention calls of `model`'s decoder layers, compiled with dynamic shapes, capture in their
    score_mod and mask_mod: the traced values of every call in every graph, over no-grad forwards of `forests`
    (BlockMasks on CPU), each forward's logits checked against the eager dense-mask forward, and no
    graph compiled after the first forest's (`kernels`' routing variable, which dynamo left set after a traced
    FlexAttention call, failed the layers' guard once: `transformers_compat.kernel_routing_kept`)."""
    captures, graphs = [], []

    def record(gm, example_inputs):
        graphs.append(gm)
        for node in gm.graph.nodes:
            if node.target is torch.ops.higher_order.flex_attention:
                score_buffers, mask_buffers = node.args[-2:]
                captures.append(
                    [getattr(b, "meta", {}).get("example_value", b) for b in (*score_buffers, *mask_buffers)]
                )
        return gm.forward

    with torch.no_grad():
        wants = [model(**forest_forward_kwargs(forest, "cpu")).logits for forest in forests]
    torch._dynamo.reset()
    try:
        compile_decoder_layers(model, backend=record, dynamic=True)
        with torch.no_grad():
            for forest, want in zip(forests, wants):
                kwargs = forest_forward_kwargs(forest, "cpu")
                kwargs["attention_mask"] = forest.attention_mask("cpu", dense=False)
                got = call_compiled(model, functools.partial(model, **kwargs)).logits
                n = forest.num_tree_tokens
                torch.testing.assert_close(got[0, :n], want[0, :n], atol=TOLERANCES["logps_atol"], rtol=0)
                if forest is forests[0]:
                    warm = len(graphs)
        assert len(graphs) == warm, "a forest of another length compiled the layers again"
    finally:
        torch._dynamo.reset()
    assert captures, "no FlexAttention call was traced"
    return captures


def _family_model(family: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config_of(family), attn_implementation="tree_flex").eval()


@pytest.mark.parametrize("family", ["qwen3", "mistral"])  # the tree mask; with a sliding window (depths captured)
def test_flash_backend_masks_capture_no_symbolic_size_in_layers_compiled_with_dynamic_shapes(family, monkeypatch):
    """FlexAttention's FLASH backend refuses a mask that captures a symbolic size (torch's lowering: "mask_mod
    captures a dynamic scalar"). With the backend set, the tree masks read the forest's tensors from buffers of static
    size (`masks.static_rows`): in layers compiled with dynamic shapes, over forests of three lengths, every
    FlexAttention call captures tensors alone, and the forwards are the dense mask's. Without it, the captured
    `subtree_end` brings its length as a symbolic size (what the FLASH lowering refused)."""
    forests = [hf_tree_attn.pack_forest(forest_case("mixed", seed), pad_multiple=8)[0] for seed in (0, 3, 4)]
    assert len({forest.seq_len for forest in forests}) == 3
    symbolic = (torch.SymInt, torch.SymFloat)

    monkeypatch.setattr(hf_tree_attn.attention, "FLEX_KERNEL_OPTIONS", {"BACKEND": "FLASH"})
    for captured in _mask_captures(_family_model(family), forests):
        assert captured and not any(isinstance(value, symbolic) for value in captured), captured
        assert all(value.shape[0] >= hf_tree_attn.masks.STATIC_ROWS_MIN for value in captured), captured

    monkeypatch.setattr(hf_tree_attn.attention, "FLEX_KERNEL_OPTIONS", None)
    for forest in forests:
        forest._mask_cache.clear()
    captured = [value for values in _mask_captures(_family_model(family), forests) for value in values]
    assert any(isinstance(value, symbolic) for value in captured), captured


def test_static_rows_buffers():
    """`static_rows`: the rows at the front, the rest the fill, the size a power of two of at least
    `STATIC_ROWS_MIN`, held static by dynamo."""
    from hf_tree_attn.masks import STATIC_ROWS_MIN, static_rows

    for size, capacity in ((0, STATIC_ROWS_MIN), (5, STATIC_ROWS_MIN), (STATIC_ROWS_MIN, STATIC_ROWS_MIN)):
        rows = torch.arange(1, size + 1, dtype=torch.int32)
        buffer = static_rows(rows, fill=-1)
        assert buffer.shape == (capacity,) and buffer.dtype == rows.dtype
        assert torch.equal(buffer[:size], rows) and bool((buffer[size:] == -1).all())
        assert 0 in buffer._dynamo_static_indices
    assert static_rows(torch.zeros(STATIC_ROWS_MIN + 1)).shape == (2 * STATIC_ROWS_MIN,)


def test_compiled_forwards_through_block_masks_leave_kernels_routing_as_found():
    """Where transformers wraps attention modules with `kernels`' `use_kernelized_func` (5.25 depends on `kernels`),
    the wrapper around each attention module's forward sets a routing variable
    and resets it in a `finally`; dynamo replays the set and not the reset when the block traces FlexAttention, so
    the variable stayed set after the first compiled forward through BlockMasks and the second compiled every layer
    again. Through `call_compiled` the variable is as the eager wrapper leaves it, and a forest of another length
    compiles nothing."""
    layer = pytest.importorskip("kernels._internals.layer.layer")
    routing = layer._ACTIVE_KERNEL_FUNCS
    found = (routing.global_var, routing.uses_global_var)
    model = tiny_model("qwen3")
    forests = [hf_tree_attn.pack_forest(forest_case("mixed", seed), pad_multiple=8)[0] for seed in (0, 3)]
    assert forests[0].seq_len != forests[1].seq_len
    backend = CountingBackend()
    torch._dynamo.reset()
    try:
        compile_decoder_layers(model, backend=backend.backend, dynamic=True)
        graphs = []
        with torch.no_grad():
            for forest in forests:
                kwargs = forest_forward_kwargs(forest, "cpu")
                kwargs["attention_mask"] = forest.attention_mask("cpu", dense=False)
                call_compiled(model, functools.partial(model, **kwargs))
                assert (routing.global_var, routing.uses_global_var) == found
                graphs.append(counters["stats"]["unique_graphs"])
        assert backend.calls["forward"] > 0, "the compiled layers did not run"
        assert graphs[1] == graphs[0], "the second forest compiled the layers again"
    finally:
        torch._dynamo.reset()


# ----------------------------------------------------------------------------------------------------------------
# FlexAttention's FLASH backend by default where it was measured.


def _flash_model(dtype=torch.bfloat16, **config):
    """A dense Qwen3 of the measured kind (full attention, head size 64, bf16 weights), with `config` changed."""
    from transformers import Qwen3Config

    fields = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=64) | config  # fmt: skip
    return AutoModelForCausalLM.from_config(Qwen3Config(**fields), dtype=dtype)


def _flash_default(monkeypatch, *, args=None, accelerator=None, decision=None, model=None, capability=(9, 0),
                   installed=True, env=None):  # fmt: skip
    """`default_flash_backend` on a CUDA trainer with compiled layers, a Hopper GPU and FlashAttention-4 unless
    told otherwise; returns the kernel options it left (the package's global, restored after the test)."""
    from hf_tree_attn import attention

    monkeypatch.setattr(attention, "FLEX_KERNEL_OPTIONS", None if env is None else json.loads(env))
    monkeypatch.delenv(attention.FLEX_KERNEL_OPTIONS_ENV, raising=False)
    if env is not None:
        monkeypatch.setenv(attention.FLEX_KERNEL_OPTIONS_ENV, env)
    monkeypatch.setattr(compile_setting, "_FLASH_BY_DEFAULT", None)  # no earlier trainer's default
    monkeypatch.setattr(compile_setting, "_device_capability", lambda device: capability)
    monkeypatch.setattr(compile_setting, "_flash_attention_4_installed", lambda: installed)
    args = args or SimpleNamespace(tree_prefix_reuse=False)
    decision = decision or compile_setting.CompileDecision(dict(compile_setting.DEFAULT_COMPILE), "default", "")
    note = compile_setting.default_flash_backend(
        args, accelerator or _accelerator(device="cuda"), decision, model or _flash_model()
    )
    assert (note is not None) == (attention.FLEX_KERNEL_OPTIONS == {"BACKEND": "FLASH"})
    return attention.FLEX_KERNEL_OPTIONS


def test_compiled_layers_of_the_measured_kind_run_on_the_flash_backend_by_default(monkeypatch):
    from hf_tree_attn import masks

    assert _flash_default(monkeypatch) == {"BACKEND": "FLASH"}
    assert masks.needs_static_rows()  # the masks then read the forest from buffers of static size
    assert _flash_default(monkeypatch, capability=(10, 0), model=_flash_model(head_dim=128)) == {"BACKEND": "FLASH"}
    # float32 weights under accelerate's bf16 mixed precision: tree attention's inputs are cast to bf16
    mixed = _accelerator(device="cuda")
    mixed.mixed_precision = "bf16"
    assert _flash_default(monkeypatch, accelerator=mixed, model=_flash_model(torch.float32)) == {"BACKEND": "FLASH"}


FLASH_STAYS_OFF = {
    "the user's kernel options": dict(env='{"USE_TMA": true}'),
    "the user's Triton kernels": dict(env="{}"),
    "layers not compiled": dict(decision=compile_setting.CompileDecision(None, "none", "tree_compile=False")),
    "on CPU": dict(accelerator=_accelerator(device="cpu")),
    "an Ampere GPU": dict(capability=(8, 0)),
    "FlashAttention-4 not installed": dict(installed=False),
    "prefix reuse": dict(args=SimpleNamespace(tree_prefix_reuse=True)),
    "head size 32": dict(model=_flash_model(head_dim=32)),
    "a sliding window": dict(model=_flash_model(use_sliding_window=True, sliding_window=16)),
    "sliding layers": dict(model=_flash_model(layer_types=["sliding_attention", "full_attention"],
                                              use_sliding_window=True, sliding_window=16)),
    "mixture of experts": dict(model="moe"),
    "float32 attention inputs": dict(model=_flash_model(torch.float32)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(FLASH_STAYS_OFF))
def test_the_flash_backend_stays_off_by_default_outside_what_was_measured(monkeypatch, case):
    given = dict(FLASH_STAYS_OFF[case])
    if given.get("model") == "moe":
        given["model"] = _model("moe")
    left = _flash_default(monkeypatch, **given)
    assert left == (json.loads(given["env"]) if "env" in given else None)


def test_a_trainers_flash_default_does_not_reach_the_next_trainer(monkeypatch):
    """The FLASH default is a process-wide setting (`attention.FLEX_KERNEL_OPTIONS`): the next trainer's init undoes
    an earlier trainer's default and decides again — a float32 hybrid trained after a bf16 Qwen3 in the same process
    ran its eager layers on FlashAttention-4 and failed ("inputs must be float16, bfloat16") — while kernel options
    the user set stay."""
    from hf_tree_attn import attention

    assert _flash_default(monkeypatch) == {"BACKEND": "FLASH"}
    cuda, none = _accelerator(device="cuda"), compile_setting.CompileDecision(None, "none", "tree_compile=False")
    compiled = compile_setting.CompileDecision(dict(compile_setting.DEFAULT_COMPILE), "default", "")
    args = SimpleNamespace(tree_prefix_reuse=False)
    for decision, model in ((none, _flash_model()), (compiled, _flash_model(torch.float32)), (None, _flash_model())):
        assert compile_setting.default_flash_backend(args, cuda, compiled, _flash_model()) is not None
        assert compile_setting.default_flash_backend(args, cuda, decision, model) is None
        assert attention.FLEX_KERNEL_OPTIONS is None, (decision, model.dtype)
    assert compile_setting.default_flash_backend(args, cuda, compiled, _flash_model()) is not None
    assert compile_setting.default_flash_backend(args, cuda, compiled, _flash_model()) is not None  # decided again
    users = {"BACKEND": "FLASH"}  # the user's own dict, equal to the default's but set by the user
    monkeypatch.setattr(attention, "FLEX_KERNEL_OPTIONS", users)
    assert compile_setting.default_flash_backend(args, cuda, none, _flash_model(torch.float32)) is None
    assert attention.FLEX_KERNEL_OPTIONS is users


def test_the_flash_backend_on_float32_inputs_is_refused_with_the_way_out(monkeypatch):
    """FlashAttention-4 takes bf16 / fp16 only: kernel options asking for FLASH on float32 tree attention raise an
    error naming the variable and the fix (in compiled layers `call_compiled` then turns the backend off), instead
    of FlashAttention-4's own assertion deep in its kernel."""
    from hf_tree_attn import attention

    monkeypatch.setattr(attention, "FLEX_KERNEL_OPTIONS", {"BACKEND": "FLASH"})
    query = SimpleNamespace(device=torch.device("cuda"), dtype=torch.float32)
    with pytest.raises(ValueError, match=r"HF_TREE_ATTN_FLEX_KERNEL_OPTIONS asks .* are torch.float32.*'\{\}'"):
        attention._kernel_options(None, query, None)
    for dtype in (torch.bfloat16, torch.float16):
        assert attention._kernel_options(None, SimpleNamespace(device=query.device, dtype=dtype), None) == {
            "BACKEND": "FLASH"
        }
    assert attention._kernel_options({"BLOCK_M": 64}, query, None) == {"BLOCK_M": 64}  # the caller's own
    monkeypatch.setattr(attention, "FLEX_KERNEL_OPTIONS", {"USE_TMA": True})
    assert attention._kernel_options(None, query, None) == {"USE_TMA": True}  # Triton kernels take float32
